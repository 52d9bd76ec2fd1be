"""Checkpoints: clear errors, atomic saves, and a quiet interpreter exit."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import textwrap

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jmp_train

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _step():
  return jmp_train.make_train_step(
    lambda v, x: x @ v["params"]["w"], lambda out, y: jnp.mean((out - y) ** 2), optax.adam(0.1)
  )


def test_restore_into_another_shape_names_the_leaf_and_both_shapes(tmp_path):
  step = _step()
  path = jmp_train.save_checkpoint(tmp_path / "ckpt", step.init({"w": jnp.ones((3, 2))}))
  with pytest.raises(
    ValueError,
    match=r"\.params\['w'\] has shape \(3, 2\) in the "
    r"checkpoint but \(4, 2\) in the template",
  ):
    jmp_train.restore_checkpoint(path, step.init({"w": jnp.ones((4, 2))}))
  with pytest.raises(
    ValueError,
    match=r"\['w'\] has dtype float32 in the checkpoint but "
    r"bfloat16",
  ):
    jmp_train.restore_checkpoint(
      path, step.init({"w": jnp.ones((3, 2))}).replace(params={"w": jnp.ones((3, 2), jnp.bfloat16)})
    )
  with pytest.raises(FileNotFoundError, match="No checkpoint at"):
    jmp_train.restore_checkpoint(tmp_path / "missing", step.init({"w": jnp.ones((3, 2))}))


_QUIET = textwrap.dedent("""
    import sys
    sys.path.insert(0, sys.argv[2])
    import jax.numpy as jnp, optax, jmp_train
    step = jmp_train.make_train_step(
        lambda v, x: x @ v["params"]["w"], lambda o, y: jnp.mean((o - y) ** 2), optax.adam(0.1))
    state = step.init({"w": jnp.ones((3, 2))})
    path = jmp_train.save_checkpoint(sys.argv[1] + "/ok", state)
    jmp_train.restore_checkpoint(path, state)
    try:
      jmp_train.restore_checkpoint(path, step.init({"w": jnp.ones((4, 2))}))
    except ValueError as e:
      print("ValueError:", e)
    try:
      jmp_train.save_checkpoint(sys.argv[1] + "/bad", state.replace(model_state={"x": object()}))
    except TypeError as e:
      print("TypeError:", e)
""")


def test_no_traceback_noise_at_interpreter_exit(tmp_path):
  script = tmp_path / "quiet.py"
  script.write_text(_QUIET)
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  env["JAX_PLATFORMS"] = "cpu"
  result = subprocess.run(
    [sys.executable, str(script), str(tmp_path), str(ROOT)], env=env, capture_output=True, text=True, timeout=240
  )
  assert result.returncode == 0, result.stderr[-3000:]
  assert "ValueError: Cannot restore" in result.stdout
  assert "TypeError: Cannot checkpoint the leaf .model_state['x']" in result.stdout
  for noise in ("Traceback", "Exception ignored", "Event loop is closed", "RuntimeError"):
    assert noise not in result.stderr, result.stderr[-3000:]
  assert not (tmp_path / "bad").exists()


def test_a_failed_save_leaves_nothing_a_restore_accepts(tmp_path, monkeypatch):
  import orbax.checkpoint as ocp

  step = _step()
  state = step.init({"w": jnp.ones((3, 2))})
  # An unsaveable leaf is refused before anything is written, even with force
  # over a good checkpoint, which stays intact.
  good = jmp_train.save_checkpoint(tmp_path / "good", state)
  with pytest.raises(TypeError, match=r"\.model_state\['x'\] of type object"):
    jmp_train.save_checkpoint(good, state.replace(model_state={"x": object()}), force=True)
  chex.assert_trees_all_equal(jmp_train.restore_checkpoint(good, state), state)

  # A write that fails after orbax started writing.
  def failing_wait(self):
    raise OSError("disk full")

  monkeypatch.setattr(ocp.StandardCheckpointer, "wait_until_finished", failing_wait)
  with pytest.raises(OSError, match="disk full"):
    jmp_train.save_checkpoint(tmp_path / "partial", state)
  monkeypatch.undo()
  assert sorted(p.name for p in tmp_path.iterdir()) == ["good"]
  with pytest.raises(FileNotFoundError):
    jmp_train.restore_checkpoint(tmp_path / "partial", state)


def test_nnx_state_round_trips(tmp_path):
  from flax import nnx

  model = nnx.Sequential(
    nnx.Linear(3, 4, rngs=nnx.Rngs(0)), nnx.BatchNorm(4, rngs=nnx.Rngs(0)), nnx.Dropout(0.5, rngs=nnx.Rngs(dropout=1))
  )
  step = jmp_train.make_train_step(model, lambda out, y: jnp.mean((out - y) ** 2), optax.sgd(0.1))
  state, _ = step(step.init(model), (np.ones((4, 3), np.float32), np.zeros((4, 4), np.float32)))
  path = jmp_train.save_checkpoint(tmp_path / "nnx", state)
  restored = jmp_train.restore_checkpoint(path, step.init(model))
  chex.assert_trees_all_equal(jax.tree.map(np.asarray, restored), jax.tree.map(np.asarray, state))
