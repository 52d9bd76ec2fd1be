"""Tests for jmp_train._src.sign_compression (1-bit SGD with error feedback)."""

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
from jmp_train import SignCompressionState, sign_compression, sign_compression_specs

AXIS = "i"
# In jax.tree order (sorted keys), so that leaf order matches the flat buffer.
SHAPES = {"bias": (3,), "conv": (2, 2, 3, 4), "dense": (5, 3), "scalar": ()}
MIXED_DTYPES = {"conv": jnp.float32, "dense": jnp.bfloat16, "bias": jnp.float16, "scalar": jnp.float32}


# ---------------------------------------------------------------------------
# NumPy reference of the whole algorithm, written from the description
# (segments, chunks, owners), independently of the implementation's tables.
# ---------------------------------------------------------------------------


def ref_flatten(leaves, scale):
  parts, seg_len = [], []
  for x in leaves:
    x = np.asarray(x, np.float32)
    if x.size == 0:
      continue
    if scale == "column" and x.ndim >= 2:
      parts.append(np.moveaxis(x, -1, 0).ravel())
      seg_len += [x.size // x.shape[-1]] * x.shape[-1]
    else:
      parts.append(x.ravel())
      seg_len.append(x.size)
  return np.concatenate(parts), seg_len


def ref_unflatten(flat, like, scale):
  out, off = [], 0
  for x in like:
    size = x.size
    part = flat[off : off + size]
    if scale == "column" and x.ndim >= 2:
      part = np.moveaxis(part.reshape((x.shape[-1],) + x.shape[:-1]), 0, -1)
    out.append(part.reshape(x.shape))
    off += size
  return out


def ref_quantize(x, scale):
  """Decoded values of one segment ``x``."""
  nonneg = x >= 0
  if scale == "column":
    hi = x[nonneg].mean() if nonneg.any() else 0.0
    lo = x[~nonneg].mean() if (~nonneg).any() else 0.0
  elif scale == "l1":
    hi = np.abs(x).mean()
    lo = -hi
  else:
    hi = np.sqrt((x * x).mean())
    lo = -hi
  return np.where(nonneg, np.float32(hi), np.float32(lo)).astype(np.float32)


def ref_step(grads, r, e, scale, error_feedback=True, server_error_feedback=True):
  """One step for K replicas. grads: K lists of leaves; r: (K, n_pad); e: (K, S).

  Returns (per-replica outputs as leaves, new r, new e, v, u).
  """
  k = len(grads)
  flats = [ref_flatten(g, scale) for g in grads]
  seg_len = flats[0][1]
  n = flats[0][0].size
  n_pad = max(8 * k, -(-n // (8 * k)) * 8 * k)
  chunk = n_pad // k
  ids = np.repeat(np.arange(len(seg_len) + 1), seg_len + [n_pad - n])
  g = np.stack([np.pad(f, (0, n_pad - n)) for f, _ in flats])
  v = g + r if error_feedback else g
  dec = np.zeros_like(v)
  for j in range(k):
    for s in np.unique(ids):
      dec[j, ids == s] = ref_quantize(v[j, ids == s], scale)
  r_new = v - dec if error_feedback else r
  # Owners: chunk c of everyone's decoded gradient goes to replica c.
  avg = dec.sum(axis=0, dtype=np.float32) / np.float32(k)
  u = avg + e.reshape(-1) if server_error_feedback else avg
  out = np.zeros(n_pad, np.float32)
  for c in range(k):
    sl = slice(c * chunk, (c + 1) * chunk)
    for s in np.unique(ids[sl]):
      mask = np.zeros(n_pad, bool)
      mask[sl] = ids[sl] == s
      out[mask] = ref_quantize(u[mask], scale)
  e_new = (u - out).reshape(k, chunk) if server_error_feedback else e
  return ref_unflatten(out, grads[0], scale), r_new, e_new, v, u, out


# ---------------------------------------------------------------------------
# Helpers: pmap / shard_map runners, built once per configuration.
# ---------------------------------------------------------------------------


def make_grads(k, seed, dtypes=None, shapes=SHAPES):
  rng = np.random.default_rng(seed)
  dtypes = dtypes or {}
  return {
      name: jnp.asarray(rng.normal(size=(k,) + shape), dtypes.get(name, jnp.float32))
      for name, shape in shapes.items()
  }


def replicated_zeros(k, shapes=SHAPES, dtypes=None):
  dtypes = dtypes or {}
  return {n: jnp.zeros((k,) + s, dtypes.get(n, jnp.float32)) for n, s in shapes.items()}


@functools.lru_cache(maxsize=None)
def pmapped(k, **kwargs):
  tx = sign_compression(AXIS, **kwargs)
  devices = jax.devices()[:k]
  init = jax.pmap(tx.init, axis_name=AXIS, devices=devices)
  update = jax.pmap(tx.update, axis_name=AXIS, devices=devices)
  return init, update


def per_replica_leaves(tree, j):
  return [np.asarray(tree[n][j], np.float32) for n in SHAPES]


# ---------------------------------------------------------------------------
# Reference and conservation.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "k, scale", [(2, "column"), (4, "column"), (8, "column"), (4, "l1"), (8, "l2")]
)
def test_matches_numpy_reference_and_conserves(k, scale):
  init, update = pmapped(k, scale=scale)
  state = init(replicated_zeros(k))
  for step in range(3):
    grads = make_grads(k, seed=step)
    r_old = np.asarray(state.worker_residual)
    e_old = np.asarray(state.server_residual)
    out, state = update(grads, state)
    ref_out, ref_r, ref_e, v, u, ref_flat = ref_step(
        [per_replica_leaves(grads, j) for j in range(k)], r_old, e_old, scale
    )
    for name, ref_leaf in zip(SHAPES, ref_out):
      got = np.asarray(out[name])
      # Identical (bit for bit) on every replica.
      np.testing.assert_array_equal(got, np.broadcast_to(got[0], got.shape))
      np.testing.assert_allclose(got[0], ref_leaf, rtol=2e-5, atol=1e-6, err_msg=name)
    r_new = np.asarray(state.worker_residual)
    e_new = np.asarray(state.server_residual)
    np.testing.assert_allclose(r_new, ref_r, rtol=2e-5, atol=2e-6)
    np.testing.assert_allclose(e_new, ref_e, rtol=2e-5, atol=2e-6)
    # Conservation, worker side: v = decode(v) + r, to one float32 rounding.
    decoded = v - ref_r  # the reference's decoded values
    # (to a few roundings: the reference's means are summed in another order).
    tol = 8 * np.float32(2.0**-23) * (np.abs(v) + np.abs(decoded))
    assert (np.abs(v - (decoded + r_new)) <= tol + 1e-30).all()
    # Owner side: u = decode(u) + e, for every chunk, with the actual output
    # (to a few roundings: the reference sums the K chunks in another order).
    flat_out = np.asarray(ref_flatten([np.asarray(out[n][0]) for n in SHAPES], scale)[0])
    flat_out = np.pad(flat_out, (0, u.size - flat_out.size))
    tol = 8 * np.float32(2.0**-23) * (np.abs(u) + np.abs(flat_out) + np.abs(e_old.reshape(-1)))
    assert (np.abs(u - (flat_out + e_new.reshape(-1))) <= tol + 1e-30).all()
    assert np.asarray(state.count)[0] == step + 1


def test_residual_is_exact_difference():
  # With the implementation's own output: new residual == v - decoded exactly,
  # and the worker's decoded values take one of two values per column.
  k = 2
  init, update = pmapped(k, scale="column", server_error_feedback=False)
  state = init(replicated_zeros(k))
  grads = make_grads(k, seed=7)
  _, state = update(grads, state)
  r = np.asarray(state.worker_residual)
  for j in range(k):
    v, seg_len = ref_flatten(per_replica_leaves(grads, j), "column")
    decoded = v - r[j, : v.size]
    off = 0
    for length in seg_len:
      col_v, col_d = v[off : off + length], decoded[off : off + length]
      # One value for the non-negative entries, one for the negative ones.
      assert len(np.unique(np.round(col_d[col_v >= 0], 5))) <= 1
      assert len(np.unique(np.round(col_d[col_v < 0], 5))) <= 1
      # hi >= 0 decodes the non-negative entries, lo < 0 the negative ones.
      assert ((col_d >= 0) == (col_v >= 0)).all()
      off += length
  np.testing.assert_array_equal(np.asarray(state.server_residual), 0.0)


# ---------------------------------------------------------------------------
# Execution modes and dtypes.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "dtype, mode, scale",
    [
        (jnp.float32, "nojit", "column"),
        (jnp.float32, "jit", "column"),
        (jnp.bfloat16, "jit", "column"),
        (jnp.float16, "jit", "column"),
        (jnp.float16, "jit", "l2"),
        (jnp.bfloat16, "jit", "l1"),
    ],
)
def test_local_error_feedback_matches_reference(dtype, mode, scale):
  # axis_name=None: quantization with error feedback on one device.
  tx = sign_compression(scale=scale)
  params = {n: jnp.zeros(s, dtype) for n, s in SHAPES.items()}
  update = tx.update if mode == "nojit" else jax.jit(tx.update)
  state = tx.init(params)
  assert state.server_residual.shape == (0,)
  for step in range(2):
    grads = {n: x[0].astype(dtype) for n, x in make_grads(1, seed=step).items()}
    r_old = np.asarray(state.worker_residual)[None]
    out, state = update(grads, state)
    assert {n: x.dtype for n, x in out.items()} == {n: np.dtype(dtype) for n in SHAPES}
    assert state.worker_residual.dtype == jnp.float32
    assert state.count.dtype == jnp.int32
    leaves = [np.asarray(grads[n], np.float32) for n in SHAPES]
    # With one replica the owner re-quantizes an already quantized buffer:
    # the reference's second stage is the identity, so compare to stage one.
    _, ref_r, _, v, _, _ = ref_step([leaves], r_old, np.zeros((1, r_old.shape[1]), np.float32), scale)
    decoded_ref = v[0] - ref_r[0]
    expected = ref_unflatten(decoded_ref[: sum(np.prod(s, dtype=int) for s in SHAPES.values())], leaves, scale)
    for name, ref_leaf in zip(SHAPES, expected):
      np.testing.assert_allclose(
          np.asarray(out[name], np.float32),
          ref_leaf.astype(dtype).astype(np.float32),
          rtol=1e-2 if dtype != jnp.float32 else 1e-5,
          atol=1e-6,
      )
    np.testing.assert_allclose(np.asarray(state.worker_residual), ref_r[0], rtol=1e-5, atol=1e-6)


def test_mixed_dtypes_under_pmap():
  k = 4
  init, update = pmapped(k)
  state = init(replicated_zeros(k, dtypes=MIXED_DTYPES))
  grads = make_grads(k, seed=3, dtypes=MIXED_DTYPES)
  out, new_state = update(grads, state)
  for name, dtype in MIXED_DTYPES.items():
    assert out[name].dtype == np.dtype(dtype), name
    o = np.asarray(out[name], np.float32)
    np.testing.assert_array_equal(o, np.broadcast_to(o[0], o.shape))
  chex_shapes = jax.tree.map(lambda x: (x.shape, x.dtype), new_state)
  assert chex_shapes == jax.tree.map(lambda x: (x.shape, x.dtype), state)


def test_shard_map_equals_pmap():
  k = 8
  tx = sign_compression(AXIS, scale="column")
  mesh = jax.make_mesh((k,), (AXIS,))
  params = {n: jnp.zeros(s) for n, s in SHAPES.items()}
  shapes = jax.eval_shape(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=P()), params)
  specs = sign_compression_specs(shapes, AXIS)
  init = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=specs))

  def local_update(g, s):
    return tx.update(jax.tree.map(lambda x: x[0], g), s)

  update = jax.jit(
      jax.shard_map(local_update, mesh=mesh, in_specs=(P(AXIS), specs), out_specs=(P(), specs))
  )
  p_init, p_update = pmapped(k, scale="column")
  state, p_state = init(params), p_init(replicated_zeros(k))
  assert state.worker_residual.sharding.spec == P(AXIS)
  for step in range(3):
    grads = make_grads(k, seed=10 + step)
    out, state = update(jax.device_put(grads, NamedSharding(mesh, P(AXIS))), state)
    p_out, p_state = p_update(grads, p_state)
    for name in SHAPES:
      np.testing.assert_array_equal(np.asarray(out[name]), np.asarray(p_out[name][0]))
    np.testing.assert_array_equal(
        np.asarray(state.worker_residual), np.asarray(p_state.worker_residual).reshape(-1)
    )
    np.testing.assert_array_equal(
        np.asarray(state.server_residual), np.asarray(p_state.server_residual).reshape(-1)
    )


