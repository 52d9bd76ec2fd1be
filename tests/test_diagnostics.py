"""Tests for jmp_train.diagnostics."""

from __future__ import annotations

import functools
import math
import sys

import chex
import jax
from jax import lax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jmp_train import diagnostics as diag

F16, BF16, F32 = np.dtype(jnp.float16), np.dtype(jnp.bfloat16), np.dtype(jnp.float32)
TARGETS = [F16, BF16]
INPUT_DTYPES = [F32, BF16, F16]


def _log_uniform(rng, n, lo, hi, dtype=np.float32):
  signs = rng.choice([-1.0, 1.0], n)
  return (signs * np.exp2(rng.uniform(lo, hi, n))).astype(dtype)


def _edge_values():
  """Values at the float16 and bfloat16 rounding boundaries."""
  f16_tie = 2.0**-25  # halfway to the smallest subnormal: rounds to even 0.
  return np.array(
      [
          f16_tie, np.nextafter(np.float32(f16_tie), np.float32(1)), 2.0**-24,
          2.0**-14, np.nextafter(np.float32(2.0**-14), np.float32(0)),
          65504.0, 65519.99, 65520.0, 65536.0, -65520.0,
          3.38e38, 3.3895e38, 3.3961e38, 3.4e38,  # bfloat16's largest ~3.3895e38
          0.0, -0.0, np.inf, -np.inf, np.nan,
      ],
      np.float32,
  )


@pytest.fixture(scope="module")
def spread():
  """Values over many orders of magnitude, with zeros and non-finite ones.

  The magnitudes stay above 2**-100: XLA's CPU backend flushes float32
  subnormals to zero in arithmetic, NumPy does not.
  """
  rng = np.random.default_rng(0)
  x = _log_uniform(rng, 3000, -60, 40)
  x[rng.random(x.size) < 0.1] = 0.0
  return np.concatenate([x, _edge_values()])


@functools.lru_cache(maxsize=None)
def _jitted_histogram(target, min_exponent=-40, max_exponent=20):
  return jax.jit(
      lambda t, s: diag.gradient_histogram(
          t, target_dtype=target, scale=s, min_exponent=min_exponent, max_exponent=max_exponent
      )
  )


def _reference(x: np.ndarray, target: np.dtype, scale: float, lo: int, hi: int) -> dict:
  """What NumPy's (ml_dtypes') cast does, counted the slow way."""
  x32 = x.astype(np.float32)
  finite = np.isfinite(x32)
  nonzero = finite & (x32 != 0)
  with np.errstate(over="ignore"):
    v = x32 * np.float32(scale)
    y = v.astype(target).astype(np.float32)
  tiny = float(ml_dtypes.finfo(target).smallest_normal)
  counts = np.zeros(hi - lo, np.int64)
  below = above = 0
  for val in np.abs(v[nonzero]).astype(np.float64):
    if val == 0:
      below += 1
      continue
    if val == np.inf:  # overflowed float32 when scaled
      above += 1
      continue
    e = math.frexp(val)[1] - 1
    if e < lo:
      below += 1
    elif e >= hi:
      above += 1
    else:
      counts[e - lo] += 1
  return {
      "zeros": int(np.sum(finite & ~nonzero)),
      "nonfinite": int(np.sum(~finite)),
      "underflow": int(np.sum(nonzero & (y == 0))),
      "subnormal": int(np.sum(nonzero & (y != 0) & (np.abs(y) < tiny))),
      "overflow": int(np.sum(nonzero & np.isinf(y))),
      "counts": counts,
      "below": below,
      "above": above,
  }


# ---------------------------------------------------------------------------
# Histograms and fractions against actual casts.


@pytest.mark.parametrize("target", TARGETS, ids=lambda d: d.name)
@pytest.mark.parametrize("scale", [1.0, 2.0**-3, 2.0**12])
def test_histogram_matches_numpy_casts(spread, target, scale):
  x = spread
  tree = {"a": jnp.asarray(x[:1000]), "b": [jnp.asarray(x[1000:])], "step": jnp.int32(3)}
  h = _jitted_histogram(target)(tree, jnp.float32(scale))
  ref = _reference(x, target, scale, -40, 20)
  t = h.total
  assert t.dtype == target and (t.min_exponent, t.max_exponent) == (-40, 20)
  for field in ("zeros", "nonfinite", "underflow", "subnormal", "overflow", "below", "above"):
    assert int(getattr(t, field)) == ref[field], field
  np.testing.assert_array_equal(np.asarray(t.counts), ref["counts"])
  assert int(t.size) == x.size
  # Every non-zero finite value lies in exactly one bin.
  assert int(t.counts.sum()) + int(t.below) + int(t.above) == int(t.nonzero)
  assert t.counts.dtype == jnp.int32
  # The per-leaf histograms add up to the total; the int leaf is skipped.
  assert h.paths == ("['a']", "['b'][0]")
  assert h.per_leaf.counts.shape == (2, 60) and h.per_leaf.size.tolist() == [1000, x.size - 1000]
  summed = h["['a']"] + h["['b'][0]"]
  chex.assert_trees_all_equal(summed, t)
  assert [p for p, _ in h.items()] == list(h.paths)
  with pytest.raises(KeyError, match="No floating leaf"):
    h["['step']"]


