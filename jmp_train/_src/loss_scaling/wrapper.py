"""Loss scaling as an optax transformation that skips non-finite steps.

:func:`loss_scaled` wraps any optax transformation: it receives gradients of
the *scaled* loss, unscales them, runs the inner transformation and adjusts
the loss scale; when any gradient is inf or NaN it returns zero updates,
keeps the inner state bit-for-bit and backs the scale off. The scale lives
in the optimizer state (:class:`LossScaledState`), where the train step reads
it with :func:`get_loss_scale`, so there is one copy of it, checkpointed with
the rest of the state. The two branches of a step are built in ``steps``;
:func:`get_loss_scale` and :func:`loss_scale_metrics` live in ``lookup``,
:func:`scaled_value_and_grad` in ``scaled_grad``.

A train step, in a few lines::

  tx = jmp_train.loss_scaled(optax.adamw(1e-3), jmp_train.DynamicLossScale())
  grad_fn = jmp_train.scaled_value_and_grad(loss_fn)

  @jax.jit
  def step(params, opt_state, batch):
    loss_scale = jmp_train.get_loss_scale(opt_state)
    loss, grads = grad_fn(loss_scale, params, batch)  # grads are scaled
    updates, opt_state = tx.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    return params, opt_state, loss, jmp_train.loss_scale_metrics(opt_state)
"""

from __future__ import annotations

from typing import Any, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import optax

from jmp_train._src.loss_scaling.scales import LossScale
from jmp_train._src.loss_scaling.steps import branches
from jmp_train._src.loss_scaling.steps import unscaled_all_finite
from jmp_train._src.loss_scaling.steps import unscaler
from jmp_train._src.pytrees import fresh_arrays

__all__ = ["LossScaledState", "loss_scaled"]


class LossScaledState(NamedTuple):
  """State of :func:`loss_scaled`.

  The counters are named as in ``optax.ApplyIfFiniteState``, which counts the
  same things.

  Attributes:
    loss_scale: the current loss scale (a :class:`NoOpLossScale`,
      :class:`StaticLossScale` or :class:`DynamicLossScale`), to multiply the
      loss by in the next step.
    notfinite_count: int32 count of consecutive non-finite (skipped) steps,
      0 after a finite one.
    total_notfinite: int32 count of non-finite (skipped) steps so far.
    inner_state: state of the wrapped transformation; unchanged, bit for bit,
      by a skipped step.
  """

  loss_scale: LossScale
  notfinite_count: jax.Array
  total_notfinite: jax.Array
  inner_state: optax.OptState

  @property
  def last_finite(self) -> jax.Array:
    """Whether the last step's gradients were all finite (``True`` at first).

    Derived from ``notfinite_count == 0`` (the same fact, so not stored
    twice).
    """
    return jnp.asarray(self.notfinite_count) == 0


_SKIP_MODES = ("cond", "select")


