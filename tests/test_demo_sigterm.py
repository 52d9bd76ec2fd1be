"""SIGTERM stops the demo at a safe point: never inside a checkpoint save."""

from __future__ import annotations

import os
import signal

import pytest

from jmp_train_examples import demo
from jmp_train_examples import stopping


def _sigterm_self():
  os.kill(os.getpid(), signal.SIGTERM)


def test_sigterm_raises_terminated_while_the_demo_runs_and_not_after():
  before = signal.getsignal(signal.SIGTERM)
  with pytest.raises(stopping.Terminated):
    with stopping.sigterm_unwinds():
      _sigterm_self()
      for _ in range(100_000):  # Python runs the handler between bytecodes
        pass
      raise AssertionError("SIGTERM did not raise")
  assert signal.getsignal(signal.SIGTERM) is before


def test_a_sigterm_inside_deferred_is_raised_when_the_block_ends():
  done = []
  with pytest.raises(stopping.Terminated):
    with stopping.sigterm_unwinds():
      with stopping.deferred():
        with stopping.deferred():  # nested: held until the outer block ends
          _sigterm_self()
          for _ in range(1000):  # Python runs the handler between bytecodes
            done.append(None)
        done.append("inner block finished")
      done.append("never reached")
  assert done[-1] == "inner block finished"


def test_sigterm_unwinds_is_inactive_in_a_worker_process():
  before = signal.getsignal(signal.SIGTERM)
  with stopping.sigterm_unwinds(active=False):
    assert signal.getsignal(signal.SIGTERM) is before


def test_preempted_is_false_outside_a_multi_process_job():
  assert not stopping.preempted(1)


def test_workers_that_stopped_on_sigterm_make_the_launcher_stop_too(monkeypatch):
  # Every worker saved the step they agreed on and exited with 128 + SIGTERM
  # (or had already finished).
  monkeypatch.setattr(
    demo, "run_processes", lambda commands, env: [(128 + signal.SIGTERM, "jmp-train: terminated (SIGTERM)\n"), (0, "")]
  )
  with pytest.raises(stopping.Terminated):
    demo._run_processes(demo.DemoSettings(num_processes=2), ["8dev-f32"], [])
