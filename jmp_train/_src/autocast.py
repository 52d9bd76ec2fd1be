"""A dtype policy as a function transformation: autocast for any JAX function.

:func:`autocast` traces a function to a jaxpr and evaluates the jaxpr again
with each equation's floating-point operands cast after the AMP op lists
(:mod:`jmp_train._src.autocast_lists`): matmuls and convolutions in the
policy's compute dtype, ``exp``/``log``/reductions and the patterns they form
(softmax, log-softmax, normalization statistics) in float32, everything else
following its inputs. Evaluation binds ordinary primitives, so the result
composes with ``jit``, ``grad``, ``vmap``, ``shard_map``, ``pmap`` and
``checkpoint`` like any JAX function.

References:
  Micikevicius et al., "Mixed Precision Training", ICLR 2018.
  https://arxiv.org/abs/1710.03740
"""

from __future__ import annotations

import dataclasses
import fnmatch
import functools
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend import core as jex_core

from jmp_train._src import autocast_lists
from jmp_train._src import policy as policy_lib

__all__ = ["autocast"]

_F32 = np.dtype(jnp.float32)

# Tags of floating-point values, weakest first. A value's tag decides which
# dtype an "infer" op casts its operands to:
# CONST: literals, constants and integers converted to float: take any dtype.
# PARAM: parameters and values computed from parameters alone: they stay in
#   param_dtype until they meet an activation (then take its dtype).
# HALF: activations in the compute dtype.
# FLOAT32: activations in a float32 region (results of float32-list ops).
_CONST, _PARAM, _HALF, _FLOAT32 = 0, 1, 2, 3


def _is_float(dtype: Any) -> bool:
  if dtype is None:
    return False
  try:
    return bool(jnp.issubdtype(dtype, jnp.floating))
  except TypeError:  # extended dtypes (keys)
    return False


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


@dataclasses.dataclass(frozen=True)
class _Rules:
  """The op lists and the policy, resolved."""

  policy: policy_lib.Policy
  half_prims: frozenset[str]
  float32_prims: frozenset[str]
  half_scopes: tuple[str, ...]
  float32_scopes: tuple[str, ...]

  def scope_mode(self, scope: tuple[str, ...]) -> int | None:
    """``_HALF``/``_FLOAT32`` if a scope entry names ``scope``; innermost wins."""
    for i in reversed(range(len(scope))):
      path = "/".join(scope[: i + 1])
      for patterns, mode in ((self.float32_scopes, _FLOAT32), (self.half_scopes, _HALF)):
        if any(fnmatch.fnmatchcase(scope[i], p) or fnmatch.fnmatchcase(path, p)
               for p in patterns):
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


def _demanded(rules: _Rules, jaxpr: Any, scope: tuple[str, ...]) -> set[int]:
  """Infer equations pulled into float32 by the float32 ops around them.

  An infer op whose floating results are consumed only by ops that run in
  float32 (float32-list ops, ops pulled in, or ops with an operand produced
  in float32) runs in float32 too: softmax's ``x - max(x)`` before ``exp``,
  the squares before a variance's sum, log-softmax's shift. The set is a
  fixed point of a forward pass (which ops produce float32) and a backward
  pass (which ops only feed float32 ops).
  """
  eqns = jaxpr.eqns
  modes = [rules.mode(e.primitive.name, scope + _name_stack(e)) for e in eqns]
  inferable = [
      m is None and not _has_subjaxpr(e) and e.primitive.name not in _LOCKED
      and e.primitive.name != "convert_element_type"
      for e, m in zip(eqns, modes)
  ]
  deny = {i for i, m in enumerate(modes) if m == _FLOAT32}
  producer: dict[Any, int] = {}
  consumers: dict[Any, list[int]] = {}
  for i, eqn in enumerate(eqns):
    for v in eqn.outvars:
      producer[v] = i
    for v in eqn.invars:
      if not isinstance(v, jex_core.Literal):
        consumers.setdefault(v, []).append(i)
  outputs = {v for v in jaxpr.outvars if not isinstance(v, jex_core.Literal)}
  demanded: set[int] = set()
  for _ in range(4):
    produces_f32 = set(deny | demanded)
    for i, eqn in enumerate(eqns):
      if inferable[i] and any(
          producer.get(v) in produces_f32 for v in eqn.invars
          if not isinstance(v, jex_core.Literal)):
        produces_f32.add(i)
    new: set[int] = set()
    for i in reversed(range(len(eqns))):
      if not inferable[i]:
        continue
      outs = [v for v in eqns[i].outvars if _is_float(getattr(v.aval, "dtype", None))]
      if outs and all(
          v not in outputs and consumers.get(v)
          and all(c in deny or c in new or c in produces_f32 for c in consumers[v])
          for v in outs):
        new.add(i)
    if new == demanded:
      break
    demanded = new
  return demanded