@pytest.mark.parametrize("input_dtype", INPUT_DTYPES, ids=lambda d: d.name)
@pytest.mark.parametrize("target", TARGETS, ids=lambda d: d.name)
def test_fractions_match_actual_casts(spread, input_dtype, target):
  rng = np.random.default_rng(1)
  x = np.concatenate([spread, _log_uniform(rng, 500, -30, 20)])
  with np.errstate(over="ignore"):
    x = x.astype(input_dtype)
  for scale in (1.0, 2.0**-4, 2.0**16):
    ref = _reference(x, target, scale, -40, 20)
    nonzero = int(np.sum(np.isfinite(x) & (x.astype(np.float32) != 0)))
    under = diag.underflow_fraction({"x": jnp.asarray(x)}, target, scale)
    over = diag.overflow_fraction(jnp.asarray(x), target, scale)
    assert under.dtype == over.dtype == jnp.float32
    np.testing.assert_allclose(float(under), ref["underflow"] / nonzero, rtol=1e-6)
    np.testing.assert_allclose(float(over), ref["overflow"] / nonzero, rtol=1e-6)


def test_rounding_boundaries_float16():
  h = diag.gradient_histogram(jnp.asarray(_edge_values())).total
  # 2**-25 is a tie that rounds to 0; just above it rounds up to 2**-24.
  assert int(h.underflow) == 1
  # 65519.99 rounds down to 65504; 65520 and above become inf (4 of them
  # below float32's max, and the bfloat16-scale values).
  assert int(h.overflow) == 3 + 4
  assert int(h.zeros) == 2 and int(h.nonfinite) == 3
  # Just above 2**-25 (rounds up to 2**-24) and 2**-24 itself; just below
  # 2**-14 rounds up to the smallest normal, so it is not subnormal.
  assert int(h.subnormal) == 2
  assert float(diag.overflow_fraction(jnp.array([65519.0, 65520.0]))) == 0.5


def test_bfloat16_needs_no_scale_where_float16_does():
  rng = np.random.default_rng(2)
  g = jnp.asarray(_log_uniform(rng, 1000, -40, -10))
  assert float(diag.underflow_fraction(g, "float16")) > 0.4
  assert float(diag.underflow_fraction(g, "bf16")) == 0.0
  assert float(diag.underflow_fraction(g, "float16", 2.0**20)) == 0.0


def test_all_zero_tree_gives_zero_fractions():
  tree = {"w": jnp.zeros((3, 4)), "b": jnp.zeros(4, jnp.bfloat16)}
  assert float(diag.underflow_fraction(tree)) == 0.0
  assert float(diag.overflow_fraction(tree)) == 0.0
  h = diag.gradient_histogram(tree).total
  assert int(h.zeros) == 16 and int(h.nonzero) == 0
  assert float(h.underflow_fraction) == 0.0 and float(h.zero_fraction) == 1.0


def test_histogram_jit_pmap_and_eager_agree(num_devices):
  rng = np.random.default_rng(3)
  x = _log_uniform(rng, num_devices * 64, -35, 18).reshape(num_devices, 64)
  eager = diag.gradient_histogram(x, scale=4.0).total
  jitted = _jitted_histogram(F16)(x, 4.0).total
  chex.assert_trees_all_equal(eager, jitted)

  @functools.partial(jax.pmap, axis_name="d")
  def per_device(shard):
    # Each replica sees its 64 values; axis_name combines all replicas.
    return (
        diag.gradient_histogram({"g": shard}, scale=4.0, axis_name="d"),
        diag.underflow_fraction(shard, "float16", 4.0, axis_name="d"),
        diag.suggest_loss_scale(shard, axis_name="d"),
    )

  hist, under, suggestion = per_device(jnp.asarray(x))
  assert hist.total.counts.shape == (num_devices, 60)
  assert hist.per_leaf.counts.shape == (num_devices, 1, 60)
  for field in ("counts", "below", "above", "underflow", "subnormal", "overflow", "size"):
    got = np.asarray(getattr(hist.total, field))
    np.testing.assert_array_equal(got, np.broadcast_to(getattr(eager, field), got.shape))
  np.testing.assert_array_equal(under, np.full(num_devices, float(eager.underflow_fraction)))
  overall = diag.suggest_loss_scale(x)
  np.testing.assert_array_equal(suggestion.loss_scale, np.full(num_devices, overall.loss_scale))
  np.testing.assert_array_equal(suggestion.underflow_fraction, overall.underflow_fraction)
  # The replicas' own maxima differ: without the pmax they would disagree.
  assert len(set(np.abs(x).max(axis=1).tolist())) > 1


