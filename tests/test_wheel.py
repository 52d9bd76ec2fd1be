"""`make wheel-check`: CI installs the built wheel and runs README.md's quick start.

The check itself builds and installs (a minute, with the package index);
these tests only keep its pieces in agreement: the block
``.ci/quickstart_check.py`` runs is the one ``tests/test_demo.py`` runs, and
CI calls the target.
"""

import re
import runpy
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_quickstart_check_runs_the_readme_block_the_suite_runs():
  check = runpy.run_path(str(ROOT / ".ci" / "quickstart_check.py"))
  readme = (ROOT / "README.md").read_text()
  block = check["quick_start"](readme)
  tested = readme.split("## Quick start", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
  assert block == tested
  assert "import jmp_train" in block and "metrics" in block


def test_ci_builds_and_installs_the_wheel_after_the_suite():
  makefile = (ROOT / "Makefile").read_text()
  recipe = makefile.split("\nwheel-check:", 1)[1].split("\n\n", 1)[0]
  assert "-m build" in recipe and "-m venv" in recipe and "jmp_train-*.whl" in recipe
  assert "quickstart_check.py" in recipe and "-I" in recipe  # isolated: no checkout on sys.path
  assert "wheel_contents.py" in recipe
  steps = re.findall(r"^make (\S+)$", (ROOT / ".ci" / "run").read_text(), re.M)
  assert steps.index("wheel-check") == steps.index("test") + 1
  assert {"lint", "docs"} <= set(steps)


def test_wheel_contents_check_names_what_is_not_the_library(tmp_path):
  import zipfile

  check = runpy.run_path(str(ROOT / ".ci" / "wheel_contents.py"))
  library = [
    "jmp_train/__init__.py",
    "jmp_train/_src/train/step.py",
    "jmp_train/py.typed",
    "jmp_train-0.1.0.dist-info/METADATA",
    "jmp_train-0.1.0.dist-info/RECORD",
  ]
  assert check["foreign_files"](library) == []
  extra = [
    "jmp_train_examples/cli.py",
    "benchmarks/bench_fp8.py",
    "tests/test_train.py",
    "jmp_train-0.1.0.dist-info/entry_points.txt",
  ]
  assert check["foreign_files"](library + extra) == extra
  wheel = tmp_path / "jmp_train-0.1.0-py3-none-any.whl"
  with zipfile.ZipFile(wheel, "w") as z:
    for name in library + extra[:1]:
      z.writestr(name, "")
  assert check["main"](["wheel_contents.py", str(wheel)]) == 1
  with zipfile.ZipFile(wheel, "w") as z:
    for name in library:
      z.writestr(name, "")
  assert check["main"](["wheel_contents.py", str(wheel)]) == 0


def test_the_library_never_imports_the_examples_or_benchmarks():
  for path in sorted((ROOT / "jmp_train").rglob("*.py")):
    text = path.read_text()
    for name in ("jmp_train_examples", "benchmarks"):
      assert f"import {name}" not in text and f"from {name}" not in text, (path, name)
