"""Transformations that average the replicas' local gradients themselves.

:func:`~jmp_train.sign_compression` and :func:`~jmp_train.compressed_mean`
(compressors chained before an optimizer) and :func:`~jmp_train.one_bit_adam`
and :func:`~jmp_train.one_bit_momentum` (complete optimizers) take each
replica's *local* gradients and run their own exchange across the mapped
axis. They return these ``optax.GradientTransformation`` subclasses, so that
:func:`~jmp_train.make_train_step` can tell them from an optimizer that
expects averaged gradients and name the argument they belong to.
"""

from __future__ import annotations

import optax

__all__ = ["ReplicaCompressor", "ReplicaOptimizer"]


class ReplicaCompressor(optax.GradientTransformation):
  """A compressor of local gradients: their replica average comes out."""

  __slots__ = ()


class ReplicaOptimizer(optax.GradientTransformation):
  """A complete optimizer on local gradients that averages them itself."""

  __slots__ = ()
