"""Models written the way Flax's examples write them, for test_policy_corpus.py.

Every layer declares ``dtype=jnp.float32`` and ``param_dtype=jnp.float32``, as
Flax's ImageNet ResNet, its lm1b/wmt Transformer and its NNX examples do. Such
a layer casts what it receives to its ``dtype`` (``nn.Dense`` promotes its
inputs and kernel to ``dtype``), so a policy that only casts a model's inputs
and parameters leaves every matmul and convolution in float32: the corpus
checks that :func:`jmp_train.make_train_step` reaches them anyway.

Four tiny models (widths 16-32, one or two blocks, 8x8 images, 16 tokens, a
vocabulary of 64), each with its loss and a deterministic batch generator:

* :class:`LinenResNet`: ``nn.Conv`` + synchronized ``nn.BatchNorm``
  (``axis_name="batch"``), a residual block, an ``nn.Dense`` head and a
  ``train`` argument.
* :class:`LinenTransformerLM`: ``nn.Embed`` with a tied output head
  (``embed.attend``), causal ``nn.MultiHeadDotProductAttention``,
  ``nn.LayerNorm``, an ``nn.Dense`` MLP, ``nn.Dropout``; the layers are an
  ``nn.scan`` over an ``nn.remat`` block, as lm1b-style code writes them.
* :class:`NnxConvNet`: ``nnx.Conv``, synchronized ``nnx.BatchNorm``,
  ``nnx.Dropout`` with its own stream, an ``nnx.Linear`` head.
* :class:`NnxTransformerLM`: ``nnx.Embed`` (tied head), ``nnx.MultiHeadAttention``,
  ``nnx.LayerNorm``, ``nnx.Dropout``; the blocks made with ``nnx.vmap`` and
  applied with ``nnx.scan`` over an ``nnx.remat`` block ("scan over layers"
  of Flax's NNX documentation).

Our own code, small enough that each train step compiles in seconds on CPU.
The Transformers drop out once per block (and the linen one in attention):
each dropout site is random-bit code that XLA compiles, twice under remat,
and the compile time of the corpus is the test suite's to pay.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from flax import struct

__all__ = [
  "CORPUS",
  "CorpusModel",
  "LinenResNet",
  "LinenTransformerLM",
  "NnxConvNet",
  "NnxTransformerLM",
  "TransformerConfig",
  "image_batches",
  "loss_fn",
  "token_batches",
]

IMAGE_SIZE = 8
CHANNELS = 3
NUM_CLASSES = 10
VOCAB = 64
SEQ_LEN = 16
AXIS = "batch"  # the data-parallel axis the synchronized BatchNorms reduce over


def loss_fn(outputs: jax.Array, targets: jax.Array) -> jax.Array:
  """Mean softmax cross-entropy with integer labels (any leading axes)."""
  return optax.softmax_cross_entropy_with_integer_labels(outputs, targets).mean()


# ---------------------------------------------------------------------------
# Data.


def image_batches(num_batches: int, batch_size: int = 16, seed: int = 0):
  """``[(images, labels)]``: noise plus a fixed per-class pattern, NHWC float32.

  Each class adds its own colour (a per-channel offset, which survives the
  global average pool) and a fainter 8x8x3 texture to Gaussian noise, so a
  small conv net separates the classes within a few steps.
  """
  rng = np.random.default_rng(seed)
  templates = rng.normal(size=(NUM_CLASSES, 1, 1, CHANNELS)) + 0.5 * rng.normal(
    size=(NUM_CLASSES, IMAGE_SIZE, IMAGE_SIZE, CHANNELS)
  )
  out = []
  for _ in range(num_batches):
    labels = rng.integers(0, NUM_CLASSES, batch_size).astype(np.int32)
    images = 0.5 * rng.normal(size=(batch_size, IMAGE_SIZE, IMAGE_SIZE, CHANNELS))
    out.append(((images + templates[labels]).astype(np.float32), labels))
  return out


def token_batches(num_batches: int, batch_size: int = 16, seed: int = 0):
  """``[(tokens, next_tokens)]``: arithmetic progressions modulo the vocabulary.

  A row is ``start, start + stride, start + 2 stride, ...`` (mod 64) with a
  random start and a stride of 1 or 3: the next token follows from the
  current one and the stride, which the causal attention reads from the
  previous token. Inputs are ``SEQ_LEN`` tokens, targets the same shifted by
  one.
  """
  rng = np.random.default_rng(seed)
  out = []
  for _ in range(num_batches):
    start = rng.integers(0, VOCAB, (batch_size, 1))
    stride = rng.choice([1, 3], (batch_size, 1))
    seq = ((start + stride * np.arange(SEQ_LEN + 1)) % VOCAB).astype(np.int32)
    out.append((seq[:, :-1], seq[:, 1:]))
  return out


# ---------------------------------------------------------------------------
# Linen ResNet (the structure of Flax's ImageNet example, much smaller).


class ResidualBlock(nn.Module):
  """conv-bn-relu-conv-bn, added to the input, relu."""

  features: int
  conv: Callable[..., Any]
  norm: Callable[..., Any]

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    residual = x
    y = self.conv(self.features, (3, 3))(x)
    y = nn.relu(self.norm()(y))
    y = self.conv(self.features, (3, 3))(y)
    y = self.norm(scale_init=nn.initializers.zeros_init())(y)
    return nn.relu(residual + y)


class LinenResNet(nn.Module):
  """Stem conv, ``num_blocks`` residual blocks, global average pool, Dense head."""

  num_classes: int = NUM_CLASSES
  width: int = 16
  num_blocks: int = 1
  dtype: Any = jnp.float32
  param_dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x: jax.Array, train: bool = True) -> jax.Array:
    conv = functools.partial(nn.Conv, use_bias=False, dtype=self.dtype, param_dtype=self.param_dtype)
    norm = functools.partial(
      nn.BatchNorm,
      use_running_average=not train,
      momentum=0.9,
      epsilon=1e-5,
      axis_name=AXIS,
      dtype=self.dtype,
      param_dtype=self.param_dtype,
    )
    x = conv(self.width, (3, 3), name="conv_init")(x)
    x = nn.relu(norm(name="bn_init")(x))
    for i in range(self.num_blocks):
      x = ResidualBlock(self.width, conv=conv, norm=norm, name=f"block{i}")(x)
    x = jnp.mean(x, axis=(1, 2))
    x = nn.Dense(self.num_classes, dtype=self.dtype, param_dtype=self.param_dtype)(x)
    return jnp.asarray(x, self.dtype)


# ---------------------------------------------------------------------------
# Linen Transformer LM (the structure of Flax's lm1b example, much smaller).


@struct.dataclass
class TransformerConfig:
  """Hyperparameters, as lm1b's ``TransformerConfig`` holds them."""

  vocab_size: int = VOCAB
  emb_dim: int = 32
  num_heads: int = 4
  num_layers: int = 2
  mlp_dim: int = 64
  max_len: int = SEQ_LEN
  dropout_rate: float = 0.1
  attention_dropout_rate: float = 0.1
  deterministic: bool = False
  dtype: Any = jnp.float32
  param_dtype: Any = jnp.float32


