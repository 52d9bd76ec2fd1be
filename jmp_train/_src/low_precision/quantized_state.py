"""Blockwise 8-bit quantization of arrays, for optimizer state.

An array is cut into blocks of ``block_size`` consecutive elements (in
row-major order, the last block padded with zeros). Each block keeps its
absolute maximum :math:`a_b` in float32 and each element :math:`x` one byte,
the index :math:`q` of the entry of a 256-entry code map :math:`C \\subset
[-1, 1]` nearest to :math:`x / a_b`:

.. math::

  q = \\arg\\min_k |C_k - x / a_b|, \\qquad \\hat x = C_q\\, a_b

(Dettmers et al., 2022; torchao's low-bit optimizers use the same layout with
blocks of 256). Two code maps, each signed (for a first moment) or unsigned
(for a second moment, which is non-negative and spends the sign bit on
magnitude):

* ``"dynamic"``: the dynamic (exponent) code of bitsandbytes. An entry is
  :math:`10^{-e} f` for a decimal exponent :math:`e \\in \\{0, ..., 6\\}`
  and a fraction :math:`f \\in [0.1, 1]` whose resolution doubles with each
  exponent step towards 1; with 0 and 1 added (so the signed code's most
  negative entry is -0.993, not -1). Relative error is small over seven
  decades below the block maximum.
* ``"linear"``: evenly spaced entries (:math:`k/127` signed, :math:`k/255`
  unsigned): absolute error at most :math:`a_b/254` or :math:`a_b/510`
  (:math:`a_b/255` for positive values lifted off zero, below), but small
  values keep no significant digits.

With ``unsigned`` codes a positive value never rounds to zero (it takes the
smallest positive entry instead): a second moment rounded to zero would turn
Adam's :math:`m / (\\sqrt{v} + \\epsilon)` into :math:`m / \\epsilon`.

The codes are stored in the array's own shape (``uint8``) and the scales as
a ``(num_blocks,)`` float32 vector, so a quantized array's shapes and dtypes
depend only on the original's shape: they stay the same across steps, shard
or replicate like the original, and checkpoint as two plain arrays.
Non-finite inputs make their block's scale non-finite.

References:
  Dettmers, Lewis, Shleifer and Zettlemoyer, "8-bit Optimizers via Block-wise
  Quantization", ICLR 2022, https://arxiv.org/abs/2110.02861.
"""

from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jmp_train._src.hyperparams import check_int

__all__ = [
  "CODES",
  "QuantizedArray",
  "code_map",
  "dequantize",
  "quantize",
  "zeros",
]

CODES = ("dynamic", "linear")


class QuantizedArray(NamedTuple):
  r"""An array stored as blockwise 8-bit codes: the 8-bit moments' storage.

  The flattened array is cut into blocks of ``block_size`` consecutive
  elements; element :math:`x` of block :math:`b` is stored as the index
  :math:`q` of the entry of a 256-entry code map :math:`C \subset [-1, 1]`
  nearest to :math:`x / a_b`, and read back as :math:`C_q\, a_b`, with
  :math:`a_b` the block's absolute maximum. The shapes and dtypes depend
  only on the original array's shape, so they stay the same across steps
  and checkpoint as two plain arrays.

  Attributes:
    codes: ``uint8`` indices into the code map, in the original array's shape.
    absmax: ``float32`` absolute maximum of each block, shape
      ``(ceil(size / block_size),)``.

  Examples:
    >>> import jmp_train
    >>> tx = jmp_train.sgd_8bit(0.1, min_8bit_size=0)
    >>> q = tx.init({"w": jnp.zeros((64, 64))})[0].trace["w"]
    >>> q.codes.dtype, q.shape, q.absmax.shape, q.nbytes  # 4096 codes + 16 scales
    (dtype('uint8'), (64, 64), (16,), 4160)
  """

  codes: jax.Array
  absmax: jax.Array

  @property
  def shape(self) -> tuple[int, ...]:
    """The original array's shape (that of ``codes``)."""
    return self.codes.shape

  @property
  def size(self) -> int:
    """The original array's number of elements."""
    return self.codes.size

  @property
  def nbytes(self) -> int:
    """Bytes stored: the codes and the block scales."""
    return self.codes.nbytes + self.absmax.nbytes


