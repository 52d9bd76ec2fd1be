"""Data-parallel step time across processes: float32 vs bfloat16, float8, 1-bit.

P processes (2 and 4) on ``127.0.0.1`` join a ``jax.distributed`` job with
gloo CPU collectives and one CPU device each: the code path of several
hosts. Each runs the same data-parallel step of an MLP (SGD; each process's
own batch shard; local gradients, then one exchange) with:

* ``float32``: ``lax.pmean`` of the float32 gradients (one all-reduce per
  leaf, what a plain optax step does);
* ``float32_buckets``: the same mean over the gradients flattened into
  25 MB buckets, last layers first (:func:`jmp_train.make_train_step`'s
  uncompressed exchange; a leaf of 4 MB or more is averaged where it
  is); ``float32_b4MB``: the same with 4 MB buckets;
* ``bfloat16`` / ``float8_e4m3``: :func:`jmp_train.compressed_mean`
  (``bfloat16_b4MB``: the same in 4 MB buckets, last layers first);
* ``1bit_column`` / ``1bit_l1``: :func:`jmp_train.sign_compression`
  (``1bit_column_b4MB`` / ``1bit_l1_b4MB``: in 4 MB buckets, last layers
  first, each exchanged on its own).

Per scheme: ``step_ms`` (the whole step), ``compute_ms`` (forward and
backward alone), ``exchange_ms`` (the exchange alone, on given gradients:
codec and communication), ``codec_ms`` (the codec alone in one process, no
communication: ``axis_name=None``; for 1-bit only the worker side, for
bfloat16/float8 quantize + dequantize; 0 for float32), ``comm_ms`` =
``exchange_ms - codec_ms`` (an estimate), ``wire_bytes`` (per process, from
the compiled step's HLO, :func:`jmp_train.diagnostics.collective_bytes`) and
``vs_float32`` (step-time ratio; below 1 is faster). Medians of
interleaved rounds.

Links: the loopback as is, and capped at 1 and 10 Gbit/s with a token
bucket on ``lo`` (``tc qdisc add dev lo root tbf rate R burst 256kbit
latency 50ms``) when the process runs as root and ``tc`` is present; the
cap is removed afterwards, also on failure or interrupt, and only ``lo`` is
ever touched. Every record names its link (``cap``) or why no cap was set
(``cap_note``). Other processes on the machine share the cores and, while a
cap is set, the loopback: the figures are noisy.

``BENCH_MULTIPROCESS_DONATE=1`` makes the step donate its parameters and
optimizer state (and the exchange and the codec their state), as
:func:`jmp_train.make_train_step` does; ``=both`` times the donated steps
and, in the same rounds, the steps without donation
(``step_ms_undonated``, ``vs_float32_undonated``). Each record says whether
its step donated (``donated``).

``BENCH_MULTIPROCESS_PIN=1`` keeps process ``i`` on core ``i mod cores``
(``sched_setaffinity``), as one pins a process per core or socket on a
host: XLA then runs each process on one thread, where unpinned processes
each start a thread per core and, with more processes than cores, every
parallel loop waits for its slowest thread. Each record says whether its
processes were pinned (``pinned``) and the cores process 0 ran on
(``cores``). Pinning needs Linux; ``--quick`` pins where it can.

``BENCH_MULTIPROCESS_KEEP_FREED=1`` starts the processes with glibc's
malloc told to keep the memory it frees (``MALLOC_MMAP_THRESHOLD_`` of 1 GiB,
``MALLOC_TRIM_THRESHOLD_`` of 8 GiB; see ``mallopt(3)``). By default glibc
serves a large block from a fresh mapping (every block above 32 MB; its
threshold starts at 128 KiB and rises with the blocks freed) and returns
it to the kernel when freed, so every step faults in new pages for the
large buffers XLA allocates per execution (its temporaries, the outputs
that are not donated); on a virtual machine a fault costs microseconds per
4 KiB page.
Each record says whether its processes kept freed memory (``keep_freed``);
``--quick`` keeps it where glibc is the C library.

``BENCH_MULTIPROCESS_SIZES`` (comma-separated of ``1M,8M,32M``),
``BENCH_MULTIPROCESS_PROCESSES`` (e.g. ``2,4``) and
``BENCH_MULTIPROCESS_LINKS`` (of ``none,10gbit,1gbit``) and
``BENCH_MULTIPROCESS_SCHEMES`` (of the schemes above) restrict the full run;
``float32``, the reference of every ratio, always runs. An unknown size or
scheme is a ``ValueError`` that lists the valid ones.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pathlib
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

from jmp_train_examples.processes import free_port, run_processes

NAME = "multiprocess"
COLUMNS = (
  "link",
  "processes",
  "params",
  "scheme",
  "step_ms",
  "vs_float32",
  "compute_ms",
  "exchange_ms",
  "codec_ms",
  "comm_ms",
  "wire_bytes",
  "wire_vs_float32",
)
AXIS = "data"
SIZES = {  # MLP layer widths (input 784, output 10)
  "tiny": (64, 10),
  "1M": (784, 1024, 256, 10),
  "8M": (784, 2048, 2048, 1024, 10),
  "32M": (784, 4096, 4096, 2048, 10),
}
SCHEMES = (
  "float32",
  "float32_buckets",
  "float32_b4MB",
  "bfloat16",
  "bfloat16_b4MB",
  "float8_e4m3",
  "1bit_column",
  "1bit_column_b4MB",
  "1bit_l1",
  "1bit_l1_b4MB",
)
PER_PROCESS_BATCH = 32
# glibc's malloc keeps freed memory: no mmap per large buffer, no trim.
KEEP_FREED_ENV = {"MALLOC_MMAP_THRESHOLD_": str(2**30), "MALLOC_TRIM_THRESHOLD_": str(2**33)}
ROOT = pathlib.Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------------------
# The parent: loopback caps and process launch.
# ---------------------------------------------------------------------------


def _cap_unavailable() -> str | None:
  if not hasattr(os, "geteuid") or os.geteuid() != 0:
    return "not root: the loopback cannot be shaped"
  if shutil.which("tc") is None:
    return "tc not found (apt-get install -y iproute2)"
  shown = subprocess.run(["tc", "qdisc", "show", "dev", "lo"], capture_output=True, text=True)
  if "tbf" in shown.stdout or "netem" in shown.stdout:
    return f"lo already has a qdisc set by someone else: {shown.stdout.strip()}"
  return None


@contextlib.contextmanager
def loopback_cap(rate: str | None):
  """Caps ``lo`` at ``rate`` (e.g. ``"1gbit"``) while the block runs.

  Yields ``{"link", "cap", "cap_note"}``. The qdisc is deleted on exit,
  exception, ``KeyboardInterrupt`` or SIGTERM (turned into ``SystemExit``
  for the duration); nothing is touched when it could not be added.
  """
  if rate is None:
    yield {"link": "loopback", "cap": None, "cap_note": "loopback as is"}
    return
  reason = _cap_unavailable()
  # The bucket must hold a whole packet: tbf never sends a packet larger than
  # its burst, and loopback packets reach the interface's MTU (64 KiB), so a
  # smaller burst stalls every TCP connection that sends a full segment.
  mtu = int(pathlib.Path("/sys/class/net/lo/mtu").read_text()) if reason is None else 65536
  add = ["tc", "qdisc", "add", "dev", "lo", "root", "tbf", "rate", rate, "burst", str(4 * mtu), "latency", "50ms"]
  if reason is None:
    res = subprocess.run(add, capture_output=True, text=True)
    reason = None if res.returncode == 0 else f"tc failed: {res.stderr.strip()}"
  if reason is not None:
    yield {"link": f"lo<={rate} (not applied)", "cap": None, "cap_note": reason}
    return

  def on_term(signum, frame):
    raise SystemExit(128 + signum)

  previous = signal.signal(signal.SIGTERM, on_term)
  try:
    yield {"link": f"lo<={rate}", "cap": " ".join(add[3:]), "cap_note": "tc tbf on lo"}
  finally:
    subprocess.run(["tc", "qdisc", "del", "dev", "lo", "root"], capture_output=True)
    signal.signal(signal.SIGTERM, previous)


_CAN_PIN = hasattr(os, "sched_setaffinity")
_GLIBC = platform.libc_ver()[0] == "glibc"


def launch(
  processes: int,
  size: str,
  rounds: int,
  schemes=SCHEMES,
  timeout: float = 1800,
  donate: bool | str = False,
  pin: bool = False,
  keep_freed: bool = False,
  xla_flags: str = "",
) -> list[dict]:
  """Runs the step in ``processes`` processes; returns process 0's records.

  ``donate``: ``True``, ``False``, or ``"both"`` (donated steps, and the
  same steps without donation timed beside them). ``pin``: process ``i``
  runs on core ``i mod cores`` alone (XLA then runs it on one thread).
  ``keep_freed``: the processes' malloc keeps the memory it frees
  (``KEEP_FREED_ENV``). ``xla_flags``: more ``XLA_FLAGS`` for the processes.
  """
  if pin and not _CAN_PIN:
    raise ValueError("pin=True needs os.sched_setaffinity (Linux); this platform has none.")
  if keep_freed and not _GLIBC:
    raise ValueError(f"keep_freed=True needs glibc's malloc; this platform has {platform.libc_ver()}.")
  args = ["--size", size, "--rounds", str(rounds), "--schemes", ",".join(schemes)]
  args += {"both": ["--donate", "--also-undonated"], True: ["--donate"]}.get(donate, [])
  return launch_workers(
    "benchmarks.bench_multiprocess",
    args,
    processes,
    pin=pin,
    env=KEEP_FREED_ENV if keep_freed else {},
    timeout=timeout,
    xla_flags=f"--xla_cpu_collective_call_terminate_timeout_seconds=900 {xla_flags}".strip(),
  )


def launch_workers(
  module: str,
  args: list[str],
  processes: int,
  *,
  pin: bool,
  env: dict[str, str],
  timeout: float,
  xla_flags: str = "",
) -> list[dict]:
  """Runs ``python -m module ... args`` as ``processes`` workers of one job; returns process 0's records.

  Each worker gets ``--port`` (a free coordinator port), ``--processes``,
  ``--process-id``, ``--out`` (where process 0 writes its records as JSON)
  and, with ``pin``, ``--core`` (core ``i mod cores``): the arguments of
  :func:`worker_parser`. One CPU device per process (``xla_flags`` added
  to the flag that says so), ``env`` added to this process's environment.
  """
  cores = sorted(os.sched_getaffinity(0)) if pin else []
  full_env = dict(os.environ)
  full_env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count=1 {xla_flags}".strip()
  full_env["JAX_PLATFORMS"] = "cpu"
  full_env.update(env)
  full_env["PYTHONPATH"] = os.pathsep.join([str(ROOT), full_env.get("PYTHONPATH", "")])
  with tempfile.TemporaryDirectory() as tmp:
    out = pathlib.Path(tmp) / "records.json"
    cmd = [sys.executable, "-m", module, "--port", str(free_port()), "--processes", str(processes)]
    cmd += args + ["--out", str(out)]
    pins = [["--core", str(cores[i % len(cores)])] if pin else [] for i in range(processes)]
    done = run_processes(
      [cmd + ["--process-id", str(i)] + pins[i] for i in range(processes)], full_env, timeout=timeout, cwd=ROOT
    )
    # Process 0 writes the records before leaving the job; a later failure
    # of the distributed shutdown (a slow peer under load) loses nothing.
    if not out.exists():
      bad = [(code, log) for code, log in done if code != 0]
      code, log = bad[0] if bad else done[0]
      raise RuntimeError(f"worker exited with {code} and no records:\n{log[-3000:]}")
    return json.loads(out.read_text())


def worker_parser(description: str) -> argparse.ArgumentParser:
  """A worker's command line: the arguments :func:`launch_workers` passes."""
  parser = argparse.ArgumentParser(description=description)
  parser.add_argument("--process-id", type=int, required=True)
  parser.add_argument("--processes", type=int, required=True)
  parser.add_argument("--port", type=int, required=True)
  parser.add_argument("--core", type=int, help="run on this core alone (before jax starts)")
  parser.add_argument("--out", required=True)
  return parser


