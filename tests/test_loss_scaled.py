"""Tests for jmp_train._src.loss_scaling.wrapper: the loss_scaled optax wrapper.

The update rule, skip modes, errors, serialization.
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jmp_train
from jmp_train import DynamicLossScale
from jmp_train import LossScaledState
from jmp_train import NoOpLossScale
from jmp_train import StaticLossScale
from jmp_train import get_loss_scale
from jmp_train import loss_scale_metrics
from jmp_train import loss_scaled
from jmp_train import scaled_value_and_grad
from helpers.loss_scaling import DTYPES
from helpers.loss_scaling import _assert_bitwise_equal
from helpers.loss_scaling import _grads
from helpers.loss_scaling import _np_grads
from helpers.loss_scaling import _params
from helpers.loss_scaling import _run


# --- the update rule ---------------------------------------------------------

# finite, finite, +inf, -inf, nan, finite: two growths (interval 2) and
# three back-offs.
_SCRIPT = [None, None, np.inf, -np.inf, np.nan, None]
_S0 = 2.0**8


# Eager mode runs the same Python code as jit without compiling the whole
# step; it is dtype-independent and slow (each lax.cond compiles on its
# own), so it runs for float32 only. jit and pmap run for every dtype.
@pytest.mark.parametrize(
  "dtype, mode, skip_mode",
  [(d, m, "cond") for d in DTYPES for m in ("jit", "pmap")]
  + [(jnp.float32, "nojit", "cond")]
  + [(d, m, "select") for d in (jnp.float16, jnp.float32) for m in ("jit", "pmap")],
)
def test_update_rule(dtype, mode, skip_mode):
  params = _params(dtype)
  inner = optax.adamw(1e-2, weight_decay=0.1)
  tx = loss_scaled(
    inner, DynamicLossScale(_S0, growth_interval=2), axis_name="i" if mode == "pmap" else None, skip_mode=skip_mode
  )
  scales = [_S0, _S0, 2 * _S0, _S0, _S0 / 2, _S0 / 4]  # before each step
  grads_seq = [_np_grads(dtype, s, bad) for s, bad in zip(scales, _SCRIPT)]

  def script(params, grads_seq):
    state0 = tx.init(params)
    if mode == "nojit":
      states, updates = [], []
      state = state0
      for grads in grads_seq:
        u, state = tx.update(grads, state, params)
        states.append(state)
        updates.append(u)
      return state0, states, updates

    def body(state, grads):
      u, state = tx.update(grads, state, params)
      return state, (state, u)

    stacked = jax.tree.map(lambda *x: jnp.stack(x), *grads_seq)
    _, (states, updates) = jax.lax.scan(body, state0, stacked)
    return state0, states, updates

  # Two replicas: the axis reduction and the replicas' agreement do not
  # depend on their number (test_loss_scaling_distributed runs eight).
  state0, states, updates = _run(mode, script, params, grads_seq, ndev=2)
  if mode != "nojit":  # unstack the scan's outputs
    unstack = lambda tree: [jax.tree.map(lambda x: x[t], tree) for t in range(len(_SCRIPT))]
    states, updates = unstack(states), unstack(updates)
  states = [state0] + states

  # Finite steps: the inner transformation on the true gradients. Unscaling
  # by a power of two is exact; the inner update, compiled inside lax.cond,
  # may round differently from the reference by an ulp (fusion).
  ref = jax.jit(inner.update)
  ref_state = inner.init(params)
  tol = 4 * float(jnp.finfo(dtype).eps)
  for t in [0, 1, 5]:
    r, ref_state = ref(_np_grads(dtype), ref_state, params)
    chex.assert_trees_all_close((updates[t], states[t + 1].inner_state), (r, ref_state), rtol=tol, atol=0)
  # Skipped steps: zero updates in the params' dtypes, inner state bit for
  # bit as before the first overflow.
  for t in [2, 3, 4]:
    for u, p in zip(jax.tree.leaves(updates[t]), jax.tree.leaves(params)):
      assert u.dtype == p.dtype
      np.testing.assert_array_equal(np.asarray(u, np.float32), 0.0)
    _assert_bitwise_equal(states[t + 1].inner_state, states[2].inner_state)
  # The scale and the counters follow the script.
  m = [loss_scale_metrics(s) for s in states[1:]]
  assert [float(x["loss_scale"]) for x in m] == scales[1:] + [_S0 / 4]
  assert [int(s.loss_scale.counter) for s in states[1:]] == [1, 0, 0, 0, 0, 1]
  assert [int(x["total_notfinite"]) for x in m] == [0, 0, 1, 2, 3, 3]
  assert [int(x["notfinite_count"]) for x in m] == [0, 0, 1, 2, 3, 0]
  assert [bool(x["last_finite"]) for x in m] == [True, True, False, False, False, True]
  # Every state leaf keeps its dtype and shape at every step.
  for state in states[1:]:
    chex.assert_trees_all_equal_shapes_and_dtypes(state, states[0])
  assert states[0].loss_scale.loss_scale.dtype == jnp.float32
  assert states[0].loss_scale.counter.dtype == jnp.int32
  assert {k: v.dtype for k, v in m[0].items()} == {
    "loss_scale": jnp.float32,
    "total_notfinite": jnp.int32,
    "notfinite_count": jnp.int32,
    "last_finite": jnp.bool_,
  }


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_no_implicit_promotion(dtype):
  # Under strict dtype promotion any silent half -> float32 upcast in the
  # wrapper, the scale arithmetic or the metrics would raise.
  tx = loss_scaled(optax.sgd(0.5, momentum=0.9), DynamicLossScale(2.0**4, growth_interval=1))
  params = _params(dtype)
  with jax.numpy_dtype_promotion("strict"):
    state = tx.init(params)
    step = jax.jit(tx.update)
    u, state = step(_np_grads(dtype, 2.0**4), state, params)
    _, state = step(_np_grads(dtype, 2.0**5, np.inf), state, params)
    metrics = jax.jit(loss_scale_metrics)(state)
  assert {x.dtype for x in jax.tree.leaves(u)} == {jnp.dtype(dtype)}
  assert float(metrics["loss_scale"]) == 2.0**4
  assert int(metrics["total_notfinite"]) == 1


def test_vmap_over_independent_runs():
  # Under vmap the predicate is batched and lax.cond becomes a select: each
  # member still skips or updates on its own, state untouched when skipping.
  tx = loss_scaled(optax.adam(0.1), DynamicLossScale(4.0))
  params = {"w": np.zeros((2, 3), np.float32)}
  grads = {"w": np.array([[4.0, 8.0, 4.0], [4.0, np.nan, 4.0]], np.float32)}
  states = jax.vmap(tx.init)(params)
  updates, new_states = jax.jit(jax.vmap(tx.update))(grads, states, params)
  np.testing.assert_array_equal(new_states.total_notfinite, [0, 1])
  np.testing.assert_array_equal(new_states.loss_scale.loss_scale, [4.0, 2.0])
  np.testing.assert_array_equal(updates["w"][1], 0.0)
  assert (np.asarray(updates["w"][0]) < 0).all()
  _assert_bitwise_equal(
    jax.tree.map(lambda x: x[1], new_states.inner_state), jax.tree.map(lambda x: x[1], states.inner_state)
  )


def test_scale_trajectory_through_the_transform():
  # The scale inside loss_scaled follows DynamicLossScale.adjust exactly and
  # the counters follow the scripted pattern.
  pattern = [True, True, False, True, True, True, False, False, True, True]
  ls = DynamicLossScale(2.0**6, growth_interval=3, min_scale=2.0**4)
  tx = loss_scaled(optax.sgd(0.1), ls)
  params = _params(jnp.float32)

  def body(state, finite):
    grads = _grads(jnp.float32, 1.0, jnp.where(finite, 1.0, jnp.inf))
    _, state = tx.update(grads, state, params)
    m = loss_scale_metrics(state)
    return state, (m["loss_scale"], m["total_notfinite"], m["notfinite_count"], m["last_finite"])

  _, (scales, total, consecutive, last) = jax.jit(lambda s, p: jax.lax.scan(body, s, p))(
    tx.init(params), jnp.array(pattern)
  )
  np.testing.assert_array_equal(scales, [64, 64, 32, 32, 32, 64, 32, 16, 16, 16])
  np.testing.assert_array_equal(total, [0, 0, 1, 1, 1, 1, 2, 3, 3, 3])
  np.testing.assert_array_equal(consecutive, [0, 0, 1, 0, 0, 0, 1, 2, 0, 0])
  np.testing.assert_array_equal(last, pattern)


@pytest.mark.parametrize("skip_mode", ["cond", "select"])
def test_overflow_storm_of_1000_steps_then_recovery(skip_mode):
  dtype = jnp.float16
  params = _params(dtype)
  tx = loss_scaled(
    optax.adam(1e-2), DynamicLossScale(2.0**10, growth_interval=4, min_scale=2.0**-2), skip_mode=skip_mode
  )

  def train(params, state, finite_mask):
    def body(carry, finite):
      params, state = carry
      scale = get_loss_scale(state).loss_scale
      grads = jax.tree.map(lambda g: jnp.where(finite, g, jnp.array(jnp.inf, g.dtype)), _grads(dtype, scale))
      updates, state = tx.update(grads, state, params)
      params = optax.apply_updates(params, updates)
      return (params, state), loss_scale_metrics(state)["loss_scale"]

    return jax.lax.scan(body, (params, state), finite_mask)

  train = jax.jit(train)
  # Warm up with 3 finite steps so the inner state is not the initial one.
  (params, state), _ = train(params, tx.init(params), jnp.ones(3, bool))
  assert int(state.total_notfinite) == 0
  (p_storm, s_storm), scales = train(params, state, jnp.zeros(1000, bool))
  _assert_bitwise_equal(p_storm, params)
  _assert_bitwise_equal(s_storm.inner_state, state.inner_state)
  # 2**10 halves 12 times down to the floor 2**-2 and stays there.
  np.testing.assert_array_equal(np.asarray(scales[:12]), 2.0 ** np.arange(9, -3, -1))
  assert (np.asarray(scales[12:]) == 0.25).all()
  assert int(s_storm.total_notfinite) == 1000
  assert int(s_storm.notfinite_count) == 1000
  # Recovery: the next finite steps update the parameters and grow the scale.
  (p_rec, s_rec), scales = train(p_storm, s_storm, jnp.ones(8, bool))
  assert not any(
    np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(jax.tree.leaves(p_rec), jax.tree.leaves(p_storm))
  )
  np.testing.assert_array_equal(scales, [0.25] * 3 + [0.5] * 4 + [1.0])
  assert int(s_rec.notfinite_count) == 0
  assert int(s_rec.total_notfinite) == 1000
  chex.assert_tree_all_finite(p_rec)
  chex.assert_trees_all_equal_shapes_and_dtypes(s_rec, state)


@pytest.mark.parametrize("skip_mode", ["cond", "select"])
def test_skip_zeros_take_the_dtype_inner_returns(skip_mode):
  # An inner transformation whose updates are float32 for float16 grads:
  # the zeros of a skipped step are float32 too (lax.cond needs it).
  inner = optax.chain(optax.stateless(lambda u, p: jax.tree.map(lambda x: x.astype(jnp.float32), u)), optax.sgd(1.0))
  tx = loss_scaled(inner, StaticLossScale(2.0), skip_mode=skip_mode)
  params = _params(jnp.float16)
  state = tx.init(params)
  step = jax.jit(tx.update)
  good, _ = step(_np_grads(jnp.float16, 2.0), state, params)
  bad, _ = step(_np_grads(jnp.float16, 2.0, np.inf), state, params)
  assert {x.dtype for x in jax.tree.leaves(good)} == {jnp.dtype(jnp.float32)}
  chex.assert_trees_all_equal_shapes_and_dtypes(good, bad)
  chex.assert_trees_all_equal(bad, jax.tree.map(jnp.zeros_like, good))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("jit", [False, True])
def test_finiteness_is_of_unscaled_grads(dtype, jit):
  # A step is skipped exactly when all_finite(unscale(G)) is False, also
  # where G is finite but G / S overflows (S < 1), for either sign, and
  # right at the edge of the dtype's range.
  big = float(jnp.finfo(dtype).max)
  values = [0.0, 1.0, big / 2, big / 2 * 1.0009765625, big, np.inf, np.nan]
  scales = [2.0**-10, 0.5, 1.0, 3.0, 2.0**15]
  if not jit:  # Op by op every case costs seconds: the edges only.
    values, scales = [1.0, big / 2 * 1.0009765625, np.inf, np.nan], [0.5, 2.0**15]
  steps = {}
  for scale in scales:
    ls = StaticLossScale(scale)
    tx = loss_scaled(optax.sgd(1.0), ls)
    update = jax.jit(tx.update) if jit else tx.update
    steps[scale] = tx, update
    for v in values:
      for sign in [1.0, -1.0]:
        g = _np_grads(dtype, bad=np.array(sign * v, np.float32).astype(dtype))
        want = bool(jmp_train.all_finite(ls.unscale(g)))
        _, state = update(g, tx.init(_params(dtype)))
        assert bool(state.last_finite) == want, (scale, sign * v)
  # The cases that differ from a test of the scaled gradients (S = 0.5,
  # with the step compiled above).
  tx, update = steps[0.5]
  for sign in [1.0, -1.0]:
    g = _np_grads(dtype, bad=np.array(sign * big, np.float32).astype(dtype))
    updates, state = update(g, tx.init(_params(dtype)))
    assert not bool(state.last_finite)
    chex.assert_trees_all_equal(updates, jax.tree.map(jnp.zeros_like, g))


def test_noop_loss_scale_still_skips_non_finite():
  tx = loss_scaled(optax.sgd(1.0), NoOpLossScale())
  params = _params(jnp.bfloat16)
  state = tx.init(params)
  updates, state = tx.update(_np_grads(jnp.bfloat16), state, params)
  chex.assert_trees_all_equal(updates, jax.tree.map(lambda g: -g, _np_grads(jnp.bfloat16)))
  updates, state = tx.update(_np_grads(jnp.bfloat16, bad=np.nan), state, params)
  chex.assert_trees_all_equal(updates, jax.tree.map(jnp.zeros_like, params))
  assert int(state.total_notfinite) == 1
  assert float(get_loss_scale(state).loss_scale) == 1.0


def test_extra_args_are_passed_to_inner():
  def scale_by_extra(factor_name):
    def update(updates, state, params=None, **extra):
      del params
      return jax.tree.map(lambda u: u * extra[factor_name], updates), state

    return optax.GradientTransformationExtraArgs(lambda p: optax.EmptyState(), update)

  tx = loss_scaled(scale_by_extra("value"), StaticLossScale(4.0))
  params = {"w": jnp.ones(2)}
  updates, _ = tx.update({"w": jnp.full(2, 8.0)}, tx.init(params), params, value=jnp.float32(3.0))
  np.testing.assert_array_equal(updates["w"], [6.0, 6.0])  # 8 / 4 * 3


def test_bad_skip_mode():
  with pytest.raises(ValueError, match="'branch'.*valid: cond, select"):
    loss_scaled(optax.sgd(1.0), StaticLossScale(2.0), skip_mode="branch")


def test_skip_modes_agree_on_a_mixed_sequence():
  # The same scripted run with both modes: the same skips, scales and
  # counters; the same parameters up to the last bit of a finite step.
  params = _params(jnp.float16)
  runs = {}
  for skip_mode in ("cond", "select"):
    tx = loss_scaled(optax.adam(1e-2), DynamicLossScale(2.0**4, growth_interval=2), skip_mode=skip_mode)

    def body(carry, bad):
      p, s = carry
      grads = jax.tree.map(
        lambda g: jnp.where(bad, jnp.array(jnp.nan, g.dtype), g), _grads(jnp.float16, get_loss_scale(s).loss_scale)
      )
      u, s = tx.update(grads, s, p)
      return (optax.apply_updates(p, u), s), loss_scale_metrics(s)

    script = jnp.array([0, 0, 1, 0, 1, 1, 0, 0, 0], bool)
    runs[skip_mode] = jax.jit(lambda p: jax.lax.scan(body, (p, tx.init(p)), script))(params)
  (p_c, s_c), m_c = runs["cond"]
  (p_s, s_s), m_s = runs["select"]
  chex.assert_trees_all_equal(m_c, m_s)
  assert np.asarray(m_c["total_notfinite"]).tolist() == [0, 0, 1, 1, 2, 3, 3, 3, 3]
  chex.assert_trees_all_close(p_c, p_s, rtol=4 * float(jnp.finfo(jnp.float16).eps))
  chex.assert_trees_all_close(s_c.inner_state, s_s.inner_state, rtol=1e-3)


def test_bad_loss_scale_argument():
  with pytest.raises(ValueError, match="loss_scale must be a NoOpLossScale"):
    loss_scaled(optax.sgd(0.1), 2.0**15)


def test_no_retrace_when_the_scale_changes():
  tx = loss_scaled(optax.adam(1e-3), DynamicLossScale(2.0**4, growth_interval=1))
  grad_fn = scaled_value_and_grad(lambda p, x: jnp.sum((x @ p["w"] + p["b"]) ** 2))

  @jax.jit
  @chex.assert_max_traces(n=1)
  def step(params, state, x):
    loss, grads = grad_fn(get_loss_scale(state), params, x)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state, loss

  params = _params(jnp.float32)
  state = tx.init(params)
  scales = []
  for x in [1.0, 1.0, np.inf, 1.0, np.inf, np.inf, 1.0]:
    params, state, _ = step(params, state, jnp.full((4, 3), x))
    scales.append(float(state.loss_scale.loss_scale))
  assert scales == [32, 64, 32, 64, 32, 16, 32]


# --- dtypes, errors, signature, serialization --------------------------------


@pytest.mark.parametrize(
  "inner, fragment",
  [
    ("sgd", r"got str 'sgd'"),
    (optax.sgd, r"sgd looks like a factory: call it"),
    (None, r"got NoneType None"),
    (optax.GradientTransformation, r"got type"),
  ],
)
def test_inner_that_is_no_transformation_is_a_type_error(inner, fragment):
  with pytest.raises(TypeError, match=r"expects an optax.GradientTransformation.*" + fragment):
    loss_scaled(inner, StaticLossScale(2.0))


def test_inner_may_be_any_object_with_init_and_update():
  class Duck:
    init = staticmethod(optax.sgd(1.0).init)
    update = staticmethod(optax.sgd(1.0).update)

  tx = loss_scaled(Duck(), StaticLossScale(2.0))
  updates, _ = tx.update({"w": jnp.full(2, 2.0)}, tx.init({"w": jnp.zeros(2)}))
  np.testing.assert_array_equal(updates["w"], [-1.0, -1.0])


def _non_default_state():
  """A LossScaledState whose every leaf differs from what init gives."""
  tx = loss_scaled(
    optax.adam(1e-2),
    DynamicLossScale(
      2.0**6, growth_interval=3, growth_factor=4.0, backoff_factor=0.25, min_scale=0.5, max_scale=2.0**10
    ),
  )
  params = _params(jnp.float16)
  state = tx.init(params)
  step = jax.jit(tx.update)
  for bad in [None, np.inf, None, np.nan]:
    _, state = step(_np_grads(jnp.float16, get_loss_scale(state).loss_scale.item(), bad), state, params)
  assert int(state.notfinite_count) == 1 and int(state.total_notfinite) == 2
  assert int(state.loss_scale.counter) == 0  # the backoff reset it
  _, state = step(_np_grads(jnp.float16, 1.0), state, params)
  assert int(state.loss_scale.counter) == 1 and int(state.notfinite_count) == 0
  _, state = step(_np_grads(jnp.float16, 1.0, np.inf), state, params)
  assert int(state.notfinite_count) == 1 and int(state.total_notfinite) == 3
  _, state = step(_np_grads(jnp.float16, 1.0), state, params)
  return tx, params, state


def test_state_round_trips_through_flax_serialization_and_pytrees():
  from flax import serialization
  from flax.training import train_state

  tx, params, state = _non_default_state()
  template = tx.init(params)
  leaves, treedef = jax.tree.flatten(state)
  _assert_bitwise_equal(jax.tree.unflatten(treedef, leaves), state)
  for restored in (
    serialization.from_state_dict(template, serialization.to_state_dict(state)),
    serialization.from_bytes(template, serialization.to_bytes(state)),
  ):
    restored = jax.tree.map(jnp.asarray, restored)
    assert isinstance(restored, LossScaledState)
    chex.assert_trees_all_equal_shapes_and_dtypes(restored, state)
    _assert_bitwise_equal(restored, state)
  # A Flax TrainState holding it serializes, and training resumes on it.
  ts = train_state.TrainState.create(apply_fn=None, params=params, tx=tx)
  ts = ts.replace(step=7, opt_state=state)
  back = serialization.from_bytes(
    train_state.TrainState.create(apply_fn=None, params=params, tx=tx), serialization.to_bytes(ts)
  )
  assert int(back.step) == 7
  _assert_bitwise_equal(jax.tree.map(jnp.asarray, back.opt_state), state)
  assert float(loss_scale_metrics(back)["loss_scale"]) == float(state.loss_scale.loss_scale)
