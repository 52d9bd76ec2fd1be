"""The train step: :func:`~jmp_train.make_train_step` and its checkpoints.

* ``step``: :func:`~jmp_train.make_train_step`.
* ``setup``: argument checks and the composed optimizer.
* ``replica_step``: one replica's step (policy casts, loss, gradients,
  exchange, update, skip).
* ``modes``: the compiled forms for one device, ``pmap`` and ``shard_map``.
* ``model``: adapters for linen applies, linen modules and NNX modules.
* ``model_policy``: how the policy reaches every product of the model
  (``apply_policy``, NNX layer fields, ``autocast``) and the audit of the
  products it leaves wide.
* ``state``: :class:`~jmp_train.TrainState` and :class:`~jmp_train.TrainStep`.
* ``checkpoint``: :func:`~jmp_train.save_checkpoint` and
  :func:`~jmp_train.checkpoint_save_args` (orbax, with checksums).
* ``checkpoint_restore``: :func:`~jmp_train.restore_checkpoint` and
  :func:`~jmp_train.restore_latest_checkpoint` (the fall-back to an older step).
* ``checkpoint_checksums``: the arrays' checksums, saved and verified.
* ``checkpoint_folders``: what a checkpoint folder is, its JSON files checked.
* ``checkpoint_store``: why an array store does not read, and which file holds
  a key (TensorStore's public API).
* ``checkpoint_orbax``: orbax's import, the noise of its failed reads, the
  threads of a failed save.
"""
