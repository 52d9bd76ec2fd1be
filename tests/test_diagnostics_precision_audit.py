"""Tests for jmp_train.diagnostics.precision_audit."""

from __future__ import annotations


import jax
from jax import lax
import jax.numpy as jnp
import numpy as np
import pytest

from jmp_train import diagnostics as diag

F16, BF16, F32 = np.dtype(jnp.float16), np.dtype(jnp.bfloat16), np.dtype(jnp.float32)


# ---------------------------------------------------------------------------
# Precision audit.


def _logits(w, x, dtype):
  return x.astype(dtype) @ w.astype(dtype)


@pytest.mark.parametrize("dtype", [F16, BF16], ids=lambda d: d.name)
def test_audit_flags_half_softmax_and_loss(dtype):
  def bad_loss(w, x):
    return -jax.nn.log_softmax(_logits(w, x, dtype)).mean()

  w, x = jnp.ones((8, 16)), jnp.ones((4, 8))
  report = diag.precision_audit(bad_loss, w, x)
  assert {i.op for i in report.of_kind("half_op")} == {"exp", "log"}
  assert all("log_softmax" in i.where and i.dtype == dtype for i in report.of_kind("half_op"))
  (out,) = report.of_kind("half_output")
  assert out.shape == () and "loss" in out.message
  assert not report.ok and report.half_ops > 0
  with pytest.raises(AssertionError) as info:
    report.assert_clean()
  assert "exp" in str(info.value) and "log_softmax" in str(info.value)

  def good_loss(w, x):
    logits = _logits(w, x, dtype).astype(jnp.float32)
    return -jax.nn.log_softmax(logits).mean()

  good = diag.precision_audit(good_loss, w, x, backward=True)
  good.assert_clean()
  assert good.ok and "0 issue(s)" in str(good)


def test_audit_large_reductions_and_threshold():
  def f(x):  # a sum accumulated in the input's dtype
    return lax.reduce(x, np.array(0, x.dtype), lax.add, (1,)).astype(jnp.float32)

  x = jnp.ones((2, 2048), jnp.bfloat16)
  (issue,) = diag.precision_audit(f, x).issues
  assert issue.kind == "half_reduction" and issue.op == "reduce_sum[2048]"
  assert issue.shape == (2, 2048) and issue.dtype == BF16
  assert diag.precision_audit(f, x, reduction_threshold=4096).ok
  assert diag.precision_audit(f, x[:, :1023]).ok
  # A sum of exactly the threshold (1,024 by default) counts.
  (issue,) = diag.precision_audit(f, x[:, :1024]).issues
  assert issue.op == "reduce_sum[1024]"
  assert diag.precision_audit(f, x.astype(jnp.float32)).ok
  # jnp.sum already accumulates 16-bit inputs in float32.
  assert diag.precision_audit(lambda x: x.sum(axis=1).astype(jnp.float32), x).ok


def test_audit_backward_reduction_and_scan_counts():
  # The bias gradient of a bfloat16 layer is a sum over the batch in bf16.
  def f(b, x):
    return (x + b.astype(jnp.bfloat16)).astype(jnp.float32).sum()

  b, x = jnp.zeros(4), jnp.ones((2048, 4), jnp.bfloat16)
  assert diag.precision_audit(f, b, x).ok
  report = diag.precision_audit(f, b, x, backward=True)
  (issue,) = report.issues
  assert (issue.kind, issue.phase, issue.op) == ("half_reduction", "backward", "reduce_sum[2048]")

  def g(x):
    y, _ = lax.scan(lambda c, _: (jnp.exp(c), None), x, None, length=7)
    return y.astype(jnp.float32)

  (issue,) = diag.precision_audit(g, jnp.ones(3, jnp.float16)).issues
  assert issue.op == "exp" and issue.count == 7 and "scan" in issue.where


def test_audit_backward_scatter_add_of_a_half_table():
  # A lookup in a bfloat16 table: its gradient adds one row per index into
  # the table, in bfloat16. Gathering float32 rows and casting them after
  # the lookup keeps that sum in float32.
  ids = jnp.arange(4096) % 16

  def half_table(table):
    return jnp.take(table.astype(jnp.bfloat16), ids, axis=0).astype(jnp.float32).sum()

  def float32_rows(table):
    return jnp.take(table, ids, axis=0).astype(jnp.bfloat16).astype(jnp.float32).sum()

  table = jnp.ones((16, 8))
  assert diag.precision_audit(half_table, table).ok  # the forward pass only gathers
  (issue,) = diag.precision_audit(half_table, table, backward=True).issues
  assert (issue.kind, issue.phase, issue.op) == ("half_reduction", "backward", "scatter-add[4096]")
  assert issue.dtype == BF16 and issue.shape == (16, 8)
  # A scatter of exactly reduction_threshold rows counts; one more row than it does not.
  assert not diag.precision_audit(half_table, table, backward=True, reduction_threshold=4096).ok
  assert diag.precision_audit(half_table, table, backward=True, reduction_threshold=4097).ok
  assert diag.precision_audit(float32_rows, table, backward=True).ok


def test_audit_float32_matmul_and_ignore():
  def f(w, x):
    return jnp.tanh(x @ w)

  report = diag.precision_audit(f, jnp.ones((8, 8)), jnp.ones((2, 8)))
  (issue,) = report.issues
  assert issue.kind == "float32_matmul" and issue.dtype == F32
  report.assert_clean(ignore=("float32_matmul",))
  with pytest.raises(AssertionError, match="float32_matmul"):
    report.assert_clean()
  with pytest.raises(ValueError, match="valid kinds"):
    report.assert_clean(ignore=("float32_matmuls",))
  assert set(diag.ISSUE_KINDS) == {"half_op", "half_reduction", "half_output", "float32_matmul"}
