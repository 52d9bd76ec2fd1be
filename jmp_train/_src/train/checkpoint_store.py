"""What is wrong with a checkpoint's array store, through TensorStore's public API.

Called only once orbax failed to restore a checkpoint, or a restored array
differs from its checksum: the store is opened as a TensorStore key-value
store (``ocdbt`` over ``file``, as orbax writes it, or ``file``), its keys
are listed and read, and each array (a key ending in zarr's ``.zarray`` or
``zarr.json``) is read whole with TensorStore's zarr driver. Which file holds
a key is found by elimination, not from the store's internal format: the
key is read again with each file of the folder hidden in turn (in a folder
of links to the others), and a file whose absence changes the read (but not
the list of keys) holds it. A key whose value reads empty while no file
holds it lost its data file.
"""

from __future__ import annotations

import hashlib
import pathlib
import tempfile
from typing import Any

from jmp_train._src.messages import error_summary

__all__ = ["leaf_files", "unreadable"]

# Array metadata keys: zarr v2 and v3, and TensorStore's driver for each.
_ARRAY_METADATA = {".zarray": "zarr", "zarr.json": "zarr3"}
# The elimination opens the store once per file and reads the keys again:
# not for folders of more files, nor for more bytes read in all.
_MAX_FILES = 256
_MAX_BYTES = 2**30


def _spec(path: pathlib.Path, ocdbt: bool, sub: str = "") -> dict[str, Any]:
  if ocdbt:
    return {"driver": "ocdbt", "base": {"driver": "file", "path": f"{path}/"}, "path": sub}
  return {"driver": "file", "path": f"{path}/{sub}"}


def _open(path: pathlib.Path, ocdbt: bool) -> Any:
  import tensorstore as ts

  return ts.KvStore.open(_spec(path, ocdbt), context=ts.Context()).result()


def _read(store: Any, key: bytes) -> tuple[str, str, int]:
  """``(state, detail, bytes)`` of reading ``key``: ``"value"`` (its sha256), ``"empty"`` or ``"error"`` (why)."""
  try:
    result = store.read(key).result()
  except Exception as e:
    return "error", error_summary(e), 0
  if result.state != "value" or not result.value:
    return "empty", "", 0
  return "value", hashlib.sha256(result.value).hexdigest(), len(result.value)


def _array_names(keys: list[bytes]) -> list[tuple[str, str]]:
  """``(array name, TensorStore driver)`` for each array among ``keys``."""
  arrays = []
  for key in keys:
    name, _, last = key.decode(errors="replace").rpartition("/")
    if last in _ARRAY_METADATA:
      arrays.append((name, _ARRAY_METADATA[last]))
  return arrays


def _chunks(keys: list[bytes], name: str) -> list[bytes]:
  prefix = f"{name}/".encode()
  return [k for k in keys if k.startswith(prefix) and k[len(prefix) :].decode(errors="replace") not in _ARRAY_METADATA]


def _holders(path: pathlib.Path, ocdbt: bool, listing: list[bytes], reads: dict[bytes, tuple[str, str, int]]):
  """``{key: [files of the folder that hold it]}`` for the keys of ``reads``, by elimination."""
  held: dict[bytes, list[str]] = {key: [] for key in reads}
  files = sorted(p for p in path.rglob("*") if p.is_file())
  if not reads or len(files) > _MAX_FILES or len(files) * sum(r[2] for r in reads.values()) > _MAX_BYTES:
    return held
  with tempfile.TemporaryDirectory(prefix="jmp_train-checkpoint-") as tmp:
    mirror = pathlib.Path(tmp)
    links = {file: mirror / file.relative_to(path) for file in files}
    try:
      for file, link in links.items():
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(file)
    except OSError:
      return held  # no links here: the files go unnamed
    for file, link in links.items():
      link.unlink()
      try:
        store = _open(mirror, ocdbt)
        if sorted(store.list().result()) == listing:  # else the store needs it to list its keys
          for key, read in reads.items():
            if _read(store, key) != read:
              held[key].append(str(file.relative_to(path)))
      except Exception:
        pass  # the store needs it to open
      finally:
        link.symlink_to(file)
  return held


def _files(held: dict[bytes, list[str]]) -> list[str]:
  return sorted({file for files in held.values() for file in files})


def _array_problem(path: pathlib.Path, ocdbt: bool, store: Any, keys: list[bytes], name: str, error: Exception) -> str:
  """Why the array ``name`` does not read: a data file truncated, missing or unreadable."""
  reads = {key: _read(store, key) for key in _chunks(keys, name)}
  held = _holders(path, ocdbt, keys, reads)
  for key, (state, detail, _) in reads.items():
    files, shown = held[key], key.decode(errors="replace")
    if state == "error":
      what = f"its data file {', '.join(files)}" if files else "its array store"
      if detail.startswith("ValueError: OUT_OF_RANGE"):
        size = "" if len(files) != 1 else f"{(path / files[0]).stat().st_size} bytes; "
        return f"{what} is truncated ({size}it holds {shown!r})"
      return f"{what} cannot be read: it holds {shown!r} ({detail})"
    if state == "empty" and not files:
      return f"a data file of its array store is missing (it holds {shown!r})"
  files = _files(held)
  where = f"; its data is in {', '.join(files)}" if files else ""
  return f"its array {name} cannot be read ({error_summary(error)}{where})"


def unreadable(path: pathlib.Path, ocdbt: bool) -> str | None:
  """Why an array of the checkpoint at ``path`` does not read, or None if every one reads.

  Reads every array whole, synchronously: run only after orbax failed, to
  tell a damaged checkpoint from another failure.
  """
  import tensorstore as ts

  try:
    store = _open(path, ocdbt)
    keys = sorted(store.list().result())
  except Exception as e:
    return f"its array store cannot be read ({error_summary(e)})"
  arrays = _array_names(keys)
  if not arrays:
    return "its array store holds no arrays"
  for name, driver in arrays:
    spec = {"driver": driver, "kvstore": _spec(path, ocdbt, f"{name}/")}
    try:
      ts.open(spec, open=True, context=ts.Context()).result().read().result()
    except Exception as e:
      return _array_problem(path, ocdbt, store, keys, name, e)
  return None


def leaf_files(path: pathlib.Path, ocdbt: bool, name: str) -> str:
  """`` (in <files>)``: the files of the folder that hold the array ``name``, or ``""``."""
  try:
    store = _open(path, ocdbt)
    keys = sorted(store.list().result())
    reads = {key: _read(store, key) for key in _chunks(keys, name)}
    files = _files(_holders(path, ocdbt, keys, reads))
  except Exception:
    return ""
  return f" (in {', '.join(files)})" if files else ""
