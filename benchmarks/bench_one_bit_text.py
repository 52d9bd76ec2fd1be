"""1-bit Adam and 1-bit momentum SGD on the demo's text Transformer.

The demo's character-level language model
(:class:`jmp_train_examples.models.TransformerBlock`: 1 layer, width 64, 4
heads, sequences of 64 bytes of the Python standard library's source,
:func:`jmp_train_examples.data.load_text_corpus`, the last 10% held out),
8 data-parallel replicas, a global batch of 32 sequences (4 per replica), the
same initialisation, batches and learning-rate *schedule* for every row of a
seed: linear warm-up over 10% of the steps, then cosine decay to 1% (the
demo's ``optax.warmup_cosine_decay_schedule``); 3 seeds. Rows (``mode``):

* Adam (peak learning rate ``LR_ADAM``): ``adam_float32`` (``optax.adam``
  on the exact ``pmean``), ``adam_frozen_v`` (the exact ``pmean``, ``v``
  frozen after the same warm-up: 1-bit Adam's rule with a lossless
  exchange), ``one_bit_adam`` (exact for the first 20% of the steps,
  DeepSpeed's ``freeze_step``, then ``v`` frozen and the momentum exchanged
  in 1 bit), ``one_bit_adam_clipped`` (``clip_step=True``: each step
  clipped to Kingma & Ba's bound), ``one_bit_adam_refresh`` (``one_bit_adam``
  with ``variance_refresh`` every 1/8 of the steps: an exact step that
  updates ``v``, as in 0/1 Adam), ``one_bit_adam_refresh_clipped`` (both),
  ``one_bit_adam_rescaled_clipped`` (``rescale_variance=True``: each
  tensor's frozen ``v`` follows its mean squared gradient, with
  ``clip_step``) and ``adam_grad_1bit`` (gradient compression,
  :func:`jmp_train.sign_compression`, before ``optax.adam``: for contrast);
* momentum SGD 0.9 (peak learning rate ``LR_SGDM``, the demo's):
  ``sgdm_float32``, ``one_bit_momentum`` (column scales, no warm-up),
  ``one_bit_momentum_l2`` (per-tensor RMS scales) and ``sgdm_grad_1bit``.

Columns: validation loss (mean next-byte cross-entropy over 16 fixed
held-out batches) at the last step, mean and spread over seeds;
``rel_to_float32``: the mean over seeds of each seed's validation loss over
the uncompressed row's of the same seed, minus 1 (paired);
``rel_to_float32_max``: the worst seed's; the final training loss (16 fixed
training batches); ``wire_ratio``: bytes one device sends per step after
warm-up over a float32 ring all-reduce (compiled HLO, see
``bench_one_bit_optimizers``). ``--quick``: a smaller model, 4 steps, one
seed, ``adam_float32`` only (a smoke test of the code; the compressed
optimizers' quick rows are in ``bench_one_bit_optimizers``).

Environment (full runs): ``BENCH_ONE_BIT_TEXT_STEPS`` (default 200; the
schedule, the 1-bit warm-up and the refresh interval scale with it) and
``BENCH_ONE_BIT_TEXT_MODES`` (comma-separated rows; default all; each
optimizer's ``*_float32`` row is needed for ``rel_to_float32``).
"""

from __future__ import annotations

import jax
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

NAME = "one_bit_text"
COLUMNS = (
  "optimizer",
  "mode",
  "learning_rate",
  "steps",
  "seeds",
  "val_loss",
  "val_loss_min",
  "val_loss_max",
  "rel_to_float32",
  "rel_to_float32_max",
  "train_loss",
  "wire_ratio",
)
AXIS = "data"
REPLICAS = 8
LR_ADAM = 3e-3
LR_SGDM = 0.15
ONE_BIT_WARMUP = 0.2


