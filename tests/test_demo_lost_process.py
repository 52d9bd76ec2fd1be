"""A dead worker process ends a ``--num-processes`` run with a message naming it."""

from __future__ import annotations

import os
import signal
import time

import pytest

from helpers import processes
from jmp_train_examples import demo


def test_a_killed_worker_is_named_not_the_one_that_stopped_after_it(monkeypatch):
  # Process 0 aborted (SIGABRT: jax.distributed found its peer gone);
  # process 1 was killed from outside.
  aborted = "F1127 client.h:80] Terminating process because ... Task 1 heartbeat timeout\n"
  monkeypatch.setattr(demo, "run_processes", lambda commands, env: [(-signal.SIGABRT, aborted), (-signal.SIGKILL, "")])
  with pytest.raises(demo.DemoError) as e:
    demo._run_processes(demo.DemoSettings(num_processes=2), ["8dev-f32"], [])
  assert str(e.value) == ("process 1 of 2 was lost (killed by SIGKILL); the others stopped without it")


def test_a_worker_that_failed_on_its_own_is_reported_with_its_error(monkeypatch):
  monkeypatch.setattr(
    demo, "run_processes", lambda commands, env: [(0, ""), (-signal.SIGABRT, "F1127 x.cc:1] Check failed: bad\n")]
  )
  with pytest.raises(demo.DemoError, match=r"process 1 of 2 failed: F1127 x.cc:1\] Check failed"):
    demo._run_processes(demo.DemoSettings(num_processes=2), ["8dev-f32"], [])


@pytest.mark.slow
@pytest.mark.skipif(not os.path.isdir("/proc"), reason="finds the workers in /proc")
def test_kill_9_of_a_worker_ends_the_run_within_a_minute(tmp_path, tmp_path_factory):
  ckpt = tmp_path / "ckpt"
  # Far more steps than run before the kill; as many as test_demo_faults.py's runs
  # take, so that the compiled step comes from the cache they share.
  launcher = processes.start_demo(
    "--steps",
    "3000",
    "--checkpoint-dir",
    str(ckpt),
    "--checkpoint-every",
    "1",
    "--out",
    str(tmp_path / "out"),
    cache=processes.demo_cache(tmp_path_factory),
  )
  workers = {}
  try:
    # Training has begun once a checkpoint is written.
    workers = processes.wait_for_training(launcher, ckpt, timeout=240)
    victim = workers[1]
    os.kill(victim, signal.SIGKILL)
    killed_at = time.monotonic()
    _, err = launcher.communicate(timeout=90)
    elapsed = time.monotonic() - killed_at
  finally:
    for pid in [*workers.values(), launcher.pid]:
      try:
        os.kill(pid, signal.SIGKILL)
      except (ProcessLookupError, PermissionError):
        pass
    launcher.wait()
  assert launcher.returncode == 1
  assert elapsed < 60, elapsed
  assert err.strip().splitlines()[-1] == (
    "jmp-train: error: process 1 of 2 was lost (killed by SIGKILL); the others stopped without it"
  ), err[-2000:]
