"""FP8 matmuls: accuracy against bfloat16 (any backend) and speed (GPU).

Accuracy: the same models trained from the same weights on the same batches
under ``"mixed_bfloat16"`` and ``"mixed_float8"`` (``jmp_train.flax.
apply_policy``: FP8 products with delayed scaling, bfloat16 elsewhere),
Adam, three seeds:

* ``digits``: a 64-64-64-10 MLP on scikit-learn's 8x8 digits, 400 steps of
  batch 128, test loss;
* ``text``: the demo's one-layer Transformer language model (d_model 64,
  sequence 64) on the Python standard library's source, 300 steps of batch
  32, validation loss on held-out text.

The FP8 state (amax histories, scales) is updated every step from the
gradient with respect to it (``jmp_train.update_fp8_meta``). XLA:CPU runs
FP8 types by converting, so the CPU step times say nothing about speed.

Speed (GPU only, recorded with the device name): a train step of the 4x4096
MLP (batch 4096) and of a d1024 Transformer under both policies, and the
FP8 matmul's TFLOP/s against bfloat16's on one large product.
"""

from __future__ import annotations

import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jmp_train
import jmp_train.flax
from benchmarks import _harness
from jmp_train.examples import data as data_lib
from jmp_train.examples import models

NAME = "fp8"
COLUMNS = ("kind", "task", "policy", "seeds", "final_loss", "worst_seed_loss",
           "gap_to_bf16", "seed_spread", "steps_per_s", "ms_per_step", "speedup_vs_bf16",
           "tflops")
POLICIES = ("mixed_bfloat16", "mixed_float8")


def _cross_entropy(logits, y):
  return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), y).mean()


def make_step(model: Any, tx: optax.GradientTransformation):
  """A jitted Adam step that also stores the FP8 products' new state."""

  def loss_fn(params, meta, x, y):
    return _cross_entropy(model.apply({"params": params, **meta}, x), y)

  @jax.jit
  def step(params, meta, opt_state, x, y):
    loss, (g, g_meta) = jax.value_and_grad(loss_fn, argnums=(0, 1))(params, meta, x, y)
    updates, opt_state = tx.update(g, opt_state, params)
    meta = jmp_train.update_fp8_meta(meta, g_meta)
    return optax.apply_updates(params, updates), meta, opt_state, loss

  evaluate = jax.jit(loss_fn)
  return step, evaluate


def _split(variables):
  meta = {k: v for k, v in variables.items() if k != "params"}
  return variables["params"], meta


def _digits(seed: int, quick: bool):
  ds = data_lib.load_digits(seed=0)
  model = models.MLP(features=(64, 64), num_classes=10)

  def batch(i):
    idx = np.random.default_rng((seed, i)).integers(0, len(ds.x_train), 128)
    return ds.x_train[idx], ds.y_train[idx]

  return model, np.zeros((1, 64), np.float32), batch, (ds.x_test, ds.y_test), (20 if quick else 400), 3e-3


def _text(seed: int, quick: bool):
  seq = 16 if quick else 64
  corpus = data_lib.load_text_corpus(1_000_000)
  split = int(len(corpus) * 0.9)
  train, val = corpus[:split], corpus[split:]

  def windows(source, rng, n):
    return data_lib.text_windows(source, rng, n, seq)

  model = models.TransformerBlock(vocab_size=data_lib.TEXT_VOCAB_SIZE, d_model=64, num_heads=4,
                                  mlp_dim=256, num_layers=1, max_len=seq)
  held_out = windows(val, np.random.default_rng((seed, 99)), 256)
  return (model, np.zeros((1, seq), np.int32),
          lambda i: windows(train, np.random.default_rng((seed, i)), 32),
          held_out, (20 if quick else 300), 3e-3)


TASKS = {"digits": _digits, "text": _text}


def train_once(task: str, policy: str, seed: int, quick: bool) -> dict[str, float]:
  """Final held-out loss and steps/s of one run."""
  model, example, batch, held_out, steps, lr = TASKS[task](seed, quick)
  model = jmp_train.flax.apply_policy(model, policy)
  params, meta = _split(jax.jit(model.init)(jax.random.key(seed), example))  # not op by op
  tx = optax.adam(lr)
  step, evaluate = make_step(model, tx)
  opt_state = tx.init(params)
  params, meta, opt_state, _ = step(params, meta, opt_state, *batch(0))  # compile
  start = time.perf_counter()
  for i in range(1, steps):
    params, meta, opt_state, loss = step(params, meta, opt_state, *batch(i))
  jax.block_until_ready(loss)
  elapsed = time.perf_counter() - start
  return {"final_loss": float(evaluate(params, meta, *held_out)),
          "steps_per_s": (steps - 1) / elapsed}


