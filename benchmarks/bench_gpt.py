"""GPT train step: ``make_train_step(policy="mixed_bfloat16")`` against a hand-written bfloat16 step.

The model is :class:`jmp_train_examples.models.gpt.GPT` (pre-norm decoder,
causal attention through ``jmp_train.flax.dot_product_attention``: cuDNN's
fused kernel on GPUs; chunked float32 cross-entropy). Two steps of the same
model, the same batch and ``optax.adam``:

* ``floor``: written by hand (:func:`floor_step`): the float32 parameters
  cast to bfloat16 once per step, ``jax.value_and_grad``, the Adam update in
  float32; no policy machinery. What a user would write to go fast.
* ``library``: ``jmp_train.make_train_step(apply_fn, loss_fn, optax.adam(...),
  policy="mixed_bfloat16")`` of the same model (it also returns the
  gradient norm and the loss-scale metrics).

Both are timed round-robin in one process (median of the step times after
warm-up). ``tokens_per_s`` is batch times sequence over the median;
``tflops`` the model's matmul FLOPs per step (``6 N`` per token for the
parameters' matmuls, the head included, plus ``12 L T d`` for attention:
:meth:`GPTConfig.train_flops_per_token`) over the median;
``fraction_of_peak`` that over the device's dense bfloat16 peak
(``jmp_train.diagnostics.CHIPS``); ``vs_floor`` the library's time over the
floor's (1.0: no overhead). ``hlo_dots`` and ``weight_converts`` count the
lowered step's matmuls and its converts of weight-sized arrays
(:func:`hlo_profile`); ``xla_flags`` is the ``XLA_FLAGS`` the run had.
``roofline_ms`` is :func:`jmp_train.diagnostics.roofline`'s predicted time
of the step on the detected chip (``roofline_chip``) and
``roofline_over_measured`` that over the median.

Runs only on a GPU (the 1.3B-parameter ``GPTConfig.gpt_1b``, sequence 2048,
batch ``BENCH_GPT_BATCH``, default 4; ``BENCH_GPT_REMAT`` picks the blocks'
recomputation, default ``none``); elsewhere it returns one record saying it
was skipped. ``python -m benchmarks --gpu-probe`` runs it with the other GPU
measurements (:mod:`benchmarks._probe`).
"""

from __future__ import annotations

import collections
import os
import re
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jmp_train
from benchmarks import _harness
from jmp_train_examples.models.gpt import GPT, GPTConfig, gpt_train_fns

NAME = "gpt"
COLUMNS = (
  "variant",
  "model",
  "params",
  "batch",
  "seq",
  "remat",
  "median_ms",
  "tokens_per_s",
  "tflops",
  "peak_tflops",
  "fraction_of_peak",
  "vs_floor",
  "roofline_ms",
  "roofline_over_measured",
  "hlo_dots",
  "weight_converts",
)


def floor_step(model: GPT, tx: optax.GradientTransformation) -> Callable[..., Any]:
  """The hand-written bfloat16 step: ``(params, opt_state, tokens, targets) -> (params, opt_state, loss)``.

  Float32 parameters cast to bfloat16 once per step, the model's float32
  loss (float32 softmax), gradients back to float32 through the cast, the
  optimizer in float32. Not jitted.
  """

  def loss_fn(params, tokens, targets):
    half = jax.tree.map(lambda p: p.astype(jnp.bfloat16), params)
    return model.apply({"params": half}, tokens, targets)

  def step(params, opt_state, tokens, targets):
    loss, grads = jax.value_and_grad(loss_fn)(params, tokens, targets)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  return step


def library_step(model: GPT, tx: optax.GradientTransformation, **kwargs: Any):
  """``jmp_train.make_train_step`` of ``model`` under ``"mixed_bfloat16"``; batch ``((tokens, targets), None)``."""
  return jmp_train.make_train_step(*gpt_train_fns(model), tx, policy="mixed_bfloat16", **kwargs)


_TENSOR = re.compile(r"tensor<([^>]*)>")


def _tensor(text: str) -> tuple[tuple[int, ...], str]:
  """``"4x8xbf16"`` -> ``((4, 8), "bf16")``."""
  *dims, dtype = text.split("x")
  return tuple(int(d) for d in dims), dtype


def hlo_profile(stablehlo_text: str, weight_shapes) -> dict[str, Any]:
  """Matmuls and weight-sized converts of a lowered step (StableHLO text).

  Args:
    stablehlo_text: ``jax.jit(f).lower(...).as_text()``.
    weight_shapes: the parameters' shapes.

  Returns:
    ``dots``: a ``Counter`` of ``(lhs dtype, rhs dtype, result dtype)`` over
    ``stablehlo.dot_general`` ops; ``weight_converts``: how many
    ``stablehlo.convert`` ops have a result of a weight's shape (any dtype);
    ``weight_converts_by``: a ``Counter`` of ``(shape, from, to)`` of those.
  """
  shapes = {tuple(s) for s in weight_shapes}
  dots, converts = collections.Counter(), collections.Counter()
  for line in stablehlo_text.splitlines():
    if "stablehlo.dot_general" in line or "stablehlo.convert" in line:
      types = [_tensor(t) for t in _TENSOR.findall(line.rsplit(":", 1)[-1])]
      if "stablehlo.dot_general" in line and len(types) == 3:
        dots[tuple(t[1] for t in types)] += 1
      elif "stablehlo.convert" in line and len(types) == 2 and types[1][0] in shapes:
        converts[(types[1][0], types[0][1], types[1][1])] += 1
  return {"dots": dots, "weight_converts": sum(converts.values()), "weight_converts_by": converts}


