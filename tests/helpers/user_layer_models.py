"""Language models built from layers of their own, the way model libraries write them.

Gemma-style code (Flax's own NNX Gemma example among them) brings its own
``RMSNorm`` class, an ``Embed`` subclass that scales the looked-up rows,
hand-written attention (``jnp.einsum`` projections or ``nnx.Einsum``
layers, ``jax.nn.softmax``) and a head tied to the embedding. A policy that
recognises Flax's layer classes misses all of them: the tests check on the
compiled step that the policy decided per operation reaches them anyway.

Sizes: a vocabulary of 64, width 32, 2 heads of 16, 2 blocks, 128 tokens
per sequence, 8 sequences per step: 1,024 tokens, so that each norm scale's
gradient is a sum over 1,024 elements and the embedding's a scatter of
1,024 rows.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

VOCAB, WIDTH, HEADS, HEAD_DIM, LAYERS, LENGTH, BATCH = 64, 32, 2, 16, 2, 128, 8


def token_batch(seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
  """``(tokens, next tokens)``: arithmetic progressions modulo the vocabulary."""
  rng = np.random.default_rng(seed)
  start = rng.integers(0, VOCAB, (BATCH, 1))
  stride = rng.integers(1, 4, (BATCH, 1))
  seq = (start + stride * np.arange(LENGTH + 1)) % VOCAB
  return seq[:, :-1].astype(np.int32), seq[:, 1:].astype(np.int32)


def _causal(length: int) -> jax.Array:
  return jnp.tril(jnp.ones((length, length), bool))


def _attend(q, k, v):
  """Hand-written attention: ``[b, t, h, k]`` queries, keys and values."""
  logits = jnp.einsum("bthk,bshk->bhts", q, k) / jnp.sqrt(q.shape[-1]).astype(q.dtype)
  logits = jnp.where(_causal(q.shape[1]), logits, jnp.finfo(logits.dtype).min)
  probs = jax.nn.softmax(logits, axis=-1)
  return jnp.einsum("bhts,bshk->bthk", probs, v)


# ---------------------------------------------------------------------------
# linen


class RMSNorm(nn.Module):
  """Gemma's norm: ``x / rms(x) * (1 + scale)``."""

  @nn.compact
  def __call__(self, x):
    scale = self.param("scale", nn.initializers.zeros_init(), (x.shape[-1],))
    var = jnp.mean(jnp.square(x), axis=-1, keepdims=True)
    return x * jax.lax.rsqrt(var + 1e-6) * (1 + scale)


class ScaledEmbed(nn.Embed):
  """``nn.Embed`` whose rows are scaled by ``sqrt(features)``; ``attend`` inherited."""

  def __call__(self, tokens):
    return super().__call__(tokens) * jnp.sqrt(float(self.features))


class EinsumAttention(nn.Module):
  @nn.compact
  def __call__(self, x):
    init = nn.initializers.normal(0.05)
    qkv = self.param("qkv", init, (3, x.shape[-1], HEADS, HEAD_DIM))
    q, k, v = jnp.einsum("btd,sdhk->sbthk", x, qkv)
    out = self.param("out", init, (HEADS, HEAD_DIM, x.shape[-1]))
    return jnp.einsum("bthk,hkd->btd", _attend(q, k, v), out)


class Block(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = x + EinsumAttention()(RMSNorm()(x))
    h = nn.gelu(nn.Dense(2 * WIDTH)(RMSNorm()(x)))
    return x + nn.Dense(WIDTH)(h)


class LinenUserLayersLM(nn.Module):
  @nn.compact
  def __call__(self, tokens):
    embed = ScaledEmbed(VOCAB, WIDTH, embedding_init=nn.initializers.normal(1.0))
    x = embed(tokens)
    for _ in range(LAYERS):
      x = Block()(x)
    return embed.attend(RMSNorm()(x))


# ---------------------------------------------------------------------------
# NNX


class NnxRMSNorm(nnx.Module):
  def __init__(self, width: int):
    self.scale = nnx.Param(jnp.zeros((width,)))

  def __call__(self, x):
    var = jnp.mean(jnp.square(x), axis=-1, keepdims=True)
    return x * jax.lax.rsqrt(var + 1e-6) * (1 + self.scale[...])


class NnxScaledEmbed(nnx.Embed):
  def __call__(self, tokens):
    return super().__call__(tokens) * jnp.sqrt(float(self.features))


class NnxEinsumAttention(nnx.Module):
  def __init__(self, rngs: nnx.Rngs):
    init = nnx.initializers.normal(0.05)
    self.q = nnx.Einsum("btd,dhk->bthk", (WIDTH, HEADS, HEAD_DIM), kernel_init=init, rngs=rngs)
    self.kv = nnx.Einsum("btd,sdhk->sbthk", (2, WIDTH, HEADS, HEAD_DIM), kernel_init=init, rngs=rngs)
    self.o = nnx.Einsum("bthk,hkd->btd", (HEADS, HEAD_DIM, WIDTH), kernel_init=init, rngs=rngs)

  def __call__(self, x):
    k, v = self.kv(x)
    return self.o(_attend(self.q(x), k, v))


class NnxBlock(nnx.Module):
  def __init__(self, rngs: nnx.Rngs):
    self.norm1, self.norm2 = NnxRMSNorm(WIDTH), NnxRMSNorm(WIDTH)
    self.attn = NnxEinsumAttention(rngs)
    self.up = nnx.Linear(WIDTH, 2 * WIDTH, rngs=rngs)
    self.down = nnx.Linear(2 * WIDTH, WIDTH, rngs=rngs)

  def __call__(self, x):
    x = x + self.attn(self.norm1(x))
    return x + self.down(nnx.gelu(self.up(self.norm2(x))))


class NnxUserLayersLM(nnx.Module):
  def __init__(self, rngs: nnx.Rngs):
    self.embed = NnxScaledEmbed(VOCAB, WIDTH, embedding_init=nnx.initializers.normal(1.0), rngs=rngs)
    self.blocks = nnx.List([NnxBlock(rngs) for _ in range(LAYERS)])
    self.norm = NnxRMSNorm(WIDTH)

  def __call__(self, tokens):
    x = self.embed(tokens)
    for block in self.blocks:
      x = block(x)
    return self.embed.attend(self.norm(x))
