"""Shared benchmark helpers: timing, machine facts, JSON results, tables.

Every figure is a median over repeated runs after warm-up; comparisons are
ratios of figures taken in the same process.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import math
import os
import pathlib
import platform
import statistics
import time
from typing import Any, Callable, Sequence

import jax
import numpy as np

from jmp_train.diagnostics import format_table as format_table  # re-exported for benchmarks

RESULTS_DIR = pathlib.Path(__file__).parent / "results"
# XLA's options for the compilations of a ``--quick`` run: a smoke test of the
# code, whose figures mean nothing and whose time is mostly compilation. LLVM's
# optimizations off and, on CPU, XLA's loop emitters instead of its fusion
# emitters (quicker to compile). ``jax.jit(..., compiler_options=...)``, or
# ``.lower(...).compile(compiler_options=...)``; the same as ``XLA_FLAGS`` for
# a quick run's worker processes: ``QUICK_XLA_FLAGS``.
QUICK_COMPILE = {
  "xla_backend_optimization_level": 0,
  "xla_llvm_disable_expensive_passes": True,
  "xla_cpu_use_fusion_emitters": False,
}
QUICK_XLA_FLAGS = " ".join(f"--{k}={str(v).lower()}" for k, v in QUICK_COMPILE.items())


def compile_options(quick: bool) -> dict[str, Any] | None:
  """:data:`QUICK_COMPILE` for a ``--quick`` run on CPU, else ``None`` (the options a full run compiles with)."""
  return dict(QUICK_COMPILE) if quick and jax.default_backend() == "cpu" else None


def block(tree: Any) -> Any:
  """Waits for every array in ``tree``."""
  return jax.block_until_ready(tree)


def median_seconds(fn: Callable[..., Any], *args: Any, warmup: int = 2, repeats: int = 10) -> float:
  """Median wall-clock seconds of ``fn(*args)`` after ``warmup`` calls.

  Each call is timed until its outputs are ready (``jax.block_until_ready``),
  so asynchronous dispatch does not hide device time.

  Args:
    fn: the function to time (typically jitted).
    *args: its arguments.
    warmup: untimed calls first (compilation, caches).
    repeats: timed calls; the median of these is returned.

  Returns:
    The median in seconds.

  Raises:
    ValueError: if ``warmup < 0`` or ``repeats < 1``.
  """
  _check_counts(warmup, repeats)
  for _ in range(warmup):
    block(fn(*args))
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    block(fn(*args))
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def interleaved_seconds(
  fns: dict[str, Callable[[], Any]], *, warmup: int = 2, repeats: int = 10
) -> dict[str, list[float]]:
  """Seconds of every timed call of several zero-argument callables, round-robin.

  Interleaving spreads machine noise (other processes, turbo) evenly over
  the candidates, so their ratios are fairer than back-to-back blocks.
  Round ``i`` starts at the ``i``-th candidate (cyclically), so that no
  candidate always follows the same one: a call runs measurably faster
  after one that left its inputs in the caches than after one that evicted
  them. Each call is timed until its outputs are ready.

  Args:
    fns: name -> zero-argument callable.
    warmup: untimed calls of each first.
    repeats: timed rounds; each round calls every candidate once.

  Returns:
    name -> the ``repeats`` seconds of its timed calls, in round order.

  Raises:
    ValueError: if ``warmup < 0`` or ``repeats < 1``.
  """
  _check_counts(warmup, repeats)
  for fn in fns.values():
    for _ in range(warmup):
      block(fn())
  times: dict[str, list[float]] = {name: [] for name in fns}
  names = list(fns)
  for i in range(repeats):
    first = i % len(names)
    for name in names[first:] + names[:first]:
      start = time.perf_counter()
      block(fns[name]())
      times[name].append(time.perf_counter() - start)
  return times


def interleaved_median_seconds(
  fns: dict[str, Callable[[], Any]], *, warmup: int = 2, repeats: int = 10
) -> dict[str, float]:
  """Medians of :func:`interleaved_seconds`: name -> median seconds.

  Raises:
    ValueError: if ``warmup < 0`` or ``repeats < 1``.
  """
  times = interleaved_seconds(fns, warmup=warmup, repeats=repeats)
  return {name: statistics.median(ts) for name, ts in times.items()}


def _check_counts(warmup: int, repeats: int) -> None:
  if warmup < 0:
    raise ValueError(f"warmup must be >= 0, got {warmup}.")
  if repeats < 1:
    raise ValueError(f"repeats must be >= 1, got {repeats}.")


def skipped(reason: str) -> list[dict[str, Any]]:
  """The records of a benchmark that cannot run here (e.g. it needs a GPU).

  A skipped benchmark returns exactly one record ``{"skipped": True,
  "reason": reason}``; the runner prints it as such and the test suite
  accepts it in place of the benchmark's columns.

  Args:
    reason: why, for a reader of the results file.

  Returns:
    A one-record list.
  """
  return [{"skipped": True, "reason": reason}]


def is_skipped(records: Sequence[dict[str, Any]]) -> bool:
  """Whether ``records`` is the output of :func:`skipped`."""
  return len(records) == 1 and records[0].get("skipped") is True


def env_int(variable: str, default: int) -> int:
  """The positive integer in the environment ``variable``, else ``default``.

  Raises:
    ValueError: naming the variable, for a value that is not a positive integer.
  """
  value = os.environ.get(variable, "")
  if not value:
    return default
  if not value.isdigit() or int(value) < 1:
    raise ValueError(f"{variable} must be a positive integer, got {value!r}.")
  return int(value)


def selected_rows(rows: Sequence[tuple], variable: str) -> list[tuple]:
  """The rows ``(group, mode, ...)`` whose mode the environment ``variable`` names.

  ``variable`` holds comma-separated modes; unset or empty keeps every row.
  Each group kept must keep its ``*_float32`` row, the reference of the
  benchmark's relative columns.

  Raises:
    ValueError: for a mode that is not a row, or a group without its
      ``*_float32`` row.
  """
  value = os.environ.get(variable, "")
  if not value:
    return list(rows)
  modes, known = value.split(","), [row[1] for row in rows]
  unknown = sorted(set(modes) - set(known))
  if unknown:
    raise ValueError(f"{variable}: unknown rows {unknown}; valid: {sorted(set(known))}.")
  kept = [row for row in rows if row[1] in modes]
  missing = sorted({r[0] for r in kept} - {r[0] for r in kept if r[1].endswith("float32")})
  if missing:
    raise ValueError(f"{variable}: keep the float32 row of {missing} too.")
  return kept


def tree_bytes(tree: Any) -> int:
  """Bytes of the array leaves of ``tree`` (``size * itemsize`` summed)."""
  sizes = [math.prod(x.shape) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree) if hasattr(x, "dtype")]
  return int(sum(sizes))


def compiled_memory(compiled: Any) -> dict[str, int | None]:
  """Byte counts of a compiled executable's ``memory_analysis()``.

  Args:
    compiled: ``jax.jit(f).lower(*args).compile()``.

  Returns:
    ``argument_bytes``, ``output_bytes``, ``alias_bytes`` (outputs that
    reuse donated arguments), ``temp_bytes`` (XLA's scratch buffers, where
    the activations kept for the backward pass live in a train step) and
    ``code_bytes``; all ``None`` where the backend gives no analysis.
  """
  keys = {
    "argument_bytes": "argument_size_in_bytes",
    "output_bytes": "output_size_in_bytes",
    "alias_bytes": "alias_size_in_bytes",
    "temp_bytes": "temp_size_in_bytes",
    "code_bytes": "generated_code_size_in_bytes",
  }
  try:
    stats = compiled.memory_analysis()
  except Exception:  # Unsupported backend.
    stats = None
  if stats is None:
    return {k: None for k in keys}
  return {k: int(getattr(stats, v)) for k, v in keys.items()}


def compiled_flops(compiled: Any) -> float | None:
  """XLA's count of floating-point operations per call, or ``None``."""
  try:
    cost = compiled.cost_analysis()
  except Exception:  # Unsupported backend.
    return None
  if isinstance(cost, (list, tuple)):
    cost = cost[0] if cost else None
  if not cost or "flops" not in cost:
    return None
  flops = float(cost["flops"])
  return flops if flops > 0 else None


