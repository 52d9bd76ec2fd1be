"""Launches a test's worker script in several processes on loopback."""

from __future__ import annotations

import os
import pathlib
import re
import sys

from jmp_train_examples.processes import free_port, run_processes

HERE = pathlib.Path(__file__).parent  # tests/helpers: the worker scripts


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
  env["PYTHONPATH"] = os.pathsep.join([str(HERE.parents[1]), env.get("PYTHONPATH", "")])
  return env


def run_workers(script: str, argv_per_process: list[list[str]], timeout: float) -> None:
  """Runs ``tests/<script>`` once per argv (``{port}`` filled in); asserts all exit 0.

  The workers add their own device count to ``XLA_FLAGS`` (see
  :func:`worker_env`) and import the repository's packages. A worker still
  running after ``timeout`` seconds, or after another failed, is killed.
  """
  port = str(free_port())
  commands = [[sys.executable, str(HERE / script), *(a.format(port=port) for a in argv)] for argv in argv_per_process]
  for code, log in run_processes(commands, worker_env(), timeout=timeout):
    assert code == 0, log[-4000:]


def worker_pids(marker: str) -> dict[int, int]:
  """``{process index: pid}`` of the demo's workers whose command line holds ``marker``."""
  pids = {}
  for entry in pathlib.Path("/proc").iterdir():
    if not entry.name.isdigit():
      continue
    try:
      argv = (entry / "cmdline").read_bytes().split(b"\0")
    except OSError:
      continue
    if b"--_process" in argv and marker.encode() in argv:
      index = int(argv[argv.index(b"--_process") + 1].split(b",")[0])
      pids[index] = int(entry.name)
  return pids
