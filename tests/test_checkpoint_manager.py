"""A TrainState saved and restored with orbax's CheckpointManager, as the guide shows."""

from __future__ import annotations

import os
import shutil

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jmp_train

ocp = pytest.importorskip("orbax.checkpoint")


def _step(mode):
  compression = jmp_train.sign_compression("batch") if mode == "shard_map" else None
  return jmp_train.make_train_step(
    lambda v, x, **_: x @ v["params"]["w"],
    lambda out, y: jnp.mean((out - y) ** 2),
    optax.sgd(0.1, momentum=0.9),
    policy="mixed_float16",
    mode=mode,
    compression=compression,
    loss_scale=jmp_train.DynamicLossScale(2.0**4),
  )


def _batch(i):
  rng = np.random.RandomState(i)
  return rng.randn(16, 16).astype(np.float32), rng.randn(16, 4).astype(np.float32)


def _host(tree):
  return jax.tree.map(np.array, tree)


def _options(**kwargs):
  return ocp.CheckpointManagerOptions(enable_async_checkpointing=True, **kwargs)


@pytest.mark.parametrize("mode", ["single", "shard_map"])
def test_async_saves_every_n_steps_keep_the_last_and_restore_bit_for_bit(tmp_path, mode):
  step = _step(mode)
  params = {"w": jnp.ones((16, 4))}
  state = step.init(params, rng=0)
  saved = {}
  options = _options(save_interval_steps=2, max_to_keep=2)
  with ocp.CheckpointManager(tmp_path, options=options) as manager:
    for i in range(7):
      state, _ = step(state, step.shard_batch(_batch(i)))
      n = int(step.unreplicate(state.step))
      # Saves the first step, then multiples of save_interval_steps.
      if manager.save(n, args=ocp.args.StandardSave(state)):
        saved[n] = _host(state)  # the next step donates the state's buffers
    manager.wait_until_finished()
    assert sorted(saved) == [1, 2, 4, 6]
    assert manager.all_steps() == [4, 6]  # max_to_keep
  # A new process: a new manager, restored into a fresh state as template.
  with ocp.CheckpointManager(tmp_path, options=options) as manager:
    latest = manager.latest_step()
    restored = manager.restore(latest, args=ocp.args.StandardRestore(step.init(params, rng=0)))
  assert latest == 6 and isinstance(restored, jmp_train.TrainState)
  chex.assert_trees_all_equal(_host(restored), saved[6], strict=True)
  if mode == "shard_map":
    # Each replica's 1-bit residual (error feedback) came back, per device.
    residuals = [
      x
      for path, x in jax.tree_util.tree_leaves_with_path(restored.opt_state)
      if "residual" in jax.tree_util.keystr(path)
    ]
    assert residuals and all(r.shape[0] == jax.device_count() for r in residuals)
    assert restored.params["w"].sharding == state.params["w"].sharding
  # The loss scale too.
  np.testing.assert_array_equal(
    np.asarray(jmp_train.get_loss_scale(restored.opt_state).loss_scale),
    np.asarray(jmp_train.get_loss_scale(saved[6].opt_state).loss_scale),
  )
  # Training continues from it as the uninterrupted run did (its step 7).
  resumed, _ = step(restored, step.shard_batch(_batch(6)))
  chex.assert_trees_all_equal(_host(resumed), _host(state), strict=True)


def test_a_half_written_step_is_ignored_on_restart(tmp_path):
  step = _step("single")
  params = {"w": jnp.ones((16, 4))}
  state = step.init(params)
  options = _options(save_interval_steps=1, max_to_keep=3)
  with ocp.CheckpointManager(tmp_path, options=options) as manager:
    for i in range(2):
      state, _ = step(state, step.shard_batch(_batch(i)))
      manager.save(int(state.step), args=ocp.args.StandardSave(state))
    manager.wait_until_finished()
  expected = _host(state)
  # A process killed while writing step 3 leaves orbax's temporary folder:
  # a save is committed by renaming it to "3".
  shutil.copytree(tmp_path / "2", tmp_path / "3.orbax-checkpoint-tmp-1234567")
  with ocp.CheckpointManager(tmp_path, options=options) as manager:
    assert manager.all_steps() == [1, 2]
    latest = manager.latest_step()
    restored = manager.restore(latest, args=ocp.args.StandardRestore(step.init(params)))
    assert latest == 2
    chex.assert_trees_all_equal(_host(restored), expected, strict=True)
    # The restarted run saves step 3 again over the leftover.
    state, _ = step(restored, step.shard_batch(_batch(2)))
    manager.save(3, args=ocp.args.StandardSave(state), force=True)
    manager.wait_until_finished()
    assert manager.all_steps() == [1, 2, 3]
  assert "3" in os.listdir(tmp_path)
