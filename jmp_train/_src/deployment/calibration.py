r"""Calibration: static activation scales for each weight product of a function.

The function runs under :func:`jmp_train.autocast` with a site hook
(``jmp_train._src.autocast.scaled``): each weight product is bound in
float32 as it is, and its activation operand's statistics come back as
extra outputs of the jitted evaluation (no host callback). A first pass
over the batches takes each site's amax; for the histogram methods a
second one takes the histogram of :math:`|x|` over :math:`[0, \mathrm{amax}]`
in 2048 bins. The clip threshold :math:`T` of each site, from its
statistics:

* ``"max"``: :math:`T = \mathrm{amax}`;
* ``"percentile"``: the ``percentile``-th percentile of :math:`|x|` (an upper bin edge);
* ``"entropy"``: TensorRT's: the threshold (a bin edge, 128 bins or more)
  whose clipped distribution :math:`P` and its quantization to 128
  levels :math:`Q` have the least KL divergence :math:`\sum P \log(P/Q)`
  (the zero bin counted as its neighbour, as NVIDIA's reference does);
* ``"mse"``: the threshold whose quantize-dequantize has the least mean
  squared error over the histogram.

The scale is :math:`\Delta = T / 127`.

With ``smoothquant=alpha`` (SmoothQuant), the first pass also takes each
``dot_general`` site's amax per input channel, the smoothing factors
:math:`s` follow (``jmp_train._src.deployment.smoothquant``), and the
statistics above are those of the smoothed activation :math:`X/s`: its amax
from the per-channel ones, its histogram over :math:`X/s` in the second
pass.

References:
  Migacz, "8-bit Inference with TensorRT", GTC 2017.

  Wu et al., "Integer Quantization for Deep Learning Inference: Principles
  and Empirical Evaluation", 2020. https://arxiv.org/abs/2004.09602

  Xiao et al., "SmoothQuant: Accurate and Efficient Post-Training
  Quantization for Large Language Models", ICML 2023.
  https://arxiv.org/abs/2211.10438
"""

from __future__ import annotations

import math
from typing import Any, Callable, Iterable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jmp_train._src.autocast import scaled
from jmp_train._src.deployment import rules as keep_rules
from jmp_train._src.deployment import smoothquant as smooth_lib
from jmp_train._src.int8.recipe import Int8Recipe

__all__ = ["CALIBRATION_METHODS", "Calibration", "calibrate", "observe", "site_table"]

CALIBRATION_METHODS = ("max", "percentile", "entropy", "mse")
NUM_BINS = 2048
_LEVELS = 128


class Calibration(NamedTuple):
  """Static activation scales of a function's weight products, by site.

  Attributes:
    method: the calibration method.
    thresholds: site name -> the clip threshold :math:`T` (a float).
    scales: site name -> the scale :math:`\\Delta = T/127` (a float).
    amax: site name -> the largest :math:`|x|` seen (of :math:`X/s` at a smoothed site).
    inputs: the shapes and dtypes of a batch (``jax.ShapeDtypeStruct``
      leaves), to trace the function with.
    kept: the sites kept in high precision (``keep=``), which have no scale.
    smoothquant: SmoothQuant's migration strength :math:`\\alpha`, or ``None``
      (no smoothing).
    smoothing: site name -> its smoothing factors :math:`s` (float32, one per
      input channel, in the order of the activation's contracting axes), for
      the smoothed sites; their thresholds, scales and amax are those of
      :math:`X/s`.
  """

  method: str
  thresholds: dict[str, float]
  scales: dict[str, float]
  amax: dict[str, float]
  inputs: Any = None
  kept: tuple[str, ...] = ()
  smoothquant: float | None = None
  smoothing: dict[str, np.ndarray] = {}


def float_policy():
  from jmp_train._src.policy.policy import Policy

  return Policy("float32", "float32", "float32", int8=Int8Recipe())


def bind(site: scaled.Site, vals):
  params = site.eqn.primitive.get_bind_params(dict(site.eqn.params))
  return site.eqn.primitive.bind(*vals, **params)


