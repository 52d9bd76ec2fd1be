"""Which format pays on which chip: the same function's roofline under several policies.

Each policy's variant is ``jmp_train.autocast(fn, policy)`` (what the policy
makes of the function is what is counted: its casts, its quantize and scale
work), or a variant the user wrote in that format. The predicted times give
each one's speed-up and a verdict on the narrowest.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple, Sequence

from jmp_train._src import tables
from jmp_train._src.diagnostics import chips
from jmp_train._src.diagnostics import roofline as roofline_lib

__all__ = ["FormatComparison", "FormatRow", "roofline_compare"]

# A speed-up below this is "does not pay" (the roofline's own error is larger).
_PAYS = 1.05


class FormatRow(NamedTuple):
  """One policy of :func:`roofline_compare`.

  Attributes:
    name: the policy's spec (or the name given with a variant).
    time_s: the predicted time.
    speedup: the first row's time over this one's.
    product_share: share of the time in matmuls and convolutions.
    memory_bound_share: share of the time in memory-bound rows.
    quantize_share: share of the time in quantize, dequantize and scale work.
    formats: the products' formats, e.g. ``("bfloat16", "fp8")``.
  """

  name: str
  time_s: float
  speedup: float
  product_share: float
  memory_bound_share: float
  quantize_share: float
  formats: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class FormatComparison:
  """The predicted time of one function under several formats on a chip.

  Attributes:
    rows: a :class:`FormatRow` per policy, in the order given.
    reports: ``{name: RooflineReport}``.
    chip: the :class:`Chip`.
    verdict: the last policy against the one before it, in a sentence
      (``"fp8 pays here: 1.41x over mixed_bfloat16"``, ``"memory-bound (..):
      a narrower format saves at most 1.1x"``).
  """

  rows: tuple[FormatRow, ...]
  reports: dict[str, roofline_lib.RooflineReport]
  chip: chips.Chip
  verdict: str

  def to_rows(self) -> list[dict[str, Any]]:
    return [
      {
        "policy": r.name,
        "time_ms": r.time_s * 1e3,
        "speedup": r.speedup,
        "products": f"{r.product_share:.1%}",
        "memory_bound": f"{r.memory_bound_share:.1%}",
        "quantize": f"{r.quantize_share:.1%}",
        "formats": ",".join(r.formats) or "-",
      }
      for r in self.rows
    ]

  def __str__(self) -> str:
    return tables.format_table(self.to_rows()) + f"\n{self.chip.name}: {self.verdict}"


def _is_variant(entry: Any) -> bool:
  return isinstance(entry, tuple) and len(entry) == 2 and isinstance(entry[0], str) and callable(entry[1])


def _narrow_bound(report: roofline_lib.RooflineReport) -> float:
  """The most any narrower product format can save: products' math free and their bytes halved."""
  floor = sum(r.t_mem_s / 2 if r.product else r.time_s for r in report.rows)
  return report.time_s / floor if floor else float("inf")


def _verdict(rows: list[FormatRow], reports: dict, wanted_fp8: dict[str, bool]) -> str:
  notes = [
    f"under {name} no product runs on FP8 operands (what autocast made of the function)"
    for name, wanted in wanted_fp8.items()
    if wanted and "fp8" not in next(r.formats for r in rows if r.name == name)
  ]
  if len(rows) < 2:
    text = f"{rows[0].name}: {rows[0].time_s * 1e3:.4g} ms predicted"
  else:
    prev, last = rows[-2], rows[-1]
    gain = prev.time_s / last.time_s if last.time_s else float("inf")
    if gain >= _PAYS:
      text = f"{last.name} pays here: {gain:.2f}x over {prev.name}"
    else:
      report = reports[prev.name]
      share = report.memory_bound_share
      if share >= 0.5:
        text = (
          f"memory-bound ({share:.0%} of {prev.name}'s time in memory-bound work): a narrower format saves at "
          f"most {_narrow_bound(report):.2f}x; {last.name} gives {gain:.2f}x"
        )
      else:
        text = (
          f"{last.name} does not pay here: {gain:.2f}x over {prev.name} (quantize and scale work "
          f"{last.quantize_share:.0%} of its time)"
        )
  return "; ".join([text, *notes])


def roofline_compare(
  fn: Callable[..., Any],
  *args: Any,
  policies: Sequence[Any] = ("float32", "mixed_bfloat16", "mixed_float8"),
  chip: Any,
  backward: bool = True,
  fuse: bool = True,
  params_argnums: Any = 0,
) -> FormatComparison:
  """The roofline of ``fn`` under each policy on ``chip``: predicted times, speed-ups and a verdict.

  Each entry of ``policies`` is a policy (a :class:`~jmp_train.Policy` or a
  spec, e.g. ``"mixed_bfloat16"``), whose variant is
  ``jmp_train.autocast(fn, policy, params_argnums=params_argnums)``, or a
  ``(name, function)`` pair, a variant already in its format (a model with
  :func:`~jmp_train.fp8_dot_general` products), used as is. Each variant's
  :func:`roofline` counts what it runs: the casts a policy adds, and FP8's
  quantize, dequantize and scale work (rows under ``fp8_product`` scopes and
  casts to or from 8-bit types). The verdict compares the last entry with
  the one before it: it pays at 1.05x or more; otherwise, when most of the
  time is memory-bound, it says the most any narrower product format could
  save (products' math free and their bytes halved).

  Args:
    fn: the function (its parameters at ``params_argnums``).
    *args: its arguments (arrays or ``jax.ShapeDtypeStruct``).
    policies: the policies or ``(name, function)`` variants, widest first;
      speed-ups are over the first.
    chip: as for :func:`roofline`.
    backward: also the backward pass.
    fuse: as for :func:`roofline`.
    params_argnums: as for :func:`~jmp_train.autocast`.

  Returns:
    A :class:`FormatComparison`; ``print(comparison)`` shows the table.

  Raises:
    ValueError: for no policies, an unknown policy spec, or as
      :func:`roofline` raises (FP8 on a chip without FP8 Tensor Cores).

  Examples:
    >>> x = jax.ShapeDtypeStruct((4096, 4096), jnp.float32)
    >>> w = jax.ShapeDtypeStruct((4096, 4096), jnp.float32)
    >>> comparison = roofline_compare(lambda w, x: x @ w, w, x, chip="H100 SXM",
    ...                               policies=("float32", "mixed_bfloat16"), backward=False)
    >>> comparison.verdict  # the products 2x faster, the casts to bfloat16 and back counted
    'mixed_bfloat16 pays here: 1.21x over float32'
  """
  from jmp_train._src.autocast.transform import autocast
  from jmp_train._src.policy.policy import get_policy

  chip = chips.chip_peaks(chip)
  if isinstance(policies, str) or _is_variant(policies) or not isinstance(policies, Sequence):
    policies = (policies,)
  if not policies:
    raise ValueError("roofline_compare needs at least one policy, e.g. policies=('float32', 'mixed_bfloat16').")
  reports, rows, wanted_fp8 = {}, [], {}
  for entry in policies:
    if _is_variant(entry):
      name, variant = str(entry[0]), entry[1]
    else:
      policy = get_policy(entry)
      name = entry if isinstance(entry, str) else str(policy)
      variant = autocast(fn, policy, params_argnums=params_argnums)
      wanted_fp8[name] = policy.fp8 is not None
    report = roofline_lib.roofline(variant, *args, chip=chip, backward=backward, fuse=fuse)
    reports[name] = report
    base = rows[0].time_s if rows else report.time_s
    rows.append(
      FormatRow(
        name=name,
        time_s=report.time_s,
        speedup=base / report.time_s if report.time_s else float("inf"),
        product_share=report.product_share,
        memory_bound_share=report.memory_bound_share,
        quantize_share=report.quantize_share,
        formats=tuple(sorted({r.format for r in report.rows if r.product})),
      )
    )
  return FormatComparison(rows=tuple(rows), reports=reports, chip=chip, verdict=_verdict(rows, reports, wanted_fp8))
