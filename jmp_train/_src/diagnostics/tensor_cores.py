"""Matmuls and convolutions against the Tensor Core shape rules.

NVIDIA's Tensor Cores run a GEMM when both operands are 16-bit floats and its
dimensions are multiples of 8 (8-bit operands, FP8 included: multiples of
16). Products of :func:`jmp_train.fp8_dot_general` (FP8 operands, under
the ``fp8_product`` name scope) are held to FP8's rule.
:func:`tensor_core_report` lists every ``dot_general`` and convolution of a
function (read from its jaxpr, forward and backward) against that rule, with
the Amdahl bound on the speed-up, and :func:`pad_to_multiple` gives the size
to pad a dimension to.

References:
  NVIDIA, "Deep Learning Performance: Matrix Multiplication" user guide.
  https://docs.nvidia.com/deeplearning/performance/dl-performance-matrix-multiplication/
"""

from __future__ import annotations

import math
import dataclasses
from typing import Any, Callable, NamedTuple

import numpy as np

from jmp_train._src import tables
from jmp_train._src.fp8.products import FP8_SCOPE
from jmp_train._src.diagnostics import arguments
from jmp_train._src.diagnostics import jaxprs
from jmp_train._src.hyperparams import check_int

__all__ = ["MatmulEntry", "TensorCoreReport", "pad_to_multiple", "tensor_core_report"]


def _required_multiple(lhs: np.dtype, rhs: np.dtype) -> int | None:
  """8 for 16-bit float operands, 16 for 8-bit ones, None otherwise."""
  if lhs in arguments.HALF_DTYPES and rhs in arguments.HALF_DTYPES:
    return 8
  if lhs.itemsize == 1 and rhs.itemsize == 1:
    return 16  # int8, uint8, float8_*
  return None


class MatmulEntry(NamedTuple):
  """One ``dot_general`` or convolution found by :func:`tensor_core_report`.

  For a convolution, ``batch, m, n, k`` are its implicit GEMM per group
  (``batch`` = groups, ``m`` = images x output positions, ``n`` = output
  channels per group, ``k`` = input channels per group x kernel positions)
  and ``checked`` holds the channels per group, which the Tensor Core rule
  is about (a depthwise convolution has 1 and cannot use Tensor Cores).

  Attributes:
    phase: ``"forward"`` or ``"backward"``.
    op: ``"dot_general"`` or ``"conv"``.
    lhs_dtype: dtype of the left operand.
    rhs_dtype: dtype of the right operand.
    out_dtype: dtype of the result.
    lhs_shape: shape of the left operand.
    rhs_shape: shape of the right operand.
    batch: product of the batch dimensions (1 if none; groups for convs).
    m: product of the left operand's free dimensions.
    n: product of the right operand's free dimensions.
    k: product of the contracting dimensions.
    flops: ``2 * batch * m * n * k`` times the enclosing scans' lengths.
    required_multiple: 8 (16-bit operands), 16 (8-bit) or None (no Tensor
      Cores: float32 or mixed operands).
    checked: ``{name: size}`` of the dimensions the rule applies to.
    misaligned: names of the checked dimensions that are not multiples.
    repeats: how often it runs per call (scan lengths multiplied).
    where: enclosing calls and ``file:line (function)``.
    fp8: whether it is an FP8 product (:func:`jmp_train.fp8_dot_general`),
      held to the 8-bit rule.
  """

  phase: str
  op: str
  lhs_dtype: np.dtype
  rhs_dtype: np.dtype
  out_dtype: np.dtype
  lhs_shape: tuple[int, ...]
  rhs_shape: tuple[int, ...]
  batch: int
  m: int
  n: int
  k: int
  flops: int
  required_multiple: int | None
  checked: dict[str, int]
  misaligned: tuple[str, ...]
  repeats: int
  where: str
  fp8: bool = False

  @property
  def half_precision(self) -> bool:
    """Whether both operands are 16- or 8-bit (a Tensor Core type)."""
    return self.required_multiple is not None

  @property
  def tensor_core(self) -> bool:
    """Half-precision operands and every checked dimension aligned."""
    return self.half_precision and not self.misaligned


