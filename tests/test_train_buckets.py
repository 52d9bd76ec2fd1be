"""Bucketed gradient averaging: the helpers and the compiled data-parallel step."""

from __future__ import annotations

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax

import jmp_train
from jmp_train._src import buckets
from jmp_train._src.compression.sign_compression import sign_compression


def _tree():
  rng = np.random.default_rng(0)
  return {
    "a": jnp.asarray(rng.normal(size=(3, 5)), jnp.float32),
    "b": jnp.asarray(rng.normal(size=(7,)), jnp.float32),
    "c": jnp.asarray(rng.normal(size=(2, 2)), jnp.bfloat16),
    "d": jnp.asarray(rng.normal(size=(4,)), jnp.float32),
  }


@pytest.mark.parametrize("bucket_bytes", [1, 28, 64, 10**6])
@pytest.mark.parametrize("dtype", [None, jnp.float32, jnp.bfloat16])
def test_flatten_unflatten_round_trip(bucket_bytes, dtype):
  tree = _tree()
  flat = buckets.flatten_to_buckets(tree, bucket_bytes, dtype)
  assert all(b.ndim == 1 for b in flat)
  assert sum(b.size for b in flat) == sum(x.size for x in jax.tree.leaves(tree))
  if dtype is not None:
    assert {b.dtype for b in flat} == {np.dtype(dtype)}
  back = buckets.unflatten_from_buckets(flat, tree, bucket_bytes, dtype)
  chex.assert_trees_all_equal_shapes_and_dtypes(back, tree)
  expected = tree if dtype in (None, jnp.float32) else jax.tree.map(lambda x: x.astype(dtype).astype(x.dtype), tree)
  chex.assert_trees_all_equal(back, expected)


def test_buckets_take_the_last_leaves_first_and_split_by_dtype():
  tree = _tree()  # leaves a (15 f32), b (7 f32), c (4 bf16), d (4 f32)
  assert buckets.bucket_sizes(tree, 10**6) == [[3], [2], [1, 0]]
  assert buckets.bucket_sizes(tree, 10**6, jnp.float32) == [[3, 2, 1, 0]]
  # A bucket closes once it holds bucket_bytes: d+c (16 + 16 bytes) >= 24,
  # then b (28 bytes) alone; a leaf is never split.
  assert buckets.bucket_sizes(tree, 24, jnp.float32) == [[3, 2], [1], [0]]
  assert buckets.bucket_sizes(tree, 40, jnp.float32) == [[3, 2, 1], [0]]
  flat = buckets.flatten_to_buckets(tree, 10**6, jnp.float32)
  np.testing.assert_array_equal(flat[0][:4], tree["d"])
  with pytest.raises(ValueError, match="bucket_bytes must be a positive int, got 0"):
    buckets.bucket_sizes(tree, 0)


def test_mean_buckets_leave_a_leaf_that_fills_a_bucket_alone():
  tree = _tree()  # leaves a (60 bytes as float32), b (28), c (16), d (16)
  # Where bucket_sizes starts a new bucket with a large leaf anyway, the
  # buckets are the same.
  assert buckets.bucket_sizes(tree, 24, jnp.float32) == [[3, 2], [1], [0]]
  assert buckets.mean_buckets(tree, 24, jnp.float32) == [[3, 2], [1], [0]]
  assert buckets.bucket_sizes(tree, 40, jnp.float32) == [[3, 2, 1], [0]]
  assert buckets.mean_buckets(tree, 40, jnp.float32) == [[3, 2, 1], [0]]
  # bucket_sizes copies a (60 bytes) into b's bucket; mean_buckets leaves it alone.
  assert buckets.bucket_sizes(tree, 30, jnp.float32) == [[3, 2], [1, 0]]
  assert buckets.mean_buckets(tree, 30, jnp.float32) == [[3, 2], [1], [0]]
  # In their own dtypes: c (8 bytes of bfloat16) apart from the float32 leaves.
  assert buckets.mean_buckets(tree, 20) == [[3], [2], [1], [0]]
  assert buckets.mean_buckets(tree, 10**6) == buckets.bucket_sizes(tree, 10**6)
  with pytest.raises(ValueError, match="bucket_bytes must be a positive int, got 0"):
    buckets.mean_buckets(tree, 0)


