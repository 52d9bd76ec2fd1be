"""Lists a built wheel and checks it holds the library alone.

Run as ``python .ci/wheel_contents.py WHEEL``: every file must be under
``jmp_train/`` (the package) or the wheel's ``.dist-info`` folder; no
example, benchmark, notebook or test file, and no console script. Exits 1,
naming the files that do not belong, otherwise prints the package's files.
"""

from __future__ import annotations

import sys
import zipfile


def foreign_files(names: list[str]) -> list[str]:
  """The files of a wheel's ``names`` that are not the library's."""
  bad = []
  for name in names:
    top = name.split("/", 1)[0]
    if top == "jmp_train":
      continue
    if top.startswith("jmp_train-") and top.endswith(".dist-info"):
      if name.endswith("/entry_points.txt"):
        bad.append(name)  # a console script: the demo belongs to the examples
      continue
    bad.append(name)
  return bad


def main(argv: list[str]) -> int:
  if len(argv) != 2:
    print("usage: python .ci/wheel_contents.py WHEEL", file=sys.stderr)
    return 2
  with zipfile.ZipFile(argv[1]) as wheel:
    names = wheel.namelist()
  bad = foreign_files(names)
  if bad:
    print(f"{argv[1]} holds files that are not the library: {bad}", file=sys.stderr)
    return 1
  package = [n for n in names if n.startswith("jmp_train/")]
  print(f"{len(package)} files under jmp_train/, nothing else but the metadata")
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv))
