"""GPU throughput: float32 vs mixed bfloat16 vs mixed float16, and matmul peak.

Runs only where JAX's default backend is a GPU; elsewhere it returns one
record saying it was skipped and why. Self-contained: ``python -m benchmarks
--only gpu`` on a machine with a CUDA build of JAX.

Two kinds of rows (``kind``):

* ``step``: a jitted train step (loss, ``value_and_grad``, SGD update) of an
  MLP and of a one-layer Transformer language model (models from
  ``jmp_train_examples.models`` under :func:`jmp_train.flax.apply_policy`),
  every matmul dimension a multiple of 64 so Tensor Cores apply, under
  ``float32`` traced inside ``jax.default_matmul_precision("highest")``
  (true float32 matmuls, no TF32), ``float32`` with XLA's default matmul
  precision (TF32 on Ampere and later), ``mixed_bfloat16`` and
  ``mixed_float16`` (float32 parameters, half compute, float32 loss). The
  step time is the median over repeated steps after warm-up, the policies
  timed round-robin in one process; ``speedup`` is the float32-highest
  row's time over this row's; ``tflops`` is the FLOPs of the step's
  matmuls, forward and backward (:func:`jmp_train.diagnostics.
  tensor_core_report` on the step's jaxpr), over the median time. No loss
  scaling is in the step (its overhead is ``bench_loss_scaling``'s subject).
  Memory: ``temp_bytes`` is XLA's planned scratch (``memory_analysis()``,
  where the activations kept for the backward pass live), ``peak_bytes`` the
  device's ``peak_bytes_in_use`` counter after one step (steps run in
  increasing order of ``temp_bytes``, since the counter never drops), and
  ``peak_ratio`` that over the first setup's (float32). ``roofline_ms`` is
  :func:`jmp_train.diagnostics.roofline`'s predicted time of the same step
  on the detected chip (``roofline_chip``; ``_harness.roofline_prediction``)
  and ``roofline_over_measured`` that over the median.
* ``matmul``: one large square matmul per dtype (float32 highest, float32
  default, bfloat16, float16; half-precision inputs and output, float32
  accumulation), achieved TFLOP/s ``2 n^3 / t`` against the device's dense
  peak for that dtype from the library's chip table,
  :data:`jmp_train.diagnostics.CHIPS` (datasheet figures; ``None`` and
  ``peak_source="unknown"`` for a device not in the table).
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import jax
import jax.numpy as jnp

from benchmarks import _harness
from jmp_train.diagnostics import chip_peaks
from jmp_train.diagnostics import tensor_core_report

NAME = "gpu"
COLUMNS = (
  "kind",
  "model",
  "policy",
  "shape",
  "median_ms",
  "speedup",
  "items_per_s",
  "tflops",
  "peak_tflops",
  "fraction_of_peak",
  "temp_bytes",
  "peak_bytes",
  "peak_ratio",
  "roofline_ms",
  "roofline_over_measured",
)

# The peak mode of a row -> the operand format of jmp_train.diagnostics.CHIPS.
_MODE_FORMATS = {"fp32": "float32", "tf32": "tf32", "bf16": "bfloat16", "fp16": "float16"}


def peak_tflops(device_kind: str, mode: str) -> float | None:
  """The datasheet dense peak of ``device_kind`` in ``mode``, or ``None``.

  Read from the library's chip table, :data:`jmp_train.diagnostics.CHIPS`
  (the roofline's), matched by the device kind's words.

  Args:
    device_kind: ``jax.devices()[0].device_kind``, e.g. ``"NVIDIA H100 80GB
      HBM3"``.
    mode: ``"fp32"``, ``"tf32"``, ``"bf16"`` or ``"fp16"``.

  Returns:
    TFLOP/s, or ``None`` for a device not in the table (the CPU's peaks are
    measured, not a datasheet's) or a mode it lacks.

  Raises:
    ValueError: for an unknown ``mode``.

  Examples:
    >>> peak_tflops("NVIDIA H100 80GB HBM3", "bf16")
    989.4
    >>> peak_tflops("cpu", "bf16") is None
    True
  """
  if mode not in _MODE_FORMATS:
    raise ValueError(f"Unknown mode {mode!r}; valid: {', '.join(_MODE_FORMATS)}.")
  if device_kind.strip().lower() == "cpu":
    return None
  try:
    chip = chip_peaks(device_kind)
  except ValueError:
    return None
  peak = chip.peaks.get(_MODE_FORMATS[mode])
  return None if peak is None else round(peak / 1e12, 6)


# name -> (policy spec, matmul precision to trace under, peak mode)
_SETUPS: dict[str, tuple[str, str | None, str]] = {
  "float32 (highest)": ("float32", "highest", "fp32"),
  "float32 (default/TF32)": ("float32", None, "tf32"),
  "mixed_bfloat16": ("mixed_bfloat16", None, "bf16"),
  "mixed_float16": ("mixed_float16", None, "fp16"),
}


def _precision(name: str | None):
  if name is None:
    return contextlib.nullcontext()
  return jax.default_matmul_precision(name)


def _sizes(quick: bool, on_gpu: bool) -> dict[str, Any]:
  if on_gpu and not quick:
    return dict(
      mlp_batch=4096,
      mlp_width=4096,
      mlp_layers=4,
      tfm_batch=16,
      tfm_seq=1024,
      tfm_d=1024,
      tfm_heads=16,
      tfm_mlp=4096,
      tfm_vocab=8192,
      matmul_n=16384,
      repeats=20,
      compiler_options=None,
    )
  if on_gpu:
    return dict(
      mlp_batch=512,
      mlp_width=512,
      mlp_layers=2,
      tfm_batch=4,
      tfm_seq=128,
      tfm_d=256,
      tfm_heads=4,
      tfm_mlp=1024,
      tfm_vocab=512,
      matmul_n=1024,
      repeats=5,
      compiler_options=None,
    )
  # The same code on CPU, tiny (used by the test suite to keep it working),
  # compiled as a --quick run compiles.
  return dict(
    mlp_batch=8,
    mlp_width=32,
    mlp_layers=2,
    tfm_batch=2,
    tfm_seq=8,
    tfm_d=32,
    tfm_heads=2,
    tfm_mlp=64,
    tfm_vocab=64,
    matmul_n=64,
    repeats=2,
    compiler_options=dict(_harness.QUICK_COMPILE),
  )


def _step_fn(module, policy: str) -> Callable[..., Any]:
  """A train step (loss, gradients, SGD update) of ``module`` under ``policy``."""
  from jmp_train.flax import apply_policy

  model = apply_policy(module, policy)

  def loss_fn(params, x, y):
    logits = model.apply({"params": params}, x)
    logp = jax.nn.log_softmax(logits.astype(jnp.float32))
    return -jnp.mean(jnp.take_along_axis(logp, y[..., None], axis=-1))

  def step(params, x, y):
    loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
    params = jax.tree.map(lambda p, g: p - 1e-3 * g.astype(p.dtype), params, grads)
    return params, loss

  return step


def _step_rows(sizes: dict[str, Any], models: tuple[str, ...], setups: tuple[str, ...]) -> list[dict[str, Any]]:
  from jmp_train_examples import models as zoo

  key_x, key_y = jax.random.split(jax.random.key(1))
  b, w = sizes["mlp_batch"], sizes["mlp_width"]
  tb, ts, tv = sizes["tfm_batch"], sizes["tfm_seq"], sizes["tfm_vocab"]
  # Built on demand: only the requested models' inputs are made.
  cases = {
    "mlp": lambda: (
      f"MLP {w}x{sizes['mlp_layers']}",
      zoo.MLP(features=(w,) * sizes["mlp_layers"], num_classes=w),
      jax.random.normal(key_x, (b, w), jnp.float32),
      jax.random.randint(key_y, (b,), 0, w),
      b,
      f"batch {b}",
    ),
    "transformer": lambda: (
      f"Transformer d{sizes['tfm_d']}",
      zoo.TransformerBlock(
        vocab_size=tv,
        d_model=sizes["tfm_d"],
        num_heads=sizes["tfm_heads"],
        mlp_dim=sizes["tfm_mlp"],
        num_layers=1,
        max_len=ts,
      ),
      jax.random.randint(key_x, (tb, ts), 0, tv),
      jax.random.randint(key_y, (tb, ts), 0, tv),
      tb * ts,
      f"batch {tb} x seq {ts}",
    ),
  }
  rows = []
  for key in models:
    model_name, module, x, y, items, shape = cases[key]()
    # Every policy stores float32 parameters with the same tree: init once.
    params = jax.jit(module.init)(jax.random.key(0), x)["params"]
    fns, flops, memory, predicted = {}, {}, {}, {}
    for setup in setups:
      policy, precision, _ = _SETUPS[setup]
      with _precision(precision):
        compiled = jax.jit(_step_fn(module, policy)).lower(params, x, y).compile(sizes["compiler_options"])
        # The matmuls' FLOPs, counted on the jaxpr: XLA:GPU's cost analysis
        # counts none for cuBLAS calls (0.07 TFLOP/s was reported for the
        # MLP step on an H100), and the lowered module has no cost analysis
        # there.
        flops[setup] = tensor_core_report(_step_fn(module, policy), params, x, y).total_flops
        predicted[setup] = _harness.roofline_prediction(_step_fn(module, policy), params, x, y)
      fns[setup] = lambda c=compiled: c(params, x, y)
      memory[setup] = _harness.compiled_memory(compiled)["temp_bytes"]
    peaks = _peak_bytes(fns, memory)
    times = _harness.interleaved_median_seconds(fns, warmup=2, repeats=sizes["repeats"])
    base = times[setups[0]]
    for setup, t in times.items():
      rows.append(
        {
          "kind": "step",
          "model": model_name,
          "policy": setup,
          "shape": shape,
          "median_ms": 1e3 * t,
          "speedup": base / t,
          "items_per_s": items / t,
          "tflops": flops[setup] / t / 1e12 if flops[setup] else None,
          "peak_tflops": None,
          "fraction_of_peak": None,
          "temp_bytes": memory[setup],
          "peak_bytes": peaks[setup],
          "peak_ratio": (peaks[setup] / peaks[setups[0]] if peaks[setup] and peaks[setups[0]] else None),
          **_harness.with_measured(predicted[setup], 1e3 * t),
        }
      )
  return rows


def _peak_bytes(fns: dict[str, Callable[[], Any]], temp_bytes: dict[str, int | None]) -> dict[str, int | None]:
  """The device's peak bytes in use while each step runs (None if unknown).

  The device counts one peak per process and never lowers it, so the steps
  run once each in increasing order of XLA's planned temp bytes
  (``memory_analysis()``): each reading is then that step's own peak, or
  an earlier, smaller step's, and the order is checked against XLA's plan.
  """
  device = jax.devices()[0]
  order = sorted(fns, key=lambda k: temp_bytes[k] or 0)
  peaks = {}
  for setup in order:
    jax.block_until_ready(fns[setup]())
    stats = device.memory_stats() or {}
    peaks[setup] = stats.get("peak_bytes_in_use")
  return peaks


def _matmul_rows(sizes: dict[str, Any], device_kind: str) -> list[dict[str, Any]]:
  n = sizes["matmul_n"]
  key_a, key_b = jax.random.split(jax.random.key(2))
  setups = {
    "float32 (highest)": (jnp.float32, "highest", "fp32"),
    "float32 (default/TF32)": (jnp.float32, None, "tf32"),
    "bfloat16": (jnp.bfloat16, None, "bf16"),
    "float16": (jnp.float16, None, "fp16"),
  }
  rows = []
  fns = {}
  for name, (dtype, precision, _) in setups.items():
    a = jax.random.normal(key_a, (n, n), jnp.float32).astype(dtype)
    b = jax.random.normal(key_b, (n, n), jnp.float32).astype(dtype)
    with _precision(precision):
      matmul = jax.jit(lambda a, b: jnp.matmul(a, b, preferred_element_type=jnp.float32).astype(a.dtype))
      compiled = matmul.lower(a, b).compile(sizes["compiler_options"])
    fns[name] = lambda c=compiled, a=a, b=b: c(a, b)
  times = _harness.interleaved_median_seconds(fns, warmup=3, repeats=sizes["repeats"])
  for name, t in times.items():
    mode = setups[name][2]
    achieved = 2 * n**3 / t / 1e12
    peak = peak_tflops(device_kind, mode)
    rows.append(
      {
        "kind": "matmul",
        "model": f"matmul {n}x{n}x{n}",
        "policy": name,
        "shape": f"{n}x{n}",
        "median_ms": 1e3 * t,
        "speedup": times["float32 (highest)"] / t,
        "items_per_s": None,
        "tflops": achieved,
        "peak_tflops": peak,
        "fraction_of_peak": achieved / peak if peak else None,
        "peak_mode": mode,
        "peak_source": "datasheet (dense)" if peak else "unknown",
      }
    )
  return rows


def measure(
  quick: bool, *, models: tuple[str, ...] = ("mlp", "transformer"), setups: tuple[str, ...] = tuple(_SETUPS)
) -> list[dict[str, Any]]:
  """The step and matmul rows on the default device, whatever its kind.

  :func:`run` calls this only on a GPU; the test suite calls it on CPU with
  ``quick=True`` (tiny sizes) so the code keeps working without a GPU.

  Args:
    quick: smaller sizes and fewer repeats.
    models: which step benchmarks: ``"mlp"``, ``"transformer"``.
    setups: which policies for the step rows, from ``_SETUPS``; the first
      is the baseline of ``speedup``.

  Returns:
    The records, ``device_kind`` in each.

  Raises:
    ValueError: for an unknown model or setup.
  """
  for name, given, valid in (("model", models, ("mlp", "transformer")), ("setup", setups, tuple(_SETUPS))):
    bad = [g for g in given if g not in valid]
    if bad or not given:
      raise ValueError(f"Bad {name}s {list(given)!r}; valid: {', '.join(valid)}.")
  device_kind = jax.devices()[0].device_kind
  sizes = _sizes(quick, jax.default_backend() == "gpu")
  rows = _step_rows(sizes, models, setups) + _matmul_rows(sizes, device_kind)
  for row in rows:
    row["device_kind"] = device_kind
  return rows


def run(quick: bool) -> list[dict[str, Any]]:
  """The benchmark on a GPU; one ``skipped`` record elsewhere.

  Args:
    quick: small sizes and few repeats (a smoke test).

  Returns:
    The records.
  """
  backend = jax.default_backend()
  if backend != "gpu":
    return _harness.skipped(
      f"needs a GPU: JAX's default backend here is {backend!r} "
      f"({jax.devices()[0].device_kind}); install a CUDA build of JAX "
      "(pip install -U 'jax[cuda12]') and run python -m benchmarks --only gpu"
    )
  return measure(quick)
