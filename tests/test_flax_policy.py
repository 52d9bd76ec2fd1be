"""Tests for jmp_train.flax (dtype policies on linen and NNX modules): what runs in which dtype, and errors."""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jmp_train
import jmp_train.flax as jflax

from helpers.flax_policy import F16
from helpers.flax_policy import BF16
from helpers.flax_policy import F32
from helpers.flax_policy import MATMULS
from helpers.flax_policy import FRAGILE
from helpers.flax_policy import TOKENS
from helpers.flax_policy import _transformer
from helpers.flax_policy import make_linen_variables
from helpers.flax_policy import nnx_twin
from helpers.flax_policy import _operand_dtypes
from helpers.flax_policy import _forward_and_grad_jaxprs


@pytest.fixture(scope="module")
def linen_variables():
  return make_linen_variables()


@pytest.mark.parametrize("style", ["linen", "nnx"])
@pytest.mark.parametrize("name", ["resnet", "transformer"])
@pytest.mark.parametrize("compute", [F16, BF16, F32], ids=str)
def test_matmuls_in_compute_dtype_fragile_ops_in_float32(style, name, compute, linen_variables):
  policy = jmp_train.Policy(F32, compute, F32)
  fwd, grad = _forward_and_grad_jaxprs(style, name, policy, linen_variables[name])
  for jaxpr in (fwd, grad):
    matmuls = _operand_dtypes(jaxpr, MATMULS)
    assert matmuls, "no matmul found: the jaxpr walk is broken"
    for (prim, dtypes), _ in matmuls.items():
      assert set(dtypes) == {compute}, (prim, dtypes)
    fragile = _operand_dtypes(jaxpr, FRAGILE)
    assert fragile
    for (prim, dtypes), _ in fragile.items():
      assert set(dtypes) == {F32}, (prim, dtypes)
  # Forward reductions (norm statistics, softmax sums, pooling) in float32.
  for (prim, dtypes), _ in _operand_dtypes(fwd, ("reduce_sum",)).items():
    assert set(dtypes) == {F32}, (prim, dtypes)
  if name == "transformer":  # the softmax: one exp, in float32
    assert _operand_dtypes(fwd, ("exp",)) == {("exp", (F32,)): 1}


@pytest.mark.parametrize("style", ["linen", "nnx"])
def test_float32_paths_keep_stem_and_head_in_float32(style, linen_variables):
  fwd, grad = _forward_and_grad_jaxprs(
    style, "resnet", "mixed_float16", linen_variables["resnet"], float32_paths=("stem", "head")
  )
  fwd_counts = _operand_dtypes(fwd, MATMULS)
  # Exactly the stem convolution and the head matmul run in float32.
  assert fwd_counts[("conv_general_dilated", (F32, F32))] == 1
  assert fwd_counts[("dot_general", (F32, F32))] == 1
  assert fwd_counts[("conv_general_dilated", (F16, F16))] == 5
  for jaxpr in (fwd, grad):
    for (prim, dtypes), _ in _operand_dtypes(jaxpr, MATMULS).items():
      assert len(set(dtypes)) == 1 and dtypes[0] in (F16, F32), (prim, dtypes)
  grad_counts = _operand_dtypes(grad, MATMULS)
  assert grad_counts[("dot_general", (F32, F32))] >= 2  # head: dW and dx
  assert grad_counts[("conv_general_dilated", (F16, F16))] > 5


def test_float32_paths_glob_covers_submodules(linen_variables):
  fwd, _ = _forward_and_grad_jaxprs(
    "linen",
    "resnet",
    "mixed_bfloat16",
    linen_variables["resnet"],
    float32_paths=("block1",),
  )
  counts = _operand_dtypes(fwd, MATMULS)
  # block1 holds conv1, conv2 and proj: all in float32; stem + block0 in bf16.
  assert counts[("conv_general_dilated", (F32, F32))] == 3
  assert counts[("conv_general_dilated", (BF16, BF16))] == 3
  fwd_nnx, _ = _forward_and_grad_jaxprs(
    "nnx",
    "resnet",
    "mixed_bfloat16",
    linen_variables["resnet"],
    float32_paths=("block*/conv1",),
  )
  counts = _operand_dtypes(fwd_nnx, MATMULS)
  assert counts[("conv_general_dilated", (F32, F32))] == 2


