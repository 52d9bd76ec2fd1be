"""Checks of a tree's leaves: floating only (optimizers, gradients), finite (loss scaling)."""

from __future__ import annotations

from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jmp_train._src.dtypes import is_floating_array

__all__ = ["all_finite", "check_leaves", "first_not_differentiable", "non_finite_leaves"]


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


def non_finite_leaves(tree: Any) -> list[tuple[str, int, int]]:
  """The floating leaves of ``tree`` that hold inf or NaN: a check on the host, for values given once.

  One small reduction per leaf where it lives (a device array is not
  copied to the host) and one transfer of the counts. Leaves being traced
  (``jax.eval_shape`` of an ``init``) have no values: nothing is found.

  Args:
    tree: a pytree of arrays (parameters to start from).

  Returns:
    ``(path, non-finite elements, elements)`` of each such leaf, in tree
    order, ``path`` as ``jax.tree_util.keystr`` writes it.

  Examples:
    >>> non_finite_leaves({"w": jnp.array([1.0, jnp.inf]), "b": jnp.zeros(2)})
    [("['w']", 1, 2)]
  """
  leaves = [(p, x) for p, x in jax.tree_util.tree_flatten_with_path(tree)[0] if is_floating_array(x)]
  if any(isinstance(x, jax.core.Tracer) for _, x in leaves):
    return []
  on_device = [x for _, x in leaves if isinstance(x, jax.Array)]
  try:  # one program for the device leaves (not one small compilation per shape)
    device_counts = iter(jax.device_get(_non_finite_counts(on_device)))
  except ValueError:  # leaves committed to different devices: one reduction each
    device_counts = iter(jax.device_get([jnp.sum(~jnp.isfinite(x)) for x in on_device]))
  counts = [next(device_counts) if isinstance(x, jax.Array) else np.sum(~np.isfinite(x)) for _, x in leaves]
  return [(jax.tree_util.keystr(p), int(c), int(np.size(x))) for (p, x), c in zip(leaves, counts) if c]


@jax.jit
def _non_finite_counts(xs: list[jax.Array]) -> list[jax.Array]:
  return [jnp.sum(~jnp.isfinite(x)) for x in xs]


def all_finite(tree: Any, axis_name: str | Sequence[str] | None = None) -> jax.Array:
  """Whether every floating-point leaf of ``tree`` is free of inf and NaN.

  Computed as one ``sum(leaf * 0)`` per leaf: ``x * 0`` is ``0`` for finite
  ``x`` and NaN for inf or NaN, so the sums are zero exactly when every
  element is finite and can never overflow (large finite float16 values do
  not add up to a false inf, as a plain ``sum(leaf)`` would). It is one
  fused reduction per leaf; ``all(isfinite(leaf))`` is also correct, but
  XLA:CPU writes out the boolean array before reducing it, an extra pass
  over memory on the critical path of every train step. Python floats
  count as float32; non-floating leaves (integers, ``float0``
  gradients of integer inputs, ``None``) are ignored.

  Args:
    tree: a pytree of arrays, typically gradients.
    axis_name: name (or names) of a mapped axis (``pmap``, ``shard_map``,
      ``vmap``). When given, the answer is reduced with ``lax.pmin`` over the
      axis, so every replica gets the same answer: all replicas skip if any
      replica overflowed.

  Returns:
    A boolean scalar array.

  Examples:
    >>> bool(all_finite({"a": jnp.ones(2), "b": jnp.array([1.0, jnp.inf])}))
    False
  """
  leaves = [jnp.asarray(x, jnp.float32) if isinstance(x, float) else x for x in jax.tree.leaves(tree)]
  leaves = [x for x in leaves if is_floating_array(x)]
  finite = jnp.array(True)
  for leaf in leaves:
    # Zeros in the leaf's own dtype: exact, whatever the dtype.
    finite = finite & jnp.isfinite(jnp.sum(leaf * jnp.zeros((), leaf.dtype)))
  if axis_name is not None:
    finite = jax.lax.pmin(finite.astype(jnp.int32), axis_name).astype(jnp.bool_)
  return finite
