"""Dtypes and a scan runner shared by the half-precision weight-update tests (test_low_precision*.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax


F32, BF16, F16 = jnp.float32, jnp.bfloat16, jnp.float16
ALL_DTYPES = [F32, BF16, F16]
HALF_DTYPES = [BF16, F16]


def _eps(dtype) -> float:
  """Spacing of ``dtype`` just above 1 (so the ulp on [0.5, 1) is eps/2)."""
  return float(jnp.finfo(dtype).eps)


def _run(opt, params, grads_seq):
  """Applies ``opt`` over a sequence of gradients; returns params, state."""
  state = opt.init(params)

  @jax.jit
  def run(params, state, grads_seq):
    def step(carry, g):
      p, s = carry
      u, s = opt.update(g, s, p)
      return (optax.apply_updates(p, u), s), None

    (params, state), _ = jax.lax.scan(step, (params, state), grads_seq)
    return params, state

  return run(params, state, grads_seq)
