"""Saving a :class:`~jmp_train.TrainState` with orbax, with the checksums of its arrays.

A save is all or nothing: orbax writes into a temporary directory and
renames it when every process has finished, and :func:`save_checkpoint`
checks every leaf and the target folder before anything is written and
removes the temporary directory of a save that failed, so a later
:func:`~jmp_train.restore_checkpoint` never reads half a checkpoint. The
save carries a 64-bit checksum of every array (``checkpoint_checksums``) as
the item's custom metadata, in orbax's ``_METADATA`` file;
:func:`checkpoint_save_args` gives an ``orbax.checkpoint.CheckpointManager``
the same checksums. Restoring is in ``checkpoint_restore``.
"""

from __future__ import annotations

import json
import pathlib
import shutil
import tempfile
import threading
from typing import Any

import jax
import numpy as np

from jmp_train._src.messages import error_summary
from jmp_train._src.train.checkpoint_checksums import checksum_metadata
from jmp_train._src.train.checkpoint_folders import STEP_METADATA, TREE_METADATA, names
from jmp_train._src.train.checkpoint_orbax import orbax, release_threads
from jmp_train._src.train.state import TrainState

__all__ = ["checkpoint_save_args", "save_checkpoint"]


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


# What marks a folder as a checkpoint that ``force=True`` may replace: a
# save_checkpoint folder, a CheckpointManager step or item (even one that
# lost a file).
_CHECKPOINT_MARKERS = (TREE_METADATA, STEP_METADATA, "manifest.ocdbt", "commit_success.txt")


def _check_target(path: pathlib.Path, force: bool) -> None:
  """Raises unless ``path`` is free, or ``force`` and a checkpoint folder."""
  if not (path.exists() or path.is_symlink()):
    return
  if path.is_dir():
    entries = sorted(path.iterdir())
    if not entries or any((path / name).exists() for name in _CHECKPOINT_MARKERS):
      if not force:
        raise FileExistsError(
          f"{path} already exists: pass save_checkpoint(..., force=True) to overwrite it, or save to a new folder."
        )
      return
    what = f"a folder that is not a checkpoint (it holds {names(entries)})"
  else:
    what = "a file, not a folder"
  raise (ValueError if force else FileExistsError)(
    f"{path} exists and is {what}: save_checkpoint(..., force=True) only replaces "
    "a checkpoint folder, so it is left as it is. Save to another path."
  )


def _check_writable(path: pathlib.Path) -> None:
  """Raises ``OSError`` at once if no folder can be made beside ``path``.

  Before orbax starts: a save that orbax begins where it cannot create its
  temporary folder leaves its threads waiting for minutes for a signal that
  never comes, and the interpreter waits for them at exit.
  """
  ancestor = path.parent
  while not (ancestor.exists() or ancestor.is_symlink()) and ancestor != ancestor.parent:
    ancestor = ancestor.parent
  if not ancestor.is_dir():
    raise NotADirectoryError(f"Cannot write a checkpoint at {path}: {ancestor} is a file, not a folder.")
  try:
    path.parent.mkdir(parents=True, exist_ok=True)
    pathlib.Path(tempfile.mkdtemp(prefix=f".{path.name}.probe-", dir=path.parent)).rmdir()
  except OSError as e:
    raise type(e)(f"Cannot write a checkpoint at {path}: its folder cannot be written ({error_summary(e)}).") from None


