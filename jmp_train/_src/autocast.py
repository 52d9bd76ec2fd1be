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

import functools
from typing import Any, Callable, Sequence

import jax
import numpy as np

from jmp_train._src import autocast_calls
from jmp_train._src import autocast_lists
from jmp_train._src import policy as policy_lib
from jmp_train._src.autocast_interpreter import _CONST
from jmp_train._src.autocast_interpreter import _HALF
from jmp_train._src.autocast_interpreter import _PARAM
from jmp_train._src.autocast_interpreter import _Rules
from jmp_train._src.autocast_interpreter import _cast
from jmp_train._src.autocast_interpreter import _dtype

__all__ = ["autocast"]


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
    lookup_ops: Sequence[str] = autocast_lists.DEFAULT_LOOKUP_OPS,
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
  * ``lookup_ops`` (default :data:`DEFAULT_LOOKUP_OPS`: ``gather``) on a
    parameter table: the rows are read in ``param_dtype`` and cast to
    ``compute_dtype`` after the lookup (an embedding's output is a
    half-precision activation; the table's gradient is scattered back in
    ``param_dtype``);
  * every other op (infer) follows its operands: float32 if one comes from
    a float32 op, else ``compute_dtype`` if one is a half-precision
    activation, else as traced. Parameters and constants never promote an
    activation: a float32 bias added to a half-precision activation is cast
    to the activation's dtype. Only the ops that feed nothing but float32
    ops join a float32 region (softmax's ``x - max(x)``), and, one level
    deep, an op whose every use meets a float32 value (batch norm's
    ``x - mean`` before ``* rsqrt(var)``); a half-precision value that meets
    a float32 one elsewhere (a residual stream entering a normalization) is
    cast at that op and stays half precision.

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
    lookup_ops: the table lookups (``()`` to keep looked-up rows in
      ``param_dtype``).
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
  lookup = autocast_lists.check_op_list(lookup_ops, "lookup_ops")
  both = sorted(set(f32) & set(half))
  if both:
    raise ValueError(f"{both} are in both float32_ops and half_ops; keep each in one list.")
  lookup_prims, lookup_scopes = autocast_lists.split_op_list(lookup)
  if lookup_scopes:
    raise ValueError(
        f"lookup_ops holds primitive names only (e.g. {autocast_lists.DEFAULT_LOOKUP_OPS}), "
        f"got scope entries {list(lookup_scopes)}.")
  f32_prims, f32_scopes = autocast_lists.split_op_list(f32)
  half_prims, half_scopes = autocast_lists.split_op_list(half)
  rules = _Rules(policy, half_prims, f32_prims, half_scopes, f32_scopes, lookup_prims)
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
    outs, _ = autocast_calls._closed(rules, closed, vals, tags, ())
    outs = [_cast(o, policy.output_dtype) for o in outs]
    return jax.tree.unflatten(jax.tree.structure(out_shape), outs)

  return wrapped
