"""The GPU probe: ``python -m benchmarks --gpu-probe`` (``make gpu-probe``).

Runs the GPU measurements of :data:`PROBE`, most wanted first, each in its
own process, and writes each one's results file
(``<name>-<device>.json``) as soon as that process ends. Three rules keep
it inside a lent machine's time:

* **Only what is missing.** Each results file the probe writes records the
  repository's source files its process had loaded (``jmp_train``, the
  benchmarks, the example models: the code its figures depend on) and a
  fingerprint of their contents (:func:`source_fingerprint`). A benchmark
  whose results file for this device kind holds complete records with the
  fingerprint of the current files is not run again
  (:func:`probe_plan`); ``--gpu-probe --all`` or ``BENCH_PROBE_ALL=1``
  runs every one.
* **A budget it never exceeds** (``BENCH_PROBE_BUDGET_S``, default 420 s,
  counted from the probe's start): a benchmark starts only when its
  estimated seconds (:attr:`ProbeItem.estimate_s`, measured on an NVIDIA
  H200, its process's start included) fit in what is left, and its process
  is killed when the budget runs out (:func:`fits`). A benchmark that
  yields its records as it goes keeps those it had yielded: they are
  written with ``"complete": false``, and the next probe runs it again.
* **Priority order.** :data:`PROBE` lists the figures still missing first;
  a benchmark that does not fit is passed over and the next ones are
  still tried.

Each file's ``probe`` field holds ``fingerprint``, ``sources``, ``complete``
and ``seconds``. The probe's own machinery (this module, the command line)
is not among the sources: a change to it re-measures nothing.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import pathlib
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from typing import Any, Callable, Iterable, NamedTuple, Sequence

ROOT = pathlib.Path(__file__).resolve().parents[1]
BUDGET_VARIABLE = "BENCH_PROBE_BUDGET_S"
ALL_VARIABLE = "BENCH_PROBE_ALL"
DEFAULT_BUDGET_S = 420
# Files whose changes leave every figure as it was: the probe's runner.
_NOT_SOURCES = frozenset({"benchmarks/_probe.py", "benchmarks/__main__.py"})


class ProbeItem(NamedTuple):
  """One measurement of the probe: ``benchmarks.<module>.<function>(**kwargs)`` on a GPU.

  Attributes:
    name: the results file's name (``<name>-<device>.json``).
    module: a module of ``benchmarks`` (``"bench_fp8"``) or a dotted path.
    function: returns the records (a list) or yields them (a record or a
      list of records at a time: those yielded survive a cut-off).
    estimate_s: seconds it takes on an NVIDIA H200, its process's start
      (about 8 s) included.
    kwargs: keyword arguments of ``function``, as ``(key, value)`` pairs.
  """

  name: str
  module: str
  function: str
  estimate_s: float
  kwargs: tuple[tuple[str, Any], ...] = ()


# The probe's measurements, most wanted first. Estimates: from the H200 runs'
# results (their files' times and compile_s) and the sizes; see each module.
PROBE: tuple[ProbeItem, ...] = (
  # FP8 (and INT8) on a d4096 Transformer through make_train_step.
  ProbeItem("step_formats", "bench_step_formats", "records", 70),
  # ResNet-50: the hand-wrapped variants against the default step, with the compiled step's profile.
  ProbeItem("user_models_resnet50", "bench_user_models", "resnet50_profile_records", 95),
  # loss_scaled's kernel counts on the GPU's compiler, and its queued step at 1.1M parameters.
  ProbeItem("loss_scaling_kernels", "bench_loss_scaling", "kernel_records", 35),
  # s8 x s8 -> s32 against bfloat16 and FP8 products, with the kernels called.
  ProbeItem("int8_gemm", "bench_int8_gemm", "records", 30),
  # 1-bit DiLoCo at width 1,024 for 2,000 steps, the replicas mapped on one device.
  ProbeItem("diloco_scale", "bench_diloco_scale", "records", 85),
  # The 1-bit codec's whole update against a device copy.
  ProbeItem("compression_throughput", "bench_compression", "throughput_records", 30),
  # Figures measured before, again once their code has changed.
  ProbeItem("gpt", "bench_gpt", "run", 75, (("quick", False),)),
  ProbeItem("fp8", "bench_fp8", "speed_records", 35),
  ProbeItem("fp8_first_call", "bench_fp8_first_call", "run", 70, (("quick", False),)),
  ProbeItem("loss_scaling", "bench_loss_scaling", "run", 105, (("quick", False),)),
  ProbeItem("gpu", "bench_gpu", "run", 60, (("quick", False),)),
  ProbeItem("user_models", "bench_user_models", "run", 300, (("quick", False),)),
)


# --- what a results file depends on -----------------------------------------


def loaded_sources(modules: Iterable[Any] | None = None, root: pathlib.Path = ROOT) -> list[str]:
  """The repository's Python files among ``modules`` (default: every loaded module), relative and sorted.

  Installed packages (``site-packages``, a virtual environment inside the
  repository) and the probe's runner are left out.
  """
  modules = list(sys.modules.values()) if modules is None else modules
  found = set()
  for module in modules:
    file = getattr(module, "__file__", None)
    if not file or not file.endswith(".py"):
      continue
    path = pathlib.Path(file).resolve()
    try:
      rel = path.relative_to(root).as_posix()
    except ValueError:
      continue
    if "site-packages" in path.parts or rel.startswith(".") or rel in _NOT_SOURCES:
      continue
    found.add(rel)
  return sorted(found)


def source_fingerprint(sources: Iterable[str], root: pathlib.Path = ROOT) -> str | None:
  """A SHA-256 over the contents of the files ``sources`` (relative to ``root``), or ``None`` if one is gone.

  The same files with the same bytes give the same fingerprint, whatever
  their order or the machine.
  """
  digest = hashlib.sha256()
  for rel in sorted(set(sources)):
    path = root / rel
    if not path.is_file():
      return None
    digest.update(f"{rel}\0{hashlib.sha256(path.read_bytes()).hexdigest()}\n".encode())
  return digest.hexdigest()


def result_status(name: str, device_tag: str, results_dirs: Sequence[pathlib.Path], root: pathlib.Path = ROOT) -> str:
  """Whether ``<name>-<device_tag>.json`` in one of ``results_dirs`` holds current figures.

  Returns:
    ``"current"`` (complete records whose recorded sources have the
    recorded fingerprint today), else why not, from the most telling file:
    ``"code changed"``, ``"incomplete"`` (cut off or failed), ``"no
    fingerprint"`` (written before the probe recorded one) or ``"missing"``.
  """
  order = ("missing", "no fingerprint", "incomplete", "code changed")
  worst = "missing"
  for folder in results_dirs:
    path = pathlib.Path(folder) / f"{name}-{device_tag}.json"
    if not path.is_file():
      continue
    try:
      probe = json.loads(path.read_text()).get("probe") or {}
    except (json.JSONDecodeError, AttributeError):
      probe = {}
    if not probe.get("fingerprint"):
      status = "no fingerprint"
    elif not probe.get("complete"):
      status = "incomplete"
    elif source_fingerprint(probe.get("sources") or [], root) != probe["fingerprint"]:
      status = "code changed"
    else:
      return "current"
    worst = max(worst, status, key=order.index)
  return worst


def probe_plan(
  items: Sequence[ProbeItem],
  device_tag: str,
  results_dirs: Sequence[pathlib.Path],
  *,
  force: bool = False,
  root: pathlib.Path = ROOT,
) -> list[tuple[ProbeItem, str]]:
  """Each item with why it runs (``"missing"``, ``"code changed"``, ...) or ``"current"`` (it does not).

  ``force``: every item runs (``"forced"``). Reads the results files only.
  """
  if force:
    return [(item, "forced") for item in items]
  return [(item, result_status(item.name, device_tag, results_dirs, root)) for item in items]


def fits(estimate_s: float, elapsed_s: float, budget_s: float) -> bool:
  """Whether a benchmark of ``estimate_s`` seconds, started ``elapsed_s`` into the probe, ends within ``budget_s``."""
  return elapsed_s + estimate_s <= budget_s


# --- one benchmark in its own process ---------------------------------------


class ChildResult(NamedTuple):
  """What one benchmark's process left: its records and how it ended."""

  records: list[dict[str, Any]]
  sources: list[str]
  complete: bool
  error: str | None
  timed_out: bool
  seconds: float