def observe(apply_fn: Callable[..., Any], stat: Callable[[str, jax.Array], Any]):
  """``f(params, batch) -> (outputs, {site: stat(site, activation)})``: the function in
  float32 with each weight product's activation operand observed (traceable)."""
  from jmp_train._src.autocast.transform import autocast

  def run(params, batch):
    stats: dict[str, Any] = {}

    def hook(site, vals, policy):
      del policy
      stats[site.name] = stat(site.name, vals[site.activation])
      return bind(site, vals)

    with scaled.hooked(hook):
      out = autocast(apply_fn, float_policy())(params, batch)
    return out, stats

  return run


def site_table(apply_fn: Callable[..., Any], params: Any, inputs: Any) -> dict[str, tuple[str, ...]]:
  """Site name -> its scope, for each weight product of ``apply_fn`` on ``inputs`` (shapes suffice)."""
  from jmp_train._src.autocast.transform import autocast

  table: dict[str, tuple[str, ...]] = {}

  def run(p, x):
    def hook(site, vals, policy):
      del policy
      table[site.name] = site.scope
      return bind(site, vals)

    with scaled.hooked(hook):
      return autocast(apply_fn, float_policy())(p, x)

  jax.eval_shape(run, params, inputs)
  return table


class Smoothable(NamedTuple):
  """A site SmoothQuant can smooth: the axes it contracts and its weight's leaf."""

  activation_axes: tuple[int, ...]
  weight_axes: tuple[int, ...]
  leaf: int  # the weight's index in the params' leaves


def smoothable_sites(apply_fn: Callable[..., Any], params: Any, inputs: Any, kept=frozenset()) -> dict[str, Smoothable]:
  """The sites SmoothQuant can smooth: ``dot_general`` without batch axes, not kept, whose weight is
  a parameter leaf used as stored by that product alone (no other equation reads it)."""
  from jmp_train._src.autocast.transform import autocast

  leaves, treedef = jax.tree.flatten(params)
  found: dict[str, Smoothable] = {}
  by_leaf: dict[int, int] = {}

  def traced(flat, x):
    ids = {id(leaf): i for i, leaf in enumerate(flat)}

    def hook(site, vals, policy):
      del policy
      i = ids.get(id(vals[site.weight]))
      if i is not None:
        by_leaf[i] = by_leaf.get(i, 0) + 1
        axes = smooth_lib.axes_of(site)
        if axes is not None and site.name not in kept:
          found[site.name] = Smoothable(*axes, i)
      return bind(site, vals)

    with scaled.hooked(hook):
      return autocast(apply_fn, float_policy())(jax.tree.unflatten(treedef, flat), x)

  jax.make_jaxpr(traced)(leaves, inputs)
  uses = smooth_lib.leaf_uses(apply_fn, params, inputs)
  return {s: v for s, v in found.items() if by_leaf[v.leaf] == 1 and uses[v.leaf] == 1}


def _amax_stats(site, x):
  del site
  x = jnp.asarray(x, jnp.float32)
  return jnp.max(jnp.abs(x)), jnp.all(jnp.isfinite(x))


def _check(method: str, percentile: Any) -> None:
  if method not in CALIBRATION_METHODS:
    raise ValueError(f"Unknown calibration method {method!r}; choose one of {CALIBRATION_METHODS}.")
  if method == "percentile":
    ok = isinstance(percentile, (int, float)) and not isinstance(percentile, bool) and 0 < percentile < 100
    if not ok:
      raise ValueError(
        f"percentile must be a number in (0, 100), e.g. 99.99 (TensorRT's choices are 99.9, 99.99, 99.999), "
        f"got {percentile!r}."
      )


def _batches(batches: Any) -> list[Any]:
  if batches is None:
    raise ValueError("calibrate needs batches: an iterable of inputs to the function, e.g. [x1, x2].")
  out = list(batches)
  if not out:
    raise ValueError(
      "calibrate got no batches: give an iterable of at least one input batch (TensorRT suggests 500 samples or more)."
    )
  return out


