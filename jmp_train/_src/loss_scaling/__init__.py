"""Loss scaling: static and dynamic scales, and the optax wrapper that skips.

* ``scales``: :class:`~jmp_train.NoOpLossScale`,
  :class:`~jmp_train.StaticLossScale`, :class:`~jmp_train.DynamicLossScale`.
* ``checks``: the validation of their arguments.
* ``wrapper``: :func:`~jmp_train.loss_scaled` and its state.
* ``steps``: the unscale, the finiteness test across replicas and the skip.
* ``lookup``: :func:`~jmp_train.get_loss_scale`,
  :func:`~jmp_train.loss_scale_metrics` (a scale found inside any state).
* ``scaled_grad``: :func:`~jmp_train.scaled_value_and_grad`.

The finiteness test, :func:`~jmp_train.all_finite`, is in
``jmp_train._src.leaf_checks`` (the step and the compressors use it too).
"""
