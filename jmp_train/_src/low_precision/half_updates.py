"""Shared pieces of the half-precision weight updates.

:func:`jmp_train.modified_momentum_sgd`, :func:`jmp_train.kahan_compensation`
and :func:`jmp_train.stochastic_rounding` rewrite the updates so that
``optax.apply_updates`` (which computes ``(p + u).astype(p.dtype)``) lands
exactly on a chosen half-precision value; the helpers here compute in
float32 for half types, check the ``params`` argument and compute that
landing update.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def accumulation_dtype(dtype: Any) -> np.dtype:
  """float32 for half types, the dtype itself for float32 and wider."""
  dtype = np.dtype(dtype)
  return np.dtype(jnp.float32) if dtype.itemsize < 4 else dtype


def is_narrower_than_float32(dtype: Any) -> bool:
  return np.dtype(dtype).itemsize < 4


def check_params(params: Any, name: str) -> None:
  if params is None:
    raise ValueError(
      f"{name} needs the current parameters: call "
      "`update(updates, state, params)` with params (and place it last in "
      "an optax.chain, so the updates it receives are the final ones)."
    )


def check_structure(updates: Any, params: Any, name: str) -> None:
  updates_def = jax.tree.structure(updates)
  params_def = jax.tree.structure(params)
  if updates_def != params_def:
    raise ValueError(
      f"{name}: updates and params must have the same tree structure; got "
      f"updates {updates_def} and params {params_def}."
    )


def land(p: jax.Array, step: jax.Array, update_dtype: Any) -> tuple[jax.Array, jax.Array]:
  """The update landing ``p`` on ``round(p + step)``, and the step it applies.

  Args:
    p: the parameter.
    step: the wanted step, in ``p``'s accumulation dtype.
    update_dtype: dtype of the returned update.

  Returns:
    ``(update, applied)``: ``update`` in ``update_dtype``, and ``applied``,
    the accumulation-dtype difference between what ``optax.apply_updates``
    (``(p + update).astype(p.dtype)``) will produce and ``p``.
  """
  acc = step.dtype
  p_acc = p.astype(acc)
  target = (p_acc + step).astype(p.dtype)
  update = (target.astype(acc) - p_acc).astype(update_dtype)
  # Exactly what optax.apply_updates will compute.
  landed = jnp.asarray(p + update).astype(p.dtype)
  return update, landed.astype(acc) - p_acc


def unzip_pairs(like: Any, pairs: Any) -> tuple[Any, Any]:
  """A tree of ``(a, b)`` pairs as a tree of ``a`` and a tree of ``b``.

  ``pairs`` has ``like``'s structure with a pair at each leaf; the outer
  structure comes from ``like``, so trees made of tuples (``(w, b)``
  parameters) are split at the leaves, not at their own tuples.
  """
  outer = jax.tree.structure(like)
  return jax.tree.transpose(outer, jax.tree.structure((0, 0)), pairs)
