"""What the diagnostics check of their arguments, and the float formats they know.

Each check raises ``ValueError`` naming the argument, the value it got and
what is valid; a traced value (a loss scale inside ``jit``) is taken as it
is.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jmp_train._src import dtypes
from jmp_train._src.dtypes import is_floating_array

F16 = np.dtype(jnp.float16)
BF16 = np.dtype(jnp.bfloat16)
F32 = np.dtype(jnp.float32)
HALF_DTYPES = (F16, BF16)
# Smallest and largest binary exponents a float32 value can have.
MIN_EXPONENT = -149
MAX_EXPONENT = 128


def target_dtype(dtype: Any) -> np.dtype:
  """Parses the half type values are cast to; float16 or bfloat16 only."""
  valid = "float16 (f16, fp16) or bfloat16 (bf16), or 'half'"
  try:
    parsed = dtypes.parse_dtype(dtype)
  except ValueError as e:
    raise ValueError(f"Bad target dtype {dtype!r}: {e} Valid targets: {valid}.") from None
  if parsed not in HALF_DTYPES:
    raise ValueError(
      f"Bad target dtype {dtype!r} ({parsed.name}): the diagnostics cast to a "
      f"half-precision type; valid targets: {valid}."
    )
  return parsed


def check_positive(name: str, value: Any, *, minimum: float = 0.0, inclusive: bool = False):
  """Raises ValueError if a concrete ``value`` is not finite and > minimum."""
  if isinstance(value, jax.core.Tracer):
    return  # A traced value (e.g. a loss scale inside jit) cannot be checked.
  try:
    arr = np.asarray(value, dtype=np.float64)
  except (TypeError, ValueError):
    raise ValueError(f"{name} must be a positive number, got {value!r}.") from None
  if arr.shape != ():
    raise ValueError(f"{name} must be a scalar, got shape {arr.shape}.")
  v = float(arr)
  ok = math.isfinite(v) and (v >= minimum if inclusive else v > minimum)
  if not ok:
    bound = f">= {minimum:g}" if inclusive else f"> {minimum:g}"
    raise ValueError(f"{name} must be finite and {bound}, got {value!r}.")


def floating_leaves(tree: Any, fn_name: str) -> list[tuple[str, Any]]:
  """``(path, leaf)`` for the floating-point array leaves of ``tree``."""
  with_path = jax.tree_util.tree_flatten_with_path(tree)[0]
  out = [(jax.tree_util.keystr(p) or "<root>", x) for p, x in with_path if is_floating_array(x)]
  if not out:
    kinds = sorted({type(x).__name__ + (f"[{x.dtype}]" if hasattr(x, "dtype") else "") for _, x in with_path})
    hint = ""
    if any(isinstance(x, float) for _, x in with_path):
      hint = " Python floats are not counted: wrap them with jnp.asarray."
    raise ValueError(
      f"{fn_name} needs a pytree with floating-point array leaves (float16, "
      f"bfloat16, float32, ...); got {len(with_path)} leaves of types "
      f"{kinds or '(none: the tree is empty)'}.{hint}"
    )
  return out


def check_callable(fn: Any, fn_name: str):
  if not callable(fn):
    raise ValueError(
      f"{fn_name} needs a callable (the function to trace, e.g. a loss "
      f"function or `model.apply`) as its first argument; got "
      f"{type(fn).__name__} {fn!r:.80}."
    )


def is_traced(tree: Any) -> bool:
  return any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(tree))
