"""The documentation site: API pages from ``__all__``, toctrees, the build.

The tests run the page generator of ``docs/_ext/jmp_api.py`` into a
temporary folder and read the toctrees of ``docs/*.md``; they need no
Sphinx. ``make docs`` (run by CI) builds the whole site with warnings as
errors, nitpicky.
"""

import fnmatch
import importlib
import inspect
import re
import runpy
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
sys.path.insert(0, str(DOCS / "_ext"))

import jmp_api  # noqa: E402  (docs/_ext is not a package)

NAMESPACES = ("jmp_train", "jmp_train.flax", "jmp_train.diagnostics", "jmp_train.int8")
_DIRECTIVE = re.compile(r"^\.\. (autoclass|autofunction|autodata):: (\S+)$", re.M)


def _toctree_entries(page: Path) -> list[str]:
  """The entries of every ```{toctree}`` block of a MyST page."""
  entries = []
  for block in re.findall(r"```\{toctree\}\n(.*?)```", page.read_text(), re.S):
    entries += [line.strip() for line in block.splitlines() if line.strip() and not line.startswith(":")]
  return entries


def _listed(docname: str, entries: list[str], prefix: str = "") -> bool:
  return any(fnmatch.fnmatchcase(docname, prefix + entry) for entry in entries)


@pytest.fixture(scope="module")
def api_pages(tmp_path_factory):
  return jmp_api.api_pages(tmp_path_factory.mktemp("api"))


def test_every_public_name_has_one_entry(api_pages):
  documented = {}
  for text in api_pages.values():
    for kind, target in _DIRECTIVE.findall(text):
      assert target not in documented, f"{target} is documented twice"
      documented[target] = kind
  expected = {f"{ns}.{name}" for ns in NAMESPACES for name in importlib.import_module(ns).__all__}
  assert set(documented) == expected


def test_entries_resolve_to_the_public_objects(api_pages):
  for text in api_pages.values():
    for kind, target in _DIRECTIVE.findall(text):
      namespace, _, name = target.rpartition(".")
      obj = getattr(importlib.import_module(namespace), name)
      want = "autoclass" if inspect.isclass(obj) else "autofunction" if callable(obj) else "autodata"
      assert kind == want, target


def test_top_level_names_are_grouped_by_concern():
  sections = dict((ns, s) for _, ns, _, s in jmp_api.NAMESPACES)
  for namespace in NAMESPACES:
    for name, origin in jmp_api.source_modules(namespace).items():
      section = jmp_api._section(origin, sections[namespace])
      assert section != "Other", (
        f"{namespace}.{name} comes from {origin!r}, which no section of "
        f"NAMESPACES in docs/_ext/jmp_api.py names: add it there."
      )


def test_toctree_lists_every_notebook(tmp_path):
  stems = jmp_api.copy_notebooks(dst=tmp_path)
  assert stems == sorted(p.stem for p in (ROOT / "notebooks").glob("*.ipynb"))
  assert len(stems) >= 5
  entries = _toctree_entries(DOCS / "notebooks.md")
  for stem in stems:
    assert _listed(f"_notebooks/{stem}", entries), stem
  assert jmp_api.NOTEBOOKS_DIR == DOCS / "_notebooks"


def _quick_start(path: Path) -> str:
  text = path.read_text()
  match = re.search(r"^## Quick start\n.*?```python\n(.*?)```", text, re.S | re.M)
  assert match, f"{path.name} has no quick start block"
  return match.group(1)


def test_landing_page_quick_start_is_the_tested_one():
  # tests/test_demo.py runs README.md's block; the landing page shows a copy.
  assert _quick_start(DOCS / "index.md") == _quick_start(ROOT / "README.md")


def test_notebooks_are_not_executed():
  conf = runpy.run_path(str(DOCS / "conf.py"))
  assert conf["nb_execution_mode"] == "off"
  assert {"myst_nb", "sphinx.ext.autodoc", "sphinx.ext.napoleon", "jmp_api"} <= set(conf["extensions"])
  assert conf["nitpicky"]
