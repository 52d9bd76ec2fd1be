"""Tests for jmp_train._src.loss_scaling: the loss_scaled optax wrapper."""

from __future__ import annotations

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import jmp_train
from jmp_train import (
    DynamicLossScale,
    LossScaledState,
    NoOpLossScale,
    StaticLossScale,
    get_loss_scale,
    loss_scale_metrics,
    loss_scaled,
    scaled_value_and_grad,
)

DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]
MODES = ["nojit", "jit", "pmap"]
NDEV = 8


_W = [[0.5, -1.0], [2.0, 0.25], [-0.75, 1.5]]
_B = [0.125, -0.5]
_GW = [[0.25, -0.5], [1.0, 0.125], [-2.0, 0.75]]
_GB = [0.5, -0.0625]


def _params(dtype):
  # NumPy arrays (float16/bfloat16 via ml_dtypes): building test inputs
  # costs no eager JAX dispatch or compilation.
  return {"w": np.array(_W, dtype), "b": np.array(_B, dtype)}


def _np_grads(dtype, scale=1.0, bad=None):
  """Gradients scaled by ``scale``, optionally with one non-finite entry."""
  g = {"w": (np.array(_GW, np.float32) * scale).astype(dtype),
       "b": (np.array(_GB, np.float32) * scale).astype(dtype)}
  if bad is not None:
    g["w"][1, 0] = bad
  return g


def _grads(dtype, scale=1.0, bad=None):
  """Like ``_np_grads`` for use inside traced code (``scale``/``bad`` traced)."""
  g = {"w": jnp.array(_GW, jnp.float32), "b": jnp.array(_GB, jnp.float32)}
  g = jax.tree.map(lambda x: (x * scale).astype(dtype), g)
  if bad is not None:
    g["w"] = g["w"].at[1, 0].set(jnp.asarray(bad, dtype))
  return g


def _bits(tree):
  """Leaves as raw bytes: equality is bit-for-bit (NaN payloads, -0.0)."""
  return [(np.asarray(x).dtype, np.asarray(x).tobytes())
          for x in jax.tree.leaves(tree)]


def _assert_bitwise_equal(a, b):
  assert jax.tree.structure(a) == jax.tree.structure(b)
  assert _bits(a) == _bits(b)


def _run(mode, fn, *args):
  """Runs ``fn(*args)`` eagerly, jitted, or pmapped over 8 replicas.

  Under pmap every argument is replicated and the first replica's output is
  returned after checking that all replicas agree bit for bit.
  """
  if mode == "nojit":
    return fn(*args)
  if mode == "jit":
    return jax.jit(fn)(*args)
  replicated = jax.tree.map(lambda x: np.stack([x] * NDEV), args)
  out = jax.pmap(fn, axis_name="i")(*replicated)
  first = jax.tree.map(lambda x: x[0], out)
  for r in range(1, NDEV):
    _assert_bitwise_equal(jax.tree.map(lambda x: x[r], out), first)
  return first


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
  tx = loss_scaled(inner, DynamicLossScale(_S0, growth_interval=2),
                   axis_name="i" if mode == "pmap" else None,
                   skip_mode=skip_mode)
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

  state0, states, updates = _run(mode, script, params, grads_seq)
  if mode != "nojit":  # unstack the scan's outputs
    unstack = lambda tree: [jax.tree.map(lambda x: x[t], tree)
                            for t in range(len(_SCRIPT))]
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
    chex.assert_trees_all_close((updates[t], states[t + 1].inner_state),
                                (r, ref_state), rtol=tol, atol=0)
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
  assert [bool(x["last_finite"]) for x in m] == [True, True, False, False,
                                                 False, True]
  # Every state leaf keeps its dtype and shape at every step.
  for state in states[1:]:
    chex.assert_trees_all_equal_shapes_and_dtypes(state, states[0])
  assert states[0].loss_scale.loss_scale.dtype == jnp.float32
  assert states[0].loss_scale.counter.dtype == jnp.int32
  assert {k: v.dtype for k, v in m[0].items()} == {
      "loss_scale": jnp.float32, "total_notfinite": jnp.int32,
      "notfinite_count": jnp.int32, "last_finite": jnp.bool_}


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_no_implicit_promotion(dtype):
  # Under strict dtype promotion any silent half -> float32 upcast in the
  # wrapper, the scale arithmetic or the metrics would raise.
  tx = loss_scaled(optax.sgd(0.5, momentum=0.9),
                   DynamicLossScale(2.0**4, growth_interval=1))
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
  _assert_bitwise_equal(jax.tree.map(lambda x: x[1], new_states.inner_state),
                        jax.tree.map(lambda x: x[1], states.inner_state))


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
    return state, (m["loss_scale"], m["total_notfinite"],
                   m["notfinite_count"], m["last_finite"])

  _, (scales, total, consecutive, last) = jax.jit(
      lambda s, p: jax.lax.scan(body, s, p))(tx.init(params),
                                             jnp.array(pattern))
  np.testing.assert_array_equal(
      scales, [64, 64, 32, 32, 32, 64, 32, 16, 16, 16])
  np.testing.assert_array_equal(total, [0, 0, 1, 1, 1, 1, 2, 3, 3, 3])
  np.testing.assert_array_equal(consecutive, [0, 0, 1, 0, 0, 0, 1, 2, 0, 0])
  np.testing.assert_array_equal(last, pattern)


