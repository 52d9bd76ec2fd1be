"""Tests of loss_scaled under pmap and shard_map: every replica skips together."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jmp_train import DynamicLossScale
from jmp_train import StaticLossScale
from jmp_train import loss_scaled
from helpers.loss_scaling import NDEV
from helpers.loss_scaling import _np_grads


# --- distributed -------------------------------------------------------------


def _per_replica_grads(bad_replica):
  g = np.stack([_np_grads(np.float32, 2.0**4)["w"] * (r + 1) for r in range(NDEV)]).astype(np.float16)
  if bad_replica is not None:
    g[bad_replica, 2, 1] = np.inf
  return {"w": g}


@pytest.fixture(scope="module")
def pmapped_update():
  def make(axis_name):
    tx = loss_scaled(optax.sgd(1.0), DynamicLossScale(2.0**4), axis_name=axis_name)

    def step(grads, params):
      state = tx.init(params)
      return tx.update(grads, state, params)

    return jax.pmap(step, axis_name="i", in_axes=(0, None))

  return {"axis": make("i"), "no_axis": make(None)}


@pytest.mark.parametrize("bad_replica", [None, 0, 5])
def test_pmap_one_replica_overflowing_makes_all_skip(pmapped_update, bad_replica):
  params = {"w": jnp.zeros((3, 2), jnp.float16)}
  grads = _per_replica_grads(bad_replica)
  updates, state = pmapped_update["axis"](grads, params)
  skipped = np.asarray(state.total_notfinite).tolist()
  if bad_replica is None:
    assert skipped == [0] * NDEV
    expected = -np.asarray(grads["w"], np.float32) / 2.0**4
    np.testing.assert_array_equal(np.asarray(updates["w"], np.float32), expected)
  else:
    assert skipped == [1] * NDEV
    np.testing.assert_array_equal(np.asarray(updates["w"], np.float32), 0.0)
    np.testing.assert_array_equal(state.loss_scale.loss_scale, [8.0] * NDEV)
    # Without the axis name only the overflowing replica skips: the
    # replicas would disagree, which is what axis_name prevents.
    _, local = pmapped_update["no_axis"](grads, params)
    expected = [0] * NDEV
    expected[bad_replica] = 1
    assert np.asarray(local.total_notfinite).tolist() == expected


def test_shard_map_one_replica_overflowing_makes_all_skip():
  mesh = Mesh(np.array(jax.devices()[:NDEV]), ("d",))
  tx = loss_scaled(optax.sgd(1.0), DynamicLossScale(2.0**4), axis_name="d")
  params = {"w": jnp.zeros((3, 2), jnp.float16)}

  @jax.jit
  @functools.partial(jax.shard_map, mesh=mesh, in_specs=(P("d"), P()), out_specs=(P("d"), P()))
  def step(grads, params):
    local = jax.tree.map(lambda g: g[0], grads)  # this replica's gradients
    updates, state = tx.update(local, tx.init(params), params)
    # The state is replica-invariant (same on every device) by construction.
    return jax.tree.map(lambda u: u[None], updates), state

  for bad_replica in [None, 3]:
    updates, state = step(_per_replica_grads(bad_replica), params)
    if bad_replica is None:
      assert int(state.total_notfinite) == 0
      assert np.abs(np.asarray(updates["w"], np.float32)).min() > 0
    else:
      assert int(state.total_notfinite) == 1
      assert float(state.loss_scale.loss_scale) == 8.0
      np.testing.assert_array_equal(np.asarray(updates["w"], np.float32), 0.0)


@pytest.mark.parametrize("skip_mode", ["cond", "select"])
def test_shard_map_per_replica_inner_state(skip_mode):
  # Momentum of each replica's own gradients: the inner state enters
  # replicated and leaves varying over the mesh axis, so the skip branch must
  # mark the unchanged state as varying too for lax.cond to type-check.
  mesh = Mesh(np.array(jax.devices()[:NDEV]), ("d",))
  tx = loss_scaled(optax.sgd(1.0, momentum=0.5), StaticLossScale(2.0**4), axis_name="d", skip_mode=skip_mode)
  params = {"w": jnp.zeros((3, 2), jnp.float16)}
  state0 = tx.init(params)

  @jax.jit
  @functools.partial(jax.shard_map, mesh=mesh, in_specs=(P("d"), P(), P()), out_specs=(P("d"), P("d")))
  def step(grads, state, params):
    local = jax.tree.map(lambda g: g[0], grads)
    updates, state = tx.update(local, state, params)
    stack = lambda t: jax.tree.map(lambda x: x[None], t)
    return stack(updates), stack(state.inner_state)

  for bad_replica in [None, 6]:
    updates, inner = step(_per_replica_grads(bad_replica), state0, params)
    trace = np.asarray(inner[0].trace["w"], np.float32)  # (8, 3, 2)
    if bad_replica is None:
      expected = np.asarray(_per_replica_grads(None)["w"], np.float32) / 16
      np.testing.assert_array_equal(trace, expected)  # each its own
    else:
      np.testing.assert_array_equal(trace, 0.0)  # all replicas skipped
      np.testing.assert_array_equal(np.asarray(updates["w"], np.float32), 0)