def _eval(rules: _Rules, jaxpr: Any, consts: Sequence[Any], const_tags: Sequence[int],
          args: Sequence[Any], tags: Sequence[int], scope: tuple[str, ...]):
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
    handler = _HANDLERS.get(eqn.primitive.name)
    with jax.named_scope("/".join(_name_stack(eqn))) if _name_stack(eqn) else _nullcontext():
      if handler is not None:
        outs, out_tags = handler(rules, eqn, vals, in_tags, eqn_scope)
      elif _has_subjaxpr(eqn) or eqn.primitive.name in _LOCKED:
        outs, out_tags = _opaque(eqn, vals, in_tags)
      else:
        mode = _FLOAT32 if i in demanded else rules.mode(eqn.primitive.name, eqn_scope)
        outs, out_tags = _plain(rules, eqn, vals, in_tags, mode)
    for v, x, t in zip(eqn.outvars, outs, out_tags):
      env[v] = (x, t)
  read = [_read(env, v) for v in jaxpr.outvars]
  return [r[0] for r in read], [r[1] for r in read]


class _nullcontext:
  def __enter__(self):
    return None

  def __exit__(self, *exc):
    return False


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


def _plain(rules: _Rules, eqn: Any, vals: list, tags: list, mode: int | None):
  """A primitive without sub-jaxprs: cast operands, fix dtype parameters, bind."""
  name = eqn.primitive.name
  if name == "convert_element_type":
    return _convert(eqn, vals, tags)
  dtype, out_tag = _target(rules, vals, tags, mode)
  if dtype is None:
    return _bind(eqn, vals), [out_tag] * len(eqn.outvars)
  vals = [_cast(x, dtype) for x in vals]
  params = dict(eqn.params)
  if params.get("preferred_element_type") is not None and _is_float(
      params["preferred_element_type"]):
    params["preferred_element_type"] = dtype
  outs = _bind(eqn, vals, params)
  return outs, [out_tag if _dtype(o) is not None else _CONST for o in outs]


def _convert(eqn: Any, vals: list, tags: list):
  (x,), (tag,) = vals, tags
  new = np.dtype(eqn.params["new_dtype"]) if _is_float(eqn.params["new_dtype"]) else None
  out = _bind(eqn, [x])
  if new is None:
    return out, [_CONST]
  if _dtype(x) is None:
    return out, [_CONST]  # integers and booleans to float: a constant
  # An explicit float-to-float cast in the function: respected.
  return out, [_HALF if new.itemsize < _F32.itemsize else max(tag, _HALF) if tag >= _HALF else tag]


def _opaque(eqn: Any, vals: list, tags: list):
  """Binds as traced: operands cast back to the dtypes the callee expects."""
  vals = [_cast(x, np.dtype(v.aval.dtype)) if _is_float(getattr(v.aval, "dtype", None)) else x
          for x, v in zip(vals, eqn.invars)]
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
_LOCKED = frozenset({
    "bitcast_convert_type", "reduce_precision", "pure_callback", "io_callback",
    "callback", "ffi_call", "custom_call", "tpu_custom_call", "mosaic_gpu_call",
    "custom_partitioning", "cudnn_dot_product_attention",
})


# ---------------------------------------------------------------------------
# Calls and control flow: evaluated recursively under the same rules.


def _closed(rules: _Rules, closed: Any, vals: Sequence[Any], tags: Sequence[int],
            scope: tuple[str, ...]):
  consts = list(closed.consts)
  return _eval(rules, closed.jaxpr, consts, [_PARAM] * len(consts), vals, tags, scope)


