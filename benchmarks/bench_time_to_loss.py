"""Wall-clock time to a validation loss across processes on a capped link.

``PROCESSES`` (4) processes on ``127.0.0.1`` join a ``jax.distributed`` job
(gloo CPU collectives, one CPU device each, process ``i`` pinned to core
``i mod cores``): the code path of several hosts, here sharing one
machine's cores. Each process is one replica of ``bench_diloco``'s text
Transformer (8 sequences of 64 bytes per step, so the global batch is
``bench_diloco``'s 32; the same data, schedule and, for every row, the peak
learning rate ``bench_diloco.PEAK_LR`` gives the width, synchronous Adam's
best there, and every Adam's beta_1 ``bench_diloco.B1``), trained for
``steps`` steps with donated parameters and optimizer state:

* ``adam_float32``: ``optax.adam`` on the exact mean of the gradients,
  flattened into one bucket (:func:`jmp_train.bucketed_mean`, the exchange
  of :func:`jmp_train.make_train_step`);
* ``one_bit_adam``: :func:`jmp_train.one_bit_adam` (exact for the first 20%
  of the steps);
* ``diloco_h16``: :func:`jmp_train.diloco`, local ``optax.adamw`` steps and
  every 16 steps an outer ``optax.sgd(1.0)`` on the exact mean of the
  pseudo-gradients; ``diloco_h16_1bit``: the same mean through
  :func:`jmp_train.sign_compression`.

Every ``EVAL_EVERY`` (16) steps each process copies replica 0's parameters
to the host and the processes meet at a barrier; neither is timed. After
the run, process 0 evaluates the copies (16 held-out batches). Each seed
(its own initialisation and data, as ``bench_diloco``'s) is one launch of
every row. Per link, seed and row: ``train_s`` (the timed steps, all of
them), ``step_ms`` (``train_s`` over the steps), ``sync_step_ms`` and
``local_step_ms`` (the median of every
16th step, where the DiLoCo rows synchronise, and of the others),
``val_loss`` (at the last step), ``target`` (the largest final validation
loss of the link's and seed's rows: a loss every row reaches),
``time_to_target_s`` (the training time at which the row's validation loss
first reaches ``target``, linear between the two evaluations around it)
and ``vs_adam`` (that time over ``adam_float32``'s; below 1 is faster).

Links: the loopback as is and capped at 1 Gbit/s (``tc`` token bucket on
``lo``, as in ``bench_multiprocess``; only when run as root, removed
afterwards; ``cap_note`` says why a cap was not set). The processes share
the cores and, while capped, the loopback's bandwidth.

Environment: ``BENCH_TIME_TO_LOSS_SEEDS`` (default 3: seeds 0, 1, 2),
``BENCH_TIME_TO_LOSS_STEPS`` (default 192, a multiple of 16),
``BENCH_TIME_TO_LOSS_LINKS`` (of ``none,1gbit``), ``BENCH_TIME_TO_LOSS_WIDTH``
(the Transformer's width, default 256, 0.94M parameters: wide enough that a
float32 all-reduce shows at 1 Gbit/s; at ``bench_diloco``'s 64 the steps
are bound by compute and collective latency). ``--quick``: 1 process, a tiny
model, 16 steps of ``adam_float32``, the loopback as is (a smoke test of
the worker; the other rows' optimizers have their own tests).
"""

from __future__ import annotations

import json
import pathlib
import sys
import time

from benchmarks import _harness
from benchmarks import bench_multiprocess as mp

NAME = "time_to_loss"
COLUMNS = (
  "link",
  "seed",
  "processes",
  "d_model",
  "learning_rate",
  "mode",
  "steps",
  "step_ms",
  "local_step_ms",
  "sync_step_ms",
  "train_s",
  "val_loss",
  "target",
  "time_to_target_s",
  "vs_adam",
)
AXIS = "data"
PROCESSES = 4
EVAL_EVERY = 16
GLOBAL_BATCH = 32
MODES = ("adam_float32", "one_bit_adam", "diloco_h16", "diloco_h16_1bit")
LINKS = ("none", "1gbit")


def time_to_target(trajectory: list[tuple[float, float]], target: float) -> float | None:
  """The first time at which the loss reaches ``target``, linear between evaluations.

  Args:
    trajectory: ``(seconds, loss)`` pairs in training order; the first is
      the start, ``(0.0, initial loss)``.
    target: the loss to reach.

  Returns:
    The interpolated time, or ``None`` if the loss never reaches ``target``.
  """
  for (t0, l0), (t1, l1) in zip(trajectory, trajectory[1:]):
    if l1 <= target:
      if l0 <= target:
        return t0
      return t0 + (t1 - t0) * (l0 - target) / (l0 - l1)
  return trajectory[0][0] if trajectory and trajectory[0][1] <= target else None


