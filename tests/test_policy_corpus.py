"""The policy reaches every product of models written the way Flax writes them.

Flax's examples declare ``dtype=jnp.float32`` on every layer; such a layer
promotes the half-precision inputs and parameters it receives back to
float32. ``make_train_step(model.apply, ..., policy="mixed_bfloat16")`` with
default settings must still run every matmul and convolution on
half-precision operands, for linen modules (``functools.partial(model.apply,
train=True)``) and NNX modules (the module itself), with synchronized
BatchNorm, ``nn.scan``/``nnx.scan`` over remat blocks, tied embeddings and
dropout (the corpus: ``helpers/corpus_models.py``). Each model also trains under
``mixed_bfloat16``, ``mixed_float16`` and ``mixed_float8`` about as well as
under float32, from the same start on the same batches. ``model_policy="inputs"`` keeps the old behaviour.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jmp_train
import jmp_train.diagnostics as diag

from helpers import corpus_models as corpus

NARROW = {"mixed_bfloat16": np.dtype(jnp.bfloat16), "mixed_float16": np.dtype(jnp.float16)}
MLIR_NAME = {np.dtype(jnp.bfloat16): "bf16", np.dtype(jnp.float16): "f16", np.dtype(jnp.float32): "f32"}
MODELS = tuple(corpus.CORPUS)
STEPS = 16
BATCH = 16  # 8 examples on each of the 2 replicas
# Fewer products than this and the check could pass on a program that lost
# the model (every corpus model has several convolutions or matmuls, twice
# as many with the backward pass).
MIN_PRODUCTS = 6
# Adam's learning rates: the convolution nets' pooled features need larger
# steps to move within STEPS steps than the Transformers do.
LEARNING_RATE = {"linen_resnet": 1e-2, "nnx_convnet": 1e-2, "linen_transformer": 3e-3, "nnx_transformer": 3e-3}


def _step_kwargs(policy: str) -> dict:
  kwargs = {"policy": policy}
  if policy == "mixed_float16":
    kwargs["loss_scale"] = jmp_train.DynamicLossScale(2.0**15)
  return kwargs


@functools.cache
def _mesh() -> jax.sharding.Mesh:
  return jax.sharding.Mesh(np.array(jax.devices()[:2]), (corpus.AXIS,))


@functools.cache
def _batches(name: str) -> tuple:
  return tuple(corpus.CORPUS[name].batches(STEPS, BATCH))


@functools.cache
def _initial(name: str):
  """What every step of a model starts from, made once per test process.

  A linen model: ``(module, params, model_state)``. An NNX model: its
  ``nnx.split`` (a fresh module per step is ``nnx.merge`` of it; arrays are
  immutable and ``step.init`` lays out copies on the mesh).
  """
  entry = corpus.CORPUS[name]
  model = entry.make()
  if entry.kind == "linen":
    params, model_state = corpus.init_linen(model, _batches(name)[0][0])
    return model, params, model_state
  return nnx.split(model)


@functools.cache
def _step(name: str, policy: str, model_policy: str | None = None):
  """The step with default settings, the model passed as users pass it.

  Cached: the products test lowers the same step object that the training
  test then calls, and JAX reuses that trace (one trace less per step).
  """
  entry = corpus.CORPUS[name]
  optimizer = optax.adam(LEARNING_RATE[name])
  kwargs = dict(_step_kwargs(policy), mode="shard_map", mesh=_mesh())
  if model_policy is not None:
    kwargs["model_policy"] = model_policy
  if entry.kind == "linen":
    model, _, _ = _initial(name)
    return jmp_train.make_train_step(
      functools.partial(model.apply, train=True),
      corpus.loss_fn,
      optimizer,
      eval_apply_fn=functools.partial(model.apply, train=False),
      **kwargs,
    )
  return jmp_train.make_train_step(nnx.merge(*_initial(name)), corpus.loss_fn, optimizer, **kwargs)


def _build(name: str, policy: str, model_policy: str | None = None):
  """``(step, a fresh initial state)``: the state's buffers are donated by a step."""
  step = _step(name, policy, model_policy)
  # Example inputs: under mixed_float8 the step finds the FP8 products on them.
  inputs = _batches(name)[0][0]
  if corpus.CORPUS[name].kind == "linen":
    _, params, model_state = _initial(name)
    return step, step.init(params, model_state=model_state or None, rng=0, inputs=inputs)
  return step, step.init(nnx.merge(*_initial(name)), inputs=inputs)


# ---------------------------------------------------------------------------
# Reading the products of a lowered step.

_PRODUCT_LINE = re.compile(r"stablehlo\.(dot_general|convolution)\b")
_OPERANDS = re.compile(r":\s*\(tensor<([^<>]*)>,\s*tensor<([^<>]*)>\)\s*->")


