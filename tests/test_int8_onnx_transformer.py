"""INT8 ONNX export of a Transformer language model: int32 token ids, embeddings, einsum projections, attention."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import jmp_train.int8 as int8

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
from onnx import numpy_helper  # noqa: E402

VOCAB, WIDTH, HEADS, SEQ = 32, 16, 2, 8


class _Attention(nn.Module):
  """Causal self-attention with einsum projections (``btd,dhk->bthk``, ``bthk,hkd->btd``)."""

  @nn.compact
  def __call__(self, x):
    k_dim = WIDTH // HEADS
    q, k, v = (nn.Einsum((WIDTH, HEADS, k_dim), "btd,dhk->bthk", name=n)(x) for n in ("query", "key", "value"))
    scores = jnp.einsum("bqhk,bshk->bhqs", q, k) / np.sqrt(k_dim)
    causal = jnp.tril(jnp.ones((SEQ, SEQ), bool))
    weights = jax.nn.softmax(jnp.where(causal, scores, jnp.finfo(scores.dtype).min), axis=-1)
    mixed = jnp.einsum("bhqs,bshk->bqhk", weights, v)
    return nn.Einsum((HEADS, k_dim, WIDTH), "bthk,hkd->btd", name="out")(mixed)


class _LM(nn.Module):
  """Token embedding, one pre-norm block (RMSNorm, attention, LayerNorm, GELU MLP), the head tied to the table."""

  @nn.compact
  def __call__(self, tokens):
    embed = nn.Embed(VOCAB, WIDTH, name="embed")
    x = embed(tokens)
    x = x + _Attention(name="attn")(nn.RMSNorm(name="norm1")(x))
    h = nn.gelu(nn.Dense(4 * WIDTH, name="mlp_in")(nn.LayerNorm(name="norm2")(x)), approximate=False)
    x = x + nn.Dense(WIDTH, name="mlp_out")(h)
    x = nn.RMSNorm(name="final_norm")(x)
    return jnp.einsum("btd,vd->btv", x, embed.embedding)  # tied head: the table's rows are its channels


@pytest.fixture(scope="module")
def lm():
  net = _LM()
  tokens = jax.random.randint(jax.random.key(0), (16, SEQ), 0, VOCAB, jnp.int32)
  params = jax.jit(net.init)(jax.random.key(1), tokens)["params"]
  apply = lambda p, t: net.apply({"params": p}, t)  # noqa: E731
  calib = [jax.random.randint(jax.random.key(i), (16, SEQ), 0, VOCAB, jnp.int32) for i in (2, 3)]
  return apply, params, calib, tokens


def _session(path):
  options = ort.SessionOptions()
  options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
  return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def _producer(graph):
  return {o: n for n in graph.node for o in n.output}


def test_transformer_lm_exports_and_onnxruntime_agrees_with_the_int8_model(lm, tmp_path):
  apply, params, calib, tokens = lm
  model = int8.quantize(apply, params, int8.calibrate(apply, params, calib))
  weights = {p: w for p, w in zip(model.weight_paths, _int8_leaves(model.params))}
  assert "['embed']['embedding']" in weights and "['attn']['query']['kernel']" in weights
  proto = int8.export_onnx(model, tokens, tmp_path / "lm.onnx")
  graph = proto.graph
  (given,) = graph.input
  assert given.type.tensor_type.elem_type == onnx.TensorProto.INT32
  assert [d.dim_value for d in given.type.tensor_type.shape.dim] == [16, SEQ]

  # Every quantized weight is one int8 initializer (the tied table too, shared by Gather and the head).
  inits = {t.name: t for t in graph.initializer}
  int8_inits = [numpy_helper.to_array(t) for t in inits.values() if t.data_type == onnx.TensorProto.INT8 and t.dims]
  assert len(int8_inits) == len(weights) == 7
  for path, w in weights.items():
    codes = np.asarray(w.codes)
    assert any(a.size == codes.size and np.array_equal(a, codes.reshape(a.shape)) for a in int8_inits), path
  # ... and no float copy of one: float initializers hold biases, norms' scales, activation scales.
  floats = [t for t in inits.values() if t.data_type == onnx.TensorProto.FLOAT]
  assert max(int(np.prod(t.dims)) for t in floats) < min(np.asarray(w.codes).size for w in weights.values())

  # A QuantizeLinear -> DequantizeLinear on the activation of every weight product, none on attention's.
  producer = _producer(graph)

  def from_int8_weight(name):
    node = producer.get(name)
    while node is not None and node.op_type in ("Reshape", "Transpose"):
      node = producer.get(node.input[0])
    return node is not None and node.op_type == "DequantizeLinear" and node.input[0] in inits

  def quantized_activation(name):
    node = producer.get(name)
    return node.op_type == "DequantizeLinear" and producer[node.input[0]].op_type == "QuantizeLinear"

  products = [n for n in graph.node if n.op_type in ("MatMul", "Einsum")]
  weight_products = [n for n in products if any(from_int8_weight(i) for i in n.input)]
  assert len(weight_products) == len(model.scales) == 7  # q, k, v, out, mlp_in, mlp_out, head
  for n in weight_products:
    (act,) = [i for i in n.input if not from_int8_weight(i)]
    assert quantized_activation(act), n
  attention = [n for n in products if n not in weight_products]
  assert len(attention) == 2 and not any(quantized_activation(i) for n in attention for i in n.input)
  assert [n.op_type for n in graph.node].count("QuantizeLinear") == 7
  assert {"Gather", "Where", "Erf", "ReduceMax", "Exp"} <= {n.op_type for n in graph.node}

  session = _session(tmp_path / "lm.onnx")
  for batch in (tokens, calib[0]):
    ours = np.asarray(model(batch))
    theirs = session.run(None, {"input": np.asarray(batch)})[0]
    assert np.mean(theirs.argmax(-1) == ours.argmax(-1)) >= 0.999
    np.testing.assert_allclose(theirs, ours, atol=1e-5)
  # The int8 model is not the float one (the comparison above is of int8 computations).
  assert float(np.abs(ours - np.asarray(apply(params, calib[0]))).max()) > 1e-4

  # The graph's input is the example's shape and dtype: onnxruntime refuses others.
  with pytest.raises(Exception, match="(?i)invalid dimensions"):
    session.run(None, {"input": np.asarray(tokens[:2])})
  with pytest.raises(Exception, match="(?i)data type"):
    session.run(None, {"input": np.asarray(tokens, np.float32)})


def _projections(p, x):
  h = lax.dot_general(p["a"], x, (((0,), (2,)), ((), ())))  # the weight on the left: hkbt
  h = jax.nn.gelu(jnp.transpose(h, (2, 3, 0, 1)))
  y = jnp.einsum("bthk,hkd->btd", h, p["b"])  # two contracting axes
  return jnp.einsum("btd,de->bte", y, p["c"])


def test_einsum_weight_products_smoothed_kept_and_with_the_weight_first_agree(tmp_path):
  ka, kb, kc, kx = jax.random.split(jax.random.key(4), 4)
  p = {
    "a": jax.random.normal(ka, (6, 2, 4)) / 3,
    "b": jax.random.normal(kb, (2, 4, 6)) / 3,
    "c": jax.random.normal(kc, (6, 5)) / 3,
  }
  x = jax.random.normal(kx, (3, 4, 6)).at[..., 2].multiply(20.0)  # an outlier channel for SmoothQuant
  cal = int8.calibrate(_projections, p, [x], smoothquant=0.5)
  model = int8.quantize(_projections, p, cal, keep="bthk,hkd->btd")
  assert model.kept == ("bthk,hkd->btd/dot_general",) and "dot_general" in model.smoothing
  assert model.params["a"].scale.shape == (1, 2, 4)  # a channel per (head, feature)
  proto = int8.export_onnx(model, x, tmp_path / "proj.onnx")
  ops = [n.op_type for n in proto.graph.node]
  assert ops.count("QuantizeLinear") == 2 and ops.count("Einsum") == 2 and ops.count("MatMul") == 1
  int8_inits = [t for t in proto.graph.initializer if t.data_type == onnx.TensorProto.INT8 and t.dims]
  assert sorted(tuple(t.dims) for t in int8_inits) == [(6, 5), (6, 8)]  # "a" as [contracting, channels]
  theirs = _session(tmp_path / "proj.onnx").run(None, {"input": np.asarray(x)})[0]
  np.testing.assert_allclose(theirs, np.asarray(model(x)), atol=1e-5)


def _gathers(p, ids):
  rows = jnp.take(p["table"], ids, axis=0)  # the default mode: out-of-range ids give NaN rows
  columns = jnp.take(p["table"], ids, axis=1, mode="clip")  # along axis 1
  # The slice's axis first (Gather's layout transposed), ids in range as promised.
  inside = jnp.maximum(jnp.minimum(ids, 5), 0)
  dn = lax.GatherDimensionNumbers(offset_dims=(0,), collapsed_slice_dims=(0,), start_index_map=(0,))
  first = lax.gather(p["table"], inside[..., None], dn, (1, 6), mode="promise_in_bounds")
  return rows @ p["w"], rows, columns, first, ids * 2 - 1


@pytest.mark.parametrize("table_in_int8", [True, False])
def test_gathers_fill_clip_and_index_along_an_axis_as_jax_does(table_in_int8, tmp_path):
  table = jnp.linspace(-1.0, 1.0, 6 * 6).reshape(6, 6)
  p = {"table": table, "w": jnp.linspace(-0.5, 0.5, 6 * 3).reshape(6, 3)}
  ids = jnp.array([[0, 5, 2], [1, 3, 4]], jnp.int32)
  model = int8.quantize(_gathers, p, int8.calibrate(_gathers, p, [ids]))
  if not table_in_int8:  # a float table (as a kept site leaves it)
    model = int8.QuantizedModel(
      _gathers, {**model.params, "table": table}, model.scales, ("['w']",), model.kept, model.smoothing
    )
  assert isinstance(model.params["table"], int8.Int8Weight) == table_in_int8
  proto = int8.export_onnx(model, ids, tmp_path / "g.onnx")
  assert {"Gather", "Where", "Min", "Max", "Transpose"} <= {n.op_type for n in proto.graph.node}
  assert proto.graph.output[4].type.tensor_type.elem_type == onnx.TensorProto.INT32
  session = _session(tmp_path / "g.onnx")
  outside = jnp.array([[0, 7, 2], [-1, 3, 6]], jnp.int32)  # 7 and 6: past the end; -1: the last row
  for batch in (ids, outside):
    ours = [np.asarray(o) for o in model(batch)]
    theirs = session.run(None, {"input": np.asarray(batch)})
    for a, b in zip(theirs[1:], ours[1:]):
      np.testing.assert_array_equal(a, b)  # the looked-up values and the integer output, exactly
    if batch is ids:  # (a NaN row's int8 codes are each runtime's own)
      np.testing.assert_allclose(theirs[0], ours[0], atol=1e-6)
  assert np.isnan(ours[1][0, 1]).all() and np.isnan(ours[1][1, 2]).all()  # jax's fill, onnxruntime's too


def test_logical_operations_on_integers_are_named(tmp_path):
  f = lambda p, ids: (ids & 3).astype(jnp.float32)[:, :2] @ p["w"]  # noqa: E731
  p, ids = {"w": jnp.ones((2, 3))}, jnp.arange(6, dtype=jnp.int32).reshape(2, 3)
  model = int8.quantize(f, p, int8.calibrate(f, p, [ids]))
  with pytest.raises(ValueError, match="'and' on booleans only"):
    int8.export_onnx(model, ids, tmp_path / "m.onnx")


def _int8_leaves(params):
  is_w = lambda x: isinstance(x, int8.Int8Weight)  # noqa: E731
  return [w for w in jax.tree.leaves(params, is_leaf=is_w) if is_w(w)]
