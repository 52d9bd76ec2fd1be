"""Tests for jmp_train.half_precision_saveable (a jax.checkpoint policy)."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jmp_train
import jmp_train.flax as jflax
from jmp_train.diagnostics import SavedResidual
from jmp_train.diagnostics import saved_residuals
from jmp_train_examples import models

from helpers.flax_policy import fill

F16, BF16, F32 = np.dtype(jnp.float16), np.dtype(jnp.bfloat16), np.dtype(jnp.float32)
HALF = [F16, BF16]

residuals = saved_residuals


def _saved(res):
  """(shape, dtype) of the residuals that cost memory."""
  return [(r.shape_dtype.shape, np.dtype(r.shape_dtype.dtype)) for r in res if r.costs_memory]


def _block(w1, w2, scale, x, dtype):
  """Half matmuls around a float32 normalization, a relu and a float32 loss."""
  h = x.astype(dtype) @ w1.astype(dtype)
  h32 = h.astype(jnp.float32)
  h32 = (h32 - h32.mean(-1, keepdims=True)) * jax.lax.rsqrt(h32.var(-1, keepdims=True) + 1e-5) * scale
  h = jax.nn.relu(h32.astype(dtype))
  out = (h @ w2.astype(dtype)).astype(jnp.float32)
  return jnp.mean(jax.nn.logsumexp(out, axis=-1))


def _args(seed=0):
  rng = np.random.default_rng(seed)
  return (
    jnp.asarray(rng.normal(0, 0.3, (16, 32)), jnp.float32),
    jnp.asarray(rng.normal(0, 0.3, (32, 8)), jnp.float32),
    jnp.asarray(rng.uniform(0.5, 1.5, (32,)), jnp.float32),
    jnp.asarray(rng.normal(0, 1.0, (4, 16)), jnp.float32),
  )


@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_only_half_precision_values_are_saved(dtype):
  f = lambda w1, w2, s, x: _block(w1, w2, s, x, dtype)
  default = _saved(residuals(f, *_args()))
  # Without the policy JAX keeps float32 normalization values, the half
  # copies of the float32 weights and relu's boolean mask.
  assert any(d == F32 for _, d in default)
  assert any(d == np.dtype(bool) for _, d in default)
  assert ((16, 32), dtype) in default  # the cast copy of w1
  saved = _saved(residuals(jax.checkpoint(f, policy=jmp_train.half_precision_saveable), *_args()))
  assert saved, "the matmul outputs should be saved"
  assert all(d == dtype for _, d in saved), saved
  # No weight-shaped copy: the casts are recomputed from the arguments.
  assert all(shape[0] == 4 for shape, _ in saved), saved
  assert sum(np.prod(s) * d.itemsize for s, d in saved) < sum(np.prod(s) * d.itemsize for s, d in default)


def test_float32_function_saves_nothing_it_computed():
  f = jax.checkpoint(lambda w1, w2, s, x: _block(w1, w2, s, x, F32), policy=jmp_train.half_precision_saveable)
  assert _saved(residuals(f, *_args())) == []


@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_gradients_equal_those_without_remat(dtype):
  # Eagerly every operation rounds to its dtype, so the recomputed forward
  # values are the saved ones and the gradients agree bit for bit.
  f = lambda w1, w2, s, x: _block(w1, w2, s, x, dtype)
  g = jax.grad(f, argnums=(0, 1, 2))(*_args())
  g_remat = jax.grad(jax.checkpoint(f, policy=jmp_train.half_precision_saveable), argnums=(0, 1, 2))(*_args())
  for a, b in zip(g, g_remat):
    assert a.dtype == b.dtype == F32
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_jitted_gradients_as_accurate_as_without_remat(dtype):
  # Under jit XLA may keep half-precision intermediates in float32 ("excess
  # precision") differently in the two programs, so compare both with the
  # float32 gradients instead of with each other.
  f = lambda w1, w2, s, x: _block(w1, w2, s, x, dtype)
  ref = jax.grad(lambda *a: _block(*a, F32), argnums=(0, 1, 2))(*_args())
  g = jax.jit(jax.grad(f, argnums=(0, 1, 2)))(*_args())
  g_remat = jax.jit(jax.grad(jax.checkpoint(f, policy=jmp_train.half_precision_saveable), argnums=(0, 1, 2)))(*_args())
  eps = float(jnp.finfo(dtype).eps)
  for r, a, b in zip(ref, g, g_remat):
    scale = float(jnp.max(jnp.abs(r)))
    err_default = float(jnp.max(jnp.abs(a - r)))
    err_remat = float(jnp.max(jnp.abs(b - r)))
    assert err_remat <= 2 * err_default + 4 * eps * scale, (err_remat, err_default)


def test_policy_on_primitives():
  aval = lambda dtype: jax.core.ShapedArray((2, 2), dtype)
  p = jmp_train.half_precision_saveable
  assert p(jax.lax.add_p, aval(F16), aval(F16))
  assert p(jax.lax.add_p, aval(BF16), aval(BF16))
  assert not p(jax.lax.add_p, aval(F32), aval(F32))
  assert not p(jax.lax.gt_p, aval(F16), aval(F16))  # boolean output
  assert not p(jax.lax.convert_element_type_p, aval(F32), new_dtype=F16, weak_type=False, sharding=None)


def _linen_case(name):
  if name == "resnet":
    # One block: eager gradients cost a compilation per operation.
    module = models.ResNet(num_classes=8, stage_features=(8,))
    x = jnp.linspace(0.0, 1.0, 2 * 8 * 8 * 3, dtype=jnp.float32).reshape(2, 8, 8, 3)
    return module, x, {"train": True, "mutable": ["batch_stats"]}
  # Equal widths: the eager operations share their compiled programs.
  module = models.TransformerBlock(vocab_size=32, d_model=32, num_heads=4, mlp_dim=32, max_len=8)
  x = (jnp.arange(16, dtype=jnp.int32).reshape(2, 8) * 7) % 32
  return module, x, {}


# One half dtype per model: the eager gradients take seconds per case.
@pytest.mark.parametrize(
  "name,dtype", [("resnet", F16), ("transformer", BF16)], ids=["resnet-float16", "transformer-bfloat16"]
)
def test_linen_policy_models_save_half_and_keep_gradients(name, dtype):
  module, x, kwargs = _linen_case(name)
  model = jflax.apply_policy(module, jmp_train.Policy(F32, dtype, F32))
  variables = fill(jax.eval_shape(model.init, jax.random.key(0), x))
  params = variables["params"]
  state = {k: v for k, v in variables.items() if k != "params"}

  def loss(params, x):
    out = model.apply({"params": params, **state}, x, **kwargs)
    out = out[0] if kwargs else out
    return jnp.mean(jnp.square(out.astype(jnp.float32)))

  remat_loss = jax.checkpoint(loss, policy=jmp_train.half_precision_saveable)
  default = _saved(residuals(loss, params, x))
  saved = _saved(residuals(remat_loss, params, x))
  assert any(d == F32 for _, d in default)  # the float32 regions
  assert saved and all(d == dtype for _, d in saved), saved
  nbytes = lambda rs: sum(np.prod(s) * d.itemsize for s, d in rs)
  assert nbytes(saved) < nbytes(default)
  # Eagerly (see test_gradients_equal_those_without_remat): bit for bit.
  g = jax.grad(loss)(params, x)
  g_remat = jax.grad(remat_loss)(params, x)
  for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(g_remat)):
    np.testing.assert_array_equal(a, b)


def test_linen_remat_of_a_submodule_under_apply_policy():
  # nn.remat(Module, policy=...) inside a policy-wrapped model: the
  # interceptor still sets the dtypes inside the lifted remat, and only the
  # remat'd part keeps half-precision values alone.
  class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
      block = nn.remat(models.MLP, policy=jmp_train.half_precision_saveable)
      h = block(features=(32, 32), num_classes=16, name="block")(x)
      return nn.LayerNorm(name="norm")(h)

  model = jflax.apply_policy(Net(), "mixed_float16")
  x = jnp.linspace(-1.0, 1.0, 4 * 16, dtype=jnp.float32).reshape(4, 16)
  params = fill(jax.eval_shape(model.init, jax.random.key(0), x))["params"]
  loss = lambda p, x: jnp.mean(model.apply({"params": p}, x).astype(jnp.float32) ** 2)
  saved = _saved(residuals(loss, params, x))
  block_width = [(s, d) for s, d in saved if s == (4, 32)]
  assert block_width and all(d == F16 for _, d in block_width)  # in the remat
  assert any(d == F32 for _, d in saved)  # the LayerNorm outside it
  # No weight-shaped half copy inside the remat'd block.
  assert not any(s in ((16, 32), (32, 32), (32, 16)) and d == F16 for s, d in saved)
  grads = jax.jit(jax.grad(loss))(params, x)
  assert {np.dtype(g.dtype) for g in jax.tree.leaves(grads)} == {F32}


def test_nnx_remat_with_the_policy():
  model = jflax.apply_policy(models.NNXMLP(16, (32, 32), 8, rngs=nnx.Rngs(0)), "mixed_bfloat16")
  x = jnp.linspace(-1.0, 1.0, 4 * 16, dtype=jnp.float32).reshape(4, 16)

  def loss(m, x):
    return jnp.mean(jnp.square(m(x)))

  remat_loss = nnx.remat(loss, policy=jmp_train.half_precision_saveable)
  g = nnx.grad(loss)(model, x)
  g_remat = nnx.grad(remat_loss)(model, x)
  leaves = jax.tree.leaves(nnx.state(g, nnx.Param))
  leaves_remat = jax.tree.leaves(nnx.state(g_remat, nnx.Param))
  assert leaves and len(leaves) == len(leaves_remat)
  for a, b in zip(leaves, leaves_remat):
    np.testing.assert_array_equal(a, b)


# One device and the data-parallel shard_map step: the remat policy wraps the
# per-replica function alike under pmap (pmap steps are tested in test_train.py).
@pytest.mark.parametrize("mode", ["single", "shard_map"])
def test_make_train_step_with_remat_policy(mode):
  module = models.ResNet(num_classes=8, stage_features=(8,))  # convolutions + BatchNorm
  model = jflax.apply_policy(module, "mixed_float16")
  n = 1 if mode == "single" else jax.device_count()
  x = jnp.linspace(0.0, 1.0, 2 * n * 8 * 8 * 3, dtype=jnp.float32).reshape(2 * n, 8, 8, 3)
  y = jnp.arange(2 * n, dtype=jnp.int32) % 8
  variables = fill(jax.eval_shape(module.init, jax.random.key(0), x[:1]))
  loss_fn = lambda out, y: optax.softmax_cross_entropy_with_integer_labels(out, y).mean()
  runs = []
  for remat_policy in (None, jmp_train.half_precision_saveable):
    step = jmp_train.make_train_step(
      model.apply,
      loss_fn,
      optax.sgd(0.1),
      policy="mixed_float16",
      loss_scale=jmp_train.DynamicLossScale(2.0**10),
      cast_params=False,
      mode=mode,
      remat_policy=remat_policy,
      eval_apply_fn=lambda v, x: model.apply(v, x, train=False),
    )
    state = step.init(variables["params"], model_state={"batch_stats": variables["batch_stats"]})
    losses = []
    for _ in range(3):
      state, metrics = step(state, (x, y) if mode == "single" else step.shard_batch((x, y)))
      losses.append(float(np.asarray(metrics["loss"]).reshape(-1)[0]))
    runs.append((losses, step.unreplicate(state.params)))
  np.testing.assert_allclose(runs[0][0], runs[1][0], rtol=1e-5)
  for a, b in zip(jax.tree.leaves(runs[0][1]), jax.tree.leaves(runs[1][1])):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


# --------------------------------------------------------------------------
# saved_residuals
# --------------------------------------------------------------------------


def test_residuals_are_classified():
  def f(w, x):
    h = jnp.tanh(x @ w.astype(jnp.bfloat16))
    return jnp.sum(jax.nn.relu(h).astype(jnp.float32) ** 2)

  w = jax.ShapeDtypeStruct((4, 8), jnp.float32)
  x = jax.ShapeDtypeStruct((2, 4), jnp.bfloat16)
  res = saved_residuals(f, w, x)
  by_kind: dict[str, list] = {}
  for r in res:
    by_kind.setdefault(r.kind, []).append(r.shape_dtype)
  # x is kept as is; w's bfloat16 copy is what the backward matmul reads.
  assert by_kind["argument"] == [x]
  assert by_kind["cast_copy"] == [jax.ShapeDtypeStruct((4, 8), jnp.bfloat16)]
  # relu's derivative selects against broadcast zeros: not real memory.
  assert all(s.shape == (2, 8) for s in by_kind["constant"])
  assert by_kind["activation"]
  assert all(s.shape == (2, 8) for s in by_kind["activation"])
  assert {s.dtype for s in by_kind["activation"]} <= {jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32), jnp.dtype(bool)}


def test_residuals_of_a_remat_function_are_only_its_inputs():
  f = jax.checkpoint(lambda w, x: jnp.sum(jnp.sin(x @ w) ** 2), policy=jax.checkpoint_policies.nothing_saveable)
  w = jax.ShapeDtypeStruct((4, 8), jnp.float32)
  x = jax.ShapeDtypeStruct((2, 4), jnp.float32)
  res = saved_residuals(f, w, x)
  assert sorted(r.kind for r in res) == ["argument", "argument"]


def test_saved_residual_bytes():
  res = saved_residuals(
    lambda w, x: jnp.sum(jnp.tanh(x @ w.astype(jnp.float16)).astype(jnp.float32)),
    jnp.ones((3, 5)),
    jnp.ones((4, 3), jnp.float16),
  )
  assert all(isinstance(r, SavedResidual) for r in res)
  by_kind = {r.kind: r for r in res}
  assert by_kind["cast_copy"].nbytes == 3 * 5 * 2
  assert by_kind["argument"].nbytes == 4 * 3 * 2
  assert by_kind["cast_copy"].costs_memory and not by_kind["argument"].costs_memory
