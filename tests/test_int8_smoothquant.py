"""SmoothQuant in INT8 post-training quantization: factors, float identity, accuracy, exports."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jmp_train.int8 as int8
from helpers.int8 import ConvNet

_OUTLIERS = (3, 11)  # input channels 50x the others


def _mlp(p, x):
  return jax.nn.relu(x @ p["w1"] + p["b1"]) @ p["w2"]


@pytest.fixture(scope="module")
def outliers():
  k1, k2 = jax.random.split(jax.random.key(0))
  p = {"w1": jax.random.normal(k1, (16, 32)) / 4, "b1": jnp.zeros(32), "w2": jax.random.normal(k2, (32, 4)) / 6}
  gain = jnp.ones(16).at[jnp.array(_OUTLIERS)].set(50.0)
  batches = [jax.random.normal(jax.random.key(i + 1), (128, 16)) * gain for i in range(2)]
  x_test = jax.random.normal(jax.random.key(9), (256, 16)) * gain
  return p, batches, x_test


@pytest.fixture(scope="module")
def smoothed(outliers):
  p, batches, _ = outliers
  cal = int8.calibrate(_mlp, p, batches, smoothquant=0.5)
  return cal, int8.quantize(_mlp, p, cal)


def _activations(p, batches):
  """Each site's activation over the batches: x, then the hidden layer."""
  x = jnp.concatenate(batches)
  return {"dot_general": x, "dot_general#1": jax.nn.relu(x @ p["w1"] + p["b1"])}


def test_smoothing_factors_are_positive_finite_and_the_papers(outliers, smoothed):
  p, batches, _ = outliers
  cal, _ = smoothed
  assert cal.smoothquant == 0.5 and sorted(cal.smoothing) == ["dot_general", "dot_general#1"]
  acts = _activations(p, batches)
  for site, w in (("dot_general", p["w1"]), ("dot_general#1", p["w2"])):
    s = cal.smoothing[site]
    assert s.dtype == np.float32 and s.shape == (w.shape[0],)
    assert np.all(np.isfinite(s)) and np.all(s > 0)
    a, w_max = np.abs(np.asarray(acts[site])).max(0), np.abs(np.asarray(w)).max(1)
    want = np.where((a > 0) & (w_max > 0), np.sqrt(a) / np.sqrt(np.where(w_max > 0, w_max, 1.0)), 1.0)
    np.testing.assert_allclose(s, want, rtol=1e-5)
  assert set(np.argsort(cal.smoothing["dot_general"])[-2:]) == set(_OUTLIERS)
  # A channel that is always 0 keeps s = 1; alpha = 1 scales every channel's amax to 1.
  zeroed = [b.at[:, 0].set(0.0) for b in batches]
  full = int8.calibrate(_mlp, p, zeroed, smoothquant=1.0)
  assert full.smoothing["dot_general"][0] == 1.0
  np.testing.assert_allclose(full.smoothing["dot_general"][1:], np.abs(np.concatenate(zeroed))[:, 1:].max(0), rtol=0)
  np.testing.assert_allclose(full.amax["dot_general"], 1.0, rtol=1e-6)


def test_smoothing_keeps_the_float_product_and_calibrates_the_smoothed_activation(outliers, smoothed):
  p, batches, _ = outliers
  cal, model = smoothed
  acts = _activations(p, batches)
  for site, w, key in (("dot_general", p["w1"], "w1"), ("dot_general#1", p["w2"], "w2")):
    s = jnp.asarray(cal.smoothing[site])
    x = acts[site]
    # X/s . (diag(s) W) = X W, in float.
    np.testing.assert_allclose((x / s) @ (w * s[:, None]), x @ w, rtol=1e-5, atol=1e-5 * float(jnp.abs(x @ w).max()))
    # The model's weight holds diag(s) W (to its int8 step), and the threshold is X/s's amax.
    folded = model.params[key]
    assert folded.codes.dtype == jnp.int8
    assert np.all(np.abs(folded.dequantize() - w * s[:, None]) <= folded.scale / 2 + 1e-6)
    want = float(jnp.abs(x * (1 / s)).max())
    np.testing.assert_allclose(cal.amax[site], want, rtol=1e-6)
    assert cal.thresholds[site] == cal.amax[site]
  assert float(jnp.abs(acts["dot_general"]).max()) > 5 * cal.amax["dot_general"]  # the outliers moved out
  # A histogram method's threshold is a percentile of |X/s| too (to a bin of the 2048-bin histogram).
  pct = int8.calibrate(_mlp, p, batches, "percentile", percentile=99.0, smoothquant=0.5)
  np.testing.assert_array_equal(pct.smoothing["dot_general"], cal.smoothing["dot_general"])
  x = np.abs(np.asarray(acts["dot_general"] * (1 / jnp.asarray(cal.smoothing["dot_general"]))))
  assert abs(pct.thresholds["dot_general"] - np.percentile(x, 99.0)) <= 1.5 * x.max() / 2048
  # The report quantizes X/s: max calibration on the same batches clips nothing.
  report = int8.quantization_report(_mlp, p, cal, batches)
  assert all(r.clipped == 0.0 for r in report.values()), report


