"""Runs the benchmark suite: ``python -m benchmarks [--quick] [--only NAME ...]``.

Each ``benchmarks/bench_*.py`` module defines ``NAME``, an optional
``COLUMNS`` and ``run(quick: bool) -> list[dict]``. Results go to
``benchmarks/results/<NAME>-<device>.json`` (with machine, device, versions
and date; ``<NAME>-quick-<device>.json`` for ``--quick``) and a table is
printed per benchmark. A benchmark that cannot run here returns
``_harness.skipped(reason)``; one that raises is reported, the others still
run, and the exit status is 1.

``python -m benchmarks --summary`` prints the stored results, one table per
file; ``python -m benchmarks --report`` writes them, with headline figures,
to ``docs/benchmarks_report.md`` (:func:`report`).
"""

from __future__ import annotations

import argparse
import ast
import importlib
import json
import math
import os
import pathlib
import sys
import time
import traceback
from typing import Any, Callable, Iterator

from jmp_train.diagnostics import format_table

_HERE = pathlib.Path(__file__).resolve().parent
_ROOT = _HERE.parent
RESULTS_DIR = _HERE / "results"  # the same folder as ``_harness.RESULTS_DIR``
REPORT_PATH = _ROOT / "docs" / "benchmarks_report.md"
REPORT_COMMAND = "python -m benchmarks --report"


def discover() -> list[str]:
  """The benchmark module names (``bench_*``), sorted."""
  here = pathlib.Path(__file__).parent
  return sorted(p.stem for p in here.glob("bench_*.py"))


def _simulate_cpu_devices(count: int) -> None:
  """Asks XLA for ``count`` host devices, if JAX has not started yet.

  Only the CPU platform is affected: on a GPU machine the GPUs stay the
  default devices. Once ``jax`` is imported (the test suite, a notebook) the
  flag can no longer take effect, and it is left alone.
  """
  flags = os.environ.get("XLA_FLAGS", "")
  if "jax" in sys.modules or "xla_force_host_platform_device_count" in flags:
    return
  os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={count}".strip()


def module_facts(path: pathlib.Path) -> tuple[str, tuple[str, ...] | None]:
  """A module's docstring summary line and its ``COLUMNS``, read without importing it.

  Returns:
    ``(summary, columns)``: the first line of the docstring with reST
    literals as Markdown ones (``""`` without a docstring or a file), and the
    literal ``COLUMNS`` tuple (``None`` without one).
  """
  if not path.is_file():
    return "", None
  tree = ast.parse(path.read_text())
  doc = (ast.get_docstring(tree) or "").strip()
  line = doc.splitlines()[0].replace("``", "`") if doc else ""
  columns = None
  for node in tree.body:
    if (
      isinstance(node, ast.Assign)
      and len(node.targets) == 1
      and isinstance(node.targets[0], ast.Name)
      and node.targets[0].id == "COLUMNS"
    ):
      columns = tuple(ast.literal_eval(node.value))
  return line, columns


def _columns(name: str) -> tuple[str, ...] | None:
  return module_facts(_HERE / f"bench_{name}.py")[1]


def summary(results_dir: pathlib.Path | None = None) -> str:
  """The stored full-size results as markdown: one table per result file."""
  results_dir = pathlib.Path(results_dir or RESULTS_DIR)
  parts = []
  for path in sorted(results_dir.glob("*.json")):
    payload = json.loads(path.read_text())
    name = payload["benchmark"]
    if name.endswith("-quick"):
      continue
    m = payload["machine"]
    columns = _columns(name)
    if columns is not None and any("run" in r for r in payload["records"]):
      columns = (*columns, "run")  # records appended by later runs say which run
    parts.append(
      f"#### {name}\n\n{m['device_kind']} x{m['device_count']} ({m['backend']}, "
      f"{m.get('cpu_count')} CPU cores), jax {m['versions']['jax']}, {m['date']}\n\n"
      + format_table(payload["records"], columns)
    )
  return "\n\n".join(parts) if parts else f"(no results in {results_dir})"


# --- The generated report -------------------------------------------------

