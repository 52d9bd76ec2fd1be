"""Models a train step accepts: a linen-style ``apply``, a linen module, an NNX module.

:func:`as_model` turns what the user passed to
:func:`jmp_train.make_train_step` into one small interface, so that the step
itself never asks which kind of model it runs:

* ``initial(params, model_state)``: the ``(params, model_state)`` pair a
  :class:`~jmp_train.TrainState` stores;
* ``train_apply(params, model_state, inputs, rng, replica)``: outputs and the
  new ``model_state`` in training mode;
* ``eval_apply(params, model_state, inputs)``: outputs in evaluation mode.

An ``nnx.Module`` is split once, at construction, into its graph definition,
its ``nnx.Param`` s and the rest (batch statistics, RNG streams); each step
merges a fresh module inside the trace, so no module object crosses a trace
boundary. Typed PRNG keys of NNX RNG streams are stored as their ``uint32``
key data (as :class:`~jmp_train.TrainState` stores its own key), so the
state can be replicated, averaged and checkpointed like any array tree.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp

from jmp_train._src.autocast import sites

__all__ = ["as_model", "LinenModel", "NnxModel"]


def _is_linen_module(x: Any) -> bool:
  from flax import linen

  return isinstance(x, linen.Module)


def _is_nnx_module(x: Any) -> bool:
  from flax import nnx

  return isinstance(x, nnx.Module)


def _invalid_rng_error() -> type[Exception]:
  from flax import errors

  return errors.InvalidRngError


def _first_line(e: BaseException) -> str:
  """The first line of ``e``'s message, without Flax's link to its docs."""
  lines = str(e).strip().splitlines()
  if not lines:
    return type(e).__name__
  # Without Flax's link, and without the scope of the step's own remat.
  return re.sub(r"\s*\(https?://[^)]*\)", "", lines[0]).replace("/remat()", "")


def _linen_rng_error(e: Exception, rng: Any, rng_collections: Sequence[str]) -> ValueError:
  """What make_train_step expects, for a linen ``InvalidRngError`` ``e``."""
  match = re.search(r'PRNG for "([^"]+)"', str(e))
  name = match.group(1) if match else None
  wanted = repr(name) if name else "each collection the model draws from"
  if rng is None:
    fix = (
      "the state holds no PRNG key: make it with step.init(params, rng=0) (an "
      "int seed or a PRNG key), and make_train_step passes a key, folded with "
      "the step and the replica, under each name in rng_collections "
      f"(now {tuple(rng_collections)!r}), which must include {wanted}"
    )
  else:
    names = tuple(rng_collections) + ((name,) if name and name not in rng_collections else ())
    fix = (
      f"make_train_step passes keys only under the names in rng_collections, "
      f"now {tuple(rng_collections)!r}: pass make_train_step(..., "
      f"rng_collections={names!r})"
    )
  return ValueError(f"The model needs a PRNG key ({_first_line(e)}), but {fix}.")


def _nnx_rng_error(e: Exception) -> ValueError | None:
  """What make_train_step expects, if ``e`` is NNX's Dropout without rngs."""
  text = str(e)
  if not re.search(r"no `?rngs`? (argument )?was provided", text):
    return None
  return ValueError(
    f"An nnx.Dropout of the module has no RNG stream ({_first_line(e)}). "
    "make_train_step passes no rngs to an NNX module (rng_collections and "
    "step.init's rng are for linen models): each step draws from the module's "
    "own nnx.Rngs streams, which it stores in model_state. Construct the "
    "Dropout with a stream, nnx.Dropout(0.5, rngs=nnx.Rngs(dropout=0)), or "
    "pass the module's rngs (an nnx.Rngs with a 'dropout' stream) to it."
  )


def _collection_name(e: Exception) -> str | None:
  match = re.search(r'collection "([^"]+)"', str(e))
  return match.group(1) if match else None