@pytest.mark.parametrize("skip_mode", ["cond", "select"])
def test_overflow_storm_of_1000_steps_then_recovery(skip_mode):
  dtype = jnp.float16
  params = _params(dtype)
  tx = loss_scaled(optax.adam(1e-2),
                   DynamicLossScale(2.0**10, growth_interval=4,
                                    min_scale=2.0**-2),
                   skip_mode=skip_mode)

  def train(params, state, finite_mask):
    def body(carry, finite):
      params, state = carry
      scale = get_loss_scale(state).loss_scale
      grads = jax.tree.map(
          lambda g: jnp.where(finite, g, jnp.array(jnp.inf, g.dtype)),
          _grads(dtype, scale))
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
  np.testing.assert_array_equal(np.asarray(scales[:12]),
                                2.0 ** np.arange(9, -3, -1))
  assert (np.asarray(scales[12:]) == 0.25).all()
  assert int(s_storm.total_notfinite) == 1000
  assert int(s_storm.notfinite_count) == 1000
  # Recovery: the next finite steps update the parameters and grow the scale.
  (p_rec, s_rec), scales = train(p_storm, s_storm, jnp.ones(8, bool))
  assert not any(np.array_equal(np.asarray(a), np.asarray(b))
                 for a, b in zip(jax.tree.leaves(p_rec),
                                 jax.tree.leaves(p_storm)))
  np.testing.assert_array_equal(scales, [0.25] * 3 + [0.5] * 4 + [1.0])
  assert int(s_rec.notfinite_count) == 0
  assert int(s_rec.total_notfinite) == 1000
  chex.assert_tree_all_finite(p_rec)
  chex.assert_trees_all_equal_shapes_and_dtypes(s_rec, state)


@pytest.mark.parametrize("skip_mode", ["cond", "select"])
def test_skip_zeros_take_the_dtype_inner_returns(skip_mode):
  # An inner transformation whose updates are float32 for float16 grads:
  # the zeros of a skipped step are float32 too (lax.cond needs it).
  inner = optax.chain(
      optax.stateless(lambda u, p: jax.tree.map(
          lambda x: x.astype(jnp.float32), u)),
      optax.sgd(1.0))
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
  for scale in [2.0**-10, 0.5, 1.0, 3.0, 2.0**15]:
    ls = StaticLossScale(scale)
    tx = loss_scaled(optax.sgd(1.0), ls)
    update = jax.jit(tx.update) if jit else tx.update
    for v in values:
      for sign in [1.0, -1.0]:
        g = _np_grads(dtype, bad=np.array(sign * v, np.float32).astype(dtype))
        want = bool(jmp_train.all_finite(ls.unscale(g)))
        _, state = update(g, tx.init(_params(dtype)))
        assert bool(state.last_finite) == want, (scale, sign * v)
  # The cases that differ from a test of the scaled gradients.
  tx = loss_scaled(optax.sgd(1.0), StaticLossScale(0.5))
  for sign in [1.0, -1.0]:
    g = _np_grads(dtype, bad=np.array(sign * big, np.float32).astype(dtype))
    updates, state = tx.update(g, tx.init(_params(dtype)))
    assert not bool(state.last_finite)
    chex.assert_trees_all_equal(updates, jax.tree.map(jnp.zeros_like, g))


