"""Activation memory per dtype policy: residuals of ``jax.vjp`` and XLA's plan.

For each model (an MLP, a small ResNet, a one-layer Transformer language
model: ``jmp_train_examples.models``) under each policy (``float32``;
``mixed_float16`` and ``mixed_bfloat16``: float32 parameters, half-precision
compute, float32 output), applied with :func:`jmp_train.flax.apply_policy`
(so normalization layers and the attention softmax stay in float32), two
figures for one training step:

* **Residual bytes**: the arrays ``jax.vjp`` keeps for the backward pass of
  the loss, read from the closure of the VJP function in its jaxpr (the same
  inspection as ``jax.ad_checkpoint.print_saved_residuals``). They do not
  depend on the backend. Residuals that *are* an argument (the float32
  parameters, the input batch) cost no memory beyond what the caller holds
  and are counted apart (``argument_residual_bytes``), as are broadcast
  constants (never stored by XLA). ``residual_bytes`` is everything else
  the forward pass computed and keeps alive until the backward pass:
  activations plus ``cast_copy_bytes``, the half-precision copies of the
  float32 weights (and of a float32 input batch) that the backward matmuls
  read. ``residual_ratio`` is over the float32 row of the same model (and
  remat setting, see below); the target is mixed <= 0.55x. ``activation_ratio`` is the
  same ratio without the cast copies.
* **Compiled step**: ``memory_analysis()`` of the jitted train step (loss,
  ``value_and_grad``, an SGD update; parameters donated): XLA's temp
  (scratch) bytes, where the residuals live during the step, and argument
  bytes. Backend-specific: XLA:CPU may run half-precision matmuls and
  convolutions in float32 internally, and temp bytes are the peak of the
  whole step (gradients included), so on CPU ``temp_ratio`` need not follow
  the residuals; read it from a GPU run.

Each model is measured four ways:

* ``remat="default"``: :func:`jmp_train.flax.apply_policy` as it comes
  (``recompute="float32"``: the model under ``jax.checkpoint`` with
  half-precision values saved and casts, float32 regions and masks
  recomputed); ratios over the float32 row with ``"none"`` (under float32
  the default recomputes nothing). This is the target's row: mixed <= 0.55x.
* ``remat="none"``: ``apply_policy(..., recompute=None)``, what JAX saves
  by default; ratios over the float32 row with ``"none"``. Under a mixed policy this includes float32 values (the
  float32 regions: normalizations, the attention softmax, the loss's
  logits), the half-precision copies of the float32 weights, and boolean
  masks, so the ratio stays above one half.
* ``remat="dots"``: ``recompute=None`` and the model under ``jax.checkpoint`` with
  ``jax.checkpoint_policies.dots_saveable``, which saves only matmul and
  convolution outputs (in the compute dtype) and recomputes the rest; ratios
  over the float32 row with ``"dots"``: the same recomputation on both
  sides, so the ratio is the dtype's effect alone.
* ``remat="half"``: ``recompute=None`` and the mixed policies under
  ``jax.checkpoint`` with :func:`jmp_train.half_precision_saveable` applied
  by hand around the whole forward pass: the default's rule from outside,
  a cross-check that should give the default's figures; ratios over the
  float32 row with ``"none"`` (a float32 model has no half-precision values, so that
  policy would recompute everything: no float32 row of its own).

Nothing is executed: the jaxprs are traced and the steps compiled, so even
the full sizes take seconds per row. ``quick=True`` uses tiny models and
compiles only the MLP's plain step (a smoke test; its figures mean little).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import _harness
from jmp_train_examples import models
from jmp_train import Policy, get_policy, half_precision_saveable
from jmp_train.diagnostics import saved_residuals
from jmp_train.flax import apply_policy

NAME = "activation_memory"
COLUMNS = (
  "model",
  "remat",
  "policy",
  "params",
  "residual_bytes",
  "residual_ratio",
  "cast_copy_bytes",
  "activation_ratio",
  "half_residual_share",
  "temp_bytes",
  "temp_ratio",
  "argument_bytes",
  "meets_target",
)
POLICIES = ("float32", "mixed_float16", "mixed_bfloat16")
TARGET_RATIO = 0.55
# remat -> (apply_policy's `recompute`, a checkpoint policy around the model).
REMATS = {
  "default": ("float32", None),
  "none": (None, None),
  "dots": (None, jax.checkpoint_policies.dots_saveable),
  "half": (None, half_precision_saveable),
}


@dataclasses.dataclass(frozen=True)
class _Case:
  """A model (from ``jmp_train_examples.models``) and its batch's shapes."""

  name: str
  module: nn.Module
  inputs: jax.ShapeDtypeStruct  # the batch's features (or tokens)
  labels: jax.ShapeDtypeStruct
  train_kwargs: tuple[tuple[str, Any], ...] = ()  # extra apply() arguments


