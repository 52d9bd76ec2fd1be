"""Tests for jmp_train._src.loss_scaling.scaled_grad and jmp_train._src.loss_scaling.lookup.

scaled_value_and_grad, get_loss_scale, loss_scale_metrics.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jmp_train
from jmp_train import DynamicLossScale
from jmp_train import LossScaledState
from jmp_train import StaticLossScale
from jmp_train import get_loss_scale
from jmp_train import loss_scale_metrics
from jmp_train import loss_scaled
from jmp_train import scaled_value_and_grad
from helpers.loss_scaling import DTYPES


# --- get_loss_scale / metrics / scaled_value_and_grad ------------------------


def test_get_loss_scale_errors_name_the_problem():
  with pytest.raises(ValueError, match="found no LossScaledState"):
    get_loss_scale(optax.adam(1e-3).init({"w": jnp.zeros(2)}))
  two = optax.chain(
    loss_scaled(optax.sgd(0.1), StaticLossScale(2.0)), loss_scaled(optax.sgd(0.1), StaticLossScale(4.0))
  )
  with pytest.raises(ValueError, match="found 2 LossScaledState"):
    loss_scale_metrics(two.init({"w": jnp.zeros(2)}))
  nested = loss_scaled(loss_scaled(optax.sgd(0.1), StaticLossScale(2.0)), StaticLossScale(4.0))
  with pytest.raises(ValueError, match="found 2 LossScaledState"):
    get_loss_scale(nested.init({"w": jnp.zeros(2)}))


def test_get_loss_scale_in_multisteps_state():
  params = {"w": jnp.zeros(2)}
  inner = optax.MultiSteps(loss_scaled(optax.sgd(0.1), StaticLossScale(2.0)), 2)
  assert float(get_loss_scale(inner.init(params)).loss_scale) == 2.0
  state = loss_scaled(optax.sgd(0.1), StaticLossScale(2.0)).init(params)
  assert isinstance(state, LossScaledState)
  assert get_loss_scale(state) is state.loss_scale


@pytest.mark.parametrize("dtype", DTYPES)
def test_scaled_value_and_grad(dtype):
  def loss_fn(w, x, *, offset):
    loss = jnp.sum((w * x) ** 2).astype(dtype) + offset
    return loss, {"twice": 2 * loss}

  w = jnp.array([0.5, -1.0, 2.0], dtype)
  x = jnp.array([1.0, 2.0, 0.25], dtype)
  g = scaled_value_and_grad(loss_fn, has_aux=True, argnums=(0, 1))
  (loss, aux), (gw, gx) = jax.jit(g)(StaticLossScale(2.0**8), w, x, offset=1.0)
  ref_loss, ref_aux = loss_fn(w, x, offset=1.0)
  assert loss.dtype == dtype
  np.testing.assert_array_equal(loss, ref_loss)  # unscaled, exactly
  np.testing.assert_array_equal(aux["twice"], ref_aux["twice"])
  (_, _), (rw, rx) = jax.value_and_grad(loss_fn, argnums=(0, 1), has_aux=True)(w, x, offset=1.0)
  assert gw.dtype == gx.dtype == dtype
  np.testing.assert_array_equal(np.asarray(gw, np.float32), np.asarray(rw, np.float32) * 2.0**8)
  np.testing.assert_array_equal(np.asarray(gx, np.float32), np.asarray(rx, np.float32) * 2.0**8)
  # A plain number, a scalar array or the whole state work as the scale.
  _, g2 = scaled_value_and_grad(lambda w: jnp.sum(w))(4.0, w)
  np.testing.assert_array_equal(np.asarray(g2, np.float32), [4.0] * 3)
  state = loss_scaled(optax.sgd(0.1), StaticLossScale(2.0)).init(w)
  _, g3 = scaled_value_and_grad(lambda w: jnp.sum(w))(state, w)
  np.testing.assert_array_equal(np.asarray(g3, np.float32), [2.0] * 3)
  with pytest.raises(ValueError, match="positive scalar"):
    scaled_value_and_grad(lambda w: jnp.sum(w))(-1.0, w)
  with pytest.raises(TypeError, match="needs a callable fun, got int: 5"):
    scaled_value_and_grad(5)
  with pytest.raises(TypeError, match="needs a callable value_and_grad, got str"):
    scaled_value_and_grad(jnp.sum, value_and_grad="grad")


def test_float16_loss_overflow_is_caught_and_backed_off():
  # An end-to-end float16 case: a scale too large for the float16 loss
  # produces inf gradients, the step is skipped, the scale halves until the
  # step goes through.
  tx = loss_scaled(optax.sgd(0.1), DynamicLossScale(2.0**24, growth_interval=1000))
  grad_fn = scaled_value_and_grad(lambda w: jnp.sum(w.astype(jnp.float16) ** 2))
  w = jnp.array([3.0, 4.0], jnp.float16)
  state = tx.init(w)

  @jax.jit
  def step(w, state):
    _, grads = grad_fn(get_loss_scale(state), w)
    updates, state = tx.update(grads, state, w)
    return optax.apply_updates(w, updates), state

  w1 = w
  for _ in range(14):
    w1, state = step(w1, state)
  # The float16 gradient S * 2w = S * [6, 8] overflows 65504 for every
  # S >= 2**13: 12 skips from 2**24 down to 2**13, then two steps at 2**12.
  assert int(state.total_notfinite) == 12
  assert int(state.notfinite_count) == 0
  assert float(state.loss_scale.loss_scale) == 2.0**12
  np.testing.assert_allclose(np.asarray(w1, np.float32), [1.92, 2.56], rtol=2e-3)  # w * (1 - 0.1 * 2) ** 2


def test_exported_names():
  for name in ["loss_scaled", "LossScaledState", "get_loss_scale", "loss_scale_metrics", "scaled_value_and_grad"]:
    assert name in jmp_train.__all__ and hasattr(jmp_train, name)


def _power_loss(w, x, n_terms, *, power):
  # n_terms and power are Python values (range, **): they must be static.
  return sum(jnp.sum((w * x) ** power) for _ in range(n_terms))


def test_scaled_value_and_grad_signature_has_the_loss_scale_first():
  import inspect

  g = scaled_value_and_grad(_power_loss)
  params = list(inspect.signature(g).parameters.values())
  assert [p.name for p in params] == ["loss_scale", "w", "x", "n_terms", "power"]
  assert params[0].kind is inspect.Parameter.POSITIONAL_ONLY
  # A function with its own `loss_scale` parameter keeps it.
  own = scaled_value_and_grad(lambda loss_scale, w: loss_scale * jnp.sum(w))
  assert list(inspect.signature(own).parameters) == ["loss_scale_", "loss_scale", "w"]


@pytest.mark.parametrize(
  "static",
  [
    dict(static_argnums=(3,), static_argnames=("power",)),
    dict(static_argnames=("n_terms", "power")),
  ],
  ids=["static_argnums", "static_argnames"],
)
def test_scaled_value_and_grad_under_jit_with_static_arguments(static):
  # As jax.value_and_grad of the same function under jit: the same static
  # arguments by name, the numbers shifted by one for the loss scale.
  w, x = jnp.array([0.5, -1.0]), jnp.array([2.0, 3.0])
  ref_static = dict(static)
  if "static_argnums" in ref_static:
    ref_static["static_argnums"] = tuple(i - 1 for i in static["static_argnums"])
  ref_loss, ref_grads = jax.jit(jax.value_and_grad(_power_loss), **ref_static)(w, x, 3, power=2)
  g = jax.jit(scaled_value_and_grad(_power_loss), **static)
  if "static_argnums" in static:
    loss, grads = g(StaticLossScale(4.0), w, x, 3, power=2)
  else:
    loss, grads = g(StaticLossScale(4.0), w, x, n_terms=3, power=2)
  np.testing.assert_array_equal(loss, ref_loss)
  np.testing.assert_array_equal(grads, ref_grads * 4.0)