def test_noop_loss_scale_still_skips_non_finite():
  tx = loss_scaled(optax.sgd(1.0), NoOpLossScale())
  params = _params(jnp.bfloat16)
  state = tx.init(params)
  updates, state = tx.update(_np_grads(jnp.bfloat16), state, params)
  chex.assert_trees_all_equal(
      updates, jax.tree.map(lambda g: -g, _np_grads(jnp.bfloat16)))
  updates, state = tx.update(_np_grads(jnp.bfloat16, bad=np.nan), state, params)
  chex.assert_trees_all_equal(updates, jax.tree.map(jnp.zeros_like, params))
  assert int(state.total_notfinite) == 1
  assert float(get_loss_scale(state).loss_scale) == 1.0


def test_extra_args_are_passed_to_inner():
  def scale_by_extra(factor_name):
    def update(updates, state, params=None, **extra):
      del params
      return jax.tree.map(lambda u: u * extra[factor_name], updates), state
    return optax.GradientTransformationExtraArgs(lambda p: optax.EmptyState(),
                                                 update)

  tx = loss_scaled(scale_by_extra("value"), StaticLossScale(4.0))
  params = {"w": jnp.ones(2)}
  updates, _ = tx.update({"w": jnp.full(2, 8.0)}, tx.init(params), params,
                         value=jnp.float32(3.0))
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
    tx = loss_scaled(optax.adam(1e-2), DynamicLossScale(2.0**4, growth_interval=2),
                     skip_mode=skip_mode)

    def body(carry, bad):
      p, s = carry
      grads = jax.tree.map(
          lambda g: jnp.where(bad, jnp.array(jnp.nan, g.dtype), g),
          _grads(jnp.float16, get_loss_scale(s).loss_scale))
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
  tx = loss_scaled(optax.adam(1e-3), DynamicLossScale(2.0**4,
                                                      growth_interval=1))
  grad_fn = scaled_value_and_grad(
      lambda p, x: jnp.sum((x @ p["w"] + p["b"]) ** 2))

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


# --- distributed -------------------------------------------------------------


def _per_replica_grads(bad_replica):
  g = np.stack([_np_grads(np.float32, 2.0**4)["w"] * (r + 1)
                for r in range(NDEV)]).astype(np.float16)
  if bad_replica is not None:
    g[bad_replica, 2, 1] = np.inf
  return {"w": g}


@pytest.fixture(scope="module")
def pmapped_update():
  def make(axis_name):
    tx = loss_scaled(optax.sgd(1.0), DynamicLossScale(2.0**4),
                     axis_name=axis_name)

    def step(grads, params):
      state = tx.init(params)
      return tx.update(grads, state, params)

    return jax.pmap(step, axis_name="i", in_axes=(0, None))

  return {"axis": make("i"), "no_axis": make(None)}


@pytest.mark.parametrize("bad_replica", [None, 0, 5])
def test_pmap_one_replica_overflowing_makes_all_skip(pmapped_update,
                                                     bad_replica):
  params = {"w": jnp.zeros((3, 2), jnp.float16)}
  grads = _per_replica_grads(bad_replica)
  updates, state = pmapped_update["axis"](grads, params)
  skipped = np.asarray(state.total_notfinite).tolist()
  if bad_replica is None:
    assert skipped == [0] * NDEV
    expected = -np.asarray(grads["w"], np.float32) / 2.0**4
    np.testing.assert_array_equal(np.asarray(updates["w"], np.float32),
                                  expected)
  else:
    assert skipped == [1] * NDEV
    np.testing.assert_array_equal(np.asarray(updates["w"], np.float32), 0.0)
    np.testing.assert_array_equal(state.loss_scale.loss_scale, [8.0] * NDEV)
    # Without the axis name only the overflowing replica skips: the
    # replicas would disagree, which is what axis_name prevents.
    _, local = pmapped_update["no_axis"](grads, params)
    expected = [0] * NDEV
    expected[bad_replica] = 1
    assert np.asarray(local.total_notfinite).tolist() == expected


