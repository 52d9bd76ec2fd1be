"""Tests for jmp_train._src.one_bit_optimizers (1-bit Adam, 1-bit momentum SGD)."""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jmp_train
from jmp_train import SignCompressionState, collective_ops, sign_compression_specs
from jmp_train._src.one_bit_optimizers import (
    OneBitAdamState,
    OneBitMomentumState,
    one_bit_adam,
    one_bit_momentum,
)

AXIS = "i"
# In jax.tree order (sorted keys), so that leaf order matches the flat buffer.
SHAPES = {"b": (5,), "conv": (2, 2, 3, 4), "w": (6, 3)}
B1, B2, EPS = 0.9, 0.999, 1e-8


# ---------------------------------------------------------------------------
# NumPy reference: the 1-bit exchange (worker + server error feedback, K
# owners of contiguous chunks) and 1-bit Adam on top of it, from the papers'
# description.
# ---------------------------------------------------------------------------


def ref_flatten(leaves, scale):
  parts, seg_len = [], []
  for x in leaves:
    x = np.asarray(x, np.float32)
    if scale == "column" and x.ndim >= 2:
      parts.append(np.moveaxis(x, -1, 0).ravel())
      seg_len += [x.size // x.shape[-1]] * x.shape[-1]
    else:
      parts.append(x.ravel())
      seg_len.append(x.size)
  return np.concatenate(parts), seg_len


def ref_unflatten(flat, shapes, scale):
  out, off = [], 0
  for shape in shapes:
    size = int(np.prod(shape))
    part = flat[off : off + size]
    if scale == "column" and len(shape) >= 2:
      part = np.moveaxis(part.reshape((shape[-1],) + shape[:-1]), 0, -1)
    out.append(part.reshape(shape))
    off += size
  return out


def ref_decode(x, scale):
  """One segment ``x`` quantized to two values and decoded."""
  nonneg = x >= 0
  if scale == "column":
    hi = x[nonneg].mean() if nonneg.any() else 0.0
    lo = x[~nonneg].mean() if (~nonneg).any() else 0.0
  elif scale == "l1":
    hi = lo = np.abs(x).mean()
    lo = -lo
  else:
    hi = np.sqrt((x * x).mean())
    lo = -hi
  return np.where(nonneg, np.float32(hi), np.float32(lo)).astype(np.float32)


def ref_exchange(values, r, e, scale):
  """1-bit average of K replicas' trees. values: K lists of leaves.

  Returns (averaged leaves, new worker residuals (K, n_pad), new server
  residuals (K, S)).
  """
  k = len(values)
  flats = [ref_flatten(v, scale) for v in values]
  seg_len, n = flats[0][1], flats[0][0].size
  n_pad = max(8 * k, -(-n // (8 * k)) * 8 * k)
  chunk = n_pad // k
  ids = np.repeat(np.arange(len(seg_len) + 1), seg_len + [n_pad - n])
  v = np.stack([np.pad(f, (0, n_pad - n)) for f, _ in flats]) + r
  dec = np.zeros_like(v)
  for j in range(k):
    for s in np.unique(ids):
      dec[j, ids == s] = ref_decode(v[j, ids == s], scale)
  u = dec.sum(axis=0, dtype=np.float32) / np.float32(k) + e.reshape(-1)
  out = np.zeros(n_pad, np.float32)
  for c in range(k):  # owner c re-quantizes its chunk, per segment part
    sl = np.zeros(n_pad, bool)
    sl[c * chunk : (c + 1) * chunk] = True
    for s in np.unique(ids[sl]):
      mask = sl & (ids == s)
      out[mask] = ref_decode(u[mask], scale)
  shapes = [np.shape(x) for x in values[0]]
  return ref_unflatten(out[:n], shapes, scale), v - dec, (u - out).reshape(k, chunk)


def ref_covered(t, warmup, refresh):
  """Steps of gradient history v stands for after t steps."""
  after = max(t - warmup, 0)
  return min(t, warmup) + (after - after % refresh if refresh else 0)


def ref_adam_step(grads, params, state, *, lr, wd, warmup, scale, exchange, refresh=0):
  """One step of 1-bit Adam for K replicas from the (replicated) state.

  grads: K lists of leaves; params, mu, nu: lists of leaves; state: dict with
  count, mu, nu, r (K, n_pad), e (K, S). ``refresh``: an exact step every
  ``refresh`` steps after warm-up, v decayed by B2**refresh. Returns
  (updates, new state).
  """
  k, count = len(grads), state["count"]
  mu, nu, r, e = state["mu"], state["nu"], state["r"], state["e"]
  if count < warmup or (refresh and (count + 1 - warmup) % refresh == 0):
    keep = B2 if count < warmup else B2**refresh
    g = [np.mean([grads[j][i] for j in range(k)], axis=0, dtype=np.float32) for i in range(len(mu))]
    live = [np.full(v.shape, count < warmup) | (v > 0) for v in nu]
    mu = [np.where(ok, B1 * m + (1 - B1) * x, 0) for m, x, ok in zip(mu, g, live)]
    nu = [np.where(ok, keep * v + (1 - keep) * x * x, v) for v, x, ok in zip(nu, g, live)]
  else:
    # Frozen preconditioner d (m/d is exchanged) or none (m is exchanged);
    # elements with v == 0 keep m == 0.
    if exchange == "preconditioned":
      c2 = np.float32(1) - np.float32(B2) ** np.float32(ref_covered(count, warmup, refresh))
      d = [np.sqrt(v / c2) + EPS for v in nu]
    else:
      d = [np.ones_like(v) for v in nu]
    local = [
        [np.where(v > 0, (B1 * m + (1 - B1) * x) / dd, 0) for m, x, v, dd in zip(mu, grads[j], nu, d)]
        for j in range(k)
    ]
    avg, r, e = ref_exchange(local, r, e, scale)
    mu = [np.where(v > 0, a * dd, 0) for a, v, dd in zip(avg, nu, d)]
  t = count + 1
  c1, c2 = 1 - B1**t, 1 - B2 ** ref_covered(t, warmup, refresh)
  updates = [
      -lr * ((m / c1) / (np.sqrt(v / c2) + EPS) + wd * p) for m, v, p in zip(mu, nu, params)
  ]
  return updates, dict(count=t, mu=mu, nu=nu, r=r, e=e)


# ---------------------------------------------------------------------------
# Helpers.
# ---------------------------------------------------------------------------


def make_tree(k, seed, dtype=jnp.float32, scale=1.0):
  rng = np.random.default_rng(seed)
  return {n: jnp.asarray(rng.normal(size=(k,) + s) * scale, dtype) for n, s in SHAPES.items()}


def leaves_of(tree, j=None):
  return [np.asarray(tree[n] if j is None else tree[n][j], np.float32) for n in SHAPES]


@functools.lru_cache(maxsize=None)
def pmapped(k, factory, **kwargs):
  tx = factory(axis_name=AXIS, **kwargs)
  devices = jax.devices()[:k]
  return (
      tx,
      jax.pmap(tx.init, axis_name=AXIS, devices=devices),
      jax.pmap(tx.update, axis_name=AXIS, devices=devices),
  )


def adam(**kw):
  kw.setdefault("axis_name", AXIS)
  return one_bit_adam(kw.pop("learning_rate", 1e-2), **kw)


def momentum(**kw):
  kw.setdefault("axis_name", AXIS)
  return one_bit_momentum(kw.pop("learning_rate", 0.1), **kw)


# ---------------------------------------------------------------------------
# 1-bit Adam against the NumPy reference, step by step; conservation.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "k, scale, exchange, refresh",
    [(2, "l2", "momentum", 0), (4, "l2", "momentum", 0), (8, "l2", "momentum", 0),
     (4, "column", "momentum", 0), (4, "l2", "preconditioned", 0),
     (4, "l2", "momentum", 2), (4, "l2", "preconditioned", 3)],
)
def test_adam_matches_numpy_reference_step_by_step(k, scale, exchange, refresh):
  lr, wd, warmup = 1e-2, 0.05, 2
  _, init, update = pmapped(
      k, adam, learning_rate=lr, weight_decay=wd, warmup_steps=warmup, scale=scale,
      exchange=exchange, variance_refresh=refresh,
  )
  params = make_tree(k, seed=1)
  params = jax.tree.map(lambda x: jnp.broadcast_to(x[:1], x.shape), params)  # replicated
  state = init(params)
  p_np = leaves_of(params, 0)
  for step in range(7 if refresh else 5):
    grads = make_tree(k, seed=10 + step)
    before = dict(
        count=int(state.count[0]),
        mu=leaves_of(state.mu, 0),
        nu=leaves_of(state.nu, 0),
        r=np.asarray(state.compression.worker_residual),
        e=np.asarray(state.compression.server_residual),
    )
    ref_u, ref = ref_adam_step(
        [leaves_of(grads, j) for j in range(k)], p_np, before,
        lr=lr, wd=wd, warmup=warmup, scale=scale, exchange=exchange, refresh=refresh,
    )
    residuals = (state.compression.worker_residual, state.compression.server_residual)
    updates, state = update(grads, state, params)
    for j in range(k):  # every replica holds the same update and moments
      for a, b in zip(leaves_of(updates, j), ref_u):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-7)
      for a, b in zip(leaves_of(state.mu, j), ref["mu"]):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-7)
      for a, b in zip(leaves_of(state.nu, j), ref["nu"]):
        np.testing.assert_allclose(a, b, rtol=2e-6, atol=1e-9)
    np.testing.assert_allclose(np.asarray(state.compression.worker_residual), ref["r"], rtol=2e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(state.compression.server_residual), ref["e"], rtol=2e-5, atol=1e-6)
    assert int(state.count[0]) == step + 1
    if step < warmup:  # residuals untouched during warm-up
      np.testing.assert_array_equal(np.asarray(state.compression.worker_residual), 0.0)
    else:
      assert np.abs(np.asarray(state.compression.worker_residual)).max() > 0
    exact = step < warmup or (refresh and (step + 1 - warmup) % refresh == 0)
    if exact:  # an exact step leaves both residuals as they were
      np.testing.assert_array_equal(np.asarray(state.compression.worker_residual), residuals[0])
      np.testing.assert_array_equal(np.asarray(state.compression.server_residual), residuals[1])
    if refresh and step >= warmup:  # v moves on refresh steps only
      assert (ref["nu"][0] != before["nu"][0]).any() == bool(exact)


