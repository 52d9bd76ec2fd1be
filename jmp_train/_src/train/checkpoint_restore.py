"""Restoring a checkpoint: its folder checked, orbax's restore, the checksums verified.

:func:`restore_checkpoint` checks the folder (orbax's JSON files parse, a
manager step's JSON items match their checksums), compares orbax's metadata
of the saved tree with the checksums' record of it and with the template,
restores through orbax, and recomputes the checksums of the restored
arrays. A damaged or incomplete checkpoint is recognised by what orbax
reports (its metadata does not read, its restore raises) and by a checksum
that differs; :mod:`checkpoint_store` then names the file or leaf.
:func:`restore_latest_checkpoint` restores the newest intact step of a
folder of steps, passing over damaged ones with a warning.
"""

from __future__ import annotations

import pathlib
import warnings
from typing import Any

import jax
import numpy as np

from jmp_train._src.messages import error_summary
from jmp_train._src.train import checkpoint_store
from jmp_train._src.train.checkpoint_checksums import mismatched_leaf, named_leaves, saved_checksums
from jmp_train._src.train.checkpoint_folders import (
  STEP_METADATA,
  TREE_METADATA,
  DamagedCheckpoint,
  check_folder,
  check_json_items,
  damaged,
  incomplete,
  manager_item,
  steps as step_folders,
)
from jmp_train._src.train.checkpoint_orbax import QuietOrbax, orbax
from jmp_train._src.train.state import TrainState

__all__ = ["restore_checkpoint", "restore_latest_checkpoint"]


def _describe_leaf(leaf: Any) -> str:
  dtype = getattr(leaf, "dtype", None)
  return f"shape {tuple(leaf.shape)}" + ("" if dtype is None else f", {np.dtype(dtype)}")


def _shape_mismatch(stored: Any, like: Any) -> str | None:
  """The first leaf whose stored shape or dtype differs from ``like``'s."""
  stored_named = named_leaves(stored)
  stored_leaves = {names: leaf for names, _, leaf in stored_named}
  like_leaves = named_leaves(like)
  for names, name, leaf in like_leaves:
    meta = stored_leaves.get(names)
    if meta is None:
      return f"the leaf {name} is missing from the checkpoint"
    if tuple(meta.shape) != tuple(np.shape(leaf)):
      return (
        f"the leaf {name} has shape {tuple(meta.shape)} in the checkpoint but {tuple(np.shape(leaf))} in the template"
      )
    if getattr(meta, "dtype", None) is not None and np.dtype(meta.dtype) != np.dtype(leaf.dtype):
      return (
        f"the leaf {name} has dtype {np.dtype(meta.dtype)} in the checkpoint but {np.dtype(leaf.dtype)} in the template"
      )
  like_names = {names for names, _, _ in like_leaves}
  for names, name, leaf in stored_named:
    if names not in like_names:
      return f"the checkpoint's leaf {name} ({_describe_leaf(leaf)}) is not in the template"
  if len(stored_leaves) != len(like_leaves):
    return f"the checkpoint has {len(stored_leaves)} array leaves, the template {len(like_leaves)}"
  return None


def _metadata_disagrees(stored_tree: Any, checksums: dict[str, Any]) -> str | None:
  """Where orbax's tree metadata and the checksums' record of the leaves differ."""
  leaves = checksums["leaves"]
  stored = named_leaves(stored_tree)
  for names, keystr, meta in stored:
    entry = leaves.get("/".join(names))
    if entry is None:
      return f"its {TREE_METADATA} lists the leaf {keystr}, which its checksums do not"
    dtype = getattr(meta, "dtype", None)
    try:
      dtype = None if dtype is None else str(np.dtype(dtype))
    except TypeError:
      dtype = str(dtype)
    if list(meta.shape) != entry["shape"] or dtype not in (None, entry["dtype"]):
      return (
        f"its {TREE_METADATA} gives the leaf {keystr} {_describe_leaf(meta)}, its "
        f"checksums shape {tuple(entry['shape'])}, {entry['dtype']}"
      )
  if len(stored) != len(leaves):
    return f"its {TREE_METADATA} lists {len(stored)} leaves, its checksums {len(leaves)}"
  return None


