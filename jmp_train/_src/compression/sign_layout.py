"""The flat buffer of :func:`jmp_train.sign_compression`: segments, chunks, runs.

Everything here is static (computed with NumPy at trace time from the leaves'
shapes, the scale and the replica count ``K``), so the codec in ``sign_codec``
is built from reshapes, reductions and broadcasts only: no per-element
segment ids, gathers or scatters.

* The gradient tree is laid out in one flat buffer of ``N`` elements, leaf
  after leaf, a leaf with column scales stored column by column (its last
  axis first), padded with zeros to ``N_pad``, a multiple of ``8·K``: the
  order of the bits on the wire and of the owners' chunks.
* The final decode writes a column-scale leaf in its own order from the
  buffer-order bits without transposing floats: when its rows are a
  multiple of 8 and its offset a multiple of 8, the packed bits are read
  as 32-, 16- or 8-bit words and only the words are transposed
  (:meth:`Layout.word_bits`).
* A *segment* shares reconstruction values: a column (``"column"``) or a
  whole leaf (``"l1"``, ``"l2"``); the padding is one more segment.
* Chunk ``k`` (``S = N_pad / K`` elements) is owned by replica ``k``. A
  *piece* is the part of a segment inside one chunk: what an owner quantizes.
* A :class:`Run` is a contiguous range of ``count`` consecutive segments (or
  pieces) of the same ``length``, viewed as a ``(count, length)`` array: one
  row reduction gives all their sums. A leaf of ``c`` columns is one run for
  the worker; a chunk boundary through a leaf splits it into at most three
  runs for the owners (whole columns before, the two parts of the cut column,
  whole columns after).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

__all__ = ["Run", "Layout", "make_layout", "axis_size"]


class Run(NamedTuple):
  """``count`` consecutive segments of ``length`` elements from ``start``.

  Attributes:
    start: offset of the first element (in the flat buffer or in a chunk).
    count: number of segments (rows of the run's ``(count, length)`` view).
    length: elements per segment.
    leaf: index of the leaf the run belongs to (``-1``: the padding).
  """

  start: int
  count: int
  length: int
  leaf: int

  @property
  def size(self) -> int:
    return self.count * self.length


@dataclasses.dataclass(frozen=True)
class Layout:
  """Static description of the flat buffer for ``k`` replicas.

  Attributes:
    shapes: the leaves' shapes.
    transpose: whether each leaf is stored column by column.
    offsets: each leaf's offset in the flat buffer.
    n: elements of all leaves; ``n_pad``: with the padding.
    k: replicas; ``chunk``: elements per owner, ``n_pad // k``.
    worker_runs: one run per leaf (and the padding), in buffer order.
    owner_runs: for each owner, the runs of its pieces, offsets relative to
      the chunk start.
    max_local: ``M``, the most pieces any chunk holds (rows of the pair
      tables exchanged with the bits).
    send_index: ``(K, M)`` int32, the segment of owner ``k``'s ``m``-th
      piece (rows past the owner's pieces repeat the last segment).
  """

  shapes: tuple[tuple[int, ...], ...]
  transpose: tuple[bool, ...]
  offsets: tuple[int, ...]
  n: int
  n_pad: int
  k: int
  chunk: int
  worker_runs: tuple[Run, ...]
  owner_runs: tuple[tuple[Run, ...], ...]
  max_local: int
  send_index: np.ndarray

  @property
  def sizes(self) -> tuple[int, ...]:
    return tuple(int(np.prod(s, dtype=np.int64)) for s in self.shapes)

  def rows(self, i: int) -> int:
    """Rows of leaf ``i`` as a ``(rows, columns)`` matrix (its size if not by column)."""
    size = self.sizes[i]
    return size // self.shapes[i][-1] if self.transpose[i] and size else size

  def word_bits(self, i: int) -> int:
    """Bits per word in which leaf ``i``'s bits are transposed (``0``: one per byte).

    A column-scale leaf whose offset is a multiple of 8 (its packed bytes
    start on a byte) and whose rows are a multiple of 32, 16 or 8 transposes
    its bits as packed ``uint32``, ``uint16`` or ``uint8`` words; other
    column-scale leaves transpose them one byte per element.
    """
    if not (self.transpose[i] and self.sizes[i] and self.offsets[i] % 8 == 0):
      return 0
    return next((w for w in (32, 16, 8) if self.rows(i) % w == 0), 0)

  def leaf_runs(self, i: int) -> list[tuple[int, int, Run]]:
    """The owners' runs of leaf ``i``, in buffer order.

    Returns:
      ``(owner, pair_row, run)``: ``pair_row`` is the run's first row in the
      owner's pair table; ``run.start`` is relative to the leaf's offset
      (its position in the leaf's column-by-column order).
    """
    out = []
    for j, runs in enumerate(self.owner_runs):
      row = 0
      for run in runs:
        if run.leaf == i:
          out.append((j, row, run._replace(start=j * self.chunk + run.start - self.offsets[i])))
        row += run.count
    return out


def _group(starts, lengths, leaves, base: int) -> tuple[Run, ...]:
  """Groups consecutive pieces of equal length and leaf into runs."""
  runs: list[Run] = []
  for start, length, leaf in zip(starts, lengths, leaves):
    last = runs[-1] if runs else None
    if last is not None and last.length == length and last.leaf == leaf:
      runs[-1] = last._replace(count=last.count + 1)
    else:
      runs.append(Run(int(start) - base, 1, int(length), int(leaf)))
  return tuple(runs)


def make_layout(shapes, scale: str, k: int) -> Layout:
  """The layout of leaves of ``shapes`` for ``scale`` and ``k`` replicas."""
  transpose, offsets, seg_len, seg_leaf, worker_runs = [], [], [], [], []
  offset = 0
  for i, shape in enumerate(shapes):
    size = int(np.prod(shape, dtype=np.int64))
    by_column = scale == "column" and len(shape) >= 2
    c = 0 if size == 0 else (shape[-1] if by_column else 1)
    transpose.append(by_column)
    offsets.append(offset)
    if c:
      seg_len += [size // c] * c
      seg_leaf += [i] * c
      worker_runs.append(Run(offset, c, size // c, i))
    offset += size
  n = offset
  n_pad = max(8 * k, -(-n // (8 * k)) * 8 * k)
  if n_pad > n:
    seg_len.append(n_pad - n)
    seg_leaf.append(-1)
    worker_runs.append(Run(n, 1, n_pad - n, -1))
  lengths = np.asarray(seg_len, np.int64)
  starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
  ends = starts + lengths
  chunk = n_pad // k
  edges = np.arange(k + 1) * chunk
  owner_runs, firsts, counts = [], [], []
  for j in range(k):
    first = int(np.searchsorted(starts, edges[j], side="right") - 1)
    last = int(np.searchsorted(starts, edges[j + 1] - 1, side="right") - 1)
    idx = np.arange(first, last + 1)
    p_start = np.maximum(starts[idx], edges[j])
    p_len = np.minimum(ends[idx], edges[j + 1]) - p_start
    assert p_len.sum() == chunk and (p_len > 0).all()
    owner_runs.append(_group(p_start, p_len, np.asarray(seg_leaf)[idx], edges[j]))
    firsts.append(first)
    counts.append(len(idx))
  m = max(counts)
  send = np.minimum(np.asarray(firsts)[:, None] + np.arange(m)[None, :], len(seg_len) - 1)
  return Layout(
      shapes=tuple(tuple(s) for s in shapes),
      transpose=tuple(transpose),
      offsets=tuple(offsets),
      n=n,
      n_pad=n_pad,
      k=k,
      chunk=chunk,
      worker_runs=tuple(worker_runs),
      owner_runs=tuple(owner_runs),
      max_local=m,
      send_index=send.astype(np.int32),
  )


def axis_size(
    axis_name: str, num_replicas: int | None, where: str, name: str = "sign_compression"
) -> int:
  """The size of the bound axis ``axis_name``, checked against ``num_replicas``.

  ``init`` may run outside a mapped context when ``num_replicas`` is given;
  ``update`` always needs the axis (it runs collectives over it). Raises a
  ValueError naming the axis otherwise.
  """
  try:
    size = lax.axis_size(axis_name)
  except NameError:
    if num_replicas is not None and where == "init":
      return num_replicas
    raise ValueError(
        f"{name}(axis_name={axis_name!r}).{where} runs outside a "
        f"mapped context with axis {axis_name!r}: call it inside "
        f"jax.pmap(..., axis_name={axis_name!r}) or jax.shard_map over a "
        f"Mesh with an axis named {axis_name!r}"
        + (f" (or give num_replicas= to {name})." if where == "init" else ".")
    ) from None
  if num_replicas is not None and num_replicas != size:
    raise ValueError(
        f"{name} got num_replicas={num_replicas}, but axis "
        f"{axis_name!r} has size {size}."
    )
  return int(size)


def from_flat_leaf(flat: jax.Array, layout: Layout, i: int, dtype) -> jax.Array:
  """Leaf ``i`` back from its ``size`` buffer-order elements ``flat``."""
  shape = layout.shapes[i]
  x = flat
  if layout.transpose[i]:
    x = jnp.moveaxis(x.reshape((shape[-1],) + shape[:-1]), 0, -1)
  return x.reshape(shape).astype(dtype)
