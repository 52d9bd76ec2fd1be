"""Bucketed 1-bit exchange: each bucket is the unbucketed exchange of its leaves."""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest

from jmp_train import one_bit_adam, one_bit_momentum, sign_compression, sign_compression_wire_bytes
from jmp_train.diagnostics import collective_bytes, collective_ops

from helpers.sign_reference import AXIS, WIDE_SHAPES, make_grads, replicated_zeros  # noqa: E402

K = 4
# 2,000 bytes: buckets {i}, {h, g} and {f, ..., a} (last leaves first).
BUCKETS = (("i",), ("g", "h"), ("a", "b", "c", "d", "e", "f"))


# Compiling an exchange takes most of each test's time: the tests below
# share their programs, each pmapped (and compiled) once per module.
def _pmapped(k=K, **kwargs):
  return _pmapped_once(k, **kwargs)


@functools.cache
def _pmapped_once(k, **kwargs):
  tx = sign_compression(AXIS, **kwargs)
  devices = jax.devices()[:k]
  return jax.pmap(tx.init, axis_name=AXIS, devices=devices), jax.pmap(tx.update, axis_name=AXIS, devices=devices)


# Column scales: the layout with the most cases (leaves split by columns,
# word-packed or not, by rows and by entries); bucketing itself is
# scale-blind. Two tests below take its bucketed program.
def test_buckets_equal_separate_exchanges_bit_for_bit(scale="column", k=K):
  init, update = _pmapped(k, scale=scale, bucket_bytes=2000)
  state = init(replicated_zeros(k, WIDE_SHAPES))
  sub = {names: _pmapped(k, scale=scale) for names in BUCKETS}
  sub_states = {names: sub[names][0](replicated_zeros(k, {n: WIDE_SHAPES[n] for n in names})) for names in BUCKETS}
  for step in range(3):
    grads = make_grads(k, seed=60 + step, shapes=WIDE_SHAPES)
    out, state = update(grads, state)
    server = []  # each bucket's chunk, in the order of its leaves
    for names in BUCKETS:
      sub_out, sub_states[names] = sub[names][1]({n: grads[n] for n in names}, sub_states[names])
      for n in names:
        np.testing.assert_array_equal(np.asarray(out[n]), np.asarray(sub_out[n]), err_msg=n)
    leaf_names = sorted(WIDE_SHAPES)
    for names in BUCKETS:
      for j, n in enumerate(names):
        np.testing.assert_array_equal(
          np.asarray(state.worker_residual[leaf_names.index(n)]),
          np.asarray(sub_states[names].worker_residual[j]),
        )
      server.append((min(leaf_names.index(n) for n in names), np.asarray(sub_states[names].server_residual)))
    np.testing.assert_array_equal(
      np.asarray(state.server_residual), np.concatenate([e for _, e in sorted(server)], axis=1)
    )


