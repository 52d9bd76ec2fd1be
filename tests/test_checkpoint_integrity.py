"""Checkpoints that prove themselves: checksums, the newest intact step, prompt failures.

One checkpoint and one CheckpointManager folder are saved per worker; each
case damages a copy (a flipped bit, 64 flipped bytes, a truncated or
missing file, an edited checksum, a damaged JSON record) and reads it back
through restore_checkpoint and restore_latest_checkpoint.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys
import textwrap
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jmp_train

ocp = pytest.importorskip("orbax.checkpoint")

ROOT = pathlib.Path(__file__).resolve().parents[1]
_RECORD = {"loss": [0.5, 0.25], "note": "the curves so far"}


def _step():
  return jmp_train.make_train_step(
    lambda v, x: x @ v["params"]["w"], lambda out, y: jnp.mean((out - y) ** 2), optax.adam(0.1)
  )


def _state(step, seed):
  # 64 x 32 random float32: its chunk is too large to sit inline in the
  # store's B-tree (which TensorStore checks itself): it gets a data file.
  w = np.random.RandomState(seed).randn(64, 32).astype(np.float32)
  return step.init({"w": jnp.asarray(w)})


def _host(tree):
  return jax.tree.map(np.asarray, tree)


def _assert_equal(a, b):
  jax.tree.map(np.testing.assert_array_equal, _host(a), _host(b))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  root = tmp_path_factory.mktemp("saved")
  step = _step()
  states = {n: _state(step, n) for n in (1, 2)}
  ckpt = jmp_train.save_checkpoint(root / "ckpt", states[2])
  options = ocp.CheckpointManagerOptions(enable_async_checkpointing=True)
  with ocp.CheckpointManager(root / "run", options=options) as manager:
    for n, state in states.items():
      manager.save(n, args=jmp_train.checkpoint_save_args(state, record={**_RECORD, "step": n}))
    manager.wait_until_finished()
  return {
    "ckpt": ckpt,
    "run": root / "run",
    "states": {n: _host(s) for n, s in states.items()},
    "like": _state(step, 0),
  }


def _largest(folder):
  # The data file of params.w (the other arrays are small and inline).
  return max((p for p in folder.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)


def _flip(nbytes):
  def damage(item):
    data = _largest(item)
    raw = bytearray(data.read_bytes())
    middle = len(raw) // 2
    if nbytes == 0:
      raw[middle] ^= 0b1000  # one bit
    else:
      raw[middle : middle + nbytes] = bytes(b ^ 0xFF for b in raw[middle : middle + nbytes])
    data.write_bytes(bytes(raw))

  return damage


def _truncate(item):
  data = _largest(item)
  data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])


def _edit_checksums(edit):
  def damage(item):
    metadata = json.loads((item / "_METADATA").read_text())
    edit(metadata["custom_metadata"]["jmp_train_checksums"]["leaves"])
    (item / "_METADATA").write_text(json.dumps(metadata))

  return damage


def _change_checksum(leaves):
  old = leaves["params/w"]["checksum"]
  leaves["params/w"]["checksum"] = ("0" if old[0] != "0" else "1") + old[1:]


# Damage to the array item (save_checkpoint's folder, or a step's "state"),
# and a fragment of the one-line error that names it.
_ARRAY_DAMAGE = {
  "one_bit": (_flip(0), r"the data of the leaf .params['w'] (in ocdbt.process_0/d/"),
  "64_bytes": (_flip(64), r"does not match the checksum saved with it in _METADATA"),
  "truncated_data_file": (_truncate, "is truncated"),
  "missing_data_file": (lambda item: _largest(item).unlink(), "is missing (it holds 'params.w/0.0')"),
  "missing_metadata": (lambda item: (item / "_METADATA").unlink(), "it has no _METADATA file"),
  # The checksums live in _METADATA: an edited or a lost one.
  "changed_checksum": (_edit_checksums(_change_checksum), "does not match the checksum"),
  "missing_checksum": (
    _edit_checksums(lambda leaves: leaves.pop("params/w")),
    "its _METADATA lists the leaf ['params']['w'], which its checksums do not",
  ),
}


def _truncate_record(step):
  record = step / "record" / "metadata"
  record.write_text(record.read_text()[:20])


def _change_record(step):
  record = step / "record" / "metadata"
  record.write_text(record.read_text().replace("0.25", "0.35"))  # still parses


# Damage to the JSON files of a manager step: the record beside its state, its metadata.
_RECORD_DAMAGE = {
  "truncated_record": (_truncate_record, "its file record/metadata does not parse as JSON"),
  "changed_record": (_change_record, "its file record/metadata does not match the checksum"),
  "missing_record": (
    lambda step: (step / "record" / "metadata").unlink(),
    "its JSON item 'record' has no file record/metadata",
  ),
  "truncated_step_metadata": (
    lambda step: (step / "_CHECKPOINT_METADATA").write_text('{"item_handlers": {"st'),
    "its file _CHECKPOINT_METADATA does not parse as JSON",
  ),
}


def _one_line_error(call):
  with pytest.raises(ValueError) as info:
    call()
  message = str(info.value)
  assert "\n" not in message, message
  assert info.value.__cause__ is None and (info.value.__context__ is None or info.value.__suppress_context__)
  return message


@pytest.mark.parametrize("kind", sorted(_ARRAY_DAMAGE))
def test_a_damaged_checkpoint_raises_one_line_naming_it(saved, tmp_path, kind):
  damage, fragment = _ARRAY_DAMAGE[kind]
  path = tmp_path / "ckpt"
  shutil.copytree(saved["ckpt"], path)
  damage(path)
  message = _one_line_error(lambda: jmp_train.restore_checkpoint(path, saved["like"]))
  assert message.startswith(f"{path} is "), message
  assert fragment in message, message


@pytest.mark.parametrize("kind", sorted(_ARRAY_DAMAGE) + sorted(_RECORD_DAMAGE))
def test_a_damaged_manager_step_is_named_and_passed_over(saved, tmp_path, kind):
  run = tmp_path / "run"
  shutil.copytree(saved["run"], run)
  if kind in _ARRAY_DAMAGE:
    damage, fragment = _ARRAY_DAMAGE[kind]
    damage(run / "2" / "state")
  else:
    damage, fragment = _RECORD_DAMAGE[kind]
    damage(run / "2")
  # The step folder, through restore_checkpoint: one line naming the step.
  message = _one_line_error(lambda: jmp_train.restore_checkpoint(run / "2", saved["like"]))
  assert message.startswith(f"{run / '2'}"), message
  assert fragment in message, message
  # The fall-back: a warning naming step 2 and why, then step 1, intact.
  with pytest.warns(UserWarning) as record:
    n, state = jmp_train.restore_latest_checkpoint(run, saved["like"])
  assert n == 1
  _assert_equal(state, saved["states"][1])
  [warning] = [str(w.message) for w in record if "Passing over" in str(w.message)]
  assert warning.startswith(f"Passing over step 2 of {run}, damaged or incomplete: 2"), warning
  assert fragment in warning and "\n" not in warning, warning


def test_intact_steps_restore_the_newest_without_a_warning(saved, tmp_path):
  run = tmp_path / "run"
  shutil.copytree(saved["run"], run)
  # A save a kill interrupted: orbax's temporary folder, never a step.
  shutil.copytree(run / "2", run / "3.orbax-checkpoint-tmp-1234")
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    n, state = jmp_train.restore_latest_checkpoint(run, saved["like"])
    restored = jmp_train.restore_checkpoint(saved["ckpt"], saved["like"])
  assert n == 2
  _assert_equal(state, saved["states"][2])
  _assert_equal(restored, saved["states"][2])
  # save_checkpoint folders named <name>_<step> are steps too.
  folders = tmp_path / "folders"
  for n in (9, 10):
    shutil.copytree(saved["ckpt"], folders / f"step_{n}")
  _flip(0)(folders / "step_10")
  with pytest.warns(UserWarning, match="Passing over step 10"):
    assert jmp_train.restore_latest_checkpoint(folders, saved["like"])[0] == 9


def test_no_intact_step_and_no_step_raise(saved, tmp_path):
  run = tmp_path / "run"
  shutil.copytree(saved["run"], run)
  for n in (1, 2):
    _flip(64)(run / str(n) / "state")
  with pytest.warns(UserWarning) as record:
    message = _one_line_error(lambda: jmp_train.restore_latest_checkpoint(run, saved["like"]))
  assert [str(w.message).split(",")[0] for w in record] == [f"Passing over step {n} of {run}" for n in (2, 1)]
  assert message.startswith(f"No intact checkpoint in {run}: all 2 step(s)"), message
  assert "step 2: the data of the leaf .params['w']" in message, message
  (tmp_path / "empty").mkdir()
  with pytest.raises(FileNotFoundError, match="holds no step folders"):
    jmp_train.restore_latest_checkpoint(tmp_path / "empty", saved["like"])


def test_a_template_that_does_not_match_is_not_passed_over(saved):
  other = _step().init({"w": jnp.zeros((8, 32))})
  with warnings.catch_warnings():
    warnings.simplefilter("error")  # raised at once: an older step would not match either
    with pytest.raises(ValueError, match=r"Cannot restore .*/run/2/state into this template"):
      jmp_train.restore_latest_checkpoint(saved["run"], other)


def test_checkpoints_without_checksums_restore_unverified(saved, tmp_path):
  # As the guide's recipe saved before checksums (ocp.args.StandardSave).
  state = saved["states"][1]
  with ocp.CheckpointManager(tmp_path / "old") as manager:
    manager.save(5, args=ocp.args.StandardSave(state))
    manager.wait_until_finished()
  metadata = json.loads((tmp_path / "old" / "5" / "default" / "_METADATA").read_text())
  assert "jmp_train_checksums" not in (metadata.get("custom_metadata") or {})
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    n, restored = jmp_train.restore_latest_checkpoint(tmp_path / "old", saved["like"])
  assert n == 5
  _assert_equal(restored, state)
  # checkpoint_save_args without JSON items: the manager's "default" item.
  with ocp.CheckpointManager(tmp_path / "new") as manager:
    manager.save(6, args=jmp_train.checkpoint_save_args(state))
    manager.wait_until_finished()
  _flip(0)(tmp_path / "new" / "6" / "default")
  with pytest.raises(ValueError, match=r"/new/6/default is a damaged jmp_train checkpoint"):
    jmp_train.restore_checkpoint(tmp_path / "new" / "6", saved["like"])
  with pytest.raises(TypeError, match="JSON item 'record' is not JSON-serializable"):
    jmp_train.checkpoint_save_args(state, record={"x": object()})


def test_a_step_that_lost_its_step_metadata_restores_as_the_newest_step_does(saved, tmp_path):
  # The step's _CHECKPOINT_METADATA gone, its items intact: restored (and
  # verified) as restore_latest_checkpoint restores it.
  run = tmp_path / "run"
  shutil.copytree(saved["run"], run)
  (run / "2" / "_CHECKPOINT_METADATA").unlink()
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    _assert_equal(jmp_train.restore_checkpoint(run / "2", saved["like"]), saved["states"][2])
    assert jmp_train.restore_latest_checkpoint(run, saved["like"])[0] == 2
  # Its JSON record is still checked against the checksum saved with the state.
  _change_record(run / "2")
  message = _one_line_error(lambda: jmp_train.restore_checkpoint(run / "2", saved["like"]))
  assert message.startswith(f"{run / '2'} is a damaged"), message
  assert "its file record/metadata does not match the checksum" in message, message
  # With two array items, which one to restore is the caller's choice: the
  # message names the missing file and the call.
  shutil.copytree(saved["run"] / "2" / "state", run / "1" / "other")
  (run / "1" / "_CHECKPOINT_METADATA").unlink()
  message = _one_line_error(lambda: jmp_train.restore_checkpoint(run / "1", saved["like"]))
  assert message.startswith(f"{run / '1'} has no _CHECKPOINT_METADATA file"), message
  assert f"restore_checkpoint('{run / '1' / 'state'}', like)" in message, message


def test_checksums_do_not_depend_on_the_sharding(saved, tmp_path):
  # Saved sharded over the 8 devices, restored replicated: the same sums.
  mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(4, 2), ("a", "b"))
  sharded = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("a", "b"))
  state = jax.tree.map(jnp.asarray, saved["states"][2])
  state = state.replace(params={"w": jax.device_put(state.params["w"], sharded)})
  path = jmp_train.save_checkpoint(tmp_path / "sharded", state)
  replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  like = saved["like"].replace(params={"w": jax.device_put(saved["like"].params["w"], replicated)})
  restored = jmp_train.restore_checkpoint(path, like)
  assert restored.params["w"].sharding == replicated
  _assert_equal(restored, saved["states"][2])
  assert (
    json.loads((path / "_METADATA").read_text())["custom_metadata"]
    == json.loads((saved["ckpt"] / "_METADATA").read_text())["custom_metadata"]
  )


def test_force_replaces_only_a_checkpoint_folder(saved, tmp_path):
  state = saved["states"][1]
  notes = tmp_path / "notes.txt"
  notes.write_text("the user's file")
  with pytest.raises(ValueError) as info:
    jmp_train.save_checkpoint(notes, state, force=True)
  message = str(info.value)
  assert message.startswith(f"{notes} exists and is a file"), message
  assert "force=True) only replaces a checkpoint folder" in message, message
  assert notes.read_text() == "the user's file"
  with pytest.raises(FileExistsError) as info:
    jmp_train.save_checkpoint(notes, state)
  assert "is a file" in str(info.value) and "force=True to" not in str(info.value)
  # A folder of other files, and a CheckpointManager's folder of steps.
  folder = tmp_path / "results"
  folder.mkdir()
  (folder / "results.json").write_text("{}")
  run = tmp_path / "run"
  shutil.copytree(saved["run"], run)
  for target in (folder, run):
    with pytest.raises(ValueError, match="a folder that is not a checkpoint"):
      jmp_train.save_checkpoint(target, state, force=True)
  assert (folder / "results.json").read_text() == "{}"
  assert sorted(p.name for p in run.iterdir()) == ["1", "2"]
  # A checkpoint folder (a manager step included) is replaced.
  assert jmp_train.save_checkpoint(run / "2", state, force=True) == run / "2"
  _assert_equal(jmp_train.restore_checkpoint(run / "2", saved["like"]), state)


_FAILED_SAVES = textwrap.dedent("""
    import pathlib, sys, time
    sys.path.insert(0, sys.argv[2])
    import jax.numpy as jnp, optax, jmp_train
    from jmp_train._src.train import checkpoint
    out = pathlib.Path(sys.argv[1])
    (out / "file").write_text("x")
    step = jmp_train.make_train_step(
        lambda v, x: x @ v["params"]["w"], lambda o, y: jnp.mean((o - y) ** 2), optax.adam(0.1))
    state = step.init({"w": jnp.ones((3, 2))})
    targets = [out / "file" / "ckpt", pathlib.Path("/proc/jmp_train_ckpt")]
    if not hasattr(__import__("os"), "geteuid") or __import__("os").geteuid() != 0:
      (out / "read_only").mkdir(mode=0o555)  # root writes anyway
      targets.append(out / "read_only" / "ckpt")
    for target in targets:
      try:
        jmp_train.save_checkpoint(target, state)
      except OSError as e:
        print("refused:", type(e).__name__, e)
    # A failure inside orbax (its folder check skipped): its threads that
    # wait for the failed phase's signal are released.
    checkpoint._check_writable = lambda path: None
    try:
      jmp_train.save_checkpoint(out / "file" / "inside", state)
    except OSError as e:
      print("failed inside orbax:", type(e).__name__)
    print("done", time.monotonic(), flush=True)
