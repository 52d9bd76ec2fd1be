"""Tests of the half-precision weight updates: invalid arguments.

A step skipped by loss scaling leaves their state alone.
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jmp_train
from helpers.low_precision import F32
from helpers.low_precision import BF16
from helpers.low_precision import F16


# ---------------------------------------------------------------------------
# Bad input.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("momentum", [-0.1, 1.0, 1.5])
def test_bad_momentum(momentum):
  with pytest.raises(ValueError, match=r"momentum must be in \[0, 1\)"):
    jmp_train.modified_momentum_sgd(0.1, momentum)


@pytest.mark.parametrize("learning_rate", [-0.1, 0.0, -1, float("nan"), float("inf"), np.float32(-0.5)])
def test_bad_learning_rate(learning_rate):
  with pytest.raises(ValueError, match=r"learning_rate must be finite and > 0"):
    jmp_train.modified_momentum_sgd(learning_rate)


@pytest.mark.parametrize("learning_rate", ["fast", None])
def test_learning_rate_that_is_no_number(learning_rate):
  with pytest.raises(ValueError, match=r"learning_rate must be a number > 0 or a schedule"):
    jmp_train.modified_momentum_sgd(learning_rate)


@pytest.mark.parametrize("momentum", [-0.5, 1.0, np.float32(1.2)])
def test_bad_momentum_is_named(momentum):
  with pytest.raises(ValueError, match=r"momentum must be in \[0, 1\)"):
    jmp_train.modified_momentum_sgd(0.1, momentum)


def test_schedules_and_injected_rates_are_accepted():
  # A warm-up schedule starting at 0 and an injected (array) rate are fine.
  params = {"w": jnp.ones(3, F16)}
  grads = {"w": jnp.ones(3, F16)}
  warmup = optax.linear_schedule(0.0, 0.1, transition_steps=2)
  for opt in (
    jmp_train.modified_momentum_sgd(warmup),
    optax.inject_hyperparams(jmp_train.modified_momentum_sgd)(learning_rate=warmup),
  ):
    state = opt.init(params)
    step = jax.jit(opt.update)
    moved = []
    for _ in range(3):
      updates, state = step(grads, state, params)
      moved.append(float(jnp.abs(updates["w"].astype(F32)).max()))
    assert moved[0] == 0.0 and moved[1] > 0 and moved[2] > moved[1]


def test_bad_nesterov():
  with pytest.raises(ValueError, match="nesterov"):
    jmp_train.modified_momentum_sgd(0.1, 0.9, nesterov="yes")


def test_bad_error_feedback():
  with pytest.raises(ValueError, match="error_feedback must be True or False, got 'no'"):
    jmp_train.modified_momentum_sgd(0.1, 0.9, error_feedback="no")


def test_plain_rule_needs_no_params():
  opt = jmp_train.modified_momentum_sgd(0.1, error_feedback=False)
  params = jnp.ones(3, F16)
  updates, _ = opt.update(params, opt.init(params))
  assert updates.dtype == F16


@pytest.mark.parametrize(
  "make",
  [jmp_train.kahan_compensation, jmp_train.stochastic_rounding, lambda: jmp_train.modified_momentum_sgd(0.1)],
  ids=["kahan", "stochastic_rounding", "modified_momentum"],
)
def test_params_are_required(make):
  opt = make()
  params = jnp.ones(3, BF16)
  with pytest.raises(ValueError, match="needs the current parameters"):
    opt.update(params, opt.init(params))
  with pytest.raises(ValueError, match="same tree structure"):
    opt.update({"a": params}, opt.init(params), params)


@pytest.mark.parametrize(
  "make",
  [
    lambda: optax.chain(optax.sgd(1e-3), jmp_train.kahan_compensation()),
    lambda: optax.chain(optax.sgd(1e-3), jmp_train.stochastic_rounding(0)),
    lambda: jmp_train.modified_momentum_sgd(1e-3),
    lambda: jmp_train.modified_momentum_sgd(1e-3, error_feedback=False),
  ],
  ids=["kahan", "stochastic_rounding", "modified_momentum", "modified_momentum_plain"],
)
def test_tuple_params_keep_their_structure(make):
  # Parameters that are themselves tuples: each update and state leaf keeps
  # its parameter's shape (a tree of per-leaf pairs is split at the leaves).
  # Shapes and dtypes only: the update is traced, not compiled.
  params = (jnp.ones(3, BF16), jnp.ones((2, 2), BF16))
  opt = make()
  state = opt.init(params)
  updates, new_state = jax.eval_shape(opt.update, params, state, params)
  chex.assert_trees_all_equal_shapes_and_dtypes(updates, params)
  chex.assert_trees_all_equal_shapes_and_dtypes(new_state, state)


@pytest.mark.parametrize("seed", ["0", 1.5, None, jnp.zeros(3, jnp.int32)])
def test_bad_seed(seed):
  with pytest.raises(ValueError, match="seed must be"):
    jmp_train.stochastic_rounding(seed)


def test_seed_forms_agree():
  params = jnp.ones(64, BF16)
  u = jnp.full(64, 1e-3, BF16)
  outs = []
  for seed in (7, jax.random.key(7), jax.random.PRNGKey(7)):
    opt = jmp_train.stochastic_rounding(seed)
    outs.append(np.asarray(opt.update(u, opt.init(params), params)[0].astype(F32)))
  np.testing.assert_array_equal(outs[0], outs[1])
  np.testing.assert_array_equal(outs[0], outs[2])


@pytest.mark.parametrize("dtype", ["int32", "not-a-dtype"])
def test_bad_compensation_dtype(dtype):
  with pytest.raises(ValueError, match="compensation_dtype must be a floating dtype"):
    jmp_train.kahan_compensation(dtype)


def test_float32_compensation_buffer():
  params = {"w": jnp.ones(3, BF16), "step": jnp.zeros((), jnp.int32)}
  opt = jmp_train.kahan_compensation(jnp.float32)
  state = opt.init(params)
  assert state.compensation["w"].dtype == F32
  u = {"w": jnp.full(3, 1e-3, BF16), "step": jnp.ones((), jnp.int32)}
  out, _ = opt.update(u, state, params)
  assert out["step"] is u["step"]  # integer leaves pass through


# ---------------------------------------------------------------------------
# Composition with loss scaling: a skipped step leaves buffers and keys alone.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["kahan", "stochastic_rounding", "modified_momentum"])
def test_skipped_step_leaves_state_untouched(method):
  inner = {
    "kahan": optax.chain(optax.adam(1e-3), jmp_train.kahan_compensation()),
    "stochastic_rounding": optax.chain(optax.sgd(1e-3), jmp_train.stochastic_rounding(seed=2)),
    "modified_momentum": jmp_train.modified_momentum_sgd(1e-3),
  }[method]
  tx = jmp_train.loss_scaled(inner, jmp_train.DynamicLossScale(scale=8.0))
  params = jnp.ones(16, F16)
  update = jax.jit(tx.update)
  state = tx.init(params)
  good = jnp.full(16, 8.0 * 0.3, F16)  # scaled gradients
  u, state = update(good, state, params)
  params = optax.apply_updates(params, u)
  before = state.inner_state
  bad = good.at[3].set(jnp.inf)
  u, skipped = update(bad, state, params)
  np.testing.assert_array_equal(np.asarray(u), np.zeros(16))
  chex.assert_trees_all_equal(skipped.inner_state, before)
  assert not bool(skipped.last_finite)
  # A finite step afterwards does change them.
  _, after = update(good, skipped, params)
  with pytest.raises(AssertionError):
    chex.assert_trees_all_equal(after.inner_state, before)