def _cases(quick: bool) -> list[_Case]:
  if quick:
    mlp = dict(batch=4, features=16, hidden=(32, 32), classes=8)
    conv = dict(batch=2, size=8, stages=(8, 16), classes=8)
    tfm = dict(batch=2, seq=8, vocab=32, d_model=32, heads=2, mlp=64)
  else:
    mlp = dict(batch=256, features=784, hidden=(1024, 1024, 1024), classes=16)
    conv = dict(batch=32, size=32, stages=(64, 128), classes=16)
    tfm = dict(batch=8, seq=256, vocab=256, d_model=256, heads=8, mlp=1024)
  f32, i32 = jnp.float32, jnp.int32
  hidden = "-".join(map(str, mlp["hidden"]))
  return [
    _Case(
      name=f"MLP {mlp['features']}-{hidden}-{mlp['classes']} b{mlp['batch']}",
      module=models.MLP(features=mlp["hidden"], num_classes=mlp["classes"]),
      inputs=jax.ShapeDtypeStruct((mlp["batch"], mlp["features"]), f32),
      labels=jax.ShapeDtypeStruct((mlp["batch"],), i32),
    ),
    _Case(
      name=(f"ResNet {'-'.join(map(str, conv['stages']))}ch {conv['size']}x{conv['size']} b{conv['batch']}"),
      module=models.ResNet(num_classes=conv["classes"], stage_features=conv["stages"]),
      inputs=jax.ShapeDtypeStruct((conv["batch"], conv["size"], conv["size"], 3), f32),
      labels=jax.ShapeDtypeStruct((conv["batch"],), i32),
      train_kwargs=(("train", True), ("mutable", ("batch_stats",))),
    ),
    _Case(
      name=f"Transformer d{tfm['d_model']} h{tfm['heads']} s{tfm['seq']} b{tfm['batch']}",
      module=models.TransformerBlock(
        vocab_size=tfm["vocab"],
        d_model=tfm["d_model"],
        num_heads=tfm["heads"],
        mlp_dim=tfm["mlp"],
        num_layers=1,
        max_len=tfm["seq"],
      ),
      inputs=jax.ShapeDtypeStruct((tfm["batch"], tfm["seq"]), i32),
      labels=jax.ShapeDtypeStruct((tfm["batch"], tfm["seq"]), i32),
    ),
  ]


def _cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
  logp = jax.nn.log_softmax(logits.astype(jnp.float32))
  return -jnp.mean(jnp.take_along_axis(logp, labels[..., None], axis=-1))


