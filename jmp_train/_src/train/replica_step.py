"""The per-replica train and eval steps that :func:`~jmp_train.make_train_step` compiles.

Three pieces (:func:`_forward`: policy casts, model and loss;
:func:`_gradients`: the (loss-scaled) gradient and its replica average;
:func:`_update`: the optimizer and the skip of non-finite steps) make
:func:`train_step`; :func:`eval_step` is the forward pass alone. Both take
their static configuration, a :class:`StepConfig`, first.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import functools
import inspect
import re
import traceback
import warnings
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from jmp_train._src import buckets
from jmp_train._src.fp8 import products as fp8_lib
from jmp_train._src.fp8 import flax_layers as fp8_flax
from jmp_train._src.leaf_checks import first_not_differentiable
from jmp_train._src.messages import describe, error_summary
from jmp_train._src.policy.policy import Policy
from jmp_train._src.train import model_policy
from jmp_train._src.train.state import TrainState

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
  regularizer: Callable[[Any], Any] | None = None


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


def _leading_sizes(tree: Any) -> set[int]:
  return {x.shape[0] for x in jax.tree.leaves(tree) if len(getattr(x, "shape", ())) >= 1}


def _check_batch_sizes(cfg: StepConfig, inputs: Any, targets: Any) -> None:
  """Inputs and targets hold as many examples (their leading axes), checked at trace time.

  Only when all of the inputs' leaves agree on one leading size, and all
  of the targets' leaves on one: a batch may carry other arrays (a table
  every example shares) whose leading axis is no batch axis.

  Raises:
    ValueError: naming both sizes and shapes.
  """
  sizes_in, sizes_out = _leading_sizes(inputs), _leading_sizes(targets)
  if len(sizes_in) != 1 or len(sizes_out) != 1 or sizes_in == sizes_out:
    return
  where = " on each replica (the share of the batch one device sees)" if cfg.axis_name is not None else ""
  raise ValueError(
    f"The batch's inputs hold {sizes_in.pop()} examples but its targets {sizes_out.pop()}{where} "
    f"(leading axes; inputs {describe(inputs)}, targets {describe(targets)}): a loss of the model's "
    "outputs against these targets compares the wrong examples or fails. Pass one target per example, "
    "inputs and targets cut from the same slice of the data."
  )


# First parameter names of a loss that expects the model, its state or its
# parameters (a Flax-tutorial ``loss_fn(model, batch)``), not its outputs.
_MODEL_PARAMETERS = frozenset({"model", "module", "net", "network", "state", "train_state", "params", "variables"})

_LOSS_SIGNATURE = (
  "make_train_step calls loss_fn(outputs, targets): outputs is what the model "
  "returns for the inputs of a batch (inputs, targets), cast to the policy's "
  "output dtype, and targets is the batch's second element; loss_fn returns a "
  "scalar loss, or (loss, aux) with aux a dict of scalar metrics and "
  "has_aux=True."
)


def _loss_signature_mismatch(loss_fn: Callable[..., Any], error: Exception, outputs: Any, targets: Any) -> str | None:
  """Why ``error`` from ``loss_fn(outputs, targets)`` is a signature mistake, or None.

  Only three signs count, so that a genuine error inside a loss of the right
  signature reaches the user unchanged: ``loss_fn`` cannot take two
  positional arguments; its first parameter is named like the model, its
  state or its parameters (``model``, ``state``, ``params``, ...); or the
  error is JAX's refusal to index an array with a string (``batch["label"]``
  on the targets array).
  """
  try:
    signature = inspect.signature(loss_fn)
  except (TypeError, ValueError):
    signature = None
  shown = "loss_fn" + (str(signature) if signature is not None else "")
  if signature is not None:
    try:
      signature.bind(outputs, targets)
    except TypeError:
      return f"The {shown} given cannot be called so ({error_summary(error)})."
    first = next(iter(signature.parameters), None)
    if first in _MODEL_PARAMETERS:
      return (
        f"The {shown} given takes {first!r} first (make_train_step runs the "
        "model itself, so a Flax-tutorial loss_fn(model, batch) or "
        f"loss_fn(params, batch) does not fit) and raised {error_summary(error)}. "
        "A term of the parameters (an L2 penalty) goes in make_train_step(..., "
        "regularizer=lambda params: ...)."
      )
  if isinstance(error, TypeError) and "string indexing" in str(error):
    return (
      f"The {shown} given indexed an array with a string ({error_summary(error)}), "
      "as a Flax-tutorial loss_fn(model, batch) does with batch['label']."
    )
  return None


# The errors a loss raises on arguments it cannot use; each is re-raised as
# its kind, naming what the loss was given.
_LOSS_ERRORS = (TypeError, ValueError, IndexError, KeyError, AttributeError)


def _loss_error(error: Exception, outputs: Any, targets: Any) -> Exception:
  """``error`` from ``loss_fn(outputs, targets)``, of the same kind, naming the shapes and dtypes it got."""
  kind = next(k for k in _LOSS_ERRORS if isinstance(error, k))
  return kind(
    f"loss_fn(outputs, targets) raised {error_summary(error)}; it was given outputs ({describe(outputs)}) "
    f"and targets ({describe(targets)}). Check that the targets fit the loss: integer class labels of shape "
    "(batch,) for optax.softmax_cross_entropy_with_integer_labels (labels[:, 0] for labels of shape "
    "(batch, 1), labels.astype(jnp.int32) for float ones; one-hot targets go with "
    "optax.softmax_cross_entropy), the outputs' shape for an elementwise loss."
  )


def _call_loss_fn(cfg: StepConfig, outputs, targets):
  try:
    return cfg.loss_fn(outputs, targets)
  # ValueError: a loss_fn(params, batch) unpacking `x, y = batch` from the targets.
  except _LOSS_ERRORS as e:
    why = _loss_signature_mismatch(cfg.loss_fn, e, outputs, targets)
    if why is None:
      raise _loss_error(e, outputs, targets) from e
  raise TypeError(
    f"{_LOSS_SIGNATURE} {why} Pass the model as apply_fn and a loss of its "
    "outputs, e.g. lambda logits, labels: optax.softmax_cross_entropy_with_"
    "integer_labels(logits, labels).mean(), with step(state, (batch['image'], "
    "batch['label']))."
  ) from None


def _warn_broadcast(outputs: Any, targets: Any) -> None:
  """A ``UserWarning`` (at trace time) when outputs and targets broadcast to a larger shape than either.

  Outputs ``(16, 1)`` against targets ``(16,)`` broadcast to ``(16, 16)``:
  an elementwise loss (``jnp.mean((outputs - targets) ** 2)``) then
  compares every output with every target, as PyTorch's ``MSELoss`` warns.
  Shapes that broadcast to one of them (per-example logits ``(16, 10)``
  with labels ``(16,)`` of 16 classes) are left alone.
  """
  if not all(hasattr(x, "shape") and hasattr(x, "dtype") for x in (outputs, targets)):
    return
  o, t = tuple(outputs.shape), tuple(targets.shape)
  try:
    both = tuple(np.broadcast_shapes(o, t))
  except ValueError:
    return
  if both in (o, t):
    return
  if o == (*t, 1):
    fix = "jnp.squeeze(outputs, -1), or targets[..., None]"
  elif t == (*o, 1):
    fix = "jnp.squeeze(targets, -1)"
  else:
    fix = "targets.reshape(outputs.shape)"
  warnings.warn(
    f"loss_fn gets outputs of shape {o} and targets of shape {t}, which broadcast to {both}: an "
    "elementwise loss such as jnp.mean((outputs - targets) ** 2) then compares every output with every "
    f"target, not each with its own. Give them the same shape, e.g. {fix}, in the loss or in the batch.",
    UserWarning,
    stacklevel=2,
  )


def _loss(cfg: StepConfig, outputs, targets):
  """The float32 scalar loss and the aux metrics of ``loss_fn``.

  Raises:
    TypeError: if ``loss_fn`` does not take ``(outputs, targets)`` (see
      :func:`_loss_signature_mismatch`), or returns a tuple without
      ``has_aux`` or no ``(loss, aux dict)`` with it.
    ValueError: if the loss is not a scalar.
  """
  outputs = cfg.policy.cast_to_output(outputs)
  _warn_broadcast(outputs, targets)
  result = _call_loss_fn(cfg, outputs, targets)
  if cfg.has_aux:
    if not (isinstance(result, (tuple, list)) and len(result) == 2):
      raise TypeError(f"With has_aux=True, loss_fn must return (loss, aux), got {describe(result)}.")
    loss, aux = result
    if not isinstance(aux, collections.abc.Mapping):
      raise TypeError(
        "With has_aux=True, loss_fn returns (loss, aux) with aux a dict of scalar "
        f"metrics (averaged and returned with the step's metrics), got aux as "
        f"{describe(aux)}."
      )
  else:
    if isinstance(result, (tuple, list)):
      raise TypeError(
        f"loss_fn returned a {type(result).__name__} of length {len(result)}, not a "
        "scalar loss: if it returns (loss, aux) with aux a dict of scalar metrics, "
        "pass make_train_step(..., has_aux=True)."
      )
    loss, aux = result, {}
  loss = jnp.asarray(loss, jnp.float32)
  if loss.shape != ():
    raise ValueError(f"loss_fn must return a scalar loss, got shape {loss.shape}: reduce it (e.g. with jnp.mean).")
  return loss, aux


def _regularization(cfg: StepConfig, params):
  """``regularizer(params)`` as a float32 scalar.

  Raises:
    ValueError: if it is not a scalar.
  """
  value = jnp.asarray(cfg.regularizer(params), jnp.float32)
  if value.shape != ():
    raise ValueError(
      f"regularizer must return a scalar, got shape {value.shape}: reduce it "
      "(e.g. with sum(jnp.sum(p ** 2) for p in jax.tree.leaves(params)))."
    )
  return value


def _unbound_axis(cfg: StepConfig, e: NameError) -> ValueError | None:
  """What make_train_step expects, if ``e`` is JAX's unbound axis name in the model."""
  match = re.search(r"unbound axis name:? (\S+)", str(e))
  if match is None:
    return None
  name = match.group(1).strip("'\".,")
  if cfg.axis_name is None:
    fix = (
      f"build the step with mode='shard_map' (or 'pmap') and axis_name={name!r}, "
      "or, to train on one device with mode='single', build the model without it "
      "(BatchNorm(..., axis_name=None))"
    )
  else:
    fix = (
      f"the step maps the axis {cfg.axis_name!r}: build it with "
      f"make_train_step(..., axis_name={name!r}), or the model with "
      f"axis_name={cfg.axis_name!r}"
    )
  return ValueError(
    f"The model averages over an axis named {name!r} (a BatchNorm with "
    f"axis_name={name!r}, as in Flax's ImageNet example, or a collective of its "
    f"own), which the step does not map: {fix}."
  )