@pytest.mark.parametrize("style", ["linen", "nnx"])
@pytest.mark.parametrize(
  "classes, n_f32, n_half",
  [
    # Dense/Linear by class: mlp_in, mlp_out, head (norms no longer listed).
    ((nn.Dense, nnx.Linear), 3, 6),
    # Attention by class covers its submodules: q, k, v, out and the two
    # attention matmuls.
    ((nn.MultiHeadDotProductAttention, nnx.MultiHeadAttention), 6, 3),
  ],
  ids=["dense", "attention"],
)
def test_float32_modules_override_by_class(style, classes, n_f32, n_half, linen_variables):
  fwd, _ = _forward_and_grad_jaxprs(
    style,
    "transformer",
    "mixed_bfloat16",
    linen_variables["transformer"],
    float32_modules=classes,
  )
  counts = _operand_dtypes(fwd, MATMULS)
  assert counts[("dot_general", (F32, F32))] == n_f32
  assert counts[("dot_general", (BF16, BF16))] == n_half
  assert sum(counts.values()) == n_f32 + n_half


def test_default_float32_modules_keep_the_norms_in_float32(linen_variables):
  for cls in (nn.BatchNorm, nn.LayerNorm, nn.RMSNorm, nnx.BatchNorm, nnx.LayerNorm, nnx.RMSNorm):
    assert cls in jflax.DEFAULT_FLOAT32_MODULES
  assert nn.Dense not in jflax.DEFAULT_FLOAT32_MODULES
  variables = linen_variables["transformer"]
  x = jnp.ones((2, 8, 32), BF16)
  # With no float32 modules the norms output the compute dtype; their
  # statistics stay float32 (linen's force_float32_reductions, NNX always).
  for modules, norm_dtype in ((jflax.DEFAULT_FLOAT32_MODULES, F32), ((), BF16)):
    model = jflax.apply_policy(_transformer(), "mixed_bfloat16", float32_modules=modules)
    assert isinstance(model, jflax.LinenPolicyWrapper)
    assert model.float32_modules == tuple(modules)
    apply = functools.partial(model.apply, capture_intermediates=True, mutable=["intermediates"])
    out, state = jax.eval_shape(apply, variables, TOKENS)
    assert out.dtype == F32
    seen = state["intermediates"]
    for norm in (seen["layer0"]["ln1"], seen["layer0"]["ln2"], seen["final_norm"]):
      assert norm["__call__"][0].dtype == norm_dtype
    assert seen["layer0"]["mlp_in"]["__call__"][0].dtype == BF16
    fwd = jax.make_jaxpr(model.apply)(variables, TOKENS)
    assert set(_operand_dtypes(fwd, ("rsqrt",))) == {("rsqrt", (F32,))}

    nnx_model = jflax.apply_policy(nnx_twin("transformer", variables), "mixed_bfloat16", float32_modules=modules)
    assert isinstance(nnx_model, jflax.NNXPolicyWrapper)
    assert nnx_model.policy == jmp_train.get_policy("mixed_bfloat16")
    layer = nnx_model.module.layer0
    assert layer.ln1.dtype == layer.ln2.dtype == norm_dtype
    assert layer.mlp_in.dtype == BF16
    assert jax.eval_shape(lambda x: layer.ln1(x), x).dtype == norm_dtype
    graphdef, nnx_state = nnx.split(nnx_model)
    nnx_fwd = jax.make_jaxpr(lambda s: nnx.merge(graphdef, s)(TOKENS))(nnx_state)
    assert set(_operand_dtypes(nnx_fwd, ("rsqrt",))) == {("rsqrt", (F32,))}


def test_why_not_flax_default_attention():
  # The control for the float32-softmax assertions above. Flax's default
  # attention given bfloat16 exponentiates in bfloat16; with
  # force_fp32_for_softmax=True its weights-times-values matmul runs in
  # float32. Ours: both matmuls in bfloat16, softmax in float32.
  q = jnp.ones((1, 8, 2, 8), BF16)
  default = jax.make_jaxpr(nn.dot_product_attention)(q, q, q)
  assert _operand_dtypes(default, ("exp",)) == {("exp", (BF16,)): 1}
  forced = jax.make_jaxpr(functools.partial(nn.dot_product_attention, force_fp32_for_softmax=True))(q, q, q)
  # A dot_general with a float32 operand: a float32 matmul.
  assert any(F32 in dtypes for _, dtypes in _operand_dtypes(forced, MATMULS))
  ours = jax.make_jaxpr(jflax.dot_product_attention)(q, q, q)
  assert _operand_dtypes(ours, ("exp",)) == {("exp", (F32,)): 1}
  assert set(_operand_dtypes(ours, MATMULS)) == {("dot_general", (BF16, BF16))}


