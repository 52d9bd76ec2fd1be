"""The 1-bit codec of :func:`jmp_train.sign_compression`: worker, owner, decode.

Each step works on the static runs of ``sign_layout``: a run is a
``(count, length)`` view of the flat buffer, so the per-segment sums are row
reductions and decoding is a broadcast of one ``(hi, lo)`` pair per row. The
bits' packing and their transposes as words live in ``sign_bits``.

The final decode writes a column-scale leaf in its own ``(rows, columns)``
order: its bits cross from the buffer's column-by-column order as packed
32-, 16- or 8-bit words (``sign_bits.unpack_columns``), so no float buffer
is transposed (a transpose runs several times slower than a copy on
XLA:CPU).

* :func:`worker_step`: ``v = g + r``; packed bits, pairs, ``r <- v - decode``,
  each leaf in its own order (the residuals are per leaf). The bits and the
  sums behind the pairs come from one pass over ``v``: a variadic reduction
  over blocks of 8 entries (:func:`_packed_rows`,
  :func:`_column_statistics`).
* :func:`owner_step`: decode the ``K`` received chunks, average them, add
  the server residual, re-quantize (one ``lax.switch`` branch per owner:
  each owner's pieces are static); the server residual is updated after
  the switch, in place when donated.
* :func:`final_decode`: the gathered bits and pairs to the leaves.

Packed bits are decoded from ``(..., bytes, 8)`` views, each entry's shift
its index along the last axis (:func:`_decode_packed`), and partial sums
already in memory are finished by products with a vector of ones
(:func:`_sum_by_product`): the forms XLA:CPU runs at memory speed.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jmp_train._src.buckets import assemble
from jmp_train._src.leaf_checks import all_finite
from jmp_train._src.compression.sign_bits import (
    SHIFTS, bit_lanes, pack, unpack, unpack_columns, wider_words, words_to_bytes,
)
from jmp_train._src.compression.sign_layout import Layout, Run, from_flat_leaf

__all__ = ["quantize_rows", "worker_step", "owner_step", "final_decode"]

def _column_sums(x: jax.Array):
  """Per row: sum of the non-negative entries, of the negative ones, their count.

  One variadic reduction (a single pass over ``x``): XLA:CPU runs three
  sibling ``jnp.sum`` s as separate passes, or a slow multi-output fusion.
  """
  zero = jnp.zeros((), jnp.float32)
  add3 = lambda a, b: (a[0] + b[0], a[1] + b[1], a[2] + b[2])
  return lax.reduce(
      (jnp.maximum(x, zero), jnp.minimum(x, zero), (x >= 0).astype(jnp.float32)),
      (zero, zero, zero),
      add3,
      (x.ndim - 1,),
  )


def _signed_sums_over_rows(v: jax.Array):
  """Per column of ``(rows, columns)`` ``v``: sums of the non-negative and of the negative entries.

  Two plain reductions over the rows, each term exact: ``max(v, -0)`` and
  ``(v - |v|) / 2`` (the halving on the sum). The ``-0`` keeps the zero
  apart from the one of ``v >= 0``: a zero shared by both would be
  materialized as a full ``(rows, columns)`` buffer. For rows that form
  blocks of 8, :func:`_column_statistics` does this and more in one pass.
  """
  pos = jnp.sum(jnp.maximum(v, jnp.float32(-0.0)), axis=0)
  neg = jnp.sum(v - jnp.abs(v), axis=0) * 0.5
  return pos, neg


def _bits_and_sums(blocks: jax.Array, axis: int, scale: str):
  """One variadic reduction over ``axis`` (of length 8) of ``blocks``: bits and partial sums.

  Returns ``(packed, *sums)``: the 8 entries' byte of bits (``x >= 0``,
  entry ``b`` in bit ``b``) and their sums of ``|x|`` (``l1``), ``x**2``
  (``l2``), or of the non-negative and of the negative entries
  (``column``: ``max(x, -0)`` and ``x - |x|``, twice the negative sum; each
  term exact). XLA:CPU unrolls such a short reduction into a vectorized loop
  at memory speed, where a variadic reduction of whole rows or columns runs
  on one core several times slower, and separate reductions would each
  read the entries again.
  """
  zero = jnp.zeros((), jnp.float32)
  if scale == "column":
    terms = (jnp.maximum(blocks, -zero), blocks - jnp.abs(blocks))
  else:
    terms = (jnp.abs(blocks) if scale == "l1" else jnp.square(blocks),)
  shape = [1] * blocks.ndim
  shape[axis] = 8
  shifts = jnp.asarray(SHIFTS, jnp.uint8).reshape(shape)
  return lax.reduce(
      ((blocks >= 0).astype(jnp.uint8) << shifts,) + terms,
      (jnp.zeros((), jnp.uint8),) + (zero,) * len(terms),
      lambda a, b: tuple(p + q for p, q in zip(a, b)),
      (axis,),
  )


# Columns from which a column leaf's bytes are transposed as wider words.
_WIDEN_FROM_COLUMNS = 2048


def _column_statistics(v: jax.Array):
  """Bits and per-column sums and counts of ``(rows, columns)`` ``v`` in one pass.

  ``rows`` is a multiple of 8. :func:`_bits_and_sums` over blocks of 8 rows
  yields, per block and column, a byte of bits and the sums of the
  non-negative and negative entries; :func:`_sum_by_product` finishes the
  ``(rows / 8, columns)`` partial sums and the bytes' popcounts.

  Returns:
    ``(bytes, pos, neg, count)``: the bits in column-by-column order as
    :func:`pack_columns` packs them, the sums of the non-negative and of the
    negative entries, and the number of non-negative ones (float32, exact
    up to ``2**24`` rows).
  """
  rows, cols = v.shape
  words, pos, neg = _bits_and_sums(v.reshape(rows // 8, 8, cols), 1, "column")
  count = _sum_by_product(lax.population_count(words).astype(jnp.float32), 0)
  packed = words_to_bytes(wider_words(words) if cols >= _WIDEN_FROM_COLUMNS else words)
  return packed, _sum_by_product(pos, 0), _sum_by_product(neg, 0) * 0.5, count


def _sum_by_product(y: jax.Array, axis: int) -> jax.Array:
  """``jnp.sum(y, axis)`` of a 2-D float32 ``y`` as a product with a vector of ones.

  For partial sums already in memory: XLA:CPU runs the matrix-vector
  product at memory speed, where its reductions of such arrays cost
  several times more. In full float32 (``Precision.HIGHEST``), so that no
  accelerator rounds the sums' inputs to a narrower type.
  """
  ones = jnp.ones((y.shape[axis],), jnp.float32)
  hi = lax.Precision.HIGHEST
  return jnp.dot(ones, y, precision=hi) if axis == 0 else jnp.dot(y, ones, precision=hi)


def _lane_sum(y: jax.Array) -> jax.Array:
  """``jnp.sum(y, axis=-1)`` as partial sums over up to 128 lanes, then their sum.

  A row sum is a chain of dependent additions; XLA:CPU does not reorder
  them. Viewing each row as ``(length / w, w)`` and summing over the first
  axis gives ``w`` independent accumulators that vectorize, at memory
  speed.
  """
  n = y.shape[-1]
  w = next(w for w in (128, 64, 32, 16, 8, 4, 2, 1) if n % w == 0)
  if w == 1:
    return jnp.sum(y, axis=-1)
  y = y.reshape(y.shape[:-1] + (n // w, w))
  return jnp.sum(jnp.sum(y, axis=-2), axis=-1)


def quantize_rows(x: jax.Array, scale: str):
  """Quantizes each row of ``x`` (one segment per row).

  Returns:
    ``(bits, pairs, decoded)``: ``x >= 0``, the rows' ``(hi, lo)`` as
    ``(rows, 2)`` float32, and ``where(bits, hi, lo)``.
  """
  bits = x >= 0
  n = x.shape[-1]
  if scale == "column":
    pairs = _column_pairs(*_column_sums(x), n)
  else:
    pairs = _norm_pairs(_lane_sum(jnp.abs(x) if scale == "l1" else jnp.square(x)), n, scale)
  return bits, pairs, decode_rows(bits, pairs)


def _norm_pairs(total: jax.Array, n: int, scale: str) -> jax.Array:
  """``(hi, -hi)`` from the sum of ``|x|`` (``l1``) or of ``x**2`` (``l2``) over ``n`` entries."""
  hi = total / max(n, 1)
  if scale == "l2":
    hi = jnp.sqrt(hi)
  return jnp.stack([hi, -hi], axis=-1)


def _column_pairs(pos_sum, neg_sum, pos_cnt, n: int) -> jax.Array:
  """``(hi, lo)``: the means of the non-negative and of the negative entries.

  Counts are float32: exact up to 2**24 entries per column.
  """
  hi = pos_sum / jnp.maximum(pos_cnt, 1.0)
  lo = neg_sum / jnp.maximum(n - pos_cnt, 1.0)
  return jnp.stack([hi, lo], axis=-1)


def decode_rows(bits: jax.Array, pairs: jax.Array) -> jax.Array:
  """``where(bits, hi, lo)`` with one ``(hi, lo)`` row of ``pairs`` per row of bits."""
  return jnp.where(bits, pairs[..., 0:1], pairs[..., 1:2])


def _decode_packed(packed: jax.Array, run: Run, pairs: jax.Array) -> jax.Array:
  """``decode_rows`` of run ``run`` of the packed bits ``packed`` (``(n / 8,)`` uint8).

  A run whose rows start and end on bytes is decoded from a ``(count,
  length / 8, 8)`` view: the shift of each entry is its index along the last
  axis, so XLA:CPU vectorizes the decode. Unpacking first and viewing the
  bits as rows leaves it an index computation and a byte load per entry,
  several times slower. Any other run unpacks the bytes that hold it.
  """
  if run.start % 8 == 0 and run.length % 8 == 0:
    bits = bit_lanes(packed[run.start // 8 : (run.start + run.size) // 8].reshape(run.count, -1))
    out = jnp.where(bits, pairs[:, 0, None, None], pairs[:, 1, None, None])
    return out.reshape(run.count, run.length)
  first = run.start // 8
  bits = unpack(packed[first : -(-(run.start + run.size) // 8)])
  return decode_rows(_view(bits, run, -8 * first), pairs)


def _view(flat: jax.Array, run: Run, base: int = 0) -> jax.Array:
  lo = base + run.start
  return flat[..., lo : lo + run.size].reshape(flat.shape[:-1] + (run.count, run.length))


def _leaf_pairs(v: jax.Array, scale: str) -> jax.Array:
  """The pair ``(1, 2)`` of a one-segment leaf ``v`` (1-D) with an ``l1``/``l2``/``column`` scale.

  A plain sum: for one long row XLA:CPU reduces it at memory speed.
  """
  n = v.shape[0]
  if scale == "column":
    return _column_pairs(*_column_sums(v[None]), n)
  return _norm_pairs(jnp.sum(jnp.abs(v) if scale == "l1" else jnp.square(v)), n, scale)[None]


def _packed_rows(x: jax.Array, scale: str):
  """The packed bits and the pairs of the rows of ``x`` (one segment per row) in one pass.

  ``x`` is ``(rows, length)``, ``length`` a multiple of 8.
  :func:`_bits_and_sums` over each 8 consecutive entries yields their byte of
  bits and their partial sums; :func:`_sum_by_product` adds the partial sums up.

  Returns:
    ``(packed, pairs)``: ``pack(x >= 0)`` flattened, ``(rows * length / 8,)``
    uint8, and the ``(rows, 2)`` pairs of :func:`quantize_rows`.
  """
  rows, n = x.shape
  packed, *sums = _bits_and_sums(x.reshape(rows, n // 8, 8), 2, scale)
  sums = [_sum_by_product(s, 1) for s in sums]
  if scale != "column":
    return packed.reshape(-1), _norm_pairs(sums[0], n, scale)
  count = jnp.sum(lax.population_count(packed), axis=-1, dtype=jnp.int32).astype(jnp.float32)
  return packed.reshape(-1), _column_pairs(sums[0], sums[1] * 0.5, count, n)


def _leaf_sum(x: jax.Array, r, shape) -> jax.Array:
  """``v = x + r`` in float32, in ``shape`` (``x`` alone without a residual)."""
  v = x.astype(jnp.float32).reshape(shape)
  return v if r is None else v + r.reshape(shape)


def _worker_leaf(x: jax.Array, r, layout: Layout, i: int, scale: str):
  """Leaf ``i``: ``(v, bits in buffer order, pairs, decoded)``.

  ``v`` and ``decoded`` are float32, in the leaf's shape, or ``(rows,
  columns)`` for a column-scale leaf: a residual update
  ``v - decoded`` that broadcasts each column's pair along the rows then
  runs at memory speed (XLA:CPU indexes a broadcast along the minor axis of
  a flattened output element by element).

  The statistics add ``x + r`` again, behind an optimization barrier, so
  that XLA does not keep one ``v`` for both: kept, every leaf's ``v`` is a
  temporary alive until the finiteness of all pairs is known, a block the
  size of the gradients (which a donated step, its outputs in the donated
  buffers, allocates afresh at every call). Added twice, ``v`` is never
  stored: the statistics and the residual update each read ``x`` and ``r``,
  and the residual update writes in place over a donated ``r``.
  """
  shape = (layout.rows(i), layout.shapes[i][-1]) if layout.transpose[i] else x.shape
  v = _leaf_sum(x, r, shape)
  vs = _leaf_sum(*lax.optimization_barrier((x, r)), shape)  # the same values
  if not layout.transpose[i]:
    flat = vs.reshape(-1)
    if flat.shape[0] % 8 == 0 and layout.offsets[i] % 8 == 0:  # whole bytes
      bits, pairs = _packed_rows(flat[None], scale)
    else:
      bits, pairs = flat >= 0, _leaf_pairs(flat, scale)
    return v, bits, pairs, jnp.where(v >= 0, pairs[0, 0], pairs[0, 1])
  # Column scales: the sums are reductions over the rows; the residual
  # update and, where the rows allow packed words, the bits stay in the
  # leaf's own order.
  rows = shape[0]
  if layout.word_bits(i):  # bits, sums and counts in one pass over the floats
    bits, pos, neg, count = _column_statistics(vs)
  else:
    nonneg = vs >= 0
    bits = nonneg.T.reshape(-1)
    count = jnp.sum(nonneg, axis=0, dtype=jnp.float32)
    pos, neg = _signed_sums_over_rows(vs)
  pairs = _column_pairs(pos, neg, count, rows)
  return v, bits, pairs, jnp.where(v >= 0, pairs[:, 0], pairs[:, 1])


def _pack_pieces(pieces, n_pad: int) -> jax.Array:
  """Packs pieces that cover ``[0, n_pad)`` in order into ``(n_pad / 8,)`` uint8.

  A piece is boolean bits, or ``uint8`` bits already packed (starting on a
  byte). A boolean piece that starts and ends on a byte is packed on its
  own; neighbours that share a byte are concatenated first (small leaves,
  in practice).
  """
  packed, group, start, size = [], [], 0, 0
  for bits in pieces:
    if bits.dtype == jnp.uint8:
      assert not group, "packed pieces start on a byte"
      packed.append((start // 8, bits))
      start += 8 * bits.shape[0]
      continue
    group.append(bits)
    size += bits.shape[0]
    if size % 8 == 0:
      packed.append((start // 8, pack(group[0] if len(group) == 1 else jnp.concatenate(group))))
      start, group, size = start + size, [], 0
  return assemble(packed, jnp.zeros((n_pad // 8,), jnp.uint8))


def worker_step(leaves, residual, layout: Layout, scale: str, *, decode: bool):
  """Worker quantization of the local gradient leaves with residuals ``residual``.

  Each leaf is quantized in its own order: ``v = g + r`` and ``r <- v -
  decode(v)`` are elementwise on the leaf, so a donated residual is
  updated in place; only the bits (and, for column scales, the column
  sums) are taken in buffer order.

  Args:
    leaves: the gradient leaves (any floating dtype).
    residual: the worker residuals, one float32 array per leaf in the
      leaf's shape (``(1,)`` for a scalar), or ``None`` without error
      feedback.
    layout: the static layout.
    scale: ``"column"``, ``"l1"`` or ``"l2"``.
    decode: also return the decoded leaves (float32, leaf shapes).

  Returns:
    ``(packed, pairs, new_residual, decoded)``: the bits in buffer order
    packed to ``(n_pad / 8,)`` uint8, pairs ``(segments, 2)`` float32 in
    buffer order, the new residuals (``None`` without error feedback; the
    old ones where ``v`` is not finite) and the decoded leaves (``None``
    unless ``decode``).
  """
  bits, pairs, done = [], [], {}
  for run in layout.worker_runs:
    if run.leaf < 0:  # the padding: zeros, which quantize to zero
      b, p, _ = quantize_rows(jnp.zeros((1, run.length), jnp.float32), scale)
      bits.append(b.reshape(-1))
      pairs.append(p)
      continue
    i = run.leaf
    v, b, p, d = _worker_leaf(leaves[i], None if residual is None else residual[i], layout, i, scale)
    bits.append(b)
    pairs.append(p)
    done[i] = (v, d)
  pairs = jnp.concatenate(pairs)
  if residual is not None:
    # Non-finite v makes its segment's pairs non-finite: keep the residual.
    finite = all_finite(pairs)
    residual = tuple(
        jnp.where(finite, (done[i][0] - done[i][1]).reshape(r.shape), r)
        if i in done else r
        for i, r in enumerate(residual)
    )
  dec = None
  if decode:
    dec = [
        done[i][1].reshape(shape) if i in done else jnp.zeros(shape, jnp.float32)
        for i, shape in enumerate(layout.shapes)
    ]
  return _pack_pieces(bits, layout.n_pad), pairs, residual, dec


def _owner_chunk(runs, recv_bits, recv_pairs, e, k: int, m: int, scale: str):
  """One owner's step on its static pieces ``runs``; ``e`` may be ``None``.

  Returns the packed bits, the pairs, and ``None`` or the chunk's new
  server residual ``u - decode(u)`` (applied, or not, by the caller).
  """
  out_bits, out_pairs, ud = [], [], []
  row = 0
  for run in runs:
    pairs_in = recv_pairs[:, row : row + run.count]  # (K, count, 2)
    row += run.count
    # Unrolled over the K senders: XLA:CPU runs a reduction over the leading
    # axis of a fused decode an order of magnitude slower than K adds.
    u = _decode_packed(recv_bits[0], run, pairs_in[0])
    for j in range(1, k):
      u = u + _decode_packed(recv_bits[j], run, pairs_in[j])
    u = u / k
    if e is not None:
      u = u + _view(e, run)
    if run.start % 8 == 0 and run.length % 8 == 0:  # whole bytes
      b, p = _packed_rows(u, scale)
    else:
      b, p, _ = quantize_rows(u, scale)
      b = b.reshape(-1)
    out_bits.append(b)
    out_pairs.append(p)
    ud.append((run, u, decode_rows(u >= 0, p)))
  pairs = jnp.concatenate(out_pairs + [jnp.zeros((m - row, 2), jnp.float32)])
  if e is not None:  # the runs cover the chunk in order
    e = assemble([(run.start, (u - d).reshape(-1)) for run, u, d in ud], jnp.zeros_like(e))
  return _pack_pieces(out_bits, 8 * recv_bits.shape[1]), pairs, e


def owner_step(recv_bits, recv_pairs, e, owner, layout: Layout, scale: str):
  """The owner ``owner`` (traced) averages and re-quantizes its chunk.

  Args:
    recv_bits: ``(K, S/8)`` uint8, every worker's packed chunk.
    recv_pairs: ``(K, M, 2)`` float32, their pieces' pairs.
    e: the server residual ``(S,)`` float32, or ``None``.
    owner: this replica's index along the axis.
    layout: the static layout.
    scale: the scale.

  Returns:
    ``(packed (S/8,) uint8, pairs (M, 2) float32, new e or None)``.
  """
  k, m = layout.k, layout.max_local
  branches = [
      (lambda b, p, e, runs=runs: _owner_chunk(runs, b, p, e, k, m, scale))
      for runs in layout.owner_runs
  ]
  if len(set(layout.owner_runs)) == 1:
    bits, pairs, r = branches[0](recv_bits, recv_pairs, e)
  else:
    bits, pairs, r = lax.switch(owner, branches, recv_bits, recv_pairs, e)
  # Outside the branches, where a donated ``e`` is updated in place: a
  # branch that updates its operand copies it first, and its result is
  # copied again into the output.
  return bits, pairs, None if e is None else jnp.where(all_finite(pairs), r, e)


def _decode_columns(flat_bytes, all_pairs, layout: Layout, i: int) -> jax.Array:
  """Leaf ``i`` (with :meth:`Layout.word_bits`) decoded in its own ``(rows, columns)`` order.

  Each column takes the pair of its piece that starts at row 0; the pieces
  that start lower (a chunk boundary cuts the column) are written over it.
  """
  rows, cols, off = layout.rows(i), layout.shapes[i][-1], layout.offsets[i]
  packed = flat_bytes[off // 8 : (off + rows * cols) // 8]
  bits = unpack_columns(packed, rows, cols, layout.word_bits(i))
  base, cuts = [], []
  for j, row, run in layout.leaf_runs(i):
    if run.length == rows:  # whole columns
      base.append(all_pairs[j, row : row + run.count])
      continue
    for t in range(run.count):
      start = run.start + t * run.length
      if start % rows == 0:
        base.append(all_pairs[j, row + t : row + t + 1])
      else:
        cuts.append((all_pairs[j, row + t], start % rows, start // rows, run.length))
  base = jnp.concatenate(base)  # (cols, 2)
  out = jnp.where(bits, base[:, 0], base[:, 1])
  for pair, a, c, length in cuts:
    piece = jnp.where(bits[a : a + length, c : c + 1], pair[0], pair[1])
    out = lax.dynamic_update_slice(out, piece, (a, c))
  return out


def _decode_pieces(flat_bytes, all_pairs, layout: Layout, i: int) -> jax.Array:
  """Leaf ``i`` (one segment per piece, on whole bytes) decoded in buffer order in one pass.

  Each byte takes the pair of the last piece that starts at or before it
  (a chain of selects on the byte index): XLA:CPU concatenates separately
  decoded pieces at about half the speed of this single fused decode.
  """
  off, size = layout.offsets[i], layout.sizes[i]
  bits = bit_lanes(flat_bytes[off // 8 : (off + size) // 8])  # (size / 8, 8)
  (j, row, _), *later = layout.leaf_runs(i)
  hi, lo = all_pairs[j, row, 0], all_pairs[j, row, 1]
  index = lax.broadcasted_iota(jnp.int32, (size // 8, 1), 0)
  for j, row, run in later:
    after = index >= run.start // 8
    hi = jnp.where(after, all_pairs[j, row, 0], hi)
    lo = jnp.where(after, all_pairs[j, row, 1], lo)
  return jnp.where(bits, hi, lo).reshape(-1)


def final_decode(all_bits, all_pairs, layout: Layout, dtypes) -> list[jax.Array]:
  """The leaves from the owners' gathered ``(K, S/8)`` bits and ``(K, M, 2)`` pairs."""
  words = [layout.word_bits(i) for i in range(len(layout.shapes))]
  out = []
  for i, dtype in enumerate(dtypes):
    if not layout.sizes[i]:  # an empty leaf: nothing crossed the wire
      out.append(jnp.zeros(layout.shapes[i], dtype))
      continue
    if words[i]:
      x = _decode_columns(all_bits.reshape(-1), all_pairs, layout, i)
      out.append(x.reshape(layout.shapes[i]).astype(dtype))
      continue
    runs = layout.leaf_runs(i)
    if layout.offsets[i] % 8 == 0 and layout.sizes[i] % 8 == 0 and all(
        run.count == 1 for _, _, run in runs):
      x = _decode_pieces(all_bits.reshape(-1), all_pairs, layout, i)
      out.append(from_flat_leaf(x, layout, i, dtype))
      continue
    parts = []
    for j, row, run in runs:
      chunk_run = run._replace(start=run.start + layout.offsets[i] - j * layout.chunk)
      pairs = all_pairs[j, row : row + run.count]
      parts.append(_decode_packed(all_bits[j], chunk_run, pairs).reshape(-1))
    # Several segments per piece (a column-scale leaf without whole-byte
    # rows): the pieces decoded apart and concatenated (dynamic-update-slices
    # run slower).
    out.append(from_flat_leaf(jnp.concatenate(parts), layout, i, dtype))
  return out
