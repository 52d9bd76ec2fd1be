"""A run that cannot learn says so: consecutive skipped steps, in the metrics and the demo."""

import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jmp_train
from jmp_train_examples import cli
from jmp_train_examples import demo_training
from jmp_train_examples.demo_configs import DemoError
from jmp_train_examples.demo_configs import DemoSettings


def _nan_model(variables, x):
  # NaN by itself, whatever the loss scale: every step is skipped.
  return x @ variables["params"]["w"] * jnp.nan


def _linear(variables, x):
  return x @ variables["params"]["w"]


def _mse(out, y):
  return jnp.mean((out - y) ** 2)


def _step(apply_fn, scale=2.0**15):
  return jmp_train.make_train_step(
    apply_fn, _mse, optax.sgd(0.1), policy="mixed_float16", loss_scale=jmp_train.DynamicLossScale(scale)
  )


def _batch(value=1.0):
  return np.full((4, 3), value, np.float32), np.zeros((4, 2), np.float32)


def test_consecutive_skipped_steps_counts_a_model_that_makes_nan():
  step = _step(_nan_model)
  state = step.init({"w": jnp.ones((3, 2))})
  seen = []
  for _ in range(4):
    state, metrics = step(state, _batch())
    seen.append(metrics)
  assert metrics["consecutive_skipped_steps"].dtype == np.int32
  assert metrics["consecutive_skipped_steps"].shape == ()
  assert [int(m["consecutive_skipped_steps"]) for m in seen] == [1, 2, 3, 4]
  assert [int(m["skipped_steps"]) for m in seen] == [1, 2, 3, 4]


def test_consecutive_skipped_steps_resets_after_a_finite_step():
  step = _step(_linear, scale=2.0**4)
  state = step.init({"w": jnp.ones((3, 2))})
  consecutive, total = [], []
  for value in (1.0, np.nan, np.nan, 1.0, np.nan):
    state, metrics = step(state, _batch(value))
    consecutive.append(int(metrics["consecutive_skipped_steps"]))
    total.append(int(metrics["skipped_steps"]))
  assert consecutive == [0, 1, 2, 0, 1]
  assert total == [0, 1, 2, 2, 3]


def test_consecutive_skipped_steps_is_zero_without_loss_scaling():
  step = jmp_train.make_train_step(_nan_model, _mse, optax.sgd(0.1))
  state = step.init({"w": jnp.ones((3, 2))})
  _, metrics = step(state, _batch())
  assert int(metrics["consecutive_skipped_steps"]) == 0


class _Task:
  """The one method of a demo task that the training loop uses."""

  def train_batch(self, i):
    del i
    return _batch()


def test_demo_loop_stops_after_max_skipped_steps():
  step = _step(_nan_model)
  state = step.init({"w": jnp.ones((3, 2))})
  compiled = step.lower(state, _batch()).compile()
  s = DemoSettings(steps=50, max_skipped_steps=20)
  reached = []
  with pytest.raises(DemoError, match=r"'nan-model' cannot learn: the last 20 steps") as e:
    demo_training._train(step, compiled, state, _Task(), s, lambda i, _: reached.append(i), "nan-model")
  assert "--max-skipped-steps 20" in str(e.value)
  assert reached == [10, 20]  # checked when the progress fetches the metrics


def test_demo_loop_runs_on_below_the_limit():
  step = _step(_nan_model)
  state = step.init({"w": jnp.ones((3, 2))})
  compiled = step.lower(state, _batch()).compile()
  s = DemoSettings(steps=10, max_skipped_steps=11)
  state, metrics, _, _ = demo_training._train(step, compiled, state, _Task(), s, lambda i, _: None, "nan-model")
  assert int(metrics["consecutive_skipped_steps"]) == 10 and int(state.step) == 10


def test_max_skipped_steps_flag_reaches_the_settings():
  parser = cli.build_parser()
  settings = cli._settings(parser.parse_args(["--max-skipped-steps", "7"]), parser.config_names)
  assert settings["max_skipped_steps"] == 7
  default = cli._settings(parser.parse_args([]), parser.config_names)
  assert default["max_skipped_steps"] == DemoSettings().max_skipped_steps == 100
  with pytest.raises(cli._UsageError, match="positive integer"):
    parser.parse_args(["--max-skipped-steps", "0"])
