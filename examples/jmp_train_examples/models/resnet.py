"""Small ResNets in Flax linen and NNX, twins.

:class:`ResNetBlock` / :class:`NNXResNetBlock`: a residual block of two 3x3
convolutions with batch norm; :class:`ResNet` / :class:`NNXResNet`: a small
ResNet-style classifier (``stem`` convolution, blocks, global average pool,
``head``); see :mod:`jmp_train_examples.models`.

References:
  He et al., "Deep Residual Learning for Image Recognition", CVPR 2016.
  https://arxiv.org/abs/1512.03385
"""

from __future__ import annotations

import functools
import math
from typing import Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx

__all__ = ["NNXResNet", "NNXResNetBlock", "ResNet", "ResNetBlock"]


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
    f"Expected images [batch, height, width, channels] or flat square images [batch, side*side], got shape {x.shape}."
  )


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
    norm = functools.partial(nn.BatchNorm, use_running_average=not train, momentum=_BN_MOMENTUM)
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
    x = nn.BatchNorm(use_running_average=not train, momentum=_BN_MOMENTUM, name="stem_bn")(x)
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
