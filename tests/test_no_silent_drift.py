"""Mistakes that used to train wrong without a word now raise, naming the fix.

A compressor without the step's axis averaged nothing (each replica trained
on its own); a policy without an output dtype computed its outputs in
float64; a loss of the parameters, a compressor on another axis and an
autocast function returning a string gave errors from deep inside.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh

import jmp_train

MODEL = nn.Dense(4)
PARAMS = MODEL.init(jax.random.key(0), jnp.ones((1, 3)))["params"]
BATCH = (jnp.ones((4, 3)), jnp.zeros((4, 4)))


def _mse(outputs, targets):
  return jnp.mean((outputs - targets) ** 2)


def _run(compression, mode, optimizer="sgd"):
  mesh = Mesh(np.asarray(jax.devices()[:2]), ("batch",)) if mode == "shard_map" else None
  step = jmp_train.make_train_step(
    MODEL.apply, _mse, optax.sgd(0.1) if optimizer == "sgd" else None, compression=compression, mode=mode, mesh=mesh
  )
  batch = (jnp.ones((8, 3)), jnp.zeros((8, 4)))
  return step.lower(step.init(PARAMS), step.shard_batch(batch))


@pytest.mark.parametrize("mode", ["shard_map", "pmap"])
@pytest.mark.parametrize("factory", [jmp_train.sign_compression, jmp_train.compressed_mean])
def test_a_compressor_without_axis_name_in_a_mapped_step_raises(factory, mode):
  name = factory.__name__
  with pytest.raises(
    ValueError,
    match=rf"{name}\(axis_name=None\)\.update runs inside a step "
    rf"mapped over 'batch'.*averages nothing.*{name}\(axis_name='batch'\)",
  ):
    _run(factory(), mode)


def test_a_compressor_on_another_axis_names_the_steps_axis():
  with pytest.raises(
    ValueError,
    match=r"sign_compression\(axis_name='data'\)\.init runs inside "
    r"a step mapped over \['batch'\].*sign_compression\(axis_name='batch'\)",
  ):
    _run(jmp_train.sign_compression("data"), "shard_map")
  with pytest.raises(
    ValueError,
    match=r"mapped over \['batch'\], where no axis is named "
    r"'devices'",
  ):
    _run(jmp_train.one_bit_adam(1e-3, warmup_steps=2, axis_name="devices"), "pmap", optimizer=None)


def test_a_policy_without_output_dtype_keeps_the_compute_dtype_never_float64():
  policy = jmp_train.Policy("float32", "bfloat16", None)
  assert policy.output_dtype == jnp.bfloat16
  assert policy.cast_to_output(jnp.ones(2, jnp.float32)).dtype == jnp.bfloat16
  for bad in ((None, "bfloat16", "float32"), ("float32", None, "float32")):
    with pytest.raises(ValueError, match="None is not a dtype"):
      jmp_train.Policy(*bad)


def test_a_loss_of_the_parameters_and_the_batch_names_the_signature_and_regularizer():

  def loss_fn(params, batch):  # a Flax-tutorial loss
    x, y = batch
    return _mse(MODEL.apply({"params": params}, x), y)

  step = jmp_train.make_train_step(MODEL.apply, loss_fn, optax.sgd(0.1))
  with pytest.raises(
    TypeError,
    match=r"loss_fn\(outputs, targets\).*takes 'params' first.*"
    r"too many values to unpack.*regularizer=",
  ):
    step.lower(step.init(PARAMS), BATCH)


def test_autocast_of_a_function_returning_a_string_names_the_output():
  f = jmp_train.autocast(lambda x: {"y": x, "note": "done"}, "mixed_bfloat16")
  with pytest.raises(TypeError, match=r"returned str 'done' at \['note'\].*arrays or numbers"):
    f(jnp.ones(3))
