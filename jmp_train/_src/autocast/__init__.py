"""A policy as a function transformation: :func:`~jmp_train.autocast`.

* ``transform``: :func:`~jmp_train.autocast` itself (tracing, NNX modules
  among the arguments, the output cast).
* ``lists``: the AMP op lists (allow, deny, lookup) and their defaults.
* ``interpreter``: the rules that choose each equation's dtype.
* ``scaled``: the weight products it runs in the policy's narrow format
  (FP8, INT8), and the site hook calibration and quantized models use.
* ``sites``: the delayed FP8 scaling state of each product site, which a
  train step keeps in its model state.
* ``calls``: how calls are followed (``jit``, ``scan``, ``cond``,
  ``checkpoint``, ``shard_map``, ``custom_jvp``).
"""
