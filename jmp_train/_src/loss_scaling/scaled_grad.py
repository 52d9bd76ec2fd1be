"""Loss and gradients of a scaled loss, for :func:`jmp_train.loss_scaled`."""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable, Sequence

import jax

from jmp_train._src.leaf_checks import first_not_differentiable
from jmp_train._src.loss_scaling.scales import LossScale
from jmp_train._src.loss_scaling.scales import StaticLossScale
from jmp_train._src.loss_scaling.wrapper import LossScaledState
from jmp_train._src.messages import describe

__all__ = ["scaled_value_and_grad"]


def _is_scalar(value: Any) -> bool:
  if isinstance(value, bool):
    return False
  if isinstance(value, (int, float)):
    return True
  return getattr(value, "shape", None) == ()


def _as_loss_scale(loss_scale: Any) -> LossScale:
  """The loss scale that ``g`` got first.

  Raises:
    TypeError: if ``loss_scale`` is not a loss scale, a LossScaledState or a
      scalar (the parameters, when the loss scale was left out), described
      in one line with the call to make.
    ValueError: if it is a scalar but not a positive finite number.
  """
  if isinstance(loss_scale, LossScale):
    return loss_scale
  if isinstance(loss_scale, LossScaledState):
    return loss_scale.loss_scale
  if not _is_scalar(loss_scale):
    raise TypeError(
      "The gradient function from scaled_value_and_grad takes the loss scale first: "
      "grad_fn(loss_scale, params, ...), with loss_scale from "
      "get_loss_scale(opt_state), a LossScaledState or a positive scalar. Its "
      f"first argument here is {describe(loss_scale)}: was the loss scale left out?"
    )
  try:
    return StaticLossScale(loss_scale)
  except (TypeError, ValueError) as e:
    raise ValueError(
      "loss_scale must be a loss-scale value (e.g. from get_loss_scale) or "
      f"a positive scalar, got {describe(loss_scale)}: {e}"
    ) from None


