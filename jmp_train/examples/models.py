"""Small example models, each written in Flax linen and in Flax NNX.

The twins have the same variable names and shapes (linen's
``{"params": ..., "batch_stats": ...}`` mirror the NNX ``nnx.Param`` and
``nnx.BatchStat`` trees), so with the same variables they compute the same
function; :func:`nnx_with_linen_variables` copies linen variables into an
NNX twin. Every call takes ``train`` (dropout on, batch statistics from the
batch and updated; linen needs ``mutable=["batch_stats"]`` and a
``"dropout"`` rng then).

Sizes default to multiples of 8 (Tensor Cores need multiples of 8 in every
GEMM/convolution dimension for float16) except where the data fixes them
(one input channel, ten classes).

* :class:`MLP` / :class:`NNXMLP`: ``Dense`` + ReLU + ``Dropout`` layers and a
  classifier head, for flat inputs (the 8x8 digits as 64 features).
* :class:`ResNetBlock` / :class:`NNXResNetBlock`: a residual block of two 3x3
  convolutions with batch norm, and :class:`ResNet` / :class:`NNXResNet`: a
  small ResNet-style classifier (``stem`` convolution, blocks, global average
  pool, ``head``).
* :class:`TransformerBlock` / :class:`NNXTransformerBlock`: a small causal
  language model (token and position ``Embed``, pre-norm decoder layers of
  ``LayerNorm`` + multi-head attention + ``Dropout`` + ``Dense`` MLP, a final
  ``RMSNorm`` and a ``head``); tokens in, logits out.

References:
  He et al., "Deep Residual Learning for Image Recognition", CVPR 2016.
  https://arxiv.org/abs/1512.03385
  Vaswani et al., "Attention Is All You Need", NeurIPS 2017.
  https://arxiv.org/abs/1706.03762
"""

from __future__ import annotations

import functools
import math
from typing import Any, Mapping, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx

__all__ = [
    "MLP",
    "NNXMLP",
    "ResNetBlock",
    "NNXResNetBlock",
    "ResNet",
    "NNXResNet",
    "TransformerLayer",
    "NNXTransformerLayer",
    "TransformerBlock",
    "NNXTransformerBlock",
    "nnx_with_linen_variables",
]

_BN_MOMENTUM = 0.9


def _as_images(x: jax.Array) -> jax.Array:
  """``[B, H, W, C]`` as is; flat square ``[B, H*W]`` to ``[B, H, W, 1]``."""
  if x.ndim == 4:
    return x
  if x.ndim == 2:
    side = math.isqrt(x.shape[-1])
    if side * side == x.shape[-1]:
      return x.reshape(x.shape[0], side, side, 1)
  raise ValueError(
      f"Expected images [batch, height, width, channels] or flat square "
      f"images [batch, side*side], got shape {x.shape}."
  )


# --------------------------------------------------------------------------
# MLP.
# --------------------------------------------------------------------------


class MLP(nn.Module):
  """A multilayer perceptron classifier (linen).

  Attributes:
    features: widths of the hidden ``Dense`` layers ``dense0``, ``dense1``...
    num_classes: width of the ``head``.
    dropout_rate: dropout after each hidden layer.
  """

  features: Sequence[int] = (64, 64)
  num_classes: int = 10
  dropout_rate: float = 0.0

  @nn.compact
  def __call__(self, x: jax.Array, train: bool = False) -> jax.Array:
    x = x.reshape(x.shape[0], -1)
    for i, width in enumerate(self.features):
      x = nn.relu(nn.Dense(width, name=f"dense{i}")(x))
      x = nn.Dropout(self.dropout_rate, deterministic=not train)(x)
    return nn.Dense(self.num_classes, name="head")(x)


