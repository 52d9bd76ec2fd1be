"""Validation of the loss-scale values' arguments, in one place.

Each check raises a ``ValueError`` naming the bad argument and its valid
range; values that are traced (inside ``jit``) are converted but not
checked.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jmp_train._src.hyperparams import check_int

__all__ = [
  "FROM_ARGS",
  "as_counter_array",
  "as_flag",
  "as_scale_array",
  "dynamic_config",
  "dynamic_scale",
]

_F32_MAX = float(np.finfo(np.float32).max)
_F32_TINY = float(np.finfo(np.float32).tiny)


class _FromLeaves:
  """Default of the keyword ``loss_scale``: build from the user's arguments."""

  def __repr__(self) -> str:
    return "<validated from scale>"


FROM_ARGS: Any = _FromLeaves()


def is_concrete(x: Any) -> bool:
  return not isinstance(x, jax.core.Tracer)


def _as_scalar(value: Any, dtype: Any, name: str, expected: str) -> jax.Array:
  """``value`` as a scalar array of ``dtype``; a ValueError names ``name``."""
  try:
    arr = jnp.asarray(value, dtype=dtype)
  except (TypeError, ValueError):
    raise ValueError(f"{name} must be {expected}, got {value!r}.") from None
  if arr.shape != ():
    raise ValueError(f"{name} must be a scalar, got shape {arr.shape}.")
  return arr


def as_scale_array(value: Any, name: str) -> jax.Array:
  """Converts ``value`` to a float32 scalar, validating it when concrete."""
  arr = _as_scalar(value, jnp.float32, name, "a positive number (a float32 scalar)")
  if is_concrete(arr):
    v = float(arr)
    if not (math.isfinite(v) and v > 0):
      raise ValueError(f"{name} must be finite and > 0, got {value!r}; valid values lie in (0, {_F32_MAX:.4g}].")
  return arr


def as_counter_array(value: Any, growth_interval: int) -> jax.Array:
  """Converts ``value`` to an int32 scalar in ``[0, growth_interval)``."""
  counter = _as_scalar(value, jnp.int32, "counter", "an integer in [0, growth_interval)")
  if is_concrete(counter) and not 0 <= int(counter) < growth_interval:
    raise ValueError(f"counter must lie in [0, growth_interval) = [0, {growth_interval}), got {int(counter)}.")
  return counter


def as_flag(grads_finite: jax.typing.ArrayLike) -> jax.Array:
  """The boolean scalar ``adjust`` takes; a non-scalar flag is an error."""
  finite = jnp.asarray(grads_finite, dtype=jnp.bool_)
  if finite.shape != ():
    raise ValueError(
      "adjust(grads_finite) takes one boolean scalar for the whole step "
      f"(e.g. all_finite(grads)), got shape {finite.shape}; reduce it "
      "first, e.g. with jnp.all."
    )
  return finite


def dynamic_config(
  growth_interval: Any,
  growth_factor: Any,
  backoff_factor: Any,
  min_scale: Any,
  max_scale: Any,
) -> dict[str, Any]:
  """The validated static configuration of a :class:`DynamicLossScale`."""
  interval = check_int(growth_interval, "growth_interval", 1, note=" (good steps before the scale grows)")
  config = dict(
    growth_interval=interval,
    growth_factor=_static_float(growth_factor, "growth_factor"),
    backoff_factor=_static_float(backoff_factor, "backoff_factor"),
    min_scale=_static_float(min_scale, "min_scale"),
    max_scale=_static_float(max_scale, "max_scale"),
  )
  _check_factors(config["growth_factor"], config["backoff_factor"])
  _check_bounds(config["min_scale"], config["max_scale"])
  return config


def _check_factors(growth_factor: float, backoff_factor: float) -> None:
  if not growth_factor > 1.0:
    raise ValueError(f"growth_factor must be > 1, got {growth_factor!r}.")
  if not 0.0 < backoff_factor < 1.0:
    raise ValueError(f"backoff_factor must lie in (0, 1), got {backoff_factor!r}.")


def _check_bounds(min_scale: float, max_scale: float) -> None:
  if not _F32_TINY <= min_scale <= _F32_MAX:
    raise ValueError(
      f"min_scale must be > 0 (at least {_F32_TINY:.4g}, the smallest normal float32), got {min_scale!r}."
    )
  if not max_scale <= _F32_MAX:
    raise ValueError(f"max_scale must be finite (at most {_F32_MAX:.4g}), got {max_scale!r}.")
  if min_scale > max_scale:
    raise ValueError(f"min_scale ({min_scale!r}) must be <= max_scale ({max_scale!r}).")


def dynamic_scale(scale: Any, min_scale: float, max_scale: float) -> jax.Array:
  """The validated initial scale, inside ``[min_scale, max_scale]``."""
  loss_scale = as_scale_array(scale, "scale")
  if is_concrete(loss_scale) and not (np.float32(min_scale) <= float(loss_scale) <= np.float32(max_scale)):
    raise ValueError(f"scale must lie in [min_scale, max_scale] = [{min_scale!r}, {max_scale!r}], got {scale!r}.")
  return loss_scale


def _static_float(value: Any, name: str) -> float:
  try:
    out = float(value)
  except (TypeError, ValueError):
    raise ValueError(f"{name} must be a number, got {value!r}.") from None
  if not math.isfinite(out):
    raise ValueError(f"{name} must be finite, got {value!r}.")
  return out
