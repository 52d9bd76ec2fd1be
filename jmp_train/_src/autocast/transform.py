"""A dtype policy as a function transformation: autocast for any JAX function.

:func:`autocast` traces a function to a jaxpr and evaluates the jaxpr again
with each equation's floating-point operands cast after the AMP op lists
(``lists``): matmuls and convolutions in the
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

import contextlib
import dataclasses
import functools
import sys
from typing import Any, Callable, NamedTuple, Sequence

import jax
import numpy as np

from jmp_train._src.autocast import calls as autocast_calls
from jmp_train._src.autocast import lists as autocast_lists
from jmp_train._src.policy import policy as policy_lib
from jmp_train._src.autocast.interpreter import _CONST
from jmp_train._src.autocast.interpreter import _HALF
from jmp_train._src.autocast.interpreter import _PARAM
from jmp_train._src.autocast.interpreter import _Rules
from jmp_train._src.autocast.interpreter import _cast
from jmp_train._src.autocast.interpreter import _dtype

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
  return isinstance(x, (jax.Array, np.ndarray, np.generic, jax.core.Tracer)) or (isinstance(x, jax.ShapeDtypeStruct))


def autocast(
  fun: Callable[..., Any],
  policy: policy_lib.Policy | str,
  *,
  float32_ops: Sequence[str] = autocast_lists.DEFAULT_FLOAT32_OPS,
  half_ops: Sequence[str] = autocast_lists.DEFAULT_HALF_OPS,
  lookup_ops: Sequence[str] = autocast_lists.DEFAULT_LOOKUP_OPS,
  params_argnums: int | Sequence[int] | None = 0,
  keep: Sequence[str] | str | None = None,
) -> Callable[..., Any]:
  r"""Runs ``fun`` under a mixed-precision policy by transforming its jaxpr.

  ``autocast(fun, policy)`` has ``fun``'s signature. Each call traces ``fun``
  to a jaxpr on the arguments' shapes and dtypes (``jax.make_jaxpr``) and
  evaluates it again, equation by equation, after the AMP op lists:

  * ``half_ops`` (allow list, default :data:`DEFAULT_HALF_OPS`:
    ``dot_general``, ``conv_general_dilated``): floating operands cast to
    ``policy.compute_dtype``, result in ``compute_dtype`` (GPUs and TPUs
    accumulate 16-bit matmuls in float32 in hardware; a float32 result would
    make the backward pass a mixed-dtype matmul). Under a policy with an FP8
    recipe (``"mixed_float8"``), a weight product (one operand a parameter,
    or computed from parameters alone) is an FP8 product with current
    scaling (:func:`jmp_train.fp8_dot_general` with ``meta=None``; a train
    step gives each its delayed scaling state), and under an INT8 recipe an
    int8 product; products of two activations (attention's) and the weight
    products in the ``keep`` scopes stay in ``compute_dtype``;
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
    to the activation's dtype, after its broadcast, so that its gradient
    (the broadcast's transpose, a sum over every token) is summed in
    ``param_dtype``. Only the ops that feed nothing but float32
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

  Flax NNX modules (and other NNX graph nodes: ``nnx.Variable`` s,
  ``nnx.Rngs``, optimizers) may be arguments, anywhere in ``args`` or
  ``kwargs``: their state updates (BatchNorm's running statistics, RNG
  counts, any ``nnx.Variable`` ``fun`` writes) are kept, in place, as
  without autocast, so ``nnx.value_and_grad(autocast(loss_fn, policy))``
  trains under ``nnx.jit`` as it does without autocast. A module's
  ``nnx.Param`` leaves are parameters when it is at ``params_argnums``;
  its other state keeps its dtype, and comes back in the dtype ``fun``
  gives it (float32 batch statistics stay float32). ``fun`` may neither
  return a module nor change a module's static attributes (a TypeError
  says so).

  Calls are followed: ``jit`` functions (inlined; their names join the
  scope), ``scan``, ``while_loop``, ``cond``/``switch``, ``checkpoint``,
  ``shard_map`` and ``custom_jvp`` functions (primal and rule both under the
  lists, e.g. ``jax.nn.relu``). ``custom_vjp`` functions, Pallas kernels,
  callbacks and other calls run as traced, with their operands cast back to
  the dtypes they were traced with, so their own rules stay valid. Explicit
  float-to-float casts in ``fun`` are kept.

  Entries ``"scope:PATTERN"`` in either list name a region (a
  ``jax.named_scope``, a linen module's path, an NNX submodule's attribute
  path such as ``blocks/1/attn``, or a jitted / ``custom_jvp`` function's
  name, as a shell glob matched against each name and each ``/``-joined run
  of names): every floating op inside runs in that list's dtype, the
  innermost named region winning. Each operation bound keeps the source
  line it was traced from.

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
    keep: under an FP8 or INT8 policy, the scopes whose weight products stay
      in ``compute_dtype`` (a first convolution, an LM head): shell globs
      matched as ``"scope:"`` entries are (``"head"``, ``"blocks/0/*"``).

  Returns:
    The transformed function.

  Raises:
    TypeError: if ``fun`` is not callable, or a list or ``params_argnums``
      is malformed; at a call, if ``fun`` returns an NNX module or changes
      the structure of one it was given.
    ValueError: if ``policy`` is not a policy or a valid spec, or a list
      entry is not a primitive name nor a ``"scope:"`` entry; at a call
      under an FP8 or INT8 policy, if a ``keep`` rule matches no weight
      product (naming the scopes they run in).

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

    An NNX module's state updates are kept:

    >>> from flax import nnx
    >>> model = nnx.BatchNorm(3, rngs=nnx.Rngs(0))
    >>> _ = autocast(lambda m, x: m(x), "mixed_bfloat16")(model, jnp.arange(6.0).reshape(2, 3))
    >>> model.mean[...]  # 0.99 * 0 + 0.01 * the batch's mean
    Array([0.015, 0.025, 0.035], dtype=float32)

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
      f"got scope entries {list(lookup_scopes)}."
    )
  f32_prims, f32_scopes = autocast_lists.split_op_list(f32)
  half_prims, half_scopes = autocast_lists.split_op_list(half)
  kept = autocast_lists.check_keep(keep)
  base_rules = _Rules(policy, half_prims, f32_prims, half_scopes, f32_scopes, lookup_prims, kept)
  argnums = _check_argnums(params_argnums)

  @functools.wraps(fun)
  def wrapped(*args, **kwargs):
    rules = dataclasses.replace(base_rules, matched=set(), seen=[])
    bad = [n for n in argnums if not -len(args) <= n < len(args)]
    if bad:
      raise ValueError(f"params_argnums {bad} out of range for a call with {len(args)} positional arguments.")
    params = {n % len(args) for n in argnums}
    nnx = _nnx()
    is_node = (lambda x: False) if nnx is None else functools.partial(_is_graph_node, nnx)
    is_param = [jax.tree.map(lambda _, p=i in params: p, a, is_leaf=is_node) for i, a in enumerate(args)]
    leaves, treedef = jax.tree.flatten((args, kwargs), is_leaf=is_node)
    kw_flags = jax.tree.map(lambda _: False, kwargs, is_leaf=is_node)
    param_flags = jax.tree.leaves((is_param, kw_flags))
    if any(is_node(x) for x in leaves):
      out = _call_nnx(nnx, rules, fun, leaves, treedef, param_flags)
      rules.check_kept()
      return out

    def call(full):
      a, k = jax.tree.unflatten(treedef, full)
      return _check_out(nnx, fun(*a, **k))

    kinds = [_PARAMETER if p else _ACTIVATION for p in param_flags]
    outs, out_shape = _evaluate(rules, call, leaves, kinds)
    rules.check_kept()
    outs = [_cast(o, policy.output_dtype) for o in outs]
    return jax.tree.unflatten(jax.tree.structure(out_shape), outs)

  return wrapped


