r"""The data-parallel exchange against the step's compute, and Seide et al.'s balance point.

An alpha-beta model of one step's gradient exchange over ``K`` replicas:
``alpha`` seconds per message, ``B`` bytes per second per replica link,

.. math::
  T_\mathrm{comm}(K) = m(K)\,\alpha + \frac{w(K)}{B},

with ``w(K)`` the bytes one replica sends and ``m(K)`` its messages in
sequence: a ring all-reduce of ``n`` bytes sends :math:`2\frac{K-1}{K}n`
in :math:`2(K-1)` messages (float32: ``n = 4N``, bfloat16: ``2N``); the
1-bit exchange of :func:`jmp_train.sign_compression` (an all-to-all of
packed signs, then an all-gather of the re-quantized chunks) sends
:func:`jmp_train.sign_compression_wire_bytes` in :math:`2(K-1)`
messages, and its codec takes ``codec_s_per_element * N``. Compute over a
fixed global batch split over the replicas, :math:`T_\mathrm{calc}(K) =
T_\mathrm{fixed} + T_1 / K`; the balance point :math:`\hat K` is where
:math:`T_\mathrm{calc}(\hat K) = T_\mathrm{comm}(\hat K)` (Seide et al.,
2014: beyond it, more replicas wait on the wire).

References:
  Seide, Fu, Droppo, Li, Yu, "1-Bit Stochastic Gradient Descent and its
  Application to Data-Parallel Distributed Training of Speech DNNs",
  Interspeech 2014.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple, Sequence

import jax
import numpy as np

from jmp_train._src import tables
from jmp_train._src.diagnostics import arguments
from jmp_train._src.diagnostics import hlo

__all__ = ["ExchangeReport", "ExchangeRow", "data_parallel_exchange"]

EXCHANGE_FORMATS = ("float32", "bfloat16", "1-bit")
_RING_BYTES = {"float32": 4, "bfloat16": 2}
_MAX_REPLICAS = 1 << 24


class ExchangeRow(NamedTuple):
  """One exchange format of :func:`data_parallel_exchange`.

  Attributes:
    format: ``"float32"``, ``"bfloat16"``, ``"1-bit"`` or ``"compiled"``
      (the collectives of a compiled step).
    replicas: ``K``.
    bytes_per_replica: bytes one replica sends per step.
    messages: messages in sequence (each pays the latency).
    t_comm_s: the exchange's time (codec included for 1-bit).
    t_calc_s: the compute time per replica, ``fixed_s + compute_s / K``.
    step_s: ``t_calc_s + t_comm_s``, or their max with ``overlap=True``.
    balance_replicas: :math:`\\hat K`, where ``t_calc = t_comm``
      (``inf`` if the compute never falls to the exchange's time).
  """

  format: str
  replicas: int
  bytes_per_replica: float
  messages: int
  t_comm_s: float
  t_calc_s: float
  step_s: float
  balance_replicas: float


@dataclasses.dataclass(frozen=True)
class ExchangeReport:
  """The exchange of a data-parallel step per format; ``str(report)`` is a table.

  Attributes:
    rows: an :class:`ExchangeRow` per format.
    link_bytes_per_s: the link's bytes per second per replica.
    latency_s: seconds per message.
  """

  rows: tuple[ExchangeRow, ...]
  link_bytes_per_s: float
  latency_s: float

  def row(self, fmt: str) -> ExchangeRow:
    """The row of ``fmt``."""
    for r in self.rows:
      if r.format == fmt:
        return r
    raise KeyError(f"no {fmt!r} row; rows: {[r.format for r in self.rows]}")

  def to_rows(self) -> list[dict[str, Any]]:
    return [
      {
        "format": r.format,
        "replicas": r.replicas,
        "MB_per_replica": r.bytes_per_replica / 1e6,
        "messages": r.messages,
        "t_comm_ms": r.t_comm_s * 1e3,
        "t_calc_ms": r.t_calc_s * 1e3,
        "step_ms": r.step_s * 1e3,
        "balance_K": r.balance_replicas,
      }
      for r in self.rows
    ]

  def __str__(self) -> str:
    return (
      tables.format_table(self.to_rows())
      + f"\nlink {self.link_bytes_per_s * 8 / 1e9:.4g} Gbit/s per replica, {self.latency_s * 1e6:.4g} us per message"
    )


def _balance(calc, comm) -> float:
  """The K >= 1 where ``calc(K) = comm(K)`` (calc falls, comm grows), by bisection; inf if none."""
  if calc(1.0) <= comm(1.0):
    return 1.0
  hi = 2.0
  while calc(hi) > comm(hi):
    if hi >= _MAX_REPLICAS:
      return math.inf
    hi *= 2
  lo = hi / 2
  for _ in range(60):
    mid = (lo + hi) / 2
    lo, hi = (mid, hi) if calc(mid) > comm(mid) else (lo, mid)
  return (lo + hi) / 2


def _compiled_exchange(compiled: Any) -> tuple[float, int]:
  ops = hlo.collective_ops(compiled)
  steps = {"all-reduce": 2, "all-gather": 1, "all-to-all": 1, "reduce-scatter": 1}
  messages = sum(steps.get(op.kind, 0) * (op.group_size - 1) + (op.kind == "collective-permute") for op in ops)
  return float(hlo.collective_bytes(compiled, wire=True)["total"]), int(messages)


def data_parallel_exchange(
  params: Any,
  *,
  replicas: int,
  link_bytes_per_s: float,
  compute_s: float = 0.0,
  fixed_s: float = 0.0,
  latency_s: float = 10e-6,
  formats: Sequence[str] = EXCHANGE_FORMATS,
  codec_s_per_element: float = 0.0,
  compiled: Any = None,
  overlap: bool = False,
) -> ExchangeReport:
  r"""One data-parallel step's gradient exchange against its compute, per format, and the balance point.

  The model is the module's (``jmp_train._src.diagnostics.exchange``):
  ring all-reduces for float32 and bfloat16 (:math:`2(K-1)\alpha +
  2\frac{K-1}{K}n/B`), :func:`jmp_train.sign_compression`'s two-phase
  exchange for ``"1-bit"`` (its real layout's bytes, plus the codec's
  ``codec_s_per_element * N``), and, with ``compiled``, the collectives of
  a compiled step as :func:`collective_bytes` reads them (``wire=True``;
  its messages ``2(k-1)`` per all-reduce, ``k-1`` per all-gather,
  all-to-all and reduce-scatter over ``k`` devices) at its own replica
  count. ``compute_s`` is the step's compute over the whole global batch on
  one replica (e.g. :func:`roofline`'s ``time_s`` at that batch, or a
  measured time), shared by the ``K`` replicas; ``fixed_s`` what does not
  shrink with ``K`` (the optimizer's update). Each row's
  ``balance_replicas`` is Seide et al.'s :math:`\hat K`.

  Args:
    params: the gradients' pytree, or anything with their shapes
      (parameters, ``jax.ShapeDtypeStruct`` s).
    replicas: ``K``.
    link_bytes_per_s: ``B``, bytes per second each replica sends (a link of
      ``g`` Gbit/s is ``g * 1e9 / 8``).
    compute_s: :math:`T_1`, compute seconds for the global batch on one replica.
    fixed_s: compute seconds per step that do not shrink with ``K``.
    latency_s: :math:`\alpha`, seconds per message.
    formats: of ``"float32"``, ``"bfloat16"``, ``"1-bit"``.
    codec_s_per_element: the 1-bit codec's seconds per gradient element.
    compiled: a compiled step (``jax.jit(step).lower(...).compile()``) or its
      HLO text: adds a ``"compiled"`` row at ``replicas``.
    overlap: exchange and compute overlap (``step_s`` is their max; Seide
      et al.'s double buffering) rather than add up.

  Returns:
    An :class:`ExchangeReport`.

  Raises:
    ValueError: for a bad count, rate or format, or params without
      floating-point leaves.

  Examples:
    >>> grads = {"w": jax.ShapeDtypeStruct((1024, 1024), jnp.float32)}
    >>> report = data_parallel_exchange(grads, replicas=8, link_bytes_per_s=100e9 / 8, compute_s=0.01)
    >>> [(r.format, round(r.bytes_per_replica / 1e6, 2)) for r in report.rows]
    [('float32', 7.34), ('bfloat16', 3.67), ('1-bit', 0.24)]
    >>> round(report.row("float32").balance_replicas, 1)
    12.0
  """
  from jmp_train._src.compression.sign_compression import sign_compression_wire_bytes

  leaves = arguments.floating_leaves(params, "data_parallel_exchange")
  n = float(sum(np.prod(np.shape(x), dtype=np.float64) for _, x in leaves))
  if isinstance(replicas, bool) or not isinstance(replicas, (int, np.integer)) or replicas < 1:
    raise ValueError(f"replicas must be an int >= 1, got {replicas!r}.")
  arguments.check_positive("link_bytes_per_s", link_bytes_per_s)
  for name, v in (("compute_s", compute_s), ("fixed_s", fixed_s), ("latency_s", latency_s)):
    arguments.check_positive(name, v, inclusive=True)
  arguments.check_positive("codec_s_per_element", codec_s_per_element, inclusive=True)
  unknown = [f for f in formats if f not in EXCHANGE_FORMATS]
  if unknown:
    raise ValueError(f"Unknown exchange formats {unknown}; valid: {', '.join(EXCHANGE_FORMATS)}.")
  like = [jax.ShapeDtypeStruct(np.shape(x), np.float32) for _, x in leaves]

  def model(fmt):
    """``comm(K)`` and its bytes and messages."""

    def parts(k):
      if fmt == "1-bit":  # its layout needs whole replicas
        k = max(int(round(k)), 1)
        wire, extra = float(sign_compression_wire_bytes(like, k)) if k > 1 else 0.0, codec_s_per_element * n
      else:
        wire, extra = 2.0 * (k - 1) / k * _RING_BYTES[fmt] * n, 0.0
      return wire, 2 * (k - 1), extra

    def comm(k):
      wire, messages, extra = parts(k)
      return messages * latency_s + wire / link_bytes_per_s + (extra if k > 1 else 0.0)

    return comm, parts

  calc = lambda k: fixed_s + compute_s / k  # noqa: E731
  join = max if overlap else (lambda a, b: a + b)
  rows = []
  for fmt in formats:
    comm, parts = model(fmt)
    wire, messages, _ = parts(replicas)
    t_comm, t_calc = comm(replicas), calc(replicas)
    balance = _balance(calc, comm) if compute_s or fixed_s else 1.0
    rows.append(ExchangeRow(fmt, int(replicas), wire, int(messages), t_comm, t_calc, join(t_calc, t_comm), balance))
  if compiled is not None:
    wire, messages = _compiled_exchange(compiled)
    t_comm, t_calc = messages * latency_s + wire / link_bytes_per_s, calc(replicas)
    rows.append(ExchangeRow("compiled", int(replicas), wire, messages, t_comm, t_calc, join(t_calc, t_comm), math.nan))
  return ExchangeReport(rows=tuple(rows), link_bytes_per_s=float(link_bytes_per_s), latency_s=float(latency_s))
