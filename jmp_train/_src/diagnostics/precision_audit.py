"""An audit of the ops a mixed-precision function runs in half precision.

:func:`precision_audit` reads a function's jaxpr (forward and, if asked,
backward) and lists the ops that the automatic mixed precision lists keep
in float32 but that run in float16/bfloat16 (exp, log, large sums, the
loss), and the matmuls left in float32. The report's ``assert_clean`` makes
it a test assertion.

References:
  Micikevicius et al., "Mixed Precision Training", ICLR 2018.
  https://arxiv.org/abs/1710.03740
"""

from __future__ import annotations

import math
import dataclasses
from typing import Any, Callable, Iterable, NamedTuple, Sequence

import numpy as np

from jmp_train._src import tables
from jmp_train._src.diagnostics import arguments
from jmp_train._src.diagnostics import jaxprs
from jmp_train._src.dtypes import is_floating_dtype
from jmp_train._src.hyperparams import check_int

__all__ = [
  "ISSUE_KINDS",
  "PrecisionIssue",
  "PrecisionReport",
  "precision_audit",
]

# Ops that AMP lists keep in float32 (NVIDIA apex, torch.autocast): their
# results lose range or precision in 16 bits.
_FLOAT32_OPS = frozenset(
  {
    "exp",
    "exp2",
    "expm1",
    "log",
    "log1p",
    "pow",
    "rsqrt",
    "tan",
    "sinh",
    "cosh",
    "asin",
    "acos",
    "erf_inv",
    "lgamma",
    "digamma",
  }
)
# Accumulating reductions: a 16-bit sum stops growing once the total is
# 2**8 (bfloat16) or 2**11 (float16) times the addends.
_REDUCTIONS = frozenset({"reduce_sum", "reduce_prod", "cumsum", "cumprod", "cumlogsumexp"})
# Scatters that accumulate: the backward pass of a gather (an embedding
# lookup) adds one row per index into the table.
_SCATTER_SUMS = frozenset({"scatter-add", "scatter_add", "scatter-mul", "scatter_mul"})
# The primitives of cuDNN's fused attention (jax._src.cudnn): half-precision
# operands, softmax statistics (max and log-sum-exp) in float32.
_FUSED_ATTENTION = frozenset(
  {
    "dot_product_attention_fwd",
    "dot_product_attention_fwd_wrapper",
    "dot_product_attention_bwd",
    "dot_product_attention_bwd_wrapper",
  }
)

ISSUE_KINDS = ("half_op", "half_reduction", "half_output", "float32_matmul")


class PrecisionIssue(NamedTuple):
  """One finding of :func:`precision_audit` (identical ops merged).

  Attributes:
    kind: ``"half_op"`` (exp, log, ... in half precision), ``"half_reduction"``
      (a large sum in half precision), ``"half_output"`` (an output, e.g. the
      loss, in half precision) or ``"float32_matmul"``.
    phase: ``"forward"`` or ``"backward"``.
    op: the primitive, e.g. ``"exp"``, or ``"output[0]"``.
    dtype: the dtype it runs in.
    shape: the operand's shape.
    where: enclosing calls (``log_softmax``, ``scan``, ...) and the source line.
    count: how many identical ops were merged into this row.
    message: what to do about it.
  """

  kind: str
  phase: str
  op: str
  dtype: np.dtype
  shape: tuple[int, ...]
  where: str
  count: int
  message: str


@dataclasses.dataclass(frozen=True)
class PrecisionReport:
  """The result of :func:`precision_audit`.

  Attributes:
    issues: the :class:`PrecisionIssue` rows.
    half_ops: number of equations computing in float16/bfloat16.
    float32_ops: number of equations computing in float32 or wider (fused
      attention calls included: their softmax runs in float32).
    fused_attention: calls of a fused attention kernel (cuDNN's, through
      ``jax.nn.dot_product_attention``), forward and backward, each
      counted as often as it runs; their softmax statistics are float32.
  """

  issues: tuple[PrecisionIssue, ...]
  half_ops: int
  float32_ops: int
  fused_attention: int = 0

  @property
  def ok(self) -> bool:
    return not self.issues

  def of_kind(self, *kinds: str) -> tuple[PrecisionIssue, ...]:
    """The issues whose kind is one of ``kinds``."""
    _check_kinds(kinds)
    return tuple(i for i in self.issues if i.kind in kinds)

  def to_rows(self) -> list[dict[str, Any]]:
    return [
      {
        "kind": i.kind,
        "phase": i.phase,
        "op": i.op,
        "dtype": i.dtype.name,
        "shape": i.shape,
        "count": i.count,
        "where": i.where,
        "fix": i.message,
      }
      for i in self.issues
    ]

  def __str__(self) -> str:
    head = (
      f"precision audit: {len(self.issues)} issue(s); {self.half_ops} ops in "
      f"half precision, {self.float32_ops} in float32"
    )
    return head + ("\n" + tables.format_table(self.to_rows()) if self.issues else "")

  def assert_clean(self, ignore: Sequence[str] = ()) -> None:
    """Raises AssertionError with the table of issues (except ``ignore`` kinds).

    Args:
      ignore: issue kinds to tolerate, from ``ISSUE_KINDS``.

    Raises:
      AssertionError: listing the offending ops.
      ValueError: for an unknown kind in ``ignore``.
    """
    if isinstance(ignore, str):
      ignore = (ignore,)
    _check_kinds(ignore)
    bad = [i for i in self.issues if i.kind not in ignore]
    if bad:
      rows = [r for r, i in zip(self.to_rows(), self.issues) if i.kind not in ignore]
      raise AssertionError(f"precision audit found {len(bad)} issue(s):\n" + tables.format_table(rows))


