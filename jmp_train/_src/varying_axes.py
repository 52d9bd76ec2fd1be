"""Which mesh axes a value varies over inside ``shard_map``, and marking more.

Both branches of a ``lax.cond`` (and both operands of a select) must agree on
the mesh axes each output varies over; these helpers read them from a value's
abstract type and mark a value as varying over more axes (which changes no
value). Outside ``shard_map`` a value varies over no axis and marking is a
no-op.
"""

from __future__ import annotations

import contextlib

from typing import Any

import jax

__all__ = ["all_gather_invariant", "cond", "pvary", "varying_axes"]


def varying_axes(x: Any) -> frozenset[str]:
  """Mesh axes ``x`` varies over inside ``shard_map`` (empty elsewhere).

  Args:
    x: an array, a tracer or a ``jax.ShapeDtypeStruct``.

  Returns:
    The names of the manual mesh axes ``x`` varies over.

  Examples:
    >>> sorted(varying_axes(jnp.zeros(3)))
    []
  """
  return _aval_axes(x if isinstance(x, jax.ShapeDtypeStruct) else jax.typeof(x))


def _aval_axes(aval: Any) -> frozenset[str]:
  manual = getattr(aval, "manual_axis_type", None)  # jax >= 0.10
  if manual is not None:
    return frozenset(manual.varying)
  return frozenset(getattr(aval, "vma", None) or ())  # older jax


def pvary(x: Any, axes: frozenset[str]) -> Any:
  """Marks ``x`` as varying over ``axes`` (a no-op for axes it varies over).

  Args:
    x: an array or tracer.
    axes: the mesh axes ``x`` must vary over.

  Returns:
    ``x``, unchanged in value, varying over at least ``axes``.

  Examples:
    >>> pvary(jnp.ones(2), frozenset()).tolist()
    [1.0, 1.0]
  """
  missing = tuple(sorted(axes - varying_axes(x)))
  if not missing:
    return x
  if hasattr(jax.lax, "pcast"):
    return jax.lax.pcast(x, missing, to="varying")
  return jax.lax.pvary(x, missing)


def all_gather_invariant(x: Any, axis_name: Any) -> Any:
  """``lax.all_gather(x, axis_name)``, typed the same on every replica.

  Under ``shard_map`` a gathered value that varies over ``axis_name`` is
  gathered ``to="invarying"`` (every replica holds the whole); under
  ``vmap`` or ``pmap``, or where the value carries no varying axes, the
  plain gather is the same value (``to="invarying"`` is refused there).

  Examples:
    >>> jax.vmap(lambda v: all_gather_invariant(v, "i"), axis_name="i")(jnp.arange(2.0)).tolist()
    [[0.0, 1.0], [0.0, 1.0]]
  """
  names = (axis_name,) if isinstance(axis_name, str) else tuple(axis_name)
  if set(names) & varying_axes(x):
    return jax.lax.all_gather(x, axis_name, to="invarying")
  return jax.lax.all_gather(x, axis_name)


def cond(pred: Any, true_fun: Any, false_fun: Any, *operands: Any) -> Any:
  """``lax.cond`` whose branches may differ in the mesh axes they vary over.

  Under ``shard_map`` a branch that ``pmean``s is invariant across replicas
  where the other branch's outputs vary (or the reverse), and ``lax.cond``
  requires equal types: each output is marked varying over the union of both
  branches' axes (:func:`pvary`), which changes no value.

  Args:
    pred: a boolean scalar.
    true_fun: called with ``operands`` where ``pred`` holds.
    false_fun: called with ``operands`` elsewhere.
    *operands: the branches' arguments.

  Returns:
    The output of the branch ``pred`` selects. Each branch runs under a
    ``jax.named_scope`` of its function's name.

  Examples:
    >>> int(cond(jnp.array(True), lambda x: x + 1, lambda x: x - 1, 1))
    2
  """
  outs = [jax.make_jaxpr(f)(*operands).out_avals for f in (true_fun, false_fun)]
  axes = [_aval_axes(a) | _aval_axes(b) for a, b in zip(*outs)]

  def unified(fun):
    name = getattr(fun, "__name__", "")

    def branch(*args):
      # Named after the branch's function, so a compiled program's collectives
      # say which branch they run in (CollectiveOp.scope: ".../warmup/psum").
      with jax.named_scope(name) if name.isidentifier() else contextlib.nullcontext():
        flat, tree = jax.tree.flatten(fun(*args))
      return jax.tree.unflatten(tree, [pvary(x, want) for x, want in zip(flat, axes)])

    return branch

  return jax.lax.cond(pred, unified(true_fun), unified(false_fun), *operands)
