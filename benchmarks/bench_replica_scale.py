"""The 1-bit step against the replica count K: program size, compile and step times, and a projection.

Part ``measured``: ``make_train_step(mode="shard_map")`` of a
1,068,810-parameter MLP (784-1024-256-10, 8 examples per replica) on
K = 8, 16, 32 and 64 simulated CPU devices, each K in a process of its own
(``XLA_FLAGS=--xla_force_host_platform_device_count=K``), for four steps
(``scheme``): ``float32`` (a float32 ``pmean`` and SGD with momentum 0.9),
``sign_compression`` (:func:`jmp_train.sign_compression` before the same
SGD), ``one_bit_momentum`` and ``one_bit_adam`` (``warmup_steps=1``), every
other option at its default. ``hlo_lines``: lines of the lowered step's
StableHLO (the per-replica program); ``lower_s`` and ``compile_s``: tracing
and lowering, XLA's compilation; ``first_step_s``: both plus the first
call; ``step_s``: the median of the following calls (the K replicas share
this machine's cores, so it grows with K); ``step_per_replica_s``:
``step_s / K``. A step whose process runs past its time budget has no
record.

Part ``projection`` (a model, not a measurement): the seconds one step's
gradient exchange takes on K replicas under an alpha-beta model, for a
GPT-2-small-shaped (124M parameters) and a GPT-3-XL-shaped (1.3B) model,
at 10, 100 and 400 Gbit/s per replica, K up to 1,024:

* ``ring_allreduce_ms``: a float32 ring all-reduce,
  ``2(K-1)·alpha + 2(K-1)/K·4N/B``;
* ``one_bit_ms``: the two-phase 1-bit exchange of ``sign_compression``
  (column scales): its all-to-all and all-gather, ``2(K-1)·alpha +
  2(K-1)·(S/8 + 8M)/B`` with the chunk ``S`` and pairs ``M`` of the actual
  layout (:func:`jmp_train.sign_compression_wire_bytes` of the model's
  leaves: padding and pairs included), plus the codec's compute, ``c·N``,
  where ``c`` is the codec's time per element (a replica's whole
  ``sign_compression`` update at one replica, the 1.1M MLP row: an upper
  bound, as one replica re-encodes the whole gradient where each of K
  re-encodes ``1/K`` of it; per phase in older results: worker with
  donated residual + owner + final decode at K = 8) measured by the
  ``compression`` benchmark and
  stored in ``results/compression-<device>.json`` (``codec``: which device's
  file; ``c_ns`` its value);
* ``alpha = 10 µs`` per message, ``B`` the link's bytes per second; the
  exchange does not overlap with compute, and the codec and the wire do
  not overlap with each other. ``one_bit_speedup``: ring over 1-bit.

``--quick``: K = 2 in the calling process (its first two devices), a
16-10 MLP (one layer: the 1-bit steps' programs grow with the leaves), one
timed step; the projection as in a full run.

Environment (full runs): ``BENCH_REPLICA_SCALE_KS`` (comma-separated
replica counts, default ``8,16,32,64``; the stored run adds 128 and 256: about 5
minutes in all on this project's 2-core machine), ``BENCH_REPLICA_SCALE_SCHEMES``
(default all four) and ``BENCH_REPLICA_SCALE_BUDGET_S`` (seconds per K
process, default 600).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import time

import numpy as np

from benchmarks import _harness

NAME = "replica_scale"
COLUMNS = (
  "part",
  "scheme",
  "replicas",
  "hlo_lines",
  "lower_s",
  "compile_s",
  "first_step_s",
  "step_s",
  "step_per_replica_s",
  "model",
  "params",
  "link_gbit_s",
  "codec",
  "c_ns",
  "ring_allreduce_ms",
  "one_bit_ms",
  "one_bit_speedup",
)
AXIS = "batch"
SCHEMES = ("float32", "sign_compression", "one_bit_momentum", "one_bit_adam")
ROOT = pathlib.Path(__file__).resolve().parents[1]
PER_REPLICA_BATCH = 8
STEADY_STEPS = 5


# --- Part 1: measured ------------------------------------------------------


def _step(scheme: str, sizes: tuple[int, ...], mesh, compiler_options=None):
  """``make_train_step`` of an MLP of ``sizes`` for ``scheme`` on ``mesh`` (compiled with ``compiler_options``)."""
  import flax.linen as nn
  import optax

  import jmp_train

  class Mlp(nn.Module):
    @nn.compact
    def __call__(self, x):
      for width in sizes[1:-1]:
        x = nn.relu(nn.Dense(width)(x))
      return nn.Dense(sizes[-1])(x)

  def loss(logits, labels):
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

  sgd = optax.sgd(0.01, momentum=0.9)
  optimizer, compression = {
    "float32": (sgd, None),
    "sign_compression": (sgd, jmp_train.sign_compression(AXIS)),
    "one_bit_momentum": (None, jmp_train.one_bit_momentum(0.01, 0.9, axis_name=AXIS)),
    "one_bit_adam": (None, jmp_train.one_bit_adam(1e-3, axis_name=AXIS, warmup_steps=1)),
  }[scheme]
  model = Mlp()
  step = jmp_train.make_train_step(
    model.apply,
    loss,
    optimizer,
    compression=compression,
    mode="shard_map",
    axis_name=AXIS,
    mesh=mesh,
    compiler_options=compiler_options,
  )
  import jax
  import jax.numpy as jnp

  params = model.init(jax.random.key(0), jnp.zeros((1, sizes[0])))["params"]
  return step, params


def measure(
  k: int,
  schemes,
  sizes=(784, 1024, 256, 10),
  steps: int = STEADY_STEPS,
  devices=None,
  emit=None,
  compiler_options=None,
) -> list[dict]:
  """The measured records of ``schemes`` on ``k`` devices (``devices``, default the first ``k``).

  ``compiler_options``: the steps' (``make_train_step``'s; ``None``: its defaults).
  """
  import jax

  devices = (devices or jax.devices())[:k]
  mesh = jax.make_mesh((k,), (AXIS,), devices=devices)
  rng = np.random.default_rng(0)
  x = rng.normal(size=(PER_REPLICA_BATCH * k, sizes[0])).astype(np.float32)
  y = rng.integers(0, sizes[-1], size=(PER_REPLICA_BATCH * k,)).astype(np.int32)
  records = []
  for scheme in schemes:
    step, params = _step(scheme, sizes, mesh, compiler_options)
    state = step.init(params)
    batch = step.shard_batch((x, y))
    start = time.perf_counter()
    lowered = step.lower(state, batch)
    lines = len(lowered.as_text().splitlines())
    lower_s = time.perf_counter() - start
    start = time.perf_counter()
    compiled = lowered.compile()
    compile_s = time.perf_counter() - start
    start = time.perf_counter()
    state, metrics = compiled(state, batch)
    _harness.block((state, metrics))
    first = time.perf_counter() - start
    times = []
    for _ in range(steps):
      start = time.perf_counter()
      state, metrics = compiled(state, batch)
      _harness.block((state, metrics))
      times.append(time.perf_counter() - start)
    step_s = float(np.median(times))
    record = {
      "part": "measured",
      "scheme": scheme,
      "replicas": k,
      "hlo_lines": lines,
      "lower_s": lower_s,
      "compile_s": compile_s,
      "first_step_s": lower_s + compile_s + first,
      "step_s": step_s,
      "step_per_replica_s": step_s / k,
    }
    records.append(record)
    if emit is not None:
      emit(record)
  return records


def _child(k: int, schemes) -> None:
  """One K's process: prints each record as a JSON line once measured."""
  measure(k, schemes, emit=lambda r: print(json.dumps(r), flush=True))


