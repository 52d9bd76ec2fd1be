"""docs/benchmarks_report.md is what the committed results generate.

The report is made from ``benchmarks/results`` alone (no benchmark runs):
regenerate it with ``python -m benchmarks --report`` after adding results or
changing a benchmark module's first docstring line.
"""

from __future__ import annotations

import json
import pathlib
import sys

import pytest

_ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:  # `pytest` run without `python -m`.
  sys.path.insert(0, str(_ROOT))

from benchmarks import __main__ as bench_main  # noqa: E402
from benchmarks import _report as bench_report  # noqa: E402

RESULTS = _ROOT / "benchmarks" / "results"
REPORT = _ROOT / "docs" / "benchmarks_report.md"
RESULT_FILES = sorted(p for p in RESULTS.rglob("*.json") if "-quick-" not in p.name)


@pytest.fixture(scope="module")
def report() -> str:
  return bench_report.report(RESULTS)


def test_committed_report_is_current(report):
  assert REPORT.is_file(), f"run `{bench_report.REPORT_COMMAND}` to write {REPORT}"
  assert REPORT.read_text() == report, f"{REPORT.relative_to(_ROOT)} is stale: run `{bench_report.REPORT_COMMAND}`"


def test_report_is_deterministic(report):
  assert bench_report.report(RESULTS) == report


def test_report_says_it_is_generated(report):
  head = "\n".join(report.splitlines()[:6])
  assert bench_report.REPORT_COMMAND in head and "do not edit by hand" in head.lower()


@pytest.mark.parametrize("path", RESULT_FILES, ids=lambda p: p.relative_to(RESULTS).as_posix())
def test_report_names_each_file_with_its_machine(report, path):
  payload = json.loads(path.read_text())
  name = path.relative_to(RESULTS).as_posix()
  heading = next(
    (i for i, line in enumerate(report.splitlines()) if line.startswith("### ") and f"`{name}`" in line), None
  )
  assert heading is not None, f"no section for {name}"
  machine_line = report.splitlines()[heading + 2]
  m = payload["machine"]
  assert machine_line.startswith("Machine: ")
  if m.get("device_kind"):
    assert m["device_kind"] in machine_line
  assert m["backend"] in machine_line
  jax_version = (m.get("versions") or {}).get("jax", m.get("jax"))
  assert f"jax {jax_version}" in machine_line
  if m.get("date"):
    assert m["date"] in machine_line
  else:
    assert "no date" in machine_line


def test_report_has_one_section_per_benchmark(report):
  benchmarks = {json.loads(p.read_text())["benchmark"] for p in RESULTS.glob("*.json")}
  for name in benchmarks - {n for n in benchmarks if n.endswith("-quick")}:
    assert f"\n## `{name}`\n" in report
    doc = bench_report.module_facts(_ROOT / "benchmarks" / f"bench_{name}.py")[0]
    assert doc and doc in report


def test_report_headlines(report):
  head = report.split("\n## ", 2)[1]
  assert head.startswith("Headlines")
  # The demo's gaps to their baseline, and figures computed from other files.
  assert "| 8dev-1bit " in head and "| f16 " in head
  assert head.count("\n| ") >= 8


def test_report_of_a_folder_of_its_own(tmp_path):
  records = [
    {"setup": "a", "total_per_param": 14.0, "run": "first"},
    {"setup": "b", "total_per_param": 4.5, "date": "2030-01-02T00:00:00+00:00"},
  ]
  machine = {
    "date": "2030-01-01T00:00:00+00:00",
    "backend": "cpu",
    "device_kind": "cpu",
    "device_count": 8,
    "cpu_count": 2,
    "versions": {"jax": "0.0.1"},
  }
  (tmp_path / "weight_memory-cpu.json").write_text(
    json.dumps({"benchmark": "weight_memory", "machine": machine, "records": records})
  )
  (tmp_path / "weight_memory-quick-cpu.json").write_text(
    json.dumps({"benchmark": "weight_memory-quick", "machine": machine, "records": records})
  )
  (tmp_path / "gpu-cpu.json").write_text(
    json.dumps({"benchmark": "gpu", "machine": machine, "records": [{"skipped": True, "reason": "needs a GPU"}]})
  )
  text = bench_report.report(tmp_path)
  assert text.endswith("\n") and "weight_memory-quick" not in text
  assert "Run: first." in text and "Date: 2030-01-02T00:00:00+00:00." in text
  assert "cpu x8" in text and "jax 0.0.1; 2030-01-01T00:00:00+00:00" in text
  assert "Skipped there: needs a GPU" in text
  assert "| b     | 4.5 " in text
  empty = tmp_path / "empty"
  empty.mkdir()
  assert "no results" in bench_report.report(empty)


