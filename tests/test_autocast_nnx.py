"""Tests for jmp_train.autocast on functions of Flax NNX modules: their state updates."""

from __future__ import annotations

import functools

import jax
import jax.flatten_util
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jmp_train._src.autocast.transform import autocast

from helpers.autocast import BF16, F32, _eqns, _rel_err, _xent


class _CNN(nnx.Module):
  """The NNX MNIST tutorial's CNN, small: Conv, BatchNorm, Dropout, Linear."""

  def __init__(self, rngs):
    self.conv = nnx.Conv(1, 4, kernel_size=(3, 3), rngs=rngs)
    self.bn = nnx.BatchNorm(4, rngs=rngs)
    self.dropout = nnx.Dropout(0.25, rngs=rngs)
    self.linear = nnx.Linear(4 * 6 * 6, 10, rngs=rngs)

  def __call__(self, x):
    x = nnx.relu(self.bn(self.conv(x)))
    return self.linear(self.dropout(x).reshape(x.shape[0], -1))


def _model():
  """A fresh model in training mode, the same each time."""
  model = _CNN(nnx.Rngs(0, dropout=1))
  # Running statistics with all of float32's digits: a half-precision cast
  # of them (about 3 significant digits) would show in their update.
  model.bn.mean[...] = jnp.linspace(0.1234567, 0.7654321, 4)
  model.bn.var[...] = jnp.linspace(1.1234567, 1.7654321, 4)
  return model


_BATCH = {
  "image": jnp.sin(jnp.arange(8 * 6 * 6, dtype=jnp.float32)).reshape(8, 6, 6, 1),
  "label": jnp.arange(8) % 10,
}


def _loss_fn(model, batch):
  logits = model(batch["image"])
  return _xent(logits, batch["label"]), logits


def _state(model):
  """The state a training step updates: BatchNorm's statistics, Dropout's RNG count."""
  return model.bn.mean[...], model.bn.var[...], model.dropout.rngs.count[...]


def _train(loss_fn, steps=2):
  """The tutorial's step, under ``nnx.jit``: ``(model, losses, last grads)``."""
  model = _model()

  @nnx.jit
  def step(model, batch):
    grad_fn = nnx.value_and_grad(loss_fn, has_aux=True)
    (loss, logits), grads = grad_fn(model, batch)
    return loss, logits, grads

  losses = []
  for _ in range(steps):
    loss, logits, grads = step(model, _BATCH)
    losses.append(loss)
  assert logits.dtype == F32
  return model, losses, grads


@functools.cache
def _reference():
  """The same training steps without autocast."""
  model, losses, grads = _train(_loss_fn)
  return _state(model), losses, grads


def _check_grads(grads, grads_ref, tol):
  assert isinstance(grads, nnx.State)
  variables = jax.tree.leaves(grads, is_leaf=lambda x: isinstance(x, nnx.Variable))
  assert variables and all(isinstance(v, nnx.Param) for v in variables)
  assert jax.tree.structure(grads) == jax.tree.structure(grads_ref)
  assert all(g.dtype == F32 and np.any(np.asarray(g) != 0) for g in jax.tree.leaves(grads))
  # All together: the convolution's bias gradient is rounding noise (the
  # BatchNorm after it cancels the bias).
  flat, flat_ref = (jax.flatten_util.ravel_pytree(g)[0] for g in (grads, grads_ref))
  assert _rel_err(flat, flat_ref) <= tol, _rel_err(flat, flat_ref)


def test_value_and_grad_in_nnx_jit_keeps_state_updates_exactly_in_float32():
  (mean_ref, var_ref, count_ref), losses_ref, grads_ref = _reference()
  model, losses, grads = _train(autocast(_loss_fn, "float32"))
  mean, var, count = _state(model)
  assert int(count) == int(count_ref) == 2
  np.testing.assert_array_equal(mean, mean_ref)
  np.testing.assert_array_equal(var, var_ref)
  np.testing.assert_allclose(losses, losses_ref, rtol=1e-6)
  _check_grads(grads, grads_ref, tol=1e-6)


def test_value_and_grad_in_nnx_jit_keeps_state_updates_in_mixed_bfloat16():
  (mean_ref, var_ref, count_ref), losses_ref, grads_ref = _reference()
  mean0, var0, _ = _state(_model())
  model, losses, grads = _train(autocast(_loss_fn, "mixed_bfloat16"))
  mean, var, count = _state(model)
  assert int(count) == int(count_ref) == 2
  assert mean.dtype == var.dtype == F32
  assert np.all(np.asarray(mean) != np.asarray(mean0))
  assert np.all(np.asarray(var) != np.asarray(var0))
  # The running statistics are updated in float32: only the batch's
  # statistics (weight 1 - momentum) carry the bfloat16 convolution's
  # rounding, not the old statistics (weight momentum).
  np.testing.assert_allclose(mean, mean_ref, rtol=1e-4)
  np.testing.assert_allclose(var, var_ref, rtol=1e-4)
  assert all(loss.dtype == F32 for loss in losses)
  np.testing.assert_allclose(losses, losses_ref, rtol=2e-2)
  _check_grads(grads, grads_ref, tol=5e-2)


