"""``jmp-train`` / ``python -m jmp_train_examples``: the demo in one command.

This module imports nothing heavy at import time: ``jmp-train --help`` and
flag errors answer without starting JAX.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import sys
import threading
import time
from typing import Any, Callable

_NUM_DEVICES = 8
# jax.distributed timeouts of the --num-processes workers, in seconds.
_HEARTBEAT_S = 10
_SHUTDOWN_S = 60
_PROG = "jmp-train"

# Plain text for --help (no reST markup).
_DESCRIPTION = (
  "Trains a character-level Transformer on the Python standard library's source "
  "(or an MLP on scikit-learn's digits) in nine configurations, under one warm-up + "
  "cosine-decay learning-rate schedule, and compares them: float32; mixed float16 "
  "without and with dynamic loss scaling; mixed bfloat16; float16 weights with plain "
  "momentum SGD and with the modified momentum SGD; 8 data-parallel devices with a "
  "float32 all-reduce, 1-bit compression without error feedback, and 1-bit SGD with "
  "error feedback. Prints one table and writes results.json and (with matplotlib) "
  "results.png to --out."
)
_EPILOG = (
  "Without matplotlib the table and results.json are still written; "
  "pip install 'jmp_train[plot]' adds the figure. JMP_TRAIN_DEBUG=1 shows tracebacks."
)


class _Parser(argparse.ArgumentParser):
  """An ArgumentParser whose errors are one line (no usage block)."""

  def error(self, message):
    raise _UsageError(message)


class _UsageError(Exception):
  pass


def _number(convert: Callable[[str], Any], valid: Callable[[Any], bool], expected: str):
  """An argparse ``type``: ``convert(text)``, which ``valid`` must accept."""

  def parse(text: str):
    try:
      value = convert(text)
    except ValueError:
      raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
    if not valid(value):
      shown = value if isinstance(value, int) else text
      raise argparse.ArgumentTypeError(f"expected {expected}, got {shown}")
    return value

  return parse


_positive_int = _number(int, lambda v: v > 0, "a positive integer")
_nonnegative_int = _number(int, lambda v: v >= 0, "a non-negative integer")
_fraction = _number(float, lambda v: 0.0 < v <= 1.0, "a number in (0, 1]")
_positive_float = _number(float, lambda v: v > 0, "a positive number")


def build_parser() -> argparse.ArgumentParser:
  """The CLI's argument parser."""
  # Names only; importing the demo module here would import JAX first.
  config_names = (
    "f32",
    "f16",
    "f16-dls",
    "bf16",
    "f16w-sgd",
    "f16w-mmsgd",
    "8dev-f32",
    "8dev-1bit-noef",
    "8dev-1bit",
    "8dev-diloco",
    "8dev-diloco-1bit",
  )
  default_configs = tuple(n for n in config_names if "diloco" not in n)
  parser = _Parser(prog=_PROG, description=_DESCRIPTION, epilog=_EPILOG)
  parser.add_argument(
    "--task",
    choices=("text", "digits"),
    default="text",
    help="char-level LM on the stdlib source, or MLP on sklearn digits (default: %(default)s)",
  )
  parser.add_argument(
    "--steps", type=_positive_int, default=None, help="training steps per configuration (default 200; 20 with --quick)"
  )
  parser.add_argument(
    "--batch", type=_positive_int, default=None, help="global batch size, a multiple of 8 (default 32; 16 with --quick)"
  )
  parser.add_argument(
    "--seq-len",
    type=_positive_int,
    default=None,
    help="tokens per sequence for --task text (default 64; 16 with --quick)",
  )
  parser.add_argument(
    "--d-model", type=_positive_int, default=None, help="model width, a multiple of 16 (default 64; 16 with --quick)"
  )
  parser.add_argument(
    "--layers", type=_positive_int, default=None, help="Transformer layers (text) or hidden layers (digits) (default 1)"
  )
  parser.add_argument(
    "--hidden", type=_positive_int, default=128, help="hidden width of the digits MLP (default: %(default)s)"
  )
  parser.add_argument(
    "--lr", type=_positive_float, default=None, help="peak learning rate of every configuration (default 0.15)"
  )
  parser.add_argument(
    "--final-lr",
    type=_fraction,
    default=0.01,
    help="the rate the cosine decay ends at, as a fraction of --lr (default: %(default)s)",
  )
  parser.add_argument(
    "--one-bit-scale",
    choices=("l1", "l2", "column"),
    default="l1",
    help="reconstruction value of the 1-bit rows: per tensor mean |v| (l1), "
    "per tensor l2 norm, or per column (default: %(default)s)",
  )
  parser.add_argument(
    "--init",
    choices=("flax", "gpt2"),
    default="flax",
    help="text task weights: Flax's default initializers, or GPT-2's "
    "(normal 0.02, residual projections / sqrt(2 layers)) "
    "(default: %(default)s)",
  )
  parser.add_argument(
    "--configs",
    default=",".join(default_configs),
    help="comma-separated subset of "
    + ", ".join(config_names)
    + " (default: all but the 8dev-diloco rows, which train with "
    "local steps and an average every 8 steps)",
  )
  parser.add_argument("--out", default="jmp_train_output", help="output folder (default: %(default)s)")
  parser.add_argument(
    "--seed", type=_nonnegative_int, default=0, help="seed of weights and data (default: %(default)s)"
  )
  parser.add_argument(
    "--max-skipped-steps",
    type=_positive_int,
    default=100,
    help="stop with an error once this many steps in a row were skipped "
    "for non-finite gradients (default: %(default)s)",
  )
  parser.add_argument(
    "--checkpoint-dir",
    default=None,
    help="save each configuration's training state there (orbax); the "
    "same command run again resumes each from its latest complete "
    "checkpoint (with the same --num-processes); one run at a time "
    "per folder",
  )
  parser.add_argument(
    "--checkpoint-every",
    type=_positive_int,
    default=None,
    help="steps between checkpoints, with --checkpoint-dir (default 50)",
  )
  parser.add_argument(
    "--num-processes",
    type=_positive_int,
    default=1,
    help="run the 8-device configurations as N local processes (jax.distributed, gloo, 127.0.0.1); N in 1, 2, 4, 8",
  )
  parser.add_argument("--quick", action="store_true", help="tiny sizes and few steps (CI smoke test)")
  parser.add_argument("--no-plot", dest="plot", action="store_false", help="skip results.png (no matplotlib needed)")
  parser.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
  parser.add_argument("--_process", default=None, help=argparse.SUPPRESS)
  parser.config_names = config_names  # type: ignore[attr-defined]
  return parser