def _missing_collection_error(e: Exception, model_state: Any) -> ValueError:
  """What make_train_step expects, for a linen ``ScopeCollectionNotFound`` ``e``."""
  name = _collection_name(e) or "batch_stats"
  if name == fp8_meta_collection():
    return ValueError(
      f"The model's FP8 products keep their scaling state in the {name!r} collection, "
      f"which the state does not hold ({_first_line(e)}). Make it with "
      "step.init(params, ..., inputs=example_inputs): the step traces the model once "
      "on the example inputs (their shapes) to find its products."
    )
  held = sorted(model_state) if isinstance(model_state, dict) else []
  hint = ""
  if held:
    hint = (
      f" model_state holds {held}: it maps collection names to their variables, "
      f"so pass model_state={{{name!r}: variables[{name!r}]}}, not the "
      "collection's contents."
    )
  return ValueError(
    f"The model reads the {name!r} collection, which the state does not hold "
    f"({_first_line(e)}). Pass it to step.init(params, model_state={{{name!r}: "
    f"variables[{name!r}]}}) with variables = model.init(...).{hint}"
  )


def fp8_meta_collection() -> str:
  from jmp_train._src.fp8 import flax_layers

  return flax_layers.FP8_COLLECTION


def _scope_errors() -> tuple[type[Exception], type[Exception]]:
  from flax import errors

  return errors.ScopeCollectionNotFound, errors.ModifyScopeVariableError


def _split_sites(model_state: Any) -> tuple[dict[str, Any], Any]:
  """``(site states, model_state without them)`` of a linen model (``autocast.sites``).

  The site states sit under ``autocast.sites.SITES`` in the ``"fp8_meta"``
  collection; the model itself never sees them.
  """
  name = fp8_meta_collection()
  collection = model_state.get(name) if model_state else None
  if not hasattr(collection, "get") or sites.SITES not in collection:
    return {}, model_state
  rest = {k: v for k, v in collection.items() if k != sites.SITES}
  others = {k: v for k, v in model_state.items() if k != name}
  return dict(collection[sites.SITES]), ({**others, name: rest} if rest else others)


def _join_sites(model_state: Any, states: dict[str, Any]) -> Any:
  """The inverse of :func:`_split_sites`."""
  if not states:
    return model_state
  name = fp8_meta_collection()
  model_state = dict(model_state)
  model_state[name] = {**model_state.get(name, {}), sites.SITES: states}
  return model_state


