"""Mistakes and faults that used to pass silently or end in a misleading error: each now names itself.

Complete optimizers given together with an optimizer, non-finite starting
parameters, outputs and targets that broadcast, batches whose inputs and
targets disagree, losses that fail on their targets, an axis name the step
does not map, empty parameters, NumPy integers as arguments, and a process
continued after its job gave it up.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import signal
import subprocess
import sys
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jmp_train
from helpers import processes
from test_user_errors import _linear_apply, _mse

HERE = pathlib.Path(__file__).parent


def _xent(logits, labels):
  return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def _mesh(n=2):
  return jax.sharding.Mesh(np.asarray(jax.devices()[:n]), ("batch",))


# 1. A complete optimizer given as compression= with an optimizer besides.


@pytest.mark.parametrize(
  "complete",
  [
    lambda: jmp_train.diloco(optax.adam(1e-2), sync_every=4, axis_name="batch"),
    lambda: jmp_train.one_bit_adam(1e-3, axis_name="batch", warmup_steps=2),
    lambda: jmp_train.one_bit_momentum(0.1, axis_name="batch"),
  ],
)
def test_a_complete_optimizer_as_compression_with_an_optimizer_is_refused(complete):
  # Before: accepted, and a second Adam ran on the complete optimizer's updates.
  with pytest.raises(TypeError) as info:
    jmp_train.make_train_step(_linear_apply, _mse, optax.adam(1e-2), compression=complete(), mode="shard_map")
  message = str(info.value)
  assert message.startswith("compression is a complete optimizer on local gradients"), message
  assert "scale_by_adam" in message and "Pass optimizer=None" in message, message
  # Alone, it is the whole optimizer.
  jmp_train.make_train_step(_linear_apply, _mse, None, compression=complete(), mode="shard_map", mesh=_mesh())


# 2. Parameters that are not finite at init.


def test_non_finite_parameters_at_init_are_named():
  step = jmp_train.make_train_step(_linear_apply, _mse, optax.sgd(0.1))
  params = {"w": jnp.ones((3, 2)).at[1, 1].set(jnp.inf), "b": jnp.array([0.0, jnp.nan, jnp.nan])}
  with pytest.raises(ValueError) as info:
    step.init(params)
  message = str(info.value)
  assert message.startswith("step.init got parameters that are not finite: "), message
  assert "params['b'] (2 of 3), params['w'] (1 of 6)" in message and "initialiser" in message, message
  step.init({"w": jnp.ones((3, 2))})  # finite: fine
  # Finite in float32, inf once cast to float16 parameters.
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # half-precision weights without a narrow-weights rule
    half = jmp_train.make_train_step(_linear_apply, _mse, optax.sgd(0.1), policy="float16", loss_scale=None)
  with pytest.raises(ValueError, match=r"once cast to the policy's param_dtype float16: inf or NaN in params\['w'\]"):
    half.init({"w": jnp.full((3, 2), 1e5)})


# 3. Outputs and targets that broadcast to a larger shape.


def test_outputs_and_targets_that_broadcast_warn_once_per_trace():
  step = jmp_train.make_train_step(_linear_apply, _mse, optax.sgd(0.1))
  state = step.init({"w": jnp.ones((3, 1))})
  batch = (np.ones((16, 3), np.float32), np.zeros((16,), np.float32))
  with pytest.warns(UserWarning) as record:
    state, _ = step(state, batch)
  messages = [str(r.message) for r in record if "broadcast" in str(r.message)]
  assert len(messages) == 1, messages
  assert messages[0].startswith(
    "loss_fn gets outputs of shape (16, 1) and targets of shape (16,), which broadcast to (16, 16)"
  ), messages[0]
  assert "jnp.squeeze(outputs, -1)" in messages[0], messages[0]
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    step(state, batch)  # compiled already: no trace, no warning
    # Per-example logits against integer labels, and equal shapes: silent.
    xent = jmp_train.make_train_step(_linear_apply, _xent, optax.sgd(0.1))
    xent(xent.init({"w": jnp.ones((3, 16))}), (batch[0], np.zeros((16,), np.int32)))
    mse = jmp_train.make_train_step(_linear_apply, _mse, optax.sgd(0.1))
    mse(mse.init({"w": jnp.ones((3, 1))}), (batch[0], batch[1][:, None]))


# 4. sign_compression_wire_bytes and sign_compression agree on what is sent.


def test_wire_bytes_refuse_the_leaf_sign_compression_refuses():
  params = {"w": jnp.zeros((8, 16)), "n": jnp.zeros((32,), jnp.int32)}
  with pytest.raises(ValueError) as refused:
    jmp_train.sign_compression("batch", num_replicas=8).init(params)
  with pytest.raises(ValueError) as counted:
    jmp_train.sign_compression_wire_bytes(params, 8)  # before: counted the int32 leaf as sent
  assert str(counted.value) == str(refused.value)
  assert "the leaf at \"['n']\" has dtype int32" in str(counted.value) and "optax.masked" in str(counted.value)
  floating = {"w": params["w"]}
  assert jmp_train.sign_compression_wire_bytes(floating, 8) == jmp_train.sign_compression_wire_bytes(
    jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), floating), 8
  )


# 5. A dynamic loss scale pinned at its floor.


def test_the_demo_warns_when_the_loss_scale_sits_at_its_floor_for_a_growth_interval():
  from jmp_train_examples import demo_training

  step = jmp_train.make_train_step(
    _linear_apply,
    _mse,
    optax.sgd(0.1),
    policy="mixed_float16",
    loss_scale=jmp_train.DynamicLossScale(4.0, growth_interval=20),
  )
  watch = demo_training._ScaleFloorWatch(step.init({"w": jnp.ones((3, 2))}), "f16")
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    for i, scale in ((10, 1.0), (20, 2.0), (30, 1.0), (40, 1.0)):  # back above the floor at 20
      watch.update({"loss_scale": jnp.float32(scale)}, i)
  with pytest.warns(
    UserWarning, match=r"'f16': the dynamic loss scale has sat at its floor min_scale=1 from step 30 to step 50"
  ):
    watch.update({"loss_scale": jnp.float32(1.0)}, 50)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    watch.update({"loss_scale": jnp.float32(1.0)}, 60)  # once
    # Without loss scaling the scale metric is 1 for good: silent.
    plain = demo_training._ScaleFloorWatch(_linear_step_state(), "f32")
    for i in range(10, 200, 10):
      plain.update({"loss_scale": jnp.float32(1.0)}, i)


def _linear_step_state():
  return jmp_train.make_train_step(_linear_apply, _mse, optax.sgd(0.1)).init({"w": jnp.ones((3, 2))})


# 6. A process continued after its job gave it up.


def test_a_failed_collective_in_a_multi_process_step_is_not_blamed_on_donation(monkeypatch):
  step = jmp_train.make_train_step(_linear_apply, _mse, optax.sgd(0.1))
  state = step.init({"w": jnp.ones((3, 2))})

  def lost(state, batch):
    jax.tree.map(lambda x: x.delete(), state)  # donated when the step started
    raise ValueError("UNKNOWN: Gloo all-reduce failed: [pair.cc:547] Connection closed by peer [127.0.0.1]:1234")

  broken = dataclasses.replace(step, _step=lost)
  monkeypatch.setattr(jax, "process_count", lambda: 2)
  monkeypatch.setattr(jax, "process_index", lambda: 1)
  with pytest.raises(RuntimeError) as info:
    broken(state, (np.ones((4, 3), np.float32), np.zeros((4, 2), np.float32)))
  message = str(info.value)
  assert message.startswith("step(state, batch) failed in process 1 of 2: a collective lost the other processes"), (
    message
  )
  assert "Connection closed by peer" in message and "heartbeat timeout" in message and "donat" not in message
  assert isinstance(info.value.__cause__, ValueError)


def _stop_and_continue(folder: pathlib.Path) -> tuple[int, str]:
  """Two workers; process 1 stops itself, process 0 ends; then process 1 continues: its output."""
  folder.mkdir(parents=True)
  env = processes.worker_env()
  env["JAX_PLATFORMS"] = "cpu"
  port = str(processes.free_port())
  procs = [
    subprocess.Popen(
      [sys.executable, str(HERE / "helpers" / "stopped_worker.py"), str(pid), "2", port, str(folder)],
      env=env,
      stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT,
      text=True,
    )
    for pid in range(2)
  ]
  try:
    deadline = time.monotonic() + 60
    while not (folder / "stopped").exists():
      assert all(p.poll() is None for p in procs) and time.monotonic() < deadline, "the workers did not start"
      time.sleep(0.1)
    # The job gives the stopped process up: process 0 ends, and the coordination service with it.
    first = procs[0].communicate(timeout=60)[0]
    assert procs[0].returncode != 0, first[-3000:]
    os.kill(procs[1].pid, signal.SIGCONT)
    return procs[1].communicate(timeout=60)[0]
  finally:
    for p in procs:
      if p.poll() is None:
        os.kill(p.pid, signal.SIGCONT)
        p.kill()
        p.wait()


@pytest.mark.slow
def test_a_process_continued_after_its_job_gave_it_up_names_the_lost_peers(tmp_path):
  # Before: "The state passed to step(state, batch) was donated to an earlier step ... donate=False".
  for attempt in range(3):
    output = _stop_and_continue(tmp_path / str(attempt))
    # jax.distributed aborts the process as it continues, too; rarely before Python's error is out.
    if "error:" in output:
      break
  assert "donat" not in output, output[-3000:]
  line = next((x for x in output.splitlines() if x.startswith("error:")), None)
  assert line is not None, output[-3000:]
  assert line.startswith(
    "error: RuntimeError: step(state, batch) failed in process 1 of 2: a collective lost the other processes ("
  ), line
  assert "paused (SIGSTOP" in line and "restart every process" in line, line


# 7. An axis name the step does not map.


@pytest.mark.parametrize(
  "make, name",
  [
    (lambda: jmp_train.diloco(optax.sgd(0.1), sync_every=2, axis_name="foo"), "diloco"),
    # init made outside the axis (num_replicas): before, a bare AssertionError.
    (lambda: jmp_train.one_bit_adam(1e-3, axis_name="foo", warmup_steps=1, num_replicas=2), "one_bit_adam"),
    (lambda: jmp_train.one_bit_momentum(0.1, axis_name="foo", warmup_steps=1, num_replicas=2), "one_bit_momentum"),
  ],
)
def test_a_complete_optimizer_on_an_axis_the_step_does_not_map_names_the_steps_axis(make, name):
  step = jmp_train.make_train_step(_linear_apply, _mse, None, compression=make(), mode="shard_map", mesh=_mesh())
  state = step.init({"w": jnp.ones((3, 2))})
  with pytest.raises(ValueError) as info:
    step(state, step.shard_batch((np.ones((4, 3), np.float32), np.zeros((4, 2), np.float32))))
  message = str(info.value)
  assert message.startswith(
    f"{name}(axis_name='foo').update runs inside a step mapped over ['batch'], where no axis is named 'foo'"
  ), message
  assert f"{name}(axis_name='batch')" in message, message


# 8. Empty parameters.


@pytest.mark.parametrize(
  "tx",
  [
    jmp_train.one_bit_adam(1e-2, axis_name="i", warmup_steps=1),
    jmp_train.one_bit_adam(1e-2, axis_name="i", warmup_steps=1, variance_refresh=2, exchange="preconditioned"),
  ],
)
def test_one_bit_adam_on_empty_parameters_is_a_no_op_as_optax(tx):
  mapped = lambda f: jax.vmap(f, axis_name="i", axis_size=2)
  state = mapped(tx.init)({})
  for _ in range(3):  # warm-up, then compressed steps
    updates, state = mapped(lambda s: tx.update({}, s, {}))(state)
  assert updates == {} == optax.adam(1e-2).update({}, optax.adam(1e-2).init({}))[0]
  assert state.count.tolist() == [3, 3]


# 9. Integer arguments: one check, NumPy integers alike.


def test_integer_arguments_take_numpy_integers_and_refuse_bools_everywhere():
  i = np.int64
  jmp_train.diloco(optax.sgd(0.1), sync_every=i(4), axis_name="batch")  # before: refused
  jmp_train.one_bit_adam(1e-3, axis_name="batch", warmup_steps=i(5), variance_refresh=np.int32(2))
  jmp_train.one_bit_momentum(0.1, axis_name="batch", warmup_steps=i(2), num_replicas=i(2), bucket_bytes=i(4096))
  jmp_train.sign_compression("batch", warmup_steps=i(1), num_replicas=i(8), bucket_bytes=i(4096))
  jmp_train.compressed_mean("batch", num_replicas=i(2), bucket_bytes=i(4096))
  assert jmp_train.DynamicLossScale(growth_interval=i(10)).growth_interval == 10
  assert jmp_train.sign_compression_wire_bytes({"w": jnp.zeros((8, 8))}, i(4)) > 0
  assert jmp_train.diagnostics.pad_to_multiple(i(50), i(8)) == 56
  jmp_train.make_train_step(_linear_apply, _mse, optax.sgd(0.1), bucket_bytes=i(2**20))
  jmp_train.adam_8bit(1e-3, block_size=i(64))
  for bad in (True, 4.0, 0, jnp.int32(4)):
    with pytest.raises(ValueError, match=r"^sync_every must be a positive int \(local steps per synchronisation"):
      jmp_train.diloco(optax.sgd(0.1), sync_every=bad, axis_name="batch")
  # bools passed as integers before.
  for make, name in [
    (lambda: jmp_train.compressed_mean("batch", num_replicas=True), "num_replicas"),
    (lambda: jmp_train.sign_compression("batch", warmup_steps=True), "warmup_steps"),
    (lambda: jmp_train.one_bit_adam(1e-3, axis_name="batch", warmup_steps=True), "warmup_steps"),
    (lambda: jmp_train.DynamicLossScale(growth_interval=True), "growth_interval"),
    (lambda: jmp_train.adam_8bit(1e-3, min_8bit_size=True), "min_8bit_size"),
  ]:
    with pytest.raises(ValueError, match=rf"^{name} must be a.* int.*, got True"):
      make()


# 11. Targets the loss cannot use.


def test_bad_targets_name_the_shapes_and_dtypes_the_loss_was_given():
  step = jmp_train.make_train_step(_linear_apply, _xent, optax.sgd(0.1))
  state = step.init({"w": jnp.ones((3, 10))})
  x = np.ones((16, 3), np.float32)
  for targets, kind, original in [
    (np.zeros((16,), np.float32), TypeError, "Expected the input to have a dtype that is a subdtype of"),
    (np.zeros((16, 1), np.int32), ValueError, "indices and arr must have the same number of dimensions"),
  ]:
    with pytest.raises(kind) as info:
      step(state, (x, targets))
    message = str(info.value)
    assert message.startswith(f"loss_fn(outputs, targets) raised {kind.__name__}: {original}"), message
    shown = f"targets (an array of shape {targets.shape} and dtype {targets.dtype})"
    assert "outputs (an array of shape (16, 10) and dtype float32)" in message and shown in message, message
    assert "labels[:, 0]" in message and "labels.astype(jnp.int32)" in message, message
    assert isinstance(info.value.__cause__, kind) and original in str(info.value.__cause__)
  # 16 inputs against 8 targets: before, "Incompatible shapes for broadcasting" from inside optax.
  for call in (step, step.evaluate):
    with pytest.raises(ValueError, match=r"^The batch's inputs hold 16 examples but its targets 8 \(leading axes"):
      call(state, (x, np.zeros((8,), np.int32)))
  sharded = jmp_train.make_train_step(_linear_apply, _xent, optax.sgd(0.1), mode="shard_map", mesh=_mesh())
  with pytest.raises(ValueError, match=r"inputs hold 8 examples but its targets 4 on each replica"):
    sharded(sharded.init({"w": jnp.ones((3, 10))}), sharded.shard_batch((x, np.zeros((8,), np.int32))))