def _pjit(rules, eqn, vals, tags, scope):
  # Inlined: the enclosing trace (jit or not) compiles it the same way, and
  # the function's name joins the scope, so "scope:log_softmax" matches.
  closed = eqn.params["jaxpr"]
  return _closed(rules, closed, vals, tags, scope + (str(eqn.params.get("name", "jit")),))


def _closed_call(rules, eqn, vals, tags, scope):
  return _closed(rules, eqn.params["call_jaxpr"], vals, tags, scope)


def _func_name(closed: Any, default: str) -> str:
  info = getattr(closed.jaxpr, "debug_info", None)
  return str(getattr(info, "func_name", None) or default)


def _custom_jvp(rules, eqn, vals, tags, scope):
  """A ``custom_jvp`` function whose primal and JVP rule both run under the rules.

  The primal is the autocast call jaxpr; the rule is the original JVP jaxpr
  evaluated under the same rules on the primals' and tangents' dtypes, its
  outputs cast to the primal outputs' dtypes, so the pair stays consistent.
  """
  call = eqn.params["call_jaxpr"]
  num_consts = eqn.params["num_consts"]
  jvp_fun = eqn.params["jvp_jaxpr_fun"]
  scope = scope + (_func_name(call, "custom_jvp"),)
  consts, args = vals[:num_consts], vals[num_consts:]
  const_tags, arg_tags = tags[:num_consts], tags[num_consts:]
  box = []

  def primal(*xs):
    outs, out_tags = _closed(rules, call, [*consts, *xs], [*const_tags, *arg_tags], scope)
    box.append(out_tags)
    return outs

  primal.__name__ = scope[-1]

  fun = jax.custom_jvp(primal)

  @fun.defjvp
  def _jvp(primals, tangents):
    out_avals = jax.eval_shape(primal, *primals)
    is_float = [_dtype(p) is not None for p in primals]
    jaxpr, jvp_consts, out_zeros = jvp_fun.call_wrapped(*[not f for f in is_float])
    nz = [t for t, f in zip(tangents, is_float) if f]
    nz_tags = [t for t, f in zip(arg_tags, is_float) if f]
    outs, _ = _eval(rules, jaxpr, jvp_consts, [_PARAM] * len(jvp_consts),
                    [*primals, *nz], [*arg_tags, *nz_tags], scope)
    n = len(out_zeros)
    p_out = [_cast(o, np.dtype(a.dtype)) if _is_float(a.dtype) else o
             for o, a in zip(outs[:n], out_avals)]
    nz_out = iter(outs[n:])
    t_out = []
    for p, a, z in zip(p_out, out_avals, out_zeros):
      if z:
        t_out.append(jnp.zeros(a.shape, jax.dtypes.float0 if not _is_float(a.dtype) else a.dtype))
      else:
        t = next(nz_out)
        t_out.append(_cast(t, np.dtype(a.dtype)) if _is_float(a.dtype) else t)
    return p_out, t_out

  outs = fun(*args)
  return list(outs), box[0] if box else [_HALF] * len(outs)


def _custom_vjp(rules, eqn, vals, tags, scope):
  # A user's backward rule is Python code written for the dtypes the
  # function was traced with: the call runs as traced (operands cast back),
  # which keeps forward, residuals and backward consistent.
  return _opaque(eqn, vals, tags)


def _carry_dtypes(vals: Sequence[Any]) -> list[np.dtype | None]:
  return [_dtype(x) for x in vals]


def _cast_like(vals: Sequence[Any], dtypes: Sequence[np.dtype | None]) -> list[Any]:
  return [x if d is None else _cast(x, d) for x, d in zip(vals, dtypes)]


def _scan(rules, eqn, vals, tags, scope):
  p = eqn.params
  nc, ncarry = p["num_consts"], p["num_carry"]
  consts, init, xs = vals[:nc], vals[nc:nc + ncarry], vals[nc + ncarry:]
  c_tags, i_tags, x_tags = tags[:nc], tags[nc:nc + ncarry], tags[nc + ncarry:]
  carry_dtypes = _carry_dtypes(init)
  box = []

  def body(carry, x):
    outs, out_tags = _closed(rules, p["jaxpr"], [*consts, *carry, *x],
                             [*c_tags, *i_tags, *x_tags], scope + ("scan",))
    box.append(out_tags)
    return _cast_like(outs[:ncarry], carry_dtypes), outs[ncarry:]

  carry, ys = lax.scan(body, list(init), list(xs), length=p["length"],
                       reverse=p["reverse"], unroll=p["unroll"])
  y_tags = box[0][ncarry:]
  return [*carry, *ys], [*i_tags, *y_tags]