# ---------------------------------------------------------------------------
# Tracing and evaluation.

# How an argument leaf enters the jaxpr: a parameter (cast to param_dtype),
# an activation (cast to compute_dtype), or module state (an NNX Variable
# other than a parameter, e.g. batch statistics: kept in its own dtype). Both
# parameters and state are tagged as parameters: they never promote an
# activation.
_ACTIVATION, _PARAMETER, _STATE = 0, 1, 2


def _evaluate(
  rules: _Rules, call: Callable[[list[Any]], Any], leaves: Sequence[Any], kinds: Sequence[int]
) -> tuple[list[Any], Any]:
  """Traces ``call(leaves)`` and evaluates its jaxpr under ``rules``.

  Args:
    rules: the op lists and the policy.
    call: the function, taking the list of leaves.
    leaves: the arguments' leaves; arrays are traced, the rest closed over.
    kinds: each leaf's ``_ACTIVATION``, ``_PARAMETER`` or ``_STATE``.

  Returns:
    The flat outputs as evaluated (no output cast) and the traced output
    shapes (``jax.ShapeDtypeStruct`` leaves, in ``call``'s output structure).
  """
  policy = rules.policy
  dynamic = [i for i, x in enumerate(leaves) if _is_array(x)]

  def flat_fun(*dyn):
    full = list(leaves)
    for i, x in zip(dynamic, dyn):
      full[i] = x
    return call(full)

  dyn_vals = [leaves[i] for i in dynamic]
  try:
    closed, out_shape = jax.make_jaxpr(flat_fun, return_shape=True)(*dyn_vals)
  except Exception as e:
    errors = sys.modules.get("flax.errors")
    if errors is not None and isinstance(e, errors.TraceContextError):
      raise TypeError(
        "autocast's function wrote to an NNX Variable it closes over, which autocast's "
        "tracing cannot keep. Pass the module as an argument: "
        "autocast(lambda model, x: ..., policy)(model, x) keeps its updates."
      ) from e
    raise
  vals, tags = [], []
  for i, x in zip(dynamic, dyn_vals):
    if _dtype(x) is None:
      vals.append(x)
      tags.append(_CONST)
    elif kinds[i] == _PARAMETER:
      vals.append(_cast(x, policy.param_dtype))
      tags.append(_PARAM)
    elif kinds[i] == _STATE:
      vals.append(x)
      tags.append(_PARAM)
    else:
      vals.append(_cast(x, policy.compute_dtype))
      tags.append(_HALF)
  outs, _ = autocast_calls._closed(rules, closed, vals, tags, ())
  return list(outs), out_shape


