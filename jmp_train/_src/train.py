"""A train-step builder: policy, loss scaling, compression and an optimizer.

:func:`make_train_step` composes a Flax-style ``apply_fn``, a loss, an optax
optimizer, a dtype :class:`~jmp_train.Policy`, optional loss scaling
(:func:`jmp_train.loss_scaled`) and optional gradient compression
(:func:`jmp_train.sign_compression`) into one compiled step

.. math::

  (\\text{state}_{t+1}, \\text{metrics}_t) = \\text{step}(\\text{state}_t,
  \\text{batch}_t)

for one device (``jit``), ``pmap``, or ``shard_map`` over a data-parallel
:class:`jax.sharding.Mesh`; the ``pmap`` and ``shard_map`` modes run unchanged
over several processes started with :func:`jax.distributed.initialize`.
:func:`save_checkpoint` / :func:`restore_checkpoint` store the whole
:class:`TrainState` with orbax, and a restored run continues bit-for-bit.
"""

from __future__ import annotations

import dataclasses
import functools
import pathlib
from typing import Any, Callable, Sequence

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import struct
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jmp_train._src.policy import Policy, get_policy

__all__ = [
    "TrainState",
    "TrainStep",
    "make_train_step",
    "save_checkpoint",
    "restore_checkpoint",
    "tree_bytes",
]

_MODES = ("single", "pmap", "shard_map")


class TrainState(struct.PyTreeNode):
  """Everything a training run carries from one step to the next.

  A pytree of arrays only (no functions), so it can be donated, checkpointed
  and sharded as a whole. In the ``pmap`` and ``shard_map`` modes every leaf
  has a leading axis with one entry per device (as with
  ``flax.jax_utils.replicate``): per-device optimizer state, such as the
  error-feedback residuals of 1-bit SGD, lives there.

  Attributes:
    step: ``int32`` scalar, the number of steps taken (skipped ones included,
      so that ``step`` also indexes the data stream).
    params: parameters, stored in the policy's ``param_dtype``.
    opt_state: the optimizer state (with the loss scale inside it when loss
      scaling is on).
    model_state: mutable Flax collections other than ``params`` (for example
      ``{"batch_stats": ...}``); ``{}`` if the model has none.
    rng: a ``jax.random.key_data``-style ``uint32`` key, or ``None``. Each step
      folds in the step number (and the device index) so that a resumed run
      draws the same dropout masks.
  """

  step: jax.Array
  params: Any
  opt_state: Any
  model_state: Any
  rng: jax.Array | None


def tree_bytes(tree: Any) -> int:
  """Bytes of the array leaves of ``tree`` (per replica for replicated trees).

  Args:
    tree: any pytree of arrays.

  Returns:
    The sum of ``size * itemsize`` over leaves with a ``dtype``.
  """
  return int(
      sum(
          np.prod(np.shape(x), dtype=np.int64) * np.dtype(x.dtype).itemsize
          for x in jax.tree.leaves(tree)
          if hasattr(x, "dtype")
      )
  )


def _loss_scaling_api():
  # Imported lazily: the loss-scaling module is optional for a step without
  # loss scaling, and importing it here keeps this module import-cycle free.
  from jmp_train._src import loss_scaling  # pylint: disable=g-import-not-at-top

  return loss_scaling


