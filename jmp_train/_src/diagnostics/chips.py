r"""Chip peaks: FLOP/s per operand format and memory bandwidth, one table for the roofline and the benchmarks.

Each :class:`Chip` holds its dense (no structured sparsity) peak per operand
format of a matrix product (``"float32"``, ``"tf32"``, ``"bfloat16"``,
``"float16"``, ``"fp8"``, ``"int8"``), the float32 peak of its vector units
(elementwise work) and its memory bandwidth. A format missing from a chip's
``peaks`` has no fast path there (an A100 has no FP8 Tensor Cores); asking
for it raises. ``"cpu"`` is measured on the spot (a matmul's FLOP/s per
format, an in-place scaling pass's bytes/s), once per process.

Sources (vendor datasheets; dense figures, half the "with sparsity" ones):

* V100 SXM2 / PCIe: NVIDIA Tesla V100 datasheet (125 / 112 TFLOP/s float16
  Tensor Core, 15.7 / 14 float32, 900 GB/s HBM2).
* T4: NVIDIA T4 datasheet (65 float16, 130 TOP/s int8, 8.1 float32,
  320 GB/s).
* A100 SXM 80 GB / 40 GB: NVIDIA A100 datasheet (19.5 float32, 156 TF32,
  312 bfloat16 / float16, 624 TOP/s int8; 2,039 / 1,555 GB/s).
* H100 SXM / PCIe / NVL, H200 SXM / NVL, GH200: NVIDIA H100, H200 and GH200
  datasheets (H100 SXM: 67 float32, 494.7 TF32, 989.4 bfloat16, 1,978.9 FP8
  and int8, 3.35 TB/s; H200: the same math, 4.8 TB/s).
* B200: NVIDIA HGX B200 datasheet, per GPU (75 float32, 1,100 TF32, 2,250
  bfloat16, 4,500 FP8 and int8, 8 TB/s).
* L4: NVIDIA L4 datasheet (30.3 float32, 60 TF32, 121 bfloat16, 242.5 FP8
  and int8, 300 GB/s).
* TPU v5e: Google Cloud TPU v5e documentation (197 TFLOP/s bfloat16, 394
  TOP/s int8, 819 GB/s). A float32 product at JAX's default precision is
  one bfloat16 pass (listed as ``"tf32"``, the reduced-precision float32 of
  the table); at ``"highest"`` six passes (``"float32"``: 197 / 6).

To add a chip, build a :class:`Chip` and pass it as ``chip=``:
``Chip("MI300X", peaks={"bfloat16": 1307e12, "fp8": 2615e12}, hbm_bytes_per_s=5.3e12)``.
"""

from __future__ import annotations

import dataclasses
import functools
import re
import time
import types
from typing import Any, Callable, Iterator, Mapping

import numpy as np

__all__ = ["CHIPS", "Chip", "chip_peaks", "product_format"]

FORMATS = ("float32", "tf32", "bfloat16", "float16", "fp8", "int8")
# What each format runs on, for messages: "no FP8 Tensor Cores".
_LABELS = {
  "float32": "float32",
  "tf32": "TF32",
  "bfloat16": "bfloat16",
  "float16": "float16",
  "fp8": "FP8",
  "int8": "int8",
  "float64": "float64",
}
_T = 1e12


