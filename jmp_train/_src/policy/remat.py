"""A ``jax.checkpoint`` policy that keeps only half-precision residuals.

Mixed-precision training halves the activation memory only if what the
forward pass keeps for the backward pass is in half precision. By default
JAX keeps whatever the backward pass reads, and under a mixed policy that
includes float32 values: the float32 regions (normalization statistics and
outputs, the attention softmax, the logits of the loss), the half-precision
copies of the float32 weights made by every layer's cast, and boolean masks
(``relu``'s ``x > 0``) next to the values they were computed from.
:func:`half_precision_saveable` keeps the half-precision values alone and
recomputes the rest from them in the backward pass: casts, comparisons and
float32 elementwise work, which cost little next to the matmuls.

References:
  Chen et al., "Training Deep Nets with Sublinear Memory Cost", 2016
  (recomputation). https://arxiv.org/abs/1604.06174
  JAX, "Gradient checkpointing with jax.checkpoint".
  https://docs.jax.dev/en/latest/gradient-checkpointing.html
"""

from __future__ import annotations

from typing import Any

import numpy as np

from jmp_train._src.dtypes import is_floating_dtype

__all__ = ["half_precision_saveable"]

# Casts are never saved: their input is either an argument (a float32
# weight: no memory beyond what the caller holds) or another value that is
# itself saved or recomputed, so saving the cast's output would store the
# same data twice.
_NEVER_SAVED = frozenset({"convert_element_type", "reduce_precision"})
# Fused attention kernels (cuDNN's, through jax.nn.dot_product_attention):
# their outputs, the attention output in half precision and the float32
# softmax statistics (one value per query and head, small), are saved;
# recomputing them would rerun the whole attention forward pass.
_ALWAYS_SAVED = frozenset({"dot_product_attention_fwd", "dot_product_attention_fwd_wrapper"})


def _is_half_floating(aval: Any) -> bool:
  dtype = getattr(aval, "dtype", None)
  # Extended dtypes (PRNG keys) are not floating: recomputed.
  return is_floating_dtype(dtype) and np.dtype(dtype).itemsize <= 2


def half_precision_saveable(prim: Any, *avals: Any, **params: Any) -> bool:
  """``jax.checkpoint`` policy: save only floating values of 16 bits or less.

  Under ``jax.checkpoint(fun, policy=half_precision_saveable)`` the backward
  pass of ``fun`` finds saved only the outputs of operations whose every
  output is a float16, bfloat16 (or 8-bit float) array, casts excepted;
  everything else (float32 values, integer and boolean values, casts) is
  recomputed from those and from ``fun``'s arguments. A fused attention
  kernel's outputs (``jax.nn.dot_product_attention`` on cuDNN) are saved
  too, its float32 softmax statistics included: one value per query and
  head, where recomputing them would rerun the kernel. Under a mixed
  policy the saved values are the matmul and convolution outputs and the
  half-precision activations: half the bytes of the same activations in
  float32, while the float32 regions the policy keeps for accuracy stay
  float32 (they are recomputed in float32, not stored in half). Under a
  float32 policy nothing floating qualifies and the whole function is
  recomputed (as with ``jax.checkpoint_policies.nothing_saveable``).

  The gradients are the same values as without ``jax.checkpoint`` (the
  recomputation repeats the forward operations: bit for bit op by op; under
  ``jit`` XLA may keep half-precision intermediates in float32 differently
  in the two programs, a difference at the half dtype's rounding level);
  the cost is the recomputed elementwise and normalization work in the
  backward pass.

  Use it wherever JAX takes a checkpoint policy: ``jax.checkpoint(loss_fn,
  policy=half_precision_saveable)``, ``flax.linen.remat(Block,
  policy=...)`` (also inside a model wrapped by
  :func:`jmp_train.flax.apply_policy`), ``flax.nnx.remat(fn, policy=...)``,
  or ``jmp_train.make_train_step(..., remat_policy=...)``.

  Args:
    prim: the JAX primitive of an equation (given by ``jax.checkpoint``).
    *avals: the abstract values of its inputs.
    **params: its parameters.

  Returns:
    Whether the equation's outputs may be saved for the backward pass.

  Examples:
    >>> import jax
    >>> def f(w, x):
    ...   h = (x.astype(jnp.float16) @ w.astype(jnp.float16))
    ...   return jnp.sum(jax.nn.relu(h).astype(jnp.float32) ** 2)
    >>> f = jax.checkpoint(f, policy=half_precision_saveable)
    >>> g = jax.grad(f)(jnp.ones((4, 4)), jnp.ones((2, 4)))
    >>> g.dtype
    dtype('float32')

  References:
    Chen et al., "Training Deep Nets with Sublinear Memory Cost", 2016.
    https://arxiv.org/abs/1604.06174
  """
  if prim.name in _ALWAYS_SAVED:
    return True
  if prim.name in _NEVER_SAVED:
    return False
  try:
    out = prim.abstract_eval(*avals, **params)
  except Exception:
    # No shape rule we can call here (e.g. a higher-order primitive):
    # recomputing is always correct.
    return False
  # Most rules return (output avals, effects); older ones the avals alone.
  if isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], (set, frozenset)):
    out = out[0]
  outs = out if isinstance(out, (list, tuple)) else (out,)
  return bool(outs) and all(_is_half_floating(o) for o in outs)
