"""The check that a tree holds floating leaves only, shared by the optimizers."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

__all__ = ["check_leaves"]


def check_leaves(tree: Any, what: str, name: str) -> tuple[list[Any], Any]:
  """The leaves and treedef of ``tree``, every leaf checked to be floating.

  Transformations that compute in float32 and cast back would otherwise
  round their updates into an integer leaf (a step counter, a lookup
  table among the parameters), or fail deep inside JAX on the ``float0``
  gradients of such a leaf.

  Args:
    tree: the parameters, gradients or updates.
    what: what ``tree`` is, for the message (``"gradients"``).
    name: the transformation, for the message.

  Returns:
    ``(leaves, treedef)`` of ``tree``.

  Raises:
    ValueError: naming the path and dtype of the first non-floating leaf,
      the valid dtypes and ``optax.masked`` to leave such leaves out.

  Examples:
    >>> import jax.numpy as jnp
    >>> leaves, _ = check_leaves({"w": jnp.ones(2)}, "gradients", "sgd_8bit")
    >>> len(leaves)
    1
    >>> check_leaves({"n": jnp.ones(2, jnp.int32)}, "parameters", "sgd_8bit")
    Traceback (most recent call last):
    ...
    ValueError: sgd_8bit needs floating parameters; the leaf at "['n']" has dtype int32. ...
  """
  leaves_with_path, treedef = jax.tree_util.tree_flatten_with_path(tree)
  leaves = []
  for path, leaf in leaves_with_path:
    dtype = getattr(leaf, "dtype", None)
    if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
      raise ValueError(
          f"{name} needs floating {what}; the leaf at "
          f"{jax.tree_util.keystr(path)!r} has dtype "
          f"{getattr(dtype, 'name', type(leaf).__name__)}. Valid dtypes: float16, "
          "bfloat16, float32, float64. Mask integer leaves out with optax.masked."
      )
    leaves.append(leaf)
  return leaves, treedef
