"""Every ``Examples:`` block in the library's docstrings runs and prints what it shows."""

from __future__ import annotations

import doctest
import importlib
import pkgutil

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
      for name in ("jmp_train._src.loss_scaling", "jmp_train._src.remat",
                   "jmp_train._src.policy", "jmp_train._src.diagnostics.histograms",
                   "jmp_train._src.diagnostics.precision_audit")
  }
  for name, tests in attempted.items():
    assert sum(len(t.examples) for t in tests) > 0, name
