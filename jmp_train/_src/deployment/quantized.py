r"""Post-training quantization: a function's weights in int8, its products on int8 codes.

:func:`quantize` finds each weight product's weight (a parameter leaf used
as it is stored), quantizes it per output channel,
:math:`q = \mathrm{round}(w / \Delta_c)`, :math:`\Delta_c = \max_c |w| / 127`,
and returns a :class:`QuantizedModel` holding the int8 codes and float32
scales (:class:`Int8Weight`) in place of the float leaves, and the
calibrated activation scales. Called on inputs, the model runs the function
under :func:`jmp_train.autocast` with each weight product on int8 codes:
the activation with its static scale, the weight with its own codes (a
dequantized weight requantizes to the same codes: its channel amax is
:math:`127 \Delta_c`), int32 accumulation, float32 elsewhere. Tables the
function looks rows up in (embeddings) are stored in int8 too, one scale per
row, and dequantized where they are read. Sites kept in high precision
(``keep=``) run in float32 on their float weights. At a site the
calibration smoothed (SmoothQuant, ``calibrate(..., smoothquant=alpha)``),
the stored weight is :math:`\mathrm{diag}(s) W` and the activation is
multiplied by :math:`1/s` before it is quantized.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jex_core

from jmp_train._src.autocast import scaled
from jmp_train._src.deployment import calibration as calib
from jmp_train._src.int8 import products as int8_products
from jmp_train._src.deployment import rules as keep_rules
from jmp_train._src.deployment import smoothquant as smooth_lib

__all__ = ["Int8Weight", "QuantizedModel", "dequantize_params", "quantize", "static_product"]


class Int8Weight(NamedTuple):
  """A weight in int8: codes and per-channel float32 scales.

  Attributes:
    codes: ``int8``, the weight's shape.
    scale: float32, the weight's rank, size 1 on the axes a channel spans
      (:math:`w \\approx \\mathrm{codes} \\cdot \\mathrm{scale}`).
  """

  codes: jax.Array
  scale: jax.Array

  def dequantize(self) -> jax.Array:
    """``codes * scale`` in float32."""
    return self.codes.astype(jnp.float32) * self.scale


# jax.export serializes the weights' tree (an exported function taking the params).
jax.export.register_namedtuple_serialization(Int8Weight, serialized_name="jmp_train.int8.Int8Weight")


def _is_weight(x: Any) -> bool:
  return isinstance(x, Int8Weight)


def dequantize_params(params: Any) -> Any:
  """``params`` with every :class:`Int8Weight` replaced by its float32 value."""
  return jax.tree.map(lambda x: x.dequantize() if _is_weight(x) else x, params, is_leaf=_is_weight)


class QuantizedModel:
  """A function with int8 weights and static activation scales, callable on inputs.

  Built by :func:`~jmp_train.int8.quantize`. ``model(x)`` runs the function
  (jitted) with every weight product on int8 codes with int32 accumulation.

  Attributes:
    apply_fn: the float function, ``apply_fn(params, x)``.
    params: its parameters, each quantized weight an :class:`Int8Weight`.
    scales: site name -> the activation scale :math:`\\Delta` (float32).
    weight_paths: the key paths of the quantized weights.
    kept: the sites kept in high precision (float32 products, float weights).
    smoothing: site name -> the SmoothQuant factors :math:`s` (float32) of
      the smoothed sites: their weights hold :math:`\\mathrm{diag}(s) W`, and
      the activation is multiplied by :math:`1/s` before it is quantized
      (constants of :meth:`inference_fn`).
  """

  def __init__(
    self,
    apply_fn: Callable[..., Any],
    params: Any,
    scales: dict[str, Any],
    weight_paths: tuple = (),
    kept: tuple[str, ...] = (),
    smoothing: dict[str, Any] | None = None,
  ):
    self.apply_fn = apply_fn
    self.params = params
    self.scales = {k: jnp.float32(v) for k, v in scales.items()}
    self.weight_paths = tuple(weight_paths)
    self.kept = tuple(kept)
    self.smoothing = {k: np.asarray(v, np.float32) for k, v in (smoothing or {}).items()}
    for site, s in self.smoothing.items():
      if site not in self.scales:
        raise ValueError(
          f"QuantizedModel got smoothing factors for site {site!r}, which has no activation scale "
          f"(the sites with one: {sorted(self.scales)})."
        )
      if s.ndim == 0 or not np.all(np.isfinite(s) & (s > 0)):
        raise ValueError(
          f"QuantizedModel's smoothing factors at site {site!r} must be a positive, finite vector (one per "
          f"input channel), got {s!r}."
        )
    found = {
      jax.tree_util.keystr(path)
      for path, x in jax.tree_util.tree_flatten_with_path(params, is_leaf=_is_weight)[0]
      if _is_weight(x)
    }
    floats = [p for p in self.weight_paths if p not in found]
    if floats:
      raise TypeError(
        f"QuantizedModel got float weights at {floats}: a quantized model holds them as "
        "jmp_train.int8.Int8Weight (int8 codes, float32 scales). Build it with jmp_train.int8.quantize."
      )
    if self.smoothing:  # the factors are constants of the function
      self._call = jax.jit(self.inference_fn())
    else:  # models of one function and kept sites share one jitted function (and its compilations)
      self._call = _shared_inference(self.apply_fn, frozenset(self.kept))

  def inference_fn(self) -> Callable[[Any, dict[str, Any], Any], Any]:
    """The pure function ``f(params, scales, x)`` the model calls (for ``jax.export``)."""
    inverses = {site: smooth_lib.inverse(s) for site, s in self.smoothing.items()}
    return _inference(self.apply_fn, frozenset(self.kept), inverses)

  def __call__(self, x: Any) -> Any:
    return self._call(self.params, self.scales, x)


@functools.lru_cache(maxsize=16)
def _shared_inference(apply_fn: Callable[..., Any], kept: frozenset[str]) -> Callable[..., Any]:
  """The jitted inference of ``apply_fn`` with ``kept`` sites (scales and weights are arguments).

  Quantized models that differ only in their scales and codes (one per
  calibration method) call the same function, so XLA compiles it once per
  input shape.
  """
  return jax.jit(_inference(apply_fn, kept, {}))


def _inference(apply_fn: Callable[..., Any], kept: frozenset[str], inverses: dict[str, Any]) -> Callable[..., Any]:
  """``f(params, scales, x)``: ``apply_fn`` with its weight products on int8 codes."""

  def infer(params, scales, x):
    from jmp_train._src.autocast.transform import autocast

    def hook(site, vals, policy):
      del policy
      if site.name in kept:
        return calib.bind(site, vals)
      if site.name not in scales:
        raise ValueError(
          f"The quantized model has no activation scale for the weight product at site {site.name!r} "
          f"(it has {sorted(scales)}): calibrate this function, with the same input structure."
        )
      if site.name in inverses:
        vals = smoothed(site, vals, inverses[site.name])
      return static_product(site, vals, scales[site.name])

    with scaled.hooked(hook):
      return autocast(apply_fn, calib.float_policy())(dequantize_params(params), x)

  return infer


def smoothed(site: scaled.Site, vals: Any, inverse: Any) -> list[Any]:
  """``vals`` with the activation multiplied by ``inverse`` (``1/s``) along its contracting axes."""
  axes = smooth_lib.axes_of(site)
  a = vals[site.activation]
  if axes is None or inverse.shape != tuple(a.shape[d] for d in axes[0]):
    raise ValueError(
      f"The smoothing factors of site {site.name!r} (shape {inverse.shape}) do not fit its product "
      f"(a dot_general without batch axes contracting an activation of shape {a.shape}): calibrate this function."
    )
  out = list(vals)
  out[site.activation] = jnp.asarray(a, jnp.float32) * smooth_lib.laid_out(jnp.asarray(inverse), a.ndim, axes[0])
  return out


def static_product(site: scaled.Site, vals: Any, scale: Any) -> jax.Array:
  """A site's product on int8 codes: its activation at the static ``scale``, its weight per channel."""
  fine, given = [False, False], [None, None]
  fine[site.weight] = True
  given[site.activation] = scale
  op = scaled.op_of(site.eqn)
  return int8_products.int8_product(op, *vals, tuple(fine), int8_products.Int8Scales(*given), jnp.float32)


