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
  steps = re.findall(r"^make (\S+)$", (ROOT / ".ci" / "run").read_text(), re.M)
  assert steps.index("wheel-check") == steps.index("test") + 1
  assert {"lint", "docs"} <= set(steps)


def test_readme_says_the_package_is_not_on_pypi():
  install = (ROOT / "README.md").read_text().split("## Installation", 1)[1].split("\n## ", 1)[0]
  assert "not on PyPI" in install
  assert "pip install jmp_train" not in install
  assert "python -m build" in install and "dist/jmp_train-*.whl" in install
