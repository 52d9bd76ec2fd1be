"""Tests of Adam and momentum SGD with 8-bit moments (jmp_train._src.low_precision.optimizers_8bit)."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jmp_train
from jmp_train._src.low_precision import quantized_state as qs
from jmp_train._src.low_precision.optimizers_8bit import QuantizedTraceState
from jmp_train._src.low_precision.optimizers_8bit import adam_8bit
from jmp_train._src.low_precision.optimizers_8bit import scale_by_narrow_adam
from jmp_train._src.low_precision.optimizers_8bit import sgd_8bit

SHAPES = {"w": (64, 96), "b": (96,), "v": (40, 130)}  # b stays float32 by default


def _params(dtype=jnp.float32, seed=0):
  keys = jax.random.split(jax.random.key(seed), len(SHAPES))
  return {n: (0.1 * jax.random.normal(k, s)).astype(dtype) for (n, s), k in zip(SHAPES.items(), keys)}


def _grads(step, dtype=jnp.float32):
  return _params(dtype, seed=1000 + step)


def _leaves(tree, names):
  """The leaves ``names`` of ``tree``: each leaf adds to a step's compilation."""
  return {n: tree[n] for n in names}


def _regression(seed=0, n=256, d=96, k=32):
  """A least-squares problem with correlated features (Adam's curvature matters)."""
  kx, kw, kn = jax.random.split(jax.random.key(seed), 3)
  x = jax.random.normal(kx, (n, d)) * jnp.linspace(0.5, 2.0, d)
  w_true = jax.random.normal(kw, (d, k)) / 4
  y = x @ w_true + 0.1 * jax.random.normal(kn, (n, k))
  return x, y


def _train(tx, dtype, steps, seed=0):
  x, y = _regression(seed)
  params = {"w": jnp.zeros((96, 32), dtype), "b": jnp.zeros((32,), dtype)}

  def loss(p):
    pred = x @ p["w"].astype(jnp.float32) + p["b"].astype(jnp.float32)
    return jnp.mean(jnp.square(pred - y))

  @jax.jit
  def run(params):
    def step(carry, _):
      params, state = carry
      g = jax.grad(loss)(params)
      updates, state = tx.update(g, state, params)
      return (optax.apply_updates(params, updates), state), loss(params)

    (params, state), losses = jax.lax.scan(step, (params, tx.init(params)), None, length=steps)
    return params, losses

  params, losses = run(params)
  return params, np.asarray(losses), float(loss(params))


@functools.cache
def _adam_float32(lr, steps):
  """``_train(optax.adam(lr), float32, steps)``, once per worker (several tests compare to it)."""
  return _train(optax.adam(lr), jnp.float32, steps)


@functools.cache
def _adam_8bit_plain(lr, steps, dtype):
  """``_train(adam_8bit(lr, min_8bit_size=0), dtype, steps)``, once per worker and dtype."""
  return _train(adam_8bit(lr, min_8bit_size=0), dtype, steps)


@functools.cache
def _sgd_run(lr, steps, nesterov, bits8):
  """Momentum SGD (0.9) in float32 or with an 8-bit trace (stochastic rounding), once per worker."""
  if bits8:
    return _train(sgd_8bit(lr, 0.9, nesterov, min_8bit_size=0), jnp.float32, steps)
  return _train(optax.sgd(lr, 0.9, nesterov), jnp.float32, steps)


# ---------------------------------------------------------------------------
# Dtype choice per moment.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("mu_dtype,nu_dtype", [(None, None), ("float32", "float32"), ("bfloat16", "float32")])
def test_float_moments_match_optax(mu_dtype, nu_dtype):
  params = _params()
  ours = scale_by_narrow_adam(mu_dtype=mu_dtype, nu_dtype=nu_dtype)
  ref = optax.scale_by_adam(mu_dtype=None if mu_dtype is None else jnp.dtype(mu_dtype))
  s1, s2 = ours.init(params), ref.init(params)
  update1, update2 = jax.jit(ours.update), jax.jit(ref.update)
  for step in range(5):
    u1, s1 = update1(_grads(step), s1)
    u2, s2 = update2(_grads(step), s2)
    if mu_dtype == "bfloat16":  # optax steps with mu rounded to bfloat16; we, with float32
      for name in SHAPES:
        assert float(jnp.linalg.norm(u1[name] - u2[name]) / jnp.linalg.norm(u2[name])) < 1e-2
    else:
      chex.assert_trees_all_close(u1, u2, rtol=1e-5, atol=1e-6)
  chex.assert_trees_all_equal_shapes_and_dtypes(s1, s2)
  assert type(s1) is optax.ScaleByAdamState
  chex.assert_trees_all_close(s1.nu, s2.nu, rtol=1e-6)


