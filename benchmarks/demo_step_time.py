"""The demo's step time over training windows, and which kernels take longer as it trains.

``python -m benchmarks.demo_step_time CONFIG [STEPS] [WINDOW]`` trains one
configuration of ``jmp-train`` on its text task at the size of the README's
larger GPU run (``--d-model 512 --layers 6 --seq-len 256 --batch 64``,
``--lr 0.05``), building each batch as the demo does, and prints the mean
milliseconds per step over each window (one wait at each window's end) and
the final train loss. Run it once per configuration and per ``XLA_FLAGS``
(for example ``--xla_gpu_ftz=true``), to see whether a step's time moves
with the values it computes (subnormals, say) as training goes on.

``--isolated`` times the compiled step alone, on one batch, from the
initial state and from the state after ``STEPS`` steps (the median of
``--repeats`` calls, each on a fresh copy of the state and waited for), so
that the values, not the queue, explain any difference. ``--profile DIR``
also traces three such calls from each state with ``jax.profiler`` into
``DIR/early`` and ``DIR/late`` and prints the kernels whose total time grew
most. ``--small`` runs a width-16 model (a smoke test on any machine).
"""

from __future__ import annotations

import argparse
import collections
import pathlib
import statistics
import time

import jax
import jax.numpy as jnp

from jmp_train_examples import demo_training
from jmp_train_examples.demo_configs import CONFIGS, DemoSettings
from jmp_train_examples.demo_tasks import TASKS


def settings(small: bool = False, steps: int = 200) -> DemoSettings:
  """The README's larger GPU size, or a tiny one (``small``)."""
  if small:
    return DemoSettings(d_model=16, seq_len=16, batch=8, steps=steps, plot=False, progress=False)
  return DemoSettings(
    d_model=512, layers=6, seq_len=256, batch=64, steps=steps, learning_rate=0.05, plot=False, progress=False
  )


def _compiled_step(name: str, s: DemoSettings):
  task = TASKS["text"](s)
  step = demo_training._build_step(CONFIGS[name], task, s)
  state = step.init(demo_training.init_task_params(task, s))
  compiled = step.lower(state, step.shard_batch(task.train_batch(0))).compile()
  return task, step, state, compiled


def window_times(
  name: str, steps: int = 200, window: int = 25, s: DemoSettings | None = None
) -> tuple[list[float], float]:
  """Milliseconds per step over each ``window`` steps, and the last train loss."""
  task, step, state, compiled = _compiled_step(name, s or settings(steps=steps))
  times, t0, metrics = [], time.perf_counter(), None
  for i in range(steps):
    state, metrics = compiled(state, step.shard_batch(task.train_batch(i)))
    if (i + 1) % window == 0:
      jax.block_until_ready(state)
      t1 = time.perf_counter()
      times.append((t1 - t0) / window * 1e3)
      t0 = t1
  return times, float(metrics["loss"])


def kernel_times(trace_dir: str | pathlib.Path) -> collections.Counter:
  """Total nanoseconds per kernel (XLA op) in the ``jax.profiler`` traces under ``trace_dir``.

  GPU traces: the device planes' ``XLA Ops`` lines (or their streams where
  there is no such line); CPU traces: the host events that name an
  ``hlo_op``.
  """
  totals = collections.Counter()
  for path in sorted(pathlib.Path(trace_dir).rglob("*.xplane.pb")):
    planes = list(jax.profiler.ProfileData.from_file(str(path)).planes)
    devices = [p for p in planes if p.name.startswith("/device:")]
    for plane in devices or [p for p in planes if p.name == "/host:CPU"]:
      lines = list(plane.lines)
      if devices:
        ops = [ln for ln in lines if ln.name == "XLA Ops"]
        lines = ops or [ln for ln in lines if ln.name.startswith("Stream")]
      for line in lines:
        for event in line.events:
          if devices or any(k == "hlo_op" for k, _ in event.stats):
            totals[event.name] += event.duration_ns
  return totals


def _median_ms(compiled, state, batch, repeats: int) -> float:
  times = []
  for _ in range(repeats):
    fresh = jax.block_until_ready(jax.tree.map(jnp.copy, state))  # the step donates its state
    t0 = time.perf_counter()
    jax.block_until_ready(compiled(fresh, batch))
    times.append((time.perf_counter() - t0) * 1e3)
  return statistics.median(times)


def isolated_times(
  name: str,
  steps: int = 200,
  repeats: int = 20,
  s: DemoSettings | None = None,
  profile_dir: str | pathlib.Path | None = None,
) -> dict:
  """The step alone from the initial state and from the state after ``steps`` steps.

  Returns ``{"early_ms", "late_ms", "loss"}``, and with ``profile_dir``
  ``"kernels"``: ``(name, early ns, late ns)`` per kernel over three
  traced calls from each state, the largest growth first.
  """
  task, step, state, compiled = _compiled_step(name, s or settings(steps=steps))
  batch = step.shard_batch(task.train_batch(0))
  early = jax.block_until_ready(jax.tree.map(jnp.copy, state))
  metrics = None
  for i in range(steps):
    state, metrics = compiled(state, step.shard_batch(task.train_batch(i)))
    jax.block_until_ready(state)
  out = {
    "early_ms": _median_ms(compiled, early, batch, repeats),
    "late_ms": _median_ms(compiled, state, batch, repeats),
    "loss": float(metrics["loss"]) if metrics is not None else None,
  }
  if profile_dir is not None:
    totals = {}
    for label, start in (("early", early), ("late", state)):
      with jax.profiler.trace(str(pathlib.Path(profile_dir) / label)):
        _median_ms(compiled, start, batch, 3)
      totals[label] = kernel_times(pathlib.Path(profile_dir) / label)
    names = set(totals["early"]) | set(totals["late"])
    out["kernels"] = sorted(((k, totals["early"][k], totals["late"][k]) for k in names), key=lambda t: t[1] - t[2])
  return out


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(prog="python -m benchmarks.demo_step_time", description=__doc__.split("\n\n")[0])
  parser.add_argument("config", choices=sorted(CONFIGS))
  parser.add_argument("steps", nargs="?", type=int, default=200)
  parser.add_argument("window", nargs="?", type=int, default=25)
  parser.add_argument("--isolated", action="store_true")
  parser.add_argument("--repeats", type=int, default=20)
  parser.add_argument("--profile", metavar="DIR")
  parser.add_argument("--small", action="store_true")
  args = parser.parse_args(argv)
  for name in ("steps", "window", "repeats"):
    if getattr(args, name) < 1:
      parser.error(f"{name} must be a positive integer, got {getattr(args, name)}")
  s = settings(args.small, args.steps)
  if not (args.isolated or args.profile):
    times, loss = window_times(args.config, args.steps, args.window, s)
    print(f"{args.config}: ms/step per window: {' '.join(f'{t:.0f}' for t in times)}; loss {loss:.3f}")
    return
  r = isolated_times(args.config, args.steps, args.repeats, s, args.profile)
  print(
    f"{args.config}: step alone {r['early_ms']:.2f} ms from the initial state, "
    f"{r['late_ms']:.2f} ms after {args.steps} steps; loss {r['loss']:.3f}"
  )
  for name, early, late in r.get("kernels", [])[:15]:  # ns over 3 calls, in ms per step
    early, late = early / 3e6, late / 3e6
    print(f"  {late - early:+9.3f} ms/step  {early:9.3f} -> {late:9.3f}  {name}")


if __name__ == "__main__":
  main()