# ---------------------------------------------------------------------------
# Options: no error feedback, warm-up.
# ---------------------------------------------------------------------------


def test_without_error_feedback_residuals_stay_zero():
  k = 4
  init, update = pmapped(k, error_feedback=False, server_error_feedback=False)
  state = init(replicated_zeros(k))
  for step in range(2):
    grads = make_grads(k, seed=20 + step)
    out, state = update(grads, state)
    np.testing.assert_array_equal(np.asarray(state.worker_residual), 0.0)
    np.testing.assert_array_equal(np.asarray(state.server_residual), 0.0)
    ref_out, *_ = ref_step(
        [per_replica_leaves(grads, j) for j in range(k)],
        np.zeros(state.worker_residual.shape, np.float32),
        np.zeros(state.server_residual.shape, np.float32),
        "column",
        error_feedback=False,
        server_error_feedback=False,
    )
    for name, ref_leaf in zip(SHAPES, ref_out):
      np.testing.assert_allclose(np.asarray(out[name][0]), ref_leaf, rtol=2e-5, atol=1e-6)


def test_warmup_is_exact_pmean_then_compressed():
  k = 4
  init, update = pmapped(k, warmup_steps=2)
  state = init(replicated_zeros(k))
  for step in range(3):
    grads = make_grads(k, seed=30 + step)
    out, state = update(grads, state)
    if step < 2:
      for name in SHAPES:
        np.testing.assert_allclose(
            np.asarray(out[name][0]), np.asarray(grads[name]).mean(0), rtol=1e-6, atol=1e-7
        )
      np.testing.assert_array_equal(np.asarray(state.worker_residual), 0.0)
      np.testing.assert_array_equal(np.asarray(state.server_residual), 0.0)
    else:
      ref_out, ref_r, *_ = ref_step(
          [per_replica_leaves(grads, j) for j in range(k)],
          np.zeros(state.worker_residual.shape, np.float32),
          np.zeros(state.server_residual.shape, np.float32),
          "column",
      )
      for name, ref_leaf in zip(SHAPES, ref_out):
        np.testing.assert_allclose(np.asarray(out[name][0]), ref_leaf, rtol=2e-5, atol=1e-6)
      np.testing.assert_allclose(np.asarray(state.worker_residual), ref_r, rtol=2e-5, atol=2e-6)
  assert np.asarray(state.count)[0] == 3