def _dynamic_map(signed: bool) -> np.ndarray:
  """bitsandbytes' ``create_dynamic_map(signed, max_exponent_bits=7, total_bits=8)``."""
  exponent_bits = 7
  data = []
  for i in range(exponent_bits):
    items = 2**i + 1 if signed else 2 ** (i + 1) + 1
    bounds = np.linspace(0.1, 1.0, items)
    means = (bounds[:-1] + bounds[1:]) / 2.0
    magnitude = 10.0 ** (-(exponent_bits - 1) + i) * means
    data.extend(magnitude)
    if signed:
      data.extend(-magnitude)
  data += [0.0, 1.0]
  assert len(data) == 256, len(data)
  return np.sort(np.asarray(data, np.float32))


def _linear_map(signed: bool) -> np.ndarray:
  if signed:  # k/127 for |k| <= 127, -1 twice (256 entries, 0 exact).
    values = np.concatenate([[-1.0], np.arange(-127, 128) / 127.0])
  else:
    values = np.arange(256) / 255.0
  return np.asarray(values, np.float32)


def _check_code(code: str) -> None:
  if code not in CODES:
    raise ValueError(f"code must be one of {CODES}; got {code!r}.")


@functools.cache
def _code_map(code: str, signed: bool) -> np.ndarray:
  _check_code(code)
  table = _dynamic_map(signed) if code == "dynamic" else _linear_map(signed)
  table.setflags(write=False)
  return table


def code_map(code: str = "dynamic", signed: bool = True) -> np.ndarray:
  """The 256 sorted float32 values an 8-bit code stands for (times the block's absmax).

  Args:
    code: ``"dynamic"`` or ``"linear"``.
    signed: values in ``[-1, 1]`` (a first moment) or ``[0, 1]`` (a second
      moment).

  Returns:
    A read-only NumPy array of shape ``(256,)``, sorted, containing 0 and 1.

  Raises:
    ValueError: if ``code`` is not one of ``"dynamic"``, ``"linear"``.

  Examples:
    >>> from jmp_train._src.low_precision.quantized_state import code_map
    >>> table = code_map("dynamic", signed=False)
    >>> table.shape, float(table[0]), float(table[-1])
    ((256,), 0.0, 1.0)
  """
  return _code_map(code, bool(signed))


def _check_block_size(block_size: Any) -> int:
  return check_int(block_size, "block_size", 1)


def _blocks(x: jax.Array, block_size: int) -> jax.Array:
  """``x`` flattened, zero-padded to whole blocks, shape ``(num_blocks, block_size)``."""
  flat = jnp.ravel(x)
  num_blocks = max(1, math.ceil(flat.size / block_size))
  flat = jnp.pad(flat, (0, num_blocks * block_size - flat.size))
  return flat.reshape(num_blocks, block_size)


def _stochastic_codes(normed: jax.Array, table: jax.Array, key: jax.Array) -> jax.Array:
  """Rounds up or down to the neighbouring entries, with probability by distance."""
  lo = jnp.clip(jnp.searchsorted(table, normed, side="right") - 1, 0, table.size - 2)
  below, above = table[lo], table[lo + 1]
  gap = above - below
  p_up = jnp.where(gap > 0, (normed - below) / jnp.where(gap > 0, gap, 1.0), 0.0)
  return lo + (jax.random.uniform(key, normed.shape) < p_up)


def quantize(
  x: jax.Array,
  *,
  block_size: int = 256,
  code: str = "dynamic",
  signed: bool = True,
  key: jax.Array | None = None,
) -> QuantizedArray:
  """Blockwise 8-bit quantization of ``x`` (rounding to the nearest code).

  Args:
    x: a floating array (computed in float32).
    block_size: elements per block (each block has one float32 scale).
    code: the code map, ``"dynamic"`` or ``"linear"`` (see :func:`code_map`).
    signed: use the signed code (values of either sign) or the unsigned one
      (``x >= 0``; negative values round to 0). Unsigned codes never round a
      positive value to zero.

  Returns:
    A :class:`QuantizedArray` with ``uint8`` codes in ``x``'s shape and one
    float32 scale per block.

  Raises:
    ValueError: for a bad ``block_size`` or ``code``.

  Examples:
    >>> import jax.numpy as jnp
    >>> from jmp_train._src.low_precision.quantized_state import quantize, dequantize
    >>> x = jnp.linspace(-1.0, 1.0, 1000)
    >>> q = quantize(x, block_size=256)
    >>> q.codes.dtype, q.codes.shape, q.absmax.shape
    (dtype('uint8'), (1000,), (4,))
    >>> bool(jnp.max(jnp.abs(dequantize(q, block_size=256) - x)) < 0.01)
    True
  """
  block_size = _check_block_size(block_size)
  _check_code(code)
  return _quantize(x, key, block_size=block_size, code=code, signed=bool(signed))


