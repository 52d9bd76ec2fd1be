"""Tests of blockwise 8-bit quantization (jmp_train._src.low_precision.quantized_state)."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jmp_train._src.low_precision import quantized_state as qs

CODES_SIGNED = [(c, s) for c in qs.CODES for s in (True, False)]


def _reference_dynamic_map(signed):
  """bitsandbytes' create_dynamic_map(signed, 7, 8), written out independently."""
  values = [0.0, 1.0]
  for i in range(7):
    n = 2**i if signed else 2 ** (i + 1)  # fraction entries in decade 10^(i-6)
    edges = np.linspace(0.1, 1.0, n + 1)
    mids = 10.0 ** (i - 6) * (edges[1:] + edges[:-1]) / 2
    values += list(mids) + (list(-mids) if signed else [])
  return np.sort(np.float32(values))


def _reference_quantize(x, block_size, table):
  """NumPy: per block, the index of the table entry nearest to x / absmax."""
  flat = np.asarray(x, np.float32).ravel()
  n_blocks = max(1, math.ceil(flat.size / block_size))
  blocks = np.zeros(n_blocks * block_size, np.float32)
  blocks[: flat.size] = flat
  blocks = blocks.reshape(n_blocks, block_size)
  absmax = np.abs(blocks).max(axis=1)
  normed = blocks / np.where(absmax > 0, absmax, 1)[:, None]
  codes = np.abs(normed[..., None] - table).argmin(-1)
  if table.min() >= 0:  # unsigned: a positive value takes at least the smallest positive entry
    smallest = np.flatnonzero(table > 0)[0]
    codes = np.where((normed > 0) & (table[codes] == 0), smallest, codes)
  return codes.ravel()[: flat.size].reshape(np.shape(x)), absmax


@functools.partial(jax.jit, static_argnames=("block_size", "code", "signed"))
def _round_trip(x, *, block_size=256, code="dynamic", signed=True):
  """quantize then dequantize, compiled as one program (not op by op)."""
  q = qs.quantize(x, block_size=block_size, code=code, signed=signed)
  return q, qs.dequantize(q, block_size=block_size, code=code, signed=signed)


def _sample(shape, signed, seed=0):
  rng = np.random.default_rng(seed)
  # Magnitudes spread over six decades, as optimizer moments are.
  x = np.exp(rng.uniform(np.log(1e-6), 0, shape)) * rng.uniform(0.5, 4, shape[:1] + (1,) * (len(shape) - 1))
  if signed:
    x = x * rng.choice([-1.0, 1.0], shape)
  return np.float32(x)


@pytest.mark.parametrize("signed", [True, False])
def test_dynamic_map_matches_bitsandbytes_construction(signed):
  np.testing.assert_array_equal(qs.code_map("dynamic", signed), _reference_dynamic_map(signed))


@pytest.mark.parametrize("code,signed", CODES_SIGNED)
def test_code_map_properties(code, signed):
  table = qs.code_map(code, signed)
  assert table.shape == (256,) and table.dtype == np.float32
  assert np.all(np.diff(table) >= 0)
  assert 0.0 in table and table[-1] == 1.0
  assert (table.min() < 0) == signed
  assert not table.flags.writeable


@pytest.mark.parametrize("code,signed", CODES_SIGNED)
@pytest.mark.parametrize("shape,block_size", [((1000,), 256), ((64, 48), 256), ((7, 5, 3), 32), ((), 256)])
def test_quantize_matches_numpy_reference(code, signed, shape, block_size):
  x = _sample(shape if shape else (1,), signed).reshape(shape)
  q = jax.jit(lambda x: qs.quantize(x, block_size=block_size, code=code, signed=signed))(x)
  table = qs.code_map(code, signed)
  ref_codes, ref_absmax = _reference_quantize(x, block_size, table)
  assert q.codes.dtype == np.uint8 and q.codes.shape == shape
  assert q.absmax.dtype == np.float32 and q.absmax.shape == (max(1, math.ceil(x.size / block_size)),)
  np.testing.assert_array_equal(q.absmax, ref_absmax)
  # Ties between two entries may go either way; both are nearest.
  got = table[np.asarray(q.codes)]
  want = table[ref_codes]
  normed = x / np.repeat(ref_absmax, block_size)[: x.size].reshape(shape)
  np.testing.assert_allclose(np.abs(got - normed), np.abs(want - normed), atol=1e-7)
  if not signed:  # a positive value never becomes zero
    assert np.all(got[x > 0] > 0)


