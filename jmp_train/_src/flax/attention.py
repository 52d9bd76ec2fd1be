"""Attention under a dtype policy: half-precision matmuls, float32 softmax.

:func:`dot_product_attention` is the ``attention_fn`` that
:func:`jmp_train.flax.apply_policy` installs in Flax's attention layers. It
has two implementations with the same guarantee, the softmax in float32:

* **fused**: ``jax.nn.dot_product_attention`` with cuDNN's kernel (flash
  attention on NVIDIA GPUs), which never writes the score matrix to memory
  and keeps the softmax statistics (running maximum and log-sum-exp) in
  float32;
* **explicit**: the score matrix from a half-precision matmul, the softmax
  in float32, the weights rounded back to the compute dtype for the second
  matmul, so both matmuls (and their backward passes) run in half precision.

``implementation="auto"`` takes the fused kernel where it is available and
accepts the call, and the explicit path otherwise.

References:
  Dao et al., "FlashAttention: Fast and Memory-Efficient Exact Attention
  with IO-Awareness", NeurIPS 2022. https://arxiv.org/abs/2205.14135
  Micikevicius et al., "Mixed Precision Training", ICLR 2018.
  https://arxiv.org/abs/1710.03740
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["ATTENTION_IMPLEMENTATIONS", "dot_product_attention", "fused_attention_unsupported"]

ATTENTION_IMPLEMENTATIONS = ("auto", "cudnn", "xla", "explicit")

_F32 = np.dtype(jnp.float32)
_FUSED_DTYPES = (np.dtype(jnp.float16), np.dtype(jnp.bfloat16), _F32)
# What cuDNN's kernel raises, at trace time, for a call it does not take
# (no cuDNN, an old version, a shape, dtype or mask it does not support).
_CUDNN_REFUSALS = (RuntimeError, ValueError, NotImplementedError, TypeError)


def fused_attention_unsupported(
  query: Any,
  key: Any,
  value: Any,
  bias: Any = None,
  mask: Any = None,
  *,
  dtype: Any = None,
  dropout: bool = False,
  sow: bool = False,
  precision: Any = None,
  force_fp32_for_softmax: bool = True,
) -> str | None:
  """Why a call cannot go through ``jax.nn.dot_product_attention`` (None: it can).

  Args:
    query: ``[batch..., q_length, num_heads, head_dim]``.
    key: ``[batch..., kv_length, num_kv_heads, head_dim]``.
    value: ``[batch..., kv_length, num_kv_heads, v_dim]``.
    bias: the additive bias, or None.
    mask: the boolean mask, or None.
    dtype: the matmuls' dtype.
    dropout: whether dropout on the attention weights is active.
    sow: whether the attention weights are to be recorded (``module``).
    precision: the matmuls' ``jax.lax.Precision``.
    force_fp32_for_softmax: whether the softmax must run in float32.

  Returns:
    ``None`` when the fused function can compute this call, else the reason.

  Examples:
    >>> q = jnp.ones((2, 8, 4, 16), jnp.bfloat16)
    >>> fused_attention_unsupported(q, q, q) is None
    True
    >>> fused_attention_unsupported(q, q, q, dropout=True)
    'dropout on the attention weights'
  """
  dtype = np.dtype(jnp.result_type(query, key, value) if dtype is None else dtype)
  head_dim, v_dim = np.shape(key)[-1], np.shape(value)[-1]
  reasons = (
    (dropout, "dropout on the attention weights"),
    (sow, "the attention weights are sown"),
    (precision is not None, "an explicit matmul precision"),
    (not force_fp32_for_softmax, "a half-precision softmax was asked for"),
    (dtype not in _FUSED_DTYPES, f"dtype {dtype.name}"),
    (np.ndim(query) not in (3, 4) or np.ndim(key) != np.ndim(query), "more than one batch dimension"),
    (v_dim != head_dim, "values and keys of different head sizes"),
    (np.shape(query)[-2] % max(np.shape(key)[-2], 1) != 0, "query heads not a multiple of key heads"),
    (any(t is not None and np.ndim(t) > 4 for t in (bias, mask)), "a mask or bias of more than 4 dimensions"),
  )
  return next((why for bad, why in reasons if bad), None)


def _causal_mask(q_len: int, kv_len: int) -> jax.Array:
  """Query ``i`` sees keys ``<= i + kv_len - q_len`` (the last query sees all)."""
  return jnp.tril(jnp.ones((q_len, kv_len), bool), kv_len - q_len)


def _fused(query, key, value, bias, mask, is_causal, implementation):
  """``jax.nn.dot_product_attention``; ``implementation`` None is XLA's."""
  q_len, kv_len = query.shape[-3], key.shape[-3]
  if is_causal and q_len != kv_len:
    # jax.nn's causal mask is aligned top-left; ours (and Flax's) bottom-right.
    causal = _causal_mask(q_len, kv_len)
    mask, is_causal = (causal if mask is None else jnp.logical_and(mask, causal)), False
  if mask is not None:
    mask = jnp.asarray(mask).astype(bool)
  if bias is not None:
    bias = jnp.asarray(bias, _F32 if implementation is None else query.dtype)
  return jax.nn.dot_product_attention(
    query,
    key,
    value,
    bias=bias,
    mask=mask,
    is_causal=is_causal,
    implementation=implementation,
  )


