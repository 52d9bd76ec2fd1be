"""Checkpoints of a whole :class:`~jmp_train.TrainState` with orbax.

A save is all or nothing: orbax writes into a temporary directory and
renames it when every process has finished, and :func:`save_checkpoint`
checks every leaf before anything is written and removes the temporary
directory of a save that failed, so a later :func:`restore_checkpoint`
never reads half a checkpoint. A save also writes a 64-bit checksum of
every array into orbax's ``_METADATA`` file (computed on the devices, over
each whole global array), and :func:`restore_checkpoint` compares the
restored arrays with it: a flipped bit in the array store is an error, not a
silently different state. :func:`restore_checkpoint` checks the folder
first (its metadata files parse, its array store lists and reads), so that a
folder that is missing, empty, truncated or not a checkpoint gives one
message naming it, not an error from deep inside orbax (and none of the
complaints orbax's abandoned reads print); it then compares the stored
shapes and dtypes with the template and names the first leaf that differs.
:func:`restore_latest_checkpoint` restores the newest intact step of a
folder of steps, passing over damaged ones with a warning, and
:func:`checkpoint_save_args` gives an ``orbax.checkpoint.CheckpointManager``
the same checksums.
"""

from __future__ import annotations

import gc
import hashlib
import inspect
import json
import logging
import pathlib
import re
import shutil
import sys
import tempfile
import threading
import time
import traceback
import urllib.parse
import warnings
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from jmp_train._src.messages import error_summary
from jmp_train._src.train.state import TrainState

__all__ = [
  "checkpoint_save_args",
  "restore_checkpoint",
  "restore_latest_checkpoint",
  "save_checkpoint",
]


def _orbax():
  try:
    import orbax.checkpoint as ocp
  except ImportError as e:
    raise ImportError("Checkpoints need orbax-checkpoint: pip install 'jmp_train[checkpoint]'") from e
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


# Checksums. Each array leaf gets two independent 32-bit sums, over its
# elements, of a mix of the element's bits with its flat index: a bijective
# mix in the bits, so that any change of one element changes both sums, and
# one that depends on the index, so that moved elements change them too.
# Integer sums do not depend on the order of the additions: the value is
# the same for any sharding, on every process, on every backend.
_CHECKSUMS = "jmp_train_checksums"
_CHECKSUM_FORMAT = "mix32x2-v1"


def _fmix(h: jax.Array, m1: int, s2: int, m2: int) -> jax.Array:
  """A 32-bit finalizer (xorshift-multiply, bijective)."""
  h = h ^ (h >> jnp.uint32(16))
  h = h * jnp.uint32(m1)
  h = h ^ (h >> jnp.uint32(s2))
  h = h * jnp.uint32(m2)
  return h ^ (h >> jnp.uint32(16))


def _words(x: jax.Array) -> jax.Array:
  """The bits of ``x`` as ``uint32`` words (a trailing axis of 2 for 64-bit dtypes)."""
  if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
    x = jax.random.key_data(x)
  if jnp.issubdtype(x.dtype, jnp.complexfloating):
    x = jnp.stack([jnp.real(x), jnp.imag(x)], axis=-1)
  if x.dtype == jnp.bool_:
    return x.astype(jnp.uint32)
  bits = (jnp.finfo(x.dtype) if jnp.issubdtype(x.dtype, jnp.floating) else jnp.iinfo(x.dtype)).bits
  if bits < 8:  # int4, float4: widened exactly
    x = x.astype(
      jnp.float32
      if jnp.issubdtype(x.dtype, jnp.floating)
      else jnp.int8
      if jnp.issubdtype(x.dtype, jnp.signedinteger)
      else jnp.uint8
    )
    bits = jnp.dtype(x.dtype).itemsize * 8
  unsigned = {8: jnp.uint8, 16: jnp.uint16, 32: jnp.uint32, 64: jnp.uint32}[bits]
  return jax.lax.bitcast_convert_type(x, unsigned).astype(jnp.uint32)


