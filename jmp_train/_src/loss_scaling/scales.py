"""Loss-scale values (no-op, static, dynamic) and a replica-aware finite test.

Loss scaling (Micikevicius et al., "Mixed Precision Training", ICLR 2018,
section 3.2) multiplies the loss by a factor ``S`` before backpropagation so
that small float16 gradients do not flush to zero, and multiplies the
gradients by ``1/S`` before anything else touches them. Dynamic loss scaling
picks ``S`` online: it halves ``S`` (and the step is skipped) whenever a
gradient overflowed, and doubles it after ``growth_interval`` consecutive
finite steps.

The three loss-scale classes here are immutable pytrees. Their array fields
(``loss_scale`` and, for :class:`DynamicLossScale`, ``counter``) are leaves,
so a new scale value never retraces a jitted step; their configuration
(``growth_interval``, ``growth_factor``, ``backoff_factor``, ``min_scale``,
``max_scale``) is static pytree metadata that survives ``jax.jit``,
``jax.tree.map`` and checkpoint round trips. Flattening is derived from the
dataclass fields themselves, so no field can be forgotten.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import optax

from jmp_train._src import pytrees
from jmp_train._src.loss_scaling.checks import FROM_ARGS
from jmp_train._src.loss_scaling.checks import as_counter_array
from jmp_train._src.loss_scaling.checks import as_flag
from jmp_train._src.loss_scaling.checks import as_scale_array
from jmp_train._src.loss_scaling.checks import dynamic_config
from jmp_train._src.loss_scaling.checks import dynamic_scale
from jmp_train._src.dtypes import is_floating_array

__all__ = [
  "LossScale",
  "NoOpLossScale",
  "StaticLossScale",
  "DynamicLossScale",
]


def _static(**kwargs: Any) -> Any:
  """A dataclass field that is static pytree metadata (not a leaf)."""
  return dataclasses.field(metadata={"static": True}, **kwargs)


def apply_scale(tree: Any, factor: jax.Array) -> Any:
  """Multiplies floating leaves by a float32 scalar, keeping their dtypes.

  The product is formed in float32 for half-precision leaves (so a scale
  beyond float16's range and large intermediate values are representable),
  in the leaf's own dtype for float32 and float64 leaves, and cast back to
  the leaf's dtype. Non-floating leaves are returned as they are; Python
  floats are treated as float32 scalars.
  """

  def mul(x):
    if isinstance(x, float):  # a Python float loss, e.g. from a constant
      x = jnp.asarray(x, jnp.float32)
    if not is_floating_array(x):
      return x
    # Explicit (not jnp.promote_types, which strict promotion forbids).
    compute = x.dtype if x.dtype.itemsize >= 4 else jnp.dtype(jnp.float32)
    return (x.astype(compute) * factor.astype(compute)).astype(x.dtype)

  return jax.tree.map(mul, tree)


class LossScale:
  """Base class of loss-scale values: ``scale``, ``unscale``, ``adjust``.

  Subclasses are frozen dataclasses registered as pytrees; ``loss_scale`` is
  the current scale as a float32 scalar array.
  """

  loss_scale: jax.Array

  def scale(self, tree: Any) -> Any:
    """Multiplies the floating leaves of ``tree`` by the loss scale.

    Args:
      tree: a pytree, typically the loss (a scalar).

    Returns:
      ``tree * S`` with every leaf in its own dtype (computed in float32 or
      wider, then cast back).
    """
    return apply_scale(tree, self.loss_scale)

  def unscale(self, tree: Any) -> Any:
    """Multiplies the floating leaves of ``tree`` by ``1 / S``.

    ``1/S`` is computed in float32 and each leaf is multiplied in float32
    (or wider) before being cast back to its dtype, so float16 gradients
    scaled up to near 65504 come back without an intermediate overflow. A
    multiply (unlike a division) is cheap enough for XLA to fuse into every
    consumer, so unscaling adds no pass over the gradients of its own.

    Args:
      tree: a pytree, typically the scaled gradients.

    Returns:
      ``tree / S`` with every leaf in its own dtype.
    """
    return apply_scale(tree, jnp.float32(1.0) / self.loss_scale)

  def adjust(self, grads_finite: jax.typing.ArrayLike) -> "LossScale":
    """Returns the loss scale to use after a step (see subclasses)."""
    raise NotImplementedError

  def replace(self, **changes: Any) -> "LossScale":
    """Returns a copy with some fields replaced, without validation.

    Meant for leaves (``loss_scale``, ``counter``) inside traced code; build
    a new value with the constructor to change the configuration.

    Raises:
      ValueError: if a name is not a field of this class.
    """
    names = {f.name for f in dataclasses.fields(self)}
    if unknown := set(changes) - names:
      raise ValueError(f"Unknown field(s) {sorted(unknown)} for {type(self).__name__}; fields: {sorted(names)}.")
    return type(self)(**{n: changes.get(n, getattr(self, n)) for n in names})


@pytrees.register_pytree_dataclass
@dataclasses.dataclass(frozen=True, eq=False)
class NoOpLossScale(LossScale):
  """A loss scale of 1 that does nothing: for float32 or bfloat16 training.

  ``scale`` and ``unscale`` return their input unchanged; ``adjust`` returns
  ``self``. It has no leaves.

  Examples:
    >>> ls = NoOpLossScale()
    >>> float(ls.loss_scale), float(ls.scale(jnp.float32(3.0)))
    (1.0, 3.0)
  """

  @property
  def loss_scale(self) -> jax.Array:  # type: ignore[override]
    """The constant scale 1 as a float32 scalar."""
    return jnp.ones((), jnp.float32)

  def scale(self, tree: Any) -> Any:
    return tree

  def unscale(self, tree: Any) -> Any:
    return tree

  def adjust(self, grads_finite: jax.typing.ArrayLike) -> "NoOpLossScale":
    as_flag(grads_finite)
    return self


@pytrees.register_pytree_dataclass
@dataclasses.dataclass(frozen=True, eq=False, init=False)
class StaticLossScale(LossScale):
  """A fixed loss scale ``S``.

  Attributes:
    loss_scale: the scale as a float32 scalar array (a pytree leaf, so
      changing it does not retrace a jitted function).

  Examples:
    >>> ls = StaticLossScale(2.0 ** 10)
    >>> float(ls.unscale(ls.scale(jnp.float16(0.5))))
    0.5
  """

  loss_scale: jax.Array

  def __init__(
    self,
    scale: jax.typing.ArrayLike = FROM_ARGS,
    *,
    loss_scale: Any = FROM_ARGS,
  ):
    """Builds a static loss scale.

    Args:
      scale: the scale ``S``, finite and > 0.
      loss_scale: the field itself, taken as is without validation (how JAX
        and :meth:`replace` rebuild the value from its leaves); give
        ``scale`` instead.

    Raises:
      ValueError: if ``scale`` is not a finite positive scalar, or if both
        or neither of ``scale`` and ``loss_scale`` are given.
    """
    if (scale is FROM_ARGS) == (loss_scale is FROM_ARGS):
      raise ValueError(
        "StaticLossScale takes the scale S, e.g. StaticLossScale(2.0**15); "
        f"got scale={scale!r}, loss_scale={loss_scale!r}."
      )
    if loss_scale is FROM_ARGS:
      loss_scale = as_scale_array(scale, "scale")
    object.__setattr__(self, "loss_scale", loss_scale)

  def adjust(self, grads_finite: jax.typing.ArrayLike) -> "StaticLossScale":
    """Returns ``self``: a static scale never changes."""
    as_flag(grads_finite)
    return self


@pytrees.register_pytree_dataclass
@dataclasses.dataclass(frozen=True, eq=False, init=False)
class DynamicLossScale(LossScale):
  r"""A loss scale that backs off on overflow and grows after good steps.

  With ``S`` the scale and ``c`` the count of consecutive finite steps,
  :meth:`adjust` does, for a step whose gradients were finite or not:

  .. math::

    \text{non-finite:}\quad & S \leftarrow \max(S \cdot b, S_{min}),
        \quad c \leftarrow 0 \\
    \text{finite},\ c + 1 = N:\quad & S \leftarrow \min(S \cdot g, S_{max}),
        \quad c \leftarrow 0 \\
    \text{finite, otherwise:}\quad & c \leftarrow c + 1

  with ``N = growth_interval``, ``g = growth_factor``, ``b =
  backoff_factor``. Growth happens on exactly the ``N``-th consecutive finite
  step, as in PyTorch's ``torch.amp.GradScaler`` (whose trajectory this
  matches for the same settings while ``S`` stays inside ``[S_min,
  S_max]``); ``S`` never leaves ``[S_min, S_max]`` and ``S_min`` may be below
  1. The scale is a float32 scalar as in PyTorch; the factors are rounded to
  float32, so for factors exact in float32 (2, 0.5, 1.5, 0.25, ...) every
  product is rounded once, exactly as PyTorch rounds its float64 product.

  Attributes:
    loss_scale: current scale, float32 scalar (pytree leaf).
    counter: consecutive finite steps since the last change, int32 scalar
      (pytree leaf).
    growth_interval: ``N`` (static).
    growth_factor: ``g > 1`` (static).
    backoff_factor: ``b`` in (0, 1) (static).
    min_scale: ``S_min > 0`` (static).
    max_scale: ``S_max >= S_min``, finite (static).

  Examples:
    >>> ls = DynamicLossScale(2.0 ** 15, growth_interval=2)
    >>> ls = ls.adjust(jnp.array(False))
    >>> float(ls.loss_scale)
    16384.0
    >>> ls = ls.adjust(jnp.array(True)).adjust(jnp.array(True))
    >>> float(ls.loss_scale), int(ls.counter)
    (32768.0, 0)

  References:
    Micikevicius et al., "Mixed Precision Training", ICLR 2018.
    https://arxiv.org/abs/1710.03740

    PyTorch ``torch.amp.GradScaler`` (``_amp_update_scale_``).
    https://pytorch.org/docs/stable/amp.html#gradient-scaling
  """

  loss_scale: jax.Array
  counter: jax.Array
  growth_interval: int = _static()
  growth_factor: float = _static()
  backoff_factor: float = _static()
  min_scale: float = _static()
  max_scale: float = _static()

  def __init__(
    self,
    scale: jax.typing.ArrayLike = 2.0**15,
    growth_interval: int = 2000,
    growth_factor: float = 2.0,
    backoff_factor: float = 0.5,
    min_scale: float = 1.0,
    max_scale: float = 2.0**24,
    counter: jax.typing.ArrayLike = 0,
    *,
    loss_scale: Any = FROM_ARGS,
  ):
    """Builds a dynamic loss scale.

    Args:
      scale: initial scale, finite, in ``[min_scale, max_scale]``.
      growth_interval: number of consecutive finite steps after which the
        scale grows, an integer >= 1.
      growth_factor: factor the scale grows by, > 1.
      backoff_factor: factor the scale shrinks by on overflow, in (0, 1).
      min_scale: floor of the scale, > 0 (may be below 1).
      max_scale: ceiling of the scale, finite, >= ``min_scale``.
      counter: initial count of consecutive finite steps (to resume), in
        ``[0, growth_interval)``.
      loss_scale: the scale field itself; when given, every argument is
        taken as is without validation (how JAX and :meth:`replace` rebuild
        the value from its leaves). Give ``scale`` instead.

    Raises:
      ValueError: naming the bad argument and its valid range.
    """
    fields = dict(
      loss_scale=loss_scale,
      counter=counter,
      growth_interval=growth_interval,
      growth_factor=growth_factor,
      backoff_factor=backoff_factor,
      min_scale=min_scale,
      max_scale=max_scale,
    )
    if loss_scale is FROM_ARGS:  # built by a user: validate everything
      config = dynamic_config(growth_interval, growth_factor, backoff_factor, min_scale, max_scale)
      fields.update(
        config,
        loss_scale=dynamic_scale(scale, config["min_scale"], config["max_scale"]),
        counter=as_counter_array(counter, config["growth_interval"]),
      )
    for name, value in fields.items():
      object.__setattr__(self, name, value)

  def adjust(self, grads_finite: jax.typing.ArrayLike) -> "DynamicLossScale":
    """Returns the scale for the next step (see the class docstring).

    Args:
      grads_finite: a boolean scalar, whether this step's gradients were all
        finite (see :func:`all_finite`).

    Returns:
      A new :class:`DynamicLossScale` with the same configuration; its leaves
      keep their dtypes (float32 scale, int32 counter).

    Raises:
      ValueError: if ``grads_finite`` is not a scalar.
    """
    finite = as_flag(grads_finite)
    scale = self.loss_scale.astype(jnp.float32)
    counter = self.counter.astype(jnp.int32)
    next_count = optax.safe_increment(counter)
    grow = finite & (next_count >= self.growth_interval)
    grown = jnp.minimum(scale * jnp.float32(self.growth_factor), self.max_scale)
    shrunk = jnp.maximum(scale * jnp.float32(self.backoff_factor), self.min_scale)
    new_scale = jnp.where(finite, jnp.where(grow, grown, scale), shrunk)
    new_counter = jnp.where(finite & ~grow, next_count, jnp.zeros_like(counter))
    return self.replace(loss_scale=new_scale, counter=new_counter)
