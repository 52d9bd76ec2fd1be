"""INT8 deployment: calibration methods, quantized models, jax.export and ONNX (onnxruntime)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jmp_train.int8 as int8
from helpers.int8 import ConvNet


def _mlp(p, x):
  return jax.nn.relu(x @ p["w1"] + p["b1"]) @ p["w2"]


@pytest.fixture(scope="module")
def mlp():
  k1, k2 = jax.random.split(jax.random.key(0))
  p = {"w1": jax.random.normal(k1, (16, 32)) / 4, "b1": jnp.zeros(32), "w2": jax.random.normal(k2, (32, 4)) / 6}
  # Heavy-tailed activations: the methods disagree on where to clip.
  batches = [jax.random.laplace(jax.random.key(i), (128, 16)) for i in range(3)]
  return p, batches


@pytest.fixture(scope="module")
def conv():
  net = ConvNet()
  x = jax.random.normal(jax.random.key(1), (4, 8, 8, 3))
  params = net.init(jax.random.key(0), x)["params"]
  apply = lambda p, x: net.apply({"params": p}, x)  # noqa: E731
  model = int8.quantize(apply, params, int8.calibrate(apply, params, [x]))
  return apply, params, x, model


def test_calibration_methods_give_their_thresholds(mlp):
  p, batches = mlp
  cal = {m: int8.calibrate(_mlp, p, batches, m) for m in int8.CALIBRATION_METHODS}
  first = "dot_general"
  amax = float(max(jnp.abs(b).max() for b in batches))
  assert sorted(cal["max"].thresholds) == ["dot_general", "dot_general#1"]
  np.testing.assert_allclose(cal["max"].thresholds[first], amax, rtol=1e-6)
  np.testing.assert_allclose(cal["max"].scales[first], amax / 127, rtol=1e-6)
  # The percentile of |x|, to a bin of the 2048-bin histogram.
  want = np.percentile(np.abs(np.concatenate([np.asarray(b) for b in batches])), 99.0)
  p99 = int8.calibrate(_mlp, p, batches, "percentile", percentile=99.0).thresholds[first]
  assert abs(p99 - want) <= 1.5 * amax / 2048, (p99, want)
  # Entropy and MSE clip heavy tails below the amax, and differ from each other.
  for m in ("entropy", "mse"):
    assert 0.2 * amax < cal[m].thresholds[first] < amax, (m, cal[m].thresholds)
  assert cal["entropy"].thresholds[first] != cal["mse"].thresholds[first]


def test_calibration_errors(mlp):
  p, batches = mlp
  with pytest.raises(ValueError, match="Unknown calibration method 'minmax'"):
    int8.calibrate(_mlp, p, batches, "minmax")
  for bad in (0, 100, 120.0, "99.9"):
    with pytest.raises(ValueError, match=r"percentile must be a number in \(0, 100\)"):
      int8.calibrate(_mlp, p, batches, "percentile", percentile=bad)
  with pytest.raises(ValueError, match="no batches"):
    int8.calibrate(_mlp, p, [], "max")
  broken = [batches[0], batches[1].at[3, 2].set(jnp.nan)]
  with pytest.raises(ValueError, match="batch 1 gives a non-finite activation at site 'dot_general'"):
    int8.calibrate(_mlp, p, broken, "max")
  with pytest.raises(ValueError, match="no weight product"):
    int8.calibrate(lambda p, x: x * 2, p, batches)


def test_quantized_model_has_int8_weights_and_int8_products(conv):
  apply, params, x, model = conv
  kernel = model.params["Conv_0"]["kernel"]
  assert isinstance(kernel, int8.Int8Weight)
  assert kernel.codes.dtype == jnp.int8 and kernel.scale.dtype == jnp.float32 and kernel.scale.shape == (1, 1, 1, 8)
  assert model.params["Dense_0"]["bias"].dtype == jnp.float32  # biases stay float
  np.testing.assert_allclose(np.abs(kernel.codes).max(axis=(0, 1, 2)), 127)  # per channel
  text = jax.jit(model.inference_fn()).lower(model.params, model.scales, x).as_text()
  assert text.count("stablehlo.convolution") == 2 and text.count("xi8>, tensor<") >= 3
  assert "xf32>, tensor<3x3x3x8xf32>" not in text  # no float product of the first conv
  y, ref = model(x), apply(params, x)
  assert 0 < float(jnp.abs(y - ref).max()) < 0.05 * float(jnp.abs(ref).max())


def test_quantized_model_refuses_float_weights_and_a_foreign_calibration(conv, mlp):
  apply, params, x, model = conv
  floats = jax.tree.map(
    lambda w: w.dequantize() if isinstance(w, int8.Int8Weight) else w,
    model.params,
    is_leaf=lambda w: isinstance(w, int8.Int8Weight),
  )
  with pytest.raises(TypeError, match="float weights at"):
    int8.QuantizedModel(apply, floats, model.scales, model.weight_paths)
  p, batches = mlp
  with pytest.raises(ValueError, match="not this function's weight products"):
    int8.quantize(
      apply, params, int8.calibrate(_mlp, p, batches)._replace(inputs=jax.ShapeDtypeStruct(x.shape, x.dtype))
    )
  with pytest.raises(TypeError, match="Calibration"):
    int8.quantize(apply, params, {"scales": {}})


def test_jax_export_with_a_symbolic_batch_round_trips(conv):
  _, _, _, model = conv
  from jax import export

  spec = jax.ShapeDtypeStruct(export.symbolic_shape("b, 8, 8, 3"), jnp.float32)
  exported = export.export(jax.jit(model.inference_fn()))(model.params, model.scales, spec)
  restored = export.deserialize(exported.serialize())
  for n in (1, 5):
    x = jax.random.normal(jax.random.key(n), (n, 8, 8, 3))
    np.testing.assert_array_equal(restored.call(model.params, model.scales, x), model(x))


def test_onnx_export_runs_in_onnxruntime_and_agrees(conv, tmp_path):
  onnx = pytest.importorskip("onnx")
  ort = pytest.importorskip("onnxruntime")
  _, _, x, model = conv
  proto = int8.export_onnx(model, x, tmp_path / "net.onnx")
  ops = [n.op_type for n in proto.graph.node]
  assert ops.count("QuantizeLinear") == 3 and {"Conv", "MatMul", "DequantizeLinear"} <= set(ops)
  int8_inits = [t for t in proto.graph.initializer if t.data_type == onnx.TensorProto.INT8 and len(t.dims) > 1]
  assert len(int8_inits) == 3  # the three weights, as int8
  options = ort.SessionOptions()
  options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
  session = ort.InferenceSession(str(tmp_path / "net.onnx"), options, providers=["CPUExecutionProvider"])
  out = session.run(None, {"input": np.asarray(x)})[0]
  np.testing.assert_allclose(out, np.asarray(model(x)), atol=1e-5)


def test_onnx_export_names_an_unsupported_primitive(tmp_path):
  pytest.importorskip("onnx")
  f = lambda p, x: jnp.sort(x @ p["w"], axis=-1)  # noqa: E731
  p, x = {"w": jnp.ones((4, 3))}, jnp.ones((2, 4))
  model = int8.quantize(f, p, int8.calibrate(f, p, [x]))
  with pytest.raises(ValueError, match="cannot write the primitive 'sort'"):
    int8.export_onnx(model, x, tmp_path / "m.onnx")
