"""Tests for jmp_train.flax (dtype policies on linen and NNX modules)."""

from __future__ import annotations

import collections
import functools

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.extend import core as jex_core

import jmp_train
import jmp_train.flax as jflax
from jmp_train.examples import models

F16, BF16, F32 = np.dtype(jnp.float16), np.dtype(jnp.bfloat16), np.dtype(jnp.float32)
HALF = [F16, BF16]
MATMULS = ("dot_general", "conv_general_dilated")
# Primitives of softmax and of normalization statistics.
FRAGILE = ("exp", "reduce_max", "rsqrt")

# Tiny, Tensor-Core-shaped (multiples of 8) versions of the example models.
X_IMG = jnp.linspace(0.0, 1.0, 4 * 64, dtype=jnp.float32).reshape(4, 64)
TOKENS = (jnp.arange(2 * 8, dtype=jnp.int32).reshape(2, 8) * 7) % 32


def _resnet():
  return models.ResNet(num_classes=8, stage_features=(8, 16))


def _nnx_resnet():
  return models.NNXResNet(1, 8, (8, 16), rngs=nnx.Rngs(0))


def _transformer():
  return models.TransformerBlock(
      vocab_size=32, d_model=32, num_heads=4, mlp_dim=64, max_len=8
  )


def _nnx_transformer():
  return models.NNXTransformerBlock(
      vocab_size=32, d_model=32, num_heads=4, mlp_dim=64, max_len=8, rngs=nnx.Rngs(0)
  )


MODELS = {
    "resnet": (_resnet, _nnx_resnet, X_IMG),
    "transformer": (_transformer, _nnx_transformer, TOKENS),
}


def fill(shapes, seed=0):
  """Deterministic float32 values for abstract variables, made with NumPy.

  Compiling JAX's random initializers costs seconds on a loaded CPU; NumPy
  values need no compilation. Kernels are scaled by 1/sqrt(fan-in).
  """
  rng = np.random.default_rng(seed)

  def leaf(path, s):
    name = path[-1].key
    if name == "var":
      return jnp.ones(s.shape, s.dtype)
    if name == "mean":
      return jnp.asarray(0.1 * rng.standard_normal(s.shape), s.dtype)
    if name == "scale":
      return jnp.asarray(1.0 + 0.1 * rng.standard_normal(s.shape), s.dtype)
    if name == "bias":
      return jnp.asarray(0.1 * rng.standard_normal(s.shape), s.dtype)
    fan_in = int(np.prod(s.shape[:-1])) if name == "kernel" else 1
    return jnp.asarray(rng.standard_normal(s.shape) / np.sqrt(fan_in), s.dtype)

  return jax.tree_util.tree_map_with_path(leaf, shapes)


@pytest.fixture(scope="module")
def linen_variables():
  """Float32 variables of each linen model (no compilation)."""
  return {
      name: fill(jax.eval_shape(make().init, jax.random.key(0), x))
      for name, (make, _, x) in MODELS.items()
  }


def nnx_twin(name, variables):
  """The NNX twin holding the linen variables (built abstractly, no compile)."""
  abstract = nnx.eval_shape(MODELS[name][1])
  return models.nnx_with_linen_variables(abstract, variables)


# --------------------------------------------------------------------------
# Jaxpr inspection.
# --------------------------------------------------------------------------


def _eqns(jaxpr):
  for eqn in jaxpr.eqns:
    yield eqn
    for param in eqn.params.values():
      for sub in param if isinstance(param, (list, tuple)) else (param,):
        if isinstance(sub, jex_core.ClosedJaxpr):
          yield from _eqns(sub.jaxpr)
        elif isinstance(sub, jex_core.Jaxpr):
          yield from _eqns(sub)


def _operand_dtypes(closed_jaxpr, primitives):
  """Counter of (primitive, operand dtypes) over the jaxpr and sub-jaxprs."""
  counts = collections.Counter()
  for eqn in _eqns(closed_jaxpr.jaxpr):
    if eqn.primitive.name in primitives:
      dtypes = tuple(np.dtype(v.aval.dtype) for v in eqn.invars)
      counts[(eqn.primitive.name, dtypes)] += 1
  return counts