def test_histogram_is_a_pytree_keeping_its_metadata():
  tree = {"w": jnp.linspace(-1, 1, 7, dtype=jnp.bfloat16)}
  h = diag.gradient_histogram(tree, target_dtype="bf16", min_exponent=-130, max_exponent=5)
  rebuilt = jax.tree.map(lambda x: x, h)
  t = rebuilt.total
  assert (t.dtype, t.min_exponent, t.max_exponent) == (BF16, -130, 5)
  assert t.counts.shape == (135,) and t.bin_edges[0] == 2.0**-130
  np.testing.assert_array_equal(t.exponents, np.arange(-130, 5))
  chex.assert_trees_all_equal(rebuilt, h)


def test_compiled_size_does_not_grow_with_the_number_of_leaves():
  # All leaves go through one computation (two bincounts on the values of
  # every leaf), so compile time stays flat for models with hundreds of
  # parameter arrays (per-leaf kernels compiled in time linear in them).
  def ops(num_leaves):
    tree = [jnp.ones((3, i + 1)) for i in range(num_leaves)]
    text = jax.jit(diag.gradient_histogram).lower(tree).as_text()
    return text.count("stablehlo.scatter"), text.count("stablehlo.compare")

  assert ops(1) == ops(12)
  assert 0 < ops(12)[0] <= 4


def test_traced_scale_does_not_retrace():
  traces = []

  @jax.jit
  def f(g, s):
    traces.append(1)
    return diag.underflow_fraction(g, "float16", s)

  g = jnp.asarray([1e-6, 1e-9, 1.0])
  assert float(f(g, jnp.float32(1.0))) == pytest.approx(1 / 3)
  assert float(f(g, jnp.float32(2.0**10))) == 0.0
  assert len(traces) == 1


def test_str_and_rows():
  g = {"w": jnp.array([0.0, 2.0**-30, 1e-3, 1e5]), "b": jnp.ones(2, jnp.float16)}
  h = diag.gradient_histogram(g)
  rows = h.to_rows()
  assert [r["leaf"] for r in rows] == ["['b']", "['w']", "total"]
  assert rows[1]["underflow"] == pytest.approx(1 / 3) and rows[1]["min_log2"] == -30
  text = str(h)
  assert "float16" in text and "underflow" in text and "['w']" in text


def test_results_are_the_documented_types():
  # One small known input per function; a field of each result type checked.
  g = {"w": jnp.array([0.0, 2.0**-30, 1e-3, 1e5])}
  h = diag.gradient_histogram(g)
  assert isinstance(h, diag.GradientHistogram) and h.paths == ("['w']",)
  assert isinstance(h.total, diag.Histogram) and isinstance(h["['w']"], diag.Histogram)
  # 0 is a zero, 2**-30 flushes to 0 in float16, 1e5 overflows; 1e-3 in 2**-10.
  t = h.total
  assert (int(t.zeros), int(t.underflow), int(t.overflow)) == (1, 1, 1)
  assert int(t.counts[-10 - t.min_exponent]) == 1 and int(t.counts.sum()) == 3

  s = diag.suggest_loss_scale({"w": jnp.array([3e-2, 1e-8, -2e-6])}, headroom=2.0)
  assert isinstance(s, diag.LossScaleSuggestion)
  assert float(s.loss_scale) == 2.0**20  # 65504 / (2 * 0.03) ~ 2**20.06
  assert float(s.max_abs) == np.float32(3e-2)

  x = jax.ShapeDtypeStruct((64, 1000), jnp.float16)
  w = jax.ShapeDtypeStruct((1000, 30), jnp.float16)
  r = diag.tensor_core_report(jnp.dot, x, w)
  assert isinstance(r, diag.TensorCoreReport)
  (e,) = r.entries
  assert isinstance(e, diag.MatmulEntry)
  assert (e.m, e.n, e.k, e.misaligned) == (64, 30, 1000, ("N",))

  def loss(w, x):
    return -jax.nn.log_softmax(x.astype(jnp.bfloat16) @ w.astype(jnp.bfloat16)).mean()

  audit = diag.precision_audit(loss, jnp.ones((8, 8)), jnp.ones((4, 8)))
  assert isinstance(audit, diag.PrecisionReport)
  assert audit.issues and all(isinstance(i, diag.PrecisionIssue) for i in audit.issues)
  (out,) = audit.of_kind("half_output")
  assert (out.op, out.dtype, out.shape, out.count) == ("output[0]", BF16, (), 1)


