"""1-bit Adam and 1-bit momentum SGD across modes, loss scaling, checkpoints, processes."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jmp_train
from jmp_train import OneBitAdamState, OneBitMomentumState, SignCompressionState
from jmp_train import one_bit_adam, one_bit_momentum, sign_compression_specs
from jmp_train.diagnostics import collective_ops
from jmp_train.diagnostics import conditional_branches

from helpers import processes
from helpers.one_bit import AXIS, SHAPES, adam, adam_rescaled, make_tree, momentum, pmapped


# ---------------------------------------------------------------------------
# Execution modes, dtypes, state structure.
# ---------------------------------------------------------------------------


# Compiling a step takes most of each test's time: the tests below share
# these optimizers, each built and compiled once per module.
SHARD_MAP_TXS = {
  # Defaults: clip_step and rescale_variance on.
  "adam": lambda: one_bit_adam(1e-2, axis_name=AXIS, warmup_steps=1, weight_decay=0.01),
  "momentum": lambda: one_bit_momentum(0.1, axis_name=AXIS, warmup_steps=1, nesterov=True),
}
ADAM_KW = dict(learning_rate=1e-2, weight_decay=0.01, clip_step=True, rescale_variance=True, warmup_steps=1)
MOMENTUM_KW = dict(learning_rate=0.1, momentum=0.9, warmup_steps=1)


@functools.lru_cache(maxsize=None)
def shard_mapped(name, k):
  """(tx, mesh, specs, init, step) under shard_map over k devices; step takes local grads."""
  tx = SHARD_MAP_TXS[name]()
  mesh = jax.make_mesh((k,), (AXIS,), devices=jax.devices()[:k])
  params = {n: jnp.zeros(s) for n, s in SHAPES.items()}
  shapes = jax.eval_shape(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=P()), params)
  specs = sign_compression_specs(shapes, AXIS)
  init = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=specs))

  def local_step(p, s, g):
    updates, s = tx.update(jax.tree.map(lambda x: x[0], g), s, p)
    return optax.apply_updates(p, updates), s

  step = jax.jit(jax.shard_map(local_step, mesh=mesh, in_specs=(P(), specs, P(AXIS)), out_specs=(P(), specs)))
  return tx, mesh, specs, init, step


@pytest.mark.parametrize("name", ["adam", "momentum"])
def test_shard_map_equals_pmap(name):
  k = 4
  tx, mesh, specs, init, step = shard_mapped(name, k)
  # The moments are replicated, the residuals per replica.
  assert specs.compression == SignCompressionState(P(), P(AXIS), P(AXIS))
  assert all(s == P() for s in jax.tree.leaves(specs[1]))
  # float32, not weakly typed (as jnp.full(s, 0.1) is): as the step returns
  # them, so that the step is compiled once.
  params = {n: np.full(s, 0.1, np.float32) for n, s in SHAPES.items()}
  p_sm, s_sm = jax.device_put(params, NamedSharding(mesh, P())), init(params)
  p_pm = jax.tree.map(lambda x: np.broadcast_to(x, (k,) + x.shape), params)
  devices = jax.devices()[:k]
  s_pm = jax.pmap(tx.init, axis_name=AXIS, devices=devices)(p_pm)

  def pm_step(p, s, g):
    updates, s = tx.update(g, s, p)
    return optax.apply_updates(p, updates), s

  pm_step = jax.pmap(pm_step, axis_name=AXIS, devices=devices)
  for t in range(3):
    grads = make_tree(k, seed=90 + t)
    p_sm, s_sm = jax.block_until_ready(step(p_sm, s_sm, jax.device_put(grads, NamedSharding(mesh, P(AXIS)))))
    p_pm, s_pm = jax.block_until_ready(pm_step(p_pm, s_pm, grads))
    # NumPy, as at the first step: the pmapped step, given device arrays
    # instead, would be compiled again.
    p_pm = jax.tree.map(np.asarray, p_pm)
  for n in SHAPES:
    np.testing.assert_allclose(np.asarray(p_sm[n]), p_pm[n][0], rtol=1e-6, atol=1e-7)
  for r_sm, r_pm in zip(s_sm.compression.worker_residual, s_pm.compression.worker_residual, strict=True):
    np.testing.assert_allclose(np.asarray(r_sm).reshape(k, -1), np.asarray(r_pm).reshape(k, -1), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize(
  "factory, kwargs", [(one_bit_adam, ADAM_KW), (one_bit_momentum, MOMENTUM_KW)], ids=["adam", "momentum"]
)
def test_dtypes_are_stable(dtype, factory, kwargs):
  k = 2
  # Built as in test_injected_hyperparameters_step_as_plain_ones (float32 shared).
  tx, init, update = pmapped(k, factory, **kwargs)
  params = make_tree(k, seed=3, dtype=dtype)
  state = init(params)
  first = jax.tree.map(lambda x: (x.shape, x.dtype), state)
  for t in range(3):
    updates, state = update(make_tree(k, seed=t, dtype=dtype), state, params)
    assert jax.tree.map(lambda x: (x.shape, x.dtype), state) == first
    for u in jax.tree.leaves(updates):
      assert u.dtype == dtype and np.isfinite(np.asarray(u, np.float32)).all()
  assert state.count.dtype == jnp.int32
  assert isinstance(state, OneBitAdamState if factory is one_bit_adam else OneBitMomentumState)


def test_one_bit_momentum_without_warmup_has_no_float_all_reduce():
  k = 8
  tx = one_bit_momentum(0.1, axis_name=AXIS, scale="l1")
  params = {"w": jnp.zeros((k, 64, 256)), "b": jnp.zeros((k, 256))}
  devices = jax.devices()[:k]
  state = jax.pmap(tx.init, axis_name=AXIS, devices=devices)(params)
  compiled = jax.pmap(tx.update, axis_name=AXIS, devices=devices).lower(params, state).compile()
  counts = jmp_train.diagnostics.collective_bytes(compiled)
  assert counts["all-reduce"] == 0
  n = 64 * 256 + 256
  # The packed bits with their reconstruction pairs (8 bytes per segment piece).
  assert n // 8 < counts["all-to-all:u8"] <= n // 8 + 8 * k * 4
  assert not any(key.endswith(":f32") for key in counts)
  wire = jmp_train.diagnostics.collective_bytes(compiled, wire=True)["total"]
  assert wire <= 2 * (k - 1) / k * 4 * n / 28


# The exact refresh steps and rescale_variance's per-tensor all-reduce in one
# program: each case is a compilation.
@pytest.mark.parametrize("refresh, rescale", [(0, False), (4, True)])
def test_one_bit_adam_float_all_reduce_only_in_the_warmup_branch(refresh, rescale):
  k = 8
  tx = one_bit_adam(1e-3, axis_name=AXIS, warmup_steps=5, variance_refresh=refresh, rescale_variance=rescale)
  params = {"w": jnp.zeros((k, 64, 256)), "b": jnp.zeros((k, 256))}
  devices = jax.devices()[:k]
  state = jax.pmap(tx.init, axis_name=AXIS, devices=devices)(params)
  text = jax.pmap(tx.update, axis_name=AXIS, devices=devices).lower(params, state, params).compile().as_text()
  ops = collective_ops(text)
  names = conditional_branches(text)
  n = 64 * 256 + 256
  # rescale_variance adds one all-reduce of a float per tensor to every step.
  scalars = [op for op in ops if op.operand_types == (("f32", (len(params),)),)]
  assert len(scalars) == rescale
  float_reduce = [op for op in ops if op.kind == "all-reduce" and op not in scalars]
  packed = [op for op in ops if op.dtypes == ("u8",)]
  assert float_reduce and packed
  assert sum(op.operand_bytes for op in float_reduce) >= 4 * n  # the gradients
  warmup_comps = {op.computation for op in float_reduce}
  assert warmup_comps <= names  # never in the entry computation
  after = [op for op in ops if op.computation not in warmup_comps]
  assert not any(op.kind == "all-reduce" for op in after if op not in scalars)
  # After warm-up, at K = 8: under 1/28 of a float32 ring all-reduce.
  assert sum(op.wire_bytes for op in after) <= 2 * (k - 1) / k * 4 * n / 28


# ---------------------------------------------------------------------------
# loss_scaled: an overflow anywhere skips the step everywhere.
# ---------------------------------------------------------------------------


# 1-bit Adam with the most state (rescale_variance's mean squares too), and
# 1-bit momentum.
@pytest.mark.parametrize("factory", [adam_rescaled, momentum], ids=["adam-rescaled", "momentum"])
def test_loss_scaled_overflow_on_one_replica_keeps_state_bit_for_bit(factory):
  k, scale = 4, 2.0**10
  inner = factory(warmup_steps=1)
  tx = jmp_train.loss_scaled(inner, jmp_train.DynamicLossScale(scale=scale), axis_name=AXIS)
  devices = jax.devices()[:k]
  init = jax.pmap(tx.init, axis_name=AXIS, devices=devices)
  update = jax.pmap(tx.update, axis_name=AXIS, devices=devices)
  params = jax.tree.map(lambda x: x * 0 + 0.1, make_tree(k, seed=0))
  state = init(params)
  scaled = lambda g, s: jax.tree.map(lambda x: x * s, g)
  for t in range(3):  # past warm-up: residuals non-zero
    _, state = update(scaled(make_tree(k, seed=100 + t), scale), state, params)
  before = state.inner_state
  assert max(np.abs(np.asarray(r)).max() for r in before.compression.worker_residual) > 0
  assert np.abs(np.asarray(before.compression.server_residual)).max() > 0
  bad = make_tree(k, seed=110)
  bad["w"][2, 0, 0] = np.inf  # replica 2 only
  updates, after_state = update(scaled(bad, scale), state, params)
  for leaf in jax.tree.leaves(updates):
    np.testing.assert_array_equal(np.asarray(leaf), 0.0)
  for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after_state.inner_state)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert np.asarray(after_state.total_notfinite).tolist() == [1] * k
  updates, final = update(scaled(make_tree(k, seed=111), scale / 2), after_state, params)
  assert np.asarray(final.inner_state.count).tolist() == [4] * k
  assert np.abs(np.asarray(updates["w"])).max() > 0


# ---------------------------------------------------------------------------
# Checkpoints: resume bit for bit after warm-up; another replica count fails.
# ---------------------------------------------------------------------------


# One process, the steps of test_shard_map_equals_pmap (warm-up 1): two
# steps, a checkpoint, two more. tests/test_killed_process.py resumes a
# two-process 1-bit Adam run under loss scaling.
@pytest.mark.parametrize("name", ["adam", "momentum"])
def test_checkpoint_after_warmup_resumes_bit_for_bit(tmp_path, name):
  pytest.importorskip("orbax.checkpoint")
  import orbax.checkpoint as ocp

  k = 4
  _, mesh, specs, init, step = shard_mapped(name, k)
  params = jax.device_put({n: np.full(s, 0.1, np.float32) for n, s in SHAPES.items()}, NamedSharding(mesh, P()))
  opt_state = init(params)
  grads = [jax.device_put(make_tree(k, seed=120 + t), NamedSharding(mesh, P(AXIS))) for t in range(4)]
  for t in range(2):
    params, opt_state = jax.block_until_ready(step(params, opt_state, grads[t]))
  assert int(opt_state.count) == 2 and np.abs(np.asarray(opt_state.compression.server_residual)).max() > 0
  path = tmp_path / "ckpt"
  with ocp.StandardCheckpointer() as ckpt:
    ckpt.save(path, {"params": params, "opt_state": opt_state})
    ckpt.wait_until_finished()
  p_a, s_a = params, opt_state
  for t in range(2, 4):
    p_a, s_a = jax.block_until_ready(step(p_a, s_a, grads[t]))
  target = jax.tree.map(ocp.utils.to_shape_dtype_struct, {"params": params, "opt_state": opt_state})
  with ocp.StandardCheckpointer() as ckpt:
    restored = ckpt.restore(path, target)
  residuals = restored["opt_state"].compression.worker_residual
  assert all(tuple(r.sharding.spec) == (AXIS,) + (None,) * (r.ndim - 1) for r in residuals)
  p_b, s_b = restored["params"], restored["opt_state"]
  for t in range(2, 4):
    p_b, s_b = jax.block_until_ready(step(p_b, s_b, grads[t]))
  for a, b in zip(jax.tree.leaves((p_a, s_a)), jax.tree.leaves((p_b, s_b))):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("factory", [adam, momentum], ids=["adam", "momentum"])
def test_state_for_another_replica_count_raises(factory):
  tx4, init4, _ = pmapped(4, factory, warmup_steps=1)
  _, _, update2 = pmapped(2, factory, warmup_steps=1)
  state4 = init4(jax.tree.map(np.zeros_like, make_tree(4, seed=0)))
  # Two replicas' copies of a 4-replica state (as a restore onto 2 devices gives).
  moved = jax.tree.map(lambda x: np.asarray(x)[:2], state4)
  with pytest.raises(ValueError, match="replica count"):
    update2(make_tree(2, seed=1), moved, make_tree(2, seed=2))


@pytest.mark.parametrize("factory", [adam, momentum], ids=["adam", "momentum"])
def test_integer_leaves_are_named_and_masked_ones_pass(factory):
  k = 2
  tx, init, update = pmapped(k, factory, warmup_steps=1)
  tree = {"w": jnp.ones((k, 3)), "step": jnp.ones((k, 2), jnp.int32)}
  with pytest.raises(ValueError, match=r"needs floating parameters.*'step'.*int32.*optax.masked"):
    init(tree)
  state = init({"w": tree["w"]})
  with pytest.raises(ValueError, match=r"needs floating gradients.*'step'.*int32"):
    update(tree, state, tree)
  # Masked out, the integer leaf is left alone.
  masked = optax.masked(tx, {"w": True, "step": False})
  m_init = jax.pmap(masked.init, axis_name=AXIS, devices=jax.devices()[:k])
  m_update = jax.pmap(masked.update, axis_name=AXIS, devices=jax.devices()[:k])
  updates, _ = m_update(tree, m_init(tree), tree)
  np.testing.assert_array_equal(np.asarray(updates["step"]), np.asarray(tree["step"]))
  assert np.isfinite(np.asarray(updates["w"])).all() and np.any(np.asarray(updates["w"]) != 0)


def test_bad_arguments():
  with pytest.raises(ValueError, match="warmup_steps"):
    one_bit_adam(1e-3, axis_name=AXIS, warmup_steps=0)
  with pytest.raises(ValueError, match="warmup_steps"):
    one_bit_momentum(0.1, axis_name=AXIS, warmup_steps=-1)
  with pytest.raises(ValueError, match="axis_name"):
    one_bit_momentum(0.1, axis_name=None)
  with pytest.raises(ValueError, match="scale"):
    one_bit_momentum(0.1, axis_name=AXIS, scale="max")
  with pytest.raises(ValueError, match="exchange"):
    one_bit_adam(1e-3, axis_name=AXIS, warmup_steps=1, exchange="gradient")
  with pytest.raises(ValueError, match="variance_refresh"):
    one_bit_adam(1e-3, axis_name=AXIS, warmup_steps=1, variance_refresh=-1)


@pytest.mark.parametrize(
  "kwargs, message",
  [
    ({"learning_rate": -1e-3}, r"learning_rate must be finite and > 0.*got -0.001"),
    ({"learning_rate": "fast"}, "learning_rate must be a number > 0 or a schedule"),
    ({"b1": 1.0}, r"b1 must be in \[0, 1\), got 1.0"),
    ({"b2": 1.0}, r"b2 must be in \[0, 1\), got 1.0"),
    ({"b2": np.float32(-0.5)}, r"b2 must be in \[0, 1\), got .*-0.5"),
    ({"eps": -1e-8}, "eps must be finite and >= 0, got -1e-08"),
    ({"weight_decay": float("nan")}, "weight_decay must be finite and >= 0, got nan"),
    ({"clip_step": "yes"}, "clip_step must be True or False, got 'yes'"),
    ({"rescale_variance": 1}, "rescale_variance must be True or False, got 1"),
  ],
)
def test_bad_adam_hyperparameters_are_named(kwargs, message):
  kwargs = {"learning_rate": 1e-3, **kwargs}
  with pytest.raises(ValueError, match=message):
    one_bit_adam(axis_name=AXIS, warmup_steps=1, **kwargs)


@pytest.mark.parametrize(
  "kwargs, message",
  [
    ({"learning_rate": 0.0}, r"learning_rate must be finite and > 0.*got 0.0"),
    ({"momentum": 1.5}, r"momentum must be in \[0, 1\), got 1.5"),
    ({"weight_decay": -0.1}, "weight_decay must be finite and >= 0, got -0.1"),
    ({"nesterov": "yes"}, "nesterov must be True or False, got 'yes'"),
  ],
)
def test_bad_momentum_hyperparameters_are_named(kwargs, message):
  kwargs = {"learning_rate": 0.1, **kwargs}
  with pytest.raises(ValueError, match=message):
    one_bit_momentum(axis_name=AXIS, **kwargs)


@pytest.mark.parametrize(
  "factory, kwargs, static",
  [
    (one_bit_adam, ADAM_KW, ("warmup_steps", "variance_refresh")),
    (one_bit_adam, dict(learning_rate=1e-2, variance_refresh=2, warmup_steps=1), ("warmup_steps", "variance_refresh")),
    (one_bit_momentum, MOMENTUM_KW, ("warmup_steps",)),
  ],
  ids=["adam", "adam-refresh", "momentum"],
)
def test_injected_hyperparameters_step_as_plain_ones(factory, kwargs, static):
  # optax.inject_hyperparams passes the numbers as (traced) arrays: every
  # step must match the optimizer built from the plain numbers.
  k = 2
  _, plain_init, plain_update = pmapped(k, factory, **kwargs)
  injected = optax.inject_hyperparams(factory, static_args=("axis_name",) + static)(axis_name=AXIS, **kwargs)
  devices = jax.devices()[:k]
  params = jax.tree.map(lambda x: x * 0 + 0.1, make_tree(k, seed=0))
  states = [plain_init(params), jax.pmap(injected.init, axis_name=AXIS, devices=devices)(params)]
  steps = [plain_update, jax.pmap(injected.update, axis_name=AXIS, devices=devices)]
  for t in range(4):
    grads = make_tree(k, seed=60 + t)
    (u_plain, states[0]), (u_injected, states[1]) = (step(grads, state, params) for step, state in zip(steps, states))
    for a, b in zip(jax.tree.leaves(u_plain), jax.tree.leaves(u_injected)):
      np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-4, atol=1e-9)
  assert int(np.asarray(states[1].count)[0]) == 4


def test_a_structural_argument_injected_as_an_array_is_named():
  tx = optax.inject_hyperparams(one_bit_adam, static_args=("axis_name",))(1e-3, axis_name=AXIS, warmup_steps=1)
  with pytest.raises(ValueError, match="warmup_steps .* list it in static_args"):
    jax.pmap(tx.init, axis_name=AXIS, devices=jax.devices()[:1])({"w": jnp.zeros((1, 3))})


def test_schedules_are_accepted():
  one_bit_momentum(optax.cosine_decay_schedule(0.1, 10), axis_name=AXIS)


# ---------------------------------------------------------------------------
# Integration points owned elsewhere (enabled at merge).
# ---------------------------------------------------------------------------


def test_public_names():
  assert jmp_train.one_bit_adam is one_bit_adam
  assert jmp_train.one_bit_momentum is one_bit_momentum
  assert jmp_train.OneBitAdamState is OneBitAdamState
  assert jmp_train.OneBitMomentumState is OneBitMomentumState


@pytest.mark.parametrize(
  "make, state_type",
  [
    (lambda: one_bit_adam(1e-2, axis_name="batch", warmup_steps=2), OneBitAdamState),
    # The warm-up's pmean is invariant across replicas, the compressed
    # branch's output is not: the step must still trace under shard_map.
    (lambda: one_bit_momentum(1e-2, axis_name="batch", warmup_steps=2), OneBitMomentumState),
  ],
  ids=["adam", "momentum"],
)
def test_make_train_step_with_one_bit_optimizer_as_the_whole_optimizer(make, state_type):
  import flax.linen as nn

  k = 4
  model = nn.Dense(3)
  params = model.init(jax.random.key(0), jnp.ones((1, 5)))["params"]
  mesh = jax.make_mesh((k,), ("batch",), devices=jax.devices()[:k])
  step = jmp_train.make_train_step(
    model.apply,
    lambda out, y: jnp.mean((out - y) ** 2),
    None,
    compression=make(),
    loss_scale=jmp_train.DynamicLossScale(scale=2.0**8),
    mode="shard_map",
    axis_name="batch",
    mesh=mesh,
  )
  state = step.init(params)
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.normal(size=(8 * k, 5)), jnp.float32)
  y = x[:, :3] * 0.5
  losses = []
  for _ in range(8):
    state, metrics = step(state, step.shard_batch((x, y)))
    losses.append(float(metrics["loss"]))
  assert losses[-1] < losses[0]
  found = [s for s in jax.tree.leaves(state, is_leaf=lambda s: isinstance(s, state_type)) if isinstance(s, state_type)]
  assert len(found) == 1 and np.asarray(found[0].count).max() == 8


# ---------------------------------------------------------------------------
# Two processes on loopback (jax.distributed, gloo) equal one process.
# ---------------------------------------------------------------------------


# 1-bit Adam over two processes (one device each, under make_train_step and
# loss scaling, killed and restarted) equals one process in
# tests/test_killed_process.py, and sign_compression over two processes in
# tests/test_sign_compression_multiprocess.py. Here 1-bit momentum SGD with
# 8 replicas as 2 processes of 4 devices (several devices in each process,
# and every chunk's owner sending to devices of its own process and of the
# other), equal bit for bit to the same replicas as the 8 devices of this
# one process.
@pytest.mark.slow
@pytest.mark.parametrize("optimizer, num_processes, per_process", [("momentum", 2, 4)])
def test_processes_equal_one_process(tmp_path, optimizer, num_processes, per_process):
  from helpers import one_bit_multiprocess_worker as worker

  outs = [tmp_path / f"out_{i}.npz" for i in range(num_processes)]
  processes.run_workers(
    "one_bit_multiprocess_worker.py",
    [[str(i), str(num_processes), "{port}", str(out), optimizer, str(per_process)] for i, out in enumerate(outs)],
    timeout=300,
  )
  k = num_processes * per_process
  devices = jax.devices()[:k]
  assert len(devices) == k
  expected = worker.train(devices, optimizer)
  got = {}
  for out in outs:
    with np.load(out) as f:
      got.update({name: f[name] for name in f.files})
  # Parameters on every process; residuals of process 0's devices, then
  # process 1's, and so on, matched to the one-process run's devices in order.
  for name in worker.initial_params():
    np.testing.assert_array_equal(got[name], expected[name], err_msg=name)
    assert not np.array_equal(worker.initial_params()[name], expected[name])
  for field in ("worker_residual", "server_residual"):
    mine = [expected[f"{field}/{d.id}"] for d in devices]
    theirs = [got[k] for k in sorted((k for k in got if k.startswith(field)), key=lambda k: int(k.split("/")[1]))]
    assert len(theirs) == k
    for a, b in zip(mine, theirs):
      np.testing.assert_array_equal(a, b)
    assert any(np.abs(a).max() > 0 for a in mine)
