"""Tests of the half-precision weight updates across execution modes.

Dtype stability, jit/pmap, injected hyperparameters, strict promotion.
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
from helpers.low_precision import ALL_DTYPES
from helpers.low_precision import _run


# ---------------------------------------------------------------------------
# Dtype stability across execution modes.
# ---------------------------------------------------------------------------


def _three_methods(lr=1e-2):
  return {
    "modified_momentum": jmp_train.modified_momentum_sgd(lr, 0.9),
    "kahan": optax.chain(optax.sgd(lr, 0.5), jmp_train.kahan_compensation()),
    "stochastic_rounding": optax.chain(optax.sgd(lr), jmp_train.stochastic_rounding(seed=1)),
  }


class TestDtypeStability(chex.TestCase):
  @chex.variants(with_jit=True, without_jit=True, with_pmap=True)
  def test_state_and_updates_keep_dtypes(self):
    # One tree with a leaf per dtype: one trace per variant covers all three.
    names = {F32: "f32", BF16: "bf16", F16: "f16"}
    params = {names[d]: {"w": jnp.full((2, 3), 0.5, d), "b": jnp.zeros(3, d)} for d in ALL_DTYPES}
    grads = jax.tree.map(lambda p: jnp.full_like(p, 0.25), params)
    opts = _three_methods()

    @self.variant(n_devices=2)  # with_pmap: two replicas show the dtypes
    def two_steps(params, grads):
      out = {}
      for name, opt in opts.items():
        state0 = opt.init(params)
        u, state = opt.update(grads, state0, params)
        p = optax.apply_updates(params, u)
        u, state = opt.update(grads, state, p)
        out[name] = (state0, state, u, optax.apply_updates(p, u))
      return out

    out = two_steps(params, grads)
    for name, (state0, state, u, p) in out.items():
      chex.assert_trees_all_equal_shapes_and_dtypes(state0, state)
      chex.assert_trees_all_equal_shapes_and_dtypes(u, grads)
      chex.assert_trees_all_equal_shapes_and_dtypes(p, params)
      chex.assert_tree_all_finite(p)
      for d in ALL_DTYPES:
        # The weights moved (steps of ~2.5e-3; half an ulp below 0.5 is
        # 9.8e-4 in bfloat16).
        moved = jnp.abs(p[names[d]]["w"].astype(F32) - 0.5).min()
        assert float(moved) > 0, (name, d)
    mm_state = out["modified_momentum"][1]
    assert isinstance(mm_state, jmp_train.ModifiedMomentumState)
    assert mm_state.count.dtype == jnp.int32 and int(mm_state.count) == 2
    # One momentum buffer per parameter, in the parameter's shape and dtype.
    chex.assert_trees_all_equal_shapes_and_dtypes(mm_state.momentum, params)
    kahan_state = out["kahan"][1][1]
    srd_state0, srd_state = (s[1] for s in out["stochastic_rounding"][:2])
    for d in ALL_DTYPES:
      assert mm_state.momentum[names[d]]["w"].dtype == d
      assert kahan_state.compensation[names[d]]["w"].dtype == d
    # The state is the raw key data of the seed, split once per step.
    assert isinstance(srd_state, jmp_train.StochasticRoundingState)
    assert srd_state.key.dtype == jnp.uint32 and srd_state.key.shape == (2,)
    seed_key = jax.random.key(1)
    np.testing.assert_array_equal(srd_state0.key, jax.random.key_data(seed_key))
    twice = jax.random.split(jax.random.split(seed_key)[0])[0]
    np.testing.assert_array_equal(srd_state.key, jax.random.key_data(twice))


@pytest.mark.parametrize("nesterov", [False, True])
def test_modified_momentum_equals_optax_sgd_in_float32(nesterov):
  schedule = optax.linear_schedule(0.1, 0.01, transition_steps=4)
  params = jnp.asarray([1.0, -2.0, 3.0], F32)
  grads = jnp.asarray(np.random.default_rng(0).normal(size=(6, 3)), F32)
  ours, state = _run(jmp_train.modified_momentum_sgd(schedule, 0.8, nesterov=nesterov), params, grads)
  ref, _ = _run(optax.sgd(schedule, 0.8, nesterov=nesterov), params, grads)
  np.testing.assert_allclose(np.asarray(ours), np.asarray(ref), rtol=1e-6)
  assert state.count.dtype == jnp.int32 and int(state.count) == 6


def test_stochastic_rounding_keeps_replicas_identical(num_devices):
  opt = optax.chain(optax.sgd(1e-3), jmp_train.stochastic_rounding(seed=5))
  params = jnp.ones((num_devices, 256), BF16)
  local_grads = jnp.asarray(np.random.default_rng(0).normal(1, 0.3, (num_devices, 256)), BF16)
  state = jax.tree.map(lambda x: jnp.broadcast_to(x, (num_devices,) + x.shape), opt.init(params[0]))

  def step(params, state, grads):
    grads = jax.lax.pmean(grads, "i")  # each replica had its own gradients
    u, state = opt.update(grads, state, params)
    return optax.apply_updates(params, u), state

  step = jax.pmap(step, axis_name="i")
  new, new_state = step(params, state, local_grads)
  new = np.asarray(new.astype(F32))
  for d in range(1, num_devices):
    np.testing.assert_array_equal(new[d], new[0])
  assert np.any(new[0] != 1.0)  # and some weights did move
  keys = np.asarray(new_state[1].key)
  assert (keys == keys[0]).all()


def test_modified_momentum_under_inject_hyperparams():
  params = jnp.asarray([1.0, -1.0], F32)
  grads = jnp.asarray([[0.5, 0.25], [1.0, -2.0], [0.1, 0.3]], F32)
  injected = optax.inject_hyperparams(jmp_train.modified_momentum_sgd)(learning_rate=0.1, momentum=0.9)
  ours, state = _run(injected, params, grads)
  ref, _ = _run(jmp_train.modified_momentum_sgd(0.1, 0.9), params, grads)
  np.testing.assert_allclose(np.asarray(ours), np.asarray(ref), rtol=1e-6)
  assert float(state.hyperparams["momentum"]) == pytest.approx(0.9)


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=lambda d: d.__name__)
def test_no_implicit_promotion(dtype):
  # Under strict promotion a silent float16 -> float32 upcast is an error.
  params = {"w": jnp.full(3, 0.5, dtype)}
  opts = [
    *_three_methods().values(),
    optax.inject_hyperparams(jmp_train.modified_momentum_sgd)(learning_rate=0.1, momentum=0.9, nesterov=True),
    optax.chain(optax.sgd(0.1), jmp_train.kahan_compensation(jnp.float32)),
  ]

  @jax.jit  # traced under strict promotion: one program for the five steps
  def steps(params):
    return [optax.apply_updates(params, opt.update(params, opt.init(params), params)[0]) for opt in opts]

  with jax.numpy_dtype_promotion("strict"):
    for new in steps(params):
      assert new["w"].dtype == dtype
