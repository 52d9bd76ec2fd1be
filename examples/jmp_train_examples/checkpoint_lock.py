"""One run per checkpoint folder: a lock file naming the run that holds it.

Two runs writing the same ``--checkpoint-dir`` would save into each other's
checkpoints (with several processes they wait on each other's barriers
forever). The run that starts first holds ``<checkpoint dir>/.jmp_train.lock``:
an exclusive ``flock`` on that file, which records the holder's pid, host
and start time. A second run is refused at once with
:class:`CheckpointDirBusy`, naming the holder.

The operating system drops a ``flock`` when the last process holding the
file open ends, however it ends (SIGKILL included): the launcher of a
``--num-processes`` run passes the descriptor to its workers, so the lock
lasts as long as any of them. A lock file left behind by a run that is
gone (its ``flock`` released) is taken over with a note on standard error.
A file written on another host is not taken over (whether that run still
goes on cannot be told from here): the message says which file to delete.

Where ``fcntl`` is missing (Windows), no lock is taken.

This module imports nothing heavy: the CLI refuses before JAX starts.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import time
from typing import Iterator

try:
  import fcntl
except ImportError:  # pragma: no cover (Windows)
  fcntl = None

__all__ = ["CheckpointDirBusy", "LOCK_NAME", "held_fd", "hold"]

LOCK_NAME = ".jmp_train.lock"

# Locks this process holds: real path of the folder -> [descriptor, depth].
_held: dict[str, list[int]] = {}


class CheckpointDirBusy(Exception):
  """Another run holds the checkpoint folder (the CLI exits with status 2)."""


def _read(fd: int) -> dict:
  os.lseek(fd, 0, os.SEEK_SET)
  text = os.read(fd, 4096).decode("utf-8", "replace")
  try:
    holder = json.loads(text)
  except ValueError:
    return {}
  return holder if isinstance(holder, dict) else {}


def _holder(holder: dict) -> str:
  since = holder.get("started")
  return f"pid {holder.get('pid', '?')} on host {holder.get('host', '?')}" + (f", since {since}" if since else "")


def _busy(directory: str, holder: dict, path: str, other_host: bool = False) -> CheckpointDirBusy:
  if other_host:
    return CheckpointDirBusy(
      f"--checkpoint-dir {directory} is locked by a run on another host "
      f"({_holder(holder)}); wait for it to finish or pass another --checkpoint-dir "
      f"(if no run is going on there, delete {path})"
    )
  return CheckpointDirBusy(
    f"--checkpoint-dir {directory} is in use by another jmp-train run "
    f"({_holder(holder)}); wait for it to finish, or pass another --checkpoint-dir"
  )


def _acquire(directory: str) -> int:
  """Takes the lock of ``directory``; returns its descriptor."""
  os.makedirs(directory, exist_ok=True)
  path = os.path.join(directory, LOCK_NAME)
  while True:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
      holder = _read(fd)
      os.close(fd)
      raise _busy(directory, holder, path) from None
    # The holder may have removed the file between our open and our lock:
    # then we hold a file nobody else sees, and try again.
    try:
      same = os.path.samestat(os.fstat(fd), os.stat(path))
    except FileNotFoundError:
      same = False
    if same:
      break
    os.close(fd)
  previous = _read(fd)
  host = socket.gethostname()
  if previous.get("host", host) != host:
    os.close(fd)
    raise _busy(directory, previous, path, other_host=True)
  if previous:
    print(
      f"jmp-train: taking over the lock of --checkpoint-dir {directory}: the run "
      f"that held it ({_holder(previous)}) is no longer running",
      file=sys.stderr,
    )
  record = {"pid": os.getpid(), "host": host, "started": time.strftime("%Y-%m-%d %H:%M:%S %z")}
  os.ftruncate(fd, 0)
  os.lseek(fd, 0, os.SEEK_SET)
  os.write(fd, (json.dumps(record) + "\n").encode())
  os.fsync(fd)
  return fd


def _release(directory: str, fd: int) -> None:
  path = os.path.join(directory, LOCK_NAME)
  try:
    if os.path.samestat(os.fstat(fd), os.stat(path)):
      os.unlink(path)  # before the lock goes: no one can take a file being removed
  except OSError:
    pass
  os.close(fd)


@contextlib.contextmanager
def hold(directory: str | os.PathLike[str]) -> Iterator[int | None]:
  """Holds the lock of ``directory`` while the block runs (re-entrant in a process).

  Args:
    directory: the checkpoint folder (created if missing).

  Yields:
    The lock file's descriptor (``None`` where ``fcntl`` is missing).

  Raises:
    CheckpointDirBusy: another run holds the folder.
  """
  if fcntl is None:
    yield None
    return
  key = os.path.realpath(directory)
  if key in _held:
    _held[key][1] += 1
  else:
    _held[key] = [_acquire(os.fspath(directory)), 1]
  try:
    yield _held[key][0]
  finally:
    _held[key][1] -= 1
    if not _held[key][1]:
      _release(key, _held.pop(key)[0])


def held_fd(directory: str | os.PathLike[str] | None) -> int | None:
  """The descriptor of the lock this process holds on ``directory``, else ``None``."""
  if directory is None:
    return None
  entry = _held.get(os.path.realpath(directory))
  return entry[0] if entry else None