def test_mean_buckets_leave_a_leaf_of_4_mib_alone_in_larger_buckets():
  four_mib = buckets.ALONE_FROM_BYTES // 4
  tree = [jax.ShapeDtypeStruct(s, jnp.float32) for s in [(8,), (four_mib,), (four_mib - 1,), (4,)]]
  assert buckets.bucket_sizes(tree, 25 * 2**20) == [[3, 2, 1, 0]]
  assert buckets.mean_buckets(tree, 25 * 2**20) == [[3, 2, 0], [1]]
  # In bfloat16 the same leaf is 2 MiB: in the bucket.
  assert buckets.mean_buckets(tree, 25 * 2**20, jnp.bfloat16) == [[3, 2, 1, 0]]


def test_bucketed_mean_averages_a_large_leaf_where_it_is():
  # The large leaf reaches its own all-reduce (raveled: a bitcast, not a
  # copy into a flat buffer shared with the small ones, which bucket_sizes
  # would make: one bucket of 2060 elements).
  tree = {"big": jnp.ones((64, 32)), "s1": jnp.ones(8), "s2": jnp.ones(4)}
  fn = jax.pmap(lambda t: buckets.bucketed_mean(t, "i", 1024), axis_name="i", devices=jax.devices()[:2])
  stacked = jax.tree.map(lambda x: jnp.stack([x, 3 * x]), tree)
  operands = sorted(
    shape
    for op in jmp_train.diagnostics.collective_ops(fn.lower(stacked).compile())
    if op.kind == "all-reduce"
    for _, shape in op.operand_types
  )
  assert operands == [(12,), (2048,)]
  expected = jax.tree.map(lambda x: jnp.stack([2 * x, 2 * x]), tree)
  chex.assert_trees_all_close(fn(stacked), expected)


def test_bucketed_mean_equals_the_mean_per_leaf():
  # Compiled (one program each, not one per operation).
  tree = jax.tree.map(lambda x: np.stack([np.asarray(x) * (i + 1) for i in range(4)]), _tree())
  per_leaf = jax.jit(jax.vmap(lambda t: lax.pmean(t, "i"), axis_name="i"))(tree)
  bucketed = jax.jit(jax.vmap(lambda t: buckets.bucketed_mean(t, "i", 32), axis_name="i"))(tree)
  chex.assert_trees_all_equal_shapes_and_dtypes(bucketed, per_leaf)
  chex.assert_trees_all_close(bucketed, per_leaf, rtol=1e-6)


class _Mlp(nn.Module):
  widths: tuple = (64, 64, 64)

  @nn.compact
  def __call__(self, x):
    for width in self.widths:
      x = nn.relu(nn.Dense(width)(x))
    return nn.Dense(4)(x)


def _xent(logits, labels):
  return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def _gradient_all_reduces(compiled):
  """The (dtype, shape) of every non-scalar all-reduce operand of a compiled step.

  XLA may combine independent all-reduces into one instruction with several
  operands, so the buckets are counted as operands, not instructions. The
  scalar metric and loss-scale reductions are not gradient exchanges.
  """
  return [
    (dtype, shape)
    for op in jmp_train.diagnostics.collective_ops(compiled)
    if op.kind == "all-reduce"
    for dtype, shape in op.operand_types
    if np.prod(shape) > 1
  ]


