"""Inputs and runners shared by the loss-scaling tests (test_loss_scaled.py, test_loss_scaling_*.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]
MODES = ["nojit", "jit", "pmap"]
NDEV = 8


_W = [[0.5, -1.0], [2.0, 0.25], [-0.75, 1.5]]
_B = [0.125, -0.5]
_GW = [[0.25, -0.5], [1.0, 0.125], [-2.0, 0.75]]
_GB = [0.5, -0.0625]


def _params(dtype):
  # NumPy arrays (float16/bfloat16 via ml_dtypes): building test inputs
  # costs no eager JAX dispatch or compilation.
  return {"w": np.array(_W, dtype), "b": np.array(_B, dtype)}


def _np_grads(dtype, scale=1.0, bad=None):
  """Gradients scaled by ``scale``, optionally with one non-finite entry."""
  g = {"w": (np.array(_GW, np.float32) * scale).astype(dtype), "b": (np.array(_GB, np.float32) * scale).astype(dtype)}
  if bad is not None:
    g["w"][1, 0] = bad
  return g


def _grads(dtype, scale=1.0, bad=None):
  """Like ``_np_grads`` for use inside traced code (``scale``/``bad`` traced)."""
  g = {"w": jnp.array(_GW, jnp.float32), "b": jnp.array(_GB, jnp.float32)}
  g = jax.tree.map(lambda x: (x * scale).astype(dtype), g)
  if bad is not None:
    g["w"] = g["w"].at[1, 0].set(jnp.asarray(bad, dtype))
  return g


def _bits(tree):
  """Leaves as raw bytes: equality is bit-for-bit (NaN payloads, -0.0)."""
  return [(np.asarray(x).dtype, np.asarray(x).tobytes()) for x in jax.tree.leaves(tree)]


def _assert_bitwise_equal(a, b):
  assert jax.tree.structure(a) == jax.tree.structure(b)
  assert _bits(a) == _bits(b)


def _run(mode, fn, *args, ndev=NDEV):
  """Runs ``fn(*args)`` eagerly, jitted, or pmapped over ``ndev`` replicas.

  Under pmap every argument is replicated and the first replica's output is
  returned after checking that all replicas agree bit for bit.
  """
  if mode == "nojit":
    return fn(*args)
  if mode == "jit":
    return jax.jit(fn)(*args)
  replicated = jax.tree.map(lambda x: np.stack([x] * ndev), args)
  out = jax.pmap(fn, axis_name="i", devices=jax.devices()[:ndev])(*replicated)
  first = jax.tree.map(lambda x: x[0], out)
  for r in range(1, ndev):
    _assert_bitwise_equal(jax.tree.map(lambda x: x[r], out), first)
  return first
