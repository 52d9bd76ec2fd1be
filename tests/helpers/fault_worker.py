"""One process of the killed-process tests: 1-bit Adam with loss scaling, checkpointed.

Run as ``python tests/helpers/fault_worker.py PROCESS_ID NUM_PROCESSES PORT DIR
[flags]``. The process joins a ``jax.distributed`` job on
``127.0.0.1:PORT`` (one CPU device, gloo collectives, a heartbeat timeout
so that a dead peer ends the job) and trains a small MLP with
:func:`jmp_train.make_train_step` in ``shard_map`` mode:
:func:`jmp_train.one_bit_adam` (per-device worker and server residuals),
``mixed_float16`` and a :class:`jmp_train.DynamicLossScale` whose scale
grows and backs off within the run.

It resumes from the latest complete checkpoint under ``DIR/ckpt`` when
there is one, trains to ``--steps`` and saves every ``--every`` steps:

* ``--checkpointer files``: :func:`jmp_train.save_checkpoint` into
  ``DIR/ckpt/<step>`` (atomic: orbax writes a temporary folder and renames
  it); the latest complete step is the largest number there.
* ``--checkpointer manager``: ``ocp.CheckpointManager`` with asynchronous
  saves (``save_interval_steps``), restored from ``latest_step()``.

Fault injection, for the test to kill the process at a known point:
``--stop-after N`` writes ``DIR/at<N>.<pid>`` after step ``N`` and waits
there; ``--die-in-save N`` sends SIGKILL to this process right after it
has started the (asynchronous) save of step ``N``. ``--dump`` writes this
process's replica of every leaf of the final state to ``DIR/state<pid>.npz``;
``--compilation-cache DIR`` turns on JAX's persistent compilation cache.
``--then DIR2 CHECKPOINTER`` (repeatable) does the same, afterwards, in
``DIR2`` with that checkpointer: one job resumes several folders with one
compiled step.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import signal
import sys
import time

STEPS, EVERY, WARMUP, DEVICES = 40, 10, 5, 1
HEARTBEAT_S = 10


def _args(argv):
  p = argparse.ArgumentParser()
  p.add_argument("pid", type=int)
  p.add_argument("n", type=int)
  p.add_argument("port", type=int)
  p.add_argument("dir", type=pathlib.Path)
  p.add_argument("--checkpointer", choices=["files", "manager"], default="files")
  p.add_argument("--steps", type=int, default=STEPS)
  p.add_argument("--every", type=int, default=EVERY)
  p.add_argument("--stop-after", type=int)
  p.add_argument("--die-in-save", type=int)
  p.add_argument("--dump", action="store_true")
  p.add_argument("--compilation-cache", type=pathlib.Path)
  p.add_argument("--then", nargs=2, action="append", default=[], metavar=("DIR", "CHECKPOINTER"))
  a = p.parse_args(argv)
  for _, checkpointer in a.then:
    if checkpointer not in ("files", "manager"):
      p.error(f"--then: checkpointer {checkpointer!r} is not 'files' or 'manager'")
  return a


def batch(i, pid, n, per_process=8):
  """Process ``pid``'s share of the global batch of step ``i``."""
  import numpy as np

  rng = np.random.default_rng(1000 + i)
  x = rng.normal(size=(n * per_process, 8)).astype(np.float32)
  y = np.tanh(x @ np.linspace(-1, 1, 8 * 4, dtype=np.float32).reshape(8, 4))
  return x[pid * per_process : (pid + 1) * per_process], y[pid * per_process : (pid + 1) * per_process]


def make_step(mesh=None):
  """The train step (over ``mesh``, else all devices of the job)."""
  import jax.numpy as jnp
  import jmp_train

  def apply_fn(variables, x):
    p = variables["params"]
    return jnp.tanh(x @ p["w1"] + p["b1"]) @ p["w2"]

  return jmp_train.make_train_step(
    apply_fn,
    lambda out, y: jnp.mean((out - y) ** 2),
    None,
    compression=jmp_train.one_bit_adam(3e-2, axis_name="batch", warmup_steps=WARMUP),
    policy="mixed_float16",
    mode="shard_map",
    mesh=mesh,
    # Grows every 4 good steps from 2^14: float16 overflows on the way.
    loss_scale=jmp_train.DynamicLossScale(2.0**14, growth_interval=4),
  )