def start_worker(args: argparse.Namespace, worker) -> int:
  """Pins the process to ``args.core`` (if given), then runs ``worker(args)``."""
  if args.core is not None:
    os.sched_setaffinity(0, {args.core})
  return worker(args)


def _env_names(variable: str, default, valid) -> tuple[str, ...]:
  """The comma-separated names in the environment ``variable`` (else ``default``).

  Raises:
    ValueError: if a name is not one of ``valid``, or none is given.
  """
  value = os.environ.get(variable)
  names = default if value is None else tuple(n for n in value.split(",") if n)
  unknown = [n for n in names if n not in valid]
  if unknown or not names:
    raise ValueError(f"{variable}={value!r}: unknown {unknown or 'empty list'}; valid: {', '.join(valid)}.")
  return tuple(names)


def run(quick: bool) -> list[dict]:
  schemes = SCHEMES
  xla_flags = ""
  if quick:  # a smoke test of the code: float32, a compressed_mean and a 1-bit scheme
    from benchmarks import _harness

    plan, links, rounds, schemes = [(2, "tiny")], (None,), 1, ("float32", "bfloat16", "1bit_l1")
    donate, pin, keep_freed, xla_flags = True, _CAN_PIN, _GLIBC, _harness.QUICK_XLA_FLAGS
  else:
    sizes = _env_names("BENCH_MULTIPROCESS_SIZES", ("1M", "8M", "32M"), tuple(SIZES))
    procs = [int(p) for p in os.environ.get("BENCH_MULTIPROCESS_PROCESSES", "2,4").split(",")]
    links = os.environ.get("BENCH_MULTIPROCESS_LINKS", "none,10gbit,1gbit").split(",")
    links = tuple(None if link == "none" else link for link in links)
    # float32 always runs: it is the reference of every ratio.
    schemes = _env_names("BENCH_MULTIPROCESS_SCHEMES", SCHEMES, SCHEMES)
    schemes = ("float32",) + tuple(s for s in schemes if s != "float32")
    plan, rounds = [(p, s) for p in procs for s in sizes], 5
    donate = os.environ.get("BENCH_MULTIPROCESS_DONATE", "0")
    donate = {"1": True, "both": "both"}.get(donate, False)
    pin = os.environ.get("BENCH_MULTIPROCESS_PIN", "0") == "1"
    keep_freed = os.environ.get("BENCH_MULTIPROCESS_KEEP_FREED", "0") == "1"
  records = []
  for rate in links:
    with loopback_cap(rate) as link:
      for processes, size in plan:
        options = dict(donate=donate, pin=pin, keep_freed=keep_freed, xla_flags=xla_flags)
        for r in launch(processes, size, rounds, schemes, **options):
          records.append({**link, **r, "pinned": pin, "keep_freed": keep_freed})
          print(json.dumps(records[-1]), flush=True)  # progress, if a later run fails
  return records


