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
import re
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp

__all__ = ["as_model", "LinenModel", "NnxModel"]


def _is_linen_module(x: Any) -> bool:
  from flax import linen  # pylint: disable=g-import-not-at-top

  return isinstance(x, linen.Module)


def _is_nnx_module(x: Any) -> bool:
  from flax import nnx  # pylint: disable=g-import-not-at-top

  return isinstance(x, nnx.Module)


def _invalid_rng_error() -> type[Exception]:
  from flax import errors  # pylint: disable=g-import-not-at-top

  return errors.InvalidRngError


def _first_line(e: BaseException) -> str:
  """The first line of ``e``'s message, without Flax's link to its docs."""
  lines = str(e).strip().splitlines()
  return re.sub(r"\s*\(https?://[^)]*\)", "", lines[0]) if lines else type(e).__name__


def _linen_rng_error(e: Exception, rng: Any, rng_collections: Sequence[str]) -> ValueError:
  """What make_train_step expects, for a linen ``InvalidRngError`` ``e``."""
  match = re.search(r'PRNG for "([^"]+)"', str(e))
  name = match.group(1) if match else None
  wanted = repr(name) if name else "each collection the model draws from"
  if rng is None:
    fix = ("the state holds no PRNG key: make it with step.init(params, rng=0) (an "
           "int seed or a PRNG key), and make_train_step passes a key, folded with "
           "the step and the replica, under each name in rng_collections "
           f"(now {tuple(rng_collections)!r}), which must include {wanted}")
  else:
    names = tuple(rng_collections) + ((name,) if name and name not in rng_collections else ())
    fix = (f"make_train_step passes keys only under the names in rng_collections, "
           f"now {tuple(rng_collections)!r}: pass make_train_step(..., "
           f"rng_collections={names!r})")
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


@dataclasses.dataclass(frozen=True)
class LinenModel:
  """A Flax linen-style ``apply_fn(variables, inputs, **kwargs)``."""

  apply_fn: Callable[..., Any]
  eval_apply_fn: Callable[..., Any] | None
  rng_collections: Sequence[str]

  def initial(self, params: Any, model_state: Any) -> tuple[Any, Any]:
    if params is None:
      raise TypeError("init needs the parameters: step.init(params).")
    return params, {} if model_state is None else dict(model_state)

  def train_apply(self, params, model_state, inputs, rng, replica):
    """Outputs and new model state in training mode.

    Raises:
      ValueError: if the model needs a PRNG key the step did not pass (no
        ``rng`` in the state, or a collection missing from
        ``rng_collections``), saying which.
    """
    del replica  # Folded into ``rng`` by the step.
    variables = {"params": params, **model_state}
    kwargs = {}
    if rng is not None:
      kwargs["rngs"] = {
          name: jax.random.fold_in(rng, i) for i, name in enumerate(self.rng_collections)
      }
    try:
      if not model_state:
        return self.apply_fn(variables, inputs, **kwargs), model_state
      outputs, new_model_state = self.apply_fn(
          variables, inputs, mutable=list(model_state), **kwargs
      )
    except _invalid_rng_error() as e:
      raise _linen_rng_error(e, rng, self.rng_collections) from None
    return outputs, dict(new_model_state)

  def eval_apply(self, params, model_state, inputs):
    """Outputs in evaluation mode (no ``rngs``, nothing mutable).

    Raises:
      ValueError: if the model still draws random numbers, naming
        ``eval_apply_fn``.
    """
    try:
      return (self.eval_apply_fn or self.apply_fn)({"params": params, **model_state}, inputs)
    except _invalid_rng_error() as e:
      raise ValueError(
          f"evaluate calls the model without PRNG keys, but it needs one "
          f"({_first_line(e)}): pass make_train_step(..., eval_apply_fn=...) an "
          "apply in evaluation mode, e.g. functools.partial(model.apply, "
          "train=False), with its Dropout deterministic."
      ) from None


