"""FP8 products take FP8 operands in the lowered program: forward and backward."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jmp_train
import jmp_train.diagnostics as diag
import jmp_train.flax
from jmp_train_examples import models

E4M3, E5M2 = np.dtype(jnp.float8_e4m3fn), np.dtype(jnp.float8_e5m2)
DN = (((1,), (0,)), ((), ()))


def _ce(logits, y):
  return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def _assert_fp8(report, forward, backward):
  """All products FP8: ``forward`` E4M3 x E4M3, ``backward`` with an E5M2 gradient."""
  assert not report.not_fp8, str(report)
  pairs = [{p.lhs_dtype, p.rhs_dtype} for p in report.products]
  assert sum(pair == {E4M3} for pair in pairs) >= forward, str(report)
  assert sum(E5M2 in pair for pair in pairs) >= backward, str(report)
  assert all(p.out_dtype == np.float32 for p in report.products)


@pytest.mark.parametrize("net", ["mlp", "resnet"])
def test_linen_step_under_mixed_float8_has_fp8_operands_only(net):
  if net == "mlp":
    model = jmp_train.flax.apply_policy(models.MLP(features=(32,), num_classes=16), "mixed_float8")
    x = jnp.ones((8, 64))
  else:
    model = jmp_train.flax.apply_policy(models.ResNet(num_classes=16), "mixed_float8")
    x = jnp.ones((2, 8, 8, 1))
  variables = jax.eval_shape(model.init, jax.random.key(0), x)  # lowering needs only shapes
  params, meta = variables.pop("params"), {"fp8_meta": variables.pop("fp8_meta")}
  y = jnp.arange(x.shape[0]) % 16

  def loss(params, meta, state):
    out = model.apply({"params": params, **meta, **state}, x, mutable=list(state) if state else False)
    return _ce(out[0] if state else out, y)

  lowered = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(params, meta, variables)
  n = len(jax.tree.leaves(meta)) // 6  # six state leaves per FP8 product
  _assert_fp8(diag.fp8_products(lowered), forward=n, backward=2 * n - 1)
  if net == "resnet":
    assert any(p.op == "convolution" for p in diag.fp8_products(lowered).products)


def test_nnx_step_under_mixed_float8_has_fp8_operands_only():
  model = jmp_train.flax.apply_policy(
    models.NNXMLP(64, features=(32,), num_classes=16, rngs=nnx.Rngs(0)), "mixed_float8"
  )
  graphdef, params, meta = nnx.split(model, nnx.Param, jmp_train.flax.Fp8Meta)
  x, y = jnp.ones((8, 64)), jnp.arange(8) % 16

  def loss(params, meta):
    return _ce(nnx.merge(graphdef, params, meta)(x), y)

  lowered = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(params, meta)
  _assert_fp8(diag.fp8_products(lowered), forward=2, backward=3)


@pytest.mark.parametrize("mode", ["single", "shard_map"])
def test_make_train_step_with_mixed_float8_has_fp8_operands_only(mode):
  model = jmp_train.flax.apply_policy(models.MLP(features=(32,), num_classes=16), "mixed_float8")
  variables = jax.jit(model.init)(jax.random.key(0), jnp.zeros((1, 64)))
  step = jmp_train.make_train_step(
    model.apply, _ce, optax.adam(1e-3), policy="mixed_float8", cast_params=False, mode=mode
  )
  state = step.init(variables["params"], model_state={"fp8_meta": variables["fp8_meta"]})
  batch = step.shard_batch((jnp.ones((16, 64)), jnp.arange(16) % 16))
  report = diag.fp8_products(step.lower(state, batch))
  _assert_fp8(report, forward=2, backward=3)
  assert report.dialect == "stablehlo" and "fp8_product" in report.products[0].name


def test_fp8_products_flags_a_product_that_is_not_fp8():
  meta = jmp_train.init_fp8_meta(jmp_train.Fp8Recipe(scaling="current"))

  def f(x, w, v):
    h = jmp_train.fp8_dot_general(x, w, DN, meta=meta, recipe=jmp_train.Fp8Recipe("current"))
    return jnp.tanh(h @ v).astype(jnp.float32).sum()  # a plain bfloat16 dot

  x, w, v = (jnp.ones(s, jnp.bfloat16) for s in ((8, 16), (16, 16), (16, 4)))
  report = diag.fp8_products(jax.jit(jax.grad(f, argnums=(0, 1))).lower(x, w, v))
  assert isinstance(report, diag.Fp8ProductReport)
  assert all(isinstance(p, diag.ProductEntry) for p in report.products)
  assert len(report.fp8) == 3 and len(report.not_fp8) == 2  # h @ v and its transpose
  bad = report.not_fp8[0]
  assert (bad.lhs_dtype, bad.rhs_dtype) == (np.dtype(jnp.bfloat16),) * 2 and not bad.fp8
  assert "bfloat16 x bfloat16" in str(report) and "3 with FP8 operands, 2 without" in str(report)


def test_fp8_products_reads_compiled_hlo_and_gpu_custom_calls():
  meta = jmp_train.init_fp8_meta()
  f = jax.jit(lambda x, w: jmp_train.fp8_dot_general(x, w, DN, meta=meta))
  compiled = f.lower(jnp.ones((8, 16)), jnp.ones((16, 4))).compile()
  report = diag.fp8_products(compiled)
  # XLA:CPU converts FP8 operands to float32 before its dot: what runs.
  assert report.dialect == "hlo" and len(report.products) == 1
  assert report.products[0].op == "dot" and report.products[0].out_shape == (8, 4)
  gpu = """HloModule jit_f
ENTRY %main (a: f8e4m3fn[16,32], b: f8e5m2[32,16]) -> f32[16,16] {
  %a = f8e4m3fn[16,32]{1,0} parameter(0)
  %b = f8e5m2[32,16]{1,0} parameter(1)
  %s = f32[] constant(1)
  %c = (f32[16,16]{1,0}, s8[1024]{0}) custom-call(%a, %b, %s, %s), \
custom_call_target="__cublas$lt$matmul$f8", metadata={op_name="jit(f)/fp8_product/dot_general"}
  %g = f32[16,16]{1,0} get-tuple-element(%c), index=0
  ROOT %d = bf16[16,16]{1,0} dot(bf16[16,32]{1,0} %x, bf16[32,16]{1,0} %y), \
lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %x = bf16[16,32]{1,0} parameter(2)
  %y = bf16[32,16]{1,0} parameter(3)
}
"""
  report = diag.fp8_products(gpu)
  (gemm, dot) = report.products
  assert gemm.op == "__cublas$lt$matmul$f8" and gemm.fp8 and gemm.rhs_dtype == E5M2
  assert gemm.name == "jit(f)/fp8_product/dot_general" and gemm.lhs_shape == (16, 32)
  assert dot.op == "dot" and report.not_fp8 == (dot,)
  with pytest.raises(TypeError, match="jax.stages.Lowered"):
    diag.fp8_products(f)
  with pytest.raises(ValueError, match="neither StableHLO .* nor HLO"):
    diag.fp8_products("not a program")