def _leaf_checksum(x: jax.Array) -> jax.Array:
  w = _words(x)
  # The flat (row-major) index, from one iota per axis: no reshape, so a
  # sharded array is not gathered.
  index = jnp.zeros(w.shape, jnp.uint32)
  stride = 1
  for axis in reversed(range(w.ndim)):
    index = index + jax.lax.broadcasted_iota(jnp.uint32, w.shape, axis) * jnp.uint32(stride % 2**32)
    stride *= w.shape[axis]
  a = _fmix(
    w ^ _fmix(index * jnp.uint32(0x9E3779B9) + jnp.uint32(0x6A09E667), 0x85EBCA6B, 13, 0xC2B2AE35),
    0x85EBCA6B,
    13,
    0xC2B2AE35,
  )
  b = _fmix(w + _fmix(index ^ jnp.uint32(0xBB67AE85), 0x7FEB352D, 15, 0x846CA68B), 0x7FEB352D, 15, 0x846CA68B)
  return jnp.stack([jnp.sum(a, dtype=jnp.uint32), jnp.sum(b, dtype=jnp.uint32)])


@jax.jit
def _checksum_leaves(leaves: list[Any]) -> jax.Array:
  return jnp.stack([_leaf_checksum(x) for x in leaves]) if leaves else jnp.zeros((0, 2), jnp.uint32)


def _to_host(x: jax.Array) -> np.ndarray:
  if x.is_fully_addressable:
    return np.asarray(x)
  if x.is_fully_replicated:
    return np.asarray(x.addressable_data(0))
  from jax.experimental import multihost_utils

  return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def _host_words(leaf: Any) -> Any:
  """A 64-bit NumPy leaf as its ``uint32`` word pairs, as :func:`_words` reads them.

  Without ``jax_enable_x64`` JAX would narrow it to 32 bits before hashing.
  """
  if not isinstance(leaf, (np.ndarray, np.generic)):
    return leaf
  if leaf.dtype.kind == "c" and leaf.dtype.itemsize == 16:  # as _words stacks them
    leaf = np.stack([leaf.real, leaf.imag], axis=-1)
  if leaf.dtype.kind in "iuf" and leaf.dtype.itemsize == 8:
    leaf = np.ascontiguousarray(leaf)
    return leaf.view(np.uint32).reshape(leaf.shape + (2,))
  return leaf


def _checksums(state: Any) -> dict[str, dict[str, Any]]:
  """``{leaf name: {"shape", "dtype", "checksum"}}`` of every array leaf of ``state``.

  One program per set of devices the leaves live on (leaves on different
  devices cannot share one); every process must call it.
  """
  named = _named_leaves(state)
  groups: dict[Any, list[int]] = {}
  for i, (_, _, leaf) in enumerate(named):
    devices = leaf.sharding.device_set if isinstance(leaf, jax.Array) else None
    groups.setdefault(None if devices is None else frozenset(devices), []).append(i)
  sums: dict[int, np.ndarray] = {}
  for indices in groups.values():
    out = _to_host(_checksum_leaves([_host_words(named[i][2]) for i in indices]))
    sums.update(zip(indices, out))
  return {
    "/".join(names): {
      "shape": list(np.shape(leaf)),
      "dtype": str(leaf.dtype),
      "checksum": f"{int(sums[i][0]):08x}{int(sums[i][1]):08x}",
    }
    for i, (names, _, leaf) in enumerate(named)
  }


def _canonical_json(value: Any) -> Any:
  return json.loads(json.dumps(value))


def _json_checksum(value: Any) -> str:
  text = json.dumps(value, sort_keys=True, separators=(",", ":"))
  return hashlib.sha256(text.encode()).hexdigest()[:16]


def _checksum_metadata(state: Any, json_items: dict[str, Any] | None = None) -> dict[str, Any]:
  metadata = {"format": _CHECKSUM_FORMAT, "leaves": _checksums(state)}
  if json_items:
    metadata["json_items"] = {name: _json_checksum(_canonical_json(value)) for name, value in json_items.items()}
  return {_CHECKSUMS: metadata}


# The files of orbax's StandardCheckpointer that hold JSON: the tree's
# metadata (required), the step's metadata and the shardings.
_TREE_METADATA = "_METADATA"
_STEP_METADATA = "_CHECKPOINT_METADATA"
_JSON_FILES = (_TREE_METADATA, _STEP_METADATA, "_sharding")
# Array metadata among the keys of the OCDBT store: zarr v2 and v3.
_ARRAY_METADATA = {".zarray": "zarr", "zarr.json": "zarr3"}
# The first bytes of a zstd frame (orbax's default compression).
_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"


