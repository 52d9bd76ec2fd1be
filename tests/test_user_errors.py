"""Users' common mistakes: one short message naming the bad value and the fix."""

from __future__ import annotations

import gc
import logging
import re
import shutil
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jmp_train

_NOISE = ("Event loop is closed", "Traceback", "Exception ignored", "never retrieved")


def _mse(out, y):
  return jnp.mean((out - y) ** 2)


def _linear_step():
  return jmp_train.make_train_step(
      lambda v, x: x @ v["params"]["w"], _mse, optax.adam(0.1))


_BATCH = (np.ones((4, 3), np.float32), np.zeros((4, 2), np.float32))


def _assert_quiet(capfd, caplog, unraisables):
  gc.collect()  # Orbax's abandoned coroutines complain when collected.
  err = capfd.readouterr().err
  for noise in _NOISE:
    assert noise not in err, err[-3000:]
  loud = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
  assert not loud, loud
  assert not unraisables, [str(u.exc_value)[:200] for u in unraisables]


def test_restore_from_an_empty_or_missing_folder_names_it(tmp_path):
  state = _linear_step().init({"w": jnp.ones((3, 2))})
  (tmp_path / "empty").mkdir()
  for name in ("empty", "missing"):
    with pytest.raises(FileNotFoundError, match=re.escape(f"No checkpoint at {tmp_path / name}:")):
      jmp_train.restore_checkpoint(tmp_path / name, state)


