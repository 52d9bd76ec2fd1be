"""Loss scaling as an optax transformation that skips non-finite steps.

:func:`loss_scaled` wraps any optax transformation: it receives gradients of
the *scaled* loss, unscales them, runs the inner transformation and adjusts
the loss scale; when any gradient is inf or NaN it returns zero updates,
keeps the inner state bit-for-bit and backs the scale off. The scale lives
in the optimizer state (:class:`LossScaledState`), where the train step reads
it with :func:`get_loss_scale`, so there is one copy of it, checkpointed with
the rest of the state.

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

import functools
from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import optax

from jmp_train._src.loss_scale import LossScale
from jmp_train._src.loss_scale import NoOpLossScale
from jmp_train._src.loss_scale import StaticLossScale
from jmp_train._src.loss_scale import all_finite
from jmp_train._src.policy import is_floating_array

__all__ = [
    "LossScaledState",
    "loss_scaled",
    "get_loss_scale",
    "loss_scale_metrics",
    "scaled_value_and_grad",
]


class LossScaledState(NamedTuple):
  """State of :func:`loss_scaled`.

  Attributes:
    loss_scale: the current loss scale (a :class:`NoOpLossScale`,
      :class:`StaticLossScale` or :class:`DynamicLossScale`), to multiply the
      loss by in the next step.
    inner_state: state of the wrapped transformation; unchanged, bit for bit,
      by a skipped step.
    total_skipped: int32 count of skipped (non-finite) steps so far.
    consecutive_skipped: int32 count of skipped steps since the last finite
      one (0 after a finite step).
    last_finite: bool, whether the last step's gradients were all finite
      (``True`` before the first step).
  """

  loss_scale: LossScale
  inner_state: optax.OptState
  total_skipped: jax.Array
  consecutive_skipped: jax.Array
  last_finite: jax.Array


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
    inner.update(g, ...)``, ``S`` adjusted by ``loss_scale.adjust(True)``;
  * otherwise: zero updates (in the dtypes ``inner`` would return), the
    inner state returned bit-for-bit unchanged, ``S`` backed off by
    ``loss_scale.adjust(False)``, ``total_skipped`` and
    ``consecutive_skipped`` counted up.

  Unscaling comes first, so anything in ``inner`` (clipping, weight decay,
  the optimizer's moments) sees true gradients: ``loss_scaled(optax.chain(
  optax.clip_by_global_norm(1.0), optax.adamw(1e-3)), ...)`` clips the
  unscaled gradients.

  By default (``skip_mode="cond"``) the branch is a ``lax.cond``, not a
  ``jnp.where`` over both results: the inner update is not computed on a
  skipped step (``where`` would compute it
  from inf/NaN inputs and throw it away), and the unchanged inner state is
  passed through rather than selected element by element; on a finite step
  the whole overhead over ``inner`` is one extra read of the gradients (the
  finiteness test, with the unscaling fused into it) plus writing the
  updates out of the ``cond``. The predicate is
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
      ``lax.cond`` around ``inner`` (fastest measured on CPU; on an H100
      XLA compiled both modes to the same kernels, see
      ``benchmarks/README.md``). ``"select"``: ``inner`` always runs and
      ``jnp.where`` keeps the old inner state and zero updates on a
      non-finite step, as jmp and Flax examples do. Both skip the same
      steps and keep the inner state bit for bit on them (finite steps may
      differ in the last bit where XLA fuses ``inner`` differently);
      ``"select"`` avoids a data-dependent branch, which on some
      accelerators means reading the predicate back to the host each step.

  Returns:
    A ``GradientTransformationExtraArgs`` with state :class:`LossScaledState`.

  Raises:
    ValueError: if ``loss_scale`` is not a loss-scale value, or for an
      unknown ``skip_mode``.

  Examples:
    >>> import optax
    >>> tx = loss_scaled(optax.sgd(0.1), StaticLossScale(4.0))
    >>> params = {"w": jnp.ones(2)}
    >>> state = tx.init(params)
    >>> updates, state = tx.update({"w": jnp.full(2, 4.0)}, state, params)
    >>> updates["w"].tolist()  # -0.1 * (4 / 4)
    [-0.10000000149011612, -0.10000000149011612]
    >>> updates, state = tx.update({"w": jnp.array([1.0, jnp.inf])}, state)
    >>> updates["w"].tolist(), int(state.total_skipped)
    ([0.0, 0.0], 1)

  References:
    Micikevicius et al., "Mixed Precision Training", ICLR 2018.
    https://arxiv.org/abs/1710.03740
  """
  if not isinstance(loss_scale, LossScale):
    raise ValueError(
        f"loss_scale must be a NoOpLossScale, StaticLossScale or "
        f"DynamicLossScale, got {loss_scale!r}."
    )
  if skip_mode not in _SKIP_MODES:
    raise ValueError(
        f"Unknown skip_mode {skip_mode!r}; valid: {', '.join(_SKIP_MODES)}."
    )
  inner = optax.with_extra_args_support(inner)

  def init_fn(params):
    return LossScaledState(
        loss_scale=loss_scale,
        inner_state=inner.init(params),
        total_skipped=jnp.zeros((), jnp.int32),
        consecutive_skipped=jnp.zeros((), jnp.int32),
        last_finite=jnp.array(True, jnp.bool_),
    )

  def update_fn(updates, state, params=None, **extra_args):
    loss_scale = state.loss_scale
    finite = _unscaled_all_finite(loss_scale, updates, axis_name)

    def run_inner(scaled_grads, inner_state, params):
      grads = loss_scale.unscale(scaled_grads)
      return inner.update(grads, inner_state, params, **extra_args)

    # What `inner` returns, without running it: the skip branch returns zeros
    # of the same shapes and dtypes (which may differ from the gradients').
    out_updates, out_state = jax.eval_shape(
        run_inner, updates, state.inner_state, params
    )
    # Under shard_map both branches must also agree on which mesh axes each
    # output varies over; outside shard_map these are no-ops.
    state_axes = jax.tree.map(
        lambda a, b: _varying_axes(a) | _varying_axes(b),
        state.inner_state, out_state,
    )

    def apply_inner(scaled_grads, inner_state, params):
      new_updates, new_state = run_inner(scaled_grads, inner_state, params)
      return new_updates, jax.tree.map(_pvary, new_state, state_axes)

    def skip(scaled_grads, inner_state, params):
      del scaled_grads, params
      zeros = jax.tree.map(
          lambda s: _pvary(jnp.zeros(s.shape, s.dtype), _varying_axes(s)),
          out_updates,
      )
      return zeros, jax.tree.map(_pvary, inner_state, state_axes)

    if skip_mode == "cond":
      new_updates, new_inner_state = jax.lax.cond(
          finite, apply_inner, skip, updates, state.inner_state, params
      )
    else:
      # Both results, selected element by element: the skip branch's
      # values are the old state and zeros, bit for bit as with the cond.
      select = lambda new, old: jax.tree.map(
          lambda a, b: jnp.where(finite, a, b), new, old)
      new_updates, new_inner_state = select(
          apply_inner(updates, state.inner_state, params),
          skip(updates, state.inner_state, params),
      )
    skipped = jnp.logical_not(finite)
    new_state = LossScaledState(
        loss_scale=loss_scale.adjust(finite),
        inner_state=new_inner_state,
        total_skipped=jnp.where(
            skipped, optax.safe_increment(state.total_skipped),
            state.total_skipped,
        ),
        consecutive_skipped=jnp.where(
            skipped, optax.safe_increment(state.consecutive_skipped),
            jnp.zeros_like(state.consecutive_skipped),
        ),
        last_finite=finite,
    )
    return new_updates, new_state

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _unscaled_all_finite(
    loss_scale: LossScale, scaled_grads: Any,
    axis_name: str | Sequence[str] | None,
) -> jax.Array:
  """``all_finite(loss_scale.unscale(scaled_grads), axis_name)``, from ``|G|``.

  The test is of the *unscaled* gradients: with a scale below 1 a finite
  gradient can overflow when unscaled. Unscaling ``|G|`` instead of ``G``
  gives the same answer exactly: ``1/S`` is applied the same way (in float32
  or wider, cast back to the leaf's dtype), rounding is symmetric, so
  ``|unscale(g)| == unscale(|g|)`` element by element, and ``abs`` keeps
  inf and NaN. It keeps the test from sharing the ``G * (1/S)`` of the
  inner update: when it did, the product had two users and XLA:GPU wrote
  it out as a separate pass over the gradients (the multiply was taken as
  the epilogue of the weight-gradient matmul, then left as its own kernel
  when cuBLAS was picked for the matmul). Now the gradient is read once by
  this reduction (``|G| / S`` fused into it) and once by the inner update
  (``G / S`` fused into it), as by a step without loss scaling.
  """
  if isinstance(loss_scale, NoOpLossScale):
    return all_finite(scaled_grads, axis_name)
  magnitudes = jax.tree.map(
      lambda x: jnp.abs(x) if is_floating_array(x) else x, scaled_grads)
  return all_finite(loss_scale.unscale(magnitudes), axis_name)


