"""Tests for jmp_train._src.compression.compressed_mean (bfloat16 / float8 gradient exchange)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jmp_train import sign_compression_specs
from jmp_train.diagnostics import collective_bytes, collective_ops
from jmp_train import CompressedMeanState, compressed_mean

AXIS = "i"
SHAPES = {"b": (7,), "w": (13, 5)}
FP8 = {"float8_e4m3": ml_dtypes.float8_e4m3fn, "float8_e5m2": ml_dtypes.float8_e5m2}


def make_grads(k, seed, dtype=jnp.float32):
  rng = np.random.default_rng(seed)
  return {n: jnp.asarray(rng.normal(size=(k,) + s), dtype) for n, s in SHAPES.items()}


@functools.lru_cache(maxsize=None)
def pmapped(k, **kwargs):
  tx = compressed_mean(AXIS, **kwargs)
  devices = jax.devices()[:k]
  return jax.pmap(tx.init, axis_name=AXIS, devices=devices), jax.pmap(tx.update, axis_name=AXIS, devices=devices)


def flat(tree, j):
  return np.concatenate([np.asarray(tree[n][j], np.float32).ravel() for n in SHAPES])


def ref_fp8(x, fmt):
  """Per-row scaled float8 round trip of ``x`` (rows: chunks), in NumPy."""
  fmax = np.float32(ml_dtypes.finfo(FP8[fmt]).max)
  amax = np.abs(x).max(axis=-1, keepdims=True)
  s = np.where(amax == 0, np.float32(1), fmax / amax).astype(np.float32)
  q = np.clip(x * s, -fmax, fmax).astype(FP8[fmt]).astype(np.float32)
  return q / s


@pytest.mark.parametrize("k", [2, 8])
def test_bfloat16_is_rounded_float32_mean_of_rounded_gradients(k):
  init, update = pmapped(k, wire="bfloat16")
  grads = make_grads(k, seed=k)
  out, state = update(grads, init(grads))
  n = sum(int(np.prod(s)) for s in SHAPES.values())
  g = np.stack([flat(grads, j) for j in range(k)])
  rounded = g.astype(ml_dtypes.bfloat16).astype(np.float32)
  mean = rounded[0]
  for j in range(1, k):
    mean = mean + rounded[j]
  expected = (mean / np.float32(k)).astype(ml_dtypes.bfloat16).astype(np.float32)
  for j in range(k):
    np.testing.assert_array_equal(flat(out, j), expected[:n])
  # No zero-size residual arrays (XLA:CPU in jax 0.11 crashes on them beside collectives).
  assert state.worker_residual == optax.EmptyState() == state.server_residual


@pytest.mark.parametrize("fmt", ["float8_e4m3", "float8_e5m2"])
def test_float8_matches_reference_and_conserves(fmt):
  k = 4
  init, update = pmapped(k, wire=fmt)
  grads = make_grads(k, seed=1)
  state = init(grads)
  n = sum(int(np.prod(s)) for s in SHAPES.values())
  n_pad = -(-n // k) * k
  for step in range(3):
    grads = make_grads(k, seed=step)
    r_old = np.asarray(state.worker_residual)
    e_old = np.asarray(state.server_residual).reshape(-1)
    out, state = update(grads, state)
    g = np.stack([np.pad(flat(grads, j), (0, n_pad - n)) for j in range(k)])
    v = (g + r_old).reshape(k, k, n_pad // k)  # replica, chunk, element
    dec = ref_fp8(v, fmt)
    np.testing.assert_allclose(np.asarray(state.worker_residual), (v - dec).reshape(k, -1), rtol=1e-5, atol=1e-6)
    u = dec.sum(axis=0) / np.float32(k) + e_old.reshape(k, -1)
    expected = ref_fp8(u, fmt).reshape(-1)
    for j in range(k):
      np.testing.assert_allclose(flat(out, j), expected[:n], rtol=1e-5, atol=1e-6)
      np.testing.assert_array_equal(flat(out, j), flat(out, 0))
    # Owner conservation: u = decoded + e.
    e_new = np.asarray(state.server_residual).reshape(-1)
    np.testing.assert_allclose(u.reshape(-1), expected + e_new, rtol=1e-5, atol=1e-6)


BYTES_K, BYTES_SHAPES = 8, {"w": (256, 64), "b": (64,)}


@functools.lru_cache(maxsize=None)
def float32_mean_wire_bytes(mode):
  """Wire bytes of a float32 ``pmean`` of the gradients (compiled once per mode)."""
  k, shapes = BYTES_K, BYTES_SHAPES
  if mode == "pmap":
    grads = {n: jnp.zeros((k,) + s) for n, s in shapes.items()}
    base = jax.pmap(lambda g: jax.lax.pmean(g, AXIS), axis_name=AXIS).lower(grads).compile()
  else:
    mesh = jax.make_mesh((k,), (AXIS,))
    grads = {n: jax.device_put(jnp.zeros((k * s[0],) + s[1:]), NamedSharding(mesh, P(AXIS))) for n, s in shapes.items()}
    mean = jax.shard_map(lambda g: jax.lax.pmean(g, AXIS), mesh=mesh, in_specs=P(AXIS), out_specs=P())
    base = jax.jit(mean).lower(grads).compile()
  return collective_bytes(base, wire=True)["total"]


@pytest.mark.parametrize("wire, ratio", [("bfloat16", 2), ("float8_e4m3", 4), ("float8_e5m2", 4)])
@pytest.mark.parametrize("mode", ["pmap", "shard_map"])
def test_moves_the_promised_bytes(wire, ratio, mode):
  k, shapes = BYTES_K, BYTES_SHAPES
  tx = compressed_mean(AXIS, wire=wire, num_replicas=k)
  if mode == "pmap":
    grads = {n: jnp.zeros((k,) + s) for n, s in shapes.items()}
    state = jax.pmap(tx.init, axis_name=AXIS)(grads)
    compiled = jax.pmap(tx.update, axis_name=AXIS).lower(grads, state).compile()
  else:
    mesh = jax.make_mesh((k,), (AXIS,))
    put = lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec))
    grads = {n: put(jnp.zeros((k * s[0],) + s[1:]), P(AXIS)) for n, s in shapes.items()}
    state = tx.init({n: jnp.zeros(s) for n, s in shapes.items()})
    specs = sign_compression_specs(state, AXIS)
    state = jax.tree.map(lambda x, sp: put(jnp.tile(x, k) if x.ndim else x, sp), state, specs)
    update = jax.shard_map(tx.update, mesh=mesh, in_specs=(P(AXIS), specs), out_specs=(P(), specs))
    compiled = jax.jit(update).lower(grads, state).compile()
  got = collective_bytes(compiled, wire=True)
  f32 = float32_mean_wire_bytes(mode)
  assert got["all-reduce"] == 0
  # Wire elements only, in one unsigned message per phase (float8: with each
  # chunk's 4-byte scale appended).
  assert not any(key.endswith(":f32") for key in got)
  assert (got["all-to-all"] > 0) and (got["all-gather"] > 0)
  assert abs(got["total"] - f32 / ratio) <= 8 * k + 0.01 * f32 / ratio, (got, f32)


@pytest.mark.parametrize("wire, dtype", [("bfloat16", "u16"), ("float8_e4m3", "u8"), ("float8_e5m2", "u8")])
def test_one_collective_per_phase_and_bucket(wire, dtype):
  # Two buckets: per bucket one all-to-all to the owners and one all-gather
  # back, each a single unsigned message (float8 chunks carry their scale).
  k = 4
  tx = compressed_mean(AXIS, wire=wire, bucket_bytes=64)
  grads = {n: jnp.zeros((k,) + s) for n, s in SHAPES.items()}
  devices = jax.devices()[:k]
  state = jax.pmap(tx.init, axis_name=AXIS, devices=devices)(grads)
  compiled = jax.pmap(tx.update, axis_name=AXIS, devices=devices).lower(grads, state).compile()
  ops = collective_ops(compiled)
  assert sorted(op.kind for op in ops) == ["all-gather"] * 2 + ["all-to-all"] * 2
  assert all(op.dtypes == (dtype,) for op in ops)


def test_buckets_give_the_same_bfloat16_mean():
  k = 4
  grads = make_grads(k, seed=5)
  _, one = pmapped(k, wire="bfloat16")
  init, many = pmapped(k, wire="bfloat16", bucket_bytes=64)
  a, _ = one(grads, init(grads))
  b, _ = many(grads, init(grads))
  for n in SHAPES:
    np.testing.assert_array_equal(np.asarray(a[n]), np.asarray(b[n]))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_dtypes_are_kept(dtype):
  k = 2
  init, update = pmapped(k, wire="float8_e5m2")
  grads = make_grads(k, seed=0, dtype=dtype)
  state = init(grads)
  out, new_state = update(grads, state)
  assert all(out[n].dtype == dtype for n in SHAPES)
  assert jax.tree.map(lambda x: (x.shape, x.dtype), new_state) == jax.tree.map(lambda x: (x.shape, x.dtype), state)
  assert new_state.count.dtype == jnp.int32


@pytest.mark.parametrize("fmt, value", [("e4m3", np.inf), ("e4m3", np.nan), ("e5m2", -np.inf)])
def test_non_finite_gradient_keeps_residuals_and_reaches_output(fmt, value):
  k = 2
  init, update = pmapped(k, wire=f"float8_{fmt}")
  grads = make_grads(k, seed=0)
  _, state = update(grads, init(grads))
  bad = dict(grads, w=grads["w"].at[1, 0, 0].set(value))
  out, new_state = update(bad, state)
  assert not np.isfinite(np.asarray(out["w"])).all()
  np.testing.assert_array_equal(np.asarray(new_state.worker_residual)[1], np.asarray(state.worker_residual)[1])
  assert np.isfinite(np.asarray(new_state.server_residual)).all()


def test_local_quantization_without_axis():
  tx = compressed_mean(wire="float8_e4m3")
  g = {"w": jnp.linspace(-1.0, 1.0, 16)}
  state = tx.init(g)
  out, state = jax.jit(tx.update)(g, state)
  np.testing.assert_allclose(np.asarray(out["w"]) + np.asarray(state.worker_residual), np.asarray(g["w"]), rtol=1e-6)
  assert isinstance(state, CompressedMeanState)


@pytest.mark.parametrize("wire", ["float8_e4m3", "float8_e5m2"])
def test_tiny_chunks_stay_finite(wire):
  # A chunk whose largest magnitude is below fmax / 2**126 takes the scale
  # 2**126 (fmax / amax would be inf, or its reciprocal flushed to zero).
  tx = compressed_mean(wire=wire)
  g = {"w": jnp.full(16, 3e-37, jnp.float32).at[3].set(0.0)}
  out, state = jax.jit(tx.update)(g, tx.init(g))
  assert np.isfinite(np.asarray(out["w"])).all()
  np.testing.assert_allclose(np.asarray(out["w"]), np.asarray(g["w"]), rtol=0.07)
  # The residual (about 1e-39 here) is a float32 subnormal, which XLA:CPU
  # flushes to zero: it must stay finite, not conserve exactly.
  assert np.isfinite(np.asarray(state.worker_residual)).all()


def test_errors():
  with pytest.raises(ValueError, match=r"'int8'.*bfloat16, float8_e4m3, float8_e5m2"):
    compressed_mean(AXIS, wire="int8")
  with pytest.raises(ValueError, match="bucket_bytes"):
    compressed_mean(AXIS, bucket_bytes=0)
  with pytest.raises(ValueError, match="error_feedback must be True, False or None.*'yes'"):
    compressed_mean(AXIS, error_feedback="yes")
  with pytest.raises(ValueError, match=r"'data'.*pmap"):
    compressed_mean("data", num_replicas=2).update({"w": jnp.ones(3)}, None)
  tx = compressed_mean(AXIS, num_replicas=4, wire="float8_e4m3")
  state = tx.init({"w": jnp.ones(8)})
  with pytest.raises(ValueError, match="replica"):
    jax.pmap(tx.update, axis_name=AXIS, devices=jax.devices()[:2])(
      {"w": jnp.ones((2, 8))}, jax.tree.map(lambda x: jnp.stack([x, x]), state)
    )


def test_chain_with_sgd_trains_under_pmap():
  k = 4
  tx = optax.chain(compressed_mean(AXIS, wire="float8_e4m3"), optax.sgd(0.1))
  params = {"w": jnp.zeros((k, 3))}
  target = jnp.asarray([1.0, -2.0, 0.5])
  state = jax.pmap(tx.init, axis_name=AXIS, devices=jax.devices()[:k])(params)

  @functools.partial(jax.pmap, axis_name=AXIS, devices=jax.devices()[:k])
  def step(p, s, noise):
    g = jax.grad(lambda p: jnp.sum((p["w"] - target - noise) ** 2))(p)
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s

  noise = jnp.asarray(np.random.default_rng(0).normal(size=(k, 3)) * 0.1, jnp.float32)
  for _ in range(60):
    params, state = step(params, state, noise)
  np.testing.assert_allclose(np.asarray(params["w"][0]), target + noise.mean(0), atol=1e-2)
