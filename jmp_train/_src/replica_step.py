"""The per-replica train and eval steps that :func:`~jmp_train.make_train_step` compiles.

Three pieces (:func:`_forward`: policy casts, model and loss;
:func:`_gradients`: the (loss-scaled) gradient and its replica average;
:func:`_update`: the optimizer and the skip of non-finite steps) make
:func:`train_step`; :func:`eval_step` is the forward pass alone. Both take
their static configuration, a :class:`StepConfig`, first.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import chex
import jax
import jax.numpy as jnp
import optax
from jax import lax

from jmp_train._src import buckets
from jmp_train._src import fp8 as fp8_lib
from jmp_train._src import fp8_flax
from jmp_train._src.policy import Policy
from jmp_train._src.train_state import TrainState

__all__ = ["StepConfig", "eval_step", "train_step"]

@dataclasses.dataclass(frozen=True)
class StepConfig:
  """What the per-replica step needs to know (static)."""

  model: Any
  loss_fn: Callable[..., Any]
  tx: optax.GradientTransformationExtraArgs
  policy: Policy
  ls_api: Any  # LossScalingFns, or None without loss scaling
  axis_name: str | None
  exchange: bool  # average the gradients here (no compression)
  has_aux: bool
  cast_params: bool
  remat_policy: Callable[..., bool] | None
  bucket_bytes: int
  reduce_dtype: Any


def _split_batch(batch: Any) -> tuple[Any, Any]:
  if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
    what = f"a {type(batch).__name__}"
    if hasattr(batch, "shape") and hasattr(batch, "dtype"):
      what = f"a single array of shape {tuple(batch.shape)} and dtype {batch.dtype}"
    elif isinstance(batch, (tuple, list)):
      what += f" of length {len(batch)}"
    elif isinstance(batch, dict):
      what += f" with keys {sorted(batch)}"
    raise TypeError(
        f"The batch must be a tuple (inputs, targets), got {what}. Pass "
        f"step(state, (inputs, targets)), e.g. (batch['image'], batch['label'])."
    )
  return batch[0], batch[1]


def _loss(cfg: StepConfig, outputs, targets):
  result = cfg.loss_fn(cfg.policy.cast_to_output(outputs), targets)
  loss, aux = result if cfg.has_aux else (result, {})
  loss = jnp.asarray(loss, jnp.float32)
  chex.assert_shape(loss, ())
  return loss, aux


def _forward(cfg: StepConfig, params, model_state, inputs, targets, rng, replica):
  """The loss of one replica's batch, its aux metrics and the new model state."""
  if cfg.cast_params:
    params = cfg.policy.cast_to_compute(params)
  outputs, new_model_state = cfg.model.train_apply(
      params, model_state, cfg.policy.cast_to_compute(inputs), rng, replica
  )
  # Keep the model state's dtypes stable across steps.
  new_model_state = jax.tree.map(
      lambda new, old: jnp.asarray(new, old.dtype), new_model_state, model_state
  )
  loss, aux = _loss(cfg, outputs, targets)
  return loss, (aux, new_model_state)


def _replica(cfg: StepConfig):
  return None if cfg.axis_name is None else lax.axis_index(cfg.axis_name)


