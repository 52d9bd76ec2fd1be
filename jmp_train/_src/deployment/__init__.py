"""INT8 deployment: from a trained model to one a runtime loads.

* ``calibration``: :func:`~jmp_train.int8.calibrate`, static activation
  scales per weight product ("max", "percentile", "entropy", "mse").
* ``quantized``: :func:`~jmp_train.int8.quantize`, int8 weights per channel
  and products on int8 codes with the static scales.
* ``rules``: ``keep=`` rules, the weight products left in high precision.
* ``smoothquant``: SmoothQuant's per-channel factors (``calibrate(...,
  smoothquant=alpha)``), folded into the weights by ``quantize``.
* ``sensitivity``: :func:`~jmp_train.int8.sensitivity`, each product
  quantized alone, and those to keep for a target.
* ``report``: :func:`~jmp_train.int8.quantization_report`, per product the
  share clipped and the signal-to-noise ratios.
* ``onnx_export``: :func:`~jmp_train.int8.export_onnx`, the quantized model
  as ONNX (QuantizeLinear / DequantizeLinear, int8 initializers).

Each runs the model under :func:`~jmp_train.autocast` and its site hook
(``autocast.scaled``); the products are the ``int8`` package's.
"""
