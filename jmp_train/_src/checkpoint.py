"""Checkpoints of a whole :class:`~jmp_train.TrainState` with orbax.

A save is all or nothing: orbax writes into a temporary directory and
renames it when every process has finished, and :func:`save_checkpoint`
checks every leaf before anything is written and removes the temporary
directory of a save that failed, so a later :func:`restore_checkpoint`
never reads half a checkpoint. :func:`restore_checkpoint` compares the
stored shapes and dtypes with the template first and names the first leaf
that differs.
"""

from __future__ import annotations

import pathlib
import shutil
from typing import Any

import jax
import numpy as np

from jmp_train._src.train_state import TrainState

__all__ = ["save_checkpoint", "restore_checkpoint"]


def _orbax():
  try:
    import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    raise ImportError(
        "Checkpoints need orbax-checkpoint: pip install 'jmp_train[checkpoint]'"
    ) from e
  return ocp


def _check_leaves(state: Any) -> None:
  for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
    if not isinstance(leaf, (jax.Array, np.ndarray, np.generic)):
      raise TypeError(
          f"Cannot checkpoint the leaf {jax.tree_util.keystr(path)} of type "
          f"{type(leaf).__name__}: every leaf must be an array (or None)."
      )


def _remove_partial(path: pathlib.Path) -> None:
  if jax.process_index() != 0:
    return
  for partial in path.parent.glob(f"{path.name}.orbax-checkpoint-tmp*"):
    shutil.rmtree(partial, ignore_errors=True)


def save_checkpoint(directory: str | pathlib.Path, state: TrainState, *, force: bool = False) -> pathlib.Path:
  """Saves a :class:`TrainState` (every leaf, every device's copy) with orbax.

  Every process must call it (orbax writes each process's shards). The save
  is atomic: a save that fails leaves no directory at ``directory`` (with
  ``force``, orbax removes the old checkpoint before writing the new one).

  Args:
    directory: where to write; must not exist unless ``force``.
    state: the state to save.
    force: overwrite an existing checkpoint.

  Returns:
    The absolute checkpoint path.

  Raises:
    ImportError: with an install hint, if orbax-checkpoint is missing.
    TypeError: if a leaf of ``state`` is not an array, naming its path.

  Examples:
    Resuming: the step counter, parameters, optimizer state (with the loss
    scale and any error-feedback residuals), model state and PRNG key all
    come back, so the run continues bit-for-bit::

      save_checkpoint("/tmp/run/step_1000", state)
      state = restore_checkpoint("/tmp/run/step_1000", step.init(params))
  """
  ocp = _orbax()
  _check_leaves(state)
  path = pathlib.Path(directory).absolute()
  checkpointer = ocp.StandardCheckpointer()
  try:
    checkpointer.save(path, state, force=force)
    checkpointer.wait_until_finished()
  except BaseException:
    _remove_partial(path)
    raise
  finally:
    # Joins orbax's background threads now, not at interpreter exit.
    checkpointer.close()
  return path


def _key_name(key: Any) -> str:
  return str(getattr(key, "key", getattr(key, "name", getattr(key, "idx", key))))


def _named_leaves(tree: Any) -> list[tuple[tuple[str, ...], str, Any]]:
  # Orbax stores a dataclass or NamedTuple as a dict or list of its fields:
  # compare leaves by the names along their paths.
  return [(tuple(_key_name(k) for k in path), jax.tree_util.keystr(path), leaf)
          for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]]


def _shape_mismatch(stored: Any, like: Any) -> str | None:
  """The first leaf whose stored shape or dtype differs from ``like``'s."""
  stored_leaves = {names: leaf for names, _, leaf in _named_leaves(stored)}
  like_leaves = _named_leaves(like)
  for names, name, leaf in like_leaves:
    meta = stored_leaves.get(names)
    if meta is None:
      return f"the leaf {name} is missing from the checkpoint"
    if tuple(meta.shape) != tuple(np.shape(leaf)):
      return (f"the leaf {name} has shape {tuple(meta.shape)} in the checkpoint "
              f"but {tuple(np.shape(leaf))} in the template")
    if getattr(meta, "dtype", None) is not None and np.dtype(meta.dtype) != np.dtype(leaf.dtype):
      return (f"the leaf {name} has dtype {np.dtype(meta.dtype)} in the checkpoint "
              f"but {np.dtype(leaf.dtype)} in the template")
  if len(stored_leaves) != len(like_leaves):
    return (f"the checkpoint has {len(stored_leaves)} array leaves, the template "
            f"{len(like_leaves)}")
  return None


def restore_checkpoint(directory: str | pathlib.Path, like: TrainState) -> TrainState:
  """Restores a :class:`TrainState` saved by :func:`save_checkpoint`.

  Args:
    directory: the checkpoint path.
    like: a state with the same structure, shapes, dtypes and shardings
      (for example ``step.init(params)``); its values are not used.

  Returns:
    The restored state, laid out like ``like``.

  Raises:
    ImportError: with an install hint, if orbax-checkpoint is missing.
    FileNotFoundError: if there is no checkpoint at ``directory``.
    ValueError: if a leaf's stored shape or dtype differs from ``like``'s,
      naming the leaf and both shapes.
  """
  ocp = _orbax()
  path = pathlib.Path(directory).absolute()
  if not path.is_dir():
    raise FileNotFoundError(f"No checkpoint at {path}.")
  abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, like)
  with ocp.StandardCheckpointer() as checkpointer:
    stored = checkpointer.metadata(path).item_metadata.tree
    problem = _shape_mismatch(stored, abstract)
    if problem is not None:
      raise ValueError(f"Cannot restore {path} into this template: {problem}.")
    return checkpointer.restore(path, abstract)

