"""The chunks of :func:`jmp_train.sign_compression`: each leaf split among the owners.

Everything here is static (computed with NumPy at trace time from the leaves'
shapes, the scale and the replica count ``K``), and every owner's chunk has
the same structure: the owners differ only in which part of each leaf they
hold. So one program serves every owner, and its size does not grow with
``K`` (no per-owner branches, no piece tables): the codec in ``sign_codec``
is reshapes, reductions and broadcasts over each leaf's part.

* A *segment* shares reconstruction values: a column (``"column"`` scale,
  a leaf of two or more axes: ``rows`` entries each, ``cols`` of them) or a
  whole leaf (``"l1"``, ``"l2"``, vectors and scalars: one segment of
  ``rows = size`` entries).
* Each non-empty leaf is split among the ``K`` owners in one of two ways
  (:class:`Part`), whichever sends fewer bytes:

  - by **columns**: owner ``o`` holds whole columns ``o·w`` to ``o·w + w - 1``,
    column by column (zero columns appended to reach ``K·w``); with
    ``sub > 1``, each column counts as ``sub`` columns of ``rows / sub``
    consecutive rows (the same order), so that a leaf of fewer columns
    than owners still splits with little padding;
  - by **rows**: owner ``o`` holds rows ``o·w`` to ``o·w + w - 1`` of every
    column, row by row (the leaf's own order; zero rows appended). A
    one-segment leaf is always split so: owner ``o`` holds entries ``o·w``
    to ``o·w + w - 1``.

  ``w`` (the part's ``width``) is rounded up so that every part is whole
  bytes of bits. An owner re-quantizes each *piece* of its chunk: a (sub-)
  column held whole (split by columns) or its rows of a column (split by
  rows), the appended zeros left out.
* Chunk ``o`` is owner ``o``'s parts of all leaves, leaf after leaf:
  ``S = chunk`` elements, the same for every owner. The ``(hi, lo)`` pairs an
  owner needs follow the same order: a part split by columns brings one pair
  per column it holds, a part split by rows the pairs of all its columns.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple, Sequence

import numpy as np
from jax import lax

from jmp_train._src.varying_axes import varying_axes

__all__ = ["Part", "Layout", "make_layout", "axis_size"]


class Part(NamedTuple):
  """Leaf ``leaf``'s part of every chunk: the same shape for every owner.

  Attributes:
    leaf: the leaf's index.
    rows: entries per segment (a column's rows; the leaf's size for a
      one-segment leaf).
    cols: segments of the leaf (its columns; 1 for a one-segment leaf).
    split: ``"columns"`` (whole columns per owner, stored column by column)
      or ``"rows"`` (rows of every column per owner, stored row by row).
    width: (sub-)columns (``"columns"``) or rows (``"rows"``) per owner.
    offset: the part's first element in the chunk (a multiple of 8).
    pair_offset: the part's first row in the owner's table of pairs.
    sub: sub-columns per column (``"columns"``; 1 otherwise).
  """

  leaf: int
  rows: int
  cols: int
  split: str
  width: int
  offset: int
  pair_offset: int
  sub: int = 1

  @property
  def piece_rows(self) -> int:
    """Entries of a piece held whole (split by columns): a (sub-)column."""
    return self.rows // self.sub

  @property
  def size(self) -> int:
    """Elements per owner (a multiple of 8)."""
    return self.width * (self.piece_rows if self.split == "columns" else self.cols)

  @property
  def pairs(self) -> int:
    """``(hi, lo)`` pairs per owner."""
    return self.width if self.split == "columns" else self.cols

  def valid(self, owner):
    """Rows of owner ``owner`` (int or traced) that hold entries, not appended zeros (``"rows"``)."""
    if isinstance(owner, (int, np.integer)):
      return min(max(self.rows - int(owner) * self.width, 0), self.width)
    return lax.clamp(0, self.rows - owner * self.width, self.width)


@dataclasses.dataclass(frozen=True)
class Layout:
  """Static description of the chunks for ``k`` replicas.

  Attributes:
    shapes: the leaves' shapes.
    k: replicas.
    parts: one :class:`Part` per non-empty leaf, in leaf order.
    n: elements of all leaves.
    chunk: ``S``, elements per owner (the parts end to end).
    max_local: ``M``, pairs per owner (the parts' pairs end to end).
  """

  shapes: tuple[tuple[int, ...], ...]
  k: int
  parts: tuple[Part, ...]
  n: int
  chunk: int
  max_local: int

  @property
  def n_pad(self) -> int:
    """Elements on the wire per replica and phase: ``K·S``."""
    return self.k * self.chunk

  @property
  def sizes(self) -> tuple[int, ...]:
    return tuple(int(np.prod(s, dtype=np.int64)) for s in self.shapes)

  def part(self, i: int) -> Part | None:
    """Leaf ``i``'s part (``None`` for an empty leaf)."""
    return next((p for p in self.parts if p.leaf == i), None)

  def word_bits(self, i: int) -> int:
    """Bits per word in which leaf ``i``'s bits are transposed (``0``: none or one per byte).

    A leaf split by columns travels column by column: when its rows are a
    multiple of 32, 16 or 8 its bits are transposed as packed ``uint32``,
    ``uint16`` or ``uint8`` words; other such leaves transpose one byte per
    element. A leaf split by rows travels in its own order: no transpose.
    """
    part = self.part(i)
    if part is None or part.split != "columns":
      return 0
    return next((w for w in (32, 16, 8) if part.rows % w == 0), 0)


def _round_up(x: int, m: int) -> int:
  return -(-x // m) * m


def _subdivisions(rows: int) -> list[int]:
  """The ``sub`` a column of ``rows`` may be cut into: divisors of ``rows``, keeping
  whole-byte sub-columns whole bytes."""
  out = set()
  for d in range(1, math.isqrt(rows) + 1):
    if rows % d == 0:
      out |= {d, rows // d}
  if rows % 8 == 0:
    out = {d for d in out if (rows // d) % 8 == 0}
  return sorted(out)


def _split(rows: int, cols: int, k: int) -> tuple[str, int, int]:
  """``(split, width, sub)`` for a leaf of ``cols`` segments of ``rows`` entries.

  Whichever split sends fewest bits per owner: its part's bits plus 64 per
  pair (ties: by columns, fewest sub-columns). Widths are rounded up so
  that a part is whole bytes.
  """
  by_rows = _round_up(-(-rows // k), 8 // math.gcd(cols, 8))
  if cols == 1:
    return "rows", by_rows, 1
  best = ("rows", by_rows, 1)
  cost = by_rows * cols + 64 * cols
  for sub in _subdivisions(rows):
    piece = rows // sub
    width = _round_up(-(-(cols * sub) // k), 8 // math.gcd(piece, 8))
    if width * piece + 64 * width < cost or (best[0] == "rows" and width * piece + 64 * width == cost):
      best, cost = ("columns", width, sub), width * piece + 64 * width
  return best


def make_layout(shapes, scale: str, k: int) -> Layout:
  """The layout of leaves of ``shapes`` for ``scale`` and ``k`` replicas."""
  parts, offset, pair_offset, n = [], 0, 0, 0
  for i, shape in enumerate(shapes):
    size = int(np.prod(shape, dtype=np.int64))
    n += size
    if size == 0:
      continue
    cols = shape[-1] if scale == "column" and len(shape) >= 2 else 1
    split, width, sub = _split(size // cols, cols, k)
    part = Part(i, size // cols, cols, split, width, offset, pair_offset, sub)
    parts.append(part)
    offset += part.size
    pair_offset += part.pairs
  return Layout(
    shapes=tuple(tuple(s) for s in shapes),
    k=k,
    parts=tuple(parts),
    n=n,
    chunk=offset,
    max_local=pair_offset,
  )


def _mapped_axes(leaves: Sequence[Any]) -> list[str]:
  """The mapped axes bound here: those ``leaves`` vary over (``shard_map``), else ``pmap``'s."""
  axes: set[str] = set()
  for x in leaves:
    try:
      axes |= varying_axes(x)
    except TypeError:  # not an array
      pass
  if not axes:
    try:  # JAX has no public list of the bound axes; best effort.
      from jax._src import core as jax_core

      axes = {a for a in jax_core.get_axis_env().axis_names() if isinstance(a, str)}
    except Exception:  # pragma: no cover - a JAX without it: no names to offer
      axes = set()
  return sorted(axes)


def axis_size(
  axis_name: str | None,
  num_replicas: int | None,
  where: str,
  name: str = "sign_compression",
  leaves: Sequence[Any] = (),
) -> int:
  """The size of the bound axis ``axis_name``, checked against ``num_replicas``.

  ``init`` may run outside a mapped context when ``num_replicas`` is given;
  ``update`` always needs the axis (it runs collectives over it). Without
  an axis (``axis_name=None``: each replica on its own) the size is 1, but
  an ``update`` whose ``leaves`` vary over a ``shard_map`` axis would then
  average nothing, and raises.

  Raises:
    ValueError: naming the axis and, inside ``shard_map``, the axes the
      values do vary over.
  """
  mapped = _mapped_axes(leaves)
  if axis_name is None:
    if where == "update" and mapped:
      raise ValueError(
        f"{name}(axis_name=None).update runs inside a step mapped over "
        f"{mapped[0]!r}, but without axis_name it averages nothing: each replica "
        f"would train on its own gradients. "
        f"Build it with {name}(axis_name={mapped[0]!r}), the step's axis name."
      )
    return 1
  try:
    size = lax.axis_size(axis_name)
  except NameError:
    if num_replicas is not None and where == "init":
      return num_replicas
    if mapped:
      raise ValueError(
        f"{name}(axis_name={axis_name!r}).{where} runs inside a step mapped over "
        f"{mapped}, where no axis is named {axis_name!r}: build it with "
        f"{name}(axis_name={mapped[0]!r}), the step's axis name (make_train_step's "
        f"axis_name), or map the step over an axis named {axis_name!r}."
      ) from None
    raise ValueError(
      f"{name}(axis_name={axis_name!r}).{where} found no mapped axis named "
      f"{axis_name!r}: call it inside jax.pmap(..., axis_name={axis_name!r}) or "
      f"jax.shard_map over a Mesh with an axis named {axis_name!r}, and in "
      f"make_train_step build it with the step's axis_name"
      + (f" (or give num_replicas= to {name})." if where == "init" else ".")
    ) from None
  if num_replicas is not None and num_replicas != size:
    raise ValueError(f"{name} got num_replicas={num_replicas}, but axis {axis_name!r} has size {size}.")
  return int(size)
