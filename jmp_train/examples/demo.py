"""The demo behind ``jmp-train``: each fix of the mixed-precision papers, on a real task.

Trains one model, from the same initial weights, on the same batches, under
one learning-rate schedule (linear warm-up, then cosine decay to a small
rate), in each configuration of :data:`CONFIGS`, in three comparisons:

* **loss scaling**: float32; mixed float16 without loss scaling (gradients
  below float16's range flush to zero); mixed float16 with dynamic loss
  scaling; mixed bfloat16 (float32's range, no scaling needed);
* **weight updates**: float16 weights (no float32 master copy) with the
  float32 row's momentum SGD (``optax.sgd``), whose step ``lr·G`` is lost
  once it falls below half an ulp of the weights as the rate decays, and
  with :func:`jmp_train.modified_momentum_sgd` (the modified momentum of
  NVIDIA's mixed-precision training guide, with error feedback of what
  rounding drops);
* **compression**: data parallelism over 8 devices with a float32
  all-reduce, 1-bit compression without error feedback, and 1-bit SGD with
  error feedback (Seide et al.).

Reports one table (final train and validation loss and accuracy, the
validation loss relative to the comparison's float32 reference, steps per
second, skipped steps, final loss scale, the share of gradients that would
underflow float16 without loss scaling, bytes of parameters + optimizer
state, and wire bytes per step read from the compiled HLO) and writes
``results.json`` and, with matplotlib, ``results.png``
(:mod:`jmp_train.examples.demo_plot`).

The rows and settings are in :mod:`jmp_train.examples.demo_configs`, the
tasks in :mod:`jmp_train.examples.demo_tasks`, training one row in
:mod:`jmp_train.examples.demo_training`; this module runs them all (in
worker processes where asked) and writes the results.

The task is a character-level Transformer language model on the Python
standard library's own source (:func:`jmp_train.examples.data.load_text_corpus`),
or an MLP on scikit-learn's 8x8 digits (``--task digits``). Single-device
rows run on JAX's default device (a GPU when there is one); the 8-device rows
need 8 devices of one kind, which on a one-GPU machine are 8 simulated CPU
devices (:func:`jmp_train.examples.cli.main` creates them).
"""


from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import re
import signal
import sys
import tempfile
import time
from typing import Any, Sequence

import jax
import numpy as np

from jmp_train.examples.demo_configs import COLUMNS
from jmp_train.examples.demo_configs import COMPARISONS
from jmp_train.examples.demo_configs import CONFIGS
from jmp_train.examples.demo_configs import NUM_DEVICES
from jmp_train.examples.demo_configs import DemoError
from jmp_train.examples.demo_configs import DemoSettings
from jmp_train.examples.demo_configs import RunConfig
from jmp_train.examples.demo_configs import data_parallel_optimizer
from jmp_train.examples.demo_configs import learning_rate_schedule
from jmp_train.examples.demo_tasks import TASKS
from jmp_train.examples.demo_tasks import gpt2_init
from jmp_train.examples.demo_training import data_parallel_devices
from jmp_train.examples.demo_training import run_configs
from jmp_train.examples.processes import free_port, run_processes
from jmp_train.examples.stopping import Terminated

__all__ = [
    "CONFIGS", "COLUMNS", "DemoError", "DemoSettings", "RunConfig", "format_table", "run_demo",
    "learning_rate_schedule", "data_parallel_optimizer", "TASKS", "gpt2_init",
]

# Lines that say why a process failed: a Python exception, an absl fatal
# log line (XLA's failed checks), a C++ exception's message.
_ERROR_LINE = re.compile(r"Error\b|error:|Check failed|terminate called|what\(\):|^F\d{4} ")


def _failure_line(log: str) -> str:
  """The line of a failed worker's output that says why: its last error line, else its last line.

  A process that aborts prints a native stack after the error; its last
  line is a stack frame.
  """
  lines = [line.strip() for line in log.splitlines() if line.strip()]
  errors = [line for line in lines if _ERROR_LINE.search(line)]
  return (errors or lines or ["(no output)"])[-1]


