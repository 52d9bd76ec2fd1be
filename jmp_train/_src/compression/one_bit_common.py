"""Pieces shared by ``one_bit_adam`` and ``one_bit_momentum``.

Argument checks, float32 casts and the learning rate at a step.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jmp_train._src.hyperparams import static_hint


def check_common(axis_name, warmup_steps, minimum: int) -> None:
  if not isinstance(axis_name, str):
    raise ValueError(f"axis_name must be a string (the replicas' mapped axis), got {axis_name!r}.")
  if not isinstance(warmup_steps, (int, np.integer)) or warmup_steps < minimum:
    raise ValueError(
      f"warmup_steps must be an int >= {minimum}, got {warmup_steps!r}"
      + static_hint(warmup_steps)
      + (": the frozen second moment comes from the warm-up." if minimum else ".")
    )


def f32(tree):
  return jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), tree)


def lr_at(learning_rate: optax.ScalarOrSchedule, count: jax.Array) -> jax.Array:
  return jnp.asarray(learning_rate(count) if callable(learning_rate) else learning_rate, jnp.float32)
