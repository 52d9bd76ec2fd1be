"""Argument checks and composition for :func:`~jmp_train.make_train_step`.

Validation in one place (a ``TypeError``/``ValueError`` naming the bad value
and the valid ones), the mesh and replica count of each mode, and the
optimizer chain wrapped in loss scaling.
"""

from __future__ import annotations

import functools
import inspect
import warnings
from typing import Any, Callable, Iterator, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh

from jmp_train._src import buckets
from jmp_train._src.hyperparams import check_bool
from jmp_train._src.compression.replica_averaging import ReplicaCompressor, ReplicaOptimizer

__all__ = [
  "LossScalingFns",
  "check_arguments",
  "compose",
  "layout",
  "warn_float16_without_loss_scale",
  "warn_half_weights_without_narrow_rule",
]

MODES = ("single", "pmap", "shard_map")
_REDUCE_DTYPES = ("float32", "bfloat16", "float16")


class LossScalingFns(NamedTuple):
  """The loss-scaling functions the step calls (loaded only when used)."""

  get_loss_scale: Callable[..., Any]
  scaled_value_and_grad: Callable[..., Any]
  loss_scale_metrics: Callable[..., Any]


def _check_transformation(name: str, tx: Any, allow_none: bool) -> None:
  if tx is None and allow_none:
    return
  if isinstance(tx, optax.GradientTransformation) or (
    callable(getattr(tx, "init", None)) and callable(getattr(tx, "update", None))
  ):
    return
  hint = ""
  if callable(tx):
    hint = f" {getattr(tx, '__name__', tx)!r} looks like a factory: call it, e.g. optax.sgd(0.1) rather than optax.sgd."
  raise TypeError(
    f"{name} must be an optax.GradientTransformation"
    f"{' or None' if allow_none else ''}, got {type(tx).__name__}: {tx!r}.{hint}"
  )


def _check_optimizer_slot(optimizer: Any, compression: Any) -> None:
  """A transformation that averages local gradients itself belongs in ``compression``."""
  if isinstance(optimizer, ReplicaOptimizer):
    raise TypeError(
      "optimizer is a complete optimizer on local gradients (diloco, one_bit_adam or "
      "one_bit_momentum) that averages them across replicas itself: pass it as "
      "compression=, with optimizer=None, e.g. make_train_step(apply_fn, loss_fn, None, "
      "compression=one_bit_adam(...), mode='shard_map')."
    )
  if isinstance(optimizer, ReplicaCompressor):
    raise TypeError(
      "optimizer is a compressor of local gradients (sign_compression or "
      "compressed_mean), which averages them across replicas and applies no "
      "learning rate: pass it as compression=, and an optax optimizer as optimizer="
      ", e.g. make_train_step(apply_fn, loss_fn, optax.sgd(0.1), "
      "compression=sign_compression('batch'), mode='shard_map')."
    )
  if isinstance(compression, ReplicaOptimizer) and optimizer is not None:
    # chain(compression, optimizer) would run the optimizer on the complete
    # optimizer's updates: a second Adam on DiLoCo's steps, say.
    raise TypeError(
      "compression is a complete optimizer on local gradients (diloco, one_bit_adam or "
      "one_bit_momentum) whose output is the parameter update itself, but optimizer= "
      f"was also given ({_describe(optimizer)}): the step would run it on those updates. "
      "Pass optimizer=None, e.g. make_train_step(apply_fn, loss_fn, None, "
      "compression=diloco(optax.adamw(1e-3), axis_name='batch'), mode='shard_map'); "
      "the inner optimizer goes inside it (diloco's inner=, one_bit_adam's own learning_rate)."
    )


def warn_float16_without_loss_scale(policy: Any, loss_scale: Any) -> None:
  """A ``UserWarning`` when float16 gradients have no loss scale to keep them from flushing."""
  if loss_scale is None and jnp.dtype(policy.compute_dtype) == jnp.float16:
    warnings.warn(
      f"float16 compute without loss scaling (policy {policy}): gradients smaller "
      "than 2**-24 flush to zero in float16 and larger than 65504 overflow. Pass "
      "loss_scale=jmp_train.DynamicLossScale(2.0**15), or use a bfloat16 policy "
      "('mixed_bfloat16'), which needs no loss scale.",
      UserWarning,
      stacklevel=3,
    )


# The modules of the narrow-weights rules: transformations that land each
# update on a well-chosen half-precision weight instead of letting round to
# nearest drop it (see the narrow-weights guide). The 8-bit optimizers only
# store their moments narrowly: they are not among them.
_NARROW_WEIGHT_RULE_MODULES = frozenset(
  f"jmp_train._src.low_precision.{name}" for name in ("stochastic_rounding", "kahan_compensation", "modified_momentum")
)
# Composition helpers, left out of an optimizer's description.
_WRAPPERS = frozenset(
  ("chain", "named_chain", "with_extra_args_support", "identity", "inject_hyperparams", "init_empty_state")
)


