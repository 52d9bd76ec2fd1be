"""The state a train step carries, and the compiled step with its layout helpers.

:class:`TrainState` is the pytree a step maps to the next one;
:class:`TrainStep` (built by :func:`jmp_train.make_train_step`) holds the
compiled step and lays out its inputs for the mode: plain arrays for one
device, one copy per device (a leading device axis) for ``pmap`` and
``shard_map``.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jmp_train._src import pytrees
from jmp_train._src.leaf_checks import non_finite_leaves
from jmp_train._src.messages import error_summary
from jmp_train._src.policy.policy import Policy

__all__ = ["TrainState", "TrainStep", "tree_bytes"]

# JAX's errors for a deleted (donated) input: "Array has been deleted",
# "Buffer has been deleted or donated".
_DELETED = re.compile(r"delete|donat", re.IGNORECASE)
# A collective of a multi-process step whose peers are gone: gloo's "Connection
# closed by peer", NCCL's, the coordination service's UNAVAILABLE or timeouts.
_LOST_PEER = re.compile(
  r"gloo|nccl|connection (closed|reset|refused)|socket closed|broken pipe|unavailable|deadline_exceeded|heartbeat"
  r"|coordination service",
  re.IGNORECASE,
)


@pytrees.register_pytree_dataclass
@dataclasses.dataclass(frozen=True)
class TrainState:
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
      ``{"batch_stats": ...}``); ``{}`` if the model has none. For an
      ``nnx.Module``: its ``nnx.State`` other than ``nnx.Param`` (batch
      statistics, RNG stream counters and ``uint32`` key data).
    rng: a ``jax.random.key_data``-style ``uint32`` key, or ``None``. Each step
      folds in the step number (and the device index) so that a resumed run
      draws the same dropout masks.
  """

  step: jax.Array
  params: Any
  opt_state: Any
  model_state: Any
  rng: jax.Array | None

  def replace(self, **changes: Any) -> "TrainState":
    """A copy with ``changes`` (``dataclasses.replace``)."""
    return dataclasses.replace(self, **changes)


def tree_bytes(tree: Any) -> int:
  """Bytes of the array leaves of ``tree`` (per replica for replicated trees).

  Args:
    tree: any pytree of arrays.

  Returns:
    The sum of ``size * itemsize`` over leaves with a ``dtype``.

  Examples:
    >>> import jax.numpy as jnp
    >>> tree_bytes({"w": jnp.ones((3, 4)), "b": jnp.ones(5, jnp.bfloat16), "n": None})
    58
  """
  return int(
    sum(
      np.prod(np.shape(x), dtype=np.int64) * np.dtype(x.dtype).itemsize
      for x in jax.tree.leaves(tree)
      if hasattr(x, "dtype")
    )
  )


