"""Models, inputs and jaxpr helpers shared by the autocast tests (test_autocast*.py)."""

from __future__ import annotations

import collections
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jmp_train_examples import models

from helpers.flax_policy import fill

F16, BF16, F32 = np.dtype(jnp.float16), np.dtype(jnp.bfloat16), np.dtype(jnp.float32)
HALF = [F16, BF16]
POLICIES = {F16: "mixed_float16", BF16: "mixed_bfloat16"}
MATMULS = ("dot_general", "conv_general_dilated")

X_IMG = jnp.linspace(0.0, 1.0, 8 * 64, dtype=jnp.float32).reshape(8, 64)
TOKENS = (jnp.arange(2 * 8, dtype=jnp.int32).reshape(2, 8) * 7) % 32


def _flax_cases():
  return {
    "mlp": (models.MLP(features=(32, 32)), X_IMG),
    "resnet": (models.ResNet(num_classes=8, stage_features=(8, 16)), X_IMG),
    "transformer": (
      models.TransformerBlock(vocab_size=32, d_model=16, num_heads=2, mlp_dim=32, max_len=8),
      TOKENS,
    ),
  }


@functools.cache
def _flax_variables(name):
  """Float32 variables of a ``_flax_cases()`` model, filled by NumPy (no compile)."""
  model, x = _flax_cases()[name]
  return fill(jax.eval_shape(model.init, jax.random.key(0), x))


def _eqns(jaxpr):
  """Every equation, sub-jaxprs included."""
  for eqn in jaxpr.eqns:
    yield eqn
    for sub in jax.extend.core.jaxprs_in_params(eqn.params):
      yield from _eqns(sub)


def _dtypes_of(fn, *args, names=MATMULS):
  """The set of output dtypes of the primitives ``names`` in ``fn``'s jaxpr."""
  jaxpr = jax.make_jaxpr(fn)(*args).jaxpr
  return {np.dtype(e.outvars[0].aval.dtype) for e in _eqns(jaxpr) if e.primitive.name in names}


def _matmul_signature(report):
  """The (phase, op, dtypes) counts of a ``diag.tensor_core_report``."""
  return collections.Counter(
    (e.phase, e.op, e.lhs_dtype.name, e.rhs_dtype.name, e.out_dtype.name) for e in report.entries
  )


def _rel_err(a, b):
  a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
  return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-12))


def _xent(logits, labels):
  return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
