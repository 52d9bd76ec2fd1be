"""The GPU probe's planning and budget, on CPU: what it runs, what it skips, and that it stops in time.

The probe itself refuses without a GPU; here its pieces run with fake
benchmarks (``tests/helpers/probe_fakes.py``) and fake results folders.
"""

from __future__ import annotations

import json
import pathlib
import sys
import time

import jax
import pytest

_ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:  # `pytest` run without `python -m`.
  sys.path.insert(0, str(_ROOT))

from benchmarks import __main__ as bench_main  # noqa: E402
from benchmarks import _harness  # noqa: E402, F401  (a loaded source)
from benchmarks import _probe  # noqa: E402

FAKES = "tests.helpers.probe_fakes"


def _item(name, estimate_s=1.0, function="listed", kwargs=()):
  return _probe.ProbeItem(name, FAKES, function, estimate_s, kwargs)


def _write(folder: pathlib.Path, name: str, tag: str, probe: dict | None) -> pathlib.Path:
  folder.mkdir(parents=True, exist_ok=True)
  path = folder / f"{name}-{tag}.json"
  payload = {"benchmark": name, "machine": {}, "records": [{"x": 1}]}
  if probe is not None:
    payload["probe"] = probe
  path.write_text(json.dumps(payload))
  return path


@pytest.fixture
def repo(tmp_path):
  """A fake repository with two source files."""
  root = tmp_path / "repo"
  (root / "pkg").mkdir(parents=True)
  (root / "pkg" / "a.py").write_text("A = 1\n")
  (root / "pkg" / "b.py").write_text("B = 2\n")
  return root


def test_fingerprint_follows_the_sources_contents_only(repo):
  first = _probe.source_fingerprint(["pkg/a.py", "pkg/b.py"], repo)
  assert first == _probe.source_fingerprint(["pkg/b.py", "pkg/a.py", "pkg/a.py"], repo)  # order, repeats
  assert len(first) == 64
  (repo / "pkg" / "b.py").write_text("B = 3\n")
  assert _probe.source_fingerprint(["pkg/a.py", "pkg/b.py"], repo) != first
  assert _probe.source_fingerprint(["pkg/a.py", "pkg/gone.py"], repo) is None


def test_loaded_sources_are_the_repositorys_files_but_not_the_probes():
  sources = _probe.loaded_sources()
  assert "benchmarks/_harness.py" in sources and "tests/test_gpu_probe.py" in sources
  assert "benchmarks/_probe.py" not in sources and "benchmarks/__main__.py" not in sources
  assert not any("site-packages" in s or s.startswith(".") for s in sources)
  assert all((_ROOT / s).is_file() for s in sources)
  assert _probe.loaded_sources([json, _probe, jax]) == []  # stdlib, the probe, an installed package


def test_plan_runs_what_is_missing_changed_or_incomplete_and_keeps_what_is_current(repo, tmp_path):
  committed, out = tmp_path / "committed", tmp_path / "out"
  sources = ["pkg/a.py", "pkg/b.py"]
  current = {"fingerprint": _probe.source_fingerprint(sources, repo), "sources": sources, "complete": True}
  _write(committed, "kept", "nvidia-h200", current)
  _write(committed, "kept_elsewhere", "nvidia-h100", current)  # another device kind does not count
  _write(committed, "old", "nvidia-h200", None)
  _write(committed, "cut", "nvidia-h200", {**current, "complete": False})
  _write(committed, "changed", "nvidia-h200", {**current, "sources": ["pkg/a.py"]})
  _write(out, "rerun", "nvidia-h200", current)  # written by an earlier, cut-off probe into its folder
  _write(committed, "rerun", "nvidia-h200", None)
  names = ("kept", "kept_elsewhere", "old", "cut", "changed", "rerun", "new")
  items = [_item(n) for n in names]
  plan = _probe.probe_plan(items, "nvidia-h200", [out, committed], root=repo)
  assert [item.name for item, _ in plan] == list(names)  # the priority order is kept
  assert dict((item.name, why) for item, why in plan) == {
    "kept": "current",
    "kept_elsewhere": "missing",
    "old": "no fingerprint",
    "cut": "incomplete",
    "changed": "code changed",
    "rerun": "current",
    "new": "missing",
  }
  (repo / "pkg" / "a.py").write_text("A = 2\n")  # the code of "kept" changed
  assert _probe.result_status("kept", "nvidia-h200", [committed], repo) == "code changed"
  forced = _probe.probe_plan(items, "nvidia-h200", [committed], force=True, root=repo)
  assert {why for _, why in forced} == {"forced"}


def test_fits_within_the_budget():
  assert _probe.fits(100, 320, 420) and not _probe.fits(100.5, 320, 420)


def test_probe_table_is_in_priority_order_and_fits_its_budget():
  names = [item.name for item in _probe.PROBE]
  assert len(set(names)) == len(names)
  new = ["step_formats", "user_models_resnet50", "loss_scaling_kernels", "int8_gemm", "diloco_scale"]
  assert names[: len(new)] == new
  assert sum(item.estimate_s for item in _probe.PROBE[: len(new) + 1]) <= _probe.DEFAULT_BUDGET_S - 60
  for item in _probe.PROBE:
    module = __import__(f"benchmarks.{item.module}", fromlist=["_"])
    assert callable(getattr(module, item.function)), item


def _fake_runner(calls, seconds=0.0):
  def runner(item, left):
    calls.append((item.name, left))
    time.sleep(seconds)
    records = [{"case": item.name, "value": 1}]
    return _probe.ChildResult(records, ["benchmarks/_harness.py"], True, None, False, seconds)

  return runner


