"""Launches a test's worker script in several processes on loopback."""

from __future__ import annotations

import os
import pathlib
import socket
import subprocess
import sys

HERE = pathlib.Path(__file__).parent


def free_port() -> int:
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def run_workers(script: str, argv_per_process: list[list[str]], timeout: float) -> None:
  """Runs ``tests/<script>`` once per argv (``{port}`` filled in); asserts all exit 0.

  The workers set their own device count (``XLA_FLAGS`` is not passed on)
  and import the repository's packages. A worker still running after
  ``timeout`` seconds, or after another failed, is killed.
  """
  port = str(free_port())
  env = dict(os.environ)
  env.pop("XLA_FLAGS", None)
  env["PYTHONPATH"] = os.pathsep.join([str(HERE.parent), env.get("PYTHONPATH", "")])
  procs = [
      subprocess.Popen(
          [sys.executable, str(HERE / script), *(a.format(port=port) for a in argv)],
          env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
      )
      for argv in argv_per_process
  ]
  logs = []
  try:
    for p in procs:
      logs.append(p.communicate(timeout=timeout)[0])
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
        p.wait()
  for p, log in zip(procs, logs):
    assert p.returncode == 0, log[-4000:]
