"""Reading a function's jaxpr: the forward and backward passes, and every equation in them.

The Tensor Core report and the precision audit read the jaxpr of a function
(nothing runs): :func:`trace` makes the forward pass's jaxpr and, if asked,
the pullback's, and :func:`walk` visits every equation with how often it
runs and the user's source line.
"""

from __future__ import annotations

import os
import re
from typing import Any, Callable, Iterator

import jax
from jax.extend import core as jex_core
from jax.extend import source_info_util
import numpy as np

from jmp_train._src.dtypes import is_floating_array


def _where(eqn) -> str:
  """``file.py:line (function)`` of the user code that emitted ``eqn``."""
  try:
    text = source_info_util.summarize(eqn.source_info)
  except Exception:  # pragma: no cover - source info is best effort.
    return ""
  match = re.match(r"^(.*?):(\d+)(?::\d+)?(.*)$", text)
  if match:
    return f"{os.path.basename(match.group(1))}:{match.group(2)}{match.group(3)}"
  return text


def _context_label(eqn) -> str:
  name = eqn.primitive.name
  if name in ("pjit", "jit", "closed_call", "core_call"):
    return str(eqn.params.get("name", name))
  return name


def walk(jaxpr, repeats: int = 1, context: tuple[str, ...] = (), site: str = "") -> Iterator[tuple[Any, int, str]]:
  """Yields ``(eqn, times it runs, where)`` for every equation.

  Recurses into every sub-jaxpr found in the parameters (jit, scan, cond,
  while, remat, custom_jvp/custom_vjp, shard_map, ...). ``scan`` bodies
  count ``length`` times; ``while`` bodies once (the trip count is not
  static); every ``cond`` branch is visited (an upper bound). ``where`` is
  the enclosing calls (``log_softmax/...``) and the user's source line; ops
  inside library functions inherit the line of the call into the library.
  """
  for eqn in jaxpr.eqns:
    own = _where(eqn) or site
    where = " ".join(s for s in ("/".join(context), own) if s)
    yield eqn, repeats, where
    inner = repeats * int(eqn.params.get("length", 1)) if eqn.primitive.name == "scan" else repeats
    label = context + (_context_label(eqn),)
    for sub in jex_core.jaxprs_in_params(eqn.params):
      yield from walk(sub, inner, label, own)


def _split_args(args: tuple) -> tuple[list, list, list[bool], Any]:
  leaves, treedef = jax.tree.flatten(args)
  is_float = [is_floating_array(x) for x in leaves]
  floats = [x for x, f in zip(leaves, is_float) if f]
  others = [x for x, f in zip(leaves, is_float) if not f]
  return floats, others, is_float, treedef


def train_step_program(fn: Any) -> Callable | None:
  """The jitted program of a :class:`jmp_train.TrainStep` (called on ``(state, batch)``), else None."""
  if type(fn).__name__ != "TrainStep":
    return None
  from jmp_train._src.train.state import TrainStep

  return fn._step if isinstance(fn, TrainStep) else None


def trace(fn: Callable, args: tuple, backward: bool) -> list[tuple[str, Any]]:
  """``[(phase, jaxpr)]``: the forward pass and, if asked, the backward pass.

  A :class:`jmp_train.TrainStep` (with ``args`` its state and batch) is one
  phase, ``"step"``: its program holds the forward pass, the backward pass
  and the update, as compiled.

  The backward pass is the pullback of ``jax.vjp(fn, ...)`` with respect to
  every floating-point leaf of ``args``, traced on its own (from abstract
  residuals and cotangents for every floating output), so the forward pass
  is not counted twice.
  """
  step = train_step_program(fn)
  if step is not None:
    # The whole compiled step: forward, backward and update in one program
    # (traced through the jitted function itself: its compiler options, e.g.
    # FP8's on GPUs, refuse an enclosing make_jaxpr).
    traced = getattr(step, "trace", None)
    jaxpr = traced(*args).jaxpr.jaxpr if traced is not None else jax.make_jaxpr(step)(*args).jaxpr
    return [("step", jaxpr)]
  phases = [("forward", jax.make_jaxpr(fn)(*args).jaxpr)]
  if not backward:
    return phases
  floats, others, is_float, treedef = _split_args(args)
  if not floats:
    raise ValueError(
      "backward=True differentiates with respect to the floating-point leaves of the arguments, and there are none."
    )

  def rebuild(fl, ot):
    fl, ot = iter(fl), iter(ot)
    return jax.tree.unflatten(treedef, [next(fl) if f else next(ot) for f in is_float])

  def forward_and_pullback(fl, ot):
    return jax.vjp(lambda fl_: fn(*rebuild(fl_, ot)), fl)

  out_shape, pullback_shape = jax.eval_shape(forward_and_pullback, floats, others)
  res_leaves, pullback_def = jax.tree.flatten(pullback_shape)
  out_leaves, out_def = jax.tree.flatten(out_shape)
  out_float = [is_floating_array(o) for o in out_leaves]
  if not any(out_float):
    raise ValueError("backward=True needs a function with a floating-point output.")

  def pullback(res, cts):
    cts = iter(cts)
    full = [next(cts) if f else np.zeros(o.shape, jax.dtypes.float0) for f, o in zip(out_float, out_leaves)]
    return jax.tree.unflatten(pullback_def, res)(jax.tree.unflatten(out_def, full))

  cts = [o for o, f in zip(out_leaves, out_float) if f]
  phases.append(("backward", jax.make_jaxpr(pullback)(res_leaves, cts).jaxpr))
  return phases


def has_subjaxpr(eqn) -> bool:
  return any(True for _ in jex_core.jaxprs_in_params(eqn.params))
