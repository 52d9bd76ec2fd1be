r"""The one place where a narrow product is scaled, quantized, multiplied and rescaled.

A *narrow product* is a ``dot_general`` or ``conv_general_dilated`` whose
operands are cast to a narrow format (FP8, INT8) after scaling:

.. math::

  q_a = Q(a / \Delta_a), \quad q_b = Q(b / \Delta_b), \qquad
  a \cdot b \approx (q_a \cdot q_b) \, \Delta_a \Delta_b ,

with the product of the codes accumulated wide (float32 for FP8, int32 for
INT8) and rescaled to a float. A :class:`NarrowFormat` says how an operand
is scaled and quantized (per tensor, per row, per output channel; from its
own amax or from a stored scale), how the product is rescaled, and what the
backward pass multiplies: FP8 quantizes the output gradient too (E5M2) and
runs both gradient products on FP8 codes; INT8 takes the straight-through
estimator, its gradient products on the dequantized operands in the compute
dtype, the gradient zeroed where the forward pass clipped.

:func:`narrow_product` builds the ``custom_vjp`` that does all of this for
one format and one :class:`ProductOp`; ``jmp_train.fp8_dot_general`` and
``jmp_train.int8.int8_dot_general`` (and their convolutions) are thin
wrappers over it.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple, Protocol

import jax
import jax.numpy as jnp
from jax import lax
from jax.extend import core as jex_core

from jmp_train._src.fp8.scaling import E4M3
from jmp_train._src.fp8.scaling import E5M2
from jmp_train._src.fp8.scaling import pmax_together
from jmp_train._src.varying_axes import pvary
from jmp_train._src.varying_axes import varying_axes

__all__ = ["NarrowFormat", "ProductOp", "Quantized", "check_operands", "conv_op", "dot_op", "narrow_product"]


class Quantized(NamedTuple):
  """One operand of a narrow product, quantized.

  Attributes:
    codes: the narrow array (FP8, int8), or the value itself where a format
      keeps it (an INT8 backward operand in the compute dtype).
    scale: the format's scale: a scalar, or an array of the operand's rank
      with size 1 on the reduced axes; ``None`` for none.
    meta: the new scaling state of this tensor (``None`` without state).
    keep: where the gradient passes (the straight-through estimator's
      mask, ``False`` where the value was clipped), or ``None`` everywhere.
  """

  codes: jax.Array
  scale: Any
  meta: Any = None
  keep: Any = None


class ProductOp(NamedTuple):
  """A product as the narrow mechanism sees it.

  Attributes:
    apply: ``apply(a, b, accumulate)``: the product with
      ``preferred_element_type=accumulate``.
    fine_axes: ``fine_axes(side, ndim)``: the axes an operand's amax is
      taken over for a scale per row (``side`` 0) or per output channel
      (``side`` 1); the other axes keep their own scale.
    to_output: ``to_output(side, scale, out_ndim)``: an operand's scale
      (:attr:`Quantized.scale`) laid out to broadcast against the product.
  """

  apply: Callable[[jax.Array, jax.Array, Any], jax.Array]
  fine_axes: Callable[[int, int], tuple[int, ...]]
  to_output: Callable[[int, Any, int], Any]


class NarrowFormat(Protocol):
  """What a format does at each step of a narrow product.

  ``scope`` names the products (diagnostics read it), ``accumulate`` is
  the forward product's accumulation dtype. ``quantize(x, meta, side, op)``
  quantizes operand ``side`` (0 or 1) of the forward product;
  ``gradient(g, meta)`` prepares the output gradient and
  ``backward_operand(quantized, dtype)`` a forward operand for the
  backward products; ``rescale(out, s_a, s_b)`` turns a product of codes
  into values; ``new_meta(meta, lhs, rhs, grad)`` is the cotangent of the
  scaling state (its value for the next step).
  """

  scope: str
  accumulate: Any

  def quantize(self, x: jax.Array, meta: Any, side: int, op: ProductOp) -> Quantized: ...

  def gradient(self, g: jax.Array, meta: Any) -> Quantized: ...

  def backward_operand(self, q: Quantized, dtype: Any) -> Quantized: ...

  def rescale(self, out: jax.Array, s_a: Any, s_b: Any) -> jax.Array: ...

  def new_meta(self, meta: Any, lhs: Quantized, rhs: Quantized, grad: Quantized) -> Any: ...


def check_operands(lhs: Any, rhs: Any, fn: str) -> None:
  """A TypeError naming ``fn`` if an operand of a narrow product is not floating."""
  for name, x in (("lhs", lhs), ("rhs", rhs)):
    if not jnp.issubdtype(jnp.result_type(x), jnp.floating):
      raise TypeError(f"{fn}: {name} must be floating (the narrow codes are made inside), got {jnp.result_type(x)}.")


# ---------------------------------------------------------------------------
# The products.


def _dot_to_output(dimension_numbers: Any, side: int, scale: Any, out_ndim: int) -> Any:
  """A scale of operand ``side`` (size 1 on its contracting axes) in the
  product's layout: batch axes, the left operand's free axes, the right's."""
  if scale is None or jnp.ndim(scale) == 0:
    return scale
  (contract_l, contract_r), (batch_l, batch_r) = dimension_numbers
  contract, batch = ((contract_l, batch_l), (contract_r, batch_r))[side]
  ndim = jnp.ndim(scale)
  free = [d for d in range(ndim) if d not in contract and d not in batch]
  moved = jnp.transpose(scale, (*batch, *free, *contract)).reshape([scale.shape[d] for d in (*batch, *free)])
  n_other_free = out_ndim - len(batch) - len(free)
  ones = (1,) * n_other_free
  if side == 0:
    return moved.reshape(moved.shape + ones)
  return moved.reshape(moved.shape[: len(batch)] + ones + moved.shape[len(batch) :])