def _functions(obj: Any, seen: set[int], depth: int = 0) -> Iterator[Any]:
  """The Python functions a transformation is made of, through its closures.

  A transformation's ``init`` and ``update`` are closures over its
  hyperparameters and the transformations it wraps (``optax.chain``,
  ``optax.inject_hyperparams``, ``optax.MultiSteps``, ...): following the
  closure cells, partials, bound methods of optax's and our classes, and
  tuples, lists and dicts reaches the functions of every transformation
  inside, built by factories such as :func:`jmp_train.stochastic_rounding`.
  Arrays and other values are not entered.
  """
  if depth > 16 or id(obj) in seen:
    return
  seen.add(id(obj))
  children: tuple[Any, ...] = ()
  if isinstance(obj, functools.partial):
    children = (obj.func, *obj.args, *obj.keywords.values())
  elif inspect.ismethod(obj):
    owner = type(obj.__self__).__module__.split(".")[0]
    children = (obj.__func__,)
    if owner in ("optax", "jmp_train"):
      children += tuple(vars(obj.__self__).values()) if hasattr(obj.__self__, "__dict__") else ()
  elif inspect.isfunction(obj):
    yield obj
    cells = []
    for cell in obj.__closure__ or ():
      try:
        cells.append(cell.cell_contents)
      except ValueError:  # an empty cell
        pass
    children = (*cells, getattr(obj, "__wrapped__", None))
  elif isinstance(obj, (tuple, list)):
    children = tuple(obj)
  elif isinstance(obj, dict):
    children = tuple(obj.values())
  for child in children:
    yield from _functions(child, seen, depth + 1)


def _parts(*transformations: Any) -> list[Any]:
  seen: set[int] = set()
  return [
    f
    for tx in transformations
    if tx is not None
    for f in _functions((getattr(tx, "init", None), getattr(tx, "update", None)), seen)
  ]


def has_narrow_weights_rule(*transformations: Any) -> bool:
  """Whether one of the library's narrow-weights rules is among ``transformations``.

  Recognised by the module of the functions the transformation is built
  from (:func:`jmp_train.stochastic_rounding`,
  :func:`jmp_train.kahan_compensation`,
  :func:`jmp_train.modified_momentum_sgd`), wrapped or chained in any way
  optax composes transformations.
  """
  return any(f.__module__ in _NARROW_WEIGHT_RULE_MODULES for f in _parts(*transformations))


def _describe(tx: Any) -> str:
  """The factories a transformation was built with, e.g. ``scale_by_adam, scale``."""
  names = []
  for f in _parts(tx):
    # A closure made by a factory, or a factory itself (inject_hyperparams').
    head = f.__qualname__.split(".<locals>")[0]
    factory = head != f.__qualname__ or (
      f.__module__.split(".")[0] in ("optax", "jmp_train") and not head.startswith("_")
    )
    if factory and head not in _WRAPPERS and head not in names:
      names.append(head)
  return "built from " + (", ".join(names[:4]) or type(tx).__name__)


def warn_half_weights_without_narrow_rule(policy: Any, optimizer: Any, compression: Any) -> None:
  """A ``UserWarning`` when half-precision weights have no rule to keep small updates.

  With ``policy.param_dtype`` float16 or bfloat16 (no float32 master
  weights), round to nearest returns ``w`` unchanged for an update ``u``
  with ``|u| < |w|·2^-11`` (float16; ``2^-8`` in bfloat16): a plain optax
  optimizer then stops moving the weights where float32 ones go on. Silent
  when ``optimizer`` or ``compression`` holds one of the library's
  narrow-weights rules (:func:`has_narrow_weights_rule`). A rule of one's
  own is not recognised: filter the warning
  (``warnings.filterwarnings("ignore", "Half-precision parameters")``).
  """
  dtype = np.dtype(policy.param_dtype)
  if dtype not in (np.dtype(jnp.float16), np.dtype(jnp.bfloat16)):
    return
  if has_narrow_weights_rule(optimizer, compression):
    return
  bits = 11 if dtype == np.dtype(jnp.float16) else 8
  used = " and ".join(_describe(t) for t in (compression, optimizer) if t is not None)
  warnings.warn(
    f"Half-precision parameters ({dtype.name}, policy {policy}) with an optimizer that "
    f"has no narrow-weights rule ({used}): updates smaller than about |w|*2**-{bits} "
    f"round away in {dtype.name}, so the weights stop moving where float32 ones go on. "
    "Chain a rule last, e.g. optax.chain(optimizer, jmp_train.stochastic_rounding(seed=0)) "
    "or optax.chain(optimizer, jmp_train.kahan_compensation()), or use "
    "jmp_train.modified_momentum_sgd(...) for float16 weights; or keep float32 "
    "parameters with policy='mixed_float16' or 'mixed_bfloat16'. See the guide on "
    "narrow weights and optimizer state.",
    UserWarning,
    stacklevel=3,
  )