def _killed(code: int) -> bool:
  """Whether a worker's exit status says a signal from outside ended it.

  A worker that stops on its own error exits non-zero or aborts (SIGABRT:
  XLA's fatal log, as when jax.distributed finds a peer gone); a worker
  killed from outside (kill -9, the out-of-memory killer) ends by another
  signal: that one is the process the job lost.
  """
  return code < 0 and -code != signal.SIGABRT


def _signal_name(number: int) -> str:
  try:
    return f"killed by {signal.Signals(number).name}"
  except ValueError:
    return f"killed by signal {number}"


def _worker_xla_flags(flags: str) -> str:
  """``XLA_FLAGS`` for a worker process: the caller's, without a CPU device count.

  Each worker sets its own device count (8 / N); every other flag (a GPU
  flag, a collective timeout) reaches the workers as the user set it.
  """
  return " ".join(
      f for f in flags.split() if not f.startswith("--xla_force_host_platform_device_count")
  )


def _run_processes(s: DemoSettings, names: Sequence[str], argv_base: list[str]) -> tuple[list[dict], dict]:
  """Runs ``names`` in ``s.num_processes`` local processes (jax.distributed)."""
  port = free_port()
  env = dict(os.environ)
  env["XLA_FLAGS"] = _worker_xla_flags(env.get("XLA_FLAGS", ""))
  with tempfile.TemporaryDirectory(prefix="jmp_train_mp_") as tmp:
    commands = [
        [sys.executable, "-m", "jmp_train", *argv_base,
         "--configs", ",".join(names), "--out", tmp, "--no-plot", "--no-progress",
         "--num-processes", "1",
         "--_process", f"{pid},{s.num_processes},{port}"]
        for pid in range(s.num_processes)
    ]
    results = run_processes(commands, env)
    lost = [(pid, code) for pid, (code, _) in enumerate(results) if _killed(code)]
    if lost:
      pid, code = lost[0]
      raise DemoError(
          f"process {pid} of {s.num_processes} was lost ({_signal_name(-code)}); "
          "the others stopped without it")
    if any(code == 128 + signal.SIGTERM for code, _ in results) and all(
        code in (0, 128 + signal.SIGTERM) for code, _ in results):
      # SIGTERM to a worker: all of them saved the same step and stopped.
      raise Terminated()
    for pid, (code, log) in enumerate(results):
      if code != 0:
        raise DemoError(f"process {pid} of {s.num_processes} failed: {_failure_line(log)}")
    payload = json.loads((pathlib.Path(tmp) / "worker.json").read_text())
  return payload["rows"], payload["curves"]


def _add_gaps(rows: list[dict]) -> None:
  """``val_loss_gap``: validation loss relative to the row's reference."""
  by_name = {r["config"]: r for r in rows}
  for r in rows:
    ref = by_name.get(r["reference"])
    r["val_loss_gap"] = (r["val_loss"] / ref["val_loss"] - 1.0) if ref else None


def _run_all(s: DemoSettings, argv_base: Sequence[str]) -> tuple[list[dict], dict]:
  local = [n for n in s.configs if s.num_processes == 1 or CONFIGS[n].devices == 1]
  remote = [n for n in s.configs if n not in local]
  # The task first: its errors (a missing package, a batch larger than the
  # data) come before the progress bar and the worker processes.
  task = TASKS[s.task](s)
  bar = None
  if s.progress:
    from tqdm.auto import tqdm  # pylint: disable=g-import-not-at-top

    bar = tqdm(total=s.steps * len(local), desc="jmp-train", unit="step",
               dynamic_ncols=True, file=sys.stderr)
  try:
    rows, curves = run_configs(s, local, bar, task)
  finally:
    if bar is not None:
      bar.close()
  if remote:
    if s.progress:
      print(f"running {', '.join(remote)} in {s.num_processes} processes "
            "(jax.distributed, gloo on 127.0.0.1)...", file=sys.stderr, flush=True)
    more_rows, more_curves = _run_processes(s, remote, list(argv_base))
    rows += more_rows
    curves.update(more_curves)
  order = {n: i for i, n in enumerate(s.configs)}
  rows.sort(key=lambda r: order[r["config"]])
  _add_gaps(rows)
  return rows, curves