def _measured(ks, schemes, budget_s: int) -> list[dict]:
  records = []
  for k in ks:
    env = dict(os.environ)
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={k}"
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    cmd = [sys.executable, "-m", "benchmarks.bench_replica_scale", "--child", str(k), "--schemes", ",".join(schemes)]
    try:
      done = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=budget_s)
      out, err, code = done.stdout, done.stderr, done.returncode
    except subprocess.TimeoutExpired as exc:
      out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
      err, code = f"timed out after {budget_s} s", 0
    got = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    if code != 0:
      raise RuntimeError(f"K={k}: exited with {code}:\n{err[-3000:]}")
    if len(got) < len(schemes):
      print(f"replica_scale: K={k}: {err.strip()[-200:]}; measured {[r['scheme'] for r in got]}", file=sys.stderr)
    records += got
  return records


# --- Part 2: projection ----------------------------------------------------

ALPHA_S = 10e-6
LINKS_GBIT_S = (10, 100, 400)
PROJECTED_KS = (8, 16, 32, 64, 128, 256, 512, 1024)


def gpt_shapes(d: int, layers: int, vocab: int = 50257, context: int = 1024) -> list[tuple]:
  """The parameter shapes of a GPT-2-style decoder (tied embedding)."""
  layer = [(d,), (d,), (d, 3 * d), (3 * d,), (d, d), (d,), (d,), (d,), (d, 4 * d), (4 * d,), (4 * d, d), (d,)]
  return [(vocab, d), (context, d)] + layer * layers + [(d,), (d,)]