@dataclasses.dataclass(frozen=True)
class Chip:
  """A chip's peaks: the roofline's ceilings.

  Attributes:
    name: its name in :data:`CHIPS`, e.g. ``"H100 SXM"``.
    peaks: ``{format: FLOP/s}`` of matrix products per operand format (keys
      among ``"float32"``, ``"tf32"``, ``"bfloat16"``, ``"float16"``,
      ``"fp8"``, ``"int8"``; int8 in operations per second). A format not
      listed has no fast path on the chip.
    hbm_bytes_per_s: memory (HBM) bandwidth in bytes per second.
    vector_flops_per_s: float32 FLOP/s of the vector units (CUDA cores), the
      ceiling of elementwise work; ``None``: the ``"float32"`` peak.
    matrix_units: what runs the products, for messages (``"Tensor
      Cores"``, ``"MXU"``).
    device_kinds: the words of ``jax.Device.device_kind`` (lower case) that
      identify the chip, each tuple all required; the first chip of
      :data:`CHIPS` whose tuple matches wins.
    source: where the figures come from.
  """

  name: str
  peaks: Mapping[str, float]
  hbm_bytes_per_s: float
  vector_flops_per_s: float | None = None
  matrix_units: str = "Tensor Cores"
  device_kinds: tuple[tuple[str, ...], ...] = ()
  source: str = ""

  def __post_init__(self):
    unknown = sorted(set(self.peaks) - set(FORMATS) - {"float64"})
    if unknown:
      raise ValueError(f"Chip {self.name!r}: unknown formats {unknown} in peaks; valid: {', '.join(FORMATS)}.")
    if not self.hbm_bytes_per_s > 0:
      raise ValueError(f"Chip {self.name!r}: hbm_bytes_per_s must be > 0, got {self.hbm_bytes_per_s!r}.")

  def peak(self, fmt: str) -> float:
    """FLOP/s of a product on ``fmt`` operands; ``"tf32"`` falls back to ``"float32"``.

    Raises:
      ValueError: if the chip has no peak for ``fmt`` (FP8 on an A100),
        naming the chips that have one.
    """
    if fmt == "tf32" and "tf32" not in self.peaks:
      fmt = "float32"
    if fmt in self.peaks:
      return float(self.peaks[fmt])
    having = [c.name for c in CHIPS.values() if fmt in c.peaks]
    label = _LABELS.get(fmt, fmt)
    raise ValueError(
      f"{self.name} has no {label} {self.matrix_units} (its table lists "
      f"{', '.join(self.peaks) or 'no formats'}); products on {label} operands have no peak there. "
      f"Chips with one: {', '.join(having) or 'none'}; or keep those products in a format the chip has."
    )

  @property
  def vector_peak(self) -> float:
    """FLOP/s of elementwise work: ``vector_flops_per_s`` or the float32 peak."""
    return float(self.vector_flops_per_s or self.peak("float32"))

  def ridge(self, fmt: str) -> float:
    """The ridge point ``peak(fmt) / hbm_bytes_per_s`` in FLOP per byte."""
    return self.peak(fmt) / self.hbm_bytes_per_s


def _nvidia(name, fp32, tf32, half, fp8, int8, tb_s, kinds, source, bf16=True) -> Chip:
  peaks = {"float32": fp32, "tf32": tf32, "bfloat16": half if bf16 else None, "float16": half, "fp8": fp8, "int8": int8}
  peaks = {k: v * _T for k, v in peaks.items() if v}
  return Chip(name, peaks, tb_s * _T, fp32 * _T, "Tensor Cores", kinds, source)


_TABLE = (
  _nvidia("GH200", 67.0, 494.7, 989.4, 1978.9, 1978.9, 4.0, (("gh200",),), "NVIDIA GH200 datasheet (96 GB HBM3)"),
  _nvidia("H200 NVL", 60.0, 417.5, 835.5, 1671.0, 1671.0, 4.8, (("h200", "nvl"),), "NVIDIA H200 datasheet"),
  _nvidia("H200", 67.0, 494.7, 989.4, 1978.9, 1978.9, 4.8, (("h200",),), "NVIDIA H200 datasheet (SXM)"),
  _nvidia("H100 PCIe", 51.0, 378.0, 756.0, 1513.0, 1513.0, 2.0, (("h100", "pcie"),), "NVIDIA H100 datasheet"),
  _nvidia("H100 NVL", 60.0, 417.5, 835.5, 1671.0, 1671.0, 3.9, (("h100", "nvl"),), "NVIDIA H100 datasheet"),
  _nvidia("H100 SXM", 67.0, 494.7, 989.4, 1978.9, 1978.9, 3.35, (("h100",),), "NVIDIA H100 datasheet (SXM)"),
  _nvidia("B200", 75.0, 1100.0, 2250.0, 4500.0, 4500.0, 8.0, (("b200",),), "NVIDIA HGX B200 datasheet, per GPU"),
  _nvidia("A100 40GB", 19.5, 156.0, 312.0, None, 624.0, 1.555, (("a100", "40gb"),), "NVIDIA A100 datasheet"),
  _nvidia("A100", 19.5, 156.0, 312.0, None, 624.0, 2.039, (("a100",),), "NVIDIA A100 datasheet (SXM 80 GB)"),
  _nvidia("L4", 30.3, 60.0, 121.0, 242.5, 242.5, 0.3, (("l4",),), "NVIDIA L4 datasheet"),
  _nvidia("V100 PCIe", 14.0, None, 112.0, None, None, 0.9, (("v100", "pcie"),), "NVIDIA V100 datasheet", bf16=False),
  _nvidia("V100", 15.7, None, 125.0, None, None, 0.9, (("v100",),), "NVIDIA V100 datasheet (SXM2)", bf16=False),
  _nvidia("T4", 8.1, None, 65.0, None, 130.0, 0.32, (("t4",),), "NVIDIA T4 datasheet", bf16=False),
  Chip(
    "TPU v5e",
    {"float32": 197 * _T / 6, "tf32": 197 * _T, "bfloat16": 197 * _T, "int8": 394 * _T},
    0.819 * _T,
    None,
    "MXU",
    (("tpu", "v5", "lite"), ("tpu", "v5e")),
    "Google Cloud TPU v5e documentation",
  ),
)
CHIPS: Mapping[str, Chip] = types.MappingProxyType({c.name: c for c in _TABLE})


