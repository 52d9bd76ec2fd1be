"""A small causal Transformer language model in Flax linen and NNX, twins.

:class:`TransformerBlock` / :class:`NNXTransformerBlock`: token and position
``Embed``, pre-norm decoder layers (:class:`TransformerLayer` /
:class:`NNXTransformerLayer`: ``LayerNorm`` + multi-head attention +
``Dropout`` + ``Dense`` MLP), a final ``RMSNorm`` and a ``head``; tokens
in, logits out. See :mod:`jmp_train_examples.models`.

References:
  Vaswani et al., "Attention Is All You Need", NeurIPS 2017.
  https://arxiv.org/abs/1706.03762
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx

__all__ = ["NNXTransformerBlock", "NNXTransformerLayer", "TransformerBlock", "TransformerLayer"]


class TransformerLayer(nn.Module):
  """A pre-norm decoder layer (linen).

  ``x + drop(attn(ln1(x)))``, then ``x + drop(mlp_out(gelu(mlp_in(ln2(x)))))``.

  Attributes:
    d_model: model width.
    num_heads: attention heads (``d_model`` divisible by it).
    mlp_dim: hidden width of the MLP.
    dropout_rate: dropout on attention weights and on both residual branches.
  """

  d_model: int = 64
  num_heads: int = 4
  mlp_dim: int = 256
  dropout_rate: float = 0.0

  @nn.compact
  def __call__(self, x: jax.Array, mask: jax.Array | None, train: bool = False) -> jax.Array:
    h = nn.LayerNorm(name="ln1")(x)
    h = nn.MultiHeadDotProductAttention(
      num_heads=self.num_heads,
      qkv_features=self.d_model,
      dropout_rate=self.dropout_rate,
      deterministic=not train,
      name="attn",
    )(h, h, mask=mask)
    x = x + nn.Dropout(self.dropout_rate, deterministic=not train)(h)
    h = nn.LayerNorm(name="ln2")(x)
    h = nn.gelu(nn.Dense(self.mlp_dim, name="mlp_in")(h))
    h = nn.Dense(self.d_model, name="mlp_out")(h)
    return x + nn.Dropout(self.dropout_rate, deterministic=not train)(h)


class NNXTransformerLayer(nnx.Module):
  """The NNX twin of :class:`TransformerLayer`.

  Args:
    d_model: model width.
    num_heads: attention heads (``d_model`` divisible by it).
    mlp_dim: hidden width of the MLP.
    dropout_rate: dropout on attention weights and on both residual branches.
    rngs: ``nnx.Rngs`` with ``params`` (and ``dropout`` to train with it).
  """

  def __init__(
    self,
    d_model: int = 64,
    num_heads: int = 4,
    mlp_dim: int = 256,
    dropout_rate: float = 0.0,
    *,
    rngs: nnx.Rngs,
  ):
    self.ln1 = nnx.LayerNorm(d_model, rngs=rngs)
    self.attn = nnx.MultiHeadAttention(
      num_heads=num_heads,
      in_features=d_model,
      qkv_features=d_model,
      dropout_rate=dropout_rate,
      decode=False,
      rngs=rngs,
    )
    self.ln2 = nnx.LayerNorm(d_model, rngs=rngs)
    self.mlp_in = nnx.Linear(d_model, mlp_dim, rngs=rngs)
    self.mlp_out = nnx.Linear(mlp_dim, d_model, rngs=rngs)
    # Without dropout, no rng state is kept (nor needed at call time).
    self.dropout = nnx.Dropout(dropout_rate, rngs=rngs if dropout_rate else None)

  def __call__(self, x: jax.Array, mask: jax.Array | None, train: bool = False) -> jax.Array:
    det = not train
    h = self.ln1(x)
    h = self.attn(h, h, mask=mask, deterministic=det)
    x = x + self.dropout(h, deterministic=det)
    h = nnx.gelu(self.mlp_in(self.ln2(x)))
    h = self.mlp_out(h)
    return x + self.dropout(h, deterministic=det)


class TransformerBlock(nn.Module):
  """A small causal Transformer language model (linen).

  Token ``embed`` + learned ``pos_embed``, ``num_layers``
  :class:`TransformerLayer` (``layer0``...), a final ``RMSNorm``
  (``final_norm``) and a ``Dense`` ``head`` to ``vocab_size`` logits.

  Attributes:
    vocab_size: vocabulary (256: bytes).
    d_model: model width.
    num_heads: attention heads.
    mlp_dim: MLP hidden width.
    num_layers: decoder layers.
    max_len: longest sequence (size of the position embedding).
    dropout_rate: dropout rate.

  Examples:
    >>> model = TransformerBlock(vocab_size=256, d_model=64, num_heads=4)
    >>> tokens = jnp.zeros((2, 16), jnp.int32)
    >>> variables = model.init(jax.random.key(0), tokens)
    >>> model.apply(variables, tokens).shape
    (2, 16, 256)
  """

  vocab_size: int = 256
  d_model: int = 64
  num_heads: int = 4
  mlp_dim: int = 256
  num_layers: int = 1
  max_len: int = 128
  dropout_rate: float = 0.0

  @nn.compact
  def __call__(self, tokens: jax.Array, train: bool = False) -> jax.Array:
    length = tokens.shape[-1]
    if length > self.max_len:
      raise ValueError(f"Sequence length {length} exceeds max_len={self.max_len}.")
    x = nn.Embed(self.vocab_size, self.d_model, name="embed")(tokens)
    x = x + nn.Embed(self.max_len, self.d_model, name="pos_embed")(jnp.arange(length))
    mask = nn.make_causal_mask(tokens)
    for i in range(self.num_layers):
      x = TransformerLayer(
        self.d_model,
        self.num_heads,
        self.mlp_dim,
        self.dropout_rate,
        name=f"layer{i}",
      )(x, mask, train)
    x = nn.RMSNorm(name="final_norm")(x)
    return nn.Dense(self.vocab_size, name="head")(x)


class NNXTransformerBlock(nnx.Module):
  """The NNX twin of :class:`TransformerBlock`.

  Args:
    vocab_size: vocabulary (256: bytes).
    d_model: model width.
    num_heads: attention heads.
    mlp_dim: MLP hidden width.
    num_layers: decoder layers.
    max_len: longest sequence (size of the position embedding).
    dropout_rate: dropout rate.
    rngs: ``nnx.Rngs`` with ``params`` (and ``dropout`` to train with it).

  Examples:
    >>> model = NNXTransformerBlock(d_model=32, num_heads=2, rngs=nnx.Rngs(0))
    >>> model(jnp.zeros((2, 16), jnp.int32)).shape
    (2, 16, 256)
  """

  def __init__(
    self,
    vocab_size: int = 256,
    d_model: int = 64,
    num_heads: int = 4,
    mlp_dim: int = 256,
    num_layers: int = 1,
    max_len: int = 128,
    dropout_rate: float = 0.0,
    *,
    rngs: nnx.Rngs,
  ):
    self.max_len = max_len
    self.embed = nnx.Embed(vocab_size, d_model, rngs=rngs)
    self.pos_embed = nnx.Embed(max_len, d_model, rngs=rngs)
    self.num_layers = num_layers
    for i in range(num_layers):
      layer = NNXTransformerLayer(d_model, num_heads, mlp_dim, dropout_rate, rngs=rngs)
      setattr(self, f"layer{i}", layer)
    self.final_norm = nnx.RMSNorm(d_model, rngs=rngs)
    self.head = nnx.Linear(d_model, vocab_size, rngs=rngs)

  def __call__(self, tokens: jax.Array, train: bool = False) -> jax.Array:
    length = tokens.shape[-1]
    if length > self.max_len:
      raise ValueError(f"Sequence length {length} exceeds max_len={self.max_len}.")
    x = self.embed(tokens) + self.pos_embed(jnp.arange(length))
    mask = nnx.make_causal_mask(tokens)
    for i in range(self.num_layers):
      x = getattr(self, f"layer{i}")(x, mask, train)
    return self.head(self.final_norm(x))