class DecoderBlock(nn.Module):
  """Pre-norm decoder layer; ``(carry, mask) -> (carry, None)`` for ``nn.scan``."""

  config: TransformerConfig

  @nn.compact
  def __call__(self, x: jax.Array, mask: jax.Array):
    cfg = self.config
    dense = functools.partial(nn.Dense, dtype=cfg.dtype, param_dtype=cfg.param_dtype)
    y = nn.LayerNorm(dtype=cfg.dtype, param_dtype=cfg.param_dtype)(x)
    y = nn.MultiHeadDotProductAttention(
      num_heads=cfg.num_heads,
      qkv_features=cfg.emb_dim,
      use_bias=False,
      broadcast_dropout=False,
      dropout_rate=cfg.attention_dropout_rate,
      deterministic=cfg.deterministic,
      dtype=cfg.dtype,
      param_dtype=cfg.param_dtype,
    )(y, mask=mask)
    x = x + y
    z = nn.LayerNorm(dtype=cfg.dtype, param_dtype=cfg.param_dtype)(x)
    z = nn.relu(dense(cfg.mlp_dim)(z))
    z = dense(cfg.emb_dim)(z)
    x = x + nn.Dropout(cfg.dropout_rate, deterministic=cfg.deterministic)(z)
    return x, None


