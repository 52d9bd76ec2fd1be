"""Gradient buckets: a pytree flattened into a few flat arrays, and back.

A data-parallel step that averages gradients with one collective per leaf
pays each collective's fixed cost once per leaf. Flattening the leaves into
buckets of about ``bucket_bytes`` each (PyTorch DDP's default is 25 MB) pays
it once per bucket. The buckets are filled in reverse leaf order (the last
layer first): the backward pass produces the last layer's gradients first,
so XLA may start a bucket's collective as soon as its gradients exist.

:func:`flatten_to_buckets` and :func:`unflatten_from_buckets` are inverse to
each other (up to the dtype cast); :func:`bucketed_mean` averages a pytree
across a mapped axis with one ``pmean`` per bucket of :func:`mean_buckets`,
which leaves a leaf of 4 MiB or more in a bucket of its own (flattening
would copy it in and out for no collective saved).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jmp_train._src.hyperparams import check_int

__all__ = [
  "assemble",
  "flatten_to_buckets",
  "unflatten_from_buckets",
  "bucketed_mean",
  "bucket_sizes",
  "mean_buckets",
  "check_bucket_bytes",
]

DEFAULT_BUCKET_BYTES = 25 * 2**20


def check_bucket_bytes(bucket_bytes: Any, allow_none: bool = False) -> None:
  """Raises ``ValueError`` unless ``bucket_bytes`` is a positive int (or ``None`` if allowed)."""
  check_int(bucket_bytes, "bucket_bytes", 1, allow_none=allow_none)


def assemble(pieces, base: jax.Array) -> jax.Array:
  """``base`` with each ``(start, x)`` of ``pieces`` written from ``start`` on.

  A concatenation as dynamic-update-slices into one buffer: XLA updates the
  buffer in place, one copy per piece, where XLA:CPU runs a concatenation
  (and whatever it fuses into it) many times slower than a copy.

  Args:
    pieces: ``(start, x)`` pairs, ``x`` of ``base``'s rank and dtype.
    base: the buffer the pieces are written into (its other elements kept).

  Returns:
    The assembled buffer.

  Examples:
    >>> import jax.numpy as jnp
    >>> assemble([(0, jnp.ones(2)), (3, jnp.full(1, 5.0))], jnp.zeros(4)).tolist()
    [1.0, 1.0, 0.0, 5.0]
  """
  if len(pieces) == 1 and pieces[0][1].shape == base.shape:
    return pieces[0][1]
  for start, x in pieces:
    base = lax.dynamic_update_slice(base, x, (start,) if np.ndim(start) == 0 else start)
  return base


def bucket_sizes(tree: Any, bucket_bytes: int, dtype: Any = None) -> list[list[int]]:
  """Which leaves (by index in ``jax.tree.leaves`` order) go to which bucket.

  Leaves are taken last first; a bucket is closed once it holds at least
  ``bucket_bytes`` (a leaf is never split, so a large leaf is a bucket of its
  own), and a new bucket starts where the dtype changes (``dtype=None``).

  Args:
    tree: a pytree of arrays (or ``jax.ShapeDtypeStruct`` s).
    bucket_bytes: the target bytes per bucket, positive.
    dtype: the dtype the buckets are cast to, or ``None`` for the leaves' own.

  Returns:
    A list of buckets, each a list of leaf indices in the order they are
    concatenated.

  Raises:
    ValueError: if ``bucket_bytes`` is not a positive integer.
  """
  check_bucket_bytes(bucket_bytes)
  leaves = jax.tree.leaves(tree)
  buckets: list[list[int]] = []
  filled, current_dtype = 0, None
  for i in reversed(range(len(leaves))):
    leaf_dtype = np.dtype(dtype if dtype is not None else leaves[i].dtype)
    if not buckets or filled >= bucket_bytes or leaf_dtype != current_dtype:
      buckets.append([])
      filled, current_dtype = 0, leaf_dtype
    buckets[-1].append(i)
    filled += _nbytes(leaves[i], dtype)
  return buckets


def _nbytes(leaf: Any, dtype: Any) -> int:
  """Bytes of ``leaf`` in ``dtype`` (its own dtype if ``None``)."""
  itemsize = np.dtype(dtype if dtype is not None else leaf.dtype).itemsize
  return int(np.prod(np.shape(leaf), dtype=np.int64)) * itemsize


# Leaves from this size on are averaged on their own (see mean_buckets).
ALONE_FROM_BYTES = 4 * 2**20


def mean_buckets(tree: Any, bucket_bytes: int, dtype: Any = None) -> list[list[int]]:
  """The buckets of :func:`bucketed_mean`: a leaf of ``bucket_bytes`` or 4 MiB or more alone.

  The other leaves are grouped as :func:`bucket_sizes` groups them. A leaf
  in a bucket with others is copied into the bucket's flat buffer and out
  again, to save a collective's fixed cost. A leaf that fills a bucket by
  itself saves none; nor, in practice, does one of ``ALONE_FROM_BYTES``
  (4 MiB) or more: its two copies cost more than the collective (with gloo
  across processes on CPU). Such leaves are averaged where they are.

  Args:
    tree: a pytree of arrays (or ``jax.ShapeDtypeStruct`` s).
    bucket_bytes: the target bytes per bucket, positive.
    dtype: the dtype the buckets are cast to, or ``None`` for the leaves' own.

  Returns:
    A list of buckets, each a list of leaf indices in the order they are
    concatenated; the buckets holding later leaves first.

  Raises:
    ValueError: if ``bucket_bytes`` is not a positive integer.

  Examples:
    >>> import jax.numpy as jnp
    >>> tree = [jnp.ones(2), jnp.ones(8), jnp.ones(1)]
    >>> bucket_sizes(tree, bucket_bytes=16), mean_buckets(tree, bucket_bytes=16)
    ([[2, 1], [0]], [[2, 0], [1]])
  """
  check_bucket_bytes(bucket_bytes)
  leaves = jax.tree.leaves(tree)
  alone = min(bucket_bytes, ALONE_FROM_BYTES)
  small = [i for i, x in enumerate(leaves) if _nbytes(x, dtype) < alone]
  grouped = bucket_sizes([leaves[i] for i in small], bucket_bytes, dtype)
  out = [[small[j] for j in bucket] for bucket in grouped]
  out += [[i] for i, x in enumerate(leaves) if _nbytes(x, dtype) >= alone]
  return sorted(out, key=lambda bucket: -bucket[0])


def flatten_to_buckets(tree: Any, bucket_bytes: int = DEFAULT_BUCKET_BYTES, dtype: Any = None) -> list[jax.Array]:
  """Concatenates the leaves of ``tree`` into flat buckets, last leaf first.

  Args:
    tree: a pytree of arrays.
    bucket_bytes: the target bytes per bucket (see :func:`bucket_sizes`).
    dtype: cast every leaf to this dtype, or ``None`` to keep each leaf's
      dtype (then a bucket holds leaves of one dtype only).

  Returns:
    A list of 1-D arrays; :func:`unflatten_from_buckets` inverts it.

  Examples:
    >>> import jax.numpy as jnp
    >>> tree = {"a": jnp.ones((2, 3)), "b": jnp.zeros(4)}
    >>> [b.shape for b in flatten_to_buckets(tree, bucket_bytes=16)]
    [(4,), (6,)]
    >>> [b.shape for b in flatten_to_buckets(tree)]
    [(10,)]
  """
  return _flatten(jax.tree.leaves(tree), bucket_sizes(tree, bucket_bytes, dtype), dtype)


def _flatten(leaves, layout: list[list[int]], dtype: Any) -> list[jax.Array]:
  out = []
  for bucket in layout:
    parts = [jnp.ravel(leaves[i]) for i in bucket]
    common = jnp.result_type(*parts)
    starts = np.cumsum([0] + [p.size for p in parts[:-1]]).tolist()
    flat = assemble(
      [(s, p.astype(common)) for s, p in zip(starts, parts)], jnp.zeros((sum(p.size for p in parts),), common)
    )
    # One cast of the whole bucket (a cast inside each piece's copy is slower).
    out.append(flat if dtype is None else flat.astype(dtype))
  return out


def unflatten_from_buckets(
  buckets: list[jax.Array], like: Any, bucket_bytes: int = DEFAULT_BUCKET_BYTES, dtype: Any = None
) -> Any:
  """The inverse of :func:`flatten_to_buckets`.

  Args:
    buckets: the flat arrays returned by :func:`flatten_to_buckets`.
    like: the original pytree (or one of ``jax.ShapeDtypeStruct`` s): its
      structure, shapes and dtypes; the leaves come back in their own dtype.
    bucket_bytes: the value given to :func:`flatten_to_buckets`.
    dtype: the value given to :func:`flatten_to_buckets`.

  Returns:
    A pytree like ``like`` holding the buckets' values.

  Examples:
    >>> import jax.numpy as jnp
    >>> tree = {"a": jnp.arange(6.0).reshape(2, 3), "b": jnp.arange(4.0)}
    >>> flat = flatten_to_buckets(tree, bucket_bytes=16, dtype=jnp.bfloat16)
    >>> back = unflatten_from_buckets(flat, tree, bucket_bytes=16, dtype=jnp.bfloat16)
    >>> back["a"].dtype, bool((back["a"] == tree["a"]).all())
    (dtype('float32'), True)
  """
  layout = bucket_sizes(like, bucket_bytes, dtype)
  if len(layout) != len(buckets):
    raise ValueError(
      f"Got {len(buckets)} buckets for a tree that makes {len(layout)} with "
      f"bucket_bytes={bucket_bytes} and dtype={dtype}."
    )
  return _unflatten(buckets, like, layout)


def _unflatten(buckets: list[jax.Array], like: Any, layout: list[list[int]]) -> Any:
  leaves, treedef = jax.tree.flatten(like)
  out: list[Any] = [None] * len(leaves)
  for bucket, flat in zip(layout, buckets):
    offset = 0
    for i in bucket:
      size = int(np.prod(np.shape(leaves[i]), dtype=np.int64))
      piece = lax.slice_in_dim(flat, offset, offset + size) if len(bucket) > 1 else flat
      out[i] = jnp.reshape(piece, np.shape(leaves[i])).astype(leaves[i].dtype)
      offset += size
  return jax.tree.unflatten(treedef, out)


def bucketed_mean(tree: Any, axis_name: str, bucket_bytes: int = DEFAULT_BUCKET_BYTES, dtype: Any = None) -> Any:
  """Averages ``tree`` over ``axis_name`` with one ``pmean`` per bucket of about ``bucket_bytes``.

  The leaves are flattened into buckets, the last leaves first (the first
  gradients a backward pass produces), so that XLA can overlap each
  bucket's all-reduce with the rest of the backward pass, as PyTorch DDP's
  gradient buckets do; a leaf of ``bucket_bytes`` or 4 MiB or more is
  averaged on its own. This is what :func:`jmp_train.make_train_step`'s
  data-parallel modes do without ``compression``; use it in a hand-written
  ``shard_map`` or ``pmap`` step.

  .. math::

    \\bar g = \\frac{1}{K} \\sum_{k=1}^{K} g_k

  computed in ``dtype`` (the leaves' own dtypes if ``None``) and cast back to
  each leaf's dtype.

  Args:
    tree: a pytree of arrays, inside a ``pmap`` / ``shard_map`` over
      ``axis_name``.
    axis_name: the mapped axis to average over.
    bucket_bytes: the target bytes per bucket.
    dtype: the dtype the average is computed in (what crosses devices),
      e.g. ``jnp.bfloat16`` for half the bytes of float32. XLA may move a
      convert across an all-reduce (XLA:CPU runs bfloat16 all-reduces in
      float32); check the compiled step with
      :func:`jmp_train.diagnostics.collective_bytes`.

  Returns:
    The average, with the structure and dtypes of ``tree``.

  Examples:
    >>> import jax, jax.numpy as jnp
    >>> tree = {"w": jnp.arange(8.0).reshape(8, 1), "b": jnp.ones((8, 2))}
    >>> out = jax.vmap(lambda t: bucketed_mean(t, "i"), axis_name="i")(tree)
    >>> float(out["w"][0, 0]), out["b"].shape
    (3.5, (8, 2))
  """
  if not jax.tree.leaves(tree):
    return tree
  layout = mean_buckets(tree, bucket_bytes, dtype)
  buckets = [lax.pmean(b, axis_name) for b in _flatten(jax.tree.leaves(tree), layout, dtype)]
  return _unflatten(buckets, tree, layout)
