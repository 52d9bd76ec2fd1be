"""Tests for jmp_train.flax: embedding lookups under a policy, linen and NNX.

The gradient of a lookup is a scatter-add of one cotangent row per token:
under a half-precision policy it must be accumulated in float32, while the
forward values and the tied head (``attend``) stay those of the compute
dtype.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jmp_train.flax as jflax

from helpers.flax_policy import F16
from helpers.flax_policy import BF16
from helpers.flax_policy import F32
from helpers.flax_policy import _operand_dtypes

VOCAB, FEATURES, TOKENS = 16, 8, 8192
IDS = (jnp.arange(TOKENS, dtype=jnp.int32) * 7 % VOCAB).reshape(4, -1)
# Same-signed cotangents, as the rows of a frequent token get: a half-precision
# running sum of 512 of them keeps few of their bits.
COTANGENT = (0.5 + jax.random.uniform(jax.random.key(1), IDS.shape + (FEATURES,))) / TOKENS


def _linen_embed_grad(spec, dtype=None):
  embed = nn.Embed(VOCAB, FEATURES, dtype=dtype)
  model = embed if spec is None else jflax.apply_policy(embed, spec)
  params = nn.Embed(VOCAB, FEATURES).init(jax.random.key(0), IDS)["params"]
  if spec is not None and spec.startswith("p=f16"):
    params = jax.tree.map(lambda x: x.astype(F16), params)

  def loss(p):
    out = model.apply({"params": p}, IDS)
    return jnp.sum(out.astype(F32) * COTANGENT.astype(out.dtype).astype(F32))

  return jax.grad(loss)(params)["embedding"]


def _nnx_embed_grad(spec):
  model = jflax.apply_policy(nnx.Embed(VOCAB, FEATURES, rngs=nnx.Rngs(0)), spec)

  def loss(m):
    out = m(IDS)
    return jnp.sum(out.astype(F32) * COTANGENT.astype(out.dtype).astype(F32))

  return nnx.grad(loss)(model)["module"]["embedding"][...]


def _exact_sum(compute):
  """The table's gradient: the compute-dtype cotangents summed in float64."""
  rows = np.asarray(COTANGENT.astype(compute).astype(F32), np.float64).reshape(-1, FEATURES)
  out = np.zeros((VOCAB, FEATURES))
  np.add.at(out, np.asarray(IDS).reshape(-1), rows)
  return out


def _relative_error(grad, exact):
  grad = np.asarray(jnp.asarray(grad, F32), np.float64)
  return np.linalg.norm(grad - exact) / np.linalg.norm(exact)


@pytest.mark.parametrize("style", ["linen", "nnx"])
@pytest.mark.parametrize("spec, compute", [("mixed_float16", F16), ("mixed_bfloat16", BF16)])
def test_embedding_gradient_is_summed_in_float32(style, spec, compute):
  exact = _exact_sum(compute)
  grad = _linen_embed_grad(spec) if style == "linen" else _nnx_embed_grad(spec)
  assert grad.dtype == F32
  assert _relative_error(grad, exact) < 1e-6
  # A lookup in the compute dtype (Flax's `Embed(dtype=...)` alone) sums the
  # rows in that dtype: far off.
  assert _relative_error(_linen_embed_grad(None, dtype=compute), exact) > 1e-3


def test_float16_tables_get_the_float32_sum_rounded_once():
  grad = _linen_embed_grad("p=f16,c=f16,o=f32")
  assert grad.dtype == F16
  np.testing.assert_array_equal(grad, _exact_sum(F16).astype(np.float32).astype(F16))


@pytest.mark.parametrize("spec, compute", [("p=f32,c=f16,o=f16", F16), ("p=f32,c=bf16,o=bf16", BF16)])
def test_lookup_values_and_tied_head_stay_in_the_compute_dtype(spec, compute):
  class Tied(nn.Module):
    @nn.compact
    def __call__(self, ids):
      embed = nn.Embed(VOCAB, FEATURES)
      rows = embed(ids)
      return rows, embed.attend(rows)

  model = jflax.apply_policy(Tied(), spec)
  variables = model.init(jax.random.key(0), IDS)
  rows, logits = model.apply(variables, IDS)
  table = variables["params"]["Embed_0"]["embedding"]
  assert rows.dtype == logits.dtype == compute
  np.testing.assert_array_equal(rows, jnp.take(table.astype(compute), IDS, axis=0))
  # `attend` is a matmul in the compute dtype: its jaxpr multiplies half operands.
  jaxpr = jax.make_jaxpr(lambda v: model.apply(v, IDS))(variables)
  assert _operand_dtypes(jaxpr, ("dot_general",)) == {("dot_general", (compute, compute)): 1}


def test_nnx_layers_keep_their_state_and_references():
  class Tied(nnx.Module):
    def __init__(self):
      self.embed = nnx.Embed(VOCAB, FEATURES, rngs=nnx.Rngs(0))
      self.head = self.embed  # the same layer, twice

    def __call__(self, ids):
      return self.head.attend(self.embed(ids))

  original = Tied()
  wrapped = jflax.apply_policy(original, "p=f32,c=bf16,o=bf16")
  assert isinstance(wrapped.module.embed, jflax.Float32LookupEmbed)
  assert isinstance(wrapped.module.embed, nnx.Embed)
  assert wrapped.module.head is wrapped.module.embed
  assert type(original.embed) is nnx.Embed  # the caller's model is not changed
  assert jax.tree.structure(nnx.state(wrapped.module)) == jax.tree.structure(nnx.state(original))
  out = wrapped(IDS)
  assert out.dtype == BF16
  table = original.embed.embedding[...].astype(BF16)
  expected = jnp.take(table, IDS, axis=0) @ table.T
  np.testing.assert_allclose(np.asarray(out, F32), np.asarray(expected, F32), rtol=1e-2)
  # A clone (split and merge) keeps the float32 lookup.
  clone = nnx.clone(wrapped)
  assert type(clone.module.embed) is type(wrapped.module.embed)
  # Traced, with and without the recompute checkpoint: the layer is not mutated.
  plain = jflax.apply_policy(original, "p=f32,c=bf16,o=bf16", recompute=None)
  for model in (wrapped, plain):
    np.testing.assert_array_equal(jax.jit(lambda ids: model(ids))(IDS), out)
    np.testing.assert_array_equal(nnx.jit(lambda m, ids: m(ids))(model, IDS), out)
