"""Dtype policies on Flax modules, linen and NNX.

:func:`apply_policy` makes a model built from standard Flax layers compute in
the policy's ``compute_dtype`` while its parameters stay in ``param_dtype``
and its fragile numerics stay in float32, using Flax's own mechanisms:

* every layer's ``dtype`` (computation) and ``param_dtype`` (storage) fields;
* ``force_float32_reductions`` of the linen norms (float32 statistics and
  float32 batch statistics; the NNX norms always reduce in float32);
* the layers' ``attention_fn`` hook, set to :func:`dot_product_attention`,
  which runs both attention matmuls in the compute dtype and the softmax in
  float32, through cuDNN's fused kernel where it is available (see the
  function for why Flax's ``force_fp32_for_softmax`` is not enough on its
  own).
* embedding lookups that gather float32 rows and cast them to the compute
  dtype, so that the table's gradient, a sum over the batch's tokens, is
  accumulated in float32 (``Embed.__call__`` runs with a float32 ``dtype``
  and its output is cast; NNX: :class:`Float32LookupEmbed`).

Modules kept in float32 (by class, :data:`DEFAULT_FLOAT32_MODULES`, or by
path) run entirely in float32: their floating inputs are cast to float32 on
entry, their layers get ``dtype=float32``, and their outputs are float32; the
next half-precision layer casts its inputs itself.

References:
  Micikevicius et al., "Mixed Precision Training", ICLR 2018.
  https://arxiv.org/abs/1710.03740
"""

from __future__ import annotations

from typing import Any, Sequence

import flax.linen as nn
from flax import nnx

from jmp_train._src.flax import layers as flax_layers
from jmp_train._src.flax import nnx_modules as flax_nnx
from jmp_train._src.fp8 import flax_layers as fp8_flax
from jmp_train._src.policy import policy as policy_lib
from jmp_train._src.flax.layers import DEFAULT_FLOAT32_MODULES
from jmp_train._src.flax.nnx_modules import Float32LookupEmbed
from jmp_train._src.flax.nnx_modules import NNXPolicyWrapper
from jmp_train._src.hyperparams import check_bool

__all__ = [
  "DEFAULT_FLOAT32_MODULES",
  "Float32LookupEmbed",
  "apply_policy",
  "LinenPolicyWrapper",
  "NNXPolicyWrapper",
]

# --------------------------------------------------------------------------
# Linen.
# --------------------------------------------------------------------------


