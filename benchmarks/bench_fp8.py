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

Speed (GPU only, recorded with the device name): a train step of an MLP of
four 8,192-wide layers (batch 8,192) under both policies (the two-layer
d4096 Transformer of :func:`_speed_model` is timed through
``make_train_step`` by ``bench_step_formats``): the median step time, the
compilation and first call's seconds, and the compiled step's GEMM custom
calls with FP8 operands (:func:`jmp_train.diagnostics.fp8_products`); the
FP8 matmul's TFLOP/s against bfloat16's on one large product. FP8 steps
are compiled as ``make_train_step`` compiles them on GPUs, without Triton
GEMMs (:data:`FP8_GPU_OPTIONS`). ``bench_fp8_first_call`` times the FP8 step's first call under XLA flags.
"""

from __future__ import annotations

import functools
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jmp_train
import jmp_train.flax
from benchmarks import _harness
from jmp_train_examples import data as data_lib
from jmp_train_examples import models

NAME = "fp8"
COLUMNS = (
  "kind",
  "task",
  "policy",
  "seeds",
  "final_loss",
  "worst_seed_loss",
  "gap_to_bf16",
  "seed_spread",
  "steps_per_s",
  "ms_per_step",
  "speedup_vs_bf16",
  "tflops",
)
POLICIES = ("mixed_bfloat16", "mixed_float8")


def _cross_entropy(logits, y):
  return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), y).mean()


def make_step(model: Any, tx: optax.GradientTransformation, compiler_options: dict[str, Any] | None = None):
  """A jitted Adam step that also stores the FP8 products' new state, and the jitted loss.

  Both are compiled with ``compiler_options`` (``jax.jit``'s).
  """

  def loss_fn(params, meta, x, y):
    return _cross_entropy(model.apply({"params": params, **meta}, x), y)

  @functools.partial(jax.jit, compiler_options=compiler_options)
  def step(params, meta, opt_state, x, y):
    loss, (g, g_meta) = jax.value_and_grad(loss_fn, argnums=(0, 1))(params, meta, x, y)
    updates, opt_state = tx.update(g, opt_state, params)
    meta = jmp_train.update_fp8_meta(meta, g_meta)
    return optax.apply_updates(params, updates), meta, opt_state, loss

  evaluate = jax.jit(loss_fn, compiler_options=compiler_options)
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

  model = models.TransformerBlock(
    vocab_size=data_lib.TEXT_VOCAB_SIZE, d_model=64, num_heads=4, mlp_dim=256, num_layers=1, max_len=seq
  )
  held_out = windows(val, np.random.default_rng((seed, 99)), 256)
  return (
    model,
    np.zeros((1, seq), np.int32),
    lambda i: windows(train, np.random.default_rng((seed, i)), 32),
    held_out,
    (20 if quick else 300),
    3e-3,
  )


TASKS = {"digits": _digits, "text": _text}


def train_once(task: str, policy: str, seed: int, quick: bool) -> dict[str, float]:
  """Final held-out loss and steps/s of one run."""
  model, example, batch, held_out, steps, lr = TASKS[task](seed, quick)
  model = jmp_train.flax.apply_policy(model, policy)
  options = _harness.compile_options(quick)
  params, meta = _split(jax.jit(model.init, compiler_options=options)(jax.random.key(seed), example))  # not op by op
  tx = optax.adam(lr)
  step, evaluate = make_step(model, tx, options)
  opt_state = tx.init(params)
  params, meta, opt_state, _ = step(params, meta, opt_state, *batch(0))  # compile
  start = time.perf_counter()
  for i in range(1, steps):
    params, meta, opt_state, loss = step(params, meta, opt_state, *batch(i))
  jax.block_until_ready(loss)
  elapsed = time.perf_counter() - start
  return {"final_loss": float(evaluate(params, meta, *held_out)), "steps_per_s": (steps - 1) / elapsed}


def accuracy_records(quick: bool) -> list[dict[str, Any]]:
  """bfloat16 vs FP8 final loss per task, mean over seeds."""
  seeds = (0,) if quick else (0, 1, 2)
  records = []
  for task in ("digits",) if quick else TASKS:
    runs = {p: [train_once(task, p, s, quick) for s in seeds] for p in POLICIES}
    bf16 = float(np.mean([r["final_loss"] for r in runs["mixed_bfloat16"]]))
    for policy, rs in runs.items():
      losses = [r["final_loss"] for r in rs]
      records.append(
        {
          "kind": "accuracy",
          "task": task,
          "policy": policy,
          "seeds": len(seeds),
          "final_loss": float(np.mean(losses)),
          "worst_seed_loss": max(losses),
          "gap_to_bf16": float(np.mean(losses)) / bf16 - 1.0,
          "seed_spread": max(losses) - min(losses),
          "steps_per_s": float(np.mean([r["steps_per_s"] for r in rs])),
        }
      )
  return records


def _matmul_tflops(policy: str, n: int) -> float:
  x = jnp.ones((n, n), jnp.bfloat16)
  w = jnp.ones((n, n), jnp.bfloat16) * 0.01
  dn = (((1,), (0,)), ((), ()))
  if policy == "mixed_float8":
    meta = jmp_train.init_fp8_meta(jmp_train.Fp8Recipe())
    f = jax.jit(lambda x, w: jmp_train.fp8_dot_general(x, w, dn, meta=meta))
  else:
    f = jax.jit(lambda x, w: jax.lax.dot_general(x, w, dn, preferred_element_type=jnp.float32).astype(jnp.bfloat16))
  seconds = _harness.median_seconds(f, x, w, warmup=3, repeats=10)
  return 2 * n**3 / seconds / 1e12


# What ``make_train_step`` compiles FP8 steps with on GPUs (its
# ``compiler_options`` default): cuBLAS GEMMs only, no Triton candidates.
FP8_GPU_OPTIONS = {"xla_gpu_enable_triton_gemm": False}


def _step_record(
  model: Any, example: np.ndarray, batch: tuple, policy: str, compiler_options: dict[str, Any] | None = None
) -> dict[str, Any]:
  """One step's compile time, first call, steady time and products (GPU).

  ``compiler_options``: ``None`` compiles an FP8 step on a GPU with
  :data:`FP8_GPU_OPTIONS`, as ``make_train_step`` does; ``{}`` with XLA's
  defaults (and ``XLA_FLAGS``).
  """
  import time

  if compiler_options is None:
    on_gpu = jax.default_backend() == "gpu"
    compiler_options = FP8_GPU_OPTIONS if on_gpu and policy == "mixed_float8" else {}

  model = jmp_train.flax.apply_policy(model, policy)
  params, meta = _split(jax.jit(model.init)(jax.random.key(0), example))
  tx = optax.adam(1e-4)
  step, _ = make_step(model, tx)
  opt_state = jax.jit(tx.init)(params)
  batch = tuple(jax.device_put(b) for b in batch)
  jax.block_until_ready((params, meta, opt_state, batch))
  t0 = time.perf_counter()
  compiled = step.lower(params, meta, opt_state, *batch).compile(compiler_options=compiler_options or None)
  compile_s = time.perf_counter() - t0
  jax.block_until_ready(compiled(params, meta, opt_state, *batch))
  first_call_s = time.perf_counter() - t0
  report = jmp_train.diagnostics.fp8_products(compiled)
  gemms = [p for p in report.products if p.op.startswith("__cublas") or p.op.startswith("__cudnn")]

  def run(params, meta, opt_state):
    return compiled(params, meta, opt_state, *batch)

  ms = 1e3 * _harness.median_seconds(run, params, meta, opt_state, warmup=3, repeats=10)
  return {
    "compiler_options": compiler_options,
    "ms_per_step": ms,
    "compile_s": compile_s,
    "first_call_s": first_call_s,
    "products": len(report.products),
    "fp8_products": len(report.fp8),
    "gemm_calls": len(gemms),
    "fp8_gemm_calls": sum(1 for p in gemms if "f8" in p.op),
  }


# Sizes of the speed records: FP8 pays off on products with K and N above
# about 4,096 (torchao's and Transformer Engine's GEMM profiling).
SPEED_MODELS = ("mlp_8x8192", "transformer_d4096")
# The models speed_records times: the Transformer's FP8 step is measured
# through make_train_step by bench_step_formats.
TIMED_SPEED_MODELS = ("mlp_8x8192",)


def _speed_model(name: str, rng: np.random.Generator):
  if name == "mlp_8x8192":
    width, batch = 8192, 8192
    return (
      models.MLP(features=(width,) * 4, num_classes=width),
      np.zeros((1, width), np.float32),
      (rng.normal(size=(batch, width)).astype(np.float32), rng.integers(0, width, batch)),
    )
  if name == "transformer_d4096":
    seq, batch, vocab = 2048, 4, 32768
    return (
      models.TransformerBlock(vocab_size=vocab, d_model=4096, num_heads=32, mlp_dim=16384, num_layers=2, max_len=seq),
      np.zeros((1, seq), np.int32),
      (rng.integers(0, vocab, (batch, seq)).astype(np.int32), rng.integers(0, vocab, (batch, seq)).astype(np.int32)),
    )
  raise ValueError(f"unknown speed model {name!r}; expected one of {SPEED_MODELS}")


def speed_records() -> list[dict[str, Any]]:
  """FP8 vs bfloat16 train step (time, compile, FP8 GEMMs) and matmul TFLOP/s (GPU only)."""
  rng = np.random.default_rng(0)
  records = []
  for name in TIMED_SPEED_MODELS:
    model, example, batch = _speed_model(name, rng)
    rows = {p: _step_record(model, example, batch, p) for p in POLICIES}
    for p in POLICIES:
      records.append(
        {
          "kind": "step",
          "task": name,
          "policy": p,
          **rows[p],
          "speedup_vs_bf16": rows["mixed_bfloat16"]["ms_per_step"] / rows[p]["ms_per_step"],
        }
      )
    print(
      _harness.format_table(
        records[-2:],
        (
          "task",
          "policy",
          "ms_per_step",
          "speedup_vs_bf16",
          "compile_s",
          "first_call_s",
          "fp8_gemm_calls",
          "gemm_calls",
        ),
      ),
      flush=True,
    )
  for p in POLICIES:
    records.append({"kind": "matmul", "task": "16384^3", "policy": p, "tflops": _matmul_tflops(p, 16384)})
  return records


def run(quick: bool) -> list[dict[str, Any]]:
  records = accuracy_records(quick)
  if jax.default_backend() == "gpu" and not quick:
    records += speed_records()
  else:
    records.append(
      {
        "kind": "speed",
        "task": "skipped",
        "policy": f"needs a GPU (backend here: {jax.default_backend()})",
        "ms_per_step": None,
        "speedup_vs_bf16": None,
        "tflops": None,
      }
    )
  return records