def test_probe_skips_current_results_and_what_would_not_fit(tmp_path, monkeypatch, capsys):
  monkeypatch.setattr(_probe, "no_gpu_reason", lambda: None)
  sources = ["benchmarks/_harness.py"]
  probe = {"fingerprint": _probe.source_fingerprint(sources), "sources": sources, "complete": True}
  _write(tmp_path, "done", "cpu", probe)
  items = [_item("done", 1), _item("big", 50), _item("small", 5), _item("small2", 5)]
  calls = []
  assert _probe.gpu_probe(tmp_path, budget_s=12, items=items, runner=_fake_runner(calls), force=False) == 0
  assert [name for name, _ in calls] == ["small", "small2"]  # "big" passed over, the later ones still run
  assert all(left <= 12 for _, left in calls)
  out = capsys.readouterr().out
  assert "current (kept)" in out and "not run (budget)" in out and "needs ~50 s" in out
  payload = json.loads((tmp_path / "small-cpu.json").read_text())
  assert payload["records"] == [{"case": "small", "value": 1}]
  assert payload["probe"] == {**probe, "seconds": 0.0}
  assert not (tmp_path / "big-cpu.json").exists()
  calls.clear()
  assert _probe.gpu_probe(tmp_path, budget_s=100, items=items, runner=_fake_runner(calls), force=True) == 0
  assert [name for name, _ in calls] == ["done", "big", "small", "small2"]


def test_child_process_is_stopped_at_the_deadline_and_its_streamed_records_kept():
  start = time.monotonic()
  result = _probe.run_child(_item("hangs", function="streamed_then_hangs"), timeout_s=2.5)
  assert time.monotonic() - start < 10
  assert result.timed_out and not result.complete and result.error is None
  assert [r["case"] for r in result.records] == ["first", "second"]
  assert "tests/helpers/probe_fakes.py" in result.sources


def test_child_process_reports_records_errors_and_arguments():
  ok = _probe.run_child(_item("ok", kwargs=(("value", 7),)), timeout_s=60)
  assert ok.complete and not ok.timed_out and ok.error is None
  assert ok.records == [{"case": "listed", "value": 7}]
  bad = _probe.run_child(_item("bad", function="streamed_then_fails"), timeout_s=60)
  assert not bad.complete and "broken on purpose" in bad.error
  assert [r["case"] for r in bad.records] == ["first"]


def test_probe_writes_a_cut_off_benchmarks_partial_records_as_incomplete(tmp_path, monkeypatch, capsys):
  monkeypatch.setattr(_probe, "no_gpu_reason", lambda: None)
  items = [_item("hangs", 1, "streamed_then_hangs"), _item("late", 100)]
  start = time.monotonic()
  assert _probe.gpu_probe(tmp_path, budget_s=2.5, items=items, force=False) == 1
  assert time.monotonic() - start < 10
  payload = json.loads((tmp_path / "hangs-cpu.json").read_text())
  assert [r["case"] for r in payload["records"]] == ["first", "second"]
  assert payload["probe"]["complete"] is False
  assert _probe.result_status("hangs", "cpu", [tmp_path]) == "incomplete"
  out = capsys.readouterr().out
  assert "cut (budget)" in out and "not run (budget)" in out


def test_gpu_probe_refuses_without_gpu(capsys):
  assert jax.default_backend() != "gpu"
  assert bench_main.main(["--gpu-probe"]) == 2
  err = capsys.readouterr().err
  assert "--gpu-probe needs a GPU" in err and "'cpu'" in err


def test_all_goes_with_the_probe(capsys):
  with pytest.raises(SystemExit):
    bench_main.main(["--all"])
  assert "--all goes with --gpu-probe" in capsys.readouterr().err


# An optimized GPU HLO's lines, as XLA:GPU writes them (abridged).
_GPU_HLO = "\n".join(
  (
    "%cublas-gemm.1 = (s32[64,64]{1,0}, s8[0]{0}) custom-call(s8[64,64]{1,0} %p0, s8[64,64]{1,0} %p1), "
    'custom_call_target="__cublas$gemm"',
    "%conv.2 = (f32[8,64,56,56]{3,2,1,0}, u8[0]{0}) custom-call(f32[8,64,56,56]{3,2,1,0} %a), "
    'custom_call_target="__cudnn$convForward"',
    "%gemm_fusion = bf16[64,64]{1,0} fusion(bf16[64,64]{1,0} %x), kind=kCustom, "
    'backend_config={"fusion_backend_config":{"kind":"__triton_gemm"}}',
    "%transpose.3 = f32[64,8]{1,0} transpose(f32[8,64]{1,0} %y), dimensions={1,0}",
  )
)


def test_compiled_kernels_name_the_gemm_calls_and_triton_fusions():
  from benchmarks.bench_int8_gemm import compiled_kernels

  assert compiled_kernels(_GPU_HLO) == {"kernels": ["__cublas$gemm", "__cudnn$convForward"], "triton_fusions": 1}


def test_compiled_profile_counts_custom_calls_by_result_dtype_and_layout_ops():
  from benchmarks.bench_user_models import compiled_profile

  profile = compiled_profile(_GPU_HLO)
  assert profile["custom_calls"] == {"__cublas$gemm": 1, "__cudnn$convForward": 1}
  assert profile["custom_call_dtypes"] == {"__cublas$gemm s32": 1, "__cudnn$convForward f32": 1}
  assert (profile["transpose"], profile["fusion"], profile["copy"]) == (1, 1, 0)
