"""Tests for the histograms, cast fractions and loss-scale suggestion of jmp_train.diagnostics."""

from __future__ import annotations

import functools
import math

import chex
import jax
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
      f16_tie,
      np.nextafter(np.float32(f16_tie), np.float32(1)),
      2.0**-24,
      2.0**-14,
      np.nextafter(np.float32(2.0**-14), np.float32(0)),
      65504.0,
      65519.99,
      65520.0,
      65536.0,
      -65520.0,
      3.38e38,
      3.3895e38,
      3.3961e38,
      3.4e38,  # bfloat16's largest ~3.3895e38
      0.0,
      -0.0,
      np.inf,
      -np.inf,
      np.nan,
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
    (
      lambda: diag.tensor_core_report(jnp.dot, jnp.ones(2), jnp.ones(2), tensor_core_speedup=0),
      ["tensor_core_speedup"],
    ),
    (lambda: diag.precision_audit(jnp.sum, jnp.ones(2), reduction_threshold=0), ["reduction_threshold"]),
    (lambda: diag.tensor_core_report(lambda i: i * 2, jnp.arange(3), backward=True), ["floating-point"]),
    (lambda: diag.pad_to_multiple(-1), ["n must be an int >= 0", "-1"]),
    (lambda: diag.pad_to_multiple(3.5), ["n must be an int", "3.5"]),
    (lambda: diag.pad_to_multiple(10, 0), ["multiple must be a positive int"]),
  ],
)
def test_bad_input_is_explained(call, fragments):
  with pytest.raises(ValueError) as info:
    call()
  for fragment in fragments:
    assert fragment in str(info.value)
