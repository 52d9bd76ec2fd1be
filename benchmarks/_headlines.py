"""The report's headline figures, each computed from the records of one results file.

:data:`FIGURES` maps a benchmark's name to a function of one of its results
files' records that yields ``(figure, value)`` pairs; the report applies it
to every stored file of that benchmark (``--quick`` files aside), so a new
machine's results add their own rows. Figures about a GPU come only from
files measured on one (:data:`GPU_ONLY`). A figure whose records are
missing is left out. :func:`demo_table` is the demo's table of validation
losses, from every ``demo-<device>/`` results file.
"""

from __future__ import annotations

import math
import pathlib
from typing import Any, Callable, Iterator

from jmp_train.diagnostics import format_table

Records = list[dict[str, Any]]
Figure = tuple[str, str]


def percent(digits: int) -> Callable[[Any], str]:
  """A signed percentage formatter (``+1.23%``) that leaves non-numbers as text."""

  def fmt(v: Any) -> str:
    return f"{v:+.{digits}%}" if isinstance(v, (int, float)) and math.isfinite(v) else str(v)

  return fmt


def find(records: Records, **match: Any) -> dict[str, Any] | None:
  """The first record with every ``match`` field equal, or ``None``."""
  return next((r for r in records if all(r.get(k) == v for k, v in match.items())), None)


def _compression(records: Records) -> Iterator[Figure]:
  r = find(records, part="bytes", scheme="1bit_l1", replicas=8)
  if r:
    yield (
      f"1-bit exchange (`1bit_l1`) bytes over a float32 all-reduce, {r['params']:,}-parameter MLP, 8 replicas",
      f"{r['vs_f32']:.4f} ({1 / r['vs_f32']:.0f}x fewer)",
    )


def _replica_scale(records: Records) -> Iterator[Figure]:
  measured = [r for r in records if r.get("part") == "measured" and r.get("scheme") == "sign_compression"]
  if len(measured) >= 2:
    lo, hi = min(measured, key=lambda r: r["replicas"]), max(measured, key=lambda r: r["replicas"])
    yield (
      f"`sign_compression` step's program (StableHLO lines) and first step, "
      f"{lo['replicas']} against {hi['replicas']} replicas",
      f"{lo['hlo_lines']:,} / {lo['first_step_s']:.1f} s against {hi['hlo_lines']:,} / {hi['first_step_s']:.1f} s",
    )


def _weight_memory(records: Records) -> Iterator[Figure]:
  q8, f32 = find(records, optimizer="adam_8bit"), find(records, optimizer="adam", weights="float32")
  if q8 and f32:
    yield (
      "Adam state bytes per parameter: `adam_8bit` against float32 moments",
      f"{q8['opt_state_per_param']:.2f} against {f32['opt_state_per_param']:.2f}",
    )


def _one_bit_text(records: Records) -> Iterator[Figure]:
  r = find(records, mode="one_bit_adam_rescaled_clipped", steps=200)
  if r:
    yield (
      "`one_bit_adam` (`clip_step`, `rescale_variance`) on the demo's text "
      "Transformer, 8 replicas, 200 steps: validation loss against Adam",
      f"{percent(2)(r['rel_to_float32'])}, at {r['wire_ratio']:.3f} of the bytes",
    )


def _diloco(records: Records) -> Iterator[Figure]:
  modes = (
    "diloco_h16",
    "diloco_h16_1bit",
    "d256_diloco_h16_1bit",
    "d256_r4_diloco_h16_1bit",
    "d256_r2_diloco_h16_1bit",
  )
  for mode in modes:
    r = find(records, mode=mode)
    if r and r.get("rel_to_adam") is not None:
      width = f" of width {r['d_model']}" if "d_model" in r else ""
      yield (
        f"`diloco` ({'1-bit' if mode.endswith('1bit') else 'exact'} outer "
        f"updates every {r['sync_every']} steps) on the demo's text Transformer{width}, "
        f"{r['replicas']} replicas sharing {r['batch']} sequences per step, {r['steps']} steps: "
        "validation loss against synchronous Adam",
        f"{percent(1)(r['rel_to_adam'])}, at {r['wire_ratio']:.4f} of the bytes",
      )