MODELS = {"124M": gpt_shapes(768, 12), "1.3B": gpt_shapes(2048, 24, context=2048)}


def codec_seconds_per_element(results_dir: pathlib.Path = _harness.RESULTS_DIR) -> dict[str, float]:
  """Codec seconds per element, per device, from the stored ``compression`` results.

  A replica's whole update (``1bit_column_mlp``), or, in results measured
  per phase, worker (with a donated residual where measured) + owner +
  final decode; column scales, the MLP rows.
  """
  out = {}
  for path in sorted(results_dir.glob("compression-*.json")):
    if "-quick-" in path.name:
      continue
    payload = json.loads(path.read_text())
    rows = {r["scheme"]: r for r in payload["records"] if r.get("part") == "throughput"}
    device = path.stem.removeprefix("compression-")
    step = rows.get("1bit_column_mlp")
    if step:
      out[device] = step["seconds"] / step["params"]
      continue
    # Results measured per phase (the codec's worker, owner and decode).
    worker = rows.get("1bit_column_worker_donated_mlp") or rows.get("1bit_column_worker_mlp")
    owner, decode = rows.get("1bit_column_owner_mlp"), rows.get("1bit_column_decode_mlp")
    if worker and owner and decode:
      out[device] = (worker["seconds"] + owner["seconds"] + decode["seconds"]) / worker["params"]
  return out


def projection(codecs: dict[str, float]) -> list[dict]:
  import jax
  import jax.numpy as jnp

  from jmp_train.diagnostics import data_parallel_exchange

  records = []
  for model, shapes in MODELS.items():
    n = sum(int(np.prod(s)) for s in shapes)
    like = [jax.ShapeDtypeStruct(s, jnp.float32) for s in shapes]
    for k in PROJECTED_KS:
      for gbit in LINKS_GBIT_S:
        rate = gbit * 1e9 / 8
        for codec, c in codecs.items():
          exchange = data_parallel_exchange(
            like,
            replicas=k,
            link_bytes_per_s=rate,
            latency_s=ALPHA_S,
            codec_s_per_element=c,
            formats=("float32", "1-bit"),
          )
          ring, one_bit = exchange.row("float32").t_comm_s, exchange.row("1-bit").t_comm_s
          records.append(
            {
              "part": "projection",
              "scheme": "ring_vs_1bit",
              "replicas": k,
              "model": model,
              "params": n,
              "link_gbit_s": gbit,
              "codec": codec,
              "c_ns": c * 1e9,
              "ring_allreduce_ms": ring * 1e3,
              "one_bit_ms": one_bit * 1e3,
              "one_bit_speedup": ring / one_bit,
            }
          )
  return records


def run(quick: bool) -> list[dict]:
  codecs = codec_seconds_per_element()
  if quick:
    import jax

    if len(jax.devices()) < 2:
      return _harness.skipped("needs 2 devices (python -m benchmarks simulates 8 CPU devices)")
    measured = measure(2, SCHEMES, sizes=(16, 10), steps=1, compiler_options=_harness.compile_options(quick))
  else:
    ks = [int(k) for k in os.environ.get("BENCH_REPLICA_SCALE_KS", "8,16,32,64").split(",")]
    value = os.environ.get("BENCH_REPLICA_SCALE_SCHEMES")
    schemes = SCHEMES if not value else tuple(value.split(","))
    unknown = sorted(set(schemes) - set(SCHEMES))
    if unknown:
      raise ValueError(f"BENCH_REPLICA_SCALE_SCHEMES: unknown {unknown}; valid: {SCHEMES}.")
    measured = _measured(ks, schemes, _harness.env_int("BENCH_REPLICA_SCALE_BUDGET_S", 600))
  # Without stored codec times: 2.5 ns per element, the column codec on this
  # project's 2-core CPU machine.
  return measured + projection(codecs or {"assumed_cpu": 2.5e-9})


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description="one replica count of the replica_scale benchmark")
  parser.add_argument("--child", type=int, required=True, help="replicas (simulated devices)")
  parser.add_argument("--schemes", default=",".join(SCHEMES))
  args = parser.parse_args(argv)
  _child(args.child, tuple(args.schemes.split(",")))
  return 0


if __name__ == "__main__":
  sys.exit(main())