# ---------------------------------------------------------------------------
# A worker process.
# ---------------------------------------------------------------------------


def _init_mlp(widths):
  import numpy as np

  rng = np.random.default_rng(0)
  params = {}
  for i, (m, n) in enumerate(zip(widths[:-1], widths[1:])):
    params[f"w{i}"] = (rng.normal(size=(m, n)) / np.sqrt(m)).astype(np.float32)
    params[f"b{i}"] = np.zeros((n,), np.float32)
  return params


def _loss(params, x, y):
  import jax.numpy as jnp

  h = x
  layers = len(params) // 2
  for i in range(layers):
    h = h @ params[f"w{i}"] + params[f"b{i}"]
    if i < layers - 1:
      h = jnp.tanh(h)
  return jnp.mean((h - y) ** 2)


def _transform(scheme: str, axis_name):
  import jax
  import optax

  from jmp_train import bucketed_mean, compressed_mean, sign_compression

  if scheme.startswith("float32"):
    if axis_name is None:
      return optax.identity()
    if scheme == "float32_buckets":
      mean = lambda u: bucketed_mean(u, axis_name)
    elif scheme == "float32_b4MB":
      mean = lambda u: bucketed_mean(u, axis_name, 4 * 2**20)
    else:
      mean = lambda u: jax.lax.pmean(u, axis_name)
    return optax.GradientTransformation(lambda _: optax.EmptyState(), lambda u, s, p=None: (mean(u), s))
  wire, _, bucket = scheme.partition("_b")
  bucket_bytes = int(bucket[:-2]) * 2**20 if bucket else None
  if scheme.startswith("1bit_"):
    return sign_compression(axis_name, scale=wire.removeprefix("1bit_"), bucket_bytes=bucket_bytes)
  return compressed_mean(axis_name, wire=wire, bucket_bytes=bucket_bytes)


