"""NumPy values for abstract variables: tests' parameters without compiling JAX's initializers."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def fill(shapes, seed=0):
  """Deterministic float32 values for abstract variables, made with NumPy.

  Compiling JAX's random initializers costs seconds on a loaded CPU; NumPy
  values need no compilation. Kernels are scaled by 1/sqrt(fan-in).
  """
  rng = np.random.default_rng(seed)

  def leaf(path, s):
    name = path[-1].key
    if name == "var":
      return jnp.ones(s.shape, s.dtype)
    if name == "mean":
      return jnp.asarray(0.1 * rng.standard_normal(s.shape), s.dtype)
    if name == "scale":
      return jnp.asarray(1.0 + 0.1 * rng.standard_normal(s.shape), s.dtype)
    if name == "bias":
      return jnp.asarray(0.1 * rng.standard_normal(s.shape), s.dtype)
    fan_in = int(np.prod(s.shape[:-1])) if name == "kernel" else 1
    return jnp.asarray(rng.standard_normal(s.shape) / np.sqrt(fan_in), s.dtype)

  return jax.tree_util.tree_map_with_path(leaf, shapes)
