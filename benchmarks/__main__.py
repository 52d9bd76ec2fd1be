"""Runs the benchmark suite: ``python -m benchmarks [--quick] [--only NAME ...]``.

Each ``benchmarks/bench_*.py`` module defines ``NAME``, an optional
``COLUMNS`` and ``run(quick: bool) -> list[dict]``. Results go to
``benchmarks/results/<NAME>-<device>.json`` (with machine, device, versions
and date) and a table is printed per benchmark.
"""

from __future__ import annotations

import argparse
import importlib
import json
import pathlib
import sys


def discover() -> list[str]:
  here = pathlib.Path(__file__).parent
  return sorted(p.stem for p in here.glob("bench_*.py"))


def main(argv: list[str] | None = None) -> int:
  modules = discover()
  names = [m.removeprefix("bench_") for m in modules]
  parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__)
  parser.add_argument("--quick", action="store_true", help="tiny sizes, few repeats (smoke test)")
  parser.add_argument("--only", nargs="*", choices=names, help="run only these benchmarks")
  parser.add_argument("--out", type=pathlib.Path, default=None, help="results folder")
  parser.add_argument("--json", action="store_true", help="print the JSON records too")
  args = parser.parse_args(argv)

  from benchmarks import _harness

  for module_name, name in zip(modules, names):
    if args.only and name not in args.only:
      continue
    module = importlib.import_module(f"benchmarks.{module_name}")
    print(f"\n## {module.NAME}", flush=True)
    records = module.run(quick=args.quick)
    path = _harness.save_results(module.NAME + ("-quick" if args.quick else ""), records, args.out)
    print(_harness.format_table(records, getattr(module, "COLUMNS", None)))
    if args.json:
      print(json.dumps(records, indent=2, default=str))
    print(f"(written to {path})", flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