def dot_op(dimension_numbers: Any, out_sharding: Any = None) -> ProductOp:
  """The :class:`ProductOp` of ``lax.dot_general(a, b, dimension_numbers)``.

  Fine scales are per row of the left operand and per output channel of
  the right one: each over the operand's contracting axes.
  """
  extra = {} if out_sharding is None else {"out_sharding": out_sharding}
  (contract_l, contract_r), (batch_l, batch_r) = dimension_numbers
  dn = ((tuple(contract_l), tuple(contract_r)), (tuple(batch_l), tuple(batch_r)))

  def apply(a, b, accumulate):
    return lax.dot_general(a, b, dimension_numbers, preferred_element_type=accumulate, **extra)

  return ProductOp(
    apply,
    lambda side, ndim: tuple(int(d) for d in dn[0][side]),
    functools.partial(_dot_to_output, dn),
  )


def conv_op(*args: Any, **kwargs: Any) -> ProductOp:
  """The :class:`ProductOp` of ``lax.conv_general_dilated(a, b, *args, **kwargs)``.

  The input takes one scale (per tensor, also as its "fine" scale); the
  kernel a scale per output feature.
  """
  kwargs = dict(kwargs)
  kwargs.pop("preferred_element_type", None)
  kwargs.pop("precision", None)

  def apply(a, b, accumulate):
    return lax.conv_general_dilated(a, b, *args, preferred_element_type=accumulate, **kwargs)

  def numbers(lhs_ndim):
    dn = kwargs.get("dimension_numbers")
    return lax.conv_dimension_numbers((1,) * lhs_ndim, (1,) * lhs_ndim, dn)

  def fine_axes(side, ndim):
    if side == 0:
      return tuple(range(ndim))
    out_feature = numbers(ndim).rhs_spec[0]
    return tuple(d for d in range(ndim) if d != out_feature)

  def to_output(side, scale, out_ndim):
    if scale is None or jnp.ndim(scale) == 0:
      return scale
    dn = numbers(out_ndim)
    feature = dn.rhs_spec[0] if side == 1 else None
    if feature is None:
      return jnp.reshape(scale, ())
    shape = [1] * out_ndim
    shape[dn.out_spec[1]] = scale.shape[feature]
    return jnp.reshape(scale, shape)

  return ProductOp(apply, fine_axes, to_output)


# ---------------------------------------------------------------------------
# Replicas (shard_map) and the backward products.


