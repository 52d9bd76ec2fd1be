"""Checkpoints of a whole :class:`~jmp_train.TrainState` with orbax.

A save is all or nothing: orbax writes into a temporary directory and
renames it when every process has finished, and :func:`save_checkpoint`
checks every leaf before anything is written and removes the temporary
directory of a save that failed, so a later :func:`restore_checkpoint`
never reads half a checkpoint. :func:`restore_checkpoint` checks the folder
first (its metadata files parse, its array store lists and reads), so that a
folder that is missing, empty, truncated or not a checkpoint gives one
message naming it, not an error from deep inside orbax (and none of the
complaints orbax's abandoned reads print); it then compares the stored
shapes and dtypes with the template and names the first leaf that differs.
"""

from __future__ import annotations

import gc
import inspect
import json
import logging
import pathlib
import shutil
import sys
import time
import traceback
from typing import Any, Callable

import jax
import numpy as np

from jmp_train._src.messages import error_summary
from jmp_train._src.train.state import TrainState

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


# The files of orbax's StandardCheckpointer that hold JSON: the tree's
# metadata (required), the step's metadata and the shardings.
_TREE_METADATA = "_METADATA"
_JSON_FILES = (_TREE_METADATA, "_CHECKPOINT_METADATA", "_sharding")
# Array metadata among the keys of the OCDBT store: zarr v2 and v3.
_ARRAY_METADATA = {".zarray": "zarr", "zarr.json": "zarr3"}
# The first bytes of a zstd frame (orbax's default compression).
_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"


def _incomplete(path: pathlib.Path, reason: str) -> ValueError:
  return ValueError(
      f"{path} is not a complete jmp_train checkpoint: {reason}. Restore from a "
      "folder that save_checkpoint wrote (the path it returned), or save the "
      "state again."
  )


def _names(entries: list[pathlib.Path], limit: int = 5, slash: bool = True) -> str:
  names = [p.name + ("/" if slash and p.is_dir() else "") for p in entries[:limit]]
  return ", ".join(names) + (", ..." if len(entries) > limit else "")


def _ocdbt_store(path: pathlib.Path) -> dict[str, Any]:
  return {"driver": "ocdbt", "base": {"driver": "file", "path": f"{path}/"}}


def _array_names(keys: list[bytes]) -> list[tuple[str, str]]:
  """``(array name, tensorstore driver)`` for each array among ``keys``."""
  arrays = []
  for key in keys:
    name, _, last = key.decode().rpartition("/")
    if last in _ARRAY_METADATA:
      arrays.append((name, _ARRAY_METADATA[last]))
  return arrays


def _check_ocdbt(path: pathlib.Path) -> None:
  """Lists the OCDBT store and reads what orbax reads first, synchronously.

  Each array's zarr metadata is read whole and, of each chunk, its last
  byte and (when zstd-compressed) its first four, so that a truncated,
  missing or overwritten store file shows here (in the B-tree, the metadata
  or the data files), without orbax's asyncio reads, which leave complaints
  behind when they fail.
  """
  import tensorstore as ts  # pylint: disable=g-import-not-at-top

  def read_value(key, read):
    result = read.result()
    if result.state != "value":
      raise ValueError(f"the store lists {key.decode()!r} but holds no value for it")
    return result.value

  try:
    store = ts.KvStore.open(_ocdbt_store(path)).result()
    keys = list(store.list().result())
    arrays = dict(_array_names(keys))
    metadata = {f"{name}/{last}".encode(): name
                for name, driver in arrays.items()
                for last, d in _ARRAY_METADATA.items() if d == driver}
    # Issued together: TensorStore reads them concurrently.
    metadata_reads = {key: store.read(key) for key in metadata}
    zstd = set()
    for key, name in metadata.items():
      meta = json.loads(read_value(key, metadata_reads[key]))
      if isinstance(meta, dict) and (meta.get("compressor") or {}).get("id") == "zstd":
        zstd.add(name)
    chunks = [key for key in keys
              if key not in metadata and key.decode().rpartition("/")[0] in arrays]
    lasts = {key: store.read(key, byte_range=slice(-1, None)) for key in chunks}
    heads = {key: store.read(key, byte_range=slice(0, 4)) for key in chunks
             if key.decode().rpartition("/")[0] in zstd}
    for key, last in lasts.items():
      read_value(key, last)
    for key, head in heads.items():
      if read_value(key, head) != _ZSTD_MAGIC:
        raise ValueError(f"the chunk {key.decode()!r} is not zstd data")
  except Exception as e:  # pylint: disable=broad-exception-caught
    raise _incomplete(path, f"its array store cannot be read ({error_summary(e)})") from None
  if not metadata:
    raise _incomplete(path, "its array store holds no arrays")


