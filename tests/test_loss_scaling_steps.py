"""Tests for jmp_train._src.loss_scaling.steps: the finite and skipped steps.

State dtypes, what the compiled step moves.
"""

from __future__ import annotations

import sys

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jmp_train import DynamicLossScale
from jmp_train import loss_scaled
from helpers.loss_scaling import DTYPES
from helpers.loss_scaling import _np_grads
from helpers.loss_scaling import _params


# --- every state leaf keeps its dtype -----------------------------------------

_PAIRS = [(g, p) for g in DTYPES for p in DTYPES if g != p]


@pytest.mark.parametrize("skip_mode", ["cond", "select"])
@pytest.mark.parametrize(
  "grad_dtype, param_dtype", _PAIRS, ids=[f"{jnp.dtype(g).name}-grads-{jnp.dtype(p).name}-params" for g, p in _PAIRS]
)
def test_state_keeps_its_dtypes_for_every_grad_param_pairing(grad_dtype, param_dtype, skip_mode):
  # Adam's moments take the parameters' dtype at init; its update would
  # promote them with the gradients' dtype. Finite and skipped steps, jitted
  # and in a scan carry, keep every state leaf in its initial dtype.
  tx = loss_scaled(optax.adam(1e-2), DynamicLossScale(2.0**4, growth_interval=2), skip_mode=skip_mode)
  params = _params(param_dtype)
  state0 = tx.init(params)
  script = [None, np.inf, None, np.nan, None]
  grads_seq = [_np_grads(grad_dtype, 2.0**4, bad) for bad in script]

  def body(state, grads):
    updates, state = tx.update(grads, state, params)
    return state, updates

  stacked = jax.tree.map(lambda *x: np.stack(x), *grads_seq)
  state, updates = jax.jit(lambda s, g: jax.lax.scan(body, s, g))(state0, stacked)
  chex.assert_trees_all_equal_shapes_and_dtypes(state, state0)
  assert np.asarray(state.total_notfinite).item() == 2
  mu = state.inner_state[0].mu["w"]
  assert mu.dtype == param_dtype and np.abs(np.asarray(mu, np.float32)).max() > 0
  # One step at a time (eagerly built state, jitted update) agrees too.
  step = jax.jit(tx.update)
  s = state0
  for grads in grads_seq:
    _, s = step(grads, s, params)
    chex.assert_trees_all_equal_shapes_and_dtypes(s, state0)


# --- what the compiled step launches and moves --------------------------------


@pytest.fixture(scope="module")
def compiled_profiles():
  from benchmarks import bench_loss_scaling

  records = bench_loss_scaling.compiled_profiles(
    sizes=(16, 256, 256, 10), batch=32, variants=("skip_floor", "jmp_train")
  )
  return {(r["part"], r["variant"]): r for r in records}


@pytest.mark.parametrize("part", ["hlo_step", "hlo_update"])
def test_finite_step_moves_what_the_skip_floor_moves(compiled_profiles, part):
  # loss_scaled(adamw) against a bare finiteness test and lax.cond around
  # adamw (benchmarks/bench_loss_scaling.py): the same passes over
  # gradient-, parameter- and state-sized buffers and the same bytes (up to
  # the scalar 1/S each fused pass reads); the loss-scale bookkeeping adds a
  # handful of scalar operations only.
  ours = compiled_profiles[part, "jmp_train"]
  floor = compiled_profiles[part, "skip_floor"]
  assert ours["array_kernels"] == floor["array_kernels"]
  assert floor["array_bytes"] <= ours["array_bytes"] <= floor["array_bytes"] + 256
  assert ours["scalar_kernels"] <= floor["scalar_kernels"] + 8


def test_finite_step_profile_counts_passes():
  # The counter itself: an extra pass over the gradients is one more array
  # kernel and its bytes; a scalar operation is a scalar kernel.
  from benchmarks.bench_loss_scaling import finite_step_profile

  g = jnp.zeros((64, 64))
  one = jax.jit(lambda g: g * 2.0).lower(g).compile().as_text()
  two = jax.jit(lambda g, s: (g * 2.0, jnp.sin(s) * 3.0)).lower(g, jnp.float32(1.0)).compile().as_text()
  cond = jax.jit(lambda g: jax.lax.cond(jnp.sum(g) > 0, lambda g: g + 1.0, lambda g: g, g)).lower(g).compile().as_text()
  p1, p2, p3 = map(finite_step_profile, (one, two, cond))
  assert p1 == {"array_kernels": 1, "scalar_kernels": 0, "array_bytes": 2 * 64 * 64 * 4}
  assert p2["array_kernels"] == 1 and p2["scalar_kernels"] >= 1
  assert p3["array_kernels"] >= 2  # the reduction and the branch's add


def test_benchmark_leaves_out_jmp_where_it_is_not_installed(monkeypatch):
  from benchmarks import bench_loss_scaling

  monkeypatch.setitem(sys.modules, "jmp", None)  # as if not installed
  assert "jmp" not in bench_loss_scaling._variants()
  steps = bench_loss_scaling._steps()
  assert "jmp" not in steps and {"adamw", "jmp_train", "flax", "optax"} <= set(steps)
  records = bench_loss_scaling.compiled_profiles(sizes=(8, 16, 10), batch=4, variants=("adamw",), steps=steps)
  assert {r["part"] for r in records} == {"hlo_step", "hlo_update"}
