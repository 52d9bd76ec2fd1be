"""Compressed gradient exchange: wire bytes from compiled HLO, codec throughput.

Part 1, bytes: for a 1,068,810-parameter MLP (784-1024-256-10), the
per-device bytes of every collective in the compiled program of one
gradient exchange (:func:`jmp_train.diagnostics.collective_bytes`), for K = 2..8
replicas under ``pmap`` (on a one-GPU machine, over simulated CPU devices):

* ``pmean_f32``: ``lax.pmean`` of float32 gradients (an all-reduce);
* ``pmean_bf16``: gradients cast to bfloat16, then ``pmean`` (XLA:CPU
  promotes a bfloat16 all-reduce to float32, so on CPU its bytes are the
  float32 ones: the figure is what the compiled program moves);
* ``two_phase_bfloat16`` / ``two_phase_float8_e4m3``:
  :func:`jmp_train.compressed_mean` (all-to-all + all-gather of wire bytes);
* ``1bit_column`` / ``1bit_l1``: :func:`jmp_train.sign_compression`.

``operand_bytes`` is what each device hands to the collectives;
``wire_bytes`` what it sends with bandwidth-optimal algorithms (ring
all-reduce ``2(K-1)/K·n``; see :func:`jmp_train.diagnostics.collective_bytes`); ``vs_f32`` is
``wire_bytes`` over the float32 all-reduce's.

The programs of part 1 are only inspected, never run: they are compiled
with LLVM's optimizations off (``xla_backend_optimization_level=0``), which
changes the machine code, not the HLO and its collectives.

Part 2, throughput: one device, the codecs as a train step runs them:
``1bit_column`` / ``1bit_l1`` / ``1bit_l2`` is :func:`jmp_train.sign_compression`'s
update under ``pmap`` over one device (one replica), its state donated
(each call's new state the next call's): residual add, scales, bits and
packing, the owner's decode, average, server residual and re-encode, and
the final decode, with a one-replica exchange. With K replicas a replica
encodes its gradient (``n`` elements), decodes the K chunks it receives
(``n``), re-encodes their average (``n/K``) and decodes the gathered
chunks (``n``); at one replica the re-encode is of all ``n``, so these
rows bound a replica's codec time at K replicas from above, by at most
one encode of the gradient; ``bfloat16`` / ``float8_e4m3`` quantize +
dequantize is ``compressed_mean()`` without an axis. Each against an
elementwise pass over the same float32 buffer (``x + 1``, a read and a
write: the memory-bound floor), for a 2048 x 2048 float32 gradient, and
(rows ending in ``_mlp``) for the gradients of the MLP of part 1, six
leaves. On a GPU the buffers are larger, so that they dwarf its L2 cache
and a call its launch cost: a 16384 x 16384 gradient and a
4096-16384-4096-1000 MLP's. GB/s counts the gradient's float32 bytes once;
``vs_copy`` is the copy's time over the codec's, in the same run.

``--quick`` (a smoke test, figures meaningless): a 64-10 MLP, K = 2,
a 64 x 64 gradient, everything compiled with ``_harness.QUICK_COMPILE``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import _harness

NAME = "compression"
COLUMNS = (
  "part",
  "scheme",
  "replicas",
  "params",
  "operand_bytes",
  "wire_bytes",
  "vs_f32",
  "seconds",
  "gb_per_s",
  "vs_copy",
)
AXIS = "i"
# The bytes programs are inspected, not run: skip LLVM's optimizations.
_INSPECT_ONLY = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


def _mlp_shapes(sizes: tuple[int, ...]) -> dict[str, tuple[int, ...]]:
  shapes = {}
  for i, (m, n) in enumerate(zip(sizes[:-1], sizes[1:])):
    shapes[f"w{i}"] = (m, n)
    shapes[f"b{i}"] = (n,)
  return shapes


def _exchange_devices() -> list:
  """The bytes programs' devices: the default backend's, else the simulated CPUs."""
  devices = jax.devices()
  return devices if len(devices) >= 2 else jax.devices("cpu")


def _throughput_shapes(mlp) -> dict[str, list[tuple[int, ...]]]:
  """The gradients timed: larger on a GPU, to be well past its L2 and launch costs."""
  if jax.default_backend() != "gpu":
    return {"": [(2048, 2048)], "_mlp": list(mlp.values())}
  big = _mlp_shapes((4096, 16384, 4096, 1000))
  return {"": [(16384, 16384)], "_mlp": list(big.values())}


def _bytes_records(shapes, ks, all_devices, compiler_options=_INSPECT_ONLY) -> list[dict]:
  from jmp_train import sign_compression
  from jmp_train.diagnostics import collective_bytes
  from jmp_train import compressed_mean

  n = sum(int(np.prod(s)) for s in shapes.values())
  records = []
  for k in ks:
    devices = all_devices[:k]
    grads = {name: jax.ShapeDtypeStruct((k,) + s, jnp.float32) for name, s in shapes.items()}
    programs = {
      "pmean_f32": (jax.pmap(lambda g: jax.lax.pmean(g, AXIS), axis_name=AXIS, devices=devices), None),
      "pmean_bf16": (
        jax.pmap(
          lambda g: jax.lax.pmean(jax.tree.map(lambda x: x.astype(jnp.bfloat16), g), AXIS),
          axis_name=AXIS,
          devices=devices,
        ),
        None,
      ),
    }
    for wire in ("bfloat16", "float8_e4m3"):
      tx = compressed_mean(AXIS, wire=wire)
      state = jax.eval_shape(jax.pmap(tx.init, axis_name=AXIS, devices=devices), grads)
      programs[f"two_phase_{wire}"] = (jax.pmap(tx.update, axis_name=AXIS, devices=devices), state)
    for scale in ("column", "l1"):
      tx = sign_compression(AXIS, scale=scale)
      state = jax.eval_shape(jax.pmap(tx.init, axis_name=AXIS, devices=devices), grads)
      programs[f"1bit_{scale}"] = (jax.pmap(tx.update, axis_name=AXIS, devices=devices), state)
    base = None
    for scheme, (fn, state) in programs.items():
      args = (grads,) if state is None else (grads, state)
      compiled = fn.lower(*args).compile(compiler_options=compiler_options)
      operand = collective_bytes(compiled)["total"]
      wire = collective_bytes(compiled, wire=True)["total"]
      if scheme == "pmean_f32":
        base = wire
      records.append(
        {
          "part": "bytes",
          "scheme": scheme,
          "replicas": k,
          "params": n,
          "operand_bytes": operand,
          "wire_bytes": wire,
          "vs_f32": wire / base,
        }
      )
  return records


def _codec_calls(shapes, suffix: str = "") -> dict:
  """name -> (jitted function, args[, carry]), for every codec timed.

  The 1-bit rows run :func:`jmp_train.sign_compression`'s update as a
  replica's step runs it (``pmap`` over one device, the state donated and
  each call's new state passed to the next): the worker's encode, the
  owner's decode, average and re-encode, and the final decode, with the
  exchange of a single replica (no bytes leave the device).
  """
  from jmp_train import compressed_mean
  from jmp_train import sign_compression

  keys = jax.random.split(jax.random.key(0), len(shapes))
  grads = [jax.random.normal(key, s, jnp.float32) for key, s in zip(keys, shapes)]
  flat = jnp.concatenate([g.reshape(-1) for g in grads])
  calls = {f"elementwise_x_plus_1{suffix}": (jax.jit(lambda x: x + 1.0), (flat,))}
  one = jax.devices()[:1]
  mapped = [g[None] for g in grads]
  for scale in ("column", "l1", "l2"):
    tx = sign_compression(AXIS, scale=scale)
    state = jax.pmap(tx.init, axis_name=AXIS, devices=one)(mapped)
    step = jax.pmap(tx.update, axis_name=AXIS, devices=one, donate_argnums=1)
    calls[f"1bit_{scale}{suffix}"] = (step, (mapped, state), (1, 1))
  if not suffix:
    tree = {"w": grads[0]}
    for wire in ("bfloat16", "float8_e4m3"):
      tx = compressed_mean(wire=wire)
      calls[f"{wire}_quantize_dequantize"] = (jax.jit(tx.update), (tree, tx.init(tree)))
  return calls


class _Call:
  """``fn(*args)`` as a zero-argument call, optionally feeding an output back.

  With ``carry=(i, j)``, output ``j`` replaces argument ``i`` after each
  call: the successor of a donated argument, which the call deletes.
  """

  def __init__(self, fn, args, carry=None):
    self.fn, self.args, self.carry = fn, tuple(args), carry

  def __call__(self):
    out = self.fn(*self.args)
    if self.carry is not None:
      i, j = self.carry
      self.args = self.args[:i] + (out[j],) + self.args[i + 1 :]
    return out


def _throughput_records(shape_sets, repeats: int, compiler_options=None) -> list[dict]:
  calls = {}
  sizes = {}
  for suffix, shapes in shape_sets.items():
    part = _codec_calls(shapes, suffix)
    calls.update(part)
    sizes.update({name: (suffix, sum(int(np.prod(s)) for s in shapes)) for name in part})
  if compiler_options:
    calls = {
      name: (call[0].lower(*call[1]).compile(compiler_options=compiler_options),) + call[1:]
      for name, call in calls.items()
    }
  times = _harness.interleaved_median_seconds({name: _Call(*call) for name, call in calls.items()}, repeats=repeats)
  records = []
  for name, t in times.items():
    suffix, n = sizes[name]
    records.append(
      {
        "part": "throughput",
        "scheme": name,
        "replicas": 1,
        "params": n,
        "seconds": t,
        "gb_per_s": 4 * n / t / 1e9,
        "vs_copy": times[f"elementwise_x_plus_1{suffix}"] / t,
      }
    )
  return records


def throughput_records(quick: bool = False) -> list[dict]:
  """Part 2 alone (the codecs' whole updates against an elementwise pass), at the backend's sizes.

  The GPU probe's share of this benchmark: part 1's bytes do not depend on
  the device. ``quick``: a 64 x 64 gradient, compiled with
  ``_harness.QUICK_COMPILE``.
  """
  if quick:
    return _throughput_records({"": [(64, 64)]}, repeats=3, compiler_options=dict(_harness.QUICK_COMPILE))
  return _throughput_records(_throughput_shapes(_mlp_shapes((784, 1024, 256, 10))), repeats=15)


def run(quick: bool) -> list[dict]:
  devices = _exchange_devices()
  if len(devices) < 2:
    raise ValueError(
      "bench_compression needs several devices: run it through `python -m "
      "benchmarks` (8 simulated CPU devices) or set "
      "XLA_FLAGS=--xla_force_host_platform_device_count=8."
    )
  ks = (2,) if quick else tuple(range(2, min(8, len(devices)) + 1))
  # --quick: a smoke test, its figures mean nothing: one layer (every
  # codec's program grows with the leaves), compiled as quickly as XLA can.
  mlp = _mlp_shapes((64, 10) if quick else (784, 1024, 256, 10))
  records = _bytes_records(mlp, ks, devices, dict(_harness.QUICK_COMPILE) if quick else _INSPECT_ONLY)
  return records + throughput_records(quick)