_SPLIT_KEYS = ("part", "study", "kind")  # a column that names a table of its own
_LABEL_KEYS = ("run", "date", "skipped", "reason")
_SHORT_TEXT = 24  # longer text varying between rows stays out of the tables
# A folder of results that are not ``bench_*`` output: its section's title
# and the module whose docstring says what it measures.
_FOLDERS = {"demo": ("Demo (`jmp-train`)", _ROOT / "jmp_train" / "examples" / "demo.py")}
_DEMO_SETTINGS = (
  "task",
  "steps",
  "batch",
  "seq_len",
  "d_model",
  "layers",
  "learning_rate",
  "momentum",
  "one_bit_scale",
  "seed",
)


def _percent(digits: int) -> Callable[[Any], str]:
  def fmt(v: Any) -> str:
    return f"{v:+.{digits}%}" if isinstance(v, (int, float)) and math.isfinite(v) else str(v)

  return fmt


def _plain(v: Any) -> Any:
  """A record value ready for a Markdown cell (``|`` escaped)."""
  return v.replace("|", "\\|") if isinstance(v, str) else v


def _sentence(text: str) -> str:
  return text if text.endswith((".", "!", "?")) else text + "."


def _key(v: Any) -> str:
  return json.dumps(v, sort_keys=True)


def _is_short_scalar(v: Any) -> bool:
  if isinstance(v, str):
    return len(v) <= _SHORT_TEXT
  return v is None or isinstance(v, (bool, int, float))


def _machine(m: dict[str, Any]) -> str:
  """The machine of a results file, in words, from its ``machine`` only."""
  kind, count = m.get("device_kind"), m.get("device_count", m.get("devices"))
  words = []
  if kind:
    words.append(f"{kind} x{count}" if count is not None else str(kind))
  elif count is not None:
    words.append(f"{count} device{'s' if count != 1 else ''}")
  details = [f"{m['backend']} backend"] if m.get("backend") else []
  if m.get("backend") == "cpu" and "xla_force_host_platform_device_count" in (m.get("xla_flags") or ""):
    details.append("simulated devices")
  if m.get("cpu_count"):
    details.append(f"{m['cpu_count']} CPU cores")
  if details:
    words.append(f"({', '.join(details)})")
  jax_version = (m.get("versions") or {}).get("jax", m.get("jax"))
  text = " ".join(words) + (f", jax {jax_version}" if jax_version else "")
  date = m.get("date")
  return f"{text}; {date}" if date else f"{text}; the file records no date"


def _display(path: pathlib.Path) -> tuple[str, str | None]:
  """``(name shown, link from docs/)`` of a results file."""
  try:
    rel = path.resolve().relative_to(_ROOT).as_posix()
  except ValueError:
    return path.as_posix(), None
  return rel, f"../{rel}"


def _file_blocks(path: pathlib.Path, results_dir: pathlib.Path, machine: dict[str, Any]) -> list[str]:
  """A file's heading (no link: Sphinx takes none in a title), machine and link."""
  shown, link = _display(path)
  blocks = [f"### `{path.relative_to(results_dir).as_posix()}`", f"Machine: {_machine(machine)}."]
  if link:
    blocks.append(f"File: [`{shown}`]({link}).")
  return blocks


def _record_tables(records: list[dict[str, Any]], columns: tuple[str, ...] | None) -> Iterator[str]:
  """Markdown blocks: one table per value of a splitting column and per run.

  Columns: ``columns`` (those some record of the table has), then every
  other short scalar field that varies within the table; a run's label and
  a single date go above its table.
  """
  records = [{k: _plain(v) for k, v in r.items()} for r in records]
  base = list(columns) if columns else list(dict.fromkeys(k for r in records for k in r))
  split = [k for k in _SPLIT_KEYS if k in base and len({_key(r.get(k)) for r in records}) > 1]
  groups: dict[tuple[str, ...], list[dict[str, Any]]] = {}
  for r in records:
    groups.setdefault(tuple(_key(r.get(k)) for k in split), []).append(r)
  for split_key, members in groups.items():
    if split:
      yield "#### " + ", ".join(f"{k} `{json.loads(v)}`" for k, v in zip(split, split_key))
    runs: dict[str, list[dict[str, Any]]] = {}
    for r in members:
      runs.setdefault(_key(r.get("run")), []).append(r)
    for run_key, rows in runs.items():
      run = json.loads(run_key)
      dates = sorted({str(r["date"]) for r in rows if "date" in r})
      notes = []
      if run is not None:
        notes.append(_sentence(f"Run: {run}"))
      if len(dates) == 1 and all("date" in r for r in rows):
        notes.append(f"Date: {dates[0]}.")
      shown = [c for c in base if c not in split and any(c in r for r in rows)]
      if len(dates) > 1 or (dates and not all("date" in r for r in rows)):
        shown.append("date")
      for k in dict.fromkeys(k for r in rows for k in r):
        if k in shown or k in split or k in _LABEL_KEYS:
          continue
        values = [r.get(k) for r in rows]
        if all(_is_short_scalar(v) for v in values) and len({_key(v) for v in values}) > 1:
          shown.append(k)
      if notes:
        yield " ".join(notes)
      yield format_table(rows, shown)


