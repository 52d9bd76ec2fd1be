"""Tests for jmp_train.flax: parameter, batch-statistic, output and gradient dtypes.

Linen and NNX agree under jit, pmap and strict promotion.
"""

from __future__ import annotations

import functools

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jmp_train
import jmp_train.flax as jflax
from jmp_train_examples import models

from helpers.flax_policy import F16
from helpers.flax_policy import BF16
from helpers.flax_policy import F32
from helpers.flax_policy import MATMULS
from helpers.flax_policy import X_IMG
from helpers.flax_policy import TOKENS
from helpers.flax_policy import _resnet
from helpers.flax_policy import _nnx_resnet
from helpers.flax_policy import _transformer
from helpers.flax_policy import fill
from helpers.flax_policy import make_linen_variables
from helpers.flax_policy import nnx_twin
from helpers.flax_policy import _operand_dtypes
from helpers.flax_policy import _forward_and_grad_jaxprs


@pytest.fixture(scope="module")
def linen_variables():
  return make_linen_variables()


# --------------------------------------------------------------------------
# Parameter, batch-statistic, output and gradient dtypes.
# --------------------------------------------------------------------------


def _dtypes(tree):
  return {np.dtype(x.dtype) for x in jax.tree.leaves(tree)}


@pytest.mark.parametrize(
  "spec, param, output",
  [("mixed_float16", F32, F32), ("p=bf16,c=bf16,o=bf16", BF16, BF16), ("p=f32,c=f16,o=f16", F32, F16)],
)
def test_linen_param_batch_stats_output_and_grad_dtypes(spec, param, output):
  model = jflax.apply_policy(_resnet(), spec)
  variables = jax.eval_shape(model.init, jax.random.key(0), X_IMG)
  assert _dtypes(variables["params"]) == {param}
  assert _dtypes(variables["batch_stats"]) == {F32}
  out, updates = jax.eval_shape(
    functools.partial(model.apply, train=True, mutable=["batch_stats"]),
    variables,
    X_IMG,
  )
  assert out.dtype == output
  assert _dtypes(updates["batch_stats"]) == {F32}

  def loss(p, stats):
    y = model.apply({"params": p, "batch_stats": stats}, X_IMG)
    return jnp.sum(y.astype(F32))

  grads = jax.eval_shape(jax.grad(loss), variables["params"], variables["batch_stats"])
  chex.assert_trees_all_equal_shapes_and_dtypes(grads, variables["params"])


@pytest.mark.parametrize(
  "spec, param, output",
  [("mixed_bfloat16", F32, F32), ("p=f16,c=f16,o=f32", F16, F32)],
)
def test_nnx_param_batch_stats_output_and_grad_dtypes(spec, param, output):
  original = nnx.eval_shape(_nnx_resnet)
  model = jflax.apply_policy(original, spec)
  assert _dtypes(nnx.state(model, nnx.Param)) == {param}
  assert _dtypes(nnx.state(model, nnx.BatchStat)) == {F32}
  # The caller's module is not changed.
  assert _dtypes(nnx.state(original, nnx.Param)) == {F32}
  assert original.stem.dtype is None and original.head.dtype is None
  assert model.module.stem.dtype == model.policy.compute_dtype
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)

  def forward(p, r):
    return nnx.merge(graphdef, p, r)(X_IMG)

  assert jax.eval_shape(forward, params, rest).dtype == output
  loss = lambda p, r: jnp.sum(forward(p, r).astype(F32))
  grads = jax.eval_shape(jax.grad(loss), params, rest)
  chex.assert_trees_all_equal_shapes_and_dtypes(grads, params)


def test_linen_lifted_transforms_and_nested_setup_modules():
  # Layers inside nn.remat and inside setup-defined submodules get the policy.
  class Model(nn.Module):
    def setup(self):
      self.block = nn.remat(models.ResNetBlock)(8)
      self.head = nn.Dense(8)

    def __call__(self, x):
      return self.head(jnp.mean(self.block(x), axis=(1, 2)))

  model = jflax.apply_policy(Model(), "mixed_bfloat16")
  x = X_IMG.reshape(4, 8, 8, 1)
  variables = jax.eval_shape(model.init, jax.random.key(0), x)
  assert _dtypes(variables["params"]) == {F32}

  def loss(p, stats):
    return jnp.sum(model.apply({"params": p, "batch_stats": stats}, x))

  grad = jax.make_jaxpr(jax.grad(loss))(variables["params"], variables["batch_stats"])
  counts = _operand_dtypes(grad, MATMULS)
  assert counts and set(counts) <= {("conv_general_dilated", (BF16, BF16)), ("dot_general", (BF16, BF16))}


def test_linen_wrapper_keeps_variable_tree(linen_variables):
  wrapped = jflax.apply_policy(_transformer(), "mixed_bfloat16")
  shapes = jax.eval_shape(wrapped.init, jax.random.key(0), TOKENS)
  chex.assert_trees_all_equal_shapes_and_dtypes(shapes, linen_variables["transformer"])


