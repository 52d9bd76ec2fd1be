"""The train-step builder: forward and loss, gradient, update, per-mode wrappers.

:func:`make_train_step` checks its arguments in one place, builds the
per-replica step from three pieces (:func:`_forward`: policy casts, model
and loss; :func:`_gradients`: the (loss-scaled) gradient and its replica
average; :func:`_update`: the optimizer and the skip of non-finite steps)
and compiles it for one device, ``pmap`` or ``shard_map`` (:func:`_compile`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Sequence

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import Mesh

from jmp_train._src import buckets
from jmp_train._src import fp8 as fp8_lib
from jmp_train._src import fp8_flax
from jmp_train._src import train_model
from jmp_train._src import train_modes
from jmp_train._src.policy import Policy, get_policy
from jmp_train._src.train_state import TrainState, TrainStep

__all__ = ["make_train_step"]

_MODES = ("single", "pmap", "shard_map")
_REDUCE_DTYPES = ("float32", "bfloat16", "float16")


@dataclasses.dataclass(frozen=True)
class _Config:
  """What the per-replica step needs to know (static)."""

  model: Any
  loss_fn: Callable[..., Any]
  tx: optax.GradientTransformationExtraArgs
  policy: Policy
  ls_api: Any
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


def _loss(cfg: _Config, outputs, targets):
  result = cfg.loss_fn(cfg.policy.cast_to_output(outputs), targets)
  loss, aux = result if cfg.has_aux else (result, {})
  loss = jnp.asarray(loss, jnp.float32)
  chex.assert_shape(loss, ())
  return loss, aux


def _forward(cfg: _Config, params, model_state, inputs, targets, rng, replica):
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


def _replica(cfg: _Config):
  return None if cfg.axis_name is None else lax.axis_index(cfg.axis_name)


def _gradients(cfg: _Config, state: TrainState, inputs, targets):
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


def _update(cfg: _Config, state: TrainState, grads, model_state):
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


def _mean(cfg: _Config, x):
  x = jnp.asarray(x)
  if cfg.axis_name is None:
    return x
  if jnp.issubdtype(x.dtype, jnp.integer):
    return lax.pmax(x, cfg.axis_name)
  return lax.pmean(x, cfg.axis_name)


def _train_step(cfg: _Config, state: TrainState, batch):
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


def _eval_step(cfg: _Config, state: TrainState, batch):
  inputs, targets = _split_batch(batch)
  params = cfg.policy.cast_to_compute(state.params) if cfg.cast_params else state.params
  outputs = cfg.model.eval_apply(params, state.model_state, cfg.policy.cast_to_compute(inputs))
  loss, aux = _loss(cfg, outputs, targets)
  return jax.tree.map(functools.partial(_mean, cfg), {"loss": loss, **aux})


def _check_transformation(name: str, tx: Any, allow_none: bool) -> None:
  if tx is None and allow_none:
    return
  if isinstance(tx, optax.GradientTransformation) or (
      callable(getattr(tx, "init", None)) and callable(getattr(tx, "update", None))
  ):
    return
  hint = ""
  if callable(tx):
    hint = (f" {getattr(tx, '__name__', tx)!r} looks like a factory: call it, "
            f"e.g. optax.sgd(0.1) rather than optax.sgd.")
  raise TypeError(
      f"{name} must be an optax.GradientTransformation"
      f"{' or None' if allow_none else ''}, got {type(tx).__name__}: {tx!r}.{hint}"
  )


def _dtype_name(dtype: Any) -> str | None:
  try:
    return jnp.dtype(dtype).name
  except TypeError:
    return None


def _check_arguments(loss_fn, optimizer, compression, mode, grad_reduce_dtype) -> None:
  """Validation in one place: TypeError/ValueError naming the bad value."""
  if not callable(loss_fn):
    raise TypeError(
        f"loss_fn must be callable as loss_fn(outputs, targets), got "
        f"{type(loss_fn).__name__}: {loss_fn!r}."
    )
  _check_transformation("optimizer", optimizer, allow_none=compression is not None)
  _check_transformation("compression", compression, allow_none=True)
  if mode not in _MODES:
    raise ValueError(f"Unknown mode {mode!r}; valid modes: {', '.join(_MODES)}.")
  if compression is not None and mode == "single":
    raise ValueError(
        "compression averages gradients across replicas, so it needs mode "
        "'pmap' or 'shard_map', not 'single'."
    )
  if grad_reduce_dtype is not None and _dtype_name(grad_reduce_dtype) not in _REDUCE_DTYPES:
    raise ValueError(
        f"grad_reduce_dtype {grad_reduce_dtype!r} is not supported; valid: None, "
        f"{', '.join(_REDUCE_DTYPES)}."
    )


def _layout(mode: str, axis_name: str, mesh: Mesh | None) -> tuple[Mesh | None, int]:
  """The mesh (``shard_map`` only) and the number of data-parallel replicas."""
  if mode == "shard_map":
    if mesh is None:
      mesh = Mesh(np.asarray(jax.devices()), (axis_name,))
    if axis_name not in mesh.axis_names:
      raise ValueError(
          f"axis_name {axis_name!r} is not an axis of the mesh; mesh axes: "
          f"{mesh.axis_names}."
      )
    return mesh, mesh.shape[axis_name]
  if mesh is not None:
    raise ValueError(f"mesh is only used with mode='shard_map', not {mode!r}.")
  return None, jax.device_count() if mode == "pmap" else 1


def _compose(optimizer, compression, loss_scale, axis):
  """``loss_scaled(chain(compression, optimizer))``, parts left out when None."""
  parts = [t for t in (compression, optimizer) if t is not None]
  tx = optax.with_extra_args_support(parts[0] if len(parts) == 1 else optax.chain(*parts))
  if loss_scale is None:
    return tx, None
  # Imported here: a step without loss scaling does not need the module.
  from jmp_train._src import loss_scaling  # pylint: disable=g-import-not-at-top

  return loss_scaling.loss_scaled(tx, loss_scale, axis_name=axis), loss_scaling


def make_train_step(
    apply_fn: Callable[..., Any],
    loss_fn: Callable[..., Any],
    optimizer: optax.GradientTransformation | None,
    *,
    policy: Policy | str = "float32",
    loss_scale: Any = None,
    compression: optax.GradientTransformation | None = None,
    mode: str = "single",
    axis_name: str = "batch",
    mesh: Mesh | None = None,
    has_aux: bool = False,
    cast_params: bool = True,
    rng_collections: Sequence[str] = ("dropout",),
    eval_apply_fn: Callable[..., Any] | None = None,
    donate: bool = True,
    remat_policy: Callable[..., bool] | None = None,
    bucket_bytes: int = buckets.DEFAULT_BUCKET_BYTES,
    grad_reduce_dtype: Any = None,
) -> TrainStep:
  """Builds a compiled mixed-precision train step.

  One step, per replica, with ``S`` the current loss scale:

  .. math::

    \\ell = \\mathrm{loss}(\\mathrm{out}(f(\\mathrm{cast_c}(\\theta),
    \\mathrm{cast_c}(x))), y), \\quad g = \\nabla_\\theta (S\\,\\ell), \\quad
    \\theta \\leftarrow \\theta + \\mathrm{tx}(\\bar g)

  where ``cast_c`` casts floating leaves to the compute dtype, ``out`` casts
  the model's outputs to the output dtype (the loss and softmax run there,
  float32 in the mixed presets), and ``ḡ`` is the replica mean of ``g``
  (``lax.pmean``) unless ``compression`` averages the gradients itself. The
  composed optimizer is ``loss_scaled(chain(compression, optimizer))``: it
  unscales first, skips the update (parameters, optimizer state and
  ``model_state`` unchanged) when any replica saw a non-finite gradient, and
  adjusts the scale; all replicas agree on the skip. In the data-parallel
  modes the floating leaves of ``model_state`` (batch statistics) are
  averaged over replicas each step.

  Args:
    apply_fn: the model. A Flax linen-style apply, ``apply_fn(variables,
      inputs, **kwargs)`` with ``variables = {"params": params,
      **model_state}``; it receives ``rngs={name: key}`` when the state has a
      key and ``mutable=[...]`` (and then returns ``(outputs,
      new_model_state)``) when the state has ``model_state``. A
      ``flax.linen.Module`` stands for its ``apply``. A ``flax.nnx.Module``
      is used as is: ``step.init(module)`` stores its ``nnx.Param`` s as
      ``params`` and the rest (``BatchStat`` s, the ``nnx.Rngs`` streams of
      ``Dropout``) as ``model_state``; each step merges a copy in training
      mode (``module.train()``; evaluation: ``module.eval()``), and
      :meth:`TrainStep.to_nnx` returns the trained module (stream keys are
      stored as ``uint32`` key data in the state).
      In the data-parallel modes each replica folds its index into the
      streams' keys (one dropout mask per replica).
    loss_fn: ``loss_fn(outputs, targets)`` returning a scalar loss, or
      ``(loss, aux)`` with a dict of scalar metrics when ``has_aux``.
    optimizer: the optax optimizer (``optax.sgd(0.1)``,
      :func:`jmp_train.modified_momentum_sgd`, ...), or ``None`` when
      ``compression`` is the whole optimizer.
    policy: a :class:`~jmp_train.Policy` or a spec for
      :func:`~jmp_train.get_policy`.
    loss_scale: ``None`` (no loss scaling), or a loss scale
      (:class:`~jmp_train.StaticLossScale`,
      :class:`~jmp_train.DynamicLossScale`, ...) for
      :func:`~jmp_train.loss_scaled`.
    compression: ``None``, or a transformation that takes each replica's local
      gradients and averages them itself, built with the same
      ``axis_name``: either a compressor chained before ``optimizer``, such
      as ``jmp_train.sign_compression(axis_name)``, or, with
      ``optimizer=None``, a complete optimizer on local gradients (1-bit
      Adam-style). Its ``init`` runs inside the mapped axis, and every leaf
      of its state is kept per replica (error-feedback residuals may
      differ between replicas). Needs ``mode="pmap"`` or ``"shard_map"``.
    mode: ``"single"`` (``jax.jit``), ``"pmap"`` (``jax.pmap`` over the local
      devices) or ``"shard_map"`` (``jax.jit`` of ``jax.shard_map`` over a
      1-D mesh of all global devices).
    axis_name: the data-parallel axis name (``pmap`` and ``shard_map``).
    mesh: the ``shard_map`` mesh; default a 1-D mesh of ``jax.devices()``
      named ``axis_name``.
    has_aux: whether ``loss_fn`` returns ``(loss, aux)``.
    cast_params: cast parameters to the compute dtype before ``apply_fn``
      (the jmp way). Set ``False`` when the model applies the policy itself
      (:func:`jmp_train.flax.apply_policy`), for example to keep batch-norm
      parameters in float32.
    rng_collections: the ``rngs`` names ``apply_fn`` receives.
    eval_apply_fn: the apply :meth:`TrainStep.evaluate` uses, called as
      ``eval_apply_fn(variables, inputs)`` (no ``rngs``, nothing mutable);
      default ``apply_fn``. For example
      ``functools.partial(model.apply, train=False)``.
    donate: donate the input state's buffers to the output state.
    remat_policy: ``None`` (JAX keeps what the backward pass reads), or a
      ``jax.checkpoint`` policy for the forward pass and loss, such as
      :func:`jmp_train.half_precision_saveable` (keep only half-precision
      activations; recompute the float32 regions, casts and masks in the
      backward pass) or ``jax.checkpoint_policies.dots_saveable``.
    bucket_bytes: without ``compression``, the data-parallel modes average
      the gradients with one ``pmean`` per bucket of about this many bytes
      (flattened leaves, the last leaves first, so that a bucket's
      collective can start as soon as its gradients exist) instead of one
      per leaf. Default 25 MiB.
    grad_reduce_dtype: ``None`` (the gradients' dtype), ``"float32"``,
      ``"bfloat16"`` or ``"float16"``: the dtype the buckets are averaged
      in. XLA may move a convert across an all-reduce (XLA:CPU runs a
      bfloat16 all-reduce in float32): check the bytes of ``step.lower(...)
      .compile()`` with :func:`jmp_train.collective_bytes`.

  Returns:
    A :class:`TrainStep`; ``step(state, batch)`` returns ``(state, metrics)``
    with float32 ``loss``, ``loss_scale`` (after this step's adjustment: the
    scale of the next step; 1 without loss scaling), ``grad_norm`` (of the unscaled
    gradients that reach the optimizer; with compression, the replica mean
    of local norms), ``int32`` ``skipped_steps`` (total), and the aux
    metrics, each a scalar array averaged over replicas (no host sync).

  Raises:
    TypeError: if ``apply_fn`` or ``loss_fn`` is not callable, or
      ``optimizer`` / ``compression`` is not a transformation (a string, or
      a factory such as ``optax.sgd`` instead of ``optax.sgd(0.1)``); at the
      first step, if the batch is not a tuple ``(inputs, targets)``.
    ValueError: for an unknown ``mode`` or ``grad_reduce_dtype``, a
      ``compression`` without a data-parallel mode, or a ``mesh`` that lacks
      ``axis_name``.

  Examples:
    >>> import jax, jax.numpy as jnp, flax.linen as nn, optax, jmp_train
    >>> model = nn.Dense(4)
    >>> params = model.init(jax.random.PRNGKey(0), jnp.ones((1, 3)))["params"]
    >>> step = jmp_train.make_train_step(
    ...     model.apply, lambda out, y: jnp.mean((out - y) ** 2), optax.sgd(0.1),
    ...     policy="mixed_bfloat16")
    >>> state = step.init(params)
    >>> state, metrics = step(state, (jnp.ones((2, 3)), jnp.zeros((2, 4))))
    >>> sorted(metrics)
    ['grad_norm', 'loss', 'loss_scale', 'skipped_steps']

  References:
    Micikevicius et al., "Mixed Precision Training", ICLR 2018.
    https://arxiv.org/abs/1710.03740
  """
  _check_arguments(loss_fn, optimizer, compression, mode, grad_reduce_dtype)
  policy = get_policy(policy)
  model = train_model.as_model(apply_fn, eval_apply_fn, rng_collections)
  mesh, num_replicas = _layout(mode, axis_name, mesh)
  axis = axis_name if mode != "single" else None
  tx, ls_api = _compose(optimizer, compression, loss_scale, axis)
  cfg = _Config(
      model=model, loss_fn=loss_fn, tx=tx, policy=policy, ls_api=ls_api,
      axis_name=axis, exchange=axis is not None and compression is None,
      has_aux=has_aux, cast_params=cast_params, remat_policy=remat_policy,
      bucket_bytes=bucket_bytes,
      reduce_dtype=None if grad_reduce_dtype is None else jnp.dtype(grad_reduce_dtype),
  )
  train = functools.partial(_train_step, cfg)
  evaluate = functools.partial(_eval_step, cfg)
  if mode == "single":
    compiled = train_modes.compile_single(train, evaluate, tx.init, donate)
  elif mode == "pmap":
    compiled = train_modes.compile_pmap(train, evaluate, tx.init, donate, axis_name)
  else:
    compiled = train_modes.compile_shard_map(train, evaluate, tx.init, donate, axis_name, mesh)
  step_fn, eval_fn, init_fn = compiled
  return TrainStep(
      tx=tx, policy=policy, mode=mode, axis_name=axis, mesh=mesh,
      num_replicas=num_replicas, _step=step_fn, _eval=eval_fn, _init_opt=init_fn,
      _model=model,
  )