def test_nu_dtype_independent_of_params():
  params = _params(jnp.bfloat16)
  state = scale_by_narrow_adam(nu_dtype="float32").init(params)
  assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(state.mu))
  assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(state.nu))
  state = scale_by_narrow_adam(mu_dtype=jnp.float16, nu_dtype="8bit", min_8bit_size=0).init(params)
  assert all(x.dtype == jnp.float16 for x in jax.tree.leaves(state.mu))
  assert all(
    isinstance(x, qs.QuantizedArray)
    for x in jax.tree.leaves(state.nu, is_leaf=lambda x: isinstance(x, qs.QuantizedArray))
  )


def test_bfloat16_nu_stalls_where_8bit_follows():
  # A constant gradient: v -> g^2 after bias correction, whatever the steps.
  g = {"w": jnp.full((64, 64), 1e-2, jnp.float32)}
  results = {}
  for nu_dtype in ("bfloat16", "8bit", "float32"):
    tx = scale_by_narrow_adam(b1=0.0, nu_dtype=nu_dtype, min_8bit_size=0)
    # 300 updates in one compiled scan (not 300 dispatches).
    run = jax.jit(lambda s, tx=tx: jax.lax.scan(lambda s, _: (tx.update(g, s)[1], None), s, None, length=300)[0])
    state = run(tx.init(g))
    nu = state.nu["w"]
    v = qs.dequantize(nu, signed=False) ** 2 if isinstance(nu, qs.QuantizedArray) else nu
    results[nu_dtype] = float(jnp.mean(v.astype(jnp.float32))) / (1 - 0.999**300)
  assert results["float32"] == pytest.approx(1e-4, rel=1e-4)
  assert results["8bit"] == pytest.approx(1e-4, rel=0.02)
  assert abs(results["bfloat16"] / 1e-4 - 1) > 0.05  # its EMA steps round away


# ---------------------------------------------------------------------------
# Tracking float32 Adam and momentum SGD.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("code", qs.CODES)
def test_adam_8bit_tracks_adam(code):
  lr, steps = 1e-2, 300
  p32, l32, final32 = _adam_float32(lr, steps)
  p8, l8, final8 = _train(adam_8bit(lr, code=code, min_8bit_size=0), jnp.float32, steps)
  assert final32 < 0.01 * l32[0]  # it did learn
  assert abs(final8 / final32 - 1) < 0.01
  # The trajectories, not only the end points, stay close.
  np.testing.assert_allclose(l8, l32, rtol=0.1)
  assert float(jnp.linalg.norm(p8["w"] - p32["w"]) / jnp.linalg.norm(p32["w"])) < 0.02


def test_nearest_rounding_freezes_a_slow_trace():
  # Full-batch gradients shrink slowly: the trace's changes fall below half a
  # code interval, and rounding to nearest stops following them.
  lr, steps = 2e-3, 300
  _, _, final32 = _sgd_run(lr, steps, False, False)
  _, _, stochastic = _sgd_run(lr, steps, False, True)
  _, _, nearest = _train(sgd_8bit(lr, 0.9, min_8bit_size=0, rounding="nearest"), jnp.float32, steps)
  assert abs(stochastic / final32 - 1) < 0.01
  assert abs(nearest / final32 - 1) > 3 * abs(stochastic / final32 - 1)


