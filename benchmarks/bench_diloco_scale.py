"""1-bit DiLoCo against synchronous Adam at a larger width, the replicas mapped on one device.

``bench_diloco``'s text task and rows, on a Transformer of ``d_model``
1,024 (one layer, 64 heads, MLP 4,096; 13M parameters against 87k and
0.94M there) for 2,000 steps, 8 replicas of 4 sequences of 64 bytes each
per step, one seed. The replicas are a ``jax.vmap`` axis on one device
(their collectives are the vmapped axis's), so one GPU trains all eight:

* ``adam_float32_lr{lr}``: synchronous Adam (exact mean of the gradients
  every step) at each peak learning rate of :data:`LR_SWEEP`; the best of
  them is ``adam_float32``, the reference, and every other row trains at
  its rate;
* ``diloco_h16``: :func:`jmp_train.diloco` (inner AdamW, outer
  ``optax.sgd(1.0)`` on the exact mean of the pseudo-gradients every 16
  steps);
* ``diloco_h16_1bit``: the same with the pseudo-gradients averaged by
  :func:`jmp_train.sign_compression`.

Columns as ``bench_diloco``'s: ``val_loss`` (replica 0 after the last
step, 16 held-out batches), ``rel_to_adam`` (over ``adam_float32``'s, minus
1), ``seconds`` (the run's wall time, its compilation included). Rows are
yielded as they finish. On a GPU by the GPU probe (:mod:`benchmarks._probe`;
``BENCH_DILOCO_SCALE_STEPS``, default 2,000); ``--quick`` (any backend):
width 32, 32 steps, sequences of 16, 2 replicas, one Adam and the 1-bit row
(a smoke test). A full run elsewhere is skipped. A row whose optimizer
cannot run under ``vmap`` records its ``error`` instead.
"""

from __future__ import annotations

import time
from typing import Any, Iterator

import jax
import numpy as np
import optax

from benchmarks import _harness
from benchmarks.bench_diloco import B1, BATCH
from benchmarks.bench_one_bit_text import AXIS, REPLICAS, _task, eval_losses, schedule

NAME = "diloco_scale"
COLUMNS = ("mode", "d_model", "learning_rate", "sync_every", "replicas", "steps", "val_loss", "rel_to_adam", "seconds")
D_MODEL = 1024
LR_SWEEP = (1e-3, 2e-3, 4e-3)
SYNC_EVERY = 16


def train_mapped(
  tx: optax.GradientTransformation,
  *,
  steps: int,
  seed: int = 0,
  d_model: int = D_MODEL,
  seq_len: int = 64,
  eval_batches: int = 16,
  replicas: int = REPLICAS,
  compiler_options=None,
) -> dict[str, float]:
  """Trains the text Transformer with ``tx`` on local gradients, the replicas a ``vmap`` axis ``AXIS`` on one device.

  The programs are compiled with ``compiler_options`` (``jax.jit``'s).
  """
  model, params, (xs, ys), evals = _task(seed, steps, d_model, seq_len, BATCH, eval_batches, compiler_options)
  split = lambda a: a.reshape(steps, replicas, BATCH // replicas, seq_len).swapaxes(0, 1)
  xs, ys = split(xs), split(ys)
  stacked = jax.tree.map(lambda p: np.broadcast_to(p, (replicas,) + p.shape).copy(), params)

  def loss_fn(p, x, y):
    logits = model.apply({"params": p}, x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

  def train(p, xs, ys):
    def body(carry, b):
      p, s = carry
      updates, s = tx.update(jax.grad(loss_fn)(p, *b), s, p)
      return (optax.apply_updates(p, updates), s), None

    (p, _), _ = jax.lax.scan(body, (p, tx.init(p)), (xs, ys))
    return p

  run = jax.jit(jax.vmap(train, axis_name=AXIS), compiler_options=compiler_options)
  trained = jax.block_until_ready(run(stacked, xs, ys))
  return eval_losses(loss_fn, jax.tree.map(lambda x: x[0], jax.device_get(trained)), evals, BATCH, compiler_options)


def _optimizer(mode: str, lr: float, steps: int) -> optax.GradientTransformation:
  from jmp_train import diloco, sign_compression

  from benchmarks.bench_one_bit_convergence import _exact_mean

  if mode.startswith("adam_float32"):
    return optax.chain(_exact_mean(AXIS), optax.adam(schedule(lr, steps), b1=B1))
  inner = optax.adamw(schedule(lr, steps), b1=B1, weight_decay=0.0)
  compression = sign_compression(AXIS) if mode.endswith("_1bit") else None
  return diloco(inner, optax.sgd(1.0), SYNC_EVERY, axis_name=AXIS, compression=compression)


def records(quick: bool = False) -> Iterator[dict[str, Any]]:
  """Yields the Adam sweep's rows, then the DiLoCo rows at the best Adam's rate (see the module docstring)."""
  steps = 32 if quick else _harness.env_int("BENCH_DILOCO_SCALE_STEPS", 2000)
  if steps % SYNC_EVERY:
    raise ValueError(f"BENCH_DILOCO_SCALE_STEPS={steps} is not a multiple of sync_every {SYNC_EVERY}.")
  size = (
    dict(d_model=32, seq_len=16, eval_batches=2, replicas=2, compiler_options=_harness.compile_options(quick))
    if quick
    else {}
  )
  d_model, replicas = size.get("d_model", D_MODEL), size.get("replicas", REPLICAS)

  def row(mode: str, lr: float, h: int) -> dict[str, Any]:
    t0 = time.perf_counter()
    losses = train_mapped(_optimizer(mode, lr, steps), steps=steps, **size)
    return {
      "mode": mode,
      "d_model": d_model,
      "learning_rate": lr,
      "sync_every": h,
      "replicas": replicas,
      "steps": steps,
      "batch": BATCH,
      **losses,
      "seconds": time.perf_counter() - t0,
    }

  sweep = []
  for lr in LR_SWEEP[1:2] if quick else LR_SWEEP:
    sweep.append(row(f"adam_float32_lr{lr:g}", lr, 1))
    print(sweep[-1], flush=True)
  best = min(sweep, key=lambda r: r["val_loss"])
  for r in sweep:
    r["rel_to_adam"] = r["val_loss"] / best["val_loss"] - 1.0
    yield r
  yield {**best, "mode": "adam_float32", "rel_to_adam": 0.0}
  for mode in ("diloco_h16_1bit",) if quick else ("diloco_h16", "diloco_h16_1bit"):
    try:
      r = row(mode, best["learning_rate"], SYNC_EVERY)
    except Exception as e:  # A row that cannot run mapped on one device is a result; the others still run.
      yield {"mode": mode, "d_model": d_model, "steps": steps, "error": f"{type(e).__name__}: {str(e)[:300]}"}
      continue
    r["rel_to_adam"] = r["val_loss"] / best["val_loss"] - 1.0
    print(r, flush=True)
    yield r


def run(quick: bool) -> list[dict[str, Any]]:
  if jax.default_backend() != "gpu" and not quick:
    return _harness.skipped(f"needs a GPU for width 1,024 x 2,000 steps (backend here: {jax.default_backend()})")
  return list(records(quick))
