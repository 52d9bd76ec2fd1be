"""A Transformer's ``make_train_step`` under bfloat16, FP8 and INT8 policies, against the roofline's times.

The model is ``jmp_train_examples.models.TransformerBlock`` at d_model
4,096 (32 heads, MLP 16,384, 2 layers, vocabulary 32,768, sequence 2,048,
batch 4: products with K and N of 4,096 and more, where FP8 pays), trained
by ``jmp_train.make_train_step(model.apply, loss, optax.adam(1e-4),
policy=...)`` with its defaults (``model_policy="auto"``; FP8 steps compile
without Triton GEMMs on GPUs), one record per policy:

* ``products`` / ``narrow_products``: the lowered step's products
  (:func:`jmp_train.diagnostics.fp8_products`) and those with both operands
  in the policy's product format (``fp8_products`` for FP8, int8 for INT8,
  bfloat16 for bfloat16); ``wide_products``: where the others are (the
  attention's score and value products, activations times activations,
  stay bfloat16 under FP8);
* ``gemm_calls`` / ``narrow_gemm_calls``: the compiled step's GEMM custom
  calls and those on 8-bit operands (GPU);
* ``ms_per_step`` (median of 10 steps after 3), ``speedup_vs_bf16`` and
  ``compile_s``;
* ``predicted_ms``: :func:`jmp_train.diagnostics.roofline` of the whole step
  on the device (``chip`` its kind), ``measured_over_predicted`` the
  measured time over it, and ``predicted_speedup_vs_bf16`` the roofline's
  speed-up next to the measured one.

A policy whose step fails (``mixed_int8`` where the backend cannot run it)
gives a record with its ``error``; the records are yielded one policy at a
time, so a run cut off keeps the policies done. On a GPU by the GPU probe
(:mod:`benchmarks._probe`); ``--quick`` (any backend): ``mixed_bfloat16``
and ``mixed_float8`` only, width 64, one layer, sequence 16, batch 2, 2
timed steps (a smoke test; the XLA:CPU of some JAX versions cannot run
``mixed_int8``'s bfloat16 x bfloat16 -> float32 products). A full run
elsewhere is skipped.
"""

from __future__ import annotations

import time
from typing import Any, Iterator

import jax
import jax.numpy as jnp
import numpy as np
import optax

from benchmarks import _harness

NAME = "step_formats"
COLUMNS = (
  "policy",
  "model",
  "ms_per_step",
  "speedup_vs_bf16",
  "predicted_ms",
  "measured_over_predicted",
  "predicted_speedup_vs_bf16",
  "products",
  "narrow_products",
  "gemm_calls",
  "narrow_gemm_calls",
  "compile_s",
)
POLICIES = ("mixed_bfloat16", "mixed_float8", "mixed_int8")
# The product format each policy aims at: the operand dtypes' names.
_NARROW = {"mixed_bfloat16": ("bfloat16",), "mixed_float8": ("float8_e4m3fn", "float8_e5m2"), "mixed_int8": ("int8",)}


def _sizes(quick: bool) -> dict[str, int]:
  if quick:
    return dict(vocab=256, d_model=64, heads=4, mlp=256, layers=1, seq=16, batch=2, repeats=2, warmup=1)
  return dict(vocab=32768, d_model=4096, heads=32, mlp=16384, layers=2, seq=2048, batch=4, repeats=10, warmup=3)


def _loss(logits, targets):
  return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), targets).mean()


def _narrow(entry, policy: str) -> bool:
  names = _NARROW[policy]
  return np.dtype(entry.lhs_dtype).name in names and np.dtype(entry.rhs_dtype).name in names