def _time_to_loss(records: Records) -> Iterator[Figure]:
  link = "lo<=1gbit"
  ratios = {
    mode: [r["vs_adam"] for r in records if r.get("link") == link and r["mode"] == mode and r.get("vs_adam")]
    for mode in ("one_bit_adam", "diloco_h16_1bit")
  }
  diloco = find(records, link=link, mode="diloco_h16_1bit")
  if diloco and all(ratios.values()):
    spread = lambda v: f"{sum(v) / len(v):.2f}" + (f" [{min(v):.2f}, {max(v):.2f}]" if len(v) > 1 else "")
    seeds = len(ratios["diloco_h16_1bit"])
    yield (
      f"`diloco` (1-bit outer updates every 16 steps) across {diloco['processes']} processes at 1 Gbit/s, "
      f"text Transformer of width {diloco['d_model']}: wall-clock time to the loss every row reaches, "
      "over float32 Adam's (`one_bit_adam`'s beside it), "
      + (f"mean [min, max] of {seeds} seeds" if seeds > 1 else "1 seed"),
      f"{spread(ratios['diloco_h16_1bit'])} ({spread(ratios['one_bit_adam'])})",
    )


def _gpt(records: Records) -> Iterator[Figure]:
  lib, floor = find(records, variant="library"), find(records, variant="floor")
  if lib and floor:
    yield (
      f"{lib['model']} ({lib['params'] / 1e9:.2f}B parameters, "
      f"{lib['batch']}x{lib['seq']} tokens) under `make_train_step(..., "
      '"mixed_bfloat16")`: share of the bfloat16 peak; time over a '
      "hand-written bfloat16 step",
      f"{lib['fraction_of_peak']:.1%} ({lib['tflops']:.0f} TFLOP/s); {lib['vs_floor']:.3f}",
    )


def _user_models(records: Records) -> Iterator[Figure]:
  for model in ("transformer", "resnet50"):
    auto = find(records, model=model, variant="mixed_bfloat16")
    if auto:
      yield (
        f"Flax-style {model} declaring float32 dtypes, `make_train_step("
        'policy="mixed_bfloat16")` defaults: speed-up over float32 (TF32); '
        "time over the model wrapped by hand in `apply_policy`",
        f"{auto['speedup_vs_float32']:.2f}x; {auto['vs_by_hand']:.3f}",
      )


def _fp8(records: Records) -> Iterator[Figure]:
  for r in records:
    if r.get("kind") == "step" and r.get("policy") == "mixed_float8":
      yield (
        f"FP8 train step (`mixed_float8`) of `{r['task']}` over `mixed_bfloat16`; first call",
        f"{r['speedup_vs_bf16']:.2f}x; {r['first_call_s']:.1f} s",
      )


def _fp8_first_call(records: Records) -> Iterator[Figure]:
  for r in records:
    if r.get("xla_flags") == "--xla_gpu_enable_triton_gemm=false" and "error" not in r:
      yield (
        f"FP8 train step of `{r['task']}`, first call and step time with "
        "`xla_gpu_enable_triton_gemm=false` (`make_train_step`'s FP8 default)",
        f"{r['first_call_s']:.1f} s; {r['ms_per_step']:.1f} ms",
      )


def _gpu(records: Records) -> Iterator[Figure]:
  bf16 = find(records, kind="step", model="Transformer d1024", policy="mixed_bfloat16")
  tf32 = find(records, kind="step", model="Transformer d1024", policy="float32 (default/TF32)")
  if bf16 and tf32:
    yield (
      "Train step of a d_model 1024 Transformer: `mixed_bfloat16` speed-up over float32 (TF32 matmuls)",
      f"{tf32['median_ms'] / bf16['median_ms']:.2f}x ({bf16['median_ms']:.2f} ms against {tf32['median_ms']:.2f} ms)",
    )


def _activation_memory(records: Records) -> Iterator[Figure]:
  for r in records:
    if (
      r.get("remat") == "default"
      and r.get("policy") == "mixed_bfloat16"
      and str(r.get("model", "")).startswith("Transformer")
    ):
      yield (
        f"Bytes kept for the backward pass, {r['model']}, `apply_policy` under `mixed_bfloat16`, over float32",
        f"{r['residual_ratio']:.3f}",
      )
      return


def _loss_scaling(records: Records) -> Iterator[Figure]:
  steps = [r for r in records if r.get("part") == "step" and r.get("variant") == "jmp_train" and "run" not in r]
  if steps:
    r = max(steps, key=lambda r: (r["params"], r["batch"]))
    yield (
      f"`loss_scaled(adamw)` step time over `adamw`, {r['params']:,} parameters, batch {r['batch']}",
      f"{r['ratio_to_adamw']:.3f}",
    )