# ---------------------------------------------------------------------------
# Non-finite gradients never enter a residual.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [np.inf, np.nan])
def test_non_finite_gradient_keeps_residuals(bad):
  k = 4
  init, update = pmapped(k)
  state = init(replicated_zeros(k))
  _, state = update(make_grads(k, seed=40), state)
  grads = make_grads(k, seed=41)
  grads["dense"] = grads["dense"].at[1, 2, 0].set(bad)
  r_old = np.asarray(state.worker_residual)
  e_old = np.asarray(state.server_residual)
  out, new_state = update(grads, state)
  r_new = np.asarray(new_state.worker_residual)
  e_new = np.asarray(new_state.server_residual)
  assert np.isfinite(r_new).all() and np.isfinite(e_new).all()
  # Replica 1 saw the bad value: its residual is untouched; others moved on.
  np.testing.assert_array_equal(r_new[1], r_old[1])
  for j in (0, 2, 3):
    assert not np.array_equal(r_new[j], r_old[j])
  # Owners whose chunk was poisoned kept their residual too.
  poisoned = [c for c in range(k) if not np.array_equal(e_new[c], e_old[c])]
  assert len(poisoned) < k
  # The non-finite value reaches the output, on every replica alike.
  assert not np.isfinite(np.asarray(out["dense"])).all()
  for j in range(k):
    np.testing.assert_array_equal(
        np.isfinite(np.asarray(out["dense"][j])), np.isfinite(np.asarray(out["dense"][0]))
    )


