"""Tests for the policy's attention: fused (jax.nn / cuDNN) and explicit paths."""

from __future__ import annotations

import flax.linen as nn
import jax
from jax._src.cudnn import fused_attention_stablehlo as cudnn_attention
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.lib import cuda_versions  # None without JAX's CUDA plugin

import jmp_train
from jmp_train import diagnostics
from jmp_train._src.flax import attention

F16, BF16, F32 = np.dtype(jnp.float16), np.dtype(jnp.bfloat16), np.dtype(jnp.float32)
# One rounding of a value of magnitude ~1 in the half type, a few times over.
TOLERANCE = {F16: 4e-3, BF16: 3e-2, F32: 1e-5}


def _qkv(dtype, q_len=8, kv_len=8, heads=4, head_dim=16, seed=0):
  rng = np.random.default_rng(seed)
  shapes = [(2, q_len, heads, head_dim)] + [(2, kv_len, heads, head_dim)] * 2
  return [jnp.asarray(rng.standard_normal(s), dtype) for s in shapes]


def _masks(q_len, kv_len):
  rng = np.random.default_rng(1)
  padding = jnp.asarray(rng.random((2, 1, 1, kv_len)) > 0.3).at[..., 0].set(True)
  return {
    "none": {},
    "causal": {"is_causal": True},
    "tril_mask": {"mask": jnp.tril(jnp.ones((q_len, kv_len), bool))},
    "padding_mask": {"mask": padding},
    "float_mask": {"mask": padding.astype(F32)},  # nn.make_attention_mask's
    "bias": {"bias": jnp.asarray(rng.standard_normal((4, q_len, kv_len)), F32)},
    "causal_and_mask": {"is_causal": True, "mask": padding},
  }


@pytest.mark.parametrize("dtype", [F16, BF16, F32], ids=lambda d: d.name)
@pytest.mark.parametrize("q_len", [8, 5], ids=["square", "short_query"])
def test_fused_and_explicit_paths_agree(dtype, q_len):
  q, k, v = _qkv(dtype, q_len=q_len)

  # Eagerly: XLA:CPU compiles jax.nn's float16 scores (float16 operands,
  # float32 result) only op by op, not inside one jit.
  def both(q, k, v):
    out = {}
    for name, kw in _masks(q_len, 8).items():
      out[name] = [attention.dot_product_attention(q, k, v, implementation=impl, **kw) for impl in ("xla", "explicit")]
    return out

  for name, (fused, explicit) in both(q, k, v).items():
    assert fused.dtype == explicit.dtype == dtype, name
    np.testing.assert_allclose(
      np.asarray(fused, F32),
      np.asarray(explicit, F32),
      atol=TOLERANCE[dtype],
      rtol=TOLERANCE[dtype],
      err_msg=name,
    )


def test_causal_is_aligned_bottom_right_like_flax():
  q, k, v = _qkv(F32, q_len=3)
  mask = jnp.tril(jnp.ones((3, 8), bool), 8 - 3)

  @jax.jit  # one program for the reference and both paths
  def outputs(q, k, v):
    ref = nn.dot_product_attention(q, k, v, mask=mask)
    return ref, [
      attention.dot_product_attention(q, k, v, is_causal=True, implementation=impl) for impl in ("xla", "explicit")
    ]

  ref, outs = outputs(q, k, v)
  for out in outs:
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
  "kwargs, reason",
  [
    ({"dropout": True}, "dropout"),
    ({"sow": True}, "sown"),
    ({"precision": jax.lax.Precision.HIGHEST}, "precision"),
    ({"force_fp32_for_softmax": False}, "half-precision softmax"),
    ({"dtype": jnp.float64}, "float64"),
  ],
)
def test_what_rules_out_the_fused_path(kwargs, reason):
  q, k, v = _qkv(BF16)
  assert attention.fused_attention_unsupported(q, k, v) is None
  assert reason in attention.fused_attention_unsupported(q, k, v, **kwargs)
  five_d = q[None]
  assert "batch" in attention.fused_attention_unsupported(five_d, five_d, five_d)
  assert "head sizes" in attention.fused_attention_unsupported(q, k, v[..., :8])


@pytest.mark.parametrize(
  "shapes, message",
  [
    (((2, 8, 4, 16), (2, 8, 4, 15), (2, 8, 4, 16)), "query and key head_dim must match"),
    (((2, 8, 4, 16), (2, 8, 2, 16), (2, 8, 2, 16)), "num_heads must match"),
    (((2, 8, 4, 16), (2, 8, 4, 16), (2, 9, 4, 16)), "key and value lengths must match"),
    (((2, 8, 4, 16), (3, 8, 4, 16), (3, 8, 4, 16)), "batch dimensions must match"),
    (((8, 16), (8, 16), (8, 16)), "same rank, at least 3"),
  ],
)
def test_shapes_that_do_not_fit_are_named(shapes, message):
  q, k, v = (jnp.ones(s, BF16) for s in shapes)
  with pytest.raises(ValueError, match=message):
    attention.dot_product_attention(q, k, v)


