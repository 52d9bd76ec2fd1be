"""One process of the stopped-process test: a small data-parallel run that one process pauses in.

Run as ``python tests/helpers/stopped_worker.py PROCESS_ID NUM_PROCESSES PORT
DIR``. The process joins a ``jax.distributed`` job on ``127.0.0.1:PORT`` (one
CPU device, gloo collectives, a short heartbeat timeout) and trains a tiny
linear model with :func:`jmp_train.make_train_step` in ``shard_map`` mode.
After step :data:`STOP_AT` process 1 writes ``DIR/stopped`` and stops itself
with ``SIGSTOP``, as a debugger or a job scheduler's suspend does; the test
continues it (``SIGCONT``) once its peer is gone, and the step it then takes
fails. The error is printed on the last line, ``error: Type: message``.
"""

from __future__ import annotations

import os
import pathlib
import signal
import sys
import traceback

STOP_AT, STEPS = 3, 1000
# Short, so that the job gives the stopped process up within seconds.
HEARTBEAT_S = 2


def main(argv) -> int:
  pid, n, port, folder = int(argv[0]), int(argv[1]), int(argv[2]), pathlib.Path(argv[3])
  import jax

  jax.config.update("jax_num_cpu_devices", 1)
  jax.config.update("jax_platforms", "cpu")
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(
    f"127.0.0.1:{port}",
    num_processes=n,
    process_id=pid,
    heartbeat_timeout_seconds=HEARTBEAT_S,
    shutdown_timeout_seconds=HEARTBEAT_S,
  )
  import jax.numpy as jnp
  import numpy as np
  import optax
  import jmp_train

  step = jmp_train.make_train_step(
    lambda v, x: x @ v["params"]["w"],
    lambda out, y: jnp.mean((out - y) ** 2),
    optax.sgd(0.1),
    mode="shard_map",
  )
  state = step.init({"w": np.ones((3, 2), np.float32)})
  batch = step.shard_batch((np.ones((4, 3), np.float32), np.zeros((4, 2), np.float32)))
  try:
    for i in range(STEPS):
      state, metrics = step(state, batch)
      if i + 1 == STOP_AT and pid == 1:
        (folder / "stopped").write_text("")
        os.kill(os.getpid(), signal.SIGSTOP)
        print(f"process {pid}: continued after step {i + 1}", flush=True)
  except Exception as e:  # the test reads the first line; jax.distributed may abort the process soon after
    print(f"error: {type(e).__name__}: {e}", flush=True)
    traceback.print_exc()
    return 3
  print(f"process {pid}: finished", flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
