"""Finding the loss-scaling state in an optimizer state, and its metrics."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

from jmp_train._src.loss_scaling.scales import LossScale
from jmp_train._src.loss_scaling.wrapper import LossScaledState

__all__ = ["get_loss_scale", "loss_scale_metrics"]


def _unwrap_variable(x: Any) -> Any:
  """Returns the array inside a Flax NNX ``Variable``, else ``x``."""
  get_value = getattr(x, "get_value", None)
  if get_value is not None and not isinstance(x, jax.Array):
    return get_value()
  return x


def _find_state(opt_state: Any, caller: str) -> LossScaledState:
  """The one :class:`LossScaledState` anywhere in ``opt_state``.

  ``optax.tree.get_all_with_path`` finds it in any nesting (``optax.chain``,
  ``inject_hyperparams``, ``MultiSteps``, a Flax ``TrainState`` or
  ``nnx.Optimizer``), including one nested in another's ``inner_state``,
  which is reported rather than silently shadowed.
  """
  found = [
    state
    for _, state in optax.tree.get_all_with_path(
      opt_state, LossScaledState.__name__, filtering=lambda _, value: isinstance(value, LossScaledState)
    )
  ]
  if len(found) != 1:
    what = "no" if not found else f"{len(found)}"
    raise ValueError(
      f"{caller} found {what} LossScaledState in the optimizer state of "
      f"type {type(opt_state).__name__}; it needs exactly one, made by "
      "jmp_train.loss_scaled(...) (nested anywhere: optax.chain, "
      "inject_hyperparams, MultiSteps, a Flax TrainState or nnx.Optimizer)."
    )
  # nnx.Optimizer wraps each array leaf of its state in a Variable.
  is_variable = lambda x: _unwrap_variable(x) is not x
  if not any(map(is_variable, jax.tree.leaves(found[0], is_leaf=is_variable))):
    return found[0]
  return jax.tree.map(_unwrap_variable, found[0], is_leaf=is_variable)


def get_loss_scale(opt_state: Any) -> LossScale:
  """Finds the current loss scale in an optimizer state.

  Searches the whole state (tuples from ``optax.chain``,
  ``InjectHyperparamsState``, ``MultiStepsState``, ...) for the one
  :class:`LossScaledState`. A Flax ``TrainState`` or ``nnx.Optimizer`` (or
  their ``.opt_state``) can be passed directly. No host sync: the scale is
  returned as the arrays it is made of.

  Args:
    opt_state: an optimizer state containing exactly one state of
      :func:`loss_scaled`.

  Returns:
    The loss-scale value; call its ``scale(loss)`` or pass it to a function
    made by :func:`scaled_value_and_grad`. Its ``loss_scale`` field is the
    scale as a float32 scalar.

  Raises:
    ValueError: if the state holds no :class:`LossScaledState`, or more than
      one.

  Examples:
    >>> import jmp_train, optax
    >>> tx = optax.chain(optax.clip(1.0), jmp_train.loss_scaled(
    ...     optax.sgd(0.1), jmp_train.StaticLossScale(8.0)))
    >>> float(jmp_train.get_loss_scale(tx.init(jnp.zeros(2))).loss_scale)
    8.0
  """
  return _find_state(opt_state, "get_loss_scale").loss_scale


def loss_scale_metrics(opt_state: Any) -> dict[str, jax.Array]:
  """Loss-scaling metrics to log, as arrays (no host sync in the step).

  Args:
    opt_state: an optimizer state containing exactly one state of
      :func:`loss_scaled` (or a Flax ``TrainState``/``nnx.Optimizer``).

  Returns:
    ``{"loss_scale": float32, "notfinite_count": int32, "total_notfinite":
    int32, "last_finite": bool}``, all scalars, named as the fields of
    :class:`LossScaledState`.

  Raises:
    ValueError: if the state holds no :class:`LossScaledState`, or more than
      one.

  Examples:
    >>> import jmp_train, optax
    >>> tx = jmp_train.loss_scaled(optax.sgd(0.1), jmp_train.DynamicLossScale(2.0 ** 4))
    >>> state = tx.init(jnp.zeros(2))
    >>> _, state = tx.update(jnp.array([1.0, jnp.nan]), state)
    >>> {k: v.item() for k, v in jmp_train.loss_scale_metrics(state).items()}
    {'loss_scale': 8.0, 'notfinite_count': 1, 'total_notfinite': 1, 'last_finite': False}
  """
  state = _find_state(opt_state, "loss_scale_metrics")
  return {
    "loss_scale": jnp.asarray(state.loss_scale.loss_scale, jnp.float32),
    "notfinite_count": state.notfinite_count,
    "total_notfinite": state.total_notfinite,
    "last_finite": state.last_finite,
  }
