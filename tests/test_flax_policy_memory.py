"""Tests for jmp_train.flax: what the backward pass keeps by default (residual bytes, recomputation)."""

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

from helpers.flax_policy import BF16
from helpers.flax_policy import F32
from helpers.flax_policy import _resnet
from helpers.flax_policy import _nnx_resnet
from helpers.flax_policy import _transformer
from helpers.flax_policy import _nnx_transformer
from helpers.flax_policy import fill


# --------------------------------------------------------------------------
# Memory: what the backward pass keeps by default.
# --------------------------------------------------------------------------

MEMORY_MODELS = {
  "mlp": (
    lambda: models.MLP(features=(64, 64), num_classes=8),
    lambda: models.NNXMLP(64, (64, 64), 8, rngs=nnx.Rngs(0)),
    jax.ShapeDtypeStruct((16, 64), F32),
    {},
  ),
  "resnet": (
    _resnet,
    _nnx_resnet,
    jax.ShapeDtypeStruct((4, 8, 8, 1), F32),
    {"train": True, "mutable": ("batch_stats",)},
  ),
  "transformer": (_transformer, _nnx_transformer, jax.ShapeDtypeStruct((2, 8), jnp.int32), {}),
}


@functools.cache
def _linen_residual_bytes(name, policy, **apply_policy_kwargs):
  """Costly residual bytes (traced, nothing runs); cached: float32's serve both policies."""
  module, _, x, kwargs = MEMORY_MODELS[name]
  model = jflax.apply_policy(module(), policy, **apply_policy_kwargs)
  variables = jax.eval_shape(model.init, jax.random.key(0), jnp.zeros(x.shape, x.dtype))
  params = variables.pop("params")

  def loss(params, state, x):
    out = model.apply({"params": params, **state}, x, **kwargs)
    logits = out[0] if "mutable" in kwargs else out
    return jnp.mean(logits.astype(F32) ** 2)

  return _costly_bytes(jmp_train.diagnostics.saved_residuals(loss, params, variables, x))


def _costly_bytes(residuals):
  return sum(r.nbytes for r in residuals if r.costs_memory)


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
@pytest.mark.parametrize("name", sorted(MEMORY_MODELS))
def test_default_keeps_at_most_055_of_float32s_residual_bytes(name, policy):
  float32 = _linen_residual_bytes(name, "float32")
  assert _linen_residual_bytes(name, "float32", recompute=None) == float32
  mixed = _linen_residual_bytes(name, policy)
  assert mixed <= 0.55 * float32, (mixed, float32)
  # The control: without recomputation the half copies of the float32
  # weights, float32 regions and masks are kept.
  assert _linen_residual_bytes(name, policy, recompute=None) > mixed


def test_default_recomputes_the_half_copies_of_the_weights():
  module, _, x, _ = MEMORY_MODELS["mlp"]
  for recompute, copies in (("float32", 0), (None, 3)):
    model = jflax.apply_policy(module(), "mixed_bfloat16", recompute=recompute)
    params = jax.eval_shape(model.init, jax.random.key(0), jnp.zeros(x.shape))["params"]
    res = jmp_train.diagnostics.saved_residuals(lambda p, x: jnp.sum(model.apply({"params": p}, x)), params, x)
    kernels = [
      r for r in res if r.kind == "cast_copy" and len(r.shape_dtype.shape) == 2 and r.shape_dtype.shape != x.shape
    ]
    assert len(kernels) == copies, res
    if recompute:  # Only half-precision activations: relu's masks recomputed.
      assert {r.shape_dtype.dtype for r in res if r.costs_memory} == {BF16}, res


@pytest.mark.parametrize("name", ["mlp", "transformer"])
def test_nnx_default_keeps_at_most_055_of_float32s_residual_bytes(name):
  _, module, x, _ = MEMORY_MODELS[name]
  x = jnp.zeros(x.shape, x.dtype)

  def residual_bytes(policy, **kwargs):
    # Built abstractly (no initializer runs): the residuals are traced only.
    graphdef, params, rest = nnx.split(jflax.apply_policy(nnx.eval_shape(module), policy, **kwargs), nnx.Param, ...)

    def loss(params, x):
      return jnp.mean(nnx.merge(graphdef, params, rest)(x).astype(F32) ** 2)

    return _costly_bytes(jmp_train.diagnostics.saved_residuals(loss, params, x))

  float32 = residual_bytes("float32")
  assert residual_bytes("mixed_bfloat16") <= 0.55 * float32
  assert residual_bytes("mixed_bfloat16", recompute=None) > 0.55 * float32


@pytest.mark.parametrize("name, policy", [("mlp", "mixed_bfloat16"), ("resnet", "mixed_float16")])
def test_recompute_gradients_match(name, policy):
  module, _, x, kwargs = MEMORY_MODELS[name]
  x = jnp.linspace(-1.0, 1.0, int(np.prod(x.shape)), dtype=F32).reshape(x.shape)
  grads = {}
  for recompute in ("float32", None):
    model = jflax.apply_policy(module(), policy, recompute=recompute)
    variables = fill(jax.eval_shape(model.init, jax.random.key(0), x))

    def loss(params):
      out = model.apply({**variables, "params": params}, x, **kwargs)
      logits = out[0] if "mutable" in kwargs else out
      return jnp.mean(logits.astype(F32) ** 2)

    grads[recompute] = jax.jit(jax.grad(loss))(variables["params"])
  chex.assert_trees_all_equal_dtypes(grads["float32"], grads[None])
  # The recomputation repeats the forward ops, but XLA may keep a half
  # intermediate in float32 in one program and not the other: rounding-level
  # differences, amplified by the normalizations' backward pass.
  for a, b in zip(jax.tree.leaves(grads["float32"]), jax.tree.leaves(grads[None])):
    scale = float(jnp.max(jnp.abs(b)))
    np.testing.assert_allclose(a, b, rtol=0, atol=0.05 * scale + 1e-6)


def test_saved_residuals_needs_a_function():
  with pytest.raises(ValueError, match="saved_residuals needs a callable"):
    jmp_train.diagnostics.saved_residuals(5, jnp.ones(2))


def test_recompute_is_checked():
  with pytest.raises(ValueError, match="recompute must be one of"):
    jflax.apply_policy(nn.Dense(4), "mixed_bfloat16", recompute="all")
  with pytest.raises(ValueError, match="recompute must be one of"):
    jflax.apply_policy(nnx.Linear(2, 2, rngs=nnx.Rngs(0)), "mixed_bfloat16", recompute=True)