def _matmul_entry(eqn, phase: str, repeats: int, where: str) -> MatmulEntry | None:
  name = eqn.primitive.name
  if name not in ("dot_general", "conv_general_dilated"):
    return None
  lhs, rhs = (v.aval for v in eqn.invars[:2])
  out = eqn.outvars[0].aval
  lhs_dt, rhs_dt = np.dtype(lhs.dtype), np.dtype(rhs.dtype)
  multiple = _required_multiple(lhs_dt, rhs_dt)
  fp8 = FP8_SCOPE in str(eqn.source_info.name_stack)
  if fp8:
    multiple = 16
  if name == "dot_general":
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    batch = math.prod(lhs.shape[d] for d in lb)
    k = math.prod(lhs.shape[d] for d in lc)
    m = math.prod(s for d, s in enumerate(lhs.shape) if d not in (*lc, *lb))
    n = math.prod(s for d, s in enumerate(rhs.shape) if d not in (*rc, *rb))
    flops = 2 * batch * m * n * k * repeats
    checked = {"M": m, "N": n, "K": k}
    op = "dot_general"
  else:
    dn = eqn.params["dimension_numbers"]
    rhs_spec, out_spec = dn.rhs_spec, dn.out_spec
    batch = int(eqn.params.get("feature_group_count", 1)) * int(eqn.params.get("batch_group_count", 1))
    cin = int(rhs.shape[rhs_spec[1]])  # input channels per group
    cout = int(rhs.shape[rhs_spec[0]])
    kernel = math.prod(rhs.shape[d] for d in rhs_spec[2:])
    m = math.prod(out.shape[d] for d in out_spec[2:]) * int(out.shape[out_spec[0]])
    n, k = cout // batch, cin * kernel
    # Every output element is a dot product of length cin * kernel.
    flops = 2 * math.prod(out.shape) * cin * kernel * repeats
    checked = {"C_in": cin, "C_out": n}
    op = "conv"
  misaligned = tuple(d for d, s in checked.items() if multiple and s % multiple)
  return MatmulEntry(
    phase=phase,
    op=op,
    lhs_dtype=lhs_dt,
    rhs_dtype=rhs_dt,
    out_dtype=np.dtype(out.dtype),
    lhs_shape=tuple(int(s) for s in lhs.shape),
    rhs_shape=tuple(int(s) for s in rhs.shape),
    batch=batch,
    m=m,
    n=n,
    k=k,
    flops=int(flops),
    required_multiple=multiple,
    checked=checked,
    misaligned=misaligned,
    repeats=repeats,
    where=where,
    fp8=fp8,
  )


