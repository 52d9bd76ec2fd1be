"""Tests for jmp_train.diagnostics.tensor_core_report and pad_to_multiple."""

from __future__ import annotations


import jax
from jax import lax
import jax.numpy as jnp
import numpy as np
import pytest

from jmp_train import diagnostics as diag

F16, BF16, F32 = np.dtype(jnp.float16), np.dtype(jnp.bfloat16), np.dtype(jnp.float32)


# ---------------------------------------------------------------------------
# Tensor Core report.


def test_dot_general_dims_flops_and_alignment():
  x = jnp.ones((4, 6, 16), jnp.float16)  # batch 4, M 6, K 16
  w = jnp.ones((4, 16, 24), jnp.float16)  # N 24
  r = diag.tensor_core_report(lambda a, b: jnp.einsum("bmk,bkn->bmn", a, b), x, w)
  (e,) = r.entries
  assert (e.phase, e.op, e.batch, e.m, e.n, e.k) == ("forward", "dot_general", 4, 6, 24, 16)
  assert e.flops == 2 * 4 * 6 * 24 * 16 == r.total_flops
  assert e.required_multiple == 8 and e.misaligned == ("M",)
  assert e.half_precision and not e.tensor_core
  assert r.half_precision_fraction == 1.0 and r.tensor_core_fraction == 0.0
  assert r.misaligned == (e,)
  with pytest.raises(AssertionError, match="M % 8"):
    r.assert_aligned()


@pytest.mark.parametrize(
  "dtype, multiple",
  [(F16, 8), (BF16, 8), (F32, None), (np.dtype(jnp.int8), 16)],
  ids=lambda v: getattr(v, "name", str(v)),
)
def test_required_multiple_by_dtype(dtype, multiple):
  x = jax.ShapeDtypeStruct((16, 8), dtype)  # no arrays needed
  w = jax.ShapeDtypeStruct((8, 32), dtype)
  pref = jnp.int32 if dtype == np.dtype(jnp.int8) else None
  dot = lambda a, b: lax.dot_general(a, b, (((1,), (0,)), ((), ())), preferred_element_type=pref)
  r = diag.tensor_core_report(dot, x, w)
  (e,) = r.entries
  assert e.required_multiple == multiple
  assert e.lhs_dtype == dtype and (e.m, e.n, e.k) == (16, 32, 8)
  assert e.misaligned == (("K",) if multiple == 16 else ())
  assert e.tensor_core == (multiple == 8)
  assert r.float32 == (() if multiple else (e,))


def test_convolution_channels_and_flops():
  x = jnp.ones((2, 9, 9, 3), jnp.bfloat16)  # NHWC, 3 input channels (RGB)
  k = jnp.ones((3, 3, 3, 16), jnp.bfloat16)  # HWIO
  conv = lambda a, b: lax.conv_general_dilated(a, b, (2, 2), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))
  (e,) = diag.tensor_core_report(conv, x, k).entries
  assert e.op == "conv" and e.checked == {"C_in": 3, "C_out": 16}
  assert e.misaligned == ("C_in",)
  out_elems = 2 * 5 * 5 * 16
  assert e.flops == 2 * out_elems * 3 * 9
  assert (e.m, e.n, e.k) == (2 * 5 * 5, 16, 27)
  # Padding the RGB channels to 8 makes it eligible.
  x8 = jnp.ones((2, 9, 9, diag.pad_to_multiple(3)), jnp.bfloat16)
  k8 = jnp.ones((3, 3, 8, 16), jnp.bfloat16)
  assert diag.tensor_core_report(conv, x8, k8).tensor_core_fraction == 1.0
  # A depthwise convolution has one channel per group.
  dw = lambda a, b: lax.conv_general_dilated(
    a, b, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"), feature_group_count=8
  )
  (e,) = diag.tensor_core_report(dw, x8, jnp.ones((3, 3, 1, 8), jnp.bfloat16)).entries
  assert e.batch == 8 and e.checked == {"C_in": 1, "C_out": 1}
  assert e.flops == 2 * (2 * 9 * 9 * 8) * 9 == 2 * e.batch * e.m * e.n * e.k


def test_recurses_into_sub_jaxprs():
  w = jnp.ones((8, 8), jnp.float16)

  @jax.custom_vjp
  def cv(x):
    return x @ w

  cv.defvjp(lambda x: (cv(x), None), lambda _, g: (g @ w.T,))

  @jax.custom_jvp
  def cj(x):
    return x @ w

  cj.defjvp(lambda p, t: (cj(p[0]), t[0] @ w))

  def f(x):
    x = jax.jit(lambda y: y @ w)(x)
    x = jax.checkpoint(lambda y: y @ w)(x)
    x = lax.cond(x.sum() > 0, lambda y: y @ w, lambda y: y, x)
    x, _ = lax.scan(lambda c, _: (c @ w, None), x, None, length=5)
    return cj(cv(x))

  r = diag.tensor_core_report(f, jnp.ones((8, 8), jnp.float16))
  assert len(r.entries) == 6
  assert sorted(e.repeats for e in r.entries) == [1, 1, 1, 1, 1, 5]
  assert r.total_flops == (5 + 5) * 2 * 8**3
  assert any("scan" in e.where for e in r.entries)
  assert all("test_diagnostics_tensor_cores.py" in e.where for e in r.entries)


