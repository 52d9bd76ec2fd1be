"""The demo resumes from its checkpoints: a stopped or killed run, rerun, equals an uninterrupted one."""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from jmp_train_examples import cli
from jmp_train_examples import demo_training
from jmp_train_examples.demo_configs import DemoError
from jmp_train_examples.demo_configs import DemoSettings
from jmp_train_examples.demo_tasks import TASKS

from helpers import processes

pytest.importorskip("orbax.checkpoint")

ROOT = pathlib.Path(__file__).resolve().parents[1]

# Timings differ from run to run; everything else must not.
_TIMINGS = ("steps_per_s", "compile_s")


def _settings(*flags):
  parser = cli.build_parser()
  args = parser.parse_args(["--quick", "--task", "digits", "--no-plot", "--no-progress", *flags])
  return DemoSettings(**cli._settings(args, parser.config_names))


def test_checkpoint_flags():
  s = _settings("--checkpoint-dir", "ck")
  assert s.checkpoint_dir == "ck" and s.checkpoint_every == 50
  assert _settings().checkpoint_dir is None
  with pytest.raises(cli._UsageError, match="--checkpoint-every needs --checkpoint-dir"):
    _settings("--checkpoint-every", "5")


def _steps_saved(directory: pathlib.Path) -> list[int]:
  return sorted(int(p.name) for p in directory.glob("*") if p.name.isdigit())


def _interrupt(command, directory, after, sig, env):
  """Runs ``command`` until a checkpoint past step ``after`` is written, then sends ``sig``."""
  proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  try:
    deadline = time.monotonic() + 240
    while not [n for n in _steps_saved(directory) if n > after]:
      assert proc.poll() is None, proc.communicate()
      assert time.monotonic() < deadline, "no checkpoint written"
      time.sleep(0.05)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=120)
  finally:
    if proc.poll() is None:
      proc.kill()
      proc.wait()
  return proc.returncode, err


def _env(cache):
  # The runs of one command compile the same programs: the later ones read them from the cache.
  env = processes.with_cache(processes.worker_env(), cache)
  env["JAX_PLATFORMS"] = "cpu"
  return env


@pytest.mark.slow
def test_jmp_train_stopped_by_sigterm_then_sigkill_resumes_to_the_uninterrupted_results(tmp_path):
  """``jmp-train`` itself, on the dynamic-loss-scaling row (its scale and counters).

  SIGTERM unwinds: the save in flight completes, the exit status is 143 and
  the message says how to resume. SIGKILL ends the process at once (a save
  may be half written). The same command run again then finishes with the
  uninterrupted run's row and curves.
  """
  name = "f16-dls"
  flags = ["--configs", name, "--steps", "100", "--checkpoint-dir", str(tmp_path / "ckpt"), "--checkpoint-every", "5"]
  s = _settings(*flags)
  want = demo_training.run_configs(dataclasses.replace(s, checkpoint_dir=None), [name], task=TASKS[s.task](s))
  command = [
    sys.executable,
    "-m",
    "jmp_train_examples",
    "--quick",
    "--task",
    "digits",
    "--no-plot",
    "--no-progress",
    *flags,
    "--out",
    str(tmp_path / "out"),
  ]
  directory = tmp_path / "ckpt" / name
  env = _env(tmp_path / "jax_cache")

  code, err = _interrupt(command, directory, 10, signal.SIGTERM, env)
  assert code == 128 + signal.SIGTERM, err[-3000:]
  assert err.strip().splitlines()[-1] == (
    "jmp-train: terminated (SIGTERM); run the same command again to resume from the latest checkpoint"
  )
  # Nothing half written: the save in flight was completed.
  assert all(p.name.isdigit() for p in directory.iterdir()), os.listdir(directory)
  resumed_from = _steps_saved(directory)[-1]
  assert 10 < resumed_from < 100

  code, err = _interrupt(command, directory, resumed_from + 10, signal.SIGKILL, env)
  assert code == -signal.SIGKILL, err[-3000:]

  done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240, check=False)
  assert done.returncode == 0, done.stderr[-3000:]
  payload = json.loads((tmp_path / "out" / "results.json").read_text())
  (row,) = payload["rows"]
  (want_row,), want_curves = want
  assert {k: row[k] for k in want_row if k not in _TIMINGS} == {k: v for k, v in want_row.items() if k not in _TIMINGS}
  assert payload["curves"][name]["loss"] == want_curves[name]["loss"]
  assert payload["curves"][name]["loss_scale"] == want_curves[name]["loss_scale"]
  # The last two checkpoints are kept.
  assert _steps_saved(directory) == [95, 100]

  # Run again when complete: restored, nothing left to train.
  rows, _ = demo_training.run_configs(s, [name], task=TASKS[s.task](s))
  assert rows[0]["val_loss"] == want_row["val_loss"] and np.isnan(rows[0]["steps_per_s"])
  # Under other settings the checkpoint is refused, not mixed in.
  with pytest.raises(DemoError, match=rf"'{name}' .* other settings \(learning_rate differ\)"):
    demo_training.run_configs(dataclasses.replace(s, learning_rate=0.3), [name], task=TASKS[s.task](s))
