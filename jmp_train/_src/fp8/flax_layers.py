"""FP8 products as Flax layers' pluggable dot and convolution (linen and NNX).

Flax's ``Dense``/``DenseGeneral``/``Einsum`` (linen ``dot_general_cls``) and
``Conv`` (``conv_general_dilated_cls``), and NNX's ``Linear``/
``LinearGeneral``/``Einsum`` (``dot_general``) and ``Conv``
(``conv_general_dilated``), take the product they run as a field. The
modules here are such products in FP8 (:func:`jmp_train.fp8_dot_general`,
:func:`jmp_train.fp8_conv_general_dilated`), each with its own scaling
state:

* linen: six float32 variables in the ``"fp8_meta"`` collection
  (:data:`FP8_COLLECTION`), not in ``"params"``, so an optimizer never sees
  them;
* NNX: six :class:`Fp8Meta` variables, a ``nnx.Variable`` type that
  ``nnx.Optimizer(wrt=nnx.Param)`` leaves alone.

The new state of a step comes back as the gradient of these variables (see
:func:`jmp_train.fp8_dot_general`): take the gradient with respect to them
too, and store it in their place with :func:`jmp_train.update_fp8_meta`.
"""

from __future__ import annotations

import functools
from typing import Any

import flax.linen as nn
import jax
from flax import nnx

from jmp_train._src.fp8 import products as fp8_lib

__all__ = [
  "FP8_COLLECTION",
  "Fp8Meta",
  "Fp8DotGeneral",
  "Fp8ConvGeneralDilated",
  "NNXFp8DotGeneral",
  "NNXFp8ConvGeneralDilated",
  "initial_fp8_values",
  "linen_fp8_fields",
  "nnx_fp8_attributes",
]

FP8_COLLECTION = "fp8_meta"
_NAMES = ("input", "kernel", "output_grad")


class Fp8Meta(nnx.Variable):
  """An NNX variable holding FP8 scaling state (scales, amax histories)."""


def to_meta(values: dict[str, jax.Array]) -> fp8_lib.Fp8DotMeta:
  """The :class:`~jmp_train.Fp8DotMeta` of an FP8 layer's six variables, by name."""
  return fp8_lib.Fp8DotMeta(*(fp8_lib.Fp8TensorMeta(values[f"{n}_scale"], values[f"{n}_amax_history"]) for n in _NAMES))


def initial_fp8_values(recipe: fp8_lib.Fp8Recipe) -> dict[str, jax.Array]:
  """Each FP8 scaling variable's initial value, by variable name."""
  return _initial_values(recipe)


def _initial_values(recipe: fp8_lib.Fp8Recipe) -> dict[str, jax.Array]:
  meta = fp8_lib.init_fp8_meta(recipe)
  out = {}
  for name, t in zip(_NAMES, meta):
    out[f"{name}_scale"], out[f"{name}_amax_history"] = t.scale, t.amax_history
  return out


class _LinenFp8(nn.Module):
  recipe: fp8_lib.Fp8Recipe = fp8_lib.Fp8Recipe()

  def _meta(self) -> fp8_lib.Fp8DotMeta:
    init = _initial_values(self.recipe)
    return to_meta({k: self.variable(FP8_COLLECTION, k, lambda v=v: v).value for k, v in init.items()})


class Fp8DotGeneral(_LinenFp8):
  """A linen ``dot_general_cls``: ``lax.dot_general`` in FP8.

  Examples:
    >>> import functools, flax.linen as nn, jmp_train
    >>> layer = nn.Dense(16, dot_general_cls=functools.partial(
    ...     Fp8DotGeneral, recipe=jmp_train.Fp8Recipe(amax_history_len=4)))
    >>> variables = layer.init(jax.random.key(0), jnp.ones((2, 16)))
    >>> sorted(variables)
    ['fp8_meta', 'params']
  """

  @nn.compact
  def __call__(self, lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None, **kwargs):
    return fp8_lib.fp8_dot_general(
      lhs, rhs, dimension_numbers, precision, preferred_element_type, meta=self._meta(), recipe=self.recipe, **kwargs
    )


class Fp8ConvGeneralDilated(_LinenFp8):
  """A linen ``conv_general_dilated_cls``: ``lax.conv_general_dilated`` in FP8."""

  @nn.compact
  def __call__(self, lhs, rhs, *args, **kwargs):
    return fp8_lib.fp8_conv_general_dilated(lhs, rhs, *args, meta=self._meta(), recipe=self.recipe, **kwargs)