def save_checkpoint(directory: str | pathlib.Path, state: TrainState, *, force: bool = False) -> pathlib.Path:
  """Saves a :class:`TrainState` (every leaf, every device's copy) with orbax.

  Every process must call it (orbax writes each process's shards). The save
  is atomic: a save that fails leaves no directory at ``directory`` (with
  ``force``, orbax removes the old checkpoint before writing the new one).
  A 64-bit checksum of every array (over the whole global array, computed
  on its devices) is written with it, into orbax's ``_METADATA`` file, for
  :func:`restore_checkpoint` to verify.

  Args:
    directory: where to write; must not exist unless ``force``.
    state: the state to save.
    force: overwrite an existing checkpoint folder (one written by
      :func:`save_checkpoint` or a ``CheckpointManager`` step), or an empty
      folder; never a file or a folder of other files.

  Returns:
    The absolute checkpoint path.

  Raises:
    ImportError: with an install hint, if orbax-checkpoint is missing.
    TypeError: if a leaf of ``state`` is not an array, naming its path.
    FileExistsError: if ``directory`` exists and ``force`` is false, naming
      it (and ``force=True`` if it is a checkpoint folder).
    ValueError: with ``force``, if ``directory`` is a file or a folder that
      is not a checkpoint, naming it; it is left as it is.
    OSError: at once, before orbax starts, if the folder cannot be written
      (under a file, read-only, ``/proc``), naming ``directory``.

  Examples:
    Resuming: the step counter, parameters, optimizer state (with the loss
    scale and any error-feedback residuals), model state and PRNG key all
    come back, so the run continues bit-for-bit::

      save_checkpoint("/tmp/run/step_1000", state)
      state = restore_checkpoint("/tmp/run/step_1000", step.init(params))
  """
  ocp = orbax()
  _check_leaves(state)
  path = pathlib.Path(directory).absolute()
  _check_target(path, force)
  _check_writable(path)
  custom_metadata = checksum_metadata(state)
  before = set(threading.enumerate())
  checkpointer = ocp.StandardCheckpointer()
  try:
    # StandardCheckpointer.save has no argument for the item's metadata:
    # its base class's save, with the same handler, takes StandardSave's.
    super(ocp.StandardCheckpointer, checkpointer).save(
      path, args=ocp.args.StandardSave(state, custom_metadata=custom_metadata), force=force
    )
    checkpointer.wait_until_finished()
  except BaseException:
    release_threads(before)
    try:
      checkpointer.close()
    except Exception:
      pass  # the cancelled threads' errors: the save's own error is raised
    _remove_partial(path)
    raise
  # Joins orbax's background threads now, not at interpreter exit.
  checkpointer.close()
  return path


def checkpoint_save_args(state: TrainState, **json_items: Any) -> Any:
  """``args`` for ``CheckpointManager.save`` that carry the state's checksums.

  The arrays' checksums (as :func:`save_checkpoint` writes them) go into
  the state item's ``_METADATA``, in the same atomic save;
  :func:`restore_checkpoint` and :func:`restore_latest_checkpoint` verify
  them. Each JSON item (any JSON-serializable value, such as a record of the
  run) is saved beside the state as ``ocp.args.JsonSave`` does, and its
  checksum with the state's. Every process must call it (the checksums are
  computed over the global arrays); it waits for ``state``'s values, not for
  the save: call it only for the steps the manager saves
  (``manager.should_save(n)``).

  Args:
    state: the state to save.
    **json_items: JSON items to save beside it, by item name.

  Returns:
    ``ocp.args.StandardSave(state, custom_metadata=...)`` (the manager's
    ``default`` item), or, with JSON items,
    ``ocp.args.Composite(state=..., **{name: ocp.args.JsonSave(value)})``.

  Raises:
    ImportError: with an install hint, if orbax-checkpoint is missing.
    TypeError: if a leaf of ``state`` is not an array, or a JSON item is not
      JSON-serializable.

  Examples:
    Periodic saves that :func:`restore_latest_checkpoint` can verify::

      if manager.should_save(n):
        manager.save(n, args=jmp_train.checkpoint_save_args(state))
      # with a JSON record beside the state (item "state", item "record"):
      manager.save(n, args=jmp_train.checkpoint_save_args(state, record={"loss": 0.25}))
  """
  ocp = orbax()
  _check_leaves(state)
  for name, value in json_items.items():
    try:
      json.dumps(value)
    except (TypeError, ValueError) as e:
      raise TypeError(f"The JSON item {name!r} is not JSON-serializable ({error_summary(e)}).") from None
  save = ocp.args.StandardSave(state, custom_metadata=checksum_metadata(state, json_items))
  if not json_items:
    return save
  return ocp.args.Composite(state=save, **{name: ocp.args.JsonSave(value) for name, value in json_items.items()})