@dataclasses.dataclass(frozen=True)
class TensorCoreReport:
  r"""Matmuls and convolutions of a function, against the Tensor Core rules.

  ``str(report)`` is a table, one row per op, and a summary: total FLOPs,
  the share in half precision, the share eligible for Tensor Cores (half
  precision and aligned), and the speed-up bound

  .. math::
    \frac{1}{x + (1 - x) / y}

  with :math:`x` the share of matmul FLOPs *not* on Tensor Cores and
  :math:`y` ``tensor_core_speedup`` (Amdahl's law). It treats the
  FLOP share as the time share and ignores non-matmul work, so it is
  optimistic: elementwise ops are memory bound and do not speed up by y.
  float32 matmuls count as off Tensor Cores, although Ampere and later GPUs
  may run them as TF32 on Tensor Cores at JAX's default matmul precision.

  Attributes:
    entries: the :class:`MatmulEntry` rows, forward pass first.
    tensor_core_speedup: the ``y`` of the bound.
  """

  entries: tuple[MatmulEntry, ...]
  tensor_core_speedup: float

  @property
  def total_flops(self) -> int:
    return sum(e.flops for e in self.entries)

  @property
  def half_precision_flops(self) -> int:
    return sum(e.flops for e in self.entries if e.half_precision)

  @property
  def tensor_core_flops(self) -> int:
    return sum(e.flops for e in self.entries if e.tensor_core)

  @property
  def half_precision_fraction(self) -> float:
    """Share of matmul FLOPs with 16- or 8-bit operands."""
    return self.half_precision_flops / self.total_flops if self.total_flops else 0.0

  @property
  def tensor_core_fraction(self) -> float:
    """Share of matmul FLOPs in half precision with aligned dimensions."""
    return self.tensor_core_flops / self.total_flops if self.total_flops else 0.0

  @property
  def speedup_bound(self) -> float:
    """``1 / (x + (1 - x) / y)`` with ``x = 1 - tensor_core_fraction``."""
    x = 1.0 - self.tensor_core_fraction
    return 1.0 / (x + (1.0 - x) / self.tensor_core_speedup)

  @property
  def misaligned(self) -> tuple[MatmulEntry, ...]:
    """Half-precision ops that lose the Tensor Core path to a dimension."""
    return tuple(e for e in self.entries if e.half_precision and e.misaligned)

  @property
  def float32(self) -> tuple[MatmulEntry, ...]:
    """Ops whose operands are not both half precision."""
    return tuple(e for e in self.entries if not e.half_precision)

  def to_rows(self) -> list[dict[str, Any]]:
    """One dict per op, for tables and dataframes."""
    rows = []
    for e in self.entries:
      rows.append(
        {
          "phase": e.phase,
          "op": e.op,
          "dtypes": ("fp8 (" if e.fp8 else "")
          + f"{e.lhs_dtype.name}x{e.rhs_dtype.name}->{e.out_dtype.name}"
          + (")" if e.fp8 else ""),
          "batch": e.batch,
          "M": e.m,
          "N": e.n,
          "K": e.k,
          "checked": ",".join(f"{k}={v}" for k, v in e.checked.items()),
          "GFLOP": e.flops / 1e9,
          "tensor_core": (
            "yes"
            if e.tensor_core
            else "no: float32"
            if not e.half_precision
            else f"no: {','.join(e.misaligned)} % {e.required_multiple}"
          ),
          "where": e.where,
        }
      )
    return rows

  def summary(self) -> str:
    return (
      f"{len(self.entries)} matmul/conv ops, {self.total_flops / 1e9:.4g} GFLOP; "
      f"half precision {self.half_precision_fraction:.1%}, "
      f"Tensor Core eligible {self.tensor_core_fraction:.1%}; "
      f"speed-up bound 1/(x+(1-x)/y) = {self.speedup_bound:.2f}x "
      f"(x = {1 - self.tensor_core_fraction:.3f}, y = {self.tensor_core_speedup:g})"
    )

  def __str__(self) -> str:
    return tables.format_table(self.to_rows()) + "\n" + self.summary()

  def assert_aligned(self) -> None:
    """Raises AssertionError listing half-precision ops with misaligned dims."""
    bad = self.misaligned
    if bad:
      rows = [r for r, e in zip(self.to_rows(), self.entries) if e in bad]
      raise AssertionError(
        f"{len(bad)} half-precision matmul/conv op(s) with dimensions that are "
        "not multiples of 8 (16-bit) / 16 (8-bit); pad them (see "
        "pad_to_multiple):\n" + tables.format_table(rows)
      )


