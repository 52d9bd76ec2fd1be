"""Shared inputs of the 1-bit optimizer tests."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jmp_train import one_bit_adam, one_bit_momentum

AXIS = "i"
# In jax.tree order (sorted keys), so that leaf order matches the flat buffer.
SHAPES = {"b": (5,), "conv": (2, 2, 3, 4), "w": (6, 3)}
B1, B2, EPS = 0.9, 0.999, 1e-8


def make_tree(k, seed, dtype=jnp.float32, scale=1.0):
  # NumPy arrays (the values jnp.asarray would give): pmap puts them on the
  # devices as they are, where a device array would first be split by a
  # program compiled for each leaf shape.
  rng = np.random.default_rng(seed)
  return {n: (rng.normal(size=(k,) + s) * scale).astype(dtype) for n, s in SHAPES.items()}


def leaves_of(tree, j=None):
  # Indexed on the host: indexing a device array compiles a program per leaf shape.
  return [np.asarray(tree[n], np.float32) if j is None else np.asarray(tree[n], np.float32)[j] for n in SHAPES]


@functools.lru_cache(maxsize=None)
def pmapped(k, factory, **kwargs):
  tx = factory(axis_name=AXIS, **kwargs)
  devices = jax.devices()[:k]
  return (
    tx,
    jax.pmap(tx.init, axis_name=AXIS, devices=devices),
    jax.pmap(tx.update, axis_name=AXIS, devices=devices),
  )


def adam(**kw):
  """1-bit Adam under the paper's rule (no step clip, ``v`` frozen as is)."""
  kw = {"axis_name": AXIS, "clip_step": False, "rescale_variance": False, **kw}
  return one_bit_adam(kw.pop("learning_rate", 1e-2), **kw)


def adam_rescaled(**kw):
  """1-bit Adam with ``rescale_variance`` and ``clip_step``."""
  return adam(**{"rescale_variance": True, "clip_step": True, **kw})


def momentum(**kw):
  kw.setdefault("axis_name", AXIS)
  return one_bit_momentum(kw.pop("learning_rate", 0.1), **kw)