class _DamagedCheckpoint(ValueError):
  """A checkpoint folder that is incomplete or damaged (not the caller's mistake).

  Attributes:
    path: the folder (a checkpoint, or a ``CheckpointManager`` step).
    reason: what is wrong, naming the file or leaf.
  """

  def __init__(self, message: str, path: pathlib.Path, reason: str):
    super().__init__(message)
    self.path, self.reason = path, reason


def _incomplete(path: pathlib.Path, reason: str) -> _DamagedCheckpoint:
  return _DamagedCheckpoint(
    f"{path} is not a complete jmp_train checkpoint: {reason}. Restore from a "
    "folder that save_checkpoint wrote (the path it returned), or save the "
    "state again.",
    path,
    reason,
  )


def _damaged(path: pathlib.Path, reason: str) -> _DamagedCheckpoint:
  return _DamagedCheckpoint(
    f"{path} is a damaged jmp_train checkpoint: {reason}. Restore an older one "
    "(restore_latest_checkpoint passes over damaged steps), or save the state again.",
    path,
    reason,
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


# A location in an OCDBT dump: kind, base path, relative path, offset, length.
_LOCATION = re.compile(r"([^:]+):([^:]*):([^:]*):([0-9]+):([0-9]+)")


def _ocdbt_values(path: pathlib.Path) -> dict[str, tuple[pathlib.Path, int, int] | None]:
  """``{key: (data file, offset, length)}`` of the OCDBT store at ``path``.

  None for a value stored inline in its B-tree node (which carries a CRC32C
  checksum: TensorStore refuses a damaged node). Read from TensorStore's
  dump of the manifest and the B-tree nodes.
  """
  import tensorstore as ts

  def location(text: str) -> tuple[pathlib.Path, int, int]:
    match = _LOCATION.fullmatch(text)
    if match is None:
      raise ValueError(f"the store's B-tree holds the location {text!r}")
    _, base, relative, offset, length = match.groups()
    return path / (urllib.parse.unquote(base) + urllib.parse.unquote(relative)), int(offset), int(length)

  base = ts.KvStore.open({"driver": "file", "path": f"{path}/"}).result()
  versions = ts.ocdbt.dump(base).result().get("versions") or []
  pending = [versions[-1]["root"].get("location")] if versions else []
  values: dict[str, tuple[pathlib.Path, int, int] | None] = {}
  while pending:
    node = pending.pop()
    if node is None:  # an empty tree
      continue
    for entry in ts.ocdbt.dump(base, node).result().get("entries", []):
      if "location" in entry:  # an interior node's child
        pending.append(entry["location"])
        continue
      key = bytes(entry["key"]).decode(errors="replace")
      values[key] = location(entry["indirect_value"]) if "indirect_value" in entry else None
  return values


def _data_file(path: pathlib.Path, values: dict[str, Any], key: str) -> str:
  where = values.get(key)
  return "" if where is None else f" (in {where[0].relative_to(path)})"


def _check_ocdbt(path: pathlib.Path) -> None:
  """Lists the OCDBT store and reads what orbax reads first, synchronously.

  Each value's data file must hold its byte range (a missing or truncated
  data file is named); each array's zarr metadata is read whole and, of
  each zstd-compressed chunk, its first four bytes, so that a truncated,
  missing or overwritten store file shows here (in the B-tree, the metadata
  or the data files), without orbax's asyncio reads, which leave complaints
  behind when they fail.
  """
  import tensorstore as ts

  try:
    values = _ocdbt_values(path)
  except Exception as e:
    raise _incomplete(path, f"its array store cannot be read ({error_summary(e)})") from None
  for key, where in values.items():
    if where is None:
      continue
    file, offset, length = where
    name = file.relative_to(path) if file.is_relative_to(path) else file
    if not file.is_file():
      raise _incomplete(path, f"its data file {name} is missing (it holds {key!r})")
    size = file.stat().st_size
    if size < offset + length:
      raise _incomplete(
        path, f"its data file {name} is truncated ({size} bytes; {key!r} ends at byte {offset + length})"
      )

  def read_value(key, read):
    result = read.result()
    if result.state != "value":
      raise ValueError(f"the store lists {key.decode()!r} but holds no value for it")
    return result.value

  try:
    store = ts.KvStore.open(_ocdbt_store(path)).result()
    keys = list(store.list().result())
    arrays = dict(_array_names(keys))
    metadata = {
      f"{name}/{last}".encode(): name
      for name, driver in arrays.items()
      for last, d in _ARRAY_METADATA.items()
      if d == driver
    }
    # Issued together: TensorStore reads them concurrently.
    metadata_reads = {key: store.read(key) for key in metadata}
    zstd = set()
    for key, name in metadata.items():
      meta = json.loads(read_value(key, metadata_reads[key]))
      if isinstance(meta, dict) and (meta.get("compressor") or {}).get("id") == "zstd":
        zstd.add(name)
    chunks = [key for key in keys if key not in metadata and key.decode().rpartition("/")[0] in arrays]
    lasts = {key: store.read(key, byte_range=slice(-1, None)) for key in chunks}
    heads = {key: store.read(key, byte_range=slice(0, 4)) for key in chunks if key.decode().rpartition("/")[0] in zstd}
    for key, last in lasts.items():
      read_value(key, last)
    for key, head in heads.items():
      if read_value(key, head) != _ZSTD_MAGIC:
        raise ValueError(f"the chunk {key.decode()!r}{_data_file(path, values, key.decode())} is not zstd data")
  except Exception as e:
    raise _incomplete(path, f"its array store cannot be read ({error_summary(e)})") from None
  if not metadata:
    raise _incomplete(path, "its array store holds no arrays")


def _is_array_item(path: pathlib.Path) -> bool:
  return path.is_dir() and any((path / name).exists() for name in (_TREE_METADATA, "manifest.ocdbt", "d"))


def _manager_item(path: pathlib.Path, step: bool = False) -> pathlib.Path:
  """The array item of a ``CheckpointManager`` step folder, else ``path``.

  A manager writes each step to ``<directory>/<step>/`` (with the step's
  metadata) and each item in a folder of it: ``default`` for
  ``args=StandardSave(state)``, the item names for ``args=Composite(...)``.
  A step folder with one array item (one with orbax's tree metadata, or
  with an array store whose metadata is lost) stands for that item. With
  ``step``, ``path`` is known to be a step: its own metadata is not needed.
  """
  if not path.is_dir() or _is_array_item(path):
    return path
  if not (step or (path / _STEP_METADATA).is_file()):
    return path
  items = [p for p in sorted(path.iterdir()) if (p / _TREE_METADATA).is_file()]
  if not items:
    items = [p for p in sorted(path.iterdir()) if _is_array_item(p)]
  return items[0] if len(items) == 1 else path


def _is_manager_step(path: pathlib.Path) -> bool:
  return (path / _STEP_METADATA).is_file() and any((p / _TREE_METADATA).is_file() for p in path.iterdir() if p.is_dir())


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
    steps = [p for p in entries if p.is_dir() and _is_manager_step(p)]
    if steps and not inner:
      steps.sort(key=lambda p: (len(p.name), p.name))
      raise ValueError(
        f"{path} is not a complete jmp_train checkpoint, but it holds the steps of "
        f"an orbax CheckpointManager ({_names(steps, slash=False)}): pass one of "
        f"them, e.g. restore_checkpoint({str(steps[-1])!r}, like)."
      )
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
  import tensorstore as ts

  try:
    keys = list(ts.KvStore.open(_ocdbt_store(path)).result().list().result())
  except Exception as e:
    return f"its array store cannot be read ({error_summary(e)})"
  for name, driver in _array_names(keys):
    spec = {"driver": driver, "kvstore": {**_ocdbt_store(path), "path": f"{name}/"}}
    try:
      ts.open(spec, open=True).result().read().result()
    except Exception as e:
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
    inspect.iscoroutine(o) and o.cr_frame is not None and "orbax" in o.cr_code.co_filename for o in gc.get_objects()
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

  def __init__(self, drop: Callable[[logging.LogRecord], bool] = lambda record: False):
    self._drop = drop

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
        if not self._drop(record):
          logging.getLogger(record.name).handle(record)
    return False


# What marks a folder as a checkpoint that ``force=True`` may replace: a
# save_checkpoint folder, a CheckpointManager step or item (even one that
# lost a file).
_CHECKPOINT_MARKERS = (_TREE_METADATA, _STEP_METADATA, "manifest.ocdbt", "commit_success.txt")


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
    what = f"a folder that is not a checkpoint (it holds {_names(entries)})"
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


def _release_orbax_threads(before: set[threading.Thread]) -> None:
  """Stops the orbax threads a failed save left waiting for its signals.

  Orbax's ``_SignalingThread`` waits (five minutes by default) for signals
  of the save's earlier phases; after a failure they never come, and the
  interpreter waits for the (non-daemon) threads at exit. Each thread this
  save started is cancelled and its signals are set, so that it returns.
  """
  try:
    from orbax.checkpoint._src.futures import future

    signaling = future._SignalingThread
  except (ImportError, AttributeError):
    return
  stuck = [t for t in threading.enumerate() if t not in before and isinstance(t, signaling) and t.is_alive()]
  for thread in stuck:
    try:
      thread.cancel()
      future.set_signals(
        thread._receive_signals,
        operation_id=thread._operation_id,
      )
    except Exception:
      pass
  deadline = time.monotonic() + 10.0
  for thread in stuck:
    try:
      thread.join(max(0.0, deadline - time.monotonic()))
    except Exception:
      pass  # its join raises CancelledError, as asked


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
  ocp = _orbax()
  _check_leaves(state)
  path = pathlib.Path(directory).absolute()
  _check_target(path, force)
  _check_writable(path)
  custom_metadata = _checksum_metadata(state)
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
    _release_orbax_threads(before)
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
  ocp = _orbax()
  _check_leaves(state)
  for name, value in json_items.items():
    try:
      json.dumps(value)
    except (TypeError, ValueError) as e:
      raise TypeError(f"The JSON item {name!r} is not JSON-serializable ({error_summary(e)}).") from None
  save = ocp.args.StandardSave(state, custom_metadata=_checksum_metadata(state, json_items))
  if not json_items:
    return save
  return ocp.args.Composite(state=save, **{name: ocp.args.JsonSave(value) for name, value in json_items.items()})


def _key_name(key: Any) -> str:
  return str(getattr(key, "key", getattr(key, "name", getattr(key, "idx", key))))


def _named_leaves(tree: Any) -> list[tuple[tuple[str, ...], str, Any]]:
  # Orbax stores a dataclass or NamedTuple as a dict or list of its fields:
  # compare leaves by the names along their paths.
  return [
    (tuple(_key_name(k) for k in path), jax.tree_util.keystr(path), leaf)
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]
  ]


