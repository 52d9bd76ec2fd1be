"""The benchmark suite keeps working: every benchmark runs once, tiny.

Benchmarks are not tests (their figures are not asserted here); this file
runs each ``benchmarks/bench_*.py`` (discovered, so new ones are covered)
through the real entry point with ``--quick`` and checks the JSON it
writes, and tests the harness and the pieces of the benchmarks that compute
something (residual classification, peak table, the GPU code path on CPU).
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import importlib
import io
import json
import os
import pathlib
import platform
import re
import subprocess
import sys
import types

import jax
import jax.numpy as jnp
import pytest

_ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:  # `pytest` run without `python -m`.
  sys.path.insert(0, str(_ROOT))

from benchmarks import __main__ as bench_main  # noqa: E402
from benchmarks import _report as bench_report  # noqa: E402
from benchmarks import _harness  # noqa: E402
from jmp_train import get_policy  # noqa: E402

BENCHMARKS = [m.removeprefix("bench_") for m in bench_main.discover()]
MACHINE_KEYS = {
  "date",
  "platform",
  "processor",
  "cpu_count",
  "python",
  "backend",
  "device_kind",
  "device_count",
  "device_memory_bytes",
  "xla_flags",
  "versions",
}


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
  """Runs a benchmark once (``--quick``) per module; returns its output."""
  cache: dict[str, tuple[int, str, dict | None]] = {}

  def get(name: str) -> tuple[int, str, dict | None]:
    if name not in cache:
      out_dir = tmp_path_factory.mktemp(f"bench_{name}")
      buf_out, buf_err = io.StringIO(), io.StringIO()
      with contextlib.redirect_stdout(buf_out), contextlib.redirect_stderr(buf_err):
        rc = bench_main.main(["--quick", "--only", name, "--out", str(out_dir)])
      files = sorted(out_dir.glob("*.json"))
      payload = json.loads(files[0].read_text()) if len(files) == 1 else None
      cache[name] = (rc, buf_out.getvalue() + buf_err.getvalue(), payload)
    return cache[name]

  return get


def test_discover_finds_every_bench_file():
  files = sorted(p.stem for p in (_ROOT / "benchmarks").glob("bench_*.py"))
  assert bench_main.discover() == files
  assert "activation_memory" in BENCHMARKS and "gpu" in BENCHMARKS


def test_every_benchmark_has_a_row_in_the_benchmarks_readme():
  readme = (_ROOT / "benchmarks" / "README.md").read_text()
  missing = [name for name in BENCHMARKS if f"\n| `{name}` |" not in readme]
  assert not missing, f"benchmarks/README.md's table lacks {missing}"


@pytest.mark.parametrize("name", BENCHMARKS)
def test_benchmark_runs_quick(name, quick_run):
  rc, output, payload = quick_run(name)
  assert rc == 0, output[-4000:]
  module = importlib.import_module(f"benchmarks.bench_{name}")
  assert f"## {name}" in output
  assert payload is not None, f"expected one JSON file; output:\n{output[-2000:]}"
  assert payload["benchmark"] == f"{module.NAME}-quick"

  machine = payload["machine"]
  assert MACHINE_KEYS <= machine.keys()
  assert machine["backend"] == jax.default_backend()
  assert machine["device_count"] == jax.device_count()
  assert machine["versions"]["jax"] == jax.__version__
  assert datetime.datetime.fromisoformat(machine["date"]).tzinfo is not None

  records = payload["records"]
  assert isinstance(records, list) and records
  assert all(isinstance(r, dict) and r for r in records)
  if _harness.is_skipped(records):
    assert isinstance(records[0]["reason"], str) and records[0]["reason"]
    assert f"skipped: {records[0]['reason']}" in output
    return
  columns = list(getattr(module, "COLUMNS", None) or records[0])
  # The first column names the row, so every record has it; every other
  # column is in some record (a benchmark in parts leaves the other part's
  # cells empty). Values may be None or NaN: "not applicable" and
  # "diverged" are results too.
  for record in records:
    assert columns[0] in record, f"record lacks {columns[0]!r}: {record}"
  present = set().union(*(r.keys() for r in records))
  assert not set(columns) - present, f"columns in no record: {sorted(set(columns) - present)}"
  header = "| " + " | ".join(columns)
  assert any(line.replace(" ", "").startswith(header.replace(" ", "")) for line in output.splitlines()), output[-2000:]
  # What a benchmark's quick records show, checked here rather than in a
  # test of its own (under pytest-xdist that could run the benchmark again).
  _QUICK_RECORD_CHECKS.get(name, lambda records: None)(records)


def _check_multiprocess_records(records):
  # The code path of several hosts (launch, workers, timing, bytes): 2
  # processes on the loopback as is, a one-layer model (two leaves).
  by = {r["scheme"]: r for r in records}
  assert set(by) == {"float32", "bfloat16", "1bit_l1"}
  assert all(r["processes"] == 2 and r["step_ms"] > 0 for r in records)
  assert all(r["cap"] is None and r["link"] == "loopback" for r in records)
  assert by["float32"]["vs_float32"] == 1.0
  assert by["bfloat16"]["wire_vs_float32"] == pytest.approx(0.5, abs=0.01)
  assert by["1bit_l1"]["wire_vs_float32"] < 0.1
  # --quick pins process i to core i mod cores (where it can): process 0 to the first.
  if hasattr(os, "sched_setaffinity"):
    first = min(os.sched_getaffinity(0))
    assert all(r["pinned"] and r["cores"] == [first] for r in records)
  # ... and keeps freed memory where glibc's malloc is the one to tell.
  glibc = platform.libc_ver()[0] == "glibc"
  assert all(r["keep_freed"] is glibc for r in records)


def _check_activation_memory_records(records):
  models = {r["model"] for r in records}
  assert len(models) == 3
  # models x (3 policies for "none" and "dots", 2 mixed ones for "default"
  # and "half")
  assert len(records) == 3 * (3 + 3 + 2 + 2)
  by_key = {(r["model"], r["remat"], r["policy"]): r for r in records}
  for r in records:
    assert r["residual_bytes"] > 0
    if r["policy"] == "float32":
      assert r["residual_ratio"] == 1.0 and r["meets_target"] is None
      assert r["half_residual_share"] == 0.0 and r["cast_copy_bytes"] == 0
    elif r["remat"] in ("default", "half"):
      # No weight copies (recomputed from the float32 weights), and less
      # than the same policy saves by default (tests/test_remat.py checks
      # that the model's residuals are all half precision).
      default = by_key[(r["model"], "none", r["policy"])]
      assert r["cast_copy_bytes"] == 0, r
      assert r["residual_bytes"] < default["residual_bytes"]
      base = by_key[(r["model"], "none", "float32")]
      assert r["residual_ratio"] == r["residual_bytes"] / base["residual_bytes"]
      assert r["meets_target"] == (r["residual_ratio"] <= 0.55)
    else:
      # Normalization layers keep float32 residuals: never all half.
      assert 0.0 < r["half_residual_share"] < 1.0
      assert r["meets_target"] == (r["residual_ratio"] <= 0.55)
    if r["remat"] == "dots" and r["policy"] != "float32":
      # Only matmul/conv outputs saved, in half precision: about half.
      assert 0.45 < r["residual_ratio"] < 0.6, r
      assert r["half_residual_share"] > 0.7, r
  # The quick run compiles only the first model's plain step.
  compiled = [r for r in records if r["temp_bytes"] is not None]
  assert {r["model"] for r in compiled} == {records[0]["model"]}
  assert all(r["remat"] == "none" and r["argument_bytes"] > 0 for r in compiled)


def _check_compression_records(records):
  # Every 1-bit scale's update and every wire's quantize + dequantize is
  # timed against the copy.
  by = {r["scheme"]: r for r in records if r["part"] == "throughput"}
  assert by["elementwise_x_plus_1"]["vs_copy"] == 1.0
  names = [f"1bit_{scale}" for scale in ("column", "l1", "l2")]
  names += [f"{wire}_quantize_dequantize" for wire in ("bfloat16", "float8_e4m3")]
  assert sorted(by) == sorted(names + ["elementwise_x_plus_1"])
  for name in names:
    assert by[name]["seconds"] > 0 and by[name]["vs_copy"] > 0, by[name]


def _check_roofline_records(records):
  cpu = [r for r in records if r["part"] == "cpu"]
  predicted = [r for r in records if r["part"] == "predicted"]
  assert len(cpu) + len(predicted) == len(records)
  # Both policies of both models, predicted (the CPU's measured peaks) and measured.
  assert {(r["model"], r["policy"]) for r in cpu} == {
    (m, p) for m in ("mlp", "mlp_wide") for p in ("float32", _mixed_policy())
  }
  for r in cpu:
    assert r["predicted_ms"] > 0 and r["measured_ms"] > 0 and r["chip"] == "cpu"
    assert r["predicted_over_measured"] == pytest.approx(r["predicted_ms"] / r["measured_ms"])
  for policy in {r["policy"] for r in cpu}:
    rows = {r["model"]: r for r in cpu if r["policy"] == policy}
    # The wider MLP on 8x the batch does more work: predicted slower.
    assert rows["mlp"]["rank_predicted"] == 1 and rows["mlp_wide"]["rank_predicted"] == 2
    assert sorted(r["rank_measured"] for r in rows.values()) == [1, 2]
    same = all(r["rank_predicted"] == r["rank_measured"] for r in rows.values())
    assert all(r["ranking_matches"] is same for r in rows.values())
  # The GPU figures are predictions, and say so: one chip in the quick run.
  assert {(r["model"], r["chip"]) for r in predicted} == {("mlp", "H100 SXM"), ("mlp_wide", "H100 SXM")}
  for r in predicted:
    assert r["source"] == "predicted only" and "measured_ms" not in r
    assert r["float32_ms"] > 0 and r["mixed_ms"] > 0 and r["mixed_speedup"] > 0 and r["fp8_speedup"] > 0
    assert r["verdict"]


def _mixed_policy():
  from jmp_train import half_dtype

  return "mixed_float16" if half_dtype() == jnp.float16 else "mixed_bfloat16"


def _check_default_policy_records(records):
  by = {r["model_policy"]: r for r in records}
  assert [r["model"] for r in records] == ["mlp", "mlp"] and set(by) == {"flax", "auto"}
  assert by["flax"]["compile_ratio"] == by["flax"]["step_ratio"] == 1.0
  for r in records:
    assert r["compile_ms"] > 0 and r["median_ms"] > 0
  assert by["auto"]["step_ratio"] == pytest.approx(by["auto"]["median_ms"] / by["flax"]["median_ms"])


_QUICK_RECORD_CHECKS = {
  "activation_memory": _check_activation_memory_records,
  "compression": _check_compression_records,
  "default_policy": _check_default_policy_records,
  "multiprocess": _check_multiprocess_records,
  "roofline": _check_roofline_records,
}


# --------------------------------------------------------------------------
# The entry point.
# --------------------------------------------------------------------------


def test_roofline_ranks_by_time():
  from benchmarks.bench_roofline import ranks

  assert ranks({"a": 2.0, "b": 1.0, "c": 3.0}) == {"a": 2, "b": 1, "c": 3}
  assert ranks({"x": 1.0, "y": 1.0}) == {"x": 1, "y": 2}  # ties: the order given


def test_compression_call_passes_a_donated_output_on():
  from benchmarks import bench_compression

  seen = []

  def fn(g, r):
    seen.append(r)
    return g, g, r + 1

  call = bench_compression._Call(fn, (10, 0), carry=(1, 2))
  for _ in range(3):
    call()
  assert seen == [0, 1, 2]
  plain = bench_compression._Call(fn, (10, 0))
  plain(), plain()
  assert seen[-2:] == [0, 0]


def test_main_lists_benchmarks(capsys):
  assert bench_main.main(["--list"]) == 0
  assert capsys.readouterr().out.split() == BENCHMARKS


def test_main_sets_the_simulated_devices_before_jax_starts():
  # `python -m benchmarks` must not import JAX before --cpu-devices takes
  # effect: the multi-device benchmarks would find one device.
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  code = (
    "import sys; import benchmarks.__main__ as m; assert 'jax' not in sys.modules, 'jax imported early'; "
    "m._simulate_cpu_devices(3); import jax; print(jax.device_count())"
  )
  out = subprocess.run([sys.executable, "-c", code], env=env, cwd=_ROOT, capture_output=True, text=True)
  assert out.returncode == 0, out.stderr[-2000:]
  assert out.stdout.split()[-1] == "3"


def test_summary_renders_stored_results_and_skips_quick_ones(tmp_path, capsys):
  from benchmarks import _harness

  _harness.save_results("weight_memory", [{"setup": "a", "total_per_param": 14.0}], tmp_path)
  _harness.save_results("weight_memory-quick", [{"setup": "q", "total_per_param": 1.0}], tmp_path)
  assert bench_main.main(["--summary", "--out", str(tmp_path)]) == 0
  out = capsys.readouterr().out
  assert out.startswith("#### weight_memory\n")
  assert "| a " in out and "| q " not in out
  assert "jax " + jax.__version__ in out
  empty = tmp_path / "empty"
  empty.mkdir()
  assert "no results" in bench_report.summary(empty)
  # Records labelled by the run that made them show the label.
  _harness.save_results(
    "weight_memory",
    [{"setup": "a", "total_per_param": 14.0}, {"setup": "a", "total_per_param": 15.0, "run": "old"}],
    empty,
  )
  table = bench_report.summary(empty)
  assert "| run" in table.splitlines()[4] and "| old" in table


def test_main_rejects_unknown_benchmark(capsys):
  with pytest.raises(SystemExit):
    bench_main.main(["--only", "no_such_benchmark"])
  assert "no_such_benchmark" in capsys.readouterr().err


def test_main_reports_a_failing_benchmark_and_runs_the_rest(monkeypatch, tmp_path, capsys):
  def failing_run(quick):
    raise RuntimeError("boom in the benchmark")

  fake = {
    "bench_zz_fails": types.SimpleNamespace(NAME="zz_fails", run=failing_run),
    "bench_zz_works": types.SimpleNamespace(NAME="zz_works", COLUMNS=("a",), run=lambda quick: [{"a": 1.5, "b": None}]),
  }
  for module_name, module in fake.items():
    monkeypatch.setitem(sys.modules, f"benchmarks.{module_name}", module)
  monkeypatch.setattr(bench_main, "discover", lambda: sorted(fake))
  rc = bench_main.main(["--quick", "--out", str(tmp_path)])
  out = capsys.readouterr()
  assert rc == 1
  assert "boom in the benchmark" in out.err and "FAILED: zz_fails" in out.err
  assert [p.name for p in tmp_path.glob("*.json")] == [f"zz_works-quick-{_harness.device_tag()}.json"]
  assert "| 1.5 |" in out.out


# --------------------------------------------------------------------------
# The harness.
# --------------------------------------------------------------------------


def test_median_seconds_calls_warmup_plus_repeats():
  calls = []
  t = _harness.median_seconds(lambda x: calls.append(x) or jnp.ones(2), 7, warmup=2, repeats=5)
  assert calls == [7] * 7
  assert t >= 0.0


def test_interleaved_median_seconds_round_robin():
  order = []
  fns = {k: (lambda k=k: order.append(k)) for k in "abc"}
  times = _harness.interleaved_median_seconds(fns, warmup=1, repeats=4)
  assert set(times) == set("abc") and all(t >= 0.0 for t in times.values())
  # Warm-up in order, then each round starts one candidate later.
  assert "".join(order) == "abc" + "abc" + "bca" + "cab" + "abc"
  every = _harness.interleaved_seconds(fns, warmup=0, repeats=2)
  assert {k: len(v) for k, v in every.items()} == {"a": 2, "b": 2, "c": 2}


@pytest.mark.parametrize("warmup,repeats", [(-1, 3), (0, 0)])
def test_timing_rejects_bad_counts(warmup, repeats):
  with pytest.raises(ValueError, match="warmup|repeats"):
    _harness.median_seconds(lambda: None, warmup=warmup, repeats=repeats)
  with pytest.raises(ValueError, match="warmup|repeats"):
    _harness.interleaved_median_seconds({"f": lambda: None}, warmup=warmup, repeats=repeats)


def test_format_table():
  table = _harness.format_table(
    [{"name": "x", "v": 1.234567, "ok": True, "n": None}, {"name": "longer", "v": 2.0, "ok": False}],
    ["name", "v", "ok", "n"],
  )
  lines = table.splitlines()
  assert lines[0].split("|")[1:-1] == [" name   ", " v     ", " ok  ", " n "]
  assert lines[2] == "| x      | 1.235 | yes | - |"
  assert lines[3] == "| longer | 2     | no  |   |"
  assert _harness.format_table([]) == "(no rows)"


def test_tree_bytes_and_compiled_analysis():
  tree = {"a": jnp.ones((3, 4), jnp.bfloat16), "b": jax.ShapeDtypeStruct((5,), jnp.float32), "c": None}
  assert _harness.tree_bytes(tree) == 3 * 4 * 2 + 5 * 4
  n = 8
  compiled = jax.jit(lambda a, b: a @ b).lower(jnp.ones((n, n)), jnp.ones((n, n))).compile()
  memory = _harness.compiled_memory(compiled)
  assert memory["argument_bytes"] == 2 * n * n * 4
  assert memory["output_bytes"] == n * n * 4
  assert _harness.compiled_flops(compiled) == 2 * n**3


def test_roofline_prediction_of_a_step_and_where_there_is_none():
  import optax

  from jmp_train import make_train_step

  step = make_train_step(lambda v, x: x @ v["params"]["w"], lambda y, t: jnp.mean((y - t) ** 2), optax.sgd(0.1))
  state = step.init({"w": jnp.ones((64, 64))})
  batch = (jnp.ones((32, 64)), jnp.zeros((32, 64)))
  found = _harness.roofline_prediction(step, state, batch)
  assert found["roofline_chip"] == "cpu" and found["roofline_ms"] > 0 and "roofline_error" not in found
  assert _harness.with_measured(found, 2 * found["roofline_ms"])["roofline_over_measured"] == pytest.approx(0.5)
  # A device the chip table lacks: no prediction, and the reason, the measured figures untouched.
  unknown = _harness.roofline_prediction(step, state, batch, device=types.SimpleNamespace(device_kind="Mystery X1"))
  assert unknown["roofline_chip"] is None and unknown["roofline_ms"] is None
  assert unknown["roofline_error"].startswith("ValueError: Unknown chip 'Mystery X1'")
  assert _harness.with_measured(unknown, 3.0) == {**unknown, "roofline_over_measured": None}


def test_quick_compile_options_on_cpu_only_in_a_quick_run():
  # A full run compiles with the defaults; --quick (here, on CPU) with XLA's
  # quickest options, a copy each time, the same values. Its workers get them
  # as XLA_FLAGS (the multiprocess quick run starts processes with them).
  assert _harness.compile_options(False) is None
  options = _harness.compile_options(True)
  assert options == _harness.QUICK_COMPILE and options is not _harness.compile_options(True)
  assert "--xla_cpu_use_fusion_emitters=false" in _harness.QUICK_XLA_FLAGS.split()
  f = lambda x: jnp.tanh(x) @ x.T
  x = jnp.arange(12.0).reshape(3, 4) / 10
  assert jnp.allclose(jax.jit(f, compiler_options=options)(x), jax.jit(f)(x), rtol=1e-6)


def test_skipped_records():
  records = _harness.skipped("no GPU here")
  assert _harness.is_skipped(records) and records[0]["reason"] == "no GPU here"
  assert not _harness.is_skipped([{"skipped": True}, {"skipped": True}])
  assert not _harness.is_skipped([{"a": 1}])


def test_env_int_reads_a_positive_integer(monkeypatch):
  monkeypatch.delenv("BENCH_STEPS", raising=False)
  assert _harness.env_int("BENCH_STEPS", 200) == 200
  monkeypatch.setenv("BENCH_STEPS", "1000")
  assert _harness.env_int("BENCH_STEPS", 200) == 1000
  for bad in ("0", "-5", "1e3", "ten"):
    monkeypatch.setenv("BENCH_STEPS", bad)
    with pytest.raises(ValueError, match=rf"BENCH_STEPS must be a positive integer, got '{bad}'"):
      _harness.env_int("BENCH_STEPS", 200)


def test_time_to_loss_interpolates_between_evaluations():
  from benchmarks.bench_time_to_loss import _records, time_to_target

  trajectory = [(0.0, 5.0), (1.0, 4.0), (3.0, 2.0), (4.0, 2.5)]
  assert time_to_target(trajectory, 3.0) == pytest.approx(2.0)
  assert time_to_target(trajectory, 4.0) == pytest.approx(1.0)
  assert time_to_target(trajectory, 6.0) == 0.0
  assert time_to_target(trajectory, 1.5) is None
  rows = [
    {"mode": "adam_float32", "val_loss": 2.0, "trajectory": [(0.0, 5.0), (2.0, 3.0), (4.0, 2.0)]},
    {"mode": "diloco_h16_1bit", "val_loss": 3.0, "trajectory": [(0.0, 5.0), (0.5, 4.0), (1.0, 3.0)]},
  ]
  adam, local = _records({"link": "loopback"}, rows)
  assert adam["target"] == local["target"] == 3.0  # the loss every row reaches
  assert adam["time_to_target_s"] == pytest.approx(2.0) and local["time_to_target_s"] == pytest.approx(1.0)
  assert local["vs_adam"] == pytest.approx(0.5) and adam["link"] == "loopback"


def test_time_to_loss_trains_at_the_widths_tuned_learning_rate(monkeypatch):
  from benchmarks import bench_time_to_loss as bench
  from benchmarks.bench_diloco import PEAK_LR

  launched, row = [], {"mode": "adam_float32", "val_loss": 2.0, "trajectory": [(0.0, 3.0), (1.0, 2.0)]}
  monkeypatch.setattr(bench, "launch", lambda *args, **kwargs: launched.append(args) or [dict(row)])
  monkeypatch.setenv("BENCH_TIME_TO_LOSS_LINKS", "none")
  for width in (64, 256):
    monkeypatch.setenv("BENCH_TIME_TO_LOSS_WIDTH", str(width))
    bench.run(quick=False)
    assert [args[3:] for args in launched[-3:]] == [(width, PEAK_LR[width], seed) for seed in range(3)]
  assert PEAK_LR[64] != PEAK_LR[256]  # each width its own sweep's best
  monkeypatch.setenv("BENCH_TIME_TO_LOSS_WIDTH", "128")
  with pytest.raises(
    ValueError, match=r"BENCH_TIME_TO_LOSS_WIDTH=128 has no tuned learning rate; use one of \[64, 256\]"
  ):
    bench.run(quick=False)


def test_selected_rows_follow_the_environment(monkeypatch):
  rows = [
    ("adam", "adam_float32", 1),
    ("adam", "one_bit_adam", 2),
    ("sgdm", "sgdm_float32", 3),
    ("sgdm", "one_bit_momentum", 4),
  ]
  monkeypatch.delenv("BENCH_ROWS", raising=False)
  assert _harness.selected_rows(rows, "BENCH_ROWS") == rows
  monkeypatch.setenv("BENCH_ROWS", "adam_float32,one_bit_adam")
  assert _harness.selected_rows(rows, "BENCH_ROWS") == rows[:2]
  monkeypatch.setenv("BENCH_ROWS", "adam_float32,one_bit_adma")
  with pytest.raises(ValueError, match=r"unknown rows \['one_bit_adma'\]; valid: .*one_bit_adam"):
    _harness.selected_rows(rows, "BENCH_ROWS")
  # A row without its reference would have no relative column.
  monkeypatch.setenv("BENCH_ROWS", "adam_float32,one_bit_momentum")
  with pytest.raises(ValueError, match=r"float32 row of \['sgdm'\]"):
    _harness.selected_rows(rows, "BENCH_ROWS")


def test_multiprocess_names_from_the_environment(monkeypatch):
  from benchmarks import bench_multiprocess as bench

  names = bench._env_names
  monkeypatch.delenv("BENCH_MULTIPROCESS_SIZES", raising=False)
  assert names("BENCH_MULTIPROCESS_SIZES", ("1M", "8M"), tuple(bench.SIZES)) == ("1M", "8M")
  monkeypatch.setenv("BENCH_MULTIPROCESS_SIZES", "8M,32M")
  assert names("BENCH_MULTIPROCESS_SIZES", ("1M",), tuple(bench.SIZES)) == ("8M", "32M")
  for bad, shown in (("8M,16M", r"\['16M'\]"), (",", "empty list")):
    monkeypatch.setenv("BENCH_MULTIPROCESS_SIZES", bad)
    with pytest.raises(
      ValueError,
      match=rf"BENCH_MULTIPROCESS_SIZES='{bad}': unknown {shown}; "
      r"valid: tiny, 1M, 8M, 32M\.",
    ):
      names("BENCH_MULTIPROCESS_SIZES", ("1M",), tuple(bench.SIZES))


def test_one_bit_optimizers_rejects_a_warmup_of_the_whole_run(monkeypatch):
  from benchmarks import bench_one_bit_optimizers as bench

  monkeypatch.setenv("BENCH_ONE_BIT_OPTIMIZERS_WARMUP", "100")
  with pytest.raises(ValueError, match="BENCH_ONE_BIT_OPTIMIZERS_WARMUP must be below 100"):
    bench.run(quick=False)


@pytest.mark.parametrize(
  "value, seeds", [("", (0, 1, 2)), ("5", (0, 1, 2, 3, 4)), ("3-6", (3, 4, 5, 6)), (" 2-2 ", (2,))]
)
def test_one_bit_optimizers_seeds_from_the_environment(value, seeds):
  from benchmarks import bench_one_bit_optimizers as bench

  assert bench._seeds(value) == seeds


@pytest.mark.parametrize("value", ["0", "4-3", "a", "1,2", "-2"])
def test_one_bit_optimizers_rejects_bad_seeds(value):
  from benchmarks import bench_one_bit_optimizers as bench

  with pytest.raises(ValueError, match="BENCH_ONE_BIT_OPTIMIZERS_SEEDS must be a count"):
    bench._seeds(value)


def test_one_bit_wire_ratio_counts_every_step_but_the_exact_branch():
  # The warm-up branch's float all-reduce is left out; an all-reduce that
  # runs on every step (rescale_variance's one float per tensor) is not.
  from benchmarks import bench_one_bit_optimizers as bench
  from jmp_train import one_bit_adam

  params = {"b": jnp.zeros((256,)), "w": jnp.zeros((64, 256))}
  make = lambda **kw: one_bit_adam(1e-3, axis_name=bench.AXIS, warmup_steps=2, **{"rescale_variance": False, **kw})
  # 4 replicas (the benchmark uses 8): the ring's factor 2 * (K - 1) / K is
  # not 1, and each compile is cheaper than with 8 (and quicker with --quick's options).
  ratio = lambda tx: bench.wire_ratio(tx, params, 4, _harness.QUICK_COMPILE)
  plain, rescaled = ratio(make()), ratio(make(rescale_variance=True))
  n = 64 * 256 + 256
  assert 1 / 32 < plain < 1 / 28
  # Two float32 scalars in a ring all-reduce: 2 * (K - 1) / K * 8 bytes.
  assert rescaled - plain == pytest.approx(8 / (4 * n), rel=1e-6)


# --------------------------------------------------------------------------
# Activation memory: residual classification (its quick records are checked
# above, in test_benchmark_runs_quick).
# --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def activation_memory():
  return importlib.import_module("benchmarks.bench_activation_memory")


def test_activation_memory_rejects_unknown_remat(activation_memory):
  case = activation_memory._cases(quick=True)[0]
  with pytest.raises(ValueError, match="'everything'.*none, dots, half"):
    activation_memory.measure(case, get_policy("float32"), "everything")


# --------------------------------------------------------------------------
# GPU benchmark: the peak table, and its code path run on CPU.
# --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gpu_bench():
  return importlib.import_module("benchmarks.bench_gpu")


@pytest.mark.parametrize(
  "kind,mode,peak",
  [
    ("NVIDIA H100 80GB HBM3", "bf16", 989.4),
    ("NVIDIA H100 PCIe", "fp16", 756.0),
    ("NVIDIA H200", "bf16", 989.4),
    ("NVIDIA A100-SXM4-80GB", "bf16", 312.0),
    ("NVIDIA A100-SXM4-40GB", "fp32", 19.5),
    ("Tesla V100-SXM2-16GB", "bf16", None),
    ("NVIDIA L4", "fp16", 121.0),
    ("NVIDIA L40S", "bf16", None),
    ("cpu", "bf16", None),
  ],
)
def test_peak_tflops(gpu_bench, kind, mode, peak):
  assert gpu_bench.peak_tflops(kind, mode) == peak


def test_peak_tflops_rejects_unknown_mode(gpu_bench):
  with pytest.raises(ValueError, match="'int8'.*fp32, tf32, bf16, fp16"):
    gpu_bench.peak_tflops("NVIDIA H100 80GB HBM3", "int8")


def test_gpu_benchmark_skips_without_gpu(gpu_bench):
  if jax.default_backend() == "gpu":
    pytest.fail("this test suite runs on simulated CPU devices")
  records = gpu_bench.run(quick=True)
  assert _harness.is_skipped(records)
  assert "GPU" in records[0]["reason"] and "'cpu'" in records[0]["reason"]


def test_gpu_benchmark_code_path_on_cpu(gpu_bench):
  setups = ("float32 (highest)", "mixed_float16")
  rows = gpu_bench.measure(True, models=("mlp",), setups=setups)
  steps = [r for r in rows if r["kind"] == "step"]
  matmuls = [r for r in rows if r["kind"] == "matmul"]
  assert [r["policy"] for r in steps] == list(setups)
  assert steps[0]["speedup"] == 1.0
  for r in steps:
    assert r["median_ms"] > 0 and r["items_per_s"] > 0 and r["tflops"] > 0
    # The roofline's prediction of the same step on the detected chip (here the CPU's measured peaks).
    assert r["roofline_chip"] == "cpu" and r["roofline_ms"] > 0 and "roofline_error" not in r
    assert r["roofline_over_measured"] == pytest.approx(r["roofline_ms"] / r["median_ms"])
  assert [r["policy"] for r in matmuls] == ["float32 (highest)", "float32 (default/TF32)", "bfloat16", "float16"]
  for r in matmuls:
    assert r["tflops"] > 0
    assert r["peak_tflops"] is None and r["peak_source"] == "unknown"
    assert r["fraction_of_peak"] is None
  assert all(r["device_kind"] == jax.devices()[0].device_kind for r in rows)
  with pytest.raises(ValueError, match="'resnet'"):
    gpu_bench.measure(True, models=("resnet",))


# --------------------------------------------------------------------------
# The demo's step-time study (run by hand on a GPU; here tiny, on CPU).
# --------------------------------------------------------------------------


def test_demo_step_time_isolated_and_profiled(tmp_path, capsys, monkeypatch):
  from benchmarks import demo_step_time

  # Both runs below use one configuration and size: build and compile its
  # step once (the step donates its state: each run gets a fresh copy).
  built = functools.cache(demo_step_time._compiled_step)

  def compiled_step(name, s):
    task, step, state, compiled = built(name, s)
    return task, step, jax.tree.map(jnp.copy, state), compiled

  monkeypatch.setattr(demo_step_time, "_compiled_step", compiled_step)
  s = demo_step_time.settings(small=True, steps=4)
  r = demo_step_time.isolated_times("f16", steps=4, repeats=2, s=s, profile_dir=tmp_path)
  assert r["early_ms"] > 0 and r["late_ms"] > 0 and r["loss"] > 0
  # Every kernel of both traces, the largest growth first, none negative.
  growth = [late - early for _, early, late in r["kernels"]]
  assert growth and growth == sorted(growth, reverse=True)
  assert all(e >= 0 and t >= 0 for _, e, t in r["kernels"])
  assert sum(demo_step_time.kernel_times(tmp_path / "late").values()) == sum(t for _, _, t in r["kernels"])
  demo_step_time.main(["f16", "4", "2", "--small"])
  assert re.match(r"f16: ms/step per window: \d+ \d+; loss \d", capsys.readouterr().out)
  with pytest.raises(SystemExit):
    demo_step_time.main(["f16", "0", "--small"])
  assert "steps must be a positive integer, got 0" in capsys.readouterr().err