def _varying_axes(x: Any) -> frozenset[str]:
  """Mesh axes ``x`` varies over inside ``shard_map`` (empty elsewhere)."""
  aval = x if isinstance(x, jax.ShapeDtypeStruct) else jax.typeof(x)
  manual = getattr(aval, "manual_axis_type", None)  # jax >= 0.10
  if manual is not None:
    return frozenset(manual.varying)
  return frozenset(getattr(aval, "vma", None) or ())  # older jax


def _pvary(x: Any, axes: frozenset[str]) -> Any:
  """Marks ``x`` as varying over ``axes`` (a no-op for axes it varies over)."""
  missing = tuple(sorted(axes - _varying_axes(x)))
  if not missing:
    return x
  if hasattr(jax.lax, "pcast"):
    return jax.lax.pcast(x, missing, to="varying")
  return jax.lax.pvary(x, missing)


def _unwrap_variable(x: Any) -> Any:
  """Returns the array inside a Flax NNX ``Variable``, else ``x``."""
  get_value = getattr(x, "get_value", None)
  if get_value is not None and not isinstance(x, jax.Array):
    return get_value()
  return x


def _find_states(opt_state: Any) -> list[LossScaledState]:
  # A Flax TrainState or nnx.Optimizer holds the optax state in `.opt_state`.
  if not isinstance(opt_state, LossScaledState):
    inner = getattr(opt_state, "opt_state", None)
    if inner is not None:
      opt_state = inner
  is_state = lambda x: isinstance(x, LossScaledState)
  found = [x for x in jax.tree.leaves(opt_state, is_leaf=is_state)
           if is_state(x)]
  # Also look inside each one, so loss_scaled nested in loss_scaled is
  # reported rather than silently shadowed.
  return found + [y for x in found for y in _find_states(x.inner_state)]


