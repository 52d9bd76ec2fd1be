"""Flax integration: dtype policies on linen and NNX modules.

Reached as ``jmp_train.flax`` after ``import jmp_train`` (loaded on first
use, so ``import jmp_train`` alone does not import Flax). Example models to
try it on live in ``jmp_train_examples.models``.

* :func:`apply_policy` runs a linen or NNX module under a
  :class:`jmp_train.Policy`: half-precision matmuls and convolutions,
  parameters in ``param_dtype``, normalization and softmax in float32,
  outputs in ``output_dtype``, and by default only half-precision values
  kept for the backward pass (``recompute="float32"``);
  :data:`DEFAULT_FLOAT32_MODULES` lists the module classes kept in float32
  by default.
* :func:`dot_product_attention`: the attention function it installs
  (half-precision matmuls, float32 softmax; cuDNN's fused kernel on GPUs).
* :class:`Float32LookupEmbed`: the ``nnx.Embed`` it installs in NNX models
  (lookups gathered in float32, their gradient summed in float32).

Examples:
  >>> import flax.linen as nn
  >>> import jmp_train
  >>> model = jmp_train.flax.apply_policy(nn.Dense(16), "mixed_float16")
  >>> variables = model.init(jax.random.key(0), jnp.zeros((2, 8)))
  >>> model.apply(variables, jnp.zeros((2, 8))).dtype
  dtype('float32')
"""

from __future__ import annotations

from jmp_train._src.flax.policy import DEFAULT_FLOAT32_MODULES
from jmp_train._src.flax.policy import Float32LookupEmbed
from jmp_train._src.flax.policy import LinenPolicyWrapper
from jmp_train._src.flax.policy import NNXPolicyWrapper
from jmp_train._src.flax.policy import apply_policy
from jmp_train._src.flax.attention import dot_product_attention
from jmp_train._src.fp8.flax_layers import FP8_COLLECTION
from jmp_train._src.fp8.flax_layers import Fp8ConvGeneralDilated
from jmp_train._src.fp8.flax_layers import Fp8DotGeneral
from jmp_train._src.fp8.flax_layers import Fp8Meta
from jmp_train._src.fp8.flax_layers import NNXFp8ConvGeneralDilated
from jmp_train._src.fp8.flax_layers import NNXFp8DotGeneral

__all__ = (
  "DEFAULT_FLOAT32_MODULES",
  "FP8_COLLECTION",
  "Float32LookupEmbed",
  "Fp8ConvGeneralDilated",
  "Fp8DotGeneral",
  "Fp8Meta",
  "NNXFp8ConvGeneralDilated",
  "NNXFp8DotGeneral",
  "LinenPolicyWrapper",
  "NNXPolicyWrapper",
  "apply_policy",
  "dot_product_attention",
)
