"""Diagnostics that explain half precision: ``jmp_train.diagnostics``.

* :func:`gradient_histogram`, :func:`underflow_fraction`,
  :func:`overflow_fraction`: where values lie against float16/bfloat16's
  range, and what a cast does to them.
* :func:`suggest_loss_scale`: the largest power-of-two loss scale that fits.
* :func:`tensor_core_report`, :func:`pad_to_multiple`: matmuls and
  convolutions against the Tensor Core shape rules, and the Amdahl bound.
* :func:`precision_audit`: ops in half precision that should be float32,
  and matmuls left in float32; usable as a test assertion.
* :func:`saved_residuals`: the arrays the backward pass keeps (activation
  memory), each with its dtype and what produced it.
* :func:`plot_gradient_histogram`: the histogram as a bar chart against the
  float16 range (needs matplotlib: ``pip install 'jmp_train[plot]'``).
"""

from jmp_train._src.diagnostics import GradientHistogram
from jmp_train._src.diagnostics import Histogram
from jmp_train._src.diagnostics import ISSUE_KINDS
from jmp_train._src.diagnostics import LossScaleSuggestion
from jmp_train._src.diagnostics import MatmulEntry
from jmp_train._src.diagnostics import PrecisionIssue
from jmp_train._src.diagnostics import PrecisionReport
from jmp_train._src.diagnostics import TensorCoreReport
from jmp_train._src.diagnostics import gradient_histogram
from jmp_train._src.diagnostics import overflow_fraction
from jmp_train._src.diagnostics import pad_to_multiple
from jmp_train._src.diagnostics import precision_audit
from jmp_train._src.diagnostics import suggest_loss_scale
from jmp_train._src.diagnostics import tensor_core_report
from jmp_train._src.diagnostics import underflow_fraction
from jmp_train._src.diagnostics_plot import plot_gradient_histogram
from jmp_train._src.remat import SavedResidual
from jmp_train._src.remat import saved_residuals

__all__ = (
    "GradientHistogram",
    "Histogram",
    "ISSUE_KINDS",
    "LossScaleSuggestion",
    "MatmulEntry",
    "PrecisionIssue",
    "PrecisionReport",
    "SavedResidual",
    "TensorCoreReport",
    "gradient_histogram",
    "overflow_fraction",
    "pad_to_multiple",
    "plot_gradient_histogram",
    "precision_audit",
    "saved_residuals",
    "suggest_loss_scale",
    "tensor_core_report",
    "underflow_fraction",
)