def _argument_name(signature: inspect.Signature | None, index: int) -> str:
  """The name of ``fun``'s positional argument ``index``, for messages."""
  if signature is not None:
    positional = [p for p in signature.parameters.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if index < len(positional):
      return positional[index].name
    rest = [p for p in signature.parameters.values() if p.kind == p.VAR_POSITIONAL]
    if rest:
      return f"{rest[0].name}[{index - len(positional)}]"
  return f"args[{index}]"


def _check_differentiable(
  signature: inspect.Signature | None, args: tuple[Any, ...], argnums: int | Sequence[int]
) -> None:
  """Names an integer (or boolean, key) leaf of a differentiated argument.

  Raises:
    TypeError: naming the argument, the leaf's path and dtype, and the fix.
  """
  for index in (argnums,) if isinstance(argnums, int) else tuple(argnums):
    if not -len(args) <= index < len(args):
      continue  # jax.value_and_grad says so itself.
    index %= len(args)
    found = first_not_differentiable(args[index])
    if found is not None:
      name = _argument_name(signature, index)
      path, dtype = found
      raise TypeError(
        f"scaled_value_and_grad differentiates {name}, but {name}{path} has "
        f"dtype {dtype}: gradients need floating-point (or complex) leaves. Cast "
        f"it to a float dtype (e.g. x.astype(jnp.float32)), or pass integer "
        f"values in an argument that argnums leaves out."
      )


def scaled_value_and_grad(
  fun: Callable[..., Any],
  has_aux: bool = False,
  argnums: int | Sequence[int] = 0,
  *,
  value_and_grad: Callable[..., Callable[..., Any]] = jax.value_and_grad,
) -> Callable[..., tuple[Any, Any]]:
  r"""Turns a loss function into one returning the loss and scaled gradients.

  ``g = scaled_value_and_grad(fun)`` computes, for a loss scale ``S``,

  .. math::

    g(S, *args) = \left(L, \nabla_{args} (S \cdot L)\right),
    \quad L = \text{fun}(*args),

  the loss ``L`` itself (not ``S L / S``) and the gradients of the scaled
  loss, ready for :func:`loss_scaled`, which unscales them.

  Args:
    fun: the loss function; returns a real scalar (or ``(loss, aux)`` when
      ``has_aux``).
    has_aux: whether ``fun`` returns ``(loss, aux)``.
    argnums: which positional arguments of ``fun`` to differentiate (as in
      ``jax.value_and_grad``; the loss-scale argument is not counted).
    value_and_grad: the differentiation transform, ``jax.value_and_grad`` or
      e.g. ``flax.nnx.value_and_grad`` for NNX modules.

  Returns:
    ``g(loss_scale, *args, **kwargs) -> (value, scaled_grads)`` where
    ``loss_scale`` is a loss-scale value (see :func:`get_loss_scale`), a
    :class:`LossScaledState`, or a positive scalar, and ``value`` is the
    unscaled loss, or ``(loss, aux)`` when ``has_aux``. Its
    ``inspect.signature`` is ``fun``'s with the positional-only loss-scale
    parameter first, so ``jax.jit(g, static_argnums=...)`` and
    ``static_argnames=...`` name the same arguments as for
    ``jax.value_and_grad(fun)``, with the numbers shifted by one.

  Raises:
    TypeError: if ``fun`` or ``value_and_grad`` is not callable. The
      returned function raises a ``TypeError`` if its first argument is not
      a loss scale (the parameters, when the loss scale was left out:
      described by type and number of leaves, with the call to make), or,
      with the default ``value_and_grad``, if a differentiated argument has
      an integer, boolean or key leaf (naming its path and dtype); a
      ``ValueError`` if the loss scale is a scalar that is not positive.

  Examples:
    >>> g = scaled_value_and_grad(lambda w: jnp.sum(w ** 2))
    >>> loss, grads = g(StaticLossScale(8.0), jnp.ones(2))
    >>> float(loss), grads.tolist()
    (2.0, [16.0, 16.0])
  """
  for name, value in (("fun", fun), ("value_and_grad", value_and_grad)):
    if not callable(value):
      raise TypeError(f"scaled_value_and_grad needs a callable {name}, got {type(value).__name__}: {value!r}.")

  try:
    signature = inspect.signature(fun)
  except (TypeError, ValueError):  # e.g. some builtins
    signature = None

  @functools.wraps(fun)
  def g(loss_scale, *args, **kwargs):
    scale = _as_loss_scale(loss_scale)
    if value_and_grad is jax.value_and_grad:
      # jax.grad's own error names the dtype only, not the leaf.
      _check_differentiable(signature, args, argnums)

    def scaled_fun(*fargs):
      out = fun(*fargs, **kwargs)
      loss, aux = out if has_aux else (out, None)
      return scale.scale(loss), (loss, aux)

    (_, (loss, aux)), grads = value_and_grad(scaled_fun, argnums=argnums, has_aux=True)(*args)
    return ((loss, aux) if has_aux else loss), grads

  return _with_loss_scale_first(g, fun)


def _with_loss_scale_first(g: Callable[..., Any], fun: Callable[..., Any]):
  """Gives ``g`` the signature of ``fun`` with a loss-scale parameter first.

  ``functools.wraps`` makes ``inspect.signature(g)`` report ``fun``'s own
  signature, one positional argument short, which misleads ``jax.jit``'s
  ``static_argnums``/``static_argnames``. The parameter is positional-only
  (``g`` takes it first) and named ``loss_scale`` (with underscores added if
  ``fun`` has a parameter of that name).
  """
  try:
    signature = inspect.signature(fun)
  except (TypeError, ValueError):  # e.g. some builtins: leave it unknown
    return g
  name = "loss_scale"
  while name in signature.parameters:
    name += "_"
  first = inspect.Parameter(name, inspect.Parameter.POSITIONAL_ONLY)
  g.__signature__ = signature.replace(parameters=[first, *signature.parameters.values()])
  return g
