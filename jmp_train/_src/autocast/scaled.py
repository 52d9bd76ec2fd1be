"""The products :func:`jmp_train.autocast` runs in a policy's narrow format.

Under a policy with a narrow product format, each weight product of the
function (a ``dot_general`` or ``conv_general_dilated`` with a parameter
operand) is bound as a narrow product (``jmp_train._src.fp8.narrow``) on its
compute-dtype operands, with current scaling: each operand is scaled by its
own amax in the same step, so the product keeps no state and any function,
``scan`` bodies and rematerialized regions included, gets narrow products
without a place to store a history.

* FP8 (``"mixed_float8"``): :func:`jmp_train.fp8_dot_general` /
  :func:`jmp_train.fp8_conv_general_dilated`, per-tensor scales; the
  recipe's ``margin`` applies.
* INT8 (``"mixed_int8"``): int8 codes, int32 accumulation, per-row scales
  of the activation and per-channel scales of the weight (after the
  :class:`~jmp_train.int8.Int8Recipe`), the straight-through estimator
  backward with compute-dtype products.

A *site hook* (:func:`hooked`) sees each weight product first, under a
name for its site (the named scope and the primitive, numbered in
evaluation order: ``"Dense_0/dot_general"``), and may bind it itself:
calibration records the activation operand's statistics there, and a
quantized model gives its static activation scales.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable, Iterator, Sequence

from jax import lax

from jmp_train._src.fp8 import narrow
from jmp_train._src.fp8 import products as fp8_products
from jmp_train._src.int8 import products as int8_products
from jmp_train._src.int8.recipe import Int8Recipe

__all__ = ["PRODUCTS", "Site", "hooked", "op_of", "product"]

PRODUCTS = frozenset({"dot_general", "conv_general_dilated"})


@dataclasses.dataclass(frozen=True)
class Site:
  """A weight product as a site hook sees it.

  Attributes:
    name: the site's name, unique within one evaluation.
    eqn: the product's equation (primitive and parameters).
    weight: which operand (0 or 1) is the weight.
    scope: the named scopes the product runs in, outermost first (a linen
      module's path, an NNX attribute path, ``jax.named_scope`` names).
  """

  name: str
  eqn: Any
  weight: int
  scope: tuple[str, ...] = ()

  @property
  def activation(self) -> int:
    """Which operand (0 or 1) is the activation."""
    return 1 - self.weight


class _Hook:
  def __init__(self, fn: Callable[[Site, Sequence[Any], Any], Any]):
    self.fn = fn
    self.seen: dict[str, int] = {}

  def name(self, scope: tuple[str, ...], primitive: str) -> str:
    base = "/".join((*scope, primitive))
    n = self.seen.get(base, 0)
    self.seen[base] = n + 1
    return base if n == 0 else f"{base}#{n}"


_HOOKS: list[_Hook] = []


@contextlib.contextmanager
def hooked(fn: Callable[[Site, Sequence[Any], Any], Any]) -> Iterator[None]:
  """Within the block, ``fn(site, vals, policy)`` binds every weight product autocast evaluates.

  ``fn`` returns the product's result, or ``None`` for the policy's own.
  Site names count from the block's start.
  """
  _HOOKS.append(_Hook(fn))
  try:
    yield
  finally:
    _HOOKS.pop()


def site_names() -> Callable[[tuple[str, ...], str], str]:
  """A fresh site namer, for walkers that must name sites as autocast does."""
  return _Hook(lambda *a: None).name


def op_of(eqn: Any) -> narrow.ProductOp:
  """The :class:`~jmp_train._src.fp8.narrow.ProductOp` of a product equation."""
  params = dict(eqn.params)
  if eqn.primitive is lax.dot_general_p:
    return narrow.dot_op(params["dimension_numbers"], params.get("out_sharding"))
  return narrow.conv_op(
    params["window_strides"],
    params["padding"],
    lhs_dilation=params["lhs_dilation"],
    rhs_dilation=params["rhs_dilation"],
    dimension_numbers=params["dimension_numbers"],
    feature_group_count=params["feature_group_count"],
    batch_group_count=params["batch_group_count"],
  )


def int8_fine(recipe: Int8Recipe, eqn: Any, weight: int) -> tuple[bool, bool]:
  """Per operand, whether its INT8 scale is fine (per row / per channel)."""
  act_fine = recipe.activation == "per_row" and eqn.primitive is lax.dot_general_p
  fine = [act_fine, act_fine]
  fine[weight] = recipe.weight == "per_channel"
  return fine[0], fine[1]


def product(policy: Any, eqn: Any, vals: Sequence[Any], weight: int = 1, scope: tuple[str, ...] = ()) -> Any:
  """``eqn`` (a product) on ``vals`` in the policy's narrow format, in ``compute_dtype``.

  ``weight`` is the position of the weight operand; ``scope`` the named
  scope of the product (its site's name, for a site hook).
  """
  if _HOOKS:
    hook = _HOOKS[-1]
    out = hook.fn(Site(hook.name(scope, eqn.primitive.name), eqn, weight, tuple(scope)), vals, policy)
    if out is not None:
      return out
  lhs, rhs = vals
  out_dtype = policy.compute_dtype
  if policy.int8 is not None:
    fine = int8_fine(policy.int8, eqn, weight)
    return int8_products.int8_product(op_of(eqn), lhs, rhs, fine, None, out_dtype, policy.int8.backward)
  recipe = dataclasses.replace(policy.fp8, scaling="current")
  fmt = fp8_products.Fp8Format(recipe)
  return narrow.narrow_product(op_of(eqn), fmt, lhs.dtype, rhs.dtype, out_dtype)(lhs, rhs, None)
