"""Calls and control flow under :func:`jmp_train.autocast`.

Each handler evaluates its sub-jaxprs under the same rules and rebuilds the
construct with the public API (``lax.scan``, ``lax.while_loop``,
``lax.switch``, ``jax.checkpoint``, ``jax.shard_map``, ``jax.custom_jvp``),
so loop carries and branch outputs keep one dtype each. ``jit`` calls are
inlined. Importing this module registers the handlers.
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jmp_train._src.autocast import interpreter as interp
from jmp_train._src.autocast.interpreter import _CONST
from jmp_train._src.autocast.interpreter import _F32
from jmp_train._src.autocast.interpreter import _FLOAT32
from jmp_train._src.autocast.interpreter import _HALF
from jmp_train._src.autocast.interpreter import _PARAM
from jmp_train._src.autocast.interpreter import _Rules
from jmp_train._src.autocast.interpreter import _cast
from jmp_train._src.autocast.interpreter import _dtype
from jmp_train._src.autocast.interpreter import _eval
from jmp_train._src.autocast.interpreter import _is_float
from jmp_train._src.autocast.interpreter import _opaque


def _open(closed: Any) -> tuple[Any, list[Any]]:
  """A body's jaxpr and constants: newer JAX passes open jaxprs (constants as operands)."""
  if hasattr(closed, "consts"):
    return closed.jaxpr, list(closed.consts)
  return closed, []


def _closed(rules: _Rules, closed: Any, vals: Sequence[Any], tags: Sequence[int], scope: tuple[str, ...]):
  jaxpr, consts = _open(closed)
  return _eval(rules, jaxpr, consts, [_PARAM] * len(consts), vals, tags, scope)


def _pjit(rules, eqn, vals, tags, scope):
  # Inlined: the enclosing trace (jit or not) compiles it the same way, and
  # the function's name joins the scope, so "scope:log_softmax" matches.
  closed = eqn.params["jaxpr"]
  return _closed(rules, closed, vals, tags, scope + (str(eqn.params.get("name", "jit")),))


def _closed_call(rules, eqn, vals, tags, scope):
  return _closed(rules, eqn.params["call_jaxpr"], vals, tags, scope)


def _func_name(closed: Any, default: str) -> str:
  info = getattr(_open(closed)[0], "debug_info", None)
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
    outs, _ = _eval(rules, jaxpr, jvp_consts, [_PARAM] * len(jvp_consts), [*primals, *nz], [*arg_tags, *nz_tags], scope)
    n = len(out_zeros)
    p_out = [_cast(o, np.dtype(a.dtype)) if _is_float(a.dtype) else o for o, a in zip(outs[:n], out_avals)]
    nz_out = iter(outs[n:])
    t_out = []
    for a, z in zip(out_avals, out_zeros):
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


def _scan_counts(params: dict[str, Any]) -> tuple[int, int]:
  """Constants and carries of a scan: counts, or newer JAX's (consts, carry, xs) flat tree."""
  if "num_consts" in params:
    return params["num_consts"], params["num_carry"]
  consts, carry, _ = params["ft_in"].unpack()
  return len(list(consts)), len(list(carry))


def _scan(rules, eqn, vals, tags, scope):
  p = eqn.params
  nc, ncarry = _scan_counts(p)
  consts, init, xs = vals[:nc], vals[nc : nc + ncarry], vals[nc + ncarry :]
  c_tags, i_tags, x_tags = tags[:nc], tags[nc : nc + ncarry], tags[nc + ncarry :]
  carry_dtypes = _carry_dtypes(init)
  box = []

  def body(carry, x):
    outs, out_tags = _closed(rules, p["jaxpr"], [*consts, *carry, *x], [*c_tags, *i_tags, *x_tags], scope + ("scan",))
    box.append(out_tags)
    return _cast_like(outs[:ncarry], carry_dtypes), outs[ncarry:]

  carry, ys = lax.scan(body, list(init), list(xs), length=p["length"], reverse=p["reverse"], unroll=p["unroll"])
  y_tags = box[0][ncarry:]
  return [*carry, *ys], [*i_tags, *y_tags]


def _while(rules, eqn, vals, tags, scope):
  p = eqn.params
  cn, bn = p["cond_nconsts"], p["body_nconsts"]
  cc, bc, init = vals[:cn], vals[cn : cn + bn], vals[cn + bn :]
  cc_t, bc_t, i_t = tags[:cn], tags[cn : cn + bn], tags[cn + bn :]
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
  out_tags = [
    _CONST if d is None else (strongest if strongest < _HALF else _HALF if d.itemsize < _F32.itemsize else _FLOAT32)
    for d in dtypes
  ]
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

  fn = jax.shard_map(
    body,
    mesh=p["mesh"],
    in_specs=tuple(p["in_specs"]),
    out_specs=tuple(p["out_specs"]),
    axis_names=set(p.get("newly_manual_axes", p.get("manual_axes"))),
    check_vma=p["check_vma"],
  )
  outs = fn(*vals)
  return list(outs), box[0]


interp.HANDLERS.update(
  {
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
)
