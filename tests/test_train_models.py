"""make_train_step with NNX modules, linen modules, and the errors a newcomer meets."""

from __future__ import annotations

import functools
import warnings

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jmp_train


class _NnxNet(nnx.Module):
  """Linear -> BatchNorm -> ReLU -> Dropout -> Linear."""

  def __init__(self, rngs: nnx.Rngs):
    self.dense1 = nnx.Linear(6, 16, rngs=rngs)
    self.norm = nnx.BatchNorm(16, momentum=0.9, rngs=rngs)
    self.dropout = nnx.Dropout(0.25, rngs=rngs)
    self.dense2 = nnx.Linear(16, 4, rngs=rngs)

  def __call__(self, x):
    return self.dense2(self.dropout(nnx.relu(self.norm(self.dense1(x)))))


def _xent(logits, labels):
  return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def _batch(i, n=16):
  rng = np.random.default_rng(i)
  y = rng.integers(0, 4, n).astype(np.int32)
  x = rng.normal(size=(n, 6)).astype(np.float32) + np.eye(4, 6, dtype=np.float32)[y]
  return x, y


def _run(step, state, steps):
  losses = []
  for i in range(steps):
    state, metrics = step(state, step.shard_batch(_batch(i)))
    jax.block_until_ready(state)
    losses.append(float(metrics["loss"]))
  return state, losses


@pytest.mark.parametrize("mode", ["single", "pmap", "shard_map"])
def test_nnx_module_with_batch_norm_and_dropout(mode):
  model = _NnxNet(nnx.Rngs(0, dropout=1))
  mean_before = np.asarray(model.norm.mean[...])
  step = jmp_train.make_train_step(model, _xent, optax.sgd(0.1), policy="mixed_bfloat16", mode=mode)
  state = step.init(model)
  state, losses = _run(step, state, 4)
  assert all(np.isfinite(losses))
  # Parameters stay float32 masters; the batch statistics moved and stay float32.
  assert {np.dtype(x.dtype) for x in jax.tree.leaves(state.params)} == {np.dtype(jnp.float32)}
  trained = step.to_nnx(state)
  assert isinstance(trained, _NnxNet)
  assert trained.norm.mean[...].dtype == jnp.float32
  assert not np.allclose(np.asarray(trained.norm.mean[...]), mean_before)
  # The dropout stream advanced once per step and keeps a typed key.
  assert int(trained.dropout.rngs.count[...]) == 4
  assert jnp.issubdtype(trained.dropout.rngs.key[...].dtype, jax.dtypes.prng_key)
  if mode != "single":
    for stat in jax.tree.leaves(state.model_state):
      stat = np.asarray(stat)
      np.testing.assert_array_equal(stat, np.broadcast_to(stat[0], stat.shape))
  # Evaluation runs the module in eval mode: no dropout, running statistics.
  first = step.evaluate(state, step.shard_batch(_batch(9)))
  second = step.evaluate(state, step.shard_batch(_batch(9)))
  assert float(first["loss"]) == float(second["loss"])
  nnx.update(model, nnx.state(trained))
  np.testing.assert_array_equal(np.asarray(model.norm.mean[...]), np.asarray(trained.norm.mean[...]))


def test_nnx_dropout_masks_differ_between_steps_and_replicas():
  # Two replicas fed the same examples see different dropout masks, so the
  # averaged gradient differs from the one-device gradient of the same batch.
  model = nnx.Sequential(nnx.Linear(6, 4, rngs=nnx.Rngs(0)), nnx.Dropout(0.5, rngs=nnx.Rngs(dropout=3)))
  single = jmp_train.make_train_step(model, _xent, optax.sgd(0.0))
  state = single.init(model)
  x, y = _batch(0, n=8)
  losses = []
  for _ in range(2):
    state, metrics = single(state, (x, y))
    losses.append(float(metrics["loss"]))
  assert losses[0] != losses[1]  # a new mask each step (sgd(0.0): same params)
  parallel = jmp_train.make_train_step(model, _xent, optax.sgd(0.0), mode="pmap")
  pstate = parallel.init(model)
  tiled = (np.tile(x[:1], (8, 1)), np.tile(y[:1], 8))
  _, metrics = parallel(pstate, parallel.shard_batch(tiled))
  one = single.init(model)
  _, reference = single(one, (x[:1], y[:1]))
  assert float(metrics["loss"]) != pytest.approx(float(reference["loss"]), abs=0)