def _edges(amax: float) -> np.ndarray:
  return np.linspace(0.0, amax, NUM_BINS + 1)


def _percentile(hist: np.ndarray, edges: np.ndarray, percentile: float) -> float:
  cdf = np.cumsum(hist) / max(hist.sum(), 1)
  i = int(np.searchsorted(cdf, percentile / 100.0))
  return float(edges[min(i + 1, NUM_BINS)])


def _entropy(hist: np.ndarray, edges: np.ndarray) -> float:
  """TensorRT's KL-divergence threshold over the histogram.

  As NVIDIA's reference (``pytorch-quantization``'s ``_compute_amax_entropy``):
  the zero bin's count is replaced by its neighbour's (a spike of exact
  zeros, ReLU's, would otherwise pull the threshold down to the first
  candidate), and the last of equal minima wins.
  """
  hist = hist.astype(np.float64).copy()
  hist[0] = hist[1]
  best, best_i = math.inf, NUM_BINS
  for i in range(_LEVELS, NUM_BINS + 1):
    p = hist[:i].copy()
    p[-1] += hist[i:].sum()
    # Q: hist[:i] merged into 128 levels, each spread evenly over its nonzero bins.
    nonzero = (hist[:i] != 0).astype(np.float64)
    level = (np.arange(i) * _LEVELS) // i
    sums = np.bincount(level, weights=hist[:i], minlength=_LEVELS)
    counts = np.bincount(level, weights=nonzero, minlength=_LEVELS)
    q = nonzero * sums[level] / np.maximum(counts[level], 1)
    if p.sum() == 0 or q.sum() == 0:
      continue
    p, q = p / p.sum(), q / q.sum()
    mask = p > 0
    if np.any(q[mask] == 0):
      kl = math.inf
    else:
      kl = float(np.sum(p[mask] * np.log(p[mask] / q[mask])))
    if kl <= best:
      best, best_i = kl, i
  return float(edges[best_i])


def _mse(hist: np.ndarray, edges: np.ndarray) -> float:
  """The threshold (a bin edge) whose quantize-dequantize has the least squared error."""
  centers = (edges[:-1] + edges[1:]) / 2
  candidates = edges[_LEVELS:]
  step = candidates[:, None] / 127.0
  deq = np.clip(np.round(centers[None, :] / step), 0, 127) * step
  err = ((deq - centers[None, :]) ** 2 * hist[None, :]).sum(axis=1)
  return float(candidates[int(np.argmin(err))])


