"""Orbax itself: its import, the noise of its failed reads, the threads of a failed save.

The one place that knows how orbax behaves when something fails: when one
of its concurrent TensorStore reads fails, it closes its event loop while the
others still run, and those report "Event loop is closed" through
``sys.unraisablehook``, complain when collected, and log through asyncio and
absl (:class:`QuietOrbax` holds these back); a save that fails leaves threads
waiting for signals that never come (:func:`release_threads` ends them).
"""

from __future__ import annotations

import gc
import inspect
import logging
import sys
import threading
import time
import traceback
import types
from typing import Any, Callable

__all__ = ["QuietOrbax", "orbax", "release_threads"]


def orbax():
  """``orbax.checkpoint``, or an ``ImportError`` with the install hint."""
  try:
    import orbax.checkpoint as ocp
  except ImportError as e:
    raise ImportError("Checkpoints need orbax-checkpoint: pip install 'jmp_train[checkpoint]'") from e
  return ocp


def _is_orbax_noise(unraisable: Any) -> bool:
  """Whether an unraisable exception is a complaint of orbax's abandoned reads."""
  exc = unraisable.exc_value
  if isinstance(exc, RuntimeError) and "Event loop is closed" in str(exc):
    return True
  code = getattr(unraisable.object, "cr_code", None)
  return code is not None and "orbax" in code.co_filename


def _orbax_coroutines_alive() -> bool:
  # Objects frozen before the block (gc.freeze) are not listed: only the
  # block's own, so the scan does not grow with the process's heap.
  return any(
    inspect.iscoroutine(o) and o.cr_frame is not None and "orbax" in o.cr_code.co_filename for o in gc.get_objects()
  )


class QuietOrbax:
  """Holds back orbax's log records and the complaints of its abandoned reads.

  After a failure they are dropped, once they have settled; after a success,
  the held log records are passed on (less those ``drop`` selects). The
  objects alive before the block are frozen (``gc.freeze``) while it runs,
  unless something froze objects already: settling collects and scans only
  what the block made, however large the process's heap.

  Args:
    drop: selects the log records to drop even after a success.
  """

  _LOGGERS = ("absl", "asyncio")

  def __init__(self, drop: Callable[[logging.LogRecord], bool] = lambda record: False):
    self._drop = drop

  def __enter__(self) -> "QuietOrbax":
    self._froze = gc.get_freeze_count() == 0
    if self._froze:
      gc.freeze()
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
    try:
      if isinstance(exc, Exception):
        self._settle(exc)
    finally:
      if self._froze:
        gc.unfreeze()
    for name in self._LOGGERS:
      logging.getLogger(name).removeFilter(self._hold)
    if sys.unraisablehook == self._hook:
      sys.unraisablehook = self._previous_hook
    if exc_type is None:
      for record in self._records:
        if not self._drop(record):
          logging.getLogger(record.name).handle(record)
    return False


def release_threads(before: set[threading.Thread]) -> None:
  """Stops the orbax threads a failed save left waiting for its signals.

  Orbax's ``_SignalingThread`` waits (five minutes by default) for signals
  of the save's earlier phases; after a failure they never come, and the
  interpreter waits for the (non-daemon) threads at exit. Each thread this
  save started is cancelled (its target dropped where orbax has no
  ``cancel``) and the signals it waits for are set, so that it returns. An
  orbax without that class has nothing to release. Orbax's private API:
  ``make check-orbax-range`` runs the test of it against both ends of the
  range.
  """
  try:
    from orbax.checkpoint._src.futures import future

    signaling = future._SignalingThread
  except (ImportError, AttributeError):
    return
  stuck = [t for t in threading.enumerate() if t not in before and isinstance(t, signaling) and t.is_alive()]
  for thread in stuck:
    try:
      if hasattr(thread, "cancel"):
        thread.cancel()
      else:  # before orbax 0.12.x's cancel: the thread's run() skips a missing target
        thread._target = None
      signals, operation_id = thread._receive_signals, thread._operation_id
      if hasattr(future, "set_signals"):
        future.set_signals(signals, operation_id=operation_id)
      else:  # before orbax 0.11.34: the thread class's setter, on the signals it waits for
        signaling._set_signals(types.SimpleNamespace(_send_signals=signals, _operation_id=operation_id))
    except Exception:
      pass
  deadline = time.monotonic() + 10.0
  for thread in stuck:
    try:
      thread.join(max(0.0, deadline - time.monotonic()))
    except Exception:
      pass  # its join raises CancelledError, as asked