@pytest.mark.parametrize(
    "factory, exchange",
    [(adam, "momentum"), (adam, "preconditioned"), (momentum, None)],
    ids=["adam", "adam-preconditioned", "momentum"],
)
def test_both_residuals_conserve_the_exchanged_momentum_each_step(factory, exchange):
  # mean_j (m_j + r_j) == new momentum + mean_j r_j' + (e' - e), per element:
  # nothing the quantization drops is lost, with worker and server residuals.
  k = 4
  extra = {"exchange": exchange} if exchange else {}
  _, init, update = pmapped(k, factory, warmup_steps=1, scale="l2", **extra)
  params = jax.tree.map(lambda x: x * 0, make_tree(k, seed=0))
  state = init(params)
  coef = (B1, 1 - B1) if factory is adam else (0.9, 1.0)
  flat = lambda leaves: np.concatenate([x.ravel() for x in leaves])
  for step in range(4):
    grads = make_tree(k, seed=20 + step)
    trace = state.mu if factory is adam else state.trace
    if exchange == "preconditioned":  # the exchange runs on m / (sqrt(v_hat) + eps)
      d = flat(np.sqrt(v / (np.float32(1) - np.float32(B2))) + EPS for v in leaves_of(state.nu, 0))
    else:
      d = 1.0
    local = np.stack([
        flat(coef[0] * m + coef[1] * g for m, g in zip(leaves_of(trace, j), leaves_of(grads, j))) / d
        for j in range(k)
    ])
    r0 = np.asarray(state.compression.worker_residual)
    e0 = np.asarray(state.compression.server_residual).reshape(-1)
    _, state = update(grads, state, params)
    if step < 1:
      continue
    n = local.shape[1]
    r1 = np.asarray(state.compression.worker_residual)
    e1 = np.asarray(state.compression.server_residual).reshape(-1)
    new = state.mu if factory is adam else state.trace
    out = flat(leaves_of(new, 0)) / d
    decoded = np.pad(local, ((0, 0), (0, r0.shape[1] - n))) + r0 - r1  # each worker's message
    # Per leaf, every worker's decoded message takes the two values +-h.
    off = 0
    for shape in SHAPES.values():
      size = int(np.prod(shape))
      for j in range(k):
        part = np.abs(decoded[j, off : off + size])
        np.testing.assert_allclose(part, part.max(), rtol=1e-5)
      off += size
    received = decoded.sum(0, dtype=np.float32)[:n] / k + e0[:n] - e1[:n]
    np.testing.assert_allclose(out, received, rtol=1e-5, atol=1e-6)