@pytest.mark.slow
@pytest.mark.parametrize(
  "half,finisher",
  [
    (jnp.bfloat16, lambda: jmp_train.stochastic_rounding(0)),
    (jnp.bfloat16, lambda: jmp_train.kahan_compensation()),
    (jnp.float16, lambda: jmp_train.kahan_compensation()),
  ],
)
def test_adam_8bit_with_half_weights(half, finisher):
  lr, steps = 1e-2, 300
  _, _, final32 = _adam_float32(lr, steps)
  params, _, final = _train(optax.chain(adam_8bit(lr, min_8bit_size=0), finisher()), half, steps)
  assert params["w"].dtype == half
  assert abs(final / final32 - 1) < 0.05
  _, _, plain = _adam_8bit_plain(lr, steps, half)
  assert abs(final / final32 - 1) < abs(plain / final32 - 1)


@pytest.mark.parametrize("nesterov", [False, True])
def test_sgd_8bit_tracks_momentum_sgd(nesterov):
  lr, steps = 2e-3, 300
  p32, l32, final32 = _sgd_run(lr, steps, nesterov, False)
  p8, l8, final8 = _sgd_run(lr, steps, nesterov, True)
  assert final32 < 0.3 * l32[0]
  assert abs(final8 / final32 - 1) < 0.01
  assert float(jnp.linalg.norm(p8["w"] - p32["w"]) / jnp.linalg.norm(p32["w"])) < 0.02


def test_weight_decay_and_schedule_are_adamw():
  params = _params()
  sched = optax.linear_schedule(1e-2, 1e-3, 10)
  ours = adam_8bit(sched, weight_decay=0.1, block_size=64)
  ref = optax.adamw(sched, weight_decay=0.1)
  s1, s2 = ours.init(params), ref.init(params)
  update1, update2 = jax.jit(ours.update), jax.jit(ref.update)
  for step in range(3):
    u1, s1 = update1(_grads(step), s1, params)
    u2, s2 = update2(_grads(step), s2, params)
    # 8-bit moments: close to AdamW, with the same decay and schedule.
    for name in SHAPES:
      assert float(jnp.linalg.norm(u1[name] - u2[name]) / jnp.linalg.norm(u2[name])) < 0.02
    assert float(jnp.abs(u1["b"] - u2["b"]).max()) < 1e-7  # small leaf: float32 moments


# ---------------------------------------------------------------------------
# State: dtypes, shapes and bytes.
# ---------------------------------------------------------------------------


def _is_q(x):
  return isinstance(x, qs.QuantizedArray)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize(
  "make",
  [
    lambda: adam_8bit(1e-3),
    lambda: adam_8bit(1e-3, code="linear", block_size=100, rounding="nearest"),
    lambda: scale_by_narrow_adam(mu_dtype="bfloat16", nu_dtype="8bit"),
    lambda: sgd_8bit(1e-2, nesterov=True),
  ],
  ids=["adam_8bit", "adam_8bit_linear", "mixed", "sgd_8bit"],
)
def test_state_dtypes_stable_across_steps(dtype, make):
  # Two leaves, one of each kind (each case compiles its own step): "b"
  # keeps float moments (below min_8bit_size), "v" quantized ones.
  tx = make()
  params = _leaves(_params(dtype), ("b", "v"))
  state0 = tx.init(params)
  update = jax.jit(tx.update)
  state, updates = state0, None
  for step in range(3):
    updates, state = update(_leaves(_grads(step, dtype), ("b", "v")), state, params)
  chex.assert_trees_all_equal_shapes_and_dtypes(state, state0)
  chex.assert_trees_all_equal_shapes_and_dtypes(updates, params)
  chex.assert_tree_all_finite(updates)
  quantized = [x for x in jax.tree.leaves(state, is_leaf=_is_q) if _is_q(x)]
  assert quantized and all(q.codes.dtype == jnp.uint8 and q.absmax.dtype == jnp.float32 for q in quantized)


