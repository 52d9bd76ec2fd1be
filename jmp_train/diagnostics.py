"""Diagnostics that explain half precision: ``jmp_train.diagnostics``.

* :func:`gradient_histogram`, :func:`underflow_fraction`,
  :func:`overflow_fraction`: where values lie against float16/bfloat16's
  range, and what a cast does to them.
* :func:`suggest_loss_scale`: the largest power-of-two loss scale that fits.
* :func:`fp8_cast_fractions`: the share of values an FP8 cast saturates,
  flushes to zero or leaves subnormal, at a given scale.
* :func:`tensor_core_report`, :func:`pad_to_multiple`: matmuls and
  convolutions against the Tensor Core shape rules (FP8 products: multiples
  of 16), and the Amdahl bound.
* :func:`fp8_products`: the matmuls and convolutions of a lowered or
  compiled step with their operand dtypes, and those not on FP8 operands;
  usable as a test assertion.
* :func:`precision_audit`: ops in half precision that should be float32,
  and matmuls left in float32; usable as a test assertion.
* :func:`saved_residuals`: the arrays the backward pass keeps (activation
  memory), each with its dtype and what produced it.
* :func:`collective_bytes`, :func:`collective_ops`,
  :func:`conditional_branches`: the bytes a compiled step exchanges between
  devices, read from its HLO, and which collectives run only in a branch.
* :func:`roofline`, :func:`roofline_compare`, :func:`data_parallel_exchange`:
  each operation's FLOPs, bytes and bound on a chip (:data:`CHIPS`,
  :func:`chip_peaks`) and the predicted time; the same function under
  several formats with a verdict; a data-parallel step's exchange against
  its compute, and the balance point.
* :func:`format_table`: the reports' markdown tables, for any rows.
* :func:`plot_gradient_histogram`: the histogram as a bar chart against the
  float16 range (needs matplotlib: ``pip install 'jmp_train[plot]'``).
"""

from jmp_train._src.diagnostics.fp8_casts import Fp8CastFractions
from jmp_train._src.diagnostics.fp8_casts import fp8_cast_fractions
from jmp_train._src.diagnostics.fp8_products import Fp8ProductReport
from jmp_train._src.diagnostics.fp8_products import ProductEntry
from jmp_train._src.diagnostics.fp8_products import fp8_products
from jmp_train._src.diagnostics.fractions import LossScaleSuggestion
from jmp_train._src.diagnostics.fractions import overflow_fraction
from jmp_train._src.diagnostics.fractions import suggest_loss_scale
from jmp_train._src.diagnostics.fractions import underflow_fraction
from jmp_train._src.diagnostics.histograms import GradientHistogram
from jmp_train._src.diagnostics.histograms import Histogram
from jmp_train._src.diagnostics.histograms import gradient_histogram
from jmp_train._src.diagnostics.plotting import plot_gradient_histogram
from jmp_train._src.diagnostics.precision_audit import ISSUE_KINDS
from jmp_train._src.diagnostics.precision_audit import PrecisionIssue
from jmp_train._src.diagnostics.precision_audit import PrecisionReport
from jmp_train._src.diagnostics.precision_audit import precision_audit
from jmp_train._src.diagnostics.residuals import SavedResidual
from jmp_train._src.diagnostics.residuals import saved_residuals
from jmp_train._src.diagnostics.tensor_cores import MatmulEntry
from jmp_train._src.diagnostics.tensor_cores import TensorCoreReport
from jmp_train._src.diagnostics.tensor_cores import pad_to_multiple
from jmp_train._src.diagnostics.tensor_cores import tensor_core_report
from jmp_train._src.diagnostics.chips import CHIPS
from jmp_train._src.diagnostics.chips import Chip
from jmp_train._src.diagnostics.chips import chip_peaks
from jmp_train._src.diagnostics.exchange import ExchangeReport
from jmp_train._src.diagnostics.exchange import ExchangeRow
from jmp_train._src.diagnostics.exchange import data_parallel_exchange
from jmp_train._src.diagnostics.format_compare import FormatComparison
from jmp_train._src.diagnostics.format_compare import FormatRow
from jmp_train._src.diagnostics.format_compare import roofline_compare
from jmp_train._src.diagnostics.roofline import RooflineReport
from jmp_train._src.diagnostics.roofline import RooflineRow
from jmp_train._src.diagnostics.roofline import roofline
from jmp_train._src.diagnostics.hlo import collective_bytes
from jmp_train._src.diagnostics.hlo import collective_ops
from jmp_train._src.diagnostics.hlo import conditional_branches
from jmp_train._src.tables import format_table

__all__ = (
  "CHIPS",
  "Chip",
  "ExchangeReport",
  "ExchangeRow",
  "FormatComparison",
  "FormatRow",
  "Fp8CastFractions",
  "fp8_cast_fractions",
  "Fp8ProductReport",
  "fp8_products",
  "GradientHistogram",
  "Histogram",
  "ISSUE_KINDS",
  "LossScaleSuggestion",
  "MatmulEntry",
  "PrecisionIssue",
  "PrecisionReport",
  "ProductEntry",
  "RooflineReport",
  "RooflineRow",
  "SavedResidual",
  "TensorCoreReport",
  "chip_peaks",
  "collective_bytes",
  "collective_ops",
  "conditional_branches",
  "data_parallel_exchange",
  "format_table",
  "gradient_histogram",
  "overflow_fraction",
  "pad_to_multiple",
  "plot_gradient_histogram",
  "precision_audit",
  "roofline",
  "roofline_compare",
  "saved_residuals",
  "suggest_loss_scale",
  "tensor_core_report",
  "underflow_fraction",
)