def test_warmup_is_adamw_on_the_average_and_momentum_is_sgd():
  k, steps = 4, 3
  sched = optax.linear_schedule(1e-2, 1e-3, 10)
  cases = [
      (one_bit_adam(sched, weight_decay=0.1, axis_name=AXIS, warmup_steps=10),
       optax.adamw(sched, weight_decay=0.1)),
      (one_bit_momentum(sched, 0.9, axis_name=AXIS, warmup_steps=10, nesterov=True),
       optax.sgd(sched, 0.9, nesterov=True)),
  ]
  for tx, ref in cases:
    devices = jax.devices()[:k]
    params = jax.tree.map(lambda x: jnp.broadcast_to(x[:1], x.shape), make_tree(k, seed=2))
    state = jax.pmap(tx.init, axis_name=AXIS, devices=devices)(params)
    step = jax.pmap(tx.update, axis_name=AXIS, devices=devices)
    rp = jax.tree.map(lambda x: x[0], params)
    rstate = ref.init(rp)
    for t in range(steps):
      grads = make_tree(k, seed=40 + t)
      updates, state = step(grads, state, params)
      params = optax.apply_updates(params, updates)
      ru, rstate = ref.update(jax.tree.map(lambda x: x.mean(0), grads), rstate, rp)
      rp = optax.apply_updates(rp, ru)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(rp)):
      np.testing.assert_allclose(np.asarray(a)[0], np.asarray(b), rtol=1e-6, atol=1e-7)


