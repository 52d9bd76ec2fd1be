"""Shared benchmark helpers: timing, machine facts, JSON results, tables.

Every figure is a median over repeated runs after warm-up; comparisons are
ratios of figures taken in the same process.
"""

from __future__ import annotations

import datetime
import json
import os
import pathlib
import platform
import statistics
import time
from typing import Any, Callable, Iterable, Sequence

import jax

RESULTS_DIR = pathlib.Path(__file__).parent / "results"


def block(tree: Any) -> Any:
  """Waits for every array in ``tree``."""
  return jax.block_until_ready(tree)


def median_seconds(
    fn: Callable[..., Any], *args: Any, warmup: int = 2, repeats: int = 10
) -> float:
  """Median wall-clock seconds of ``fn(*args)`` after ``warmup`` calls."""
  for _ in range(warmup):
    block(fn(*args))
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    block(fn(*args))
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def interleaved_median_seconds(
    fns: dict[str, Callable[[], Any]], *, warmup: int = 2, repeats: int = 10
) -> dict[str, float]:
  """Medians of several zero-argument callables timed round-robin.

  Interleaving spreads machine noise (other processes, turbo) evenly over
  the candidates, so their ratios are fairer than back-to-back blocks.
  """
  for fn in fns.values():
    for _ in range(warmup):
      block(fn())
  times: dict[str, list[float]] = {name: [] for name in fns}
  for _ in range(repeats):
    for name, fn in fns.items():
      start = time.perf_counter()
      block(fn())
      times[name].append(time.perf_counter() - start)
  return {name: statistics.median(ts) for name, ts in times.items()}


def machine_info() -> dict[str, Any]:
  """Machine, device, versions and date, recorded with every result."""
  import flax
  import numpy as np
  import optax

  import jmp_train

  devices = jax.devices()
  return {
      "date": datetime.datetime.now(datetime.timezone.utc).isoformat(
          timespec="seconds"
      ),
      "platform": platform.platform(),
      "processor": platform.processor() or platform.machine(),
      "cpu_count": os.cpu_count(),
      "python": platform.python_version(),
      "backend": jax.default_backend(),
      "device_kind": devices[0].device_kind,
      "device_count": len(devices),
      "versions": {
          "jax": jax.__version__,
          "flax": flax.__version__,
          "optax": optax.__version__,
          "numpy": np.__version__,
          "jmp_train": jmp_train.__version__,
      },
  }


def device_tag() -> str:
  """A file-name-safe tag of the device, e.g. ``cpu`` or ``nvidia-h100``."""
  kind = jax.devices()[0].device_kind.lower()
  keep = "".join(c if c.isalnum() else "-" for c in kind)
  return "-".join(p for p in keep.split("-") if p) or jax.default_backend()


def save_results(
    name: str, records: Sequence[dict[str, Any]], out_dir: pathlib.Path | None = None
) -> pathlib.Path:
  """Writes ``{machine, records}`` as JSON; returns the path."""
  out_dir = pathlib.Path(out_dir or RESULTS_DIR)
  out_dir.mkdir(parents=True, exist_ok=True)
  path = out_dir / f"{name}-{device_tag()}.json"
  payload = {"benchmark": name, "machine": machine_info(), "records": list(records)}
  path.write_text(json.dumps(payload, indent=2, default=_jsonable) + "\n")
  return path


def _jsonable(x: Any) -> Any:
  if hasattr(x, "item"):
    return x.item()
  if hasattr(x, "tolist"):
    return x.tolist()
  return str(x)


def format_table(rows: Iterable[dict[str, Any]], columns: Sequence[str] | None = None) -> str:
  """A GitHub-markdown table of ``rows`` (floats to 4 significant digits)."""
  rows = list(rows)
  if not rows:
    return "(no rows)"
  columns = list(columns or rows[0].keys())

  def fmt(v: Any) -> str:
    if isinstance(v, float):
      return f"{v:.4g}"
    return str(v)

  cells = [[fmt(r.get(c, "")) for c in columns] for r in rows]
  widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
  line = lambda vals: "| " + " | ".join(v.ljust(w) for v, w in zip(vals, widths)) + " |"
  sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
  return "\n".join([line(columns), sep, *(line(r) for r in cells)])