def test_shard_map_one_replica_overflowing_makes_all_skip():
  mesh = Mesh(np.array(jax.devices()[:NDEV]), ("d",))
  tx = loss_scaled(optax.sgd(1.0), DynamicLossScale(2.0**4), axis_name="d")
  params = {"w": jnp.zeros((3, 2), jnp.float16)}

  @jax.jit
  @functools.partial(jax.shard_map, mesh=mesh, in_specs=(P("d"), P()),
                     out_specs=(P("d"), P()))
  def step(grads, params):
    local = jax.tree.map(lambda g: g[0], grads)  # this replica's gradients
    updates, state = tx.update(local, tx.init(params), params)
    # The state is replica-invariant (same on every device) by construction.
    return jax.tree.map(lambda u: u[None], updates), state

  for bad_replica in [None, 3]:
    updates, state = step(_per_replica_grads(bad_replica), params)
    if bad_replica is None:
      assert int(state.total_notfinite) == 0
      assert np.abs(np.asarray(updates["w"], np.float32)).min() > 0
    else:
      assert int(state.total_notfinite) == 1
      assert float(state.loss_scale.loss_scale) == 8.0
      np.testing.assert_array_equal(np.asarray(updates["w"], np.float32), 0.0)


@pytest.mark.parametrize("skip_mode", ["cond", "select"])
def test_shard_map_per_replica_inner_state(skip_mode):
  # Momentum of each replica's own gradients: the inner state enters
  # replicated and leaves varying over the mesh axis, so the skip branch must
  # mark the unchanged state as varying too for lax.cond to type-check.
  mesh = Mesh(np.array(jax.devices()[:NDEV]), ("d",))
  tx = loss_scaled(optax.sgd(1.0, momentum=0.5), StaticLossScale(2.0**4),
                   axis_name="d", skip_mode=skip_mode)
  params = {"w": jnp.zeros((3, 2), jnp.float16)}
  state0 = tx.init(params)

  @jax.jit
  @functools.partial(jax.shard_map, mesh=mesh, in_specs=(P("d"), P(), P()),
                     out_specs=(P("d"), P("d")))
  def step(grads, state, params):
    local = jax.tree.map(lambda g: g[0], grads)
    updates, state = tx.update(local, state, params)
    stack = lambda t: jax.tree.map(lambda x: x[None], t)
    return stack(updates), stack(state.inner_state)

  for bad_replica in [None, 6]:
    updates, inner = step(_per_replica_grads(bad_replica), state0, params)
    trace = np.asarray(inner[0].trace["w"], np.float32)  # (8, 3, 2)
    if bad_replica is None:
      expected = np.asarray(_per_replica_grads(None)["w"], np.float32) / 16
      np.testing.assert_array_equal(trace, expected)  # each its own
    else:
      np.testing.assert_array_equal(trace, 0.0)  # all replicas skipped
      np.testing.assert_array_equal(np.asarray(updates["w"], np.float32), 0)


# --- composition -------------------------------------------------------------


def test_chain_clipping_sees_unscaled_grads():
  # True gradient norm 0.5 < 1: no clipping. Had the clip seen the scaled
  # gradients (norm 512), it would have shrunk them.
  tx = loss_scaled(optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(1.0)),
                   StaticLossScale(2.0**10))
  params = {"w": jnp.zeros(2)}
  updates, _ = tx.update({"w": jnp.array([0.3, 0.4]) * 2.0**10},
                         tx.init(params), params)
  np.testing.assert_allclose(updates["w"], [-0.3, -0.4], rtol=1e-6)
  # loss_scaled nested inside a chain is found by get_loss_scale.
  outer = optax.chain(optax.identity(), tx)
  assert float(get_loss_scale(outer.init(params)).loss_scale) == 2.0**10