@dataclasses.dataclass(frozen=True)
class LinenModel:
  """A Flax linen-style ``apply_fn(variables, inputs, **kwargs)``."""

  apply_fn: Callable[..., Any]
  eval_apply_fn: Callable[..., Any] | None
  rng_collections: Sequence[str]
  # "flax" or "autocast": the apply runs under the policy; "inputs": as given.
  mechanism: str = "inputs"
  # Trace the forward pass for products wider than the compute dtype.
  audit: bool = False

  # The policy of the "flax" mechanism (FP8 scaling state at init).
  policy: Any = None
  # Whether the user's apply is a linen module's (it takes ``rngs`` and
  # ``mutable``); a function of the user's is called as the step calls it.
  linen: bool = True

  def initial(self, params: Any, model_state: Any, inputs: Any = None, axis_name: str | None = None) -> tuple[Any, Any]:
    """``(params, model_state)``, the latter with FP8 scaling state made if missing.

    Raises:
      TypeError: without ``params``.
      ValueError: if an FP8 policy needs the ``"fp8_meta"`` collection and
        neither ``model_state`` nor ``inputs`` gives it.
    """
    if params is None:
      raise TypeError("init needs the parameters: step.init(params).")
    model_state = {} if model_state is None else dict(model_state)
    name = fp8_meta_collection()
    if self.policy is not None and self.policy.fp8 is not None and name not in model_state:
      if inputs is None:
        if self.mechanism != "flax" and not (self.mechanism == "autocast" and sites.has_state(self.policy)):
          return params, model_state  # current scaling: no state to make
        raise ValueError(
          f"Under the FP8 policy {self.policy} each product of the model keeps its "
          f"scaling state in the {name!r} collection, which model_state does not hold. "
          "Pass example inputs (one batch's inputs, or arrays of their shapes) so the "
          "step can make it: step.init(params, ..., inputs=example_inputs)."
        )
      fp8_meta = self._initial_fp8_meta(params, model_state, inputs, axis_name)
      if fp8_meta:
        model_state[name] = fp8_meta
    return params, model_state

  def _initial_fp8_meta(self, params: Any, model_state: Any, inputs: Any, axis_name: str | None) -> Any:
    """The ``"fp8_meta"`` collection of the model on ``inputs``, at its initial values."""
    from jmp_train._src.fp8 import flax_layers

    name = fp8_meta_collection()
    key = jax.random.key(0)
    rngs = {c: key for c in self.rng_collections}
    inputs = self.policy.cast_to_compute(inputs)
    if self.linen:
      trace = lambda p, s, x: self.apply_fn({"params": p, **s}, x, rngs=rngs, mutable=[*s, name])[1]
    else:
      trace = lambda p, s, x: self.train_apply(p, s, x, None, None)[1]  # noqa: E731
    if axis_name is not None:  # the model's collectives (synchronized BatchNorm)
      trace = jax.vmap(trace, in_axes=None, out_axes=None, axis_size=1, axis_name=axis_name)
    try:
      shapes, names = sites.traced(trace, self.policy.cast_to_param(params), model_state, inputs)
    except _scope_errors() as e:
      raise _missing_collection_error(e, model_state) from None
    values = flax_layers.initial_fp8_values(self.policy.fp8)

    def initial(path, shape):
      value = values[path[-1].key]
      if value.shape == shape.shape:
        return value
      # A layer of another recipe (a model wrapped by hand): the same rule, its length.
      return jnp.full(shape.shape, value.reshape(-1)[0] if value.size else 0, shape.dtype)

    made = jax.tree_util.tree_map_with_path(initial, shapes.get(name, {}))
    if self.mechanism == "autocast" and sites.has_state(self.policy) and names:
      made = {**made, sites.SITES: sites.initial(self.policy.fp8, names)}
    return made

  def train_apply(self, params, model_state, inputs, rng, replica):
    """Outputs and new model state in training mode.

    Raises:
      ValueError: if the model needs a PRNG key the step did not pass (no
        ``rng`` in the state, or a collection missing from
        ``rng_collections``), saying which.
    """
    del replica  # Folded into ``rng`` by the step.
    states, model_state = _split_sites(model_state)
    variables = {"params": params, **model_state}
    kwargs = {}
    if rng is not None:
      kwargs["rngs"] = {name: jax.random.fold_in(rng, i) for i, name in enumerate(self.rng_collections)}
    try:
      with sites.delayed(states):
        if not model_state:
          return self.apply_fn(variables, inputs, **kwargs), _join_sites(model_state, states)
        outputs, new_model_state = self.apply_fn(variables, inputs, mutable=list(model_state), **kwargs)
    except _invalid_rng_error() as e:
      raise _linen_rng_error(e, rng, self.rng_collections) from None
    except _scope_errors()[0] as e:
      raise _missing_collection_error(e, model_state) from None
    # The sites' new states come back as their gradient.
    return outputs, _join_sites(dict(new_model_state), states)

  def eval_apply(self, params, model_state, inputs):
    """Outputs in evaluation mode (no ``rngs``, nothing mutable).

    Raises:
      ValueError: if the model still draws random numbers, naming
        ``eval_apply_fn``.
    """
    states, model_state = _split_sites(model_state)
    try:
      with sites.delayed(states):
        return (self.eval_apply_fn or self.apply_fn)({"params": params, **model_state}, inputs)
    except _scope_errors()[0] as e:
      raise _missing_collection_error(e, model_state) from None
    except _scope_errors()[1] as e:
      raise ValueError(
        f"evaluate calls the model with nothing mutable, but it writes to the "
        f"{_collection_name(e) or 'batch_stats'!r} collection in this mode "
        f"({_first_line(e)}): a model in training mode (BatchNorm updating its "
        "statistics). Pass make_train_step(..., eval_apply_fn=functools.partial("
        "model.apply, train=False)), an apply in evaluation mode."
      ) from None
    except _invalid_rng_error() as e:
      raise ValueError(
        f"evaluate calls the model without PRNG keys, but it needs one "
        f"({_first_line(e)}): pass make_train_step(..., eval_apply_fn=...) an "
        "apply in evaluation mode, e.g. functools.partial(model.apply, "
        "train=False), with its Dropout deterministic."
      ) from None


