"""The train-step builder: :func:`make_train_step`.

It checks its arguments in one place (``setup``), builds the per-replica
step (``replica_step``: policy casts, model and loss; the (loss-scaled)
gradient and its replica average; the optimizer and the skip of non-finite
steps) and compiles it for one device, ``pmap`` or ``shard_map``
(``modes``).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh

from jmp_train._src import buckets
from jmp_train._src.train import model as train_model
from jmp_train._src.train import modes as train_modes
from jmp_train._src.policy.policy import Policy, get_policy
from jmp_train._src.train.replica_step import StepConfig
from jmp_train._src.train.replica_step import eval_step
from jmp_train._src.train.replica_step import train_step
from jmp_train._src.train.setup import check_arguments
from jmp_train._src.train.setup import compose
from jmp_train._src.train.setup import layout
from jmp_train._src.train.setup import warn_float16_without_loss_scale
from jmp_train._src.train.setup import warn_half_weights_without_narrow_rule
from jmp_train._src.train.model_policy import check_keep
from jmp_train._src.train.model_policy import check_model_policy
from jmp_train._src.train.state import TrainStep

__all__ = ["make_train_step"]


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
  model_policy: str = "auto",
  keep: Sequence[str] | str | None = None,
  cast_params: bool | None = None,
  regularizer: Callable[[Any], Any] | None = None,
  rng_collections: Sequence[str] = ("dropout",),
  eval_apply_fn: Callable[..., Any] | None = None,
  donate: bool = True,
  remat_policy: Callable[..., bool] | None = None,
  bucket_bytes: int = buckets.DEFAULT_BUCKET_BYTES,
  grad_reduce_dtype: Any = None,
  compiler_options: Mapping[str, Any] | None = None,
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
      1-D mesh of all global devices). On several CPU devices (simulated
      with ``--xla_force_host_platform_device_count``, or gloo processes)
      each step of the ``pmap`` and ``shard_map`` modes returns once it has
      run: XLA:CPU aborts, or hangs, when more steps' all-reduces are queued
      than its thread pool can run. A hand-written loop over collectives on
      CPU devices should do the same (``jax.block_until_ready(state)`` after
      each step).
    axis_name: the data-parallel axis name (``pmap`` and ``shard_map``).
    mesh: the ``shard_map`` mesh; default a 1-D mesh of ``jax.devices()``
      named ``axis_name``.
    has_aux: whether ``loss_fn`` returns ``(loss, aux)``.
    model_policy: how the policy reaches the model's operations, whatever
      layers the model is built from and whatever dtype they declare (Flax's
      example models declare ``dtype=jnp.float32`` on every layer, which a
      cast of the inputs alone would leave in float32). Under a policy that
      computes in float32 nothing is applied. ``"auto"`` (default): the
      model (a ``flax.linen.Module``, its ``apply`` or a
      ``functools.partial`` of it, an ``nnx.Module``, any callable; the same
      for ``eval_apply_fn``) runs under :func:`jmp_train.autocast`, which
      decides each operation: matrix products and convolutions in the
      compute dtype, exp, log, softmax, norm statistics, sums and embedding
      gradients in float32, forward and backward; under an FP8 policy every
      weight product in FP8, each with its own delayed scaling state
      keyed by its site in the model (``step.init(..., inputs=...)``
      makes it; products inside loops use current scaling).
      ``"flax"``: :func:`jmp_train.flax.apply_policy`, the Flax layers'
      fields (Flax modules only; :meth:`TrainStep.to_nnx` returns the
      caller's module class and fields); ``"autocast"``:
      :func:`jmp_train.autocast`, as ``"auto"`` does;
      ``"inputs"``: parameters and inputs cast, nothing else (the layers'
      declared dtypes win). A model that applies a policy itself (made with
      :func:`jmp_train.flax.apply_policy` or :func:`jmp_train.autocast`) is
      used as is. At the first trace the forward pass is checked (except
      with ``"inputs"`` or a model that applies a policy itself), and a
      ``UserWarning`` names the products still wider than the compute dtype
      (inside a ``custom_vjp`` rule or a kernel, which autocast runs as
      traced).
    keep: under an FP8 or INT8 policy, the weight products that stay in the
      compute dtype (a first convolution, an LM head), by the scope they
      run in (a linen module's path, an NNX attribute path, a
      ``jax.named_scope``; shell globs: ``"head"``, ``"blocks/0/*"``) or by
      the site names :func:`jmp_train.int8.sensitivity` proposes. A rule
      that matches no weight product raises a ``ValueError`` at the first
      trace; with ``model_policy="flax"`` or ``"inputs"``, at once.
    cast_params: cast parameters to the compute dtype before ``apply_fn``
      (the jmp way). Default (``None``): ``True`` when the model receives its
      parameters as stored (``model_policy="inputs"``, a model that applies
      a policy itself), ``False`` when
      the step applies the policy inside the model (which keeps batch-norm
      parameters in float32, and sums an embedding table's gradient in
      float32: a table cast up front is gathered in the compute dtype, so
      its gradient, a sum over the batch's tokens, is summed in that dtype
      too). Pass ``False`` for a model that applies the policy itself.
    regularizer: ``None``, or ``regularizer(params)`` returning a scalar
      added to the loss, such as an L2 penalty: ``lambda params: 1e-4 * 0.5 *
      sum(jnp.sum(p ** 2) for p in jax.tree.leaves(params) if p.ndim > 1)``.
      It sees the parameters as stored (``param_dtype``, not cast) and runs
      in float32; the ``loss`` metric is the sum, the objective
      differentiated.
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
      per leaf; a leaf of ``bucket_bytes`` or 4 MiB or more is averaged on
      its own, without being copied into a bucket. Default 25 MiB.
    grad_reduce_dtype: ``None`` (the gradients' dtype), ``"float32"``,
      ``"bfloat16"`` or ``"float16"``: the dtype the buckets are averaged
      in. XLA may move a convert across an all-reduce (XLA:CPU runs a
      bfloat16 all-reduce in float32): check the bytes of ``step.lower(...)
      .compile()`` with :func:`jmp_train.diagnostics.collective_bytes`.
    compiler_options: XLA options the step and ``evaluate`` are compiled
      with (``jax.jit``'s ``compiler_options``; they take precedence over
      ``XLA_FLAGS``). ``None`` (the default): for an FP8 policy on GPUs,
      ``{"xla_gpu_enable_triton_gemm": False}``, so that XLA picks each FP8
      GEMM among cuBLAS's kernels only, without compiling and timing
      generated Triton kernels for it (a first call of seconds instead of
      minutes, and cuBLAS's FP8 GEMMs in the step); nothing otherwise. ``{}``
      compiles with XLA's defaults. ``mode="pmap"`` takes no options
      (``jax.pmap`` has none): set ``XLA_FLAGS`` before JAX starts, e.g.
      ``XLA_FLAGS=--xla_gpu_enable_triton_gemm=false``.

  Returns:
    A :class:`TrainStep`; ``step(state, batch)`` returns ``(state, metrics)``
    with float32 ``loss``, ``loss_scale`` (after this step's adjustment: the
    scale of the next step; 1 without loss scaling), ``grad_norm`` (of the unscaled
    gradients that reach the optimizer; with compression, the replica mean
    of local norms), ``int32`` ``skipped_steps`` (total) and
    ``consecutive_skipped_steps`` (in a row; 0 after a finite step), and
    the aux metrics, each a scalar array averaged over replicas (no host sync).

  Raises:
    TypeError: if ``apply_fn``, ``loss_fn``, ``regularizer`` or
      ``remat_policy`` is not callable, ``model_policy="flax"`` is given a
      function that is no Flax module's apply, or ``optimizer`` / ``compression`` is not a transformation
      (a string, or a factory such as ``optax.sgd`` instead of
      ``optax.sgd(0.1)``); if ``optimizer`` averages local gradients itself
      (``one_bit_adam``, ``one_bit_momentum``, ``sign_compression``,
      ``compressed_mean``: pass it as ``compression``), or ``compression``
      is a complete optimizer (``diloco``, ``one_bit_adam``,
      ``one_bit_momentum``) and ``optimizer`` is not ``None``; at the first step, if
      the batch is not a tuple ``(inputs, targets)``, a parameter is not
      floating (its path named), ``loss_fn`` does not take ``(outputs,
      targets)`` (a Flax-tutorial ``loss_fn(model, batch)``), or it returns a
      tuple without ``has_aux`` (or no ``(loss, aux dict)`` with it).
    TypeError: if ``compiler_options`` is not a mapping from option names.
    ValueError: for an unknown ``mode``, ``model_policy`` or
      ``grad_reduce_dtype``, non-empty ``compiler_options`` with
      ``mode="pmap"``, a
      non-positive ``bucket_bytes``, a non-string ``axis_name``, a non-bool
      ``has_aux``, ``cast_params`` or ``donate``, ``rng_collections`` that
      are not a sequence of names, a ``compression`` without a
      data-parallel mode, or a ``mesh`` that lacks ``axis_name``; at the
      first step, for inputs and targets of different leading sizes, for a
      loss (or ``regularizer`` value) that is not a scalar,
      a model that reads a collection ``model_state`` does not hold (naming
      ``step.init(params, model_state={"batch_stats": ...})``, or
      ``inputs=`` for FP8 scaling state), a model whose collectives name an
      axis the step does not map (a BatchNorm with ``axis_name="batch"`` in
      ``mode="single"``), or a model that draws
      random keys the step does not give it (a linen model without
      ``step.init(..., rng=...)`` or its collection in ``rng_collections``;
      an ``nnx.Dropout`` without an ``nnx.Rngs`` stream); at every step
      (``step(state, batch)``, :meth:`TrainStep.evaluate`), for a state
      donated to an earlier step or a batch not laid out by
      ``step.shard_batch(batch)`` for ``pmap``/``shard_map``.

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
    ['consecutive_skipped_steps', 'grad_norm', 'loss', 'loss_scale', 'skipped_steps']

  Warns:
    UserWarning: for float16 compute without a ``loss_scale`` (gradients
      flush to zero or overflow; bfloat16 needs none); at the first trace,
      for products the policy leaves wider than the compute dtype (see
      ``model_policy``); for float16 or bfloat16 parameters without a
      narrow-weights rule in ``optimizer`` (updates below about
      ``|w|·2^-11`` round away: chain :func:`jmp_train.stochastic_rounding`
      or :func:`jmp_train.kahan_compensation`, use
      :func:`jmp_train.modified_momentum_sgd`, or keep float32 parameters);
      at the first trace, for outputs and targets that broadcast to a larger
      shape than either (``(16, 1)`` against ``(16,)``).

  References:
    Micikevicius et al., "Mixed Precision Training", ICLR 2018.
    https://arxiv.org/abs/1710.03740
  """
  check_arguments(
    loss_fn,
    optimizer,
    compression,
    mode,
    grad_reduce_dtype,
    bucket_bytes,
    axis_name=axis_name,
    has_aux=has_aux,
    cast_params=True if cast_params is None else cast_params,
    donate=donate,
    rng_collections=rng_collections,
    remat_policy=remat_policy,
  )
  model_policy = check_model_policy(model_policy)
  keep = check_keep(keep, model_policy)
  if regularizer is not None and not callable(regularizer):
    raise TypeError(
      f"regularizer must be None or a function of the parameters returning a scalar, "
      f"e.g. lambda params: 1e-4 * sum(jnp.sum(p ** 2) for p in jax.tree.leaves(params)), "
      f"got {type(regularizer).__name__}: {regularizer!r}."
    )
  policy = get_policy(policy)
  warn_float16_without_loss_scale(policy, loss_scale)
  warn_half_weights_without_narrow_rule(policy, optimizer, compression)
  model = train_model.as_model(apply_fn, eval_apply_fn, rng_collections, policy, model_policy, keep)
  if cast_params is None:
    cast_params = model.mechanism == "inputs"
  mesh, num_replicas = layout(mode, axis_name, mesh)
  axis = axis_name if mode != "single" else None
  tx, ls_api = compose(optimizer, compression, loss_scale, axis)
  cfg = StepConfig(
    model=model,
    loss_fn=loss_fn,
    tx=tx,
    policy=policy,
    ls_api=ls_api,
    axis_name=axis,
    exchange=axis is not None and compression is None,
    has_aux=has_aux,
    cast_params=cast_params,
    remat_policy=remat_policy,
    regularizer=regularizer,
    bucket_bytes=bucket_bytes,
    reduce_dtype=None if grad_reduce_dtype is None else jnp.dtype(grad_reduce_dtype),
  )
  train = functools.partial(train_step, cfg)
  evaluate = functools.partial(eval_step, cfg)
  devices = list(mesh.devices.flat if mode == "shard_map" else jax.local_devices())
  options = train_modes.check_compiler_options(compiler_options)
  if mode == "pmap" and options:
    raise ValueError(
      f"compiler_options={options!r} cannot apply to mode='pmap' (jax.pmap compiles "
      "without per-function options): use mode='shard_map', or set XLA_FLAGS before JAX "
      "starts, e.g. XLA_FLAGS=--xla_gpu_enable_triton_gemm=false."
    )
  if options is None:
    options = train_modes.default_compiler_options(policy, devices[0].platform)
  if mode == "single":
    compiled = train_modes.compile_single(train, evaluate, tx.init, donate, options)
  elif mode == "pmap":
    compiled = train_modes.compile_pmap(train, evaluate, tx.init, donate, axis_name)
  else:
    compiled = train_modes.compile_shard_map(train, evaluate, tx.init, donate, axis_name, mesh, options)
  step_fn, eval_fn, init_fn = compiled
  if train_modes.waits_for_each_step(mode, devices):
    step_fn = train_modes.waiting(step_fn)
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
    _model=model,
  )