def _in_collective(e: BaseException) -> bool:
  """Whether ``e`` was raised inside JAX's collectives (``lax.psum`` and kin)."""
  frames = traceback.extract_tb(e.__traceback__)
  return any(f.filename.replace("\\", "/").endswith("lax/parallel.py") for f in frames)


def _run_model(cfg: StepConfig, run: Callable[[], Any]) -> Any:
  """``run()``, with JAX's errors for a model's unmapped axis made clear.

  Raises:
    ValueError: if a collective of the model names an axis the step does
      not map (JAX's ``NameError`` outside a mapped step, an
      ``AssertionError`` inside one).
  """
  try:
    return run()
  except NameError as e:
    error = _unbound_axis(cfg, e)
    if error is None:
      raise
    raise error from None
  except AssertionError as e:
    if cfg.axis_name is None or not _in_collective(e):
      raise
    raise ValueError(
      f"A collective inside the model (a BatchNorm's axis_name, or a psum/pmean of "
      f"its own) names an axis the step does not map: the step maps "
      f"{cfg.axis_name!r}. Build the model with axis_name={cfg.axis_name!r}, or the "
      f"step with the model's axis name, make_train_step(..., axis_name=...)."
    ) from None


def _forward(cfg: StepConfig, params, model_state, inputs, targets, rng, replica):
  """The loss of one replica's batch, its aux metrics and the new model state."""
  stored = params
  if cfg.cast_params:
    params = cfg.policy.cast_to_compute(params)
  inputs = cfg.policy.cast_to_compute(inputs)

  def run():
    model = model_policy.audited(
      cfg.model,
      cfg.policy,
      lambda m: lambda p, s, x: m.train_apply(p, s, x, rng, replica),
      (params, model_state, inputs),
      warn=True,
    )
    return model.train_apply(params, model_state, inputs, rng, replica)

  outputs, new_model_state = _run_model(cfg, run)
  # Keep the model state's dtypes stable across steps.
  new_model_state = jax.tree.map(lambda new, old: jnp.asarray(new, old.dtype), new_model_state, model_state)
  loss, aux = _loss(cfg, outputs, targets)
  if cfg.regularizer is not None:
    loss = loss + _regularization(cfg, stored)
  return loss, (aux, new_model_state)