def _key_to_data(tree: Any) -> Any:
  return jax.tree.map(
      lambda x: jax.random.key_data(x) if jnp.issubdtype(x.dtype, jax.dtypes.prng_key) else x,
      tree,
  )


def _data_to_key(tree: Any, replica: jax.Array | None) -> Any:
  """Typed keys back from key data, folded with the replica index if any."""
  from flax import nnx  # pylint: disable=g-import-not-at-top

  def wrap(variable):
    if not isinstance(variable, nnx.RngKey):
      return variable
    key = jax.random.wrap_key_data(variable.get_value())
    if replica is not None:
      # One dropout mask per replica, not the same mask everywhere.
      key = jax.random.fold_in(key, replica)
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

  @classmethod
  def from_module(cls, module: Any) -> "NnxModel":
    from flax import nnx  # pylint: disable=g-import-not-at-top

    graphdef, params, rest = nnx.split(module, nnx.Param, ...)
    return cls(graphdef, params, _key_to_data(rest))

  def initial(self, params: Any, model_state: Any) -> tuple[Any, Any]:
    if params is None:
      return self.params, self.rest if model_state is None else model_state
    if _is_nnx_module(params):
      other = NnxModel.from_module(params)
      if jax.tree.structure(other.params) != jax.tree.structure(self.params):
        raise ValueError(
            "init got an nnx.Module whose parameters differ in structure from "
            "the module the step was built from."
        )
      return other.params, other.rest if model_state is None else model_state
    return params, self.rest if model_state is None else model_state

  def _merge(self, params, model_state, replica):
    from flax import nnx  # pylint: disable=g-import-not-at-top

    return nnx.merge(self.graphdef, params, _data_to_key(model_state, replica))

  def to_module(self, params, model_state):
    """The module holding ``params`` and ``model_state`` (typed keys again)."""
    return self._merge(params, model_state, None)

  def train_apply(self, params, model_state, inputs, rng, replica):
    """Outputs and new model state in training mode.

    Raises:
      ValueError: if an ``nnx.Dropout`` has no RNG stream, saying how to
        give it one.
    """
    from flax import nnx  # pylint: disable=g-import-not-at-top

    del rng  # The module draws from its own nnx.Rngs streams.
    model = self._merge(params, model_state, replica)
    model.train()
    try:
      outputs = model(inputs)
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
        model_state,
    )
    return outputs, rest

  def eval_apply(self, params, model_state, inputs):
    model = self._merge(params, model_state, None)
    model.eval()
    return model(inputs)


def as_model(
    apply_fn: Any,
    eval_apply_fn: Any,
    rng_collections: Sequence[str],
) -> LinenModel | NnxModel:
  """The model interface for what was passed as ``apply_fn``.

  Args:
    apply_fn: a linen-style apply function, a ``flax.linen.Module`` (its
      ``apply`` is used) or a ``flax.nnx.Module``.
    eval_apply_fn: the apply for evaluation, or ``None``.
    rng_collections: the ``rngs`` names a linen apply receives.

  Returns:
    A :class:`LinenModel` or :class:`NnxModel`.

  Raises:
    TypeError: if ``apply_fn`` or ``eval_apply_fn`` is not callable, or an
      ``eval_apply_fn`` is given with an NNX module.

  Examples:
    >>> import flax.linen as nn
    >>> as_model(nn.Dense(3), None, ("dropout",)).apply_fn.__name__
    'apply'
  """
  if _is_nnx_module(apply_fn):
    if eval_apply_fn is not None:
      raise TypeError(
          "eval_apply_fn is not used with an nnx.Module: evaluation calls "
          "module.eval() on a copy of the module."
      )
    return NnxModel.from_module(apply_fn)
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
    raise TypeError(
        f"eval_apply_fn must be callable or None, got "
        f"{type(eval_apply_fn).__name__}: {eval_apply_fn!r}."
    )
  return LinenModel(apply_fn, eval_apply_fn, tuple(rng_collections))