def policy_record(
  model, params, batch, policy: str, *, repeats: int, warmup: int, compiler_options=None
) -> dict[str, Any]:
  """One policy's step: products by format, GEMM calls, step time and the roofline's time.

  ``compiler_options``: ``make_train_step``'s (``None``: its defaults).
  """
  import jmp_train
  from jmp_train.diagnostics import fp8_products, roofline

  step = jmp_train.make_train_step(
    model.apply, _loss, optax.adam(1e-4), policy=policy, compiler_options=compiler_options
  )
  state = step.init(jax.tree.map(jnp.copy, params), inputs=batch[0])
  batch = step.shard_batch(batch)
  t0 = time.perf_counter()
  lowered = step.lower(state, batch)
  lowered_report = fp8_products(lowered)
  compiled = lowered.compile()
  compile_s = time.perf_counter() - t0
  gemms = [p for p in fp8_products(compiled).products if p.op.startswith(("__cublas", "__cudnn"))]
  wide = sorted(
    {f"{p.name or p.op} {np.dtype(p.lhs_dtype).name}" for p in lowered_report.products if not _narrow(p, policy)}
  )
  predicted = roofline(step, state, batch, chip=jax.devices()[0].device_kind).time_s

  stepper = {"state": state}

  def run():
    stepper["state"], metrics = compiled(stepper["state"], batch)
    return metrics["loss"]

  seconds = _harness.median_seconds(run, warmup=warmup, repeats=repeats)
  return {
    "policy": policy,
    "ms_per_step": 1e3 * seconds,
    "predicted_ms": 1e3 * predicted,
    "measured_over_predicted": seconds / predicted if predicted else None,
    "products": len(lowered_report.products),
    "narrow_products": sum(1 for p in lowered_report.products if _narrow(p, policy)),
    "fp8_products": len(lowered_report.fp8),
    "wide_products": wide[:12],
    "gemm_calls": len(gemms),
    "narrow_gemm_calls": sum(1 for p in gemms if "f8" in p.op or "s8" in p.op),
    "gemm_targets": sorted({p.op for p in gemms}),
    "compile_s": compile_s,
  }


def records(quick: bool = False) -> Iterator[dict[str, Any]]:
  """Yields one record per policy of :data:`POLICIES` (see the module docstring), ``mixed_bfloat16`` first."""
  from jmp_train_examples.models import TransformerBlock

  s = _sizes(quick)
  model = TransformerBlock(
    vocab_size=s["vocab"],
    d_model=s["d_model"],
    num_heads=s["heads"],
    mlp_dim=s["mlp"],
    num_layers=s["layers"],
    max_len=s["seq"],
  )
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, s["vocab"], (s["batch"], s["seq"] + 1)).astype(np.int32)
  batch = (tokens[:, :-1], tokens[:, 1:])
  params = jax.jit(model.init)(jax.random.key(0), batch[0])["params"]
  label = f"TransformerBlock d{s['d_model']} L{s['layers']} seq {s['seq']} batch {s['batch']}"
  base = None
  for policy in POLICIES[:2] if quick else POLICIES:
    try:
      row = policy_record(
        model,
        params,
        batch,
        policy,
        repeats=s["repeats"],
        warmup=s["warmup"],
        compiler_options=_harness.compile_options(quick),
      )
    except Exception as e:  # One policy's failure (INT8 on XLA:CPU) is a result; the others still run.
      yield {"policy": policy, "model": label, "error": f"{type(e).__name__}: {str(e)[:300]}"}
      continue
    base = base or row
    row["model"] = label
    row["speedup_vs_bf16"] = base["ms_per_step"] / row["ms_per_step"]
    row["predicted_speedup_vs_bf16"] = base["predicted_ms"] / row["predicted_ms"]
    print({k: row[k] for k in COLUMNS if k in row}, flush=True)
    yield row


def run(quick: bool) -> list[dict[str, Any]]:
  if jax.default_backend() != "gpu" and not quick:
    return _harness.skipped(
      f"needs a GPU for the d4096 sizes (backend here: {jax.default_backend()}); --quick runs here"
    )
  return list(records(quick))