def call_module(module: Any, inputs: Any) -> Any:
  """``module(inputs)``, or ``module(*inputs)`` / ``module(**inputs)`` where its call needs it.

  A batch is ``(inputs, targets)``. A module whose ``__call__`` takes one
  argument gets ``inputs`` whole. One that takes several (Flax's Gemma:
  ``Transformer(tokens, positions, cache, attention_mask)``) gets a tuple
  of inputs as its positional arguments and a dict as its keyword
  arguments: whichever of ``module(inputs)``, ``module(*inputs)`` and
  ``module(**inputs)`` its signature accepts, in that order.

  Raises:
    TypeError: if the signature accepts none of them, naming it and the
      convention.
  """
  from jmp_train._src.flax import nnx_modules

  # A policy wrapper takes what its module takes.
  inner = module.module if isinstance(module, nnx_modules.NNXPolicyWrapper) else None
  try:
    signature = inspect.signature((inner or module).__call__)
  except (TypeError, ValueError):  # no signature to read: called as given
    return module(inputs)
  calls = [((inputs,), {})]
  if isinstance(inputs, (tuple, list)):
    calls.append((tuple(inputs), {}))
  if isinstance(inputs, dict) and all(isinstance(k, str) for k in inputs):
    calls.append(((), dict(inputs)))
  for args, kwargs in calls:
    try:
      signature.bind(*args, **kwargs)
    except TypeError:
      continue
    return module(*args, **kwargs)
  kind = type(inputs).__name__
  raise TypeError(
    f"{type(inner or module).__name__}.__call__{signature} cannot take the batch's inputs (a {kind}): "
    "make_train_step calls an NNX module as module(inputs) with batch = (inputs, targets), "
    "module(*inputs) when inputs is a tuple of its positional arguments, and "
    "module(**inputs) when inputs is a dict of its keyword arguments. Make the batch "
    "((tokens, positions, ...), targets) or ({'tokens': ..., ...}, targets)."
  )


def _key_to_data(tree: Any) -> Any:
  return jax.tree.map(
    lambda x: jax.random.key_data(x) if jnp.issubdtype(x.dtype, jax.dtypes.prng_key) else x,
    tree,
  )


def _data_to_key(tree: Any, replica: jax.Array | None) -> Any:
  """Typed keys back from key data, folded with the replica index if any."""
  from flax import nnx

  def wrap(variable):
    if not isinstance(variable, nnx.RngKey):
      return variable
    key = jax.random.wrap_key_data(variable.get_value())
    if replica is not None:
      # One dropout mask per replica, not the same mask everywhere. A stream
      # of layers made under nnx.vmap (scan over layers) holds a key per layer.
      fold = lambda k: jax.random.fold_in(k, replica)
      for _ in range(key.ndim):
        fold = jax.vmap(fold)
      key = fold(key)
    return variable.replace(key)

  tree = jax.tree.map(wrap, tree, is_leaf=lambda x: isinstance(x, nnx.Variable))
  # Fresh Variable objects, made at the current trace level: NNX refuses to
  # mutate a variable made outside it (batch statistics under grad).
  return jax.tree.map(lambda x: x, tree)


