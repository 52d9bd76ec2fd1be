"""The interpreter behind :func:`jmp_train.autocast`: tags, rules, evaluation.

Values carry a tag (constant, parameter, half-precision activation, float32
activation) that decides which dtype an "infer" op casts its operands to;
:func:`eval_jaxpr` evaluates a jaxpr equation by equation, binding ordinary
primitives, so the enclosing trace (jit, grad, vmap...) sees plain JAX ops.
Calls and control flow are handled in ``calls``, registered in
``HANDLERS``.
"""

from __future__ import annotations

import dataclasses
import fnmatch
from typing import Any, Callable, Sequence

import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend import core as jex_core
from jax.extend import source_info_util

from jmp_train._src.autocast import scaled
from jmp_train._src.dtypes import is_floating_dtype
from jmp_train._src.policy import policy as policy_lib


_F32 = np.dtype(jnp.float32)

# Tags of floating-point values, weakest first. A value's tag decides which
# dtype an "infer" op casts its operands to:
# CONST: literals, constants and integers converted to float: take any dtype.
# PARAM: parameters and values computed from parameters alone: they stay in
#   param_dtype until they meet an activation (then take its dtype).
# HALF: activations in the compute dtype.
# FLOAT32: activations in a float32 region (results of float32-list ops).
_CONST, _PARAM, _HALF, _FLOAT32 = 0, 1, 2, 3


_is_float = is_floating_dtype


def _dtype(x: Any) -> np.dtype | None:
  d = getattr(x, "dtype", None)
  if d is None:
    d = np.asarray(x).dtype
  return np.dtype(d) if _is_float(d) else None


def _cast(x: Any, dtype: np.dtype) -> Any:
  d = _dtype(x)
  if d is None or d == dtype:
    return x
  return lax.convert_element_type(x, dtype)


def _matches(scope: tuple[str, ...], pattern: str, innermost: bool = False) -> bool:
  """Whether the glob ``pattern`` names a scope: one of its names or a
  ``/``-joined run of them (``Block_1/Attention_0`` inside
  ``Model/Block_1/Attention_0``); with ``innermost``, only those ending at
  the innermost name."""
  ends = (len(scope),) if innermost else range(1, len(scope) + 1)
  return any(fnmatch.fnmatchcase("/".join(scope[i:j]), pattern) for j in ends for i in range(j))


@dataclasses.dataclass(frozen=True)
class _Rules:
  """The op lists and the policy, resolved."""

  policy: policy_lib.Policy
  half_prims: frozenset[str]
  float32_prims: frozenset[str]
  half_scopes: tuple[str, ...]
  float32_scopes: tuple[str, ...]
  lookup_prims: frozenset[str] = frozenset()
  # Scopes whose weight products stay in the compute dtype (not the policy's
  # FP8 or INT8): the ``keep`` rules.
  unscaled_scopes: tuple[str, ...] = ()
  # Per evaluation: the keep rules that matched a weight product, and the
  # scopes of the weight products seen (for the error naming a rule that
  # matched none).
  matched: set = dataclasses.field(default_factory=set, compare=False, hash=False)
  seen: list = dataclasses.field(default_factory=list, compare=False, hash=False)

  def scales(self, name: str, tags: Sequence[int], scope: tuple[str, ...]) -> bool:
    """Whether a product runs in the policy's scaled format (FP8 or INT8).

    Weight products do: a matmul or convolution one of whose operands is a
    parameter (or computed from parameters alone), outside the
    ``unscaled_scopes``. Products of two activations (attention's scores and
    its weighted sum) stay in the compute dtype, as Transformer Engine's and
    DeepSeek-V3's FP8 recipes keep them.
    """
    if self.policy.product_format is None or name not in scaled.PRODUCTS or _PARAM not in tags[:2]:
      return False
    site = "/".join((*scope, name))
    kept = {p for p in self.unscaled_scopes if _matches(scope, p) or fnmatch.fnmatchcase(site, p)}
    self.matched.update(kept)
    self.seen.append("/".join(scope))
    return not kept

  def check_kept(self) -> None:
    """After an evaluation: a ValueError for a keep rule that matched no weight product."""
    if self.policy.product_format is None:
      return
    missing = [p for p in self.unscaled_scopes if p not in self.matched]
    if missing:
      scopes = sorted({s for s in self.seen if s})
      raise ValueError(
        f"The keep rule(s) {missing} match no weight product of the function: a rule is a "
        "glob over the scope a product runs in (a linen module's path, an NNX attribute "
        "path, a jax.named_scope), matched against each name and each run of names; the "
        f"weight products run in {scopes[:20]}{' ...' if len(scopes) > 20 else ''}."
      )

  def scope_mode(self, scope: tuple[str, ...]) -> int | None:
    """``_HALF``/``_FLOAT32`` if a scope entry names ``scope``; innermost wins."""
    for i in reversed(range(len(scope))):
      for patterns, mode in ((self.float32_scopes, _FLOAT32), (self.half_scopes, _HALF)):
        if any(_matches(scope[: i + 1], p, innermost=True) for p in patterns):
          return mode
    return None

  def mode(self, name: str, scope: tuple[str, ...]) -> int | None:
    scoped = self.scope_mode(scope)
    if scoped is not None:
      return scoped
    if name in self.half_prims:
      return _HALF
    if name in self.float32_prims:
      return _FLOAT32
    return None


