"""Loss and gradients of a scaled loss, for :func:`~jmp_train._src.loss_scaling.loss_scaled`."""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable, Sequence

import jax

from jmp_train._src.loss_scale import LossScale
from jmp_train._src.loss_scale import StaticLossScale
from jmp_train._src.loss_scaling import LossScaledState

__all__ = ["scaled_value_and_grad"]


def _as_loss_scale(loss_scale: Any) -> LossScale:
  if isinstance(loss_scale, LossScale):
    return loss_scale
  if isinstance(loss_scale, LossScaledState):
    return loss_scale.loss_scale
  try:
    return StaticLossScale(loss_scale)
  except (TypeError, ValueError) as e:
    raise ValueError(
        "loss_scale must be a loss-scale value (e.g. from get_loss_scale) or "
        f"a positive scalar, got {loss_scale!r}: {e}"
    ) from None


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
    TypeError: if ``fun`` or ``value_and_grad`` is not callable.

  Examples:
    >>> g = scaled_value_and_grad(lambda w: jnp.sum(w ** 2))
    >>> loss, grads = g(StaticLossScale(8.0), jnp.ones(2))
    >>> float(loss), grads.tolist()
    (2.0, [16.0, 16.0])
  """
  for name, value in (("fun", fun), ("value_and_grad", value_and_grad)):
    if not callable(value):
      raise TypeError(
          f"scaled_value_and_grad needs a callable {name}, got "
          f"{type(value).__name__}: {value!r}.")

  @functools.wraps(fun)
  def g(loss_scale, *args, **kwargs):
    scale = _as_loss_scale(loss_scale)

    def scaled_fun(*fargs):
      out = fun(*fargs, **kwargs)
      loss, aux = out if has_aux else (out, None)
      return scale.scale(loss), (loss, aux)

    (_, (loss, aux)), grads = value_and_grad(
        scaled_fun, argnums=argnums, has_aux=True
    )(*args)
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
  g.__signature__ = signature.replace(
      parameters=[first, *signature.parameters.values()])
  return g