def _key(name: str) -> str:
  return re.sub(r"[^a-z0-9]+", "", name.lower())


_ALIASES = {_key(n): n for n in CHIPS} | {"h100": "H100 SXM", "h100sxm5": "H100 SXM", "v5e": "TPU v5e"}


# ---------------------------------------------------------------------------
# The CPU, measured.


def _best_seconds(fn: Callable[[], Any], repeats: int = 5) -> float:
  fn()  # compile and warm up
  best = float("inf")
  for _ in range(repeats):
    start = time.perf_counter()
    fn()
    best = min(best, time.perf_counter() - start)
  return best


@functools.lru_cache(maxsize=None)
def _cpu_matmul_flops(fmt: str) -> float:
  import jax
  import jax.numpy as jnp

  dtype = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}.get(fmt)
  dtype = dtype or {"fp8": jnp.float8_e4m3fn, "int8": jnp.int8}[fmt]
  accumulate = jnp.int32 if fmt == "int8" else jnp.float32
  cpu = jax.devices("cpu")[0]
  product = jax.jit(lambda a, b: jax.lax.dot(a, b, preferred_element_type=accumulate))
  n = 256
  while True:  # grow until one product takes long enough to time
    a = jax.device_put(jnp.ones((n, n), dtype), cpu)
    seconds = _best_seconds(lambda: product(a, a).block_until_ready(), repeats=3)
    if seconds > 0.02 or n >= 2048:
      return 2.0 * n**3 / seconds
    n *= 2


@functools.lru_cache(maxsize=None)
def _cpu_bytes_per_s() -> float:
  import jax
  import jax.numpy as jnp

  # x * 2 in place (donated: no fresh pages to fault in) over 128 MiB, beyond the caches.
  scale = jax.jit(lambda v: v * 2.0, donate_argnums=0)
  buffer = [jax.device_put(jnp.ones((1 << 25,), jnp.float32), jax.devices("cpu")[0])]
  nbytes = buffer[0].nbytes

  def run():
    buffer[0] = scale(buffer[0])
    buffer[0].block_until_ready()

  return 2.0 * nbytes / _best_seconds(run)


class _MeasuredPeaks(Mapping):
  """The CPU's product peaks, each measured the first time it is read."""

  _formats = ("float32", "bfloat16", "float16", "fp8", "int8")

  def __getitem__(self, fmt: str) -> float:
    if fmt not in self._formats:
      raise KeyError(fmt)
    return _cpu_matmul_flops(fmt)

  def __iter__(self) -> Iterator[str]:
    return iter(self._formats)

  def __len__(self) -> int:
    return len(self._formats)

  def __repr__(self) -> str:
    return "<measured on first use: " + ", ".join(self._formats) + ">"


@functools.lru_cache(maxsize=None)
def _cpu() -> Chip:
  peaks = _MeasuredPeaks()
  return Chip(
    "cpu",
    peaks,
    _cpu_bytes_per_s(),
    None,
    "matrix units",
    (("cpu",),),
    "measured: a jitted square matmul per format, and x * 2 in place over 128 MiB",
  )


