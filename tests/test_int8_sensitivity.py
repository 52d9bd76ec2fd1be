"""INT8 tools: keep= rules, the sensitivity scan, per-site diagnostics, tables, more ONNX operations."""

import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jmp_train.int8 as int8


def _dtypes_of_products(text: str) -> list[str]:
  """The left operand's element type of every dot_general / convolution of a StableHLO text."""
  return re.findall(r"stablehlo\.(?:dot_general|convolution)[^\n]*:\s*\(tensor<[^>]*x(\w+)>", text)


def _scoped_mlp(p, x):
  with jax.named_scope("body"):
    h = jax.nn.relu(x @ p["w1"])
  with jax.named_scope("head"):
    return h @ p["w2"]


@pytest.fixture(scope="module")
def mlp():
  k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
  p = {"w1": jax.random.normal(k1, (16, 32)) / 4, "w2": jax.random.normal(k2, (32, 4)) / 6}
  x = jax.random.normal(k3, (64, 16))
  return p, x, int8.calibrate(_scoped_mlp, p, [x])


def test_keep_leaves_the_named_sites_float(mlp):
  p, x, cal = mlp
  assert sorted(cal.scales) == ["body/dot_general", "head/dot_general"]
  model = int8.quantize(_scoped_mlp, p, cal, keep="head")  # a scope's name
  assert model.kept == ("head/dot_general",) and list(model.scales) == ["body/dot_general"]
  assert isinstance(model.params["w1"], int8.Int8Weight) and model.params["w2"].dtype == jnp.float32
  text = jax.jit(model.inference_fn()).lower(model.params, model.scales, x).as_text()
  assert _dtypes_of_products(text) == ["i8", "f32"]
  full = int8.quantize(_scoped_mlp, p, cal)
  assert _dtypes_of_products(jax.jit(full.inference_fn()).lower(full.params, full.scales, x).as_text()) == ["i8"] * 2
  # Only the first product is quantized: closer to float than the fully quantized model.
  ref = _scoped_mlp(p, x)
  err = lambda m: float(jnp.abs(m(x) - ref).max())  # noqa: E731
  assert 0 < err(model) < err(full)
  # The same through calibrate(keep=...), with a glob over site names.
  cal_kept = int8.calibrate(_scoped_mlp, p, [x], keep="head/*")
  assert cal_kept.kept == ("head/dot_general",) and list(cal_kept.scales) == ["body/dot_general"]
  np.testing.assert_array_equal(int8.quantize(_scoped_mlp, p, cal_kept)(x), model(x))


def test_keep_rules_that_match_nothing_or_are_not_strings_are_refused(mlp):
  p, x, cal = mlp
  with pytest.raises(ValueError, match=r"keep rule 'lm_head' matches no weight product.*'body/dot_general'"):
    int8.quantize(_scoped_mlp, p, cal, keep=["head", "lm_head"])
  with pytest.raises(ValueError, match="keep rule 'stem'"):
    int8.calibrate(_scoped_mlp, p, [x], keep="stem")
  with pytest.raises(TypeError, match="keep must be a site name or glob pattern"):
    int8.quantize(_scoped_mlp, p, cal, keep=3)


def _outlier_mlp():
  """Input feature 0 has huge outliers: the first product's static per-tensor scale crushes the rest."""
  k1, k2, k3 = jax.random.split(jax.random.key(1), 3)
  p = {"w1": jax.random.normal(k1, (16, 32)) / 4, "w2": jax.random.normal(k2, (32, 4)) / 6}
  x = jax.random.normal(k3, (128, 16)).at[::16, 0].set(300.0)
  return p, x


def test_sensitivity_ranks_the_costly_site_first_and_proposes_keeping_it():
  p, x = _outlier_mlp()
  f = lambda p, x: _scoped_mlp(p, x)  # noqa: E731
  cal = int8.calibrate(f, p, [x])
  ref = f(p, x)
  calls = []

  def neg_error(predict):  # higher is better
    calls.append(1)
    return -jnp.abs(predict(x) - ref).mean()

  quantized = -float(jnp.abs(int8.quantize(f, p, cal)(x) - ref).mean())
  keep_body = -float(jnp.abs(int8.quantize(f, p, cal, keep="body")(x) - ref).mean())
  assert quantized < keep_body  # the premise: the outliers' site costs the most
  target = (quantized + keep_body) / 2
  scan = int8.sensitivity(f, p, cal, neg_error, target=target)
  assert isinstance(scan, int8.Sensitivity)
  assert scan.ranking == ("body/dot_general", "head/dot_general")
  assert scan.by_site["body/dot_general"] < scan.by_site["head/dot_general"] < scan.float_metric
  np.testing.assert_allclose(scan.quantized_metric, quantized, rtol=1e-5)
  assert scan.keep == ("body/dot_general",) and scan.met and scan.target == target
  np.testing.assert_allclose(scan.proposed_metric, keep_body, rtol=1e-5)
  assert len(calls) == 5  # float, all int8, each site alone, the proposal
  # An unreachable target keeps every site (the float function); lower-is-better targets too.
  scan = int8.sensitivity(f, p, cal, lambda predict: jnp.abs(predict(x) - ref).mean(), higher_is_better=False)
  assert scan.keep == scan.ranking and scan.met and scan.proposed_metric == scan.float_metric


def test_sensitivity_errors(mlp):
  p, x, cal = mlp
  with pytest.raises(TypeError, match="must return a number"):
    int8.sensitivity(_scoped_mlp, p, cal, lambda predict: "good")
  with pytest.raises(ValueError, match="calibrate without keep"):
    int8.sensitivity(_scoped_mlp, p, int8.calibrate(_scoped_mlp, p, [x], keep="head"), lambda f: 0.0)
  with pytest.raises(TypeError, match="Calibration"):
    int8.sensitivity(_scoped_mlp, p, {}, lambda f: 0.0)