def test_inject_hyperparams_both_ways():
  params = _params(jnp.float32)
  # inject_hyperparams inside: the learning rate can be changed in the state.
  tx = loss_scaled(optax.inject_hyperparams(optax.sgd)(learning_rate=0.1),
                   StaticLossScale(8.0))
  state = tx.init(params)
  state.inner_state.hyperparams["learning_rate"] = jnp.asarray(1.0)
  updates, state = tx.update(_np_grads(jnp.float32, 8.0), state, params)
  chex.assert_trees_all_close(updates,
                              jax.tree.map(lambda g: -g, _np_grads(jnp.float32)))
  # inject_hyperparams outside, around a factory using loss_scaled.
  outer = optax.inject_hyperparams(
      lambda learning_rate: loss_scaled(optax.sgd(learning_rate),
                                        DynamicLossScale(4.0)))(
                                            learning_rate=0.5)
  ostate = outer.init(params)
  assert float(get_loss_scale(ostate).loss_scale) == 4.0
  updates, ostate = jax.jit(outer.update)(_np_grads(jnp.float32, 4.0, np.inf),
                                          ostate, params)
  assert float(get_loss_scale(ostate).loss_scale) == 2.0
  assert int(loss_scale_metrics(ostate)["total_notfinite"]) == 1
  chex.assert_trees_all_equal(updates, jax.tree.map(jnp.zeros_like, params))


def test_multisteps_inside_loss_scaled_drops_overflowing_mini_steps():
  # Recommended nesting: every mini-step is unscaled, then accumulated; an
  # overflowing mini-step is dropped (does not count towards k) and the
  # scale backs off at once.
  k = 3
  tx = loss_scaled(optax.MultiSteps(optax.sgd(1.0), k).gradient_transformation(),
                   DynamicLossScale(2.0**4, growth_interval=100))
  params = {"w": jnp.zeros(2)}
  step = jax.jit(tx.update)
  state = tx.init(params)
  true_grads = [jnp.array([1.0, 2.0]), jnp.array([9.0, 9.0]),
                jnp.array([3.0, 4.0]), jnp.array([5.0, 6.0])]
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
  for g in [jnp.array([4.0, 8.0]), jnp.array([12.0, 16.0]),  # window 1
            jnp.array([4.0, 4.0]), jnp.array([jnp.inf, 4.0])]:  # window 2
    updates, state = step({"w": g}, state, params)
    out.append((np.asarray(updates["w"]), loss_scale_metrics(state)))
  np.testing.assert_array_equal(out[1][0], [-2.0, -3.0])  # mean / 4
  assert float(out[1][1]["loss_scale"]) == 4.0
  np.testing.assert_array_equal(out[3][0], [0.0, 0.0])
  assert float(out[3][1]["loss_scale"]) == 2.0  # backed off at window end
  assert int(out[3][1]["total_notfinite"]) == 1


def test_flax_train_state_apply_gradients():
  from flax.training import train_state

  tx = loss_scaled(optax.adam(1e-2), DynamicLossScale(2.0**6,
                                                      growth_interval=2))
  state = train_state.TrainState.create(apply_fn=None,
                                        params=_params(jnp.float32), tx=tx)
  grad_fn = scaled_value_and_grad(
      lambda p, x: jnp.mean((x @ p["w"] + p["b"]) ** 2))

  @jax.jit
  def step(state, x):
    loss, grads = grad_fn(get_loss_scale(state), state.params, x)
    return state.apply_gradients(grads=grads), loss, loss_scale_metrics(state)

  state1, _, _ = step(state, jnp.ones((4, 3)))
  state2, _, _ = step(state1, jnp.full((4, 3), np.inf))
  _assert_bitwise_equal(state2.params, state1.params)
  _assert_bitwise_equal(state2.opt_state.inner_state,
                        state1.opt_state.inner_state)
  metrics = loss_scale_metrics(state2)
  assert float(metrics["loss_scale"]) == 2.0**5
  assert int(metrics["total_notfinite"]) == 1
  assert not bool(metrics["last_finite"])
  state3, _, _ = step(state2, jnp.ones((4, 3)))
  assert not np.array_equal(state3.params["w"], state2.params["w"])


