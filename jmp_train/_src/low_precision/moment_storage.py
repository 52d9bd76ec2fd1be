"""How an optimizer moment is stored: a floating dtype or blockwise 8 bits.

The pieces ``optimizers_8bit`` builds its optimizers from: parsing and
checking the storage options, :class:`Moment` (initialise, dequantize to
float32, requantize one leaf), the per-step PRNG key of the stochastic
rounding, and a per-leaf map over the gradients and the moments.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp

from jmp_train._src.low_precision import quantized_state as qs
from jmp_train._src.hyperparams import check_int
from jmp_train._src.dtypes import parse_dtype

__all__ = [
  "Moment",
  "ROUNDINGS",
  "STATE_DTYPES",
  "check_options",
  "map_leaves",
  "parse_state_dtype",
  "step_key",
]

_EIGHT_BIT = ("8bit", "int8")
STATE_DTYPES = ("float32", "bfloat16", "float16", "float64") + _EIGHT_BIT


def parse_state_dtype(value: Any, name: str) -> Any:
  """``None``, ``"8bit"`` or a floating NumPy dtype."""
  if value is None:
    return None
  if isinstance(value, str) and value.strip().lower() in _EIGHT_BIT:
    return "8bit"
  try:
    return parse_dtype(value)
  except (TypeError, ValueError):
    raise ValueError(
      f"{name} must be None (the parameters' dtype) or one of {', '.join(map(repr, STATE_DTYPES))}; got {value!r}."
    ) from None


ROUNDINGS = ("stochastic", "nearest")


def check_options(block_size: Any, code: Any, min_8bit_size: Any, rounding: Any) -> None:
  qs._check_block_size(block_size)
  qs._check_code(code)
  if rounding not in ROUNDINGS:
    raise ValueError(f"rounding must be one of {ROUNDINGS}; got {rounding!r}.")
  check_int(min_8bit_size, "min_8bit_size", 0)


class Moment:
  """How one moment is stored: dtype (or 8 bits), code, block size, rounding.

  An unsigned (second) moment in 8 bits is stored as its square root.
  """

  def __init__(self, dtype, signed, block_size, code, min_8bit_size, rounding="nearest"):
    self.dtype, self.signed = dtype, signed
    self.kwargs = dict(block_size=block_size, code=code, signed=signed)
    self.min_8bit_size = min_8bit_size
    self.stochastic = rounding == "stochastic"

  def init(self, p: jax.Array) -> Any:
    if self.dtype != "8bit":
      return jnp.zeros(p.shape, p.dtype if self.dtype is None else self.dtype)
    if p.size >= self.min_8bit_size:
      return qs.zeros(p.shape, **self.kwargs)
    return jnp.zeros(p.shape, jnp.float32)

  def load(self, stored: Any) -> jax.Array:
    if isinstance(stored, qs.QuantizedArray):
      x = qs.dequantize(stored, **self.kwargs)
      return x if self.signed else jnp.square(x)
    return stored.astype(jnp.float32)

  def store(self, x: jax.Array, like: Any, key: jax.Array | None = None) -> Any:
    if isinstance(like, qs.QuantizedArray):
      x = x if self.signed else jnp.sqrt(x)
      return qs.quantize(x, key=key if self.stochastic else None, **self.kwargs)
    return x.astype(like.dtype)


def map_leaves(fn: Callable[..., tuple], updates: Any, *moments: Any) -> tuple:
  """Applies ``fn(index, g, *moment_leaves)`` per leaf of ``updates``; unzips the results."""
  leaves, treedef = jax.tree.flatten(updates)
  per_moment = [treedef.flatten_up_to(m) for m in moments]
  outs = [fn(i, g, *ms) for i, (g, *ms) in enumerate(zip(leaves, *per_moment))]
  if not outs:  # an empty tree
    return (updates, *moments)
  return tuple(treedef.unflatten(list(col)) for col in zip(*outs))


def step_key(seed: int, count: jax.Array) -> jax.Array:
  """The stochastic rounding's key of step ``count``: from ``seed`` and the step.

  A resumed run draws the same bits, and replicas with the same state stay
  identical.
  """
  return jax.random.fold_in(jax.random.key(seed), count)
