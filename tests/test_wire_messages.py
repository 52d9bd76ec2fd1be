"""Codes with float32 values appended in one byte message, and back."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jmp_train._src.compression.wire_messages import append_floats, split_floats


@pytest.mark.parametrize(
  "codes_shape, floats_shape",
  [((3, 5), (3, 1)), ((4, 16), (4, 3, 2)), ((7,), (2, 2)), ((2, 0), (2, 1))],
)
def test_round_trip_is_bit_for_bit(codes_shape, floats_shape):
  rng = np.random.default_rng(0)
  codes = jnp.asarray(rng.integers(0, 256, size=codes_shape), jnp.uint8)
  floats = rng.normal(size=floats_shape).astype(np.float32)
  floats.reshape(-1)[:2] = [np.inf, np.nan]  # non-finite values survive as they are
  payload = append_floats(codes, jnp.asarray(floats))
  n_floats = int(np.prod(floats_shape[len(codes_shape) - 1 :]))
  assert payload.dtype == jnp.uint8
  assert payload.shape == codes_shape[:-1] + (codes_shape[-1] + 4 * n_floats,)
  got_codes, got_floats = split_floats(payload, codes_shape[-1], floats_shape[len(codes_shape) - 1 :])
  np.testing.assert_array_equal(np.asarray(got_codes), np.asarray(codes))
  assert got_floats.dtype == jnp.float32
  np.testing.assert_array_equal(np.asarray(got_floats).view(np.uint32), floats.view(np.uint32))
