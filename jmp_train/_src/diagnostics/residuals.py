"""The arrays the backward pass keeps: activation memory, read from a jaxpr.

:func:`saved_residuals` lists what ``jax.vjp`` saves for the backward pass,
each array with its dtype and what produced it (an argument, a cast copy of
one, a constant or an activation), the inspection behind
``jax.ad_checkpoint.print_saved_residuals`` as data.

References:
  JAX, "Gradient checkpointing with jax.checkpoint".
  https://docs.jax.dev/en/latest/gradient-checkpointing.html
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
from jax.extend import core as jex_core
import numpy as np

from jmp_train._src.diagnostics import arguments

__all__ = ["SavedResidual", "saved_residuals"]


class SavedResidual(NamedTuple):
  """One array that ``jax.vjp`` keeps for the backward pass.

  Attributes:
    shape_dtype: its shape and dtype.
    kind: ``"argument"`` (one of the inputs, kept as is: no memory beyond
      what the caller holds), ``"cast_copy"`` (a dtype cast of an input:
      the half-precision copy of a float32 weight or of the input batch),
      ``"constant"`` (a broadcast literal, such as the zeros in ``relu``'s
      derivative: XLA fuses it into its consumer and never stores it) or
      ``"activation"`` (everything else the forward pass computed).
  """

  shape_dtype: jax.ShapeDtypeStruct
  kind: str

  @property
  def nbytes(self) -> int:
    """Bytes of the array."""
    return int(np.prod(self.shape_dtype.shape, dtype=np.int64)) * np.dtype(self.shape_dtype.dtype).itemsize

  @property
  def costs_memory(self) -> bool:
    """Whether it is memory the forward pass adds (activation or cast copy)."""
    return self.kind in ("activation", "cast_copy")


def saved_residuals(fun: Callable[..., Any], *args: Any) -> list[SavedResidual]:
  """The arrays ``jax.vjp(fun, *args)`` keeps for the backward pass.

  Traces ``jax.vjp`` to a jaxpr (nothing runs, so ``args`` may be
  ``jax.ShapeDtypeStruct``) and reads the values that make up the VJP
  function's closure, classifying each by what produced it (the inspection
  behind ``jax.ad_checkpoint.print_saved_residuals``, as data). Summing
  :attr:`SavedResidual.nbytes` over those that
  :attr:`~SavedResidual.costs_memory` gives the activation memory of one
  training step; the dtypes show what a policy keeps in float32.

  Args:
    fun: the function to differentiate (e.g. a loss of parameters and a
      batch), possibly under ``jax.checkpoint``.
    *args: its arguments (arrays, pytrees, or ``jax.ShapeDtypeStruct``).

  Returns:
    One :class:`SavedResidual` per distinct residual (a buffer saved twice
    is listed once); literals baked into the program are left out.

  Raises:
    ValueError: if ``fun`` is not callable.

  Examples:
    >>> def f(w, x):
    ...   return jnp.sum(jnp.sin(x @ w.astype(jnp.float16)).astype(jnp.float32))
    >>> res = saved_residuals(f, jnp.ones((3, 4)), jnp.ones((2, 3), jnp.float16))
    >>> sorted((r.kind, r.shape_dtype.shape) for r in res)
    [('activation', (2, 4)), ('argument', (2, 3)), ('cast_copy', (3, 4))]
  """
  arguments.check_callable(fun, "saved_residuals")
  leaves, treedef = jax.tree.flatten(args)

  def vjp_residuals(*flat):
    _, vjp_fun = jax.vjp(lambda *xs: fun(*jax.tree.unflatten(treedef, xs)), *flat)
    return jax.tree.leaves(vjp_fun)

  jaxpr = jax.make_jaxpr(vjp_residuals)(*leaves).jaxpr
  invars = set(jaxpr.invars)
  producer = {v: eqn for eqn in jaxpr.eqns for v in eqn.outvars}
  seen = set()
  out = []
  for var in jaxpr.outvars:
    if isinstance(var, jex_core.Literal) or var in seen:
      continue
    seen.add(var)
    eqn = producer.get(var)
    if var in invars:
      kind = "argument"
    elif eqn is None:
      kind = "constant"  # A closed-over constant of the traced function.
    elif eqn.primitive.name == "convert_element_type" and eqn.invars[0] in invars:
      kind = "cast_copy"
    elif eqn.primitive.name == "broadcast_in_dim" and isinstance(eqn.invars[0], jex_core.Literal):
      kind = "constant"
    else:
      kind = "activation"
    out.append(SavedResidual(jax.ShapeDtypeStruct(var.aval.shape, var.aval.dtype), kind))
  return out