def _explicit(query, key, value, bias, mask, dtype, precision, module, force_fp32_for_softmax, is_causal, dropout):
  """Scores in ``dtype``, softmax in float32, weights back to ``dtype``."""
  query = query / jnp.sqrt(query.shape[-1]).astype(dtype)
  logits = jnp.einsum("...qhd,...khd->...hqk", query, key, precision=precision)
  # At least float32 (float64 stays float64), without jnp.promote_types,
  # which strict dtype promotion forbids for bfloat16/float32.
  widen = force_fp32_for_softmax and dtype.itemsize < _F32.itemsize
  softmax_dtype = _F32 if widen else dtype
  logits = logits.astype(softmax_dtype)
  if bias is not None:
    logits = logits + jnp.asarray(bias, softmax_dtype)
  if is_causal:
    causal = _causal_mask(*logits.shape[-2:])
    mask = causal if mask is None else jnp.logical_and(mask, causal)
  if mask is not None:
    big_neg = jnp.finfo(softmax_dtype).min
    logits = jnp.where(mask, logits, jnp.asarray(big_neg, softmax_dtype))
  weights = jax.nn.softmax(logits, axis=-1)
  if module is not None:
    if isinstance(module, nn.Module):
      module.sow("intermediates", "attention_weights", weights)
    else:
      module.sow(nnx.Intermediate, "attention_weights", weights)
  weights = weights.astype(dtype)
  if dropout is not None:
    rng, rate, broadcast = dropout
    keep_prob = 1.0 - rate
    shape = (1,) * (key.ndim - 2) + weights.shape[-2:] if broadcast else weights.shape
    keep = jax.random.bernoulli(rng, keep_prob, shape)
    weights = weights * (keep.astype(dtype) / jnp.asarray(keep_prob, dtype))
  return jnp.einsum("...hqk,...khd->...qhd", weights, value, precision=precision)


def _check_shapes(q: tuple[int, ...], k: tuple[int, ...], v: tuple[int, ...]) -> None:
  """Raises ``ValueError`` unless the shapes are ``[batch..., length, heads, dim]`` alike."""
  shapes = f"query {q}, key {k}, value {v}"
  if not len(q) == len(k) == len(v) >= 3:
    raise ValueError(
      f"query, key and value must have the same rank, at least 3 "
      f"([batch..., length, num_heads, head_dim]); got {shapes}."
    )
  for what, ok in (
    ("batch dimensions", q[:-3] == k[:-3] == v[:-3]),
    ("num_heads", q[-2] == k[-2] == v[-2]),
    ("key and value lengths", k[-3] == v[-3]),
    ("query and key head_dim", q[-1] == k[-1]),
  ):
    if not ok:
      raise ValueError(f"The {what} must match; got {shapes}.")


