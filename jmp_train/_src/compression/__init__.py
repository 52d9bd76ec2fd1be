"""Compressed data parallelism: the 1-bit exchange and the optimizers built on it.

The codec and its exchange (Seide et al., 2014; worker and server error
feedback):

* ``sign_compression``: :func:`~jmp_train.sign_compression`, local
  gradients in, their 1-bit average out.
* ``sign_codec``: the worker's and the owner's encode and decode.
* ``sign_bits``: packing sign bits into words.
* ``sign_layout``: the flattened, padded and bucketed layout of a tree.
* ``wire_messages``: the float32 values that decode a chunk, appended to
  its codes in one byte message.
* ``compressed_mean``: :func:`~jmp_train.compressed_mean`, the bfloat16 and
  FP8 two-phase exchange.

Optimizers on local gradients (Tang et al., 2021):

* ``one_bit_adam``: :func:`~jmp_train.one_bit_adam`.
* ``one_bit_momentum``: :func:`~jmp_train.one_bit_momentum`.

Their argument checks and schedules are the library's
(``jmp_train._src.hyperparams``).

Local steps with periodic outer updates (Douillard et al., 2023):

* ``diloco``: :func:`~jmp_train.diloco`, exact or through a compressor.
* ``replica_averaging``: the transformation types that tell
  :func:`~jmp_train.make_train_step` these average replicas themselves.
"""
