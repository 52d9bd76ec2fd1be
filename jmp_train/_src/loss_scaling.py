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
import inspect
from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import optax

from jmp_train._src.loss_scale import LossScale
from jmp_train._src.loss_scale import NoOpLossScale
from jmp_train._src.loss_scale import StaticLossScale
from jmp_train._src.loss_scale import all_finite
from jmp_train._src.loss_scale import apply_scale
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
    TypeError: if ``inner`` is not an optax transformation (e.g. a string,
      or a factory such as ``optax.sgd`` that was not called).
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
    >>> updates["w"].tolist(), int(state.total_notfinite)
    ([0.0, 0.0], 1)

  References:
    Micikevicius et al., "Mixed Precision Training", ICLR 2018.
    https://arxiv.org/abs/1710.03740
  """
  _check_inner(inner)
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
        notfinite_count=jnp.zeros((), jnp.int32),
        total_notfinite=jnp.zeros((), jnp.int32),
        inner_state=inner.init(params),
    )

  def update_fn(updates, state, params=None, **extra_args):
    unscale = _unscaler(state.loss_scale)
    finite = _unscaled_all_finite(unscale, updates, axis_name)

    def run_inner(scaled_grads, inner_state, params):
      return inner.update(unscale(scaled_grads), inner_state, params,
                          **extra_args)

    apply, skip = _branches(run_inner, updates, state, params)
    if skip_mode == "cond":
      return jax.lax.cond(finite, apply, skip, updates, state, params)
    # Both results, selected element by element: the skip branch's values
    # are the old state and zeros, bit for bit as with the cond.
    return jax.tree.map(
        lambda new, old: jnp.where(finite, new, old),
        apply(updates, state, params), skip(updates, state, params),
    )

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _check_inner(inner: Any) -> None:
  """Raises a TypeError unless ``inner`` is an optax transformation."""
  if isinstance(inner, optax.GradientTransformation) or (
      not isinstance(inner, type)
      and callable(getattr(inner, "init", None))
      and callable(getattr(inner, "update", None))
  ):
    return
  if callable(inner):
    name = getattr(inner, "__qualname__", None) or repr(inner)
    hint = (f"; {name} looks like a factory: call it with its "
            f"hyperparameters, e.g. {name}(learning_rate=1e-3)")
  else:
    hint = ""
  raise TypeError(
      "loss_scaled(inner, ...) expects an optax.GradientTransformation (an "
      "object with init and update, e.g. optax.adamw(1e-3)), got "
      f"{type(inner).__name__} {inner!r}{hint}."
  )


def _next_state(
    state: LossScaledState, finite: bool, inner_state: optax.OptState
) -> LossScaledState:
  """The state after a finite or a skipped step (``finite`` is static).

  Each branch of the step computes its own bookkeeping with a constant flag,
  so it folds to a few scalar operations inside the branch (the scale's
  growth or back-off, the counters) instead of selects on the traced flag.
  """
  if finite:
    count = jnp.zeros_like(state.notfinite_count)
    total = state.total_notfinite
  else:
    count = optax.safe_increment(state.notfinite_count)
    total = optax.safe_increment(state.total_notfinite)
  return LossScaledState(
      loss_scale=state.loss_scale.adjust(jnp.asarray(finite)),
      notfinite_count=count,
      total_notfinite=total,
      inner_state=inner_state,
  )


def _cast_like(new: Any, old: Any) -> Any:
  """``new`` with each leaf in the dtype of the matching leaf of ``old``.

  An inner update may change the dtype of its state (``optax.adam``'s
  moments become float32 when float32 gradients meet float16 parameters);
  the state keeps its dtypes across finite and skipped steps, as
  ``lax.cond`` and a training loop's carry need. Leaves already in the right
  dtype (including PRNG keys, which cannot be cast) are returned as they
  are.
  """

  def cast(n, o):
    dtype = getattr(o, "dtype", None)
    if dtype is None or getattr(n, "dtype", None) == dtype:
      return n
    return jnp.asarray(n).astype(dtype)

  return jax.tree.map(cast, new, old)


def _branches(
    run_inner: Callable[..., Any], grads: Any, state: LossScaledState,
    params: Any,
) -> tuple[Callable[..., Any], Callable[..., Any]]:
  """The finite and the skip step, as functions of ``(grads, state, params)``.

  Both return ``(updates, new_state)`` of the same shapes and dtypes: the
  skip step returns zeros shaped like what ``inner`` returns (which may
  differ from the gradients'), found without running it. Under
  ``shard_map`` both must also agree on which mesh axes each output varies
  over; outside ``shard_map`` marking them is a no-op.
  """

  def apply(scaled_grads, state, params):
    updates, inner_state = run_inner(scaled_grads, state.inner_state, params)
    inner_state = _cast_like(inner_state, state.inner_state)
    return updates, _next_state(state, True, inner_state)

  out_updates, _ = jax.eval_shape(apply, grads, state, params)

  def skip(scaled_grads, state, params):
    del scaled_grads, params
    zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), out_updates)
    return zeros, _next_state(state, False, state.inner_state)

  axes = jax.tree.map(
      lambda a, b: _varying_axes(a) | _varying_axes(b),
      jax.eval_shape(apply, grads, state, params),
      jax.eval_shape(skip, grads, state, params),
  )

  def marked(branch):
    return lambda *args: jax.tree.map(_pvary, branch(*args), axes)

  return marked(apply), marked(skip)


def _unscaler(loss_scale: LossScale) -> Callable[[Any], Any]:
  """``loss_scale.unscale``, with ``1/S`` computed once, here.

  The test and the inner update then share one scalar ``1/S`` (one scalar
  operation in the compiled step, not one per use), and each fuses its
  multiply by it into its own pass over the gradients.
  """
  if isinstance(loss_scale, NoOpLossScale):
    return lambda tree: tree
  if type(loss_scale).unscale is not LossScale.unscale:  # a custom rule
    return loss_scale.unscale
  inverse = jnp.float32(1.0) / loss_scale.loss_scale
  return lambda tree: apply_scale(tree, inverse)


def _unscaled_all_finite(
    unscale: Callable[[Any], Any], scaled_grads: Any,
    axis_name: str | Sequence[str] | None,
) -> jax.Array:
  """``all_finite(unscale(scaled_grads), axis_name)``, from ``|G|``.

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
  this reduction (``|G| * (1/S)`` fused into it) and once by the inner
  update (``G * (1/S)`` fused into it), as by a step without loss scaling.
  """
  magnitudes = jax.tree.map(
      lambda x: jnp.abs(x) if is_floating_array(x) else x, scaled_grads)
  return all_finite(unscale(magnitudes), axis_name)


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


def _find_state(opt_state: Any, caller: str) -> LossScaledState:
  """The one :class:`LossScaledState` anywhere in ``opt_state``.

  ``optax.tree.get_all_with_path`` finds it in any nesting (``optax.chain``,
  ``inject_hyperparams``, ``MultiSteps``, a Flax ``TrainState`` or
  ``nnx.Optimizer``), including one nested in another's ``inner_state``,
  which is reported rather than silently shadowed.
  """
  found = [state for _, state in optax.tree.get_all_with_path(
      opt_state, LossScaledState.__name__,
      filtering=lambda _, value: isinstance(value, LossScaledState))]
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
    ``{"loss_scale": float32, "notfinite_count": int32, "total_notfinite":
    int32, "last_finite": bool}``, all scalars, named as the fields of
    :class:`LossScaledState`.

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
    {'loss_scale': 8.0, 'notfinite_count': 1, 'total_notfinite': 1, 'last_finite': False}
  """
  state = _find_state(opt_state, "loss_scale_metrics")
  return {
      "loss_scale": jnp.asarray(state.loss_scale.loss_scale, jnp.float32),
      "notfinite_count": state.notfinite_count,
      "total_notfinite": state.total_notfinite,
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
    unscaled loss, or ``(loss, aux)`` when ``has_aux``. Its
    ``inspect.signature`` is ``fun``'s with the positional-only loss-scale
    parameter first, so ``jax.jit(g, static_argnums=...)`` and
    ``static_argnames=...`` name the same arguments as for
    ``jax.value_and_grad(fun)``, with the numbers shifted by one.

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