def _dtype_name(dtype: Any) -> str | None:
  try:
    return jnp.dtype(dtype).name
  except TypeError:
    return None


def check_arguments(
  loss_fn, optimizer, compression, mode, grad_reduce_dtype, bucket_bytes=buckets.DEFAULT_BUCKET_BYTES, **options
) -> None:
  """Validation in one place: TypeError/ValueError naming the bad value."""
  if not callable(loss_fn):
    raise TypeError(
      f"loss_fn must be callable as loss_fn(outputs, targets), got {type(loss_fn).__name__}: {loss_fn!r}."
    )
  _check_transformation("optimizer", optimizer, allow_none=compression is not None)
  _check_transformation("compression", compression, allow_none=True)
  _check_optimizer_slot(optimizer, compression)
  if mode not in MODES:
    raise ValueError(f"Unknown mode {mode!r}; valid modes: {', '.join(MODES)}.")
  if compression is not None and mode == "single":
    raise ValueError(
      "compression averages gradients across replicas, so it needs mode 'pmap' or 'shard_map', not 'single'."
    )
  if grad_reduce_dtype is not None and _dtype_name(grad_reduce_dtype) not in _REDUCE_DTYPES:
    raise ValueError(
      f"grad_reduce_dtype {grad_reduce_dtype!r} is not supported; valid: None, {', '.join(_REDUCE_DTYPES)}."
    )
  buckets.check_bucket_bytes(bucket_bytes)
  _check_options(**options)


def _check_options(
  axis_name="batch", has_aux=False, cast_params=True, donate=True, rng_collections=("dropout",), remat_policy=None
) -> None:
  if not isinstance(axis_name, str):
    raise ValueError(f"axis_name must be a string, got {axis_name!r}.")
  for name, value in (("has_aux", has_aux), ("cast_params", cast_params), ("donate", donate)):
    check_bool(value, name)
  if isinstance(rng_collections, str) or not all(
    isinstance(c, str) for c in _iterable(rng_collections, "rng_collections")
  ):
    raise ValueError(
      f"rng_collections must be a sequence of collection names such as ('dropout',), got {rng_collections!r}."
    )
  if remat_policy is not None and not callable(remat_policy):
    raise TypeError(
      f"remat_policy must be None or a jax.checkpoint policy (a callable such as "
      f"jax.checkpoint_policies.dots_saveable), got {remat_policy!r}."
    )


def _iterable(value: Any, name: str) -> tuple:
  try:
    return tuple(value)
  except TypeError:
    raise ValueError(f"{name} must be a sequence, got {value!r}.") from None


def layout(mode: str, axis_name: str, mesh: Mesh | None) -> tuple[Mesh | None, int]:
  """The mesh (``shard_map`` only) and the number of data-parallel replicas."""
  if mode == "shard_map":
    if mesh is None:
      mesh = Mesh(np.asarray(jax.devices()), (axis_name,))
    if axis_name not in mesh.axis_names:
      raise ValueError(f"axis_name {axis_name!r} is not an axis of the mesh; mesh axes: {mesh.axis_names}.")
    return mesh, mesh.shape[axis_name]
  if mesh is not None:
    raise ValueError(f"mesh is only used with mode='shard_map', not {mode!r}.")
  return None, jax.device_count() if mode == "pmap" else 1


def compose(optimizer, compression, loss_scale, axis):
  """``loss_scaled(chain(compression, optimizer))``, parts left out when None.

  Returns:
    The transformation and the :class:`LossScalingFns` (``None`` without
    loss scaling).
  """
  parts = [t for t in (compression, optimizer) if t is not None]
  tx = optax.with_extra_args_support(parts[0] if len(parts) == 1 else optax.chain(*parts))
  if loss_scale is None:
    return tx, None
  # Imported here: a step without loss scaling does not need the modules.
  from jmp_train._src.loss_scaling import lookup as loss_scale_lookup
  from jmp_train._src.loss_scaling import wrapper as loss_scaling
  from jmp_train._src.loss_scaling import scaled_grad

  fns = LossScalingFns(
    get_loss_scale=loss_scale_lookup.get_loss_scale,
    scaled_value_and_grad=scaled_grad.scaled_value_and_grad,
    loss_scale_metrics=loss_scale_lookup.loss_scale_metrics,
  )
  return loss_scaling.loss_scaled(tx, loss_scale, axis_name=axis), fns
