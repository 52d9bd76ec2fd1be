"""The roofline's predicted step times against measured ones, and its predictions for GPUs.

For three example models (``jmp_train_examples.models``: the ``MLP``, the
small ``ResNet`` on 8x8 digits-sized inputs, batch 128, and the demo's text
Transformer, ``TransformerBlock`` at the demo's sizes: width 64, 1 layer, 64
tokens, batch 32; ``--quick``: two small MLPs, ``mlp`` and ``mlp_wide``), one
``make_train_step`` step (softmax cross-entropy, Adam) under ``float32``
and the backend's mixed policy.

Two parts (``part``):

* ``cpu``: :func:`jmp_train.diagnostics.roofline` of the whole step on
  ``chip="cpu"`` (peaks measured on the spot: a matmul's FLOP/s and a copy's
  bytes/s), ``predicted_ms``, against the compiled step's median time,
  ``measured_ms`` (the steps timed in interleaved rounds in one process);
  ``predicted_over_measured`` their ratio; ``rank_predicted`` and
  ``rank_measured`` the model's place among the models under the same
  policy (1: fastest) and ``ranking_matches`` whether the two orders agree;
  ``memory_bound_share`` and ``product_share`` the shares of the predicted
  time in memory-bound rows and in matmuls and convolutions.
* ``predicted``: no measurement (``source``: predicted only), on the
  chips of :data:`jmp_train.diagnostics.CHIPS` named in :data:`GPU_CHIPS`:
  the roofline of the same steps (``float32_ms``, its products on TF32 at
  JAX's default precision, and ``mixed_ms``), and from
  :func:`jmp_train.diagnostics.roofline_compare` of the loss's value and
  gradient under ``float32``, ``mixed_bfloat16`` and ``mixed_float8``
  (each policy applied by :func:`jmp_train.autocast`, FP8's quantize and
  scale work counted) the speed-ups ``mixed_speedup`` (``mixed_bfloat16``
  over ``float32``) and ``fp8_speedup`` (``mixed_float8`` over
  ``mixed_bfloat16``), with the comparison's ``verdict``.

The roofline has no launch overhead and no caches: every byte at the
chip's memory bandwidth, every operation at its peak. Small steps (these
models') are predicted faster than they run; the GPU probe (``make
gpu-probe``) checks the predictions against measured GPU step times.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from benchmarks import _harness
from jmp_train import half_dtype, make_train_step
from jmp_train.diagnostics import roofline, roofline_compare
from jmp_train_examples import models

NAME = "roofline"
COLUMNS = (
  "part",
  "model",
  "policy",
  "chip",
  "predicted_ms",
  "measured_ms",
  "predicted_over_measured",
  "rank_predicted",
  "rank_measured",
  "ranking_matches",
  "memory_bound_share",
  "float32_ms",
  "mixed_ms",
  "mixed_speedup",
  "fp8_speedup",
  "source",
  "repeats",
)
GPU_CHIPS = ("H100 SXM", "H200")
COMPARED = ("float32", "mixed_bfloat16", "mixed_float8")


def _cases(quick: bool) -> dict[str, tuple[Any, tuple[np.ndarray, np.ndarray]]]:
  """name -> (model, (inputs, targets)); ``quick``: two small MLPs."""
  rng = np.random.default_rng(0)
  images = rng.uniform(size=(128, 64)).astype(np.float32)
  labels = np.arange(128, dtype=np.int32) % 10
  if quick:  # compiling a step is the slow part: the MLP's is the cheapest
    return {
      "mlp": (models.MLP(features=(32,)), (images[:16], labels[:16])),
      "mlp_wide": (models.MLP(features=(256, 256)), (images, labels)),
    }
  tokens = rng.integers(0, 256, (32, 65)).astype(np.int32)
  return {
    "mlp": (models.MLP(features=(256, 256)), (images, labels)),
    "resnet": (models.ResNet(stage_features=(32, 64)), (images, labels)),
    "transformer": (
      models.TransformerBlock(vocab_size=256, d_model=64, num_heads=4, mlp_dim=256, num_layers=1, max_len=64),
      (tokens[:, :-1], tokens[:, 1:]),
    ),
  }


def _loss(logits, targets):
  return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), targets).mean()


def _copy(tree: Any) -> Any:
  """A copy of ``tree``'s arrays through the host (no compilation per shape)."""
  return jax.tree.map(lambda a: jnp.asarray(np.asarray(a)), tree)