def test_backward_pass_follows_the_gemm_table():
  # Dense layer, batch 6: forward M=batch... per NVIDIA's GEMM table the weight
  # gradient's K is the batch size.
  def dense(w, x):
    return (x @ w).astype(jnp.float32).sum()

  w = jnp.ones((16, 24), jnp.float16)
  x = jnp.ones((6, 16), jnp.float16)
  r = diag.tensor_core_report(dense, w, x, backward=True)
  phases = [e.phase for e in r.entries]
  assert phases == ["forward", "backward", "backward"]
  fwd = r.entries[0]
  assert (fwd.m, fwd.n, fwd.k) == (6, 24, 16)
  # {M, N} and K of the input gradient and the weight gradient (the order
  # of M and N depends on which operand XLA puts on the left).
  dims = sorted((tuple(sorted((e.m, e.n))), e.k) for e in r.entries[1:])
  assert dims == [((6, 16), 24), ((16, 24), 6)]
  weight_grad = [e for e in r.entries[1:] if e.k == 6]
  assert [e.misaligned for e in weight_grad] == [("K",)]
  assert r.total_flops == 3 * 2 * 6 * 16 * 24


def test_speedup_bound_is_amdahl():
  def f(a, b, c):
    return (a @ b).astype(jnp.float32) @ c

  a = jnp.ones((32, 64), jnp.float16)
  b = jnp.ones((64, 32), jnp.float16)
  c = jnp.ones((32, 64), jnp.float32)
  r = diag.tensor_core_report(f, a, b, c, tensor_core_speedup=5.0)
  half, full = 2 * 32 * 64 * 32, 2 * 32 * 32 * 64
  assert r.half_precision_flops == r.tensor_core_flops == half
  x = full / (half + full)  # share outside Tensor Cores
  assert r.tensor_core_fraction == pytest.approx(1 - x)
  assert r.speedup_bound == pytest.approx(1 / (x + (1 - x) / 5.0))
  # NVIDIA's Amdahl example: half the time at 5x gives 1.67x.
  assert r.speedup_bound == pytest.approx(1 / (0.5 + 0.5 / 5)) == pytest.approx(1.6667, abs=1e-4)
  text = str(r)
  assert "float16xfloat16->float16" in text and "no: float32" in text and "1.67x" in text
  rows = r.to_rows()
  assert [row["tensor_core"] for row in rows] == ["yes", "no: float32"]


def test_flax_dense_under_a_bfloat16_policy():
  import flax.linen as nn

  model = nn.Dense(features=30, dtype=jnp.bfloat16)  # float32 params, bf16 compute
  x = jnp.ones((8, 64), jnp.float32)
  params = jax.eval_shape(model.init, jax.random.key(0), x)
  r = diag.tensor_core_report(model.apply, params, x)
  (e,) = r.entries
  assert e.lhs_dtype == e.rhs_dtype == BF16 and e.misaligned == ("N",)
  padded = nn.Dense(features=diag.pad_to_multiple(30), dtype=jnp.bfloat16)
  params = jax.eval_shape(padded.init, jax.random.key(0), x)
  diag.tensor_core_report(padded.apply, params, x).assert_aligned()


def test_nnx_modules_and_states():
  from flax import nnx

  # Abstract (no initialisation to run): the report only traces.
  model = nnx.eval_shape(lambda: nnx.Linear(16, 12, dtype=jnp.float16, rngs=nnx.Rngs(0)))
  x = jnp.full((8, 16), 1e-3)
  state = nnx.state(model, nnx.Param)
  grads = jax.tree.map(lambda s: jnp.full(s.shape, 2.0**-30, s.dtype), state)
  h = diag.gradient_histogram(grads)
  assert h.paths == ("['bias'].value", "['kernel'].value")
  assert int(h.total.size) == int(h.total.underflow) == 16 * 12 + 12
  (e,) = diag.tensor_core_report(lambda m, x: m(x), model, x).entries
  assert e.lhs_dtype == F16 and (e.m, e.n, e.k) == (8, 12, 16) and e.misaligned == ("N",)


# ---------------------------------------------------------------------------
# Padding.


@pytest.mark.parametrize(
  "n, multiple, expected",
  [(0, 8, 0), (1, 8, 8), (8, 8, 8), (30, 8, 32), (50257, 64, 50304), (3, 16, 16), (7, 1, 7)],
)
def test_pad_to_multiple(n, multiple, expected):
  assert diag.pad_to_multiple(n, multiple) == expected
  assert isinstance(diag.pad_to_multiple(np.int64(n), multiple), int)


def test_public_module_reexports_collective_bytes():
  import jmp_train

  assert diag.collective_bytes is jmp_train.diagnostics.collective_bytes
  assert diag.collective_ops is jmp_train.diagnostics.collective_ops
  assert set(diag.__all__) >= {"collective_bytes", "collective_ops", "saved_residuals"}
