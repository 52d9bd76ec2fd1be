"""How a train step's policy reaches every product of the model.

Flax's example models, and most models written after them, declare the
dtype of every layer (``nn.Dense(..., dtype=jnp.float32)``,
``nnx.Linear(..., dtype=jnp.float32)``): a layer promotes its inputs to that
dtype, so casting the parameters and the batch to the compute dtype up front
leaves every matrix product in float32. :func:`applied` chooses, for what was
passed to :func:`jmp_train.make_train_step`, how the policy reaches the
products instead (``model_policy``):

* ``"auto"`` (the default): :func:`jmp_train.autocast` decides every
  operation, whatever layers the model is built from (a linen module, its
  ``apply`` or a ``functools.partial`` of it, an ``nnx.Module``, any
  function): matrix products and convolutions in the compute dtype (FP8
  under an FP8 policy), exp, log, softmax, normalization statistics and
  reductions in float32, parameter gradients summed in the parameters'
  dtype. Under an FP8 policy with delayed scaling each FP8 product keeps
  its amax histories in the model state, keyed by its site in the model
  (``autocast.sites``); products inside loops use current scaling;
* ``"flax"``: :func:`jmp_train.flax.apply_policy` (Flax modules only);
* ``"autocast"``: :func:`jmp_train.autocast` for any model;
* ``"inputs"``: parameters and inputs cast, nothing else (the layers'
  declared dtypes win).

A model that applies a policy itself (built with
:func:`jmp_train.flax.apply_policy` or :func:`jmp_train.autocast`) is used
as is. :func:`audited` traces the forward pass once per compilation and warns
when a product still takes operands wider than the compute dtype (one inside
a ``custom_vjp`` rule, which autocast runs as traced).
"""

from __future__ import annotations

import functools
import warnings
from typing import Any, Callable, Iterator

import jax
import numpy as np
from jax.extend import core as jex_core
from jax.extend import source_info_util

from jmp_train._src.dtypes import is_floating_dtype
from jmp_train._src.policy.policy import Policy

__all__ = [
  "MODEL_POLICIES",
  "applies_policy",
  "audited",
  "check_model_policy",
  "linen_parts",
  "mark_applied",
  "wide_products",
]

MODEL_POLICIES = ("auto", "flax", "autocast", "inputs")
_PRODUCTS = ("dot_general", "conv_general_dilated")
# Set on functions that apply a policy themselves (autocast's results).
_APPLIED_ATTR = "_jmp_train_policy"


def check_model_policy(model_policy: Any) -> str:
  """``model_policy`` if valid.

  Raises:
    ValueError: naming the valid values.
  """
  if not isinstance(model_policy, str) or model_policy not in MODEL_POLICIES:
    raise ValueError(
      f"model_policy must be one of {MODEL_POLICIES}, got {model_policy!r}: 'auto' "
      "decides every operation of the model by jmp_train.autocast (products narrow, "
      "precision-sensitive operations in float32), 'flax' configures the Flax layers "
      "instead (jmp_train.flax.apply_policy), 'inputs' only casts the parameters and "
      "inputs (the layers' declared dtypes win)."
    )
  return model_policy


def is_narrow(policy: Policy) -> bool:
  """Whether ``policy`` computes in a dtype narrower than float32, or in FP8 or INT8."""
  return policy.compute_dtype.itemsize < 4 or policy.product_format is not None


def mark_applied(fn: Callable[..., Any], policy: Policy) -> Callable[..., Any]:
  """Marks ``fn`` as applying ``policy`` itself (so a train step leaves it alone)."""
  setattr(fn, _APPLIED_ATTR, policy)
  return fn