def test_nnx_optimizer():
  from flax import nnx

  model = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
  tx = loss_scaled(optax.adam(1e-2), DynamicLossScale(2.0**6,
                                                      growth_interval=2))
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
  ls = get_loss_scale(optimizer)
  assert isinstance(ls, DynamicLossScale)
  assert isinstance(ls.loss_scale, jax.Array)  # unwrapped from nnx Variables
  grad_fn = scaled_value_and_grad(lambda m, x: jnp.mean(m(x) ** 2),
                                  value_and_grad=nnx.value_and_grad)

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
  tx = loss_scaled(optax.chain(optax.clip_by_global_norm(10.0),
                               optax.adamw(1e-2)),
                   DynamicLossScale(2.0**5, growth_interval=2,
                                    growth_factor=4.0, backoff_factor=0.25,
                                    min_scale=0.5, max_scale=2.0**9))
  pattern = [True, True, False, True, True, True, False, True, True, True]

  @jax.jit
  def step(params, state, finite):
    scale = get_loss_scale(state).loss_scale
    grads = jax.tree.map(
        lambda g: jnp.where(finite, g, jnp.array(jnp.nan, g.dtype)),
        _grads(dtype, scale))
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


# --- get_loss_scale / metrics / scaled_value_and_grad ------------------------


def test_get_loss_scale_errors_name_the_problem():
  with pytest.raises(ValueError, match="found no LossScaledState"):
    get_loss_scale(optax.adam(1e-3).init({"w": jnp.zeros(2)}))
  two = optax.chain(loss_scaled(optax.sgd(0.1), StaticLossScale(2.0)),
                    loss_scaled(optax.sgd(0.1), StaticLossScale(4.0)))
  with pytest.raises(ValueError, match="found 2 LossScaledState"):
    loss_scale_metrics(two.init({"w": jnp.zeros(2)}))
  nested = loss_scaled(loss_scaled(optax.sgd(0.1), StaticLossScale(2.0)),
                       StaticLossScale(4.0))
  with pytest.raises(ValueError, match="found 2 LossScaledState"):
    get_loss_scale(nested.init({"w": jnp.zeros(2)}))


def test_get_loss_scale_in_multisteps_state():
  params = {"w": jnp.zeros(2)}
  inner = optax.MultiSteps(loss_scaled(optax.sgd(0.1), StaticLossScale(2.0)),
                           2)
  assert float(get_loss_scale(inner.init(params)).loss_scale) == 2.0
  state = loss_scaled(optax.sgd(0.1), StaticLossScale(2.0)).init(params)
  assert isinstance(state, LossScaledState)
  assert get_loss_scale(state) is state.loss_scale


@pytest.mark.parametrize("dtype", DTYPES)
def test_scaled_value_and_grad(dtype):
  def loss_fn(w, x, *, offset):
    loss = jnp.sum((w * x) ** 2).astype(dtype) + offset
    return loss, {"twice": 2 * loss}

  w = jnp.array([0.5, -1.0, 2.0], dtype)
  x = jnp.array([1.0, 2.0, 0.25], dtype)
  g = scaled_value_and_grad(loss_fn, has_aux=True, argnums=(0, 1))
  (loss, aux), (gw, gx) = jax.jit(g)(StaticLossScale(2.0**8), w, x,
                                     offset=1.0)
  ref_loss, ref_aux = loss_fn(w, x, offset=1.0)
  assert loss.dtype == dtype
  np.testing.assert_array_equal(loss, ref_loss)  # unscaled, exactly
  np.testing.assert_array_equal(aux["twice"], ref_aux["twice"])
  (_, _), (rw, rx) = jax.value_and_grad(loss_fn, argnums=(0, 1), has_aux=True)(
      w, x, offset=1.0)
  assert gw.dtype == gx.dtype == dtype
  np.testing.assert_array_equal(np.asarray(gw, np.float32),
                                np.asarray(rw, np.float32) * 2.0**8)
  np.testing.assert_array_equal(np.asarray(gx, np.float32),
                                np.asarray(rx, np.float32) * 2.0**8)
  # A plain number, a scalar array or the whole state work as the scale.
  _, g2 = scaled_value_and_grad(lambda w: jnp.sum(w))(4.0, w)
  np.testing.assert_array_equal(np.asarray(g2, np.float32), [4.0] * 3)
  state = loss_scaled(optax.sgd(0.1), StaticLossScale(2.0)).init(w)
  _, g3 = scaled_value_and_grad(lambda w: jnp.sum(w))(state, w)
  np.testing.assert_array_equal(np.asarray(g3, np.float32), [2.0] * 3)
  with pytest.raises(ValueError, match="positive scalar"):
    scaled_value_and_grad(lambda w: jnp.sum(w))(-1.0, w)