def _plain(x: Any) -> Any:
  if hasattr(x, "item"):
    return x.item()
  return x.tolist() if hasattr(x, "tolist") else str(x)


def _emit(stream: pathlib.Path, **fields: Any) -> None:
  with open(stream, "a") as f:
    f.write(json.dumps(fields, default=_plain) + "\n")


def child_main(module: str, function: str, kwargs: dict[str, Any], stream: pathlib.Path) -> int:
  """Runs one benchmark function, appending what it returns or yields to ``stream`` (JSON lines)."""
  stream = pathlib.Path(stream)
  try:
    mod = importlib.import_module(module if "." in module else f"benchmarks.{module}")
    out = getattr(mod, function)(**kwargs)
    if isinstance(out, list):
      _emit(stream, records=out, sources=loaded_sources())
    else:
      for part in out:
        _emit(stream, records=part if isinstance(part, list) else [part], sources=loaded_sources())
  except BaseException:  # Reported to the parent, which runs the rest.
    traceback.print_exc()
    _emit(stream, error=traceback.format_exc(limit=6)[-1500:], sources=loaded_sources())
    return 1
  _emit(stream, done=True, sources=loaded_sources())
  return 0


def child_env(env: dict[str, str] | None = None) -> dict[str, str]:
  """The benchmark processes' environment: ``env`` with the repository and its examples on ``PYTHONPATH``."""
  env = dict(os.environ if env is None else env)
  paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
  for extra in (str(ROOT / "examples"), str(ROOT)):
    if extra not in paths:
      paths.insert(0, extra)
  env["PYTHONPATH"] = os.pathsep.join(paths)
  return env