class LinenPolicyWrapper(nn.Module):
  """A linen module run under a dtype policy; see :func:`apply_policy`.

  The wrapped module shares this module's scope (``nn.share_scope``), so the
  variables are exactly those of the unwrapped module: checkpoints load into
  either.

  Attributes:
    module: the wrapped linen module.
    policy: the :class:`~jmp_train.Policy`.
    float32_modules: module classes run in float32.
    float32_paths: glob patterns of module paths run in float32.
    cast_inputs: cast the floating inputs to the compute dtype on entry.
    recompute: ``"float32"`` (recompute float32 values and casts in the
      backward pass, keep the half-precision ones) or ``None``.
    dtype: the policy's compute dtype (read-only), as a Flax layer's
      ``dtype``: code that reads ``model.dtype``, as Flax's examples do,
      sees the dtype the wrapped module computes in.
    param_dtype: the policy's parameter dtype (read-only), as a Flax
      layer's ``param_dtype``.
  """

  module: nn.Module
  policy: policy_lib.Policy
  float32_modules: tuple[type, ...] = DEFAULT_FLOAT32_MODULES
  float32_paths: tuple[str, ...] = ()
  cast_inputs: bool = True
  recompute: str | None = "float32"

  # Properties, not fields: fields would change the module's signature
  # (and its clones); the variables stay those of the wrapped module.
  @property
  def dtype(self) -> Any:
    return self.policy.compute_dtype

  @property
  def param_dtype(self) -> Any:
    return self.policy.param_dtype

  def setup(self):
    nn.share_scope(self, self.module)

  def __call__(self, *args, **kwargs):
    if flax_layers.remat_policy(self.policy, self.recompute) is None:
      out = self._run(args, kwargs)
    else:
      # Lifted (nn.checkpoint), so that parameters, mutable collections and
      # RNGs pass into the checkpointed function; the arguments are closed
      # over (non-array arguments such as `train=True` stay Python values),
      # and cast inside, so that the half copy of a float32 batch is
      # recomputed too.
      run = nn.checkpoint(
        lambda wrapper: wrapper._run(args, kwargs),
        policy=flax_layers.remat_policy(self.policy, self.recompute),
      )
      out = run(self)
    return self.policy.cast_to_output(out)

  def _run(self, args, kwargs):
    if self.cast_inputs:
      args, kwargs = self.policy.cast_to_compute((args, kwargs))
    with nn.intercept_methods(self._interceptor):
      return self.module(*args, **kwargs)

  @nn.nowrap
  def _float32(self, module: nn.Module, root: tuple[Any, ...]) -> tuple[bool, bool]:
    """Whether a bound module runs in float32, and whether it is named itself.

    A module runs in float32 when it, or an ancestor up to the wrapped
    module, is an instance of ``float32_modules`` or has a path matching
    ``float32_paths``.
    """

    def named(m: nn.Module) -> bool:
      rel = tuple(m.scope.path)[len(root) :]
      return isinstance(m, self.float32_modules) or flax_layers.path_matches(rel, self.float32_paths)

    if named(module):
      return True, True
    node = module
    while tuple(node.scope.path) != root:
      node = node.parent
      if not isinstance(node, nn.Module) or node.scope is None:
        break
      if named(node):
        return True, False
    return False, False

  @nn.nowrap
  def _interceptor(self, next_fun, args, kwargs, context):
    # Why an interceptor that sets fields for the duration of each call:
    # linen submodules are usually created inside their parent's
    # `@nn.compact` method (`nn.Dense(8)(x)`), so cloning the top module with
    # new fields cannot reach them, and casting parameters from outside
    # (`nn.map_variables`, the Haiku way) would bypass Flax's own
    # `dtype`/`force_float32_reductions`/`attention_fn` mechanisms. Every
    # method call of every submodule (including `setup`) passes through
    # here while the wrapper runs, and layers read their fields at call
    # time, so giving the (bound, per-`apply`) instance the policy's fields
    # during the call, and restoring them afterwards, works for compact and
    # setup modules alike and leaves the variable tree unchanged.
    module = context.module
    root = tuple(self.scope.path)
    if module.scope is None or tuple(module.scope.path)[: len(root)] != root:
      return next_fun(*args, **kwargs)
    in_f32, named_f32 = self._float32(module, root)
    dtype = flax_layers.F32 if in_f32 else self.policy.compute_dtype
    fields = flax_layers.linen_field_names(module)
    overrides = flax_layers.layer_overrides(
      fields,
      lambda name: getattr(module, name),
      dtype,
      self.policy.param_dtype,
    )
    if not in_f32:
      overrides.update(fp8_flax.linen_fp8_fields(fields, self.policy.fp8))
    if named_f32 and context.method_name != "setup":
      # Float32 on entry: linen norms normalize their input as given (only
      # their statistics are promoted), so a half input would make them
      # mix dtypes (an error under strict promotion).
      args, kwargs = policy_lib.cast_floating((args, kwargs), flax_layers.F32)
    lookup = (
      flax_layers.embedding_lookup_dtype(dtype)
      if isinstance(module, nn.Embed) and context.method_name == "__call__"
      else None
    )
    if lookup is not None:  # gathered in float32, then cast: float32 gradient sums
      overrides["dtype"] = lookup
    saved = {name: getattr(module, name) for name in overrides}
    for name, value in overrides.items():
      object.__setattr__(module, name, value)
    try:
      out = next_fun(*args, **kwargs)
    finally:
      for name, value in saved.items():
        object.__setattr__(module, name, value)
    return out if lookup is None else policy_lib.cast_floating(out, dtype)


# --------------------------------------------------------------------------
# The entry point.
# --------------------------------------------------------------------------


