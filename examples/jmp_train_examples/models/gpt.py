"""A GPT-style decoder language model in Flax linen, from ~125M to ~1.5B parameters.

:class:`GPT`: token embedding (``wte``), learned (``wpe``) or rotary
positions, ``num_layers`` pre-norm blocks (:class:`GPTBlock`: ``LayerNorm`` +
causal self-attention through :func:`jmp_train.flax.dot_product_attention`,
``LayerNorm`` + GELU or SwiGLU MLP), a final ``LayerNorm`` and a head tied
to ``wte`` or not (``lm_head``). Every size lives in a :class:`GPTConfig`;
its presets (:meth:`GPTConfig.tiny`, :meth:`GPTConfig.gpt_125m`,
:meth:`GPTConfig.gpt_1b`, ...) span the sizes people train.

The model is dtype-agnostic, like the other example models: it computes in
the dtype of the parameters it is given, so a train step that casts float32
parameters to bfloat16 (``make_train_step(..., policy="mixed_bfloat16")``)
runs every matmul in bfloat16. Two parts stay in float32 whatever the
parameters: attention's softmax (``dot_product_attention``; cuDNN's fused
kernel on GPUs) and the loss. ``model.apply(variables, tokens, targets)``
returns the mean next-token cross-entropy computed by
:func:`chunked_cross_entropy` (logits and their float32 log-softmax one chunk
of tokens at a time, recomputed in the backward pass, so that no
``[tokens, vocab]`` float32 array is ever whole); without ``targets`` it
returns the logits. :func:`gpt_train_fns` adapts it to
:func:`jmp_train.make_train_step`.

References:
  Radford et al., "Language Models are Unsupervised Multitask Learners",
  2019 (GPT-2).
  Su et al., "RoFormer: Enhanced Transformer with Rotary Position
  Embedding", 2021. https://arxiv.org/abs/2104.09864
  Shazeer, "GLU Variants Improve Transformer", 2020.
  https://arxiv.org/abs/2002.05202
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax

from jmp_train.flax import dot_product_attention

__all__ = [
  "GPT",
  "GPTBlock",
  "GPTConfig",
  "REMAT_POLICIES",
  "chunked_cross_entropy",
  "gpt_train_fns",
]

# ``GPTConfig.remat`` -> the ``jax.checkpoint`` policy of each block (None: no remat).
REMAT_POLICIES: dict[str, Callable[..., bool] | None] = {
  "none": None,
  "dots_saveable": jax.checkpoint_policies.dots_saveable,
  "nothing_saveable": jax.checkpoint_policies.nothing_saveable,
}


@dataclasses.dataclass(frozen=True)
class GPTConfig:
  """Sizes and choices of a :class:`GPT`.

  Attributes:
    vocab_size: vocabulary (a multiple of 64 keeps the head's GEMM on Tensor
      Cores).
    d_model: model width.
    num_layers: decoder blocks.
    num_heads: attention heads (``d_model`` divisible by it).
    mlp_dim: MLP hidden width (SwiGLU: of each of its two input projections).
    max_len: longest sequence (rows of ``wpe``; the RoPE table's length).
    positions: ``"learned"`` (``wpe`` added to the embeddings) or ``"rope"``
      (rotary positions on queries and keys).
    mlp: ``"gelu"`` or ``"swiglu"``.
    tie_embeddings: the head is ``wte`` transposed (no ``lm_head``).
    use_bias: biases in the projections.
    remat: recomputation of each block in the backward pass, a key of
      :data:`REMAT_POLICIES` (``"none"``, ``"dots_saveable"``: keep the
      matmuls' outputs, ``"nothing_saveable"``: keep only block inputs).
    loss_chunk: tokens per chunk of :func:`chunked_cross_entropy`.
    attention: ``implementation`` of
      :func:`jmp_train.flax.dot_product_attention` (``"auto"``: cuDNN's
      fused kernel on a GPU, the explicit float32-softmax path elsewhere).
    init_std: standard deviation of the weights' normal initialisation
      (output projections scaled down by ``sqrt(2 * num_layers)``, as GPT-2).
  """

  vocab_size: int = 50304
  d_model: int = 768
  num_layers: int = 12
  num_heads: int = 12
  mlp_dim: int = 3072
  max_len: int = 1024
  positions: str = "learned"
  mlp: str = "gelu"
  tie_embeddings: bool = True
  use_bias: bool = True
  remat: str = "none"
  loss_chunk: int = 2048
  attention: str = "auto"
  init_std: float = 0.02

  def __post_init__(self):
    checks = (
      (self.positions in ("learned", "rope"), f"positions={self.positions!r}: 'learned' or 'rope'"),
      (self.mlp in ("gelu", "swiglu"), f"mlp={self.mlp!r}: 'gelu' or 'swiglu'"),
      (self.remat in REMAT_POLICIES, f"remat={self.remat!r}: one of {sorted(REMAT_POLICIES)}"),
      (self.d_model % self.num_heads == 0, f"d_model={self.d_model} is not divisible by num_heads={self.num_heads}"),
      (
        self.positions != "rope" or self.head_dim % 2 == 0,
        f"rotary positions need an even head size, got {self.head_dim}",
      ),
      (self.loss_chunk >= 1, f"loss_chunk={self.loss_chunk} must be positive"),
    )
    for ok, why in checks:
      if not ok:
        raise ValueError(f"GPTConfig: {why}.")

  @property
  def head_dim(self) -> int:
    return self.d_model // self.num_heads

  @classmethod
  def tiny(cls, **overrides: Any) -> "GPTConfig":
    """Two blocks of width 64, vocabulary 256: for tests and CPU runs."""
    return cls(
      **{
        **dict(vocab_size=256, d_model=64, num_layers=2, num_heads=4, mlp_dim=256, max_len=64, loss_chunk=64),
        **overrides,
      }
    )

  @classmethod
  def gpt_125m(cls, **overrides: Any) -> "GPTConfig":
    """GPT-2 small: d_model 768, 12 layers, 12 heads, sequence 1024."""
    return cls(**overrides)

  @classmethod
  def gpt_350m(cls, **overrides: Any) -> "GPTConfig":
    """GPT-2 medium: d_model 1024, 24 layers, 16 heads, sequence 1024."""
    return cls(**{**dict(d_model=1024, num_layers=24, num_heads=16, mlp_dim=4096), **overrides})

  @classmethod
  def gpt_1b(cls, **overrides: Any) -> "GPTConfig":
    """About 1.3B parameters: d_model 2048, 24 layers, 16 heads, vocabulary 32768, sequence 2048."""
    return cls(
      **{**dict(vocab_size=32768, d_model=2048, num_layers=24, num_heads=16, mlp_dim=8192, max_len=2048), **overrides}
    )

  @classmethod
  def gpt_1_5b(cls, **overrides: Any) -> "GPTConfig":
    """GPT-2 XL: d_model 1600, 48 layers, 25 heads, sequence 1024."""
    return cls(**{**dict(d_model=1600, num_layers=48, num_heads=25, mlp_dim=6400), **overrides})

  def num_params(self) -> int:
    """Parameters of a :class:`GPT` of this configuration."""
    d, f, b = self.d_model, self.mlp_dim, int(self.use_bias)
    attn = 4 * d * d + b * 4 * d
    mlp = (3 * d * f + b * (2 * f + d)) if self.mlp == "swiglu" else (2 * d * f + b * (f + d))
    block = attn + mlp + 4 * d  # two LayerNorms
    embed = self.vocab_size * d * (1 if self.tie_embeddings else 2)
    pos = self.max_len * d if self.positions == "learned" else 0
    return self.num_layers * block + embed + pos + 2 * d

  def train_flops_per_token(self, seq_len: int) -> float:
    """Matmul FLOPs of one training token (forward and backward), causal attention counted whole.

    ``6 N`` for the parameters' matmuls (embedding lookups excluded, the head
    included) plus ``12 L T d`` for attention's two score matmuls (the usual
    count, as in the PaLM paper's model FLOPs utilisation).
    """
    lookups = self.vocab_size * self.d_model * (1 if self.tie_embeddings else 2) + (
      self.max_len * self.d_model if self.positions == "learned" else 0
    )
    matmul_params = self.num_params() - lookups + self.vocab_size * self.d_model  # + the head
    return 6.0 * matmul_params + 12.0 * self.num_layers * seq_len * self.d_model


def _normal(std: float):
  return nn.initializers.normal(stddev=std)


def _rope(x: jax.Array, positions: jax.Array) -> jax.Array:
  """Rotary positions on ``[batch, length, heads, head_dim]`` (halves rotated)."""
  half = x.shape[-1] // 2
  freqs = 1.0 / (10000.0 ** (jnp.arange(half, dtype=jnp.float32) / half))
  angles = positions.astype(jnp.float32)[:, None] * freqs[None, :]  # [length, half]
  cos = jnp.cos(angles)[:, None, :].astype(x.dtype)
  sin = jnp.sin(angles)[:, None, :].astype(x.dtype)
  x1, x2 = x[..., :half], x[..., half:]
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


class GPTBlock(nn.Module):
  """A pre-norm decoder block: ``x + attn(ln1(x))``, then ``x + mlp(ln2(x))``.

  Attributes:
    config: the model's :class:`GPTConfig`.
  """

  config: GPTConfig

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    cfg = self.config
    out_std = cfg.init_std / math.sqrt(2 * cfg.num_layers)
    dense = lambda features, name, std=cfg.init_std, **kw: nn.DenseGeneral(
      features, use_bias=cfg.use_bias, kernel_init=_normal(std), name=name, **kw
    )
    h = nn.LayerNorm(name="ln1")(x)
    qkv = dense((3, cfg.num_heads, cfg.head_dim), "qkv")(h)  # [batch, length, 3, heads, dim]
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    if cfg.positions == "rope":
      positions = jnp.arange(x.shape[1])
      q, k = _rope(q, positions), _rope(k, positions)
    h = dot_product_attention(q, k, v, is_causal=True, implementation=cfg.attention)
    x = x + dense(cfg.d_model, "attn_out", out_std, axis=(-2, -1))(h)
    h = nn.LayerNorm(name="ln2")(x)
    if cfg.mlp == "swiglu":
      gate_up = dense((2, cfg.mlp_dim), "mlp_in")(h)
      h = nn.silu(gate_up[..., 0, :]) * gate_up[..., 1, :]
    else:
      h = nn.gelu(dense(cfg.mlp_dim, "mlp_in")(h))
    return x + dense(cfg.d_model, "mlp_out", out_std)(h)


def chunked_cross_entropy(
  hidden: jax.Array, head: jax.Array, targets: jax.Array, chunk: int, *, head_is_vocab_major: bool = False
) -> jax.Array:
  """Mean cross-entropy of ``hidden @ head`` against ``targets``, one chunk of tokens at a time.

  Each chunk's logits come from a matmul in the inputs' dtype and are widened
  to float32 for the log-softmax; the chunk's loss is recomputed in the
  backward pass (``jax.checkpoint``), so only one chunk's ``[chunk, vocab]``
  logits exist at a time, forward or backward.

  Args:
    hidden: ``[tokens, d_model]`` final hidden states.
    head: ``[d_model, vocab]`` (or ``[vocab, d_model]`` with
      ``head_is_vocab_major``, a tied embedding table).
    targets: ``[tokens]`` integer labels.
    chunk: tokens per chunk (the last chunk is padded and masked).
    head_is_vocab_major: ``head`` is ``[vocab, d_model]``.

  Returns:
    The float32 scalar mean loss.

  Examples:
    >>> h = jnp.ones((5, 8), jnp.bfloat16)
    >>> w = jnp.zeros((8, 16), jnp.bfloat16)
    >>> loss = chunked_cross_entropy(h, w, jnp.zeros((5,), jnp.int32), chunk=2)
    >>> loss.dtype, round(float(loss), 4) == round(math.log(16), 4)
    (dtype('float32'), True)
  """
  n = hidden.shape[0]
  chunk = max(1, min(chunk, n))
  num_chunks = -(-n // chunk)
  pad = num_chunks * chunk - n
  valid = jnp.arange(num_chunks * chunk) < n
  if pad:
    hidden = jnp.pad(hidden, ((0, pad), (0, 0)))
    targets = jnp.pad(targets, (0, pad))
  hidden = hidden.reshape(num_chunks, chunk, hidden.shape[-1])
  targets = targets.reshape(num_chunks, chunk)
  valid = valid.reshape(num_chunks, chunk)
  dims = (((1,), (1,)), ((), ())) if head_is_vocab_major else (((1,), (0,)), ((), ()))

  @jax.checkpoint
  def chunk_loss(h, t, m):
    logits = lax.dot_general(h, head, dims).astype(jnp.float32)
    lse = jax.nn.logsumexp(logits, axis=-1)
    picked = jnp.take_along_axis(logits, t[:, None], axis=-1)[:, 0]
    return jnp.sum(jnp.where(m, lse - picked, 0.0))

  def body(total, xs):
    return total + chunk_loss(*xs), None

  total, _ = lax.scan(body, jnp.zeros((), jnp.float32), (hidden, targets, valid))
  return total / n


class GPT(nn.Module):
  """A GPT-style decoder language model (linen).

  Attributes:
    config: a :class:`GPTConfig`.

  Examples:
    >>> model = GPT(GPTConfig.tiny())
    >>> tokens = jnp.zeros((2, 16), jnp.int32)
    >>> variables = model.init(jax.random.key(0), tokens)
    >>> model.apply(variables, tokens).shape
    (2, 16, 256)
    >>> model.apply(variables, tokens, tokens).dtype  # the mean loss
    dtype('float32')
  """

  config: GPTConfig

  @nn.compact
  def __call__(self, tokens: jax.Array, targets: jax.Array | None = None) -> jax.Array:
    """Logits ``[batch, length, vocab]``, or the float32 mean loss against ``targets``."""
    cfg = self.config
    length = tokens.shape[-1]
    if length > cfg.max_len:
      raise ValueError(f"Sequence length {length} exceeds max_len={cfg.max_len}.")
    wte = self.param("wte", _normal(cfg.init_std), (cfg.vocab_size, cfg.d_model))
    x = jnp.take(wte, tokens, axis=0)
    if cfg.positions == "learned":
      wpe = self.param("wpe", _normal(cfg.init_std / 2), (cfg.max_len, cfg.d_model))
      x = x + wpe[:length].astype(x.dtype)
    block = GPTBlock
    policy = REMAT_POLICIES[cfg.remat]
    if cfg.remat != "none":
      block = nn.remat(GPTBlock, policy=policy, prevent_cse=True)
    for i in range(cfg.num_layers):
      x = block(cfg, name=f"block{i}")(x)
    x = nn.LayerNorm(name="ln_f")(x)
    if cfg.tie_embeddings:
      head, vocab_major = wte, True
    else:
      head = self.param("lm_head", _normal(cfg.init_std), (cfg.d_model, cfg.vocab_size))
      vocab_major = False
    head = head.astype(x.dtype)
    if targets is None:
      spec = "btd,vd->btv" if vocab_major else "btd,dv->btv"
      return jnp.einsum(spec, x, head)
    return chunked_cross_entropy(
      x.reshape(-1, cfg.d_model), head, targets.reshape(-1), cfg.loss_chunk, head_is_vocab_major=vocab_major
    )


def gpt_train_fns(model: GPT) -> tuple[Callable[..., Any], Callable[..., Any]]:
  """``(apply_fn, loss_fn)`` for :func:`jmp_train.make_train_step`.

  The model computes its own (chunked, float32) loss, so the batch is
  ``((tokens, targets), None)``: ``apply_fn`` returns the loss and
  ``loss_fn`` passes it on.

  Examples:
    >>> import optax, jmp_train
    >>> model = GPT(GPTConfig.tiny())
    >>> tokens = jnp.zeros((2, 16), jnp.int32)
    >>> params = model.init(jax.random.key(0), tokens)["params"]
    >>> step = jmp_train.make_train_step(*gpt_train_fns(model), optax.adam(1e-3),
    ...                                  policy="mixed_bfloat16")
    >>> state, metrics = step(step.init(params), ((tokens, tokens), None))
    >>> metrics["loss"].dtype
    dtype('float32')
  """

  def apply_fn(variables, inputs, **kwargs):
    tokens, targets = inputs
    return model.apply(variables, tokens, targets, **kwargs)

  def loss_fn(loss, _):
    return loss

  return apply_fn, loss_fn