def _benchmark_section(path: pathlib.Path, payload: dict[str, Any], results_dir: pathlib.Path) -> list[str]:
  records = payload["records"]
  blocks = _file_blocks(path, results_dir, payload["machine"])
  if len(records) == 1 and records[0].get("skipped") is True:
    blocks.append(f"Skipped there: {records[0].get('reason')}")
  else:
    blocks.extend(_record_tables(records, _columns(payload["benchmark"])))
  return blocks


def _folder_file_section(path: pathlib.Path, payload: dict[str, Any], results_dir: pathlib.Path) -> list[str]:
  blocks = _file_blocks(path, results_dir, payload["machine"])
  if "rows" in payload:  # a ``jmp-train`` results.json
    settings = payload.get("settings", {})
    said = [f"{k} {settings[k]}" for k in _DEMO_SETTINGS if k in settings]
    timing = payload.get("timing", {})
    if "wall_s" in timing:
      said.append(f"{timing['wall_s']:.0f} s wall")
    if said:
      blocks.append("Settings: " + ", ".join(said) + ".")
    columns = list(payload.get("columns") or payload["rows"][0])
    columns += [c for c in ("devices", "backend") if c not in columns and any(c in r for r in payload["rows"])]
    rows = [{k: _plain(v) for k, v in r.items()} for r in payload["rows"]]
    blocks.append(format_table(rows, columns, formats={"val_loss_gap": _percent(1)}))
    blocks.append(
      "`val_loss_gap`: the validation loss relative to the row's `reference` "
      "(`f32`, or `8dev-f32` for the 8-device rows)."
    )
  else:
    for key in ("what", "source"):
      if payload.get(key):
        blocks.append(_sentence(f"{key.capitalize()}: {payload[key]}"))
    blocks.extend(_record_tables(payload["records"], None))
  return blocks


def _load(results_dir: pathlib.Path) -> dict[str, tuple[pathlib.Path, dict[str, Any]]]:
  """``relative name -> (path, payload)`` of every full-size results file."""
  found = {}
  for path in sorted(results_dir.rglob("*.json")):
    payload = json.loads(path.read_text())
    if not isinstance(payload, dict) or "machine" not in payload:
      continue
    if str(payload.get("benchmark", "")).endswith("-quick"):
      continue
    found[path.relative_to(results_dir).as_posix()] = (path, payload)
  return found


# --- Headlines: figures quoted elsewhere, computed from the same files. ---


def _rows_of(loaded, name: str) -> list[dict[str, Any]]:
  if name not in loaded:
    return []
  payload = loaded[name][1]
  return payload.get("records", payload.get("rows", []))


def _find(loaded, name: str, **match: Any) -> dict[str, Any] | None:
  for r in _rows_of(loaded, name):
    if all(r.get(k) == v for k, v in match.items()):
      return r
  return None


def _where(loaded, name: str) -> str:
  path, payload = loaded[name]
  link = _display(path)[1]
  m = payload["machine"]
  device = m.get("device_kind") or f"{m.get('backend', '?')} backend"
  return f"[`{name}`]({link}) ({device})" if link else f"`{name}` ({device})"


_DEMO_FILES = (
  "demo-nvidia-h200/text-default.json",
  "demo-nvidia-h200/text-d512-l6-lr0.05.json",
  "demo-nvidia-h200/digits-default.json",
)


