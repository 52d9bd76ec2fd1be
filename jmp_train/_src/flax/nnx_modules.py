"""Dtype policies on Flax NNX modules; see :func:`jmp_train.flax.apply_policy`.

NNX layers are created eagerly with their fields as plain attributes, read
at call time: a copy of the model whose layers get the policy's fields and
whose parameters are cast to ``param_dtype`` is the whole job.
"""

from __future__ import annotations

import copy
import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jmp_train._src.flax import layers as flax_layers
from jmp_train._src.fp8 import flax_layers as fp8_flax
from jmp_train._src.policy import policy as policy_lib

__all__ = ["Float32LookupEmbed", "NNXPolicyWrapper", "apply_policy_nnx", "configured_copy"]


class Float32LookupEmbed(nnx.Embed):
  """An ``nnx.Embed`` whose lookup gathers float32 rows, then casts them to ``dtype``.

  The same forward values as ``nnx.Embed``; the table's gradient (a
  scatter-add of one row per token of the batch) is accumulated in float32
  rather than in a half-precision ``dtype``, where a row shared by
  thousands of tokens would keep few of their bits. ``attend`` is
  ``nnx.Embed``'s: a matmul in ``dtype``. :func:`apply_policy` gives
  this class to the ``nnx.Embed`` layers of its copy of the model (the same
  variables, and every reference to a layer, such as a tied output head,
  sees it).

  Examples:
    >>> import jmp_train
    >>> from flax import nnx
    >>> model = jmp_train.flax.apply_policy(
    ...     nnx.Embed(16, 8, rngs=nnx.Rngs(0)), "p=f32,c=bf16,o=bf16")
    >>> type(model.module).__name__, model.module.embedding.dtype
    ('Float32LookupEmbed', dtype('float32'))
    >>> model(jnp.arange(4)).dtype
    dtype(bfloat16)
  """

  def __call__(self, inputs, *args, **kwargs):
    lookup = flax_layers.embedding_lookup_dtype(self.dtype)
    if lookup is None:
      return super().__call__(inputs, *args, **kwargs)
    # Flax's own lookup on a shallow copy with a float32 `dtype` (the same
    # variables): the layer itself is not changed, which NNX forbids under a trace.
    view = copy.copy(self)
    object.__setattr__(view, "dtype", lookup)
    return policy_lib.cast_floating(nnx.Embed.__call__(view, inputs, *args, **kwargs), self.dtype)


class NNXPolicyWrapper(nnx.Module):
  """An NNX module under a dtype policy; see :func:`apply_policy`.

  Calling it casts the floating inputs to the compute dtype (when
  ``cast_inputs``), calls ``module`` (a policy-configured copy of the
  caller's module), and casts the floating outputs to ``output_dtype``.
  The variables live under ``module``.

  Attributes:
    module: the policy-configured module.
    policy: the :class:`~jmp_train.Policy` (static).
    cast_inputs: cast the floating inputs to the compute dtype on entry.
    recompute: ``"float32"`` or ``None``, as in :func:`apply_policy`.
  """

  def __init__(
    self, module: nnx.Module, policy: policy_lib.Policy, cast_inputs: bool, recompute: str | None = "float32"
  ):
    self.module = module
    self.policy = policy
    self.cast_inputs = cast_inputs
    self.recompute = flax_layers.check_recompute(recompute)

  def __call__(self, *args, **kwargs):
    policy, cast_inputs = self.policy, self.cast_inputs

    def run(module):
      # Cast inside, so that the half copy of a float32 batch is recomputed.
      a, k = policy.cast_to_compute((args, kwargs)) if cast_inputs else (args, kwargs)
      return module(*a, **k)

    remat_policy = flax_layers.remat_policy(policy, self.recompute)
    if remat_policy is None:
      return policy.cast_to_output(run(self.module))
    # jax.checkpoint on the module's state, split and merged by hand (the
    # arguments closed over: non-array ones stay Python values); the state
    # the call changed (batch statistics, RNG counts) is written back.
    graphdef, state = nnx.split(self.module)
    out, changed = jax.checkpoint(functools.partial(_run_nnx, run, graphdef), policy=remat_policy)(state)
    nnx.update(self.module, changed)
    return policy.cast_to_output(out)


def _run_nnx(run, graphdef, state):
  """``run`` on the merged module; its output and the state it changed."""
  # The values before the call, by identity: the module may update the very
  # Variable objects of `state` in place.
  before = {path: jax.tree.leaves(var) for path, var in nnx.to_flat_state(state)}
  module = nnx.merge(graphdef, state)
  out = run(module)
  changed = [
    (path, var)
    for path, var in nnx.to_flat_state(nnx.state(module))
    if path not in before or any(a is not b for a, b in zip(jax.tree.leaves(var), before[path]))
  ]
  return out, nnx.from_flat_state(changed)


def apply_policy_nnx(
  module: nnx.Module,
  policy: policy_lib.Policy,
  float32_modules: tuple[type, ...],
  float32_paths: tuple[str, ...],
  cast_inputs: bool,
  recompute: str | None,
) -> NNXPolicyWrapper:
  model = configured_copy(module, policy, float32_modules, float32_paths)
  return NNXPolicyWrapper(model, policy, cast_inputs, recompute)


def configured_copy(
  module: nnx.Module,
  policy: policy_lib.Policy,
  float32_modules: tuple[type, ...] = flax_layers.DEFAULT_FLOAT32_MODULES,
  float32_paths: tuple[str, ...] = (),
) -> nnx.Module:
  """A copy of ``module`` whose layers carry ``policy`` (no wrapper around it).

  The copy has the same ``nnx.Param`` paths as ``module`` (cast to
  ``param_dtype``); with an FP8 policy its products gain ``Fp8Meta``
  variables.
  """
  # NNX layers are created eagerly with their fields as plain attributes,
  # read at call time: a deep copy (`nnx.clone`, so the caller's module is
  # untouched) whose layers get new attributes and whose parameters are
  # cast to `param_dtype` is the whole job. Batch statistics stay float32.
  model = nnx.clone(module)
  modules = dict(nnx.iter_modules(model))
  f32_paths = set()
  for path, m in modules.items():
    if isinstance(m, float32_modules) or flax_layers.path_matches(path, float32_paths):
      f32_paths.add(path)
  for path, m in modules.items():
    in_f32 = any(path[:i] in f32_paths for i in range(len(path) + 1))
    dtype = flax_layers.F32 if in_f32 else policy.compute_dtype
    attrs = set(vars(m))
    for name, value in flax_layers.layer_overrides(
      attrs, lambda name: getattr(m, name), dtype, policy.param_dtype
    ).items():
      setattr(m, name, value)
    if not in_f32:
      for name, value in fp8_flax.nnx_fp8_attributes(m, policy.fp8).items():
        setattr(m, name, value)
      if type(m) is nnx.Embed:  # every reference to the layer (tied heads) sees it
        object.__setattr__(m, "__class__", Float32LookupEmbed)
  params = nnx.state(model, nnx.Param)
  nnx.update(model, jax.tree.map(functools.partial(_cast_param, policy), params))
  return model


def _cast_param(policy: policy_lib.Policy, x: Any) -> Any:
  # Abstract models (`nnx.eval_shape`) hold ShapeDtypeStructs: cast those too.
  if isinstance(x, jax.ShapeDtypeStruct):
    if jnp.issubdtype(x.dtype, jnp.floating):
      return jax.ShapeDtypeStruct(x.shape, policy.param_dtype, sharding=x.sharding)
    return x
  return policy.cast_to_param(x)