def test_fallbacks_still_compute_and_explicit_choices_raise():
  q, k, v = _qkv(BF16)
  key = jax.random.key(0)
  # Dropout takes the explicit path under "auto" and is refused by "xla".
  dropped = attention.dot_product_attention(q, k, v, dropout_rate=0.5, dropout_rng=key)
  assert dropped.dtype == BF16
  with pytest.raises(ValueError, match="dropout"):
    attention.dot_product_attention(q, k, v, dropout_rate=0.5, dropout_rng=key, implementation="xla")
  with pytest.raises(ValueError, match="implementation must be one of"):
    attention.dot_product_attention(q, k, v, implementation="flash")
  if cuda_versions is None:
    # No CUDA plugin, so no cuDNN: "cudnn" raises cuDNN's own error. (Where
    # cuDNN is installed, tracing it succeeds even on the CPU backend.)
    with pytest.raises(attention._CUDNN_REFUSALS):
      jax.eval_shape(lambda *a: attention.dot_product_attention(*a, implementation="cudnn"), q, k, v)


def test_auto_keeps_every_matmul_in_half_precision_off_gpu():
  # The XLA implementation of jax.nn.dot_product_attention keeps the scores
  # in float32: its backward pass has float32 matmuls, so "auto" does not
  # take it; the explicit path's audit is clean, forward and backward.
  q, k, v = _qkv(BF16)

  def loss(impl):
    return lambda q, k, v: jnp.sum(
      attention.dot_product_attention(q, k, v, is_causal=True, implementation=impl).astype(F32)
    )

  diagnostics.precision_audit(loss("auto"), q, k, v, backward=True).assert_clean()
  xla = diagnostics.precision_audit(loss("xla"), q, k, v, backward=True)
  assert {(i.kind, i.phase) for i in xla.issues} == {("float32_matmul", "backward")}
  assert not xla.of_kind("half_op")  # its softmax is float32 too


@pytest.fixture
def pretend_cudnn(monkeypatch):
  """Makes tracing take cuDNN's path on this CPU machine (nothing is run).

  The version checks are the only part of cuDNN's path that needs a GPU;
  tracing to a jaxpr never lowers the kernel.
  """
  monkeypatch.setattr(cudnn_attention, "check_cudnn_version", lambda: 91000)
  monkeypatch.setattr(cudnn_attention, "check_compute_capability", lambda c: True)
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")


def _transformer_loss(policy):
  model = jmp_train.flax.apply_policy(nn.MultiHeadDotProductAttention(num_heads=2, qkv_features=32), policy)
  x = jnp.ones((2, 16, 32), F32)
  variables = jax.eval_shape(model.init, jax.random.key(0), x)

  def loss(variables, x):
    return jnp.mean(model.apply(variables, x) ** 2)

  return loss, variables, x


def test_policy_routes_attention_through_cudnn_and_the_audit_knows_it(pretend_cudnn):
  loss, variables, x = _transformer_loss("mixed_bfloat16")
  forward = str(jax.make_jaxpr(loss)(variables, x))
  assert "dot_product_attention_fwd" in forward and " exp " not in forward
  report = diagnostics.precision_audit(loss, variables, x, backward=True)
  report.assert_clean()
  assert report.fused_attention == 2  # the forward and the backward kernel
  assert "dot_product_attention_bwd" in str(jax.make_jaxpr(jax.grad(loss))(variables, x))


def test_cudnn_refusal_falls_back_to_the_explicit_path(pretend_cudnn, monkeypatch):
  def no_cudnn():
    raise RuntimeError("cuDNN is not detected.")

  monkeypatch.setattr(cudnn_attention, "check_cudnn_version", no_cudnn)
  loss, variables, x = _transformer_loss("mixed_bfloat16")
  report = diagnostics.precision_audit(loss, variables, x, backward=True)
  report.assert_clean()
  assert report.fused_attention == 0
  assert "exp" in str(jax.make_jaxpr(loss)(variables, x))


def test_explicit_path_audit_without_fused_attention():
  loss, variables, x = _transformer_loss("mixed_float16")
  report = diagnostics.precision_audit(loss, variables, x, backward=True)
  report.assert_clean()
  assert report.fused_attention == 0 and report.half_ops > 0
