"""Models, variables and jaxpr helpers shared by the flax policy tests (test_flax_policy*.py)."""

from __future__ import annotations

import collections

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.extend import core as jex_core

import jmp_train.flax as jflax
from jmp_train_examples import models

from helpers.fill import fill  # noqa: F401  (the flax policy tests import it from here)


F16, BF16, F32 = np.dtype(jnp.float16), np.dtype(jnp.bfloat16), np.dtype(jnp.float32)
HALF = [F16, BF16]
MATMULS = ("dot_general", "conv_general_dilated")
# Primitives of softmax and of normalization statistics.
FRAGILE = ("exp", "reduce_max", "rsqrt")

# Tiny, Tensor-Core-shaped (multiples of 8) versions of the example models.
X_IMG = jnp.linspace(0.0, 1.0, 4 * 64, dtype=jnp.float32).reshape(4, 64)
TOKENS = (jnp.arange(2 * 8, dtype=jnp.int32).reshape(2, 8) * 7) % 32


def _resnet():
  return models.ResNet(num_classes=8, stage_features=(8, 16))


def _nnx_resnet():
  return models.NNXResNet(1, 8, (8, 16), rngs=nnx.Rngs(0))


def _transformer():
  return models.TransformerBlock(vocab_size=32, d_model=32, num_heads=4, mlp_dim=64, max_len=8)


def _nnx_transformer():
  return models.NNXTransformerBlock(vocab_size=32, d_model=32, num_heads=4, mlp_dim=64, max_len=8, rngs=nnx.Rngs(0))


MODELS = {
  "resnet": (_resnet, _nnx_resnet, X_IMG),
  "transformer": (_transformer, _nnx_transformer, TOKENS),
}


def make_linen_variables():
  """Float32 variables of each linen model (no compilation)."""
  return {name: fill(jax.eval_shape(make().init, jax.random.key(0), x)) for name, (make, _, x) in MODELS.items()}


def nnx_twin(name, variables):
  """The NNX twin holding the linen variables (built abstractly, no compile)."""
  abstract = nnx.eval_shape(MODELS[name][1])
  return models.nnx_with_linen_variables(abstract, variables)


# --------------------------------------------------------------------------
# Jaxpr inspection.
# --------------------------------------------------------------------------


def _eqns(jaxpr):
  for eqn in jaxpr.eqns:
    yield eqn
    for param in eqn.params.values():
      for sub in param if isinstance(param, (list, tuple)) else (param,):
        if isinstance(sub, jex_core.ClosedJaxpr):
          yield from _eqns(sub.jaxpr)
        elif isinstance(sub, jex_core.Jaxpr):
          yield from _eqns(sub)


def _operand_dtypes(closed_jaxpr, primitives):
  """Counter of (primitive, operand dtypes) over the jaxpr and sub-jaxprs."""
  counts = collections.Counter()
  for eqn in _eqns(closed_jaxpr.jaxpr):
    if eqn.primitive.name in primitives:
      dtypes = tuple(np.dtype(v.aval.dtype) for v in eqn.invars)
      counts[(eqn.primitive.name, dtypes)] += 1
  return counts


def _forward_and_grad_jaxprs(style, name, policy, variables, **kwargs):
  """Jaxprs of the policy'd model's forward pass and of its parameter grads.

  ``variables``: the float32 linen variables (the NNX twin gets them too).
  """
  make, _, x = MODELS[name]
  if style == "linen":
    model = jflax.apply_policy(make(), policy, **kwargs)
    params = variables["params"]
    rest = {k: v for k, v in variables.items() if k != "params"}

    def forward(p):
      return model.apply({"params": p, **rest}, x)

    fwd = jax.make_jaxpr(forward)(params)
    grad = jax.make_jaxpr(jax.grad(lambda p: jnp.sum(forward(p))))(params)
    return fwd, grad
  model = jflax.apply_policy(nnx_twin(name, variables), policy, **kwargs)
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)

  def forward(p):
    return nnx.merge(graphdef, p, rest)(x)

  fwd = jax.make_jaxpr(forward)(params)
  grad = jax.make_jaxpr(jax.grad(lambda p: jnp.sum(forward(p))))(params)
  return fwd, grad