def _weight_leaves(apply_fn, params, inputs, kept=frozenset()) -> tuple[dict[int, tuple[int, ...]], set[int]]:
  """``(leaf index -> the axes its channel spans, for each leaf a quantized weight product uses as
  stored; the leaves kept sites use)``."""
  leaves, treedef = jax.tree.flatten(params)
  found: dict[int, tuple[int, ...]] = {}
  by_kept: set[int] = set()

  def traced(flat, x):
    ids = {id(leaf): i for i, leaf in enumerate(flat)}

    def hook(site, vals, policy):
      del policy
      w = vals[site.weight]
      i = ids.get(id(w))
      if i is not None and site.name in kept:
        by_kept.add(i)
      elif i is not None:
        axes = scaled.op_of(site.eqn).fine_axes(site.weight, w.ndim)
        if found.setdefault(i, axes) != axes:
          found[i] = tuple(range(w.ndim))  # used with two layouts: one scale
      return calib.bind(site, vals)

    from jmp_train._src.autocast.transform import autocast

    with scaled.hooked(hook):
      return autocast(apply_fn, calib.float_policy())(jax.tree.unflatten(treedef, flat), x)

  jax.make_jaxpr(traced)(leaves, inputs)
  return found, by_kept


_BODIES = {"pjit": "jaxpr", "jit": "jaxpr", "closed_call": "call_jaxpr", "custom_jvp_call": "call_jaxpr"}