def _programs(scheme, mesh, params, batch, grads_local, donate: bool):
  """(step, exchange, state, wire bytes) for one scheme.

  With ``donate``, the step donates its parameters and optimizer state and
  the exchange its state, as :func:`jmp_train.make_train_step` does: the
  new ones are written in place of the old.
  """
  import jax
  import optax
  from jax.sharding import PartitionSpec as P

  from jmp_train.diagnostics import collective_bytes
  from jmp_train import sign_compression_specs

  tx = optax.chain(_transform(scheme, AXIS), optax.sgd(0.01))
  shapes = jax.eval_shape(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=P()), params)
  specs = sign_compression_specs(shapes, AXIS)
  state = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=specs))(params)

  def local_step(p, s, x, y):
    grads = jax.grad(_loss)(jax.lax.pcast(p, AXIS, to="varying"), x, y)
    u, s = tx.update(grads, s, p)
    return optax.apply_updates(p, u), s

  def exchange(g, s, p):
    # The state first: jit aliases a donated input to the first output of
    # its shape, and the updates have the residuals' shapes.
    u, s = tx.update(jax.tree.map(lambda x: x[0], g), s, p)
    return s, u

  step = jax.jit(
    jax.shard_map(local_step, mesh=mesh, in_specs=(P(), specs, P(AXIS), P(AXIS)), out_specs=(P(), specs)),
    donate_argnums=(0, 1) if donate else (),
  )
  exch = jax.jit(
    jax.shard_map(exchange, mesh=mesh, in_specs=(P(AXIS), specs, P()), out_specs=(specs, P())),
    donate_argnums=(1,) if donate else (),
  )
  # The compiled step is the one timed: compiling it a second time on the
  # first call would only cost time.
  step = step.lower(params, state, *batch).compile()
  wire = collective_bytes(step, wire=True)["total"]
  return step, exch, state, wire


