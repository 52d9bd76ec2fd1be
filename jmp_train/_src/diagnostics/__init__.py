"""Diagnostics that explain narrow formats, one module per question.

* ``histograms``, ``fractions``: where values lie against float16/bfloat16's
  range, what a cast does to them, and which loss scale moves them into
  range.
* ``fp8_casts``: what an FP8 cast saturates, flushes or leaves subnormal.
* ``fp8_products``: the matmuls and convolutions of a lowered or compiled
  step with their operand dtypes, and those not on FP8 operands.
* ``tensor_cores``: matmuls and convolutions against the Tensor Core shape
  rules.
* ``precision_audit``: ops in half precision that should be float32, and
  matmuls left in float32.
* ``residuals``: the arrays the backward pass keeps.
* ``hlo``: the collectives of a compiled step and the bytes they move.
* ``plotting``: the histogram as a chart (matplotlib).
* ``chips``, ``roofline``, ``format_compare``, ``exchange``: chip peaks, the
  roofline of a function's operations, the same function under several
  formats, and a data-parallel step's exchange against its compute.

Their shared pieces: ``arguments`` (checks of their arguments, the float
formats), ``jaxprs`` (a function's forward and backward jaxprs, walked
equation by equation) and ``op_groups`` (the roofline's operations, flattened
and fused into groups).

The public module ``jmp_train.diagnostics`` re-exports their names.
"""