def _describe_leaf(leaf: Any) -> str:
  dtype = getattr(leaf, "dtype", None)
  return f"shape {tuple(leaf.shape)}" + ("" if dtype is None else f", {np.dtype(dtype)}")


def _shape_mismatch(stored: Any, like: Any) -> str | None:
  """The first leaf whose stored shape or dtype differs from ``like``'s."""
  stored_named = _named_leaves(stored)
  stored_leaves = {names: leaf for names, _, leaf in stored_named}
  like_leaves = _named_leaves(like)
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


def _stored_checksums(path: pathlib.Path) -> dict[str, Any] | None:
  """The checksums in the ``_METADATA`` of the checkpoint at ``path``, or None.

  None for a checkpoint written without them (before they were written, or
  by ``ocp.args.StandardSave`` without :func:`checkpoint_save_args`).
  """
  name = _TREE_METADATA
  custom = json.loads((path / name).read_text(encoding="utf-8")).get("custom_metadata")
  if not isinstance(custom, dict) or _CHECKSUMS not in custom:
    return None
  checksums = custom[_CHECKSUMS]
  hex16 = re.compile(r"[0-9a-f]{16}")

  def well_formed(entry: Any) -> bool:
    return (
      isinstance(entry, dict)
      and isinstance(entry.get("shape"), list)
      and isinstance(entry.get("dtype"), str)
      and isinstance(entry.get("checksum"), str)
      and hex16.fullmatch(entry["checksum"])
    )

  if not (
    isinstance(checksums, dict)
    and checksums.get("format") == _CHECKSUM_FORMAT
    and isinstance(checksums.get("leaves"), dict)
    and all(well_formed(e) for e in checksums["leaves"].values())
    and all(isinstance(v, str) for v in (checksums.get("json_items") or {}).values())
  ):
    raise _damaged(
      path, f"the checksums in its {name} file are not in the form {_CHECKSUM_FORMAT!r} that save_checkpoint writes"
    )
  return checksums