def _gradient_underflow(records: Records) -> Iterator[Figure]:
  r = find(records, weights="after 100 float32 steps", tokens_per_step=131072)
  if r:
    yield (
      "Float16 gradient's error against float32 at 131,072 tokens per step "
      "(the demo's model after 100 steps): without a loss scale, with 2^15",
      f"{r['rel_err_f16']:.1%}, {r['rel_err_f16_scaled']:.1%}",
    )


def _roofline(records: Records) -> Iterator[Figure]:
  cpu = [r for r in records if r.get("part") == "cpu"]
  if cpu:
    policies = list(dict.fromkeys(r["policy"] for r in cpu))
    ratios: dict[str, list[str]] = {}
    for r in cpu:
      ratios.setdefault(r["model"], []).append(f"{r['predicted_over_measured']:.2f}")
    ranked = [f"{p} {'yes' if all(r['ranking_matches'] for r in cpu if r['policy'] == p) else 'no'}" for p in policies]
    yield (
      f"`roofline` on the CPU (its measured peaks), one train step: predicted over measured time under "
      f"{' / '.join(f'`{p}`' for p in policies)}; whether the predicted order of the models is the measured one",
      "; ".join(f"{m} {' / '.join(v)}" for m, v in ratios.items()) + f"; same order: {', '.join(ranked)}",
    )
  predicted = [r for r in records if r.get("part") == "predicted"]
  for chip in dict.fromkeys(r["chip"] for r in predicted):
    rows = [r for r in predicted if r["chip"] == chip]
    yield (
      f"Predicted by `roofline` on {chip}, not measured: the `{rows[0]['mixed_policy']}` train step's time; "
      "`roofline_compare` of the loss's gradient: `mixed_bfloat16` over float32, `mixed_float8` over `mixed_bfloat16`",
      "; ".join(
        f"{r['model']} {1e3 * r['mixed_ms']:.3g} µs, {r['mixed_speedup']:.2f}x, {r['fp8_speedup']:.2f}x" for r in rows
      ),
    )


def _default_policy(records: Records) -> Iterator[Figure]:
  autos = [r for r in records if r.get("model_policy") == "auto" and "step_ratio" in r]
  if autos:
    over = [r["model"] for r in autos if max(r["compile_ratio"], r["step_ratio"]) > 1.05]
    yield (
      f'`make_train_step(..., policy="{autos[0]["policy"]}")` with `model_policy="auto"` (per operation) over '
      '`"flax"` (layer fields): compile time, step time (target: within 1.05)',
      "; ".join(f"{r['model']} {r['compile_ratio']:.2f}, {r['step_ratio']:.2f}" for r in autos)
      + (f" (above the target: {', '.join(over)})" if over else " (within the target)"),
    )


def _int8(records: Records) -> Iterator[Figure]:
  def drop(r: dict[str, Any]) -> str:
    d = r["vs_float32"]
    return f"{d:+.2f} pts" if r["metric"] == "accuracy_%" else f"{d:+.2%}"

  models = list(dict.fromkeys(r["model"] for r in records if "model" in r))
  parts = []
  for model in models:
    ptq, qat = find(records, model=model, variant="best_ptq"), find(records, model=model, variant="qat")
    if ptq and qat:
      parts.append(f"{model} {drop(ptq)} ({ptq['note']}), QAT {drop(qat)}")
  if parts:
    yield (
      "INT8 w8a8 (per-channel weights, static per-tensor activations) against float32: best PTQ "
      "(calibration method), QAT (`mixed_int8` fine-tuning, 10% of the steps); accuracy points or "
      "validation loss",
      "; ".join(parts),
    )
  sizes = []
  for model in models:
    onnx, weights = find(records, model=model, variant="onnx_bytes"), find(records, model=model, variant="weight_bytes")
    agree = find(records, model=model, variant="onnxruntime_agreement")
    if onnx and weights and agree:
      sizes.append(f"{model} {weights['vs_float32']:.3f} / {onnx['vs_float32']:.3f} / {agree['value']:.1%}")
  if sizes:
    yield (
      "INT8 model over float32: weight bytes / ONNX file; onnxruntime's predictions equal to ours",
      "; ".join(sizes),
    )


