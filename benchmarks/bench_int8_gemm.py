"""INT8 products against bfloat16 and FP8 ones: speed and the kernel the compiled program calls.

One square product ``n x n @ n x n`` per operand format, in one process,
for ``n`` = 4,096 and 16,384 (GPU):

* ``int8``: ``jax.lax.dot_general`` of two int8 operands with
  ``preferred_element_type=jnp.int32`` (``s8 x s8 -> s32``: XLA:GPU's
  rewrite to a cuBLAS GEMM);
* ``bfloat16``: bfloat16 operands, float32 accumulation, bfloat16 result;
* ``fp8``: two ``float8_e4m3fn`` operands, bfloat16 result (no scaling:
  the product alone).

Columns: ``ms`` (median of 10 calls after 3), ``tops`` (``2 n^3`` over it,
tera-operations per second), ``peak_tops`` (the chip's dense peak for the
format, :func:`jmp_train.diagnostics.chip_peaks`) and ``fraction_of_peak``;
``predicted_ms`` (:func:`jmp_train.diagnostics.roofline` of the product on
the device) and ``measured_over_predicted``; ``kernels``: the custom-call
targets in the compiled HLO (``__cublas$lt$matmul$f8``, ``__cublas$gemm``,
...) and ``triton_fusions``, the Triton GEMM fusions it runs instead;
``vs_bf16``: bfloat16's time over the row's.

On a GPU by the GPU probe (:mod:`benchmarks._probe`); ``--quick`` (any
backend): ``n`` = 128 (a smoke test: XLA:CPU converts FP8 and int8 to wider
types, so its times say nothing). A full run elsewhere is skipped.
"""

from __future__ import annotations

import re
from typing import Any, Iterator

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import _harness

NAME = "int8_gemm"
COLUMNS = (
  "format",
  "n",
  "ms",
  "tops",
  "peak_tops",
  "fraction_of_peak",
  "vs_bf16",
  "predicted_ms",
  "measured_over_predicted",
  "kernels",
  "triton_fusions",
)
FORMATS = ("bfloat16", "fp8", "int8")
_TARGET = re.compile(r'custom_call_target="([^"]+)"')
_TRITON = re.compile(r'"kind":"(__triton[a-z_]*)"')
_DN = (((1,), (0,)), ((), ()))


def compiled_kernels(hlo_text: str) -> dict[str, Any]:
  """The custom-call targets (sorted, each once) and the Triton fusions' count of compiled HLO text."""
  return {"kernels": sorted(set(_TARGET.findall(hlo_text))), "triton_fusions": len(_TRITON.findall(hlo_text))}


def _product(fmt: str, n: int, rng: np.random.Generator):
  """``(function, lhs, rhs)`` of one format's product."""
  if fmt == "int8":
    a, b = (jnp.asarray(rng.integers(-127, 128, (n, n)), jnp.int8) for _ in range(2))
    return lambda x, y: jax.lax.dot_general(x, y, _DN, preferred_element_type=jnp.int32), a, b
  if fmt == "fp8":
    a, b = (jnp.asarray(rng.normal(size=(n, n)), jnp.float8_e4m3fn) for _ in range(2))
    return lambda x, y: jax.lax.dot_general(x, y, _DN, preferred_element_type=jnp.bfloat16), a, b
  a, b = (jnp.asarray(rng.normal(size=(n, n)), jnp.bfloat16) for _ in range(2))
  return lambda x, y: jax.lax.dot_general(x, y, _DN, preferred_element_type=jnp.float32).astype(jnp.bfloat16), a, b


def _peak(chip, fmt: str) -> float | None:
  try:
    return chip.peak(fmt) / 1e12
  except (KeyError, ValueError):
    return None


def records(quick: bool = False) -> Iterator[list[dict[str, Any]]]:
  """Yields each size's records (one per format of :data:`FORMATS`)."""
  from jmp_train.diagnostics import chip_peaks, roofline

  kind = jax.devices()[0].device_kind
  chip = chip_peaks(kind)
  rng = np.random.default_rng(0)
  for n in (128,) if quick else (4096, 16384):
    rows = []
    for fmt in FORMATS:
      fn, a, b = _product(fmt, n, rng)
      compiled = jax.jit(fn).lower(a, b).compile()
      seconds = _harness.median_seconds(compiled, a, b, warmup=1 if quick else 3, repeats=2 if quick else 10)
      try:
        predicted = roofline(fn, a, b, chip=kind, backward=False).time_s
      except ValueError:  # a format the chip has no peak for
        predicted = None
      tops, peak = 2 * n**3 / seconds / 1e12, _peak(chip, fmt)
      rows.append(
        {
          "format": fmt,
          "n": n,
          "ms": 1e3 * seconds,
          "tops": tops,
          "peak_tops": peak,
          "fraction_of_peak": tops / peak if peak else None,
          "predicted_ms": None if predicted is None else 1e3 * predicted,
          "measured_over_predicted": seconds / predicted if predicted else None,
          **compiled_kernels(compiled.as_text()),
        }
      )
      del a, b
    bf16 = rows[0]["ms"]
    for row in rows:
      row["vs_bf16"] = bf16 / row["ms"]
    print(_harness.format_table(rows, COLUMNS), flush=True)
    yield rows


def run(quick: bool) -> list[dict[str, Any]]:
  if jax.default_backend() != "gpu" and not quick:
    return _harness.skipped(f"needs a GPU for the 16,384^3 products (backend here: {jax.default_backend()})")
  return [r for rows in records(quick) for r in rows]