def _median_ms(calls: dict, rounds: int) -> dict[str, float]:
  """Median milliseconds of each call over interleaved rounds, after two warm-up rounds."""
  import jax

  times = {k: [] for k in calls}
  for _ in range(2):  # warm-up
    for fn in calls.values():
      jax.block_until_ready(fn())
  for _ in range(rounds):
    for k, fn in calls.items():
      start = time.perf_counter()
      jax.block_until_ready(fn())  # wait: queued collectives can starve
      times[k].append(time.perf_counter() - start)
  return {k: 1e3 * statistics.median(v) for k, v in times.items()}


def _records(args, schemes, ms, wire, n_params: int, undonated: bool) -> list[dict]:
  """One record per scheme from the median times ``ms`` and the wire bytes."""
  records = []
  for s in schemes:
    codec = ms.get(f"codec:{s}", 0.0)
    records.append(
      {
        "processes": args.processes,
        "params": n_params,
        "scheme": s,
        "donated": args.donate,
        "step_ms": ms[f"step:{s}"],
        "vs_float32": ms[f"step:{s}"] / ms["step:float32"],
        "compute_ms": ms["compute"],
        "exchange_ms": ms[f"exchange:{s}"],
        "codec_ms": codec,
        "comm_ms": max(ms[f"exchange:{s}"] - codec, 0.0),
        "wire_bytes": wire[s],
        "wire_vs_float32": wire[s] / wire["float32"],
        "cores": sorted(os.sched_getaffinity(0)) if _CAN_PIN else None,
      }
    )
    if undonated:
      records[-1]["step_ms_undonated"] = ms[f"undonated:{s}"]
      records[-1]["vs_float32_undonated"] = ms[f"undonated:{s}"] / ms["undonated:float32"]
  return records