def test_headlines_come_from_every_file_and_gpu_speed_from_gpus_only(tmp_path):
  def machine(backend, kind):
    return {"backend": backend, "device_kind": kind, "device_count": 1, "versions": {"jax": "0.0.1"}}

  step = {"part": "step", "variant": "jmp_train", "params": 10, "batch": 4}
  for tag, backend, ratio in (("cpu", "cpu", 1.5), ("gpu-a", "gpu", 1.01), ("gpu-b", "gpu", 1.02)):
    (tmp_path / f"loss_scaling-{tag}.json").write_text(
      json.dumps(
        {"benchmark": "loss_scaling", "machine": machine(backend, tag), "records": [{**step, "ratio_to_adamw": ratio}]}
      )
    )
  q8 = {"optimizer": "adam_8bit", "opt_state_per_param": 2.0}
  f32 = {"optimizer": "adam", "weights": "float32", "opt_state_per_param": 8.0}
  (tmp_path / "weight_memory-cpu.json").write_text(
    json.dumps({"benchmark": "weight_memory", "machine": machine("cpu", "cpu"), "records": [q8, f32]})
  )
  head = bench_report.report(tmp_path).split("\n## ", 2)[1]
  # One row per GPU file, none from the CPU run of a GPU speed benchmark.
  assert "| 1.010 " in head and "| 1.020 " in head and "| 1.500 " not in head
  assert "| 2.00 against 8.00 " in head
  assert head.count("loss_scaling-gpu-") == 2


def test_roofline_and_default_policy_headlines(tmp_path):
  machine = {"backend": "cpu", "device_kind": "cpu", "device_count": 1, "versions": {"jax": "0.0.1"}}
  cpu = [
    {"part": "cpu", "model": m, "policy": p, "predicted_over_measured": ratio, "ranking_matches": p == "float32"}
    for m, p, ratio in (
      ("mlp", "float32", 1.01),
      ("mlp", "mixed_bfloat16", 0.66),
      ("resnet", "float32", 0.29),
      ("resnet", "mixed_bfloat16", 0.34),
    )
  ]
  predicted = [
    {"part": "predicted", "model": "mlp", "chip": chip, "mixed_policy": "mixed_bfloat16", "mixed_ms": 0.0016}
    | {"mixed_speedup": 1.277, "fp8_speedup": speedup}
    for chip, speedup in (("H100 SXM", 0.781), ("H200", 0.79))
  ]
  default_policy = [
    {"model": m, "model_policy": v, "policy": "mixed_bfloat16", "compile_ratio": c, "step_ratio": s}
    for m, v, c, s in (
      ("transformer", "flax", 1.0, 1.0),
      ("transformer", "auto", 0.93, 0.78),
      ("resnet", "flax", 1.0, 1.0),
      ("resnet", "auto", 2.56, 1.42),
    )
  ]
  for name, records in (("roofline", cpu + predicted), ("default_policy", default_policy)):
    (tmp_path / f"{name}-cpu.json").write_text(json.dumps({"benchmark": name, "machine": machine, "records": records}))
  head = bench_report.report(tmp_path).split("\n## ", 2)[1]
  rows = [line for line in head.splitlines() if line.startswith("| ") and "-cpu.json" in line]
  assert len(rows) == 4  # the CPU check, two chips' predictions, the policies' ratios
  assert "mlp 1.01 / 0.66; resnet 0.29 / 0.34; same order: float32 yes, mixed_bfloat16 no" in head
  assert "Predicted by `roofline` on H100 SXM, not measured" in head and "on H200, not measured" in head
  assert "| mlp 1.6 µs, 1.28x, 0.78x " in head and "| mlp 1.6 µs, 1.28x, 0.79x " in head
  assert "transformer 0.93, 0.78; resnet 2.56, 1.42 (above the target: resnet)" in head
  within = [dict(r, compile_ratio=1.0, step_ratio=1.04) for r in default_policy if r["model"] == "resnet"]
  (tmp_path / "default_policy-cpu.json").write_text(
    json.dumps({"benchmark": "default_policy", "machine": machine, "records": within})
  )
  assert "resnet 1.00, 1.04 (within the target)" in bench_report.report(tmp_path)


def test_main_writes_the_report(tmp_path, monkeypatch, capsys):
  target = tmp_path / "docs" / "report.md"
  monkeypatch.setattr(bench_report, "REPORT_PATH", target)
  assert bench_main.main(["--report", "--out", str(RESULTS)]) == 0
  assert target.read_text() == bench_report.report(RESULTS)
  assert str(target) in capsys.readouterr().out
  target.unlink()
  assert bench_main.main(["--summary", "--write", "--out", str(RESULTS)]) == 0
  assert target.is_file()
