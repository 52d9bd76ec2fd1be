"""Every ``init`` returns buffers it made, so a donated step frees nothing of the user's.

optax's contract: ``init`` returns fresh arrays. A train step jitted with
``donate_argnums`` on ``(params, opt_state)`` hands the state's buffers to
XLA, which frees (on CPU too) those it reuses for the outputs. Had ``init``
put an array captured at construction into the state (the loss-scale
object's scale, the user's PRNG key), the first donated step would delete
it: the user's object would be unusable, and every later ``init`` would
return deleted arrays.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jmp_train

AXIS = "batch"
# Replicas of the shard_map cases (compiling the 1-bit exchange grows with them).
NUM_DEVICES = 4
SHAPES = {"b": (3,), "w": (4, 3)}
FP8_RECIPE = jmp_train.Fp8Recipe(amax_history_len=4)


@dataclasses.dataclass
class Case:
  """One init-and-step protocol.

  Attributes:
    init: ``params -> state``, the API under test.
    step: ``((params, state), batch) -> (params, state)``, jitted with the
      pair donated.
    params: a function making new parameters.
    batch: the step's other argument (gradients or inputs).
    owned: the user's objects given to the constructor, which must stay
      usable.
  """

  init: Callable[[Any], Any]
  step: Callable[..., Any]
  params: Callable[[], Any]
  batch: Any
  owned: Any = None


def _params(dtype=jnp.float32):
  return {n: jnp.full(s, 0.5, dtype) for n, s in SHAPES.items()}


def _grads(dtype=jnp.float32, scale=1.0, replicas=None):
  rng = np.random.default_rng(0)
  lead = lambda s: s if replicas is None else (replicas * s[0],) + s[1:]  # noqa: E731
  return {n: jnp.asarray(rng.normal(size=lead(s)) * scale, dtype) for n, s in SHAPES.items()}


def _local(tx, dtype=jnp.float32, grad_scale=1.0, owned=None) -> Case:
  """An optax transformation on one device."""

  def step(carry, grads):
    params, state = carry
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  return Case(
    tx.init, jax.jit(step, donate_argnums=0), functools.partial(_params, dtype), _grads(dtype, grad_scale), owned
  )


@functools.cache
def _mesh():
  return jax.make_mesh((NUM_DEVICES,), (AXIS,), devices=jax.devices()[:NUM_DEVICES])


def _replicated(tx, owned=None) -> Case:
  """A transformation averaging over ``AXIS``: init and step under ``shard_map``."""
  mesh = _mesh()
  shapes = jax.eval_shape(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=P()), _params())
  specs = jmp_train.sign_compression_specs(shapes, AXIS)

  def local_step(carry, grads):  # grads: this replica's, varying over AXIS
    params, state = carry
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  step = jax.jit(
    jax.shard_map(local_step, mesh=mesh, in_specs=((P(), specs), P(AXIS)), out_specs=(P(), specs)),
    donate_argnums=0,
  )
  params = lambda: jax.device_put(_params(), NamedSharding(mesh, P()))  # noqa: E731
  grads = jax.device_put(_grads(replicas=NUM_DEVICES), NamedSharding(mesh, P(AXIS)))
  init = jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=specs)
  return Case(init, step, params, grads, owned)


def _loss_scaled(loss_scale, inner=None) -> Case:
  inner = optax.adam(1e-2) if inner is None else inner
  tx = jmp_train.loss_scaled(inner, loss_scale)
  return _local(tx, grad_scale=float(loss_scale.loss_scale), owned=loss_scale)


def _stochastic_rounding(seed) -> Case:
  tx = optax.chain(optax.sgd(1e-3), jmp_train.stochastic_rounding(seed))
  return _local(tx, jnp.bfloat16, owned=seed)


def _fp8() -> Case:
  """FP8 products: ``init_fp8_meta`` makes the state, ``update_fp8_meta`` steps it."""
  dims = (((1,), (0,)), ((), ()))

  def loss(w, meta, x):
    return jmp_train.fp8_dot_general(x, w, dims, meta=meta, recipe=FP8_RECIPE).astype(jnp.float32).sum()

  def step(carry, x):
    w, meta = carry
    gw, gmeta = jax.grad(loss, argnums=(0, 1))(w, meta, x)
    return w - 0.1 * gw, jmp_train.update_fp8_meta(meta, gmeta)

  return Case(
    lambda params: jmp_train.init_fp8_meta(FP8_RECIPE),
    jax.jit(step, donate_argnums=0),
    lambda: jnp.full((16, 8), 0.5, jnp.bfloat16),
    jnp.ones((4, 16), jnp.bfloat16),
  )


CASES = {
  "loss_scaled_static": lambda: _loss_scaled(jmp_train.StaticLossScale(8.0)),
  "loss_scaled_dynamic": lambda: _loss_scaled(jmp_train.DynamicLossScale(2.0**4, growth_interval=1)),
  "loss_scaled_noop": lambda: _loss_scaled(jmp_train.NoOpLossScale()),
  "loss_scaled_8bit_rounded": lambda: _loss_scaled(
    jmp_train.DynamicLossScale(2.0**4),
    optax.chain(jmp_train.adam_8bit(1e-2, min_8bit_size=8), jmp_train.stochastic_rounding(jax.random.key(7))),
  ),
  "stochastic_rounding_int": lambda: _stochastic_rounding(0),
  "stochastic_rounding_key": lambda: _stochastic_rounding(jax.random.key(1)),
  "stochastic_rounding_raw_key": lambda: _stochastic_rounding(jax.random.PRNGKey(2)),
  "kahan_compensation": lambda: _local(optax.chain(optax.sgd(1e-2), jmp_train.kahan_compensation()), jnp.bfloat16),
  "modified_momentum_sgd": lambda: _local(jmp_train.modified_momentum_sgd(1e-2), jnp.bfloat16),
  "adam_8bit": lambda: _local(jmp_train.adam_8bit(1e-2, min_8bit_size=8)),
  "sgd_8bit": lambda: _local(jmp_train.sgd_8bit(1e-2, min_8bit_size=8)),
  "scale_by_narrow_adam": lambda: _local(
    jmp_train.scale_by_narrow_adam(mu_dtype="8bit", nu_dtype=jnp.bfloat16, min_8bit_size=8)
  ),
  "init_fp8_meta": _fp8,
  "sign_compression": lambda: _replicated(optax.chain(jmp_train.sign_compression(AXIS), optax.sgd(0.1))),
  "compressed_mean": lambda: _replicated(optax.chain(jmp_train.compressed_mean(AXIS), optax.sgd(0.1))),
  "one_bit_adam": lambda: _replicated(jmp_train.one_bit_adam(1e-2, axis_name=AXIS, warmup_steps=1)),
  "one_bit_momentum": lambda: _replicated(jmp_train.one_bit_momentum(0.1, axis_name=AXIS)),
  "loss_scaled_compressed_mean": lambda: _replicated(
    jmp_train.loss_scaled(
      optax.chain(jmp_train.compressed_mean(AXIS), optax.sgd(0.1)), jmp_train.DynamicLossScale(1.0), axis_name=AXIS
    )
  ),
}


def _host(tree):
  """Host copies of ``tree``'s arrays, made from device copies.

  ``np.asarray`` of a CPU array is a view of its buffer that the array keeps
  (and a buffer with a view is silently copied, not donated), so the
  arrays themselves are never converted.
  """
  return jax.tree.map(lambda x: np.asarray(jnp.copy(x)), tree)


def _assert_same(got, want):
  assert jax.tree.structure(got) == jax.tree.structure(want)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    assert g.dtype == w.dtype and g.shape == w.shape
    np.testing.assert_array_equal(g, w)


def _assert_usable(owned):
  """The user's loss scale or key: readable, and usable for what it is for."""
  assert not any(x.is_deleted() for x in jax.tree.leaves(owned) if isinstance(x, jax.Array))
  if isinstance(owned, jmp_train.DynamicLossScale | jmp_train.StaticLossScale | jmp_train.NoOpLossScale):
    float(owned.loss_scale)
    float(owned.scale(jnp.float32(1.0)))
    float(owned.adjust(jnp.array(True)).loss_scale)
  elif isinstance(owned, jax.Array):
    key = owned if jnp.issubdtype(owned.dtype, jax.dtypes.prng_key) else (jax.random.wrap_key_data(owned))
    jax.random.key_data(jax.random.split(key)).block_until_ready()