# ---------------------------------------------------------------------------
# Errors at trace time.
# ---------------------------------------------------------------------------


def test_unknown_scale():
  with pytest.raises(ValueError, match=r"'linf'.*column, l1, l2"):
    sign_compression("i", scale="linf")


def test_bad_arguments():
  with pytest.raises(ValueError, match="warmup_steps"):
    sign_compression("i", warmup_steps=-1)
  with pytest.raises(ValueError, match="num_replicas"):
    sign_compression("i", num_replicas=0)
  with pytest.raises(ValueError, match="axis_name"):
    sign_compression(("a", "b"))


def test_axis_missing():
  tx = sign_compression("data")
  grads = {"w": jnp.ones((2, 3))}
  with pytest.raises(ValueError, match=r"'data'.*pmap"):
    jax.pmap(tx.init, axis_name="batch", devices=jax.devices()[:2])(grads)
  with pytest.raises(ValueError, match="num_replicas"):
    tx.init({"w": jnp.ones(3)})
  state = sign_compression("data", num_replicas=2).init({"w": jnp.ones(3)})
  mesh = jax.make_mesh((2,), ("batch",), devices=jax.devices()[:2])
  fn = jax.shard_map(
      lambda g, s: tx.update(g, s), mesh=mesh, in_specs=(P(), P()), out_specs=P(), check_vma=False
  )
  with pytest.raises(ValueError, match=r"'data'"):
    jax.jit(fn).lower({"w": jnp.ones(3)}, state)


