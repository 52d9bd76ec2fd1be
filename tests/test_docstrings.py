"""Every ``Examples:`` block in the library's docstrings runs and prints what it shows."""

from __future__ import annotations

import ast
import doctest
import importlib
import inspect
import pathlib
import pkgutil
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jmp_train._src

MODULES = sorted(
  [m.name for m in pkgutil.walk_packages(jmp_train._src.__path__, "jmp_train._src.")]
  + ["jmp_train.flax", "jmp_train.diagnostics"]
)


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
  module = importlib.import_module(name)
  result = doctest.testmod(
    module,
    # The names the examples take for granted, as in the module sources.
    extraglobs={"jax": jax, "jnp": jnp, "np": np},
    optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE,
    report=False,
  )
  assert result.failed == 0, f"{result.failed} of {result.attempted} examples failed in {name}"


def test_the_public_modules_have_examples():
  attempted = {
    name: doctest.DocTestFinder().find(importlib.import_module(name))
    for name in (
      "jmp_train._src.loss_scaling.wrapper",
      "jmp_train._src.policy.remat",
      "jmp_train._src.policy.policy",
      "jmp_train._src.diagnostics.histograms",
      "jmp_train._src.diagnostics.precision_audit",
    )
  }
  for name, tests in attempted.items():
    assert sum(len(t.examples) for t in tests) > 0, name


PUBLIC_MODULES = ("jmp_train", "jmp_train.flax", "jmp_train.diagnostics")


def _docstrings(obj, name):
  """``(name, docstring)`` of ``obj`` and, for a class, of its methods and properties.

  A class's methods inherited from the library's own base classes count (a
  user reads them as the class's); Python's and other libraries' do not.
  """
  yield name, obj.__doc__
  if not inspect.isclass(obj):
    return
  for klass in obj.__mro__:
    if not klass.__module__.startswith("jmp_train"):
      continue
    for attr, value in vars(klass).items():
      if isinstance(value, (staticmethod, classmethod)):
        value = value.__func__
      elif isinstance(value, property):
        value = value.fget
      if inspect.isfunction(value):
        yield f"{name}.{attr}", value.__doc__


def _public_examples():
  """``(public name, example source)`` for every docstring example a user reads."""
  parser = doctest.DocTestParser()
  for module_name in PUBLIC_MODULES:
    module = importlib.import_module(module_name)
    for name in module.__all__:
      obj = getattr(module, name)
      if not (inspect.isclass(obj) or inspect.isroutine(obj)):
        continue  # a constant: its docstring is its type's
      for doc_name, doc in _docstrings(obj, f"{module_name}.{name}"):
        for example in parser.get_examples(doc or ""):
          yield doc_name, example.source


def test_public_examples_use_public_names():
  # The examples show the public API (``import jmp_train``), not the private
  # modules behind it.
  private = sorted({name for name, source in _public_examples() if "jmp_train._src" in source})
  assert not private, f"examples importing jmp_train._src: {private}"


def test_public_examples_are_found():
  names = {name for name, _ in _public_examples()}
  assert {"jmp_train.loss_scaled", "jmp_train.DynamicLossScale", "jmp_train.scale_by_narrow_adam"} <= names


def _source_docstrings(path):
  tree = ast.parse(path.read_text())
  for node in ast.walk(tree):
    if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
      yield getattr(node, "name", "module"), ast.get_docstring(node) or ""


LIBRARY_FILES = sorted(
  p for p in pathlib.Path(jmp_train._src.__file__).parent.parent.rglob("*.py") if "examples" not in p.parts
)


@pytest.mark.parametrize("path", LIBRARY_FILES, ids=lambda p: str(p).split("jmp_train/", 1)[-1])
def test_docstrings_state_contracts_not_history(path):
  # A module docstring a reader takes in at once; no dates, and no paths the
  # wheel does not ship (measurements live in the generated benchmarks report).
  for name, doc in _source_docstrings(path):
    if name == "module":
      assert len(doc.splitlines()) <= 60, f"{path}: module docstring of {len(doc.splitlines())} lines"
    assert not re.search(r"\b20[0-9]{2}-[0-9]{2}-[0-9]{2}\b", doc), f"{path}:{name} has a date"
    assert "benchmarks/" not in doc, f"{path}:{name} cites a benchmarks/ path"
