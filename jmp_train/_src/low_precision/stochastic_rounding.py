"""Stochastic rounding of updated half-precision parameters."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jmp_train._src.low_precision.half_updates import check_params
from jmp_train._src.low_precision.half_updates import check_structure
from jmp_train._src.low_precision.half_updates import is_narrower_than_float32
from jmp_train._src.dtypes import is_floating_array
from jmp_train._src.pytrees import fresh_arrays

__all__ = ["StochasticRoundingState", "stochastic_rounding"]


class StochasticRoundingState(NamedTuple):
  """State of :func:`stochastic_rounding`.

  Attributes:
    key: the raw ``uint32`` data of the PRNG key of the next step (split
      once per step; a raw array so it checkpoints, ``pmap``s and passes
      through ``jnp.where`` like any other leaf).
  """

  key: jax.Array


def _stochastic_round(x: jax.Array, dtype: Any, key: jax.Array) -> jax.Array:
  """Rounds float32 ``x`` to ``dtype`` up or down, unbiased.

  The result is the neighbour below or above ``x`` in ``dtype``, the far one
  with probability ``distance to the near one / gap``, so its mean is ``x``.
  Values already in ``dtype`` are kept; non-finite values and values beyond
  the largest finite one round to nearest.
  """
  near = x.astype(dtype)
  near_f = near.astype(x.dtype)
  towards = jnp.where(near_f > x, -jnp.inf, jnp.inf).astype(dtype)
  far = jnp.nextafter(near, towards)
  far_f = far.astype(x.dtype)
  # Both differences are exact: x, near and far are within one ulp.
  gap = jnp.abs(far_f - near_f)
  safe_gap = jnp.where(gap > 0, gap, jnp.ones_like(gap))
  p_far = jnp.abs(x - near_f) / safe_gap
  draw = jax.random.uniform(key, x.shape, x.dtype)
  ok = jnp.isfinite(x) & jnp.isfinite(far_f) & jnp.isfinite(near_f)
  return jnp.where(ok & (draw < p_far), far, near)


def _key_data(seed: Any) -> tuple[jax.Array, Any]:
  """Raw key data and key implementation from an int seed or a key."""
  if isinstance(seed, (int, np.integer)) and not isinstance(seed, bool):
    key = jax.random.key(int(seed))
  elif isinstance(seed, jax.Array) and jnp.issubdtype(seed.dtype, jax.dtypes.prng_key):
    key = seed
  elif isinstance(seed, (jax.Array, np.ndarray)) and seed.dtype == np.uint32 and seed.ndim == 1:
    key = jax.random.wrap_key_data(seed)
  else:
    raise ValueError(
      f"seed must be a Python int, a typed key (jax.random.key) or a raw uint32 key (jax.random.PRNGKey), got {seed!r}."
    )
  if key.shape:
    raise ValueError(f"seed must be a single key, got a key array of shape {key.shape}.")
  return jax.random.key_data(key), jax.random.key_impl(key)


def _round_leaf(u: jax.Array, p: jax.Array, key: jax.Array) -> jax.Array:
  """The update landing half-precision ``p`` on ``p + u`` rounded stochastically.

  Float32 and wider parameters, and non-floating leaves, keep ``u``.
  """
  if not (is_floating_array(p) and is_floating_array(u) and is_narrower_than_float32(p.dtype)):
    return u
  p32 = p.astype(jnp.float32)
  target = _stochastic_round(p32 + u.astype(jnp.float32), p.dtype, key)
  return (target.astype(jnp.float32) - p32).astype(u.dtype)


def stochastic_rounding(seed: int | jax.Array = 0) -> optax.GradientTransformation:
  r"""Stochastic rounding of updated low-precision parameters.

  Place it last in a chain. For each parameter ``p`` narrower than float32
  (float16, bfloat16) and incoming update ``u``, computes the float32 target
  :math:`x = p + u` and rounds it to the neighbour below,
  :math:`\lfloor x \rfloor`, or above, :math:`\lceil x \rceil`, in ``p``'s
  dtype:

  .. math::

    P(\lceil x \rceil) = \frac{x - \lfloor x \rfloor}
                              {\lceil x \rceil - \lfloor x \rfloor},
    \qquad \mathbb{E}[p'] = x.

  It returns ``p' - p`` (in ``u``'s dtype) so that ``optax.apply_updates``
  produces ``p'`` exactly whenever ``p' - p`` is representable in ``u``'s
  dtype (always when ``p'/2 <= p <= 2p'``, e.g. for steps of at most half
  the weight's magnitude; larger steps land within rounding of ``p'``). An
  update too small to survive round-to-nearest now moves the weight by one
  ulp with the matching probability: unbiased, with no extra buffer (the
  state is one PRNG key). Float32 and wider parameters, and non-floating
  leaves, pass through unchanged.

  The key is split once per step. In data-parallel training every replica
  starts from the same seed and receives the same (all-reduced) updates, so
  all replicas draw the same roundings and their weights stay identical.

  Args:
    seed: a Python int, a typed key (``jax.random.key``) or a raw ``uint32``
      key (``jax.random.PRNGKey``).

  Returns:
    An ``optax.GradientTransformation`` whose ``update`` requires ``params``;
    its state is a :class:`StochasticRoundingState`, whose key ``init``
    copies (a step that donates the state leaves ``seed`` usable).

  Raises:
    ValueError: if ``seed`` is none of the above, or (at trace time) if
      ``update`` is called without ``params`` or with params whose tree
      differs from the updates'.

  Examples:
    >>> import jax.numpy as jnp, optax
    >>> params = jnp.ones(1000, jnp.bfloat16)
    >>> opt = optax.chain(optax.sgd(1e-3), stochastic_rounding(seed=0))
    >>> state = opt.init(params)
    >>> grads = jnp.ones(1000, jnp.bfloat16)  # 1e-3 < half an ulp of 1
    >>> updates, state = opt.update(grads, state, params)
    >>> new = optax.apply_updates(params, updates)
    >>> bool(abs(float(new.astype(jnp.float32).mean()) - 0.999) < 5e-4)
    True

  References:
    Gupta et al., "Deep Learning with Limited Numerical Precision", ICML
    2015. https://arxiv.org/abs/1502.02551
    Zamirai et al., "Revisiting BFloat16 Training", 2020.
    https://arxiv.org/abs/2010.06192
  """
  key_data, impl = _key_data(seed)

  def init_fn(params):
    del params
    # A copy: a step that donates the state must not delete the caller's key
    # (whose buffer ``key_data`` may be) nor this transformation's seed.
    return StochasticRoundingState(key=fresh_arrays(key_data))

  def update_fn(updates, state, params=None):
    check_params(params, "stochastic_rounding")
    check_structure(updates, params, "stochastic_rounding")
    key = jax.random.wrap_key_data(state.key, impl=impl)
    next_key, step_key = jax.random.split(key)
    keys = optax.tree.split_key_like(step_key, updates)  # one key per leaf
    new_updates = jax.tree.map(_round_leaf, updates, params, keys)
    return new_updates, StochasticRoundingState(key=jax.random.key_data(next_key))

  return optax.GradientTransformation(init_fn, update_fn)