def _demo_headline(loaded) -> list[str]:
  names = [n for n in _DEMO_FILES if n in loaded]
  if not names:
    return []
  configs = list(dict.fromkeys(r["config"] for n in names for r in _rows_of(loaded, n)))
  rows = []
  for config in configs:
    found = [_find(loaded, n, config=config) for n in names]
    first = next(r for r in found if r is not None)
    if first.get("reference") == config:
      continue  # a baseline: gap 0 by definition
    row = {"config": config, "what": first.get("description"), "baseline": first.get("reference")}
    for n, r in zip(names, found):
      row[pathlib.PurePath(n).stem] = None if r is None else r.get("val_loss_gap")
    rows.append(row)
  columns = ["config", "what", "baseline", *(pathlib.PurePath(n).stem for n in names)]
  formats = {pathlib.PurePath(n).stem: _percent(2) for n in names}
  settings = []
  for n in names:
    s = loaded[n][1].get("settings", {})
    said = ", ".join(
      f"{k} {s[k]}" for k in ("task", "d_model", "layers", "seq_len", "batch", "steps", "learning_rate") if k in s
    )
    settings.append(f"`{pathlib.PurePath(n).stem}`: {said}")
  return [
    "### The demo: final validation loss against its baseline",
    "`jmp-train`'s configurations, each trained from the same weights on the same batches "
    "as its baseline; the validation loss relative to the baseline's (`-` where the run "
    "did not include the configuration). Single-device rows on the GPU, 8-device rows on "
    "8 simulated CPU devices. From " + ", ".join(_where(loaded, n) for n in names) + ".",
    format_table(rows, columns, formats=formats),
    "Runs: " + "; ".join(settings) + ".",
  ]