def tensor_core_report(
  fn: Callable[..., Any],
  *args: Any,
  backward: bool = False,
  tensor_core_speedup: float = 8.0,
) -> TensorCoreReport:
  r"""Lists every matmul and convolution of ``fn`` against the Tensor Core rules.

  Traces ``jax.make_jaxpr(fn)(*args)`` (nothing runs; ``args`` may be
  ``jax.ShapeDtypeStruct``) and walks it, sub-jaxprs included (jit, scan,
  cond, while, remat, custom_jvp/vjp, shard_map). For each ``dot_general``:
  operand dtypes, batch, M (left free dims), N (right free dims), K
  (contracting dims), FLOPs :math:`2BMNK`; for each ``conv_general_dilated``
  the channels and its implicit GEMM. Tensor Cores need 16-bit operands
  with M, N, K (channels for convs) multiples of 8, or 8-bit operands with
  multiples of 16 (NVIDIA's rule). With ``backward=True`` the backward
  pass is traced too (the pullback with respect to every floating argument
  leaf), where NVIDIA's table of the three GEMMs of a layer applies: the
  weight gradient's K is the batch size.

  Args:
    fn: the function, e.g. ``lambda p, x: model.apply(p, x)`` or a loss.
      Bind keyword arguments with ``functools.partial``. Or a
      :class:`jmp_train.TrainStep`, read as compiled (forward, backward and
      update: one phase, ``"step"``), with ``args`` its state and batch.
    *args: its positional arguments (arrays or ``jax.ShapeDtypeStruct``).
    backward: also trace the backward pass (a train step holds it already).
    tensor_core_speedup: ``y`` of the speed-up bound, the Tensor Core ops'
      own speed-up (8 is V100's FP16 vs FP32 peak ratio).

  Returns:
    A :class:`TensorCoreReport`; ``print(report)`` shows the table.

  Raises:
    ValueError: if ``fn`` is not callable or ``tensor_core_speedup <= 0``.

  Examples:
    >>> x = jnp.ones((64, 1000), jnp.float16)
    >>> w = jnp.ones((1000, 30), jnp.float16)
    >>> report = tensor_core_report(jnp.dot, x, w)
    >>> report.entries[0].misaligned
    ('N',)
    >>> w = jnp.ones((1000, pad_to_multiple(30)), jnp.float16)
    >>> tensor_core_report(jnp.dot, x, w).tensor_core_fraction
    1.0

  References:
    NVIDIA, "Deep Learning Performance: Matrix Multiplication" and "Mixed
    Precision Training" user guides.
    https://docs.nvidia.com/deeplearning/performance/dl-performance-matrix-multiplication/
  """
  arguments.check_callable(fn, "tensor_core_report")
  arguments.check_positive("tensor_core_speedup", tensor_core_speedup)
  entries = []
  for phase, jaxpr in jaxprs.trace(fn, args, bool(backward)):
    for eqn, repeats, where in jaxprs.walk(jaxpr):
      entry = _matmul_entry(eqn, phase, repeats, where)
      if entry is not None:
        entries.append(entry)
  return TensorCoreReport(entries=tuple(entries), tensor_core_speedup=float(tensor_core_speedup))


# ---------------------------------------------------------------------------
# Precision audit.


def pad_to_multiple(n: int, multiple: int = 8) -> int:
  """The smallest multiple of ``multiple`` that is ``>= n``.

  The recipe for Tensor Cores (NVIDIA's rule: 16-bit GEMM dimensions and conv
  channels multiples of 8, 8-bit ones of 16):

  1. Find misaligned dimensions with :func:`tensor_core_report` (with
     ``backward=True``: the weight gradient's K is the batch size).
  2. Pad sizes you choose: hidden and MLP widths, heads x head size, conv
     channels (an RGB input's 3 channels can be zero-padded to 8: zero
     inputs change nothing), and the batch size.
  3. Pad the vocabulary: ``vocab = pad_to_multiple(50257, 64)`` (50304,
     GPT-2's padded size; 64 also suits wider tiles). Extra embedding rows
     are never looked up; give the extra logits ``-inf`` (or a large
     negative) before the softmax, or never use them as labels, so that the
     loss is unchanged.
  4. Check again: ``tensor_core_report(...).assert_aligned()``.

  Args:
    n: a non-negative int.
    multiple: a positive int (8 for float16/bfloat16, 16 for int8/float8).

  Returns:
    ``ceil(n / multiple) * multiple``.

  Raises:
    ValueError: for a negative or non-int ``n`` or a non-positive ``multiple``.

  Examples:
    >>> pad_to_multiple(50257, 64), pad_to_multiple(1000), pad_to_multiple(3, 16)
    (50304, 1000, 16)
  """
  n, multiple = check_int(n, "n", 0), check_int(multiple, "multiple", 1)
  return -(-n // multiple) * multiple