def schedule(peak: float, steps: int) -> optax.Schedule:
  """The demo's schedule: warm-up over 10% of the steps, cosine decay to 1%."""
  return optax.warmup_cosine_decay_schedule(0.0, peak, max(1, steps // 10), max(2, steps), peak * 0.01)


def _task(seed: int, steps: int, d_model: int, seq_len: int, batch: int, eval_batches: int, compiler_options=None):
  from jmp_train_examples import data as data_lib
  from jmp_train_examples.models import TransformerBlock

  corpus = data_lib.load_text_corpus(1_000_000)
  split = int(len(corpus) * 0.9)
  train, val = corpus[:split], corpus[split:]

  def windows(source, rng, n):
    return data_lib.text_windows(source, rng, n, seq_len)

  rng = np.random.default_rng((seed, 1))
  xs, ys = windows(train, rng, steps * batch)
  batches = (xs.reshape(steps, batch, seq_len), ys.reshape(steps, batch, seq_len))
  eval_rng = np.random.default_rng((seed, 2))
  evals = {
    "train": windows(train, eval_rng, eval_batches * batch),
    "val": windows(val, eval_rng, eval_batches * batch),
  }
  model = TransformerBlock(
    vocab_size=data_lib.TEXT_VOCAB_SIZE,
    d_model=d_model,
    num_heads=max(1, d_model // 16),
    mlp_dim=4 * d_model,
    num_layers=1,
    max_len=seq_len,
  )
  # One compiled init, not one compilation per operation (the same values).
  init = jax.jit(model.init, compiler_options=compiler_options)
  params = init(jax.random.key(seed), np.zeros((1, seq_len), np.int32))["params"]
  return model, params, batches, evals


def train_text(
  tx: optax.GradientTransformation,
  *,
  steps: int,
  seed: int,
  d_model: int = 64,
  seq_len: int = 64,
  batch: int = 32,
  eval_batches: int = 16,
  compiler_options=None,
) -> dict:
  """Trains the text Transformer with ``tx`` (fed each replica's local gradients).

  ``tx`` averages the gradients itself (as in ``bench_one_bit_convergence``);
  the programs are compiled with ``compiler_options`` (``jax.jit``'s).
  Returns the final validation and training losses.
  """
  from jmp_train import sign_compression_specs

  if jax.device_count() < REPLICAS:
    raise ValueError(
      f"needs {REPLICAS} devices, found {jax.device_count()}: set "
      f"XLA_FLAGS=--xla_force_host_platform_device_count={REPLICAS} before JAX starts."
    )
  model, params, (xs, ys), evals = _task(seed, steps, d_model, seq_len, batch, eval_batches, compiler_options)
  mesh = jax.make_mesh((REPLICAS,), (AXIS,), devices=jax.devices()[:REPLICAS])
  xs = jax.device_put(xs, NamedSharding(mesh, P(None, AXIS)))
  ys = jax.device_put(ys, NamedSharding(mesh, P(None, AXIS)))

  def loss_fn(p, x, y):
    logits = model.apply({"params": p}, x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

  shapes = jax.eval_shape(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=P()), params)
  specs = sign_compression_specs(shapes, AXIS)
  init = jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=specs)
  opt_state = jax.jit(init, compiler_options=compiler_options)(params)

  def train(p, s, xs, ys):
    def body(carry, b):
      p, s = carry
      # Mark the replicated parameters varying: grad is this replica's own.
      grads = jax.grad(loss_fn)(jax.lax.pcast(p, AXIS, to="varying"), *b)
      updates, s = tx.update(grads, s, p)
      return (optax.apply_updates(p, updates), s), None

    (p, s), _ = jax.lax.scan(body, (p, s), (xs, ys))
    return p, s

  run = jax.jit(
    jax.shard_map(train, mesh=mesh, in_specs=(P(), specs, P(None, AXIS), P(None, AXIS)), out_specs=(P(), specs)),
    compiler_options=compiler_options,
  )
  params, _ = jax.block_until_ready(run(params, opt_state, xs, ys))
  return eval_losses(loss_fn, params, evals, batch, compiler_options)


def eval_losses(loss_fn, params, evals: dict, batch: int, compiler_options=None) -> dict[str, float]:
  """``{"val_loss", "train_loss"}``: the mean loss of ``params`` over each split, ``batch`` rows at a time."""
  evaluate = jax.jit(loss_fn, compiler_options=compiler_options)
  losses = {}
  for split, (x, y) in evals.items():
    parts = [evaluate(params, x[i : i + batch], y[i : i + batch]) for i in range(0, len(x), batch)]
    losses[split] = float(np.mean(jax.device_get(parts)))
  return {"val_loss": losses["val"], "train_loss": losses["train"]}


def _optimizers(steps: int, quick: bool):
  from jmp_train import one_bit_momentum, sign_compression

  from benchmarks.bench_one_bit_convergence import _exact_mean
  from benchmarks.bench_one_bit_optimizers import _frozen_v_adam
  from benchmarks.bench_one_bit_optimizers import _one_bit_adam

  adam, sgdm = schedule(LR_ADAM, steps), schedule(LR_SGDM, steps)
  warmup = max(1, int(ONE_BIT_WARMUP * steps))
  refresh = max(1, steps // 8)
  rows = [
    ("adam", "adam_float32", LR_ADAM, lambda: optax.chain(_exact_mean(AXIS), optax.adam(adam))),
    ("adam", "adam_frozen_v", LR_ADAM, lambda: _frozen_v_adam(adam, warmup)),
    ("adam", "one_bit_adam", LR_ADAM, lambda: _one_bit_adam(adam, warmup)),
    ("adam", "one_bit_adam_clipped", LR_ADAM, lambda: _one_bit_adam(adam, warmup, clip_step=True)),
    ("adam", "one_bit_adam_refresh", LR_ADAM, lambda: _one_bit_adam(adam, warmup, variance_refresh=refresh)),
    (
      "adam",
      "one_bit_adam_refresh_clipped",
      LR_ADAM,
      lambda: _one_bit_adam(adam, warmup, variance_refresh=refresh, clip_step=True),
    ),
    (
      "adam",
      "one_bit_adam_rescaled_clipped",
      LR_ADAM,
      lambda: _one_bit_adam(adam, warmup, rescale_variance=True, clip_step=True),
    ),
    ("adam", "adam_grad_1bit", LR_ADAM, lambda: optax.chain(sign_compression(AXIS), optax.adam(adam))),
    ("sgdm", "sgdm_float32", LR_SGDM, lambda: optax.chain(_exact_mean(AXIS), optax.sgd(sgdm, momentum=0.9))),
    ("sgdm", "one_bit_momentum", LR_SGDM, lambda: one_bit_momentum(sgdm, 0.9, axis_name=AXIS, scale="column")),
    ("sgdm", "one_bit_momentum_l2", LR_SGDM, lambda: one_bit_momentum(sgdm, 0.9, axis_name=AXIS, scale="l2")),
    ("sgdm", "sgdm_grad_1bit", LR_SGDM, lambda: optax.chain(sign_compression(AXIS), optax.sgd(sgdm, momentum=0.9))),
  ]
  return rows[:1] if quick else rows


def run(quick: bool) -> list[dict]:
  from benchmarks import _harness
  from benchmarks.bench_one_bit_optimizers import wire_ratio

  steps = 4 if quick else _harness.env_int("BENCH_ONE_BIT_TEXT_STEPS", 200)
  seeds = (0,) if quick else (0, 1, 2)
  size = dict(d_model=16, seq_len=16, eval_batches=2, compiler_options=_harness.compile_options(quick)) if quick else {}
  params = None if quick else _task(0, 1, 64, 64, 32, 1)[1]
  rows = _optimizers(steps, quick)
  if not quick:
    rows = _harness.selected_rows(rows, "BENCH_ONE_BIT_TEXT_MODES")
  records = []
  for optimizer, mode, lr, make in rows:
    runs = [train_text(make(), steps=steps, seed=s, **size) for s in seeds]
    val = np.asarray([r["val_loss"] for r in runs])
    records.append(
      {
        "optimizer": optimizer,
        "mode": mode,
        "learning_rate": lr,
        "steps": steps,
        "seeds": len(seeds),
        "val_loss": float(val.mean()),
        "val_loss_min": float(val.min()),
        "val_loss_max": float(val.max()),
        "val_losses": [float(v) for v in val],
        "train_loss": float(np.mean([r["train_loss"] for r in runs])),
        "wire_ratio": None if quick else wire_ratio(make(), params, REPLICAS),
      }
    )
  for r in records:
    base = next(b for b in records if b["optimizer"] == r["optimizer"] and b["mode"].endswith("float32"))
    rel = np.asarray(r["val_losses"]) / np.asarray(base["val_losses"]) - 1.0
    r["rel_to_float32"], r["rel_to_float32_max"] = float(rel.mean()), float(rel.max())
  return records
