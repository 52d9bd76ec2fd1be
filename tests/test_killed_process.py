"""A process killed in a two-process run: the other stops with a message, a restart continues bit for bit.

Two processes (gloo on 127.0.0.1, one CPU device each) train with
``one_bit_adam`` under ``mixed_float16`` and dynamic loss scaling
(``tests/helpers/fault_worker.py``), checkpointing every 10 of 40 steps. One
process is killed with SIGKILL; the survivor must exit non-zero within a
minute, naming the lost process; the restarted job resumes from the latest
complete checkpoint and ends with the state of an uninterrupted run, every
leaf of every replica bit for bit: the error-feedback residuals, the loss
scale and its counters included. The uninterrupted run is computed here,
on two of this process's devices: with two replicas every float reduction
is one addition, so it adds as the two processes do.
"""

from __future__ import annotations

import concurrent.futures
import os
import pathlib
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from helpers import fault_worker
from helpers import processes

ocp = pytest.importorskip("orbax.checkpoint")

HERE = pathlib.Path(__file__).parent
_LOST = "The following tasks are unhealthy (stopped sending heartbeats):\n1\n"


def _start(tmp, *flags_per_process):
  """Starts the two workers; ``flags_per_process[pid]`` are process ``pid``'s extra flags."""
  env = processes.worker_env()
  env["JAX_PLATFORMS"] = "cpu"
  port = str(processes.free_port())
  return [
    subprocess.Popen(
      [sys.executable, str(HERE / "helpers" / "fault_worker.py"), str(pid), "2", port, str(tmp), *flags],
      env=env,
      stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT,
      text=True,
    )
    for pid, flags in enumerate(flags_per_process)
  ]


def _kill_left(procs):
  for p in procs:
    if p.poll() is None:
      p.kill()
      p.wait()


def _finish(procs, timeout=180):
  """Waits for the processes; returns ``[(exit status, output)]`` (kills the ones left)."""
  try:
    logs = [p.communicate(timeout=timeout)[0] for p in procs]
    return [(p.returncode, log) for p, log in zip(procs, logs)]
  finally:
    _kill_left(procs)


def _states(tmp):
  """The replicas the two processes wrote, in one dict."""
  return {**np.load(tmp / "state0.npz"), **np.load(tmp / "state1.npz")}


def _uninterrupted():
  """The same 40 steps in this process, on 2 devices: every replica's state."""
  mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:2]), ("batch",))
  step = fault_worker.make_step(mesh)
  state = step.init(fault_worker.params())
  for i in range(fault_worker.STEPS):
    shares = [fault_worker.batch(i, pid, 2) for pid in range(2)]
    batch = tuple(np.concatenate(parts) for parts in zip(*shares))
    state, _ = step(state, step.shard_batch(batch))
  return fault_worker.local_replicas(state)


def _assert_bit_for_bit(got, want):
  assert sorted(got) == sorted(want)
  for key in want:
    assert got[key].dtype == want[key].dtype, key
    np.testing.assert_array_equal(got[key], want[key], err_msg=key)


def _wait_survivor(survivor, since):
  log = survivor.communicate(timeout=90)[0]
  return survivor.returncode, time.monotonic() - since, log


def _wait_for_death_then_survivor(procs):
  """Waits for ``procs[1]`` to kill itself, then for the survivor ``procs[0]``."""
  assert procs[1].wait(timeout=180) == -signal.SIGKILL, _finish(procs, 5)
  return _wait_survivor(procs[0], time.monotonic())


def _check_uninterrupted(want):
  # The state carries what must come back: per-replica residuals, the scale.
  keys = sorted(want)
  assert any("worker_residual" in k for k in keys) and any("server_residual" in k for k in keys)
  assert any("loss_scale.counter" in k for k in keys) and any("total_notfinite" in k for k in keys)
  assert sorted({k.rsplit("@", 1)[1] for k in keys}) == ["0", "1"]
  # The run was not trivial: the scale moved and some steps were skipped.
  assert want[".opt_state.loss_scale.loss_scale@0"].item() != 2.0**14
  assert want[".opt_state.total_notfinite@0"].item() > 0


@pytest.mark.slow
def test_a_killed_process_stops_the_other_and_a_restart_continues_bit_for_bit(tmp_path):
  # The restart reads the programs the killed runs compiled from a cache.
  cache = ["--compilation-cache", str(tmp_path / "jax_cache")]

  # Side by side:
  # 1. save_checkpoint every 10 steps; kill -9 of process 1 after step 25.
  # 2. CheckpointManager, asynchronous saves; process 1 is killed while its
  #    save of step 30 is in flight: the half-written step is ignored.
  files, manager = tmp_path / "files", tmp_path / "manager"
  files.mkdir()
  manager.mkdir()
  procs = {
    "files": _start(files, ["--stop-after", "25", *cache], ["--stop-after", "25", *cache]),
    "manager": _start(
      manager, ["--checkpointer", "manager", *cache], ["--checkpointer", "manager", "--die-in-save", "30", *cache]
    ),
  }
  try:
    deadline = time.monotonic() + 180
    while not (files / "at25.1").exists():
      assert procs["files"][1].poll() is None and time.monotonic() < deadline, _finish(procs["files"], 5)
      time.sleep(0.1)
    os.kill(procs["files"][1].pid, signal.SIGKILL)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
      waits = [
        pool.submit(_wait_survivor, procs["files"][0], time.monotonic()),
        pool.submit(_wait_for_death_then_survivor, procs["manager"]),
      ]
      # While the survivors wait out their heartbeat timeout: the same 40
      # steps in this process.
      want = _uninterrupted()
      files_survivor, manager_survivor = (w.result() for w in waits)
  finally:
    for p in procs.values():
      _kill_left(p)
  _check_uninterrupted(want)
  for (code, waited, log), lost in ((files_survivor, _LOST), (manager_survivor, None)):
    assert code != 0 and waited < 60, (code, waited, log[-3000:])
    # Names process 1 (or, when the save's barrier times out first, says so).
    assert _LOST in log or (lost is None and "async_write_complete" in log), log[-3000:]
  assert sorted(p.name for p in (files / "ckpt").iterdir()) == ["10", "20"]
  names = sorted(p.name for p in (manager / "ckpt").iterdir())
  assert "30" not in names and any(n.startswith("30.") for n in names), names
  with ocp.CheckpointManager(manager / "ckpt") as m:
    assert m.latest_step() == 20

  # One restarted job resumes both folders, one after the other: each from
  # step 20, each ending as the uninterrupted run did.
  restart = ["--dump", "--then", str(manager), "manager", *cache]
  for code, log in _finish(_start(files, restart, restart)):
    assert code == 0, log[-3000:]
    assert "files: starting at step 20" in log and "manager: starting at step 20" in log, log[-3000:]
  _assert_bit_for_bit(_states(files), want)
  _assert_bit_for_bit(_states(manager), want)
  assert "40" in os.listdir(manager / "ckpt")