def test_update_outside_the_axis_names_it():
  # num_replicas lets init run outside pmap/shard_map, never update.
  tx = sign_compression("data", num_replicas=8)
  state = tx.init({"w": jnp.ones(3)})
  with pytest.raises(ValueError, match=r"'data'.*pmap"):
    tx.update({"w": jnp.ones(3)}, state)


def test_pack_matches_numpy_and_round_trips():
  from jmp_train._src import sign_codec

  bits = np.random.default_rng(0).random((3, 64)) > 0.5
  packed = sign_codec.pack(jnp.asarray(bits))
  np.testing.assert_array_equal(np.asarray(packed), np.packbits(bits, axis=-1, bitorder="little"))
  np.testing.assert_array_equal(np.asarray(sign_codec.unpack(packed)), bits)


@pytest.mark.parametrize("scale", ["column", "l1"])
def test_compiled_exchange_has_no_gather_scatter_or_sort(scale):
  # The codec is reshapes, reductions and broadcasts over static runs: no
  # per-element segment ids (gathers, scatter-adds, sorts) over the buffer.
  import re

  k, shapes = 4, {"b": (32,), "w": (64, 32)}  # 2,080 elements
  tx = sign_compression(AXIS, scale=scale)
  grads = {n: jnp.zeros((k,) + s) for n, s in shapes.items()}
  fn = jax.pmap(tx.update, axis_name=AXIS, devices=jax.devices()[:k])
  text = fn.lower(grads, jax.pmap(tx.init, axis_name=AXIS, devices=jax.devices()[:k])(grads)).compile().as_text()
  assert not re.search(r"\b(scatter|sort)\(", text)
  # Only the small table of (hi, lo) pairs is gathered, never the buffer.
  for dims in re.findall(r"= \w+\[([\d,]*)\]\S* gather\(", text):
    assert np.prod([int(d) for d in dims.split(",") if d]) <= 2 * k * (32 // k + 3), dims


def test_non_floating_gradients():
  tx = sign_compression()
  with pytest.raises(ValueError, match=r"\['step'\].*int32.*float16, bfloat16, float32"):
    tx.init({"w": jnp.ones(3), "step": jnp.zeros((), jnp.int32)})
  state = tx.init({"w": jnp.ones(3)})
  with pytest.raises(ValueError, match=r"\['w'\].*int32"):
    jax.jit(tx.update).lower({"w": jnp.ones(3, jnp.int32)}, state)


def test_state_mismatch():
  tx = sign_compression("i", num_replicas=4)
  state = tx.init({"w": jnp.ones(100)})
  with pytest.raises(ValueError, match="replica"):
    jax.pmap(tx.update, axis_name="i", devices=jax.devices()[:2])(
        {"w": jnp.ones((2, 100))}, jax.tree.map(lambda x: jnp.stack([x, x]), state)
    )


def test_init_with_num_replicas_equals_mapped_init():
  k = 4
  init, _ = pmapped(k)
  tx = sign_compression(AXIS, num_replicas=k)
  state = tx.init({n: jnp.zeros(s) for n, s in SHAPES.items()})
  mapped = init(replicated_zeros(k))
  assert jax.tree.map(lambda x: (x.shape, x.dtype), state) == jax.tree.map(
      lambda x: (x.shape[1:], x.dtype), mapped
  )


def test_specs_for_a_chain():
  tx = optax.chain(sign_compression(AXIS, num_replicas=2), optax.sgd(0.1, momentum=0.9))
  state = tx.init({"w": jnp.ones(3)})
  specs = sign_compression_specs(state, AXIS)
  assert specs[0] == SignCompressionState(P(), P(AXIS), P(AXIS))
  assert all(s == P() for s in jax.tree.leaves(specs[1], is_leaf=lambda x: isinstance(x, P)))


def test_public_names():
  for name in ("sign_compression", "SignCompressionState", "collective_bytes", "sign_compression_specs"):
    assert name in jmp_train.__all__
    assert hasattr(jmp_train, name)


# ---------------------------------------------------------------------------
# Convergence on a real task (digits MLP, 8 replicas).
# ---------------------------------------------------------------------------


def _digits_experiment():
  import pathlib
  import sys

  root = str(pathlib.Path(__file__).resolve().parents[1])
  if root not in sys.path:
    sys.path.insert(0, root)
  from benchmarks import bench_one_bit_convergence

  return bench_one_bit_convergence


def test_convergence_on_digits_with_8_replicas():
  bench = _digits_experiment()
  # 400 steps: error feedback re-sends what quantization dropped one step
  # late, which early in training can show as a lag. At 200 steps this test
  # passed on the machine it was written on but measured +9.8% on an AMD
  # EPYC CI machine (same package versions); there 300 steps gave +3.8%,
  # 400 steps -15%, and the benchmark's 600 steps -25% on its machine.
  runs = {mode: bench.run_digits(mode, steps=400, replicas=8) for mode in bench.MODES}
  exact, ef, no_ef = runs["float32"], runs["1bit_ef"], runs["1bit_no_ef"]
  assert exact["final_loss"] < 0.2  # the baseline did learn
  # With error feedback: close to the uncompressed final loss. The final loss
  # of one run moves with float32 rounding: changing the learning rate by one
  # part in 10**6, or the summation order of the column sums, gave final
  # losses from 0.024 to 0.038 (float32: 0.031); a 2% margin would test the
  # rounding, not the algorithm.
  assert ef["final_loss"] <= 1.3 * exact["final_loss"], (ef, exact)
  # Without error feedback the same quantization is clearly worse.
  assert no_ef["final_loss"] > 2 * ef["final_loss"], (no_ef, ef)
  # The residual stays bounded: no growth over training.
  norms = ef["residual_norms"]
  assert np.isfinite(norms).all() and norms.max() > 0
  half = len(norms) // 2
  assert norms[half:].max() <= 1.5 * norms[:half].max()
  np.testing.assert_array_equal(no_ef["residual_norms"], 0.0)


# ---------------------------------------------------------------------------
# Checkpoint and restore of the per-replica (sharded) residuals.
# ---------------------------------------------------------------------------


def test_checkpoint_restore_continues_bit_for_bit(tmp_path):
  ocp = pytest.importorskip("orbax.checkpoint")
  k = 4
  mesh = jax.make_mesh((k,), (AXIS,), devices=jax.devices()[:k])
  tx = optax.chain(sign_compression(AXIS), optax.sgd(0.1, momentum=0.9))
  params = jax.device_put({n: jnp.ones(s) * 0.1 for n, s in SHAPES.items()}, NamedSharding(mesh, P()))
  shapes = jax.eval_shape(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=P()), params)
  specs = sign_compression_specs(shapes, AXIS)
  opt_state = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=specs))(params)

  def local_step(p, s, g):
    updates, s = tx.update(jax.tree.map(lambda x: x[0], g), s, p)
    return optax.apply_updates(p, updates), s

  step = jax.jit(
      jax.shard_map(local_step, mesh=mesh, in_specs=(P(), specs, P(AXIS)), out_specs=(P(), specs))
  )
  grads = [jax.device_put(make_grads(k, seed=60 + t), NamedSharding(mesh, P(AXIS))) for t in range(4)]
  for t in range(2):
    params, opt_state = step(params, opt_state, grads[t])
  path = tmp_path / "ckpt"
  checkpointer = ocp.StandardCheckpointer()
  checkpointer.save(path, {"params": params, "opt_state": opt_state})
  checkpointer.wait_until_finished()
  # Continue without interruption...
  p_a, s_a = params, opt_state
  for t in range(2, 4):
    p_a, s_a = step(p_a, s_a, grads[t])
  # ... and from the checkpoint, restored with the same shardings.
  target = jax.tree.map(ocp.utils.to_shape_dtype_struct, {"params": params, "opt_state": opt_state})
  restored = checkpointer.restore(path, target)
  sc_state = restored["opt_state"][0]
  assert isinstance(sc_state, SignCompressionState)
  assert sc_state.worker_residual.sharding.spec == P(AXIS)
  assert np.abs(np.asarray(sc_state.worker_residual)).max() > 0
  np.testing.assert_array_equal(
      np.asarray(sc_state.worker_residual), np.asarray(opt_state[0].worker_residual)
  )
  p_b, s_b = restored["params"], restored["opt_state"]
  for t in range(2, 4):
    p_b, s_b = step(p_b, s_b, grads[t])
  for a, b in zip(jax.tree.leaves((p_a, s_a)), jax.tree.leaves((p_b, s_b))):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# ---------------------------------------------------------------------------