def _settings(args: argparse.Namespace, config_names) -> dict:
  quick = args.quick
  configs = tuple(c.strip() for c in args.configs.split(",") if c.strip())
  unknown = [c for c in configs if c not in config_names]
  if not configs or unknown:
    raise _UsageError(
      f"unknown configuration(s) {', '.join(map(repr, unknown)) or '(none given)'} "
      f"in --configs; valid: {', '.join(config_names)}"
    )
  if len(set(configs)) != len(configs):
    raise _UsageError(f"--configs lists a configuration twice: {args.configs!r}")
  settings = dict(
    task=args.task,
    steps=args.steps or (20 if quick else 200),
    batch=args.batch or (16 if quick else 32),
    seq_len=args.seq_len or (16 if quick else 64),
    d_model=args.d_model or (16 if quick else 64),
    layers=args.layers or 1,
    hidden=32 if quick and args.hidden == 128 else args.hidden,
    learning_rate=args.lr or 0.15,
    final_lr_fraction=args.final_lr,
    one_bit_scale=args.one_bit_scale,
    init=args.init,
    configs=configs,
    out=args.out,
    seed=args.seed,
    eval_batches=1 if quick else 4,
    max_skipped_steps=args.max_skipped_steps,
    checkpoint_dir=args.checkpoint_dir,
    checkpoint_every=args.checkpoint_every or 50,
    num_processes=args.num_processes,
    plot=args.plot,
    progress=args.progress,
  )
  if settings["batch"] % _NUM_DEVICES:
    raise _UsageError(
      f"--batch {settings['batch']} must be a multiple of {_NUM_DEVICES} (the 8-device configurations split it evenly)"
    )
  if args.num_processes not in (1, 2, 4, 8):
    raise _UsageError(f"--num-processes {args.num_processes} must divide {_NUM_DEVICES}: 1, 2, 4 or 8")
  if args.checkpoint_every is not None and args.checkpoint_dir is None:
    raise _UsageError("--checkpoint-every needs --checkpoint-dir")
  if settings["d_model"] % 16 and args.task == "text":
    raise _UsageError(f"--d-model {settings['d_model']} must be a multiple of 16 (16 per head)")
  return settings


def _check_output_dir(path: str) -> None:
  """Creates ``--out`` if needed and checks a file can be written there."""
  import tempfile

  if os.path.exists(path) and not os.path.isdir(path):
    raise _UsageError(f"--out {path}: exists and is not a folder")
  try:
    os.makedirs(path, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=path, prefix=".jmp_train_write_check_"):
      pass
  except OSError as e:
    reason = e.strerror or type(e).__name__
    raise _UsageError(f"--out {path}: cannot write there ({reason})") from None