def roofline_prediction(fn: Callable[..., Any], *args: Any, device: Any = None) -> dict[str, Any]:
  """The roofline's predicted time of one step ``fn(*args)`` on ``device``'s chip, for a record.

  Counted by :func:`jmp_train.diagnostics.roofline` with ``backward=False``:
  ``fn`` is a whole step (a train step function or a
  :class:`jmp_train.TrainStep`, with its state and batch), traced, not run;
  call it before a donating step consumes ``args``. The chip is the one of
  ``device.device_kind`` (default: the first device; the CPU's peaks are
  measured). A prediction that cannot be made does not stop the benchmark:
  the fields are then ``None`` and ``roofline_error`` says why.

  Returns:
    ``{"roofline_chip": name, "roofline_ms": ms}``, or with ``None`` values
    and ``roofline_error``.
  """
  from jmp_train.diagnostics import roofline

  kind = (device or jax.devices()[0]).device_kind
  try:
    report = roofline(fn, *args, chip=kind, backward=False)
  except Exception as e:  # Recorded: the measured figures stand without it.
    first = (str(e).splitlines() or [""])[0]
    return {"roofline_chip": None, "roofline_ms": None, "roofline_error": f"{type(e).__name__}: {first[:300]}"}
  return {"roofline_chip": report.chip.name, "roofline_ms": 1e3 * report.time_s}


