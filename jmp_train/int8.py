"""INT8 from training to deployment: ``jmp_train.int8``.

Reached as ``jmp_train.int8`` after ``import jmp_train``.

* :class:`Int8Recipe`: how INT8 products scale their operands (the
  ``"mixed_int8"`` policy's, ``matmul=int8`` in a spec: quantization-aware
  training with int8 products).
* :func:`int8_dot_general`, :func:`int8_conv_general_dilated`: products on
  int8 codes with int32 accumulation, symmetric per-row / per-channel
  scales, the straight-through estimator backward;
  :func:`int8_quantize`, :func:`int8_scale`: the codes and the scale.
* :func:`calibrate` (:class:`Calibration`): static activation scales per
  weight product, by ``"max"``, ``"percentile"``, ``"entropy"`` or ``"mse"``;
  ``smoothquant=alpha`` adds SmoothQuant's per-channel smoothing.
* :func:`quantize` (:class:`QuantizedModel`, :class:`Int8Weight`): int8
  weights per channel, products on int8 codes with the static scales.
* :func:`sensitivity` (:class:`Sensitivity`): each weight product quantized
  alone, and the sites to keep in high precision (``keep=``) for a target.
* :func:`quantization_report` (:class:`SiteQuantization`): per site, the
  share of the activation clipped and the quantization's signal-to-noise ratios.
* :func:`export_onnx`: the quantized model as ONNX (QuantizeLinear /
  DequantizeLinear, int8 weight initializers), for onnxruntime or TensorRT.
"""

from __future__ import annotations

from jmp_train._src.deployment.calibration import CALIBRATION_METHODS
from jmp_train._src.deployment.calibration import Calibration
from jmp_train._src.deployment.calibration import calibrate
from jmp_train._src.deployment.onnx_export import export_onnx
from jmp_train._src.int8.products import int8_conv_general_dilated
from jmp_train._src.int8.products import int8_dot_general
from jmp_train._src.int8.products import int8_quantize
from jmp_train._src.int8.products import int8_scale
from jmp_train._src.deployment.quantized import Int8Weight
from jmp_train._src.deployment.quantized import QuantizedModel
from jmp_train._src.deployment.quantized import quantize
from jmp_train._src.int8.recipe import Int8Recipe
from jmp_train._src.deployment.report import SiteQuantization
from jmp_train._src.deployment.report import quantization_report
from jmp_train._src.deployment.sensitivity import Sensitivity
from jmp_train._src.deployment.sensitivity import sensitivity

__all__ = (
  "CALIBRATION_METHODS",
  "Calibration",
  "Int8Recipe",
  "Int8Weight",
  "QuantizedModel",
  "Sensitivity",
  "SiteQuantization",
  "calibrate",
  "export_onnx",
  "int8_conv_general_dilated",
  "int8_dot_general",
  "int8_quantize",
  "int8_scale",
  "quantization_report",
  "quantize",
  "sensitivity",
)
