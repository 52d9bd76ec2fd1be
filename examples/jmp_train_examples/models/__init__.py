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
(one input channel, ten classes). Each family is a module of this package
(:mod:`~jmp_train_examples.models.mlp`,
:mod:`~jmp_train_examples.models.resnet`,
:mod:`~jmp_train_examples.models.transformer`; the twins' variable copy in
:mod:`~jmp_train_examples.models.twins`), its names imported here.

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
* :class:`GPT` (linen only; :mod:`~jmp_train_examples.models.gpt`): a
  GPT-style decoder from ~125M to ~1.5B parameters (:class:`GPTConfig`
  presets), fused attention on GPUs, a chunked float32 loss.

References:
  He et al., "Deep Residual Learning for Image Recognition", CVPR 2016.
  https://arxiv.org/abs/1512.03385
  Vaswani et al., "Attention Is All You Need", NeurIPS 2017.
  https://arxiv.org/abs/1706.03762
"""

from __future__ import annotations

from jmp_train_examples.models.gpt import GPT
from jmp_train_examples.models.gpt import GPTBlock
from jmp_train_examples.models.gpt import GPTConfig
from jmp_train_examples.models.mlp import MLP
from jmp_train_examples.models.mlp import NNXMLP
from jmp_train_examples.models.resnet import NNXResNet
from jmp_train_examples.models.resnet import NNXResNetBlock
from jmp_train_examples.models.resnet import ResNet
from jmp_train_examples.models.resnet import ResNetBlock
from jmp_train_examples.models.transformer import NNXTransformerBlock
from jmp_train_examples.models.transformer import NNXTransformerLayer
from jmp_train_examples.models.transformer import TransformerBlock
from jmp_train_examples.models.transformer import TransformerLayer
from jmp_train_examples.models.twins import nnx_with_linen_variables

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