def _check_kinds(kinds: Iterable[str]) -> None:
  for k in kinds:
    if k not in ISSUE_KINDS:
      raise ValueError(f"Unknown issue kind {k!r}; valid kinds: {', '.join(ISSUE_KINDS)}.")


def precision_audit(
  fn: Callable[..., Any],
  *args: Any,
  backward: bool = False,
  reduction_threshold: int = 1024,
) -> PrecisionReport:
  """Finds ops in half precision that should not be, and float32 matmuls.

  Walks the jaxpr of ``fn(*args)`` (and, with ``backward=True``, of its
  pullback) like :func:`tensor_core_report`, and reports, after the AMP
  allow/deny lists (Micikevicius et al. 2018, NVIDIA apex, ``torch.autocast``):

  * ``half_op``: exp, log, log1p, expm1, pow, rsqrt, sinh, cosh, tan, ...
    on float16/bfloat16 operands; softmax, log-softmax and logsumexp show up
    as their exp and log pieces (``where`` names the enclosing
    ``log_softmax`` call);
  * ``half_reduction``: sums, products and cumulative sums in half
    precision over ``reduction_threshold`` elements or more (a float16
    sum stops growing once the total is 2**11 times the addends, a bfloat16
    one at 2**8), and scatter-adds of ``reduction_threshold`` or more
    rows in half precision (the backward pass of a lookup in a
    half-precision table, e.g. Flax's ``Embed(dtype=bfloat16)``);
  * ``half_output``: floating outputs of ``fn`` in half precision: the loss
    (a scalar) or a model output that the loss will consume;
  * ``float32_matmul``: ``dot_general`` and convolutions with a float32 (or
    wider) operand: they do not use Tensor Cores.

  Fused attention (cuDNN's kernel, the ``dot_product_attention_fwd``/``_bwd``
  primitives that ``jax.nn.dot_product_attention(..., implementation="cudnn")``
  leaves in the jaxpr) takes half-precision operands but keeps its softmax
  statistics in float32: it is not an issue, and
  :attr:`PrecisionReport.fused_attention` counts it. The XLA implementation
  of the same function shows its float32 ``exp`` and sums as usual.

  Args:
    fn: the function, e.g. the loss function or ``model.apply``; or a
      :class:`jmp_train.TrainStep`, audited as compiled (forward, backward
      and update: one phase, ``"step"``), with ``args`` its state and batch.
    *args: its arguments (arrays or ``jax.ShapeDtypeStruct``).
    backward: also audit the backward pass (a train step holds it already).
    reduction_threshold: reductions over this many elements or more count.

  Returns:
    A :class:`PrecisionReport`; ``print(report)`` shows the table and
    ``report.assert_clean()`` fails a test with it.

  Raises:
    ValueError: if ``fn`` is not callable or the threshold is not a
      positive int.

  Examples:
    >>> def loss(w, x):
    ...   logits = x.astype(jnp.bfloat16) @ w.astype(jnp.bfloat16)
    ...   return -jax.nn.log_softmax(logits).mean()
    >>> report = precision_audit(loss, jnp.ones((8, 8)), jnp.ones((4, 8)))
    >>> sorted({i.op for i in report.of_kind("half_op")})
    ['exp', 'log']
    >>> [i.kind for i in report.of_kind("half_output")]
    ['half_output']
  """
  arguments.check_callable(fn, "precision_audit")
  audit = _Audit(check_int(reduction_threshold, "reduction_threshold", 1))
  phases = jaxprs.trace(fn, args, bool(backward))
  for phase, jaxpr in phases:
    for eqn, repeats, where in jaxprs.walk(jaxpr):
      audit.visit(eqn, phase, repeats, where)
  if phases[0][0] != "step":  # a step's outputs are its state and metrics
    audit.check_outputs(phases[0][1].outvars)
  return PrecisionReport(
    issues=tuple(audit.merged.values()),
    half_ops=audit.half_ops,
    float32_ops=audit.float32_ops,
    fused_attention=audit.fused_attention,
  )