def _verify_arrays(path: pathlib.Path, ocdbt: bool, stored: Any, restored: Any, checksums: dict[str, Any]) -> None:
  mismatch = mismatched_leaf(restored, checksums)
  if mismatch is None:
    return
  name, keystr, saved, read = mismatch
  # Orbax's name of the leaf's array in the store (the keys joined with dots).
  arrays = {"/".join(names): getattr(meta, "name", None) for names, _, meta in named_leaves(stored)}
  files = checkpoint_store.leaf_files(path, ocdbt, arrays.get(name) or name.replace("/", "."))
  raise damaged(
    path,
    f"the data of the leaf {keystr}{files} does not match the checksum saved with it in "
    f"{TREE_METADATA} (saved {saved}, read {read}): it changed after the save",
  )


def _restore(directory: str | pathlib.Path, like: TrainState, step: bool = False) -> TrainState:
  """:func:`restore_checkpoint`; with ``step``, ``directory`` is a manager step."""
  ocp = orbax()
  given = pathlib.Path(directory).absolute()
  path = manager_item(given, step=step)
  tree_metadata = check_folder(path)
  ocdbt = bool(tree_metadata.get("use_ocdbt", (path / "manifest.ocdbt").exists()))
  abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, like)
  # A manager's item folder has no step metadata of its own (it is in the
  # step folder above): orbax says so in a warning.
  no_step_metadata = lambda record: STEP_METADATA in record.getMessage()
  with ocp.StandardCheckpointer() as checkpointer:
    try:
      with QuietOrbax(drop=no_step_metadata):
        stored = checkpointer.metadata(path).item_metadata
        if stored is None:  # Orbax logged the reason and went on.
          raise ValueError("no item metadata")
    except Exception as e:
      # Orbax reads the tree's metadata from the array store too: say what is wrong with it.
      reason = checkpoint_store.unreadable(path, ocdbt) or f"orbax cannot read its metadata ({error_summary(e)})"
      raise incomplete(path, reason) from None
    try:
      checksums = saved_checksums(stored.custom_metadata)
    except ValueError as e:
      raise damaged(path, f"the checksums in its {TREE_METADATA} file are {e}") from None
    if path != given:
      check_json_items(given, path, checksums)
    if checksums is not None:
      disagreement = _metadata_disagrees(stored.tree, checksums)
      if disagreement is not None:
        raise damaged(path, disagreement)
    problem = _shape_mismatch(stored.tree, abstract)
    if problem is not None:
      raise ValueError(
        f"Cannot restore {path} into this template: {problem}. Build the template as "
        "the saved run built its state (the same model, optimizer, policy, mode and "
        "replica count: that run's step.init(params)), or restore another checkpoint."
      )
    try:
      with QuietOrbax():
        restored = checkpointer.restore(path, abstract)
    except Exception:
      # A damaged array, or a failure that is not the checkpoint's.
      reason = checkpoint_store.unreadable(path, ocdbt)
      if reason is None:
        raise
      restored = None
    if restored is None:
      raise incomplete(path, reason)
  if checksums is not None:
    _verify_arrays(path, ocdbt, stored.tree, restored, checksums)
  return restored


