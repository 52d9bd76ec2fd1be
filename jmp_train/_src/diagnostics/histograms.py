"""Histograms of magnitudes against the float16/bfloat16 range.

:func:`gradient_histogram` counts the values of a pytree (gradients,
activations) per power-of-two bin and what a cast to the half type does to
them: the histogram of Micikevicius et al. (2018), figure 3, computed under
``jax.jit`` in one pass over all leaves.

References:
  Micikevicius et al., "Mixed Precision Training", ICLR 2018.
  https://arxiv.org/abs/1710.03740
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Iterator

import jax
import jax.numpy as jnp
import numpy as np

from jmp_train._src import tables
from jmp_train._src.diagnostics import _casts
from jmp_train._src.diagnostics import arguments
from jmp_train._src.hyperparams import check_int

__all__ = ["GradientHistogram", "Histogram", "gradient_histogram"]


@functools.partial(
  jax.tree_util.register_dataclass,
  data_fields=[
    "counts",
    "below",
    "above",
    "zeros",
    "nonfinite",
    "underflow",
    "subnormal",
    "overflow",
    "size",
    "scale",
  ],
  meta_fields=["dtype", "min_exponent", "max_exponent"],
)
@dataclasses.dataclass(frozen=True)
class Histogram:
  """Magnitudes of the values of one array (or a whole tree) in binades.

  Every non-zero finite value ``x`` is scaled, ``v = x * scale`` (in
  float32), and counted in bin ``i`` when
  ``2**(min_exponent + i) <= |v| < 2**(min_exponent + i + 1)``. The cast
  columns say what ``v.astype(dtype)`` does to it, exactly as the cast does
  (round to nearest even): for float16 the values in ``(0, 2**-25]`` become
  0 (``2**-25`` is a tie and rounds to the even 0; anything above rounds up
  to ``2**-24``), those in ``[65520, inf)`` become inf (below 65520 they
  round to 65504).

  A pytree (a registered dataclass) of int32 arrays, so it can be returned
  from ``jax.jit``; ``dtype``, ``min_exponent`` and ``max_exponent`` are
  static metadata. In :attr:`GradientHistogram.per_leaf` every array has a
  leading axis, one entry per leaf. Histograms with the same bins add up
  (``h1 + h2``), e.g. over steps or over devices.

  Attributes:
    counts: int32 ``[max_exponent - min_exponent]``, non-zero finite values
      per power-of-two bin of ``|x * scale|``.
    below: non-zero finite values with ``|x * scale| < 2**min_exponent``.
    above: non-zero finite values with ``|x * scale| >= 2**max_exponent``.
    zeros: values that are exactly zero (before scaling).
    nonfinite: inf and NaN values (not scaled, not binned).
    underflow: non-zero finite values that become 0 when ``x * scale`` is
      cast to ``dtype`` (they would flush to zero).
    subnormal: non-zero finite values that become subnormal in ``dtype``
      (non-zero but below its smallest normal, with fewer bits of precision).
    overflow: non-zero finite values that become inf when cast.
    size: number of values.
    scale: the float32 scale the values were multiplied by.
    dtype: the half type of the cast columns (float16 or bfloat16).
    min_exponent: the lowest bin's exponent.
    max_exponent: the exponent just above the highest bin.
  """

  counts: jax.Array
  below: jax.Array
  above: jax.Array
  zeros: jax.Array
  nonfinite: jax.Array
  underflow: jax.Array
  subnormal: jax.Array
  overflow: jax.Array
  size: jax.Array
  scale: jax.Array
  dtype: np.dtype = arguments.F16
  min_exponent: int = -40
  max_exponent: int = 20

  @property
  def nonzero(self) -> jax.Array:
    """Non-zero finite values (the denominator of the fractions)."""
    return self.size - self.zeros - self.nonfinite

  @property
  def exponents(self) -> np.ndarray:
    """The exponent ``e`` of each bin ``[2**e, 2**(e+1))``."""
    return np.arange(self.min_exponent, self.max_exponent)

  @property
  def bin_edges(self) -> np.ndarray:
    """The ``num_bins + 1`` bin edges, powers of two (float64)."""
    return np.ldexp(1.0, np.arange(self.min_exponent, self.max_exponent + 1))

  @property
  def underflow_fraction(self) -> jax.Array:
    """Share of non-zero finite values that become 0 when cast."""
    return _casts.fraction(self.underflow, self.nonzero)

  @property
  def subnormal_fraction(self) -> jax.Array:
    """Share of non-zero finite values that become subnormal when cast."""
    return _casts.fraction(self.subnormal, self.nonzero)

  @property
  def overflow_fraction(self) -> jax.Array:
    """Share of non-zero finite values that become inf when cast."""
    return _casts.fraction(self.overflow, self.nonzero)

  @property
  def zero_fraction(self) -> jax.Array:
    """Share of all values that are exactly zero."""
    return _casts.fraction(self.zeros, self.size)

  def __add__(self, other: "Histogram") -> "Histogram":
    if not isinstance(other, Histogram):
      return NotImplemented
    meta = (self.dtype, self.min_exponent, self.max_exponent)
    if meta != (other.dtype, other.min_exponent, other.max_exponent):
      raise ValueError(
        "Cannot add histograms with different dtype or bins: "
        f"{meta} vs {(other.dtype, other.min_exponent, other.max_exponent)}."
      )
    summed = {
      f: getattr(self, f) + getattr(other, f)
      for f in ("counts", "below", "above", "zeros", "nonfinite", "underflow", "subnormal", "overflow", "size")
    }
    return dataclasses.replace(self, **summed)

  def summary(self) -> dict[str, Any]:
    """Plain Python numbers: sizes, fractions and the occupied exponents."""
    v = {
      f: np.asarray(getattr(self, f))
      for f in ("counts", "below", "above", "zeros", "nonfinite", "underflow", "subnormal", "overflow", "size")
    }
    if v["counts"].ndim != 1:
      raise ValueError("summary() needs one histogram; index a stacked one first.")
    occupied = np.nonzero(v["counts"])[0]
    nonzero = int(v["size"] - v["zeros"] - v["nonfinite"])
    share = lambda n: float(n) / nonzero if nonzero else 0.0
    lo = int(self.exponents[occupied[0]]) if occupied.size else None
    hi = int(self.exponents[occupied[-1]]) if occupied.size else None
    return {
      "size": int(v["size"]),
      "zeros": float(v["zeros"]) / int(v["size"]) if int(v["size"]) else 0.0,
      "underflow": share(v["underflow"]),
      "subnormal": share(v["subnormal"]),
      "overflow": share(v["overflow"]),
      "nonfinite": int(v["nonfinite"]),
      "min_log2": lo if not int(v["below"]) else f"<{self.min_exponent}",
      "max_log2": hi if not int(v["above"]) else f">={self.max_exponent}",
    }


@functools.partial(
  jax.tree_util.register_dataclass,
  data_fields=["total", "per_leaf"],
  meta_fields=["paths"],
)
@dataclasses.dataclass(frozen=True)
class GradientHistogram:
  """The result of :func:`gradient_histogram`.

  ``hist[path]`` is one leaf's :class:`Histogram`, ``hist.items()`` yields
  ``(path, Histogram)`` pairs, and ``print(hist)`` shows a table.

  Attributes:
    total: the :class:`Histogram` of all floating leaves together.
    per_leaf: the leaves' histograms stacked: a :class:`Histogram` whose
      arrays have a leading axis of size ``len(paths)`` (one compiled
      computation for any number of leaves).
    paths: ``jax.tree_util.keystr`` of each floating leaf's key path
      (``"['dense']['kernel']"``), in flattening order; static metadata.
  """

  total: Histogram
  per_leaf: Histogram
  paths: tuple[str, ...] = ()

  def __getitem__(self, path: str) -> Histogram:
    if path not in self.paths:
      raise KeyError(f"No floating leaf {path!r}; the leaves are {list(self.paths)}.")
    i = self.paths.index(path)
    return jax.tree.map(lambda a: a[i], self.per_leaf)

  def items(self) -> Iterator[tuple[str, Histogram]]:
    """``(path, Histogram)`` for every floating leaf."""
    stacked = self.per_leaf if arguments.is_traced(self.per_leaf) else jax.tree.map(np.asarray, self.per_leaf)
    for i, path in enumerate(self.paths):
      yield path, jax.tree.map(lambda a: a[i], stacked)

  def to_rows(self) -> list[dict[str, Any]]:
    """One dict per leaf plus a ``total`` row (concrete values only)."""
    rows = [{"leaf": k, **h.summary()} for k, h in self.items()]
    rows.append({"leaf": "total", **self.total.summary()})
    return rows

  def __str__(self) -> str:
    if arguments.is_traced(self):
      return repr(self)
    t = self.total
    title = f"Gradient magnitudes against {t.dtype.name} (scale {float(t.scale):g}); fractions of non-zero values:"
    return title + "\n" + tables.format_table(self.to_rows())


def gradient_histogram(
  tree: Any,
  *,
  target_dtype: Any = jnp.float16,
  scale: Any = 1.0,
  min_exponent: int = -40,
  max_exponent: int = 20,
  axis_name: Any = None,
) -> GradientHistogram:
  r"""Counts ``|x * scale|`` per power-of-two bin, and what a cast does to it.

  For every floating leaf ``x`` (integer, boolean and key leaves are
  skipped): exact zeros, inf/NaN, and for the non-zero finite values the
  binade :math:`\lfloor\log_2|x\,s|\rfloor` and whether
  ``(x * s).astype(target_dtype)`` is 0 (flush to zero), subnormal, or inf.
  For float16 that is: 0 for :math:`|xs| \le 2^{-25}`, subnormal for
  :math:`2^{-25} < |xs| < 2^{-14}` (up to rounding at the top), inf for
  :math:`|xs| \ge 65520`. The cast columns are computed from an actual cast,
  so they agree with it by construction, tie-breaking included.

  This is the histogram of Micikevicius et al. (2018),
  figure 3: most activation gradients of an SSD model lie below float16's
  range, and a loss scale shifts them into it. To get activation gradients
  of a linen model, mark activations with ``x = self.perturb("act", x)``;
  the gradient with respect to the ``"perturbations"`` collection holds
  them.

  XLA's CPU and GPU backends flush float32 subnormals (below ``2**-126``)
  to zero in arithmetic, so there a scaled value that small counts as 0 and
  underflow; this only touches bfloat16's subnormal range.

  Works under ``jax.jit`` (the bins are static; ``scale`` may be traced, e.g.
  the current dynamic loss scale). Counts are int32: a single histogram
  holds at most 2**31 - 1 values.

  Args:
    tree: any pytree, e.g. gradients or activations.
    target_dtype: ``float16`` or ``bfloat16`` (names such as ``"bf16"`` work).
    scale: the factor applied before casting (a loss scale); scalar.
    min_exponent: lowest bin edge ``2**min_exponent``; >= -149.
    max_exponent: highest bin edge ``2**max_exponent``; <= 128.
    axis_name: inside ``pmap``/``shard_map``, the axis of the replicas whose
      values are counted together (``lax.psum``), so that every replica
      gets the result for all of them.

  Returns:
    A :class:`GradientHistogram`: the ``total`` histogram and the leaves'
    (``hist[path]``, ``hist.items()``; stacked in ``hist.per_leaf``).

  Raises:
    ValueError: for a tree without floating leaves, a target dtype other
      than float16/bfloat16, a non-positive concrete scale, or bad bins.

  Examples:
    >>> import jax.numpy as jnp
    >>> grads = {"w": jnp.array([0.0, 2.0**-30, 1e-3, 1e5])}
    >>> h = gradient_histogram(grads)
    >>> int(h.total.zeros), int(h.total.underflow), int(h.total.overflow)
    (1, 1, 1)
    >>> h = gradient_histogram(grads, scale=2.0**8)
    >>> int(h.total.underflow)
    0

  References:
    Micikevicius et al., "Mixed Precision Training", ICLR 2018, section 3.2
    and figure 3. https://arxiv.org/abs/1710.03740
  """
  dtype = arguments.target_dtype(target_dtype)
  arguments.check_positive("scale", scale)
  for name, value in (("min_exponent", min_exponent), ("max_exponent", max_exponent)):
    check_int(value, name, arguments.MIN_EXPONENT)
  if not arguments.MIN_EXPONENT <= min_exponent < max_exponent <= arguments.MAX_EXPONENT:
    raise ValueError(
      f"Need {arguments.MIN_EXPONENT} <= min_exponent < max_exponent <= {arguments.MAX_EXPONENT} "
      f"(the float32 range), got min_exponent={min_exponent}, "
      f"max_exponent={max_exponent}."
    )
  leaves = arguments.floating_leaves(tree, "gradient_histogram")
  total, per_leaf = _histograms(
    [x for _, x in leaves],
    jnp.asarray(scale, jnp.float32),
    dtype,
    int(min_exponent),
    int(max_exponent),
    axis_name,
  )
  return GradientHistogram(total=total, per_leaf=per_leaf, paths=tuple(p for p, _ in leaves))


@functools.partial(jax.jit, static_argnums=(2, 3, 4, 5))
def _histograms(leaves, scale, dtype, min_exponent, max_exponent, axis_name):
  """The total and per-leaf histograms, from two bincounts over all values."""
  num_leaves = len(leaves)
  sizes = [int(np.size(x)) for x in leaves]
  flat = _casts.flatten_leaves(leaves)
  finite, nonzero, v, zero, sub, inf = _casts.cast_masks(flat, dtype, scale)
  num_bins = max_exponent - min_exponent
  # Where a value goes: 0 below the bins, 1..num_bins a bin, num_bins + 1
  # above, num_bins + 2 exact zero, num_bins + 3 inf/NaN.
  v32 = v.astype(jnp.float32)
  slot = jnp.clip(_casts.float32_exponent(v32) - min_exponent, -1, num_bins) + 1
  slot = jnp.where(_casts.magnitude_bits(v32) == 0, 0, slot)  # flushed to 0 by the scale
  slot = jnp.where(nonzero, slot, jnp.where(finite, num_bins + 2, num_bins + 3))
  num_slots = num_bins + 4
  # What the cast does: 0 nothing special, 1 zero, 2 subnormal, 3 inf.
  cast = jnp.where(zero, 1, jnp.where(sub, 2, jnp.where(inf, 3, 0)))
  if num_leaves == 1:
    segment = jnp.zeros((), jnp.int32)
  else:
    segment = jnp.concatenate([jnp.full((n,), i, jnp.int32) for i, n in enumerate(sizes)])
  slots = jnp.bincount(segment * num_slots + slot, length=num_leaves * num_slots)
  casts = jnp.bincount(segment * 4 + cast, length=num_leaves * 4)
  slots, casts = _casts.psum((slots, casts), axis_name)
  slots = slots.astype(jnp.int32).reshape(num_leaves, num_slots)
  casts = casts.astype(jnp.int32).reshape(num_leaves, 4)
  size = _casts.psum(jnp.asarray(sizes, jnp.int32), axis_name)

  def histogram(s, c, n, scale):
    return Histogram(
      counts=s[..., 1 : num_bins + 1],
      below=s[..., 0],
      above=s[..., num_bins + 1],
      zeros=s[..., num_bins + 2],
      nonfinite=s[..., num_bins + 3],
      underflow=c[..., 1],
      subnormal=c[..., 2],
      overflow=c[..., 3],
      size=n,
      scale=scale,
      dtype=dtype,
      min_exponent=min_exponent,
      max_exponent=max_exponent,
    )

  total = histogram(slots.sum(0), casts.sum(0), size.sum(), scale)
  stacked = histogram(slots, casts, size, jnp.broadcast_to(scale, (num_leaves,)))
  return total, stacked
