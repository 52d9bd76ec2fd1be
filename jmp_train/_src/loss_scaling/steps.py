"""The finite and the skipped step of :func:`jmp_train.loss_scaled`.

Unscaling the gradients with ``1/S`` computed once, the finiteness test of
the unscaled gradients, and the two branches (run the inner update, or keep
its state and return zeros) with equal output types, dtypes and
``shard_map`` varying axes, as ``lax.cond`` needs.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import optax

from jmp_train._src.loss_scaling.scales import LossScale
from jmp_train._src.loss_scaling.scales import NoOpLossScale
from jmp_train._src.leaf_checks import all_finite
from jmp_train._src.loss_scaling.scales import apply_scale
from jmp_train._src.dtypes import is_floating_array
from jmp_train._src.varying_axes import pvary
from jmp_train._src.varying_axes import varying_axes

__all__ = ["branches", "unscaled_all_finite", "unscaler"]


def _next_state(state: Any, finite: bool, inner_state: optax.OptState) -> Any:
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
  return state._replace(  # a LossScaledState
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


def branches(
  run_inner: Callable[..., Any],
  grads: Any,
  state: Any,
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
    lambda a, b: varying_axes(a) | varying_axes(b),
    jax.eval_shape(apply, grads, state, params),
    jax.eval_shape(skip, grads, state, params),
  )

  def marked(branch):
    return lambda *args: jax.tree.map(pvary, branch(*args), axes)

  return marked(apply), marked(skip)


def unscaler(loss_scale: LossScale) -> Callable[[Any], Any]:
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


def unscaled_all_finite(
  unscale: Callable[[Any], Any],
  scaled_grads: Any,
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
  magnitudes = jax.tree.map(lambda x: jnp.abs(x) if is_floating_array(x) else x, scaled_grads)
  return all_finite(unscale(magnitudes), axis_name)
