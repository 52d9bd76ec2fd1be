"""A train-step builder: policy, loss scaling, compression and an optimizer.

:func:`make_train_step` composes a model (a Flax linen ``apply``, a linen
module or an NNX module), a loss, an optax optimizer, a dtype
:class:`~jmp_train.Policy`, optional loss scaling
(:func:`jmp_train.loss_scaled`) and optional gradient compression
(:func:`jmp_train.sign_compression`) into one compiled step

.. math::

  (\\text{state}_{t+1}, \\text{metrics}_t) = \\text{step}(\\text{state}_t,
  \\text{batch}_t)

for one device (``jit``), ``pmap``, or ``shard_map`` over a data-parallel
:class:`jax.sharding.Mesh`; the ``pmap`` and ``shard_map`` modes run unchanged
over several processes started with :func:`jax.distributed.initialize`.
:func:`save_checkpoint` / :func:`restore_checkpoint` store the whole
:class:`TrainState` with orbax, and a restored run continues bit-for-bit.

The pieces live in their own modules: ``train_state`` (:class:`TrainState`,
:class:`TrainStep`, :func:`tree_bytes`), ``train_model`` (the model
adapters), ``train_step`` (the builder), ``train_modes`` (the per-mode
wrappers), ``buckets`` (the bucketed gradient average) and ``checkpoint``.
"""

from __future__ import annotations

from jmp_train._src.checkpoint import restore_checkpoint
from jmp_train._src.checkpoint import save_checkpoint
from jmp_train._src.train_state import TrainState
from jmp_train._src.train_state import TrainStep
from jmp_train._src.train_state import tree_bytes
from jmp_train._src.train_step import make_train_step

__all__ = [
    "TrainState",
    "TrainStep",
    "make_train_step",
    "save_checkpoint",
    "restore_checkpoint",
    "tree_bytes",
]