# ---------------------------------------------------------------------------
# Loss scale suggestion.


@pytest.mark.parametrize("input_dtype", INPUT_DTYPES, ids=lambda d: d.name)
def test_suggest_loss_scale_is_the_largest_fitting_power_of_two(input_dtype):
  rng = np.random.default_rng(4)
  g = {"w": jnp.asarray(_log_uniform(rng, 300, -34, -4), input_dtype), "i": jnp.arange(3)}
  before = float(diag.underflow_fraction(g, "float16"))
  suggest = jax.jit(lambda g, h: diag.suggest_loss_scale(g, headroom=h))
  for headroom in (1.0, 8.0, 100.0):
    s = suggest(g, headroom)
    scale, amax = float(s.loss_scale), float(s.max_abs)
    assert amax == float(jnp.max(jnp.abs(g["w"]).astype(jnp.float32)))
    assert math.log2(scale).is_integer()
    assert scale * headroom * amax <= 65504.0 < 2 * scale * headroom * amax
    assert float(s.overflow_fraction) == 0.0
    assert float(s.underflow_fraction) == float(diag.underflow_fraction(g, "float16", scale))
    # Values already in float16 have underflowed before; others gain from S.
    assert float(s.underflow_fraction) < before or (input_dtype == F16 and before == 0.0)


def test_suggest_loss_scale_bounds():
  # All zeros: nothing can overflow, so the cap.
  assert float(diag.suggest_loss_scale(jnp.zeros(3)).loss_scale) == 2.0**24
  # Huge gradients need a scale below 1.
  s = diag.suggest_loss_scale(jnp.array([1e6, 1.0, jnp.inf]), headroom=1.0)
  assert float(s.loss_scale) == 2.0**-4 and float(s.max_abs) == 1e6
  assert float(s.overflow_fraction) == 0.0
  s = diag.suggest_loss_scale(jnp.array([1e6]), min_scale=1.0)
  assert float(s.loss_scale) == 1.0 and float(s.overflow_fraction) == 1.0
  # bfloat16 has float32's range: the cap.
  assert float(diag.suggest_loss_scale(jnp.array([3.0]), "bf16").loss_scale) == 2.0**24


# ---------------------------------------------------------------------------
# Bad input.


@pytest.mark.parametrize(
    "call, fragments",
    [
        (lambda: diag.gradient_histogram({"i": jnp.arange(3)}), ["floating-point", "int32"]),
        (lambda: diag.underflow_fraction({}), ["floating-point", "empty"]),
        (lambda: diag.suggest_loss_scale([None, "x"]), ["floating-point", "str"]),
        (lambda: diag.underflow_fraction(jnp.ones(2), "float32"), ["'float32'", "bfloat16"]),
        (lambda: diag.overflow_fraction(jnp.ones(2), "int8"), ["'int8'", "float16"]),
        (lambda: diag.gradient_histogram(jnp.ones(2), target_dtype="float17"), ["'float17'", "bf16"]),
        (lambda: diag.underflow_fraction(jnp.ones(2), "float16", 0.0), ["scale", "> 0"]),
        (lambda: diag.gradient_histogram(jnp.ones(2), scale=float("nan")), ["scale", "nan"]),
        (lambda: diag.gradient_histogram(jnp.ones(2), min_exponent=5, max_exponent=5), ["min_exponent=5"]),
        (lambda: diag.gradient_histogram(jnp.ones(2), min_exponent=-200), ["-149"]),
        (lambda: diag.suggest_loss_scale(jnp.ones(2), headroom=0.5), ["headroom", ">= 1"]),
        (lambda: diag.suggest_loss_scale(jnp.ones(2), min_scale=4.0, max_scale=2.0), ["min_scale"]),
        (lambda: diag.tensor_core_report("not a function", jnp.ones(2)), ["callable", "str"]),
        (lambda: diag.precision_audit(None), ["callable", "NoneType"]),
        (lambda: diag.tensor_core_report(jnp.dot, jnp.ones(2), jnp.ones(2), tensor_core_speedup=0), ["tensor_core_speedup"]),
        (lambda: diag.precision_audit(jnp.sum, jnp.ones(2), reduction_threshold=0), ["reduction_threshold"]),
        (lambda: diag.tensor_core_report(lambda i: i * 2, jnp.arange(3), backward=True), ["floating-point"]),
        (lambda: diag.pad_to_multiple(-1), ["n must be >= 0", "-1"]),
        (lambda: diag.pad_to_multiple(3.5), ["n must be an int", "3.5"]),
        (lambda: diag.pad_to_multiple(10, 0), ["multiple must be >= 1"]),
    ],
)
def test_bad_input_is_explained(call, fragments):
  with pytest.raises(ValueError) as info:
    call()
  for fragment in fragments:
    assert fragment in str(info.value)


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
  dot = lambda a, b: lax.dot_general(
      a, b, (((1,), (0,)), ((), ())), preferred_element_type=pref
  )
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
  conv = lambda a, b: lax.conv_general_dilated(
      a, b, (2, 2), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
  )
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
      a, b, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"), feature_group_count=8)
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
  assert all("test_diagnostics.py" in e.where for e in r.entries)


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
  assert diag.precision_audit(f, x[:, :1000]).ok
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


