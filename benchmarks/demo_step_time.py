"""The demo's step time over training, in windows of steps (a GPU study).

``python -m benchmarks.demo_step_time CONFIG [STEPS] [WINDOW]`` trains one
configuration of ``jmp-train`` on its text task at the size of the README's
larger GPU run (``--d-model 512 --layers 6 --seq-len 256 --batch 64``,
``--lr 0.05``), building each batch as the demo does, and prints the mean
milliseconds per step over each window (one wait at each window's end) and
the final train loss. Run it once per configuration and per ``XLA_FLAGS``
(for example ``--xla_gpu_ftz=true``): the step time of the half-precision
rows on a GPU moved with the values over training.
"""

from __future__ import annotations

import sys
import time

import jax

from jmp_train.examples import demo_training
from jmp_train.examples.demo_configs import CONFIGS, DemoSettings
from jmp_train.examples.demo_tasks import TASKS


def window_times(name: str, steps: int = 200, window: int = 25) -> tuple[list[float], float]:
  """Milliseconds per step over each ``window`` steps, and the last train loss."""
  s = DemoSettings(d_model=512, layers=6, seq_len=256, batch=64, steps=steps,
                   learning_rate=0.05, plot=False, progress=False)
  task = TASKS["text"](s)
  step = demo_training._build_step(CONFIGS[name], task, s)  # pylint: disable=protected-access
  state = step.init(demo_training.init_task_params(task, s))
  compiled = step.lower(state, step.shard_batch(task.train_batch(0))).compile()
  times, t0, metrics = [], time.perf_counter(), None
  for i in range(steps):
    state, metrics = compiled(state, step.shard_batch(task.train_batch(i)))
    if (i + 1) % window == 0:
      jax.block_until_ready(state)
      t1 = time.perf_counter()
      times.append((t1 - t0) / window * 1e3)
      t0 = t1
  return times, float(metrics["loss"])


def main(argv: list[str]) -> None:
  name = argv[0]
  times, loss = window_times(name, *(int(a) for a in argv[1:3]))
  print(f"{name}: ms/step per window: {' '.join(f'{t:.0f}' for t in times)}; loss {loss:.3f}")


if __name__ == "__main__":
  main(sys.argv[1:])