class LinenTransformerLM(nn.Module):
  """Embed + learned positions, scanned remat decoder blocks, tied logits."""

  config: TransformerConfig = TransformerConfig()

  @nn.compact
  def __call__(self, tokens: jax.Array, train: bool = True) -> jax.Array:
    cfg = self.config.replace(deterministic=not train)
    embed = nn.Embed(
      cfg.vocab_size,
      cfg.emb_dim,
      dtype=cfg.dtype,
      param_dtype=cfg.param_dtype,
      embedding_init=nn.initializers.normal(stddev=1.0),
      name="embed",
    )
    x = embed(tokens.astype("int32"))
    pos = self.param(
      "pos_embedding", nn.initializers.normal(stddev=0.02), (1, cfg.max_len, cfg.emb_dim), cfg.param_dtype
    )
    x = x + pos[:, : tokens.shape[1]]
    mask = nn.make_causal_mask(tokens, dtype=cfg.dtype)
    block = nn.remat(DecoderBlock, prevent_cse=False)
    x, _ = nn.scan(
      block,
      variable_axes={"params": 0},
      split_rngs={"params": True, "dropout": True},
      in_axes=nn.broadcast,
      length=cfg.num_layers,
    )(cfg, name="decoder")(x, mask)
    x = nn.LayerNorm(dtype=cfg.dtype, param_dtype=cfg.param_dtype, name="final_norm")(x)
    logits = embed.attend(x.astype(cfg.dtype))
    return logits / jnp.sqrt(x.shape[-1]).astype(logits.dtype)


# ---------------------------------------------------------------------------
# NNX conv net.