def test_small_leaves_stay_float32_and_bytes_per_parameter():
  params = _params(jnp.bfloat16)
  state = adam_8bit(1e-3).init(params)[0]
  assert state.mu["b"].dtype == jnp.float32 and state.nu["b"].dtype == jnp.float32
  assert _is_q(state.mu["w"]) and _is_q(state.nu["v"])
  q = state.nu["v"]
  assert q.codes.shape == (40, 130) and q.absmax.shape == (21,)  # ceil(5200 / 256)
  big = 64 * 96
  moment_bytes = state.mu["w"].nbytes + state.nu["w"].nbytes
  assert moment_bytes / big == pytest.approx(2 + 2 * 4 / 256)
  trace_state = sgd_8bit(1e-2, block_size=128).init(params)[0]
  assert isinstance(trace_state, QuantizedTraceState) and trace_state.count.dtype == jnp.int32
  assert trace_state.trace["w"].nbytes / big == pytest.approx(1 + 4 / 128)
  assert trace_state.trace["b"].dtype == jnp.float32


# ---------------------------------------------------------------------------
# Composition: loss scaling, 1-bit compression, checkpoints, devices.
# ---------------------------------------------------------------------------


def test_loss_scaled_skip_leaves_state_bit_for_bit():
  leaves = lambda tree: _leaves(tree, ("b", "w"))  # both quantized (min_8bit_size=0)
  params = leaves(_params(jnp.bfloat16))
  tx = jmp_train.loss_scaled(
    optax.chain(adam_8bit(1e-3, min_8bit_size=0), jmp_train.stochastic_rounding(0)),
    jmp_train.DynamicLossScale(jnp.float32(2.0**10)),
  )
  state = tx.init(params)
  update = jax.jit(tx.update)
  for step in range(2):
    _, state = update(jax.tree.map(lambda g: g * 1024, leaves(_grads(step, jnp.bfloat16))), state, params)
  bad = leaves(_grads(5, jnp.bfloat16))
  bad["w"] = bad["w"].at[3, 4].set(jnp.inf)
  updates, new_state = update(bad, state, params)
  chex.assert_trees_all_equal(new_state.inner_state, state.inner_state)
  chex.assert_trees_all_equal(updates, jax.tree.map(jnp.zeros_like, updates))
  assert int(new_state.total_notfinite) == 1


def test_checkpoint_resume_is_bit_exact(tmp_path):
  pytest.importorskip("orbax.checkpoint")
  tx = optax.chain(adam_8bit(1e-3, block_size=128), jmp_train.stochastic_rounding(3))

  @jax.jit
  def update(g, s, p):
    updates, s = tx.update(g, s, p)
    return optax.apply_updates(p, updates), s

  def run(state, start, stop):
    for step in range(start, stop):
      params, opt_state = update(_leaves(_grads(step, jnp.bfloat16), ("b", "w")), state.opt_state, state.params)
      state = state.replace(step=state.step + 1, params=params, opt_state=opt_state)
    return state

  params = _leaves(_params(jnp.bfloat16), ("b", "w"))  # float32 moments and quantized ones
  # Committed to the device, as a restored state is: the resumed steps run
  # the program compiled for the first ones.
  fresh = lambda: jax.device_put(
    jmp_train.TrainState(
      step=jnp.zeros([], jnp.int32), params=params, opt_state=tx.init(params), model_state={}, rng=None
    ),
    jax.devices()[0],
  )
  straight = run(fresh(), 0, 6)
  half = run(fresh(), 0, 3)
  path = jmp_train.save_checkpoint(tmp_path / "ckpt", half)
  restored = jmp_train.restore_checkpoint(path, fresh())
  chex.assert_trees_all_equal(restored, half)
  chex.assert_trees_all_equal_shapes_and_dtypes(restored, half)
  assert _is_q(restored.opt_state[0][0].mu["w"])
  resumed = run(restored, 3, 6)
  chex.assert_trees_all_equal(resumed, straight)


