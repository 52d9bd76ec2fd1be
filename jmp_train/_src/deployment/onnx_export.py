"""A quantized model as an ONNX graph: QuantizeLinear / DequantizeLinear pairs, int8 weights.

The function's jaxpr (on the example input's shape and dtype) is walked
equation by equation and written with onnx's own builders (``onnx.helper``,
``onnx.numpy_helper``; opset 17). Each weight product becomes the placement
TensorRT takes: ``QuantizeLinear`` -> ``DequantizeLinear`` on the
activation (its calibrated scale, zero point 0), an int8 initializer for
the weight with a per-channel ``DequantizeLinear``, and the float
``MatMul`` (``x @ W``) / ``Einsum`` (any other ``dot_general``: a weight of
several axes, its codes reshaped to 2-D [contracting, channels] for the
per-axis ``DequantizeLinear`` and reshaped back) / ``Conv``; at a SmoothQuant
site, a ``Mul`` by :math:`1/s` (a float initializer) before the
``QuantizeLinear``. Other supported primitives: elementwise arithmetic on
floats and integers, ``max`` / ``min`` (ReLU), ``exp``, ``log``, ``tanh``,
``erf``, ``erfc``, ``logistic``, ``neg``, ``abs``, ``sqrt``, ``rsqrt``, ``square``,
``integer_pow``; the comparisons ``lt`` / ``le`` / ``gt`` / ``ge`` / ``eq`` /
``ne``, ``and`` / ``or`` / ``not`` / ``xor`` on booleans, ``select_n``
(``Where``); ``convert_element_type`` (``Cast``), ``stop_gradient``;
``reduce_sum``, ``reduce_max``; ``dot_general`` of two activations
(attention's scores and weighted sum: ``Einsum``); ``gather`` of rows along
one axis (an embedding lookup: ``Gather``, an int8 table through its
per-row ``DequantizeLinear``, out-of-range indices filled, clipped or
promised as the gather's mode says); ``iota`` (a constant);
``broadcast_in_dim``, ``reshape``, ``squeeze``, ``expand_dims``,
``transpose``; ``jit`` and ``custom_jvp`` calls are followed. The graph's
input has the example input's dtype (float features, int32 token ids).

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
  "erf": "Erf",
  "logistic": "Sigmoid",
  "neg": "Neg",
  "abs": "Abs",
  "sqrt": "Sqrt",
  "log": "Log",
  "stop_gradient": "Identity",
  "copy": "Identity",
}
_COMPARISONS = {"lt": "Less", "le": "LessOrEqual", "gt": "Greater", "ge": "GreaterOrEqual", "eq": "Equal"}
_LOGICAL = {"and": "And", "or": "Or", "not": "Not", "xor": "Xor"}
_WHERE_WIDER = {
  np.dtype(np.bool_): np.dtype(np.uint8),
  np.dtype(np.int8): np.dtype(np.int32),
  np.dtype(np.int16): np.dtype(np.int32),
  np.dtype(np.uint16): np.dtype(np.int32),
  np.dtype(np.uint32): np.dtype(np.int64),
  np.dtype(np.float16): np.dtype(np.float32),
}
_CALLS = {"pjit": "jaxpr", "jit": "jaxpr", "closed_call": "call_jaxpr", "custom_jvp_call": "call_jaxpr"}
_LETTERS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"


def _onnx():
  try:
    import onnx
    from onnx import helper, numpy_helper
  except ImportError:  # pragma: no cover - depends on the environment
    raise ImportError("export_onnx needs onnx: pip install onnx (and onnxruntime to run the model).") from None
  return onnx, helper, numpy_helper


def _einsum_equation(lhs_ndim: int, rhs_ndim: int, dimension_numbers: Any) -> str:
  """``dot_general``'s dimension numbers as an ``Einsum`` equation (batch, lhs free, rhs free)."""
  (contract_l, contract_r), (batch_l, batch_r) = dimension_numbers
  if lhs_ndim + rhs_ndim > len(_LETTERS):
    raise ValueError(f"export_onnx writes a dot_general of at most {len(_LETTERS)} axes in all as an Einsum.")
  letters = iter(_LETTERS)
  lhs: list[str | None] = [None] * lhs_ndim
  rhs: list[str | None] = [None] * rhs_ndim
  for a, b in [*zip(batch_l, batch_r), *zip(contract_l, contract_r)]:
    lhs[a] = rhs[b] = next(letters)
  free_l = [a for a in range(lhs_ndim) if lhs[a] is None]
  free_r = [b for b in range(rhs_ndim) if rhs[b] is None]
  for a in free_l:
    lhs[a] = next(letters)
  for b in free_r:
    rhs[b] = next(letters)
  out = [lhs[a] for a in batch_l] + [lhs[a] for a in free_l] + [rhs[b] for b in free_r]
  return f"{''.join(lhs)},{''.join(rhs)}->{''.join(out)}"  # type: ignore[arg-type]