""")


def test_a_failed_save_lets_the_interpreter_exit_at_once(tmp_path):
  script = tmp_path / "failed_saves.py"
  script.write_text(_FAILED_SAVES)
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  env["JAX_PLATFORMS"] = "cpu"
  result = subprocess.run(
    [sys.executable, str(script), str(tmp_path), str(ROOT)], env=env, capture_output=True, text=True, timeout=60
  )
  exited = time.monotonic()
  assert result.returncode == 0, result.stderr[-3000:]
  lines = result.stdout.splitlines()
  assert (
    f"refused: NotADirectoryError Cannot write a checkpoint at {tmp_path}/file/ckpt: "
    f"{tmp_path}/file is a file, not a folder." in lines
  ), result.stdout
  assert any(line.startswith("refused: ") and "/proc/jmp_train_ckpt" in line for line in lines), result.stdout
  assert "failed inside orbax: NotADirectoryError" in lines, result.stdout
  # Orbax's threads used to keep the interpreter for five minutes.
  done = float(lines[-1].split()[1])
  assert exited - done < 20, exited - done
  assert not (tmp_path / "file").is_dir() and (tmp_path / "file").read_text() == "x"


@pytest.mark.parametrize("kind", ["one_bit", "truncated_record"])
def test_the_demo_resumes_from_its_newest_intact_step(saved, tmp_path, kind):
  from jmp_train_examples import demo_training
  from jmp_train_examples.demo_configs import DemoSettings

  s = DemoSettings(checkpoint_dir=str(tmp_path))
  checkpoints = demo_training._Checkpoints("f32", s)
  for n in (1, 2):
    state = jax.tree.map(jnp.asarray, saved["states"][n])
    curves = {"loss": [float(n)], "loss_scale": [1.0]}
    checkpoints.save(n, state, curves, {"loss_scale": 1.0, "skipped_steps": 0})
  checkpoints.close()
  if kind == "one_bit":
    damage, fragment = _ARRAY_DAMAGE[kind][0], "the data of the leaf .params['w']"
    damage(tmp_path / "f32" / "2" / "state")
  else:
    damage, fragment = _RECORD_DAMAGE[kind]
    damage(tmp_path / "f32" / "2")
  checkpoints = demo_training._Checkpoints("f32", s)
  checkpoints.check()  # the damaged step's record is left to restore()
  with pytest.warns(UserWarning, match="Passing over step 2") as record:
    state, n, run_record = checkpoints.restore(saved["like"])
  assert any(fragment in str(w.message) for w in record), [str(w.message) for w in record]
  assert n == 1 and run_record["loss"] == [1.0]
  _assert_equal(state, saved["states"][1])
  # The step passed over is gone: the resumed run saves it again.
  checkpoints.save(2, state, {"loss": [1.0, 2.0], "loss_scale": [1.0, 1.0]}, {"loss_scale": 1.0, "skipped_steps": 0})
  checkpoints.close()
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    assert jmp_train.restore_latest_checkpoint(tmp_path / "f32", saved["like"])[0] == 2


def test_the_guides_manager_recipe_resumes_past_a_damaged_step(saved, tmp_path):
  step = _step()
  x = np.random.RandomState(0).randn(4, 64).astype(np.float32)
  y = np.zeros((4, 32), np.float32)
  options = ocp.CheckpointManagerOptions(save_interval_steps=2, max_to_keep=3)

  def run(until):
    with ocp.CheckpointManager(tmp_path / "run", options=options) as manager:
      state = step.init({"w": jnp.zeros((64, 32))})
      if manager.latest_step() is not None:
        n, state = jmp_train.restore_latest_checkpoint(manager.directory, state)
        for damaged in [s for s in manager.all_steps() if s > n]:
          manager.delete(damaged)
      for _ in range(int(step.unreplicate(state.step)), until):
        state, _ = step(state, step.shard_batch((x, y)))
        n = int(step.unreplicate(state.step))
        if manager.should_save(n):
          manager.save(n, args=jmp_train.checkpoint_save_args(state))
      manager.wait_until_finished()
      return _host(state), manager.all_steps()

  want, steps = run(6)
  assert steps == [2, 4, 6]
  _flip(64)(tmp_path / "run" / "6" / "default")
  with pytest.warns(UserWarning, match="Passing over step 6"):
    got, steps = run(6)  # from step 4, saving step 6 again
  assert steps == [2, 4, 6]
  _assert_equal(got, want)
