"""Checks of hyperparameters and flags, shared by the optimizers and the step.

Each check names the hyperparameter, the value it got and the valid range.
Only plain numbers (Python or NumPy scalars) are checked: a schedule (a
callable of the step count) and arrays (e.g. from
``optax.inject_hyperparams``, possibly traced) are taken as they are.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

__all__ = [
  "check_axis_name",
  "check_bool",
  "check_int",
  "check_learning_rate",
  "check_non_negative",
  "check_unit",
  "check_warmup_steps",
  "is_number",
  "is_static_zero",
  "static_hint",
  "value_at",
]


def is_number(x: Any) -> bool:
  """A Python or NumPy real number (not a bool, not an array)."""
  return isinstance(x, numbers.Real) and not isinstance(x, (bool, np.bool_))


def is_static_zero(x: Any) -> bool:
  """A plain number equal to 0: a term it scales can be left out of the program.

  An array (e.g. from ``optax.inject_hyperparams``, possibly traced) is never
  taken as zero: its value may change between steps.
  """
  return bool(is_number(x) and x == 0)


def static_hint(value: Any) -> str:
  """For an error about a structural argument: what to do when it came as an array."""
  if isinstance(value, (jax.Array, np.ndarray)):
    return " (an array: with optax.inject_hyperparams, list it in static_args)"
  return ""


def check_learning_rate(learning_rate: Any, name: str = "learning_rate") -> None:
  """Raises ``ValueError`` unless the rate is finite and > 0, a schedule or an array."""
  if is_number(learning_rate) and not (math.isfinite(learning_rate) and learning_rate > 0):
    raise ValueError(
      f"{name} must be finite and > 0 (or a schedule, a callable of the step "
      f"count), got {learning_rate!r}: a negative rate ascends the loss and 0 "
      "never moves the weights."
    )
  if not (callable(learning_rate) or is_number(learning_rate) or isinstance(learning_rate, (jax.Array, np.ndarray))):
    raise ValueError(
      f"{name} must be a number > 0 or a schedule (a callable of the step count), got {learning_rate!r}."
    )


def check_unit(value: Any, name: str, note: str = "") -> None:
  """Raises ``ValueError`` unless a decay rate lies in [0, 1)."""
  if is_number(value) and not 0.0 <= value < 1.0:
    raise ValueError(f"{name} must be in [0, 1), got {value!r}{note}.")


def check_non_negative(value: Any, name: str) -> None:
  """Raises ``ValueError`` unless ``value`` (eps, a weight decay) is finite and >= 0."""
  if is_number(value) and not (math.isfinite(value) and value >= 0):
    raise ValueError(f"{name} must be finite and >= 0, got {value!r}.")


def check_bool(value: Any, name: str) -> None:
  """Raises ``ValueError`` unless ``value`` is ``True`` or ``False``."""
  if not isinstance(value, (bool, np.bool_)):
    raise ValueError(f"{name} must be True or False, got {value!r}.")


def check_axis_name(axis_name: Any) -> None:
  """Raises ``ValueError`` unless ``axis_name`` is a string (a mapped axis)."""
  if not isinstance(axis_name, str):
    raise ValueError(f"axis_name must be a string (the replicas' mapped axis), got {axis_name!r}.")


def check_int(value: Any, name: str, minimum: int = 0, *, allow_none: bool = False, note: str = "") -> int | None:
  """``value`` as a Python ``int``; ``ValueError`` unless it is an integer of at least ``minimum``.

  The one check of the library's integer arguments (step counts, sizes,
  replica counts): a Python ``int`` or a NumPy integer (``np.int64(4)``, as
  arithmetic on NumPy values gives) passes alike; a ``bool``, a float
  (``4.0``) or an array does not.

  Args:
    value: the argument.
    name: its name, for the message.
    minimum: the smallest valid value.
    allow_none: whether ``None`` is valid (it is returned as is).
    note: said after the valid range, e.g. ``" (local steps per synchronisation)"``.

  Returns:
    ``int(value)``, or ``None`` for ``None`` where allowed.

  Raises:
    ValueError: naming ``name``, the valid range and the value.

  Examples:
    >>> check_int(np.int64(4), "sync_every", 1)
    4
    >>> check_int(0, "sync_every", 1)
    Traceback (most recent call last):
    ...
    ValueError: sync_every must be a positive int, got 0.
  """
  if value is None and allow_none:
    return None
  if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral) or value < minimum:
    valid = "a positive int" if minimum == 1 else f"an int >= {minimum}"
    raise ValueError(
      f"{name} must be {valid}{' or None' if allow_none else ''}{note}, got {value!r}{static_hint(value)}."
    )
  return int(value)


def check_warmup_steps(warmup_steps: Any, minimum: int) -> int:
  """``warmup_steps`` as an ``int`` (:func:`check_int`: an integer of at least ``minimum``)."""
  return check_int(
    warmup_steps, "warmup_steps", minimum, note=" (the frozen second moment comes from the warm-up)" if minimum else ""
  )


def value_at(value: optax.ScalarOrSchedule, count: jax.Array) -> jax.Array:
  """A hyperparameter (a number or a schedule of the step count) at ``count``, as float32."""
  return jnp.asarray(value(count) if callable(value) else value, jnp.float32)