FIGURES: dict[str, Callable[[Records], Iterator[Figure]]] = {
  "compression": _compression,
  "replica_scale": _replica_scale,
  "weight_memory": _weight_memory,
  "one_bit_text": _one_bit_text,
  "diloco": _diloco,
  "time_to_loss": _time_to_loss,
  "gpt": _gpt,
  "user_models": _user_models,
  "fp8": _fp8,
  "fp8_first_call": _fp8_first_call,
  "gpu": _gpu,
  "activation_memory": _activation_memory,
  "loss_scaling": _loss_scaling,
  "gradient_underflow": _gradient_underflow,
  "roofline": _roofline,
  "default_policy": _default_policy,
  "int8": _int8,
}
# Speed on a GPU: a CPU run of these benchmarks exercises their code only.
GPU_ONLY = frozenset({"gpt", "user_models", "fp8", "fp8_first_call", "gpu", "loss_scaling"})


def figures(benchmark: str, payload: dict[str, Any]) -> list[Figure]:
  """The headline figures of one results file (none for a benchmark without any)."""
  fn = FIGURES.get(benchmark)
  if fn is None or (benchmark in GPU_ONLY and payload["machine"].get("backend") != "gpu"):
    return []
  return list(fn(payload.get("records", [])))


def _demo_rows(payload: dict[str, Any]) -> Records:
  return [r for r in payload.get("rows", []) if "config" in r and "val_loss_gap" in r]


def demo_table(files: dict[str, dict[str, Any]], where: Callable[[str], str]) -> list[str]:
  """The demo's gaps to each configuration's baseline, one column per run, and its bytes figure.

  Args:
    files: ``name -> payload`` of the demo's results files (``demo-<device>/``).
    where: a file's name as the report links it.

  Returns:
    Markdown blocks (none without demo results).
  """
  names = [n for n, payload in files.items() if _demo_rows(payload)]
  if not names:
    return []
  stems = {n: pathlib.PurePath(n).stem for n in names}
  if len(set(stems.values())) < len(names):
    stems = {n: n.removesuffix(".json") for n in names}
  configs = list(dict.fromkeys(r["config"] for n in names for r in _demo_rows(files[n])))
  rows = []
  for config in configs:
    found = [find(_demo_rows(files[n]), config=config) for n in names]
    first = next(r for r in found if r is not None)
    if first.get("reference") == config:
      continue  # a baseline: gap 0 by definition
    row = {"config": config, "what": first.get("description"), "baseline": first.get("reference")}
    for n, r in zip(names, found):
      row[stems[n]] = None if r is None else r.get("val_loss_gap")
    rows.append(row)
  columns = ["config", "what", "baseline", *stems.values()]
  settings = []
  for n in names:
    s = files[n].get("settings", {})
    said = ", ".join(
      f"{k} {s[k]}" for k in ("task", "d_model", "layers", "seq_len", "batch", "steps", "learning_rate") if k in s
    )
    settings.append(f"`{stems[n]}`: {said}")
  blocks = [
    "### The demo: final validation loss against its baseline",
    "`jmp-train`'s configurations, each trained from the same weights on the same batches "
    "as its baseline; the validation loss relative to the baseline's (`-` where the run "
    "did not include the configuration). Single-device rows on the GPU, 8-device rows on "
    "8 simulated CPU devices. From " + ", ".join(where(n) for n in names) + ".",
    format_table(rows, columns, formats={s: percent(2) for s in stems.values()}),
    "Runs: " + "; ".join(settings) + ".",
  ]
  return blocks


def demo_bytes(files: dict[str, dict[str, Any]]) -> tuple[str, Figure] | None:
  """``(file, figure)``: bytes a device sends per step, ``8dev-1bit`` against ``8dev-f32``.

  From the first demo run that has both rows; ``None`` without one.
  """
  for name, payload in files.items():
    rows = _demo_rows(payload)
    one_bit, f32 = find(rows, config="8dev-1bit"), find(rows, config="8dev-f32")
    if one_bit and f32 and one_bit.get("wire_bytes_per_step") and f32.get("wire_bytes_per_step"):
      a, b = one_bit["wire_bytes_per_step"], f32["wire_bytes_per_step"]
      figure = "Demo: bytes each device sends per step, `8dev-1bit` against `8dev-f32`"
      return name, (figure, f"{a:,} against {b:,} ({b / a:.0f}x fewer)")
  return None