def _products_by_regex(text: str) -> list[tuple[str, str, str]]:
  """``[(lhs element type, rhs element type, line)]`` of every product.

  Independent of :func:`jmp_train.diagnostics.fp8_products`: a plain scan of
  the StableHLO text for the ``dot_general`` and ``convolution`` ops and
  their ``(tensor<..xT>, tensor<..xT>) -> ...`` signature.
  """
  out = []
  for line in text.splitlines():
    if not _PRODUCT_LINE.search(line):
      continue
    match = _OPERANDS.search(line)
    assert match, f"a product whose operand types this test cannot read:\n{line.strip()}"
    lhs, rhs = (t.rsplit("x", 1)[-1] for t in match.groups())
    out.append((lhs, rhs, line.strip()))
  return out


def _assert_products(lowered, dtype: np.dtype):
  """Every matmul and convolution of ``lowered`` takes two ``dtype`` operands."""
  text = lowered.as_text()
  found = _products_by_regex(text)
  wanted = MLIR_NAME[dtype]
  offending = [line for lhs, rhs, line in found if (lhs, rhs) != (wanted, wanted)]
  assert len(found) >= MIN_PRODUCTS, f"only {len(found)} products found:\n" + "\n".join(line for _, _, line in found)
  assert not offending, (
    f"{len(offending)} of {len(found)} products do not take {wanted} x {wanted} operands:\n" + "\n".join(offending[:20])
  )
  # The library's own reader agrees, product for product.
  report = diag.fp8_products(lowered)
  assert len(report.products) == len(found), str(report)
  wide = [p for p in report.products if (p.lhs_dtype, p.rhs_dtype) != (dtype, dtype)]
  assert not wide, str(report)


@pytest.mark.parametrize("policy", tuple(NARROW))
@pytest.mark.parametrize("name", MODELS)
def test_default_step_runs_every_product_in_the_compute_dtype(name, policy):
  step, state = _build(name, policy)
  batch = step.shard_batch(_batches(name)[0])
  _assert_products(step.lower(state, batch), NARROW[policy])


# ---------------------------------------------------------------------------
# Training: the narrow policies follow float32.


def _train(step, state, name: str):
  losses = []
  for batch in _batches(name):
    state, metrics = step(state, step.shard_batch(batch))
    losses.append(float(metrics["loss"]))
  return state, np.array(losses)


# One test per model runs float32 and the narrow policies (float16 with its
# dynamic loss scale; FP8 with a delayed scaling state per product site): the
# float32 run (a compilation) is then shared for certain, also when
# pytest-xdist spreads the tests over processes.
@pytest.mark.slow
@pytest.mark.parametrize("name", MODELS)
def test_default_step_trains_like_float32(name):
  step, state = _build(name, "float32")
  _, reference = _train(step, state, name)
  # The model itself trains: what the narrow runs are held to.
  assert np.all(np.isfinite(reference)) and reference[-1] < reference[0], reference
  for policy in (*NARROW, "mixed_float8"):
    step, state = _build(name, policy)
    state, losses = _train(step, state, name)
    # Same initialisation, same batches, same dropout keys: the runs differ
    # only by the rounding of products and activations, small next to what
    # STEPS steps of training move the loss. A policy that broke a layer (a
    # wrong normalization, gradients lost to float16 underflow, skipped or
    # unscaled updates) leaves the loss near its initial value, as far from
    # float32's final loss as the whole of the training progress. 5% sits
    # far from both.
    assert (
      np.all(np.isfinite(losses))
      and losses[-1] < losses[0]
      and np.isclose(losses[-1], reference[-1], rtol=0.05, atol=0.0)
    ), f"{policy}: {np.round(losses, 4)}\nfloat32: {np.round(reference, 4)}"
    # evaluate's apply is wrapped as the step's.
    evaluated = float(step.evaluate(state, step.shard_batch(_batches(name)[-1]))["loss"])
    assert np.isfinite(evaluated), f"{policy}: evaluate returned a loss of {evaluated}"


# ---------------------------------------------------------------------------
# The opt-out.


def test_model_policy_inputs_leaves_declared_float32_layers_in_float32():
  # The old behaviour, kept by choice: only parameters and inputs are cast,
  # and layers that declare dtype=float32 promote them back.
  step, state = _build("linen_resnet", "mixed_bfloat16", model_policy="inputs")
  batch = step.shard_batch(_batches("linen_resnet")[0])
  _assert_products(step.lower(state, batch), np.dtype(jnp.float32))


# ---------------------------------------------------------------------------
# The audits of the step itself.


@pytest.mark.parametrize("name", MODELS)
def test_precision_audit_of_the_default_step_finds_nothing(name):
  step, state = _build(name, "mixed_bfloat16")
  report = diag.precision_audit(step, state, step.shard_batch(_batches(name)[0]))
  report.assert_clean()
  assert report.half_ops > 0, str(report)


@pytest.mark.parametrize("name", ["linen_resnet", "nnx_convnet"])
def test_mixed_float8_runs_every_convolution_and_matmul_of_a_convnet_in_fp8(name):
  step, state = _build(name, "mixed_float8")
  report = diag.fp8_products(step, state, step.shard_batch(_batches(name)[0]))
  assert len(report.products) >= MIN_PRODUCTS and not report.not_fp8, str(report)