# Composition with loss_scaled: an overflow anywhere skips the step everywhere.
# ---------------------------------------------------------------------------


def test_loss_scaled_overflow_on_one_replica_skips_everywhere():
  k = 4
  tx = jmp_train.loss_scaled(
      optax.chain(sign_compression(AXIS), optax.sgd(0.1)),
      jmp_train.DynamicLossScale(scale=2.0**10),
      axis_name=AXIS,
  )
  devices = jax.devices()[:k]
  init = jax.pmap(tx.init, axis_name=AXIS, devices=devices)
  update = jax.pmap(tx.update, axis_name=AXIS, devices=devices)
  state = init(replicated_zeros(k))
  scale = 2.0**10
  scaled = lambda g: jax.tree.map(lambda x: x * scale, g)
  _, state = update(scaled(make_grads(k, seed=70)), state)
  before = state.inner_state[0]
  assert np.asarray(before.count).tolist() == [1] * k
  bad = make_grads(k, seed=71)
  bad["conv"] = bad["conv"].at[2, 0, 0, 0, 0].set(np.inf)  # replica 2 only
  updates, after_state = update(scaled(bad), state)
  after = after_state.inner_state[0]
  # Every replica skipped: zero updates, residuals and counter untouched.
  for leaf in jax.tree.leaves(updates):
    np.testing.assert_array_equal(np.asarray(leaf), 0.0)
  for a, b in zip(before, after):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert np.asarray(after_state.total_notfinite).tolist() == [1] * k
  new_scale = np.asarray(jmp_train.get_loss_scale(after_state).loss_scale)
  np.testing.assert_array_equal(new_scale, scale / 2)
  # The next finite step goes through (at the backed-off scale) everywhere.
  updates, final = update(jax.tree.map(lambda x: x * (scale / 2), make_grads(k, seed=72)), after_state)
  assert np.asarray(final.inner_state[0].count).tolist() == [2] * k
  assert np.abs(np.asarray(updates["dense"])).max() > 0