def _metadata_disagrees(stored_tree: Any, checksums: dict[str, Any]) -> str | None:
  """Where orbax's tree metadata and the checksums' record of the leaves differ."""
  leaves = checksums["leaves"]
  stored = _named_leaves(stored_tree)
  for names, keystr, meta in stored:
    entry = leaves.get("/".join(names))
    if entry is None:
      return f"its {_TREE_METADATA} lists the leaf {keystr}, which its checksums do not"
    dtype = getattr(meta, "dtype", None)
    try:
      dtype = None if dtype is None else str(np.dtype(dtype))
    except TypeError:
      dtype = str(dtype)
    if list(meta.shape) != entry["shape"] or dtype not in (None, entry["dtype"]):
      return (
        f"its {_TREE_METADATA} gives the leaf {keystr} {_describe_leaf(meta)}, its "
        f"checksums shape {tuple(entry['shape'])}, {entry['dtype']}"
      )
  if len(stored) != len(leaves):
    return f"its {_TREE_METADATA} lists {len(stored)} leaves, its checksums {len(leaves)}"
  return None


def _leaf_files(path: pathlib.Path, name: str) -> str:
  """`` (in <data files>)`` that hold the chunks of the leaf ``name``, or ``""``."""
  try:
    values = _ocdbt_values(path)
  except Exception:
    return ""
  prefix = name.replace("/", ".") + "/"  # orbax's array names join the keys with dots
  files = sorted(
    {
      str(where[0].relative_to(path))
      for key, where in values.items()
      if key.startswith(prefix) and where is not None and where[0].is_relative_to(path)
    }
  )
  return f" (in {', '.join(files)})" if files else ""