def _while(rules, eqn, vals, tags, scope):
  p = eqn.params
  cn, bn = p["cond_nconsts"], p["body_nconsts"]
  cc, bc, init = vals[:cn], vals[cn:cn + bn], vals[cn + bn:]
  cc_t, bc_t, i_t = tags[:cn], tags[cn:cn + bn], tags[cn + bn:]
  carry_dtypes = _carry_dtypes(init)

  def cond(carry):
    (out,), _ = _closed(rules, p["cond_jaxpr"], [*cc, *carry], [*cc_t, *i_t], scope + ("while",))
    return out

  def body(carry):
    outs, _ = _closed(rules, p["body_jaxpr"], [*bc, *carry], [*bc_t, *i_t], scope + ("while",))
    return _cast_like(outs, carry_dtypes)

  return list(lax.while_loop(cond, body, list(init))), list(i_t)


def _cond(rules, eqn, vals, tags, scope):
  index, ops = vals[0], vals[1:]
  op_tags = tags[1:]
  branches = eqn.params["branches"]

  def branch_fn(closed):
    def run(*xs):
      return _closed(rules, closed, xs, op_tags, scope + ("cond",))[0]
    return run

  fns = [branch_fn(b) for b in branches]
  shapes = [jax.eval_shape(f, *ops) for f in fns]
  dtypes = []
  for outs in zip(*shapes):
    floats = [np.dtype(o.dtype) for o in outs if _is_float(o.dtype)]
    dtypes.append(max(floats, key=lambda d: d.itemsize) if floats else None)

  def unify(f):
    return lambda *xs: _cast_like(f(*xs), dtypes)

  outs = lax.switch(index, [unify(f) for f in fns], *ops)
  strongest = max([t for x, t in zip(ops, op_tags) if _dtype(x) is not None], default=_CONST)
  out_tags = [_CONST if d is None else (
      strongest if strongest < _HALF else _HALF if d.itemsize < _F32.itemsize else _FLOAT32)
              for d in dtypes]
  return list(outs), out_tags


def _remat(rules, eqn, vals, tags, scope):
  p = eqn.params
  box = []

  def body(*xs):
    outs, out_tags = _eval(rules, p["jaxpr"], [], [], xs, tags, scope + ("checkpoint",))
    box.append(out_tags)
    return outs

  outs = jax.checkpoint(body, prevent_cse=p["prevent_cse"], policy=p["policy"])(*vals)
  return list(outs), box[0]


def _shard_map(rules, eqn, vals, tags, scope):
  p = eqn.params
  box = []

  def body(*xs):
    outs, out_tags = _eval(rules, p["jaxpr"], [], [], xs, tags, scope + ("shard_map",))
    box.append(out_tags)
    return tuple(outs)

  fn = jax.shard_map(body, mesh=p["mesh"], in_specs=tuple(p["in_specs"]),
                     out_specs=tuple(p["out_specs"]), axis_names=set(p.get("newly_manual_axes", p.get("manual_axes"))),
                     check_vma=p["check_vma"])
  outs = fn(*vals)
  return list(outs), box[0]


_HANDLERS: dict[str, Callable[..., Any]] = {
    "pjit": _pjit,
    "jit": _pjit,
    "closed_call": _closed_call,
    "core_call": _closed_call,
    "custom_jvp_call": _custom_jvp,
    "custom_vjp_call": _custom_vjp,
    "scan": _scan,
    "while": _while,
    "cond": _cond,
    "checkpoint": _remat,
    "remat": _remat,
    "remat2": _remat,
    "shard_map": _shard_map,
}


# ---------------------------------------------------------------------------
# The entry point.