def params():
  import numpy as np

  rng = np.random.default_rng(0)
  return {
    "w1": (rng.normal(size=(8, 16)) * 0.3).astype(np.float32),
    "b1": np.zeros(16, np.float32),
    "w2": (rng.normal(size=(16, 4)) * 0.3).astype(np.float32),
  }


def local_replicas(state) -> dict:
  """``{"<leaf path>@<replica>": array}`` for this process's replicas of every leaf."""
  import jax
  import numpy as np

  out = {}
  for path, leaf in jax.tree_util.tree_leaves_with_path(state):
    for shard in leaf.addressable_shards:  # leading axis: one entry per replica
      out[f"{jax.tree_util.keystr(path)}@{shard.index[0].start or 0}"] = np.asarray(shard.data)
  return out


def _mark(path: pathlib.Path) -> None:
  path.write_text("")


def _run(a, step, folder: pathlib.Path, checkpointer: str) -> None:
  """Resumes from the latest complete checkpoint in ``folder/ckpt`` (if any), trains to ``a.steps``."""
  import jax
  import numpy as np
  import orbax.checkpoint as ocp
  import jmp_train

  state = step.init(params())
  ckpt = folder / "ckpt"
  manager = None
  begin = 0
  if checkpointer == "manager":
    manager = ocp.CheckpointManager(
      ckpt, options=ocp.CheckpointManagerOptions(save_interval_steps=a.every, enable_async_checkpointing=True)
    )
    latest = manager.latest_step()
    if latest is not None:
      state = manager.restore(latest, args=ocp.args.StandardRestore(state))
      begin = latest
  elif ckpt.is_dir():
    done = [int(p.name) for p in ckpt.iterdir() if p.name.isdigit()]
    if done:
      begin = max(done)
      state = jmp_train.restore_checkpoint(ckpt / str(begin), state)
  print(f"process {a.pid}: {folder.name}: starting at step {begin}", flush=True)
  assert int(step.unreplicate(state.step)) == begin

  for i in range(begin, a.steps):
    state, metrics = step(state, step.shard_batch(batch(i, a.pid, a.n)))
    n = i + 1
    if manager is not None:
      manager.save(n, args=ocp.args.StandardSave(state))
    elif n % a.every == 0:
      jax.block_until_ready(state)
      jmp_train.save_checkpoint(ckpt / str(n), state)
    if n == a.die_in_save:
      os.kill(os.getpid(), signal.SIGKILL)
    if n == a.stop_after:
      jax.block_until_ready(state)
      _mark(folder / f"at{n}.{a.pid}")
      while True:  # the test kills this process here
        time.sleep(1)
  if manager is not None:
    manager.wait_until_finished()
    manager.close()
  jax.block_until_ready(metrics)
  if a.dump:
    np.savez(folder / f"state{a.pid}.npz", **local_replicas(state))
    print(
      f"process {a.pid}: loss scale {float(metrics['loss_scale'])}, skipped {int(metrics['skipped_steps'])}", flush=True
    )


def main(argv) -> int:
  a = _args(argv)
  import jax

  jax.config.update("jax_num_cpu_devices", DEVICES)
  jax.config.update("jax_platforms", "cpu")
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  if a.compilation_cache:
    # The launches of one test compile the same programs: compile once.
    jax.config.update("jax_compilation_cache_dir", str(a.compilation_cache))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  # A peer that dies stops sending heartbeats: the others stop within
  # HEARTBEAT_S instead of waiting in a collective for ever.
  jax.distributed.initialize(
    f"127.0.0.1:{a.port}",
    num_processes=a.n,
    process_id=a.pid,
    heartbeat_timeout_seconds=HEARTBEAT_S,
    shutdown_timeout_seconds=HEARTBEAT_S,
  )
  step = make_step()
  for folder, checkpointer in [(a.dir, a.checkpointer), *((pathlib.Path(d), c) for d, c in a.then)]:
    _run(a, step, folder, checkpointer)
  jax.distributed.shutdown()
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
