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
(re-exported here); this module holds the products.

References:
  Micikevicius et al., "FP8 Formats for Deep Learning", 2022.
  https://arxiv.org/abs/2209.05433

  NVIDIA Transformer Engine, "Using FP8 with Transformer Engine" (delayed
  scaling recipe).
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.extend import core as jex_core

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
from jmp_train._src.fp8.scaling import pmax_together
from jmp_train._src.fp8.scaling import push_amax
from jmp_train._src.fp8.scaling import update_fp8_meta
from jmp_train._src.varying_axes import pvary
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


def _agree(new: Fp8DotMeta, axes: Fp8DotMeta) -> Fp8DotMeta:
  """Under ``shard_map``, a meta shared by all replicas gets their max.

  The new meta of a replicated (invariant) meta must be replicated too: the
  max over the axes the data made it vary over is the global batch's amax.
  Leaves with the same extra axes (usually all six) share one reduction.
  """
  leaves, treedef = jax.tree.flatten(new)
  extras = [tuple(sorted(varying_axes(x) - a)) for x, a in zip(leaves, jax.tree.leaves(axes))]
  for extra in sorted(set(extras)):
    if extra:
      index = [i for i, e in enumerate(extras) if e == extra]
      for i, x in zip(index, pmax_together([leaves[i] for i in index], extra)):
        leaves[i] = x
  return jax.tree.unflatten(treedef, leaves)


def _sum_extra(x: jax.Array, axes: frozenset[str]) -> jax.Array:
  """``x`` summed over the mesh axes it varies over beyond ``axes``."""
  extra = tuple(sorted(varying_axes(x) - axes))
  return lax.psum(x, extra) if extra else x


def _descale(out: jax.Array, s_a: jax.Array, s_b: jax.Array) -> jax.Array:
  """The float32 product of the codes, ``out``, divided by :math:`s_a s_b`.

  One division (one rounding) by the product of the scales, unless that
  product overflows float32 (two tiny amaxes): then one scale at a time.
  """
  both = s_a * s_b
  return jnp.where(jnp.isfinite(both), out / both, out / s_a / s_b)


def _split_e5m2(q: jax.Array) -> tuple[jax.Array, jax.Array]:
  """An E4M3 array as two E5M2 arrays that add up to it exactly.

  ``hi`` rounds ``q``'s four significant bits to E5M2's three; the rest is
  zero or a single bit, which E5M2 represents (its range covers E4M3's).
  """
  hi = q.astype(E5M2)
  lo = (q.astype(jnp.float32) - hi.astype(jnp.float32)).astype(E5M2)
  return hi, lo


def _fp8_conv(lhs: jax.Array, rhs: jax.Array, **params: Any) -> jax.Array:
  """``conv_general_dilated_p`` on FP8 operands, mixed formats included.

  StableHLO refuses a convolution of two element types, so an E4M3
  operand facing an E5M2 one is split into its exact E5M2 parts.
  """
  bind = functools.partial(lax.conv_general_dilated_p.bind, **params)
  if lhs.dtype == rhs.dtype:
    return bind(lhs, rhs)
  if lhs.dtype == E4M3:
    hi, lo = _split_e5m2(lhs)
    return bind(hi, rhs) + bind(lo, rhs)
  hi, lo = _split_e5m2(rhs)
  return bind(lhs, hi) + bind(lhs, lo)


def _replay(jaxpr: Any, *args: jax.Array) -> jax.Array:
  """Evaluates a transposed product's jaxpr, traced on float32 stand-ins,
  on FP8 operands: its product takes them as they are, the data movement
  around it (transpose, reverse, reshape) works in any dtype."""
  env = dict(zip(jaxpr.jaxpr.invars, args))
  env.update(zip(jaxpr.jaxpr.constvars, jaxpr.consts))
  read = lambda v: v.val if isinstance(v, jex_core.Literal) else env[v]  # noqa: E731
  for eqn in jaxpr.jaxpr.eqns:
    invals = [read(v) for v in eqn.invars]
    # Under shard_map, operands must vary over the same mesh axes.
    axes = frozenset().union(*map(varying_axes, invals))
    invals = [pvary(x, axes) for x in invals]
    if eqn.primitive is lax.conv_general_dilated_p:
      outs = [_fp8_conv(*invals, **eqn.params)]
    else:
      outs = eqn.primitive.bind(*invals, **eqn.params)
      outs = outs if eqn.primitive.multiple_results else [outs]
    env.update(zip(eqn.outvars, outs))
  (out,) = [read(v) for v in jaxpr.jaxpr.outvars]
  return out