def test_adam_elements_without_warmup_gradient_stay_still():
  # v == 0 after warm-up (a dead input, a token never seen): a later gradient
  # would step by g / eps; the momentum there stays zero instead.
  k = 2
  _, init, update = pmapped(k, adam, warmup_steps=2)
  params = jax.tree.map(lambda x: x * 0, make_tree(k, seed=0))
  state = init(params)
  for step in range(4):
    grads = make_tree(k, seed=80 + step)
    if step < 2:
      grads["w"] = grads["w"].at[:, 0, 0].set(0.0)
    updates, state = update(grads, state, params)
  assert float(np.asarray(state.nu["w"])[0, 0, 0]) == 0.0
  np.testing.assert_array_equal(np.asarray(updates["w"])[:, 0, 0], 0.0)
  np.testing.assert_array_equal(np.asarray(state.mu["w"])[:, 0, 0], 0.0)
  assert np.all(np.abs(np.asarray(updates["w"])[:, 1:]) > 0)


# ---------------------------------------------------------------------------
# Execution modes, dtypes, state structure.
# ---------------------------------------------------------------------------


def shard_mapped(tx, k):
  """(init, step) under shard_map over k devices; step takes local grads."""
  mesh = jax.make_mesh((k,), (AXIS,), devices=jax.devices()[:k])
  params = {n: jnp.zeros(s) for n, s in SHAPES.items()}
  shapes = jax.eval_shape(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=P()), params)
  specs = sign_compression_specs(shapes, AXIS)
  init = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=specs))

  def local_step(p, s, g):
    updates, s = tx.update(jax.tree.map(lambda x: x[0], g), s, p)
    return optax.apply_updates(p, updates), s

  step = jax.jit(
      jax.shard_map(local_step, mesh=mesh, in_specs=(P(), specs, P(AXIS)), out_specs=(P(), specs))
  )
  return mesh, specs, init, step