def test_smoothquant_beats_max_calibration_with_outlier_channels(outliers, smoothed):
  p, batches, x = outliers
  _, model = smoothed
  plain = int8.quantize(_mlp, p, int8.calibrate(_mlp, p, batches, "max"))
  ref = _mlp(p, x)

  def error(y):
    return float(jnp.abs(y - ref).mean() / jnp.abs(ref).mean())

  assert error(model(x)) < error(plain(x)), (error(model(x)), error(plain(x)))
  text = jax.jit(model.inference_fn()).lower(model.params, model.scales, x).as_text()
  assert text.count("xi8>, tensor<") >= 2  # both products on int8 codes
  assert "tensor<256x16xf32>, tensor<16x32xf32>" not in text


def test_onnx_export_of_smoothquant_agrees_with_onnxruntime(outliers, smoothed, tmp_path):
  pytest.importorskip("onnx")
  ort = pytest.importorskip("onnxruntime")
  from onnx import numpy_helper

  _, _, x = outliers
  _, model = smoothed
  proto = int8.export_onnx(model, x, tmp_path / "smooth.onnx")
  made_by = {o: n for n in proto.graph.node for o in n.output}
  inits = {t.name: numpy_helper.to_array(t) for t in proto.graph.initializer}
  quantizes = [n for n in proto.graph.node if n.op_type == "QuantizeLinear"]
  assert len(quantizes) == 2
  for site, q in zip(("dot_general", "dot_general#1"), quantizes):
    mul = made_by[q.input[0]]
    assert mul.op_type == "Mul"
    inverse = next(inits[i] for i in mul.input if i in inits)
    assert inverse.dtype == np.float32
    np.testing.assert_array_equal(inverse.reshape(-1), np.float32(1) / model.smoothing[site])
  options = ort.SessionOptions()
  options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
  session = ort.InferenceSession(str(tmp_path / "smooth.onnx"), options, providers=["CPUExecutionProvider"])
  out, ours = session.run(None, {"input": np.asarray(x)})[0], np.asarray(model(x))
  close = np.isclose(out, ours, rtol=1e-5, atol=1e-5 * np.abs(ours).max())
  assert close.mean() >= 0.999, close.mean()
  assert np.mean(out.argmax(-1) == ours.argmax(-1)) >= 0.999


def test_jax_export_of_smoothquant_round_trips(smoothed):
  _, model = smoothed
  from jax import export

  spec = jax.ShapeDtypeStruct(export.symbolic_shape("b, 16"), jnp.float32)
  restored = export.deserialize(
    export.export(jax.jit(model.inference_fn()))(model.params, model.scales, spec).serialize()
  )
  for n in (1, 7):
    x = jax.random.normal(jax.random.key(n), (n, 16)) * 20
    np.testing.assert_array_equal(restored.call(model.params, model.scales, x), model(x))


def test_smoothquant_alpha_out_of_range_and_nothing_to_smooth(outliers):
  p, batches, _ = outliers
  for bad in (-0.1, 1.5, float("nan"), "0.5", True):
    with pytest.raises(ValueError, match=r"alpha: a number in \[0, 1\]"):
      int8.calibrate(_mlp, p, batches, smoothquant=bad)
  conv = lambda p, x: jax.lax.conv_general_dilated(x, p["k"], (1, 1), "SAME")  # noqa: E731
  k, x = {"k": jnp.ones((2, 3, 3, 3))}, jnp.ones((1, 3, 5, 5))
  with pytest.raises(ValueError, match="no weight product to smooth"):
    int8.calibrate(conv, k, [x], smoothquant=0.5)


def test_convolutions_shared_and_kept_weights_stay_unsmoothed(outliers):
  net = ConvNet()
  x = jax.random.normal(jax.random.key(1), (2, 8, 8, 3))
  params = net.init(jax.random.key(0), x)["params"]
  apply = lambda p, x: net.apply({"params": p}, x)  # noqa: E731
  assert list(int8.calibrate(apply, params, [x], smoothquant=0.5).smoothing) == ["ConvNet/Dense_0/dot_general"]
  # A weight two products share cannot hold two sets of factors.
  shared = lambda p, x: (x @ p["w"]) @ p["w"] + x @ p["v"]  # noqa: E731
  pw = {"w": jnp.eye(4) * 0.5, "v": jnp.ones((4, 4))}
  assert list(int8.calibrate(shared, pw, [jnp.ones((2, 4))], smoothquant=0.5).smoothing) == ["dot_general#2"]
  # A site kept in high precision keeps its float weight, unsmoothed.
  p, batches, _ = outliers
  cal = int8.calibrate(_mlp, p, batches, smoothquant=0.5)
  model = int8.quantize(_mlp, p, cal, keep="dot_general")
  assert list(model.smoothing) == ["dot_general#1"] and model.kept == ("dot_general",)
  np.testing.assert_array_equal(model.params["w1"], p["w1"])
  ref = _mlp(p, batches[0])
  assert float(jnp.abs(model(batches[0]) - ref).max()) < 0.05 * float(jnp.abs(ref).max())


def test_models_of_one_function_share_their_compiled_inference(outliers, smoothed):
  # One model per calibration method: the same function with other scales
  # and codes, compiled once per input shape; a smoothed model (its factors
  # are constants of its function) has its own.
  p, batches, x = outliers
  models = [int8.quantize(_mlp, p, int8.calibrate(_mlp, p, batches, method=m)) for m in ("max", "mse")]
  assert models[0]._call is models[1]._call
  before = models[0]._call._cache_size()
  outs = [np.asarray(m(x)) for m in models]
  assert models[0]._call._cache_size() <= before + 1  # one compilation for both
  # Each model's own scales: the outputs differ as the scales do.
  assert models[0].scales != models[1].scales and not np.array_equal(outs[0], outs[1])
  assert smoothed[1]._call is not models[0]._call