def apply_policy(
  module: nn.Module | nnx.Module,
  policy: policy_lib.Policy | str,
  *,
  float32_modules: Sequence[type] = DEFAULT_FLOAT32_MODULES,
  float32_paths: Sequence[str] = (),
  cast_inputs: bool = True,
  recompute: str | None = "float32",
) -> LinenPolicyWrapper | NNXPolicyWrapper:
  """Runs a Flax (linen or NNX) module under a mixed-precision policy.

  For a model built from standard Flax layers (``Dense``/``Linear``,
  ``Conv``, ``Embed``, ``BatchNorm``, ``LayerNorm``, ``RMSNorm``,
  ``GroupNorm``, multi-head attention, ``Dropout``, and any module with
  Flax's ``dtype``/``param_dtype`` fields):

  * parameters are created (linen) or cast (NNX) and stored in
    ``policy.param_dtype``; batch statistics stay float32;
  * every matmul and convolution of the forward and backward pass runs in
    ``policy.compute_dtype`` (the layers' ``dtype``);
  * modules in ``float32_modules`` (default: the normalization layers) and
    modules whose path matches ``float32_paths`` run in float32, together
    with their submodules: inputs cast to float32 on entry, ``dtype``
    float32, float32 outputs;
  * attention runs :func:`dot_product_attention` (softmax in float32) in
    place of Flax's default ``attention_fn``;
  * ``Embed`` lookups gather float32 rows and cast them to
    ``compute_dtype``: the same values as a lookup in ``compute_dtype``,
    while the table's gradient (a scatter-add of one row per token) is
    summed in float32, not in a half-precision dtype that would keep few
    bits of a row shared by thousands of tokens; ``attend`` (a tied
    output head) is a matmul in ``compute_dtype``;
  * with an FP8 policy (``policy.fp8``, e.g. ``"mixed_float8"``), the
    products of ``Dense``/``DenseGeneral``/``Conv`` (linen) and
    ``Linear``/``LinearGeneral``/``Conv`` (NNX) outside the float32 modules
    run in FP8 (:func:`jmp_train.fp8_dot_general`), each with its scaling
    state in the ``"fp8_meta"`` collection (linen) or in
    :class:`jmp_train.flax.Fp8Meta` variables (NNX): differentiate with
    respect to it and store :func:`jmp_train.update_fp8_meta` of the result;
  * floating inputs are cast to ``compute_dtype`` on entry (``cast_inputs``),
    and floating outputs to ``policy.output_dtype``, so the loss is computed
    in float32 with a float32 output dtype;
  * gradients with respect to the parameters come back in ``param_dtype``;
  * with ``recompute="float32"`` (the default) and a half-precision compute
    dtype, the backward pass keeps only the half-precision values the
    forward pass computed (the matmul and convolution outputs, the
    half-precision activations) and recomputes the rest from them: the half
    copies of the float32 weights and of the batch (casts), the float32
    regions (normalizations, the softmax) and comparison masks. That is
    ``jax.checkpoint`` around the model with
    :func:`jmp_train.half_precision_saveable`'s rule (outputs of a fused
    attention kernel are kept as well); it holds the activation memory
    under half of float32's at the price of the recomputed elementwise and
    normalization work. ``recompute=None`` keeps what JAX keeps by default,
    which under a mixed policy includes a half copy of every float32
    weight.

  Integer inputs (token ids, labels) pass through untouched. Layers' own
  ``dtype`` settings are overridden: to keep a layer in float32, name it in
  ``float32_paths``. A layer kept in float32 that reads the model's raw
  input sees it already rounded to ``compute_dtype`` unless
  ``cast_inputs=False`` (the other layers cast their inputs themselves).

  Linen: returns a :class:`LinenPolicyWrapper`, a linen module with the usual
  ``init``/``apply`` and exactly the wrapped module's variables (shared
  scope). Each layer gets the policy's fields while it runs, through
  ``nn.intercept_methods``; ``module`` itself is not changed.

  NNX: returns an :class:`NNXPolicyWrapper` around a copy (``nnx.clone``) of
  ``module`` whose layers have the policy's ``dtype``/``param_dtype`` and
  attention function, whose ``nnx.Embed`` layers are
  :class:`Float32LookupEmbed` (the same variables; a subclass of
  ``nnx.Embed`` keeps its own lookup, in ``compute_dtype``) and whose
  ``nnx.Param`` values are cast to ``param_dtype``; the caller's module is
  not changed (the copy shares array buffers where no cast was needed, so
  do not donate both to ``jit``).
  NNX has no method interceptors: the layers of a float32 module cast their
  inputs themselves (Flax's ``promote_dtype``), but a custom module's own
  code (outside its layers) sees its inputs as given. An abstract model
  (``nnx.eval_shape``) works too: its parameter shapes take the new dtype.

  Paths are '/'-joined attribute names (NNX, e.g. ``"blocks/0/conv"``) or
  module names (linen, e.g. ``"Dense_0"`` or an explicit ``name=``), relative
  to ``module``, matched with shell-style globs (``fnmatch``): ``"head"``,
  ``"stem*"``, ``"*/attn"``. A match covers the module's submodules.

  Args:
    module: a ``flax.linen.Module`` or ``flax.nnx.Module``.
    policy: a :class:`~jmp_train.Policy` or a spec for
      :func:`~jmp_train.get_policy`, e.g. ``"mixed_bfloat16"``.
    float32_modules: module classes run in float32.
    float32_paths: path patterns of modules run in float32, e.g.
      ``("stem", "head")`` to keep the first convolution and the classifier
      head in float32.
    cast_inputs: cast the model's floating inputs to the compute dtype.
    recompute: ``"float32"`` or ``None`` (see above).

  Returns:
    The wrapped module.

  Raises:
    ValueError: if ``module`` is not a Flax module, ``policy`` is not a
      valid policy or spec, the overrides are malformed, ``cast_inputs`` is
      not a bool, ``recompute`` is not one of ``("float32", None)``, or the
      policy runs int8 products (which no Flax layer does: use
      :func:`jmp_train.autocast`).

  Examples:
    >>> import flax.linen as nn
    >>> model = apply_policy(nn.Dense(8), "mixed_bfloat16")
    >>> variables = model.init(jax.random.key(0), jnp.ones((2, 4)))
    >>> variables["params"]["kernel"].dtype
    dtype('float32')
    >>> model.apply(variables, jnp.ones((2, 4))).dtype
    dtype('float32')

  References:
    Micikevicius et al., "Mixed Precision Training", ICLR 2018.
    https://arxiv.org/abs/1710.03740
  """
  if isinstance(policy, policy_lib.Policy):
    pass
  elif isinstance(policy, str):
    policy = policy_lib.get_policy(policy)
  else:
    raise ValueError(
      f"policy must be a jmp_train.Policy or a spec string such as "
      f"'mixed_bfloat16' or 'params=float32,compute=float16,output=float32', "
      f"got {policy!r}."
    )
  if policy.int8 is not None:
    raise ValueError(
      f"apply_policy configures Flax's layers, and no Flax layer runs int8 products: the policy "
      f"{policy} needs its products decided per operation. Use jmp_train.autocast(model.apply, "
      "policy), or make_train_step(model, ..., policy=...) with its default model_policy='auto'."
    )
  classes = flax_layers.check_float32_modules(float32_modules)
  paths = flax_layers.check_float32_paths(float32_paths)
  recompute = flax_layers.check_recompute(recompute)
  check_bool(cast_inputs, "cast_inputs")
  if isinstance(module, nn.Module):
    return LinenPolicyWrapper(
      module=module,
      policy=policy,
      float32_modules=classes,
      float32_paths=paths,
      cast_inputs=bool(cast_inputs),
      recompute=recompute,
    )
  if isinstance(module, nnx.Module):
    return flax_nnx.apply_policy_nnx(module, policy, classes, paths, bool(cast_inputs), recompute)
  if isinstance(module, type) and issubclass(module, (nn.Module, nnx.Module)):
    raise ValueError(
      f"apply_policy needs a module instance, got the class {module.__name__}; "
      f"construct it first, e.g. {module.__name__}(...)."
    )
  raise ValueError(
    f"apply_policy needs a flax.linen.Module or flax.nnx.Module instance, got {type(module).__name__}: {module!r}."
  )