@dataclasses.dataclass(frozen=True)
class NnxModel:
  """A Flax NNX module, split into graph definition, parameters and the rest."""

  graphdef: Any
  params: Any
  rest: Any
  # The policy the module's layers get ("flax"), or None (as given).
  policy: Any = None
  # "flax": the layers carry the policy; "autocast": the call runs under it.
  mechanism: str = "inputs"
  # The caller's graph definition, for to_module (None: ``graphdef``).
  user_graphdef: Any = None
  audit: bool = False
  # Scopes whose weight products autocast keeps in the compute dtype.
  keep: tuple[str, ...] = ()

  @classmethod
  def from_module(
    cls, module: Any, policy: Any = None, mechanism: str = "inputs", audit: bool = False, keep: tuple[str, ...] = ()
  ) -> "NnxModel":
    from flax import nnx
    from jmp_train._src.flax import nnx_modules

    user_graphdef = None
    if mechanism == "flax":
      user_graphdef = nnx.graphdef(module)
      module = nnx_modules.configured_copy(module, policy)
      if policy.fp8 is not None:
        user_graphdef = None  # FP8 scaling state: only the configured module holds it
    graphdef, params, rest = nnx.split(module, nnx.Param, ...)
    return cls(graphdef, params, _key_to_data(rest), policy, mechanism, user_graphdef, audit, keep)

  def initial(self, params: Any, model_state: Any, inputs: Any = None, axis_name: str | None = None) -> tuple[Any, Any]:
    """``(params, model_state)``, the latter with autocast's FP8 site states made if missing.

    An NNX module holds its state itself; under an FP8 policy with delayed
    scaling, the step traces the module once on ``inputs`` to find the FP8
    products autocast makes, and adds their states (``autocast.sites``).

    Raises:
      ValueError: if ``params`` is a module of another structure, or the
        site states are needed and ``inputs`` is not given.
    """
    if params is None:
      params, rest = self.params, self.rest
    elif _is_nnx_module(params):
      other = NnxModel.from_module(params, self.policy, self.mechanism, keep=self.keep)
      if jax.tree.structure(other.params) != jax.tree.structure(self.params):
        raise ValueError(
          "init got an nnx.Module whose parameters differ in structure from the module the step was built from."
        )
      params, rest = other.params, other.rest
    else:
      rest = self.rest
    if model_state is not None:
      return params, model_state
    if self.mechanism == "autocast" and sites.has_state(self.policy):
      rest = self._with_sites(params, rest, inputs, axis_name)
    return params, rest

  def _with_sites(self, params: Any, rest: Any, inputs: Any, axis_name: str | None) -> Any:
    """``rest`` with the site states of the FP8 products autocast makes."""
    from flax import nnx
    from jmp_train._src.fp8 import flax_layers

    if inputs is None:
      raise ValueError(
        f"Under the FP8 policy {self.policy} each FP8 product of the module keeps its "
        "scaling state (amax histories) in the model state, which the step makes by "
        "tracing the module once. Pass example inputs (one batch's inputs, or arrays of "
        "their shapes): step.init(module, inputs=example_inputs)."
      )

    def trace(p, s, x):
      model = self._merge(p, s, None)
      model.train()
      return self._call(model, x)

    if axis_name is not None:  # the model's collectives (synchronized BatchNorm)
      trace = jax.vmap(trace, in_axes=None, out_axes=None, axis_size=1, axis_name=axis_name)
    _, names = sites.traced(trace, params, rest, self.policy.cast_to_compute(inputs))
    if not names:
      return rest
    return nnx.State({**rest.raw_mapping, sites.SITES: sites.initial(self.policy.fp8, names, flax_layers.Fp8Meta)})

  def _merge(self, params, model_state, replica):
    from flax import nnx

    model_state = _without_sites(model_state)
    return nnx.merge(self.graphdef, params, _data_to_key(model_state, replica))

  def to_module(self, params, model_state):
    """The module holding ``params`` and ``model_state`` (typed keys again).

    Of the caller's class and fields where the step configured a copy of it
    for the policy (``model_policy="flax"``), unless FP8 scaling state makes
    the configured module the only one that holds the state.
    """
    from flax import nnx

    if self.user_graphdef is None:
      return self._merge(params, model_state, None)
    return nnx.merge(self.user_graphdef, params, _data_to_key(_without_sites(model_state), None))

  def _call(self, model, inputs):
    """``model(inputs)`` as the mechanism runs it."""
    from jmp_train._src.train import model_policy

    if self.mechanism == "flax":
      from jmp_train._src.flax import nnx_modules

      # The recompute of apply_policy's wrapper; inputs are cast by the step.
      return call_module(nnx_modules.NNXPolicyWrapper(model, self.policy, cast_inputs=False), inputs)
    if self.mechanism == "autocast":
      return model_policy.autocast_call(model, inputs, self.policy, self.keep)
    return call_module(model, inputs)

  def train_apply(self, params, model_state, inputs, rng, replica):
    """Outputs and new model state in training mode.

    Raises:
      ValueError: if an ``nnx.Dropout`` has no RNG stream, saying how to
        give it one.
    """
    from flax import nnx

    del rng  # The module draws from its own nnx.Rngs streams.
    model = self._merge(params, model_state, replica)
    model.train()
    try:
      with sites.delayed(_nnx_sites(model_state)):
        outputs = self._call(model, inputs)
    except (ValueError, TypeError) as e:
      error = _nnx_rng_error(e)
      if error is None:
        raise
      raise error from None
    _, _, rest = nnx.split(model, nnx.Param, ...)
    # Keep the stored (unfolded) keys; the streams' counters move on.
    rest = jax.tree.map(
      lambda new, old: old if jnp.issubdtype(new.dtype, jax.dtypes.prng_key) else new,
      rest,
      _without_sites(model_state),
    )
    if sites.SITES in model_state:  # new values come back as their gradient
      rest = nnx.State({**rest.raw_mapping, sites.SITES: model_state.raw_mapping[sites.SITES]})
    return outputs, rest

  def eval_apply(self, params, model_state, inputs):
    model = self._merge(params, model_state, None)
    model.eval()
    with sites.delayed(_nnx_sites(model_state)):
      return self._call(model, inputs)


