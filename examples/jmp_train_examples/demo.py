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
(:mod:`jmp_train_examples.demo_plot`).

The rows and settings are in :mod:`jmp_train_examples.demo_configs`, the
tasks in :mod:`jmp_train_examples.demo_tasks`, training one row in
:mod:`jmp_train_examples.demo_training`; this module runs them all (in
worker processes where asked) and writes the results.

The task is a character-level Transformer language model on the Python
standard library's own source (:func:`jmp_train_examples.data.load_text_corpus`),
or an MLP on scikit-learn's 8x8 digits (``--task digits``). Single-device
rows run on JAX's default device (a GPU when there is one); the 8-device rows
need 8 devices of one kind, which on a one-GPU machine are 8 simulated CPU
devices (:func:`jmp_train_examples.cli.main` creates them).
"""

from __future__ import annotations

import contextlib
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

from jmp_train_examples import checkpoint_lock
from jmp_train_examples.demo_configs import COLUMNS
from jmp_train_examples.demo_configs import COMPARISONS
from jmp_train_examples.demo_configs import CONFIGS
from jmp_train_examples.demo_configs import NUM_DEVICES
from jmp_train_examples.demo_configs import DemoError
from jmp_train_examples.demo_configs import DemoSettings
from jmp_train_examples.demo_configs import RunConfig
from jmp_train_examples.demo_configs import data_parallel_optimizer
from jmp_train_examples.demo_configs import learning_rate_schedule
from jmp_train_examples.demo_tasks import TASKS
from jmp_train_examples.demo_tasks import gpt2_init
from jmp_train_examples.demo_training import data_parallel_devices
from jmp_train_examples.demo_training import run_configs
from jmp_train_examples.processes import WORKER_FOLDER_PREFIX
from jmp_train_examples.processes import free_port, run_processes
from jmp_train_examples.stopping import Terminated

__all__ = [
  "CONFIGS",
  "COLUMNS",
  "DemoError",
  "DemoSettings",
  "RunConfig",
  "format_table",
  "run_demo",
  "learning_rate_schedule",
  "data_parallel_optimizer",
  "TASKS",
  "gpt2_init",
  "write_atomic",
]

# Lines that say why a process failed: a Python exception, an absl fatal
# log line (XLA's failed checks), a C++ exception's message.
_ERROR_LINE = re.compile(r"Error\b|error:|Check failed|terminate called|what\(\):|^F\d{4} ")
# What a process that aborts prints after its error: native stack frames
# ("@ 0x7f... xla::CoordinationServiceAgent::SetError()"), absl's
# failure-signal banner ("*** SIGABRT received ...", "PC: @ ...").
_NATIVE_FRAME = re.compile(r"^(@\s+0x|PC: @|\*\*\* )")
# jax.distributed's words for a process whose heartbeats stopped: the
# coordinator's list of unhealthy tasks (their numbers on the next lines),
# "Task 1 heartbeat timeout", or a heartbeat RPC to the coordinator
# (process 0) that timed out.
_UNHEALTHY = re.compile(r"stopped sending heartbeats\):")
_TASK_TIMEOUT = re.compile(r"Task (\d+) heartbeat timeout")
_HEARTBEAT_RPC = re.compile(r"DEADLINE_EXCEEDED[\s\S]{0,200}?CoordinationService/Heartbeat")
# Characters of a worker's failure kept in its one-line summary.
_SUMMARY_CHARS = 300


def _failure_line(log: str) -> str:
  """The line of a failed worker's output that says why: its last error line, else its last line.

  A process that aborts prints a native stack after the error: its frames
  are never the answer.
  """
  lines = [line.strip() for line in log.splitlines() if line.strip()]
  lines = [line for line in lines if not _NATIVE_FRAME.match(line)]
  errors = [line for line in lines if _ERROR_LINE.search(line)]
  return (errors or lines or ["(no output)"])[-1]


def _unresponsive_peers(log: str) -> list[int] | None:
  """The processes a worker's output says stopped sending heartbeats.

  Returns:
    Their indices (``[0]``: the coordinator, for a worker whose own
    heartbeats went unanswered); ``[]`` when the output blames heartbeats
    without naming a process; ``None`` when it does not blame heartbeats.
  """
  named = [int(t) for t in _TASK_TIMEOUT.findall(log)]
  for m in _UNHEALTHY.finditer(log):
    # The list ends at "The tasks have crashed..." or a blank line; its
    # items are "1" or "/job:jax_worker/replica:0/task:1" (the last number).
    block = re.split(r"The tasks|\n\s*\n", log[m.end() : m.end() + 400])[0]
    for part in re.split(r"[,\n]", block):
      numbers = re.findall(r"\d+", part)
      if numbers:
        named.append(int(numbers[-1]))
  if _HEARTBEAT_RPC.search(log):
    named.append(0)
  if named:
    return sorted(set(named))
  return [] if "heartbeat" in log.lower() else None


def _summary(code: int, log: str, ended: bool) -> str:
  """One line on how a worker ended, from its exit status and output."""
  if ended:
    return "still running after another process had stopped: killed by the launcher"
  how = f"exit status {code}" if code >= 0 else "aborted (SIGABRT)" if -code == signal.SIGABRT else _signal_name(-code)
  peers = _unresponsive_peers(log)
  if peers:
    why = "jax.distributed lost its heartbeats from process " + ", ".join(map(str, peers))
  else:
    why = _failure_line(log)
  if len(why) > _SUMMARY_CHARS:
    why = why[: _SUMMARY_CHARS - 3] + "..."
  return f"{how}: {why}"


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
  return " ".join(f for f in flags.split() if not f.startswith("--xla_force_host_platform_device_count"))


def _job_error(n: int, results: Sequence[tuple[int, str]]) -> Exception | None:
  """Why a job of ``n`` worker processes failed, as one line; ``None`` if it did not.

  ``results`` are :func:`run_processes`'s ``(exit status, output)`` pairs;
  those it killed itself (``ended``: still running well after another
  process had failed) are told apart from processes lost to a signal from
  outside.
  """
  ended = [bool(getattr(r, "ended", False)) for r in results]
  lost = [(pid, code) for pid, (code, _) in enumerate(results) if _killed(code) and not ended[pid]]
  if lost:
    pid, code = lost[0]
    return DemoError(f"process {pid} of {n} was lost ({_signal_name(-code)}); the others stopped without it")
  codes = [code for code, _ in results]
  if not any(ended) and 128 + signal.SIGTERM in codes and all(code in (0, 128 + signal.SIGTERM) for code in codes):
    # SIGTERM to a worker: all of them saved the same step and stopped.
    return Terminated()
  failed = [pid for pid, (code, _) in enumerate(results) if code != 0 and not ended[pid]]
  stuck = [pid for pid in range(n) if ended[pid]]
  for pid in failed:
    peers = _unresponsive_peers(results[pid][1])
    if stuck and peers is not None:
      # A process alive but not answering: its peer gave up on its
      # heartbeats, and it was still running after the peer had gone.
      suspect = next((p for p in stuck if p in peers), stuck[0])
      return DemoError(
        f"process {suspect} of {n} stopped responding (alive but not answering: "
        f"process {pid} gave up on its heartbeats and stopped, it did not); "
        "the launcher killed it"
      )
  if failed:
    pid = failed[0]
    return DemoError(f"process {pid} of {n} failed: {_failure_line(results[pid][1])}")
  if stuck:
    done = [pid for pid in range(n) if not ended[pid]]
    return DemoError(
      f"process {stuck[0]} of {n} did not finish: still running long after process "
      f"{done[0] if done else '?'} had ended; the launcher killed it"
    )
  return None


def _run_processes(s: DemoSettings, names: Sequence[str], argv_base: list[str]) -> tuple[list[dict], dict]:
  """Runs ``names`` in ``s.num_processes`` local processes (jax.distributed).

  The workers share a temporary folder with this process (removed when it
  ends; by the workers when it was killed) and inherit the lock of the
  checkpoint folder (:mod:`~jmp_train_examples.checkpoint_lock`), which
  thus lasts as long as any of them.
  """
  port = free_port()
  env = dict(os.environ)
  env["XLA_FLAGS"] = _worker_xla_flags(env.get("XLA_FLAGS", ""))
  lock = checkpoint_lock.held_fd(s.checkpoint_dir)
  with tempfile.TemporaryDirectory(prefix=f"{WORKER_FOLDER_PREFIX}{os.getpid()}_") as tmp:
    commands = [
      [
        sys.executable,
        "-m",
        "jmp_train_examples",
        *argv_base,
        "--configs",
        ",".join(names),
        "--out",
        tmp,
        "--no-plot",
        "--no-progress",
        "--num-processes",
        "1",
        "--_process",
        f"{pid},{s.num_processes},{port},{os.getpid()}",
      ]
      for pid in range(s.num_processes)
    ]
    results = run_processes(commands, env, **({"pass_fds": (lock,)} if lock is not None else {}))
    error = _job_error(s.num_processes, results)
    if error is not None:
      if not isinstance(error, Terminated):
        for pid, (code, log) in enumerate(results):
          if code != 0:
            print(
              f"process {pid} of {s.num_processes}: {_summary(code, log, bool(getattr(results[pid], 'ended', False)))}",
              file=sys.stderr,
            )
            if os.environ.get("JMP_TRAIN_DEBUG"):
              print(log, file=sys.stderr)
      raise error
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
    from tqdm.auto import tqdm

    bar = tqdm(total=s.steps * len(local), desc="jmp-train", unit="step", dynamic_ncols=True, file=sys.stderr)
  try:
    rows, curves = run_configs(s, local, bar, task)
  finally:
    if bar is not None:
      bar.close()
  if remote:
    if s.progress:
      print(
        f"running {', '.join(remote)} in {s.num_processes} processes (jax.distributed, gloo on 127.0.0.1)...",
        file=sys.stderr,
        flush=True,
      )
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
  if len(data_parallel_devices()) < NUM_DEVICES and any(CONFIGS[n].devices > 1 for n in s.configs):
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
      write_atomic(
        out / "worker.json", json.dumps({"rows": rows, "curves": {k: _json_curves(v) for k, v in curves.items()}})
      )
    return rows
  t0, cpu0 = time.perf_counter(), time.process_time()
  with checkpoint_lock.hold(s.checkpoint_dir) if s.checkpoint_dir is not None else contextlib.nullcontext():
    rows, curves = _run_all(s, argv_base)
  _mark_failed(rows, curves)
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
  write_atomic(out / "results.json", json.dumps(payload, indent=2, default=_jsonable) + "\n")
  if s.plot:
    from jmp_train_examples import demo_plot

    demo_plot.plot(out / "results.png", rows, curves, s, learning_rate_schedule(s))
  return rows


def _mark_failed(rows: list[dict], curves: dict) -> None:
  """Sets ``row["failed"]`` on a row whose final or validation loss is not finite.

  A row without loss scaling whose weights overflowed trains on to the end
  with NaN losses: its numbers mean nothing, and the CLI exits 1 once the
  table and ``results.json`` are written.
  """
  for r in rows:
    losses = [r.get("train_loss"), r.get("val_loss"), (curves.get(r["config"], {}).get("loss") or [None])[-1]]
    if any(v is not None and not np.isfinite(v) for v in losses):
      r["failed"] = "loss is not finite"


def write_atomic(path: str | os.PathLike[str], text: str) -> None:
  """Writes ``text`` to ``path`` whole or not at all.

  The text goes to a temporary file in the same folder, is flushed to disk
  (``fsync``) and renamed over ``path`` (``os.replace``, atomic on POSIX
  and Windows): a full disk or a crash leaves the previous file, never an
  empty or partial one.

  Raises:
    DemoError: the write failed (naming ``path`` and why); ``path`` is
      unchanged and the temporary file removed.
  """
  path = pathlib.Path(path)
  tmp = path.with_name(f".{path.name}.{os.getpid()}.{time.monotonic_ns()}.tmp")
  try:
    # Not mkstemp: its file is private (0600); this one gets the umask's mode.
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
  except OSError as e:
    raise DemoError(f"cannot write {path}: {e.strerror or e}") from e
  try:
    with os.fdopen(fd, "w", encoding="utf-8") as f:
      f.write(text)
      f.flush()
      os.fsync(f.fileno())
    os.replace(tmp, path)
  except OSError as e:
    with contextlib.suppress(OSError):
      os.unlink(tmp)
    raise DemoError(
      f"cannot write {path}: {e.strerror or e}; "
      + ("the previous file is unchanged" if path.exists() else "nothing was written")
    ) from e


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
  """The rows as a GitHub-markdown table, in the demo's column order.

  A ``failed`` column is added when a row failed (its loss is not finite).
  """
  if not rows:
    return "(no rows)"
  if any(r.get("failed") for r in rows) and "failed" not in columns:
    columns = (*columns, "failed")
  cells = [[_cell(r.get(c), c) for c in columns] for r in rows]
  widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]

  def line(values):
    return "| " + " | ".join(v.ljust(w) for v, w in zip(values, widths)) + " |"

  sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
  return "\n".join([line(columns), sep, *(line(r) for r in cells)])
