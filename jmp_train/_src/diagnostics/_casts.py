"""Counting what a cast to float16/bfloat16 does to each value, exactly.

The histogram and fraction tools share these kernels: masks of the values
that become 0, subnormal or inf when scaled and cast, computed from the
cast's result bits (not from comparisons with the type's limits), so they
agree with the cast, tie-breaking included.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple, Sequence

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

from jmp_train._src.diagnostics import arguments


def magnitude_bits(x: jax.Array) -> jax.Array:
  """The bits of ``|x|`` as an unsigned integer (sign bit cleared).

  Bits, not comparisons: XLA's CPU and GPU backends treat float32 subnormals
  as zero in arithmetic, but a cast's result bits are exact.
  """
  nbits = x.dtype.itemsize * 8
  utype = {16: jnp.uint16, 32: jnp.uint32, 64: jnp.uint64}[nbits]
  sign_mask = np.array((1 << (nbits - 1)) - 1, dtype=utype)
  return lax.bitcast_convert_type(x, utype) & sign_mask


def float32_exponent(v: jax.Array) -> jax.Array:
  """floor(log2|v|) for finite non-zero float32 ``v``, exactly, from its bits."""
  bits = magnitude_bits(v).astype(jnp.int32)
  field = bits >> 23
  mantissa = bits & ((1 << 23) - 1)
  # Subnormals: the exponent is set by the highest mantissa bit.
  sub = (31 - lax.clz(jnp.maximum(mantissa, 1))) - 149
  return jnp.where(field == 0, sub, field - 127)


class CastCounts(NamedTuple):
  nonzero: jax.Array
  zeros: jax.Array
  nonfinite: jax.Array
  underflow: jax.Array
  subnormal: jax.Array
  overflow: jax.Array


def _scaled(x: jax.Array, scale: Any) -> jax.Array:
  wide = jnp.promote_types(x.dtype, jnp.float32)
  return x.astype(wide) * jnp.asarray(scale, wide)


def cast_masks(x: jax.Array, dtype: np.dtype, scale: Any):
  """Masks of which elements are non-zero, and become 0 / subnormal / inf."""
  x = jnp.asarray(x)
  finite = jnp.isfinite(x)
  nonzero = finite & (magnitude_bits(x) != 0)
  v = _scaled(x, scale)
  ybits = magnitude_bits(v.astype(dtype))
  info = jnp.finfo(dtype)
  nmant, nexp = int(info.nmant), int(info.nexp)
  inf_bits = ((1 << nexp) - 1) << nmant
  becomes_zero = nonzero & (ybits == 0)
  becomes_subnormal = nonzero & (ybits != 0) & (ybits < (1 << nmant))
  becomes_inf = nonzero & (ybits == inf_bits)
  return finite, nonzero, v, becomes_zero, becomes_subnormal, becomes_inf


def cast_counts(x: jax.Array, dtype: np.dtype, scale: Any) -> CastCounts:
  finite, nonzero, _, zero, sub, inf = cast_masks(x, dtype, scale)
  count = functools.partial(jnp.sum, dtype=jnp.int32)
  return CastCounts(
    nonzero=count(nonzero),
    zeros=count(finite & ~nonzero),
    nonfinite=count(~finite),
    underflow=count(zero),
    subnormal=count(sub),
    overflow=count(inf),
  )


def flatten_leaves(leaves: Sequence[jax.Array]) -> jax.Array:
  """All values in one vector, in float32 (float64 if a leaf is float64).

  One vector, so the compiled code does not grow with the number of leaves
  (per-leaf kernels made XLA's compile time grow linearly with it). The
  price is a temporary copy of the values. Every float16 and bfloat16 value
  is exact in float32.
  """
  wide = jnp.result_type(jnp.float32, *[jnp.asarray(x).dtype for x in leaves])
  flat = [jnp.ravel(jnp.asarray(x)).astype(wide) for x in leaves]
  return flat[0] if len(flat) == 1 else jnp.concatenate(flat)


def psum(tree: Any, axis_name: Any) -> Any:
  return tree if axis_name is None else jax.tree.map(lambda c: lax.psum(c, axis_name), tree)


@functools.partial(jax.jit, static_argnums=(1, 3))
def _sum_leaf_counts(leaves, dtype: np.dtype, scale: jax.Array, axis_name=None) -> CastCounts:
  # Compiled once per tree signature: eager code would compile and dispatch
  # every primitive separately. Under an outer jit it is inlined.
  return psum(cast_counts(flatten_leaves(leaves), dtype, scale), axis_name)


def sum_counts(tree: Any, dtype: np.dtype, scale: Any, fn_name: str, axis_name=None) -> CastCounts:
  leaves = [x for _, x in arguments.floating_leaves(tree, fn_name)]
  return _sum_leaf_counts(leaves, dtype, jnp.asarray(scale, jnp.float32), axis_name)


def fraction(num: jax.Array, den: jax.Array) -> jax.Array:
  return jnp.where(den > 0, num.astype(jnp.float32) / jnp.maximum(den, 1), 0.0)