@pytest.mark.parametrize(
    "tx",
    [one_bit_adam(1e-2, axis_name=AXIS, warmup_steps=1, weight_decay=0.01),
     one_bit_momentum(0.1, axis_name=AXIS, nesterov=True)],
    ids=["adam", "momentum"],
)
def test_shard_map_equals_pmap(tx):
  k = 4
  mesh, specs, init, step = shard_mapped(tx, k)
  # The moments are replicated, the residuals per replica.
  assert specs.compression == SignCompressionState(P(), P(AXIS), P(AXIS))
  assert all(s == P() for s in jax.tree.leaves(specs[1]))
  params = {n: jnp.full(s, 0.1) for n, s in SHAPES.items()}
  p_sm, s_sm = jax.device_put(params, NamedSharding(mesh, P())), init(params)
  p_pm = jax.tree.map(lambda x: jnp.broadcast_to(x, (k,) + x.shape), params)
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
  for n in SHAPES:
    np.testing.assert_allclose(np.asarray(p_sm[n]), np.asarray(p_pm[n][0]), rtol=1e-6, atol=1e-7)
  np.testing.assert_allclose(
      np.asarray(s_sm.compression.worker_residual).reshape(k, -1),
      np.asarray(s_pm.compression.worker_residual), rtol=1e-5, atol=1e-6,
  )


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("factory", [adam, momentum], ids=["adam", "momentum"])
def test_dtypes_are_stable(dtype, factory):
  k = 2
  tx, init, update = pmapped(k, factory, warmup_steps=1)
  params = make_tree(k, seed=3, dtype=dtype)
  state = init(params)
  first = jax.tree.map(lambda x: (x.shape, x.dtype), state)
  for t in range(3):
    updates, state = update(make_tree(k, seed=t, dtype=dtype), state, params)
    assert jax.tree.map(lambda x: (x.shape, x.dtype), state) == first
    for u in jax.tree.leaves(updates):
      assert u.dtype == dtype and np.isfinite(np.asarray(u, np.float32)).all()
  assert state.count.dtype == jnp.int32
  assert isinstance(state, OneBitAdamState if factory is adam else OneBitMomentumState)


def test_one_bit_momentum_without_warmup_has_no_float_all_reduce():
  k = 8
  tx = one_bit_momentum(0.1, axis_name=AXIS, scale="l1")
  params = {"w": jnp.zeros((k, 64, 256)), "b": jnp.zeros((k, 256))}
  devices = jax.devices()[:k]
  state = jax.pmap(tx.init, axis_name=AXIS, devices=devices)(params)
  compiled = jax.pmap(tx.update, axis_name=AXIS, devices=devices).lower(params, state).compile()
  counts = jmp_train.collective_bytes(compiled)
  assert counts["all-reduce"] == 0
  n = 64 * 256 + 256
  assert counts["all-to-all:u8"] == n // 8
  wire = jmp_train.collective_bytes(compiled, wire=True)["total"]
  assert wire <= 2 * (k - 1) / k * 4 * n / 28


