"""Multilayer perceptrons in Flax linen (:class:`MLP`) and NNX (:class:`NNXMLP`), twins.

``Dense`` + ReLU + ``Dropout`` layers and a classifier head, for flat inputs
(the 8x8 digits as 64 features); see :mod:`jmp_train_examples.models`.
"""

from __future__ import annotations

from typing import Sequence

import flax.linen as nn
import jax
from flax import nnx

__all__ = ["MLP", "NNXMLP"]


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
