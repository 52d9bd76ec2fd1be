"""Packed sign bits for the 1-bit codec: bytes, column words, their transposes.

Bits are packed eight to a ``uint8`` with shifts over a ``(-1, 8)`` view
(``bitorder="little"``: element ``8i + b`` is bit ``b`` of byte ``i``). A
column-scale leaf's bits travel in column-by-column order; they are packed
from the leaf's own ``(rows, columns)`` order as 32-, 16- or 8-bit words per
column, and only the packed words are transposed (a transpose of a float
buffer runs several times slower than a copy on XLA:CPU).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

__all__ = [
  "pack",
  "unpack",
  "pack_columns",
  "unpack_columns",
  "bit_lanes",
  "words_to_bytes",
  "wider_words",
  "SHIFTS",
  "WORDS",
]

SHIFTS = tuple(range(8))


def pack(bits: jax.Array) -> jax.Array:
  """Packs a boolean ``(..., 8n)`` array to ``uint8`` ``(..., n)``, little bit order."""
  b = bits.reshape(bits.shape[:-1] + (-1, 8)).astype(jnp.uint8)
  shifts = jnp.asarray(SHIFTS, jnp.uint8)
  return jnp.sum(b << shifts, axis=-1, dtype=jnp.uint8)


def bit_lanes(packed: jax.Array) -> jax.Array:
  """``uint8`` ``(..., n)`` to boolean ``(..., n, 8)``: bit ``b`` of each byte in lane ``b``."""
  return ((packed[..., None] >> jnp.asarray(SHIFTS, jnp.uint8)) & jnp.uint8(1)).astype(jnp.bool_)


def unpack(packed: jax.Array) -> jax.Array:
  """Inverse of :func:`pack`: ``uint8`` ``(..., n)`` to boolean ``(..., 8n)``."""
  return bit_lanes(packed).reshape(packed.shape[:-1] + (-1,))


WORDS = {32: jnp.uint32, 16: jnp.uint16, 8: jnp.uint8}


def _column_words(bits: jax.Array, word: int) -> jax.Array:
  """``(rows, cols)`` bools as ``(rows / word, cols)`` words: row ``word q + j`` in bit ``j``."""
  r, c = bits.shape
  dtype = WORDS[word]
  shifts = jnp.arange(word, dtype=dtype)[None, :, None]
  return jnp.sum(bits.reshape(r // word, word, c).astype(dtype) << shifts, axis=1, dtype=dtype)


def words_to_bytes(words: jax.Array) -> jax.Array:
  """The transposed words of :func:`_column_words` as little-endian bytes."""
  if words.dtype == jnp.uint8:
    return words.T.reshape(-1)
  return lax.bitcast_convert_type(words.T, jnp.uint8).reshape(-1)


def pack_columns(bits: jax.Array, word: int = 32) -> jax.Array:
  """Packs a boolean ``(rows, columns)`` matrix in column-by-column order.

  Equals ``pack(bits.T.reshape(-1))`` for ``rows`` a multiple of ``word``
  (32, 16 or 8), with no transpose of the bits: ``word`` rows are packed
  into one unsigned word per column, the ``(rows / word, columns)`` words
  are transposed and read as little-endian bytes.
  """
  return words_to_bytes(_column_words(bits, word))


def unpack_columns(packed: jax.Array, rows: int, cols: int, word: int = 32) -> jax.Array:
  """Inverse of :func:`pack_columns`: ``rows * cols / 8`` bytes to ``(rows, columns)`` bool.

  The bytes are transposed before they are read as words, so the words come
  out as ``(rows / word, columns)`` and each row of bits reads a contiguous
  row of words (XLA:CPU fuses a transpose of the words into their reader,
  which then reads one word per column several times slower).
  """
  dtype = WORDS[word]
  if word == 8:
    words = packed.reshape(cols, rows // 8).T
  else:
    by_row = packed.reshape(cols, rows // word, word // 8).transpose(1, 0, 2)
    words = lax.bitcast_convert_type(by_row, dtype)
  shifts = jnp.arange(word, dtype=dtype)[None, :, None]
  b = (words[:, None, :] >> shifts) & jnp.asarray(1, dtype)
  return b.astype(jnp.bool_).reshape(rows, cols)


def wider_words(words: jax.Array) -> jax.Array:
  """``uint8`` ``(blocks, columns)`` as ``uint32`` (or ``uint16``) ``(blocks / 4, columns)``.

  Byte ``j`` of word ``q`` is block ``4q + j`` (``2q + j``), so the words
  read as little-endian bytes are the blocks in order. XLA:CPU transposes
  element by element: the transpose in :func:`words_to_bytes` then moves
  a quarter (a half) as many elements. It pays for wide matrices only
  (the codec's ``_WIDEN_FROM_COLUMNS`` columns on): at 2048 and 4096 columns (rows of
  bytes 2 and 4 KiB apart) the byte transpose took 1.5 to 2.5 times as
  long as the words'; on narrower ones the extra pass and the words' split
  back into bytes cost more than the plain byte transpose.
  """
  n = next(n for n in (4, 2, 1) if words.shape[0] % n == 0)
  if n == 1:
    return words
  dtype = WORDS[8 * n]
  shifts = (8 * jnp.arange(n, dtype=dtype))[:, None]
  b = words.reshape(-1, n, words.shape[1]).astype(dtype) << shifts
  return lax.reduce(b, jnp.zeros((), dtype), lax.add, (1,))
