"""The 1-bit codec of :func:`jmp_train.sign_compression`: worker, owner, decode.

Every step works leaf by leaf on the static :class:`~sign_layout.Part` s of
``sign_layout``: each owner's chunk holds the same part of every leaf (whole
columns, or rows of every column), so a part is a plain ``(pieces, entries)``
or ``(rows, columns)`` array, the per-piece sums are reductions along one
axis and decoding is a broadcast of one ``(hi, lo)`` pair per piece. The
owners run one program whatever their number ``K``: no branch per owner, no
loop over chunk boundaries. The bits' packing and their transposes as
words live in ``sign_bits``.

* :func:`worker_step`: ``v = g + r``; packed bits, pairs, ``r <- v - decode``,
  each leaf in its own order (the residuals are per leaf). The bits and the
  sums behind the pairs come from one pass over ``v`` (a variadic reduction
  over blocks of 8 entries: :func:`_packed_rows`,
  :func:`_column_statistics`); a leaf split by columns packs its bits
  column by column as words (no float transpose). The bits and pairs leave
  as ``(K, S/8)`` and ``(K, M, 2)``: row ``o`` is owner ``o``'s.
* :func:`owner_step`: decode the ``K`` received chunks, average them, add
  the server residual, re-quantize each piece, update the server residual
  (in place when donated). The ``K`` senders are summed in at most 8
  unrolled terms, each over ``ceil(K / 8)`` senders at once, whose partial
  sums are then added by a product with a vector of ones
  (:func:`_sum_senders`): a program of fixed size, and XLA:CPU runs both
  forms at memory speed where it runs a reduction over a sender axis an
  order of magnitude slower.
* :func:`final_decode`: the gathered bits and pairs to the leaves, each
  part in one broadcast; a leaf split by columns is written in its own
  ``(rows, columns)`` order from bits transposed as packed words
  (``sign_bits.unpack_columns``: a float transpose runs several times slower
  than a copy on XLA:CPU).

Packed bits are decoded from ``(..., bytes, 8)`` views, each entry's shift
its index along the last axis (``sign_bits.bit_lanes``), and partial sums
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
  SHIFTS,
  bit_lanes,
  pack,
  unpack,
  unpack_columns,
  wider_words,
  words_to_bytes,
)
from jmp_train._src.compression.sign_layout import Layout, Part

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


def _norm_pairs(total: jax.Array, n, scale: str) -> jax.Array:
  """``(hi, -hi)`` from the sum of ``|x|`` (``l1``) or of ``x**2`` (``l2``) over ``n`` entries.

  ``n`` may be traced (an owner's entries, without appended zeros).
  """
  hi = total / (max(n, 1) if isinstance(n, int) else jnp.maximum(n, 1).astype(jnp.float32))
  if scale == "l2":
    hi = jnp.sqrt(hi)
  return jnp.stack([hi, -hi], axis=-1)


def _column_pairs(pos_sum, neg_sum, pos_cnt, n: int, zeros=0) -> jax.Array:
  """``(hi, lo)``: the means of the non-negative and of the negative entries.

  Counts are float32: exact up to 2**24 entries per column. ``zeros``
  (traced or not): appended zeros among the ``n`` entries, counted in
  ``pos_cnt`` but not entries (their sums add nothing).
  """
  lo = neg_sum / jnp.maximum(n - pos_cnt, 1.0)
  if not (isinstance(zeros, int) and zeros == 0):
    pos_cnt = pos_cnt - jnp.asarray(zeros, pos_cnt.dtype)
  hi = pos_sum / jnp.maximum(pos_cnt, 1.0)
  return jnp.stack([hi, lo], axis=-1)


def decode_rows(bits: jax.Array, pairs: jax.Array) -> jax.Array:
  """``where(bits, hi, lo)`` with one ``(hi, lo)`` row of ``pairs`` per row of bits."""
  return jnp.where(bits, pairs[..., 0:1], pairs[..., 1:2])


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


def _pad_bits(bits: jax.Array, n: int) -> jax.Array:
  """Bits (boolean, or ``uint8`` already packed) padded with zeros to ``n`` and packed."""
  if bits.dtype == jnp.uint8:
    return jnp.pad(bits, (0, n // 8 - bits.shape[0]))
  return pack(jnp.pad(bits, (0, n - bits.shape[0])))


def _worker_leaf(x: jax.Array, r, part: Part, scale: str):
  """One leaf: ``(v, packed bits of every owner's part (K·size/8,), pairs (cols, 2), decoded)``.

  ``v`` and ``decoded`` are float32, in the leaf's shape, or ``(rows,
  columns)`` for a leaf with a segment per column: a residual update
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
  rows, cols = part.rows, part.cols
  shape = (rows, cols) if cols > 1 else x.shape
  v = _leaf_sum(x, r, shape)
  vs = _leaf_sum(*lax.optimization_barrier((x, r)), shape)  # the same values
  if cols == 1:  # one segment, split by entries
    flat = vs.reshape(-1)
    if flat.shape[0] % 8 == 0:  # whole bytes: bits and sums in one pass
      bits, pairs = _packed_rows(flat[None], scale)
    else:
      bits, pairs = flat >= 0, _leaf_pairs(flat, scale)
    return v, bits, pairs, jnp.where(v >= 0, pairs[0, 0], pairs[0, 1])
  if part.split == "columns":  # bits column by column
    if rows % 8 == 0:  # bits, sums and counts in one pass over the floats
      bits, pos, neg, count = _column_statistics(vs)
    else:
      nonneg = vs >= 0
      bits = nonneg.T.reshape(-1)
      count = jnp.sum(nonneg, axis=0, dtype=jnp.float32)
      pos, neg = _signed_sums_over_rows(vs)
  else:  # bits in the leaf's own order
    nonneg = vs >= 0
    flat = nonneg.reshape(-1)
    bits = pack(flat) if flat.shape[0] % 8 == 0 else flat
    count = jnp.sum(nonneg, axis=0, dtype=jnp.float32)
    pos, neg = _signed_sums_over_rows(vs)
  pairs = _column_pairs(pos, neg, count, rows)
  return v, bits, pairs, jnp.where(v >= 0, pairs[:, 0], pairs[:, 1])


def _sent_pairs(pairs: jax.Array, part: Part, k: int) -> jax.Array:
  """A leaf's ``(cols, 2)`` pairs as every owner's ``(K, pairs, 2)``."""
  if part.split == "columns":  # owner o: the pairs of its (sub-)columns (zeros for appended ones)
    if part.sub > 1:  # a sub-column takes its column's pair
      pairs = jnp.repeat(pairs, part.sub, axis=0)
    pieces = part.cols * part.sub
    return jnp.pad(pairs, ((0, k * part.width - pieces), (0, 0))).reshape(k, part.width, 2)
  return jnp.broadcast_to(pairs, (k,) + pairs.shape)  # every owner: all columns


def worker_step(leaves, residual, layout: Layout, scale: str, *, decode: bool):
  """Worker quantization of the local gradient leaves with residuals ``residual``.

  Each leaf is quantized in its own order: ``v = g + r`` and ``r <- v -
  decode(v)`` are elementwise on the leaf, so a donated residual is
  updated in place; only the bits (and, for column scales, the column
  sums) are taken in the order of the owners' parts.

  Args:
    leaves: the gradient leaves (any floating dtype).
    residual: the worker residuals, one float32 array per leaf in the
      leaf's shape (``(1,)`` for a scalar), or ``None`` without error
      feedback.
    layout: the static layout.
    scale: ``"column"``, ``"l1"`` or ``"l2"``.
    decode: also return the decoded leaves (float32, leaf shapes).

  Returns:
    ``(bits, pairs, new_residual, decoded)``: the packed bits of every
    owner's chunk, ``(K, S/8)`` uint8, the pairs of its pieces, ``(K, M,
    2)`` float32, the new residuals (``None`` without error feedback; the
    old ones where ``v`` is not finite) and the decoded leaves (``None``
    unless ``decode``).
  """
  k = layout.k
  bits, pairs, done = [], [], {}
  for part in layout.parts:
    i = part.leaf
    v, b, p, d = _worker_leaf(leaves[i], None if residual is None else residual[i], part, scale)
    b = _pad_bits(b, k * part.size).reshape(k, part.size // 8)
    bits.append(((0, part.offset // 8), b))
    pairs.append(((0, part.pair_offset, 0), _sent_pairs(p, part, k)))
    done[i] = (v, d)
  bits = assemble(bits, jnp.zeros((k, layout.chunk // 8), jnp.uint8))
  pairs = assemble(pairs, jnp.zeros((k, layout.max_local, 2), jnp.float32))
  if residual is not None:
    # Non-finite v makes its segment's pairs non-finite: keep the residual.
    finite = all_finite(pairs)
    residual = tuple(
      jnp.where(finite, (done[i][0] - done[i][1]).reshape(r.shape), r) if i in done else r
      for i, r in enumerate(residual)
    )
  dec = None
  if decode:
    dec = [
      done[i][1].reshape(shape) if i in done else jnp.zeros(shape, jnp.float32) for i, shape in enumerate(layout.shapes)
    ]
  return bits, pairs, residual, dec


# Senders summed in unrolled terms, each over ceil(K / _TERMS) of them at once.
_TERMS = 8


def _sum_senders(decode, recv_bits, recv_pairs, part: Part, k: int) -> jax.Array:
  """``sum_j decode(bits_j, pairs_j)`` over the ``K`` senders of ``part``, in a program of fixed size.

  The senders are cut into ``g = min(K, 8)`` groups of ``t = ceil(K / g)``
  (the last group padded with zero senders, which decode to zeros):
  ``decode`` runs on a whole group at once, the groups are added in
  unrolled terms, and the ``t`` partial sums by a product with a vector of
  ones. For ``K <= 8`` that is the plain sum in sender order. Each group's
  bits are sliced from the received message itself, so the slice fuses
  into the decode.
  """
  lo, hi = part.offset // 8, (part.offset + part.size) // 8
  g = min(k, _TERMS)
  t = -(-k // g)
  acc = None
  for j in range(0, k, t):
    bits = recv_bits[j : j + t, lo:hi]
    pairs = recv_pairs[j : j + t, part.pair_offset : part.pair_offset + part.pairs]
    if bits.shape[0] < t:
      bits = jnp.pad(bits, ((0, t - bits.shape[0]), (0, 0)))
      pairs = jnp.pad(pairs, ((0, t - pairs.shape[0]), (0, 0), (0, 0)))
    d = decode(bits, pairs)
    acc = d if acc is None else acc + d
  if t == 1:
    return acc[0]
  return _sum_by_product(acc.reshape(t, -1), 0).reshape(acc.shape[1:])


def _decode_rows_of(bits: jax.Array, pairs: jax.Array, pieces: int, length: int) -> jax.Array:
  """``(..., pieces·length/8)`` packed bits as ``(..., pieces, length)``, piece ``i`` with ``pairs[..., i, :]``.

  Whole-byte pieces decode from a ``(..., pieces, length / 8, 8)`` view (each
  entry's shift its index along the last axis: XLA:CPU vectorizes it);
  others unpack the bits first.
  """
  lead = bits.shape[:-1]
  if length % 8 == 0:
    lanes = bit_lanes(bits.reshape(lead + (pieces, length // 8)))
    out = jnp.where(lanes, pairs[..., 0, None, None], pairs[..., 1, None, None])
    return out.reshape(lead + (pieces, length))
  b = unpack(bits).reshape(lead + (pieces, length))
  return jnp.where(b, pairs[..., 0:1], pairs[..., 1:2])


def _decode_columns_of(bits: jax.Array, pairs: jax.Array, rows: int, cols: int) -> jax.Array:
  """``(..., rows·cols/8)`` packed row-by-row bits as ``(..., rows, cols)``, column ``c`` with ``pairs[..., c, :]``."""
  lead = bits.shape[:-1]
  if cols % 8 == 0:
    lanes = bit_lanes(bits.reshape(lead + (rows, cols // 8)))
    hi = pairs[..., 0].reshape(lead + (1, cols // 8, 8))
    lo = pairs[..., 1].reshape(lead + (1, cols // 8, 8))
    return jnp.where(lanes, hi, lo).reshape(lead + (rows, cols))
  b = unpack(bits).reshape(lead + (rows, cols))
  return jnp.where(b, pairs[..., None, :, 0], pairs[..., None, :, 1])


def _decode_part(bits: jax.Array, pairs: jax.Array, part: Part) -> jax.Array:
  """Leading axes kept: one owner's part of leaf ``part.leaf`` decoded.

  ``(..., width, rows)`` for a part split by columns, ``(..., 1, width)`` for
  a one-segment leaf (one piece), ``(..., width, cols)`` otherwise.
  """
  if part.split == "columns":
    return _decode_rows_of(bits, pairs, part.width, part.piece_rows)
  if part.cols == 1:
    return _decode_rows_of(bits, pairs, 1, part.width)
  return _decode_columns_of(bits, pairs, part.width, part.cols)


def _requantize(u: jax.Array, part: Part, scale: str, zeros):
  """An owner's pieces of ``u`` re-quantized: ``(packed bits, pairs, decoded)``.

  ``zeros``: appended zeros at the end of each piece (``None`` for a part
  split by columns, whose appended columns are whole zero pieces).
  """
  if part.split == "columns" or part.cols == 1:  # one piece per row of u
    pieces, length = u.shape
    if length % 8 == 0:  # whole bytes: bits and sums in one pass
      packed, *sums = _bits_and_sums(u.reshape(pieces, length // 8, 8), 2, scale)
      sums = [_sum_by_product(s, 1) for s in sums]
      packed = packed.reshape(-1)
      if scale == "column":
        count = jnp.sum(lax.population_count(packed.reshape(pieces, -1)), axis=-1, dtype=jnp.int32).astype(jnp.float32)
        pairs = _column_pairs(sums[0], sums[1] * 0.5, count, length, 0 if zeros is None else zeros)
      else:
        pairs = _norm_pairs(sums[0], length if zeros is None else length - zeros, scale)
    else:
      bits = u >= 0
      packed = pack(bits.reshape(-1))
      if scale == "column":
        pairs = _column_pairs(*_column_sums(u), length, 0 if zeros is None else zeros)
      else:
        total = _lane_sum(jnp.abs(u) if scale == "l1" else jnp.square(u))
        pairs = _norm_pairs(total, length if zeros is None else length - zeros, scale)
    return packed, pairs, decode_rows(u >= 0, pairs)
  # A piece per column of u (rows of every column): reductions over the rows.
  rows = u.shape[0]
  nonneg = u >= 0
  count = jnp.sum(nonneg, axis=0, dtype=jnp.float32)
  pos, neg = _signed_sums_over_rows(u)
  pairs = _column_pairs(pos, neg, count, rows, zeros)
  return pack(nonneg.reshape(-1)), pairs, jnp.where(nonneg, pairs[:, 0], pairs[:, 1])


def owner_step(recv_bits, recv_pairs, e, owner, layout: Layout, scale: str):
  """The owner ``owner`` (traced) averages and re-quantizes its chunk.

  The same program for every owner: the owner's index only says how many
  rows of a part split by rows hold entries (the last owners' parts may end
  in appended zeros, which are left out of the pairs and of the residual).

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
  k = layout.k
  out_bits, out_pairs, out_e = [], [], []
  for part in layout.parts:
    decode = lambda b, p, part=part: _decode_part(b, p, part)
    u = _sum_senders(decode, recv_bits, recv_pairs, part, k) / k
    if e is not None:
      u = u + e[part.offset : part.offset + part.size].reshape(u.shape)
    zeros = valid = None
    if part.split == "rows":  # the owner's rows past the leaf's end hold no entries
      n = part.valid(owner)
      zeros = part.width - n
      if part.cols == 1:
        valid = lax.broadcasted_iota(jnp.int32, u.shape, 1) < n
      else:
        valid = lax.broadcasted_iota(jnp.int32, u.shape, 0) < n
      u = jnp.where(valid, u, 0.0)
    b, p, d = _requantize(u, part, scale, zeros)
    out_bits.append((part.offset // 8, b))
    out_pairs.append(p)
    if e is not None:
      r = u - d
      out_e.append((part, r if valid is None else jnp.where(valid, r, 0.0)))
  bits = assemble(out_bits, jnp.zeros((layout.chunk // 8,), jnp.uint8))
  pairs = jnp.concatenate(out_pairs)
  if e is None:
    return bits, pairs, None
  # Each part written over its own slice of e, or that slice kept where a
  # pair is not finite: read from and written to the buffer being updated,
  # so a donated e is updated in place, with no copy. A part of several rows
  # is computed in its own 2-D shape first: fused into the update of the
  # flat buffer, XLA:CPU indexes every element of its broadcasts from a flat
  # index, several times slower.
  finite = all_finite(pairs)
  new_e = e
  for part, r in out_e:
    r = jnp.where(finite, r, new_e[part.offset : part.offset + part.size].reshape(r.shape))
    if r.shape[0] > 1:
      r = lax.optimization_barrier(r)
    new_e = lax.dynamic_update_slice(new_e, r.reshape(-1), (part.offset,))
  return bits, pairs, new_e


def final_decode(all_bits, all_pairs, layout: Layout, dtypes) -> list[jax.Array]:
  """The leaves from the owners' gathered ``(K, S/8)`` bits and ``(K, M, 2)`` pairs."""
  k = layout.k
  out = []
  for i, dtype in enumerate(dtypes):
    shape = layout.shapes[i]
    part = layout.part(i)
    if part is None:  # an empty leaf: nothing crossed the wire
      out.append(jnp.zeros(shape, dtype))
      continue
    bits = all_bits[:, part.offset // 8 : (part.offset + part.size) // 8]
    pairs = all_pairs[:, part.pair_offset : part.pair_offset + part.pairs]
    rows, cols = part.rows, part.cols
    if part.split == "columns":  # column by column; the first pieces hold the leaf
      sub = part.sub  # (sub, cols) pairs: sub-column j of column c is rows j·rows/sub on
      pairs = pairs.reshape(k * part.width, 2)[: cols * sub].reshape(cols, sub, 2)
      pairs = jnp.moveaxis(pairs, 0, 1)
      word = layout.word_bits(i)
      if word:  # bits transposed as packed words, the floats written in place
        b = unpack_columns(bits.reshape(-1)[: rows * cols // 8], rows, cols, word)
        if sub == 1:
          x = jnp.where(b, pairs[0, :, 0], pairs[0, :, 1])
        else:
          b = b.reshape(sub, rows // sub, cols)
          x = jnp.where(b, pairs[:, None, :, 0], pairs[:, None, :, 1]).reshape(rows, cols)
      else:
        b = unpack(bits.reshape(-1))[: rows * cols].reshape(cols, sub, rows // sub)
        x = jnp.where(b, pairs[..., 0].T[:, :, None], pairs[..., 1].T[:, :, None])
        x = x.reshape(cols, rows).T
    else:  # owner o's rows, the leaf's own order: the first rows rows hold the leaf
      x = _decode_part(bits, pairs, part)
      x = x.reshape(-1)[:rows] if cols == 1 else x.reshape(k * part.width, cols)[:rows]
    out.append(x.reshape(shape).astype(dtype))
  return out