@pytest.mark.parametrize("refresh", [0, 4])
def test_one_bit_adam_float_all_reduce_only_in_the_warmup_branch(refresh):
  k = 8
  tx = one_bit_adam(1e-3, axis_name=AXIS, warmup_steps=5, variance_refresh=refresh)
  params = {"w": jnp.zeros((k, 64, 256)), "b": jnp.zeros((k, 256))}
  devices = jax.devices()[:k]
  state = jax.pmap(tx.init, axis_name=AXIS, devices=devices)(params)
  text = jax.pmap(tx.update, axis_name=AXIS, devices=devices).lower(params, state, params).compile().as_text()
  ops = collective_ops(text)
  branches = re.findall(r"branch_computations=\{([^}]*)\}", text)
  branches += [",".join(m) for m in re.findall(r"true_computation=%?([\w.\-]+), false_computation=%?([\w.\-]+)", text)]
  names = {b.strip().lstrip("%") for group in branches for b in group.split(",")}
  float_reduce = [op for op in ops if op.kind == "all-reduce"]
  packed = [op for op in ops if op.dtypes == ("u8",)]
  assert float_reduce and packed
  warmup_comps = {op.computation for op in float_reduce}
  assert warmup_comps <= names  # never in the entry computation
  after = [op for op in ops if op.computation not in warmup_comps]
  assert not any(op.kind == "all-reduce" for op in after)
  # After warm-up, at K = 8: under 1/28 of a float32 ring all-reduce.
  n = 64 * 256 + 256
  assert sum(op.wire_bytes for op in after) <= 2 * (k - 1) / k * 4 * n / 28


# ---------------------------------------------------------------------------
# loss_scaled: an overflow anywhere skips the step everywhere.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("factory", [adam, momentum], ids=["adam", "momentum"])
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
  assert np.abs(np.asarray(before.compression.worker_residual)).max() > 0
  assert np.abs(np.asarray(before.compression.server_residual)).max() > 0
  bad = make_tree(k, seed=110)
  bad["w"] = bad["w"].at[2, 0, 0].set(np.inf)  # replica 2 only
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


@pytest.mark.parametrize("factory", [adam, momentum], ids=["adam", "momentum"])
def test_checkpoint_after_warmup_resumes_bit_for_bit(tmp_path, factory):
  pytest.importorskip("orbax.checkpoint")
  import orbax.checkpoint as ocp

  k = 4
  tx = factory(warmup_steps=2)
  mesh, specs, init, step = shard_mapped(tx, k)
  params = jax.device_put({n: jnp.full(s, 0.1) for n, s in SHAPES.items()}, NamedSharding(mesh, P()))
  opt_state = init(params)
  grads = [jax.device_put(make_tree(k, seed=120 + t), NamedSharding(mesh, P(AXIS))) for t in range(6)]
  for t in range(3):
    params, opt_state = jax.block_until_ready(step(params, opt_state, grads[t]))
  assert int(opt_state.count) == 3 and np.abs(np.asarray(opt_state.compression.server_residual)).max() > 0
  path = tmp_path / "ckpt"
  with ocp.StandardCheckpointer() as ckpt:
    ckpt.save(path, {"params": params, "opt_state": opt_state})
    ckpt.wait_until_finished()
  p_a, s_a = params, opt_state
  for t in range(3, 6):
    p_a, s_a = jax.block_until_ready(step(p_a, s_a, grads[t]))
  target = jax.tree.map(ocp.utils.to_shape_dtype_struct, {"params": params, "opt_state": opt_state})
  with ocp.StandardCheckpointer() as ckpt:
    restored = ckpt.restore(path, target)
  assert restored["opt_state"].compression.worker_residual.sharding.spec == P(AXIS)
  p_b, s_b = restored["params"], restored["opt_state"]
  for t in range(3, 6):
    p_b, s_b = jax.block_until_ready(step(p_b, s_b, grads[t]))
  for a, b in zip(jax.tree.leaves((p_a, s_a)), jax.tree.leaves((p_b, s_b))):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("factory", [adam, momentum], ids=["adam", "momentum"])