def _headline_rows(loaded) -> Iterator[dict[str, str]]:
  """Figures that need a lookup (or a ratio) in one file; missing ones are left out."""
  name = "compression-cpu.json"
  r = _find(loaded, name, part="bytes", scheme="1bit_l1", replicas=8)
  if r:
    yield {
      "figure": f"1-bit exchange (`1bit_l1`) bytes over a float32 all-reduce, "
      f"{r['params']:,}-parameter MLP, 8 replicas",
      "value": f"{r['vs_f32']:.4f} ({1 / r['vs_f32']:.0f}x fewer)",
      "source": _where(loaded, name),
    }
  name = "replica_scale-cpu.json"
  measured = [
    r for r in _rows_of(loaded, name) if r.get("part") == "measured" and r.get("scheme") == "sign_compression"
  ]
  if len(measured) >= 2:
    lo, hi = min(measured, key=lambda r: r["replicas"]), max(measured, key=lambda r: r["replicas"])
    yield {
      "figure": f"`sign_compression` step's program (StableHLO lines) and first step, "
      f"{lo['replicas']} against {hi['replicas']} replicas",
      "value": f"{lo['hlo_lines']:,} / {lo['first_step_s']:.1f} s against "
      f"{hi['hlo_lines']:,} / {hi['first_step_s']:.1f} s",
      "source": _where(loaded, name),
    }
  name = _DEMO_FILES[0]
  one_bit, f32 = _find(loaded, name, config="8dev-1bit"), _find(loaded, name, config="8dev-f32")
  if one_bit and f32 and one_bit.get("wire_bytes_per_step") and f32.get("wire_bytes_per_step"):
    a, b = one_bit["wire_bytes_per_step"], f32["wire_bytes_per_step"]
    yield {
      "figure": "Demo: bytes each device sends per step, `8dev-1bit` against `8dev-f32`",
      "value": f"{a:,} against {b:,} ({b / a:.0f}x fewer)",
      "source": _where(loaded, name),
    }
  name = "weight_memory-cpu.json"
  q8, f32 = (_find(loaded, name, optimizer="adam_8bit"), _find(loaded, name, optimizer="adam", weights="float32"))
  if q8 and f32:
    yield {
      "figure": "Adam state bytes per parameter: `adam_8bit` against float32 moments",
      "value": f"{q8['opt_state_per_param']:.2f} against {f32['opt_state_per_param']:.2f}",
      "source": _where(loaded, name),
    }
  name = "one_bit_text-cpu.json"
  r = _find(loaded, name, mode="one_bit_adam_rescaled_clipped", steps=200)
  if r:
    yield {
      "figure": "`one_bit_adam` (`clip_step`, `rescale_variance`) on the demo's text "
      "Transformer, 8 replicas, 200 steps: validation loss against Adam",
      "value": f"{_percent(2)(r['rel_to_float32'])}, at {r['wire_ratio']:.3f} of the bytes",
      "source": _where(loaded, name),
    }
  name = "diloco-cpu.json"
  for mode in ("diloco_h16", "diloco_h16_1bit"):
    r = _find(loaded, name, mode=mode)
    if r and r.get("rel_to_adam") is not None:
      yield {
        "figure": f"`diloco` ({'1-bit' if mode.endswith('1bit') else 'exact'} outer "
        f"updates every {r['sync_every']} steps) on the demo's text Transformer, 8 "
        f"replicas, {r['steps']} steps: validation loss against synchronous Adam",
        "value": f"{_percent(1)(r['rel_to_adam'])}, at {r['wire_ratio']:.4f} of the bytes",
        "source": _where(loaded, name),
      }
  name = "gpt-nvidia-h200.json"
  lib, floor = _find(loaded, name, variant="library"), _find(loaded, name, variant="floor")
  if lib and floor:
    yield {
      "figure": f"{lib['model']} ({lib['params'] / 1e9:.2f}B parameters, "
      f"{lib['batch']}x{lib['seq']} tokens) under `make_train_step(..., "
      '"mixed_bfloat16")`: share of the bfloat16 peak; time over a '
      "hand-written bfloat16 step",
      "value": f"{lib['fraction_of_peak']:.1%} ({lib['tflops']:.0f} TFLOP/s); {lib['vs_floor']:.3f}",
      "source": _where(loaded, name),
    }
  name = "user_models-nvidia-h200.json"
  for model in ("transformer", "resnet50"):
    auto = _find(loaded, name, model=model, variant="mixed_bfloat16")
    if auto:
      yield {
        "figure": f"Flax-style {model} declaring float32 dtypes, `make_train_step("
        'policy="mixed_bfloat16")` defaults: speed-up over float32 (TF32); '
        "time over the model wrapped by hand in `apply_policy`",
        "value": f"{auto['speedup_vs_float32']:.2f}x; {auto['vs_by_hand']:.3f}",
        "source": _where(loaded, name),
      }
  name = "fp8-nvidia-h200.json"
  for r in _rows_of(loaded, name):
    if r.get("kind") == "step" and r.get("policy") == "mixed_float8":
      yield {
        "figure": f"FP8 train step (`mixed_float8`) of `{r['task']}` over `mixed_bfloat16`; first call",
        "value": f"{r['speedup_vs_bf16']:.2f}x; {r['first_call_s']:.1f} s",
        "source": _where(loaded, name),
      }
  name = "fp8_first_call-nvidia-h200.json"
  for r in _rows_of(loaded, name):
    if r.get("xla_flags") == "--xla_gpu_enable_triton_gemm=false" and "error" not in r:
      yield {
        "figure": f"FP8 train step of `{r['task']}`, first call and step time with "
        "`xla_gpu_enable_triton_gemm=false` (`make_train_step`'s FP8 default)",
        "value": f"{r['first_call_s']:.1f} s; {r['ms_per_step']:.1f} ms",
        "source": _where(loaded, name),
      }
  name = "gpu-nvidia-h100-80gb-hbm3.json"
  bf16 = _find(loaded, name, kind="step", model="Transformer d1024", policy="mixed_bfloat16")
  tf32 = _find(loaded, name, kind="step", model="Transformer d1024", policy="float32 (default/TF32)")
  if bf16 and tf32:
    yield {
      "figure": "Train step of a d_model 1024 Transformer: `mixed_bfloat16` speed-up over float32 (TF32 matmuls)",
      "value": f"{tf32['median_ms'] / bf16['median_ms']:.2f}x "
      f"({bf16['median_ms']:.2f} ms against {tf32['median_ms']:.2f} ms)",
      "source": _where(loaded, name),
    }
  name = "activation_memory-cpu.json"
  r = next(
    (
      r
      for r in _rows_of(loaded, name)
      if r.get("remat") == "default"
      and r.get("policy") == "mixed_bfloat16"
      and str(r.get("model", "")).startswith("Transformer")
    ),
    None,
  )
  if r:
    yield {
      "figure": f"Bytes kept for the backward pass, {r['model']}, `apply_policy` under `mixed_bfloat16`, over float32",
      "value": f"{r['residual_ratio']:.3f}",
      "source": _where(loaded, name),
    }
  name = "loss_scaling-nvidia-h200.json"
  steps = [
    r for r in _rows_of(loaded, name) if r.get("part") == "step" and r.get("variant") == "jmp_train" and "run" not in r
  ]
  if not steps:
    name = "loss_scaling-nvidia-h100-80gb-hbm3.json"
    steps = [
      r
      for r in _rows_of(loaded, name)
      if r.get("part") == "step" and r.get("variant") == "jmp_train" and "run" not in r
    ]
  if steps:
    r = max(steps, key=lambda r: (r["params"], r["batch"]))
    yield {
      "figure": f"`loss_scaled(adamw)` step time over `adamw`, {r['params']:,} parameters, batch {r['batch']}",
      "value": f"{r['ratio_to_adamw']:.3f}",
      "source": _where(loaded, name),
    }
  name = "gradient_underflow-cpu.json"
  r = _find(loaded, name, weights="after 100 float32 steps", tokens_per_step=131072)
  if r:
    yield {
      "figure": "Float16 gradient's error against float32 at 131,072 tokens per step "
      "(the demo's model after 100 steps): without a loss scale, with 2^15",
      "value": f"{r['rel_err_f16']:.1%}, {r['rel_err_f16_scaled']:.1%}",
      "source": _where(loaded, name),
    }


