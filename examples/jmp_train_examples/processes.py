"""Processes on one machine, talking over loopback (``jax.distributed`` jobs).

The demo's ``--num-processes``, the multi-process benchmark and the tests'
workers start their processes here.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import tempfile
import time
from typing import Mapping, Sequence

__all__ = ["Finished", "WORKER_FOLDER_PREFIX", "free_port", "run_processes"]

# The name of the temporary folder a launcher shares with its workers starts
# so (a worker whose launcher is gone removes it).
WORKER_FOLDER_PREFIX = "jmp_train_mp_"

# Seconds a process has to finish after SIGTERM (a checkpoint save in flight)
# before it is killed.
_GRACE_S = 15
# Seconds the others have to end once a process failed. Once one process of
# a job has failed the job cannot go on (every collective, every checkpoint
# barrier needs all of them), so those still running are killed then: a
# process that stopped answering (SIGSTOP, a debugger, a hang) gets no
# further.
_FAILED_PEER_GRACE_S = 5.0
# Seconds the others have to end once a process finished (exit status 0 or
# a coordinated stop on SIGTERM): jax.distributed's shutdown barrier lets
# them all go within a few seconds; its own timeout is 60 s.
_FINISH_S = 90.0
_POLL_S = 0.1


class Finished(tuple):
  """``(exit status, output)`` of one process, as a pair.

  Attributes:
    ended: ``True`` where :func:`run_processes` killed the process because
      it was still running well after another process of the job had
      failed or finished: a process that stopped answering, not one that
      failed on its own.
  """

  ended: bool

  def __new__(cls, code: int, output: str, ended: bool = False) -> "Finished":
    self = super().__new__(cls, (code, output))
    self.ended = ended
    return self


def free_port() -> int:
  """A TCP port on 127.0.0.1 that is free now (the coordinator's port).

  Returns:
    The port number the operating system picked.
  """
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _signal_group(p: subprocess.Popen, sig: int) -> None:
  """Sends ``sig`` to ``p``'s process group (``p`` leads its own)."""
  try:
    os.killpg(p.pid, sig)
  except (ProcessLookupError, PermissionError):
    pass


def run_processes(
  commands: Sequence[Sequence[str]],
  env: Mapping[str, str],
  *,
  timeout: float | None = None,
  cwd: str | os.PathLike[str] | None = None,
  grace_s: float = _FAILED_PEER_GRACE_S,
  pass_fds: Sequence[int] = (),
) -> list[Finished]:
  """Runs the commands side by side and waits for all of them.

  Each process runs in its own process group (a Ctrl-C in the terminal
  reaches this process only, which then stops them), with its standard
  output and error read together into an unnamed temporary file.

  Once a process exits non-zero, the others get ``grace_s`` seconds to end;
  those still running then are killed (SIGKILL, which also ends a stopped
  process) and marked :attr:`Finished.ended`. Once a process finishes
  (status 0, or a coordinated stop on SIGTERM), the others get 90 seconds.
  A process still running when waiting fails (``timeout`` passed, an
  interrupt, SIGTERM) is sent SIGTERM, and killed if it has not ended 15
  seconds later, so no worker outlives its job.

  Args:
    commands: one argv per process, all started before any is waited for.
    env: the environment of every process.
    timeout: seconds to wait for the whole job (``None``: no limit).
    cwd: the processes' working directory (``None``: this one's).
    grace_s: seconds the others have once a process has failed.
    pass_fds: file descriptors every process inherits (a lock held for
      as long as any of them runs).

  Returns:
    A :class:`Finished` ``(exit status, output)`` per command, in order.

  Raises:
    subprocess.TimeoutExpired: if the job runs past ``timeout``.
  """
  logs = [tempfile.TemporaryFile(mode="w+", errors="replace") for _ in commands]
  procs: list[subprocess.Popen] = []
  ended: set[int] = set()
  try:
    for cmd, log in zip(commands, logs):
      procs.append(
        subprocess.Popen(
          list(cmd),
          env=dict(env),
          cwd=cwd,
          stdout=log,
          stderr=subprocess.STDOUT,
          start_new_session=True,
          pass_fds=tuple(pass_fds),
        )
      )
    start = time.monotonic()
    give_up_at = None
    while True:
      codes = [p.poll() for p in procs]
      if all(c is not None for c in codes):
        break
      now = time.monotonic()
      if timeout is not None and now - start > timeout:
        raise subprocess.TimeoutExpired(procs[0].args, timeout)
      if give_up_at is None and any(c is not None for c in codes):
        failed = any(c not in (None, 0, 128 + signal.SIGTERM) for c in codes)
        give_up_at = now + (grace_s if failed else _FINISH_S)
      if give_up_at is not None and now >= give_up_at:
        for i, p in enumerate(procs):
          if p.poll() is None:
            ended.add(i)
            _signal_group(p, signal.SIGKILL)
        for p in procs:
          p.wait()
        break
      time.sleep(_POLL_S)
  finally:
    running = [p for p in procs if p.poll() is None]
    for p in running:
      _signal_group(p, signal.SIGTERM)
    for p in running:
      try:
        p.wait(timeout=_GRACE_S)
      except subprocess.TimeoutExpired:
        _signal_group(p, signal.SIGKILL)
        p.wait()
    outputs = []
    for log in logs:
      log.seek(0)
      outputs.append(log.read())
      log.close()
  return [Finished(p.returncode, out, i in ended) for i, (p, out) in enumerate(zip(procs, outputs))]