def with_measured(prediction: dict[str, Any], measured_ms: float) -> dict[str, Any]:
  """``prediction`` (:func:`roofline_prediction`) and ``roofline_over_measured``, its time over ``measured_ms``."""
  predicted = prediction.get("roofline_ms")
  ratio = predicted / measured_ms if predicted is not None and measured_ms else None
  return {**prediction, "roofline_over_measured": ratio}


def machine_info() -> dict[str, Any]:
  """Machine, device, versions and date, recorded with every result.

  Returns:
    A JSON-ready dict: ``date`` (UTC, ISO 8601), ``platform``,
    ``processor``, ``cpu_count``, ``python``, ``backend``, ``device_kind``,
    ``device_count``, ``device_memory_bytes`` (``None`` where the backend
    does not say), ``xla_flags`` and ``versions`` (jax, jaxlib, flax, optax,
    chex, numpy, jmp if installed, jmp_train).
  """
  import flax
  import optax

  import jmp_train

  devices = jax.devices()
  versions = {
    "jax": jax.__version__,
    "jaxlib": _version("jaxlib"),
    "flax": flax.__version__,
    "optax": optax.__version__,
    "chex": _version("chex"),
    "numpy": np.__version__,
    "jmp": _version("jmp"),
    "jmp_train": jmp_train.__version__,
  }
  return {
    "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    "platform": platform.platform(),
    "processor": platform.processor() or platform.machine(),
    "cpu_count": os.cpu_count(),
    "python": platform.python_version(),
    "backend": jax.default_backend(),
    "device_kind": devices[0].device_kind,
    "device_count": len(devices),
    "device_memory_bytes": _device_memory(devices[0]),
    "xla_flags": os.environ.get("XLA_FLAGS", ""),
    "versions": versions,
  }


def _version(package: str) -> str | None:
  try:
    return importlib.metadata.version(package)
  except importlib.metadata.PackageNotFoundError:
    return None


def _device_memory(device: Any) -> int | None:
  try:
    stats = device.memory_stats()
  except Exception:  # Not every backend has it.
    return None
  if not stats:
    return None
  limit = stats.get("bytes_limit")
  return int(limit) if limit is not None else None


def device_tag() -> str:
  """A file-name-safe tag of the device, e.g. ``cpu`` or ``nvidia-h100``."""
  kind = jax.devices()[0].device_kind.lower()
  keep = "".join(c if c.isalnum() else "-" for c in kind)
  return "-".join(p for p in keep.split("-") if p) or jax.default_backend()


def save_results(
  name: str,
  records: Sequence[dict[str, Any]],
  out_dir: pathlib.Path | None = None,
  extra: dict[str, Any] | None = None,
) -> pathlib.Path:
  """Writes ``{benchmark, machine, records}`` (and the fields of ``extra``) as JSON; returns the path."""
  out_dir = pathlib.Path(out_dir or RESULTS_DIR)
  out_dir.mkdir(parents=True, exist_ok=True)
  path = out_dir / f"{name}-{device_tag()}.json"
  payload = {"benchmark": name, "machine": machine_info(), "records": list(records), **(extra or {})}
  # Round-trip through the encoder so NumPy scalars become Python numbers,
  # then write NaN/inf as null: strict JSON, readable by any tool.
  plain = json.loads(json.dumps(payload, default=_jsonable))
  path.write_text(json.dumps(_finite_or_none(plain), indent=2, allow_nan=False) + "\n")
  return path


def _finite_or_none(x: Any) -> Any:
  if isinstance(x, float) and not math.isfinite(x):
    return None
  if isinstance(x, dict):
    return {k: _finite_or_none(v) for k, v in x.items()}
  if isinstance(x, list):
    return [_finite_or_none(v) for v in x]
  return x


def _jsonable(x: Any) -> Any:
  if hasattr(x, "item"):
    return x.item()
  if hasattr(x, "tolist"):
    return x.tolist()
  return str(x)
