"""Floating dtypes: names a user may write, the backend's half type, the leaf predicate.

Shared by the policies, the optimizers and the diagnostics: ``parse_dtype``
reads ``"bf16"``, ``"half"`` or a dtype; ``half_dtype`` is float16 on GPU and
bfloat16 elsewhere; ``is_floating_array`` is the one test of which leaves the
library casts, scales or inspects.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["DTYPE_ALIASES", "half_dtype", "is_floating_array", "is_floating_dtype", "parse_dtype"]

# Names accepted for floating dtypes. "half" resolves per backend at parse time.
DTYPE_ALIASES: dict[str, str] = {
  "float16": "float16",
  "f16": "float16",
  "fp16": "float16",
  "bfloat16": "bfloat16",
  "bf16": "bfloat16",
  "float32": "float32",
  "f32": "float32",
  "fp32": "float32",
  "full": "float32",
  "float64": "float64",
  "f64": "float64",
  "fp64": "float64",
}
_ACCEPTED_DTYPES = sorted(set(DTYPE_ALIASES) | {"half"})


def half_dtype() -> np.dtype:
  """Returns the half-precision dtype suited to the default backend.

  float16 on GPU (Tensor Cores run float16 and bfloat16 alike, and float16
  keeps 3 more bits of mantissa); bfloat16 on TPU and CPU (TPUs' native half
  type; CPUs emulate both, and bfloat16 needs no loss scaling).

  Returns:
    ``jnp.float16`` or ``jnp.bfloat16`` as a NumPy dtype.

  Examples:
    >>> import jmp_train
    >>> jmp_train.half_dtype() in (jnp.float16, jnp.bfloat16)
    True
  """
  if jax.default_backend() in ("gpu", "cuda", "rocm"):
    return np.dtype(jnp.float16)
  return np.dtype(jnp.bfloat16)


def parse_dtype(value: Any) -> np.dtype:
  """Parses a floating dtype from a name (``"bf16"``, ``"half"``) or a dtype.

  Args:
    value: a dtype name, alias, NumPy/JAX dtype or scalar type.

  Returns:
    The NumPy dtype.

  Raises:
    ValueError: if the name is unknown or the dtype is not floating point.
  """
  if isinstance(value, str):
    name = value.strip().lower()
    if name == "half":
      return half_dtype()
    if name not in DTYPE_ALIASES:
      try:
        known = np.dtype(name)
      except TypeError:
        known = None
      if known is not None and not jnp.issubdtype(known, jnp.floating):
        raise ValueError(f"{value!r} is not a floating dtype; a policy needs one of {', '.join(_ACCEPTED_DTYPES)}.")
      raise ValueError(f"Unknown dtype {value!r}; accepted names: {', '.join(_ACCEPTED_DTYPES)}.")
    return np.dtype(getattr(jnp, DTYPE_ALIASES[name]))
  if value is None:  # np.dtype(None) is float64: never a silent choice
    raise ValueError(f"None is not a dtype; accepted names: {', '.join(_ACCEPTED_DTYPES)}.")
  try:
    dtype = np.dtype(value)
  except TypeError as e:
    raise ValueError(f"Not a dtype: {value!r}; accepted names: {', '.join(_ACCEPTED_DTYPES)}.") from e
  if not jnp.issubdtype(dtype, jnp.floating):
    raise ValueError(f"{dtype.name!r} is not a floating dtype; a policy needs one of {', '.join(_ACCEPTED_DTYPES)}.")
  return dtype


def is_floating_dtype(dtype: Any) -> bool:
  """Whether ``dtype`` is a floating-point dtype (``None`` and key dtypes are not).

  The one dtype predicate of the library, behind :func:`is_floating_array`
  and every jaxpr walker that asks of an abstract value's dtype.
  """
  if dtype is None:
    return False
  try:
    return bool(jnp.issubdtype(dtype, jnp.floating))
  except TypeError:  # extended dtypes (typed PRNG keys)
    return False


def is_floating_array(x: Any) -> bool:
  """Whether ``x`` is a floating-point array (or tracer, or shape struct).

  The one leaf predicate of the library: Python scalars have no dtype, and
  typed PRNG keys have an extended dtype that is not floating, so both are
  left alone wherever the library casts, scales or inspects leaves.
  """
  return hasattr(x, "shape") and is_floating_dtype(getattr(x, "dtype", None))