def report(results_dir: pathlib.Path | None = None) -> str:
  """The benchmarks report: headlines, then every stored result, as Markdown.

  Made only from the JSON files under ``results_dir`` (default
  ``benchmarks/results``, subfolders included) and the benchmark modules'
  docstrings; the same files always give the same text. Each file's table
  names the machine and the date its ``machine`` records (none where it
  records none); ``--quick`` results are left out.

  Args:
    results_dir: the results folder.

  Returns:
    The page, ending in one newline.
  """
  results_dir = pathlib.Path(results_dir or RESULTS_DIR)
  loaded = _load(results_dir)
  blocks = [
    "# Benchmark results",
    f"<!-- Generated by `{REPORT_COMMAND}` from benchmarks/results/. Do not edit by hand: run the command again. -->",
    f"Generated by `{REPORT_COMMAND}` from the JSON files in `benchmarks/results/`; "
    "do not edit by hand. How the figures are taken and how to run the benchmarks: "
    "`benchmarks/README.md` in the repository. Compare figures within one table: "
    "ratios were taken within one run, and timings from different runs or machines are "
    "not comparable.",
  ]
  headlines = _demo_headline(loaded)
  others = list(_headline_rows(loaded))
  if others:
    headlines += ["### Other figures", format_table(others, ["figure", "value", "source"])]
  if headlines:
    blocks += ["## Headlines", *headlines]

  sections: dict[str, list[str]] = {}
  titles: dict[str, str] = {}
  for name, (path, payload) in loaded.items():
    folder = name.split("/")[0] if "/" in name else None
    if folder is None:
      key = payload["benchmark"]
      titles[key] = f"`{key}`"
      doc = module_facts(_HERE / f"bench_{key}.py")[0]
      sections.setdefault(key, [f"{doc}" if doc else "", f"Module: `benchmarks/bench_{key}.py`."])
      sections[key] += _benchmark_section(path, payload, results_dir)
    else:
      key = folder.split("-")[0]
      title, module = _FOLDERS.get(key, (f"`{folder}`", None))
      titles[key] = title
      doc = module_facts(module)[0] if module else ""
      sections.setdefault(key, [doc] if doc else [])
      sections[key] += _folder_file_section(path, payload, results_dir)
  if sections:
    blocks.append("Sections: " + ", ".join(f"[{titles[k]}](#{_anchor(titles[k])})" for k in sorted(sections)) + ".")
  for key in sorted(sections):
    blocks.append(f"## {titles[key]}")
    blocks += [b for b in sections[key] if b]
  if not loaded:
    blocks.append(f"(no results in {results_dir})")
  return "\n\n".join(blocks) + "\n"


def _anchor(title: str) -> str:
  """GitHub's anchor of a heading."""
  text = "".join(c for c in title.lower() if c.isalnum() or c in " -_")
  return text.replace(" ", "-")