def _verify_arrays(path: pathlib.Path, restored: Any, checksums: dict[str, Any]) -> None:
  leaves = checksums["leaves"]
  keystrs = {"/".join(names): keystr for names, keystr, _ in _named_leaves(restored)}
  for name, entry in _checksums(restored).items():
    saved = leaves.get(name, {}).get("checksum")
    if saved != entry["checksum"]:
      raise _damaged(
        path,
        f"the data of the leaf {keystrs[name]}{_leaf_files(path, name)} does "
        f"not match the checksum saved with it in {_TREE_METADATA} (saved "
        f"{saved}, read {entry['checksum']}): it changed after the save",
      )


def _json_items(step: pathlib.Path, item: pathlib.Path) -> dict[str, pathlib.Path]:
  """``{item name: its file}`` of the JSON items of a ``CheckpointManager`` step.

  Those its ``_CHECKPOINT_METADATA`` names with orbax's JSON handler;
  without that record, the folders beside the array item that hold a
  ``metadata`` file (the file orbax's JSON handler writes).

  Raises:
    _DamagedCheckpoint: if the step's ``_CHECKPOINT_METADATA`` does not parse.
  """
  items: dict[str, pathlib.Path] = {}
  if (step / _STEP_METADATA).is_file():
    try:
      handlers = json.loads((step / _STEP_METADATA).read_text(encoding="utf-8"))
    except (ValueError, OSError) as e:
      raise _damaged(step, f"its file {_STEP_METADATA} does not parse as JSON ({error_summary(e)})") from None
    handlers = handlers.get("item_handlers") if isinstance(handlers, dict) else None
    if isinstance(handlers, dict):
      return {
        name: step / name / "metadata"
        for name, handler in handlers.items()
        if isinstance(handler, str) and handler.endswith("JsonCheckpointHandler")
      }
  for sub in sorted(step.iterdir()):
    if sub != item and sub.is_dir() and (sub / "metadata").is_file() and not _is_array_item(sub):
      items[sub.name] = sub / "metadata"
  return items