def restore_checkpoint(directory: str | pathlib.Path, like: TrainState) -> TrainState:
  """Restores a :class:`TrainState` saved by :func:`save_checkpoint`.

  With an ``orbax.checkpoint.CheckpointManager``, restore a step through
  this function rather than ``manager.restore``: pass the step's folder,
  ``manager.directory / str(step)`` (the folder of its one array item, such
  as ``default``, is read), or use :func:`restore_latest_checkpoint`. Given
  a template that does not match the saved state (another model width,
  optimizer or policy), ``manager.restore`` fails deep inside orbax and
  leaves a dozen "Event loop is closed" tracebacks behind; this function
  names the first leaf that differs, before orbax reads anything.

  The restored arrays are compared with the checksums saved with them
  (by :func:`save_checkpoint`, or :func:`checkpoint_save_args` through a
  manager), and a manager step's JSON items beside the state must parse and
  match theirs. A checkpoint saved without checksums (before jmp_train wrote
  them, or with ``ocp.args.StandardSave``) restores without this
  verification: only its files' structure is checked.

  Args:
    directory: the checkpoint path (from :func:`save_checkpoint`), or a step
      folder of a ``CheckpointManager``.
    like: a state with the same structure, shapes, dtypes and shardings
      (for example ``step.init(params)``); its values are not used.

  Returns:
    The restored state, laid out like ``like``.

  Raises:
    ImportError: with an install hint, if orbax-checkpoint is missing.
    FileNotFoundError: if ``directory`` does not exist, is a file or is an
      empty folder, naming it.
    ValueError: if ``directory`` is not a complete checkpoint (a folder of
      checkpoints, a folder without orbax's metadata, or one whose files are
      truncated or overwritten), or is damaged (an array, or a JSON item,
      differs from its checksum), in one line naming it and the file or
      leaf (for the folder of a ``CheckpointManager``, naming its step
      folders); or if the saved tree differs from ``like``'s (a leaf's shape
      or dtype, a leaf only one of them has), naming the folder and the
      first such leaf, with both shapes (or dtypes).

  Examples:
    Resuming from a given step of a ``CheckpointManager``::

      state = restore_checkpoint(manager.directory / str(step), state)
  """
  try:
    return _restore(directory, like)
  except DamagedCheckpoint as e:
    raise ValueError(str(e)) from None


def restore_latest_checkpoint(directory: str | pathlib.Path, like: TrainState) -> tuple[int, TrainState]:
  """Restores the newest intact step of a folder of checkpoints.

  ``directory`` holds one folder per step: a ``CheckpointManager``'s
  ``<step>`` folders, or :func:`save_checkpoint` folders named ``<step>``
  or ``<name>_<step>`` (``step_1000``). The newest step is restored as
  :func:`restore_checkpoint` does; one that is damaged or incomplete (a
  file missing, truncated or changed since the save, a JSON item beside the
  state that does not parse or match its checksum) is passed over with a
  one-line ``UserWarning`` naming it and why, and the next older one is
  tried. A template that does not match a step (another model) is the
  caller's mistake, not damage: it raises at once. Steps saved without
  checksums are only checked for their files' structure (see
  :func:`restore_checkpoint`).

  Args:
    directory: the folder of steps (``manager.directory``).
    like: the template, as for :func:`restore_checkpoint`.

  Returns:
    ``(step, state)``: the step number of the folder restored, and the state.

  Raises:
    ImportError: with an install hint, if orbax-checkpoint is missing.
    FileNotFoundError: if ``directory`` does not exist or holds no step
      folders, naming it.
    ValueError: if no step is intact, naming the folder and the newest
      step's problem; or as :func:`restore_checkpoint` for a template that
      does not match.

  Examples:
    Resuming a run of periodic saves with a ``CheckpointManager`` (which
    refuses to save over a step that is still there: the steps passed over
    are deleted)::

      state = step.init(params)
      if manager.latest_step() is not None:
        n, state = jmp_train.restore_latest_checkpoint(manager.directory, state)
        for damaged in [s for s in manager.all_steps() if s > n]:
          manager.delete(damaged)
  """
  orbax()
  root = pathlib.Path(directory).absolute()
  if not root.is_dir():
    raise FileNotFoundError(
      f"No checkpoints in {root}: "
      + ("it is a file, not a folder of steps." if root.exists() else "the folder does not exist.")
    )
  steps = step_folders(root)
  if not steps:
    raise FileNotFoundError(
      f"No checkpoints in {root}: it holds no step folders (named <step>, as a "
      "CheckpointManager writes them, or <name>_<step>)."
    )
  first = None
  for n, folder in steps:
    try:
      return n, _restore(folder, like, step=True)
    except (DamagedCheckpoint, FileNotFoundError) as e:
      reason = getattr(e, "reason", None) or str(e)
      where = pathlib.Path(getattr(e, "path", folder))
      where = where.relative_to(root) if where.is_relative_to(root) else where
      first = first or f"step {n}: {reason}"
      warnings.warn(
        f"Passing over step {n} of {root}, damaged or incomplete: {where}: {reason}; trying the next older step.",
        UserWarning,
        stacklevel=2,
      )
  raise ValueError(
    f"No intact checkpoint in {root}: all {len(steps)} step(s) are damaged or incomplete "
    f"(the newest, {first}). Start from a fresh state or another folder of checkpoints."
  )