def _check_policy(policy: Any) -> policy_lib.Policy:
  if isinstance(policy, policy_lib.Policy):
    return policy
  if isinstance(policy, str):
    return policy_lib.get_policy(policy)
  raise ValueError(
      "policy must be a jmp_train.Policy or a spec string such as "
      f"'mixed_bfloat16' or 'params=float32,compute=float16,output=float32', got {policy!r}."
  )


def _check_argnums(params_argnums: Any) -> tuple[int, ...]:
  if params_argnums is None:
    return ()
  if isinstance(params_argnums, int) and not isinstance(params_argnums, bool):
    params_argnums = (params_argnums,)
  try:
    nums = tuple(params_argnums)
  except TypeError:
    nums = None
  if nums is None or not all(isinstance(n, int) and not isinstance(n, bool) for n in nums):
    raise TypeError(
        f"params_argnums must be an int or a tuple of ints (positions of the "
        f"parameter arguments), got {params_argnums!r}."
    )
  return nums


def _is_array(x: Any) -> bool:
  return isinstance(x, (jax.Array, np.ndarray, np.generic, jax.core.Tracer)) or (
      isinstance(x, jax.ShapeDtypeStruct))


def autocast(
    fun: Callable[..., Any],
    policy: policy_lib.Policy | str,
    *,
    float32_ops: Sequence[str] = autocast_lists.DEFAULT_FLOAT32_OPS,
    half_ops: Sequence[str] = autocast_lists.DEFAULT_HALF_OPS,
    params_argnums: int | Sequence[int] | None = 0,
) -> Callable[..., Any]:
  r"""Runs ``fun`` under a mixed-precision policy by transforming its jaxpr.

  ``autocast(fun, policy)`` has ``fun``'s signature. Each call traces ``fun``
  to a jaxpr on the arguments' shapes and dtypes (``jax.make_jaxpr``) and
  evaluates it again, equation by equation, after the AMP op lists:

  * ``half_ops`` (allow list, default :data:`DEFAULT_HALF_OPS`:
    ``dot_general``, ``conv_general_dilated``): floating operands cast to
    ``policy.compute_dtype``, result in ``compute_dtype`` (GPUs and TPUs
    accumulate 16-bit matmuls in float32 in hardware; a float32 result would
    make the backward pass a mixed-dtype matmul);
  * ``float32_ops`` (deny list, default :data:`DEFAULT_FLOAT32_OPS`: exp,
    log, log1p, logistic, pow, rsqrt, erf, ..., reduce_sum, reduce_prod,
    cumsum, ...): floating operands cast to float32, result in float32. An
    op whose floating results feed only float32 ops runs in float32 too, so
    whole patterns move together: softmax's ``x - max(x)`` before ``exp``,
    the squares before a variance's sum;
  * every other op (infer) follows its operands: float32 if one comes from
    a float32 op, else ``compute_dtype`` if one is a half-precision
    activation, else as traced. Parameters and constants never promote an
    activation: a float32 bias added to a half-precision activation is cast
    to the activation's dtype.

  Inputs: floating leaves of the arguments at ``params_argnums`` are
  parameters, cast to ``policy.param_dtype`` and kept there outside the
  allow-list ops (the cast to half happens at each matmul, so their
  gradients come back in ``param_dtype``); other floating arguments are cast
  to ``compute_dtype``. Floating outputs are cast to ``policy.output_dtype``.
  Integer, boolean and key values are never touched; Python scalars and
  other non-array leaves are static (closed over at tracing).

  Calls are followed: ``jit`` functions (inlined; their names join the
  scope), ``scan``, ``while_loop``, ``cond``/``switch``, ``checkpoint``,
  ``shard_map`` and ``custom_jvp`` functions (primal and rule both under the
  lists, e.g. ``jax.nn.relu``). ``custom_vjp`` functions, Pallas kernels,
  callbacks and other calls run as traced, with their operands cast back to
  the dtypes they were traced with, so their own rules stay valid. Explicit
  float-to-float casts in ``fun`` are kept.

  Entries ``"scope:PATTERN"`` in either list name a region (a
  ``jax.named_scope``, or a jitted / ``custom_jvp`` function's name, as a
  shell glob): every floating op inside runs in that list's dtype, the
  innermost named region winning.

  Args:
    fun: the function, e.g. ``model.apply`` or a loss function.
    policy: a :class:`~jmp_train.Policy` or a spec for
      :func:`~jmp_train.get_policy`, e.g. ``"mixed_bfloat16"``.
    float32_ops: the deny list (primitive names and ``"scope:..."`` entries).
      Extend it with ``(*DEFAULT_FLOAT32_OPS, "tanh")``.
    half_ops: the allow list.
    params_argnums: positions of the parameter arguments (``None`` or ``()``
      for none).

  Returns:
    The transformed function.

  Raises:
    TypeError: if ``fun`` is not callable, or a list or ``params_argnums``
      is malformed.
    ValueError: if ``policy`` is not a policy or a valid spec, or a list
      entry is not a primitive name nor a ``"scope:"`` entry.

  Examples:
    >>> def mlp(params, x):
    ...   h = jax.nn.relu(x @ params["w1"] + params["b1"])
    ...   return jax.nn.log_softmax(h @ params["w2"])
    >>> params = {"w1": jnp.ones((4, 8)), "b1": jnp.zeros(8), "w2": jnp.ones((8, 2))}
    >>> f = autocast(mlp, "mixed_bfloat16")
    >>> f(params, jnp.ones((3, 4))).dtype
    dtype('float32')
    >>> jaxpr = jax.make_jaxpr(f)(params, jnp.ones((3, 4)))
    >>> sorted({str(e.outvars[0].aval.dtype) for e in jaxpr.eqns
    ...         if e.primitive.name in ("dot_general", "exp")})
    ['bfloat16', 'float32']

  References:
    Micikevicius et al., "Mixed Precision Training", ICLR 2018.
    https://arxiv.org/abs/1710.03740
  """
  if not callable(fun):
    raise TypeError(f"autocast needs a callable, got {type(fun).__name__}: {fun!r}.")
  policy = _check_policy(policy)
  f32 = autocast_lists.check_op_list(float32_ops, "float32_ops")
  half = autocast_lists.check_op_list(half_ops, "half_ops")
  both = sorted(set(f32) & set(half))
  if both:
    raise ValueError(f"{both} are in both float32_ops and half_ops; keep each in one list.")
  f32_prims, f32_scopes = autocast_lists.split_op_list(f32)
  half_prims, half_scopes = autocast_lists.split_op_list(half)
  rules = _Rules(policy, half_prims, f32_prims, half_scopes, f32_scopes)
  argnums = _check_argnums(params_argnums)

  @functools.wraps(fun)
  def wrapped(*args, **kwargs):
    bad = [n for n in argnums if not -len(args) <= n < len(args)]
    if bad:
      raise ValueError(
          f"params_argnums {bad} out of range for a call with {len(args)} "
          "positional arguments."
      )
    params = {n % len(args) for n in argnums}
    is_param = [jax.tree.map(lambda _, p=i in params: p, a) for i, a in enumerate(args)]
    leaves, treedef = jax.tree.flatten((args, kwargs))
    param_flags = jax.tree.leaves((is_param, jax.tree.map(lambda _: False, kwargs)))
    dynamic = [i for i, x in enumerate(leaves) if _is_array(x)]

    def flat_fun(*dyn):
      full = list(leaves)
      for i, x in zip(dynamic, dyn):
        full[i] = x
      a, k = jax.tree.unflatten(treedef, full)
      return fun(*a, **k)

    dyn_vals = [leaves[i] for i in dynamic]
    closed, out_shape = jax.make_jaxpr(flat_fun, return_shape=True)(*dyn_vals)
    vals, tags = [], []
    for i, x in zip(dynamic, dyn_vals):
      if _dtype(x) is None:
        vals.append(x)
        tags.append(_CONST)
      elif param_flags[i]:
        vals.append(_cast(x, policy.param_dtype))
        tags.append(_PARAM)
      else:
        vals.append(_cast(x, policy.compute_dtype))
        tags.append(_HALF)
    outs, _ = _closed(rules, closed, vals, tags, ())
    outs = [_cast(o, policy.output_dtype) for o in outs]
    return jax.tree.unflatten(jax.tree.structure(out_shape), outs)

  return wrapped