def agree(new: Any, axes: Any) -> Any:
  """Under ``shard_map``, a state shared by all replicas gets their max.

  The new state of a replicated (invariant) state must be replicated too:
  the max over the axes the data made it vary over is the global batch's
  amax. Leaves with the same extra axes share one reduction.
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


def _split_e5m2(q: jax.Array) -> tuple[jax.Array, jax.Array]:
  """An E4M3 array as two E5M2 arrays that add up to it exactly.

  ``hi`` rounds ``q``'s four significant bits to E5M2's three; the rest is
  zero or a single bit, which E5M2 represents (its range covers E4M3's).
  """
  hi = q.astype(E5M2)
  lo = (q.astype(jnp.float32) - hi.astype(jnp.float32)).astype(E5M2)
  return hi, lo


def _conv(lhs: jax.Array, rhs: jax.Array, **params: Any) -> jax.Array:
  """``conv_general_dilated_p`` on narrow operands, mixed FP8 formats included.

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
  on the backward operands: its product takes them as they are (integer
  codes with int32 accumulation), the data movement around it (transpose,
  reverse, reshape) works in any dtype."""
  env = dict(zip(jaxpr.jaxpr.invars, args))
  env.update(zip(jaxpr.jaxpr.constvars, jaxpr.consts))
  read = lambda v: v.val if isinstance(v, jex_core.Literal) else env[v]  # noqa: E731
  for eqn in jaxpr.jaxpr.eqns:
    invals = [read(v) for v in eqn.invars]
    # Under shard_map, operands must vary over the same mesh axes.
    axes = frozenset().union(*map(varying_axes, invals))
    invals = [pvary(x, axes) for x in invals]
    if eqn.primitive in (lax.dot_general_p, lax.conv_general_dilated_p) and all(
      jnp.issubdtype(x.dtype, jnp.integer) for x in invals
    ):
      # Integer codes (an INT8 backward): int32 accumulation, as the forward's.
      params = {**eqn.params, "preferred_element_type": jnp.int32}
      outs = [eqn.primitive.bind(*invals, **params).astype(jnp.float32)]
    elif eqn.primitive is lax.conv_general_dilated_p:
      outs = [_conv(*invals, **eqn.params)]
    else:
      outs = eqn.primitive.bind(*invals, **eqn.params)
      outs = outs if eqn.primitive.multiple_results else [outs]
    env.update(zip(eqn.outvars, outs))
  (out,) = [read(v) for v in jaxpr.jaxpr.outvars]
  return out


def _transposed(op: ProductOp, argnum: int, g: jax.Array, other: jax.Array, shapes: tuple[Any, Any]) -> jax.Array:
  """The transpose of ``op`` with respect to operand ``argnum``, applied to
  the backward gradient ``g``, with the backward ``other`` operand: float32."""
  stand_in = [jax.ShapeDtypeStruct(s, jnp.float32) for s in shapes]
  wide = lambda a, b: op.apply(a, b, jnp.float32)  # noqa: E731
  out = jax.eval_shape(wide, *stand_in)

  def transpose(ct, b):
    linear = (lambda a: wide(a, b)) if argnum == 0 else (lambda a: wide(b, a))
    return jax.linear_transpose(linear, stand_in[argnum])(ct)[0]

  jaxpr = jax.make_jaxpr(transpose)(out, stand_in[1 - argnum])
  return _replay(jaxpr, g, other)


def _masked(d: jax.Array, keep: Any) -> jax.Array:
  return d if keep is None else jnp.where(keep, d, jnp.zeros((), d.dtype))


def narrow_product(op: ProductOp, fmt: NarrowFormat, l_dtype: Any, r_dtype: Any, out_dtype: Any):
  """``op(lhs, rhs)`` in the narrow format ``fmt``, as a ``custom_vjp`` of ``(lhs, rhs, meta)``.

  Forward: each operand quantized (:meth:`NarrowFormat.quantize`), the
  codes multiplied with ``fmt.accumulate`` accumulation under the name
  scope ``fmt.scope``, the result rescaled and cast to ``out_dtype``.
  Backward: the output gradient and the forward operands as the format
  gives them, both transposed products, each rescaled, masked by the
  other operand's clipping (the straight-through estimator) and summed
  over the mesh axes an operand is replicated over; the state's cotangent
  is :meth:`NarrowFormat.new_meta`, agreed over replicas.
  """

  def forward(lhs, rhs, meta):
    q_l, q_r = fmt.quantize(lhs, meta, 0, op), fmt.quantize(rhs, meta, 1, op)
    with jax.named_scope(fmt.scope):
      out = op.apply(q_l.codes, q_r.codes, fmt.accumulate)
      rank = out.ndim
      out = fmt.rescale(out.astype(jnp.float32), op.to_output(0, q_l.scale, rank), op.to_output(1, q_r.scale, rank))
    return out.astype(out_dtype), (q_l, q_r, meta)

  @jax.custom_vjp
  def product(lhs, rhs, meta):
    return forward(lhs, rhs, meta)[0]

  meta_axes: list[Any] = []  # the meta's varying mesh axes, seen by fwd
  operand_axes: list[Any] = []  # and the operands'

  def product_bwd(res, g):
    q_l, q_r, meta = res
    q_g = fmt.gradient(g, meta)
    b_l, b_r = fmt.backward_operand(q_l, g.dtype), fmt.backward_operand(q_r, g.dtype)
    shapes = (q_l.codes.shape, q_r.codes.shape)
    with jax.named_scope(fmt.scope):
      d_lhs = fmt.rescale(_transposed(op, 0, q_g.codes, b_r.codes, shapes), q_g.scale, b_r.scale)
      d_rhs = fmt.rescale(_transposed(op, 1, q_g.codes, b_l.codes, shapes), q_g.scale, b_l.scale)
    d_lhs, d_rhs = _masked(d_lhs, q_l.keep), _masked(d_rhs, q_r.keep)
    # An operand replicated over mesh axes its gradient varies over gets
    # the sum over them (what the transpose of its implicit broadcast does).
    d_lhs, d_rhs = (_sum_extra(d, axes) for d, axes in zip((d_lhs, d_rhs), operand_axes))
    new_meta = fmt.new_meta(meta, q_l, q_r, q_g)
    if new_meta is not None:
      new_meta = agree(new_meta, meta_axes[0])
    return d_lhs.astype(l_dtype), d_rhs.astype(r_dtype), new_meta

  def product_fwd(lhs, rhs, meta):
    meta_axes[:] = [jax.tree.map(varying_axes, meta)]
    operand_axes[:] = [varying_axes(lhs), varying_axes(rhs)]
    return forward(lhs, rhs, meta)

  product.defvjp(product_fwd, product_bwd)
  return product
