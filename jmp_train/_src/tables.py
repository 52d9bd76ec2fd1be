"""Markdown tables: the diagnostics' reports, and :func:`jmp_train.diagnostics.format_table`."""

from __future__ import annotations

import math
from typing import Any, Callable, Iterable, Mapping, Sequence

__all__ = ["format_cell", "format_table"]


def format_cell(v: Any) -> str:
  """One value as a table cell (see :func:`format_table` for the rules).

  Examples:
    >>> [format_cell(v) for v in (None, True, 0.123456, 1234567.0, (4, 8), [1, 2])]
    ['-', 'yes', '0.1235', '1.23e+06', '4x8', '[1, 2]']
  """
  if v is None:
    return "-"
  if isinstance(v, bool):
    return "yes" if v else "no"
  if isinstance(v, float):
    if not math.isfinite(v):
      return str(v)
    return f"{v:.4g}" if abs(v) < 1e5 else f"{v:.3g}"
  if isinstance(v, tuple):
    if all(isinstance(d, int) and not isinstance(d, bool) for d in v):
      return "x".join(map(str, v))  # a shape; () for a scalar
    return ",".join(map(str, v))
  return str(v)


def format_table(
  rows: Iterable[Mapping[str, Any]],
  columns: Sequence[str] | None = None,
  formats: Mapping[str, Callable[[Any], str]] | None = None,
) -> str:
  """A GitHub-markdown table of ``rows``.

  Floats are printed to 4 significant digits (3 from 1e5 on), ``None`` as
  ``-``, booleans as ``yes``/``no``, tuples of ints as shapes (``4x8``) and
  other tuples comma-separated; a row missing a column gets an empty cell.
  The same rows always give the same text.

  Args:
    rows: the records.
    columns: which keys, in order (default: the first row's keys).
    formats: column -> a function of a value to its cell, used in place of
      the rules above for that column's values other than ``None``.

  Returns:
    The table as one string (``"(no rows)"`` for no rows).

  Examples:
    >>> print(format_table([{"op": "exp", "shape": (4, 8), "share": 0.123456, "ok": False}]))
    | op  | shape | share  | ok |
    |-----|-------|--------|----|
    | exp | 4x8   | 0.1235 | no |
    >>> print(format_table([{"gap": 0.0123}], formats={"gap": "{:+.1%}".format}))
    | gap   |
    |-------|
    | +1.2% |
  """
  rows = list(rows)
  if not rows:
    return "(no rows)"
  columns = list(columns or rows[0].keys())
  formats = dict(formats or {})

  def cell(row: Mapping[str, Any], column: str) -> str:
    if column not in row:
      return ""
    v = row[column]
    if v is not None and column in formats:
      return formats[column](v)
    return format_cell(v)

  cells = [[cell(r, c) for c in columns] for r in rows]
  widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]

  def line(values):
    return "| " + " | ".join(v.ljust(w) for v, w in zip(values, widths)) + " |"

  sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
  return "\n".join([line(columns), sep, *(line(r) for r in cells)])
