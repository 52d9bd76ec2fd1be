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
(one input channel, ten classes). Each family is a module of its own
(:mod:`~jmp_train_examples.models_mlp`,
:mod:`~jmp_train_examples.models_resnet`,
:mod:`~jmp_train_examples.models_transformer`), gathered here.

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
* :class:`GPT` (linen only; :mod:`~jmp_train_examples.models_gpt`): a
  GPT-style decoder from ~125M to ~1.5B parameters (:class:`GPTConfig`
  presets), fused attention on GPUs, a chunked float32 loss.

References:
  He et al., "Deep Residual Learning for Image Recognition", CVPR 2016.
  https://arxiv.org/abs/1512.03385
  Vaswani et al., "Attention Is All You Need", NeurIPS 2017.
  https://arxiv.org/abs/1706.03762
"""

from __future__ import annotations

from typing import Any, Mapping

import jax
import jax.numpy as jnp
from flax import nnx

from jmp_train_examples.models_gpt import GPT
from jmp_train_examples.models_gpt import GPTBlock
from jmp_train_examples.models_gpt import GPTConfig
from jmp_train_examples.models_mlp import MLP
from jmp_train_examples.models_mlp import NNXMLP
from jmp_train_examples.models_resnet import NNXResNet
from jmp_train_examples.models_resnet import NNXResNetBlock
from jmp_train_examples.models_resnet import ResNet
from jmp_train_examples.models_resnet import ResNetBlock
from jmp_train_examples.models_transformer import NNXTransformerBlock
from jmp_train_examples.models_transformer import NNXTransformerLayer
from jmp_train_examples.models_transformer import TransformerBlock
from jmp_train_examples.models_transformer import TransformerLayer

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
  "GPTConfig",
  "GPTBlock",
  "GPT",
  "nnx_with_linen_variables",
]


def nnx_with_linen_variables(model: nnx.Module, variables: Mapping[str, Any]) -> nnx.Module:
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
    raise ValueError(f"Unsupported variable collections {unknown}; accepted: {sorted(collections)}.")
  model = nnx.clone(model)
  for name, var_type in collections.items():
    if name in variables:
      state = nnx.state(model, var_type)
      nnx.replace_by_pure_dict(state, jax.tree.map(jnp.asarray, dict(variables[name])))
      nnx.update(model, state)
  return model