def _sizes(on_gpu: bool) -> tuple[GPTConfig, int, int, int]:
  """``(config, batch, seq, repeats)``."""
  remat = os.environ.get("BENCH_GPT_REMAT", "none")
  if on_gpu:
    cfg = GPTConfig.gpt_1b(remat=remat)
    return cfg, _harness.env_int("BENCH_GPT_BATCH", 4), cfg.max_len, 10
  return GPTConfig.tiny(num_layers=1, remat=remat), 2, 16, 2


def measure(cfg: GPTConfig, batch: int, seq: int, *, repeats: int = 10, warmup: int = 2) -> list[dict[str, Any]]:
  """Both steps of a :class:`GPT` of ``cfg`` on one batch: one record each (floor first)."""
  from benchmarks.bench_gpu import peak_tflops

  model = GPT(cfg)
  rng = np.random.default_rng(0)
  seqs = jnp.asarray(rng.integers(0, cfg.vocab_size, (batch, seq + 1)), jnp.int32)
  tokens, targets = seqs[:, :-1], seqs[:, 1:]
  params = jax.jit(model.init)(jax.random.key(0), tokens)["params"]
  weight_shapes = [p.shape for p in jax.tree.leaves(params)]
  tx = optax.adam(1e-4)

  floor = jax.jit(floor_step(model, tx), donate_argnums=(0, 1))
  floor_lowered = floor.lower(params, tx.init(params), tokens, targets)
  library = library_step(model, tx)
  lib_state = library.init(jax.tree.map(jnp.copy, params))
  lib_batch = ((tokens, targets), None)
  lib_lowered = library.lower(lib_state, lib_batch)
  profiles = {
    "floor": hlo_profile(floor_lowered.as_text(), weight_shapes),
    "library": hlo_profile(lib_lowered.as_text(), weight_shapes),
  }
  floor_c, library_c = floor_lowered.compile(), lib_lowered.compile()
  # Traced, not run: before the donating steps consume their arguments.
  predicted = {
    "floor": _harness.roofline_prediction(floor, params, jax.eval_shape(tx.init, params), tokens, targets),
    "library": _harness.roofline_prediction(library, lib_state, lib_batch),
  }

  carry = {"floor": (params, tx.init(params)), "library": lib_state}

  def run_floor():
    p, o, loss = floor_c(*carry["floor"], tokens, targets)
    carry["floor"] = (p, o)
    return loss

  def run_library():
    carry["library"], metrics = library_c(carry["library"], lib_batch)
    return metrics["loss"]

  times = _harness.interleaved_median_seconds(
    {"floor": run_floor, "library": run_library}, warmup=warmup, repeats=repeats
  )
  kind = jax.devices()[0].device_kind
  peak = peak_tflops(kind, "bf16")
  flops = cfg.train_flops_per_token(seq) * batch * seq
  records = []
  for variant in ("floor", "library"):
    t = times[variant]
    tflops = flops / t / 1e12
    records.append(
      {
        "variant": variant,
        "model": f"GPT d{cfg.d_model} L{cfg.num_layers}",
        "params": cfg.num_params(),
        "batch": batch,
        "seq": seq,
        "remat": cfg.remat,
        "attention": cfg.attention,
        "median_ms": 1e3 * t,
        "tokens_per_s": batch * seq / t,
        "tflops": tflops,
        "peak_tflops": peak,
        "fraction_of_peak": None if peak is None else tflops / peak,
        "vs_floor": t / times["floor"],
        "hlo_dots": sum(profiles[variant]["dots"].values()),
        "hlo_dot_dtypes": {"x".join(k): v for k, v in sorted(profiles[variant]["dots"].items())},
        "weight_converts": profiles[variant]["weight_converts"],
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        **_harness.with_measured(predicted[variant], 1e3 * t),
      }
    )
  return records


def run(quick: bool) -> list[dict[str, Any]]:
  """The benchmark on a GPU (``quick``: a 125M model, sequence 512); one ``skipped`` record elsewhere."""
  if jax.default_backend() != "gpu":
    return _harness.skipped(
      f"needs a GPU (backend here: {jax.default_backend()}); the code path is tested on CPU by tests/test_gpt.py"
    )
  if quick:
    return measure(GPTConfig.gpt_125m(), 2, 512, repeats=3, warmup=1)
  cfg, batch, seq, repeats = _sizes(True)
  return measure(cfg, batch, seq, repeats=repeats)