# ---------------------------------------------------------------------------
# The interpreter.


def _read(env: dict, v: Any) -> tuple[Any, int]:
  if isinstance(v, jex_core.Literal):
    return v.val, _CONST
  return env[v]


def _name_stack(eqn: Any) -> tuple[str, ...]:
  text = str(eqn.source_info.name_stack)
  return tuple(s for s in text.split("/") if s)


def _has_subjaxpr(eqn: Any) -> bool:
  return any(True for _ in jex_core.jaxprs_in_params(eqn.params))


# Calls whose body the float32 analysis looks into: parameter name of the
# body, and the name it adds to the scope.
_CALL_BODIES = {"jit": "jaxpr", "pjit": "jaxpr", "closed_call": "call_jaxpr", "custom_jvp_call": "call_jaxpr"}


def _call_f32_inputs(rules: _Rules, eqn: Any, scope: tuple[str, ...]) -> set[int]:
  """Operand positions of a call that its body consumes only in float32."""
  key = _CALL_BODIES.get(eqn.primitive.name)
  if key is None or key not in eqn.params:
    return set()
  body = eqn.params[key]
  return _analyse(rules, getattr(body, "jaxpr", body), scope + _name_stack(eqn))[1]


def _demanded(rules: _Rules, jaxpr: Any, scope: tuple[str, ...]) -> set[int]:
  """Infer equations pulled into float32 by the float32 ops they feed.

  An infer op (or a ``jit``/``custom_jvp`` call, whose activation operands
  are then cast to float32) whose floating results are consumed only by
  float32-list ops or by ops pulled in (looking into the bodies of such
  calls) runs in float32 too: softmax's ``x - max(x)``
  before ``exp`` and the mask's ``select`` before it, the squares before a
  variance's sum, log-softmax's shift. An op that merely meets a float32
  value (a residual stream entering a normalization's ``x - mean``) is not
  pulled in: it keeps its dtype, and the float32 op casts its operand;
  only an op whose every use meets a float32 value joins, one level deep
  (:func:`_meets_float32`).
  """
  return _analyse(rules, jaxpr, scope)[0]


