"""What an FP8 cast does to values: the share that saturates or flushes to zero.

FP8 casts in :func:`jmp_train.fp8_quantize` clip to the format's largest
value (448 for E4M3, 57344 for E5M2) instead of overflowing, and flush what
lies below half the smallest subnormal to zero. :func:`fp8_cast_fractions`
counts both, and the subnormals (few significant bits), for a tree of values
and a scale, so that a user can see why an FP8 run loses accuracy: a scale
from a stale amax history saturates, one from an outlier flushes the rest.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jmp_train._src.diagnostics import _casts
from jmp_train._src.diagnostics import arguments
from jmp_train._src.fp8.scaling import fp8_dtype

__all__ = ["Fp8CastFractions", "fp8_cast_fractions"]


class Fp8CastFractions(NamedTuple):
  """Shares of the non-zero finite values of a tree, cast to FP8.

  Attributes:
    saturated: share clipped to the format's largest value.
    underflow: share that becomes 0.
    subnormal: share that becomes a subnormal (non-zero, below the
      smallest normal).
  """

  saturated: jax.Array
  underflow: jax.Array
  subnormal: jax.Array


def _leaf_counts(x: jax.Array, dtype: np.dtype, scale: Any) -> jax.Array:
  v = x.astype(jnp.float32) * jnp.asarray(scale, jnp.float32)
  nonzero = jnp.isfinite(v) & (v != 0)
  info = jnp.finfo(dtype)
  q = jnp.abs(jnp.clip(v, -float(info.max), float(info.max)).astype(dtype).astype(jnp.float32))
  count = lambda m: jnp.sum(m, dtype=jnp.int32)  # noqa: E731
  return jnp.stack(
    [
      count(nonzero),
      count(nonzero & (jnp.abs(v) > float(info.max))),
      count(nonzero & (q == 0)),
      count(nonzero & (q > 0) & (q < float(info.smallest_normal))),
    ]
  )


def fp8_cast_fractions(tree: Any, dtype: Any = "e4m3", scale: Any = 1.0, *, axis_name: Any = None) -> Fp8CastFractions:
  r"""Shares of a tree's non-zero values that saturate, flush or go subnormal in FP8.

  Each value is cast as :func:`jmp_train.fp8_quantize` does:
  :math:`q = \mathrm{fp8}(\mathrm{clip}(x s))`.

  Args:
    tree: any pytree with floating leaves.
    dtype: ``"e4m3"`` (forward operands) or ``"e5m2"`` (gradients), or the
      jnp dtypes.
    scale: the factor applied before the cast (an FP8 scale, e.g.
      ``meta.lhs.scale``).
    axis_name: inside ``pmap``/``shard_map``, the axis whose replicas are
      counted together.

  Returns:
    :class:`Fp8CastFractions` of float32 scalars in ``[0, 1]``.

  Raises:
    ValueError: for a tree without floating leaves, a bad dtype or a
      non-positive concrete scale.

  Examples:
    >>> f = fp8_cast_fractions(jnp.array([1e-6, 1.0, 500.0, 2e-3]), "e4m3")
    >>> [round(float(v), 2) for v in f]
    [0.25, 0.25, 0.25]
  """
  fp8 = fp8_dtype(dtype)
  arguments.check_positive("scale", scale)
  leaves = [x for _, x in arguments.floating_leaves(tree, "fp8_cast_fractions")]
  counts = sum(_leaf_counts(jnp.asarray(x), fp8, scale) for x in leaves)
  if axis_name is not None:
    counts = _casts.psum(counts, axis_name)
  nonzero = counts[0]
  return Fp8CastFractions(*(_casts.fraction(c, nonzero) for c in counts[1:]))
