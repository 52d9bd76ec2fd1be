"""A train loop on simulated CPU devices runs as users run it: queued, no raised timeouts.

XLA:CPU runs every queued program's collectives on one thread pool; steps
queued faster than they run made an all-reduce's rendezvous time out
("Expected 8 threads ... only 7 arrived") and abort the process. The step
``make_train_step`` returns waits for itself on that backend. This test
runs in a process of its own whose ``XLA_FLAGS`` holds only the device
count: none of the test suite's settings (``conftest.py``) apply.

The number of steps matters: without the wait, 300 queued steps of this
model (the one ``jmp-train --quick`` trains) abort the process in most runs
(the rendezvous's 40-second termination timeout), while 100 usually run
through.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import textwrap

import jax
import pytest

from jmp_train._src.train import modes as train_modes

ROOT = pathlib.Path(__file__).parent.parent

_LOOP = textwrap.dedent("""
    import jax
    from jmp_train_examples import demo_configs, demo_tasks, demo_training
    # The model `jmp-train --quick` trains: its steps take milliseconds (unwaited,
    # they would queue far ahead of their collectives).
    settings = demo_configs.DemoSettings(task="text", steps={steps}, batch=16, seq_len=16, d_model=16, eval_batches=1)
    task = demo_tasks.TASKS["text"](settings)
    step = demo_training._build_step(demo_configs.CONFIGS["8dev-f32"], task, settings)
    assert step.num_replicas == 8, step.num_replicas
    state = step.init(demo_tasks.init_params(task, settings))
    for i in range({steps}):  # a plain loop: nothing waits for the steps
      state, metrics = step(state, step.shard_batch(task.train_batch(i)))
    print("steps", int(step.unreplicate(state.step)), "loss", float(metrics["loss"]))
""")


@pytest.mark.slow
def test_300_queued_data_parallel_steps_of_the_demo_model_run_without_raised_timeouts():
  env = dict(os.environ)
  env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
  env["JAX_PLATFORMS"] = "cpu"
  env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
  done = subprocess.run(
    [sys.executable, "-c", _LOOP.format(steps=300)], env=env, capture_output=True, text=True, timeout=400
  )
  assert done.returncode == 0, done.stderr[-3000:]
  assert "steps 300 loss" in done.stdout, done.stdout


def test_only_collective_modes_on_cpu_devices_wait():
  cpus = jax.devices("cpu")
  assert train_modes.waits_for_each_step("shard_map", cpus)
  assert train_modes.waits_for_each_step("pmap", cpus)
  assert not train_modes.waits_for_each_step("single", cpus)
  assert not train_modes.waits_for_each_step("shard_map", cpus[:1])


def test_a_step_on_cpu_devices_returns_computed_arrays(monkeypatch):
  import jax.numpy as jnp
  import optax

  import jmp_train

  waited = []
  block = jax.block_until_ready
  monkeypatch.setattr(jax, "block_until_ready", lambda x: waited.append(1) or block(x))
  step = jmp_train.make_train_step(
    lambda v, x: x @ v["params"]["w"], lambda out, y: jnp.mean((out - y) ** 2), optax.sgd(0.1), mode="shard_map"
  )
  state = step.init({"w": jnp.ones((3, 2))})
  batch = step.shard_batch((jnp.ones((8, 3)), jnp.zeros((8, 2))))
  state, metrics = step(state, batch)
  assert waited and float(metrics["loss"]) > 0
  assert hasattr(step.lower(state, batch), "compile")
