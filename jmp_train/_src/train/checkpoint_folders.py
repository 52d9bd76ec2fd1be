"""What a checkpoint folder is, and the files a restore checks before orbax reads it.

A :func:`~jmp_train.save_checkpoint` folder is orbax's array item: its tree
metadata ``_METADATA`` (with the checksums), its own ``_CHECKPOINT_METADATA``
and the array store. A ``CheckpointManager`` writes each step to
``<directory>/<step>/``, with the step's ``_CHECKPOINT_METADATA``, and each
item in a folder of it (``default``, or ``state`` and the JSON items). These
checks read only orbax's JSON files; the array store is left to orbax (and,
once it failed, to :mod:`checkpoint_store`).
"""

from __future__ import annotations

import json
import pathlib
import re
from typing import Any

from jmp_train._src.messages import error_summary
from jmp_train._src.train.checkpoint_checksums import json_checksum

__all__ = [
  "DamagedCheckpoint",
  "check_folder",
  "check_json_items",
  "damaged",
  "incomplete",
  "manager_item",
  "names",
  "steps",
]

# The files of orbax's StandardCheckpointer that hold JSON: the tree's
# metadata (required), the step's metadata and the shardings.
TREE_METADATA = "_METADATA"
STEP_METADATA = "_CHECKPOINT_METADATA"
_JSON_FILES = (TREE_METADATA, STEP_METADATA, "_sharding")
# A step folder: <step> (a CheckpointManager's) or <name>_<step>.
_STEP_NAME = re.compile(r"(?:.*_)?(\d+)")


class DamagedCheckpoint(ValueError):
  """A checkpoint folder that is incomplete or damaged (not the caller's mistake).

  Attributes:
    path: the folder (a checkpoint, or a ``CheckpointManager`` step).
    reason: what is wrong, naming the file or leaf.
  """

  def __init__(self, message: str, path: pathlib.Path, reason: str):
    super().__init__(message)
    self.path, self.reason = path, reason


def incomplete(path: pathlib.Path, reason: str) -> DamagedCheckpoint:
  return DamagedCheckpoint(
    f"{path} is not a complete jmp_train checkpoint: {reason}. Restore from a "
    "folder that save_checkpoint wrote (the path it returned), or save the "
    "state again.",
    path,
    reason,
  )


def damaged(path: pathlib.Path, reason: str) -> DamagedCheckpoint:
  return DamagedCheckpoint(
    f"{path} is a damaged jmp_train checkpoint: {reason}. Restore an older one "
    "(restore_latest_checkpoint passes over damaged steps), or save the state again.",
    path,
    reason,
  )


def names(entries: list[pathlib.Path], limit: int = 5, slash: bool = True) -> str:
  shown = [p.name + ("/" if slash and p.is_dir() else "") for p in entries[:limit]]
  return ", ".join(shown) + (", ..." if len(entries) > limit else "")


def _is_array_item(path: pathlib.Path) -> bool:
  return path.is_dir() and any((path / name).exists() for name in (TREE_METADATA, "manifest.ocdbt", "d"))


def _lost_step_metadata(path: pathlib.Path, items: list[pathlib.Path]) -> bool:
  """Whether ``path`` is a manager step without its ``_CHECKPOINT_METADATA``.

  A folder named as a step whose array items have no step metadata of their
  own (as a manager writes them; a :func:`save_checkpoint` folder has its own).
  """
  return (
    bool(items)
    and not (path / STEP_METADATA).exists()
    and _STEP_NAME.fullmatch(path.name) is not None
    and not any((item / STEP_METADATA).exists() for item in items)
  )


def manager_item(path: pathlib.Path, step: bool = False) -> pathlib.Path:
  """The array item of a ``CheckpointManager`` step folder, else ``path``.

  A step folder with one array item (one with orbax's tree metadata, or with
  an array store whose metadata is lost) stands for that item. With
  ``step``, ``path`` is known to be a step: its own metadata is not needed;
  without it, a step folder that lost its ``_CHECKPOINT_METADATA`` stands for
  its one item too (its checksums and JSON items are checked as a step's).
  """
  if not path.is_dir() or _is_array_item(path):
    return path
  items = [p for p in sorted(path.iterdir()) if (p / TREE_METADATA).is_file()]
  if not (step or (path / STEP_METADATA).is_file()):
    return items[0] if len(items) == 1 and _lost_step_metadata(path, items) else path
  if not items:
    items = [p for p in sorted(path.iterdir()) if _is_array_item(p)]
  return items[0] if len(items) == 1 else path


def _is_manager_step(path: pathlib.Path) -> bool:
  return (path / STEP_METADATA).is_file() and any((p / TREE_METADATA).is_file() for p in path.iterdir() if p.is_dir())