def calibrate(
  apply_fn: Callable[..., Any],
  params: Any,
  batches: Iterable[Any],
  method: str = "max",
  *,
  percentile: float = 99.99,
  keep: Any = None,
  smoothquant: float | None = None,
) -> Calibration:
  r"""Static activation scales for every weight product of ``apply_fn``.

  ``apply_fn(params, batch)`` runs in float32 on each batch; each weight
  product (a ``dot_general`` or ``conv_general_dilated`` with a parameter
  operand, found as :func:`jmp_train.autocast` finds them) is a *site*, named
  by its named scope and primitive in evaluation order
  (``"Dense_0/dot_general"``; a repeat gets ``#1``, ``#2``...). Its
  activation operand's statistics give a clip threshold :math:`T` by
  ``method``, and the scale :math:`\Delta = T/127` that
  :func:`~jmp_train.int8.quantize` quantizes the activation with.

  With ``smoothquant=alpha`` (SmoothQuant), each ``dot_general`` site whose
  weight is a parameter used as stored by that product alone is smoothed:
  per input channel :math:`j` (the weight's contracting axis),

  .. math::

    s_j = \frac{\max |X_j|^{\alpha}}{\max |W_j|^{1-\alpha}}

  (:math:`s_j = 1` where either maximum is 0), the activation's amax per
  channel taken over the batches and every axis but the contracting one.
  :func:`~jmp_train.int8.quantize` folds :math:`s` into the weight,
  :math:`W' = \mathrm{diag}(s) W`, and the model multiplies the activation
  by :math:`1/s` before quantizing it, so :math:`X' W' = X W` in float; the
  site's threshold is that of :math:`X' = X/s` (by ``method``). A larger
  :math:`\alpha` moves more of the activation's range into the weight.
  Convolutions, products with batch axes and shared weights are left
  unsmoothed.

  Args:
    apply_fn: the function, ``apply_fn(params, batch)``.
    params: its parameters (a pytree of floating arrays).
    batches: an iterable of batches (``apply_fn``'s second argument).
    method: ``"max"`` (the amax), ``"percentile"``, ``"entropy"``
      (TensorRT's KL divergence over a 2048-bin histogram, 128 levels) or
      ``"mse"`` (least quantization error).
    percentile: for ``"percentile"``, in (0, 100), e.g. 99.9, 99.99, 99.999.
    keep: sites to keep in high precision (no scale; :func:`~jmp_train.int8.quantize`
      leaves their products and weights in float32): a site name, a glob
      over site names, or a glob naming a scope the product runs in (a
      module's path such as ``"head"``), or a sequence of them.
    smoothquant: SmoothQuant's migration strength :math:`\alpha` in
      :math:`[0, 1]` (0.5, the paper's default, suits most Transformers), or
      ``None`` (the default) for no smoothing.

  Returns:
    A :class:`~jmp_train.int8.Calibration`.

  Raises:
    ValueError: for an unknown method, a percentile outside (0, 100), no
      batches, a batch with a non-finite activation (naming the batch's
      index and the site), a function with no weight product, or a
      ``keep`` rule that matches no site (listing the sites), a
      ``smoothquant`` outside [0, 1], or a ``smoothquant`` with no site to
      smooth.
    TypeError: for a ``keep`` that is not strings.

  Examples:
    >>> def mlp(p, x):
    ...   return jax.nn.relu(x @ p["w1"]) @ p["w2"]
    >>> p = {"w1": jnp.ones((4, 8)), "w2": jnp.ones((8, 2))}
    >>> cal = calibrate(mlp, p, [jnp.linspace(-1.0, 1.0, 12).reshape(3, 4)])
    >>> sorted(cal.thresholds), cal.thresholds["dot_general"]
    (['dot_general', 'dot_general#1'], 1.0)
    >>> calibrate(mlp, p, [jnp.ones((3, 4))], "entropy").method
    'entropy'

    SmoothQuant: an outlier channel (50) gets the largest factor, and the
    smoothed activation's amax is :math:`\max_j |x_j| / s_j`:

    >>> x = jnp.array([[1.0, 50.0, -2.0, 0.5]])
    >>> cal = calibrate(mlp, p, [x], smoothquant=0.5)
    >>> [round(float(v), 3) for v in cal.smoothing["dot_general"]], round(cal.amax["dot_general"], 3)
    ([1.0, 7.071, 1.414, 0.707], 7.071)

  References:
    Migacz, "8-bit Inference with TensorRT", GTC 2017.

    Wu et al., "Integer Quantization for Deep Learning Inference: Principles
    and Empirical Evaluation", 2020. https://arxiv.org/abs/2004.09602

    Xiao et al., "SmoothQuant: Accurate and Efficient Post-Training
    Quantization for Large Language Models", ICML 2023.
    https://arxiv.org/abs/2211.10438
  """
  _check(method, percentile)
  alpha = smooth_lib.check_alpha(smoothquant)
  rules = keep_rules.check_keep(keep)
  batches = _batches(batches)
  inputs = jax.tree.map(lambda x: jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)), batches[0])
  table = site_table(apply_fn, params, inputs)
  if not table:
    raise ValueError(
      "calibrate found no weight product in the function: no dot_general or conv_general_dilated "
      "with a parameter operand (params are apply_fn's first argument)."
    )
  kept = keep_rules.resolve(rules, table)
  smoothable = {} if alpha is None else smoothable_sites(apply_fn, params, inputs, kept)
  if alpha is not None and not smoothable:
    raise ValueError(
      f"calibrate(smoothquant={smoothquant!r}) found no weight product to smooth among {sorted(table)}: "
      "SmoothQuant smooths dot_general products without batch axes whose weight is a parameter used as "
      "stored by that product alone (convolutions and shared weights are left unsmoothed); "
      "calibrate without smoothquant."
    )

  def first_stat(site, x):
    out = _amax_stats(site, x)
    if site in smoothable:
      out = (*out, smooth_lib.channel_amax(x, smoothable[site].activation_axes))
    return out

  first = jax.jit(lambda p, x: observe(apply_fn, first_stat)(p, x)[1])
  amax: dict[str, float] = {}
  channel: dict[str, np.ndarray] = {}
  for index, batch in enumerate(batches):
    stats = jax.device_get(first(params, batch))
    for site, (a, finite, *per_channel) in stats.items():
      if site in kept:
        continue
      if not finite:
        raise ValueError(
          f"Calibration batch {index} gives a non-finite activation at site {site!r}: check the batch "
          "(NaN or inf inputs) or the parameters, and leave such batches out."
        )
      amax[site] = max(amax.get(site, 0.0), float(a))
      if per_channel:
        c = np.asarray(per_channel[0], np.float32)
        channel[site] = np.maximum(channel[site], c) if site in channel else c
  smoothing = {}
  if alpha is not None:
    leaves = jax.tree.leaves(params)
    for site, info in smoothable.items():
      w_amax = np.asarray(jax.device_get(smooth_lib.channel_amax(leaves[info.leaf], info.weight_axes)))
      smoothing[site] = smooth_lib.factors(channel[site], w_amax, alpha)
      # The amax of X/s, as the model computes it (x times 1/s, in float32).
      amax[site] = float(np.max(channel[site] * smooth_lib.inverse(smoothing[site])))
  kept_names = tuple(s for s in table if s in kept)
  if method == "max":
    return Calibration(
      method, dict(amax), {s: _scale(t) for s, t in amax.items()}, amax, inputs, kept_names, alpha, smoothing
    )
  ranges = {s: jnp.float32(a) for s, a in amax.items()}
  inverses = {s: jnp.asarray(smooth_lib.inverse(v)) for s, v in smoothing.items()}

  def hist_stat(site, x):
    x = jnp.asarray(x, jnp.float32)
    if site in inverses:
      x = x * smooth_lib.laid_out(inverses[site], x.ndim, smoothable[site].activation_axes)
    x = jnp.abs(x).ravel()
    top = ranges.get(site, jnp.float32(0))
    idx = jnp.where(top > 0, jnp.floor(x / jnp.where(top > 0, top, 1.0) * NUM_BINS), 0)
    idx = jnp.clip(idx, 0, NUM_BINS - 1).astype(jnp.int32)
    return jnp.zeros(NUM_BINS, jnp.float32).at[idx].add(1.0)

  second = jax.jit(lambda p, x: observe(apply_fn, hist_stat)(p, x)[1])
  hists = {s: np.zeros(NUM_BINS) for s in amax}
  for batch in batches:
    for site, h in jax.device_get(second(params, batch)).items():
      if site in hists:
        hists[site] += np.asarray(h, np.float64)
  thresholds = {}
  for site, hist in hists.items():
    if amax[site] == 0:
      thresholds[site] = 0.0
      continue
    edges = _edges(amax[site])
    if method == "percentile":
      thresholds[site] = _percentile(hist, edges, float(percentile))
    elif method == "entropy":
      thresholds[site] = _entropy(hist, edges)
    else:
      thresholds[site] = _mse(hist, edges)
  scales = {s: _scale(t) for s, t in thresholds.items()}
  return Calibration(method, thresholds, scales, amax, inputs, kept_names, alpha, smoothing)


def _scale(threshold: float) -> float:
  return float(np.float32(threshold) / np.float32(127)) if threshold > 0 else 1.0