# ---------------------------------------------------------------------------
# Flax NNX modules as arguments.


def _nnx() -> Any:
  """``flax.nnx`` if it is imported (no NNX object exists otherwise), else ``None``."""
  return sys.modules.get("flax.nnx")


def _is_graph_node(nnx: Any, x: Any) -> bool:
  """Whether ``x`` is an NNX module, other graph node or ``Variable``."""
  return isinstance(x, nnx.Variable) or nnx.graph.is_node_module(x)


def _check_values(out: Any) -> None:
  """A TypeError naming the first output leaf that is not an array or number."""
  for path, leaf in jax.tree_util.tree_flatten_with_path(out)[0]:
    if not (_is_array(leaf) or isinstance(leaf, (bool, int, float, complex))):
      where = jax.tree_util.keystr(path) or "the output"
      raise TypeError(
        f"autocast's function returned {type(leaf).__name__} {leaf!r:.60} at {where}: "
        "autocast traces the function, so its outputs must be arrays or numbers. "
        "Return the other values from outside the autocast function."
      )


def _check_out(nnx: Any, out: Any) -> Any:
  """``out``, or a TypeError if it holds a non-array or an NNX module (a copy)."""
  if nnx is None:
    _check_values(out)
    return out
  is_module = lambda x: not isinstance(x, nnx.Variable) and nnx.graph.is_node_module(x)
  found = [type(x).__name__ for x in jax.tree.leaves(out, is_leaf=is_module) if is_module(x)]
  if found:
    raise TypeError(
      f"autocast's function returned NNX modules ({', '.join(found)}), which would come "
      "back as detached copies. Return nnx.state(module) instead; the modules passed as "
      "arguments are updated in place."
    )
  _check_values(out)
  return out


@contextlib.contextmanager
def module_scopes(nnx: Any, nodes: Sequence[Any]):
  """While tracing, each submodule's call runs under a ``jax.named_scope`` of its path.

  Linen writes a module's path into the name stack of the operations it
  traces; NNX writes nothing there. This names them the same way
  (``blocks/0/attn``), so ``"scope:PATTERN"`` entries match NNX submodules by
  path, and audits name them. The classes' ``__call__`` are wrapped for the
  duration of the trace only, and a module's own ``super().__call__`` adds no
  second scope.
  """
  paths: dict[int, str] = {}
  for node in nodes:
    if isinstance(node, nnx.Module):
      for path, module in nnx.iter_modules(node):
        if path:
          paths.setdefault(id(module), "/".join(str(p) for p in path))
  classes = {type(m) for node in nodes if isinstance(node, nnx.Module) for _, m in nnx.iter_modules(node)}
  active: list[int] = []
  patched = []

  def wrap(original):
    @functools.wraps(original)
    def call(self, *args, **kwargs):
      path = paths.get(id(self))
      if path is None or (active and active[-1] == id(self)):
        return original(self, *args, **kwargs)
      active.append(id(self))
      try:
        with jax.named_scope(path.rsplit("/", 1)[-1]) if active[:-1] else jax.named_scope(path):
          return original(self, *args, **kwargs)
      finally:
        active.pop()

    return call

  for cls in classes:
    original = next((c.__dict__["__call__"] for c in cls.__mro__ if "__call__" in c.__dict__), None)
    if original is None:
      continue
    patched.append((cls, cls.__dict__.get("__call__")))
    cls.__call__ = wrap(original)
  try:
    yield
  finally:
    for cls, own in reversed(patched):
      if own is None:
        del cls.__call__
      else:
        cls.__call__ = own


