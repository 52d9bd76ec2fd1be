"""FP8 products with per-tensor scales (E4M3 forward, E5M2 gradients).

* ``scaling``: :class:`~jmp_train.Fp8Recipe`, the meta (amax histories and
  scales), :func:`~jmp_train.fp8_quantize`, :func:`~jmp_train.fp8_dequantize`.
* ``products``: :func:`~jmp_train.fp8_dot_general`,
  :func:`~jmp_train.fp8_conv_general_dilated` and their custom gradients.
* ``flax_layers``: the linen and NNX layers that hold the meta.
* ``narrow``: the one place where a narrow product (FP8 or INT8) is scaled,
  quantized, multiplied and rescaled, with its custom gradient.
"""