def ranks(seconds: dict[str, float]) -> dict[str, int]:
  """name -> its place by time, 1 the fastest (ties: the order given)."""
  order = sorted(seconds, key=lambda k: seconds[k])
  return {k: order.index(k) + 1 for k in seconds}


def _compare_fn(model, model_state: dict[str, Any]):
  """The loss of ``model`` on ``(params, inputs, targets)`` (evaluation mode)."""

  def loss(params, inputs, targets):
    return _loss(model.apply({"params": params, **model_state}, inputs), targets)

  return loss


def _cpu_records(policies, built, times, repeats) -> list[dict[str, Any]]:
  records = []
  for policy in policies:
    names = [name for (name, p) in built if p == policy]
    predicted = {n: built[(n, policy)]["report"].time_s for n in names}
    measured = {n: times[f"{n}/{policy}"] for n in names}
    rank_p, rank_m = ranks(predicted), ranks(measured)
    for name in names:
      report = built[(name, policy)]["report"]
      records.append(
        {
          "part": "cpu",
          "model": name,
          "policy": policy,
          "chip": "cpu",
          "predicted_ms": 1e3 * predicted[name],
          "measured_ms": 1e3 * measured[name],
          "predicted_over_measured": predicted[name] / measured[name],
          "rank_predicted": rank_p[name],
          "rank_measured": rank_m[name],
          "ranking_matches": rank_p == rank_m,
          "memory_bound_share": report.memory_bound_share,
          "product_share": report.product_share,
          "source": "measured and predicted",
          "repeats": repeats,
        }
      )
  return records


def _predicted_records(cases, policies, built, chips) -> list[dict[str, Any]]:
  records = []
  for name, (model, batch) in cases.items():
    first = built[(name, policies[0])]
    loss = _compare_fn(model, first["model_state"] or {})
    for chip in chips:
      step_ms = {
        p: 1e3 * roofline(built[(name, p)]["step"], built[(name, p)]["state"], batch, chip=chip, backward=False).time_s
        for p in policies
      }
      comparison = roofline_compare(loss, first["state"].params, *batch, chip=chip, policies=COMPARED)
      _, bf16, fp8 = comparison.rows
      records.append(
        {
          "part": "predicted",
          "model": name,
          "chip": comparison.chip.name,
          "float32_ms": step_ms[policies[0]],
          "mixed_ms": step_ms[policies[1]],
          "mixed_policy": policies[1],
          "mixed_speedup": bf16.speedup,
          "fp8_speedup": bf16.time_s / fp8.time_s,
          "verdict": comparison.verdict,
          "source": "predicted only",
        }
      )
  return records


def run(quick: bool) -> list[dict[str, Any]]:
  policies = ("float32", "mixed_float16" if half_dtype() == jnp.float16 else "mixed_bfloat16")
  repeats = 3 if quick else 20
  # --quick is a smoke test of the code: its steps are compiled without
  # XLA's expensive optimizations (their times say little).
  options = dict(_harness.QUICK_COMPILE) if quick else None
  cases = _cases(quick)
  built, calls = {}, {}
  for name, (model, batch) in cases.items():
    variables = jax.jit(model.init)(jax.random.key(0), batch[0])
    params = variables["params"]
    model_state = {k: v for k, v in variables.items() if k != "params"} or None
    first = None
    for policy in policies:
      step = make_train_step(model, _loss, optax.adam(1e-3), policy=policy)
      # No rng: the models have no dropout. Both policies keep float32
      # parameters and the same Adam state: one init serves both, copied.
      state = _copy(first) if first is not None else step.init(params, model_state=model_state)
      first = first if first is not None else _copy(state)
      # Shapes only: the compiled step donates its state.
      shapes = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), state)
      report = roofline(step, shapes, batch, chip="cpu", backward=False)
      built[(name, policy)] = dict(step=step, state=shapes, model_state=model_state, report=report)
      compiled = step.lower(state, batch).compile(options)
      holder = [state]

      def call(compiled=compiled, holder=holder, batch=batch):
        holder[0], metrics = compiled(holder[0], batch)
        return metrics

      calls[f"{name}/{policy}"] = call
  times = _harness.interleaved_median_seconds(calls, warmup=1 if quick else 2, repeats=repeats)
  chips = GPU_CHIPS[:1] if quick else GPU_CHIPS
  return _cpu_records(policies, built, times, repeats) + _predicted_records(cases, policies, built, chips)