def _records(link: dict, rows: list[dict]) -> list[dict]:
  """Adds ``target``, ``time_to_target_s`` and ``vs_adam`` to one link's rows."""
  target = max(r["val_loss"] for r in rows)
  for r in rows:
    r["target"] = target
    r["time_to_target_s"] = time_to_target([tuple(p) for p in r["trajectory"]], target)
  base = next((r for r in rows if r["mode"] == "adam_float32"), None)
  for r in rows:
    ok = base is not None and base["time_to_target_s"] and r["time_to_target_s"] is not None
    r["vs_adam"] = r["time_to_target_s"] / base["time_to_target_s"] if ok else None
  return [{**link, **r} for r in rows]


def launch(
  processes: int,
  modes,
  steps: int,
  d_model: int,
  learning_rate: float,
  seed: int = 0,
  timeout: float = 1800,
  xla_flags: str = "",
) -> list[dict]:
  """Trains every mode in ``processes`` processes (``xla_flags``: their ``XLA_FLAGS``); returns process 0's rows."""
  args = ["--modes", ",".join(modes), "--steps", str(steps), "--d-model", str(d_model)]
  args += ["--learning-rate", repr(learning_rate), "--seed", str(seed)]
  return mp.launch_workers(
    "benchmarks.bench_time_to_loss", args, processes, pin=mp._CAN_PIN, env={}, timeout=timeout, xla_flags=xla_flags
  )


def run(quick: bool) -> list[dict]:
  from benchmarks.bench_diloco import LR, PEAK_LR

  xla_flags = ""
  if quick:
    processes, links, steps, d_model, modes, lr, seeds = 1, (None,), 16, 16, ("adam_float32",), LR, 1
    xla_flags = _harness.QUICK_XLA_FLAGS
  else:
    processes, modes = PROCESSES, MODES
    seeds = _harness.env_int("BENCH_TIME_TO_LOSS_SEEDS", 3)
    steps = _harness.env_int("BENCH_TIME_TO_LOSS_STEPS", 192)
    d_model = _harness.env_int("BENCH_TIME_TO_LOSS_WIDTH", 256)
    links = tuple(None if n == "none" else n for n in mp._env_names("BENCH_TIME_TO_LOSS_LINKS", LINKS, LINKS))
    if d_model not in PEAK_LR:
      raise ValueError(
        f"BENCH_TIME_TO_LOSS_WIDTH={d_model} has no tuned learning rate; use one of "
        f"{sorted(PEAK_LR)} (bench_diloco.PEAK_LR, from its learning-rate sweeps)."
      )
    lr = PEAK_LR[d_model]
  if steps < EVAL_EVERY or steps % EVAL_EVERY:
    raise ValueError(f"BENCH_TIME_TO_LOSS_STEPS={steps} must be a positive multiple of {EVAL_EVERY}.")
  records = []
  for rate in links:
    with mp.loopback_cap(rate) as link:
      for seed in range(seeds):
        rows = launch(processes, modes, steps, d_model, lr, seed, xla_flags=xla_flags)
        records += _records({**link, "seed": seed}, rows)
        for r in records[-len(rows) :]:
          print(json.dumps({k: r[k] for k in COLUMNS if k in r}), flush=True)
  return records


# ---------------------------------------------------------------------------
# A worker process.
# ---------------------------------------------------------------------------