def _analyse(rules: _Rules, jaxpr: Any, scope: tuple[str, ...]):
  """``(demanded equations, positions of inputs consumed only in float32)``."""
  eqns = jaxpr.eqns
  modes = [rules.mode(e.primitive.name, scope + _name_stack(e)) for e in eqns]
  inferable = [
    m is None
    and not _has_subjaxpr(e)
    and e.primitive.name not in _LOCKED
    and e.primitive.name != "convert_element_type"
    and e.primitive.name not in rules.lookup_prims
    for e, m in zip(eqns, modes)
  ]
  deny = {i for i, m in enumerate(modes) if m == _FLOAT32}
  consumers: dict[Any, list[tuple[int, int]]] = {}
  for i, eqn in enumerate(eqns):
    for k, v in enumerate(eqn.invars):
      if not isinstance(v, jex_core.Literal):
        consumers.setdefault(v, []).append((i, k))
  outputs = {v for v in jaxpr.outvars if not isinstance(v, jex_core.Literal)}
  call_inputs = {
    i: _call_f32_inputs(rules, e, scope)
    for i, e in enumerate(eqns)
    if e.primitive.name in _CALL_BODIES and modes[i] is None
  }
  demanded: set[int] = set()

  def float32_only(v):
    return (
      v not in outputs
      and consumers.get(v)
      and all(c in deny or c in demanded or k in call_inputs.get(c, ()) for c, k in consumers[v])
    )

  for i in reversed(range(len(eqns))):
    if not (inferable[i] or i in call_inputs):
      continue
    outs = [v for v in eqns[i].outvars if _is_float(getattr(v.aval, "dtype", None))]
    if outs and all(float32_only(v) for v in outs):
      demanded.add(i)
  inputs = {k for k, v in enumerate(jaxpr.invars) if _is_float(getattr(v.aval, "dtype", None)) and float32_only(v)}
  return demanded | _meets_float32(eqns, inferable, deny | demanded, consumers, outputs), inputs


def _meets_float32(eqns, inferable, float32, consumers, outputs) -> set[int]:
  """Infer ops each of whose results meets a float32 value at every use.

  ``x - mean`` feeding only ``(x - mean) * rsqrt(var)``: the subtraction runs
  in float32 too, so that a normalization with stored statistics (batch norm
  in evaluation mode) computes its centred values in float32. One level
  only: the ops feeding such an op keep their dtypes.
  """
  producer = {v: i for i, e in enumerate(eqns) for v in e.outvars}
  mixes = set(float32)
  for i, eqn in enumerate(eqns):
    if inferable[i] and any(producer.get(v) in mixes for v in eqn.invars if not isinstance(v, jex_core.Literal)):
      mixes.add(i)
  pulled = set()
  for i, eqn in enumerate(eqns):
    outs = [v for v in eqn.outvars if _is_float(getattr(v.aval, "dtype", None))]
    if (
      inferable[i]
      and i not in mixes
      and outs
      and all(v not in outputs and consumers.get(v) and all(c in mixes for c, _ in consumers[v]) for v in outs)
    ):
      pulled.add(i)
  return pulled


