"""Diagnostics that explain half precision, one module per question.

* :mod:`.histograms`, :mod:`.fractions`: where values lie against
  float16/bfloat16's range, what a cast does to them, and which loss scale
  moves them into range.
* :mod:`.tensor_cores`: matmuls and convolutions against the Tensor Core
  shape rules.
* :mod:`.precision_audit`: ops in half precision that should be float32,
  and matmuls left in float32.
* :mod:`.residuals`: the arrays the backward pass keeps.
* :mod:`.plotting`: the histogram as a chart (matplotlib).

Collective bytes read from compiled HLO live in :mod:`jmp_train._src.hlo`;
the public module ``jmp_train.diagnostics`` re-exports them.
"""

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