def test_each_bucket_has_its_own_packed_collectives():
  # Column scales, the most reconstruction pairs: the program of
  # test_buckets_equal_separate_exchanges_bit_for_bit.
  init, update = _pmapped(K, scale="column", bucket_bytes=2000)
  params = replicated_zeros(K, WIDE_SHAPES)
  compiled = update.lower(params, init(params)).compile()
  ops = collective_ops(compiled)
  # One uint8 all-to-all and one uint8 all-gather per bucket, nothing else:
  # the bits with their reconstruction pairs (8 bytes each, at most 16 per
  # owner here) appended.
  assert sorted(op.kind for op in ops) == ["all-gather"] * len(BUCKETS) + ["all-to-all"] * len(BUCKETS)
  assert all(op.dtypes == ("u8",) for op in ops)
  packed = sorted(op.operand_bytes for op in ops if op.kind == "all-to-all")
  sizes = [sum(int(np.prod(WIDE_SHAPES[n])) for n in names) for names in BUCKETS]
  bits = sorted(-(-n // (8 * K)) * K for n in sizes)  # n_pad / 8
  for got, want in zip(packed, bits):
    assert want < got <= want + 8 * K * 16
  # The bytes predicted without compiling are those of the compiled program.
  predicted = sign_compression_wire_bytes(WIDE_SHAPES_TREE, K, scale="column", bucket_bytes=2000)
  assert predicted == collective_bytes(compiled, wire=True)["total"]


WIDE_SHAPES_TREE = {n: np.zeros(s, np.float32) for n, s in WIDE_SHAPES.items()}


def test_wire_bytes_without_buckets_are_the_compiled_programs():
  # Column scales: the most reconstruction pairs per chunk (the program of
  # test_buckets_change_neither_the_results_nor_the_state).
  init, update = _pmapped(scale="column")
  params = replicated_zeros(K, WIDE_SHAPES)
  compiled = update.lower(params, init(params)).compile()
  assert sign_compression_wire_bytes(WIDE_SHAPES_TREE, K) == collective_bytes(compiled, wire=True)["total"]
  # One replica sends nothing; many send a 32nd of a ring all-reduce's bytes, or less.
  assert sign_compression_wire_bytes(WIDE_SHAPES_TREE, 1) == 0
  big = {"w": jax.ShapeDtypeStruct((4096, 4096), np.float32)}
  ring = 2 * 1023 / 1024 * 4 * 4096 * 4096
  assert 30 < ring / sign_compression_wire_bytes(big, 1024) <= 32


@pytest.mark.parametrize(
  "kwargs, match",
  [
    ({"num_replicas": 0}, "num_replicas must be a positive int, got 0"),
    ({"num_replicas": True}, "num_replicas must be a positive int, got True"),
    ({"num_replicas": 4, "scale": "rows"}, "Unknown scale 'rows'"),
    ({"num_replicas": 4, "bucket_bytes": -1}, "bucket_bytes must be a positive int or None, got -1"),
  ],
)
def test_wire_bytes_bad_arguments_are_value_errors(kwargs, match):
  with pytest.raises(ValueError, match=match):
    sign_compression_wire_bytes(WIDE_SHAPES_TREE, **kwargs)


@pytest.mark.parametrize("bad", [0, -1, 2.5, True, "4MB"])
def test_bad_bucket_bytes_is_a_value_error(bad):
  with pytest.raises(ValueError, match=f"bucket_bytes must be a positive int or None, got {bad!r}"):
    sign_compression(AXIS, bucket_bytes=bad)


def test_buckets_change_neither_the_results_nor_the_state():
  # A leaf's part of each chunk does not depend on the buckets: the same
  # results and state bit for bit, and a state made with other buckets (or
  # none) serves. Column scales, as the two tests above (their programs).
  init, update = _pmapped(scale="column")
  _, bucketed = _pmapped(scale="column", bucket_bytes=2000)
  params = replicated_zeros(K, WIDE_SHAPES)
  state = b_state = init(params)
  for step in range(2):
    grads = make_grads(K, seed=90 + step, shapes=WIDE_SHAPES)
    out, state = update(grads, state)
    b_out, b_state = bucketed(grads, b_state)
    for n in WIDE_SHAPES:
      np.testing.assert_array_equal(np.asarray(b_out[n]), np.asarray(out[n]), err_msg=n)
    for a, b in zip(jax.tree.leaves(b_state), jax.tree.leaves(state), strict=True):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# A smaller tree for the optimizers: 2,000 bytes give buckets {i} and {a, b}.
OPT_SHAPES = {n: WIDE_SHAPES[n] for n in ("a", "b", "i")}
OPT_BUCKETS = (("i",), ("a", "b"))


@functools.cache
def _momentum(bucket_bytes=None):
  """(init, update) of 1-bit momentum SGD pmapped over K devices, once per module."""
  tx = one_bit_momentum(0.1, 0.9, axis_name=AXIS, bucket_bytes=bucket_bytes)
  devices = jax.devices()[:K]
  return jax.pmap(tx.init, axis_name=AXIS, devices=devices), jax.pmap(tx.update, axis_name=AXIS, devices=devices)


def test_one_bit_momentum_with_buckets_equals_one_optimizer_per_bucket():
  # Momentum SGD is elementwise around the exchange, so bucketing its
  # exchange must equal running one optimizer on each bucket's leaves.
  init, update = _momentum(bucket_bytes=2000)
  sub_init, sub_update = _momentum()
  params = replicated_zeros(K, OPT_SHAPES)
  state = init(params)
  sub_states = {names: sub_init({n: params[n] for n in names}) for names in OPT_BUCKETS}
  for step in range(2):
    grads = make_grads(K, seed=70 + step, shapes=OPT_SHAPES)
    out, state = update(grads, state)
    for names in OPT_BUCKETS:
      sub_out, sub_states[names] = sub_update({n: grads[n] for n in names}, sub_states[names])
      for n in names:
        np.testing.assert_array_equal(np.asarray(out[n]), np.asarray(sub_out[n]), err_msg=n)
  assert int(np.asarray(state.count)[0]) == 2


def test_one_bit_adam_with_buckets_exchanges_each_bucket_on_its_own():
  tx = one_bit_adam(1e-2, axis_name=AXIS, warmup_steps=1, bucket_bytes=2000)
  params = replicated_zeros(K, OPT_SHAPES)
  devices = jax.devices()[:K]
  state = jax.pmap(tx.init, axis_name=AXIS, devices=devices)(params)
  update = jax.pmap(tx.update, axis_name=AXIS, devices=devices)
  ops = collective_ops(update.lower(params, state, params).compile())
  # After warm-up: one uint8 all-to-all and all-gather per bucket.
  packed = [op.kind for op in ops if op.dtypes == ("u8",)]
  assert sorted(packed) == ["all-gather"] * len(OPT_BUCKETS) + ["all-to-all"] * len(OPT_BUCKETS)
  # The server residual holds every bucket's chunk, as sign_compression's.
  alone = jax.pmap(sign_compression(AXIS, scale="l2", bucket_bytes=2000).init, axis_name=AXIS, devices=devices)(params)
  assert state.compression.server_residual.shape == alone.server_residual.shape


def test_one_bit_optimizer_state_serves_other_buckets():
  # The optimizers of the test above (their programs).
  params = replicated_zeros(K, OPT_SHAPES)
  state = _momentum()[0](params)
  init, update = _momentum(bucket_bytes=2000)
  other = init(params)
  assert jax.tree.map(np.shape, other) == jax.tree.map(np.shape, state)
  update(params, state)