def measure(
  case: _Case, policy: Policy, remat: str = "none", *, compile_step: bool = True, compiler_options=None
) -> dict[str, Any]:
  """The figures for one model under one policy (see the module docstring).

  Args:
    case: the model and its input shapes.
    policy: the dtype policy.
    remat: ``"default"`` (``apply_policy`` as it comes: its
      ``recompute="float32"``), ``"none"`` (``recompute=None``: JAX saves
      what it saves), ``"dots"`` (``recompute=None``, the model under
      ``jax.checkpoint(policy=dots_saveable)``: only matmul and convolution
      outputs are saved, everything else is recomputed) or ``"half"``
      (``recompute=None``, under
      ``jax.checkpoint(policy=half_precision_saveable)``).
    compile_step: also compile the train step for ``memory_analysis()``
      (XLA's ``*_bytes`` are ``None`` otherwise).
    compiler_options: the XLA options of that compilation (``None``: XLA's).

  Returns:
    One record.

  Raises:
    ValueError: for an unknown ``remat``.
  """
  if remat not in REMATS:
    raise ValueError(f"Unknown remat {remat!r}; valid: {', '.join(REMATS)}.")
  recompute, checkpoint_policy = REMATS[remat]
  model = apply_policy(case.module, policy, recompute=recompute)
  x, labels = case.inputs, case.labels
  variables = jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.zeros(x.shape, x.dtype)))
  params = variables["params"]
  state = {k: v for k, v in variables.items() if k != "params"}
  kwargs = dict(case.train_kwargs)

  def forward(params, state, x):
    out = model.apply({"params": params, **state}, x, **kwargs)
    return out if "mutable" in kwargs else (out, state)

  if checkpoint_policy is not None:
    forward = jax.checkpoint(forward, policy=checkpoint_policy)

  def loss_fn(params, state, x, labels):
    logits, new_state = forward(params, state, x)
    return _cross_entropy(logits, labels), new_state

  res = saved_residuals(loss_fn, params, state, x, labels)
  kept = [r.shape_dtype for r in res if r.kind in ("activation", "cast_copy")]
  residual_bytes = _harness.tree_bytes(kept)
  cast_copy_bytes = _harness.tree_bytes([r.shape_dtype for r in res if r.kind == "cast_copy"])
  record = {
    "model": case.name,
    "policy": _policy_name(policy),
    "remat": remat,
    "params": int(sum(np.prod(p.shape) for p in jax.tree.leaves(params))),
    "residual_bytes": residual_bytes,
    "cast_copy_bytes": cast_copy_bytes,
    "activation_bytes": residual_bytes - cast_copy_bytes,
    "half_residual_share": _harness.tree_bytes([s for s in kept if s.dtype.itemsize == 2]) / max(residual_bytes, 1),
    "argument_residual_bytes": _harness.tree_bytes([r.shape_dtype for r in res if r.kind == "argument"]),
    "residual_arrays": len(kept),
  }

  memory = dict.fromkeys(("temp_bytes", "argument_bytes", "output_bytes", "alias_bytes"))
  if compile_step:

    def step(params, state, x, labels):
      (loss, state), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, state, x, labels)
      params = jax.tree.map(lambda p, g: p - 0.01 * g.astype(p.dtype), params, grads)
      return params, state, loss

    lowered = jax.jit(step, donate_argnums=(0, 1)).lower(params, state, x, labels)
    compiled = lowered.compile(compiler_options)
    memory = _harness.compiled_memory(compiled)
  for key in ("temp_bytes", "argument_bytes", "output_bytes", "alias_bytes"):
    record[key] = memory[key]
  return record


def _policy_name(policy: Policy) -> str:
  for name in POLICIES:
    if get_policy(name) == policy:
      return name
  return str(policy)


def _ratio(num: int | None, den: int | None) -> float | None:
  if num is None or not den:
    return None
  return num / den


def run(quick: bool) -> list[dict[str, Any]]:
  """One record per (model, remat, policy), with ratios to float32.

  Args:
    quick: tiny models, and only the MLP's step compiled (a smoke test; the
      figures are then not meaningful).

  Returns:
    The records. ``residual_ratio``, ``activation_ratio`` and
    ``temp_ratio`` are this row's bytes over those of the float32 row with
    the same model and remat (``"none"`` for the ``"default"`` and
    ``"half"`` rows);
    ``meets_target`` says whether
    ``residual_ratio <= 0.55`` (``None`` on the float32 rows).
  """
  records = []
  for i, case in enumerate(_cases(quick)):
    base_by_remat = {}
    for remat in ("none", "default", "dots", "half"):
      compile_step = not quick or (i == 0 and remat == "none")
      # A float32 model has nothing to save under half_precision_saveable
      # (and apply_policy's default recomputes nothing under float32): the
      # "default" and "half" rows compare with float32 as JAX runs it.
      names = POLICIES[1:] if remat in ("default", "half") else POLICIES
      kw = dict(compile_step=compile_step, compiler_options=_harness.compile_options(quick))
      rows = [measure(case, get_policy(name), remat, **kw) for name in names]
      if remat in ("default", "half"):
        base = base_by_remat["none"]
      else:
        base = base_by_remat[remat] = rows[0]
      for row in rows:
        row["residual_ratio"] = _ratio(row["residual_bytes"], base["residual_bytes"])
        row["activation_ratio"] = _ratio(row["activation_bytes"], base["activation_bytes"])
        row["temp_ratio"] = _ratio(row["temp_bytes"], base["temp_bytes"])
        row["meets_target"] = row["residual_ratio"] <= TARGET_RATIO if row is not base else None
        records.append(row)
  return records