def run_demo(s: DemoSettings, *, argv_base: Sequence[str] = (), worker: bool = False) -> list[dict]:
  """Runs the demo; writes ``results.json`` (and ``results.png``) to ``s.out``.

  Args:
    s: the settings.
    argv_base: the CLI flags that describe ``s`` (passed on to worker
      processes with ``--num-processes``).
    worker: this process is one of ``--num-processes`` workers.

  Returns:
    The table rows.
  """
  if (len(data_parallel_devices()) < NUM_DEVICES
      and any(CONFIGS[n].devices > 1 for n in s.configs)):
    raise DemoError(
        f"the 8-device configurations need {NUM_DEVICES} devices, JAX has "
        f"{jax.device_count()}; run through `jmp-train` (it sets them up), or "
        "leave the 8dev-* configurations out of --configs."
    )
  out = pathlib.Path(s.out)
  out.mkdir(parents=True, exist_ok=True)
  if worker:
    rows, curves = run_configs(s, s.configs)
    if jax.process_index() == 0:
      (out / "worker.json").write_text(json.dumps(
          {"rows": rows, "curves": {k: _json_curves(v) for k, v in curves.items()}}))
    return rows
  t0, cpu0 = time.perf_counter(), time.process_time()
  rows, curves = _run_all(s, argv_base)
  payload = {
      "settings": dataclasses.asdict(s),
      "machine": {
          "backend": jax.default_backend(),
          "devices": jax.device_count(),
          "cpu_count": os.cpu_count(),
          "jax": jax.__version__,
      },
      "timing": {"wall_s": time.perf_counter() - t0, "cpu_s": time.process_time() - cpu0},
      "columns": list(COLUMNS),
      "comparisons": {k: list(v) for k, v in COMPARISONS.items()},
      "rows": rows,
      "curves": {k: _json_curves(v) for k, v in curves.items()},
  }
  (out / "results.json").write_text(json.dumps(payload, indent=2, default=_jsonable) + "\n")
  if s.plot:
    from jmp_train.examples import demo_plot  # pylint: disable=g-import-not-at-top

    demo_plot.plot(out / "results.png", rows, curves, s, learning_rate_schedule(s))
  return rows


def _json_curves(curve: dict) -> dict:
  return {k: v for k, v in curve.items() if k in ("loss", "loss_scale")}


def _jsonable(x: Any) -> Any:
  if isinstance(x, dict):
    return {k: _jsonable(v) for k, v in x.items()}
  if isinstance(x, (list, tuple)):
    return [_jsonable(v) for v in x]
  if hasattr(x, "tolist"):
    return x.tolist()
  return x


def _cell(v: Any, column: str) -> str:
  if v is None:
    return "-"
  if column == "val_loss_gap":
    return f"{v:+.1%}"
  if isinstance(v, float):
    return str(v) if not np.isfinite(v) else (f"{v:.4g}" if abs(v) < 1e5 else f"{v:.3g}")
  return str(v)


def format_table(rows: Sequence[dict[str, Any]], columns: Sequence[str] = COLUMNS) -> str:
  """The rows as a GitHub-markdown table, in the demo's column order."""
  if not rows:
    return "(no rows)"
  cells = [[_cell(r.get(c), c) for c in columns] for r in rows]
  widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]

  def line(values):
    return "| " + " | ".join(v.ljust(w) for v, w in zip(values, widths)) + " |"

  sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
  return "\n".join([line(columns), sep, *(line(r) for r in cells)])
