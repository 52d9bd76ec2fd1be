"""The demo resumes from its checkpoints: an interrupted run, rerun, equals an uninterrupted one."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

from jmp_train.examples import cli
from jmp_train.examples import demo_training
from jmp_train.examples.demo_configs import DemoError
from jmp_train.examples.demo_configs import DemoSettings
from jmp_train.examples.demo_tasks import TASKS

pytest.importorskip("orbax.checkpoint")

# Timings differ from run to run; everything else must not.
_TIMINGS = ("steps_per_s", "compile_s")


def _settings(*flags):
  parser = cli.build_parser()
  args = parser.parse_args(["--quick", "--task", "digits", "--no-plot", "--no-progress", *flags])
  return DemoSettings(**cli._settings(args, parser.config_names))  # pylint: disable=protected-access


class _Interrupt(Exception):
  pass


def _interrupt_at(monkeypatch, at):
  check = demo_training._check_skipped  # pylint: disable=protected-access

  def interrupted(metrics, s, name, step):
    check(metrics, s, name, step)
    if step == at:
      raise _Interrupt(name)

  monkeypatch.setattr(demo_training, "_check_skipped", interrupted)


def _assert_same(got, want):
  (row,), curves = got
  (want_row,), want_curves = want
  assert {k: v for k, v in row.items() if k not in _TIMINGS} == {
      k: v for k, v in want_row.items() if k not in _TIMINGS}
  (name,) = curves
  assert curves[name]["loss"] == want_curves[name]["loss"]
  assert curves[name]["loss_scale"] == want_curves[name]["loss_scale"]
  jax.tree.map(np.testing.assert_array_equal, curves[name]["grads"], want_curves[name]["grads"])


@pytest.mark.slow
@pytest.mark.parametrize("name", ["f16-dls", "8dev-1bit"])
def test_an_interrupted_run_resumes_from_its_latest_checkpoint(tmp_path, monkeypatch, name):
  # Checkpoints at steps 4, 8, ...; interrupted at step 10: resumes from 8.
  s = _settings("--checkpoint-dir", str(tmp_path), "--checkpoint-every", "4")
  task = TASKS[s.task](s)
  want = demo_training.run_configs(dataclasses.replace(s, checkpoint_dir=None), [name], task=task)
  with monkeypatch.context() as patch:
    _interrupt_at(patch, 10)
    with pytest.raises(_Interrupt):
      demo_training.run_configs(s, [name], task=task)
  assert sorted(p.name for p in (tmp_path / name).iterdir()) == ["4", "8"]
  _assert_same(demo_training.run_configs(s, [name], task=task), want)
  assert sorted(p.name for p in (tmp_path / name).iterdir()) == ["16", "20"]
  if name == "8dev-1bit":
    return
  # Run again when complete: restored, nothing left to train.
  rows, _ = demo_training.run_configs(s, [name], task=task)
  assert rows[0]["val_loss"] == want[0][0]["val_loss"] and np.isnan(rows[0]["steps_per_s"])
  # Under other settings the checkpoint is refused, not mixed in.
  with pytest.raises(DemoError, match=rf"'{name}' .* other settings \(learning_rate differ\)"):
    demo_training.run_configs(dataclasses.replace(s, learning_rate=0.3), [name], task=task)


def test_checkpoint_flags():
  s = _settings("--checkpoint-dir", "ck")
  assert s.checkpoint_dir == "ck" and s.checkpoint_every == 50
  assert _settings().checkpoint_dir is None
  with pytest.raises(cli._UsageError, match="--checkpoint-every needs --checkpoint-dir"):  # pylint: disable=protected-access
    _settings("--checkpoint-every", "5")