def test_float16_loss_overflow_is_caught_and_backed_off():
  # An end-to-end float16 case: a scale too large for the float16 loss
  # produces inf gradients, the step is skipped, the scale halves until the
  # step goes through.
  tx = loss_scaled(optax.sgd(0.1), DynamicLossScale(2.0**24,
                                                    growth_interval=1000))
  grad_fn = scaled_value_and_grad(
      lambda w: jnp.sum(w.astype(jnp.float16) ** 2))
  w = jnp.array([3.0, 4.0], jnp.float16)
  state = tx.init(w)

  @jax.jit
  def step(w, state):
    _, grads = grad_fn(get_loss_scale(state), w)
    updates, state = tx.update(grads, state, w)
    return optax.apply_updates(w, updates), state

  w1 = w
  for _ in range(14):
    w1, state = step(w1, state)
  # The float16 gradient S * 2w = S * [6, 8] overflows 65504 for every
  # S >= 2**13: 12 skips from 2**24 down to 2**13, then two steps at 2**12.
  assert int(state.total_notfinite) == 12
  assert int(state.notfinite_count) == 0
  assert float(state.loss_scale.loss_scale) == 2.0**12
  np.testing.assert_allclose(np.asarray(w1, np.float32), [1.92, 2.56],
                             rtol=2e-3)  # w * (1 - 0.1 * 2) ** 2


def test_exported_names():
  for name in ["loss_scaled", "LossScaledState", "get_loss_scale",
               "loss_scale_metrics", "scaled_value_and_grad"]:
    assert name in jmp_train.__all__ and hasattr(jmp_train, name)


# --- dtypes, errors, signature, serialization --------------------------------

_PAIRS = [(g, p) for g in DTYPES for p in DTYPES if g != p]


@pytest.mark.parametrize("skip_mode", ["cond", "select"])
@pytest.mark.parametrize("grad_dtype, param_dtype", _PAIRS,
                         ids=[f"{jnp.dtype(g).name}-grads-{jnp.dtype(p).name}-params"
                              for g, p in _PAIRS])
def test_state_keeps_its_dtypes_for_every_grad_param_pairing(
    grad_dtype, param_dtype, skip_mode):
  # Adam's moments take the parameters' dtype at init; its update would
  # promote them with the gradients' dtype. Finite and skipped steps, jitted
  # and in a scan carry, keep every state leaf in its initial dtype.
  tx = loss_scaled(optax.adam(1e-2), DynamicLossScale(2.0**4, growth_interval=2),
                   skip_mode=skip_mode)
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


@pytest.mark.parametrize("inner, fragment", [
    ("sgd", r"got str 'sgd'"),
    (optax.sgd, r"sgd looks like a factory: call it"),
    (None, r"got NoneType None"),
    (optax.GradientTransformation, r"got type"),
])
def test_inner_that_is_no_transformation_is_a_type_error(inner, fragment):
  with pytest.raises(TypeError, match=r"expects an optax.GradientTransformation.*"
                     + fragment):
    loss_scaled(inner, StaticLossScale(2.0))


def test_inner_may_be_any_object_with_init_and_update():
  class Duck:
    init = staticmethod(optax.sgd(1.0).init)
    update = staticmethod(optax.sgd(1.0).update)

  tx = loss_scaled(Duck(), StaticLossScale(2.0))
  updates, _ = tx.update({"w": jnp.full(2, 2.0)}, tx.init({"w": jnp.zeros(2)}))
  np.testing.assert_array_equal(updates["w"], [-1.0, -1.0])