def _without_sites(model_state: Any) -> Any:
  """An NNX model state without autocast's site states (``autocast.sites``)."""
  from flax import nnx

  if isinstance(model_state, nnx.State) and sites.SITES in model_state:
    return nnx.State({k: v for k, v in model_state.raw_mapping.items() if k != sites.SITES})
  return model_state


def _nnx_sites(model_state: Any) -> dict[str, Any]:
  """The site states of an NNX model state, as arrays."""
  from flax import nnx

  if not isinstance(model_state, nnx.State) or sites.SITES not in model_state:
    return {}
  return nnx.to_pure_dict(model_state[sites.SITES])


def _linen_apply_fn(fn: Any, policy: Any, mechanism: str, keep: tuple[str, ...] = ()) -> Any:
  """``fn`` with the policy applied by ``mechanism`` (``"flax"`` falls back to autocast)."""
  from jmp_train._src.train import model_policy

  if mechanism == "flax" and model_policy.linen_parts(fn) is None:
    mechanism = "autocast"  # an evaluation function that is no linen apply
  return model_policy.linen_apply(fn, policy, mechanism, keep)


def as_model(
  apply_fn: Any,
  eval_apply_fn: Any,
  rng_collections: Sequence[str],
  policy: Any = None,
  model_policy: str = "inputs",
  keep: tuple[str, ...] = (),
) -> LinenModel | NnxModel:
  """The model interface for what was passed as ``apply_fn``.

  Args:
    apply_fn: a linen-style apply function, a ``flax.linen.Module`` (its
      ``apply`` is used) or a ``flax.nnx.Module``.
    eval_apply_fn: the apply for evaluation, or ``None``.
    rng_collections: the ``rngs`` names a linen apply receives.
    policy: the step's :class:`~jmp_train.Policy`, or None.
    model_policy: how the policy reaches the model's products (see
      ``train.model_policy``): ``"auto"``, ``"flax"``, ``"autocast"`` or
      ``"inputs"``.
    keep: scopes whose weight products autocast keeps in the compute dtype.

  Returns:
    A :class:`LinenModel` or :class:`NnxModel`.

  Raises:
    TypeError: if ``apply_fn`` or ``eval_apply_fn`` is not callable, an
      ``eval_apply_fn`` is given with an NNX module, or ``model_policy="flax"``
      is given a function that is not a Flax module's apply.

  Examples:
    >>> import flax.linen as nn
    >>> as_model(nn.Dense(3), None, ("dropout",)).apply_fn.__name__
    'apply'
  """
  from jmp_train._src.train import model_policy as mp

  narrow = policy is not None and mp.is_narrow(policy)
  mechanism = model_policy if narrow and not mp.applies_policy(apply_fn) else "inputs"
  if mechanism == "auto":
    mechanism = mp.default_mechanism(apply_fn, policy)
  audit = mechanism != "inputs"
  if _is_nnx_module(apply_fn):
    if eval_apply_fn is not None:
      raise TypeError(
        "eval_apply_fn is not used with an nnx.Module: evaluation calls module.eval() on a copy of the module."
      )
    return NnxModel.from_module(apply_fn, policy, mechanism, audit, keep)
  if _is_linen_module(apply_fn):
    apply_fn = apply_fn.apply
  if _is_linen_module(eval_apply_fn):
    eval_apply_fn = eval_apply_fn.apply
  if not callable(apply_fn):
    raise TypeError(
      f"apply_fn must be callable (a linen apply such as model.apply, a "
      f"linen Module or an nnx.Module), got {type(apply_fn).__name__}: {apply_fn!r}."
    )
  if eval_apply_fn is not None and not callable(eval_apply_fn):
    raise TypeError(f"eval_apply_fn must be callable or None, got {type(eval_apply_fn).__name__}: {eval_apply_fn!r}.")
  rng_collections = tuple(rng_collections)
  linen = mp.linen_parts(apply_fn) is not None
  if mechanism != "inputs":
    apply_fn = mp.linen_apply(apply_fn, policy, mechanism, keep)
    eval_apply_fn = None if eval_apply_fn is None else _linen_apply_fn(eval_apply_fn, policy, mechanism, keep)
  return LinenModel(apply_fn, eval_apply_fn, rng_collections, mechanism, audit, policy, linen)