def _check_folder(path: pathlib.Path) -> None:
  """Raises the error that says why ``path`` is not a checkpoint, if it is not.

  Raises:
    FileNotFoundError: if ``path`` is missing, a file or an empty folder.
    ValueError: if ``path`` is a folder of checkpoints, has no tree metadata,
      or a metadata file or its array store does not read back.
  """
  if not path.exists():
    raise FileNotFoundError(f"No checkpoint at {path}: the folder does not exist.")
  if not path.is_dir():
    raise FileNotFoundError(f"No checkpoint at {path}: it is a file, not a checkpoint folder.")
  entries = sorted(path.iterdir())
  if not entries:
    raise FileNotFoundError(f"No checkpoint at {path}: the folder is empty.")
  if not (path / _TREE_METADATA).is_file():
    inner = [p for p in entries if (p / _TREE_METADATA).is_file()]
    if inner:
      raise ValueError(
          f"{path} is not a complete jmp_train checkpoint, but it holds "
          f"checkpoints ({_names(inner, slash=False)}): pass one of them, e.g. "
          f"restore_checkpoint({str(inner[-1])!r}, like)."
      )
    raise _incomplete(path, f"it has no {_TREE_METADATA} file (it holds {_names(entries)})")
  files = [path / name for name in _JSON_FILES]
  if (path / "array_metadatas").is_dir():
    files += sorted((path / "array_metadatas").iterdir())
  tree_metadata = None
  for file in files:
    if not file.is_file():
      continue
    try:
      content = json.loads(file.read_text(encoding="utf-8"))
    except (ValueError, OSError) as e:
      raise _incomplete(
          path, f"its file {file.relative_to(path)} does not parse as JSON ({error_summary(e)})"
      ) from None
    if file.name == _TREE_METADATA:
      tree_metadata = content
  if not isinstance(tree_metadata, dict):
    raise _incomplete(path, f"its {_TREE_METADATA} file holds no tree metadata")
  if tree_metadata.get("use_ocdbt", (path / "manifest.ocdbt").exists()):
    if not (path / "manifest.ocdbt").is_file():
      raise _incomplete(path, "its array store has no manifest.ocdbt")
    _check_ocdbt(path)


def _unreadable_array(path: pathlib.Path) -> str | None:
  """Why an array of the OCDBT checkpoint at ``path`` does not read, or None.

  Reads every array whole, synchronously: run only after orbax failed, to
  tell a damaged checkpoint from another failure.
  """
  import tensorstore as ts  # pylint: disable=g-import-not-at-top

  try:
    keys = list(ts.KvStore.open(_ocdbt_store(path)).result().list().result())
  except Exception as e:  # pylint: disable=broad-exception-caught
    return f"its array store cannot be read ({error_summary(e)})"
  for name, driver in _array_names(keys):
    spec = {"driver": driver, "kvstore": {**_ocdbt_store(path), "path": f"{name}/"}}
    try:
      ts.open(spec, open=True).result().read().result()
    except Exception as e:  # pylint: disable=broad-exception-caught
      return f"its array {name} cannot be read ({error_summary(e)})"
  return None


def _is_orbax_noise(unraisable: Any) -> bool:
  """Whether an unraisable exception is a complaint of orbax's abandoned reads."""
  exc = unraisable.exc_value
  if isinstance(exc, RuntimeError) and "Event loop is closed" in str(exc):
    return True
  code = getattr(unraisable.object, "cr_code", None)
  return code is not None and "orbax" in code.co_filename


