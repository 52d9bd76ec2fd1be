"""Launches a test's worker script in several processes on loopback."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys
import time

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


def demo_cache(tmp_path_factory) -> pathlib.Path:
  """A JAX compilation cache for the demo's processes, shared by the tests of one pytest process.

  The ``jmp-train`` runs the tests start compile the same programs (the
  digits MLP's 8-device step in each worker, its initialization in each
  launcher): each later run reads them from the cache. One cache per pytest
  process (per pytest-xdist worker): its tests run one after another, so
  that no run reads an entry another is still writing (JAX writes them in
  place).
  """
  return tmp_path_factory.getbasetemp() / "jmp_train_demo_jax_cache"


def with_cache(env: dict[str, str], cache: pathlib.Path | None) -> dict[str, str]:
  """``env`` with JAX's persistent compilation cache in ``cache`` (every program, however quick to compile).

  A cache the user set (``JAX_COMPILATION_CACHE_DIR``) is kept.
  """
  if cache is not None and not env.get("JAX_COMPILATION_CACHE_DIR"):
    env["JAX_COMPILATION_CACHE_DIR"] = str(cache)
    env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
  return env


def start_demo(*flags: str, tmp: pathlib.Path | None = None, cache: pathlib.Path | None = None) -> subprocess.Popen:
  """``jmp-train --quick --task digits --configs 8dev-f32 --num-processes 2 FLAGS``, started.

  As a user starts it (``python -m jmp_train_examples``, from the repository
  root, on the CPU), its output piped. With ``tmp``, the launcher's folder
  for its workers goes under ``tmp/tmp``; with ``cache``, its processes
  share that compilation cache (:func:`with_cache`).
  """
  env = with_cache(worker_env(), cache)
  env["JAX_PLATFORMS"] = "cpu"
  if tmp is not None:
    env["TMPDIR"] = str(tmp / "tmp")
    (tmp / "tmp").mkdir(exist_ok=True)
  quick = ["--quick", "--task", "digits", "--no-progress", "--no-plot", "--configs", "8dev-f32", "--num-processes", "2"]
  return subprocess.Popen(
    [sys.executable, "-m", "jmp_train_examples", *quick, *flags],
    cwd=HERE.parents[1],
    env=env,
    stdout=subprocess.PIPE,
    stderr=subprocess.PIPE,
    text=True,
  )


def wait_for_training(launcher: subprocess.Popen, ckpt: pathlib.Path, timeout: float = 150) -> dict[int, int]:
  """Waits for the demo's first checkpoint in ``ckpt`` (training has begun); returns its workers' pids."""
  deadline = time.monotonic() + timeout
  while not any(p.name.isdigit() for p in ckpt.glob("8dev-f32/*")):
    assert launcher.poll() is None, launcher.communicate()
    assert time.monotonic() < deadline, "no checkpoint written"
    time.sleep(0.05)
  workers = worker_pids(str(ckpt))
  assert len(workers) == 2, workers
  return workers