def _check_finite(params: Any, cast: str) -> None:
  """Names the parameters that hold inf or NaN (a host check, once, at ``init``).

  A non-finite parameter makes the loss and every gradient NaN: in float32
  the weights fill with NaN, and under a dynamic loss scale every step is
  skipped for ever, visible only in a metric.

  Raises:
    ValueError: naming up to three such leaves and the fix.
  """
  found = non_finite_leaves(params)
  if not found:
    return
  named = ", ".join(f"params{path} ({bad} of {size})" for path, bad, size in found[:3])
  more = f" and {len(found) - 3} more leaves" if len(found) > 3 else ""
  fix = (
    "values beyond the dtype's range overflow to inf: scale them down, or keep float32 parameters "
    "(a 'mixed_float16' or 'mixed_bfloat16' policy)"
    if cast
    else "start from finite values: check the initialiser, or the checkpoint or arrays they came from"
  )
  raise ValueError(
    f"step.init got parameters that are not finite{cast}: inf or NaN in {named}{more}. "
    "A non-finite parameter makes the loss and every gradient NaN (under a dynamic loss scale "
    f"every step would be skipped for ever): {fix}."
  )


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
  _model: Any = None

  def __call__(self, state: TrainState, batch: Any) -> tuple[TrainState, dict[str, jax.Array]]:
    """Runs one step. ``batch`` is ``(inputs, targets)`` laid out by :meth:`shard_batch`.

    Raises:
      ValueError: if ``state`` was donated to an earlier step (use the state
        that step returned, or build the step with ``donate=False``), or if
        ``batch`` is not laid out for the mode (``pmap``: a leading axis
        of one entry per local device; ``shard_map``: a leading axis that
        divides among the mesh's devices, and device arrays in a
        multi-process run); each names :meth:`shard_batch`.
      RuntimeError: in a multi-process run, if a collective of the step
        lost the other processes (one died or stopped, or this one was
        paused past ``jax.distributed``'s heartbeat timeout), naming this
        process and JAX's error (chained): the job must restart.
    """
    self._check_inputs(state, batch, "step")
    try:
      return self._step(state, batch)
    except (ValueError, RuntimeError) as e:
      self._explain_failure(e, state, "step")
      raise

  def evaluate(self, state: TrainState, batch: Any) -> dict[str, jax.Array]:
    """Loss (and the loss function's aux values) without an update.

    Raises:
      ValueError: as for a step: a donated ``state``, or a ``batch`` not
        laid out by :meth:`shard_batch`.
    """
    self._check_inputs(state, batch, "step.evaluate")
    try:
      return self._eval(state, batch)
    except (ValueError, RuntimeError) as e:
      self._explain_failure(e, state, "step.evaluate")
      raise

  def _check_inputs(self, state: Any, batch: Any, call: str) -> None:
    """Host-side checks before the compiled call: no device sync, no tracing.

    JAX's own errors here are a squeeze of the wrong axis (``pmap``), a
    divisibility complaint about ``shard_map``'s arguments, or "Array has
    been deleted" (and, under ``pmap`` on CPU devices, a crash).
    """
    # A donated state has every leaf deleted: in "single" mode its step
    # counter tells, at no cost, and the other leaves are checked when the
    # call fails. Over several (CPU) devices a single deleted leaf crashes
    # the process, so those modes check every leaf first.
    self._check_not_donated(state, call, every_leaf=self.mode != "single")
    if self.mode == "single":
      return
    for path, x in jax.tree_util.tree_leaves_with_path(batch):
      problem = self._batch_layout_problem(jax.tree_util.keystr(path) or "batch", x)
      if problem is not None:
        raise ValueError(
          f"{call}(state, batch) in mode {self.mode!r} got a batch that is not laid "
          f"out for it: {problem}. Pass step.shard_batch(batch), which lays out this "
          "process's examples for the mode."
        )

  def _explain_failure(self, error: Exception, state: Any, call: str) -> None:
    """Raises what made the compiled ``call`` fail, where JAX's error hides it.

    Only an error about deleted buffers can come from a donated state: a
    failure inside the step (a peer lost mid-collective) also leaves the
    donated input deleted, and must not be blamed on it.
    """
    if jax.process_count() > 1 and _LOST_PEER.search(str(error)):
      raise RuntimeError(
        f"{call}(state, batch) failed in process {jax.process_index()} of {jax.process_count()}: "
        f"a collective lost the other processes ({error_summary(error)}). Another process of the "
        "job has died or stopped, or this one was paused (SIGSTOP, a debugger, a suspended job) "
        "for longer than jax.distributed's heartbeat timeout, and the job's coordination service "
        "has given it up. The job cannot go on: restart every process, from the latest checkpoint "
        "(jmp_train.restore_latest_checkpoint)."
      ) from error
    if _DELETED.search(str(error)):
      self._check_not_donated(state, call, every_leaf=True)

  @staticmethod
  def _check_not_donated(state: Any, call: str, every_leaf: bool) -> None:
    leaves = jax.tree.leaves(state) if every_leaf else [getattr(state, "step", None)]
    if any([isinstance(x, jax.Array) and x.is_deleted() for x in leaves]):
      raise ValueError(
        f"The state passed to {call}(state, batch) was donated to an earlier step: "
        "its buffers were reused for the state that step returned. Pass the returned "
        "state (state, metrics = step(state, batch)), or build the step with "
        "make_train_step(..., donate=False) to keep the input state alive."
      ) from None

  @functools.cached_property
  def _local_devices(self) -> int:
    return jax.local_device_count()

  def _batch_layout_problem(self, name: str, x: Any) -> str | None:
    shape = tuple(np.shape(x))
    if self.mode == "pmap":
      n = self._local_devices
      if shape and shape[0] == n:
        return None
      expected = f"a leading axis of {n}, one slice per local device"
      if shape and shape[0] % n == 0:
        expected += f": {(n, shape[0] // n, *shape[1:])}"
      return f"the leaf {name} has shape {shape}, expected {expected}"
    n = self.num_replicas
    if not shape or shape[0] % n:
      return f"the leaf {name} has shape {shape}, whose leading axis does not divide among the mesh's {n} devices"
    if jax.process_count() > 1 and not isinstance(x, jax.Array):
      return (
        f"the leaf {name} of shape {shape} is a host array "
        f"({type(x).__name__}), but a multi-process run needs one global device "
        "array built from each process's examples"
      )
    return None

  def lower(self, state: TrainState, batch: Any) -> Any:
    """``jax.stages.Lowered`` of the step, e.g. for :func:`jmp_train.diagnostics.collective_bytes`."""
    return self._step.lower(state, batch)

  def init(
    self,
    params: Any = None,
    *,
    model_state: Any = None,
    rng: jax.Array | int | None = None,
    inputs: Any = None,
  ) -> TrainState:
    """Builds the initial :class:`TrainState`, laid out for the mode.

    Args:
      params: parameters (any float dtype; cast to ``policy.param_dtype``).
        Identical on every process in multi-process runs. For a step built
        from an ``nnx.Module``: that module (or another instance of the same
        structure), or ``None`` for the module the step was built from; its
        ``nnx.Param`` s become ``params`` and everything else (batch
        statistics, RNG streams) ``model_state``.
      model_state: other Flax collections (``{"batch_stats": ...}``) or None.
      rng: a PRNG key or an int seed for dropout-style randomness, or None.
        (An ``nnx.Module`` draws from its own ``nnx.Rngs`` streams instead.)
      inputs: example inputs (one batch's inputs, or ``jax.ShapeDtypeStruct``
        s of their shapes), or None. Only a model under an FP8 policy with
        delayed scaling (``"mixed_float8"``) needs them, a linen or NNX
        module or a function: the model is traced on them (not run) to find
        its FP8 products and make each one's scaling state, keyed by its
        site, when ``model_state`` does not hold it.

    Returns:
      The state: plain arrays in ``"single"`` mode; one copy per device (a
      leading device axis) in ``"pmap"`` and ``"shard_map"`` modes.

    Raises:
      ValueError: if a parameter holds inf or NaN, as given or once cast to
        ``policy.param_dtype`` (a float32 value beyond float16's 65504),
        naming its path (checked once, on the host); under an FP8 policy
        with delayed scaling, if ``inputs`` is missing where the scaling
        state must be made.
    """
    params, model_state = self._model.initial(params, model_state, inputs, self.axis_name)
    _check_finite(params, "")
    stored = self.policy.cast_to_param(params)
    dtypes = lambda tree: [getattr(x, "dtype", None) for x in jax.tree.leaves(tree)]
    if dtypes(stored) != dtypes(params):  # a narrower dtype can overflow
      _check_finite(stored, f" once cast to the policy's param_dtype {jnp.dtype(self.policy.param_dtype).name}")
    params = stored
    if isinstance(rng, int):
      rng = jax.random.PRNGKey(rng)
    elif rng is not None and jnp.issubdtype(rng.dtype, jax.dtypes.prng_key):
      rng = jax.random.key_data(rng)
    state = TrainState(
      step=jnp.zeros((), jnp.int32),
      params=params,
      opt_state=None,
      model_state=model_state,
      rng=rng,
    )
    state = self.replicate(state)
    # The optimizer state is made per replica, inside the mapped context, so
    # that transformations that talk across replicas (sign_compression) see
    # their axis.
    return state.replace(opt_state=self._init_opt(state.params))

  def to_nnx(self, state: TrainState) -> Any:
    """The ``nnx.Module`` holding a state's parameters and model state.

    For a step built from an ``nnx.Module``: a new module of the same graph,
    with the first replica's ``params`` and ``model_state`` (RNG streams
    with typed keys again). Use it directly or copy it into the original
    with ``nnx.update(model, nnx.state(step.to_nnx(state)))``.

    Raises:
      TypeError: if the step was not built from an ``nnx.Module``.
    """
    if not hasattr(self._model, "to_module"):
      raise TypeError("to_nnx needs a step built from an nnx.Module.")
    return self._model.to_module(self.unreplicate(state.params), self.unreplicate(state.model_state))

  def replicate(self, tree: Any) -> Any:
    """Copies a per-replica tree to every device in this mode's layout."""
    if self.mode == "single":
      # A copy: the step donates its input, which must not delete the caller's.
      return jax.tree.map(lambda x: jnp.array(x, copy=True), tree)
    if self.mode == "pmap":
      devices = jax.local_devices()
      sharding = NamedSharding(Mesh(np.asarray(devices), ("local",)), P("local"))
      return jax.tree.map(
        lambda x: jax.device_put(np.broadcast_to(np.asarray(x), (len(devices), *np.shape(x))), sharding),
        tree,
      )
    sharding = NamedSharding(self.mesh, P(self.axis_name))

    def put(x):
      x = np.asarray(x)
      shape = (self.num_replicas, *x.shape)
      return jax.make_array_from_callback(shape, sharding, lambda index: np.broadcast_to(x, shape)[index])

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
      n_local = len([d for d in self.mesh.devices.flat if d.process_index == jax.process_index()])
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
      return jax.tree.map(lambda x: np.reshape(x, (n_local, -1, *np.shape(x)[1:])), batch)
    sharding = NamedSharding(self.mesh, P(self.axis_name))
    return jax.tree.map(
      lambda x: jax.make_array_from_process_local_data(sharding, np.asarray(x)),
      batch,
    )