@dataclasses.dataclass(frozen=True, eq=False)
class TrainStep:
  """A compiled train step, with the helpers that lay out its inputs.

  Built by :func:`make_train_step`; call it as ``state, metrics =
  step(state, batch)``.

  Attributes:
    tx: the composed optax transformation (loss scaling around compression
      around the optimizer); ``state.opt_state`` is its state.
    policy: the dtype policy.
    mode: ``"single"``, ``"pmap"`` or ``"shard_map"``.
    axis_name: the data-parallel axis name (``None`` in ``"single"`` mode).
    mesh: the 1-D device mesh of the ``"shard_map"`` mode, else ``None``.
    num_replicas: data-parallel replicas over all processes.
  """

  tx: optax.GradientTransformationExtraArgs
  policy: Policy
  mode: str
  axis_name: str | None
  mesh: Mesh | None
  num_replicas: int
  _step: Callable[..., Any]
  _eval: Callable[..., Any]
  _init_opt: Callable[..., Any]

  def __call__(self, state: TrainState, batch: Any) -> tuple[TrainState, dict[str, jax.Array]]:
    """Runs one step. ``batch`` is ``(inputs, targets)`` laid out by :meth:`shard_batch`."""
    return self._step(state, batch)

  def evaluate(self, state: TrainState, batch: Any) -> dict[str, jax.Array]:
    """Loss (and the loss function's aux values) without an update."""
    return self._eval(state, batch)

  def lower(self, state: TrainState, batch: Any) -> Any:
    """``jax.stages.Lowered`` of the step, e.g. for :func:`jmp_train.collective_bytes`."""
    return self._step.lower(state, batch)

  def init(
      self,
      params: Any,
      *,
      model_state: Any = None,
      rng: jax.Array | int | None = None,
  ) -> TrainState:
    """Builds the initial :class:`TrainState`, laid out for the mode.

    Args:
      params: parameters (any float dtype; cast to ``policy.param_dtype``).
        Identical on every process in multi-process runs.
      model_state: other Flax collections (``{"batch_stats": ...}``) or None.
      rng: a PRNG key or an int seed for dropout-style randomness, or None.

    Returns:
      The state: plain arrays in ``"single"`` mode; one copy per device (a
      leading device axis) in ``"pmap"`` and ``"shard_map"`` modes.
    """
    params = self.policy.cast_to_param(params)
    if isinstance(rng, int):
      rng = jax.random.PRNGKey(rng)
    elif rng is not None and jnp.issubdtype(rng.dtype, jax.dtypes.prng_key):
      rng = jax.random.key_data(rng)
    state = TrainState(
        step=jnp.zeros((), jnp.int32),
        params=params,
        opt_state=None,
        model_state={} if model_state is None else dict(model_state),
        rng=rng,
    )
    state = self.replicate(state)
    # The optimizer state is made per replica, inside the mapped context, so
    # that transformations that talk across replicas (sign_compression) see
    # their axis.
    return state.replace(opt_state=self._init_opt(state.params))

  def replicate(self, tree: Any) -> Any:
    """Copies a per-replica tree to every device in this mode's layout."""
    if self.mode == "single":
      # A copy: the step donates its input, which must not delete the caller's.
      return jax.tree.map(lambda x: jnp.array(x, copy=True), tree)
    if self.mode == "pmap":
      devices = jax.local_devices()
      sharding = NamedSharding(Mesh(np.asarray(devices), ("local",)), P("local"))
      return jax.tree.map(
          lambda x: jax.device_put(
              np.broadcast_to(np.asarray(x), (len(devices), *np.shape(x))), sharding
          ),
          tree,
      )
    sharding = NamedSharding(self.mesh, P(self.axis_name))

    def put(x):
      x = np.asarray(x)
      shape = (self.num_replicas, *x.shape)
      return jax.make_array_from_callback(
          shape, sharding, lambda index: np.broadcast_to(x, shape)[index]
      )

    return jax.tree.map(put, tree)

  def unreplicate(self, tree: Any) -> Any:
    """The first local replica of a replicated tree (identity in ``"single"`` mode)."""
    if self.mode == "single":
      return tree
    return jax.tree.map(lambda x: x.addressable_shards[0].data[0], tree)

  def shard_batch(self, batch: Any) -> Any:
    """Lays out this process's share of a global batch for the step.

    Args:
      batch: a pytree of host arrays whose leading axis is this process's
        examples (the global batch divided by the number of processes).

    Returns:
      Device arrays: as given in ``"single"`` mode; split into
      ``(local_devices, per_device, ...)`` for ``"pmap"``; one global array
      sharded along its first axis for ``"shard_map"``.

    Raises:
      ValueError: if the local batch does not divide among the local devices.
    """
    n_local = 1 if self.mode == "single" else jax.local_device_count()
    if self.mode == "shard_map":
      n_local = len(
          [d for d in self.mesh.devices.flat if d.process_index == jax.process_index()]
      )
    for x in jax.tree.leaves(batch):
      if np.shape(x)[0] % n_local:
        raise ValueError(
            f"A batch of {np.shape(x)[0]} examples per process does not divide "
            f"among {n_local} local devices in mode {self.mode!r}; use a "
            f"multiple of {n_local}."
        )
    if self.mode == "single":
      return jax.tree.map(jnp.asarray, batch)
    if self.mode == "pmap":
      return jax.tree.map(
          lambda x: np.reshape(x, (n_local, -1, *np.shape(x)[1:])), batch
      )
    sharding = NamedSharding(self.mesh, P(self.axis_name))
    return jax.tree.map(
        lambda x: jax.make_array_from_process_local_data(sharding, np.asarray(x)),
        batch,
    )