def linen_parts(fn: Any) -> tuple[Any, tuple[Any, ...], dict[str, Any]] | None:
  """``(module, args, kwargs)`` if ``fn`` is a linen module's ``apply``, else None.

  ``fn`` may be the module itself, its bound ``apply``, or a (nested)
  ``functools.partial`` of either; ``args``/``kwargs`` are the partial's.
  """
  from flax import linen as nn

  args: tuple[Any, ...] = ()
  kwargs: dict[str, Any] = {}
  while isinstance(fn, functools.partial):
    args = tuple(fn.args) + args
    kwargs = {**fn.keywords, **kwargs}
    fn = fn.func
  if isinstance(fn, nn.Module):
    return fn, args, kwargs
  owner = getattr(fn, "__self__", None)
  if isinstance(owner, nn.Module) and getattr(fn, "__name__", None) == "apply":
    return owner, args, kwargs
  return None


def applies_policy(fn: Any) -> bool:
  """Whether ``fn`` (an apply function or module) applies a policy itself."""
  from jmp_train._src.flax import nnx_modules
  from jmp_train._src.flax import policy as flax_policy

  if isinstance(fn, nnx_modules.NNXPolicyWrapper):
    return True
  parts = linen_parts(fn)
  if parts is not None:
    return isinstance(parts[0], flax_policy.LinenPolicyWrapper)
  while isinstance(fn, functools.partial):
    fn = fn.func
  return getattr(fn, _APPLIED_ATTR, None) is not None


def default_mechanism(fn: Any, policy: Policy) -> str:
  """How ``model_policy="auto"`` applies ``policy`` to ``fn``: ``"autocast"``.

  Every operation is decided by :func:`jmp_train.autocast`, whatever layers
  the model is built from. Under an FP8 policy with delayed scaling each
  weight product autocast runs in FP8 keeps its scaling state in the
  model state, keyed by its site (``autocast.sites``); products inside
  loops and conditionals use current scaling.
  """
  del fn, policy
  return "autocast"


def _autocast(fn: Callable[..., Any], policy: Policy, keep: tuple[str, ...] = ()) -> Callable[..., Any]:
  from jmp_train._src.autocast.transform import autocast

  return autocast(fn, policy, params_argnums=0, keep=keep)


def linen_apply(
  fn: Callable[..., Any] | None, policy: Policy, mechanism: str, keep: tuple[str, ...] = ()
) -> Callable[..., Any] | None:
  """``fn`` (a linen-style apply) with ``policy`` applied by ``mechanism``."""
  if fn is None or mechanism == "inputs" or applies_policy(fn):
    return fn
  parts = linen_parts(fn)
  if mechanism == "flax":
    if parts is None:
      raise TypeError(
        f"model_policy='flax' applies jmp_train.flax.apply_policy, which needs a "
        f"flax.linen.Module, its apply, or a functools.partial of its apply; got "
        f"{fn!r}. Pass the module (or model.apply), or model_policy='autocast' for "
        "any function."
      )
    from jmp_train._src.flax import policy as flax_policy

    module, args, kwargs = parts
    return functools.partial(flax_policy.apply_policy(module, policy).apply, *args, **kwargs)
  return _autocast(fn, policy, keep)


# ---------------------------------------------------------------------------
# The audit: products still wider than the compute dtype.


def _walk(jaxpr: Any) -> Iterator[Any]:
  for eqn in jaxpr.eqns:
    yield eqn
    for sub in jex_core.jaxprs_in_params(eqn.params):
      yield from _walk(sub)


def _where(eqn: Any) -> str:
  try:
    where = source_info_util.summarize(eqn.source_info)
  except Exception:  # pragma: no cover - source info is best effort.
    where = ""
  scope = str(getattr(eqn.source_info, "name_stack", "") or "")
  return " ".join(s for s in (scope, where) if s) or eqn.primitive.name


def _float_dtype(var: Any) -> np.dtype | None:
  dtype = getattr(getattr(var, "aval", None), "dtype", None)
  return np.dtype(dtype) if is_floating_dtype(dtype) else None