def test_integer_inputs_pass_through():
  seen = []

  class Probe(nn.Module):
    @nn.compact
    def __call__(self, x, ids):
      seen.append((x.dtype, ids.dtype))
      return nn.Dense(8)(x) + ids[:, None]

  model = jflax.apply_policy(Probe(), "mixed_float16")
  ids = jnp.arange(2, dtype=jnp.int32)
  out, _ = jax.eval_shape(model.init_with_output, jax.random.key(0), X_IMG[:2], ids)
  assert seen[-1] == (F16, np.dtype(jnp.int32))
  assert out.dtype == F32
  seen.clear()
  model = jflax.apply_policy(Probe(), "mixed_float16", cast_inputs=False)
  jax.eval_shape(model.init, jax.random.key(0), X_IMG[:2], ids)
  assert seen[-1] == (F32, np.dtype(jnp.int32))


# --------------------------------------------------------------------------
# Linen and NNX agree; jit, pmap, strict dtype promotion.
# --------------------------------------------------------------------------


def test_linen_and_nnx_give_the_same_outputs_and_batch_stats(linen_variables):
  # Transformer (bfloat16, evaluation) and ResNet (float16, training, batch
  # statistics updated), linen and NNX with the same variables, one jit.
  lm_vars, cnn_vars = linen_variables["transformer"], linen_variables["resnet"]
  linen_lm = jflax.apply_policy(_transformer(), "mixed_bfloat16")
  linen_cnn = jflax.apply_policy(_resnet(), "mixed_float16")
  lm_def, lm_state = nnx.split(jflax.apply_policy(nnx_twin("transformer", lm_vars), "mixed_bfloat16"))
  cnn_def, cnn_state = nnx.split(jflax.apply_policy(nnx_twin("resnet", cnn_vars), "mixed_float16"))

  @jax.jit
  def run(lm_vars, cnn_vars, lm_state, cnn_state):
    nnx_cnn = nnx.merge(cnn_def, cnn_state)
    cnn_out, updates = linen_cnn.apply(cnn_vars, X_IMG, train=True, mutable=["batch_stats"])
    return dict(
      lm=linen_lm.apply(lm_vars, TOKENS),
      nnx_lm=nnx.merge(lm_def, lm_state)(TOKENS),
      cnn=cnn_out,
      nnx_cnn=nnx_cnn(X_IMG, train=True),
      stats=updates["batch_stats"],
      nnx_stats=nnx.to_pure_dict(nnx.state(nnx_cnn.module, nnx.BatchStat)),
    )

  out = run(lm_vars, cnn_vars, lm_state, cnn_state)
  for name in ("lm", "cnn"):
    assert out[name].dtype == out["nnx_" + name].dtype == F32
    assert np.all(np.isfinite(out[name])) and np.std(out[name]) > 0.1
    np.testing.assert_allclose(out[name], out["nnx_" + name], rtol=1e-6, atol=1e-6)
  chex.assert_trees_all_close(out["stats"], out["nnx_stats"], rtol=1e-6, atol=1e-6)
  assert _dtypes(out["stats"]) == {F32}
  # The statistics moved away from their initial values.
  assert not np.allclose(out["stats"]["stem_bn"]["mean"], cnn_vars["batch_stats"]["stem_bn"]["mean"])


@pytest.mark.parametrize("style", ["linen", "nnx"])
@pytest.mark.parametrize("name", ["resnet", "transformer"])
def test_strict_dtype_promotion(style, name, linen_variables):
  with jax.numpy_dtype_promotion("strict"):
    fwd, grad = _forward_and_grad_jaxprs(style, name, "mixed_bfloat16", linen_variables[name])
  assert fwd.out_avals[0].dtype == F32
  assert _dtypes(grad.out_avals) == {F32}


class _TinyMLP(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = nn.relu(nn.GroupNorm(num_groups=2)(nn.Dense(16)(x)))
    return nn.Dense(8)(nn.Dropout(0.5, deterministic=True)(x))


_tiny_reference = jax.jit(_TinyMLP().apply)


@pytest.mark.parametrize(
  "mode, half",
  [("eager", BF16), ("jit", F16), ("jit", BF16), ("pmap", F16)],
  ids=str,
)
def test_execution_modes(mode, half):
  model = jflax.apply_policy(_TinyMLP(), jmp_train.Policy(F32, half, F32))
  x = jnp.linspace(-1.0, 1.0, 8 * 16, dtype=F32).reshape(8, 16)
  variables = fill(jax.eval_shape(model.init, jax.random.key(0), x))
  reference = _tiny_reference(variables, x)
  if mode == "pmap":
    # Two replicas: the dtypes do not depend on how many (fewer compile faster).
    n = 2
    replicated = jax.tree.map(lambda a: jnp.broadcast_to(a, (n, *a.shape)), variables)
    out = jax.pmap(model.apply, devices=jax.devices()[:n])(replicated, x.reshape(n, -1, 16)).reshape(8, 8)
  elif mode == "jit":
    out = jax.jit(model.apply)(variables, x)
  else:
    out = model.apply(variables, x)
  assert out.dtype == F32
  scale = float(jnp.max(jnp.abs(reference)))
  # Half-precision rounding: measured below 1 eps of the largest output.
  atol = 4 * float(jnp.finfo(half).eps) * scale
  np.testing.assert_allclose(out, reference, atol=atol)
  assert not np.array_equal(np.asarray(out), np.asarray(reference))