def test_quantization_report_counts_clipped_values_and_measures_sqnr():
  p, x = _outlier_mlp()
  percentile = int8.calibrate(_scoped_mlp, p, [x], "percentile", percentile=99.0)
  report = int8.quantization_report(_scoped_mlp, p, percentile, [x[:64], x[64:]])
  assert list(report) == ["body/dot_general", "head/dot_general"]
  body = report["body/dot_general"]
  assert isinstance(body, int8.SiteQuantization) and body.scale == percentile.scales["body/dot_general"]
  # The reference: numpy over the same activation (the input) at the same scale.
  delta = np.float32(percentile.scales["body/dot_general"])
  r = np.round(np.asarray(x) / delta)
  np.testing.assert_allclose(body.clipped, np.mean((r > 127) | (r < -128)), rtol=1e-6)
  assert 0.005 < body.clipped < 0.02  # the 99th percentile clips about 1%
  x_hat = np.clip(r, -128, 127) * delta
  want = 10 * np.log10(np.sum(np.asarray(x) ** 2) / np.sum((np.asarray(x) - x_hat) ** 2))
  np.testing.assert_allclose(body.activation_sqnr_db, want, rtol=1e-4)
  assert 30 < body.weight_sqnr_db < 60  # per-channel int8 weights: about 6 dB per bit
  # With the max calibration nothing clips on the calibration data, and the outliers cost SQNR.
  by_max = int8.quantization_report(_scoped_mlp, p, int8.calibrate(_scoped_mlp, p, [x]), [x])
  assert by_max["body/dot_general"].clipped == 0.0 and by_max["head/dot_general"].clipped == 0.0
  assert by_max["head/dot_general"].output_sqnr_db > 25
  with pytest.raises(ValueError, match="needs batches"):
    int8.quantization_report(_scoped_mlp, p, percentile, [])


class _Embedder(nn.Module):
  @nn.compact
  def __call__(self, tokens):
    h = nn.Embed(32, 16, name="embed")(tokens)
    return nn.Dense(8, name="head")(h)


def test_embedding_tables_are_stored_in_int8_one_scale_per_row():
  model = _Embedder()
  tokens = jax.random.randint(jax.random.key(0), (4, 6), 0, 32)
  params = model.init(jax.random.key(1), tokens)["params"]
  f = lambda p, t: model.apply({"params": p}, t)  # noqa: E731
  q = int8.quantize(f, params, int8.calibrate(f, params, [tokens]))
  table = q.params["embed"]["embedding"]
  assert isinstance(table, int8.Int8Weight) and table.codes.dtype == jnp.int8 and table.scale.shape == (32, 1)
  np.testing.assert_allclose(np.abs(table.codes).max(axis=1), 127)
  assert q.params["head"]["bias"].dtype == jnp.float32  # a bias stays float
  ref = f(params, tokens)
  assert 0 < float(jnp.abs(q(tokens) - ref).max()) < 0.03 * float(jnp.abs(ref).max())


class _NormNet(nn.Module):
  """Batch norm (rsqrt of its statistics), a mean over positions (reduce_sum) and two dense layers."""

  @nn.compact
  def __call__(self, x):
    x = nn.relu(nn.BatchNorm(use_running_average=True)(nn.Dense(16, name="body")(x)))
    return nn.Dense(4, name="head")(jnp.mean(x, axis=1))


def test_onnx_export_with_normalization_a_mean_and_a_kept_site_agrees_with_onnxruntime(tmp_path):
  onnx = pytest.importorskip("onnx")
  ort = pytest.importorskip("onnxruntime")
  net = _NormNet()
  x = jax.random.normal(jax.random.key(0), (3, 5, 8))
  variables = net.init(jax.random.key(1), x)
  stats = jax.tree.map(lambda v: v + 0.5, variables["batch_stats"])  # non-trivial mean and variance
  f = lambda p, x: net.apply({"params": p, "batch_stats": stats}, x)  # noqa: E731
  model = int8.quantize(f, variables["params"], int8.calibrate(f, variables["params"], [x]), keep="head")
  proto = int8.export_onnx(model, x, tmp_path / "net.onnx")
  ops = [n.op_type for n in proto.graph.node]
  assert ops.count("QuantizeLinear") == 1 and {"ReduceSum", "Reciprocal", "Sqrt"} <= set(ops)
  int8_weights = [t for t in proto.graph.initializer if t.data_type == onnx.TensorProto.INT8 and len(t.dims) > 1]
  assert len(int8_weights) == 1  # the kept head's weight stays float
  options = ort.SessionOptions()
  options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
  session = ort.InferenceSession(str(tmp_path / "net.onnx"), options, providers=["CPUExecutionProvider"])
  np.testing.assert_allclose(session.run(None, {"input": np.asarray(x)})[0], np.asarray(model(x)), atol=1e-5)


def test_entropy_calibration_is_not_pulled_down_by_relus_zeros():
  # Half the values are exact zeros (a ReLU's output): counted as they are, that spike makes the
  # KL divergence favour clipping at about half the amax; NVIDIA's reference counts the zero bin
  # as its neighbour, and the threshold lands near the half-normal's tail (about 3.6 of 4.2 here).
  x = jax.nn.relu(jax.random.normal(jax.random.key(0), (4096, 16)))
  f = lambda p, x: x @ p["w"]  # noqa: E731
  cal = int8.calibrate(f, {"w": jnp.ones((16, 2))}, [x], "entropy")
  amax = float(jnp.abs(x).max())
  assert 0.75 * amax < cal.thresholds["dot_general"] < amax, (cal.thresholds, amax)