def run_child(item: ProbeItem, timeout_s: float, env: dict[str, str] | None = None) -> ChildResult:
  """Runs ``item`` in a new process (its output on this one's), killed with its own children after ``timeout_s``."""
  start = time.monotonic()
  with tempfile.TemporaryDirectory(prefix="probe-") as tmp:
    stream = pathlib.Path(tmp) / "records.jsonl"
    stream.touch()
    cmd = [
      sys.executable,
      "-m",
      "benchmarks._probe",
      "--child",
      item.module,
      item.function,
      json.dumps(dict(item.kwargs)),
    ]
    proc = subprocess.Popen([*cmd, str(stream)], env=child_env(env), cwd=ROOT, start_new_session=True)
    timed_out = False
    try:
      proc.wait(timeout=max(0.0, timeout_s))
    except subprocess.TimeoutExpired:
      timed_out = True
      os.killpg(proc.pid, signal.SIGKILL)  # its own process group: the benchmark and what it started
      proc.wait()
    lines = [json.loads(line) for line in stream.read_text().splitlines() if line.strip()]
  records = [r for line in lines for r in line.get("records", [])]
  sources = sorted(set().union(*(line.get("sources", []) for line in lines))) if lines else []
  errors = [line["error"] for line in lines if "error" in line]
  error = errors[-1] if errors else None
  if error is None and not timed_out and proc.returncode != 0:
    error = f"the benchmark's process exited with status {proc.returncode}"
  done = any(line.get("done") for line in lines)
  return ChildResult(records, sources, done and not timed_out, error, timed_out, time.monotonic() - start)


# --- the probe ---------------------------------------------------------------


def no_gpu_reason() -> str | None:
  """Why the probe cannot run here (``None`` on a GPU)."""
  import jax

  if jax.default_backend() == "gpu":
    return None
  return (
    f"--gpu-probe needs a GPU: JAX's default backend here is "
    f"{jax.default_backend()!r} ({jax.devices()[0].device_kind}). Install a CUDA "
    'build of JAX (pip install -U "jax[cuda12]") and run it on a GPU machine.'
  )


def _headline(name: str, records: list[dict[str, Any]]) -> str:
  from benchmarks import _harness

  if _harness.is_skipped(records):
    return f"skipped: {records[0]['reason']}"
  if name == "gpt":
    by = {r.get("variant"): r for r in records}
    lib, floor = by.get("library"), by.get("floor")
    if lib and floor:
      pct = lambda r: "-" if r["fraction_of_peak"] is None else f"{r['fraction_of_peak']:.1%}"
      return (
        f"library {lib['tokens_per_s']:,.0f} tok/s, {lib['tflops']:.0f} TFLOP/s "
        f"({pct(lib)} of bf16 peak); floor {floor['tokens_per_s']:,.0f} tok/s "
        f"({pct(floor)}); library/floor time {lib['vs_floor']:.3f}"
      )
  return f"{len(records)} records"


def _columns(item: ProbeItem, records: list[dict[str, Any]]) -> list[str]:
  """The item's module's ``COLUMNS`` that its records have (read without importing it), else every field."""
  from benchmarks._report import module_facts

  columns = module_facts(ROOT / "benchmarks" / f"{item.module}.py")[1] or ()
  present = set().union(*(r.keys() for r in records))
  kept = [c for c in columns if c in present]
  return kept or sorted(present)