def _orbax_coroutines_alive() -> bool:
  return any(
      inspect.iscoroutine(o) and o.cr_frame is not None and "orbax" in o.cr_code.co_filename
      for o in gc.get_objects()
  )


class _QuietOrbax:
  """Holds back orbax's log records and the complaints of its abandoned reads.

  When one of orbax's concurrent TensorStore reads fails, orbax closes its
  event loop while the others still run: each of them then reports
  "Event loop is closed" through ``sys.unraisablehook``, its coroutine
  complains when collected, and asyncio and absl log the failure. These are
  dropped; after a failure, once they have settled. After a success, the
  held log records are passed on.
  """

  _LOGGERS = ("absl", "asyncio")

  def __enter__(self) -> "_QuietOrbax":
    self._records: list[logging.LogRecord] = []
    self._previous_hook = sys.unraisablehook
    self._hook: Callable[[Any], None] = self._filter_unraisable
    sys.unraisablehook = self._hook
    for name in self._LOGGERS:
      logging.getLogger(name).addFilter(self._hold)
    return self

  def _hold(self, record: logging.LogRecord) -> bool:
    self._records.append(record)
    return False

  def _filter_unraisable(self, unraisable: Any) -> None:
    if not _is_orbax_noise(unraisable):
      self._previous_hook(unraisable)

  def _settle(self, exc: BaseException | None) -> None:
    # The failure's traceback keeps orbax's frames, and through them its
    # abandoned coroutines, alive: free them, so that they are collected
    # (and complain) now. The others wait for their TensorStore reads, which
    # finish within milliseconds: wait for them too (at most two seconds).
    seen_errors = set()
    while exc is not None and id(exc) not in seen_errors:
      seen_errors.add(id(exc))
      traceback.clear_frames(exc.__traceback__)
      exc = exc.__cause__ or exc.__context__
    deadline = time.monotonic() + 2.0
    while True:
      gc.collect()
      if not _orbax_coroutines_alive() or time.monotonic() > deadline:
        break
      time.sleep(0.01)
    time.sleep(0.02)  # The last reads' callbacks.
    gc.collect()

  def __exit__(self, exc_type, exc, tb) -> bool:
    if isinstance(exc, Exception):
      self._settle(exc)
    for name in self._LOGGERS:
      logging.getLogger(name).removeFilter(self._hold)
    if sys.unraisablehook == self._hook:
      sys.unraisablehook = self._previous_hook
    if exc_type is None:
      for record in self._records:
        logging.getLogger(record.name).handle(record)
    return False


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
    FileExistsError: if ``directory`` exists and ``force`` is false, naming
      it and ``force=True``.

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
  if path.exists() and not force:
    raise FileExistsError(
        f"{path} already exists: pass save_checkpoint(..., force=True) to "
        "overwrite it, or save to a new folder."
    )
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
    FileNotFoundError: if ``directory`` does not exist, is a file or is an
      empty folder, naming it.
    ValueError: if ``directory`` is not a complete checkpoint (a folder of
      checkpoints, a folder without orbax's metadata, or one whose files are
      truncated or overwritten), naming it and what is wrong; or if a leaf's
      stored shape or dtype differs from ``like``'s, naming the leaf and both
      shapes.
  """
  ocp = _orbax()
  path = pathlib.Path(directory).absolute()
  _check_folder(path)
  abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, like)
  with ocp.StandardCheckpointer() as checkpointer:
    try:
      with _QuietOrbax():
        stored = checkpointer.metadata(path).item_metadata
        if stored is None:  # Orbax logged the reason and went on.
          raise ValueError("no item metadata")
    except Exception as e:  # pylint: disable=broad-exception-caught
      raise _incomplete(path, f"orbax cannot read its metadata ({error_summary(e)})") from None
    problem = _shape_mismatch(stored.tree, abstract)
    if problem is not None:
      raise ValueError(f"Cannot restore {path} into this template: {problem}.")
    try:
      with _QuietOrbax():
        return checkpointer.restore(path, abstract)
    except Exception:  # pylint: disable=broad-exception-caught
      # A damaged array, or a failure that is not the checkpoint's.
      reason = _unreadable_array(path)
      if reason is None:
        raise
    raise _incomplete(path, reason) from None