def _transposed(
  op: Callable[[jax.Array, jax.Array], jax.Array], argnum: int, g: jax.Array, other: jax.Array, shapes: tuple[Any, Any]
) -> jax.Array:
  """The transpose of ``op`` with respect to operand ``argnum``, applied to
  the FP8 gradient ``g``, with the FP8 ``other`` operand: float32 result."""
  stand_in = [jax.ShapeDtypeStruct(s, jnp.float32) for s in shapes]
  out = jax.eval_shape(op, *stand_in)

  def transpose(ct, b):
    linear = (lambda a: op(a, b)) if argnum == 0 else (lambda a: op(b, a))
    return jax.linear_transpose(linear, stand_in[argnum])(ct)[0]

  jaxpr = jax.make_jaxpr(transpose)(out, stand_in[1 - argnum])
  return _replay(jaxpr, g, other)


def _fp8_binary(
  op: Callable[[jax.Array, jax.Array], jax.Array], recipe: Fp8Recipe, l_dtype: Any, r_dtype: Any, out_dtype: Any
):
  """``op(lhs, rhs)`` on FP8 operands, with FP8 gradient products, as a
  ``custom_vjp``; ``op`` accumulates in (and returns) float32."""

  def forward(lhs, rhs, meta: Fp8DotMeta):
    s_l, lhs_meta = calibrate(lhs, meta.lhs, E4M3, recipe)
    s_r, rhs_meta = calibrate(rhs, meta.rhs, E4M3, recipe)
    q_l, q_r = fp8_quantize(lhs, E4M3, s_l), fp8_quantize(rhs, E4M3, s_r)
    with jax.named_scope(FP8_SCOPE):
      out = _descale(op(q_l, q_r), s_l, s_r)
    return out.astype(out_dtype), (q_l, s_l, q_r, s_r, lhs_meta, rhs_meta, meta.grad)

  @jax.custom_vjp
  def product(lhs, rhs, meta):
    return forward(lhs, rhs, meta)[0]

  meta_axes: list[Any] = []  # the meta's varying mesh axes, seen by fwd
  operand_axes: list[Any] = []  # and the operands'

  def product_bwd(res, g):
    q_l, s_l, q_r, s_r, lhs_meta, rhs_meta, grad_meta = res
    s_g, new_grad_meta = calibrate(g, grad_meta, E5M2, recipe)
    q_g = fp8_quantize(g, E5M2, s_g)
    shapes = (q_l.shape, q_r.shape)
    with jax.named_scope(FP8_SCOPE):
      d_lhs = _descale(_transposed(op, 0, q_g, q_r, shapes), s_g, s_r)
      d_rhs = _descale(_transposed(op, 1, q_g, q_l, shapes), s_g, s_l)
    # An operand replicated over mesh axes its gradient varies over gets
    # the sum over them (what the transpose of its implicit broadcast does).
    d_lhs, d_rhs = (_sum_extra(d, axes) for d, axes in zip((d_lhs, d_rhs), operand_axes))
    new_meta = Fp8DotMeta(lhs_meta, rhs_meta, new_grad_meta)
    new_meta = _agree(new_meta, meta_axes[0])
    return d_lhs.astype(l_dtype), d_rhs.astype(r_dtype), new_meta

  def product_fwd(lhs, rhs, meta):
    meta_axes[:] = [jax.tree.map(varying_axes, meta)]
    operand_axes[:] = [varying_axes(lhs), varying_axes(rhs)]
    return forward(lhs, rhs, meta)

  product.defvjp(product_fwd, product_bwd)
  return product


def _check_meta(meta: Any, fn: str) -> Fp8DotMeta:
  if not isinstance(meta, Fp8DotMeta):
    raise TypeError(f"{fn} needs meta=Fp8DotMeta (from jmp_train.init_fp8_meta), got {type(meta).__name__}.")
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
    return lax.dot_general(a, b, dimension_numbers, preferred_element_type=jnp.float32, **extra)

  product = _fp8_binary(op, recipe, lhs.dtype, rhs.dtype, out_dtype)
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
    return lax.conv_general_dilated(a, b, *args, preferred_element_type=jnp.float32, **kwargs)

  product = _fp8_binary(op, recipe, lhs.dtype, rhs.dtype, out_dtype)
  return product(lhs, rhs, _check_meta(meta, "fp8_conv_general_dilated"))