def _find_state(opt_state: Any, caller: str) -> LossScaledState:
  found = _find_states(opt_state)
  if len(found) != 1:
    what = "no" if not found else f"{len(found)}"
    raise ValueError(
        f"{caller} found {what} LossScaledState in the optimizer state of "
        f"type {type(opt_state).__name__}; it needs exactly one, made by "
        "jmp_train.loss_scaled(...) (nested anywhere: optax.chain, "
        "inject_hyperparams, MultiSteps, a Flax TrainState or nnx.Optimizer)."
    )
  # nnx.Optimizer wraps each array leaf of its state in a Variable.
  is_variable = lambda x: _unwrap_variable(x) is not x
  if not any(map(is_variable, jax.tree.leaves(found[0], is_leaf=is_variable))):
    return found[0]
  return jax.tree.map(_unwrap_variable, found[0], is_leaf=is_variable)


def get_loss_scale(opt_state: Any) -> LossScale:
  """Finds the current loss scale in an optimizer state.

  Searches the whole state (tuples from ``optax.chain``,
  ``InjectHyperparamsState``, ``MultiStepsState``, ...) for the one
  :class:`LossScaledState`. A Flax ``TrainState`` or ``nnx.Optimizer`` (or
  their ``.opt_state``) can be passed directly. No host sync: the scale is
  returned as the arrays it is made of.

  Args:
    opt_state: an optimizer state containing exactly one state of
      :func:`loss_scaled`.

  Returns:
    The loss-scale value; call its ``scale(loss)`` or pass it to a function
    made by :func:`scaled_value_and_grad`. Its ``loss_scale`` field is the
    scale as a float32 scalar.

  Raises:
    ValueError: if the state holds no :class:`LossScaledState`, or more than
      one.

  Examples:
    >>> import optax
    >>> tx = optax.chain(optax.clip(1.0), loss_scaled(optax.sgd(0.1),
    ...     StaticLossScale(8.0)))
    >>> float(get_loss_scale(tx.init(jnp.zeros(2))).loss_scale)
    8.0
  """
  return _find_state(opt_state, "get_loss_scale").loss_scale


def loss_scale_metrics(opt_state: Any) -> dict[str, jax.Array]:
  """Loss-scaling metrics to log, as arrays (no host sync in the step).

  Args:
    opt_state: an optimizer state containing exactly one state of
      :func:`loss_scaled` (or a Flax ``TrainState``/``nnx.Optimizer``).

  Returns:
    ``{"loss_scale": float32, "total_skipped": int32, "consecutive_skipped":
    int32, "last_finite": bool}``, all scalars.

  Raises:
    ValueError: if the state holds no :class:`LossScaledState`, or more than
      one.

  Examples:
    >>> import optax
    >>> from jmp_train._src.loss_scale import DynamicLossScale
    >>> tx = loss_scaled(optax.sgd(0.1), DynamicLossScale(2.0 ** 4))
    >>> state = tx.init(jnp.zeros(2))
    >>> _, state = tx.update(jnp.array([1.0, jnp.nan]), state)
    >>> {k: v.item() for k, v in loss_scale_metrics(state).items()}
    {'loss_scale': 8.0, 'total_skipped': 1, 'consecutive_skipped': 1, 'last_finite': False}
  """
  state = _find_state(opt_state, "loss_scale_metrics")
  return {
      "loss_scale": jnp.asarray(state.loss_scale.loss_scale, jnp.float32),
      "total_skipped": state.total_skipped,
      "consecutive_skipped": state.consecutive_skipped,
      "last_finite": state.last_finite,
  }


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
    unscaled loss, or ``(loss, aux)`` when ``has_aux``.

  Examples:
    >>> g = scaled_value_and_grad(lambda w: jnp.sum(w ** 2))
    >>> loss, grads = g(StaticLossScale(8.0), jnp.ones(2))
    >>> float(loss), grads.tolist()
    (2.0, [16.0, 16.0])
  """

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

  return g
