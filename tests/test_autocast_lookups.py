"""autocast: table lookups (embeddings) and the dtypes of a Transformer's modules."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jmp_train.diagnostics as diag
import jmp_train.flax as jflax
from jmp_train._src.autocast.transform import autocast
from jmp_train._src.autocast.lists import DEFAULT_LOOKUP_OPS
from jmp_train_examples import models

from helpers.flax_policy import fill

F16, BF16, F32 = np.dtype(jnp.float16), np.dtype(jnp.bfloat16), np.dtype(jnp.float32)
POLICIES = {F16: "mixed_float16", BF16: "mixed_bfloat16"}
TOKENS = (jnp.arange(2 * 8, dtype=jnp.int32).reshape(2, 8) * 7) % 32
_CALLS = ("jit", "pjit", "closed_call", "custom_jvp_call", "custom_vjp_call", "remat2", "checkpoint")


def _flat_eqns(jaxpr):
  """Equations with calls inlined (their bodies in place of the call)."""
  for eqn in jaxpr.eqns:
    if eqn.primitive.name in _CALLS:
      for sub in jax.extend.core.jaxprs_in_params(eqn.params):
        yield from _flat_eqns(sub)
    else:
      yield eqn


def _module_dtypes(fn, *args, root):
  """Flax module path -> dtype of the last floating value computed in it."""
  out = {}
  for eqn in _flat_eqns(jax.make_jaxpr(fn)(*args).jaxpr):
    stack = str(eqn.source_info.name_stack)
    parts = re.split(rf"(?:^|/)(?:{root}|module)(?:/|$)", stack)
    floats = [v for v in eqn.outvars if jnp.issubdtype(v.aval.dtype, jnp.floating)]
    if len(parts) > 1 and floats and eqn.primitive.name != "stop_gradient":
      out[parts[-1].split("/...")[0]] = np.dtype(floats[-1].aval.dtype)
  return out


def _embed_table_and_lookup():
  def embed(params, ids):
    return jnp.take(params["table"], ids, axis=0) * 2.0

  params = {"table": jnp.linspace(-1.0, 1.0, 32 * 8, dtype=jnp.float32).reshape(32, 8)}
  return embed, params, TOKENS


@pytest.mark.parametrize("half", [F16, BF16], ids=lambda d: d.name)
def test_embedding_lookup_returns_compute_dtype_and_float32_gradient(half):
  embed, params, ids = _embed_table_and_lookup()
  policy = POLICIES[half]
  cast = autocast(embed, policy, params_argnums=0)
  jaxpr = jax.make_jaxpr(cast)(params, ids).jaxpr
  gathers = [e for e in _flat_eqns(jaxpr) if e.primitive.name == "gather"]
  # The lookup reads the float32 table; its rows are cast to half after it.
  assert [np.dtype(e.invars[0].aval.dtype) for e in gathers] == [F32]
  muls = [e for e in _flat_eqns(jaxpr) if e.primitive.name == "mul"]
  assert {np.dtype(e.outvars[0].aval.dtype) for e in muls} == {half}
  # The gradient is scattered back into the float32 table (row counts times
  # 2: exact in half precision).
  grad = jax.grad(lambda p: jnp.sum(cast(p, ids)))(params)["table"]
  assert grad.dtype == F32
  np.testing.assert_array_equal(grad, jax.grad(lambda p: jnp.sum(embed(p, ids)))(params)["table"])


def test_lookup_list_is_data():
  embed, params, ids = _embed_table_and_lookup()
  assert "gather" in DEFAULT_LOOKUP_OPS
  kept = autocast(lambda p, i: embed(p, i), "params=float32,compute=bfloat16,output=float32", lookup_ops=())
  jaxpr = jax.make_jaxpr(kept)(params, ids).jaxpr
  muls = [e for e in _flat_eqns(jaxpr) if e.primitive.name == "mul"]
  assert {np.dtype(e.outvars[0].aval.dtype) for e in muls} == {F32}
  with pytest.raises(ValueError, match="lookup_ops"):
    autocast(embed, "mixed_bfloat16", lookup_ops=("scope:embed",))
  with pytest.raises(ValueError, match="not a JAX primitive"):
    autocast(embed, "mixed_bfloat16", lookup_ops=("take",))


@pytest.mark.parametrize("half", [F16, BF16], ids=lambda d: d.name)
def test_transformer_module_dtypes_match_apply_policy(half):
  model = models.TransformerBlock(vocab_size=32, d_model=16, num_heads=2, mlp_dim=32, max_len=8)
  policy = POLICIES[half]
  variables = fill(jax.eval_shape(model.init, jax.random.key(0), TOKENS))
  cast = autocast(model.apply, policy)
  reference = jflax.apply_policy(model, policy, recompute=None).apply
  got = _module_dtypes(cast, variables, TOKENS, root="TransformerBlock")
  want = _module_dtypes(reference, variables, TOKENS, root="TransformerBlock")
  assert got == want
  # Embeddings and the residual stream in the compute dtype, norms in float32.
  assert got["embed"] == got["pos_embed"] == got["layer0"] == half
  assert got["layer0/ln1"] == got["final_norm"] == F32
  for fn in (cast, reference):
    diag.precision_audit(fn, variables, TOKENS, backward=True).assert_clean()


def test_resnet_module_dtypes_match_apply_policy():
  # Evaluation mode: batch norm with stored statistics (parameters to
  # autocast) centres and scales in float32, as apply_policy's float32 module.
  model = models.ResNet(num_classes=8, stage_features=(8, 16))
  x = jnp.linspace(0.0, 1.0, 8 * 64, dtype=jnp.float32).reshape(8, 64)
  variables = fill(jax.eval_shape(model.init, jax.random.key(0), x))
  got = _module_dtypes(autocast(model.apply, "mixed_bfloat16"), variables, x, root="ResNet")
  want = _module_dtypes(jflax.apply_policy(model, "mixed_bfloat16", recompute=None).apply, variables, x, root="ResNet")
  assert got == want
  assert F32 in got.values() and BF16 in got.values()