@pytest.mark.slow
def test_pmap_and_shard_map_keep_replicated_state_identical(num_devices):
  tx = optax.chain(adam_8bit(1e-3, block_size=64), jmp_train.stochastic_rounding(0))
  params = _params(jnp.bfloat16)
  # On the host (NumPy): device arrays would be sliced and stacked by
  # programs compiled for each shape.
  v = np.asarray(_grads(0, jnp.bfloat16)["v"])
  local = np.stack([v[i % 4] for i in range(num_devices)])  # different gradients per device

  shared = _grads(1, jnp.bfloat16)  # the same on every device

  def step(g_local, state, params):
    g = dict(shared)
    g["v"] = g["v"] + jax.lax.pmean(g_local, "batch").astype(jnp.bfloat16)[None, :]
    updates, state = tx.update(g, state, params)
    return optax.apply_updates(params, updates), state

  # Single device: the same averaged gradient.
  mean = jnp.mean(local.astype(jnp.float32), axis=0)
  g_single = dict(shared)
  g_single["v"] = g_single["v"] + mean.astype(jnp.bfloat16)[None, :]
  u, s_single = jax.jit(tx.update)(g_single, tx.init(params), params)
  p_single = optax.apply_updates(params, u)

  replicate = lambda t: jax.tree.map(lambda x: np.broadcast_to(np.asarray(x), (num_devices,) + x.shape), t)
  pm = jax.pmap(step, axis_name="batch")
  p_pm, s_pm = jax.block_until_ready(pm(local, replicate(tx.init(params)), replicate(params)))
  mesh = jax.make_mesh((num_devices,), ("batch",))
  sm = jax.jit(
    jax.shard_map(lambda g, s, p: step(g[0], s, p), mesh=mesh, in_specs=(P("batch"), P(), P()), out_specs=(P(), P()))
  )
  local = jax.device_put(local, NamedSharding(mesh, P("batch")))
  p_sm, s_sm = jax.block_until_ready(sm(local, tx.init(params), params))
  replicas, sm_host = jax.device_get(((p_pm, s_pm), (p_sm, s_sm)))
  for i in range(num_devices):
    chex.assert_trees_all_equal(jax.tree.map(lambda x: x[i], replicas), sm_host)
  # One device with the averaged gradient: the same up to the mean's rounding.
  chex.assert_trees_all_close(p_sm, p_single, atol=1e-2, rtol=1e-2)
  chex.assert_trees_all_equal_shapes_and_dtypes(s_sm, s_single)


def test_after_sign_compression_under_pmap():
  # Two replicas: the exchange's program grows with their number, and any
  # replica count > 1 shows whether they agree.
  num_devices = 2
  tx = optax.chain(jmp_train.sign_compression("batch"), adam_8bit(1e-2, min_8bit_size=0))
  params = _params()
  rng = np.random.default_rng(0)
  # NumPy arrays: pmap puts them on the devices as they are.
  grads = jax.tree.map(lambda p: rng.normal(size=(num_devices,) + p.shape).astype(np.float32), params)
  devices = jax.devices()[:num_devices]
  init = jax.pmap(tx.init, axis_name="batch", devices=devices)
  update = jax.pmap(tx.update, axis_name="batch", devices=devices)
  state = init(jax.tree.map(lambda x: np.broadcast_to(np.asarray(x), (num_devices,) + x.shape), params))
  for _ in range(2):
    updates, new_state = jax.block_until_ready(update(grads, state))
    chex.assert_trees_all_equal_shapes_and_dtypes(new_state, state)
    state = new_state
  adam_state = state[1][0]
  for leaf in jax.tree.leaves(adam_state):  # replicas agree on the 8-bit moments
    leaf = np.asarray(leaf)
    np.testing.assert_array_equal(leaf, np.broadcast_to(leaf[0], leaf.shape))
  chex.assert_tree_all_finite(updates)


# ---------------------------------------------------------------------------
# Errors.
# ---------------------------------------------------------------------------


