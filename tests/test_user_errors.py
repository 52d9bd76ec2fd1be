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
  return jmp_train.make_train_step(lambda v, x: x @ v["params"]["w"], _mse, optax.adam(0.1))


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


def test_restore_from_a_corrupt_checkpoint_raises_one_quiet_value_error(tmp_path, capfd, caplog, monkeypatch):
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
    data[len(data) // 8 : len(data) // 2] = bytes(len(data) // 2 - len(data) // 8)
    largest.write_bytes(bytes(data))

  bad = [
    corrupt("truncated", truncate),
    corrupt("truncated_btree", truncate_btree),
    corrupt("garbage", garbage_metadata),
    corrupt("scrambled", scramble),
  ]
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
  grad_fn = jmp_train.scaled_value_and_grad(lambda p, x: sum(jnp.sum(x @ layer["kernel"]) for layer in p.values()))
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
  grad_fn = jmp_train.scaled_value_and_grad(lambda params, x: jnp.sum(x @ params["dense"]["kernel"]))
  with pytest.raises(TypeError, match=r"params\['dense'\]\['kernel'\] has dtype int32.*float"):
    grad_fn(2.0, params, jnp.ones((4, 3)))
  step = jmp_train.make_train_step(
    lambda v, x: x @ v["params"]["dense"]["kernel"] + v["params"]["dense"]["bias"], _mse, optax.sgd(0.1)
  )
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
  for part in ("(inputs, targets)", "has_aux=True", "loss_fn(model, batch)", "string indexing"):
    assert part in message, message

  # A genuine error inside a loss_fn of the right signature keeps its kind and
  # its message, chained, with the shapes the loss was given.
  def buggy(outputs, targets):
    raise TypeError("my own bug")

  step = jmp_train.make_train_step(lambda v, x: x @ v["params"]["w"], buggy, optax.sgd(0.1))
  with pytest.raises(TypeError, match=r"^loss_fn\(outputs, targets\) raised TypeError: my own bug; it was") as info:
    step(step.init({"w": jnp.ones((3, 2))}), _BATCH)
  assert str(info.value.__cause__) == "my own bug"

  # The tutorial's (loss, logits) without has_aux.
  step = jmp_train.make_train_step(
    lambda v, x: x @ v["params"]["w"], lambda out, y: (_mse(out, y), out), optax.sgd(0.1)
  )
  with pytest.raises(TypeError, match=r"tuple of length 2.*has_aux=True"):
    step(step.init({"w": jnp.ones((3, 2))}), _BATCH)


def test_dropout_without_rngs_says_what_make_train_step_expects():
  import flax.linen as nn
  from flax import nnx

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


def _linear_apply(v, x, **_):
  return x @ v["params"]["w"]


def test_a_batch_not_laid_out_for_the_mode_names_shard_batch(monkeypatch):
  x, y = np.ones((16, 3), np.float32), np.zeros((16, 2), np.float32)
  step = jmp_train.make_train_step(_linear_apply, _mse, optax.sgd(0.1), mode="pmap")
  state = step.init({"w": jnp.ones((3, 2))})
  for call in (step, step.evaluate):
    # Without step.shard_batch: JAX's "cannot select an axis to squeeze out".
    with pytest.raises(ValueError) as info:
      call(state, (x, y))
    message = str(info.value)
    assert "step.shard_batch(batch)" in message, message
    assert "the leaf [0] has shape (16, 3)" in message and "(8, 2, 3)" in message, message
  # The laid-out batch runs; the state it was given is donated.
  new_state, _ = step(state, step.shard_batch((x, y)))
  for call in (step, step.evaluate):
    # JAX's "Array has been deleted", or a crash on CPU devices.
    with pytest.raises(ValueError, match=r"donated to an earlier step.*donate=False"):
      call(state, step.shard_batch((x, y)))
  assert int(step.unreplicate(new_state.step)) == 1

  step = jmp_train.make_train_step(_linear_apply, _mse, optax.sgd(0.1), mode="shard_map")
  state = step.init({"w": jnp.ones((3, 2))})
  with pytest.raises(
    ValueError,
    match=r"leaf \[0\] has shape \(12, 3\).*mesh's 8 devices.*"
    r"step\.shard_batch\(batch\)",
  ):
    step(state, (x[:12], y[:12]))
  monkeypatch.setattr(jax, "process_count", lambda: 2)
  with pytest.raises(ValueError, match=r"host array \(ndarray\).*multi-process.*shard_batch"):
    step.evaluate(state, (x, y))


def test_a_state_used_again_after_a_donated_step_says_so():
  step = _linear_step()
  state = step.init({"w": jnp.ones((3, 2))})
  new_state, _ = step(state, _BATCH)
  for call in (step, step.evaluate):
    # JAX's "Buffer has been deleted or donated" / "Array has been deleted".
    with pytest.raises(ValueError) as info:
      call(state, _BATCH)
    message = str(info.value)
    assert "donated to an earlier step" in message, message
    assert "state, metrics = step(state, batch)" in message and "donate=False" in message
  # A state with only some leaves donated (a fresh step counter) too.
  with pytest.raises(ValueError, match="donated to an earlier step"):
    step(state.replace(step=jnp.zeros((), jnp.int32)), _BATCH)
  step(new_state, _BATCH)  # the returned state trains on


def test_an_apply_policy_model_has_flax_dtype_attributes():
  import flax.linen as nn

  dense = nn.Dense(4)
  model = jmp_train.flax.apply_policy(dense, "mixed_bfloat16")
  # Flax's examples read model.dtype (e.g. to pick a loss scale).
  assert model.dtype == jnp.bfloat16 and model.param_dtype == jnp.float32
  half = jmp_train.flax.apply_policy(dense, "float16")
  assert half.dtype == jnp.float16 and half.param_dtype == jnp.float16
  with pytest.raises(AttributeError):
    model.dtype = jnp.float32  # read-only: the policy decides
  # Not fields: the variables are still exactly the wrapped module's.
  x = jnp.ones((2, 3))
  shapes = lambda m: jax.tree.map(lambda v: (v.shape, v.dtype), jax.eval_shape(m.init, jax.random.PRNGKey(0), x))
  assert shapes(model) == shapes(dense)
  assert model.clone().dtype == jnp.bfloat16
  out = model.apply(dense.init(jax.random.PRNGKey(0), x), x)
  assert out.shape == (2, 4) and out.dtype == jnp.float32


def test_half_weights_with_a_plain_optimizer_warn_at_construction():
  import warnings

  make = lambda optimizer, policy="bfloat16", **kwargs: jmp_train.make_train_step(
    _linear_apply, _mse, optimizer, policy=policy, **kwargs
  )
  for optimizer, policy, part in [
    (optax.sgd(0.1), "bfloat16", "(bfloat16, policy"),
    (optax.adam(1e-3), "params=float16,compute=float32,output=float32", "scale_by_adam"),
    (jmp_train.adam_8bit(1e-3), "bfloat16", "|w|*2**-8"),  # narrow state, not a rule
  ]:
    with pytest.warns(UserWarning, match="^Half-precision parameters") as record:
      make(optimizer, policy)
    message = str(record[0].message)
    assert record[0].filename == __file__, record[0].filename  # the user's call
    assert part in message, message
    for fix in (
      "jmp_train.stochastic_rounding(seed=0)",
      "jmp_train.kahan_compensation()",
      "jmp_train.modified_momentum_sgd(",
      "policy='mixed_float16'",
    ):
      assert fix in message, message
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    make(optax.sgd(0.1), "mixed_bfloat16")  # float32 master weights
    make(jmp_train.modified_momentum_sgd(0.1), "params=float16,compute=float32,output=float32")
    make(optax.chain(optax.adam(1e-3), jmp_train.stochastic_rounding(seed=0)))
    make(optax.inject_hyperparams(jmp_train.modified_momentum_sgd)(learning_rate=0.1))
    make(optax.MultiSteps(optax.chain(optax.sgd(0.1), jmp_train.kahan_compensation()), 2).gradient_transformation())


def test_a_mismatched_restore_of_a_checkpoint_manager_step_names_the_leaf_quietly(tmp_path, capfd, caplog, monkeypatch):
  import flax.linen as nn

  ocp = pytest.importorskip("orbax.checkpoint")

  caplog.set_level(logging.INFO)
  unraisables = []
  monkeypatch.setattr(sys, "unraisablehook", unraisables.append)

  def make(width, optimizer):
    model = nn.Dense(width)
    params = jax.eval_shape(model.init, jax.random.PRNGKey(0), jnp.ones((1, 3)))["params"]
    params = jax.tree.map(lambda x: jnp.ones(x.shape, x.dtype), params)
    return jmp_train.make_train_step(model.apply, _mse, optimizer).init(params)

  state = make(4, optax.adam(1e-3))
  # The guide's recipe: periodic saves with orbax's CheckpointManager.
  with ocp.CheckpointManager(tmp_path / "run") as manager:
    manager.save(0, args=ocp.args.StandardSave(state))
    manager.wait_until_finished()
  capfd.readouterr()
  with ocp.CheckpointManager(tmp_path / "run") as manager:
    step_folder = manager.directory / str(manager.latest_step())
    # manager.restore(...) with these templates: orbax's error and about a
    # dozen "Event loop is closed" tracebacks. Through restore_checkpoint:
    for like, problem in [
      (make(8, optax.adam(1e-3)), "the leaf .params['bias'] has shape (4,) in the checkpoint but (8,) in the template"),
      (make(4, optax.sgd(0.1)), "the checkpoint's leaf ['opt_state'][0]['count'] (shape (), int32) is not in"),
    ]:
      with pytest.raises(ValueError) as info:
        jmp_train.restore_checkpoint(step_folder, like)
      message = str(info.value)
      assert message.startswith(f"Cannot restore {tmp_path / 'run' / '0' / 'default'} "), message
      assert problem in message and "step.init(params)" in message, message
    _assert_quiet(capfd, caplog, unraisables)
    restored = jmp_train.restore_checkpoint(step_folder, make(4, optax.adam(1e-3)))
  jax.tree.map(np.testing.assert_array_equal, restored, state)
  _assert_quiet(capfd, caplog, unraisables)  # no "Metadata file does not exist"
  with pytest.raises(ValueError, match=r"steps of an orbax CheckpointManager \(0\).*/run/0'"):
    jmp_train.restore_checkpoint(tmp_path / "run", state)