# ---------------------------------------------------------------------------
# Padding.


@pytest.mark.parametrize(
    "n, multiple, expected",
    [(0, 8, 0), (1, 8, 8), (8, 8, 8), (30, 8, 32), (50257, 64, 50304), (3, 16, 16), (7, 1, 7)],
)
def test_pad_to_multiple(n, multiple, expected):
  assert diag.pad_to_multiple(n, multiple) == expected
  assert isinstance(diag.pad_to_multiple(np.int64(n), multiple), int)


# ---------------------------------------------------------------------------
# Plots.


@pytest.fixture(scope="module")
def pyplot():
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  yield plt
  plt.close("all")


def test_plot_before_and_after_scaling_writes_png(pyplot, tmp_path):
  rng = np.random.default_rng(5)
  grads = {"act": jnp.asarray(_log_uniform(rng, 2000, -34, -6)), "n": jnp.arange(2)}
  ax = diag.plot_gradient_histogram(grads)  # scales (1, suggested)
  labels = [t.get_text() for t in ax.get_legend().get_texts()]
  suggested = float(diag.suggest_loss_scale(grads).loss_scale)
  assert any(l.startswith("scale 1:") for l in labels)
  assert any(l.startswith(f"scale {suggested:g}:") for l in labels)
  assert any("subnormal" in l for l in labels) and any("65504" in l for l in labels)
  # 60 bars per scale (half a bin wide: two scales side by side); all the
  # values lie inside the bins, so no hatched end bars.
  heights = [p.get_height() for p in ax.patches if p.get_width() == 0.5]
  assert len(heights) == 120
  for i, scale in enumerate((1.0, suggested)):
    h = diag.gradient_histogram(grads, scale=scale).total
    share = 100 * np.asarray(h.counts) / int(h.nonzero)
    np.testing.assert_allclose(heights[60 * i : 60 * (i + 1)], share)
  path = tmp_path / "hist.png"
  ax.figure.savefig(path)
  assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 5000
  pyplot.close(ax.figure)


def test_plot_given_histograms_and_an_axes(pyplot):
  fig, ax = pyplot.subplots()
  x = jnp.asarray(np.geomspace(1e-12, 1e3, 100))
  hists = [diag.gradient_histogram(x, target_dtype="bf16", scale=s) for s in (1.0, 8.0)]
  out = diag.plot_gradient_histogram(hists, ax=ax)
  assert out is ax and "bfloat16" in ax.get_title()
  labels = [t.get_text() for t in ax.get_legend().get_texts()]
  # bfloat16's range (2**-133 .. 3.4e38) lies outside the bins: no marks.
  assert [l.split(":")[0] for l in labels] == ["scale 1", "scale 8"]
  ax.cla()
  diag.plot_gradient_histogram(hists[1].total, ax=ax, title="one")
  assert ax.get_title() == "one" and len(ax.get_legend().get_texts()) == 1
  with pytest.raises(ValueError, match="scales"):
    diag.plot_gradient_histogram(hists[0], scales=(1, 2))
  pyplot.close(fig)


def test_plot_without_matplotlib_names_the_extra(monkeypatch):
  monkeypatch.setitem(sys.modules, "matplotlib", None)
  monkeypatch.setitem(sys.modules, "matplotlib.pyplot", None)
  with pytest.raises(ImportError, match=r"jmp_train\[plot\]"):
    diag.plot_gradient_histogram(jnp.ones(3))
