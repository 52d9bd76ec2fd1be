"""Tests of the half-precision weight updates on a real task: a digits MLP against float32 master weights."""

from __future__ import annotations

import numpy as np
import pytest

from jmp_train_examples import data as data_lib
from jmp_train_examples import half_weights as experiment
from helpers.low_precision import BF16
from helpers.low_precision import F16


# ---------------------------------------------------------------------------
# The real task: digits MLP, half weights vs float32 master weights.
# ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def digits_results():
  # A small, fast version of benchmarks/bench_half_weights_training.py: same
  # model and data, fewer steps and units. At lr 0.02 most SGD steps are
  # below half an ulp of the bfloat16 weights.
  setups = experiment.make_setups(learning_rate=0.02, half=BF16)
  keep = ["sgd / float32 master", "sgd / bfloat16", "sgd / bfloat16 + kahan", "sgd / bfloat16 + stochastic rounding"]
  setups = {k: setups[k] for k in keep}
  return experiment.run_all(setups, BF16, steps=300, batch_size=32, hidden=32)


def test_digits_half_weights_within_one_percent_of_float32(digits_results):
  ref = digits_results["sgd / float32 master"]
  gap = lambda r: (
    experiment.relative_gap(r.test_loss, ref.test_loss),
    experiment.relative_gap(r.test_accuracy, ref.test_accuracy),
  )
  assert ref.test_accuracy > 0.7  # it did learn (10 classes)
  # Plain bfloat16 weights at this small learning rate miss the 1% criterion.
  plain_loss_gap, plain_acc_gap = gap(digits_results["sgd / bfloat16"])
  assert plain_loss_gap > 0.05 and plain_acc_gap > 0.01, (plain_loss_gap, plain_acc_gap)
  for name in ["sgd / bfloat16 + kahan", "sgd / bfloat16 + stochastic rounding"]:
    loss_gap, acc_gap = gap(digits_results[name])
    assert loss_gap < 0.01 and acc_gap < 0.01, (name, loss_gap, acc_gap)


def _mean_gaps(results, ref_name, names, seeds):
  """Relative gaps of the seed-averaged test loss and accuracy to ref_name."""
  mean = lambda name, field: np.mean([getattr(results[name, s], field) for s in seeds])
  return {
    name: (
      experiment.relative_gap(mean(name, "test_loss"), mean(ref_name, "test_loss")),
      experiment.relative_gap(mean(name, "test_accuracy"), mean(ref_name, "test_accuracy")),
    )
    for name in names
  }


def test_digits_modified_momentum_within_one_percent_in_float16():
  # The criterion for the modified momentum SGD of Micikevicius et al. in
  # float16 (within 1% of float32 master weights),
  # at the benchmark's size (2,000 steps; the benchmark averages 3 seeds,
  # here 2): momentum SGD at lr 0.01, m 0.9, float16 weights.
  g = "momentum sgd"
  names = [
    f"{g} / float32 master",
    f"{g} / float16 plain (H form)",
    f"{g} / float16 + modified momentum (no feedback)",
    f"{g} / float16 + modified momentum (error feedback)",
  ]
  setups = experiment.make_setups(0.01, F16)
  dataset = data_lib.load_digits()
  seeds = (0, 1)
  results = {
    (name, seed): experiment.train_digits(
      setups[name][1], setups[name][0], F16, steps=2000, batch_size=64, hidden=64, seed=seed, dataset=dataset
    )[0]
    for name in names
    for seed in seeds
  }
  assert all(results[names[0], s].test_accuracy > 0.95 for s in seeds)
  gaps = _mean_gaps(results, names[0], names[1:], seeds)
  h_form, plain, feedback = (gaps[n] for n in names[1:])
  assert h_form[0] > 0.02 and plain[0] > 0.02, gaps  # plain half weights miss
  assert feedback[0] < 0.01 and feedback[1] < 0.01, gaps  # the method meets it


def test_digits_modified_momentum_beats_plain_h_form_momentum():
  # The comparison of Micikevicius et al.: float16 weights, momentum in the
  # plain H form (H <- m*H - lr*g, lr*g rounded to float16) against the
  # modified form (G <- m*G + g, step lr*G), both followed by Kahan so that the
  # vanishing of small weight updates (a separate problem) does not hide the
  # buffer's. At lr 1e-4 every lr*g is a float16 subnormal and 10-17% flush
  # to zero.
  setups = experiment.make_momentum_setups(1e-4, 0.99, F16)
  g = "momentum sgd lr=0.0001 m=0.99"
  keep = [
    f"{g} / float32 master",
    f"{g} / float16 plain (H form) + kahan",
    f"{g} / float16 + modified momentum (no feedback) + kahan",
  ]
  results = experiment.run_all({k: setups[k] for k in keep}, F16, steps=1500, batch_size=32, hidden=32)
  ref, plain, modified = (results[k] for k in keep)
  assert ref.test_accuracy > 0.8
  plain_gap = experiment.relative_gap(plain.test_loss, ref.test_loss)
  modified_gap = experiment.relative_gap(modified.test_loss, ref.test_loss)
  assert plain_gap > 0.015, plain_gap
  assert modified_gap < 0.01, modified_gap
  assert experiment.relative_gap(modified.test_accuracy, ref.test_accuracy) < 0.01