_jit_call = nnx.jit(lambda m, x: m(x))


@pytest.mark.parametrize("policy", ["float32", "mixed_bfloat16"])
def test_plain_call_updates_the_module(policy):
  x = _BATCH["image"][:4]
  model_ref, model = _model(), _model()
  out_ref = _jit_call(model_ref, x)  # the reference under nnx.jit: one compile, same updates
  out = autocast(lambda m, x: m(x), policy)(model, x)
  mean, var, count = _state(model)
  mean_ref, var_ref, count_ref = _state(model_ref)
  assert int(count) == int(count_ref) == 1
  assert mean.dtype == var.dtype == out.dtype == F32
  if policy == "float32":
    np.testing.assert_array_equal(mean, mean_ref)
    np.testing.assert_array_equal(var, var_ref)
    np.testing.assert_allclose(out, out_ref, rtol=1e-6, atol=1e-6)
  else:
    np.testing.assert_allclose(mean, mean_ref, rtol=1e-4)
    np.testing.assert_allclose(var, var_ref, rtol=1e-4)
    assert _rel_err(out, out_ref) < 2e-2
  # Evaluation mode: nothing changes.
  model.eval()
  before = _state(model)
  autocast(lambda m, x: m(x), policy)(model, x)
  for a, b in zip(before, _state(model)):
    np.testing.assert_array_equal(a, b)


def test_modules_in_kwargs_shared_and_variables_are_updated():
  x = jnp.ones((2, 4))
  layer = nnx.Linear(4, 4, rngs=nnx.Rngs(0))
  counter = nnx.Variable(jnp.zeros((), jnp.int32))
  kernel = layer.kernel[...]

  def fn(first, x, *, second, counter):
    counter[...] += 1
    # `second` is the same layer as `first`, a parameter argument: its
    # kernel is a parameter, read and written in float32.
    second.kernel[...] = second.kernel[...] * 2
    second.sown = nnx.Intermediate(second(x))  # a new Variable: added to the layer
    return first(x)

  out = autocast(fn, "mixed_bfloat16")(layer, x, second=layer, counter=counter)
  assert int(counter[...]) == 1
  np.testing.assert_array_equal(layer.kernel[...], 2 * kernel)
  assert layer.kernel.dtype == layer.sown.dtype == out.dtype == F32
  assert _rel_err(out, x @ (2 * kernel) + layer.bias[...]) < 2e-2


def test_unchanged_parameters_come_back_unrounded():
  # Parameters cast to a bfloat16 param_dtype, and a module's parameters
  # taken as (bfloat16) activations: read in bfloat16, left as they were.
  x = jnp.ones((2, 4))
  for policy, params_argnums in (("p=bf16,c=bf16,o=f32", 0), ("mixed_bfloat16", None)):
    layer = nnx.Linear(4, 4, rngs=nnx.Rngs(0))
    kernel = layer.kernel[...]
    assert jnp.any(kernel.astype(BF16).astype(F32) != kernel)
    autocast(lambda m, x: m(x), policy, params_argnums=params_argnums)(layer, x)
    np.testing.assert_array_equal(layer.kernel[...], kernel)


def test_params_of_the_module_at_params_argnums_are_parameters():
  # An embedding lookup on a parameter gathers rows in param_dtype; on an
  # activation (the module not at params_argnums) in the compute dtype.
  model = nnx.Embed(16, 8, rngs=nnx.Rngs(0))
  graphdef, state = nnx.split(model)
  tokens = jnp.arange(6)

  def gather_dtypes(params_argnums):
    cast = autocast(lambda m, t: m(t), "mixed_bfloat16", params_argnums=params_argnums)
    jaxpr = jax.make_jaxpr(lambda s: cast(nnx.merge(graphdef, s), tokens))(state).jaxpr
    return {np.dtype(e.invars[0].aval.dtype) for e in _eqns(jaxpr) if e.primitive.name == "gather"}

  assert gather_dtypes(0) == {F32}
  assert gather_dtypes(None) == {BF16}


def test_unsupported_uses_raise_type_errors():
  layer = nnx.Linear(4, 4, rngs=nnx.Rngs(0))
  x = jnp.ones((2, 4))
  with pytest.raises(TypeError, match="nnx.state"):
    autocast(lambda m, x: (m(x), m), "mixed_bfloat16")(layer, x)

  def set_static(m, x):
    m.calls = 1  # a static attribute: lost in the traced copy
    return m(x)

  with pytest.raises(TypeError, match="static attribute"):
    autocast(set_static, "mixed_bfloat16")(layer, x)

  norm = nnx.BatchNorm(4, rngs=nnx.Rngs(0))
  with pytest.raises(TypeError, match="Pass the module as an argument"):
    autocast(lambda x: norm(x), "mixed_bfloat16")(x)  # closed over: updates it in the trace
