"""Pieces shared by :mod:`one_bit_adam` and :mod:`one_bit_momentum`.

Argument checks, float32 casts, the learning rate at a step, and the 1-bit
exchange with a clear error for a state made for another replica count.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from jmp_train._src.sign_compression import SignCompressionState

ScalarOrSchedule = float | Callable[[jax.Array], Any]


def check_common(axis_name, warmup_steps, minimum: int) -> None:
  if not isinstance(axis_name, str):
    raise ValueError(
        f"axis_name must be a string (the replicas' mapped axis), got {axis_name!r}."
    )
  if not isinstance(warmup_steps, (int, np.integer)) or warmup_steps < minimum:
    raise ValueError(
        f"warmup_steps must be an int >= {minimum}, got {warmup_steps!r}"
        + (": the frozen second moment comes from the warm-up." if minimum else ".")
    )


def f32(tree):
  return jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), tree)


def lr_at(learning_rate: ScalarOrSchedule, count: jax.Array) -> jax.Array:
  return jnp.asarray(learning_rate(count) if callable(learning_rate) else learning_rate, jnp.float32)


def exchange(compression, local: Any, cstate: SignCompressionState, name: str):
  """``compression.update`` with a clear error for another replica count."""
  expected = jax.eval_shape(compression.init, local)
  shapes = lambda tree: [np.shape(x) for x in jax.tree.leaves(tree)]
  for field in ("worker_residual", "server_residual"):
    want, got = shapes(getattr(expected, field)), shapes(getattr(cstate, field))
    if want != got:
      raise ValueError(
          f"{name} state's {field} has shapes {got}, but these parameters on this "
          f"replica count need {want}: the state was made (or checkpointed) for "
          "another replica count, other parameters or another bucket_bytes; init a "
          "new state (1-bit residuals cannot be moved between replica counts)."
      )
  return compression.update(local, cstate)


def cast_like(tree, like):
  return jax.tree.map(lambda x, g: x.astype(g.dtype), tree, like)
