"""Tests for jmp_train_examples.models (linen example models and NNX twins)."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jmp_train_examples import models

F32 = np.dtype(jnp.float32)


def fill(shapes, seed=0):
  """Deterministic float32 values for abstract variables, made with NumPy.

  (JAX's random initializers take seconds to compile on a loaded CPU.)
  """
  rng = np.random.default_rng(seed)

  def leaf(path, s):
    # Cast in NumPy: a cast by JAX compiles one kernel per shape.
    return jnp.asarray(np.asarray(value(path[-1].key, s.shape), s.dtype))

  def value(name, shape):
    if name == "var":
      return np.ones(shape)
    if name in ("mean", "bias"):
      return 0.1 * rng.standard_normal(shape)
    if name == "scale":
      return 1.0 + 0.1 * rng.standard_normal(shape)
    fan_in = int(np.prod(shape[:-1])) if name == "kernel" else 1
    return rng.standard_normal(shape) / np.sqrt(fan_in)

  return jax.tree_util.tree_map_with_path(leaf, shapes)


def _nnx_trees(model):
  out = {"params": nnx.to_pure_dict(nnx.state(model, nnx.Param))}
  stats = nnx.to_pure_dict(nnx.state(model, nnx.BatchStat))
  if stats:
    out["batch_stats"] = stats
  return out


X = jnp.linspace(0.0, 1.0, 4 * 64, dtype=jnp.float32).reshape(4, 64)
TOKENS = jnp.asarray((np.arange(2 * 16).reshape(2, 16) * 7) % 256, jnp.int32)

# Default constructors: what the demo and the benchmarks use.
TWINS = {
  "mlp": (models.MLP, models.NNXMLP, X),
  "resnet": (models.ResNet, models.NNXResNet, X),
  "transformer": (models.TransformerBlock, models.NNXTransformerBlock, TOKENS),
}


@pytest.mark.parametrize("name", sorted(TWINS))
def test_twins_have_the_same_variables(name):
  make, make_nnx, x = TWINS[name]
  linen_shapes = jax.eval_shape(make().init, jax.random.key(0), x)
  nnx_model = nnx.eval_shape(lambda: make_nnx(rngs=nnx.Rngs(0)))
  chex.assert_trees_all_equal_shapes_and_dtypes(dict(linen_shapes), _nnx_trees(nnx_model))
  if name == "resnet":
    assert set(linen_shapes) == {"params", "batch_stats"}
    assert {"stem", "stem_bn", "block0", "block1", "head"} <= set(linen_shapes["params"])
  out = jax.eval_shape(make().apply, linen_shapes, x)
  expected = (2, 16, 256) if name == "transformer" else (4, 10)
  assert out.shape == expected and out.dtype == F32


def test_default_sizes_are_tensor_core_friendly():
  # Every GEMM of the default Transformer has K and N multiples of 8.
  shapes = jax.eval_shape(models.TransformerBlock().init, jax.random.key(0), TOKENS)["params"]
  kernels = 0
  for path, leaf in jax.tree_util.tree_leaves_with_path(shapes):
    names = [p.key for p in path]
    if names[-1] not in ("kernel", "embedding"):
      continue
    kernels += 1
    split = 2 if names[-2] == "out" else 1  # attention out: [heads, dim, d]
    k, n = np.prod(leaf.shape[:split]), np.prod(leaf.shape[split:])
    assert k % 8 == 0 and n % 8 == 0, (names, leaf.shape)
  assert kernels == 9


@pytest.fixture(scope="module")
def small():
  """Small twins with the same (NumPy-made) variables."""
  mlp = models.MLP(features=(16, 16), num_classes=8, dropout_rate=0.5)
  lm = models.TransformerBlock(vocab_size=32, d_model=16, num_heads=2, mlp_dim=32, max_len=16)
  tokens = TOKENS % 32
  mlp_vars = fill(jax.eval_shape(mlp.init, jax.random.key(0), X))
  lm_vars = fill(jax.eval_shape(lm.init, jax.random.key(0), tokens))
  nnx_mlp = models.nnx_with_linen_variables(
    nnx.eval_shape(lambda: models.NNXMLP(64, (16, 16), 8, 0.5, rngs=nnx.Rngs(0))),
    mlp_vars,
  )
  # Built abstractly: give the dropout layer a concrete rng stream.
  nnx_mlp.dropout.rngs = nnx.Rngs(dropout=1).dropout.fork()
  nnx_lm = models.nnx_with_linen_variables(
    nnx.eval_shape(lambda: models.NNXTransformerBlock(32, 16, 2, 32, 1, 16, rngs=nnx.Rngs(0))),
    lm_vars,
  )
  return dict(
    mlp=mlp,
    lm=lm,
    tokens=tokens,
    mlp_vars=mlp_vars,
    lm_vars=lm_vars,
    nnx_mlp=nnx_mlp,
    nnx_lm=nnx_lm,
  )


def test_twins_compute_the_same_function_causally_with_dropout(small):
  tokens = small["tokens"]
  changed = tokens.at[:, -1].set((tokens[:, -1] + 1) % 32)
  mlp_def, mlp_state = nnx.split(small["nnx_mlp"])
  lm_def, lm_state = nnx.split(small["nnx_lm"])
  mlp, lm = small["mlp"], small["lm"]

  @jax.jit  # one compilation for everything
  def run(mlp_vars, lm_vars, mlp_state, lm_state, key):
    nnx_mlp = nnx.merge(mlp_def, mlp_state)
    return dict(
      mlp=mlp.apply(mlp_vars, X),
      nnx_mlp=nnx_mlp(X),
      mlp_train=mlp.apply(mlp_vars, X, train=True, rngs={"dropout": key}),
      nnx_mlp_train=nnx_mlp(X, train=True),
      lm=lm.apply(lm_vars, jnp.concatenate([tokens, changed])),
      nnx_lm=nnx.merge(lm_def, lm_state)(tokens),
    )

  out = run(small["mlp_vars"], small["lm_vars"], mlp_state, lm_state, jax.random.key(0))
  out["lm"], out["lm_changed"] = np.split(np.asarray(out["lm"]), 2)
  np.testing.assert_allclose(out["mlp"], out["nnx_mlp"], rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(out["lm"], out["nnx_lm"], rtol=1e-5, atol=1e-5)
  assert np.std(out["lm"]) > 0.1 and np.std(out["mlp"]) > 0.1
  # Causal: changing the last token changes only the last position's logits.
  np.testing.assert_array_equal(out["lm_changed"][:, :-1], out["lm"][:, :-1])
  assert not np.allclose(out["lm_changed"][:, -1], out["lm"][:, -1])
  # Dropout only in training, linen and NNX (which keeps an rng stream).
  assert not np.allclose(out["mlp_train"], out["mlp"])
  assert not np.allclose(out["nnx_mlp_train"], out["mlp"])


def test_block_and_layer_twins_compute_the_same_function():
  # The building blocks on their own: a strided ResNet block (with its
  # projection shortcut; batch statistics updated in training) and a decoder
  # layer under a causal mask. Inputs made with NumPy: no eager compiles.
  block = models.ResNetBlock(features=16, strides=2)
  layer = models.TransformerLayer(d_model=16, num_heads=2, mlp_dim=32)
  rng = np.random.default_rng(0)
  images = rng.standard_normal((4, 4, 4, 8)).astype(np.float32)
  seq = rng.standard_normal((2, 8, 16)).astype(np.float32)
  changed = seq.copy()
  changed[:, -1] = -changed[:, -1]  # the same sequences, last position changed
  seq = np.concatenate([seq, changed])
  mask = np.tril(np.ones((8, 8), bool))[None, None]  # causal, [1, 1, q, kv]
  block_vars = fill(jax.eval_shape(block.init, jax.random.key(0), images))
  layer_vars = fill(jax.eval_shape(layer.init, jax.random.key(0), seq, mask), seed=1)
  assert {"proj", "proj_bn"} <= set(block_vars["params"])
  nnx_block = nnx.eval_shape(lambda: models.NNXResNetBlock(8, 16, 2, rngs=nnx.Rngs(0)))
  nnx_layer = nnx.eval_shape(lambda: models.NNXTransformerLayer(16, 2, 32, rngs=nnx.Rngs(0)))
  chex.assert_trees_all_equal_shapes_and_dtypes(dict(block_vars), _nnx_trees(nnx_block))
  chex.assert_trees_all_equal_shapes_and_dtypes(dict(layer_vars), _nnx_trees(nnx_layer))
  block_def, block_state = nnx.split(models.nnx_with_linen_variables(nnx_block, block_vars))
  layer_def, layer_state = nnx.split(models.nnx_with_linen_variables(nnx_layer, layer_vars))

  @jax.jit  # one compilation for everything
  def run(block_vars, layer_vars, block_state, layer_state):
    nnx_block = nnx.merge(block_def, block_state)
    nnx_layer = nnx.merge(layer_def, layer_state)
    train, updates = block.apply(block_vars, images, train=True, mutable=["batch_stats"])
    return dict(
      block=block.apply(block_vars, images),
      nnx_block=nnx_block(images),
      block_train=train,
      nnx_block_train=nnx_block(images, train=True),
      stats=updates["batch_stats"],
      nnx_stats=nnx.to_pure_dict(nnx.state(nnx_block, nnx.BatchStat)),
      layer=layer.apply(layer_vars, seq, mask),
      nnx_layer=nnx_layer(seq, mask),
    )

  out = jax.device_get(run(block_vars, layer_vars, block_state, layer_state))
  assert out["block"].shape == (4, 2, 2, 16) and out["layer"].shape == (4, 8, 16)
  for name in ("block", "block_train", "layer"):
    assert out[name].shape == out["nnx_" + name].shape
    assert np.std(out[name]) > 0.1, name
    np.testing.assert_allclose(out[name], out["nnx_" + name], rtol=1e-5, atol=1e-5)
  chex.assert_trees_all_close(out["stats"], out["nnx_stats"], rtol=1e-5, atol=1e-5)
  initial = np.asarray(block_vars["batch_stats"]["bn1"]["mean"])
  assert not np.allclose(out["stats"]["bn1"]["mean"], initial)
  # Causal: changing the last position changes only the last output.
  same, moved = np.split(out["layer"], 2)
  np.testing.assert_array_equal(moved[:, :-1], same[:, :-1])
  assert not np.allclose(moved[:, -1], same[:, -1])


def test_resnet_accepts_images_and_flat_square_images():
  model = models.ResNet(num_classes=8, stage_features=(8, 16))
  shapes = jax.eval_shape(model.init, jax.random.key(0), X)
  flat = jax.eval_shape(model.apply, shapes, X)
  images = jax.eval_shape(model.apply, shapes, X.reshape(4, 8, 8, 1))
  assert flat.shape == images.shape == (4, 8)
  with pytest.raises(ValueError, match=r"flat square images.*\(4, 63\)"):
    jax.eval_shape(model.apply, shapes, X[:, :63])


def test_errors():
  lm = models.TransformerBlock(max_len=8)
  with pytest.raises(ValueError, match="16 exceeds max_len=8"):
    jax.eval_shape(lm.init, jax.random.key(0), TOKENS)
  nnx_lm = nnx.eval_shape(lambda: models.NNXTransformerBlock(max_len=8, rngs=nnx.Rngs(0)))
  with pytest.raises(ValueError, match="16 exceeds max_len=8"):
    jax.eval_shape(lambda t: nnx_lm(t), TOKENS)
  mlp = nnx.eval_shape(lambda: models.NNXMLP(rngs=nnx.Rngs(0)))
  with pytest.raises(ValueError, match=r"collections \['cache'\].*batch_stats"):
    models.nnx_with_linen_variables(mlp, {"cache": {}})
  with pytest.raises(ValueError, match="not available"):
    models.nnx_with_linen_variables(mlp, {"params": {"nope": {"kernel": X}}})
