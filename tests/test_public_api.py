"""Every public name is importable, documented and exercised by a test."""

import inspect
import pathlib
import re

import pytest

import jmp_train
import jmp_train.diagnostics
import jmp_train.flax
import jmp_train.int8

TESTS = pathlib.Path(__file__).parent
PUBLIC_MODULES = [jmp_train, jmp_train.flax, jmp_train.diagnostics, jmp_train.int8]
PUBLIC = [(m, name) for m in PUBLIC_MODULES for name in m.__all__]


def _test_sources() -> str:
  own = pathlib.Path(__file__).name
  return "\n".join(p.read_text() for p in sorted(TESTS.glob("*.py")) if p.name != own)


@pytest.mark.parametrize("module", PUBLIC_MODULES, ids=lambda m: m.__name__)
def test_all_is_sorted_free_of_duplicates_and_importable(module):
  names = list(module.__all__)
  assert len(names) == len(set(names)), names
  for name in names:
    assert hasattr(module, name), f"{module.__name__}.{name} is in __all__ but missing"


def test_version():
  assert re.fullmatch(r"\d+\.\d+\.\d+", jmp_train.__version__)


@pytest.mark.parametrize("module, name", PUBLIC, ids=[f"{m.__name__}.{n}" for m, n in PUBLIC])
def test_public_name_is_documented_and_tested(module, name):
  obj = getattr(module, name)
  if inspect.isclass(obj) or callable(obj):
    doc = inspect.getdoc(obj) or ""
    assert len(doc.split()) >= 5, f"{module.__name__}.{name} needs a docstring"
  assert re.search(rf"\b{re.escape(name)}\b", _test_sources()), f"{module.__name__}.{name} is not used by any test"


def test_import_and_help_load_no_jax():
  # Names load on first use: `import jmp_train` and `jmp-train --help` stay
  # fast (no JAX, no Flax), and a name, once used, is a plain attribute.
  import subprocess
  import sys

  code = (
    "import sys, jmp_train, runpy\n"
    "assert 'jax' not in sys.modules and 'flax' not in sys.modules\n"
    "sys.argv = ['jmp-train', '--help']\n"
    "try:\n"
    "  runpy.run_module('jmp_train_examples', run_name='__main__')\n"
    "except SystemExit:\n"
    "  pass\n"
    "assert 'jax' not in sys.modules, 'help imported jax'\n"
    "jmp_train.Policy\n"
    "assert 'Policy' in vars(jmp_train)\n"
  )
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
  assert out.returncode == 0, out.stderr
  assert "usage: jmp-train" in out.stdout


def test_unknown_attribute_raises_attribute_error():
  with pytest.raises(AttributeError, match="no_such_name"):
    jmp_train.no_such_name  # noqa: B018


def test_type_checkers_see_every_public_name_where_it_loads():
  # The TYPE_CHECKING block of jmp_train/__init__.py is the one list of
  # public names: each an explicit re-export (``import x as x``) of the
  # object the name is at run time, from the library's own modules.
  import ast
  import importlib

  tree = ast.parse(pathlib.Path(jmp_train.__file__).read_text())
  block = next(n for n in tree.body if isinstance(n, ast.If) and getattr(n.test, "id", None) == "TYPE_CHECKING")
  seen = {}
  for node in block.body:
    assert isinstance(node, ast.ImportFrom), ast.dump(node)
    assert node.module == "jmp_train" or node.module.startswith("jmp_train._src."), node.module
    for alias in node.names:
      assert alias.asname == alias.name, alias.name
      seen[alias.name] = node.module
  assert set(seen) == set(jmp_train.__all__) | {"diagnostics", "flax", "int8"}
  for name, module in seen.items():
    assert getattr(jmp_train, name) is getattr(importlib.import_module(module), name), name


def test_each_public_name_is_exported_once():
  # A name lives in one public namespace: jmp_train, jmp_train.flax or
  # jmp_train.diagnostics (collective_bytes is a diagnostic).
  names = [n for m in PUBLIC_MODULES for n in m.__all__]
  assert len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)


@pytest.mark.slow
def test_a_type_checker_resolves_public_names_from_a_users_file(tmp_path):
  # mypy reads the TYPE_CHECKING block (and py.typed): the names have real
  # signatures in a user's editor, not Any.
  import subprocess
  import sys

  user = tmp_path / "user.py"
  user.write_text(
    "import jmp_train\nimport jmp_train.diagnostics\nimport jmp_train.flax\n"
    "reveal_type(jmp_train.loss_scaled)\n"
    "reveal_type(jmp_train.flax.apply_policy)\n"
    "reveal_type(jmp_train.diagnostics.precision_audit)\n"
  )
  # Our modules are read in full; the libraries under them are skipped (their
  # types become Any): what is checked is that our own signatures resolve.
  config = tmp_path / "mypy.ini"
  config.write_text(
    "[mypy]\nfollow_imports = silent\n"
    "[mypy-jax.*,jaxlib.*,flax.*,optax.*,chex.*,numpy.*,orbax.*,ml_dtypes.*,scipy.*]\n"
    "follow_imports = skip\n"
  )
  done = subprocess.run(
    [
      sys.executable,
      "-m",
      "mypy",
      "--config-file",
      str(config),
      "--no-incremental",
      "--cache-dir",
      str(tmp_path / "cache"),
      str(user),
    ],
    cwd=TESTS.parent,
    capture_output=True,
    text=True,
    timeout=600,
  )
  revealed = [line for line in done.stdout.splitlines() if "Revealed type" in line]
  assert len(revealed) == 3, done.stdout + done.stderr
  assert "loss_scale: jmp_train._src.loss_scaling.scales.LossScale" in revealed[0], revealed[0]
  assert "policy: jmp_train._src.policy.policy.Policy | str" in revealed[1], revealed[1]
  assert "-> jmp_train._src.diagnostics.precision_audit.PrecisionReport" in revealed[2], revealed[2]