def test_custom_attention_is_left_alone():
  calls = []

  def my_attention(query, key, value, **kwargs):
    calls.append(query.dtype)
    return nn.dot_product_attention(query, key, value, **kwargs)

  x = jnp.ones((1, 8, 16), F32)
  custom_fn = nn.MultiHeadDotProductAttention(num_heads=2, attention_fn=my_attention)
  model = jflax.apply_policy(custom_fn, "mixed_bfloat16")
  jax.eval_shape(model.init, jax.random.key(0), x)
  assert calls and set(calls) == {BF16}
  # Custom (e.g. quantized) einsums only work with Flax's own function: kept,
  # with force_fp32_for_softmax=True, so a float32 matmul appears.
  custom_einsum = nn.MultiHeadDotProductAttention(
    num_heads=2,
    qk_attn_weights_einsum_cls=lambda: jnp.einsum,
    attn_weights_value_einsum_cls=lambda: jnp.einsum,
  )
  model = jflax.apply_policy(custom_einsum, "mixed_bfloat16")
  variables = jax.eval_shape(model.init, jax.random.key(0), x)
  counts = _operand_dtypes(jax.make_jaxpr(model.apply)(variables, x), MATMULS)
  assert any(F32 in dtypes for _, dtypes in counts)
  assert _operand_dtypes(jax.make_jaxpr(model.apply)(variables, x), ("exp",)) == {("exp", (F32,)): 1}


def test_attention_masks_dropout_and_bias():
  rng = np.random.default_rng(0)
  q, k, v = (jnp.asarray(rng.standard_normal((2, 8, 2, 8)), F32) for _ in range(3))
  causal = jnp.tril(jnp.ones((8, 8), bool))
  ours = jflax.dot_product_attention

  @jax.jit  # one compilation for all of it
  def outputs(q, k, v):
    return dict(
      ref=nn.dot_product_attention(q, k, v, mask=causal),
      masked=ours(q, k, v, bias=jnp.zeros((8, 8)), mask=causal),
      causal=ours(q, k, v, is_causal=True),
      dropped=ours(q, k, v, dropout_rate=0.5, dropout_rng=jax.random.key(1)),
      half=ours(q, k, v, dtype=F16, mask=causal),
    )

  out = outputs(q, k, v)
  np.testing.assert_allclose(out["masked"], out["ref"], rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(out["causal"], out["ref"], rtol=1e-5, atol=1e-5)
  assert not np.allclose(out["dropped"], out["ref"])
  assert out["half"].dtype == F16
  np.testing.assert_allclose(out["half"].astype(F32), out["ref"], atol=1e-2)


# --------------------------------------------------------------------------
# Errors.
# --------------------------------------------------------------------------


@pytest.mark.parametrize(
  "module, fragment",
  [(object(), "flax.linen.Module or flax.nnx.Module"), (nn.Dense, "class Dense"), (lambda x: x, "function")],
)
def test_rejects_non_modules(module, fragment):
  with pytest.raises(ValueError, match=fragment):
    jflax.apply_policy(module, "mixed_bfloat16")


def test_rejects_bad_policies():
  with pytest.raises(ValueError, match="'float17'"):
    jflax.apply_policy(nn.Dense(8), "p=f32,c=float17,o=f32")
  with pytest.raises(ValueError, match="jmp_train.Policy or a spec string"):
    jflax.apply_policy(nn.Dense(8), jnp.bfloat16)


def test_rejects_bad_overrides():
  with pytest.raises(ValueError, match="float32_modules.*'LayerNorm'"):
    jflax.apply_policy(nn.Dense(8), "mixed_bfloat16", float32_modules=("LayerNorm",))
  with pytest.raises(ValueError, match="float32_paths.*3"):
    jflax.apply_policy(nn.Dense(8), "mixed_bfloat16", float32_paths=("head", 3))
  with pytest.raises(ValueError, match="float32_modules"):
    jflax.apply_policy(nn.Dense(8), "mixed_bfloat16", float32_modules=3)
  with pytest.raises(ValueError, match=r"float32_paths must be a sequence .*got 5"):
    jflax.apply_policy(nn.Dense(8), "mixed_bfloat16", float32_paths=5)
  with pytest.raises(ValueError, match="cast_inputs must be True or False, got 'yes'"):
    jflax.apply_policy(nn.Dense(8), "mixed_bfloat16", cast_inputs="yes")


def test_accepts_policy_objects_and_single_overrides():
  policy = jmp_train.get_policy("mixed_float16")
  model = jflax.apply_policy(nn.Dense(8), policy, float32_modules=nn.Dense, float32_paths="head")
  assert model.policy == policy
  assert model.float32_modules == (nn.Dense,) and model.float32_paths == ("head",)
