"""What a dtype policy changes in a Flax layer, shared by linen and NNX.

The layers' own fields carry a policy: ``dtype`` (computation),
``param_dtype`` (storage), ``force_float32_reductions`` (linen norms) and
``attention_fn`` (attention layers). :func:`layer_overrides` gives the
values a policy assigns one layer; the rest checks
:func:`jmp_train.flax.apply_policy`'s arguments and chooses the
``jax.checkpoint`` policy around the model.
"""

from __future__ import annotations

import dataclasses
import fnmatch
from typing import Any, Callable, Iterable, Sequence

import flax.linen as nn
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jmp_train._src.policy import policy as policy_lib
from jmp_train._src.policy import remat
from jmp_train._src.flax.attention import dot_product_attention

__all__ = [
  "DEFAULT_FLOAT32_MODULES",
  "RECOMPUTE_OPTIONS",
  "check_float32_modules",
  "check_float32_paths",
  "check_recompute",
  "embedding_lookup_dtype",
  "layer_overrides",
  "linen_field_names",
  "path_matches",
  "remat_policy",
]

# Normalization layers, linen and NNX: their statistics (mean, variance,
# rsqrt) lose too much precision in float16/bfloat16 (NNabla's and NVIDIA's
# AMP lists keep batch-norm and reductions in float32). Softmax and the loss
# are covered elsewhere: attention through `dot_product_attention`, the loss
# by the model's float32 `output_dtype`.
DEFAULT_FLOAT32_MODULES: tuple[type, ...] = (
  nn.BatchNorm,
  nn.LayerNorm,
  nn.RMSNorm,
  nn.GroupNorm,
  nn.InstanceNorm,
  nnx.BatchNorm,
  nnx.LayerNorm,
  nnx.RMSNorm,
  nnx.GroupNorm,
  nnx.InstanceNorm,
)

F32 = np.dtype(jnp.float32)


# The attention functions we replace: Flax's defaults. A user's own
# `attention_fn` is left alone.
_FLAX_DEFAULT_ATTENTION_FNS = (
  nn.dot_product_attention,
  nnx.dot_product_attention,
)


# --------------------------------------------------------------------------
# Argument checking.
# --------------------------------------------------------------------------


def check_float32_modules(float32_modules: Any) -> tuple[type, ...]:
  if isinstance(float32_modules, type):
    float32_modules = (float32_modules,)
  try:
    classes = tuple(float32_modules)
  except TypeError:
    raise ValueError(f"float32_modules must be a tuple of module classes, got {float32_modules!r}.") from None
  for c in classes:
    if not (isinstance(c, type) and issubclass(c, (nn.Module, nnx.Module))):
      raise ValueError(f"float32_modules must hold flax.linen.Module or flax.nnx.Module subclasses, got {c!r}.")
  return classes


def check_float32_paths(float32_paths: Any) -> tuple[str, ...]:
  if isinstance(float32_paths, str):
    float32_paths = (float32_paths,)
  try:
    items = tuple(float32_paths)
  except TypeError:
    raise ValueError(
      f"float32_paths must be a sequence of path patterns such as ('head', 'blocks/*/conv1'), got {float32_paths!r}."
    ) from None
  out = []
  for p in items:
    if isinstance(p, (tuple, list)):
      p = "/".join(str(k) for k in p)
    if not isinstance(p, str):
      raise ValueError(
        f"float32_paths must hold strings such as 'head' or 'blocks/*/conv1' (or tuples of path keys), got {p!r}."
      )
    out.append(p.strip("/"))
  return tuple(out)


def _path_str(path: Iterable[Any]) -> str:
  return "/".join(str(k) for k in path)


def path_matches(path: Sequence[Any], patterns: tuple[str, ...]) -> bool:
  """Whether a module path is named by a pattern (glob on '/'-joined keys)."""
  if not patterns:
    return False
  text = _path_str(path)
  return any(fnmatch.fnmatchcase(text, p) for p in patterns)


def embedding_lookup_dtype(dtype: np.dtype) -> np.dtype | None:
  """The dtype an embedding lookup gathers in under compute ``dtype``, or None to leave it.

  The backward pass of a lookup is a scatter-add of one cotangent row per
  token into the table: a reduction over every token of the batch. Run in
  a half-precision dtype it swamps (a row summed over thousands of tokens
  keeps few of their bits), so a half-precision layer gathers float32 rows
  and casts them to ``dtype`` afterwards: the same forward values, and the
  table's gradient accumulated in float32.
  """
  return F32 if np.dtype(dtype).itemsize < F32.itemsize else None


# --------------------------------------------------------------------------
# Memory: what the backward pass keeps.
# --------------------------------------------------------------------------

RECOMPUTE_OPTIONS = ("float32", None)


def check_recompute(recompute: Any) -> str | None:
  if recompute not in RECOMPUTE_OPTIONS:
    raise ValueError(f"recompute must be one of {RECOMPUTE_OPTIONS}, got {recompute!r}.")
  return recompute


def remat_policy(policy: policy_lib.Policy, recompute: str | None):
  """The ``jax.checkpoint`` policy around the model, or None for none.

  Only under a half-precision compute dtype: under float32 nothing is
  half precision and the policy would recompute the whole model.
  """
  if recompute is None or np.dtype(policy.compute_dtype).itemsize >= F32.itemsize:
    return None
  return remat.half_precision_saveable


def linen_field_names(module: nn.Module) -> frozenset[str]:
  return frozenset(f.name for f in dataclasses.fields(module))


def layer_overrides(
  fields: frozenset[str] | set[str],
  current: Callable[[str], Any],
  dtype: np.dtype,
  param_dtype: np.dtype,
) -> dict[str, Any]:
  """The attribute values a policy gives one layer (linen or NNX)."""
  overrides: dict[str, Any] = {}
  if "dtype" in fields:
    overrides["dtype"] = dtype
  if "param_dtype" in fields:
    overrides["param_dtype"] = param_dtype
  if "force_float32_reductions" in fields:
    overrides["force_float32_reductions"] = True
  if "force_fp32_for_softmax" in fields:
    overrides["force_fp32_for_softmax"] = True
  # Flax's default attention only: a custom `attention_fn`, or custom
  # (e.g. quantized) attention einsums that only Flax's function uses, stay.
  custom_einsums = any(
    name in fields and current(name) is not None
    for name in ("qk_attn_weights_einsum_cls", "attn_weights_value_einsum_cls")
  )
  if (
    "attention_fn" in fields
    and not custom_einsums
    and any(current("attention_fn") is f for f in _FLAX_DEFAULT_ATTENTION_FNS)
  ):
    overrides["attention_fn"] = dot_product_attention
  return overrides