def _power_loss(w, x, n_terms, *, power):
  # n_terms and power are Python values (range, **): they must be static.
  return sum(jnp.sum((w * x) ** power) for _ in range(n_terms))


def test_scaled_value_and_grad_signature_has_the_loss_scale_first():
  import inspect

  g = scaled_value_and_grad(_power_loss)
  params = list(inspect.signature(g).parameters.values())
  assert [p.name for p in params] == ["loss_scale", "w", "x", "n_terms", "power"]
  assert params[0].kind is inspect.Parameter.POSITIONAL_ONLY
  # A function with its own `loss_scale` parameter keeps it.
  own = scaled_value_and_grad(lambda loss_scale, w: loss_scale * jnp.sum(w))
  assert list(inspect.signature(own).parameters) == ["loss_scale_", "loss_scale", "w"]


@pytest.mark.parametrize("static", [
    dict(static_argnums=(3,), static_argnames=("power",)),
    dict(static_argnames=("n_terms", "power")),
], ids=["static_argnums", "static_argnames"])
def test_scaled_value_and_grad_under_jit_with_static_arguments(static):
  # As jax.value_and_grad of the same function under jit: the same static
  # arguments by name, the numbers shifted by one for the loss scale.
  w, x = jnp.array([0.5, -1.0]), jnp.array([2.0, 3.0])
  ref_static = dict(static)
  if "static_argnums" in ref_static:
    ref_static["static_argnums"] = tuple(i - 1 for i in static["static_argnums"])
  ref_loss, ref_grads = jax.jit(jax.value_and_grad(_power_loss), **ref_static)(
      w, x, 3, power=2)
  g = jax.jit(scaled_value_and_grad(_power_loss), **static)
  if "static_argnums" in static:
    loss, grads = g(StaticLossScale(4.0), w, x, 3, power=2)
  else:
    loss, grads = g(StaticLossScale(4.0), w, x, n_terms=3, power=2)
  np.testing.assert_array_equal(loss, ref_loss)
  np.testing.assert_array_equal(grads, ref_grads * 4.0)


def _non_default_state():
  """A LossScaledState whose every leaf differs from what init gives."""
  tx = loss_scaled(optax.adam(1e-2), DynamicLossScale(
      2.0**6, growth_interval=3, growth_factor=4.0, backoff_factor=0.25,
      min_scale=0.5, max_scale=2.0**10))
  params = _params(jnp.float16)
  state = tx.init(params)
  step = jax.jit(tx.update)
  for bad in [None, np.inf, None, np.nan]:
    _, state = step(_np_grads(jnp.float16, get_loss_scale(state).loss_scale
                              .item(), bad), state, params)
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
      train_state.TrainState.create(apply_fn=None, params=params, tx=tx),
      serialization.to_bytes(ts))
  assert int(back.step) == 7
  _assert_bitwise_equal(jax.tree.map(jnp.asarray, back.opt_state), state)
  assert float(loss_scale_metrics(back)["loss_scale"]) == float(
      state.loss_scale.loss_scale)


# --- what the compiled step launches and moves --------------------------------


@pytest.fixture(scope="module")
def compiled_profiles():
  from benchmarks import bench_loss_scaling

  records = bench_loss_scaling.compiled_profiles(
      sizes=(16, 256, 256, 10), batch=32, variants=("skip_floor", "jmp_train"))
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
  two = jax.jit(lambda g, s: (g * 2.0, jnp.sin(s) * 3.0)).lower(
      g, jnp.float32(1.0)).compile().as_text()
  cond = jax.jit(lambda g: jax.lax.cond(jnp.sum(g) > 0, lambda g: g + 1.0,
                                        lambda g: g, g)).lower(g).compile().as_text()
  p1, p2, p3 = map(finite_step_profile, (one, two, cond))
  assert p1 == {"array_kernels": 1, "scalar_kernels": 0, "array_bytes": 2 * 64 * 64 * 4}
  assert p2["array_kernels"] == 1 and p2["scalar_kernels"] >= 1
  assert p3["array_kernels"] >= 2  # the reduction and the branch's add
