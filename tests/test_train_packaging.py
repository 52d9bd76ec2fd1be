"""Packaging: the build backend floor, py.typed, and a console script without extras."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys
import textwrap

import pytest

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _pyproject():
  return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_build_backend_floor_reads_the_spdx_license():
  config = _pyproject()
  assert isinstance(config["project"]["license"], str)  # an SPDX expression
  floors = [re.fullmatch(r"setuptools>=(\d+)(?:\.\d+)*", r) for r in config["build-system"]["requires"]]
  (floor,) = [int(m.group(1)) for m in floors if m]
  assert floor >= 77, "setuptools reads an SPDX license string from version 77"


def test_py_typed_ships_as_package_data():
  assert (ROOT / "jmp_train" / "py.typed").is_file()
  assert "py.typed" in _pyproject()["tool"]["setuptools"]["package-data"]["jmp_train"]


def test_console_script_and_extras_are_coherent():
  config = _pyproject()
  # The library declares no console script: jmp-train belongs to the examples.
  assert "scripts" not in config["project"]
  base = {re.split(r"[<>=]", d)[0] for d in config["project"]["dependencies"]}
  # The optional parts are extras, not dependencies; the demo's tqdm is the examples'.
  assert not base & {"matplotlib", "scikit-learn", "orbax-checkpoint", "tqdm"}
  examples = tomllib.loads((ROOT / "examples" / "pyproject.toml").read_text())["project"]
  assert examples["scripts"] == {"jmp-train": "jmp_train_examples.cli:main"}
  assert any(d.startswith("tqdm") for d in examples["dependencies"])
  assert {re.split(r"[<>=]", d)[0] for d in examples["optional-dependencies"]["full"]} == {"matplotlib", "scikit-learn"}
  extras = config["project"]["optional-dependencies"]
  assert any(d.startswith("matplotlib") for d in extras["plot"])
  assert any(d.startswith("orbax-checkpoint") for d in extras["checkpoint"])


_NO_EXTRAS = textwrap.dedent("""
    import sys
    sys.path.insert(0, sys.argv[1])
    for name in ("matplotlib", "sklearn", "orbax", "orbax.checkpoint", "jmp"):
      sys.modules[name] = None  # as if not installed
    import jmp_train
    from jmp_train_examples import cli
    try:
      cli.main(["--help"])
    except SystemExit as e:
      sys.exit(e.code)
""")


def test_library_and_console_script_import_without_the_extras(tmp_path):
  script = tmp_path / "no_extras.py"
  script.write_text(_NO_EXTRAS)
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  env["JAX_PLATFORMS"] = "cpu"
  result = subprocess.run(
    [sys.executable, str(script), str(ROOT)], env=env, capture_output=True, text=True, timeout=120
  )
  assert result.returncode == 0, result.stderr[-3000:]
  assert "usage" in result.stdout.lower()
