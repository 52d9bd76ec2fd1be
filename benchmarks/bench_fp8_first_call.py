"""The FP8 train step's first call (compilation) under XLA flags that change GEMM autotuning.

XLA compiles an FP8 product by trying candidate kernels for it (autotuning),
among them Triton GEMMs generated for FP8 operands; that is most of a first
call's time. :func:`first_call_records` compiles and runs the
``mlp_8x8192`` step of :mod:`benchmarks.bench_fp8` under
``policy="mixed_float8"`` once per entry of :data:`FIRST_CALL_FLAGS`, each
in a fresh process (XLA reads ``XLA_FLAGS`` once), and records the compile
time, the first call, the median step time, and the compiled step's GEMM
custom calls with FP8 operands:

* ``(none)``: XLA's defaults;
* ``--xla_gpu_autotune_level=0``: no autotuning at all;
* ``--xla_gpu_enable_triton_gemm=false``: cuBLAS GEMMs only (what
  :func:`jmp_train.make_train_step` compiles an FP8 step with on GPUs).

Runs only on a GPU; elsewhere it returns one record saying it was skipped.
"""

from __future__ import annotations

from typing import Any

import jax

from benchmarks import _harness

NAME = "fp8_first_call"
COLUMNS = ("task", "policy", "xla_flags", "compile_s", "first_call_s", "ms_per_step", "fp8_gemm_calls", "gemm_calls")

# XLA flags tried against the FP8 step's first call (compilation, with its
# GEMM autotuning), each in a fresh process.
FIRST_CALL_FLAGS = ("", "--xla_gpu_autotune_level=0", "--xla_gpu_enable_triton_gemm=false")


def first_call_records(model_name: str = "mlp_8x8192") -> list[dict[str, Any]]:
  """The FP8 step's compile time and step time under each of :data:`FIRST_CALL_FLAGS` (GPU)."""
  import json
  import os
  import subprocess
  import sys

  records = []
  for flags in FIRST_CALL_FLAGS:
    # No preallocation: this process (the probe) may hold most of the GPU.
    env = dict(
      os.environ,
      XLA_PYTHON_CLIENT_PREALLOCATE="false",
      XLA_FLAGS=" ".join(filter(None, (os.environ.get("XLA_FLAGS", ""), flags))),
    )
    code = (
      "import json, numpy as np; from benchmarks import bench_fp8 as b; "
      f"m = b._speed_model({model_name!r}, np.random.default_rng(0)); "
      "print('RESULT', json.dumps(b._step_record(*m, 'mixed_float8', compiler_options={})))"
    )
    proc = subprocess.run(
      [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=240, check=False
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    row = json.loads(lines[-1][7:]) if lines else {"error": proc.stderr[-400:]}
    records.append(
      {"kind": "first_call", "task": model_name, "policy": "mixed_float8", "xla_flags": flags or "(none)", **row}
    )
    print(records[-1], flush=True)
  return records


def run(quick: bool) -> list[dict[str, Any]]:
  if jax.default_backend() != "gpu" or quick:
    return _harness.skipped(f"needs a GPU and a full run (backend here: {jax.default_backend()}, quick={quick})")
  return first_call_records()
