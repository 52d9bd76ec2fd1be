"""Diagnostics that explain half precision.

Four questions come up when a model is switched to float16 or bfloat16 and
the loss stalls or turns into NaN (Micikevicius et al., "Mixed Precision
Training", ICLR 2018, figure 3; NVIDIA's Tensor Core guides):

* Where do the gradients lie against the half type's range, and how many
  become 0 (or inf) when cast? :func:`gradient_histogram`,
  :func:`underflow_fraction`, :func:`overflow_fraction`.
* Which loss scale would move them into range? :func:`suggest_loss_scale`.
* Do the matmuls and convolutions run on Tensor Cores (half-precision
  operands, dimensions multiples of 8, or 16 for 8-bit types), and what
  speed-up can that buy at most? :func:`tensor_core_report`,
  :func:`pad_to_multiple`.
* Which ops run in half precision but should not (exp, log, softmax, large
  reductions, the loss), and which matmuls were left in float32?
  :func:`precision_audit`.

The first three return arrays and work under ``jax.jit``; the last two read
the jaxpr of a function (nothing is executed) and return report objects with
a readable table.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
import os
import re
from typing import Any, Callable, Iterable, Iterator, NamedTuple, Sequence

import jax
from jax import lax
from jax.extend import core as jex_core
from jax.extend import source_info_util
import jax.numpy as jnp
import numpy as np

from jmp_train._src import policy as policy_lib
from jmp_train._src.policy import is_floating_array

__all__ = [
    "ISSUE_KINDS",
    "Histogram",
    "GradientHistogram",
    "LossScaleSuggestion",
    "MatmulEntry",
    "TensorCoreReport",
    "PrecisionIssue",
    "PrecisionReport",
    "gradient_histogram",
    "underflow_fraction",
    "overflow_fraction",
    "suggest_loss_scale",
    "tensor_core_report",
    "precision_audit",
    "pad_to_multiple",
]

_F16 = np.dtype(jnp.float16)
_BF16 = np.dtype(jnp.bfloat16)
_F32 = np.dtype(jnp.float32)
_TARGET_DTYPES = (_F16, _BF16)
# Smallest and largest binary exponents a float32 value can have.
_MIN_EXPONENT = -149
_MAX_EXPONENT = 128


# ---------------------------------------------------------------------------
# Argument checking.


def _target_dtype(dtype: Any) -> np.dtype:
  """Parses the half type values are cast to; float16 or bfloat16 only."""
  valid = "float16 (f16, fp16) or bfloat16 (bf16), or 'half'"
  try:
    parsed = policy_lib.parse_dtype(dtype)
  except ValueError as e:
    raise ValueError(f"Bad target dtype {dtype!r}: {e} Valid targets: {valid}.") from None
  if parsed not in _TARGET_DTYPES:
    raise ValueError(
        f"Bad target dtype {dtype!r} ({parsed.name}): the diagnostics cast to a "
        f"half-precision type; valid targets: {valid}."
    )
  return parsed


def _check_positive(name: str, value: Any, *, minimum: float = 0.0, inclusive: bool = False):
  """Raises ValueError if a concrete ``value`` is not finite and > minimum."""
  if isinstance(value, jax.core.Tracer):
    return  # A traced value (e.g. a loss scale inside jit) cannot be checked.
  try:
    arr = np.asarray(value, dtype=np.float64)
  except (TypeError, ValueError):
    raise ValueError(f"{name} must be a positive number, got {value!r}.") from None
  if arr.shape != ():
    raise ValueError(f"{name} must be a scalar, got shape {arr.shape}.")
  v = float(arr)
  ok = math.isfinite(v) and (v >= minimum if inclusive else v > minimum)
  if not ok:
    bound = f">= {minimum:g}" if inclusive else f"> {minimum:g}"
    raise ValueError(f"{name} must be finite and {bound}, got {value!r}.")


def _floating_leaves(tree: Any, fn_name: str) -> list[tuple[str, Any]]:
  """``(path, leaf)`` for the floating-point array leaves of ``tree``."""
  with_path = jax.tree_util.tree_flatten_with_path(tree)[0]
  out = [(jax.tree_util.keystr(p) or "<root>", x) for p, x in with_path if is_floating_array(x)]
  if not out:
    kinds = sorted({type(x).__name__ + (f"[{x.dtype}]" if hasattr(x, "dtype") else "")
                    for _, x in with_path})
    hint = ""
    if any(isinstance(x, float) for _, x in with_path):
      hint = " Python floats are not counted: wrap them with jnp.asarray."
    raise ValueError(
        f"{fn_name} needs a pytree with floating-point array leaves (float16, "
        f"bfloat16, float32, ...); got {len(with_path)} leaves of types "
        f"{kinds or '(none: the tree is empty)'}.{hint}"
    )
  return out


def _check_callable(fn: Any, fn_name: str):
  if not callable(fn):
    raise ValueError(
        f"{fn_name} needs a callable (the function to trace, e.g. a loss "
        f"function or `model.apply`) as its first argument; got "
        f"{type(fn).__name__} {fn!r:.80}."
    )


# ---------------------------------------------------------------------------
# Counting casts.


def _magnitude_bits(x: jax.Array) -> jax.Array:
  """The bits of ``|x|`` as an unsigned integer (sign bit cleared).

  Bits, not comparisons: XLA's CPU and GPU backends treat float32 subnormals
  as zero in arithmetic, but a cast's result bits are exact.
  """
  nbits = x.dtype.itemsize * 8
  utype = {16: jnp.uint16, 32: jnp.uint32, 64: jnp.uint64}[nbits]
  sign_mask = np.array((1 << (nbits - 1)) - 1, dtype=utype)
  return lax.bitcast_convert_type(x, utype) & sign_mask


def _float32_exponent(v: jax.Array) -> jax.Array:
  """floor(log2|v|) for finite non-zero float32 ``v``, exactly, from its bits."""
  bits = _magnitude_bits(v).astype(jnp.int32)
  field = bits >> 23
  mantissa = bits & ((1 << 23) - 1)
  # Subnormals: the exponent is set by the highest mantissa bit.
  sub = (31 - lax.clz(jnp.maximum(mantissa, 1))) - 149
  return jnp.where(field == 0, sub, field - 127)


class _CastCounts(NamedTuple):
  nonzero: jax.Array
  zeros: jax.Array
  nonfinite: jax.Array
  underflow: jax.Array
  subnormal: jax.Array
  overflow: jax.Array


def _scaled(x: jax.Array, scale: Any) -> jax.Array:
  wide = jnp.promote_types(x.dtype, jnp.float32)
  return x.astype(wide) * jnp.asarray(scale, wide)


def _cast_masks(x: jax.Array, dtype: np.dtype, scale: Any):
  """Masks of which elements are non-zero, and become 0 / subnormal / inf."""
  x = jnp.asarray(x)
  finite = jnp.isfinite(x)
  nonzero = finite & (_magnitude_bits(x) != 0)
  v = _scaled(x, scale)
  ybits = _magnitude_bits(v.astype(dtype))
  info = jnp.finfo(dtype)
  nmant, nexp = int(info.nmant), int(info.nexp)
  inf_bits = ((1 << nexp) - 1) << nmant
  becomes_zero = nonzero & (ybits == 0)
  becomes_subnormal = nonzero & (ybits != 0) & (ybits < (1 << nmant))
  becomes_inf = nonzero & (ybits == inf_bits)
  return finite, nonzero, v, becomes_zero, becomes_subnormal, becomes_inf


def _cast_counts(x: jax.Array, dtype: np.dtype, scale: Any) -> _CastCounts:
  finite, nonzero, _, zero, sub, inf = _cast_masks(x, dtype, scale)
  count = functools.partial(jnp.sum, dtype=jnp.int32)
  return _CastCounts(
      nonzero=count(nonzero),
      zeros=count(finite & ~nonzero),
      nonfinite=count(~finite),
      underflow=count(zero),
      subnormal=count(sub),
      overflow=count(inf),
  )


def _flatten_leaves(leaves: Sequence[jax.Array]) -> jax.Array:
  """All values in one vector, in float32 (float64 if a leaf is float64).

  One vector, so the compiled code does not grow with the number of leaves
  (per-leaf kernels made XLA's compile time grow linearly with it). The
  price is a temporary copy of the values. Every float16 and bfloat16 value
  is exact in float32.
  """
  wide = jnp.result_type(jnp.float32, *[jnp.asarray(x).dtype for x in leaves])
  flat = [jnp.ravel(jnp.asarray(x)).astype(wide) for x in leaves]
  return flat[0] if len(flat) == 1 else jnp.concatenate(flat)


def _psum(tree: Any, axis_name: Any) -> Any:
  return tree if axis_name is None else jax.tree.map(lambda c: lax.psum(c, axis_name), tree)


@functools.partial(jax.jit, static_argnums=(1, 3))
def _sum_leaf_counts(leaves, dtype: np.dtype, scale: jax.Array, axis_name=None) -> _CastCounts:
  # Compiled once per tree signature: eager code would compile and dispatch
  # every primitive separately. Under an outer jit it is inlined.
  return _psum(_cast_counts(_flatten_leaves(leaves), dtype, scale), axis_name)


def _sum_counts(tree: Any, dtype: np.dtype, scale: Any, fn_name: str, axis_name=None) -> _CastCounts:
  leaves = [x for _, x in _floating_leaves(tree, fn_name)]
  return _sum_leaf_counts(leaves, dtype, jnp.asarray(scale, jnp.float32), axis_name)


def _fraction(num: jax.Array, den: jax.Array) -> jax.Array:
  return jnp.where(den > 0, num.astype(jnp.float32) / jnp.maximum(den, 1), 0.0)


# ---------------------------------------------------------------------------
# Histograms.


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=[
        "counts", "below", "above", "zeros", "nonfinite", "underflow",
        "subnormal", "overflow", "size", "scale",
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
  dtype: np.dtype = _F16
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
    return _fraction(self.underflow, self.nonzero)

  @property
  def subnormal_fraction(self) -> jax.Array:
    """Share of non-zero finite values that become subnormal when cast."""
    return _fraction(self.subnormal, self.nonzero)

  @property
  def overflow_fraction(self) -> jax.Array:
    """Share of non-zero finite values that become inf when cast."""
    return _fraction(self.overflow, self.nonzero)

  @property
  def zero_fraction(self) -> jax.Array:
    """Share of all values that are exactly zero."""
    return _fraction(self.zeros, self.size)

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
        for f in ("counts", "below", "above", "zeros", "nonfinite", "underflow",
                  "subnormal", "overflow", "size")
    }
    return dataclasses.replace(self, **summed)

  def summary(self) -> dict[str, Any]:
    """Plain Python numbers: sizes, fractions and the occupied exponents."""
    v = {f: np.asarray(getattr(self, f)) for f in (
        "counts", "below", "above", "zeros", "nonfinite", "underflow", "subnormal",
        "overflow", "size")}
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
    stacked = self.per_leaf if _is_traced(self.per_leaf) else jax.tree.map(np.asarray, self.per_leaf)
    for i, path in enumerate(self.paths):
      yield path, jax.tree.map(lambda a: a[i], stacked)

  def to_rows(self) -> list[dict[str, Any]]:
    """One dict per leaf plus a ``total`` row (concrete values only)."""
    rows = [{"leaf": k, **h.summary()} for k, h in self.items()]
    rows.append({"leaf": "total", **self.total.summary()})
    return rows

  def __str__(self) -> str:
    if _is_traced(self):
      return repr(self)
    t = self.total
    title = (
        f"Gradient magnitudes against {t.dtype.name} (scale {float(t.scale):g}); "
        "fractions of non-zero values:"
    )
    return title + "\n" + _format_table(self.to_rows())


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

  This is the histogram of the seeds' figure (Micikevicius et al. 2018,
  figure 3): most activation gradients of an SSD model lie below float16's
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
  dtype = _target_dtype(target_dtype)
  _check_positive("scale", scale)
  for name, value in (("min_exponent", min_exponent), ("max_exponent", max_exponent)):
    if not isinstance(value, numbers.Integral) or isinstance(value, bool):
      raise ValueError(f"{name} must be an int, got {value!r}.")
  if not _MIN_EXPONENT <= min_exponent < max_exponent <= _MAX_EXPONENT:
    raise ValueError(
        f"Need {_MIN_EXPONENT} <= min_exponent < max_exponent <= {_MAX_EXPONENT} "
        f"(the float32 range), got min_exponent={min_exponent}, "
        f"max_exponent={max_exponent}."
    )
  leaves = _floating_leaves(tree, "gradient_histogram")
  total, per_leaf = _histograms(
      [x for _, x in leaves], jnp.asarray(scale, jnp.float32), dtype,
      int(min_exponent), int(max_exponent), axis_name,
  )
  return GradientHistogram(total=total, per_leaf=per_leaf, paths=tuple(p for p, _ in leaves))


@functools.partial(jax.jit, static_argnums=(2, 3, 4, 5))
def _histograms(leaves, scale, dtype, min_exponent, max_exponent, axis_name):
  """The total and per-leaf histograms, from two bincounts over all values."""
  num_leaves = len(leaves)
  sizes = [int(np.size(x)) for x in leaves]
  flat = _flatten_leaves(leaves)
  finite, nonzero, v, zero, sub, inf = _cast_masks(flat, dtype, scale)
  num_bins = max_exponent - min_exponent
  # Where a value goes: 0 below the bins, 1..num_bins a bin, num_bins + 1
  # above, num_bins + 2 exact zero, num_bins + 3 inf/NaN.
  v32 = v.astype(jnp.float32)
  slot = jnp.clip(_float32_exponent(v32) - min_exponent, -1, num_bins) + 1
  slot = jnp.where(_magnitude_bits(v32) == 0, 0, slot)  # flushed to 0 by the scale
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
  slots, casts = _psum((slots, casts), axis_name)
  slots = slots.astype(jnp.int32).reshape(num_leaves, num_slots)
  casts = casts.astype(jnp.int32).reshape(num_leaves, 4)
  size = _psum(jnp.asarray(sizes, jnp.int32), axis_name)

  def histogram(s, c, n, scale):
    return Histogram(
        counts=s[..., 1 : num_bins + 1], below=s[..., 0], above=s[..., num_bins + 1],
        zeros=s[..., num_bins + 2], nonfinite=s[..., num_bins + 3],
        underflow=c[..., 1], subnormal=c[..., 2], overflow=c[..., 3],
        size=n, scale=scale, dtype=dtype,
        min_exponent=min_exponent, max_exponent=max_exponent,
    )

  total = histogram(slots.sum(0), casts.sum(0), size.sum(), scale)
  stacked = histogram(slots, casts, size, jnp.broadcast_to(scale, (num_leaves,)))
  return total, stacked


def underflow_fraction(
    tree: Any, dtype: Any = jnp.float16, scale: Any = 1.0, *, axis_name: Any = None
) -> jax.Array:
  r"""Share of the non-zero finite values that become 0 when cast.

  .. math::
    \frac{\#\{x \ne 0 : \mathrm{cast}(x s) = 0\}}{\#\{x \ne 0\}}

  over all floating leaves of ``tree`` (inf/NaN excluded), computed with an
  actual cast (round to nearest even). 0 for a tree of zeros.

  Args:
    tree: any pytree with floating leaves.
    dtype: ``float16`` or ``bfloat16``.
    scale: the factor (a loss scale) applied before the cast.
    axis_name: inside ``pmap``/``shard_map``, the axis of the replicas whose
      values are counted together (``lax.psum``), so that every replica
      gets the result for all of them.

  Returns:
    A float32 scalar in ``[0, 1]``; works under ``jax.jit``.

  Raises:
    ValueError: for a tree without floating leaves, a bad dtype or a
      non-positive concrete scale.

  Examples:
    >>> x = jnp.array([1e-9, 1e-3])
    >>> float(underflow_fraction(x, "float16")), float(underflow_fraction(x, "bfloat16"))
    (0.5, 0.0)
  """
  dtype = _target_dtype(dtype)
  _check_positive("scale", scale)
  c = _sum_counts(tree, dtype, scale, "underflow_fraction", axis_name)
  return _fraction(c.underflow, c.nonzero)


def overflow_fraction(
    tree: Any, dtype: Any = jnp.float16, scale: Any = 1.0, *, axis_name: Any = None
) -> jax.Array:
  r"""Share of the non-zero finite values that become inf when cast.

  .. math::
    \frac{\#\{x \ne 0 : \mathrm{cast}(x s) = \pm\infty\}}{\#\{x \ne 0\}}

  For float16 these are the values with :math:`|xs| \ge 65520` (65504 is the
  largest finite float16; values below 65520 round down to it).

  Args:
    tree: any pytree with floating leaves.
    dtype: ``float16`` or ``bfloat16``.
    scale: the factor (a loss scale) applied before the cast.
    axis_name: inside ``pmap``/``shard_map``, the axis of the replicas whose
      values are counted together (``lax.psum``), so that every replica
      gets the result for all of them.

  Returns:
    A float32 scalar in ``[0, 1]``; works under ``jax.jit``.

  Raises:
    ValueError: for a tree without floating leaves, a bad dtype or a
      non-positive concrete scale.

  Examples:
    >>> float(overflow_fraction(jnp.array([65519.0, 65520.0]), "float16"))
    0.5
  """
  dtype = _target_dtype(dtype)
  _check_positive("scale", scale)
  c = _sum_counts(tree, dtype, scale, "overflow_fraction", axis_name)
  return _fraction(c.overflow, c.nonzero)


class LossScaleSuggestion(NamedTuple):
  """The result of :func:`suggest_loss_scale`.

  Attributes:
    loss_scale: float32 scalar, a power of two.
    underflow_fraction: share of non-zero values still becoming 0 when
      ``x * loss_scale`` is cast.
    overflow_fraction: share becoming inf at that scale (0 unless the scale
      was clipped to ``min_scale``).
    max_abs: the largest finite ``|x|`` the suggestion is based on.
  """

  loss_scale: jax.Array
  underflow_fraction: jax.Array
  overflow_fraction: jax.Array
  max_abs: jax.Array


def suggest_loss_scale(
    tree: Any,
    dtype: Any = jnp.float16,
    *,
    headroom: float = 8.0,
    min_scale: float = 2.0**-24,
    max_scale: float = 2.0**24,
    axis_name: Any = None,
) -> LossScaleSuggestion:
  r"""The largest power-of-two loss scale that keeps the gradients finite.

  .. math::
    S = 2^{\lfloor \log_2 (\mathrm{max}_{dtype} / (h \cdot \max|x|)) \rfloor},
    \qquad S \cdot h \cdot \max|x| \le \mathrm{max}_{dtype}

  clipped to ``[min_scale, max_scale]``, with :math:`\mathrm{max}_{dtype}`
  65504 for float16. The headroom ``h`` leaves room for gradients that grow
  in later steps; ``h = 1`` fits the measured gradients exactly. Pass the
  *unscaled* gradients (from a float32 run, or divided by the scale that
  produced them). Under bfloat16, whose range is float32's, the suggestion
  is normally ``max_scale``: check ``underflow_fraction`` at scale 1 instead
  (it is usually 0, and loss scaling unnecessary).

  Args:
    tree: any pytree with floating leaves (gradients, activation gradients).
    dtype: ``float16`` or ``bfloat16``.
    headroom: the factor ``h >= 1`` between the scaled largest gradient and
      the largest finite value.
    min_scale: lowest scale returned (may be below 1).
    max_scale: highest scale returned (the default matches
      :class:`DynamicLossScale`'s ``max_scale``).
    axis_name: inside ``pmap``/``shard_map``, the axis of the replicas: the
      maximum is taken (``lax.pmax``) and the values counted (``lax.psum``)
      over all of them, so every replica suggests the same scale.

  Returns:
    A :class:`LossScaleSuggestion` of float32 scalars; works under
    ``jax.jit``. All-zero gradients give ``max_scale``.

  Raises:
    ValueError: for a tree without floating leaves, a bad dtype, ``headroom <
      1`` or bad bounds.

  Examples:
    >>> grads = {"w": jnp.array([3e-2, 1e-8, -2e-6])}
    >>> s = suggest_loss_scale(grads, headroom=2.0)  # 65504 / (2 * 0.03) ~ 2**20.06
    >>> float(s.loss_scale), float(s.underflow_fraction)
    (1048576.0, 0.0)
    >>> float(underflow_fraction(grads, "float16"))  # without the scale
    0.3333333432674408

  References:
    Micikevicius et al., "Mixed Precision Training", ICLR 2018, section 3.2:
    "choose a scaling factor such that its product with the maximum absolute
    gradient value is below 65,504". https://arxiv.org/abs/1710.03740
  """
  dtype = _target_dtype(dtype)
  _check_positive("headroom", headroom, minimum=1.0, inclusive=True)
  _check_positive("min_scale", min_scale)
  _check_positive("max_scale", max_scale)
  if float(min_scale) > float(max_scale):
    raise ValueError(f"min_scale ({min_scale}) must not exceed max_scale ({max_scale}).")
  leaves = [x for _, x in _floating_leaves(tree, "suggest_loss_scale")]
  f32 = functools.partial(jnp.asarray, dtype=jnp.float32)
  return _suggest(leaves, dtype, f32(headroom), f32(min_scale), f32(max_scale), axis_name)


@functools.partial(jax.jit, static_argnums=(1, 5))
def _suggest(leaves, dtype, headroom, min_scale, max_scale, axis_name) -> LossScaleSuggestion:
  flat = _flatten_leaves(leaves)
  amax = jnp.max(jnp.where(jnp.isfinite(flat), jnp.abs(flat), 0), initial=0).astype(jnp.float32)
  if axis_name is not None:
    amax = lax.pmax(amax, axis_name)
  max_finite = jnp.float32(jnp.finfo(dtype).max)
  lo, hi = min_scale, max_scale
  ratio = max_finite / (headroom * amax)
  # frexp: ratio = m * 2**e with m in [0.5, 1), so floor(log2(ratio)) = e - 1.
  _, e = jnp.frexp(jnp.where(jnp.isfinite(ratio), ratio, 1.0))
  scale = jnp.ldexp(jnp.float32(1.0), e - 1)
  # Rounding of `ratio` must not push the product past the maximum.
  scale = jnp.where(scale * headroom * amax > max_finite, scale / 2, scale)
  scale = jnp.where(jnp.isfinite(ratio), scale, hi)
  scale = jnp.clip(scale, lo, hi)
  c = _psum(_cast_counts(flat, dtype, scale), axis_name)
  return LossScaleSuggestion(
      loss_scale=scale,
      underflow_fraction=_fraction(c.underflow, c.nonzero),
      overflow_fraction=_fraction(c.overflow, c.nonzero),
      max_abs=amax,
  )


# ---------------------------------------------------------------------------
# Jaxpr walking.


def _is_traced(tree: Any) -> bool:
  return any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(tree))


def _where(eqn) -> str:
  """``file.py:line (function)`` of the user code that emitted ``eqn``."""
  try:
    text = source_info_util.summarize(eqn.source_info)
  except Exception:  # pragma: no cover - source info is best effort.
    return ""
  match = re.match(r"^(.*?):(\d+)(?::\d+)?(.*)$", text)
  if match:
    return f"{os.path.basename(match.group(1))}:{match.group(2)}{match.group(3)}"
  return text


def _context_label(eqn) -> str:
  name = eqn.primitive.name
  if name in ("pjit", "jit", "closed_call", "core_call"):
    return str(eqn.params.get("name", name))
  return name


def _walk(
    jaxpr, repeats: int = 1, context: tuple[str, ...] = (), site: str = ""
) -> Iterator[tuple[Any, int, str]]:
  """Yields ``(eqn, times it runs, where)`` for every equation.

  Recurses into every sub-jaxpr found in the parameters (jit, scan, cond,
  while, remat, custom_jvp/custom_vjp, shard_map, ...). ``scan`` bodies
  count ``length`` times; ``while`` bodies once (the trip count is not
  static); every ``cond`` branch is visited (an upper bound). ``where`` is
  the enclosing calls (``log_softmax/...``) and the user's source line; ops
  inside library functions inherit the line of the call into the library.
  """
  for eqn in jaxpr.eqns:
    own = _where(eqn) or site
    where = " ".join(s for s in ("/".join(context), own) if s)
    yield eqn, repeats, where
    inner = repeats * int(eqn.params.get("length", 1)) if eqn.primitive.name == "scan" else repeats
    label = context + (_context_label(eqn),)
    for sub in jex_core.jaxprs_in_params(eqn.params):
      yield from _walk(sub, inner, label, own)


def _split_args(args: tuple) -> tuple[list, list, list[bool], Any]:
  leaves, treedef = jax.tree.flatten(args)
  is_float = [is_floating_array(x) for x in leaves]
  floats = [x for x, f in zip(leaves, is_float) if f]
  others = [x for x, f in zip(leaves, is_float) if not f]
  return floats, others, is_float, treedef


def _trace(fn: Callable, args: tuple, backward: bool) -> list[tuple[str, Any]]:
  """``[(phase, jaxpr)]``: the forward pass and, if asked, the backward pass.

  The backward pass is the pullback of ``jax.vjp(fn, ...)`` with respect to
  every floating-point leaf of ``args``, traced on its own (from abstract
  residuals and cotangents for every floating output), so the forward pass
  is not counted twice.
  """
  phases = [("forward", jax.make_jaxpr(fn)(*args).jaxpr)]
  if not backward:
    return phases
  floats, others, is_float, treedef = _split_args(args)
  if not floats:
    raise ValueError(
        "backward=True differentiates with respect to the floating-point "
        "leaves of the arguments, and there are none."
    )

  def rebuild(fl, ot):
    fl, ot = iter(fl), iter(ot)
    return jax.tree.unflatten(treedef, [next(fl) if f else next(ot) for f in is_float])

  def forward_and_pullback(fl, ot):
    return jax.vjp(lambda fl_: fn(*rebuild(fl_, ot)), fl)

  out_shape, pullback_shape = jax.eval_shape(forward_and_pullback, floats, others)
  res_leaves, pullback_def = jax.tree.flatten(pullback_shape)
  out_leaves, out_def = jax.tree.flatten(out_shape)
  out_float = [is_floating_array(o) for o in out_leaves]
  if not any(out_float):
    raise ValueError("backward=True needs a function with a floating-point output.")

  def pullback(res, cts):
    cts = iter(cts)
    full = [
        next(cts) if f else np.zeros(o.shape, jax.dtypes.float0)
        for f, o in zip(out_float, out_leaves)
    ]
    return jax.tree.unflatten(pullback_def, res)(jax.tree.unflatten(out_def, full))

  cts = [o for o, f in zip(out_leaves, out_float) if f]
  phases.append(("backward", jax.make_jaxpr(pullback)(res_leaves, cts).jaxpr))
  return phases


def _format_table(rows: Sequence[dict[str, Any]], columns: Sequence[str] | None = None) -> str:
  if not rows:
    return "(no rows)"
  columns = list(columns or rows[0].keys())

  def fmt(v):
    if v is None:
      return "-"
    if isinstance(v, float):
      return f"{v:.3g}"
    if isinstance(v, tuple) and all(isinstance(d, int) for d in v):
      return "x".join(map(str, v))  # a shape
    if isinstance(v, tuple):
      return ",".join(map(str, v))
    return str(v)

  cells = [[fmt(r.get(c, "")) for c in columns] for r in rows]
  widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
  line = lambda vals: "  ".join(v.ljust(w) for v, w in zip(vals, widths)).rstrip()
  return "\n".join([line(columns), line(["-" * w for w in widths]), *(line(r) for r in cells)])


# ---------------------------------------------------------------------------
# Tensor Core report.

_SIXTEEN_BIT = (np.dtype(jnp.float16), np.dtype(jnp.bfloat16))


def _required_multiple(lhs: np.dtype, rhs: np.dtype) -> int | None:
  """8 for 16-bit float operands, 16 for 8-bit ones, None otherwise."""
  if lhs in _SIXTEEN_BIT and rhs in _SIXTEEN_BIT:
    return 8
  if lhs.itemsize == 1 and rhs.itemsize == 1:
    return 16  # int8, uint8, float8_*
  return None


class MatmulEntry(NamedTuple):
  """One ``dot_general`` or convolution found by :func:`tensor_core_report`.

  For a convolution, ``batch, m, n, k`` are its implicit GEMM per group
  (``batch`` = groups, ``m`` = images x output positions, ``n`` = output
  channels per group, ``k`` = input channels per group x kernel positions)
  and ``checked`` holds the channels per group, which the Tensor Core rule
  is about (a depthwise convolution has 1 and cannot use Tensor Cores).

  Attributes:
    phase: ``"forward"`` or ``"backward"``.
    op: ``"dot_general"`` or ``"conv"``.
    lhs_dtype: dtype of the left operand.
    rhs_dtype: dtype of the right operand.
    out_dtype: dtype of the result.
    lhs_shape: shape of the left operand.
    rhs_shape: shape of the right operand.
    batch: product of the batch dimensions (1 if none; groups for convs).
    m: product of the left operand's free dimensions.
    n: product of the right operand's free dimensions.
    k: product of the contracting dimensions.
    flops: ``2 * batch * m * n * k`` times the enclosing scans' lengths.
    required_multiple: 8 (16-bit operands), 16 (8-bit) or None (no Tensor
      Cores: float32 or mixed operands).
    checked: ``{name: size}`` of the dimensions the rule applies to.
    misaligned: names of the checked dimensions that are not multiples.
    repeats: how often it runs per call (scan lengths multiplied).
    where: enclosing calls and ``file:line (function)``.
  """

  phase: str
  op: str
  lhs_dtype: np.dtype
  rhs_dtype: np.dtype
  out_dtype: np.dtype
  lhs_shape: tuple[int, ...]
  rhs_shape: tuple[int, ...]
  batch: int
  m: int
  n: int
  k: int
  flops: int
  required_multiple: int | None
  checked: dict[str, int]
  misaligned: tuple[str, ...]
  repeats: int
  where: str

  @property
  def half_precision(self) -> bool:
    """Whether both operands are 16- or 8-bit (a Tensor Core type)."""
    return self.required_multiple is not None

  @property
  def tensor_core(self) -> bool:
    """Half-precision operands and every checked dimension aligned."""
    return self.half_precision and not self.misaligned


def _prod(xs: Iterable[int]) -> int:
  return int(math.prod(int(x) for x in xs))


def _matmul_entry(eqn, phase: str, repeats: int, where: str) -> MatmulEntry | None:
  name = eqn.primitive.name
  if name not in ("dot_general", "conv_general_dilated"):
    return None
  lhs, rhs = (v.aval for v in eqn.invars[:2])
  out = eqn.outvars[0].aval
  lhs_dt, rhs_dt = np.dtype(lhs.dtype), np.dtype(rhs.dtype)
  multiple = _required_multiple(lhs_dt, rhs_dt)
  if name == "dot_general":
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    batch = _prod(lhs.shape[d] for d in lb)
    k = _prod(lhs.shape[d] for d in lc)
    m = _prod(s for d, s in enumerate(lhs.shape) if d not in (*lc, *lb))
    n = _prod(s for d, s in enumerate(rhs.shape) if d not in (*rc, *rb))
    flops = 2 * batch * m * n * k * repeats
    checked = {"M": m, "N": n, "K": k}
    op = "dot_general"
  else:
    dn = eqn.params["dimension_numbers"]
    rhs_spec, out_spec = dn.rhs_spec, dn.out_spec
    batch = int(eqn.params.get("feature_group_count", 1)) * int(
        eqn.params.get("batch_group_count", 1)
    )
    cin = int(rhs.shape[rhs_spec[1]])  # input channels per group
    cout = int(rhs.shape[rhs_spec[0]])
    kernel = _prod(rhs.shape[d] for d in rhs_spec[2:])
    m = _prod(out.shape[d] for d in out_spec[2:]) * int(out.shape[out_spec[0]])
    n, k = cout // batch, cin * kernel
    # Every output element is a dot product of length cin * kernel.
    flops = 2 * _prod(out.shape) * cin * kernel * repeats
    checked = {"C_in": cin, "C_out": n}
    op = "conv"
  misaligned = tuple(d for d, s in checked.items() if multiple and s % multiple)
  return MatmulEntry(
      phase=phase, op=op, lhs_dtype=lhs_dt, rhs_dtype=rhs_dt, out_dtype=np.dtype(out.dtype),
      lhs_shape=tuple(int(s) for s in lhs.shape), rhs_shape=tuple(int(s) for s in rhs.shape),
      batch=batch, m=m, n=n, k=k, flops=int(flops), required_multiple=multiple,
      checked=checked, misaligned=misaligned, repeats=repeats, where=where,
  )


@dataclasses.dataclass(frozen=True)
class TensorCoreReport:
  r"""Matmuls and convolutions of a function, against the Tensor Core rules.

  ``str(report)`` is a table, one row per op, and a summary: total FLOPs,
  the share in half precision, the share eligible for Tensor Cores (half
  precision and aligned), and the speed-up bound

  .. math::
    \frac{1}{x + (1 - x) / y}

  with :math:`x` the share of matmul FLOPs *not* on Tensor Cores and
  :math:`y` ``tensor_core_speedup`` (Amdahl's law, seed 002). It treats the
  FLOP share as the time share and ignores non-matmul work, so it is
  optimistic: elementwise ops are memory bound and do not speed up by y.
  float32 matmuls count as off Tensor Cores, although Ampere and later GPUs
  may run them as TF32 on Tensor Cores at JAX's default matmul precision.

  Attributes:
    entries: the :class:`MatmulEntry` rows, forward pass first.
    tensor_core_speedup: the ``y`` of the bound.
  """

  entries: tuple[MatmulEntry, ...]
  tensor_core_speedup: float

  @property
  def total_flops(self) -> int:
    return sum(e.flops for e in self.entries)

  @property
  def half_precision_flops(self) -> int:
    return sum(e.flops for e in self.entries if e.half_precision)

  @property
  def tensor_core_flops(self) -> int:
    return sum(e.flops for e in self.entries if e.tensor_core)

  @property
  def half_precision_fraction(self) -> float:
    """Share of matmul FLOPs with 16- or 8-bit operands."""
    return self.half_precision_flops / self.total_flops if self.total_flops else 0.0

  @property
  def tensor_core_fraction(self) -> float:
    """Share of matmul FLOPs in half precision with aligned dimensions."""
    return self.tensor_core_flops / self.total_flops if self.total_flops else 0.0

  @property
  def speedup_bound(self) -> float:
    """``1 / (x + (1 - x) / y)`` with ``x = 1 - tensor_core_fraction``."""
    x = 1.0 - self.tensor_core_fraction
    return 1.0 / (x + (1.0 - x) / self.tensor_core_speedup)

  @property
  def misaligned(self) -> tuple[MatmulEntry, ...]:
    """Half-precision ops that lose the Tensor Core path to a dimension."""
    return tuple(e for e in self.entries if e.half_precision and e.misaligned)

  @property
  def float32(self) -> tuple[MatmulEntry, ...]:
    """Ops whose operands are not both half precision."""
    return tuple(e for e in self.entries if not e.half_precision)

  def to_rows(self) -> list[dict[str, Any]]:
    """One dict per op, for tables and dataframes."""
    rows = []
    for e in self.entries:
      rows.append({
          "phase": e.phase,
          "op": e.op,
          "dtypes": f"{e.lhs_dtype.name}x{e.rhs_dtype.name}->{e.out_dtype.name}",
          "batch": e.batch,
          "M": e.m,
          "N": e.n,
          "K": e.k,
          "checked": ",".join(f"{k}={v}" for k, v in e.checked.items()),
          "GFLOP": e.flops / 1e9,
          "tensor_core": (
              "yes" if e.tensor_core
              else "no: float32" if not e.half_precision
              else f"no: {','.join(e.misaligned)} % {e.required_multiple}"
          ),
          "where": e.where,
      })
    return rows

  def summary(self) -> str:
    return (
        f"{len(self.entries)} matmul/conv ops, {self.total_flops / 1e9:.4g} GFLOP; "
        f"half precision {self.half_precision_fraction:.1%}, "
        f"Tensor Core eligible {self.tensor_core_fraction:.1%}; "
        f"speed-up bound 1/(x+(1-x)/y) = {self.speedup_bound:.2f}x "
        f"(x = {1 - self.tensor_core_fraction:.3f}, y = {self.tensor_core_speedup:g})"
    )

  def __str__(self) -> str:
    return _format_table(self.to_rows()) + "\n" + self.summary()

  def assert_aligned(self) -> None:
    """Raises AssertionError listing half-precision ops with misaligned dims."""
    bad = self.misaligned
    if bad:
      rows = [r for r, e in zip(self.to_rows(), self.entries) if e in bad]
      raise AssertionError(
          f"{len(bad)} half-precision matmul/conv op(s) with dimensions that are "
          "not multiples of 8 (16-bit) / 16 (8-bit); pad them (see "
          "pad_to_multiple):\n" + _format_table(rows)
      )


def tensor_core_report(
    fn: Callable[..., Any],
    *args: Any,
    backward: bool = False,
    tensor_core_speedup: float = 8.0,
) -> TensorCoreReport:
  r"""Lists every matmul and convolution of ``fn`` against the Tensor Core rules.

  Traces ``jax.make_jaxpr(fn)(*args)`` (nothing runs; ``args`` may be
  ``jax.ShapeDtypeStruct``) and walks it, sub-jaxprs included (jit, scan,
  cond, while, remat, custom_jvp/vjp, shard_map). For each ``dot_general``:
  operand dtypes, batch, M (left free dims), N (right free dims), K
  (contracting dims), FLOPs :math:`2BMNK`; for each ``conv_general_dilated``
  the channels and its implicit GEMM. Tensor Cores need 16-bit operands
  with M, N, K (channels for convs) multiples of 8, or 8-bit operands with
  multiples of 16 (NVIDIA's rule, seed 002). With ``backward=True`` the
  backward pass is traced too (the pullback with respect to every floating
  argument leaf), where the seeds' table applies: the weight gradient's K is
  the batch size.

  Args:
    fn: the function, e.g. ``lambda p, x: model.apply(p, x)`` or a loss.
      Bind keyword arguments with ``functools.partial``.
    *args: its positional arguments (arrays or ``jax.ShapeDtypeStruct``).
    backward: also trace the backward pass.
    tensor_core_speedup: ``y`` of the speed-up bound, the Tensor Core ops'
      own speed-up (8 is V100's FP16 vs FP32 peak ratio).

  Returns:
    A :class:`TensorCoreReport`; ``print(report)`` shows the table.

  Raises:
    ValueError: if ``fn`` is not callable or ``tensor_core_speedup <= 0``.

  Examples:
    >>> x = jnp.ones((64, 1000), jnp.float16)
    >>> w = jnp.ones((1000, 30), jnp.float16)
    >>> report = tensor_core_report(jnp.dot, x, w)
    >>> report.entries[0].misaligned
    ('N',)
    >>> w = jnp.ones((1000, pad_to_multiple(30)), jnp.float16)
    >>> tensor_core_report(jnp.dot, x, w).tensor_core_fraction
    1.0

  References:
    NVIDIA, "Deep Learning Performance: Matrix Multiplication" and "Mixed
    Precision Training" user guides.
    https://docs.nvidia.com/deeplearning/performance/dl-performance-matrix-multiplication/
  """
  _check_callable(fn, "tensor_core_report")
  _check_positive("tensor_core_speedup", tensor_core_speedup)
  entries = []
  for phase, jaxpr in _trace(fn, args, bool(backward)):
    for eqn, repeats, where in _walk(jaxpr):
      entry = _matmul_entry(eqn, phase, repeats, where)
      if entry is not None:
        entries.append(entry)
  return TensorCoreReport(entries=tuple(entries), tensor_core_speedup=float(tensor_core_speedup))


# ---------------------------------------------------------------------------
# Precision audit.

# Ops that AMP lists keep in float32 (NVIDIA apex, torch.autocast): their
# results lose range or precision in 16 bits.
_FLOAT32_OPS = frozenset({
    "exp", "exp2", "expm1", "log", "log1p", "pow", "rsqrt", "tan", "sinh",
    "cosh", "asin", "acos", "erf_inv", "lgamma", "digamma",
})
# Accumulating reductions: a 16-bit sum stops growing once the total is
# 2**8 (bfloat16) or 2**11 (float16) times the addends.
_REDUCTIONS = frozenset({"reduce_sum", "reduce_prod", "cumsum", "cumprod", "cumlogsumexp"})

ISSUE_KINDS = ("half_op", "half_reduction", "half_output", "float32_matmul")


class PrecisionIssue(NamedTuple):
  """One finding of :func:`precision_audit` (identical ops merged).

  Attributes:
    kind: ``"half_op"`` (exp, log, ... in half precision), ``"half_reduction"``
      (a large sum in half precision), ``"half_output"`` (an output, e.g. the
      loss, in half precision) or ``"float32_matmul"``.
    phase: ``"forward"`` or ``"backward"``.
    op: the primitive, e.g. ``"exp"``, or ``"output[0]"``.
    dtype: the dtype it runs in.
    shape: the operand's shape.
    where: enclosing calls (``log_softmax``, ``scan``, ...) and the source line.
    count: how many identical ops were merged into this row.
    message: what to do about it.
  """

  kind: str
  phase: str
  op: str
  dtype: np.dtype
  shape: tuple[int, ...]
  where: str
  count: int
  message: str


@dataclasses.dataclass(frozen=True)
class PrecisionReport:
  """The result of :func:`precision_audit`.

  Attributes:
    issues: the :class:`PrecisionIssue` rows.
    half_ops: number of equations computing in float16/bfloat16.
    float32_ops: number of equations computing in float32 or wider.
  """

  issues: tuple[PrecisionIssue, ...]
  half_ops: int
  float32_ops: int

  @property
  def ok(self) -> bool:
    return not self.issues

  def of_kind(self, *kinds: str) -> tuple[PrecisionIssue, ...]:
    """The issues whose kind is one of ``kinds``."""
    _check_kinds(kinds)
    return tuple(i for i in self.issues if i.kind in kinds)

  def to_rows(self) -> list[dict[str, Any]]:
    return [
        {"kind": i.kind, "phase": i.phase, "op": i.op, "dtype": i.dtype.name,
         "shape": i.shape, "count": i.count, "where": i.where, "fix": i.message}
        for i in self.issues
    ]

  def __str__(self) -> str:
    head = (
        f"precision audit: {len(self.issues)} issue(s); {self.half_ops} ops in "
        f"half precision, {self.float32_ops} in float32"
    )
    return head + ("\n" + _format_table(self.to_rows()) if self.issues else "")

  def assert_clean(self, ignore: Sequence[str] = ()) -> None:
    """Raises AssertionError with the table of issues (except ``ignore`` kinds).

    Args:
      ignore: issue kinds to tolerate, from ``ISSUE_KINDS``.

    Raises:
      AssertionError: listing the offending ops.
      ValueError: for an unknown kind in ``ignore``.
    """
    if isinstance(ignore, str):
      ignore = (ignore,)
    _check_kinds(ignore)
    bad = [i for i in self.issues if i.kind not in ignore]
    if bad:
      rows = [r for r, i in zip(self.to_rows(), self.issues) if i.kind not in ignore]
      raise AssertionError(
          f"precision audit found {len(bad)} issue(s):\n" + _format_table(rows)
      )


def _check_kinds(kinds: Iterable[str]) -> None:
  for k in kinds:
    if k not in ISSUE_KINDS:
      raise ValueError(f"Unknown issue kind {k!r}; valid kinds: {', '.join(ISSUE_KINDS)}.")


def precision_audit(
    fn: Callable[..., Any],
    *args: Any,
    backward: bool = False,
    reduction_threshold: int = 1024,
) -> PrecisionReport:
  """Finds ops in half precision that should not be, and float32 matmuls.

  Walks the jaxpr of ``fn(*args)`` (and, with ``backward=True``, of its
  pullback) like :func:`tensor_core_report`, and reports, after the AMP
  allow/deny lists (seed 002, NVIDIA apex, ``torch.autocast``):

  * ``half_op``: exp, log, log1p, expm1, pow, rsqrt, sinh, cosh, tan, ...
    on float16/bfloat16 operands; softmax, log-softmax and logsumexp show up
    as their exp and log pieces (``where`` names the enclosing
    ``log_softmax`` call);
  * ``half_reduction``: sums, products and cumulative sums in half
    precision over more than ``reduction_threshold`` elements (a float16
    sum stops growing once the total is 2**11 times the addends, a bfloat16
    one at 2**8);
  * ``half_output``: floating outputs of ``fn`` in half precision: the loss
    (a scalar) or a model output that the loss will consume;
  * ``float32_matmul``: ``dot_general`` and convolutions with a float32 (or
    wider) operand: they do not use Tensor Cores.

  Args:
    fn: the function, e.g. the loss function or ``model.apply``.
    *args: its arguments (arrays or ``jax.ShapeDtypeStruct``).
    backward: also audit the backward pass.
    reduction_threshold: reductions over more elements than this count.

  Returns:
    A :class:`PrecisionReport`; ``print(report)`` shows the table and
    ``report.assert_clean()`` fails a test with it.

  Raises:
    ValueError: if ``fn`` is not callable or the threshold is not a
      positive int.

  Examples:
    >>> def loss(w, x):
    ...   logits = x.astype(jnp.bfloat16) @ w.astype(jnp.bfloat16)
    ...   return -jax.nn.log_softmax(logits).mean()
    >>> report = precision_audit(loss, jnp.ones((8, 8)), jnp.ones((4, 8)))
    >>> sorted({i.op for i in report.of_kind("half_op")})
    ['exp', 'log']
    >>> [i.kind for i in report.of_kind("half_output")]
    ['half_output']
  """
  _check_callable(fn, "precision_audit")
  if (
      not isinstance(reduction_threshold, numbers.Integral)
      or isinstance(reduction_threshold, bool)
      or reduction_threshold < 1
  ):
    raise ValueError(f"reduction_threshold must be a positive int, got {reduction_threshold!r}.")
  merged: dict[tuple, PrecisionIssue] = {}
  half_ops = float32_ops = 0

  def add(kind, phase, op, dtype, shape, where, message, count):
    key = (kind, phase, op, dtype, shape, where)
    if key in merged:
      merged[key] = merged[key]._replace(count=merged[key].count + count)
    else:
      merged[key] = PrecisionIssue(kind, phase, op, dtype, shape, where, count, message)

  phases = _trace(fn, args, bool(backward))
  for phase, jaxpr in phases:
    for eqn, repeats, where in _walk(jaxpr):
      floats = [np.dtype(v.aval.dtype) for v in eqn.invars
                if hasattr(v.aval, "dtype") and _is_float_dtype(v.aval.dtype)]
      if not floats or _has_subjaxpr(eqn):
        continue  # Calls (jit, scan, ...) are counted through their bodies.
      in_half = all(d in _SIXTEEN_BIT for d in floats)
      half_ops += int(in_half)
      float32_ops += int(not in_half)
      name = eqn.primitive.name
      aval = eqn.invars[0].aval
      shape = tuple(int(s) for s in getattr(aval, "shape", ()))
      dtype = floats[0]
      if in_half and name in _FLOAT32_OPS:
        add("half_op", phase, name, dtype, shape, where,
            f"compute {name} in float32",
            repeats)
      elif in_half and name in _REDUCTIONS:
        axes = eqn.params.get("axes")
        if axes is None:
          axes = (eqn.params.get("axis", 0),)
        size = _prod(shape[a] for a in axes)
        if size > reduction_threshold:
          add("half_reduction", phase, f"{name}[{size}]", dtype, shape, where,
              "reduce in float32 (jnp.sum does; lax reductions and bias "
              "gradients do not)", repeats)
      elif name in ("dot_general", "conv_general_dilated") and not in_half:
        widest = max(floats, key=lambda d: d.itemsize)
        add("float32_matmul", phase, name, widest, shape, where,
            "cast the operands to the compute dtype (Tensor Cores)", repeats)
  # The outputs of the forward pass: the loss or the model output.
  out_avals = [v.aval for v in phases[0][1].outvars]
  for i, aval in enumerate(out_avals):
    dtype = np.dtype(aval.dtype) if hasattr(aval, "dtype") else None
    if dtype is not None and dtype in _SIXTEEN_BIT:
      shape = tuple(int(s) for s in aval.shape)
      what = "the loss" if shape == () else "a model output"
      add("half_output", "forward", f"output[{i}]", dtype, shape, "",
          f"{what} in {dtype.name}: output float32, compute the loss in float32", 1)
  return PrecisionReport(issues=tuple(merged.values()), half_ops=half_ops,
                         float32_ops=float32_ops)


def _is_float_dtype(dtype) -> bool:
  try:
    return bool(jnp.issubdtype(dtype, jnp.floating))
  except TypeError:
    return False


def _has_subjaxpr(eqn) -> bool:
  return any(True for _ in jex_core.jaxprs_in_params(eqn.params))


# ---------------------------------------------------------------------------
# Padding.


def pad_to_multiple(n: int, multiple: int = 8) -> int:
  """The smallest multiple of ``multiple`` that is ``>= n``.

  The recipe for Tensor Cores (seed 002: 16-bit GEMM dimensions and conv
  channels multiples of 8, 8-bit ones of 16):

  1. Find misaligned dimensions with :func:`tensor_core_report` (with
     ``backward=True``: the weight gradient's K is the batch size).
  2. Pad sizes you choose: hidden and MLP widths, heads x head size, conv
     channels (an RGB input's 3 channels can be zero-padded to 8: zero
     inputs change nothing), and the batch size.
  3. Pad the vocabulary: ``vocab = pad_to_multiple(50257, 64)`` (50304,
     GPT-2's padded size; 64 also suits wider tiles). Extra embedding rows
     are never looked up; give the extra logits ``-inf`` (or a large
     negative) before the softmax, or never use them as labels, so that the
     loss is unchanged.
  4. Check again: ``tensor_core_report(...).assert_aligned()``.

  Args:
    n: a non-negative int.
    multiple: a positive int (8 for float16/bfloat16, 16 for int8/float8).

  Returns:
    ``ceil(n / multiple) * multiple``.

  Raises:
    ValueError: for a negative or non-int ``n`` or a non-positive ``multiple``.

  Examples:
    >>> pad_to_multiple(50257, 64), pad_to_multiple(1000), pad_to_multiple(3, 16)
    (50304, 1000, 16)
  """
  for name, value, lowest in (("n", n, 0), ("multiple", multiple, 1)):
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
      raise ValueError(f"{name} must be an int, got {value!r}.")
    if value < lowest:
      raise ValueError(f"{name} must be >= {lowest}, got {value}.")
  return -(-int(n) // int(multiple)) * int(multiple)
