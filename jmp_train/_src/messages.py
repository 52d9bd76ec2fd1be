"""Short descriptions of values and errors for the library's error messages.

A message names the bad value and the fix in a line or two: never the repr
of a whole parameter tree, nor an exception's full text from deep inside
JAX, Flax or orbax.
"""

from __future__ import annotations

from typing import Any

import jax

__all__ = ["describe", "error_summary"]


def describe(value: Any) -> str:
  """A one-line description of ``value``: never the repr of a whole tree.

  Examples:
    >>> describe(jnp.zeros((2, 3)))
    'an array of shape (2, 3) and dtype float32'
    >>> describe({"w": jnp.zeros(2), "b": jnp.zeros(1)})
    'a dict with 2 leaves'
  """
  if value is None:
    return "None"
  if hasattr(value, "shape") and hasattr(value, "dtype"):
    return f"an array of shape {tuple(value.shape)} and dtype {value.dtype}"
  leaves = jax.tree.leaves(value)
  if not (len(leaves) == 1 and leaves[0] is value):
    kind = type(value).__name__
    article = "an" if kind[:1].lower() in "aeiou" else "a"
    return f"{article} {kind} with {len(leaves)} " + ("leaf" if len(leaves) == 1 else "leaves")
  text = repr(value)
  return f"{type(value).__name__} {text if len(text) <= 40 else text[:40] + '...'}"


def error_summary(e: BaseException, limit: int = 200) -> str:
  """``Type: first line of the message``, at most about ``limit`` characters.

  Examples:
    >>> error_summary(ValueError("bad size\\nmore detail"))
    'ValueError: bad size'
  """
  lines = str(e).strip().splitlines()
  text = lines[0] if lines else ""
  if len(text) > limit:
    text = text[:limit] + "..."
  return f"{type(e).__name__}: {text}" if text else type(e).__name__
