r"""A roofline of a function's operations on a chip: which are math-bound, which memory-bound, and the time.

Each operation's time is the larger of its math time and its memory time,

.. math::
  T_\mathrm{math} = \frac{\mathrm{FLOPs}}{\mathrm{peak}(\mathrm{format})}, \qquad
  T_\mathrm{mem} = \frac{\mathrm{bytes}}{\mathrm{bandwidth}}, \qquad
  T = \max(T_\mathrm{math}, T_\mathrm{mem}),

so an operation whose arithmetic intensity ``FLOPs / bytes`` is below the
chip's ridge point ``peak / bandwidth`` is memory-bound. The counts come
from ``jax.experimental.roofline``: its rule for each primitive is applied
to each equation on its own (its public ``roofline`` on a one-equation
function; its result is only a total per function).

References:
  Williams, Waterman, Patterson, "Roofline: an insightful visual performance
  model for multicore architectures", CACM 2009.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple

import jax
import numpy as np

from jmp_train._src import tables
from jmp_train._src.diagnostics import chips
from jmp_train._src.diagnostics import jaxprs
from jmp_train._src.diagnostics import op_groups

__all__ = ["RooflineReport", "RooflineRow", "roofline"]


class RooflineRow(NamedTuple):
  """One operation (or fusion of elementwise operations) of :func:`roofline`.

  Attributes:
    phase: ``"forward"``, ``"backward"``, or ``"step"`` (a
      :class:`jmp_train.TrainStep`'s whole program).
    op: the primitive (``"dot_general"``, ``"conv_general_dilated"``, ...) or
      ``"fusion(a+b+...)"`` for elementwise operations counted together.
    format: the peak used: a product's operand format (``"bfloat16"``,
      ``"fp8"``, ``"tf32"``, ...) or ``"vector"`` (the chip's vector units).
    dtypes: operand and result dtypes.
    flops: FLOPs (int8: operations), all repeats.
    bytes: memory bytes read and written, all repeats.
    intensity: ``flops / bytes``.
    t_math_s: ``flops / peak_flops_per_s``.
    t_mem_s: ``bytes / chip.hbm_bytes_per_s``.
    bound: ``"math"`` if ``t_math_s >= t_mem_s``, else ``"memory"``.
    peak_flops_per_s: the peak of ``format`` on the chip.
    product: a matmul or convolution.
    tensor_core: a product on the chip's matrix units (not float32).
    quantize: holds FP8 / int8 quantize, dequantize or scale work.
    repeats: times it runs per call (scan lengths).
    where: the user's source line.
  """

  phase: str
  op: str
  format: str
  dtypes: str
  flops: float
  bytes: float
  intensity: float
  t_math_s: float
  t_mem_s: float
  bound: str
  peak_flops_per_s: float
  product: bool
  tensor_core: bool
  quantize: bool
  repeats: int
  where: str

  @property
  def time_s(self) -> float:
    """``max(t_math_s, t_mem_s)``."""
    return max(self.t_math_s, self.t_mem_s)


@dataclasses.dataclass(frozen=True)
class RooflineReport:
  """The roofline of a function on a chip; ``str(report)`` is its table and summary.

  Attributes:
    rows: the :class:`RooflineRow` s in program order, forward pass first.
    chip: the :class:`Chip`.
  """

  rows: tuple[RooflineRow, ...]
  chip: chips.Chip

  @property
  def time_s(self) -> float:
    """The predicted time: the sum of the rows' ``max(t_math_s, t_mem_s)``."""
    return sum(r.time_s for r in self.rows)

  @property
  def flops(self) -> float:
    return sum(r.flops for r in self.rows)

  @property
  def bytes(self) -> float:
    return sum(r.bytes for r in self.rows)

  def _share(self, keep: Callable[[RooflineRow], bool]) -> float:
    total = self.time_s
    return sum(r.time_s for r in self.rows if keep(r)) / total if total else 0.0

  @property
  def product_share(self) -> float:
    """Share of the time in matmuls and convolutions."""
    return self._share(lambda r: r.product)

  @property
  def tensor_core_share(self) -> float:
    """Share of the time in products on the chip's matrix units (Tensor Cores, MXU)."""
    return self._share(lambda r: r.tensor_core)

  @property
  def memory_bound_share(self) -> float:
    """Share of the time in memory-bound rows."""
    return self._share(lambda r: r.bound == "memory")

  @property
  def quantize_share(self) -> float:
    """Share of the time in rows with quantize, dequantize or scale work."""
    return self._share(lambda r: r.quantize)

  @property
  def ridge_points(self) -> dict[str, float]:
    """``{format: peak / bandwidth}`` (FLOP per byte) for the products' formats."""
    return {r.format: r.peak_flops_per_s / self.chip.hbm_bytes_per_s for r in self.rows if r.product}

  def to_rows(self) -> list[dict[str, Any]]:
    """One dict per row, for tables and dataframes."""
    return [
      {
        "phase": r.phase,
        "op": r.op,
        "format": r.format,
        "GFLOP": r.flops / 1e9,
        "MB": r.bytes / 1e6,
        "intensity": r.intensity,
        "t_math_us": r.t_math_s * 1e6,
        "t_mem_us": r.t_mem_s * 1e6,
        "bound": r.bound,
        "where": r.where,
      }
      for r in self.rows
    ]

  def summary(self) -> str:
    ridges = ", ".join(f"{k} {v:.4g}" for k, v in self.ridge_points.items()) or "no products"
    return (
      f"{self.chip.name}: predicted {self.time_s * 1e3:.4g} ms for {self.flops / 1e9:.4g} GFLOP over "
      f"{self.bytes / 1e6:.4g} MB; products {self.product_share:.1%} of the time ({self.tensor_core_share:.1%} on "
      f"{self.chip.matrix_units}), memory-bound rows {self.memory_bound_share:.1%}, quantize/scale work "
      f"{self.quantize_share:.1%}; ridge points (FLOP/B): {ridges}"
    )

  def __str__(self) -> str:
    top = sorted(range(len(self.rows)), key=lambda i: -self.rows[i].time_s)[:20]
    shown = [self.to_rows()[i] for i in sorted(top)]
    rest = len(self.rows) - len(shown)
    more = f"\n({rest} smaller rows not shown: report.to_rows() has all)" if rest > 0 else ""
    return tables.format_table(shown) + more + "\n" + self.summary()

  def plot(self, ax: Any = None) -> Any:
    """Draws the roofline: intensity against attainable FLOP/s, one point per product.

    Needs matplotlib (``pip install 'jmp_train[plot]'``). The lines are
    ``min(peak, intensity * bandwidth)`` for each format of the products;
    points are the products (filled) and the other rows (hollow) at their
    achieved ``flops / time``. Returns the Axes.
    """
    from jmp_train._src.diagnostics import plotting

    plt = plotting._import_pyplot("RooflineReport.plot")
    if ax is None:
      _, ax = plt.subplots(figsize=(7, 4.5), layout="constrained")
    rows = [r for r in self.rows if r.flops > 0 and r.bytes > 0]
    xs = np.array([r.intensity for r in rows] or [1.0])
    grid = np.logspace(np.log10(min(xs.min(), 0.1)), np.log10(max(xs.max(), 1e4)), 200)
    for fmt in sorted({r.format for r in rows} | set(self.ridge_points)):
      peak = self.chip.vector_peak if fmt == "vector" else self.chip.peak(fmt)
      ax.plot(grid, np.minimum(peak, grid * self.chip.hbm_bytes_per_s), lw=1, label=f"{fmt} roof")
    for product, marker in ((True, "o"), (False, "x")):
      pts = [(r.intensity, r.flops / r.time_s) for r in rows if r.product == product]
      if pts:
        ax.scatter(*zip(*pts), marker=marker, label="products" if product else "other operations")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (FLOP / byte)")
    ax.set_ylabel("attainable FLOP/s")
    ax.set_title(f"Roofline on {self.chip.name}")
    ax.legend(fontsize="small")
    return ax


# ---------------------------------------------------------------------------
# Rows.


def _row(group: op_groups.Group, chip: chips.Chip, phase: str) -> RooflineRow:
  eqns, flops, nbytes = group.eqns, group.flops, group.bytes
  first = eqns[0]
  product = first.primitive.name in op_groups.PRODUCTS and len(eqns) == 1
  if product:
    lhs, rhs = (np.dtype(v.aval.dtype) for v in first.invars[:2])
    fmt = chips.product_format(lhs, rhs, first.params.get("precision"))
    peak = chip.peak(fmt)
    dtypes = f"{lhs.name}x{rhs.name}->{np.dtype(first.outvars[0].aval.dtype).name}"
  else:
    fmt, peak = "vector", chip.vector_peak
    names = sorted({str(v.aval.dtype) for e in eqns for v in e.outvars if hasattr(v.aval, "dtype")})
    dtypes = ",".join(names)
  prims = [e.primitive.name for e in eqns]
  op_name = prims[0] if len(prims) == 1 else f"fusion({'+'.join(dict.fromkeys(prims))})"
  t_math, t_mem = flops / peak, nbytes / chip.hbm_bytes_per_s
  return RooflineRow(
    phase=phase,
    op=op_name,
    format=fmt,
    dtypes=dtypes,
    flops=flops,
    bytes=nbytes,
    intensity=flops / nbytes if nbytes else float("inf"),
    t_math_s=t_math,
    t_mem_s=t_mem,
    bound="math" if t_math >= t_mem else "memory",
    peak_flops_per_s=peak,
    product=product,
    tensor_core=product and fmt not in ("float32", "float64") and chip.name != "cpu" and fmt in chip.peaks,
    quantize=group.quantize,
    repeats=group.repeats,
    where=group.where,
  )


def _scope_rows(jaxpr, chip, phase: str, fuse: bool) -> list[RooflineRow]:
  ops, outputs, scopes = op_groups.program(jaxpr)
  rows = [_row(g, chip, phase) for g in op_groups.groups(ops, outputs, 1, fuse)]
  # Loop bodies and branches, in the order met; of a cond's branches the slowest.
  for kind, branches, times in scopes:
    options = [[_row(g, chip, phase) for g in op_groups.groups(body, outs, times, fuse)] for body, outs in branches]
    if kind == "cond":
      rows += max(options, key=lambda rs: sum(r.time_s for r in rs))
    else:
      for option in options:
        rows += option
  return rows


def roofline(
  fn: Callable[..., Any],
  *args: Any,
  chip: Any,
  backward: bool = True,
  fuse: bool = True,
  plot: bool = False,
) -> RooflineReport:
  r"""The roofline of ``fn(*args)`` on ``chip``: each operation's FLOPs, bytes, bound and time.

  Traces ``fn`` (nothing runs; ``args`` may be ``jax.ShapeDtypeStruct``)
  and, with ``backward=True``, its backward pass (the pullback with respect
  to every floating argument leaf, traced on its own so the forward pass
  is counted once; pass a whole train step with ``backward=False``). Calls
  (jit, custom_jvp/vjp, remat, shard_map) are inlined; ``scan`` bodies count
  ``length`` times, ``while`` bodies once (the trip count is not static), of
  a ``cond``'s branches the slowest.

  What is counted how:

  * FLOPs and bytes per equation: ``jax.experimental.roofline``'s rule for
    its primitive (``unfused_flops``, ``unfused_hbm_bytes``), applied to the
    equation alone: a ``dot_general`` is ``2 * batch * M * N * K`` FLOPs over
    its operands' and result's bytes; a convolution its multiply-adds;
    elementwise ops one FLOP per element.
  * Where jax's rules count nothing although XLA runs a kernel (casts, the
    amax reductions of FP8 scaling, ``tanh``, ``clamp``, concatenation,
    sorting, random bits, ...): one read of every operand and one write of
    every result, and one FLOP per element for elementwise ops and
    reductions. Views (broadcast, reshape, transpose, ...) cost nothing.
  * ``fuse=True``: elementwise operations joined by their values (a chain
    ending, at most, in one reduction) are one row, as XLA fuses them:
    their FLOPs summed, their bytes those of the values they read from
    outside and write for outside. Products are never fused (no GEMM
    epilogues). ``fuse=False``: every equation is a row.
  * Peaks: a product uses its operand format's peak (two FP8 or int8
    operands: ``"fp8"`` / ``"int8"``; two 16-bit floats: their type;
    float32 operands run as TF32 at JAX's default precision); everything
    else the chip's vector peak. Memory: the chip's HBM bandwidth for every
    byte (no caches: small operations are predicted too fast), and no
    launch overhead or overlap between operations.

  Args:
    fn: the function, e.g. a loss ``lambda params, batch: ...``.
    *args: its positional arguments (arrays or ``jax.ShapeDtypeStruct``).
    chip: a name of :data:`CHIPS` (``"H100 SXM"``, ``"A100"``, ``"TPU v5e"``,
      ...), ``"cpu"`` (measured here), a device kind or a :class:`Chip`.
    backward: also the backward pass.
    fuse: count elementwise chains as one operation.
    plot: draw the roofline (:meth:`RooflineReport.plot`; matplotlib).

  Returns:
    A :class:`RooflineReport`.

  Raises:
    ValueError: for an unknown chip, a product format the chip has no peak
      for (FP8 on an A100), or arguments that cannot be traced.
    TypeError: if ``fn`` is not callable.

  Examples:
    The lecture's layer: 4096 outputs from 1024 inputs at batch 512, in
    float16, then its ReLU, on a V100:

    >>> x = jax.ShapeDtypeStruct((512, 1024), jnp.float16)
    >>> w = jax.ShapeDtypeStruct((1024, 4096), jnp.float16)
    >>> report = roofline(lambda x, w: jax.nn.relu(x @ w), x, w, chip="V100", backward=False)
    >>> [(r.op, round(r.flops / 1e9, 1), round(r.bytes / 1e6, 1), round(r.intensity, 2), r.bound)
    ...  for r in report.rows]
    [('dot_general', 4.3, 13.6, 315.08, 'math'), ('max', 0.0, 8.4, 0.25, 'memory')]
    >>> round(report.ridge_points["float16"])
    139

  References:
    Williams, Waterman, Patterson, "Roofline", CACM 2009.
    ``jax.experimental.roofline`` (its per-primitive rules).
  """
  if not callable(fn):
    raise TypeError(f"roofline needs a callable as its first argument; got {type(fn).__name__} {fn!r:.80}.")
  chip = chips.chip_peaks(chip)
  _check_traceable(args)
  try:
    phases = jaxprs.trace(fn, args, bool(backward))
  except (TypeError, jax.errors.ConcretizationTypeError, jax.errors.TracerBoolConversionError) as e:
    raise ValueError(
      f"roofline could not trace fn on the given arguments ({type(e).__name__}: {str(e).splitlines()[0]}). "
      "Pass arrays or jax.ShapeDtypeStruct as positional arguments, bind static ones (ints, strings, "
      "configs) with functools.partial, and avoid Python control flow on array values."
    ) from e
  rows = []
  for phase, jaxpr in phases:
    rows += _scope_rows(jaxpr, chip, phase, bool(fuse))
  report = RooflineReport(rows=tuple(rows), chip=chip)
  if plot:
    report.plot()
  return report


def _check_traceable(args: tuple) -> None:
  for path, leaf in jax.tree_util.tree_flatten_with_path(args)[0]:
    ok = isinstance(leaf, (jax.Array, np.ndarray, np.generic, jax.ShapeDtypeStruct, int, float, complex, bool))
    if not ok and not (hasattr(leaf, "shape") and hasattr(leaf, "dtype")):
      where = jax.tree_util.keystr(path) or "<root>"
      raise ValueError(
        f"roofline traces fn on its arguments, and args{where} is a {type(leaf).__name__} ({leaf!r:.60}), "
        "which cannot be traced: pass arrays or jax.ShapeDtypeStruct, and bind other arguments with "
        "functools.partial."
      )
