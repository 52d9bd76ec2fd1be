"""How far float16 gradients drift from float32 as the tokens per step grow.

The demo's character-level Transformer (``jmp-train``'s defaults: 1 layer,
width 64, sequences of 64 bytes) and its token-mean cross-entropy. The
gradient reaching a logit is ``(softmax - one_hot) / N`` for ``N`` tokens per
step, so every gradient of the network shrinks as ``1/N`` and, without loss
scaling, falls below float16's range (normal numbers from ``2**-14``,
subnormals down to ``2**-24``) once ``N`` is large enough. For ``N`` of 2k,
16k and 131k tokens (one batch each, the same weights), it compares the
gradients of the mixed float16 policy (``apply_policy(model,
"mixed_float16")``: float16 compute, float32 weights) with float32's:

* ``rel_err_f16``: ``||g16 - g32|| / ||g32||`` over all parameters, loss
  scale 1 (no scaling);
* ``rel_err_f16_scaled``: the same with the loss multiplied by ``2**15`` and
  the gradients divided by it in float32 (static loss scaling);
* ``rel_err_bf16``: the same for the mixed bfloat16 policy, loss scale 1
  (float32's range, three fewer mantissa bits than float16);
* ``worst_leaf`` / ``worst_leaf_rel_err``: the parameter whose unscaled
  float16 gradient is furthest from float32's, relative to its own norm
  (attention query and key biases are left out: their float32 gradient is
  zero up to rounding, a softmax is invariant to them);
* ``underflow_f16_logits``: the share of non-zero float32 gradients at the
  logits that flush to zero in float16 at scale 1.

Rows for the initial weights and for the weights after ``TRAIN_STEPS``
steps of the demo's float32 row (momentum SGD 0.9, its schedule).
``--quick``: a width-16 model, 1 training step, 64 tokens (a smoke test of
the code).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jmp_train
import jmp_train.flax
from benchmarks import _harness
from jmp_train_examples import demo_configs
from jmp_train_examples import demo_tasks

NAME = "gradient_underflow"
COLUMNS = (
  "weights",
  "tokens_per_step",
  "rel_err_f16",
  "rel_err_f16_scaled",
  "rel_err_bf16",
  "worst_leaf",
  "worst_leaf_rel_err",
  "underflow_f16_logits",
)
TRAIN_STEPS = 100
SCALE = 2.0**15
_SKIP = ("query", "key")  # attention biases whose exact gradient is zero


def _gradients(model, compiler_options=None):
  """``(params, batch, scale) ->`` the gradients of ``scale * loss``, divided by ``scale``."""

  @functools.partial(jax.jit, compiler_options=compiler_options)
  def grads(params, batch, scale):
    inputs, targets = batch
    loss = lambda p: scale * demo_tasks.loss_fn(model.apply({"params": p}, inputs), targets)[0]
    return jax.tree.map(lambda g: g.astype(jnp.float32) / scale, jax.grad(loss)(params))

  return grads


def _float32_gradients(model, compiler_options=None):
  """The float32 gradients and the share of logit gradients that flush in float16."""

  @functools.partial(jax.jit, compiler_options=compiler_options)
  def grads(params, batch):
    inputs, targets = batch
    logits, vjp = jax.vjp(lambda p: model.apply({"params": p}, inputs), params)
    g_logits = jax.grad(lambda z: demo_tasks.loss_fn(z, targets)[0])(logits)
    return vjp(g_logits)[0], jmp_train.diagnostics.underflow_fraction(g_logits, jnp.float16)

  return grads


def _rel(a, b) -> float:
  a, b = (np.concatenate([np.ravel(x) for x in jax.tree.leaves(t)]) for t in (a, b))
  return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def _worst_leaf(g16, g32) -> tuple[str, float]:
  errs = []
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(g16), jax.tree.leaves(g32)):
    name = "/".join(str(getattr(k, "key", k)) for k in path)
    if name.endswith("bias") and any(s in name for s in _SKIP):
      continue
    errs.append((float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)), name))
  err, name = max(errs)
  return name, err


def _train(task, params, s: demo_configs.DemoSettings, steps: int, compiler_options=None):
  tx = demo_configs.single_device_optimizer(demo_configs.CONFIGS["f32"], s)

  @functools.partial(jax.jit, compiler_options=compiler_options)
  def step(params, opt_state, batch):
    inputs, targets = batch
    loss = lambda p: demo_tasks.loss_fn(task.model.apply({"params": p}, inputs), targets)[0]
    updates, opt_state = tx.update(jax.grad(loss)(params), opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  opt_state = jax.jit(tx.init, compiler_options=compiler_options)(params)
  for i in range(steps):
    params, opt_state = step(params, opt_state, task.train_batch(i))
  return jax.device_get(params)


def run(quick: bool) -> list[dict]:
  s = demo_configs.DemoSettings(steps=TRAIN_STEPS, progress=False, plot=False)
  if quick:
    s = dataclasses.replace(s, d_model=16, seq_len=16, steps=1)
  options = _harness.compile_options(quick)
  task = demo_tasks.TASKS["text"](s)
  initial = demo_tasks.init_params(task, s)
  weights = {"initial": initial, f"after {s.steps} float32 steps": _train(task, initial, s, s.steps, options)}
  half = jmp_train.flax.apply_policy(task.model, "mixed_float16")
  g32, g16 = _float32_gradients(task.model, options), _gradients(half, options)
  gbf16 = _gradients(jmp_train.flax.apply_policy(task.model, "mixed_bfloat16"), options)
  tokens = (64,) if quick else (2048, 16384, 131072)
  records = []
  for label, params in weights.items():
    for n in tokens:
      batch = demo_tasks.TASKS["text"](dataclasses.replace(s, batch=n // s.seq_len)).train_batch(10**6)
      ref, underflow = jax.device_get(g32(params, batch))
      unscaled = jax.device_get(g16(params, batch, jnp.float32(1.0)))
      leaf, leaf_err = _worst_leaf(unscaled, ref)
      records.append(
        {
          "weights": label,
          "tokens_per_step": n,
          "rel_err_f16": _rel(unscaled, ref),
          "rel_err_f16_scaled": _rel(jax.device_get(g16(params, batch, jnp.float32(SCALE))), ref),
          "rel_err_bf16": _rel(jax.device_get(gbf16(params, batch, jnp.float32(1.0))), ref),
          "worst_leaf": leaf,
          "worst_leaf_rel_err": leaf_err,
          "underflow_f16_logits": float(underflow),
        }
      )
  return records