class _NNXFp8(nnx.Module):
  def __init__(self, recipe: fp8_lib.Fp8Recipe = fp8_lib.Fp8Recipe()):
    self.recipe = recipe
    for name, value in _initial_values(recipe).items():
      setattr(self, name, Fp8Meta(value))

  def _meta(self) -> fp8_lib.Fp8DotMeta:
    return to_meta({k: getattr(self, k)[...] for k in _initial_values(self.recipe)})


class NNXFp8DotGeneral(_NNXFp8):
  """An NNX layer's ``dot_general``: ``lax.dot_general`` in FP8.

  Examples:
    >>> import jmp_train
    >>> from flax import nnx
    >>> layer = nnx.Linear(16, 8, rngs=nnx.Rngs(0),
    ...                    dot_general=NNXFp8DotGeneral(jmp_train.Fp8Recipe(amax_history_len=4)))
    >>> layer(jnp.ones((2, 16))).shape
    (2, 8)
    >>> len(nnx.state(layer, jmp_train.flax.Fp8Meta))
    1
  """

  def __call__(self, lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None, **kwargs):
    return fp8_lib.fp8_dot_general(
      lhs, rhs, dimension_numbers, precision, preferred_element_type, meta=self._meta(), recipe=self.recipe, **kwargs
    )


class NNXFp8ConvGeneralDilated(_NNXFp8):
  """An NNX ``Conv``'s ``conv_general_dilated``: the convolution in FP8."""

  def __call__(self, lhs, rhs, *args, **kwargs):
    return fp8_lib.fp8_conv_general_dilated(lhs, rhs, *args, meta=self._meta(), recipe=self.recipe, **kwargs)


def linen_fp8_fields(fields: Any, recipe: fp8_lib.Fp8Recipe | None) -> dict[str, Any]:
  """The fields that make a linen layer's products FP8 (none without a recipe).

  Examples:
    >>> import flax.linen as nn, dataclasses
    >>> fields = {f.name for f in dataclasses.fields(nn.Dense(4))}
    >>> sorted(linen_fp8_fields(fields, fp8_lib.Fp8Recipe()))
    ['dot_general_cls']
  """
  if recipe is None:
    return {}
  out: dict[str, Any] = {}
  if "dot_general_cls" in fields:
    out["dot_general_cls"] = functools.partial(Fp8DotGeneral, recipe=recipe)
  if "conv_general_dilated_cls" in fields:
    out["conv_general_dilated_cls"] = functools.partial(Fp8ConvGeneralDilated, recipe=recipe)
  return out


def nnx_fp8_attributes(module: Any, recipe: fp8_lib.Fp8Recipe | None) -> dict[str, Any]:
  """The attributes that make an NNX layer's products FP8 (none without a recipe).

  The values are wrapped in ``nnx.data`` (NNX layers declare their product
  function a static attribute; an FP8 product holds state).
  """
  if recipe is None:
    return {}
  if isinstance(module, (nnx.Linear, nnx.LinearGeneral)) and not isinstance(
    getattr(module, "dot_general", None), _NNXFp8
  ):
    return {"dot_general": nnx.data(NNXFp8DotGeneral(recipe))}
  if isinstance(module, nnx.Conv) and not isinstance(getattr(module, "conv_general_dilated", None), _NNXFp8):
    return {"conv_general_dilated": nnx.data(NNXFp8ConvGeneralDilated(recipe))}
  return {}


def split_fp8_state(model_state: Any) -> tuple[Any, Any]:
  """Splits a model's non-parameter state into its FP8 part and the rest.

  Linen: the ``"fp8_meta"`` collection of a variables dict; NNX: the
  :class:`Fp8Meta` variables of an ``nnx.State``. A train step
  differentiates the loss with respect to the FP8 part (its "gradient" is
  its new value) and updates the rest as usual.

  Examples:
    >>> fp8, rest = split_fp8_state({"fp8_meta": {"a": 1}, "batch_stats": {"b": 2}})
    >>> fp8, rest
    ({'fp8_meta': {'a': 1}}, {'batch_stats': {'b': 2}})
  """
  if isinstance(model_state, nnx.State):
    return nnx.split_state(model_state, Fp8Meta, ...)
  if isinstance(model_state, dict):
    fp8 = {k: v for k, v in model_state.items() if k == FP8_COLLECTION}
    return fp8, {k: v for k, v in model_state.items() if k != FP8_COLLECTION}
  return {}, model_state


def merge_fp8_state(fp8: Any, rest: Any) -> Any:
  """The inverse of :func:`split_fp8_state`."""
  if isinstance(rest, nnx.State):
    return nnx.merge_state(fp8, rest)
  if isinstance(rest, dict):
    return {**rest, **fp8}
  return rest