# One compiled program per call outside ``jit`` (eager use, e.g. in a notebook,
# would otherwise dispatch every operation on its own); inlined inside ``jit``.
@functools.partial(jax.jit, static_argnames=("block_size", "code", "signed"))
def _quantize(x, key, *, block_size: int, code: str, signed: bool) -> QuantizedArray:
  table = jnp.asarray(code_map(code, signed))
  blocks = _blocks(jnp.asarray(x, jnp.float32), block_size)
  absmax = jnp.max(jnp.abs(blocks), axis=1)
  normed = blocks / jnp.where(absmax > 0, absmax, 1.0)[:, None]
  # Nearest entry: the number of midpoints strictly below the value.
  if key is None:
    midpoints = (table[1:] + table[:-1]) / 2
    codes = jnp.searchsorted(midpoints, normed, side="left").astype(jnp.uint8)
  else:
    codes = _stochastic_codes(normed, table, key).astype(jnp.uint8)
  if not signed:
    zero = int(np.argmin(np.abs(code_map(code, signed))))
    codes = jnp.where((normed > 0) & (codes == zero), zero + 1, codes).astype(jnp.uint8)
  codes = codes.reshape(-1)[: x.size].reshape(jnp.shape(x))
  return QuantizedArray(codes, absmax)


def zeros(
  shape: tuple[int, ...], *, block_size: int = 256, code: str = "dynamic", signed: bool = True
) -> QuantizedArray:
  """The :class:`QuantizedArray` of ``jnp.zeros(shape)``, built without quantizing.

  Args:
    shape: the array's shape.
    block_size: elements per block.
    code: the code map.
    signed: signed or unsigned code.

  Returns:
    Codes of the code map's zero entry and zero scales: what
    :func:`quantize` returns for zeros.

  Raises:
    ValueError: for a bad ``block_size`` or ``code``.

  Examples:
    >>> from jmp_train._src.low_precision.quantized_state import quantize, zeros
    >>> import jax.numpy as jnp
    >>> z = zeros((3, 100), block_size=128)
    >>> bool((z.codes == quantize(jnp.zeros((3, 100)), block_size=128).codes).all())
    True
  """
  block_size = _check_block_size(block_size)
  zero = int(np.argmin(np.abs(code_map(code, signed))))
  num_blocks = max(1, math.ceil(math.prod(shape) / block_size))
  return QuantizedArray(jnp.full(shape, zero, jnp.uint8), jnp.zeros((num_blocks,), jnp.float32))


def dequantize(q: QuantizedArray, *, block_size: int = 256, code: str = "dynamic", signed: bool = True) -> jax.Array:
  """The float32 values of a :class:`QuantizedArray` (``code_map[codes] * absmax``).

  Args:
    q: the quantized array.
    block_size: the block size it was quantized with.
    code: the code map it was quantized with.
    signed: whether it was quantized with the signed code.

  Returns:
    A float32 array of ``q.codes``' shape.

  Raises:
    ValueError: for a bad ``block_size`` or ``code``, or if ``q.absmax`` does
      not have one entry per block.

  Examples:
    >>> import jax.numpy as jnp
    >>> from jmp_train._src.low_precision.quantized_state import quantize, dequantize
    >>> v = jnp.array([0.0, 1e-6, 0.5, 4.0])
    >>> [float(f"{a:.3g}") for a in dequantize(quantize(v, signed=False), signed=False)]
    [0.0, 1.3e-06, 0.498, 4.0]
  """
  block_size = _check_block_size(block_size)
  num_blocks = max(1, math.ceil(q.codes.size / block_size))
  if q.absmax.shape != (num_blocks,):
    raise ValueError(
      f"absmax has shape {q.absmax.shape}; codes of shape {q.codes.shape} in "
      f"blocks of {block_size} need ({num_blocks},). Was it quantized with "
      "another block_size?"
    )
  _check_code(code)
  return _dequantize(q, block_size=block_size, code=code, signed=bool(signed))


@functools.partial(jax.jit, static_argnames=("block_size", "code", "signed"))
def _dequantize(q: QuantizedArray, *, block_size: int, code: str, signed: bool) -> jax.Array:
  table = jnp.asarray(code_map(code, signed))
  values = table[_blocks(q.codes, block_size).astype(jnp.int32)] * q.absmax[:, None]
  return values.reshape(-1)[: q.codes.size].reshape(q.codes.shape)
