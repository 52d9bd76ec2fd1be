"""1-bit gradient exchange: wire bytes from compiled HLO, and codec throughput.

Part 1, bytes: for a 1,068,810-parameter MLP (784-1024-256-10), the
per-device bytes of every collective in the compiled program of one
gradient exchange (:func:`jmp_train.collective_bytes`), for K = 2..8
replicas under ``pmap``:

* ``pmean_f32``: ``lax.pmean`` of float32 gradients (an all-reduce);
* ``pmean_bf16``: gradients cast to bfloat16, then ``pmean`` (XLA:CPU
  promotes a bfloat16 all-reduce to float32, so on CPU its bytes are the
  float32 ones: the figure is what the compiled program moves);
* ``1bit_column`` / ``1bit_l1``: :func:`jmp_train.sign_compression`.

``operand_bytes`` is what each device hands to the collectives;
``wire_bytes`` what it sends with bandwidth-optimal algorithms (ring
all-reduce ``2(K-1)/K·n``; see :mod:`jmp_train._src.hlo`); ``vs_f32`` is
``wire_bytes`` over the float32 all-reduce's.

Part 2, throughput: one device, the worker side without communication
(``sign_compression()`` with ``axis_name=None``: residual add, per-column
or per-tensor scales, bits, decode, new residual; column scales also pay
two float32 transposes, to and from the column-by-column flat layout),
and bit packing + unpacking alone,
against an elementwise pass over the same float32 buffer (``x + 1``, a
read and a write: the memory-bound floor). GB/s counts the float32 input
bytes once.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import _harness

NAME = "compression"
COLUMNS = (
    "part", "scheme", "replicas", "params", "operand_bytes", "wire_bytes",
    "vs_f32", "seconds", "gb_per_s",
)
AXIS = "i"


def _mlp_shapes(quick: bool) -> dict[str, tuple[int, ...]]:
  sizes = (64, 128, 10) if quick else (784, 1024, 256, 10)
  shapes = {}
  for i, (m, n) in enumerate(zip(sizes[:-1], sizes[1:])):
    shapes[f"w{i}"] = (m, n)
    shapes[f"b{i}"] = (n,)
  return shapes


def _bytes_records(shapes, ks) -> list[dict]:
  from jmp_train import collective_bytes, sign_compression

  n = sum(int(np.prod(s)) for s in shapes.values())
  records = []
  for k in ks:
    devices = jax.devices()[:k]
    grads = {name: jnp.zeros((k,) + s, jnp.float32) for name, s in shapes.items()}
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
    for scale in ("column", "l1"):
      tx = sign_compression(AXIS, scale=scale)
      state = jax.pmap(tx.init, axis_name=AXIS, devices=devices)(grads)
      programs[f"1bit_{scale}"] = (jax.pmap(tx.update, axis_name=AXIS, devices=devices), state)
    base = None
    for scheme, (fn, state) in programs.items():
      args = (grads,) if state is None else (grads, state)
      compiled = fn.lower(*args).compile()
      operand = collective_bytes(compiled)["total"]
      wire = collective_bytes(compiled, wire=True)["total"]
      if scheme == "pmean_f32":
        base = wire
      records.append({
          "part": "bytes",
          "scheme": scheme,
          "replicas": k,
          "params": n,
          "operand_bytes": operand,
          "wire_bytes": wire,
          "vs_f32": wire / base,
      })
  return records


def _throughput_records(n: int, repeats: int) -> list[dict]:
  from jmp_train import sign_compression
  from jmp_train._src import sign_compression as sc

  side = int(np.sqrt(n))
  grads = {"w": jax.random.normal(jax.random.key(0), (side, side), jnp.float32)}
  nbytes = 4 * side * side
  codecs = {}
  for scale in ("column", "l1"):
    tx = sign_compression(scale=scale)
    codecs[scale] = (jax.jit(tx.update), tx.init(grads))
  flat = grads["w"].reshape(-1)
  pack = jax.jit(lambda x: sc._unpack(sc._pack(x >= 0)))
  copy = jax.jit(lambda x: x + 1.0)
  times = _harness.interleaved_median_seconds(
      {
          "worker_codec_column": lambda: codecs["column"][0](grads, codecs["column"][1]),
          "worker_codec_l1": lambda: codecs["l1"][0](grads, codecs["l1"][1]),
          "pack_unpack_bits": lambda: pack(flat),
          "elementwise_x_plus_1": lambda: copy(flat),
      },
      repeats=repeats,
  )
  return [
      {
          "part": "throughput",
          "scheme": name,
          "replicas": 1,
          "params": side * side,
          "seconds": t,
          "gb_per_s": nbytes / t / 1e9,
      }
      for name, t in times.items()
  ]


def run(quick: bool) -> list[dict]:
  if jax.device_count() < 2:
    raise ValueError(
        "bench_compression needs several devices: run it through `python -m "
        "benchmarks` (8 simulated CPU devices) or set "
        "XLA_FLAGS=--xla_force_host_platform_device_count=8."
    )
  ks = (2, min(8, jax.device_count())) if quick else tuple(range(2, min(8, jax.device_count()) + 1))
  records = _bytes_records(_mlp_shapes(quick), ks)
  records += _throughput_records(2**12 if quick else 2**22, repeats=3 if quick else 20)
  return records
