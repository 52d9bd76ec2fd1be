"""Shares of values a cast flushes to zero or to inf, and a loss scale that fits.

:func:`underflow_fraction` and :func:`overflow_fraction` say how many
values a cast to float16/bfloat16 loses, and :func:`suggest_loss_scale` the
largest power-of-two loss scale that keeps the gradients finite.

References:
  Micikevicius et al., "Mixed Precision Training", ICLR 2018, section 3.2.
  https://arxiv.org/abs/1710.03740
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
from jax import lax
import jax.numpy as jnp

from jmp_train._src.diagnostics import _casts
from jmp_train._src.diagnostics import arguments

__all__ = [
  "LossScaleSuggestion",
  "overflow_fraction",
  "suggest_loss_scale",
  "underflow_fraction",
]


def _cast_counts(tree: Any, dtype: Any, scale: Any, caller: str, axis_name: Any):
  """The cast counts of ``tree`` (summed over ``axis_name``), arguments checked."""
  dtype = arguments.target_dtype(dtype)
  arguments.check_positive("scale", scale)
  return _casts.sum_counts(tree, dtype, scale, caller, axis_name)


def underflow_fraction(tree: Any, dtype: Any = jnp.float16, scale: Any = 1.0, *, axis_name: Any = None) -> jax.Array:
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
  c = _cast_counts(tree, dtype, scale, "underflow_fraction", axis_name)
  return _casts.fraction(c.underflow, c.nonzero)


def overflow_fraction(tree: Any, dtype: Any = jnp.float16, scale: Any = 1.0, *, axis_name: Any = None) -> jax.Array:
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
  c = _cast_counts(tree, dtype, scale, "overflow_fraction", axis_name)
  return _casts.fraction(c.overflow, c.nonzero)


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
  in later steps; ``h = 1`` fits the given gradients exactly. Pass the
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
      :class:`~jmp_train.DynamicLossScale`'s ``max_scale``).
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
  dtype = arguments.target_dtype(dtype)
  arguments.check_positive("headroom", headroom, minimum=1.0, inclusive=True)
  arguments.check_positive("min_scale", min_scale)
  arguments.check_positive("max_scale", max_scale)
  if float(min_scale) > float(max_scale):
    raise ValueError(f"min_scale ({min_scale}) must not exceed max_scale ({max_scale}).")
  leaves = [x for _, x in arguments.floating_leaves(tree, "suggest_loss_scale")]
  f32 = functools.partial(jnp.asarray, dtype=jnp.float32)
  return _suggest(leaves, dtype, f32(headroom), f32(min_scale), f32(max_scale), axis_name)


@functools.partial(jax.jit, static_argnums=(1, 5))
def _suggest(leaves, dtype, headroom, min_scale, max_scale, axis_name) -> LossScaleSuggestion:
  flat = _casts.flatten_leaves(leaves)
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
  c = _casts.psum(_casts.cast_counts(flat, dtype, scale), axis_name)
  return LossScaleSuggestion(
    loss_scale=scale,
    underflow_fraction=_casts.fraction(c.underflow, c.nonzero),
    overflow_fraction=_casts.fraction(c.overflow, c.nonzero),
    max_abs=amax,
  )
