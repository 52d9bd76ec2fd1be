"""Tests of loss_scaled composed with optax, Flax and Orbax.

chain, inject_hyperparams, MultiSteps, TrainState, nnx.Optimizer, checkpoints.
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax

from jmp_train import DynamicLossScale
from jmp_train import StaticLossScale
from jmp_train import get_loss_scale
from jmp_train import loss_scale_metrics
from jmp_train import loss_scaled
from jmp_train import scaled_value_and_grad
from helpers.loss_scaling import _assert_bitwise_equal
from helpers.loss_scaling import _bits
from helpers.loss_scaling import _grads
from helpers.loss_scaling import _np_grads
from helpers.loss_scaling import _params


# --- composition -------------------------------------------------------------


def test_chain_clipping_sees_unscaled_grads():
  # True gradient norm 0.5 < 1: no clipping. Had the clip seen the scaled
  # gradients (norm 512), it would have shrunk them.
  tx = loss_scaled(optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(1.0)), StaticLossScale(2.0**10))
  params = {"w": jnp.zeros(2)}
  updates, _ = tx.update({"w": jnp.array([0.3, 0.4]) * 2.0**10}, tx.init(params), params)
  np.testing.assert_allclose(updates["w"], [-0.3, -0.4], rtol=1e-6)
  # loss_scaled nested inside a chain is found by get_loss_scale.
  outer = optax.chain(optax.identity(), tx)
  assert float(get_loss_scale(outer.init(params)).loss_scale) == 2.0**10


def test_inject_hyperparams_both_ways():
  params = _params(jnp.float32)
  # inject_hyperparams inside: the learning rate can be changed in the state.
  tx = loss_scaled(optax.inject_hyperparams(optax.sgd)(learning_rate=0.1), StaticLossScale(8.0))
  state = tx.init(params)
  state.inner_state.hyperparams["learning_rate"] = jnp.asarray(1.0)
  updates, state = tx.update(_np_grads(jnp.float32, 8.0), state, params)
  chex.assert_trees_all_close(updates, jax.tree.map(lambda g: -g, _np_grads(jnp.float32)))
  # inject_hyperparams outside, around a factory using loss_scaled.
  outer = optax.inject_hyperparams(lambda learning_rate: loss_scaled(optax.sgd(learning_rate), DynamicLossScale(4.0)))(
    learning_rate=0.5
  )
  ostate = outer.init(params)
  assert float(get_loss_scale(ostate).loss_scale) == 4.0
  updates, ostate = jax.jit(outer.update)(_np_grads(jnp.float32, 4.0, np.inf), ostate, params)
  assert float(get_loss_scale(ostate).loss_scale) == 2.0
  assert int(loss_scale_metrics(ostate)["total_notfinite"]) == 1
  chex.assert_trees_all_equal(updates, jax.tree.map(jnp.zeros_like, params))


def test_multisteps_inside_loss_scaled_drops_overflowing_mini_steps():
  # Recommended nesting: every mini-step is unscaled, then accumulated; an
  # overflowing mini-step is dropped (does not count towards k) and the
  # scale backs off at once.
  k = 3
  tx = loss_scaled(
    optax.MultiSteps(optax.sgd(1.0), k).gradient_transformation(), DynamicLossScale(2.0**4, growth_interval=100)
  )
  params = {"w": jnp.zeros(2)}
  step = jax.jit(tx.update)
  state = tx.init(params)
  true_grads = [jnp.array([1.0, 2.0]), jnp.array([9.0, 9.0]), jnp.array([3.0, 4.0]), jnp.array([5.0, 6.0])]
  finite = [True, False, True, True]
  emitted = []
  for g, ok in zip(true_grads, finite):
    scale = get_loss_scale(state).loss_scale  # changes after the overflow
    scaled = g * scale if ok else g.at[0].set(jnp.inf)
    updates, state = step({"w": scaled}, state, params)
    emitted.append(np.asarray(updates["w"]))
    ms = get_loss_scale(state)
    if not ok:
      assert int(state.inner_state.mini_step) == 1  # unchanged by the skip
      assert float(ms.loss_scale) == 8.0
  # Emitted on the 3rd finite mini-step: minus the mean of the finite ones,
  # although they were scaled by 16 and then 8.
  for u in emitted[:3]:
    np.testing.assert_array_equal(u, [0.0, 0.0])
  np.testing.assert_allclose(emitted[3], -np.mean([[1, 2], [3, 4], [5, 6]], 0))
  assert int(state.inner_state.mini_step) == 0
  assert int(state.inner_state.gradient_step) == 1
  assert int(state.total_notfinite) == 1


def test_loss_scaled_inside_multisteps_skips_the_whole_window():
  # The other nesting: loss_scaled sees each window's accumulated (scaled)
  # gradients; one overflowing mini-step makes the whole window a skip.
  k = 2
  ms = optax.MultiSteps(loss_scaled(optax.sgd(1.0), DynamicLossScale(4.0)), k)
  params = {"w": jnp.zeros(2)}
  state = ms.init(params)
  step = jax.jit(ms.update)
  out = []
  for g in [
    jnp.array([4.0, 8.0]),
    jnp.array([12.0, 16.0]),  # window 1
    jnp.array([4.0, 4.0]),
    jnp.array([jnp.inf, 4.0]),
  ]:  # window 2
    updates, state = step({"w": g}, state, params)
    out.append((np.asarray(updates["w"]), loss_scale_metrics(state)))
  np.testing.assert_array_equal(out[1][0], [-2.0, -3.0])  # mean / 4
  assert float(out[1][1]["loss_scale"]) == 4.0
  np.testing.assert_array_equal(out[3][0], [0.0, 0.0])
  assert float(out[3][1]["loss_scale"]) == 2.0  # backed off at window end
  assert int(out[3][1]["total_notfinite"]) == 1


def test_flax_train_state_apply_gradients():
  from flax.training import train_state

  tx = loss_scaled(optax.adam(1e-2), DynamicLossScale(2.0**6, growth_interval=2))
  state = train_state.TrainState.create(apply_fn=None, params=_params(jnp.float32), tx=tx)
  grad_fn = scaled_value_and_grad(lambda p, x: jnp.mean((x @ p["w"] + p["b"]) ** 2))

  @jax.jit
  def step(state, x):
    loss, grads = grad_fn(get_loss_scale(state), state.params, x)
    return state.apply_gradients(grads=grads), loss, loss_scale_metrics(state)

  state1, _, _ = step(state, jnp.ones((4, 3)))
  state2, _, _ = step(state1, jnp.full((4, 3), np.inf))
  _assert_bitwise_equal(state2.params, state1.params)
  _assert_bitwise_equal(state2.opt_state.inner_state, state1.opt_state.inner_state)
  metrics = loss_scale_metrics(state2)
  assert float(metrics["loss_scale"]) == 2.0**5
  assert int(metrics["total_notfinite"]) == 1
  assert not bool(metrics["last_finite"])
  state3, _, _ = step(state2, jnp.ones((4, 3)))
  assert not np.array_equal(state3.params["w"], state2.params["w"])


def test_nnx_optimizer():
  from flax import nnx

  model = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
  tx = loss_scaled(optax.adam(1e-2), DynamicLossScale(2.0**6, growth_interval=2))
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
  ls = get_loss_scale(optimizer)
  assert isinstance(ls, DynamicLossScale)
  assert isinstance(ls.loss_scale, jax.Array)  # unwrapped from nnx Variables
  grad_fn = scaled_value_and_grad(lambda m, x: jnp.mean(m(x) ** 2), value_and_grad=nnx.value_and_grad)

  @nnx.jit
  def step(model, optimizer, x):
    loss, grads = grad_fn(get_loss_scale(optimizer), model, x)
    optimizer.update(model, grads)
    return loss, loss_scale_metrics(optimizer)

  loss, _ = step(model, optimizer, jnp.ones((4, 3)))
  assert np.isfinite(float(loss))
  kernel = np.asarray(model.kernel[...]).copy()
  # Variables are updated in place: take the bytes now.
  inner_before = _bits(optimizer.opt_state.inner_state)
  assert len(inner_before) == 5  # adam: count, mu and nu of kernel and bias
  _, metrics = step(model, optimizer, jnp.full((4, 3), np.inf))
  np.testing.assert_array_equal(np.asarray(model.kernel[...]), kernel)
  assert float(metrics["loss_scale"]) == 2.0**5
  assert int(metrics["total_notfinite"]) == 1
  # The optimizer's inner (Adam) state is untouched by the skipped step.
  assert _bits(optimizer.opt_state.inner_state) == inner_before
  _, metrics = step(model, optimizer, jnp.ones((4, 3)))
  assert bool(metrics["last_finite"])
  assert not np.array_equal(np.asarray(model.kernel[...]), kernel)


def test_orbax_checkpoint_round_trip_continues_bit_for_bit(tmp_path):
  import orbax.checkpoint as ocp

  dtype = jnp.float16
  tx = loss_scaled(
    optax.chain(optax.clip_by_global_norm(10.0), optax.adamw(1e-2)),
    DynamicLossScale(
      2.0**5, growth_interval=2, growth_factor=4.0, backoff_factor=0.25, min_scale=0.5, max_scale=2.0**9
    ),
  )
  pattern = [True, True, False, True, True, True, False, True, True, True]

  @jax.jit
  def step(params, state, finite):
    scale = get_loss_scale(state).loss_scale
    grads = jax.tree.map(lambda g: jnp.where(finite, g, jnp.array(jnp.nan, g.dtype)), _grads(dtype, scale))
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  def run(params, state, flags):
    for f in flags:
      params, state = step(params, state, jnp.asarray(f))
    return params, state

  params = _params(dtype)
  full = run(params, tx.init(params), pattern)
  half = run(params, tx.init(params), pattern[:5])
  checkpointer = ocp.StandardCheckpointer()
  checkpointer.save(tmp_path / "ckpt", half)
  checkpointer.wait_until_finished()
  abstract = jax.eval_shape(lambda: (params, tx.init(params)))
  restored = checkpointer.restore(tmp_path / "ckpt", abstract)
  chex.assert_trees_all_equal_shapes_and_dtypes(restored, half)
  _assert_bitwise_equal(restored, half)
  resumed = run(*restored, pattern[5:])
  _assert_bitwise_equal(resumed, full)
  assert int(full[1].total_notfinite) == 2