def _optimizer(mode: str, steps: int, peak: float):
  import optax

  from jmp_train import bucketed_mean, diloco, one_bit_adam, sign_compression

  from benchmarks.bench_diloco import B1
  from benchmarks.bench_one_bit_text import schedule

  lr = schedule(peak, steps)
  if mode == "adam_float32":
    mean = optax.GradientTransformation(lambda _: optax.EmptyState(), lambda u, s, p=None: (bucketed_mean(u, AXIS), s))
    return optax.chain(mean, optax.adam(lr, b1=B1))
  if mode == "one_bit_adam":
    return one_bit_adam(lr, b1=B1, axis_name=AXIS, warmup_steps=max(1, steps // 5))
  if mode in ("diloco_h16", "diloco_h16_1bit"):
    compression = sign_compression(AXIS) if mode.endswith("1bit") else None
    inner = optax.adamw(lr, b1=B1, weight_decay=0.0)
    return diloco(inner, optax.sgd(1.0), 16, axis_name=AXIS, compression=compression)
  raise ValueError(f"unknown mode {mode!r}; valid: {', '.join(MODES)}.")


def _train(mode, args, mesh, model, params, xs, ys, evals) -> dict:
  import jax
  import numpy as np
  import optax
  from jax.experimental import multihost_utils
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  tx = _optimizer(mode, args.steps, args.learning_rate)
  spec = NamedSharding(mesh, P(AXIS))
  glob = lambda tree: jax.tree.map(lambda a: jax.make_array_from_process_local_data(spec, np.asarray(a)), tree)
  first = lambda t: jax.tree.map(lambda x: x[0], t)
  expand = lambda t: jax.tree.map(lambda x: x[None], t)

  def loss_fn(p, x, y):
    return optax.softmax_cross_entropy_with_integer_labels(model.apply({"params": p}, x), y).mean()

  def step(p, s, x, y):
    p, s = first(p), first(s)
    updates, s = tx.update(jax.grad(loss_fn)(p, x, y), s, p)
    return expand(optax.apply_updates(p, updates)), expand(s)

  shard = lambda f, n: jax.shard_map(f, mesh=mesh, in_specs=(P(AXIS),) * n, out_specs=P(AXIS))
  init = jax.jit(shard(lambda p: expand(tx.init(first(p))), 1))
  run_step = jax.jit(shard(step, 4), donate_argnums=(0, 1))
  p = glob(expand(params))
  s = init(p)
  batches = [(glob(xs[i]), glob(ys[i])) for i in range(args.steps)]
  evaluate = jax.jit(loss_fn)

  def host_copy(p):
    return jax.tree.map(lambda a: np.asarray(a.addressable_data(0))[0], p)

  # Compile outside the clock: one step on copies, then the timed run.
  warm_p = glob(expand(params))
  warm_s = init(warm_p)
  jax.block_until_ready(run_step(warm_p, warm_s, *batches[0]))
  multihost_utils.sync_global_devices(f"{mode}:compiled")
  snapshots, elapsed, times = [(0.0, host_copy(p))], 0.0, []
  for i, (x, y) in enumerate(batches, start=1):
    start = time.perf_counter()
    p, s = jax.block_until_ready(run_step(p, s, x, y))
    times.append(time.perf_counter() - start)
    elapsed += times[-1]
    if i % EVAL_EVERY == 0:
      snapshots.append((elapsed, host_copy(p)))
      multihost_utils.sync_global_devices(f"{mode}:{i}")
  trajectory = []
  if args.process_id == 0:
    (vx, vy), b = evals, 32
    for t, q in snapshots:
      loss = np.mean([float(evaluate(q, vx[j : j + b], vy[j : j + b])) for j in range(0, len(vx), b)])
      trajectory.append((t, float(loss)))
  return {
    "mode": mode,
    "processes": args.processes,
    "d_model": args.d_model,
    "learning_rate": args.learning_rate,
    "steps": args.steps,
    "train_s": elapsed,
    "step_ms": 1e3 * elapsed / args.steps,
    # Medians of the steps that synchronise a DiLoCo row (every 16th) and of the others.
    "sync_step_ms": 1e3 * float(np.median(times[15::16])),
    "local_step_ms": 1e3 * float(np.median([t for i, t in enumerate(times) if i % 16 != 15])),
    "val_loss": trajectory[-1][1] if trajectory else None,
    "trajectory": trajectory,
  }


def _worker(args) -> int:
  import jax

  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(f"127.0.0.1:{args.port}", num_processes=args.processes, process_id=args.process_id)
  from benchmarks.bench_one_bit_text import _task

  per_process = GLOBAL_BATCH // args.processes
  # 16 held-out batches (2 for the tiny model of --quick).
  eval_batches = 16 if args.d_model >= 64 else 2
  model, params, (xs, ys), evals = _task(args.seed, args.steps, args.d_model, 64, GLOBAL_BATCH, eval_batches)
  own = slice(args.process_id * per_process, (args.process_id + 1) * per_process)
  xs, ys = xs[:, own], ys[:, own]
  mesh = jax.make_mesh((jax.device_count(),), (AXIS,), devices=jax.devices())
  rows = [_train(m, args, mesh, model, params, xs, ys, evals["val"]) for m in args.modes.split(",")]
  if args.process_id == 0:
    pathlib.Path(args.out).write_text(json.dumps(rows))
  jax.distributed.shutdown()
  return 0


def main(argv=None) -> int:
  parser = mp.worker_parser("one process of the time-to-loss benchmark")
  parser.add_argument("--modes", default=",".join(MODES))
  parser.add_argument("--steps", type=int, required=True)
  parser.add_argument("--d-model", type=int, required=True)
  parser.add_argument("--learning-rate", type=float, required=True)
  parser.add_argument("--seed", type=int, default=0)
  return mp.start_worker(parser.parse_args(argv), _worker)


if __name__ == "__main__":
  sys.exit(main())