def _gather_fill(dtype: np.dtype, fill: Any) -> np.ndarray:
  """The value ``gather`` writes for an out-of-range index (``fill_value``, or lax's default)."""
  if fill is not None:
    return np.asarray(fill, dtype)
  if np.issubdtype(dtype, np.inexact):
    return np.asarray(np.nan, dtype)
  if np.issubdtype(dtype, np.signedinteger):
    return np.asarray(np.iinfo(dtype).min, dtype)
  if np.issubdtype(dtype, np.unsignedinteger):
    return np.asarray(np.iinfo(dtype).max, dtype)
  return np.asarray(True, dtype)


class _Graph:
  def __init__(self, model: quantized_lib.QuantizedModel, site_names: list[str]):
    self.onnx, self.helper, self.numpy_helper = _onnx()
    self.model = model
    self.nodes: list[Any] = []
    self.inits: list[Any] = []
    self.names: dict[Any, str] = {}
    self.param: set[Any] = set()  # vars computed from parameters and constants alone
    # ... and from a parameter: autocast's weight-product operands (a product
    # with a constant alone, or a looked-up row, is not a weight product).
    self.from_params: set[Any] = set()
    self.weights: dict[Any, quantized_lib.Int8Weight] = {}
    self.values: dict[Any, Any] = {}  # the float parameters' values, by var
    self.dequantized: dict[int, str] = {}  # an int8 weight's float value, written once (a tied table)
    self.sites = iter(site_names)
    self.count = 0

  def fresh(self, base: str) -> str:
    self.count += 1
    return f"{base}_{self.count}"

  def const(self, value: Any, base: str = "const") -> str:
    name = self.fresh(base)
    self.inits.append(self.numpy_helper.from_array(np.array(value), name))
    return name

  def node(self, op: str, inputs: list[str], **attrs: Any) -> str:
    out = self.fresh(op.lower())
    self.nodes.append(self.helper.make_node(op, inputs, [out], **attrs))
    return out

  def read(self, v: Any) -> str:
    if isinstance(v, jex_core.Literal):
      return self.const(np.asarray(v.val, np.dtype(v.aval.dtype)))
    return self.names[v]

  def onnx_value(self, v: Any) -> np.ndarray:
    """A float parameter's value (a kept site's weight)."""
    return np.asarray(self.values[v], np.float32)

  def is_param(self, v: Any) -> bool:
    return isinstance(v, jex_core.Literal) or v in self.param

  def is_from_params(self, v: Any) -> bool:
    return not isinstance(v, jex_core.Literal) and v in self.from_params

  def walk(self, jaxpr: Any, consts: list[Any]) -> None:
    for v, c in zip(jaxpr.constvars, consts):
      self.names[v] = self.const(np.asarray(c), "const")
      self.param.add(v)
    for eqn in jaxpr.eqns:
      self.equation(eqn)

  def follow(self, v_from: Any, v_to: Any) -> None:
    """``v_to`` (a call's parameter or result) is ``v_from``: its name and what is known of it."""
    self.names[v_to] = self.read(v_from)
    if self.is_param(v_from):
      self.param.add(v_to)
    if self.is_from_params(v_from):
      self.from_params.add(v_to)
    for table in (self.weights, self.values):
      if not isinstance(v_from, jex_core.Literal) and v_from in table:
        table[v_to] = table[v_from]

  def equation(self, eqn: Any) -> None:
    name = eqn.primitive.name
    if name in _CALLS:
      body = eqn.params[_CALLS[name]]
      inner = getattr(body, "jaxpr", body)
      for v_in, v in zip(eqn.invars, inner.invars):
        self.follow(v_in, v)
      self.walk(inner, list(getattr(body, "consts", [])))
      for v_out, v in zip(eqn.outvars, inner.outvars):
        self.follow(v, v_out)
      return
    if len(eqn.outvars) != 1:
      raise ValueError(f"export_onnx cannot write the primitive {name!r}: it has {len(eqn.outvars)} results.")
    if name in scaled.PRODUCTS and any(self.is_from_params(v) for v in eqn.invars[:2]):
      out = self.product(eqn)
    elif name == "gather":
      out = self.gather(eqn)
    else:
      out = self.plain(eqn)
    self.names[eqn.outvars[0]] = out
    if all(self.is_param(v) for v in eqn.invars):
      self.param.add(eqn.outvars[0])
      if name != "gather" and any(self.is_from_params(v) for v in eqn.invars):
        self.from_params.add(eqn.outvars[0])

  def plain(self, eqn: Any) -> str:
    name, p = eqn.primitive.name, eqn.params
    ins = [self.read(v) for v in eqn.invars]
    dtypes = [np.dtype(v.aval.dtype) for v in eqn.invars]
    out_shape = tuple(int(d) for d in eqn.outvars[0].aval.shape)
    if name in _ELEMENTWISE:
      return self.node(_ELEMENTWISE[name], ins)
    if name in _COMPARISONS:
      return self.node(_COMPARISONS[name], ins)
    if name == "ne":
      return self.node("Not", [self.node("Equal", ins)])
    if name in _LOGICAL:
      if any(d != np.bool_ for d in dtypes):
        raise ValueError(
          f"export_onnx writes the primitive {name!r} on booleans only (ONNX's {_LOGICAL[name]}); it has "
          f"operands of dtypes {[str(d) for d in dtypes]}."
        )
      return self.node(_LOGICAL[name], ins)
    if name == "select_n":  # select_n(which, case_0, case_1, ...): case_which
      which, cases = ins[0], ins[1:]
      # onnxruntime's Where takes (u)int8 as uint8, 32- and 64-bit types: narrower cases go through a wider one.
      wide = _WHERE_WIDER.get(dtypes[1])
      if wide is not None:
        cases = [self.node("Cast", [c], to=self.helper.np_dtype_to_tensor_dtype(wide)) for c in cases]
      if dtypes[0] == np.bool_:
        out = self.node("Where", [which, cases[1], cases[0]])
      else:
        out = cases[0]
        for i, case in enumerate(cases[1:], start=1):
          is_i = self.node("Equal", [which, self.const(np.asarray(i, dtypes[0]), "case")])
          out = self.node("Where", [is_i, case, out])
      return out if wide is None else self.node("Cast", [out], to=self.helper.np_dtype_to_tensor_dtype(dtypes[1]))
    if name == "convert_element_type":
      new = np.dtype(p["new_dtype"])
      if new == dtypes[0]:
        return self.node("Identity", ins)
      return self.node("Cast", ins, to=self.helper.np_dtype_to_tensor_dtype(new))
    if name == "iota":
      dim, dtype = int(p["dimension"]), np.dtype(p["dtype"])
      line = np.arange(out_shape[dim], dtype=dtype).reshape([-1 if a == dim else 1 for a in range(len(out_shape))])
      return self.const(np.broadcast_to(line, out_shape), "iota")
    if name == "rsqrt":
      return self.node("Reciprocal", [self.node("Sqrt", ins)])
    if name == "square":
      return self.node("Mul", [ins[0], ins[0]])
    if name == "erfc":  # exact GELU's erfc(-x / sqrt(2)): 1 - erf
      return self.node("Sub", [self.const(np.asarray(1, dtypes[0]), "one"), self.node("Erf", ins)])
    if name in ("reduce_sum", "reduce_max"):
      axes = self.const(np.array(p["axes"], np.int64), "axes")
      if name == "reduce_sum":  # opset 13 on: the axes as an input
        return self.node("ReduceSum", [ins[0], axes], keepdims=0)
      return self.node("ReduceMax", ins, axes=[int(a) for a in p["axes"]], keepdims=0)
    if name == "integer_pow" and int(p["y"]) != 0:
      out = ins[0]
      for _ in range(abs(int(p["y"])) - 1):
        out = self.node("Mul", [out, ins[0]])
      return out if int(p["y"]) > 0 else self.node("Reciprocal", [out])
    if name == "dot_general":  # two activations (attention's scores, its weighted sum)
      equation = _einsum_equation(len(eqn.invars[0].aval.shape), len(eqn.invars[1].aval.shape), p["dimension_numbers"])
      return self.node("Einsum", ins, equation=equation)
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
      f"export_onnx cannot write the primitive {name!r}: it supports dense, einsum and convolution weight "
      f"products, dot_general of activations, elementwise ({', '.join(sorted(_ELEMENTWISE))}, erfc, rsqrt, "
      "square, integer_pow), comparisons, select_n, boolean and/or/not, casts, sums and maxima over axes, gathers of "
      "rows (embeddings), iota, broadcast, reshape and transpose operations."
    )

  def gather(self, eqn: Any) -> str:
    """A lookup of rows along one axis (``jnp.take``, ``table[ids]``) as ``Gather``."""
    p = eqn.params
    table_v, index_v = eqn.invars
    dn = p["dimension_numbers"]
    shape = tuple(int(d) for d in table_v.aval.shape)
    index_shape = tuple(int(d) for d in index_v.aval.shape)
    axis = int(dn.start_index_map[0]) if len(dn.start_index_map) == 1 else -1
    if (
      axis < 0
      or tuple(dn.collapsed_slice_dims) != (axis,)
      or dn.operand_batching_dims
      or dn.start_indices_batching_dims
      or not index_shape
      or index_shape[-1] != 1
      or tuple(p["slice_sizes"]) != tuple(1 if a == axis else d for a, d in enumerate(shape))
    ):
      raise ValueError(
        "export_onnx writes a gather of whole rows along one axis (an embedding lookup, jnp.take); this one "
        f"has dimension numbers {dn} and slice sizes {p['slice_sizes']} on an operand of shape {shape}."
      )
    if isinstance(table_v, jex_core.Literal) or table_v not in self.weights:
      table = self.read(table_v)
    else:  # an int8 table: its codes, dequantized per row
      w = self.weights[table_v]
      table = self._dequantized_weight(w)
    batch = index_shape[:-1]
    index_dtype = np.dtype(index_v.aval.dtype)
    ids = self.node("Reshape", [self.read(index_v), self.const(np.array(batch, np.int64), "shape")])
    mode = p["mode"]
    valid = None
    if mode == lax.GatherScatterMode.CLIP:
      ids = self.node("Max", [ids, self.const(np.asarray(0, index_dtype), "index")])
      ids = self.node("Min", [ids, self.const(np.asarray(shape[axis] - 1, index_dtype), "index")])
    elif mode == lax.GatherScatterMode.FILL_OR_DROP:
      low = self.node("GreaterOrEqual", [ids, self.const(np.asarray(0, index_dtype), "index")])
      high = self.node("Less", [ids, self.const(np.asarray(shape[axis], index_dtype), "index")])
      valid = self.node("And", [low, high])
      ids = self.node("Where", [valid, ids, self.const(np.asarray(0, index_dtype), "index")])
    out = self.node("Gather", [table, ids], axis=axis)
    if valid is not None:
      mask_shape = [1] * axis + list(batch) + [1] * (len(shape) - axis - 1)
      mask = self.node("Reshape", [valid, self.const(np.array(mask_shape, np.int64), "shape")])
      fill = _gather_fill(np.dtype(eqn.outvars[0].aval.dtype), p.get("fill_value"))
      out = self.node("Where", [mask, out, self.const(fill, "fill")])
    # Gather's layout (table axes before, index axes, table axes after) to lax's (offset_dims).
    ours = [("t", a) for a in range(axis)] + [("i", j) for j in range(len(batch))]
    ours += [("t", a) for a in range(axis + 1, len(shape))]
    kept_axes, batch_axes = iter([a for a in range(len(shape)) if a != axis]), iter(range(len(batch)))
    theirs = [("t", next(kept_axes)) if k in dn.offset_dims else ("i", next(batch_axes)) for k in range(len(ours))]
    perm = [ours.index(label) for label in theirs]
    return out if perm == sorted(perm) else self.node("Transpose", [out], perm=perm)

  def product(self, eqn: Any) -> str:
    site = next(self.sites)
    weight_side = 1 if self.is_from_params(eqn.invars[1]) else 0
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
      dims = eqn.params["dimension_numbers"]
      (contract_l, contract_r), (batch_l, batch_r) = dims
      ndim_act = len(act_v.aval.shape)
      plain = (
        weight_side == 1
        and not batch_l
        and not batch_r
        and tuple(contract_l) == (ndim_act - 1,)
        and tuple(contract_r) == (0,)
        and codes.ndim == 2
      )
      if plain:  # x @ W
        w_out = self.read(w_v) if w_scale is None else self._dequantized_weight(self.weights[w_v])
        return self.node("MatMul", [x, w_out])
      # Any other layout (DenseGeneral, einsum projections, a weight contracting its last axis): Einsum.
      w_out = self.read(w_v) if w_scale is None else self._dequantized_weight(self.weights[w_v])
      ins = [x, w_out] if weight_side == 1 else [w_out, x]
      lhs_v, rhs_v = eqn.invars[:2]
      equation = _einsum_equation(len(lhs_v.aval.shape), len(rhs_v.aval.shape), dims)
      return self.node("Einsum", ins, equation=equation)
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

  def _dequantized_weight(self, w: quantized_lib.Int8Weight) -> str:
    """An int8 weight of any rank in float: its codes through a per-axis (or per-tensor) ``DequantizeLinear``.

    The axes its scale varies along (its channels) are one axis of a 2-D view
    of the codes, [the axes a channel spans, the channel axes], computed here
    with numpy; a ``Reshape`` (and a ``Transpose`` where the channel axes are
    not the last ones) gives back the weight's layout. Written once per
    weight: a table both looked up and multiplied by (a tied head) is one
    int8 initializer.
    """
    if id(w) not in self.dequantized:
      self.dequantized[id(w)] = self._dequantize_codes(np.asarray(w.codes), np.asarray(w.scale, np.float32))
    return self.dequantized[id(w)]

  def _dequantize_codes(self, codes: np.ndarray, scale: np.ndarray) -> str:
    scale = np.asarray(scale, np.float32).reshape((1,) * (codes.ndim - np.ndim(scale)) + np.shape(scale))
    channels = [a for a in range(codes.ndim) if scale.shape[a] != 1]
    q_name = "weight_int8"
    if not channels:  # one scale
      q = self.const(codes.astype(np.int8), q_name)
      return self.node("DequantizeLinear", [q, self.const(scale.reshape(()), "weight_scale")])
    if len(channels) == 1:
      return self._dequantized(codes, scale.reshape(-1), channels[0], q_name)
    perm = [a for a in range(codes.ndim) if a not in channels] + channels
    moved = np.transpose(codes, perm)
    span = int(np.prod([codes.shape[a] for a in perm[: codes.ndim - len(channels)]]))
    flat = self._dequantized(moved.reshape(span, -1), np.transpose(scale, perm).reshape(-1), 1, q_name)
    out = self.node("Reshape", [flat, self.const(np.array(moved.shape, np.int64), "shape")])
    return out if perm == sorted(perm) else self.node("Transpose", [out], perm=[int(a) for a in np.argsort(perm)])

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

  The graph is the function's, on ``example_input``'s shape and dtype (its
  input ``"input"``: float features, or int32 token ids for a language
  model; static shapes, so onnxruntime refuses an input of another shape or
  dtype): each weight product as ``QuantizeLinear`` -> ``DequantizeLinear``
  on the activation (the calibrated scale, zero point 0), the weight's int8
  codes as an initializer with a per-channel ``DequantizeLinear``, and a
  float ``MatMul`` (``x @ W``), ``Einsum`` (any other ``dot_general``: a
  weight of several axes, as in attention's projections) or ``Conv``: the
  placement TensorRT accepts (opset 17). An int8 embedding table is an int8
  initializer too, dequantized per row before its ``Gather``. A SmoothQuant
  site's activation is first multiplied by :math:`1/s` (a ``Mul`` by a float
  initializer); its weight's codes are those of
  :math:`\\mathrm{diag}(s) W`. Products of two activations (attention's
  scores and weighted sum) are float ``Einsum`` s, as in the int8 model. Run
  in onnxruntime with ``graph_optimization_level = ORT_DISABLE_ALL`` on CPUs
  without VNNI, whose fused u8s8 kernel saturates.

  Args:
    quantized: a :class:`~jmp_train.int8.QuantizedModel`.
    example_input: an input (its shape and dtype fix the graph's input).
    path: where to write the ``.onnx`` file.

  Returns:
    The ``onnx.ModelProto`` written (checked with ``onnx.checker``).

  Raises:
    TypeError: if ``quantized`` is not a quantized model.
    ValueError: naming an unsupported primitive (or dtype of ``and`` /
      ``or`` / ``not``), gather or product layout.

  Examples:
    >>> import tempfile, os, onnx
    >>> from jmp_train.int8 import calibrate, quantize
    >>> def mlp(p, x):
    ...   return jax.nn.relu(x @ p["w1"]) @ p["w2"]
    >>> p = {"w1": jnp.ones((4, 8)) / 4, "w2": jnp.ones((8, 2)) / 8}
    >>> x = jnp.linspace(-1.0, 1.0, 12).reshape(3, 4)
    >>> model = quantize(mlp, p, calibrate(mlp, p, [x]))
    >>> proto = export_onnx(model, x, os.path.join(tempfile.mkdtemp(), "mlp.onnx"))
    >>> sorted({n.op_type for n in proto.graph.node})
    ['DequantizeLinear', 'Identity', 'MatMul', 'Max', 'QuantizeLinear']

    Token ids in, an embedding table and an einsum projection:

    >>> def lm(p, ids):
    ...   return jnp.einsum("btd,dhk->bthk", jnp.take(p["embed"], ids, axis=0), p["proj"])
    >>> p = {"embed": jnp.linspace(-1.0, 1.0, 40).reshape(10, 4), "proj": jnp.ones((4, 2, 3)) / 4}
    >>> ids = jnp.arange(6, dtype=jnp.int32).reshape(2, 3)
    >>> model = quantize(lm, p, calibrate(lm, p, [ids]))
    >>> proto = export_onnx(model, ids, os.path.join(tempfile.mkdtemp(), "lm.onnx"))
    >>> proto.graph.input[0].type.tensor_type.elem_type == onnx.TensorProto.INT32
    True
    >>> [n.op_type for n in proto.graph.node if n.op_type in ("Gather", "QuantizeLinear", "Einsum")]
    ['Gather', 'QuantizeLinear', 'Einsum']
  """
  if not isinstance(quantized, quantized_lib.QuantizedModel):
    raise TypeError(
      f"export_onnx needs a jmp_train.int8.QuantizedModel (from quantize), got {type(quantized).__name__}."
    )
  onnx, helper, _ = _onnx()
  example_input = jnp.asarray(example_input)
  params = quantized.params
  float_params = jax.eval_shape(quantized_lib.dequantize_params, params)  # the jaxpr needs shapes alone
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
      float_value = np.asarray(leaf.codes, np.float32) * np.asarray(leaf.scale, np.float32)  # as dequantize
      graph.names[v] = graph.const(float_value, "param")
    else:
      value = np.asarray(leaf)
      graph.names[v] = graph.const(
        value.astype(np.float32) if np.issubdtype(value.dtype, np.floating) else value, "param"
      )
      graph.values[v] = leaf
    graph.from_params.add(v)
  (x_var,) = input_vars
  graph.names[x_var] = "input"
  graph.walk(jaxpr, list(closed.consts))
  outputs = [graph.read(v) for v in jaxpr.outvars]
  out_nodes = [helper.make_node("Identity", [o], [f"output_{i}"]) for i, o in enumerate(outputs)]

  def elem_type(dtype):
    return helper.np_dtype_to_tensor_dtype(np.dtype(dtype))

  g = helper.make_graph(
    graph.nodes + out_nodes,
    "jmp_train_int8",
    [helper.make_tensor_value_info("input", elem_type(x_var.aval.dtype), list(example_input.shape))],
    [
      helper.make_tensor_value_info(f"output_{i}", elem_type(v.aval.dtype), [int(d) for d in v.aval.shape])
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
