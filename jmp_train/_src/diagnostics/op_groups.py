"""A function's operations as the roofline counts them: calls inlined, elementwise chains fused, each counted.

:func:`program` flattens a jaxpr (calls inlined, as XLA inlines them; loop
bodies and branches apart, with how often they run) and :func:`groups`
joins each scope's elementwise operations into fusions and counts every
operation or fusion: FLOPs and bytes from ``jax.experimental.roofline``'s rule
for each equation (its public ``roofline`` on a one-equation function), one
read and write of every operand where its rules count nothing.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import numpy as np
from jax.experimental import roofline as jax_roofline
from jax.extend import core as jex_core

from jmp_train._src.diagnostics import jaxprs
from jmp_train._src.fp8.scaling import FP8_SCOPE

__all__ = ["Group", "groups", "program"]

PRODUCTS = ("dot_general", "conv_general_dilated")
# Elementwise primitives: fused with their elementwise neighbours.
_ELEMENTWISE = frozenset(
  "abs acos asin atan cbrt ceil conj cos cosh exp exp2 expm1 floor imag integer_pow is_finite log log1p logistic "
  "neg not real round rsqrt sign sin sinh sqrt square tan tanh erf erfc erf_inv lgamma digamma bessel_i0e "
  "bessel_i1e population_count clz reduce_precision convert_element_type add sub mul div rem and or xor gt lt ge "
  "le eq ne min max pow atan2 nextafter shift_left shift_right_logical shift_right_arithmetic add_any select_n "
  "clamp".split()
)
# Reductions: the last op of a fusion (their output starts a new one).
_REDUCTIONS = frozenset(
  "reduce_sum reduce_max reduce_min reduce_prod reduce_and reduce_or reduce_xor argmax argmin".split()
)
# Views: no work; their output is their input's memory (a broadcast reads its small input).
_VIEWS = frozenset(
  "broadcast_in_dim reshape squeeze expand_dims transpose rev copy copy_p pvary sharding_constraint".split()
)
# Calls inlined (XLA inlines them too); other sub-jaxprs are scopes of their own.
_CALLS = {
  "pjit": "jaxpr",
  "jit": "jaxpr",
  "closed_call": "call_jaxpr",
  "core_call": "call_jaxpr",
  "remat": "jaxpr",
  "checkpoint": "jaxpr",
  "custom_jvp_call": "call_jaxpr",
  "custom_vjp_call": "call_jaxpr",
  "shard_map": "jaxpr",
}


class Group(NamedTuple):
  """One operation, or a fusion of elementwise ones, counted."""

  eqns: tuple
  flops: float  # all repeats
  bytes: float
  quantize: bool  # FP8 / int8 quantize, dequantize or scale work
  repeats: int
  where: str


class _Value:
  """A value of the flattened program (calls inlined: a call's inner and outer variables share one)."""

  __slots__ = ("nbytes",)

  def __init__(self, aval):
    self.nbytes = _aval_bytes(aval)


class _Op(NamedTuple):
  eqn: Any
  ins: tuple  # value ids (None for literals)
  outs: tuple
  scope: str  # the enclosing name stack
  where: str


@functools.lru_cache(maxsize=4096)
def _jax_counts_cached(prim, in_avals, params) -> tuple[float, float]:
  return _jax_counts_uncached(prim, in_avals, dict(params))


def _jax_counts_uncached(prim, in_avals, params) -> tuple[float, float]:
  shapes = [jax.ShapeDtypeStruct(shape, dtype, weak_type=weak) for shape, dtype, weak in in_avals]
  _, result = jax_roofline.roofline(lambda *xs: prim.bind(*xs, **params))(*shapes)
  return float(result.unfused_flops), float(result.unfused_hbm_bytes)


def _itemsize(dtype) -> float:
  """Bytes per element; a PRNG key counts its key data (``uint32`` words)."""
  if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
    shape = jax.eval_shape(lambda: jax.random.key_data(jax.random.key(0, impl=dtype._impl))).shape
    return 4.0 * float(np.prod(shape, dtype=np.float64))
  return float(np.dtype(dtype).itemsize)


def _aval_bytes(aval) -> float:
  return float(np.prod(aval.shape, dtype=np.float64) * _itemsize(aval.dtype)) if hasattr(aval, "shape") else 0.0


def _jax_counts(eqn) -> tuple[float, float]:
  """(flops, bytes) of one equation by its ``jax.experimental.roofline`` rule."""
  in_avals = tuple((tuple(v.aval.shape), v.aval.dtype, bool(getattr(v.aval, "weak_type", False))) for v in eqn.invars)
  try:
    return _jax_counts_cached(eqn.primitive, in_avals, tuple(sorted(eqn.params.items())))
  except TypeError:  # unhashable parameters
    return _jax_counts_uncached(eqn.primitive, in_avals, eqn.params)


def _counts(eqn) -> tuple[float, float, str]:
  """(flops, bytes, counted_by): jax's rule, or one read and write of every operand where it counts nothing."""
  flops, nbytes = _jax_counts(eqn)
  if flops or nbytes or eqn.primitive.name in _VIEWS:
    return flops, nbytes, "jax"
  ins = [v.aval for v in eqn.invars]
  outs = [v.aval for v in eqn.outvars]
  name = eqn.primitive.name
  if name in _ELEMENTWISE or name in _REDUCTIONS:
    flops = max((np.prod(a.shape) for a in (ins if name in _REDUCTIONS else outs) if hasattr(a, "shape")), default=0)
  return float(flops), sum(map(_aval_bytes, ins + outs)), "jmp_train"


def _flatten(jaxpr, env: dict, scope: str, scopes: list, repeats: int, ops: list, site: str = "") -> list:
  """Appends ``jaxpr``'s equations to ``ops`` with calls inlined; loop bodies and branches go to ``scopes``.

  Returns the value ids of ``jaxpr``'s outputs.
  """
  jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
  for v in (*jaxpr.constvars, *jaxpr.invars):
    env.setdefault(v, _Value(v.aval))

  def value(v):
    if isinstance(v, jex_core.Literal):
      return None
    if v not in env:
      env[v] = _Value(v.aval)
    return env[v]

  for eqn in jaxpr.eqns:
    name = eqn.primitive.name
    stack = f"{scope}/{eqn.source_info.name_stack}"
    where = jaxprs._where(eqn) or site
    ins = tuple(value(v) for v in eqn.invars)
    key = _CALLS.get(name)
    if key and key in eqn.params:
      inner = eqn.params[key]
      inner_jaxpr = getattr(inner, "jaxpr", inner)
      inner_env = {k: v for k, v in zip(inner_jaxpr.invars, ins) if v is not None}
      outs = _flatten(inner, inner_env, stack, scopes, repeats, ops, where)
      for outer, inner_out in zip(eqn.outvars, outs):
        env[outer] = inner_out if inner_out is not None else _Value(outer.aval)
      continue
    subs = list(jex_core.jaxprs_in_params(eqn.params))
    if subs:
      times = repeats * int(eqn.params.get("length", 1)) if name == "scan" else repeats
      branches = []
      for sub in subs:
        body: list = []
        branches.append((body, _flatten(sub, {}, stack, scopes, times, body, where)))
      scopes.append((name, branches, times))
    else:
      ops.append(_Op(eqn, ins, tuple(value(v) for v in eqn.outvars), stack, where))
    for v in eqn.outvars:
      value(v)
  return [value(v) for v in jaxpr.outvars]


def _is_quantize(eqn, scope: str) -> bool:
  if eqn.primitive.name in PRODUCTS:
    return False
  if FP8_SCOPE in scope:
    return True
  dts = [
    np.dtype(v.aval.dtype)
    for v in (*eqn.invars, *eqn.outvars)
    if hasattr(v.aval, "dtype") and not jax.dtypes.issubdtype(v.aval.dtype, jax.dtypes.prng_key)
  ]
  return eqn.primitive.name == "convert_element_type" and any(d.itemsize == 1 and d.kind in "fiu" for d in dts)


def groups(ops: list, outputs: list, repeats: int, fuse: bool) -> list[Group]:
  """The operations of one scope: products and other ops alone, elementwise chains fused (union-find)."""
  source: dict = {}  # a view's output -> the value whose memory it is
  src = lambda v: source.get(v, v)  # noqa: E731
  for op in ops:
    if op.eqn.primitive.name in _VIEWS and len(op.ins) == 1 and op.ins[0] is not None:
      source[op.outs[0]] = src(op.ins[0])
  parent = list(range(len(ops)))
  # Per group: its reductions, and the reductions its members depend on. A
  # reduction ends a fusion: what depends on it cannot join its group (XLA
  # does not fuse an amax with the scaling that uses it).
  reds = [{i} if fuse and op.eqn.primitive.name in _REDUCTIONS else set() for i, op in enumerate(ops)]
  deps: list[set] = [set() for _ in ops]

  def find(i):
    while parent[i] != i:
      parent[i] = parent[parent[i]]
      i = parent[i]
    return i

  producer: dict = {}
  for i, op in enumerate(ops):
    name = op.eqn.primitive.name
    fusible = fuse and (name in _ELEMENTWISE or name in _REDUCTIONS)
    inputs = [producer.get(src(v)) for v in op.ins if v is not None]
    for j in inputs:
      if j is not None:
        deps[i] |= deps[j] | ({j} if ops[j].eqn.primitive.name in _REDUCTIONS else set())
    if fusible:
      for j in inputs:
        if j is None or ops[j].eqn.primitive.name not in _ELEMENTWISE:
          continue
        a, b = find(i), find(j)
        if a != b and not (reds[b] & deps[a]) and not (reds[a] & deps[b]):
          parent[a] = b
          reds[b] |= reds[a]
          deps[b] |= deps[a]
    for v in op.outs:
      producer[v] = i
  fused: dict[int, list[int]] = {}
  for i, op in enumerate(ops):
    if op.eqn.primitive.name not in _VIEWS:
      fused.setdefault(find(i), []).append(i)
  uses: dict = {src(v): {"output"} for v in outputs if v is not None}
  for i, op in enumerate(ops):
    if op.eqn.primitive.name in _VIEWS:
      continue  # a view's consumers use its source
    for v in op.ins:
      if v is not None:
        uses.setdefault(src(v), set()).add(find(i))
  out = []
  for root, members in fused.items():
    eqns = [ops[i].eqn for i in members]
    counted = [_counts(e) for e in eqns]
    flops = sum(c[0] for c in counted) * repeats
    if len(members) == 1:
      nbytes = counted[0][1] * repeats
    else:
      made = {v for i in members for v in ops[i].outs}
      read = {src(v) for i in members for v in ops[i].ins if v is not None} - made
      written = {v for v in made if uses.get(v, set()) - {root}}
      nbytes = sum(v.nbytes for v in read | written) * repeats
    if flops or nbytes:
      quantize = any(_is_quantize(ops[i].eqn, ops[i].scope) for i in members)
      out.append(Group(tuple(eqns), flops, nbytes, quantize, repeats, ops[members[0]].where))
  return out


def program(jaxpr) -> tuple[list, list, list]:
  """``(ops, outputs, scopes)`` of a jaxpr: its flattened operations, its outputs, and the loop bodies and branches.

  ``scopes`` holds ``(primitive, [(ops, outputs) per sub-jaxpr], times it runs)``.
  """
  ops: list = []
  scopes: list = []
  outputs = _flatten(jaxpr, {}, "", scopes, 1, ops)
  return ops, outputs, scopes