def test_errors():
  with pytest.raises(ValueError, match=r"nu_dtype must be None .*'float32', 'bfloat16'.*'8bit'.*got 'fp4'"):
    scale_by_narrow_adam(nu_dtype="fp4")
  with pytest.raises(ValueError, match="mu_dtype .*got 'int32'"):
    scale_by_narrow_adam(mu_dtype="int32")
  with pytest.raises(ValueError, match=r"b2 must be in \[0, 1\), got 1.5"):
    adam_8bit(1e-3, b2=1.5)
  with pytest.raises(ValueError, match=r"rounding must be one of \('stochastic', 'nearest'\)"):
    adam_8bit(1e-3, rounding="up")
  with pytest.raises(ValueError, match="code must be one of"):
    adam_8bit(1e-3, code="fp8")
  with pytest.raises(ValueError, match="block_size must be a positive int"):
    sgd_8bit(1e-2, block_size=-1)
  with pytest.raises(ValueError, match="min_8bit_size must be an int >= 0"):
    adam_8bit(1e-3, min_8bit_size=-3)
  with pytest.raises(ValueError, match=r"momentum must be in \[0, 1\)"):
    sgd_8bit(1e-2, momentum=1.0)
  with pytest.raises(ValueError, match="nesterov must be a bool"):
    sgd_8bit(1e-2, nesterov="yes")
  with pytest.raises(ValueError, match=r"learning_rate must be finite and > 0.*got -0.001"):
    adam_8bit(-1e-3)
  with pytest.raises(ValueError, match=r"learning_rate must be finite and > 0.*got 0"):
    sgd_8bit(0)
  with pytest.raises(ValueError, match="eps must be finite and >= 0, got -1.0"):
    adam_8bit(1e-3, eps=-1.0)
  with pytest.raises(ValueError, match="eps_root must be finite and >= 0, got inf"):
    scale_by_narrow_adam(eps_root=float("inf"))
  with pytest.raises(ValueError, match="weight_decay must be finite and >= 0, got -0.01"):
    adam_8bit(1e-3, weight_decay=-0.01)
  assert scale_by_narrow_adam(mu_dtype="int8", nu_dtype="8BIT") is not None  # aliases


def test_inject_hyperparams():
  # The block layout is static: it sets the state's shapes.
  tx = optax.inject_hyperparams(adam_8bit, static_args=("block_size", "min_8bit_size"))(
    learning_rate=1e-3, weight_decay=0.01
  )
  params = _params()
  state = tx.init(params)
  updates, state = jax.jit(tx.update)(_grads(0), state, params)
  assert float(state.hyperparams["learning_rate"]) == pytest.approx(1e-3)
  chex.assert_tree_all_finite(updates)


def test_block_layout_injected_as_an_array_is_named():
  # optax.inject_hyperparams passes ints as arrays unless they are static.
  tx = optax.inject_hyperparams(adam_8bit, static_args=("min_8bit_size",))(learning_rate=1e-3)
  with pytest.raises(ValueError, match="block_size .* list it in static_args"):
    tx.init(_params())
  tx = optax.inject_hyperparams(sgd_8bit, static_args=("block_size",))(learning_rate=1e-3)
  with pytest.raises(ValueError, match="min_8bit_size .* list it in static_args"):
    tx.init(_params())


@pytest.mark.parametrize(
  "make, name",
  [
    (lambda: adam_8bit(1e-3, min_8bit_size=0), "scale_by_narrow_adam"),
    (lambda: sgd_8bit(1e-2, min_8bit_size=0), "sgd_8bit"),
  ],
)
def test_integer_leaves_are_named_and_masked_ones_pass(make, name):
  tree = {"w": jnp.ones((4, 64)), "step": jnp.ones((3,), jnp.int32)}
  tx = make()
  message = rf"{name} needs floating parameters.*'step'.*int32.*optax.masked"
  with pytest.raises(ValueError, match=message):
    tx.init(tree)
  state = tx.init({"w": tree["w"]})
  with pytest.raises(ValueError, match=rf"{name} needs floating gradients.*'step'.*int32"):
    tx.update(tree, state)
  # Masked out, the integer leaf passes through and the rest is updated.
  masked = optax.masked(make(), {"w": True, "step": False})
  updates, _ = jax.jit(masked.update)(tree, masked.init(tree))
  np.testing.assert_array_equal(updates["step"], tree["step"])
  assert np.all(np.asarray(updates["w"]) < 0)
