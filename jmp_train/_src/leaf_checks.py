"""Checks that a tree holds floating leaves only, shared by the optimizers and the gradients."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

__all__ = ["check_leaves", "first_not_differentiable"]


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


def first_not_differentiable(tree: Any) -> tuple[str, str] | None:
  """The path and dtype of the first leaf ``jax.grad`` refuses, or None.

  ``jax.grad`` needs floating or complex inputs; its own error names the
  dtype of an integer, boolean or key leaf but not where it is.

  Args:
    tree: the tree to be differentiated.

  Returns:
    ``(path, dtype)`` of the first such leaf (``path`` as
    ``jax.tree_util.keystr`` writes it, a Python ``int`` or ``bool`` leaf
    named by its type), or ``None`` if there is none.

  Examples:
    >>> import jax.numpy as jnp
    >>> first_not_differentiable({"w": jnp.ones(2), "n": jnp.ones(2, jnp.int32)})
    ("['n']", 'int32')
    >>> first_not_differentiable({"w": jnp.ones(2)}) is None
    True
  """
  for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
    if isinstance(leaf, (bool, int)):
      return jax.tree_util.keystr(path), f"Python {type(leaf).__name__}"
    dtype = getattr(leaf, "dtype", None)
    if dtype is not None and not jnp.issubdtype(dtype, jnp.inexact):
      return jax.tree_util.keystr(path), str(dtype)
  return None