def _replica(cfg: StepConfig):
  return None if cfg.axis_name is None else lax.axis_index(cfg.axis_name)


def _check_params(params: Any) -> None:
  """Names a leaf of ``params`` that ``jax.grad`` refuses (integer, boolean, key).

  Raises:
    TypeError: naming its path and dtype, and the two fixes.
  """
  found = first_not_differentiable(params)
  if found is not None:
    path, dtype = found
    raise TypeError(
      f"make_train_step differentiates every leaf of params, but "
      f"params{path} has dtype {dtype}: gradients need floating-point leaves. "
      "Cast it to a float dtype before step.init (e.g. jnp.float32), or keep "
      "integer values out of params: in model_state (another Flax collection, "
      "step.init(params, model_state={...}); for an NNX module, an nnx.Variable "
      "that is not an nnx.Param), which the step carries without differentiating."
    )


def _gradients(cfg: StepConfig, state: TrainState, inputs, targets):
  """The loss, aux, new model state, gradients (replica mean unless compressed) and scale."""
  _check_params(state.params)
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
    (loss, (aux, model_state)), grads = cfg.ls_api.scaled_value_and_grad(objective, has_aux=True)(current, diff)
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
    zero = jnp.zeros((), jnp.int32)
    return params, opt_state, model_state, None, zero, zero
  ls_metrics = cfg.ls_api.loss_scale_metrics(opt_state)
  finite = jnp.asarray(ls_metrics["last_finite"], jnp.bool_)
  model_state = jax.tree.map(lambda new, old: jnp.where(finite, new, old), model_state, state.model_state)
  skipped = jnp.asarray(ls_metrics["total_notfinite"], jnp.int32)
  # Skipped in a row: a run stuck at the scale's floor (a model that makes
  # NaN by itself) shows here while ``skipped`` only grows.
  consecutive = jnp.asarray(ls_metrics["notfinite_count"], jnp.int32)
  return params, opt_state, model_state, ls_metrics["loss_scale"], skipped, consecutive


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
  _check_batch_sizes(cfg, inputs, targets)
  loss, aux, model_state, grads, scale = _gradients(cfg, state, inputs, targets)
  grad_norm = optax.tree.norm(jax.tree.map(lambda g: g.astype(jnp.float32), grads)) / scale
  params, opt_state, model_state, new_scale, skipped, consecutive = _update(cfg, state, grads, model_state)
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
    "consecutive_skipped_steps": consecutive,
    "grad_norm": grad_norm,
    **aux,
  }
  return new_state, jax.tree.map(functools.partial(_mean, cfg), metrics)


def eval_step(cfg: StepConfig, state: TrainState, batch):
  inputs, targets = _split_batch(batch)
  _check_batch_sizes(cfg, inputs, targets)
  params = cfg.policy.cast_to_compute(state.params) if cfg.cast_params else state.params
  inputs = cfg.policy.cast_to_compute(inputs)

  def run():
    model = model_policy.audited(
      cfg.model, cfg.policy, lambda m: m.eval_apply, (params, state.model_state, inputs), warn=False
    )
    return model.eval_apply(params, state.model_state, inputs)

  outputs = _run_model(cfg, run)
  loss, aux = _loss(cfg, outputs, targets)
  if cfg.regularizer is not None:
    loss = loss + _regularization(cfg, state.params)
  return jax.tree.map(functools.partial(_mean, cfg), {"loss": loss, **aux})