@pytest.mark.parametrize("mode", ["pmap", "shard_map"])
@pytest.mark.parametrize("reduce_dtype", [None, "float32", "bfloat16", "float16"])
def test_compiled_step_runs_one_all_reduce_per_bucket(mode, reduce_dtype):
  params = _Mlp().init(jax.random.PRNGKey(0), jnp.ones((1, 6)))["params"]
  n = sum(x.size for x in jax.tree.leaves(params))
  bucket_bytes = 4 * 64 * 64  # about one hidden layer
  step = jmp_train.make_train_step(
    _Mlp().apply, _xent, optax.sgd(0.1), mode=mode, bucket_bytes=bucket_bytes, grad_reduce_dtype=reduce_dtype
  )
  state = step.init(params)
  x = np.ones((16, 6), np.float32)
  batch = step.shard_batch((x, np.zeros(16, np.int32)))
  compiled = step.lower(state, batch).compile()
  operands = _gradient_all_reduces(compiled)
  layout = buckets.mean_buckets(params, bucket_bytes, reduce_dtype)
  assert len(layout) > 1 and any(len(b) > 1 for b in layout)
  leaves = jax.tree.leaves(params)
  assert sorted(int(np.prod(shape)) for _, shape in operands) == sorted(
    sum(leaves[i].size for i in bucket) for bucket in layout
  )
  wire = np.dtype(reduce_dtype or "float32")
  if wire == jnp.bfloat16 and jax.default_backend() == "cpu":
    wire = np.dtype("float32")  # XLA:CPU runs bfloat16 all-reduces in float32.
  assert {dtype for dtype, _ in operands} == {{"float32": "f32", "bfloat16": "bf16", "float16": "f16"}[wire.name]}
  bytes_moved = jmp_train.diagnostics.collective_bytes(compiled)
  scalars = 64  # the metrics and the loss scale: a few scalars
  assert n * wire.itemsize <= bytes_moved["all-reduce"] <= n * wire.itemsize + scalars
  state, metrics = step(state, batch)
  assert np.isfinite(float(metrics["loss"]))


def test_bucketed_step_matches_the_per_leaf_step():
  params = _Mlp().init(jax.random.PRNGKey(0), jnp.ones((1, 6)))["params"]
  x = np.random.default_rng(0).normal(size=(16, 6)).astype(np.float32)
  batch = (x, np.arange(16, dtype=np.int32) % 4)
  results = []
  for bucket_bytes in (1, 10**8):  # one bucket per leaf / one bucket in all
    step = jmp_train.make_train_step(_Mlp().apply, _xent, optax.sgd(0.1), mode="shard_map", bucket_bytes=bucket_bytes)
    state, _ = step(step.init(params), step.shard_batch(batch))
    results.append(step.unreplicate(state.params))
  chex.assert_trees_all_close(results[0], results[1], rtol=1e-6, atol=1e-7)


def test_compression_as_the_whole_optimizer_keeps_state_per_replica():
  # One hidden layer: matrices and vectors as above, in half the leaves
  # (the 1-bit exchange's program grows with them).
  model = _Mlp(widths=(16,))
  params = model.init(jax.random.PRNGKey(0), jnp.ones((1, 6)))["params"]
  whole = optax.chain(sign_compression("batch"), optax.sgd(0.05))
  # Two replicas: the 1-bit exchange's program grows with their number.
  k = 2
  mesh = jax.make_mesh((k,), ("batch",), devices=jax.devices()[:k])
  step = jmp_train.make_train_step(model.apply, _xent, None, compression=whole, mode="shard_map", mesh=mesh)
  state = step.init(params)
  rng = np.random.default_rng(1)
  for _ in range(3):
    y = rng.integers(0, 4, 16).astype(np.int32)
    x = rng.normal(size=(16, 6)).astype(np.float32) + np.eye(4, 6, dtype=np.float32)[y]
    state, metrics = step(state, step.shard_batch((x, y)))
    jax.block_until_ready(state)
  assert np.isfinite(float(metrics["loss"]))
  kernel = np.asarray(state.params["Dense_0"]["kernel"])
  np.testing.assert_array_equal(kernel, np.broadcast_to(kernel[0], kernel.shape))
  residuals = [np.asarray(r) for r in jax.tree.leaves(state.opt_state) if np.ndim(r) > 1 and np.shape(r)[0] == k]
  assert any(not np.array_equal(r[0], r[1]) for r in residuals)
  # No gradient all-reduce of its own: the compression averages.
  assert not _gradient_all_reduces(step.lower(state, step.shard_batch((x, y))).compile())


@pytest.mark.parametrize("bad", ["int8", "float17", jnp.float64])
def test_an_unsupported_reduce_dtype_names_the_valid_ones(bad):
  with pytest.raises(
    ValueError, match="grad_reduce_dtype .* is not supported; valid: None, float32, bfloat16, float16"
  ):
    jmp_train.make_train_step(_Mlp().apply, _xent, optax.sgd(0.1), mode="pmap", grad_reduce_dtype=bad)