def _budget(budget_s: float | None) -> float:
  from benchmarks import _harness

  return float(_harness.env_int(BUDGET_VARIABLE, DEFAULT_BUDGET_S) if budget_s is None else budget_s)


def gpu_probe(
  out_dir: pathlib.Path | None = None,
  budget_s: float | None = None,
  *,
  force: bool | None = None,
  items: Sequence[ProbeItem] | None = None,
  runner: Callable[[ProbeItem, float], ChildResult] | None = None,
) -> int:
  """Runs the items of :data:`PROBE` that the results lack, within the budget; returns the exit status.

  Args:
    out_dir: where results go (default ``benchmarks/results``); the
      committed results there and this folder are both consulted.
    budget_s: seconds from the start (default ``$BENCH_PROBE_BUDGET_S``,
      else 420): nothing runs past it.
    force: run every item (default: ``$BENCH_PROBE_ALL`` is ``1``).
    items: the measurements (default :data:`PROBE`), in priority order.
    runner: ``(item, seconds left) -> ChildResult`` (default: :func:`run_child`, a process per item).

  Returns:
    0 when every benchmark that ran ended well; 1 when one failed or was
    cut off; 2 (with the reason on stderr) without a GPU.
  """
  # A CUDA client in this process takes no memory ahead: the benchmarks' own processes need it.
  child_base = dict(os.environ)
  os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
  start = time.monotonic()
  from benchmarks import _harness

  why = no_gpu_reason()
  if why is not None:
    print(why, file=sys.stderr, flush=True)
    return 2
  budget_s = _budget(budget_s)
  if runner is None:
    runner = lambda item, left: run_child(item, left, child_base)  # noqa: E731
  force = os.environ.get(ALL_VARIABLE, "") == "1" if force is None else force
  items = PROBE if items is None else tuple(items)
  tag = _harness.device_tag()
  dirs = [pathlib.Path(out_dir or _harness.RESULTS_DIR), _harness.RESULTS_DIR]
  info = _harness.machine_info()
  plan = probe_plan(items, tag, dirs, force=force)
  print(
    f"# gpu probe: {info['device_kind']} x{info['device_count']}, jax {info['versions']['jax']}, "
    f"XLA_FLAGS={info['xla_flags']!r}, budget {budget_s:.0f} s",
    flush=True,
  )
  print(_harness.format_table([{"benchmark": i.name, "why": w, "estimate_s": i.estimate_s} for i, w in plan]))
  rows, failed = [], False
  for item, why in plan:
    row = {"benchmark": item.name, "status": "current (kept)", "seconds": None, "file": None, "headline": why}
    rows.append(row)
    if why == "current":
      continue
    elapsed = time.monotonic() - start
    left = budget_s - elapsed
    if not fits(item.estimate_s, elapsed, budget_s):
      row.update(status="not run (budget)", headline=f"needs ~{item.estimate_s:.0f} s, {left:.0f} s left")
      continue
    print(f"\n## {item.name} ({why}; ~{item.estimate_s:.0f} s, {left:.0f} s left)", flush=True)
    result = runner(item, left)
    row["seconds"] = round(result.seconds, 1)
    if result.records:
      probe = {
        "fingerprint": source_fingerprint(result.sources),
        "sources": result.sources,
        "complete": result.complete,
        "seconds": round(result.seconds, 1),
      }
      path = _harness.save_results(item.name, result.records, out_dir, extra={"probe": probe})
      row["file"] = str(path)
      if not _harness.is_skipped(result.records):
        print(_harness.format_table(result.records, _columns(item, result.records)), flush=True)
    if result.timed_out:
      failed = True
      row.update(status="cut (budget)", headline=f"{len(result.records)} records kept")
    elif result.error is not None:
      failed = True
      row.update(status="FAILED", headline=result.error.strip().splitlines()[-1][:160])
    else:
      row.update(status="ok", headline=_headline(item.name, result.records))
  print(f"\n# gpu probe summary ({time.monotonic() - start:.0f} s of {budget_s:.0f})\n")
  print(_harness.format_table(rows, ("benchmark", "status", "seconds", "headline", "file")), flush=True)
  return 1 if failed else 0


if __name__ == "__main__" and len(sys.argv) == 6 and sys.argv[1] == "--child":
  sys.exit(child_main(sys.argv[2], sys.argv[3], json.loads(sys.argv[4]), pathlib.Path(sys.argv[5])))
