"""Linen and NNX twins: an NNX model holding a linen model's variables."""

from __future__ import annotations

from typing import Any, Mapping

import jax
import jax.numpy as jnp
from flax import nnx


def nnx_with_linen_variables(model: nnx.Module, variables: Mapping[str, Any]) -> nnx.Module:
  """Returns a copy of an NNX twin holding a linen model's variables.

  Args:
    model: an NNX model whose ``nnx.Param``/``nnx.BatchStat`` trees have the
      linen model's names and shapes (the twins in this module).
    variables: the linen variables, ``{"params": ..., "batch_stats": ...}``.

  Returns:
    A new NNX model (``model`` is not changed).

  Raises:
    ValueError: if a collection other than ``params``/``batch_stats`` is
      given or a name has no counterpart in ``model``.
  """
  collections = {"params": nnx.Param, "batch_stats": nnx.BatchStat}
  unknown = sorted(set(variables) - set(collections))
  if unknown:
    raise ValueError(f"Unsupported variable collections {unknown}; accepted: {sorted(collections)}.")
  model = nnx.clone(model)
  for name, var_type in collections.items():
    if name in variables:
      state = nnx.state(model, var_type)
      nnx.replace_by_pure_dict(state, jax.tree.map(jnp.asarray, dict(variables[name])))
      nnx.update(model, state)
  return model
