"""1-bit exchange under pmap against the NumPy reference (tests/helpers/sign_reference.py).

Also: conservation of both residuals, the options (no error feedback,
warm-up) and non-finite gradients.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from helpers.sign_reference import (  # noqa: E402  (tests/ is on sys.path)
  SHAPES,
  WIDE_SHAPES,
  assert_residual_zero,
  buffer_residual,
  make_grads,
  per_replica_leaves,
  pmapped,
  ref_flatten,
  ref_step,
  ref_to_chunks,
  replicated_zeros,
)


# ---------------------------------------------------------------------------
# Reference and conservation.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("k, scale", [(2, "column"), (4, "column"), (8, "column"), (4, "l1"), (4, "l2")])
def test_matches_numpy_reference_and_conserves(k, scale):
  init, update = pmapped(k, scale=scale)
  state = init(replicated_zeros(k))
  for step in range(3):
    grads = make_grads(k, seed=step)
    r_old = buffer_residual(state.worker_residual, SHAPES, scale)
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
    r_new = buffer_residual(state.worker_residual, SHAPES, scale)
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
    flat_out = np.asarray(ref_flatten([np.asarray(out[n])[0] for n in SHAPES], scale)[0])
    chunk_out = ref_to_chunks(flat_out, SHAPES, scale, k)
    tol = 8 * np.float32(2.0**-23) * (np.abs(u) + np.abs(chunk_out) + np.abs(e_old))
    assert (np.abs(u - (chunk_out + e_new)) <= tol + 1e-30).all()
    assert np.asarray(state.count)[0] == step + 1


def test_residual_is_exact_difference():
  # With the implementation's own output: new residual == v - decoded exactly,
  # and the worker's decoded values take one of two values per column.
  k = 2
  init, update = pmapped(k, scale="column", server_error_feedback=False)
  state = init(replicated_zeros(k))
  grads = make_grads(k, seed=7)
  _, state = update(grads, state)
  r = buffer_residual(state.worker_residual, SHAPES, "column")
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
# Options: no error feedback, warm-up.
# ---------------------------------------------------------------------------


def test_without_error_feedback_residuals_stay_zero():
  k = 4
  init, update = pmapped(k, error_feedback=False, server_error_feedback=False)
  state = init(replicated_zeros(k))
  for step in range(2):
    grads = make_grads(k, seed=20 + step)
    out, state = update(grads, state)
    assert_residual_zero(state.worker_residual)
    np.testing.assert_array_equal(np.asarray(state.server_residual), 0.0)
    ref_out, *_ = ref_step(
      [per_replica_leaves(grads, j) for j in range(k)],
      buffer_residual(state.worker_residual, SHAPES, "column"),
      np.zeros(state.server_residual.shape, np.float32),
      "column",
      error_feedback=False,
      server_error_feedback=False,
    )
    for name, ref_leaf in zip(SHAPES, ref_out):
      np.testing.assert_allclose(np.asarray(out[name])[0], ref_leaf, rtol=2e-5, atol=1e-6)


@pytest.mark.parametrize("scale", ["column", "l1", "l2"])
def test_empty_leaves_pass_through_and_leave_the_others_alone(scale):
  # A zero-size leaf takes no bits: the other leaves' outputs and residuals
  # are those of the same tree without it, bit for bit.
  k = 4
  empty = {"empty_matrix": (0, 3), "empty_vector": (0,)}
  init, update = pmapped(k, scale=scale)
  grads = make_grads(k, seed=7)
  with_empty = {**grads, **{n: jnp.zeros((k,) + s) for n, s in empty.items()}}
  out, state = update(grads, init(replicated_zeros(k)))
  out_e, state_e = update(with_empty, init(replicated_zeros(k, {**SHAPES, **empty})))
  for name, shape in empty.items():
    assert out_e[name].shape == (k,) + shape
  for name in grads:
    np.testing.assert_array_equal(np.asarray(out_e[name]), np.asarray(out[name]), err_msg=name)
  np.testing.assert_array_equal(np.asarray(state_e.server_residual), np.asarray(state.server_residual))


def test_warmup_is_exact_pmean_then_compressed():
  k = 4
  init, update = pmapped(k, warmup_steps=2)
  state = init(replicated_zeros(k))
  for step in range(3):
    grads = make_grads(k, seed=30 + step)
    out, state = update(grads, state)
    if step < 2:
      for name in SHAPES:
        np.testing.assert_allclose(np.asarray(out[name])[0], np.asarray(grads[name]).mean(0), rtol=1e-6, atol=1e-7)
      assert_residual_zero(state.worker_residual)
      np.testing.assert_array_equal(np.asarray(state.server_residual), 0.0)
    else:
      ref_out, ref_r, *_ = ref_step(
        [per_replica_leaves(grads, j) for j in range(k)],
        np.zeros_like(buffer_residual(state.worker_residual, SHAPES, "column")),
        np.zeros(state.server_residual.shape, np.float32),
        "column",
      )
      for name, ref_leaf in zip(SHAPES, ref_out):
        np.testing.assert_allclose(np.asarray(out[name])[0], ref_leaf, rtol=2e-5, atol=1e-6)
      np.testing.assert_allclose(buffer_residual(state.worker_residual, SHAPES, "column"), ref_r, rtol=2e-5, atol=2e-6)
  assert np.asarray(state.count)[0] == 3


# ---------------------------------------------------------------------------
# Non-finite gradients never enter a residual.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [np.inf, np.nan])
def test_non_finite_gradient_keeps_residuals(bad):
  k = 4
  init, update = pmapped(k, scale="column")  # the default, spelled as above: one compiled update
  state = init(replicated_zeros(k))
  _, state = update(make_grads(k, seed=40), state)
  grads = make_grads(k, seed=41)
  grads["dense"] = np.array(grads["dense"])
  grads["dense"][1, 2, 0] = bad
  r_old = buffer_residual(state.worker_residual, SHAPES, "column")
  e_old = np.asarray(state.server_residual)
  out, new_state = update(grads, state)
  r_new = buffer_residual(new_state.worker_residual, SHAPES, "column")
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
    np.testing.assert_array_equal(np.isfinite(np.asarray(out["dense"])[j]), np.isfinite(np.asarray(out["dense"])[0]))


@pytest.mark.parametrize("k", [3, 8])
def test_word_packed_leaves_match_numpy_reference(k):
  # Leaves whose bits cross to buffer order as packed words (rows a multiple
  # of 32, byte-aligned), one that is not byte-aligned, and columns cut by
  # chunk boundaries (a column longer than a chunk for K = 8).
  init, update = pmapped(k, scale="column")
  state = init(replicated_zeros(k, WIDE_SHAPES))
  for step in range(2):
    grads = make_grads(k, seed=80 + step, shapes=WIDE_SHAPES)
    r_old = buffer_residual(state.worker_residual, WIDE_SHAPES, "column")
    e_old = np.asarray(state.server_residual)
    out, state = update(grads, state)
    ref_out, ref_r, ref_e, *_ = ref_step([per_replica_leaves(grads, j) for j in range(k)], r_old, e_old, "column")
    for name, ref_leaf in zip(WIDE_SHAPES, ref_out):
      got = np.asarray(out[name])
      np.testing.assert_array_equal(got, np.broadcast_to(got[0], got.shape))
      np.testing.assert_allclose(got[0], ref_leaf, rtol=2e-5, atol=1e-6, err_msg=name)
    r_new = buffer_residual(state.worker_residual, WIDE_SHAPES, "column")
    np.testing.assert_allclose(r_new, ref_r, rtol=2e-5, atol=2e-6)
    np.testing.assert_allclose(np.asarray(state.server_residual), ref_e, rtol=2e-5, atol=2e-6)