def test_linen_module_stands_for_its_apply():
  model = nn.Dense(4)
  params = model.init(jax.random.PRNGKey(0), jnp.ones((1, 6)))["params"]
  by_module = jmp_train.make_train_step(model, _xent, optax.sgd(0.1))
  by_apply = jmp_train.make_train_step(model.apply, _xent, optax.sgd(0.1))
  a, _ = _run(by_module, by_module.init(params), 2)
  b, _ = _run(by_apply, by_apply.init(params), 2)
  chex.assert_trees_all_equal(a.params, b.params)


@pytest.mark.parametrize(
  "batch, expected",
  [
    ({"x": np.ones((4, 6)), "y": np.zeros(4)}, "got a dict with keys \\['x', 'y'\\]"),
    ((np.ones((4, 6)),), "got a tuple of length 1"),
    (np.ones((4, 6)), "got a single array of shape \\(4, 6\\)"),
  ],
)
def test_a_batch_that_is_not_a_pair_names_what_was_given(batch, expected):
  step = jmp_train.make_train_step(nn.Dense(4), _xent, optax.sgd(0.1))
  state = step.init(nn.Dense(4).init(jax.random.PRNGKey(0), jnp.ones((1, 6)))["params"])
  with pytest.raises(TypeError, match=f"tuple \\(inputs, targets\\), {expected}"):
    step(state, batch)
  with pytest.raises(TypeError, match="tuple \\(inputs, targets\\)"):
    step.evaluate(state, batch)


@pytest.mark.parametrize(
  "kwargs, message",
  [
    ({"optimizer": optax.sgd}, "optimizer must be an optax.GradientTransformation.*'sgd' looks like a factory"),
    ({"optimizer": "sgd"}, "optimizer must be an optax.GradientTransformation, got str"),
    ({"optimizer": None}, "optimizer must be an optax.GradientTransformation, got NoneType"),
    ({"loss_fn": "mse"}, "loss_fn must be callable"),
    ({"apply_fn": {"params": 1}}, "apply_fn must be callable"),
    ({"compression": optax.sgd, "mode": "pmap"}, "compression must be"),
    (
      {"optimizer": jmp_train.one_bit_adam(1e-3, axis_name="batch", warmup_steps=2), "mode": "shard_map"},
      "complete optimizer on local gradients .* pass it as compression=, with optimizer=None",
    ),
    ({"optimizer": jmp_train.one_bit_momentum(0.1, axis_name="batch"), "mode": "pmap"}, "pass it as compression="),
    (
      {"optimizer": jmp_train.sign_compression("batch"), "mode": "shard_map"},
      "compressor of local gradients .* pass it as compression=, and an optax optimizer",
    ),
    ({"optimizer": jmp_train.compressed_mean("batch"), "mode": "shard_map"}, "pass it as compression="),
  ],
)
def test_bad_arguments_raise_type_error_at_construction(kwargs, message):
  arguments = {"apply_fn": nn.Dense(4).apply, "loss_fn": _xent, "optimizer": optax.sgd(0.1)}
  arguments.update(kwargs)
  with pytest.raises(TypeError, match=message):
    jmp_train.make_train_step(
      arguments.pop("apply_fn"), arguments.pop("loss_fn"), arguments.pop("optimizer"), **arguments
    )


def test_float16_compute_without_a_loss_scale_warns_once_at_construction():
  make = functools.partial(jmp_train.make_train_step, nn.Dense(4).apply, _xent, optax.sgd(0.1))
  with pytest.warns(UserWarning, match="float16 compute without loss scaling") as record:
    make(policy="mixed_float16")
  assert len(record) == 1 and "DynamicLossScale" in str(record[0].message)
  assert record[0].filename == __file__  # the warning points at the user's call
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    make(policy="mixed_float16", loss_scale=jmp_train.DynamicLossScale(2.0**15))
    make(policy="mixed_bfloat16")
    # float16 weights with a plain optax.sgd warn on their own (tests/test_user_errors.py).
    warnings.filterwarnings("ignore", "Half-precision parameters", UserWarning)
    make(policy="params=float16,compute=float32,output=float32")