def write_report(path: pathlib.Path | None = None, results_dir: pathlib.Path | None = None) -> pathlib.Path:
  """Writes :func:`report` to ``path`` (default ``docs/benchmarks_report.md``)."""
  path = pathlib.Path(path or REPORT_PATH)
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(report(results_dir))
  return path


def main(argv: list[str] | None = None) -> int:
  """Runs the selected benchmarks; returns the process exit status."""
  modules = discover()
  names = [m.removeprefix("bench_") for m in modules]
  parser = argparse.ArgumentParser(
    prog="python -m benchmarks", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
  )
  parser.add_argument("--quick", action="store_true", help="tiny sizes, few repeats (smoke test)")
  parser.add_argument(
    "--only", nargs="*", choices=names, metavar="NAME", help=f"run only these benchmarks (of: {', '.join(names)})"
  )
  parser.add_argument("--out", type=pathlib.Path, default=None, help="results folder (default: benchmarks/results)")
  parser.add_argument("--json", action="store_true", help="print the JSON records too")
  parser.add_argument("--list", action="store_true", help="list the benchmarks and exit")
  parser.add_argument(
    "--summary",
    action="store_true",
    help="print the stored results (of --out) as markdown, one table per file with the machine it came from, and exit",
  )
  parser.add_argument(
    "--report",
    action="store_true",
    help="write the stored results (of --out) with headline figures to docs/benchmarks_report.md and exit",
  )
  parser.add_argument("--write", action="store_true", help="with --summary: write the report, as --report does")
  parser.add_argument(
    "--cpu-devices",
    type=int,
    default=8,
    metavar="N",
    help="simulated CPU devices for the multi-device benchmarks "
    "(sets XLA_FLAGS before JAX starts; default 8; a count "
    "already in XLA_FLAGS wins)",
  )
  parser.add_argument(
    "--gpu-probe",
    action="store_true",
    help="run the GPU measurements in one process (fp8 speed, "
    "user_models, compression, gpt, fp8_first_call, loss_scaling, "
    "gpu; bench_gpt.gpu_probe), "
    "write their results and print one summary table; refuses "
    "without a GPU",
  )
  args = parser.parse_args(argv)
  if args.write and not args.summary:
    parser.error("--write goes with --summary (or use --report)")
  if args.cpu_devices < 1:
    parser.error(f"--cpu-devices must be >= 1, got {args.cpu_devices}")
  _simulate_cpu_devices(args.cpu_devices)
  if args.gpu_probe:
    from benchmarks import bench_gpt

    return bench_gpt.gpu_probe(args.out)

  if args.list:
    print("\n".join(names))
    return 0
  if args.report or (args.summary and args.write):
    print(f"(written to {write_report(results_dir=args.out)})")
    return 0
  if args.summary:
    print(summary(args.out))
    return 0

  from benchmarks import _harness

  info = _harness.machine_info()
  print(
    f"# {info['device_kind']} x{info['device_count']} ({info['backend']}), "
    f"jax {info['versions']['jax']}, {info['date']}",
    flush=True,
  )
  failed = []
  for module_name, name in zip(modules, names):
    if args.only and name not in args.only:
      continue
    print(f"\n## {name}", flush=True)
    start = time.perf_counter()
    try:
      module = importlib.import_module(f"benchmarks.{module_name}")
      records = module.run(quick=args.quick)
      if not records:
        raise RuntimeError(f"benchmark {name!r} returned no records")
    except Exception:  # Report, run the rest.
      traceback.print_exc()
      print(f"(benchmark {name!r} FAILED)", flush=True)
      failed.append(name)
      continue
    path = _harness.save_results(module.NAME + ("-quick" if args.quick else ""), records, args.out)
    if _harness.is_skipped(records):
      print(f"skipped: {records[0]['reason']}")
    else:
      print(_harness.format_table(records, getattr(module, "COLUMNS", None)))
    if args.json:
      print(json.dumps(records, indent=2, default=str))
    print(f"(written to {path} in {time.perf_counter() - start:.1f} s)", flush=True)
  if failed:
    print(f"\nFAILED: {', '.join(failed)}", file=sys.stderr, flush=True)
    return 1
  return 0


if __name__ == "__main__":
  sys.exit(main())