def test_restore_from_a_corrupt_checkpoint_raises_one_quiet_value_error(
    tmp_path, capfd, caplog, monkeypatch):
  caplog.set_level(logging.INFO)
  # Outside pytest these print "Exception ignored in ..." on stderr.
  unraisables = []
  monkeypatch.setattr(sys, "unraisablehook", unraisables.append)
  # Large enough for its own zstd-compressed chunk in a data file.
  w = np.random.RandomState(0).randn(64, 64).astype(np.float32)
  state = _linear_step().init({"w": jnp.asarray(w)})
  good = jmp_train.save_checkpoint(tmp_path / "good", state)

  def corrupt(name, edit):
    path = tmp_path / name
    shutil.copytree(good, path)
    edit(path)
    return path

  def truncate(path):
    # The largest file holds the arrays' data (orbax's OCDBT store).
    largest = max((p for p in path.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    largest.write_bytes(largest.read_bytes()[: largest.stat().st_size // 2])

  def truncate_btree(path):
    for data in (path / "d").iterdir():
      data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])

  def garbage_metadata(path):
    (path / "_METADATA").write_bytes(b"\x00garbage")

  def scramble(path):
    # Zeros inside the compressed chunk: only decompressing it tells, which
    # orbax does with many concurrent reads (and a failure of one leaves the
    # others' complaints behind).
    largest = max((p for p in path.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    data = bytearray(largest.read_bytes())
    data[len(data) // 8: len(data) // 2] = bytes(len(data) // 2 - len(data) // 8)
    largest.write_bytes(bytes(data))

  bad = [corrupt("truncated", truncate), corrupt("truncated_btree", truncate_btree),
         corrupt("garbage", garbage_metadata), corrupt("scrambled", scramble)]
  other = tmp_path / "other"
  other.mkdir()
  (other / "notes.txt").write_text("not a checkpoint")
  capfd.readouterr()
  messages = {}
  for path in [*bad, other]:
    with pytest.raises(ValueError) as info:
      jmp_train.restore_checkpoint(path, state)
    message = str(info.value)
    assert message.startswith(f"{path} is not a complete jmp_train checkpoint"), message
    assert "save_checkpoint" in message, message
    messages[path.name] = message
    # Nothing from inside orbax or TensorStore is chained on.
    assert info.value.__cause__ is None, info.value.__cause__
    assert info.value.__context__ is None or info.value.__suppress_context__
  assert "its array params.w cannot be read" in messages["scrambled"], messages
  assert "its file _METADATA does not parse as JSON" in messages["garbage"], messages
  assert "it has no _METADATA file (it holds notes.txt)" in messages["other"], messages
  _assert_quiet(capfd, caplog, unraisables)
  # The good checkpoint still restores, quietly.
  restored = jmp_train.restore_checkpoint(good, state)
  np.testing.assert_array_equal(restored.params["w"], w)
  _assert_quiet(capfd, caplog, unraisables)


def test_a_folder_of_checkpoints_is_named_as_such(tmp_path):
  state = _linear_step().init({"w": jnp.ones((3, 2))})
  jmp_train.save_checkpoint(tmp_path / "run" / "step_10", state)
  with pytest.raises(ValueError, match=r"holds checkpoints \(step_10\)"):
    jmp_train.restore_checkpoint(tmp_path / "run", state)


def test_save_onto_an_existing_checkpoint_names_force(tmp_path):
  state = _linear_step().init({"w": jnp.ones((3, 2))})
  path = jmp_train.save_checkpoint(tmp_path / "ckpt", state)
  with pytest.raises(FileExistsError) as info:
    jmp_train.save_checkpoint(path, state)
  message = str(info.value)
  assert str(path) in message and "force=True" in message, message
  assert jmp_train.save_checkpoint(path, state, force=True) == path


def test_forgetting_the_loss_scale_gives_a_short_message():
  params = {f"layer_{i}": {"kernel": jnp.ones((8, 8)), "bias": jnp.zeros(8)} for i in range(20)}
  grad_fn = jmp_train.scaled_value_and_grad(
      lambda p, x: sum(jnp.sum(x @ layer["kernel"]) for layer in p.values()))
  with pytest.raises(TypeError) as info:
    grad_fn(params, jnp.ones((2, 8)))
  message = str(info.value)
  assert "\n" not in message and len(message) < 500, message
  assert "a dict with 40 leaves" in message, message
  assert "grad_fn(loss_scale, params, ...)" in message, message
  with pytest.raises(TypeError, match=r"an array of shape \(2, 8\) and dtype float32"):
    jmp_train.scaled_value_and_grad(jnp.sum)(jnp.ones((2, 8)))
  with pytest.raises(ValueError, match="positive scalar"):
    jmp_train.scaled_value_and_grad(jnp.sum)(-1.0, jnp.ones(2))


def test_integer_parameters_are_named():
  params = {"dense": {"kernel": jnp.ones((3, 2), jnp.int32), "bias": jnp.zeros(2)}}
  grad_fn = jmp_train.scaled_value_and_grad(
      lambda params, x: jnp.sum(x @ params["dense"]["kernel"]))
  with pytest.raises(TypeError, match=r"params\['dense'\]\['kernel'\] has dtype int32.*float"):
    grad_fn(2.0, params, jnp.ones((4, 3)))
  step = jmp_train.make_train_step(
      lambda v, x: x @ v["params"]["dense"]["kernel"] + v["params"]["dense"]["bias"], _mse,
      optax.sgd(0.1))
  with pytest.raises(TypeError) as info:
    step(step.init(params), _BATCH)
  message = str(info.value)
  assert "params['dense']['kernel'] has dtype int32" in message, message
  assert "float32" in message and "model_state" in message, message


def test_a_flax_tutorial_loss_fn_names_the_expected_signature():
  def loss_fn(model, batch):
    logits = model(batch["image"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()

  step = jmp_train.make_train_step(lambda v, x: x @ v["params"]["w"], loss_fn, optax.sgd(0.1))
  with pytest.raises(TypeError) as info:
    step(step.init({"w": jnp.ones((3, 2))}), _BATCH)
  message = str(info.value)
  assert message.startswith("make_train_step calls loss_fn(outputs, targets)"), message
  for part in ("(inputs, targets)", "has_aux=True", "loss_fn(model, batch)",
               "string indexing"):
    assert part in message, message

  # A genuine error inside a loss_fn of the right signature is left alone.
  def buggy(outputs, targets):
    raise TypeError("my own bug")

  step = jmp_train.make_train_step(lambda v, x: x @ v["params"]["w"], buggy, optax.sgd(0.1))
  with pytest.raises(TypeError, match="^my own bug"):
    step(step.init({"w": jnp.ones((3, 2))}), _BATCH)

  # The tutorial's (loss, logits) without has_aux.
  step = jmp_train.make_train_step(lambda v, x: x @ v["params"]["w"],
                                   lambda out, y: (_mse(out, y), out), optax.sgd(0.1))
  with pytest.raises(TypeError, match=r"tuple of length 2.*has_aux=True"):
    step(step.init({"w": jnp.ones((3, 2))}), _BATCH)


def test_dropout_without_rngs_says_what_make_train_step_expects():
  import flax.linen as nn  # pylint: disable=g-import-not-at-top
  from flax import nnx  # pylint: disable=g-import-not-at-top

  class Model(nn.Module):

    @nn.compact
    def __call__(self, x):
      return nn.Dropout(0.5, deterministic=False)(nn.Dense(2)(x))

  model = Model()
  params = model.init(jax.random.PRNGKey(0), jnp.ones((1, 3)))["params"]
  step = jmp_train.make_train_step(model, _mse, optax.sgd(0.1))
  with pytest.raises(ValueError, match=r"step\.init\(params, rng=0\)"):
    step(step.init(params), _BATCH)
  step = jmp_train.make_train_step(model, _mse, optax.sgd(0.1), rng_collections=("noise",))
  with pytest.raises(ValueError, match=r"rng_collections=\('noise', 'dropout'\)"):
    step(step.init(params, rng=0), _BATCH)
  step = jmp_train.make_train_step(model, _mse, optax.sgd(0.1))
  with pytest.raises(ValueError, match=r"evaluate .* eval_apply_fn"):
    step.evaluate(step.init(params, rng=0), _BATCH)

  module = nnx.Sequential(nnx.Linear(3, 2, rngs=nnx.Rngs(0)), nnx.Dropout(0.5))
  step = jmp_train.make_train_step(module, _mse, optax.sgd(0.1))
  with pytest.raises(ValueError, match=r"nnx\.Dropout\(0\.5, rngs=nnx\.Rngs\(dropout=0\)\)"):
    step(step.init(module), _BATCH)
