"""SIGTERM as an exception at a safe point: the demo's way to stop and resume.

A scheduler stops a job with SIGTERM (then SIGKILL after a grace period).
Python's default ends the process at once, dropping a checkpoint save in
flight. While :func:`sigterm_unwinds` is active, SIGTERM raises
:class:`Terminated` in the main thread instead, so ``finally`` blocks run
(an asynchronous save completes, worker processes are stopped); inside
:func:`deferred` (a checkpoint being written or restored) the exception is
held until the block ends.

The worker processes of a multi-process run leave SIGTERM to
``jax.distributed``'s preemption service instead: a notice to any process
reaches all of them, and each stops at the same step
(:func:`preempted`, JAX's ``reached_preemption_sync_point``), after saving it.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from typing import Iterator

__all__ = ["Terminated", "deferred", "preempted", "sigterm_unwinds"]

# The main thread's deferral depth and whether a SIGTERM is held.
_state = {"depth": 0, "pending": False}


class Terminated(Exception):
  """SIGTERM arrived: the run unwinds and can be resumed from its checkpoints."""


def _handler(signum, frame):
  if _state["depth"]:
    _state["pending"] = True
    return
  raise Terminated()


@contextlib.contextmanager
def sigterm_unwinds(active: bool = True) -> Iterator[None]:
  """While active, SIGTERM raises :class:`Terminated` (main thread only; else a no-op)."""
  if not active or threading.current_thread() is not threading.main_thread():
    yield
    return
  previous = signal.signal(signal.SIGTERM, _handler)
  try:
    yield
  finally:
    signal.signal(signal.SIGTERM, previous)
    _state["pending"] = False


@contextlib.contextmanager
def deferred() -> Iterator[None]:
  """Holds a SIGTERM that arrives inside the block until the block ends."""
  _state["depth"] += 1
  try:
    yield
  finally:
    _state["depth"] -= 1
  if not _state["depth"] and _state["pending"]:
    _state["pending"] = False
    raise Terminated()


def preempted(step: int) -> bool:
  """Whether the processes of a ``jax.distributed`` job agreed to stop after ``step``.

  Every process must call it after every step. ``False`` in a process
  outside a multi-process job.
  """
  import jax
  from jax.experimental import multihost_utils

  if jax.process_count() == 1:
    return False
  return multihost_utils.reached_preemption_sync_point(step)