class NNXMLP(nnx.Module):
  """The NNX twin of :class:`MLP`.

  Args:
    in_features: input width (64 for the 8x8 digits).
    features: widths of the hidden layers.
    num_classes: width of the head.
    dropout_rate: dropout after each hidden layer.
    rngs: ``nnx.Rngs`` with ``params`` (and ``dropout`` to train with it).
  """

  def __init__(
      self,
      in_features: int = 64,
      features: Sequence[int] = (64, 64),
      num_classes: int = 10,
      dropout_rate: float = 0.0,
      *,
      rngs: nnx.Rngs,
  ):
    self.num_hidden = len(features)
    width = in_features
    for i, out in enumerate(features):
      setattr(self, f"dense{i}", nnx.Linear(width, out, rngs=rngs))
      width = out
    # Without dropout, no rng state is kept (nor needed at call time).
    self.dropout = nnx.Dropout(dropout_rate, rngs=rngs if dropout_rate else None)
    self.head = nnx.Linear(width, num_classes, rngs=rngs)

  def __call__(self, x: jax.Array, train: bool = False) -> jax.Array:
    x = x.reshape(x.shape[0], -1)
    for i in range(self.num_hidden):
      x = nnx.relu(getattr(self, f"dense{i}")(x))
      x = self.dropout(x, deterministic=not train)
    return self.head(x)


# --------------------------------------------------------------------------
# ResNet.
# --------------------------------------------------------------------------


class ResNetBlock(nn.Module):
  """A basic residual block: two 3x3 convolutions with batch norm (linen).

  ``relu(x' + bn2(conv2(relu(bn1(conv1(x))))))``, where ``x'`` is ``x`` or,
  when the shape changes, ``proj_bn(proj(x))`` (a strided 1x1 convolution).

  Attributes:
    features: output channels.
    strides: stride of ``conv1`` (and ``proj``).
  """

  features: int = 16
  strides: int = 1

  @nn.compact
  def __call__(self, x: jax.Array, train: bool = False) -> jax.Array:
    conv = functools.partial(nn.Conv, use_bias=False)
    norm = functools.partial(
        nn.BatchNorm, use_running_average=not train, momentum=_BN_MOMENTUM
    )
    strides = (self.strides, self.strides)
    y = conv(self.features, (3, 3), strides, name="conv1")(x)
    y = nn.relu(norm(name="bn1")(y))
    y = conv(self.features, (3, 3), name="conv2")(y)
    y = norm(name="bn2")(y)
    residual = x
    if x.shape[-1] != self.features or self.strides != 1:
      residual = conv(self.features, (1, 1), strides, name="proj")(x)
      residual = norm(name="proj_bn")(residual)
    return nn.relu(residual + y)


class NNXResNetBlock(nnx.Module):
  """The NNX twin of :class:`ResNetBlock`.

  Args:
    in_features: input channels.
    features: output channels.
    strides: stride of ``conv1`` (and ``proj``).
    rngs: ``nnx.Rngs`` with ``params``.
  """

  def __init__(
      self,
      in_features: int = 16,
      features: int = 16,
      strides: int = 1,
      *,
      rngs: nnx.Rngs,
  ):
    conv = functools.partial(nnx.Conv, use_bias=False, rngs=rngs)
    norm = functools.partial(nnx.BatchNorm, momentum=_BN_MOMENTUM, rngs=rngs)
    s = (strides, strides)
    self.conv1 = conv(in_features, features, (3, 3), s)
    self.bn1 = norm(features)
    self.conv2 = conv(features, features, (3, 3))
    self.bn2 = norm(features)
    self.has_proj = in_features != features or strides != 1
    if self.has_proj:
      self.proj = conv(in_features, features, (1, 1), s)
      self.proj_bn = norm(features)

  def __call__(self, x: jax.Array, train: bool = False) -> jax.Array:
    ura = not train
    y = nnx.relu(self.bn1(self.conv1(x), use_running_average=ura))
    y = self.bn2(self.conv2(y), use_running_average=ura)
    residual = x
    if self.has_proj:
      residual = self.proj_bn(self.proj(x), use_running_average=ura)
    return nnx.relu(residual + y)


