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

The product runs on the dequantized operands with float32 accumulation
(``preferred_element_type=float32``) and returns the compute dtype; on a GPU,
XLA rewrites "convert from FP8, multiply by 1/s, dot" into one FP8 GEMM.
The backward pass quantizes the incoming gradient to E5M2 with its own scale
and differentiates the same product.

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
(re-exported here); this module holds the products.

References:
  Micikevicius et al., "FP8 Formats for Deep Learning", 2022.
  https://arxiv.org/abs/2209.05433

  NVIDIA Transformer Engine, "Using FP8 with Transformer Engine" (delayed
  scaling recipe).
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax import lax

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
from jmp_train._src.varying_axes import varying_axes

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


def _agree(new: jax.Array, axes: frozenset[str]) -> jax.Array:
  """Under ``shard_map``, a meta shared by all replicas gets their max.

  The new meta of a replicated (invariant) meta must be replicated too: the
  max over the axes the data made it vary over is the global batch's amax.
  """
  extra = tuple(sorted(varying_axes(new) - axes))
  return lax.pmax(new, extra) if extra else new


def _fp8_binary(op: Callable[[jax.Array, jax.Array], jax.Array], recipe: Fp8Recipe,
                l_dtype: Any, r_dtype: Any):
  """``op(lhs, rhs)`` with FP8 operands and gradient, as a ``custom_vjp``."""

  def forward(lhs, rhs, meta: Fp8DotMeta):
    s_l, lhs_meta = calibrate(lhs, meta.lhs, E4M3, recipe)
    s_r, rhs_meta = calibrate(rhs, meta.rhs, E4M3, recipe)
    q_l, q_r = fp8_quantize(lhs, E4M3, s_l), fp8_quantize(rhs, E4M3, s_r)
    with jax.named_scope(FP8_SCOPE):
      out = op(fp8_dequantize(q_l, s_l, lhs.dtype), fp8_dequantize(q_r, s_r, rhs.dtype))
    return out, (q_l, s_l, q_r, s_r, lhs_meta, rhs_meta, meta.grad)

  @jax.custom_vjp
  def product(lhs, rhs, meta):
    return forward(lhs, rhs, meta)[0]

  meta_axes: list[Any] = []  # the meta's varying mesh axes, seen by fwd

  def product_bwd(res, g):
    q_l, s_l, q_r, s_r, lhs_meta, rhs_meta, grad_meta = res
    s_g, new_grad_meta = calibrate(g, grad_meta, E5M2, recipe)
    g_hat = fp8_dequantize(fp8_quantize(g, E5M2, s_g), s_g, g.dtype)
    with jax.named_scope(FP8_SCOPE):
      _, pullback = jax.vjp(
          op, fp8_dequantize(q_l, s_l, l_dtype), fp8_dequantize(q_r, s_r, r_dtype))
      d_lhs, d_rhs = pullback(g_hat)
    new_meta = Fp8DotMeta(lhs_meta, rhs_meta, new_grad_meta)
    new_meta = jax.tree.map(_agree, new_meta, meta_axes[0])
    return d_lhs.astype(l_dtype), d_rhs.astype(r_dtype), new_meta

  def product_fwd(lhs, rhs, meta):
    meta_axes[:] = [jax.tree.map(varying_axes, meta)]
    return forward(lhs, rhs, meta)

  product.defvjp(product_fwd, product_bwd)
  return product


def _check_meta(meta: Any, fn: str) -> Fp8DotMeta:
  if not isinstance(meta, Fp8DotMeta):
    raise TypeError(
        f"{fn} needs meta=Fp8DotMeta (from jmp_train.init_fp8_meta), got "
        f"{type(meta).__name__}."
    )
  return meta


def _check_operands(lhs, rhs, fn: str) -> None:
  for name, x in (("lhs", lhs), ("rhs", rhs)):
    if not jnp.issubdtype(jnp.result_type(x), jnp.floating):
      raise TypeError(f"{fn}: {name} must be floating, got {jnp.result_type(x)}.")


def fp8_dot_general(
    lhs: jax.Array,
    rhs: jax.Array,
    dimension_numbers: Any,
    precision: Any = None,
    preferred_element_type: Any = None,
    *,
    meta: Fp8DotMeta,
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
    meta: this product's :class:`Fp8DotMeta`.
    recipe: the :class:`Fp8Recipe`.
    out_sharding: as for ``lax.dot_general``.

  Returns:
    The product.

  Raises:
    TypeError: for non-floating operands or a ``meta`` of another type.

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
  """
  del precision
  lhs, rhs = jnp.asarray(lhs), jnp.asarray(rhs)
  _check_operands(lhs, rhs, "fp8_dot_general")
  out_dtype = preferred_element_type or jnp.result_type(lhs, rhs)
  extra = {} if out_sharding is None else {"out_sharding": out_sharding}

  def op(a, b):
    out = lax.dot_general(a, b, dimension_numbers, preferred_element_type=jnp.float32, **extra)
    return out.astype(out_dtype)

  product = _fp8_binary(op, recipe, lhs.dtype, rhs.dtype)
  return product(lhs, rhs, _check_meta(meta, "fp8_dot_general"))


def fp8_conv_general_dilated(
    lhs: jax.Array,
    rhs: jax.Array,
    *args: Any,
    meta: Fp8DotMeta,
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
  _check_operands(lhs, rhs, "fp8_conv_general_dilated")
  kwargs.pop("precision", None)
  out_dtype = kwargs.pop("preferred_element_type", None) or jnp.result_type(lhs, rhs)

  def op(a, b):
    out = lax.conv_general_dilated(a, b, *args, preferred_element_type=jnp.float32, **kwargs)
    return out.astype(out_dtype)

  product = _fp8_binary(op, recipe, lhs.dtype, rhs.dtype)
  return product(lhs, rhs, _check_meta(meta, "fp8_conv_general_dilated"))