def _mesh_params_batch(size: str, process_id: int):
  """The one-axis mesh over every process's device, the replicated MLP, and the batch.

  Each process contributes its own ``PER_PROCESS_BATCH`` examples.
  """
  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  mesh = jax.make_mesh((jax.device_count(),), (AXIS,), devices=jax.devices())
  widths = SIZES[size]
  params = jax.device_put(jax.tree.map(jnp.asarray, _init_mlp(widths)), NamedSharding(mesh, P()))
  rng = np.random.default_rng(process_id)
  local = (
    rng.normal(size=(PER_PROCESS_BATCH, widths[0])).astype(np.float32),
    rng.normal(size=(PER_PROCESS_BATCH, widths[-1])).astype(np.float32),
  )
  shard = NamedSharding(mesh, P(AXIS))
  return mesh, params, tuple(jax.make_array_from_process_local_data(shard, a) for a in local)


def _worker(args) -> int:
  import jax

  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(f"127.0.0.1:{args.port}", num_processes=args.processes, process_id=args.process_id)
  import jax.numpy as jnp
  import numpy as np
  from jax.sharding import PartitionSpec as P

  mesh, params, batch = _mesh_params_batch(args.size, args.process_id)
  n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
  compute = jax.jit(
    jax.shard_map(
      lambda p, x, y: jax.tree.map(lambda g: g[None], jax.grad(_loss)(jax.lax.pcast(p, AXIS, to="varying"), x, y)),
      mesh=mesh,
      in_specs=(P(), P(AXIS), P(AXIS)),
      out_specs=P(AXIS),
    )
  )
  grads = jax.block_until_ready(compute(params, *batch))
  local_grads = jax.tree.map(lambda g: jnp.asarray(g.addressable_data(0)[0]), grads)

  schemes = args.schemes.split(",")
  donate = args.donate
  progs = {s: _programs(s, mesh, params, batch, local_grads, donate) for s in schemes}
  # The same steps without donation, timed in the same rounds.
  undonated = {s: _programs(s, mesh, params, batch, local_grads, False)[0] for s in schemes if args.also_undonated}
  codecs = {}
  for s in schemes:
    if not s.startswith("float32"):
      tx = _transform(s, None)
      codec = lambda g, st, tx=tx: tx.update(g, st)[::-1]  # the state first, as in `exchange`
      codecs[s] = (jax.jit(codec, donate_argnums=(1,) if donate else ()), tx.init(local_grads))
  # The arguments each call uses next: with donation, copies at first, then
  # what the last call returned (a donated input is deleted).
  copy = (lambda tree: jax.tree.map(jnp.copy, tree)) if donate else (lambda tree: tree)
  live = {}
  for s, (_, _, state, _) in progs.items():
    live[f"step:{s}"] = (copy(params), copy(state))
    live[f"exchange:{s}"] = copy(state)
  for s, (_, st) in codecs.items():
    live[f"codec:{s}"] = st

  def call(key, fn):
    out = fn(live[key])
    if donate:
      live[key] = out if key.startswith("step:") else out[0]
    return out

  calls = {"compute": lambda: compute(params, *batch)}
  for s, (step, exch, _, _) in progs.items():
    calls[f"step:{s}"] = lambda s=s, step=step: call(f"step:{s}", lambda a: step(*a, *batch))
    calls[f"exchange:{s}"] = lambda s=s, exch=exch: call(f"exchange:{s}", lambda st: exch(grads, st, params))
  for s, step in undonated.items():
    calls[f"undonated:{s}"] = lambda step=step, state=progs[s][2]: step(params, state, *batch)
  for s, (fn, _) in codecs.items():
    calls[f"codec:{s}"] = lambda s=s, fn=fn: call(f"codec:{s}", lambda st: fn(local_grads, st))
  ms = _median_ms(calls, args.rounds)
  wire = {s: prog[3] for s, prog in progs.items()}
  records = _records(args, schemes, ms, wire, n_params, bool(undonated))
  if args.process_id == 0:
    pathlib.Path(args.out).write_text(json.dumps(records))
  jax.distributed.shutdown()
  return 0


def main(argv=None) -> int:
  parser = worker_parser("one process of the multiprocess benchmark")
  parser.add_argument("--size", choices=tuple(SIZES), required=True)
  parser.add_argument("--rounds", type=int, default=5)
  parser.add_argument("--schemes", default=",".join(SCHEMES))
  parser.add_argument("--donate", action="store_true")
  parser.add_argument("--also-undonated", action="store_true")
  return start_worker(parser.parse_args(argv), _worker)


if __name__ == "__main__":
  sys.exit(main())