def _looked_up(apply_fn, params, inputs) -> set[int]:
  """Indices of the 2-D parameter leaves the function gathers rows from (embedding tables)."""
  leaves = jax.tree.leaves(params)
  closed = jax.make_jaxpr(lambda flat, x: apply_fn(jax.tree.unflatten(jax.tree.structure(params), flat), x))(
    leaves, inputs
  )
  found: set[int] = set()

  def walk(jaxpr, origin):
    for eqn in jaxpr.eqns:
      name = eqn.primitive.name
      if name == "gather" and not isinstance(eqn.invars[0], jex_core.Literal) and eqn.invars[0] in origin:
        found.add(origin[eqn.invars[0]])
      key = _BODIES.get(name)
      if key in eqn.params:
        body = eqn.params[key]
        inner = getattr(body, "jaxpr", body)
        walk(
          inner,
          {
            b: origin[a]
            for a, b in zip(eqn.invars, inner.invars)
            if not isinstance(a, jex_core.Literal) and a in origin
          },
        )

  invars = closed.jaxpr.invars[: len(leaves)]
  walk(closed.jaxpr, {v: i for i, v in enumerate(invars) if jnp.ndim(leaves[i]) == 2})
  return found


def quantize(
  apply_fn: Callable[..., Any], params: Any, calibration: calib.Calibration, *, keep: Any = None
) -> QuantizedModel:
  r"""The int8 model of ``apply_fn``: int8 weights per channel, static activation scales.

  Each parameter leaf that a weight product takes as stored (a Dense
  kernel, a convolution's kernel) becomes an :class:`Int8Weight`, one scale
  per output channel; the calibration's scales quantize each product's
  activation (per tensor). A 2-D table the function looks rows up in (an
  embedding) becomes an :class:`Int8Weight` with one scale per row. Other
  leaves (biases, normalization scales) stay as they are. Sites kept in high
  precision (the calibration's ``kept`` and ``keep``) keep their float
  weights and run in float32.

  At a site the calibration smoothed (``calibrate(..., smoothquant=alpha)``)
  the factors :math:`s` are folded into the weight before it is quantized,
  :math:`W' = \mathrm{diag}(s) W` (along its contracting axis), and the
  model multiplies the activation by :math:`1/s` before quantizing it with
  the site's scale (calibrated on :math:`X/s`): :math:`(X/s)\,W' = X W` in
  float.

  Args:
    apply_fn: the function, ``apply_fn(params, x)``, as calibrated.
    params: its float parameters.
    calibration: from :func:`~jmp_train.int8.calibrate` on this function.
    keep: more sites to keep in high precision, as for
      :func:`~jmp_train.int8.calibrate` (site names, globs over them, or
      globs naming a scope).

  Returns:
    A :class:`~jmp_train.int8.QuantizedModel`.

  Raises:
    TypeError: if ``calibration`` is not a :class:`~jmp_train.int8.Calibration`,
      or ``keep`` is not strings.
    ValueError: if the calibration's sites are not this function's, a
      ``keep`` rule matches no site, or a smoothed site's weight is not one
      that can hold the factors here (a parameter used by that product alone,
      one factor per input channel).

  Examples:
    >>> from jmp_train.int8 import calibrate
    >>> def mlp(p, x):
    ...   return jax.nn.relu(x @ p["w1"]) @ p["w2"]
    >>> p = {"w1": jnp.ones((4, 8)) / 4, "w2": jnp.ones((8, 2)) / 8}
    >>> x = jnp.linspace(-1.0, 1.0, 12).reshape(3, 4)
    >>> model = quantize(mlp, p, calibrate(mlp, p, [x]))
    >>> model.params["w1"].codes.dtype, model(x).shape
    (dtype('int8'), (3, 2))

    SmoothQuant, with an outlier input channel:

    >>> x = x.at[:, 1].multiply(50.0)
    >>> smooth = quantize(mlp, p, calibrate(mlp, p, [x], smoothquant=0.5))
    >>> sorted(smooth.smoothing), smooth(x).shape
    (['dot_general', 'dot_general#1'], (3, 2))
  """
  if not isinstance(calibration, calib.Calibration):
    raise TypeError(
      f"quantize needs a jmp_train.int8.Calibration (from jmp_train.int8.calibrate), got {type(calibration).__name__}."
    )
  rules = keep_rules.check_keep(keep)
  table = calib.site_table(apply_fn, params, calibration.inputs)
  kept = keep_rules.resolve(rules, table) | (set(calibration.kept) & set(table))
  wanted = set(table) - kept
  if not set(calibration.scales) <= set(table) or not wanted <= set(calibration.scales):
    raise ValueError(
      f"The calibration's sites {sorted(calibration.scales)} are not this function's weight products "
      f"{sorted(wanted)}: calibrate the same function."
    )
  found, by_kept = _weight_leaves(apply_fn, params, calibration.inputs, frozenset(kept))
  tables = _looked_up(apply_fn, params, calibration.inputs) - set(found) - by_kept
  flat, treedef = jax.tree_util.tree_flatten_with_path(params)
  smoothing = {s: v for s, v in (calibration.smoothing or {}).items() if s in wanted}
  folds = _folds(apply_fn, params, calibration.inputs, frozenset(kept), smoothing, [leaf for _, leaf in flat])
  leaves = []
  paths = []
  for i, (path, leaf) in enumerate(flat):
    axes = found.get(i, (1,) if i in tables else None)
    if i in folds:
      leaf = jnp.asarray(leaf, jnp.float32) * folds[i]
    if axes is not None:
      amax = jnp.max(jnp.abs(jnp.asarray(leaf, jnp.float32)), axis=axes, keepdims=True)
      scale = int8_products.int8_scale(amax)
      leaves.append(Int8Weight(int8_products.int8_quantize(leaf, scale), scale))
      paths.append(jax.tree_util.keystr(path))
    else:
      leaves.append(leaf)
  qparams = jax.tree.unflatten(treedef, leaves)
  scales = {s: v for s, v in calibration.scales.items() if s in wanted}
  return QuantizedModel(apply_fn, qparams, scales, tuple(paths), tuple(s for s in table if s in kept), smoothing)


def _folds(apply_fn, params, inputs, kept, smoothing, leaves) -> dict[int, jax.Array]:
  """Leaf index -> the smoothing factors laid out along its contracting axes, for each smoothed site."""
  if not smoothing:
    return {}
  sites = calib.smoothable_sites(apply_fn, params, inputs, kept)
  folds = {}
  for site, s in smoothing.items():
    info = sites.get(site)
    s = np.asarray(s, np.float32)
    want = None if info is None else tuple(jnp.shape(leaves[info.leaf])[a] for a in info.weight_axes)
    if info is None or s.shape != want:
      raise ValueError(
        f"The calibration smoothed site {site!r}, but its weight here cannot hold the factors "
        f"(shape {s.shape}; {'the site is not smoothable' if info is None else f'its input channels: {want}'}): "
        "calibrate this function with the same parameters' structure."
      )
    folds[info.leaf] = jnp.asarray(smooth_lib.laid_out(s, jnp.ndim(leaves[info.leaf]), info.weight_axes))
  return folds


def _site_names(model: QuantizedModel, inputs: Any) -> list[str]:
  """The function's sites, in evaluation order."""
  return list(calib.site_table(model.apply_fn, jax.eval_shape(dequantize_params, model.params), inputs))
