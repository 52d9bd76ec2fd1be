"""Flax integration: dtype policies on linen and NNX modules, example models.

Import it as ``import jmp_train.flax`` (the core ``jmp_train`` package does
not re-export it).

* :func:`apply_policy` runs a linen or NNX module under a
  :class:`jmp_train.Policy`: half-precision matmuls and convolutions,
  parameters in ``param_dtype``, normalization and softmax in float32,
  outputs in ``output_dtype``; :data:`DEFAULT_FLOAT32_MODULES` lists the
  module classes kept in float32 by default.
* :func:`dot_product_attention`: the attention function it installs
  (half-precision matmuls, float32 softmax).
* Example models, each in linen and NNX with the same variables:
  :class:`MLP`/:class:`NNXMLP`, :class:`ResNetBlock`/:class:`NNXResNetBlock`,
  :class:`ResNet`/:class:`NNXResNet`,
  :class:`TransformerBlock`/:class:`NNXTransformerBlock`, and
  :func:`nnx_with_linen_variables` to copy linen variables into an NNX twin.

Examples:
  >>> import jmp_train.flax
  >>> model = jmp_train.flax.apply_policy(
  ...     jmp_train.flax.ResNet(num_classes=10), "mixed_float16",
  ...     float32_paths=("stem", "head"))
  >>> variables = model.init(jax.random.key(0), jnp.zeros((2, 8, 8, 1)))
  >>> model.apply(variables, jnp.zeros((2, 8, 8, 1))).dtype
  dtype('float32')
"""

from __future__ import annotations

from jmp_train._src.flax_policy import DEFAULT_FLOAT32_MODULES
from jmp_train._src.flax_policy import LinenPolicyWrapper
from jmp_train._src.flax_policy import NNXPolicyWrapper
from jmp_train._src.flax_policy import apply_policy
from jmp_train._src.flax_policy import dot_product_attention
from jmp_train._src.models import MLP
from jmp_train._src.models import NNXMLP
from jmp_train._src.models import NNXResNet
from jmp_train._src.models import NNXResNetBlock
from jmp_train._src.models import NNXTransformerBlock
from jmp_train._src.models import NNXTransformerLayer
from jmp_train._src.models import ResNet
from jmp_train._src.models import ResNetBlock
from jmp_train._src.models import TransformerBlock
from jmp_train._src.models import TransformerLayer
from jmp_train._src.models import nnx_with_linen_variables

__all__ = (
    "DEFAULT_FLOAT32_MODULES",
    "LinenPolicyWrapper",
    "MLP",
    "NNXMLP",
    "NNXPolicyWrapper",
    "NNXResNet",
    "NNXResNetBlock",
    "NNXTransformerBlock",
    "NNXTransformerLayer",
    "ResNet",
    "ResNetBlock",
    "TransformerBlock",
    "TransformerLayer",
    "apply_policy",
    "dot_product_attention",
    "nnx_with_linen_variables",
)