def _forward_and_grad_jaxprs(style, name, policy, variables, **kwargs):
  """Jaxprs of the policy'd model's forward pass and of its parameter grads.

  ``variables``: the float32 linen variables (the NNX twin gets them too).
  """
  make, _, x = MODELS[name]
  if style == "linen":
    model = jflax.apply_policy(make(), policy, **kwargs)
    params = variables["params"]
    rest = {k: v for k, v in variables.items() if k != "params"}

    def forward(p):
      return model.apply({"params": p, **rest}, x)

    fwd = jax.make_jaxpr(forward)(params)
    grad = jax.make_jaxpr(jax.grad(lambda p: jnp.sum(forward(p))))(params)
    return fwd, grad
  model = jflax.apply_policy(nnx_twin(name, variables), policy, **kwargs)
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)

  def forward(p):
    return nnx.merge(graphdef, p, rest)(x)

  fwd = jax.make_jaxpr(forward)(params)
  grad = jax.make_jaxpr(jax.grad(lambda p: jnp.sum(forward(p))))(params)
  return fwd, grad


@pytest.mark.parametrize("style", ["linen", "nnx"])
@pytest.mark.parametrize("name", ["resnet", "transformer"])
@pytest.mark.parametrize("compute", [F16, BF16, F32], ids=str)
def test_matmuls_in_compute_dtype_fragile_ops_in_float32(
    style, name, compute, linen_variables
):
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
      style, "resnet", "mixed_float16", linen_variables["resnet"],
      float32_paths=("stem", "head")
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
      "linen", "resnet", "mixed_bfloat16", linen_variables["resnet"],
      float32_paths=("block1",),
  )
  counts = _operand_dtypes(fwd, MATMULS)
  # block1 holds conv1, conv2 and proj: all in float32; stem + block0 in bf16.
  assert counts[("conv_general_dilated", (F32, F32))] == 3
  assert counts[("conv_general_dilated", (BF16, BF16))] == 3
  fwd_nnx, _ = _forward_and_grad_jaxprs(
      "nnx", "resnet", "mixed_bfloat16", linen_variables["resnet"],
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
def test_float32_modules_override_by_class(
    style, classes, n_f32, n_half, linen_variables
):
  fwd, _ = _forward_and_grad_jaxprs(
      style, "transformer", "mixed_bfloat16", linen_variables["transformer"],
      float32_modules=classes,
  )
  counts = _operand_dtypes(fwd, MATMULS)
  assert counts[("dot_general", (F32, F32))] == n_f32
  assert counts[("dot_general", (BF16, BF16))] == n_half
  assert sum(counts.values()) == n_f32 + n_half


def test_default_float32_modules_keep_the_norms_in_float32(linen_variables):
  for cls in (nn.BatchNorm, nn.LayerNorm, nn.RMSNorm, nnx.BatchNorm, nnx.LayerNorm,
              nnx.RMSNorm):
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
    apply = functools.partial(
        model.apply, capture_intermediates=True, mutable=["intermediates"])
    out, state = jax.eval_shape(apply, variables, TOKENS)
    assert out.dtype == F32
    seen = state["intermediates"]
    for norm in (seen["layer0"]["ln1"], seen["layer0"]["ln2"], seen["final_norm"]):
      assert norm["__call__"][0].dtype == norm_dtype
    assert seen["layer0"]["mlp_in"]["__call__"][0].dtype == BF16
    fwd = jax.make_jaxpr(model.apply)(variables, TOKENS)
    assert set(_operand_dtypes(fwd, ("rsqrt",))) == {("rsqrt", (F32,))}

    nnx_model = jflax.apply_policy(
        nnx_twin("transformer", variables), "mixed_bfloat16", float32_modules=modules)
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
  forced = jax.make_jaxpr(
      functools.partial(nn.dot_product_attention, force_fp32_for_softmax=True)
  )(q, q, q)
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
  assert _operand_dtypes(
      jax.make_jaxpr(model.apply)(variables, x), ("exp",)) == {("exp", (F32,)): 1}


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
# Parameter, batch-statistic, output and gradient dtypes.
# --------------------------------------------------------------------------


def _dtypes(tree):
  return {np.dtype(x.dtype) for x in jax.tree.leaves(tree)}


@pytest.mark.parametrize(
    "spec, param, output",
    [("mixed_float16", F32, F32), ("p=bf16,c=bf16,o=bf16", BF16, BF16),
     ("p=f32,c=f16,o=f16", F32, F16)],
)
def test_linen_param_batch_stats_output_and_grad_dtypes(spec, param, output):
  model = jflax.apply_policy(_resnet(), spec)
  variables = jax.eval_shape(model.init, jax.random.key(0), X_IMG)
  assert _dtypes(variables["params"]) == {param}
  assert _dtypes(variables["batch_stats"]) == {F32}
  out, updates = jax.eval_shape(
      functools.partial(model.apply, train=True, mutable=["batch_stats"]),
      variables, X_IMG,
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

  grad = jax.make_jaxpr(jax.grad(loss))(
      variables["params"], variables["batch_stats"])
  counts = _operand_dtypes(grad, MATMULS)
  assert counts and set(counts) <= {
      ("conv_general_dilated", (BF16, BF16)), ("dot_general", (BF16, BF16))}


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
  lm_def, lm_state = nnx.split(
      jflax.apply_policy(nnx_twin("transformer", lm_vars), "mixed_bfloat16"))
  cnn_def, cnn_state = nnx.split(
      jflax.apply_policy(nnx_twin("resnet", cnn_vars), "mixed_float16"))

  @jax.jit
  def run(lm_vars, cnn_vars, lm_state, cnn_state):
    nnx_cnn = nnx.merge(cnn_def, cnn_state)
    cnn_out, updates = linen_cnn.apply(
        cnn_vars, X_IMG, train=True, mutable=["batch_stats"])
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
  assert not np.allclose(
      out["stats"]["stem_bn"]["mean"], cnn_vars["batch_stats"]["stem_bn"]["mean"]
  )


@pytest.mark.parametrize("style", ["linen", "nnx"])
@pytest.mark.parametrize("name", ["resnet", "transformer"])
def test_strict_dtype_promotion(style, name, linen_variables):
  with jax.numpy_dtype_promotion("strict"):
    fwd, grad = _forward_and_grad_jaxprs(
        style, name, "mixed_bfloat16", linen_variables[name]
    )
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
    n = jax.device_count()
    assert n == 8
    replicated = jax.tree.map(lambda a: jnp.broadcast_to(a, (n, *a.shape)), variables)
    out = jax.pmap(model.apply)(replicated, x.reshape(n, 1, 16)).reshape(8, 8)
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


# --------------------------------------------------------------------------
# Errors.
# --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "module, fragment",
    [(object(), "flax.linen.Module or flax.nnx.Module"),
     (nn.Dense, "class Dense"),
     (lambda x: x, "function")],
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


def test_accepts_policy_objects_and_single_overrides():
  policy = jmp_train.get_policy("mixed_float16")
  model = jflax.apply_policy(
      nn.Dense(8), policy, float32_modules=nn.Dense, float32_paths="head"
  )
  assert model.policy == policy
  assert model.float32_modules == (nn.Dense,) and model.float32_paths == ("head",)


# --------------------------------------------------------------------------
# Memory: what the backward pass keeps by default.
# --------------------------------------------------------------------------

MEMORY_MODELS = {
    "mlp": (lambda: models.MLP(features=(64, 64), num_classes=8),
            lambda: models.NNXMLP(64, (64, 64), 8, rngs=nnx.Rngs(0)),
            jax.ShapeDtypeStruct((16, 64), F32), {}),
    "resnet": (_resnet, _nnx_resnet, jax.ShapeDtypeStruct((4, 8, 8, 1), F32),
               {"train": True, "mutable": ("batch_stats",)}),
    "transformer": (_transformer, _nnx_transformer, jax.ShapeDtypeStruct((2, 8), jnp.int32), {}),
}


def _linen_residual_bytes(name, policy, **apply_policy_kwargs):
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
    res = jmp_train.diagnostics.saved_residuals(
        lambda p, x: jnp.sum(model.apply({"params": p}, x)), params, x)
    kernels = [r for r in res if r.kind == "cast_copy" and len(r.shape_dtype.shape) == 2
               and r.shape_dtype.shape != x.shape]
    assert len(kernels) == copies, res
    if recompute:  # Only half-precision activations: relu's masks recomputed.
      assert {r.shape_dtype.dtype for r in res if r.costs_memory} == {BF16}, res


@pytest.mark.parametrize("name", ["mlp", "transformer"])
def test_nnx_default_keeps_at_most_055_of_float32s_residual_bytes(name):
  _, module, x, _ = MEMORY_MODELS[name]
  x = jnp.zeros(x.shape, x.dtype)

  def residual_bytes(policy, **kwargs):
    graphdef, params, rest = nnx.split(
        jflax.apply_policy(module(), policy, **kwargs), nnx.Param, ...)

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


def test_recompute_is_checked():
  with pytest.raises(ValueError, match="recompute must be one of"):
    jflax.apply_policy(nn.Dense(4), "mixed_bfloat16", recompute="all")
  with pytest.raises(ValueError, match="recompute must be one of"):
    jflax.apply_policy(nnx.Linear(2, 2, rngs=nnx.Rngs(0)), "mixed_bfloat16", recompute=True)