class _Audit:
  """The running tally of :func:`precision_audit`: issues merged by key."""

  def __init__(self, reduction_threshold: int):
    self.reduction_threshold = reduction_threshold
    self.merged: dict[tuple, PrecisionIssue] = {}
    self.half_ops = self.float32_ops = self.fused_attention = 0

  def add(self, kind, phase, op, dtype, shape, where, message, count):
    key = (kind, phase, op, dtype, shape, where)
    if key in self.merged:
      self.merged[key] = self.merged[key]._replace(count=self.merged[key].count + count)
    else:
      self.merged[key] = PrecisionIssue(kind, phase, op, dtype, shape, where, count, message)

  def visit(self, eqn, phase: str, repeats: int, where: str) -> None:
    """Counts one equation and records what is wrong with it, if anything."""
    floats = [
      np.dtype(v.aval.dtype) for v in eqn.invars if hasattr(v.aval, "dtype") and is_floating_dtype(v.aval.dtype)
    ]
    name = eqn.primitive.name
    if not floats or (jaxprs.has_subjaxpr(eqn) and name not in _SCATTER_SUMS):
      return  # Calls (jit, scan, ...) are counted through their bodies.
    if name in _FUSED_ATTENTION:
      # Softmax statistics in float32 inside the kernel, whatever the
      # operands' dtype: neither an issue nor a half-precision op.
      self.fused_attention += repeats
      self.float32_ops += 1
      return
    in_half = all(d in arguments.HALF_DTYPES for d in floats)
    self.half_ops += int(in_half)
    self.float32_ops += int(not in_half)
    shape = tuple(int(s) for s in getattr(eqn.invars[0].aval, "shape", ()))
    if in_half and name in _FLOAT32_OPS:
      self.add("half_op", phase, name, floats[0], shape, where, f"compute {name} in float32", repeats)
    elif in_half and name in _REDUCTIONS:
      axes = eqn.params.get("axes")
      if axes is None:
        axes = (eqn.params.get("axis", 0),)
      size = math.prod(shape[a] for a in axes)
      if size >= self.reduction_threshold:
        self.add(
          "half_reduction",
          phase,
          f"{name}[{size}]",
          floats[0],
          shape,
          where,
          "reduce in float32 (jnp.sum does; lax reductions and bias gradients do not)",
          repeats,
        )
    elif in_half and name in _SCATTER_SUMS:
      indices = tuple(int(x) for x in eqn.invars[1].aval.shape)
      size = math.prod(indices[:-1])  # the rows scattered (index vectors last)
      if size >= self.reduction_threshold:
        self.add(
          "half_reduction",
          phase,
          f"{name}[{size}]",
          floats[0],
          shape,
          where,
          "the table is read in half precision, so its gradient's rows are summed in half: "
          "keep the table in float32 and cast the rows after the lookup (the default "
          "model_policy and jmp_train.autocast's lookup rule do; a table stored in half "
          "precision, or cast before the lookup, does not)",
          repeats,
        )
    elif name in ("dot_general", "conv_general_dilated") and not in_half:
      widest = max(floats, key=lambda d: d.itemsize)
      self.add(
        "float32_matmul",
        phase,
        name,
        widest,
        shape,
        where,
        "cast the operands to the compute dtype (Tensor Cores)",
        repeats,
      )

  def check_outputs(self, outvars) -> None:
    """The forward pass's outputs (the loss or the model output) in half."""
    for i, var in enumerate(outvars):
      aval = var.aval
      dtype = np.dtype(aval.dtype) if hasattr(aval, "dtype") else None
      if dtype is not None and dtype in arguments.HALF_DTYPES:
        shape = tuple(int(s) for s in aval.shape)
        what = "the loss" if shape == () else "a model output"
        self.add(
          "half_output",
          "forward",
          f"output[{i}]",
          dtype,
          shape,
          "",
          f"{what} in {dtype.name}: output float32, compute the loss in float32",
          1,
        )