def check_folder(path: pathlib.Path) -> dict[str, Any]:
  """Raises the error that says why ``path`` is not a checkpoint, if it is not.

  Returns:
    Its tree metadata (``_METADATA``), parsed.

  Raises:
    FileNotFoundError: if ``path`` is missing, a file or an empty folder.
    ValueError: if ``path`` is a folder of checkpoints, has no tree metadata,
      or one of orbax's JSON files in it does not parse.
  """
  if not path.exists():
    raise FileNotFoundError(f"No checkpoint at {path}: the folder does not exist.")
  if not path.is_dir():
    raise FileNotFoundError(f"No checkpoint at {path}: it is a file, not a checkpoint folder.")
  entries = sorted(path.iterdir())
  if not entries:
    raise FileNotFoundError(f"No checkpoint at {path}: the folder is empty.")
  if not (path / TREE_METADATA).is_file():
    inner = [p for p in entries if (p / TREE_METADATA).is_file()]
    found = [p for p in entries if p.is_dir() and _is_manager_step(p)]
    if found and not inner:
      found.sort(key=lambda p: (len(p.name), p.name))
      raise ValueError(
        f"{path} is not a complete jmp_train checkpoint, but it holds the steps of "
        f"an orbax CheckpointManager ({names(found, slash=False)}): pass one of "
        f"them, e.g. restore_checkpoint({str(found[-1])!r}, like)."
      )
    if inner and _lost_step_metadata(path, inner):
      raise ValueError(
        f"{path} has no {STEP_METADATA} file (the step metadata of a CheckpointManager) and holds "
        f"several array items ({names(inner, slash=False)}): pass the one to restore, e.g. "
        f"restore_checkpoint({str(inner[-1])!r}, like)."
      )
    if inner:
      raise ValueError(
        f"{path} is not a complete jmp_train checkpoint, but it holds "
        f"checkpoints ({names(inner, slash=False)}): pass one of them, e.g. "
        f"restore_checkpoint({str(inner[-1])!r}, like)."
      )
    raise incomplete(path, f"it has no {TREE_METADATA} file (it holds {names(entries)})")
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
      raise incomplete(path, f"its file {file.relative_to(path)} does not parse as JSON ({error_summary(e)})") from None
    if file.name == TREE_METADATA:
      tree_metadata = content
  if not isinstance(tree_metadata, dict):
    raise incomplete(path, f"its {TREE_METADATA} file holds no tree metadata")
  return tree_metadata


def steps(directory: pathlib.Path) -> list[tuple[int, pathlib.Path]]:
  """The step folders in ``directory`` (``<step>`` or ``<name>_<step>``), newest first."""
  found = []
  for path in directory.iterdir():
    match = _STEP_NAME.fullmatch(path.name)
    if match and path.is_dir():  # not orbax's temporary folders: <step>.orbax-checkpoint-tmp-*
      found.append((int(match.group(1)), path))
  return sorted(found, key=lambda s: (s[0], s[1].name), reverse=True)


def _json_items(step: pathlib.Path, item: pathlib.Path) -> dict[str, pathlib.Path]:
  """``{item name: its file}`` of the JSON items of a ``CheckpointManager`` step.

  Those its ``_CHECKPOINT_METADATA`` names with orbax's JSON handler;
  without that record, the folders beside the array item that hold a
  ``metadata`` file (the file orbax's JSON handler writes).

  Raises:
    DamagedCheckpoint: if the step's ``_CHECKPOINT_METADATA`` does not parse.
  """
  if (step / STEP_METADATA).is_file():
    try:
      handlers = json.loads((step / STEP_METADATA).read_text(encoding="utf-8"))
    except (ValueError, OSError) as e:
      raise damaged(step, f"its file {STEP_METADATA} does not parse as JSON ({error_summary(e)})") from None
    handlers = handlers.get("item_handlers") if isinstance(handlers, dict) else None
    if isinstance(handlers, dict):
      return {
        name: step / name / "metadata"
        for name, handler in handlers.items()
        if isinstance(handler, str) and handler.endswith("JsonCheckpointHandler")
      }
  return {
    sub.name: sub / "metadata"
    for sub in sorted(step.iterdir())
    if sub != item and sub.is_dir() and (sub / "metadata").is_file() and not _is_array_item(sub)
  }


def check_json_items(step: pathlib.Path, item: pathlib.Path, checksums: dict[str, Any] | None) -> None:
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
      raise damaged(step, f"its JSON item {name!r} has no file {where}") from None
    except (ValueError, OSError) as e:
      raise damaged(step, f"its file {where} does not parse as JSON ({error_summary(e)})") from None
    if name in expected and json_checksum(value) != expected[name]:
      raise damaged(
        step,
        f"its file {where} does not match the checksum saved with the state "
        f"in {item.name}/{TREE_METADATA}: it changed after the save",
      )
