"""Shared hyperparameter functions: what counts as a plain zero, and the array hint."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jmp_train._src.hyperparams import is_static_zero, static_hint


@pytest.mark.parametrize(
  "value, zero",
  [
    (0, True),
    (0.0, True),
    (np.float32(0), True),
    (1e-4, False),
    (False, False),
    (jnp.zeros(()), False),
    (np.zeros(()), False),
    (None, False),
  ],
)
def test_only_plain_zeros_are_static(value, zero):
  # An array may be an injected hyperparameter whose value changes later.
  assert is_static_zero(value) is zero


def test_static_hint_names_inject_hyperparams_for_arrays_only():
  assert "static_args" in static_hint(jnp.int32(3))
  assert "static_args" in static_hint(np.asarray(3))
  assert static_hint(3) == "" and static_hint("3") == ""
  seen = []
  jax.jit(lambda x: seen.append(static_hint(x)) or x)(jnp.int32(3))
  assert "static_args" in seen[0]  # a tracer is an array too
