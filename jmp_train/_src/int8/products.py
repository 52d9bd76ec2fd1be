r"""INT8 matmuls and convolutions: INT8 as a format of the narrow products.

Symmetric scales, :math:`\Delta = \mathrm{amax}/127`, per tensor, per row
(token) of an activation or per output channel of a weight; codes
:math:`q = \mathrm{clip}(\mathrm{round}(x/\Delta), -128, 127)` (rounding half
to even, as ONNX's ``QuantizeLinear``) in ``int8``, multiplied with
``preferred_element_type=int32`` and rescaled by :math:`\Delta_a \Delta_b`.
A scale is the operand's own amax in the same step (current scaling), or
given (a calibrated activation scale): then values beyond
:math:`[-128\Delta, 127\Delta]` saturate and the straight-through estimator
gives them no gradient. The backward products take the output gradient and
the dequantized operands in the compute dtype (float32 in place of bfloat16
on CPUs, whose dot kernels lack bfloat16 operands with float32 results).

The scaling, the products and the custom gradient are those of every
narrow product (``jmp_train._src.fp8.narrow``); this module holds INT8's
format (:class:`Int8Format`) and the products.

References:
  Jacob et al., "Quantization and Training of Neural Networks for
  Efficient Integer-Arithmetic-Only Inference", CVPR 2018.
  https://arxiv.org/abs/1712.05877

  Bengio, Léonard and Courville, "Estimating or Propagating Gradients
  Through Stochastic Neurons for Conditional Computation", 2013 (the
  straight-through estimator).
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jmp_train._src.fp8 import narrow
from jmp_train._src.fp8.narrow import Quantized
from jmp_train._src.int8.recipe import Int8Recipe

__all__ = [
  "INT8_SCOPE",
  "Int8Format",
  "Int8Scales",
  "int8_conv_general_dilated",
  "int8_dot_general",
  "int8_product",
  "int8_quantize",
  "int8_scale",
  "stochastic_quantize",
]

# The name scope of the INT8 products (diagnostics find them by it).
INT8_SCOPE = "int8_product"
_QMIN, _QMAX = -128, 127


class Int8Scales(NamedTuple):
  """Given scales :math:`\\Delta` of a product's operands (``None``: current scaling).

  Attributes:
    lhs: float32 scalar (or broadcastable array) for the left operand, or ``None``.
    rhs: the same for the right operand.
  """

  lhs: Any = None
  rhs: Any = None


def int8_scale(amax: jax.Array) -> jax.Array:
  r"""The symmetric scale :math:`\Delta = \mathrm{amax} / 127`; 1 where amax is 0 or not finite.

  Args:
    amax: the largest magnitude to represent (any shape).

  Returns:
    The float32 scale(s).

  Examples:
    >>> int8_scale(jnp.array([12.7, 0.0])).tolist()
    [0.10000000149011612, 1.0]
  """
  amax = jnp.asarray(amax, jnp.float32)
  ok = jnp.isfinite(amax) & (amax > 0)
  return jnp.where(ok, amax / _QMAX, 1.0).astype(jnp.float32)


def int8_quantize(x: jax.Array, scale: jax.Array) -> jax.Array:
  r"""``clip(round(x / scale), -128, 127)`` as ``int8`` (rounding half to even).

  Args:
    x: a floating array.
    scale: the float32 scale :math:`\Delta`, broadcastable against ``x``.

  Returns:
    The int8 codes.

  Raises:
    TypeError: if ``x`` is not floating.

  Examples:
    >>> int8_quantize(jnp.array([0.25, -1.0, 100.0]), jnp.float32(0.5)).tolist()
    [0, -2, 127]
  """
  if not jnp.issubdtype(jnp.result_type(x), jnp.floating):
    raise TypeError(f"int8_quantize needs a floating array, got {jnp.result_type(x)}.")
  r = jnp.asarray(x, jnp.float32) / scale
  return jnp.clip(jnp.round(r), _QMIN, _QMAX).astype(jnp.int8)


@dataclasses.dataclass(frozen=True)
class Int8Format:
  """INT8 as a format of :func:`~jmp_train._src.fp8.narrow.narrow_product`.

  Attributes:
    fine: per operand (left, right), whether its current scale is fine (per
      row of an activation, per output channel of a weight: the amax over
      the contracting axes) rather than per tensor.
    backward: ``"float"``: the backward products on the output gradient
      and the dequantized operands in the compute dtype; ``"int8"``: on
      int8 codes, the gradient stochastically rounded, all three per tensor.
  """

  fine: tuple[bool, bool] = (True, True)
  scope: str = INT8_SCOPE
  accumulate: Any = jnp.int32
  # The backward products' operands: "float" or "int8" (Int8Recipe.backward).
  backward: str = "float"

  def quantize(self, x, meta, side, op):
    given = None if meta is None else meta[side]
    if given is not None:
      scale = jnp.asarray(given, jnp.float32)
      r = jnp.asarray(x, jnp.float32) / scale
      keep = (r >= _QMIN) & (r <= _QMAX)  # the straight-through estimator's range
      return Quantized(jnp.clip(jnp.round(r), _QMIN, _QMAX).astype(jnp.int8), scale, keep=keep)
    axes = op.fine_axes(side, x.ndim) if self.fine[side] else tuple(range(x.ndim))
    amax = jnp.max(jnp.abs(x), axis=axes, keepdims=True).astype(jnp.float32)
    scale = int8_scale(amax if self.fine[side] else amax.reshape(()))
    return Quantized(int8_quantize(x, scale), scale)

  def gradient(self, g, meta):
    del meta
    if self.backward == "int8":
      scale = int8_scale(jnp.max(jnp.abs(g)))
      return Quantized(stochastic_quantize(g, scale, _gradient_key(g)), scale)
    return Quantized(g.astype(_backward_dtype(g.dtype)), None)

  def backward_operand(self, q, dtype):
    values = q.codes.astype(jnp.float32) * q.scale
    if self.backward == "int8":  # per tensor: a fine scale lies on the backward's contracting axis
      scale = int8_scale(jnp.max(jnp.abs(values)))
      return Quantized(int8_quantize(values, scale), scale)
    return Quantized(values.astype(_backward_dtype(dtype)), None)

  def rescale(self, out, s_a, s_b):
    for s in (s_a, s_b):
      if s is not None:
        out = out * s
    return out

  def new_meta(self, meta, lhs, rhs, grad):
    del lhs, rhs, grad
    return None if meta is None else jax.tree.map(jnp.zeros_like, meta)


def stochastic_quantize(x: jax.Array, scale: jax.Array, key: jax.Array) -> jax.Array:
  r"""``clip(floor(x / scale + u), -128, 127)`` as ``int8``, :math:`u \sim U[0, 1)` drawn from ``key``.

  Stochastic rounding: :math:`E[q] = x / \Delta` inside the range, so a
  value far below one step still contributes its share on average.

  Examples:
    >>> q = stochastic_quantize(jnp.full((10000,), 0.1), jnp.float32(1.0), jax.random.key(0))
    >>> sorted(set(q.tolist())), round(float(q.mean()), 1)
    ([0, 1], 0.1)
  """
  r = jnp.asarray(x, jnp.float32) / scale
  u = jax.random.uniform(key, r.shape, jnp.float32)
  return jnp.clip(jnp.floor(r + u), _QMIN, _QMAX).astype(jnp.int8)


def _gradient_key(g: jax.Array) -> jax.Array:
  """A PRNG key for rounding ``g``, from its own bits (a backward pass has no key to hand).

  The sum of ``|g|``, bitcast to an integer, differs from step to step and
  from replica to replica, so the rounding noise does too; it is drawn
  independently of each element's own fraction.
  """
  total = jnp.sum(jnp.abs(g.astype(jnp.float32)))
  return jax.random.key(jax.lax.bitcast_convert_type(total, jnp.uint32))


def _backward_dtype(dtype: Any) -> Any:
  """The backward products' operand dtype: the compute dtype, but float32 for bfloat16 on CPUs.

  The backward products accumulate in float32; XLA:CPU cannot run every
  ``bfloat16 x bfloat16 -> float32`` dot (its dot thunk refuses the
  combination), and emulates bfloat16 arithmetic anyway.
  """
  if jnp.dtype(dtype) == jnp.bfloat16 and jax.default_backend() == "cpu":
    return jnp.float32
  return dtype


def _check_recipe(recipe: Any, fn: str) -> Int8Recipe:
  if not isinstance(recipe, Int8Recipe):
    raise TypeError(f"{fn} needs recipe=jmp_train.int8.Int8Recipe(...), got {type(recipe).__name__}: {recipe!r}.")
  return recipe


def _scales(lhs_scale: Any, rhs_scale: Any) -> Int8Scales | None:
  if lhs_scale is None and rhs_scale is None:
    return None
  as_scale = lambda s: None if s is None else jnp.asarray(s, jnp.float32)  # noqa: E731
  return Int8Scales(as_scale(lhs_scale), as_scale(rhs_scale))


def int8_product(
  op: narrow.ProductOp,
  lhs: jax.Array,
  rhs: jax.Array,
  fine: tuple[bool, bool],
  scales: Int8Scales | None,
  out_dtype,
  backward: str = "float",
) -> jax.Array:
  """``op(lhs, rhs)`` on int8 codes, int32 accumulation, in ``out_dtype`` (the shared entry)."""
  fmt = Int8Format(tuple(fine), backward=backward)
  product = narrow.narrow_product(op, fmt, lhs.dtype, rhs.dtype, out_dtype)
  return product(lhs, rhs, scales)


def int8_dot_general(
  lhs: jax.Array,
  rhs: jax.Array,
  dimension_numbers: Any,
  precision: Any = None,
  preferred_element_type: Any = None,
  *,
  recipe: Int8Recipe = Int8Recipe(),
  lhs_scale: Any = None,
  rhs_scale: Any = None,
  out_sharding: Any = None,
) -> jax.Array:
  r"""``lax.dot_general`` on int8 codes with int32 accumulation.

  The left operand is the activation (a scale per row, or per tensor, after
  ``recipe.activation``), the right one the weight (a scale per output
  channel, or per tensor); a given ``lhs_scale`` / ``rhs_scale`` replaces
  the operand's current scale (static, calibrated scaling). The result,
  :math:`(q_a \cdot q_b) \Delta_a \Delta_b`, in ``preferred_element_type``
  (default: the operands' dtype). Gradients: the straight-through
  estimator, zero where a given scale clipped, products in the operands'
  dtype (on int8 codes with ``recipe.backward="int8"``). ``precision`` is
  ignored.

  Args:
    lhs, rhs, dimension_numbers, precision, preferred_element_type: as for
      ``lax.dot_general``.
    recipe: the :class:`~jmp_train.int8.Int8Recipe`.
    lhs_scale, rhs_scale: given scales :math:`\Delta` (float32 scalars or
      arrays broadcastable against the operand), or ``None``.
    out_sharding: as for ``lax.dot_general``.

  Returns:
    The product.

  Raises:
    TypeError: for non-floating operands or a ``recipe`` of another type.

  Examples:
    >>> x, w = jnp.ones((4, 16)), jnp.full((16, 8), 0.5)
    >>> y = int8_dot_general(x, w, (((1,), (0,)), ((), ())))
    >>> y.dtype, float(y[0, 0])
    (dtype('float32'), 8.0)
    >>> "xi8>" in jax.jit(lambda a, b: int8_dot_general(a, b, (((1,), (0,)), ((), ())))).lower(x, w).as_text()
    True
  """
  del precision
  lhs, rhs = jnp.asarray(lhs), jnp.asarray(rhs)
  narrow.check_operands(lhs, rhs, "int8_dot_general")
  recipe = _check_recipe(recipe, "int8_dot_general")
  out_dtype = preferred_element_type or jnp.result_type(lhs, rhs)
  fine = (recipe.activation == "per_row", recipe.weight == "per_channel")
  op = narrow.dot_op(dimension_numbers, out_sharding)
  return int8_product(op, lhs, rhs, fine, _scales(lhs_scale, rhs_scale), out_dtype, recipe.backward)


def int8_conv_general_dilated(
  lhs: jax.Array,
  rhs: jax.Array,
  *args: Any,
  recipe: Int8Recipe = Int8Recipe(),
  lhs_scale: Any = None,
  rhs_scale: Any = None,
  **kwargs: Any,
) -> jax.Array:
  """``lax.conv_general_dilated`` on int8 codes with int32 accumulation.

  The input takes one scale (per tensor), the kernel one per output feature
  (``recipe.weight="per_channel"``) or one; the rest as
  :func:`int8_dot_general`, the remaining arguments ``lax.conv_general_dilated``'s.

  Examples:
    >>> x, k = jnp.ones((1, 8, 8, 16)), jnp.full((3, 3, 16, 16), 0.25)
    >>> y = int8_conv_general_dilated(x, k, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))
    >>> float(y[0, 4, 4, 0])
    36.0
  """
  lhs, rhs = jnp.asarray(lhs), jnp.asarray(rhs)
  narrow.check_operands(lhs, rhs, "int8_conv_general_dilated")
  recipe = _check_recipe(recipe, "int8_conv_general_dilated")
  out_dtype = kwargs.pop("preferred_element_type", None) or jnp.result_type(lhs, rhs)
  op = narrow.conv_op(*args, **kwargs)
  fine = (False, recipe.weight == "per_channel")
  return int8_product(op, lhs, rhs, fine, _scales(lhs_scale, rhs_scale), out_dtype, recipe.backward)
