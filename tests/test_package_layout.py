"""The library's folders show its concerns, and imports between them run one way."""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).parent.parent
SRC = ROOT / "jmp_train" / "_src"
PACKAGES = sorted(p.name for p in SRC.iterdir() if (p / "__init__.py").is_file())


def _imports(path: pathlib.Path) -> set[str]:
  """The ``jmp_train._src`` modules and packages ``path`` imports, anywhere in it."""
  found = set()
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("jmp_train._src"):
      found.update(f"{node.module}.{a.name}" for a in node.names)
      found.add(node.module)
    elif isinstance(node, ast.Import):
      found.update(a.name for a in node.names if a.name.startswith("jmp_train._src"))
  return found


def _concern(dotted: str) -> str | None:
  """The concern package a dotted ``jmp_train._src`` name lies in, or None (shared)."""
  parts = dotted.split(".")
  return parts[2] if len(parts) > 2 and parts[2] in PACKAGES else None


def _package_graph() -> dict[str, set[str]]:
  graph: dict[str, set[str]] = {p: set() for p in PACKAGES}
  for path in SRC.rglob("*.py"):
    rel = path.relative_to(SRC)
    source = rel.parts[0] if len(rel.parts) > 1 else None
    for name in _imports(path):
      target = _concern(name)
      if source is not None and target is not None and target != source:
        graph[source].add(target)
  return graph


def test_the_top_level_holds_only_shared_helpers():
  modules = sorted(p.name for p in SRC.glob("*.py") if p.name != "__init__.py")
  assert len(modules) <= 12, modules
  for name in modules:
    used = {_concern(n) for n in _imports(SRC / name)} - {None}
    assert not used, f"the shared helper {name} imports the concern packages {used}"


def test_no_import_cycle_between_concerns():
  graph = _package_graph()

  def reaches(start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
      for nxt in graph[todo.pop()] - seen:
        seen.add(nxt)
        todo.append(nxt)
    return seen

  for package in PACKAGES:
    assert package not in reaches(package), (package, graph)


@pytest.mark.parametrize("package", PACKAGES)
def test_each_package_docstring_names_its_modules(package):
  init = SRC / package / "__init__.py"
  doc = ast.get_docstring(ast.parse(init.read_text())) or ""
  assert len(doc.splitlines()) <= 60
  for module in sorted((SRC / package).glob("*.py")):
    if module.name != "__init__.py" and not module.name.startswith("_"):
      assert f"``{module.stem}``" in doc, f"{package}/__init__.py does not name {module.stem}"


def test_examples_benchmarks_and_notebooks_use_public_names_only():
  # What users read as examples imports what users can import.
  for folder in ("examples", "benchmarks", "notebooks"):
    for path in sorted((ROOT / folder).rglob("*")):
      if path.suffix in (".py", ".ipynb", ".md") and "egg-info" not in str(path):
        assert "_src" not in path.read_text(), f"{path.relative_to(ROOT)} reaches into jmp_train._src"


def test_the_checkpoint_modules_are_small_and_one_concern_each():
  # Saving, restoring, checksums, folder checks, the array store, orbax itself.
  modules = {p.stem: len(p.read_text().splitlines()) for p in sorted((SRC / "train").glob("checkpoint*.py"))}
  assert {"checkpoint", "checkpoint_restore", "checkpoint_checksums", "checkpoint_folders"} <= set(modules), modules
  for name, lines in modules.items():
    assert lines < 400, f"{name}.py has {lines} lines: split it by concern (under 400 lines each)"