class ResNet(nn.Module):
  """A small ResNet-style classifier (linen).

  ``stem`` (3x3 convolution) + ``stem_bn`` + ReLU, one :class:`ResNetBlock`
  per entry of ``stage_features`` (``block0``, ``block1``...; stride 2 from
  the second on), global average pooling, and a ``Dense`` ``head``. Takes
  ``[batch, height, width, channels]`` images, or flat square images such
  as the 8x8 digits' 64 features.

  Attributes:
    num_classes: width of the ``head``.
    stage_features: channels of the stem and of each block.
  """

  num_classes: int = 10
  stage_features: Sequence[int] = (16, 32)

  @nn.compact
  def __call__(self, x: jax.Array, train: bool = False) -> jax.Array:
    x = _as_images(x)
    x = nn.Conv(self.stage_features[0], (3, 3), use_bias=False, name="stem")(x)
    x = nn.BatchNorm(
        use_running_average=not train, momentum=_BN_MOMENTUM, name="stem_bn"
    )(x)
    x = nn.relu(x)
    for i, width in enumerate(self.stage_features):
      x = ResNetBlock(width, strides=1 if i == 0 else 2, name=f"block{i}")(x, train)
    x = jnp.mean(x, axis=(1, 2))
    return nn.Dense(self.num_classes, name="head")(x)


class NNXResNet(nnx.Module):
  """The NNX twin of :class:`ResNet`.

  Args:
    in_features: input channels (1 for the digits).
    num_classes: width of the head.
    stage_features: channels of the stem and of each block.
    rngs: ``nnx.Rngs`` with ``params``.
  """

  def __init__(
      self,
      in_features: int = 1,
      num_classes: int = 10,
      stage_features: Sequence[int] = (16, 32),
      *,
      rngs: nnx.Rngs,
  ):
    width = stage_features[0]
    self.stem = nnx.Conv(in_features, width, (3, 3), use_bias=False, rngs=rngs)
    self.stem_bn = nnx.BatchNorm(width, momentum=_BN_MOMENTUM, rngs=rngs)
    self.num_blocks = len(stage_features)
    for i, out in enumerate(stage_features):
      block = NNXResNetBlock(width, out, 1 if i == 0 else 2, rngs=rngs)
      setattr(self, f"block{i}", block)
      width = out
    self.head = nnx.Linear(width, num_classes, rngs=rngs)

  def __call__(self, x: jax.Array, train: bool = False) -> jax.Array:
    x = _as_images(x)
    x = nnx.relu(self.stem_bn(self.stem(x), use_running_average=not train))
    for i in range(self.num_blocks):
      x = getattr(self, f"block{i}")(x, train)
    x = jnp.mean(x, axis=(1, 2))
    return self.head(x)


# --------------------------------------------------------------------------
# Transformer.
# --------------------------------------------------------------------------


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
  def __call__(
      self, x: jax.Array, mask: jax.Array | None, train: bool = False
  ) -> jax.Array:
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

  def __call__(
      self, x: jax.Array, mask: jax.Array | None, train: bool = False
  ) -> jax.Array:
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
    x = x + nn.Embed(self.max_len, self.d_model, name="pos_embed")(
        jnp.arange(length)
    )
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
      layer = NNXTransformerLayer(
          d_model, num_heads, mlp_dim, dropout_rate, rngs=rngs
      )
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


# --------------------------------------------------------------------------
# Linen -> NNX.
# --------------------------------------------------------------------------


def nnx_with_linen_variables(
    model: nnx.Module, variables: Mapping[str, Any]
) -> nnx.Module:
  """Returns a copy of an NNX twin holding a linen model's variables.

  Args:
    model: an NNX model whose ``nnx.Param``/``nnx.BatchStat`` trees have the
      linen model's names and shapes (the twins in this module).
    variables: the linen variables, ``{"params": ..., "batch_stats": ...}``.

  Returns:
    A new NNX model (``model`` is not changed).

  Raises:
    ValueError: if a collection other than ``params``/``batch_stats`` is
      given or a name has no counterpart in ``model``.
  """
  collections = {"params": nnx.Param, "batch_stats": nnx.BatchStat}
  unknown = sorted(set(variables) - set(collections))
  if unknown:
    raise ValueError(
        f"Unsupported variable collections {unknown}; accepted: "
        f"{sorted(collections)}."
    )
  model = nnx.clone(model)
  for name, var_type in collections.items():
    if name in variables:
      state = nnx.state(model, var_type)
      nnx.replace_by_pure_dict(state, jax.tree.map(jnp.asarray, dict(variables[name])))
      nnx.update(model, state)
  return model