def wide_products(jaxpr: Any, compute_dtype: Any) -> list[str]:
  """One line per product whose floating operands are wider than ``compute_dtype``.

  Products are ``dot_general`` and ``conv_general_dilated`` equations, in
  every sub-jaxpr (jit, scan, remat, custom derivatives, control flow).
  """
  width = np.dtype(compute_dtype).itemsize
  found = []
  for eqn in _walk(jaxpr):
    if eqn.primitive.name not in _PRODUCTS:
      continue
    dtypes = [_float_dtype(v) for v in eqn.invars[:2]]
    if any(d is not None and d.itemsize > width for d in dtypes):
      shapes = " x ".join(f"{d.name if d else '?'}{list(v.aval.shape)}" for d, v in zip(dtypes, eqn.invars[:2]))
      found.append(f"{eqn.primitive.name} {shapes} at {_where(eqn)}")
  return found


def _forward_jaxpr(fn: Callable[..., Any], *args: Any) -> Any:
  return jax.make_jaxpr(fn)(*args).jaxpr


def audited(
  model: Any,
  policy: Policy,
  call: Callable[[Any], Callable[..., Any]],
  args: tuple[Any, ...],
  warn: bool,
) -> Any:
  """``model``, after warning if its products stay wider than the compute dtype.

  Args:
    model: the step's model (``train.model.LinenModel`` or ``NnxModel``).
    policy: the step's policy.
    call: ``call(model)`` is the forward function of ``args`` to audit.
    args: the forward's arguments (tracers of the enclosing trace).
    warn: warn when products stay wider than the compute dtype.

  Returns:
    ``model``.

  Warns:
    UserWarning: with ``warn``, when products of the model still take
      operands wider than the compute dtype: how many, where (the first
      three, by the model's source line) and the fixes.
  """
  if not model.audit or not warn:
    return model
  wide = wide_products(_forward_jaxpr(call(model), *args), policy.compute_dtype)
  if wide:
    shown = "; ".join(wide[:3]) + (f"; and {len(wide) - 3} more" if len(wide) > 3 else "")
    warnings.warn(
      f"Under the policy {policy} the model still runs {len(wide)} matrix "
      f"product(s) or convolution(s) with operands wider than "
      f"{policy.compute_dtype.name}: {shown}. Such a product sits inside a "
      "custom_vjp rule, a Pallas kernel or a callback, which autocast runs as traced "
      "so that its own rule stays valid. Cast its operands to the compute dtype there "
      "(or take the dtype from the inputs), or, if float32 is meant there, pass "
      "make_train_step(..., model_policy='inputs') and apply the policy yourself "
      "(jmp_train.autocast(..., float32_ops=(*DEFAULT_FLOAT32_OPS, 'scope:NAME'))): "
      "a model that applies a policy itself is not audited.",
      UserWarning,
      stacklevel=2,
    )
  return model


def autocast_call(module: Any, inputs: Any, policy: Policy, keep: tuple[str, ...] = ()) -> Any:
  """``module(inputs)`` for an NNX module, under :func:`jmp_train.autocast`.

  ``inputs`` splatted as the module's signature needs (``train.model.call_module``).
  """
  from jmp_train._src.train.model import call_module

  return _autocast(call_module, policy, keep)(module, inputs)


def check_keep(keep: Any, model_policy: str) -> tuple[str, ...]:
  """``keep`` as rules, if the model policy applies them.

  Raises:
    TypeError: for rules that are not strings.
    ValueError: for rules with ``model_policy="flax"`` or ``"inputs"``.
  """
  from jmp_train._src.autocast.lists import check_keep as check_rules

  rules = check_rules(keep)
  if rules and model_policy not in ("auto", "autocast"):
    raise ValueError(
      f"keep={rules!r} names products that autocast keeps in the compute dtype, but "
      f"model_policy={model_policy!r} does not run the model under autocast. Use "
      "model_policy='auto' (the default), or with 'flax' keep a layer out of FP8 by "
      "jmp_train.flax.apply_policy(model, policy, float32_paths=(...))."
    )
  return rules