@pytest.mark.parametrize("name", CASES)
def test_init_after_a_donated_step(name):
  case = CASES[name]()
  params = case.params()
  state = case.init(params)
  first = _host(state)  # the step frees `state`'s own buffers
  jax.block_until_ready(case.step((params, state), case.batch))
  # Donation did free buffers here: the test shows something on this backend.
  assert any(x.is_deleted() for x in jax.tree.leaves((params, state)))
  if case.owned is not None:
    _assert_usable(case.owned)
  again = case.init(case.params())
  assert not any(x.is_deleted() for x in jax.tree.leaves(again))
  _assert_same(_host(again), first)
  # The next run: a donated step from the new state.
  jax.block_until_ready(case.step((case.params(), again), case.batch))
  if case.owned is not None:
    _assert_usable(case.owned)


# Every transformation, with ``num_replicas`` for those that average over an
# axis, so that ``init`` runs eagerly on one device.
EAGER = {
  "loss_scaled_dynamic": lambda: jmp_train.loss_scaled(optax.adam(1e-2), jmp_train.DynamicLossScale()),
  "loss_scaled_static": lambda: jmp_train.loss_scaled(optax.sgd(1e-2), jmp_train.StaticLossScale(4.0)),
  "stochastic_rounding": lambda: jmp_train.stochastic_rounding(jax.random.key(0)),
  "kahan_compensation": jmp_train.kahan_compensation,
  "modified_momentum_sgd": lambda: jmp_train.modified_momentum_sgd(1e-2),
  "adam_8bit": lambda: jmp_train.adam_8bit(1e-2, min_8bit_size=8),
  "sgd_8bit": lambda: jmp_train.sgd_8bit(1e-2, min_8bit_size=8),
  "scale_by_narrow_adam": lambda: jmp_train.scale_by_narrow_adam(mu_dtype="8bit", min_8bit_size=8),
  "sign_compression": lambda: jmp_train.sign_compression(AXIS, num_replicas=NUM_DEVICES),
  "compressed_mean": lambda: jmp_train.compressed_mean(AXIS, num_replicas=NUM_DEVICES),
  "one_bit_adam": lambda: jmp_train.one_bit_adam(1e-2, axis_name=AXIS, warmup_steps=1, num_replicas=NUM_DEVICES),
  "one_bit_momentum": lambda: jmp_train.one_bit_momentum(0.1, axis_name=AXIS, num_replicas=NUM_DEVICES),
}


@pytest.mark.parametrize("name", EAGER)
def test_init_leaves_share_no_buffer(name):
  # Two leaves on one buffer cannot be donated together ("Attempt to donate
  # the same buffer twice"), nor may a leaf be a buffer of the parameters.
  params = _params()
  state = EAGER[name]().init(params)
  pointers = [x.unsafe_buffer_pointer() for x in jax.tree.leaves((params, state)) if x.size]
  assert len(pointers) == len(set(pointers))