class NnxConvNet(nnx.Module):
  """Stem conv-bn-relu, one residual conv-bn, pool, dropout, Linear head."""

  def __init__(
    self,
    width: int = 16,
    num_classes: int = NUM_CLASSES,
    *,
    dtype: Any = jnp.float32,
    param_dtype: Any = jnp.float32,
    rngs: nnx.Rngs,
  ):
    conv = functools.partial(
      nnx.Conv, kernel_size=(3, 3), use_bias=False, dtype=dtype, param_dtype=param_dtype, rngs=rngs
    )
    norm = functools.partial(
      nnx.BatchNorm, momentum=0.9, epsilon=1e-5, axis_name=AXIS, dtype=dtype, param_dtype=param_dtype, rngs=rngs
    )
    self.conv_init = conv(CHANNELS, width)
    self.bn_init = norm(width)
    self.conv1 = conv(width, width)
    self.bn1 = norm(width)
    self.conv2 = conv(width, width)
    self.bn2 = norm(width, scale_init=nnx.initializers.zeros_init())
    self.dropout = nnx.Dropout(0.1, rngs=rngs)
    self.head = nnx.Linear(width, num_classes, dtype=dtype, param_dtype=param_dtype, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    x = nnx.relu(self.bn_init(self.conv_init(x)))
    y = nnx.relu(self.bn1(self.conv1(x)))
    x = nnx.relu(x + self.bn2(self.conv2(y)))
    x = self.dropout(jnp.mean(x, axis=(1, 2)))
    return self.head(x)


# ---------------------------------------------------------------------------
# NNX Transformer LM, "scan over layers".


class NnxDecoderBlock(nnx.Module):
  """Pre-norm decoder layer, the NNX twin of :class:`DecoderBlock`."""

  def __init__(self, cfg: TransformerConfig, *, rngs: nnx.Rngs):
    kw = dict(dtype=cfg.dtype, param_dtype=cfg.param_dtype, rngs=rngs)
    self.ln1 = nnx.LayerNorm(cfg.emb_dim, **kw)
    self.attn = nnx.MultiHeadAttention(
      num_heads=cfg.num_heads,
      in_features=cfg.emb_dim,
      qkv_features=cfg.emb_dim,
      use_bias=False,
      dropout_rate=0.0,
      decode=False,
      **kw,
    )
    self.ln2 = nnx.LayerNorm(cfg.emb_dim, **kw)
    self.mlp_in = nnx.Linear(cfg.emb_dim, cfg.mlp_dim, **kw)
    self.mlp_out = nnx.Linear(cfg.mlp_dim, cfg.emb_dim, **kw)
    self.dropout = nnx.Dropout(cfg.dropout_rate, rngs=rngs)

  def __call__(self, x: jax.Array, mask: jax.Array) -> jax.Array:
    x = x + self.attn(self.ln1(x), mask=mask)
    z = self.mlp_out(nnx.relu(self.mlp_in(self.ln2(x))))
    return x + self.dropout(z)


class NnxTransformerLM(nnx.Module):
  """Embed + learned positions, ``num_layers`` stacked blocks, tied logits."""

  def __init__(self, cfg: TransformerConfig | None = None, *, rngs: nnx.Rngs):
    cfg = cfg or TransformerConfig()
    self.num_layers = cfg.num_layers
    self.embed = nnx.Embed(
      cfg.vocab_size,
      cfg.emb_dim,
      dtype=cfg.dtype,
      param_dtype=cfg.param_dtype,
      embedding_init=nnx.initializers.normal(stddev=1.0),
      rngs=rngs,
    )
    self.pos_embedding = nnx.Param(
      0.02 * jax.random.normal(rngs.params(), (1, cfg.max_len, cfg.emb_dim), cfg.param_dtype)
    )

    @nnx.split_rngs(splits=cfg.num_layers)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def create_block(rngs: nnx.Rngs) -> NnxDecoderBlock:
      return NnxDecoderBlock(cfg, rngs=rngs)

    self.blocks = create_block(rngs)
    self.final_norm = nnx.LayerNorm(cfg.emb_dim, dtype=cfg.dtype, param_dtype=cfg.param_dtype, rngs=rngs)
    self.dtype = cfg.dtype

  def __call__(self, tokens: jax.Array) -> jax.Array:
    x = self.embed(tokens.astype("int32"))
    x = x + self.pos_embedding[...][:, : tokens.shape[1]]
    mask = nnx.make_causal_mask(tokens, dtype=self.dtype)

    @nnx.scan(in_axes=(nnx.Carry, 0, None), out_axes=nnx.Carry)
    @nnx.remat(prevent_cse=False)
    def forward(x, block, mask):
      return block(x, mask)

    x = forward(x, self.blocks, mask)
    x = self.final_norm(x)
    logits = self.embed.attend(x.astype(self.dtype))
    return logits / jnp.sqrt(x.shape[-1]).astype(logits.dtype)


# ---------------------------------------------------------------------------
# The corpus.


@dataclasses.dataclass(frozen=True)
class CorpusModel:
  """One model of the corpus and how to train it.

  Attributes:
    name: the test id.
    kind: ``"linen"`` or ``"nnx"``.
    make: ``make()`` returns a fresh model: a linen module, or an NNX module
      with its parameters (same values every call).
    batches: ``batches(n)`` returns ``n`` fixed ``(inputs, targets)`` pairs.
    learning_rate: Adam's learning rate for the short runs.
  """

  name: str
  kind: str
  make: Callable[[], Any]
  batches: Callable[[int], list]
  learning_rate: float = 1e-3


def _init_linen(model: nn.Module, inputs: np.ndarray) -> dict:
  """Variables of ``model``: one jitted ``init`` (not op by op)."""
  init = jax.jit(functools.partial(model.init, train=False))
  return init({"params": jax.random.key(0), "dropout": jax.random.key(1)}, inputs[:2])


CORPUS = {
  "linen_resnet": CorpusModel("linen_resnet", "linen", LinenResNet, image_batches),
  "linen_transformer": CorpusModel("linen_transformer", "linen", LinenTransformerLM, token_batches),
  "nnx_convnet": CorpusModel(
    "nnx_convnet", "nnx", lambda: NnxConvNet(rngs=nnx.Rngs(params=0, dropout=1)), image_batches
  ),
  "nnx_transformer": CorpusModel(
    "nnx_transformer", "nnx", lambda: NnxTransformerLM(rngs=nnx.Rngs(params=0, dropout=1)), token_batches
  ),
}


def init_linen(model: nn.Module, inputs: np.ndarray) -> tuple[Any, dict]:
  """``(params, model_state)`` of a linen corpus model (model_state: batch stats)."""
  variables = dict(_init_linen(model, inputs))
  params = variables.pop("params")
  return params, variables
