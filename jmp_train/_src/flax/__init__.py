"""Policies on Flax modules: ``jmp_train.flax``.

* ``policy``: :func:`~jmp_train.flax.apply_policy` and the linen and NNX
  wrappers, with the module classes kept in float32.
* ``layers``: linen interceptors that cast each layer's inputs and outputs.
* ``nnx_modules``: the NNX side (module surgery, float32 lookups).
* ``attention``: :func:`~jmp_train.flax.dot_product_attention` (cuDNN,
  XLA or explicit float32 softmax).
"""
