"""The digits experiment's shared program: several setups trained in one compiled loop."""

from __future__ import annotations

import numpy as np

from jmp_train_examples import data as data_lib
from jmp_train_examples import half_weights as experiment
from helpers.low_precision import BF16


def test_train_digits_together_equals_one_setup_at_a_time():
  # One loop that steps every setup side by side gives each the results it
  # gets alone, bit for bit, for seeds that reuse the compiled program.
  setups = experiment.make_setups(0.05, BF16)
  setups = {name: setups[name] for name in ("sgd / float32 master", "momentum sgd / bfloat16 plain (H form)")}
  dataset = data_lib.load_digits()
  kwargs = dict(steps=20, batch_size=16, hidden=8, dataset=dataset, log_every=5)
  for seed in (0, 1):
    together = experiment.train_digits_together(setups, BF16, seed=seed, **kwargs)
    assert list(together) == list(setups)
    for name, (dtype, opt) in setups.items():
      alone, curve = experiment.train_digits(opt, dtype, BF16, seed=seed, **kwargs)
      assert together[name][0] == alone, (name, seed)
      assert curve.shape == (4,) and np.array_equal(together[name][1], curve), (name, seed)
  # The two setups did train differently (float32 and bfloat16 weights).
  assert together["sgd / float32 master"][0] != together["momentum sgd / bfloat16 plain (H form)"][0]
