"""Replicas as a ``jax.vmap`` axis: the compressed exchanges run there as under ``pmap``.

One accelerator can hold several replicas as a mapped axis (DiLoCo's and
1-bit Adam's studies at scale on one GPU); the collectives are then the
vmapped axis's, and a gather that ``shard_map`` types ``to="invarying"`` is
a plain gather.
"""

from __future__ import annotations

import jax
import numpy as np

import jmp_train

from helpers.sign_reference import AXIS, SHAPES, make_grads, pmapped, replicated_zeros


def test_sign_compression_under_vmap_equals_pmap():
  k = 4
  tx = jmp_train.sign_compression(AXIS, scale="column")
  init = jax.jit(jax.vmap(tx.init, axis_name=AXIS))
  update = jax.jit(jax.vmap(tx.update, axis_name=AXIS))
  p_init, p_update = pmapped(k, scale="column")
  state, p_state = init(replicated_zeros(k)), p_init(replicated_zeros(k))
  for step in range(2):
    grads = make_grads(k, seed=20 + step)
    out, state = update(grads, state)
    p_out, p_state = p_update(grads, p_state)
    for name in SHAPES:
      np.testing.assert_array_equal(np.asarray(out[name]), np.asarray(p_out[name]))
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), state, p_state)


def test_compressed_mean_under_vmap_equals_pmap():
  k = 4
  tx = jmp_train.compressed_mean(AXIS, wire="float8_e4m3")
  grads = make_grads(k, seed=5)
  zeros = replicated_zeros(k)
  out, _ = jax.jit(jax.vmap(tx.update, axis_name=AXIS))(grads, jax.vmap(tx.init, axis_name=AXIS)(zeros))
  devices = jax.devices()[:k]
  p_out, _ = jax.pmap(tx.update, axis_name=AXIS, devices=devices)(
    grads, jax.pmap(tx.init, axis_name=AXIS, devices=devices)(zeros)
  )
  for name in SHAPES:
    np.testing.assert_array_equal(np.asarray(out[name]), np.asarray(p_out[name]))