def make_train_step(
    apply_fn: Callable[..., Any],
    loss_fn: Callable[..., Any],
    optimizer: optax.GradientTransformation,
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
    apply_fn: a Flax linen-style apply, ``apply_fn(variables, inputs,
      **kwargs)`` with ``variables = {"params": params, **model_state}``; it
      receives ``rngs={name: key}`` when the state has a key and
      ``mutable=[...]`` (and then returns ``(outputs, new_model_state)``)
      when the state has ``model_state``. For Flax NNX, pass
      ``lambda v, x: nnx.merge(graphdef, v["params"])(x)``.
    loss_fn: ``loss_fn(outputs, targets)`` returning a scalar loss, or
      ``(loss, aux)`` with a dict of scalar metrics when ``has_aux``.
    optimizer: the optax optimizer (``optax.sgd``,
      :func:`jmp_train.modified_momentum_sgd`, ...).
    policy: a :class:`~jmp_train.Policy` or a spec for
      :func:`~jmp_train.get_policy`.
    loss_scale: ``None`` (no loss scaling), or a loss scale
      (:class:`~jmp_train.StaticLossScale`,
      :class:`~jmp_train.DynamicLossScale`, ...) for
      :func:`~jmp_train.loss_scaled`.
    compression: ``None``, or a transformation that takes each replica's local
      gradients and returns their average, such as
      ``jmp_train.sign_compression(axis_name)``, built with the same
      ``axis_name``. Needs ``mode="pmap"`` or ``"shard_map"``.
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

  Returns:
    A :class:`TrainStep`; ``step(state, batch)`` returns ``(state, metrics)``
    with float32 ``loss``, ``loss_scale`` (after this step's adjustment: the
    scale of the next step; 1 without loss scaling), ``grad_norm`` (of the unscaled
    gradients that reach the optimizer; with compression, the replica mean
    of local norms), ``int32`` ``skipped_steps`` (total), and the aux
    metrics, each a scalar array averaged over replicas (no host sync).

  Raises:
    ValueError: for an unknown ``mode``, a ``compression`` without a
      data-parallel mode, or a ``mesh`` that lacks ``axis_name``.

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
  policy = get_policy(policy)
  if mode not in _MODES:
    raise ValueError(f"Unknown mode {mode!r}; valid modes: {', '.join(_MODES)}.")
  if compression is not None and mode == "single":
    raise ValueError(
        "compression averages gradients across replicas, so it needs mode "
        "'pmap' or 'shard_map', not 'single'."
    )
  if mode == "shard_map":
    if mesh is None:
      mesh = Mesh(np.asarray(jax.devices()), (axis_name,))
    if axis_name not in mesh.axis_names:
      raise ValueError(
          f"axis_name {axis_name!r} is not an axis of the mesh; mesh axes: "
          f"{mesh.axis_names}."
      )
  elif mesh is not None:
    raise ValueError(f"mesh is only used with mode='shard_map', not {mode!r}.")
  data_parallel = mode != "single"
  axis = axis_name if data_parallel else None
  if mode == "pmap":
    num_replicas = jax.device_count()
  elif mode == "shard_map":
    num_replicas = mesh.shape[axis_name]
  else:
    num_replicas = 1

  tx = optax.with_extra_args_support(
      optimizer if compression is None else optax.chain(compression, optimizer)
  )
  ls_api = None
  if loss_scale is not None:
    ls_api = _loss_scaling_api()
    tx = ls_api.loss_scaled(tx, loss_scale, axis_name=axis)

  def forward(params, model_state, inputs, targets, rng, train=True):
    if cast_params:
      params = policy.cast_to_compute(params)
    variables = {"params": params, **model_state}
    if not train:
      outputs = policy.cast_to_output(
          (eval_apply_fn or apply_fn)(variables, policy.cast_to_compute(inputs))
      )
      result = loss_fn(outputs, targets)
      loss, aux = result if has_aux else (result, {})
      return jnp.asarray(loss, jnp.float32), (aux, model_state)
    kwargs = {}
    if rng is not None:
      kwargs["rngs"] = {
          name: jax.random.fold_in(rng, i) for i, name in enumerate(rng_collections)
      }
    if model_state:
      outputs, new_model_state = apply_fn(
          variables, policy.cast_to_compute(inputs), mutable=list(model_state), **kwargs
      )
      # Keep the collections' dtypes stable across steps.
      new_model_state = jax.tree.map(
          lambda new, old: jnp.asarray(new, old.dtype),
          dict(new_model_state),
          dict(model_state),
      )
    else:
      outputs = apply_fn(variables, policy.cast_to_compute(inputs), **kwargs)
      new_model_state = model_state
    outputs = policy.cast_to_output(outputs)
    result = loss_fn(outputs, targets)
    loss, aux = result if has_aux else (result, {})
    loss = jnp.asarray(loss, jnp.float32)
    chex.assert_shape(loss, ())
    return loss, (aux, new_model_state)

  def step_rng(state):
    if state.rng is None:
      return None
    rng = jax.random.fold_in(state.rng, state.step)
    if data_parallel:
      rng = jax.random.fold_in(rng, lax.axis_index(axis_name))
    return rng

  def mean(x):
    x = jnp.asarray(x)
    if not data_parallel:
      return x
    if jnp.issubdtype(x.dtype, jnp.integer):
      return lax.pmax(x, axis_name)
    return lax.pmean(x, axis_name)

  def train_step(state: TrainState, batch):
    inputs, targets = batch
    rng = step_rng(state)
    objective = functools.partial(
        forward, model_state=state.model_state, inputs=inputs, targets=targets, rng=rng
    )
    if remat_policy is not None:
      objective = jax.checkpoint(objective, policy=remat_policy)
    if ls_api is None:
      scale = jnp.ones((), jnp.float32)
      (loss, (aux, model_state)), grads = jax.value_and_grad(objective, has_aux=True)(
          state.params
      )
    else:
      current = ls_api.get_loss_scale(state.opt_state)
      scale = jnp.asarray(current.loss_scale, jnp.float32)
      (loss, (aux, model_state)), grads = ls_api.scaled_value_and_grad(
          objective, has_aux=True
      )(current, state.params)
    if data_parallel and compression is None:
      grads = lax.pmean(grads, axis_name)
    if data_parallel:
      # Batch statistics from each replica's share of the batch, averaged so
      # that every replica keeps the same model state (as Flax's examples do).
      model_state = jax.tree.map(
          lambda x: lax.pmean(x, axis_name) if jnp.issubdtype(x.dtype, jnp.inexact) else x,
          model_state,
      )
    grad_norm = jnp.sqrt(
        sum(jnp.sum(jnp.square(g.astype(jnp.float32))) for g in jax.tree.leaves(grads))
    ) / scale
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    if ls_api is None:
      skipped = jnp.zeros((), jnp.int32)
    else:
      ls_metrics = ls_api.loss_scale_metrics(opt_state)
      scale = ls_metrics["loss_scale"]
      skipped = jnp.asarray(ls_metrics["total_skipped"], jnp.int32)
      finite = jnp.asarray(ls_metrics["last_finite"], jnp.bool_)
      model_state = jax.tree.map(
          lambda new, old: jnp.where(finite, new, old), model_state, state.model_state
      )
    new_state = state.replace(
        step=optax.safe_increment(state.step),
        params=params,
        opt_state=opt_state,
        model_state=model_state,
    )
    metrics = {
        "loss": loss,
        "loss_scale": scale,
        "skipped_steps": skipped,
        "grad_norm": grad_norm,
        **aux,
    }
    return new_state, jax.tree.map(mean, metrics)

  def eval_step(state: TrainState, batch):
    inputs, targets = batch
    loss, (aux, _) = forward(
        state.params, state.model_state, inputs, targets, None, train=False
    )
    return jax.tree.map(mean, {"loss": loss, **aux})

  donate_argnums = (0,) if donate else ()
  if mode == "single":
    step_fn = jax.jit(train_step, donate_argnums=donate_argnums)
    eval_fn = jax.jit(eval_step)
    init_fn = jax.jit(tx.init)
  elif mode == "pmap":
    pmapped_train = jax.pmap(train_step, axis_name=axis_name, donate_argnums=donate_argnums)
    pmapped_eval = jax.pmap(eval_step, axis_name=axis_name)
    first = lambda tree: jax.tree.map(lambda x: x[0], tree)

    # The metrics are equal on every device (pmean/pmax): return one copy so
    # that every mode returns scalars.
    def step_fn(state, batch):
      new_state, metrics = pmapped_train(state, batch)
      return new_state, first(metrics)

    step_fn.lower = pmapped_train.lower
    eval_fn = lambda state, batch: first(pmapped_eval(state, batch))
    init_fn = jax.pmap(tx.init, axis_name=axis_name)
  else:
    squeeze = lambda tree: jax.tree.map(lambda x: x[0], tree)
    expand = lambda tree: jax.tree.map(lambda x: x[None], tree)

    def sharded_train(state, batch):
      new_state, metrics = train_step(squeeze(state), batch)
      return expand(new_state), metrics

    def sharded_eval(state, batch):
      return eval_step(squeeze(state), batch)

    spec = P(axis_name)
    step_fn = jax.jit(
        jax.shard_map(
            sharded_train, mesh=mesh, in_specs=(spec, spec), out_specs=(spec, P())
        ),
        donate_argnums=donate_argnums,
    )
    eval_fn = jax.jit(
        jax.shard_map(sharded_eval, mesh=mesh, in_specs=(spec, spec), out_specs=P())
    )
    init_fn = jax.jit(
        jax.shard_map(
            lambda params: expand(tx.init(squeeze(params))),
            mesh=mesh,
            in_specs=spec,
            out_specs=spec,
        )
    )
  return TrainStep(
      tx=tx,
      policy=policy,
      mode=mode,
      axis_name=axis,
      mesh=mesh,
      num_replicas=num_replicas,
      _step=step_fn,
      _eval=eval_fn,
      _init_opt=init_fn,
  )


def save_checkpoint(directory: str | pathlib.Path, state: TrainState, *, force: bool = False) -> pathlib.Path:
  """Saves a :class:`TrainState` (every leaf, every device's copy) with orbax.

  Every process must call it (orbax writes each process's shards).

  Args:
    directory: where to write; must not exist unless ``force``.
    state: the state to save.
    force: overwrite an existing checkpoint.

  Returns:
    The absolute checkpoint path.

  Raises:
    ImportError: with an install hint, if orbax-checkpoint is missing.

  Examples:
    Resuming: the step counter, parameters, optimizer state (with the loss
    scale and any error-feedback residuals), model state and PRNG key all
    come back, so the run continues bit-for-bit::

      save_checkpoint("/tmp/run/step_1000", state)
      state = restore_checkpoint("/tmp/run/step_1000", step.init(params))
  """
  ocp = _orbax()
  path = pathlib.Path(directory).absolute()
  with ocp.StandardCheckpointer() as checkpointer:
    checkpointer.save(path, state, force=force)
    checkpointer.wait_until_finished()
  return path


def restore_checkpoint(directory: str | pathlib.Path, like: TrainState) -> TrainState:
  """Restores a :class:`TrainState` saved by :func:`save_checkpoint`.

  Args:
    directory: the checkpoint path.
    like: a state with the same structure, shapes, dtypes and shardings
      (for example ``step.init(params)``); its values are not used.

  Returns:
    The restored state, laid out like ``like``.

  Raises:
    ImportError: with an install hint, if orbax-checkpoint is missing.
  """
  ocp = _orbax()
  path = pathlib.Path(directory).absolute()
  abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, like)
  with ocp.StandardCheckpointer() as checkpointer:
    return checkpointer.restore(path, abstract)


def _orbax():
  try:
    import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    raise ImportError(
        "Checkpoints need orbax-checkpoint: pip install 'jmp_train[checkpoint]'"
    ) from e
  return ocp