@pytest.mark.parametrize("code,signed", CODES_SIGNED)
def test_error_bound_per_block(code, signed):
  block_size = 128
  x = _sample((16, block_size), signed, seed=1)
  _, back = _round_trip(x, block_size=block_size, code=code, signed=signed)
  back = np.asarray(back)
  table = qs.code_map(code, signed)
  half_gap = np.diff(table).max() / 2
  # The signed dynamic code's most negative entry is above -1; unsigned codes
  # lift tiny positive values to the smallest positive entry.
  bound = max(half_gap, table[0] + 1 if signed else table[table > 0].min())
  absmax = np.abs(x).max(axis=1, keepdims=True)
  assert np.all(np.abs(back - x) <= bound * absmax * (1 + 1e-5))
  if code == "linear":  # the documented bounds: absmax/254 signed, /510 unsigned
    assert half_gap == pytest.approx(1 / 254 if signed else 1 / 510, rel=1e-5)
    above = np.abs(x) >= absmax / 255
    assert np.all(np.abs(back - x)[above] <= (half_gap * absmax * (1 + 1e-5) + 0 * x)[above])


@pytest.mark.parametrize("signed", [True, False])
def test_dynamic_code_keeps_small_values(signed):
  # Values spread over four decades below the block maximum.
  x = _sample((8, 256), signed, seed=2)
  x[:, 0] = 1.0
  keep = np.abs(x) > 1e-4
  rel = {}
  for code in qs.CODES:
    back = np.asarray(_round_trip(x, code=code, signed=signed)[1])
    rel[code] = np.median(np.abs(back - x)[keep] / np.abs(x)[keep])
  assert rel["dynamic"] < 0.1
  assert rel["dynamic"] < rel["linear"] / 5


@pytest.mark.parametrize("code,signed", CODES_SIGNED)
def test_stochastic_rounding_is_unbiased_between_neighbours(code, signed):
  table = qs.code_map(code, signed)
  x = np.float32(_sample((256,), signed, seed=3))
  x = x / np.abs(x).max()  # one block, absmax 1: x is the normalized value
  draws = jax.jit(
    jax.vmap(lambda k: qs.dequantize(qs.quantize(x, code=code, signed=signed, key=k), code=code, signed=signed))
  )(jax.random.split(jax.random.key(0), 1000))
  draws = np.asarray(draws)
  # Every draw is one of the two entries around the value.
  lo = table[np.clip(np.searchsorted(table, x, side="right") - 1, 0, 254)]
  hi = table[np.clip(np.searchsorted(table, x, side="right"), 0, 255)]
  ok = np.isclose(draws, lo) | np.isclose(draws, hi)
  if not signed:  # positive values that would become 0 take the smallest entry
    ok |= np.isclose(draws, table[table > 0].min())
  assert ok.all()
  # The mean is the value, to within the sampling error.
  gap = hi - lo
  big = (gap > 0) & ((x > table[table > 0].min()) if not signed else True)
  err = np.abs(draws.mean(0) - x)[big]
  assert np.all(err <= 4 * gap[big] / np.sqrt(1000) + 1e-7)


def test_zeros_and_zero_blocks():
  x = jnp.zeros((300,)).at[280].set(2.0)
  for signed in (True, False):
    q, back = _round_trip(x, signed=signed)
    assert float(q.absmax[0]) == 0.0
    np.testing.assert_array_equal(back[:256], 0.0)
  # The defaults (dynamic, signed, 256) round-trip it exactly.
  np.testing.assert_array_equal(jax.jit(lambda x: qs.dequantize(qs.quantize(x)))(x), x)


def test_quantized_array_is_a_pytree():
  q = qs.quantize(jnp.arange(10.0), block_size=4)
  leaves, treedef = jax.tree.flatten(q)
  assert len(leaves) == 2
  again = jax.tree.unflatten(treedef, leaves)
  assert isinstance(again, qs.QuantizedArray)
  assert again.shape == (10,) and again.size == 10 and again.nbytes == 10 + 3 * 4


def test_errors():
  x = jnp.ones((10,))
  with pytest.raises(ValueError, match="code must be one of .*dynamic.*linear.*'log'"):
    qs.quantize(x, code="log")
  with pytest.raises(ValueError, match="block_size must be a positive int, got 0"):
    qs.quantize(x, block_size=0)
  with pytest.raises(ValueError, match="block_size"):
    qs.quantize(x, block_size=2.5)
  with pytest.raises(ValueError, match=r"absmax has shape \(3,\).*need \(1,\)"):
    qs.dequantize(qs.quantize(x, block_size=4), block_size=256)
  with pytest.raises(ValueError, match="code must be one of"):
    qs.code_map("fp8")
