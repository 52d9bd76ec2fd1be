"""Processes on one machine, talking over loopback (``jax.distributed`` jobs).

The demo's ``--num-processes``, the multi-process benchmark and the tests'
workers start their processes here.
"""

from __future__ import annotations

import os
import socket
import subprocess
from typing import Mapping, Sequence

__all__ = ["free_port", "run_processes"]

# Seconds a process has to finish after SIGTERM (a checkpoint save in flight)
# before it is killed.
_GRACE_S = 15


def free_port() -> int:
  """A TCP port on 127.0.0.1 that is free now (the coordinator's port).

  Returns:
    The port number the operating system picked.
  """
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def run_processes(
    commands: Sequence[Sequence[str]],
    env: Mapping[str, str],
    *,
    timeout: float | None = None,
    cwd: str | os.PathLike[str] | None = None,
) -> list[tuple[int, str]]:
  """Runs the commands side by side and waits for all of them.

  Each process's standard output and error are read together. A process
  still running when waiting fails (``timeout`` passed, an interrupt,
  SIGTERM) is sent SIGTERM, and killed if it has not ended 15 seconds
  later, so no worker outlives its job.

  Args:
    commands: one argv per process, all started before any is waited for.
    env: the environment of every process.
    timeout: seconds to wait for each process in turn (``None``: no limit).
    cwd: the processes' working directory (``None``: this one's).

  Returns:
    ``(exit status, output)`` per command, in order.

  Raises:
    subprocess.TimeoutExpired: if a process runs past ``timeout``.
  """
  procs = [
      subprocess.Popen(list(cmd), env=dict(env), cwd=cwd, stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, text=True)
      for cmd in commands
  ]
  logs = []
  try:
    for p in procs:
      logs.append(p.communicate(timeout=timeout)[0])
  finally:
    running = [p for p in procs if p.poll() is None]
    for p in running:
      p.terminate()
    for p in running:
      try:
        p.wait(timeout=_GRACE_S)
      except subprocess.TimeoutExpired:
        p.kill()
        p.wait()
  return [(p.returncode, log) for p, log in zip(procs, logs)]
