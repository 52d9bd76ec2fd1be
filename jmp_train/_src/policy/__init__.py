"""Dtype policies: what precision parameters, computation and outputs use.

* ``policy``: :class:`~jmp_train.Policy` (param / compute / output dtypes,
  the FP8 recipe), :func:`~jmp_train.get_policy` specs and presets,
  :func:`~jmp_train.cast_floating`.
* ``remat``: :func:`~jmp_train.half_precision_saveable`, a
  ``jax.checkpoint`` policy that keeps only half-precision activations.

The float dtypes themselves (parsing, :func:`~jmp_train.half_dtype`, the
one floating-leaf predicate) are in ``jmp_train._src.dtypes``.
"""