def _eval(
  rules: _Rules,
  jaxpr: Any,
  consts: Sequence[Any],
  const_tags: Sequence[int],
  args: Sequence[Any],
  tags: Sequence[int],
  scope: tuple[str, ...],
):
  """Evaluates ``jaxpr`` under the rules; returns ``(outputs, output tags)``."""
  env: dict[Any, tuple[Any, int]] = {}
  for v, x, t in zip(jaxpr.constvars, consts, const_tags):
    env[v] = (x, t)
  for v, x, t in zip(jaxpr.invars, args, tags):
    env[v] = (x, t)
  demanded = _demanded(rules, jaxpr, scope)
  for i, eqn in enumerate(jaxpr.eqns):
    read = [_read(env, v) for v in eqn.invars]
    vals, in_tags = [r[0] for r in read], [r[1] for r in read]
    eqn_scope = scope + _name_stack(eqn)
    handler = HANDLERS.get(eqn.primitive.name)
    # The model's own source line and scope on what is bound (audits name it).
    name_stack = source_info_util.current_name_stack() + eqn.source_info.name_stack
    with source_info_util.user_context(eqn.source_info.traceback, name_stack=name_stack):
      if handler is not None:
        if i in demanded:  # a call whose results feed only float32 ops
          vals, in_tags = _to_float32(vals, in_tags)
        outs, out_tags = handler(rules, eqn, vals, in_tags, eqn_scope)
      elif _has_subjaxpr(eqn) or eqn.primitive.name in _LOCKED:
        outs, out_tags = _opaque(eqn, vals, in_tags)
      else:
        mode = _FLOAT32 if i in demanded else rules.mode(eqn.primitive.name, eqn_scope)
        outs, out_tags = _plain(rules, eqn, vals, in_tags, mode, eqn_scope)
    for v, x, t in zip(eqn.outvars, outs, out_tags):
      env[v] = (x, t)
  read = [_read(env, v) for v in jaxpr.outvars]
  return [r[0] for r in read], [r[1] for r in read]


def _to_float32(vals: list, tags: list) -> tuple[list, list]:
  """Activations cast to float32 (parameters and constants unchanged)."""
  pairs = [(_cast(x, _F32), _FLOAT32) if _dtype(x) is not None and t >= _HALF else (x, t) for x, t in zip(vals, tags)]
  return [p[0] for p in pairs], [p[1] for p in pairs]


def _bind(eqn: Any, vals: Sequence[Any], params: dict | None = None) -> list[Any]:
  params = eqn.primitive.get_bind_params(dict(eqn.params if params is None else params))
  out = eqn.primitive.bind(*vals, **params)
  return list(out) if eqn.primitive.multiple_results else [out]


def _target(rules: _Rules, vals: Sequence[Any], tags: Sequence[int], mode: int | None):
  """``(dtype the floating operands are cast to or None, output tag)``."""
  floats = [(d, t) for d, t in ((_dtype(x), t) for x, t in zip(vals, tags)) if d is not None]
  if not floats:
    return None, _CONST
  strongest = max(t for _, t in floats)
  if mode == _HALF:
    return rules.policy.compute_dtype, _HALF
  if mode == _FLOAT32:
    widest = max((d for d, _ in floats), key=lambda d: d.itemsize)
    dtype = widest if widest.itemsize > _F32.itemsize else _F32
    return dtype, (_FLOAT32 if strongest >= _HALF else strongest)
  if strongest == _FLOAT32:
    return _F32, _FLOAT32
  if strongest == _HALF:
    return rules.policy.compute_dtype, _HALF
  ranked = [d for d, t in floats if t == strongest]
  return max(ranked, key=lambda d: d.itemsize), strongest


def _plain(rules: _Rules, eqn: Any, vals: list, tags: list, mode: int | None, scope: tuple[str, ...] = ()):
  """A primitive without sub-jaxprs: cast operands, fix dtype parameters, bind."""
  name = eqn.primitive.name
  if name == "convert_element_type":
    return _convert(eqn, vals, tags)
  if mode is None and name in rules.lookup_prims and _dtype(vals[0]) is not None and (tags[0] == _PARAM):
    return _lookup(rules, eqn, vals, tags)
  dtype, out_tag = _target(rules, vals, tags, mode)
  if dtype is None:
    return _bind(eqn, vals), [out_tag] * len(eqn.outvars)
  if mode == _HALF and rules.scales(name, tags, scope):
    weight = 1 if tags[1] == _PARAM else 0
    return [scaled.product(rules.policy, eqn, [_cast(x, dtype) for x in vals], weight, scope)], [_HALF]
  if name in _BROADCASTING and out_tag >= _HALF:
    vals = [_widened(x, t, dtype, eqn.outvars[0].aval.shape) for x, t in zip(vals, tags)]
  vals = [_cast(x, dtype) for x in vals]
  params = dict(eqn.params)
  if params.get("preferred_element_type") is not None and _is_float(params["preferred_element_type"]):
    params["preferred_element_type"] = dtype
  outs = _bind(eqn, vals, params)
  return outs, [out_tag if _dtype(o) is not None else _CONST for o in outs]