def _check_optional_dependencies(settings: dict) -> str | None:
  """Raises for a missing dependency the run needs; returns a note for the plot."""
  if settings["task"] == "digits":
    try:
      import sklearn  # noqa: F401
    except ImportError:
      raise _DependencyError(
        "--task digits needs scikit-learn: pip install 'jmp_train_examples[full]' (or use --task text)"
      ) from None
  if settings["checkpoint_dir"] is not None:
    try:
      import orbax.checkpoint  # noqa: F401
    except ImportError:
      raise _DependencyError("--checkpoint-dir needs orbax-checkpoint: pip install 'jmp_train[checkpoint]'") from None
  if settings["plot"]:
    try:
      import matplotlib  # noqa: F401
    except ImportError:
      settings["plot"] = False
      return "results.png not drawn: matplotlib is not installed; pip install 'jmp_train[plot]' to get the figure"
  return None


class _DependencyError(Exception):
  pass


def _setup_jax(process: str | None) -> None:
  """8 CPU devices (or 8/N per process), before JAX starts its backend."""
  import jax

  if process is None:
    try:
      jax.config.update("jax_num_cpu_devices", _NUM_DEVICES)
    except RuntimeError:
      # Called from a program that already started JAX (a test, a
      # notebook): it keeps the devices it has; main() checks there are
      # enough.
      pass
    return
  pid, n, port = (int(x) for x in process.split(",")[:3])
  jax.config.update("jax_num_cpu_devices", _NUM_DEVICES // n)
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  # A process that dies (kill -9, out of memory) stops sending heartbeats:
  # the others stop within _HEARTBEAT_S (jax's defaults wait minutes).
  jax.distributed.initialize(
    f"127.0.0.1:{port}",
    num_processes=n,
    process_id=pid,
    heartbeat_timeout_seconds=_HEARTBEAT_S,
    shutdown_timeout_seconds=_SHUTDOWN_S,
  )


def main(argv: list[str] | None = None) -> int:
  """Runs the demo; returns the exit status.

  0: done; 1: failed (a configuration whose loss is not finite included,
  after the table and ``results.json`` are written); 2: bad flags, or the
  ``--checkpoint-dir`` is in use by another run.
  """
  argv = sys.argv[1:] if argv is None else list(argv)
  parser = build_parser()
  try:
    args = parser.parse_args(argv)
    settings = _settings(args, parser.config_names)  # type: ignore[attr-defined]
  except _UsageError as e:
    print(f"{_PROG}: error: {e} (see {_PROG} --help)", file=sys.stderr)
    return 2
  if args._process is not None:
    # A worker of a --num-processes run: it ends with its launcher.
    watcher = _LauncherWatch(args._process, settings["out"])
    if watcher.orphaned():
      watcher.remove_folder()
      return 1
    try:
      return _run(args, argv, settings)
    finally:
      if watcher.orphaned():
        watcher.remove_folder()
  from jmp_train_examples import checkpoint_lock

  with contextlib.ExitStack() as stack:
    if settings["checkpoint_dir"] is not None:
      # One run per checkpoint folder, refused before anything is imported.
      try:
        stack.enter_context(checkpoint_lock.hold(settings["checkpoint_dir"]))
      except checkpoint_lock.CheckpointDirBusy as e:
        print(f"{_PROG}: error: {e}", file=sys.stderr)
        return 2
      except OSError as e:
        print(
          f"{_PROG}: error: --checkpoint-dir {settings['checkpoint_dir']}: cannot write "
          f"there ({e.strerror or type(e).__name__})",
          file=sys.stderr,
        )
        return 2
    return _run(args, argv, settings)


def _run(args: argparse.Namespace, argv: list[str], settings: dict) -> int:
  """The demo once the flags are read; returns the exit status."""
  try:
    plot_note = _check_optional_dependencies(settings)
    _check_output_dir(settings["out"])
  except _UsageError as e:
    print(f"{_PROG}: error: {e} (see {_PROG} --help)", file=sys.stderr)
    return 2
  except _DependencyError as e:
    print(f"{_PROG}: error: {e}", file=sys.stderr)
    return 1
  try:
    from jmp_train_examples import stopping

    # A worker process leaves SIGTERM to jax.distributed's preemption
    # service: the workers agree on a step, save it and stop together.
    with stopping.sigterm_unwinds(args._process is None):
      _setup_jax(args._process)
      from jmp_train_examples import demo

      s = demo.DemoSettings(**settings)
      # The flags worker processes inherit (the launcher sets the others).
      rows = demo.run_demo(s, argv_base=_strip(argv), worker=args._process is not None)
    if args._process is None:
      print(demo.format_table(rows))
      print(
        f"\nwritten: {os.path.join(s.out, 'results.json')}"
        + (f", {os.path.join(s.out, 'results.png')}" if s.plot else "")
      )
      if plot_note:
        print(plot_note)
      failed = [r for r in rows if r.get("failed")]
      if failed:
        # After everything is written: the table and results.json flag the rows.
        print(
          f"{_PROG}: error: "
          + "; ".join(
            f"configuration {r['config']!r} failed: {r['failed']} (train_loss "
            f"{r['train_loss']:.4g}, val_loss {r['val_loss']:.4g})"
            for r in failed
          )
          + "; marked failed in results.json (try dynamic loss scaling, a bfloat16 "
          "policy, or a lower --lr)",
          file=sys.stderr,
        )
        return 1
  except KeyboardInterrupt:
    print(f"{_PROG}: interrupted", file=sys.stderr)
    return 130
  except _terminated():
    print(
      f"{_PROG}: terminated (SIGTERM); run the same command again to resume from the latest checkpoint"
      if settings["checkpoint_dir"]
      else f"{_PROG}: terminated (SIGTERM)",
      file=sys.stderr,
    )
    return 128 + signal.SIGTERM
  except Exception as e:
    # One line, never a traceback; JMP_TRAIN_DEBUG=1 shows it.
    if os.environ.get("JMP_TRAIN_DEBUG"):
      raise
    message = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    print(f"{_PROG}: error: {type(e).__name__ + ': ' if not isinstance(e, _known()) else ''}{message}", file=sys.stderr)
    return 1
  return 0


class _LauncherWatch:
  """Ends this worker process when the launcher that started it is gone.

  ``process`` is the launcher's ``--_process`` value, ``index,count,port,
  launcher pid``. On Linux the kernel sends SIGTERM when the launcher dies
  (``prctl(PR_SET_PDEATHSIG)``): jax.distributed's preemption service then
  has every worker save the same step and stop. Elsewhere a thread that
  polls the parent pid sends the SIGTERM. A worker still running
  ``_ORPHAN_EXIT_S`` seconds after its launcher went (a peer that never
  started, a stuck collective) exits at once. An orphaned worker removes
  the launcher's temporary folder (its ``--out``) as it ends: a launcher
  killed with SIGKILL cannot.
  """

  def __init__(self, process: str, out: str):
    fields = process.split(",")
    launcher = int(fields[3]) if len(fields) > 3 else os.getppid()
    self._out = out
    self._parent = os.getppid()
    self._gone = self._parent != launcher and not _alive(launcher)
    if self._gone:
      return
    pdeathsig = False
    if sys.platform.startswith("linux"):
      try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        pdeathsig = libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) == 0
      except (OSError, AttributeError):
        pass
    # The launcher may have died before prctl: then the parent has changed.
    self._gone = os.getppid() != self._parent
    if not self._gone:
      threading.Thread(target=self._watch, args=(not pdeathsig,), daemon=True, name="jmp-train-launcher-watch").start()

  def orphaned(self) -> bool:
    return self._gone or os.getppid() != self._parent

  def remove_folder(self) -> None:
    from jmp_train_examples.processes import WORKER_FOLDER_PREFIX

    if os.path.basename(os.path.normpath(self._out)).startswith(WORKER_FOLDER_PREFIX):
      shutil.rmtree(self._out, ignore_errors=True)

  def _watch(self, send_sigterm: bool) -> None:
    while os.getppid() == self._parent:
      time.sleep(0.5)
    if send_sigterm:
      os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(_ORPHAN_EXIT_S)
    self.remove_folder()
    os._exit(1)


# linux/prctl.h
_PR_SET_PDEATHSIG = 1
# Seconds an orphaned worker has to save and stop before it exits regardless.
_ORPHAN_EXIT_S = 30


def _alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:
    return True
  return True


def _terminated():
  from jmp_train_examples.stopping import Terminated

  return Terminated


def _known():
  from jmp_train_examples.demo import DemoError

  return (DemoError, ImportError, ValueError)


def _strip(argv: list[str]) -> list[str]:
  """Drops flags the launcher sets itself for worker processes."""
  out, skip = [], False
  for a in argv:
    if skip:
      skip = False
      continue
    name = a.split("=")[0]
    if name in ("--configs", "--out", "--num-processes", "--_process"):
      skip = "=" not in a
      continue
    if name in ("--no-plot", "--no-progress"):
      continue
    out.append(a)
  return out


if __name__ == "__main__":
  sys.exit(main())