def _gradients(cfg: StepConfig, state: TrainState, inputs, targets):
  """The loss, aux, new model state, gradients (replica mean unless compressed) and scale."""
  replica = _replica(cfg)
  rng = None
  if state.rng is not None:
    rng = jax.random.fold_in(state.rng, state.step)
    if replica is not None:
      rng = jax.random.fold_in(rng, replica)
  # FP8 products' scaling state is differentiated too: its "gradient" is its
  # new value (see jmp_train.fp8_dot_general).
  fp8, rest = fp8_flax.split_fp8_state(state.model_state)
  has_fp8 = bool(jax.tree.leaves(fp8))

  def objective(diff):
    params, model_state = diff, state.model_state
    if has_fp8:
      params, model_state = diff[0], fp8_flax.merge_fp8_state(diff[1], rest)
    return _forward(cfg, params, model_state, inputs, targets, rng, replica)

  if cfg.remat_policy is not None:
    objective = jax.checkpoint(objective, policy=cfg.remat_policy)
  diff = (state.params, fp8) if has_fp8 else state.params
  if cfg.ls_api is None:
    scale = jnp.ones((), jnp.float32)
    (loss, (aux, model_state)), grads = jax.value_and_grad(objective, has_aux=True)(diff)
  else:
    current = cfg.ls_api.get_loss_scale(state.opt_state)
    scale = jnp.asarray(current.loss_scale, jnp.float32)
    (loss, (aux, model_state)), grads = cfg.ls_api.scaled_value_and_grad(
        objective, has_aux=True
    )(current, diff)
  if has_fp8:
    grads, fp8_grads = grads
  if cfg.exchange:
    grads = buckets.bucketed_mean(grads, cfg.axis_name, cfg.bucket_bytes, cfg.reduce_dtype)
  if cfg.axis_name is not None:
    # Batch statistics from each replica's share of the batch, averaged so
    # that every replica keeps the same model state (as Flax's examples do).
    model_state = jax.tree.map(
        lambda x: lax.pmean(x, cfg.axis_name) if jnp.issubdtype(x.dtype, jnp.inexact) else x,
        model_state,
    )
  if has_fp8:
    new_fp8 = fp8_lib.update_fp8_meta(fp8, fp8_grads, cfg.axis_name)
    model_state = fp8_flax.merge_fp8_state(new_fp8, fp8_flax.split_fp8_state(model_state)[1])
  return loss, aux, model_state, grads, scale


def _update(cfg: StepConfig, state: TrainState, grads, model_state):
  """Applies the optimizer; keeps the old model state on a skipped step."""
  updates, opt_state = cfg.tx.update(grads, state.opt_state, state.params)
  params = optax.apply_updates(state.params, updates)
  if cfg.ls_api is None:
    return params, opt_state, model_state, None, jnp.zeros((), jnp.int32)
  ls_metrics = cfg.ls_api.loss_scale_metrics(opt_state)
  finite = jnp.asarray(ls_metrics["last_finite"], jnp.bool_)
  model_state = jax.tree.map(
      lambda new, old: jnp.where(finite, new, old), model_state, state.model_state
  )
  skipped = jnp.asarray(ls_metrics["total_notfinite"], jnp.int32)
  return params, opt_state, model_state, ls_metrics["loss_scale"], skipped


def _mean(cfg: StepConfig, x):
  x = jnp.asarray(x)
  if cfg.axis_name is None:
    return x
  if jnp.issubdtype(x.dtype, jnp.integer):
    return lax.pmax(x, cfg.axis_name)
  return lax.pmean(x, cfg.axis_name)


def train_step(cfg: StepConfig, state: TrainState, batch):
  """One step on one replica: ``(state, metrics)``."""
  inputs, targets = _split_batch(batch)
  loss, aux, model_state, grads, scale = _gradients(cfg, state, inputs, targets)
  grad_norm = optax.tree.norm(jax.tree.map(lambda g: g.astype(jnp.float32), grads)) / scale
  params, opt_state, model_state, new_scale, skipped = _update(cfg, state, grads, model_state)
  new_state = state.replace(
      step=optax.safe_increment(state.step),
      params=params,
      opt_state=opt_state,
      model_state=model_state,
  )
  metrics = {
      "loss": loss,
      "loss_scale": scale if new_scale is None else new_scale,
      "skipped_steps": skipped,
      "grad_norm": grad_norm,
      **aux,
  }
  return new_state, jax.tree.map(functools.partial(_mean, cfg), metrics)


def eval_step(cfg: StepConfig, state: TrainState, batch):
  inputs, targets = _split_batch(batch)
  params = cfg.policy.cast_to_compute(state.params) if cfg.cast_params else state.params
  outputs = cfg.model.eval_apply(params, state.model_state, cfg.policy.cast_to_compute(inputs))
  loss, aux = _loss(cfg, outputs, targets)
  return jax.tree.map(functools.partial(_mean, cfg), {"loss": loss, **aux})