def loss_scaled(
  inner: optax.GradientTransformation,
  loss_scale: LossScale,
  *,
  axis_name: str | Sequence[str] | None = None,
  skip_mode: str = "cond",
) -> optax.GradientTransformationExtraArgs:
  r"""Wraps ``inner`` to take gradients of a scaled loss and skip overflows.

  Given gradients ``G = S \nabla L`` of the loss scaled by the current scale
  ``S`` (see :func:`scaled_value_and_grad`), ``update`` does:

  * if every leaf of ``g = G / S`` is finite (``1/S`` applied in float32,
    cast back to each leaf's dtype): ``updates, inner_state =
    inner.update(g, ...)``, the new inner state cast back to the dtypes of
    the old one, ``S`` adjusted by ``loss_scale.adjust(True)``,
    ``notfinite_count`` reset to 0;
  * otherwise: zero updates (in the dtypes ``inner`` would return), the
    inner state returned bit-for-bit unchanged, ``S`` backed off by
    ``loss_scale.adjust(False)``, ``notfinite_count`` and
    ``total_notfinite`` counted up.

  Every state leaf keeps its dtype across finite and skipped steps, for any
  pairing of gradient and parameter dtypes (``optax.adam`` would otherwise
  promote float16 moments to float32 when given float32 gradients).

  Unscaling comes first, so anything in ``inner`` (clipping, weight decay,
  the optimizer's moments) sees true gradients: ``loss_scaled(optax.chain(
  optax.clip_by_global_norm(1.0), optax.adamw(1e-3)), ...)`` clips the
  unscaled gradients.

  By default (``skip_mode="cond"``) the branch is a ``lax.cond``, not a
  ``jnp.where`` over both results: the inner update is not computed on a
  skipped step (``where`` would compute it
  from inf/NaN inputs and throw it away), and the unchanged inner state is
  passed through rather than selected element by element. On a finite step
  the compiled step does what a bare finiteness test and a ``lax.cond``
  around ``inner`` do (the same passes over gradient-sized buffers):
  ``1/S`` is one scalar, its multiply fused into the test and into the inner
  update, and each branch updates the scale and the counters with a few scalar
  operations of its own. The predicate is
  the same on every replica when ``axis_name`` is given (:func:`all_finite`
  reduces it over the axis), so under ``pmap``/``shard_map`` all replicas
  take the same branch. Under ``vmap`` with a batched predicate, JAX turns
  the ``cond`` into a select, which is still correct.

  With ``optax.MultiSteps`` (gradient accumulation), put ``loss_scaled``
  *outside*: ``loss_scaled(optax.MultiSteps(opt, k).gradient_transformation(),
  loss_scale)``. Then every mini-step is unscaled before it is accumulated
  (so mini-steps taken at different scales add up correctly), and a
  non-finite mini-step is dropped entirely: it does not count towards the
  ``k`` mini-steps, leaves the accumulator untouched, and the scale backs off
  at once, before the next mini-step. The other nesting,
  ``MultiSteps(loss_scaled(opt, ...), k)``, sees each window's accumulated
  scaled gradients at the ``k``-th mini-step only and skips the whole window
  if any mini-step overflowed; but ``optax.MultiSteps`` resets its
  accumulator by multiplying it by zero, so an inf in it becomes NaN and
  every later window is skipped too. Do not nest that way.

  Args:
    inner: the transformation to wrap (``GradientTransformation`` or
      ``GradientTransformationExtraArgs``); extra arguments are passed on.
    loss_scale: the initial loss scale (:class:`NoOpLossScale`,
      :class:`StaticLossScale` or :class:`DynamicLossScale`). With
      :class:`NoOpLossScale` the transformation is a pure skip-on-non-finite
      guard, useful for bfloat16.
    axis_name: the mapped axis name(s) under ``pmap``/``shard_map`` when
      ``update`` receives per-replica gradients that were not averaged yet
      (e.g. when ``inner`` does the all-reduce itself); makes every replica
      skip if any replica overflowed. Not needed when the gradients were
      averaged over the axis before ``update``, since the mean is then
      non-finite everywhere.
    skip_mode: how a skipped step is made. ``"cond"`` (default): a
      ``lax.cond`` around ``inner``, which then does not run on a skipped
      step (a compiler may still lower the branch to selects). ``"select"``:
      ``inner`` always runs and ``jnp.where`` keeps the old inner state and
      zero updates on a non-finite step, as jmp and Flax examples do. Both skip the same
      steps and keep the inner state bit for bit on them (finite steps may
      differ in the last bit where XLA fuses ``inner`` differently);
      ``"select"`` avoids a data-dependent branch, which on some
      accelerators means reading the predicate back to the host each step.

  Returns:
    A ``GradientTransformationExtraArgs`` with state :class:`LossScaledState`.
    Its ``init`` puts copies of ``loss_scale``'s arrays in the state, so a
    step that donates the state leaves ``loss_scale`` usable.

  Raises:
    TypeError: if ``inner`` is not an optax transformation (e.g. a string,
      or a factory such as ``optax.sgd`` that was not called).
    ValueError: if ``loss_scale`` is not a loss-scale value, or for an
      unknown ``skip_mode``.

  Examples:
    >>> import jmp_train, optax
    >>> tx = jmp_train.loss_scaled(optax.sgd(0.1), jmp_train.StaticLossScale(4.0))
    >>> params = {"w": jnp.ones(2)}
    >>> state = tx.init(params)
    >>> updates, state = tx.update({"w": jnp.full(2, 4.0)}, state, params)
    >>> updates["w"].tolist()  # -0.1 * (4 / 4)
    [-0.10000000149011612, -0.10000000149011612]
    >>> updates, state = tx.update({"w": jnp.array([1.0, jnp.inf])}, state)
    >>> updates["w"].tolist(), int(state.total_notfinite)
    ([0.0, 0.0], 1)

  References:
    Micikevicius et al., "Mixed Precision Training", ICLR 2018.
    https://arxiv.org/abs/1710.03740
  """
  _check_inner(inner)
  if not isinstance(loss_scale, LossScale):
    raise ValueError(f"loss_scale must be a NoOpLossScale, StaticLossScale or DynamicLossScale, got {loss_scale!r}.")
  if skip_mode not in _SKIP_MODES:
    raise ValueError(f"Unknown skip_mode {skip_mode!r}; valid: {', '.join(_SKIP_MODES)}.")
  inner = optax.with_extra_args_support(inner)

  def init_fn(params):
    # A copy: a step that donates the state must not delete the caller's.
    return LossScaledState(
      loss_scale=fresh_arrays(loss_scale),
      notfinite_count=jnp.zeros((), jnp.int32),
      total_notfinite=jnp.zeros((), jnp.int32),
      inner_state=inner.init(params),
    )

  def update_fn(updates, state, params=None, **extra_args):
    unscale = unscaler(state.loss_scale)
    finite = unscaled_all_finite(unscale, updates, axis_name)

    def run_inner(scaled_grads, inner_state, params):
      return inner.update(unscale(scaled_grads), inner_state, params, **extra_args)

    apply, skip = branches(run_inner, updates, state, params)
    if skip_mode == "cond":
      return jax.lax.cond(finite, apply, skip, updates, state, params)
    # Both results, selected element by element: the skip branch's values
    # are the old state and zeros, bit for bit as with the cond.
    return jax.tree.map(
      lambda new, old: jnp.where(finite, new, old),
      apply(updates, state, params),
      skip(updates, state, params),
    )

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _check_inner(inner: Any) -> None:
  """Raises a TypeError unless ``inner`` is an optax transformation."""
  if isinstance(inner, optax.GradientTransformation) or (
    not isinstance(inner, type) and callable(getattr(inner, "init", None)) and callable(getattr(inner, "update", None))
  ):
    return
  if callable(inner):
    name = getattr(inner, "__qualname__", None) or repr(inner)
    hint = f"; {name} looks like a factory: call it with its hyperparameters, e.g. {name}(learning_rate=1e-3)"
  else:
    hint = ""
  raise TypeError(
    "loss_scaled(inner, ...) expects an optax.GradientTransformation (an "
    "object with init and update, e.g. optax.adamw(1e-3)), got "
    f"{type(inner).__name__} {inner!r}{hint}."
  )