def test_state_for_another_replica_count_raises(factory):
  tx4, init4, _ = pmapped(4, factory, warmup_steps=1)
  _, _, update2 = pmapped(2, factory, warmup_steps=1)
  state4 = init4(jax.tree.map(jnp.zeros_like, make_tree(4, seed=0)))
  # Two replicas' copies of a 4-replica state (as a restore onto 2 devices gives).
  moved = jax.tree.map(lambda x: x[:2], state4)
  with pytest.raises(ValueError, match="replica count"):
    update2(make_tree(2, seed=1), moved, make_tree(2, seed=2))


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


# ---------------------------------------------------------------------------
# Integration points owned elsewhere (enabled at merge).
# ---------------------------------------------------------------------------


def test_public_names():
  assert jmp_train.one_bit_adam is one_bit_adam
  assert jmp_train.one_bit_momentum is one_bit_momentum
  assert jmp_train.OneBitAdamState is OneBitAdamState
  assert jmp_train.OneBitMomentumState is OneBitMomentumState


@pytest.mark.parametrize("make, state_type", [
    (lambda: one_bit_adam(1e-2, axis_name="batch", warmup_steps=2), OneBitAdamState),
    # The warm-up's pmean is invariant across replicas, the compressed
    # branch's output is not: the step must still trace under shard_map.
    (lambda: one_bit_momentum(1e-2, axis_name="batch", warmup_steps=2), OneBitMomentumState),
], ids=["adam", "momentum"])
def test_make_train_step_with_one_bit_optimizer_as_the_whole_optimizer(make, state_type):
  import flax.linen as nn

  k = 4
  model = nn.Dense(3)
  params = model.init(jax.random.key(0), jnp.ones((1, 5)))["params"]
  mesh = jax.make_mesh((k,), ("batch",), devices=jax.devices()[:k])
  step = jmp_train.make_train_step(
      model.apply, lambda out, y: jnp.mean((out - y) ** 2), None,
      compression=make(),
      loss_scale=jmp_train.DynamicLossScale(scale=2.0**8),
      mode="shard_map", axis_name="batch", mesh=mesh,
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
  found = [s for s in jax.tree.leaves(state, is_leaf=lambda s: isinstance(s, state_type))
           if isinstance(s, state_type)]
  assert len(found) == 1 and np.asarray(found[0].count).max() == 8


# ---------------------------------------------------------------------------
# Two processes on loopback (jax.distributed, gloo) equal one process.
# ---------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("optimizer, per_process", [("adam", 1), ("momentum", 2)])
def test_two_processes_equal_one_process(tmp_path, optimizer, per_process):
  import os
  import pathlib
  import socket
  import subprocess
  import sys

  import _one_bit_multiprocess_worker as worker

  here = pathlib.Path(__file__).parent
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  env = dict(os.environ)
  env.pop("XLA_FLAGS", None)  # the worker sets its own device count
  env["PYTHONPATH"] = os.pathsep.join([str(here.parent), env.get("PYTHONPATH", "")])
  outs = [tmp_path / f"out_{i}.npz" for i in range(2)]
  procs = [
      subprocess.Popen(
          [sys.executable, str(here / "_one_bit_multiprocess_worker.py"), str(i), "2", str(port), str(out),
           optimizer, str(per_process)],
          env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
      )
      for i, out in enumerate(outs)
  ]
  logs = []
  try:
    for p in procs:
      logs.append(p.communicate(timeout=300)[0])
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
        p.wait()
  for p, log in zip(procs, logs):
    assert p.returncode == 0, log[-4000:]
  k = 2 * per_process
  devices = jax.devices()[:k]
  expected = worker.train(devices, optimizer)
  got = {}
  for out in outs:
    with np.load(out) as f:
      got.update({name: f[name] for name in f.files})
  # Parameters on every process; residuals of process 0's devices, then
  # process 1's, matched to the one-process run's devices in order.
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