class _Static(NamedTuple):
  """A value of the new state that is not an array (no output of the jaxpr)."""

  value: Any


def _call_nnx(
  nnx: Any, rules: _Rules, fun: Callable[..., Any], leaves: list[Any], treedef: Any, param_flags: Sequence[bool]
) -> Any:
  """Calls ``fun`` on arguments holding NNX graph nodes, keeping their state updates.

  The graph nodes (modules, ``Variable`` s, ``Rngs``...; those of the
  arguments at ``params_argnums`` first, so that a ``Variable`` shared with
  one of them counts as a parameter) are split together into a graphdef and
  a state. The traced function merges a copy of them from the state, calls
  ``fun`` and splits the copy again: its outputs are ``fun``'s and the new
  state, which then updates the original nodes in place, as ``fun`` would.

  ``Param`` leaves of the nodes at ``params_argnums`` are parameters, those
  of other nodes activations, like any array there; other state (batch
  statistics, RNG keys and counts, caches) keeps its dtype. The new state
  comes back in the dtypes ``fun`` gives it without autocast (float32
  batch statistics stay float32); ``fun``'s own outputs in
  ``output_dtype``.
  """
  policy = rules.policy
  node_pos = {i for i, x in enumerate(leaves) if _is_graph_node(nnx, x)}
  order = sorted(node_pos, key=lambda i: (not param_flags[i], i))
  nodes = tuple(leaves[i] for i in order)
  graphdef, state = nnx.split(nodes, graph=True)

  # The kind of each state leaf: its Variable's first path entry is the
  # node's position in `nodes`.
  is_var = lambda x: isinstance(x, nnx.Variable)
  kinds = []
  for path, var in jax.tree_util.tree_flatten_with_path(state, is_leaf=is_var)[0]:
    if isinstance(var, nnx.Param):
      kind = _PARAMETER if param_flags[order[path[0].key]] else _ACTIVATION
    else:
      kind = _STATE
    kinds += [kind] * len(jax.tree.leaves(var))
  state_leaves, state_def = jax.tree.flatten(state)
  rest = [None if i in node_pos else x for i, x in enumerate(leaves)]
  rest_leaves, rest_def = jax.tree.flatten(rest)
  kinds += [_PARAMETER if param_flags[i] else _ACTIVATION for i, x in enumerate(leaves) if i not in node_pos]
  n_state = len(state_leaves)
  box = {}

  def call(full):
    copies = nnx.merge(graphdef, jax.tree.unflatten(state_def, full[:n_state]))
    args_leaves = jax.tree.unflatten(rest_def, full[n_state:])
    for i, node in zip(order, copies):
      args_leaves[i] = node
    a, k = jax.tree.unflatten(treedef, args_leaves)
    with module_scopes(nnx, copies):
      out = _check_out(nnx, fun(*a, **k))
    new_graphdef, new_state = nnx.split(copies, graph=True)
    new_leaves, new_def = jax.tree.flatten(new_state)
    # A leaf that is still its input comes back as it was passed (not as
    # the jaxpr evaluates it: cast to the dtype of its kind); other arrays
    # are outputs of the jaxpr; other values (Python scalars) are static.
    inputs = {id(x): i for i, x in enumerate(full[:n_state])}
    box.update(
      graphdef=new_graphdef,
      state_def=new_def,
      leaves=[inputs.get(id(x)) if _is_array(x) else _Static(x) for x in new_leaves],
    )
    return out, [x for x in new_leaves if _is_array(x) and id(x) not in inputs]

  outs, (out_shape, new_shapes) = _evaluate(rules, call, state_leaves + rest_leaves, kinds)
  n_out = len(jax.tree.leaves(out_shape))
  out = jax.tree.unflatten(jax.tree.structure(out_shape), [_cast(o, policy.output_dtype) for o in outs[:n_out]])
  # The new state in the dtypes `fun` gives it (as traced).
  new_vals = iter(_cast(x, s.dtype) if _dtype(s) is not None else x for x, s in zip(outs[n_out:], new_shapes))
  new_leaves = [
    next(new_vals) if x is None else x.value if isinstance(x, _Static) else state_leaves[x] for x in box["leaves"]
  ]
  nnx.update(nodes, jax.tree.unflatten(box["state_def"], new_leaves))
  if nnx.graphdef(nodes, graph=True) != box["graphdef"]:
    raise TypeError(
      "autocast's function changed the structure of its NNX arguments (set or deleted "
      "a static attribute, or replaced a submodule by one of another structure): autocast "
      "traces the function on a copy of the modules and carries their Variables' new "
      "values back, not such changes. Make the change outside the function, or keep the "
      "value in an nnx.Variable (its updates are carried back)."
    )
  return out
