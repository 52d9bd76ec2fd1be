"""Narrow weights and optimizer state: half-precision updates and 8-bit moments.

Half-precision weights without a float32 master copy:

* ``modified_momentum``: :func:`~jmp_train.modified_momentum_sgd` (the
  momentum accumulates gradients, not steps).
* ``kahan_compensation``: :func:`~jmp_train.kahan_compensation`.
* ``stochastic_rounding``: :func:`~jmp_train.stochastic_rounding`.
* ``half_updates``: what the three share (the exact rounding of an update).

8-bit optimizer state:

* ``quantized_state``: :class:`~jmp_train.QuantizedArray`, blockwise 8-bit
  codes with float32 scales.
* ``moment_storage``: a moment stored in a floating dtype or in 8 bits.
* ``optimizers_8bit``: :func:`~jmp_train.adam_8bit`,
  :func:`~jmp_train.sgd_8bit`, :func:`~jmp_train.scale_by_narrow_adam`.
"""