# Elementwise primitives that broadcast size-1 dimensions of their operands.
_BROADCASTING = frozenset(
  {"add", "add_any", "sub", "mul", "div", "max", "min", "pow", "atan2", "rem", "nextafter", "select_n", "clamp"}
)


def _widened(x: Any, tag: int, dtype: np.dtype, shape: tuple[int, ...]) -> Any:
  """A parameter broadcast to ``shape`` in its own dtype before its cast to ``dtype``.

  A bias or a norm's scale meeting a half-precision activation is cast to
  half precision there; cast first and broadcast by the op, its gradient (the
  broadcast's transpose, a sum over every token) would be summed in half
  precision. Broadcast first, the sum runs in the parameter's dtype.
  """
  d = _dtype(x)
  if tag != _PARAM or d is None or d.itemsize <= dtype.itemsize or np.shape(x) == tuple(shape):
    return x
  if len(np.shape(x)) != len(shape):
    return x
  return lax.broadcast_in_dim(x, shape, tuple(range(len(shape))))


def _lookup(rules: _Rules, eqn: Any, vals: list, tags: list):
  """Rows of a parameter table: read in ``param_dtype``, cast to compute.

  The cast comes after the lookup, so only the rows are converted and the
  table's gradient is scattered back in the parameter dtype.
  """
  (out,) = _bind(eqn, vals)
  return [_cast(out, rules.policy.compute_dtype)], [_HALF]


def _convert(eqn: Any, vals: list, tags: list):
  (x,), (tag,) = vals, tags
  new = np.dtype(eqn.params["new_dtype"]) if _is_float(eqn.params["new_dtype"]) else None
  out = _bind(eqn, [x])
  if new is None:
    return out, [_CONST]
  if _dtype(x) is None:
    return out, [_CONST]  # integers and booleans to float: a constant
  # An explicit float-to-float cast in the function: respected. A parameter
  # stays a parameter (a layer casting its kernel to its declared dtype).
  if tag == _PARAM:
    return out, [_PARAM]
  return out, [_HALF if new.itemsize < _F32.itemsize else max(tag, _HALF) if tag >= _HALF else tag]


def _opaque(eqn: Any, vals: list, tags: list):
  """Binds as traced: operands cast back to the dtypes the callee expects."""
  vals = [
    _cast(x, np.dtype(v.aval.dtype)) if _is_float(getattr(v.aval, "dtype", None)) else x
    for x, v in zip(vals, eqn.invars)
  ]
  outs = _bind(eqn, vals)
  strongest = max([t for x, t in zip(vals, tags) if _dtype(x) is not None], default=_CONST)
  out_tags = []
  for o in outs:
    d = _dtype(o)
    if d is None or strongest < _HALF:
      out_tags.append(_CONST if d is None else strongest)
    else:
      out_tags.append(_HALF if d.itemsize < _F32.itemsize else _FLOAT32)
  return outs, out_tags


# Primitives whose parameters fix their operand dtypes (scatter's combiner
# jaxpr, bitcasts): evaluated as traced, like opaque calls.
_LOCKED = frozenset(
  {
    "bitcast_convert_type",
    "reduce_precision",
    "pure_callback",
    "io_callback",
    "callback",
    "ffi_call",
    "custom_call",
    "tpu_custom_call",
    "mosaic_gpu_call",
    "custom_partitioning",
    "cudnn_dot_product_attention",
  }
)


# Primitive name -> handler(rules, eqn, vals, tags, scope) -> (outs, tags);
# filled by jmp_train._src.autocast.calls.
HANDLERS: dict[str, Callable[..., Any]] = {}
