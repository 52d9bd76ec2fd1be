"""The 1-bit exchange's program does not grow with the replica count.

Every owner runs the same code on its chunk (``sign_layout``): no branch per
owner, no loop over chunk boundaries. The steps of ``sign_compression``,
``one_bit_momentum`` and ``one_bit_adam`` are lowered (not compiled, not
run) under ``jax.shard_map`` over an abstract mesh of 8 and of 32 replicas,
more than the test process has devices: the StableHLO text is the
per-replica program, which must not grow with K.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AbstractMesh
from jax.sharding import PartitionSpec as P

from jmp_train import one_bit_adam, one_bit_momentum, sign_compression, sign_compression_specs

AXIS = "batch"
# Leaves split by columns (word-packed and not), by rows and by entries.
SHAPES = {"conv": (3, 3, 4, 8), "b0": (8,), "w1": (72, 48), "b1": (48,), "w2": (48, 10), "b2": (10,)}

FACTORIES = {
  "sign_compression": lambda **kw: sign_compression(AXIS, **kw),
  "one_bit_momentum": lambda **kw: one_bit_momentum(0.1, 0.9, axis_name=AXIS, **kw),
  "one_bit_adam": lambda **kw: one_bit_adam(1e-3, axis_name=AXIS, warmup_steps=1, **kw),
}


@functools.lru_cache(maxsize=None)
def _lines(name: str, k: int) -> int:
  """StableHLO lines of the named optimizer's update for ``k`` replicas (lowered only)."""
  make = FACTORIES[name]
  mesh = AbstractMesh((k,), (AXIS,))
  params = {n: jax.ShapeDtypeStruct(s, jnp.float32) for n, s in SHAPES.items()}
  specs = sign_compression_specs(jax.eval_shape(make(num_replicas=k).init, params), AXIS)
  tx = make()
  state = jax.eval_shape(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=specs), params)
  grads = {n: jax.ShapeDtypeStruct((k,) + s, jnp.float32) for n, s in SHAPES.items()}

  def local_update(g, s, p):
    return tx.update(jax.tree.map(lambda x: x[0], g), s, p)

  step = jax.shard_map(local_update, mesh=mesh, in_specs=(P(AXIS), specs, P()), out_specs=(P(), specs))
  return len(jax.jit(step).lower(grads, state, params).as_text().splitlines())


@pytest.mark.parametrize("name", sorted(FACTORIES))
def test_program_size_does_not_grow_with_the_replicas(name):
  small, large = _lines(name, 8), _lines(name, 32)
  assert large <= 1.3 * small, (name, small, large)
