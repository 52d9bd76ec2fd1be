"""1-bit codec pieces, one-device error feedback, compiled programs and errors."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import jmp_train
from jmp_train import SignCompressionState, sign_compression, sign_compression_specs
from jmp_train._src.compression import sign_bits
from jmp_train._src.compression import sign_codec
from jmp_train._src.compression import sign_layout

from helpers.sign_reference import (  # noqa: E402  (tests/ is on sys.path)
  AXIS,
  SHAPES,
  buffer_residual,
  make_grads,
  pmapped,
  ref_layout,
  ref_step,
  ref_unflatten,
  replicated_zeros,
)


@pytest.mark.parametrize(
  "dtype, mode, scale",
  [
    (jnp.float32, "nojit", "l1"),
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
    r_old = buffer_residual(state.worker_residual, SHAPES, scale)[None]
    out, state = update(grads, state)
    assert {n: x.dtype for n, x in out.items()} == {n: np.dtype(dtype) for n in SHAPES}
    assert all(r.dtype == jnp.float32 for r in state.worker_residual)
    assert state.count.dtype == jnp.int32
    leaves = [np.asarray(grads[n], np.float32) for n in SHAPES]
    # With one replica the owner re-quantizes an already quantized buffer:
    # the reference's second stage is the identity, so compare to stage one.
    _, ref_r, _, v, _, _ = ref_step([leaves], r_old, None, scale)
    expected = ref_unflatten(v[0] - ref_r[0], leaves, scale)
    for name, ref_leaf in zip(SHAPES, expected):
      np.testing.assert_allclose(
        np.asarray(out[name], np.float32),
        ref_leaf.astype(dtype).astype(np.float32),
        rtol=1e-2 if dtype != jnp.float32 else 1e-5,
        atol=1e-6,
      )
    np.testing.assert_allclose(buffer_residual(state.worker_residual, SHAPES, scale), ref_r[0], rtol=1e-5, atol=1e-6)


def test_local_update_keeps_empty_leaves_in_place():
  # A leaf with no elements has no segment; the others still line up.
  tx = sign_compression(scale="l1")
  grads = {"a": jnp.ones((0, 3)), "b": jnp.asarray([1.0, -2.0, 3.0])}
  out, state = tx.update(grads, tx.init(grads))
  assert out["a"].shape == (0, 3)
  np.testing.assert_allclose(np.asarray(out["b"]), [2.0, -2.0, 2.0])
  np.testing.assert_allclose(np.asarray(state.worker_residual[1]), [-1.0, 0.0, 1.0])


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
  with pytest.raises(ValueError, match="error_feedback must be True or False, got 'yes'"):
    sign_compression("i", error_feedback="yes")
  with pytest.raises(ValueError, match="server_error_feedback must be True or False, got 1"):
    sign_compression("i", server_error_feedback=1)


def test_axis_missing():
  tx = sign_compression("data")
  grads = {"w": jnp.ones((2, 3))}
  with pytest.raises(ValueError, match=r"mapped over \['batch'\], where no axis is named 'data'"):
    jax.pmap(tx.init, axis_name="batch", devices=jax.devices()[:2])(grads)
  with pytest.raises(ValueError, match="num_replicas"):
    tx.init({"w": jnp.ones(3)})
  state = sign_compression("data", num_replicas=2).init({"w": jnp.ones(3)})
  mesh = jax.make_mesh((2,), ("batch",), devices=jax.devices()[:2])
  fn = jax.shard_map(lambda g, s: tx.update(g, s), mesh=mesh, in_specs=(P(), P()), out_specs=P(), check_vma=False)
  with pytest.raises(ValueError, match=r"'data'"):
    jax.jit(fn).lower({"w": jnp.ones(3)}, state)


def test_update_outside_the_axis_names_it():
  # num_replicas lets init run outside pmap/shard_map, never update.
  tx = sign_compression("data", num_replicas=8)
  state = tx.init({"w": jnp.ones(3)})
  with pytest.raises(ValueError, match=r"'data'.*pmap"):
    tx.update({"w": jnp.ones(3)}, state)


def test_pack_matches_numpy_and_round_trips():
  bits = np.random.default_rng(0).random((3, 64)) > 0.5
  packed = sign_bits.pack(jnp.asarray(bits))
  np.testing.assert_array_equal(np.asarray(packed), np.packbits(bits, axis=-1, bitorder="little"))
  np.testing.assert_array_equal(np.asarray(sign_bits.unpack(packed)), bits)


@pytest.mark.parametrize("scale", ["column", "l1"])
def test_compiled_exchange_has_no_gather_scatter_or_sort(scale):
  # The codec is reshapes, reductions and broadcasts over static runs: no
  # per-element segment ids (gathers, scatter-adds, sorts) over the buffer.
  k, shapes = 4, {"b": (32,), "w": (64, 32)}  # 2,080 elements
  tx = sign_compression(AXIS, scale=scale)
  grads = {n: jnp.zeros((k,) + s) for n, s in shapes.items()}
  fn = jax.pmap(tx.update, axis_name=AXIS, devices=jax.devices()[:k])
  text = fn.lower(grads, jax.pmap(tx.init, axis_name=AXIS, devices=jax.devices()[:k])(grads)).compile().as_text()
  assert not re.search(r"\b(scatter|sort)\(", text)
  # Only the small table of (hi, lo) pairs is gathered, never the buffer.
  for dims in re.findall(r"= \w+\[([\d,]*)\]\S* gather\(", text):
    assert np.prod([int(d) for d in dims.split(",") if d]) <= 2 * k * (32 // k + 3), dims


@pytest.mark.parametrize("rows, cols, word", [(32, 1, 32), (64, 24, 32), (48, 5, 16), (24, 7, 8)])
def test_unpack_columns_inverts_packing_the_transpose(rows, cols, word):
  bits = np.random.default_rng(rows).random((rows, cols)) > 0.5
  packed = np.packbits(bits.T.reshape(-1), bitorder="little")
  # Compiled (one program each, not one per operation), as the codec runs them.
  got = jax.jit(sign_bits.pack_columns, static_argnums=1)(jnp.asarray(bits), word)
  np.testing.assert_array_equal(np.asarray(got), packed)
  unpack = jax.jit(sign_bits.unpack_columns, static_argnums=(1, 2, 3))
  np.testing.assert_array_equal(np.asarray(unpack(jnp.asarray(packed), rows, cols, word)), bits)


@pytest.mark.parametrize("rows, cols", [(1, 5), (7, 3), (64, 24)])
def test_signed_column_sums_match_float64_and_one_signed_columns_are_exact(rows, cols):
  x = np.random.default_rng(rows).standard_normal((rows, cols)).astype(np.float32)
  x[:, 0] = np.abs(x[:, 0])  # non-negative only
  x[:, 1] = -np.abs(x[:, 1]) - np.float32(1e-3)  # negative only
  x[0, -1], x[-1, -1] = 0.0, -0.0
  pos, neg = jax.jit(sign_codec._signed_sums_over_rows)(jnp.asarray(x))
  np.testing.assert_allclose(np.asarray(pos), np.maximum(x, 0).sum(0, dtype=np.float64), rtol=1e-6)
  np.testing.assert_allclose(np.asarray(neg), np.minimum(x, 0).sum(0, dtype=np.float64), rtol=1e-6)
  assert neg[0] == 0.0 and pos[1] == 0.0


# (64, 2048) and (48, 2048): bytes transposed as uint32 and uint16 words.
@pytest.mark.parametrize("rows, cols", [(8, 3), (64, 24), (48, 5), (24, 7), (64, 2048), (48, 2048)])
def test_column_statistics_in_one_pass_match_numpy(rows, cols):
  x = np.random.default_rng(rows).standard_normal((rows, cols)).astype(np.float32)
  x[:, 0] = np.abs(x[:, 0])  # non-negative only
  x[0, -1], x[-1, -1] = 0.0, -0.0  # both zeros count as non-negative
  packed, pos, neg, count = jax.jit(sign_codec._column_statistics)(jnp.asarray(x))
  nonneg = x >= 0
  np.testing.assert_array_equal(np.asarray(packed), np.packbits(nonneg.T.reshape(-1), bitorder="little"))
  np.testing.assert_array_equal(np.asarray(count), nonneg.sum(0))
  np.testing.assert_allclose(np.asarray(pos), np.maximum(x, 0).sum(0, dtype=np.float64), rtol=1e-6)
  np.testing.assert_allclose(np.asarray(neg), np.minimum(x, 0).sum(0, dtype=np.float64), rtol=1e-6)
  assert neg[0] == 0.0


@pytest.mark.parametrize("scale", ["column", "l1", "l2"])
@pytest.mark.parametrize("rows, n", [(1, 8), (1, 4096), (3, 1000), (5, 64)])
def test_packed_rows_in_one_pass_match_packing_and_sums_apart(scale, rows, n):
  x = np.random.default_rng(n).standard_normal((rows, n)).astype(np.float32)
  x[0, 0], x[-1, -1] = 0.0, -0.0
  packed, pairs = jax.jit(sign_codec._packed_rows, static_argnums=1)(jnp.asarray(x), scale)
  np.testing.assert_array_equal(np.asarray(packed), np.packbits(x >= 0, axis=-1, bitorder="little").reshape(-1))
  for v, got in zip(x.astype(np.float64), np.asarray(pairs)):
    nonneg = v >= 0
    if scale == "column":
      want = [v[nonneg].mean(), v[~nonneg].mean()]
    else:
      hi = np.abs(v).mean() if scale == "l1" else np.sqrt(np.square(v).mean())
      want = [hi, -hi]
    np.testing.assert_allclose(got, want, rtol=2e-6)


@pytest.mark.parametrize("rows", [64, 48, 24, 7])  # uint32, uint16, uint8 words; one per byte
def test_column_worker_pairs_are_the_column_means(rows):
  # The counts come from the packed words where the rows allow them.
  x = np.random.default_rng(rows).standard_normal((rows, 6)).astype(np.float32)
  x[:, 0] = np.abs(x[:, 0])
  layout = sign_layout.make_layout([x.shape], "column", 2)
  # Owner 0's pairs come first: those of its columns (split by columns) or all.
  pairs = jax.jit(lambda x: sign_codec.worker_step([x], None, layout, "column", decode=False)[1])(
    jnp.asarray(x)
  ).reshape(-1, 2)
  nonneg = x >= 0
  hi = np.where(nonneg, x, 0).sum(0) / np.maximum(nonneg.sum(0), 1)
  lo = np.where(nonneg, 0, x).sum(0) / np.maximum((~nonneg).sum(0), 1)
  np.testing.assert_allclose(np.asarray(pairs[:6]), np.stack([hi, lo], -1), rtol=1e-6)
  assert pairs[0, 1] == 0.0


def test_worker_residuals_have_the_leaf_shapes():
  state = sign_compression(scale="column").init({"w": jnp.ones((3, 2, 4)), "b": jnp.ones(4), "s": jnp.ones(())})
  assert [r.shape for r in state.worker_residual] == [(4,), (1,), (3, 2, 4)]


@pytest.mark.parametrize("scale", ["column", "l1"])
def test_donated_worker_keeps_no_gradient_sized_temporaries(scale):
  # v = g + r is not kept for the residual update: kept, every leaf's v
  # stays alive until all pairs are known, and a donated worker (its
  # outputs in the residual's buffers) holds them all as temporaries.
  shapes = [(256, 512), (512,), (512, 128), (128,)]
  layout = sign_layout.make_layout(shapes, scale, 4)
  grads = [jnp.ones(s) for s in shapes]
  residual = tuple(jnp.zeros(s) for s in shapes)
  fn = jax.jit(
    lambda g, r: sign_codec.worker_step(g, r, layout, scale, decode=False)[:3],
    donate_argnums=1,
  )
  memory = fn.lower(grads, residual).compile().memory_analysis()
  if memory is None:
    pytest.skip("this backend reports no memory analysis")
  gradient_bytes = 4 * sum(int(np.prod(s)) for s in shapes)
  assert memory.temp_size_in_bytes < gradient_bytes / 2, (memory.temp_size_in_bytes, gradient_bytes)


def test_final_decode_transposes_no_float_buffer():
  # The decode writes a word-packed leaf in its own order: the only
  # transposes in its compiled program are of packed bits (bytes or words).
  k, rows, cols = 4, 64, 32
  layout = sign_layout.make_layout([(rows, cols)], "column", k)
  assert layout.word_bits(0) == 32
  bits = jnp.zeros((k, layout.chunk // 8), jnp.uint8)
  pairs = jnp.zeros((k, layout.max_local, 2), jnp.float32)
  fn = jax.jit(lambda b, p: sign_codec.final_decode(b, p, layout, [jnp.float32]))
  text = fn.lower(bits, pairs).compile().as_text()
  kinds = set(re.findall(r"= (\w+)\[[\d,]*\]\S* transpose\(", text))
  assert kinds <= {"u8", "u32"}, kinds


@pytest.mark.parametrize("pieces, length", [(3, 16), (1, 40), (2, 8), (8, 5), (4, 6), (2, 12)])
def test_decoding_packed_pieces_equals_decoding_the_unpacked_bits(pieces, length):
  # Whole-byte pieces take the per-lane decode; the others unpack their bytes.
  # Both layouts of a part: a piece per row, and a piece per column (rows
  # stored one after the other). Two senders at once.
  rng = np.random.default_rng(pieces + length)
  bits = rng.random((2, 8 * pieces * length)) > 0.5
  packed = jnp.asarray(np.packbits(bits, axis=-1, bitorder="little"))
  pairs = rng.standard_normal((2, pieces, 2)).astype(np.float32)
  n = pieces * length
  got = jax.jit(sign_codec._decode_rows_of, static_argnums=(2, 3))(
    packed[:, : n // 8], jnp.asarray(pairs), pieces, length
  )
  rows = bits[:, :n].reshape(2, pieces, length)
  np.testing.assert_array_equal(np.asarray(got), np.where(rows, pairs[:, :, :1], pairs[:, :, 1:]))
  got = jax.jit(sign_codec._decode_columns_of, static_argnums=(2, 3))(packed, jnp.asarray(pairs), 8 * length, pieces)
  grid = bits.reshape(2, 8 * length, pieces)
  want = np.where(grid, pairs[:, None, :, 0], pairs[:, None, :, 1])
  np.testing.assert_array_equal(np.asarray(got), want)


@pytest.mark.parametrize("scale", ["l1", "l2", "column"])
@pytest.mark.parametrize("k", [2, 3, 8])
def test_final_decode_takes_each_piece_pair_from_its_owner(scale, k):
  # Leaves split by entries (one segment), by rows and by columns (column
  # scales), with appended zeros; the expected values from the reference's
  # description of the chunks: owner o's pairs follow its pieces in order.
  shapes = [(40,), (33, 16), (256,), (7,), (1024, 2), (5, 3)]
  layout = sign_layout.make_layout(shapes, scale, k)
  index, piece = ref_layout(shapes, scale, k)
  assert index.shape == (k, layout.chunk)
  rng = np.random.default_rng(k)
  bits = rng.random((k, layout.chunk)) > 0.5
  pairs = rng.standard_normal((k, layout.max_local, 2)).astype(np.float32)
  got = jax.jit(lambda b, p: sign_codec.final_decode(b, p, layout, [jnp.float32] * len(shapes)))(
    jnp.asarray(np.packbits(bits, axis=-1, bitorder="little")), jnp.asarray(pairs)
  )
  flat = np.zeros(sum(int(np.prod(s)) for s in shapes), np.float32)
  for o in range(k):
    order = list(dict.fromkeys(piece[o]))  # the owner's pieces, in chunk order
    assert len(order) == layout.max_local
    row = np.searchsorted(order, piece[o]) if order == sorted(order) else None
    assert row is not None
    value = np.where(bits[o], pairs[o, row, 0], pairs[o, row, 1])
    valid = index[o] >= 0
    flat[index[o][valid]] = value[valid]
  want = ref_unflatten(flat, [np.zeros(s) for s in shapes], scale)
  for i, leaf in enumerate(got):
    np.testing.assert_array_equal(np.asarray(leaf), want[i], err_msg=str(shapes[i]))


@pytest.mark.parametrize("scale", ["column", "l1"])
def test_owner_step_is_one_program_and_updates_a_donated_server_residual_in_place(scale):
  # Every owner runs the same program (no branch per owner), and the server
  # residual is updated in place, with no copy of it.
  k, shapes = 4, [(64, 48), (48,), (48, 10)]
  layout = sign_layout.make_layout(shapes, scale, k)
  s, m = layout.chunk, layout.max_local
  fn = jax.jit(lambda b, p, e, o: sign_codec.owner_step(b, p, e, o, layout, scale), donate_argnums=(2,))
  text = (
    fn.lower(jnp.zeros((k, s // 8), jnp.uint8), jnp.zeros((k, m, 2)), jnp.zeros((s,)), jnp.int32(1)).compile().as_text()
  )
  assert "conditional(" not in text
  assert not re.search(rf"= f32\[{s}\]\S* copy\(", text)


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
  assert jax.tree.map(lambda x: (x.shape, x.dtype), state) == jax.tree.map(lambda x: (x.shape[1:], x.dtype), mapped)


def test_specs_for_a_chain():
  tx = optax.chain(sign_compression(AXIS, num_replicas=2), optax.sgd(0.1, momentum=0.9))
  state = tx.init({"w": jnp.ones(3)})
  specs = sign_compression_specs(state, AXIS)
  assert specs[0] == SignCompressionState(P(), P(AXIS), P(AXIS))
  assert all(s == P() for s in jax.tree.leaves(specs[1], is_leaf=lambda x: isinstance(x, P)))


def test_public_names():
  for name in ("sign_compression", "SignCompressionState", "sign_compression_specs"):
    assert name in jmp_train.__all__
    assert hasattr(jmp_train, name)
  assert "collective_bytes" in jmp_train.diagnostics.__all__  # a diagnostic, exported once
  assert "collective_bytes" not in jmp_train.__all__
