"""Runs the benchmark suite: ``python -m benchmarks [--quick] [--only NAME ...]``.

Each ``benchmarks/bench_*.py`` module defines ``NAME``, an optional
``COLUMNS`` and ``run(quick: bool) -> list[dict]``. Results go to
``benchmarks/results/<NAME>-<device>.json`` (with machine, device, versions
and date; ``<NAME>-quick-<device>.json`` for ``--quick``) and a table is
printed per benchmark. A benchmark that cannot run here returns
``_harness.skipped(reason)``; one that raises is reported, the others still
run, and the exit status is 1.
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


def summary(results_dir: pathlib.Path | None = None) -> str:
  """The stored full-size results as markdown: one table per result file."""
  from benchmarks import _harness

  results_dir = pathlib.Path(results_dir or _harness.RESULTS_DIR)
  parts = []
  for path in sorted(results_dir.glob("*.json")):
    payload = json.loads(path.read_text())
    name = payload["benchmark"]
    if name.endswith("-quick"):
      continue
    m = payload["machine"]
    try:
      columns = getattr(importlib.import_module(f"benchmarks.bench_{name}"), "COLUMNS", None)
    except ImportError:
      columns = None
    if columns is not None and any("run" in r for r in payload["records"]):
      columns = (*columns, "run")  # records appended by later runs say which run
    parts.append(
        f"#### {name}\n\n{m['device_kind']} x{m['device_count']} ({m['backend']}, "
        f"{m.get('cpu_count')} CPU cores), jax {m['versions']['jax']}, {m['date']}\n\n"
        + _harness.format_table(payload["records"], columns)
    )
  return "\n\n".join(parts) if parts else f"(no results in {results_dir})"


def main(argv: list[str] | None = None) -> int:
  """Runs the selected benchmarks; returns the process exit status."""
  modules = discover()
  names = [m.removeprefix("bench_") for m in modules]
  parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--quick", action="store_true", help="tiny sizes, few repeats (smoke test)")
  parser.add_argument("--only", nargs="*", choices=names, metavar="NAME",
                      help=f"run only these benchmarks (of: {', '.join(names)})")
  parser.add_argument("--out", type=pathlib.Path, default=None,
                      help="results folder (default: benchmarks/results)")
  parser.add_argument("--json", action="store_true", help="print the JSON records too")
  parser.add_argument("--list", action="store_true", help="list the benchmarks and exit")
  parser.add_argument("--summary", action="store_true",
                      help="print the stored results (of --out) as markdown, with the "
                           "machine each came from, and exit (this is how the README's "
                           "tables are made)")
  parser.add_argument("--cpu-devices", type=int, default=8, metavar="N",
                      help="simulated CPU devices for the multi-device benchmarks "
                           "(sets XLA_FLAGS before JAX starts; default 8; a count "
                           "already in XLA_FLAGS wins)")
  args = parser.parse_args(argv)
  if args.cpu_devices < 1:
    parser.error(f"--cpu-devices must be >= 1, got {args.cpu_devices}")
  _simulate_cpu_devices(args.cpu_devices)

  if args.list:
    print("\n".join(names))
    return 0
  if args.summary:
    print(summary(args.out))
    return 0

  from benchmarks import _harness

  info = _harness.machine_info()
  print(f"# {info['device_kind']} x{info['device_count']} ({info['backend']}), "
        f"jax {info['versions']['jax']}, {info['date']}", flush=True)
  failed = []
  for module_name, name in zip(modules, names):
    if args.only and name not in args.only:
      continue
    print(f"\n## {name}", flush=True)
    start = time.perf_counter()
    try:
      module = importlib.import_module(f"benchmarks.{module_name}")
      records = module.run(quick=args.quick)
      if not records:
        raise RuntimeError(f"benchmark {name!r} returned no records")
    except Exception:  # pylint: disable=broad-except  # Report, run the rest.
      traceback.print_exc()
      print(f"(benchmark {name!r} FAILED)", flush=True)
      failed.append(name)
      continue
    path = _harness.save_results(module.NAME + ("-quick" if args.quick else ""), records, args.out)
    if _harness.is_skipped(records):
      print(f"skipped: {records[0]['reason']}")
    else:
      print(_harness.format_table(records, getattr(module, "COLUMNS", None)))
    if args.json:
      print(json.dumps(records, indent=2, default=str))
    print(f"(written to {path} in {time.perf_counter() - start:.1f} s)", flush=True)
  if failed:
    print(f"\nFAILED: {', '.join(failed)}", file=sys.stderr, flush=True)
    return 1
  return 0


if __name__ == "__main__":
  sys.exit(main())