def _check_json_items(step: pathlib.Path, item: pathlib.Path, checksums: dict[str, Any] | None) -> None:
  """Raises if a JSON item of the step is missing, does not parse or fails its checksum."""
  files = _json_items(step, item)
  expected = (checksums or {}).get("json_items") or {}
  for name in expected:
    files.setdefault(name, step / name / "metadata")
  for name, file in files.items():
    where = file.relative_to(step)
    try:
      value = json.loads(file.read_text(encoding="utf-8"))
    except FileNotFoundError:
      raise _damaged(step, f"its JSON item {name!r} has no file {where}") from None
    except (ValueError, OSError) as e:
      raise _damaged(step, f"its file {where} does not parse as JSON ({error_summary(e)})") from None
    if name in expected and _json_checksum(value) != expected[name]:
      raise _damaged(
        step,
        f"its file {where} does not match the checksum saved with the state "
        f"in {item.name}/{_TREE_METADATA}: it changed after the save",
      )


def _restore(directory: str | pathlib.Path, like: TrainState, step: bool = False) -> TrainState:
  """:func:`restore_checkpoint`; with ``step``, ``directory`` is a manager step."""
  ocp = _orbax()
  given = pathlib.Path(directory).absolute()
  path = _manager_item(given, step=step)
  _check_folder(path)
  checksums = _stored_checksums(path)
  if path != given:
    _check_json_items(given, path, checksums)
  abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, like)
  # A manager's item folder has no step metadata of its own (it is in the
  # step folder above): orbax says so in a warning.
  no_step_metadata = lambda record: _STEP_METADATA in record.getMessage()
  with ocp.StandardCheckpointer() as checkpointer:
    try:
      with _QuietOrbax(drop=no_step_metadata):
        stored = checkpointer.metadata(path).item_metadata
        if stored is None:  # Orbax logged the reason and went on.
          raise ValueError("no item metadata")
    except Exception as e:
      raise _incomplete(path, f"orbax cannot read its metadata ({error_summary(e)})") from None
    if checksums is not None:
      disagreement = _metadata_disagrees(stored.tree, checksums)
      if disagreement is not None:
        raise _damaged(path, disagreement)
    problem = _shape_mismatch(stored.tree, abstract)
    if problem is not None:
      raise ValueError(
        f"Cannot restore {path} into this template: {problem}. Build the template as "
        "the saved run built its state (the same model, optimizer, policy, mode and "
        "replica count: that run's step.init(params)), or restore another checkpoint."
      )
    try:
      with _QuietOrbax():
        restored = checkpointer.restore(path, abstract)
    except Exception:
      # A damaged array, or a failure that is not the checkpoint's.
      reason = _unreadable_array(path)
      if reason is None:
        raise
      restored = None
    if restored is None:
      raise _incomplete(path, reason)
  if checksums is not None:
    _verify_arrays(path, restored, checksums)
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
  except _DamagedCheckpoint as e:
    raise ValueError(str(e)) from None


def _steps(directory: pathlib.Path) -> list[tuple[int, pathlib.Path]]:
  """The step folders in ``directory`` (``<step>`` or ``<name>_<step>``), newest first."""
  steps = []
  for path in directory.iterdir():
    match = re.fullmatch(r"(?:.*_)?(\d+)", path.name)
    if match and path.is_dir():  # not orbax's temporary folders: <step>.orbax-checkpoint-tmp-*
      steps.append((int(match.group(1)), path))
  return sorted(steps, key=lambda s: (s[0], s[1].name), reverse=True)


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
  _orbax()
  root = pathlib.Path(directory).absolute()
  if not root.is_dir():
    raise FileNotFoundError(
      f"No checkpoints in {root}: "
      + ("it is a file, not a folder of steps." if root.exists() else "the folder does not exist.")
    )
  steps = _steps(root)
  if not steps:
    raise FileNotFoundError(
      f"No checkpoints in {root}: it holds no step folders (named <step>, as a "
      "CheckpointManager writes them, or <name>_<step>)."
    )
  first = None
  for n, folder in steps:
    try:
      return n, _restore(folder, like, step=True)
    except (_DamagedCheckpoint, FileNotFoundError) as e:
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