def accuracy_records(quick: bool) -> list[dict[str, Any]]:
  """bfloat16 vs FP8 final loss per task, mean over seeds."""
  seeds = (0,) if quick else (0, 1, 2)
  records = []
  for task in (("digits",) if quick else TASKS):
    runs = {p: [train_once(task, p, s, quick) for s in seeds] for p in POLICIES}
    bf16 = float(np.mean([r["final_loss"] for r in runs["mixed_bfloat16"]]))
    for policy, rs in runs.items():
      losses = [r["final_loss"] for r in rs]
      records.append({
          "kind": "accuracy", "task": task, "policy": policy, "seeds": len(seeds),
          "final_loss": float(np.mean(losses)), "worst_seed_loss": max(losses),
          "gap_to_bf16": float(np.mean(losses)) / bf16 - 1.0,
          "seed_spread": max(losses) - min(losses),
          "steps_per_s": float(np.mean([r["steps_per_s"] for r in rs])),
      })
  return records


def _matmul_tflops(policy: str, n: int) -> float:
  x = jnp.ones((n, n), jnp.bfloat16)
  w = jnp.ones((n, n), jnp.bfloat16) * 0.01
  dn = (((1,), (0,)), ((), ()))
  if policy == "mixed_float8":
    meta = jmp_train.init_fp8_meta(jmp_train.Fp8Recipe())
    f = jax.jit(lambda x, w: jmp_train.fp8_dot_general(x, w, dn, meta=meta))
  else:
    f = jax.jit(lambda x, w: jax.lax.dot_general(x, w, dn, preferred_element_type=jnp.float32
                                                 ).astype(jnp.bfloat16))
  seconds = _harness.median_seconds(f, x, w, warmup=3, repeats=10)
  return 2 * n**3 / seconds / 1e12


def _step_ms(model: Any, example: np.ndarray, batch: tuple, policy: str) -> float:
  model = jmp_train.flax.apply_policy(model, policy)
  params, meta = _split(model.init(jax.random.key(0), example))
  tx = optax.adam(1e-4)
  step, _ = make_step(model, tx)
  opt_state = tx.init(params)

  def run(params, meta, opt_state):
    return step(params, meta, opt_state, *batch)

  return 1e3 * _harness.median_seconds(run, params, meta, opt_state, warmup=3, repeats=10)


def speed_records() -> list[dict[str, Any]]:
  """FP8 vs bfloat16 step time and matmul TFLOP/s (GPU only)."""
  rng = np.random.default_rng(0)
  mlp = (models.MLP(features=(4096,) * 4, num_classes=4096), np.zeros((1, 4096), np.float32),
         (rng.normal(size=(4096, 4096)).astype(np.float32), rng.integers(0, 4096, 4096)))
  seq = 1024
  tfm = (models.TransformerBlock(vocab_size=32768, d_model=1024, num_heads=16, mlp_dim=4096,
                                 num_layers=4, max_len=seq), np.zeros((1, seq), np.int32),
         (rng.integers(0, 32768, (16, seq)).astype(np.int32),
          rng.integers(0, 32768, (16, seq)).astype(np.int32)))
  records = []
  for name, (model, example, batch) in {"mlp_4x4096": mlp, "transformer_d1024": tfm}.items():
    ms = {p: _step_ms(model, example, batch, p) for p in POLICIES}
    for p in POLICIES:
      records.append({"kind": "step", "task": name, "policy": p, "ms_per_step": ms[p],
                      "speedup_vs_bf16": ms["mixed_bfloat16"] / ms[p]})
  for p in POLICIES:
    records.append({"kind": "matmul", "task": "16384^3", "policy": p,
                    "tflops": _matmul_tflops(p, 16384)})
  return records


def run(quick: bool) -> list[dict[str, Any]]:
  records = accuracy_records(quick)
  if jax.default_backend() == "gpu" and not quick:
    records += speed_records()
  else:
    records.append({"kind": "speed", "task": "skipped",
                    "policy": f"needs a GPU (backend here: {jax.default_backend()})",
                    "ms_per_step": None, "speedup_vs_bf16": None, "tflops": None})
  return records