def chip_peaks(chip: Any) -> Chip:
  """The :class:`Chip` named ``chip``: a table name, an alias, a device kind, or a Chip.

  Names are matched without case and punctuation (``"h100"``, ``"H100
  SXM"``, ``"tpu_v5e"``); a ``jax.Device.device_kind`` (``"NVIDIA H100 80GB
  HBM3"``) is matched by its words (see ``Chip.device_kinds``).
  ``"cpu"`` is measured here, once per process: a jitted square matmul per
  format (its FLOP/s, each format on first use) and ``x * 2`` in place over
  128 MiB (bytes read and written per second).

  Args:
    chip: a name, a device kind, a ``jax.Device`` or a :class:`Chip` (returned
      as is: the way to add a chip).

  Returns:
    The :class:`Chip`.

  Raises:
    ValueError: for an unknown chip, listing the known ones and how to add
      one.

  Examples:
    >>> chip = chip_peaks("H100 SXM")
    >>> chip.peak("bfloat16") / 1e12, round(chip.ridge("bfloat16"))
    (989.4, 295)
    >>> chip_peaks("NVIDIA A100-SXM4-80GB").name
    'A100'
  """
  if isinstance(chip, Chip):
    return chip
  if hasattr(chip, "device_kind") and not isinstance(chip, str):
    chip = chip.device_kind
  if not isinstance(chip, str):
    raise TypeError(f"chip must be a name (one of {', '.join(CHIPS)}, 'cpu') or a Chip, got {type(chip).__name__}.")
  if _key(chip) == "cpu":
    return _cpu()
  name = _ALIASES.get(_key(chip))
  if name:
    return CHIPS[name]
  words = set(re.split(r"[^a-z0-9]+", chip.lower()))
  for c in CHIPS.values():
    if any(all(w in words for w in kind) for kind in c.device_kinds):
      return c
  raise ValueError(
    f"Unknown chip {chip!r}. Known: {', '.join(CHIPS)}, and 'cpu' (measured here). "
    "To add one, pass a jmp_train.diagnostics.Chip as chip=, e.g. "
    "Chip('MI300X', peaks={'bfloat16': 1307e12, 'fp8': 2615e12}, hbm_bytes_per_s=5.3e12)."
  )


def product_format(lhs_dtype: Any, rhs_dtype: Any, precision: Any = None) -> str:
  """The format whose peak a product uses: ``"fp8"``, ``"int8"``, ``"bfloat16"``, ``"float16"``, ``"tf32"``, ...

  Two 8-bit float operands: ``"fp8"`` (E4M3 x E5M2 included); two 8-bit
  integers: ``"int8"``; two 16-bit floats: their type; anything else (float32
  or mixed operands) is a float32 product, on TF32 at JAX's default matmul
  precision (``"tf32"``; chips without TF32 use their float32 peak) and
  ``"float32"`` at ``"highest"`` (the product's ``precision`` or
  ``jax.default_matmul_precision``). float64 is ``"float64"``.

  Examples:
    >>> import jax.numpy as jnp
    >>> product_format(jnp.float8_e4m3fn, jnp.float8_e5m2), product_format(jnp.float32, jnp.bfloat16)
    ('fp8', 'tf32')
  """
  import jax

  a, b = np.dtype(lhs_dtype), np.dtype(rhs_dtype)
  if a.itemsize == 1 and b.itemsize == 1:
    return "int8" if a.kind in "iu" and b.kind in "iu" else "fp8"
  halves = [d.name for d in (a, b) if d.name in ("bfloat16", "float16")]
  if halves and all(d.name in halves or d.itemsize == 1 for d in (a, b)):
    return halves[0]  # 16-bit, or 16-bit against 8-bit weights (converted before the product)
  if "float64" in (a.name, b.name):
    return "float64"
  names = {str(p).lower() for p in (precision if isinstance(precision, tuple) else (precision,))}
  names.add(str(jax.config.jax_default_matmul_precision).lower())
  return "float32" if any(("highest" in n or n == "float32") for n in names) else "tf32"