def dot_product_attention(
  query: jax.Array,
  key: jax.Array,
  value: jax.Array,
  bias: jax.Array | None = None,
  mask: jax.Array | None = None,
  broadcast_dropout: bool = True,
  dropout_rng: jax.Array | None = None,
  dropout_rate: float = 0.0,
  deterministic: bool = False,
  dtype: Any = None,
  precision: Any = None,
  module: Any = None,
  force_fp32_for_softmax: bool = True,
  is_causal: bool = False,
  implementation: str = "auto",
) -> jax.Array:
  r"""Dot-product attention with matmuls in ``dtype`` and softmax in float32.

  .. math::

    \mathrm{out} = \mathrm{cast}_{d}\big(\mathrm{softmax}_{f32}(
      q k^\top / \sqrt{d_k} + b)\big)\, v

  A drop-in ``attention_fn`` for ``flax.linen.MultiHeadDotProductAttention``
  and ``flax.nnx.MultiHeadAttention`` (it takes the keyword arguments of
  both). Flax's ``force_fp32_for_softmax=True`` (linen only) computes the
  softmax in float32 but leaves the weights in float32, so the
  weights-times-values matmul then runs in float32 too; here both matmuls
  run in ``dtype``.

  ``implementation`` chooses how:

  * ``"auto"``: cuDNN's fused kernel through ``jax.nn.dot_product_attention``
    when the default backend is a GPU and the call qualifies (see
    ``fused_attention_unsupported``; cuDNN itself may refuse a shape,
    which falls back too), else ``"explicit"``.
  * ``"cudnn"``: the fused kernel, or the error cuDNN raises.
  * ``"xla"``: ``jax.nn.dot_product_attention``'s XLA implementation. Its
    scores stay float32 (the matmul's float32 accumulator), one rounding
    fewer than the explicit path, but its backward pass then runs the two
    score-gradient matmuls in float32, which is why ``"auto"`` does not take
    it.
  * ``"explicit"``: the scores from a ``dtype`` matmul are rounded to
    ``dtype`` (a float32 accumulator would make the backward matmuls
    float32), widened, softmaxed in float32 and rounded back to ``dtype``.

  Dropout on the attention weights, sowing them (``module``), an explicit
  ``precision``, or ``force_fp32_for_softmax=False`` always take the
  explicit path.

  Args:
    query: ``[batch..., q_length, num_heads, head_dim]``.
    key: ``[batch..., kv_length, num_heads, head_dim]``.
    value: ``[batch..., kv_length, num_heads, v_dim]``.
    bias: optional additive bias, broadcastable to
      ``[batch..., num_heads, q_length, kv_length]``.
    mask: optional boolean mask of the same broadcast shape (``False``:
      masked out).
    broadcast_dropout: share the dropout mask over batch and head dims.
    dropout_rng: PRNG key for dropout.
    dropout_rate: attention-weight dropout rate.
    deterministic: disable dropout.
    dtype: dtype of the two matmuls (default: promoted from the inputs).
    precision: ``jax.lax.Precision`` of the matmuls.
    module: a linen or NNX module to sow the float32 attention weights into
      (``intermediates`` / ``nnx.Intermediate``), or ``None``.
    force_fp32_for_softmax: softmax in float32 (the point of this function;
      ``False`` computes it in ``dtype`` like Flax's default).
    is_causal: apply a causal mask as well (aligned bottom-right: the last
      query sees every key).
    implementation: one of ``ATTENTION_IMPLEMENTATIONS``.

  Returns:
    ``[batch..., q_length, num_heads, v_dim]`` in ``dtype``.

  Raises:
    ValueError: for shapes that do not fit together as above, an unknown
      ``implementation``, or ``"cudnn"``/``"xla"`` for a call that
      ``jax.nn.dot_product_attention`` cannot compute.

  Examples:
    >>> q = k = v = jnp.ones((2, 8, 4, 16), jnp.bfloat16)
    >>> dot_product_attention(q, k, v).dtype
    dtype(bfloat16)
    >>> fused = dot_product_attention(q, k, v, is_causal=True, implementation="xla")
    >>> explicit = dot_product_attention(q, k, v, is_causal=True, implementation="explicit")
    >>> bool(jnp.allclose(fused, explicit))
    True

  References:
    Dao et al., "FlashAttention: Fast and Memory-Efficient Exact Attention
    with IO-Awareness", NeurIPS 2022. https://arxiv.org/abs/2205.14135
  """
  if implementation not in ATTENTION_IMPLEMENTATIONS:
    raise ValueError(f"implementation must be one of {ATTENTION_IMPLEMENTATIONS}, got {implementation!r}.")
  _check_shapes(jnp.shape(query), jnp.shape(key), jnp.shape(value))
  dtype = np.dtype(jnp.result_type(query, key, value) if dtype is None else dtype)
  query, key, value = (jnp.asarray(t, dtype) for t in (query, key, value))
  dropout = None
  if not deterministic and dropout_rate > 0.0:
    dropout = (dropout_rng, dropout_rate, broadcast_dropout)
  if implementation != "explicit":
    why = fused_attention_unsupported(
      query,
      key,
      value,
      bias,
      mask,
      dtype=dtype,
      dropout=dropout is not None,
      sow=module is not None,
      precision=precision,
      force_fp32_for_softmax=force_fp32_for_softmax,
    )
    if why is not None and implementation != "auto":
      raise ValueError(f"implementation={implementation!r} cannot compute this call: {why}.")
    if why is None and implementation == "xla":
      return _fused(query, key, value, bias, mask, is_causal, None)
    if why is None and (implementation == "cudnn" or jax.default_backend() == "gpu"):
      try:
        return _fused(query, key, value, bias, mask, is_causal, "cudnn")
      except _CUDNN_REFUSALS:
        if implementation == "cudnn":
          raise
  return _explicit(query, key, value, bias, mask, dtype, precision, module, force_fp32_for_softmax, is_causal, dropout)
