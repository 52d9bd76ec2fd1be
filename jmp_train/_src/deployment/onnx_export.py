"""A quantized model as an ONNX graph: QuantizeLinear / DequantizeLinear pairs, int8 weights.

The function's float32 jaxpr (on the example input's shapes) is walked
equation by equation and written with onnx's own builders (``onnx.helper``,
``onnx.numpy_helper``; opset 17). Each weight product becomes the placement
TensorRT takes: ``QuantizeLinear`` -> ``DequantizeLinear`` on the
activation (its calibrated scale, zero point 0), an int8 initializer for
the weight with a per-channel ``DequantizeLinear``, and the float
``MatMul`` / ``Conv``; at a SmoothQuant site, a ``Mul`` by :math:`1/s` (a
float initializer) before the ``QuantizeLinear``. Other supported
primitives: elementwise arithmetic, ``max`` / ``min`` (ReLU), ``exp``,
``tanh``, ``logistic``, ``neg``,
``rsqrt``, ``integer_pow``, ``reduce_sum``, ``reduce_max``, ``broadcast_in_dim``, ``reshape``, ``squeeze``,
``expand_dims``, ``transpose``, float casts; ``jit`` and ``custom_jvp`` calls
are followed.

onnxruntime on CPUs without VNNI: with its default graph optimizations it
fuses the QDQ pattern into a u8s8 kernel whose 16-bit intermediate sums
saturate; a session with ``graph_optimization_level = ORT_DISABLE_ALL``
runs the graph as written and agrees with :class:`QuantizedModel`.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend import core as jex_core

from jmp_train._src.autocast import scaled
from jmp_train._src.deployment import quantized as quantized_lib
from jmp_train._src.deployment import smoothquant as smooth_lib

__all__ = ["OPSET", "export_onnx"]

OPSET = 17
_ELEMENTWISE = {
  "add": "Add",
  "add_any": "Add",
  "sub": "Sub",
  "mul": "Mul",
  "div": "Div",
  "max": "Max",
  "min": "Min",
  "exp": "Exp",
  "tanh": "Tanh",
  "logistic": "Sigmoid",
  "neg": "Neg",
  "abs": "Abs",
  "sqrt": "Sqrt",
  "log": "Log",
}
_CALLS = {"pjit": "jaxpr", "jit": "jaxpr", "closed_call": "call_jaxpr", "custom_jvp_call": "call_jaxpr"}


def _onnx():
  try:
    import onnx
    from onnx import helper, numpy_helper
  except ImportError:  # pragma: no cover - depends on the environment
    raise ImportError("export_onnx needs onnx: pip install onnx (and onnxruntime to run the model).") from None
  return onnx, helper, numpy_helper


class _Graph:
  def __init__(self, model: quantized_lib.QuantizedModel, site_names: list[str]):
    self.onnx, self.helper, self.numpy_helper = _onnx()
    self.model = model
    self.nodes: list[Any] = []
    self.inits: list[Any] = []
    self.names: dict[Any, str] = {}
    self.param: set[Any] = set()  # vars computed from parameters alone
    self.weights: dict[Any, quantized_lib.Int8Weight] = {}
    self.values: dict[Any, Any] = {}  # the float parameters' values, by var
    self.sites = iter(site_names)
    self.count = 0

  def fresh(self, base: str) -> str:
    self.count += 1
    return f"{base}_{self.count}"

  def const(self, value: Any, base: str = "const") -> str:
    name = self.fresh(base)
    self.inits.append(self.numpy_helper.from_array(np.asarray(value), name))
    return name

  def node(self, op: str, inputs: list[str], **attrs: Any) -> str:
    out = self.fresh(op.lower())
    self.nodes.append(self.helper.make_node(op, inputs, [out], **attrs))
    return out

  def read(self, v: Any) -> str:
    if isinstance(v, jex_core.Literal):
      return self.const(np.asarray(v.val, np.asarray(v.val).dtype if np.ndim(v.val) else np.float32))
    return self.names[v]

  def onnx_value(self, v: Any) -> np.ndarray:
    """A float parameter's value (a kept site's weight)."""
    return np.asarray(self.values[v], np.float32)

  def is_param(self, v: Any) -> bool:
    return isinstance(v, jex_core.Literal) or v in self.param

  def walk(self, jaxpr: Any, consts: list[Any]) -> None:
    for v, c in zip(jaxpr.constvars, consts):
      self.names[v] = self.const(np.asarray(c), "const")
      self.param.add(v)
    for eqn in jaxpr.eqns:
      self.equation(eqn)

  def equation(self, eqn: Any) -> None:
    name = eqn.primitive.name
    if name in _CALLS:
      body = eqn.params[_CALLS[name]]
      inner = getattr(body, "jaxpr", body)
      consts = list(getattr(body, "consts", []))
      for v_in, v in zip(eqn.invars, inner.invars):
        self.names[v] = self.read(v_in)
        if self.is_param(v_in):
          self.param.add(v)
        for table in (self.weights, self.values):
          if not isinstance(v_in, jex_core.Literal) and v_in in table:
            table[v] = table[v_in]
      self.walk(inner, consts)
      for v_out, v in zip(eqn.outvars, inner.outvars):
        self.names[v_out] = self.read(v)
        if self.is_param(v):
          self.param.add(v_out)
      return
    for v in eqn.invars:
      aval = getattr(v, "aval", None)
      dtype = getattr(aval, "dtype", None)
      if dtype is not None and not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(f"export_onnx supports float computations only; {name} has an operand of dtype {dtype}.")
    if name in scaled.PRODUCTS and any(self.is_param(v) for v in eqn.invars[:2]):
      out = self.product(eqn)
    else:
      out = self.plain(eqn)
    self.names[eqn.outvars[0]] = out
    if all(self.is_param(v) for v in eqn.invars):
      self.param.add(eqn.outvars[0])

  def plain(self, eqn: Any) -> str:
    name, p = eqn.primitive.name, eqn.params
    ins = [self.read(v) for v in eqn.invars]
    if name in _ELEMENTWISE:
      return self.node(_ELEMENTWISE[name], ins)
    if name == "convert_element_type":
      return self.node("Identity", ins)
    if name == "rsqrt":
      return self.node("Reciprocal", [self.node("Sqrt", ins)])
    if name in ("reduce_sum", "reduce_max"):
      axes = self.const(np.array(p["axes"], np.int64), "axes")
      if name == "reduce_sum":  # opset 13 on: the axes as an input
        return self.node("ReduceSum", [ins[0], axes], keepdims=0)
      return self.node("ReduceMax", ins, axes=[int(a) for a in p["axes"]], keepdims=0)
    if name == "integer_pow":
      out = ins[0]
      for _ in range(int(p["y"]) - 1):
        out = self.node("Mul", [out, ins[0]])
      return out
    out_shape = tuple(int(d) for d in eqn.outvars[0].aval.shape)
    if name in ("reshape", "squeeze", "expand_dims"):
      return self.node("Reshape", [ins[0], self.const(np.array(out_shape, np.int64), "shape")])
    if name == "transpose":
      return self.node("Transpose", ins, perm=list(p["permutation"]))
    if name == "broadcast_in_dim":
      in_shape = tuple(int(d) for d in eqn.invars[0].aval.shape)
      keep = [1] * len(out_shape)
      for src, dst in enumerate(p["broadcast_dimensions"]):
        keep[dst] = in_shape[src]
      shaped = self.node("Reshape", [ins[0], self.const(np.array(keep, np.int64), "shape")])
      return self.node("Expand", [shaped, self.const(np.array(out_shape, np.int64), "shape")])
    raise ValueError(
      f"export_onnx cannot write the primitive {name!r}: it supports dense, convolution, elementwise "
      f"({', '.join(sorted(_ELEMENTWISE))}, rsqrt, integer_pow), sums and maxima over axes, broadcast, reshape "
      "and transpose operations."
    )

  def product(self, eqn: Any) -> str:
    site = next(self.sites)
    weight_side = 1 if eqn.invars[1] in self.param or isinstance(eqn.invars[1], jex_core.Literal) else 0
    act_v, w_v = eqn.invars[1 - weight_side], eqn.invars[weight_side]
    kept = site in self.model.kept
    if not kept and w_v not in self.weights:
      raise ValueError(
        f"export_onnx: the weight of the product at site {site!r} is computed from the parameters; "
        "the export writes weights used as they are stored (quantize gives those int8 codes)."
      )
    if kept:  # high precision: the float activation and weight
      x = self.read(act_v)
      if w_v not in self.values:
        raise ValueError(
          f"export_onnx: the weight of the kept product at site {site!r} is computed from the parameters; "
          "the export writes weights used as they are stored."
        )
      codes, w_scale = self.onnx_value(w_v), None
    else:
      w = self.weights[w_v]
      scale = self.model.scales[site]
      zero = self.const(np.int8(0), "zero_point")
      s_act = self.const(np.float32(scale), "act_scale")
      x = self.read(act_v)
      if site in self.model.smoothing:  # SmoothQuant: x / s, as x * (1/s)
        axes = self._smoothed_axes(eqn, 1 - weight_side, site)
        inv = smooth_lib.laid_out(smooth_lib.inverse(self.model.smoothing[site]), len(act_v.aval.shape), axes)
        x = self.node("Mul", [x, self.const(inv, "smooth_inverse")])
      x = self.node("QuantizeLinear", [x, s_act, zero])
      x = self.node("DequantizeLinear", [x, s_act, zero])
      codes, w_scale = np.asarray(w.codes), np.asarray(w.scale, np.float32)
    if eqn.primitive is lax.dot_general_p:
      (contract_l, contract_r), (batch_l, batch_r) = eqn.params["dimension_numbers"]
      ndim_act = len(act_v.aval.shape)
      if weight_side != 1 or batch_l or batch_r or tuple(contract_l) != (ndim_act - 1,) or tuple(contract_r) != (0,):
        raise ValueError(
          f"export_onnx writes a dense product as x @ W (x's last axis against W's first, no batch "
          f"axes); the product at site {site!r} has dimension numbers {eqn.params['dimension_numbers']}."
        )
      if codes.ndim != 2:
        raise ValueError(f"export_onnx: the dense weight at site {site!r} must be 2-D, got shape {codes.shape}.")
      w_out = self.read(w_v) if w_scale is None else self._dequantized(codes, w_scale.reshape(-1), 1, site)
      return self.node("MatMul", [x, w_out])
    return self._conv(eqn, x, codes, w_scale, site)

  def _smoothed_axes(self, eqn: Any, side: int, site: str) -> tuple[int, ...]:
    if eqn.primitive is not lax.dot_general_p:
      raise ValueError(f"export_onnx: the smoothed site {site!r} is not a dot_general.")
    contract, _ = eqn.params["dimension_numbers"]
    return tuple(int(a) for a in contract[side])

  def _dequantized(self, codes: np.ndarray, scale: np.ndarray, axis: int, site: str) -> str:
    q = self.const(codes.astype(np.int8), "weight_int8")
    s = self.const(scale.astype(np.float32), "weight_scale")
    # No zero point: 0, of the codes' type (int8).
    return self.node("DequantizeLinear", [q, s], axis=axis)

  def _conv(self, eqn: Any, x: str, codes: np.ndarray, w_scale: np.ndarray, site: str) -> str:
    p = eqn.params
    dn = p["dimension_numbers"]
    if any(d != 1 for d in p["lhs_dilation"]) or p["batch_group_count"] != 1:
      raise ValueError(f"export_onnx: the convolution at site {site!r} has input dilation or batch groups.")
    # To ONNX's layouts: input (N, C, spatial...), kernel (O, I, spatial...), output (N, C, spatial...).
    x = self.node("Transpose", [x], perm=list(dn.lhs_spec))
    kernel = np.transpose(codes, dn.rhs_spec)
    if w_scale is None:
      w = self.const(kernel.astype(np.float32), "weight")
    else:
      w = self._dequantized(kernel, np.transpose(w_scale, dn.rhs_spec).reshape(-1), 0, site)
    pads = [int(lo) for lo, _ in p["padding"]] + [int(hi) for _, hi in p["padding"]]
    out = self.node(
      "Conv",
      [x, w],
      strides=list(p["window_strides"]),
      pads=pads,
      dilations=list(p["rhs_dilation"]),
      group=int(p["feature_group_count"]),
    )
    return self.node("Transpose", [out], perm=list(np.argsort(dn.out_spec)))


def export_onnx(quantized: quantized_lib.QuantizedModel, example_input: jax.Array, path: Any) -> Any:
  """Writes a quantized model as an ONNX model (QDQ activations, int8 weight initializers).

  The graph is the function's, on ``example_input``'s shape: each weight
  product as ``QuantizeLinear`` -> ``DequantizeLinear`` on the activation
  (the calibrated scale, zero point 0), the weight's int8 codes as an
  initializer with a per-channel ``DequantizeLinear``, and a float
  ``MatMul`` / ``Conv``: the placement TensorRT accepts (opset 17). A
  SmoothQuant site's activation is first multiplied by :math:`1/s` (a
  ``Mul`` by a float initializer); its weight's codes are those of
  :math:`\\mathrm{diag}(s) W`. Run in onnxruntime with
  ``graph_optimization_level = ORT_DISABLE_ALL`` on CPUs without VNNI, whose
  fused u8s8 kernel saturates.

  Args:
    quantized: a :class:`~jmp_train.int8.QuantizedModel`.
    example_input: an input (its shape and dtype fix the graph's input).
    path: where to write the ``.onnx`` file.

  Returns:
    The ``onnx.ModelProto`` written (checked with ``onnx.checker``).

  Raises:
    TypeError: if ``quantized`` is not a quantized model.
    ValueError: naming an unsupported primitive or product layout.

  Examples:
    >>> import tempfile, os
    >>> from jmp_train.int8 import calibrate, quantize
    >>> def mlp(p, x):
    ...   return jax.nn.relu(x @ p["w1"]) @ p["w2"]
    >>> p = {"w1": jnp.ones((4, 8)) / 4, "w2": jnp.ones((8, 2)) / 8}
    >>> x = jnp.linspace(-1.0, 1.0, 12).reshape(3, 4)
    >>> model = quantize(mlp, p, calibrate(mlp, p, [x]))
    >>> proto = export_onnx(model, x, os.path.join(tempfile.mkdtemp(), "mlp.onnx"))
    >>> sorted({n.op_type for n in proto.graph.node})
    ['DequantizeLinear', 'Identity', 'MatMul', 'Max', 'QuantizeLinear']
  """
  if not isinstance(quantized, quantized_lib.QuantizedModel):
    raise TypeError(
      f"export_onnx needs a jmp_train.int8.QuantizedModel (from quantize), got {type(quantized).__name__}."
    )
  onnx, helper, _ = _onnx()
  example_input = jnp.asarray(example_input)
  params = quantized.params
  float_params = quantized_lib.dequantize_params(params)
  names = quantized_lib._site_names(quantized, jax.ShapeDtypeStruct(example_input.shape, example_input.dtype))
  closed = jax.make_jaxpr(quantized.apply_fn)(float_params, example_input)
  graph = _Graph(quantized, names)
  flat = jax.tree.leaves(params, is_leaf=quantized_lib._is_weight)
  jaxpr = closed.jaxpr
  param_vars, input_vars = jaxpr.invars[: len(flat)], jaxpr.invars[len(flat) :]
  for v, leaf in zip(param_vars, flat):
    graph.param.add(v)
    if quantized_lib._is_weight(leaf):
      graph.weights[v] = leaf
      # Its float value, for uses outside a product (dropped by _prune when there are none).
      graph.names[v] = graph.const(np.asarray(leaf.dequantize(), np.float32), "param")
    else:
      graph.names[v] = graph.const(np.asarray(leaf, np.float32), "param")
      graph.values[v] = leaf
  (x_var,) = input_vars
  graph.names[x_var] = "input"
  graph.walk(jaxpr, list(closed.consts))
  outputs = [graph.read(v) for v in jaxpr.outvars]
  out_nodes = [helper.make_node("Identity", [o], [f"output_{i}"]) for i, o in enumerate(outputs)]
  float_type = onnx.TensorProto.FLOAT
  g = helper.make_graph(
    graph.nodes + out_nodes,
    "jmp_train_int8",
    [helper.make_tensor_value_info("input", float_type, list(example_input.shape))],
    [
      helper.make_tensor_value_info(f"output_{i}", float_type, [int(d) for d in v.aval.shape])
      for i, v in enumerate(jaxpr.outvars)
    ],
    initializer=graph.inits,
  )
  proto = helper.make_model(g, opset_imports=[helper.make_opsetid("", OPSET)], producer_name="jmp_train")
  proto.ir_version = min(proto.ir_version, 8)
  # Unused nodes (a weight's float value no product outside needs) are dropped.
  proto = _prune(onnx, proto)
  onnx.checker.check_model(proto)
  onnx.save(proto, str(path))
  return proto


def _prune(onnx: Any, proto: Any) -> Any:
  """The model without nodes and initializers no output depends on."""
  graph = proto.graph
  needed = {o.name for o in graph.output}
  keep = []
  for node in reversed(list(graph.node)):
    if any(o in needed for o in node.output):
      keep.append(node)
      needed.update(node.input)
  keep.reverse()
  inits = [t for t in graph.initializer if t.name in needed]
  del graph.node[:]
  graph.node.extend(keep)
  del graph.initializer[:]
  graph.initializer.extend(inits)
  return proto
