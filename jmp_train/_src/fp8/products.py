r"""FP8 matmuls and convolutions with per-tensor scaling.

FP8 has two formats: E4M3 (``jnp.float8_e4m3fn``: largest finite 448,
smallest normal :math:`2^{-6}`, 3 mantissa bits) for the forward operands,
and E5M2 (``jnp.float8_e5m2``: largest 57344, smallest normal
:math:`2^{-14}`, 2 mantissa bits) for gradients, whose range matters more
than their precision (the "hybrid" format of Transformer Engine). Either
range is far narrower than float16's, so every tensor is scaled before the
cast, by a per-tensor factor :math:`s`:

.. math::

  s = \frac{\mathrm{fp8\_max}}{\mathrm{amax}} \cdot 2^{-\mathrm{margin}}, \qquad
  q = \mathrm{fp8}(\mathrm{clip}(x \cdot s)), \qquad \hat x = q / s .

*Current scaling* takes :math:`\mathrm{amax} = \max|x|` of the tensor itself
in the same step. *Delayed scaling* (Transformer Engine's ``DelayedScaling``)
takes it from a history of the last ``amax_history_len`` steps' maxima
(``max`` over the history, or its ``most_recent`` entry) and pushes this
step's :math:`\max|x|` into the history after the cast; a zero or non-finite
amax leaves the previous scale, and a non-finite amax is never stored.

The products take the FP8 arrays themselves as operands (float32
accumulation, ``preferred_element_type=float32``) and divide the result by
:math:`s_a s_b`: no reliance on XLA fusing "convert from FP8, scale, dot",
which, when it does not fire, silently leaves the product in high precision
(:func:`jmp_train.diagnostics.fp8_products` checks). The backward pass
quantizes the incoming gradient to E5M2 with its own scale; both gradient
products take it and the E4M3 weight or input. StableHLO's convolution needs
one element type for both operands, so a backward convolution splits its
E4M3 operand exactly into two E5M2 parts (``hi = e5m2(q)``,
``lo = e5m2(q - hi)``) and adds the two products: the same value on FP8
operands, at twice the work.

State: each FP8 product keeps an :class:`Fp8DotMeta`, the
:class:`Fp8TensorMeta` (scale, amax history) of its left operand, right
operand and output gradient. The gradient's amax is only known in the
backward pass, so the new meta comes back as the *cotangent* of the meta
argument (the mechanism of Flax's ``fp8_ops``): differentiate with respect to
the meta and store what comes back in place of the old meta (never feed it to
an optimizer). Under data parallelism every replica must keep the same
scales: under ``shard_map`` a replicated meta's new value is already the max
over the replicas (its cotangent must be replicated too); under ``pmap``,
pass the axis to :func:`update_fp8_meta`.

The recipe, the scaling state and its update live in ``scaling``
(re-exported here); the mechanism every narrow product shares (scale,
quantize, multiply, rescale, and the custom gradient) in ``narrow``; this
module holds FP8's format of it (:class:`Fp8Format`) and the products.

References:
  Micikevicius et al., "FP8 Formats for Deep Learning", 2022.
  https://arxiv.org/abs/2209.05433

  NVIDIA Transformer Engine, "Using FP8 with Transformer Engine" (delayed
  scaling recipe).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from jmp_train._src.fp8 import narrow
from jmp_train._src.fp8.narrow import Quantized
from jmp_train._src.fp8.scaling import E4M3
from jmp_train._src.fp8.scaling import E5M2
from jmp_train._src.fp8.scaling import FP8_SCOPE
from jmp_train._src.fp8.scaling import Fp8DotMeta
from jmp_train._src.fp8.scaling import Fp8Recipe
from jmp_train._src.fp8.scaling import Fp8TensorMeta
from jmp_train._src.fp8.scaling import calibrate
from jmp_train._src.fp8.scaling import fp8_dequantize
from jmp_train._src.fp8.scaling import fp8_quantize
from jmp_train._src.fp8.scaling import fp8_scale
from jmp_train._src.fp8.scaling import init_fp8_meta
from jmp_train._src.fp8.scaling import push_amax
from jmp_train._src.fp8.scaling import update_fp8_meta

__all__ = [
  "Fp8Recipe",
  "Fp8TensorMeta",
  "Fp8DotMeta",
  "init_fp8_meta",
  "fp8_scale",
  "push_amax",
  "fp8_quantize",
  "fp8_dequantize",
  "fp8_dot_general",
  "fp8_conv_general_dilated",
  "update_fp8_meta",
]


@dataclasses.dataclass(frozen=True)
class Fp8Format:
  """FP8 as a format of :func:`~jmp_train._src.fp8.narrow.narrow_product`.

  Per-tensor scales (current, or from the meta's histories), E4M3 forward
  codes, the output gradient in E5M2, both gradient products on FP8 codes,
  float32 accumulation; the new meta is the cotangent of the meta.
  """

  recipe: Fp8Recipe
  scope: str = FP8_SCOPE
  accumulate: Any = jnp.float32

  def _scale(self, x, meta, field, dtype):
    if meta is None:
      return fp8_scale(jnp.max(jnp.abs(x)), jnp.ones((), jnp.float32), dtype, self.recipe.margin), None
    return calibrate(x, getattr(meta, field), dtype, self.recipe)

  def quantize(self, x, meta, side, op):
    del op
    scale, new = self._scale(x, meta, ("lhs", "rhs")[side], E4M3)
    return Quantized(fp8_quantize(x, E4M3, scale), scale, new)

  def gradient(self, g, meta):
    scale, new = self._scale(g, meta, "grad", E5M2)
    return Quantized(fp8_quantize(g, E5M2, scale), scale, new)

  def backward_operand(self, q, dtype):
    del dtype
    return q

  def rescale(self, out, s_a, s_b):
    """The float32 product of the codes, ``out``, divided by :math:`s_a s_b`.

    One division (one rounding) by the product of the scales, unless that
    product overflows float32 (two tiny amaxes): then one scale at a time.
    """
    both = s_a * s_b
    return jnp.where(jnp.isfinite(both), out / both, out / s_a / s_b)

  def new_meta(self, meta, lhs, rhs, grad):
    return None if meta is None else Fp8DotMeta(lhs.meta, rhs.meta, grad.meta)


def _check_meta(meta: Any, recipe: Any, fn: str) -> Fp8DotMeta | None:
  if not isinstance(recipe, Fp8Recipe):
    raise TypeError(f"{fn} needs recipe=Fp8Recipe(...), got {type(recipe).__name__}: {recipe!r}.")
  if meta is None:
    if recipe.scaling != "current":
      raise ValueError(
        f"{fn} got meta=None with a {recipe.scaling!r} recipe: delayed scaling keeps each "
        "product's amax history in its meta. Pass meta=jmp_train.init_fp8_meta(recipe) (and "
        "store what comes back as its gradient), or recipe=Fp8Recipe(scaling='current'), "
        "which needs no state."
      )
    return None
  if not isinstance(meta, Fp8DotMeta):
    raise TypeError(
      f"{fn} needs meta=Fp8DotMeta (from jmp_train.init_fp8_meta), or None with current "
      f"scaling, got {type(meta).__name__}."
    )
  return meta


def fp8_dot_general(
  lhs: jax.Array,
  rhs: jax.Array,
  dimension_numbers: Any,
  precision: Any = None,
  preferred_element_type: Any = None,
  *,
  meta: Fp8DotMeta | None,
  recipe: Fp8Recipe = Fp8Recipe(),
  out_sharding: Any = None,
) -> jax.Array:
  """``lax.dot_general`` with E4M3 operands and an E5M2 gradient.

  Accumulates in float32 and returns ``preferred_element_type`` (default:
  the operands' common dtype, e.g. bfloat16 under a mixed policy).
  The gradient with respect to ``meta`` is not a gradient: it is the meta
  to store for the next step (this step's amax pushed into each history,
  the scales this step used), to be passed through :func:`update_fp8_meta` and never
  to an optimizer. ``precision`` is ignored (FP8 has one).

  Args:
    lhs, rhs, dimension_numbers, precision, preferred_element_type: as for
      ``lax.dot_general``.
    meta: this product's :class:`Fp8DotMeta`, or ``None`` with current
      scaling (``recipe.scaling == "current"``): each operand's scale from
      its own amax, no state kept, nothing to store after the step.
    recipe: the :class:`Fp8Recipe`.
    out_sharding: as for ``lax.dot_general``.

  Returns:
    The product.

  Raises:
    TypeError: for non-floating operands or a ``meta`` of another type.
    ValueError: for ``meta=None`` with a delayed-scaling recipe.

  Examples:
    >>> meta = init_fp8_meta(Fp8Recipe(scaling="current"))
    >>> x, w = jnp.ones((4, 16), jnp.bfloat16), jnp.full((16, 8), 0.5, jnp.bfloat16)
    >>> y = fp8_dot_general(x, w, (((1,), (0,)), ((), ())), meta=meta,
    ...                     recipe=Fp8Recipe(scaling="current"))
    >>> y.dtype, float(y[0, 0])
    (dtype(bfloat16), 8.0)
    >>> new_meta = jax.grad(lambda m: fp8_dot_general(
    ...     x, w, (((1,), (0,)), ((), ())), meta=m).sum())(meta)
    >>> new_meta.lhs.amax_history[:2].tolist(), new_meta.rhs.amax_history[0].item()
    ([1.0, 0.0], 0.5)

    Current scaling needs no state:

    >>> float(fp8_dot_general(x, w, (((1,), (0,)), ((), ())), meta=None,
    ...                       recipe=Fp8Recipe(scaling="current"))[0, 0])
    8.0
  """
  del precision
  lhs, rhs = jnp.asarray(lhs), jnp.asarray(rhs)
  narrow.check_operands(lhs, rhs, "fp8_dot_general")
  out_dtype = preferred_element_type or jnp.result_type(lhs, rhs)

  meta = _check_meta(meta, recipe, "fp8_dot_general")
  product = narrow.narrow_product(
    narrow.dot_op(dimension_numbers, out_sharding), Fp8Format(recipe), lhs.dtype, rhs.dtype, out_dtype
  )
  return product(lhs, rhs, meta)


def fp8_conv_general_dilated(
  lhs: jax.Array,
  rhs: jax.Array,
  *args: Any,
  meta: Fp8DotMeta | None,
  recipe: Fp8Recipe = Fp8Recipe(),
  **kwargs: Any,
) -> jax.Array:
  """``lax.conv_general_dilated`` with E4M3 operands and an E5M2 gradient.

  The same scaling as :func:`fp8_dot_general`; the remaining arguments are
  ``lax.conv_general_dilated``'s (``precision`` is ignored).

  Examples:
    >>> meta = init_fp8_meta(Fp8Recipe(scaling="current"))
    >>> x, k = jnp.ones((1, 8, 8, 16)), jnp.full((3, 3, 16, 16), 0.25)
    >>> y = fp8_conv_general_dilated(x, k, (1, 1), "SAME",
    ...     dimension_numbers=("NHWC", "HWIO", "NHWC"), meta=meta,
    ...     recipe=Fp8Recipe(scaling="current"))
    >>> float(y[0, 4, 4, 0])
    36.0
  """
  lhs, rhs = jnp.asarray(lhs), jnp.asarray(rhs)
  narrow.check_operands(lhs, rhs, "fp8_conv_general_dilated")
  kwargs.pop("precision", None)
  out_dtype = kwargs.pop("preferred_element_type", None) or jnp.result_type(lhs, rhs)

  meta = _check_meta(meta, recipe, "fp8_conv_general_dilated")
  product = narrow.narrow_product(narrow.conv_op(*args, **kwargs), Fp8Format(recipe), lhs.dtype, rhs.dtype, out_dtype)
  return product(lhs, rhs, meta)
