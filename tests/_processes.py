"""Launches a test's worker script in several processes on loopback."""

from __future__ import annotations

import os
import pathlib
import re
import socket
import subprocess
import sys

HERE = pathlib.Path(__file__).parent


def free_port() -> int:
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def worker_env() -> dict[str, str]:
  """This process's environment for a worker that sets its own device count.

  ``XLA_FLAGS`` is passed on without the simulated device count, so that
  the workers compile as the test process does (see ``conftest.py``): a
  result compared bit for bit with one computed here must come from the
  same compiler settings.
  """
  env = dict(os.environ)
  flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", env.get("XLA_FLAGS", ""))
  env["XLA_FLAGS"] = " ".join(flags.split())
  env["PYTHONPATH"] = os.pathsep.join([str(HERE.parent), env.get("PYTHONPATH", "")])
  return env


def run_workers(script: str, argv_per_process: list[list[str]], timeout: float) -> None:
  """Runs ``tests/<script>`` once per argv (``{port}`` filled in); asserts all exit 0.

  The workers add their own device count to ``XLA_FLAGS`` (see
  :func:`worker_env`) and import the repository's packages. A worker still
  running after ``timeout`` seconds, or after another failed, is killed.
  """
  port = str(free_port())
  env = worker_env()
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
