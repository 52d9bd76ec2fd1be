"""Runs the benchmark suite: ``python -m benchmarks [--quick] [--only NAME ...]``.

Each ``benchmarks/bench_*.py`` module defines ``NAME``, an optional
``COLUMNS`` and ``run(quick: bool) -> list[dict]``. Results go to
``benchmarks/results/<NAME>-<device>.json`` (with machine, device, versions
and date; ``<NAME>-quick-<device>.json`` for ``--quick``) and a table is
printed per benchmark. A benchmark that cannot run here returns
``_harness.skipped(reason)``; one that raises is reported, the others still
run, and the exit status is 1.

``python -m benchmarks --summary`` prints the stored results, one table per
file; ``python -m benchmarks --report`` writes them, with headline figures,
to ``docs/benchmarks_report.md`` (:func:`benchmarks._report.report`).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import pathlib
import sys
import time
import traceback


def discover() -> list[str]:
  """The benchmark module names (``bench_*``), sorted."""
  here = pathlib.Path(__file__).parent
  return sorted(p.stem for p in here.glob("bench_*.py"))


def _simulate_cpu_devices(count: int) -> None:
  """Asks XLA for ``count`` host devices, if JAX has not started yet.

  Only the CPU platform is affected: on a GPU machine the GPUs stay the
  default devices. Once ``jax`` is imported (the test suite, a notebook) the
  flag can no longer take effect, and it is left alone.
  """
  flags = os.environ.get("XLA_FLAGS", "")
  if "jax" in sys.modules or "xla_force_host_platform_device_count" in flags:
    return
  os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={count}".strip()


def _parser(names: list[str]) -> argparse.ArgumentParser:
  """The command line of ``python -m benchmarks``."""
  parser = argparse.ArgumentParser(
    prog="python -m benchmarks", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
  )
  parser.add_argument("--quick", action="store_true", help="tiny sizes, few repeats (smoke test)")
  parser.add_argument(
    "--only", nargs="*", choices=names, metavar="NAME", help=f"run only these benchmarks (of: {', '.join(names)})"
  )
  parser.add_argument("--out", type=pathlib.Path, default=None, help="results folder (default: benchmarks/results)")
  parser.add_argument("--json", action="store_true", help="print the JSON records too")
  parser.add_argument("--list", action="store_true", help="list the benchmarks and exit")
  parser.add_argument(
    "--summary",
    action="store_true",
    help="print the stored results (of --out) as markdown, one table per file with the machine it came from, and exit",
  )
  parser.add_argument(
    "--report",
    action="store_true",
    help="write the stored results (of --out) with headline figures to docs/benchmarks_report.md and exit",
  )
  parser.add_argument("--write", action="store_true", help="with --summary: write the report, as --report does")
  parser.add_argument(
    "--cpu-devices",
    type=int,
    default=8,
    metavar="N",
    help="simulated CPU devices for the multi-device benchmarks "
    "(sets XLA_FLAGS before JAX starts; default 8; a count "
    "already in XLA_FLAGS wins)",
  )
  parser.add_argument(
    "--gpu-probe",
    action="store_true",
    help="run the GPU measurements that the stored GPU results lack for the current code "
    "(benchmarks/_probe.py's PROBE, most wanted first), each in its own process, within "
    "BENCH_PROBE_BUDGET_S seconds (default 420), writing each results file as it ends and "
    "one summary table; refuses without a GPU",
  )
  parser.add_argument(
    "--all", action="store_true", help="with --gpu-probe: run every measurement, current ones too (BENCH_PROBE_ALL=1)"
  )
  return parser


def _run_one(module_name: str, name: str, args: argparse.Namespace) -> bool:
  """Runs one benchmark, prints its table and writes its results; ``False`` if it raised."""
  from benchmarks import _harness

  print(f"\n## {name}", flush=True)
  start = time.perf_counter()
  try:
    module = importlib.import_module(f"benchmarks.{module_name}")
    records = module.run(quick=args.quick)
    if not records:
      raise RuntimeError(f"benchmark {name!r} returned no records")
  except Exception:  # Report, run the rest.
    traceback.print_exc()
    print(f"(benchmark {name!r} FAILED)", flush=True)
    return False
  path = _harness.save_results(module.NAME + ("-quick" if args.quick else ""), records, args.out)
  if _harness.is_skipped(records):
    print(f"skipped: {records[0]['reason']}")
  else:
    print(_harness.format_table(records, getattr(module, "COLUMNS", None)))
  if args.json:
    print(json.dumps(records, indent=2, default=str))
  print(f"(written to {path} in {time.perf_counter() - start:.1f} s)", flush=True)
  return True


def main(argv: list[str] | None = None) -> int:
  """Runs the selected benchmarks; returns the process exit status."""
  modules = discover()
  names = [m.removeprefix("bench_") for m in modules]
  parser = _parser(names)
  args = parser.parse_args(argv)
  if args.write and not args.summary:
    parser.error("--write goes with --summary (or use --report)")
  if args.cpu_devices < 1:
    parser.error(f"--cpu-devices must be >= 1, got {args.cpu_devices}")
  _simulate_cpu_devices(args.cpu_devices)
  if args.all and not args.gpu_probe:
    parser.error("--all goes with --gpu-probe")
  if args.gpu_probe:
    from benchmarks import _probe

    return _probe.gpu_probe(args.out, force=True if args.all else None)

  if args.list:
    print("\n".join(names))
    return 0
  # The report imports JAX (through jmp_train.diagnostics): only after the
  # simulated devices are set.
  from benchmarks._report import summary, write_report

  if args.report or (args.summary and args.write):
    print(f"(written to {write_report(results_dir=args.out)})")
    return 0
  if args.summary:
    print(summary(args.out))
    return 0

  from benchmarks import _harness

  info = _harness.machine_info()
  print(
    f"# {info['device_kind']} x{info['device_count']} ({info['backend']}), "
    f"jax {info['versions']['jax']}, {info['date']}",
    flush=True,
  )
  selected = [(m, n) for m, n in zip(modules, names) if not args.only or n in args.only]
  failed = [name for module_name, name in selected if not _run_one(module_name, name, args)]
  if failed:
    print(f"\nFAILED: {', '.join(failed)}", file=sys.stderr, flush=True)
    return 1
  return 0


if __name__ == "__main__":
  sys.exit(main())
