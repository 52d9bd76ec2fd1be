"""autocast against apply_policy: step time, compiled HLO, tracing and compiling.

For each example model (``jmp_train_examples.models``: an MLP, a small
ResNet with batch norm, a one-layer Transformer language model), one
training step (cross-entropy, ``value_and_grad``, SGD) under the backend's
mixed policy, built two ways from the same float32 model:

* ``apply_policy``: :func:`jmp_train.flax.apply_policy` (Flax's own
  ``dtype``/``param_dtype`` fields) with ``recompute=None``;
* ``autocast``: :func:`jmp_train.autocast` of the float32 ``model.apply``
  (the jaxpr transformation);

(``--quick``: the MLP, tiny, this pair only) and, in the
full run, the pair with recomputation (``apply_policy``'s
default ``recompute="float32"``, against ``jax.checkpoint`` of the autocast
function with the same saveable rule): ``apply_policy_recompute`` and
``autocast_recompute``. Each autocast variant is compared with the
apply_policy variant that keeps the same values for the backward pass.

Figures: the step's median time (interleaved rounds, ratio to the matching
apply_policy variant; target within 2%), the compiled HLO's matmul and convolution
signatures (opcode, operand and result types; ``hlo_dots_match``) and
instruction counts, and the time to trace (``jax.jit(...).trace``) and to
compile (``lower(...).compile()``) the step: autocast traces the model twice
(once to a jaxpr, once while evaluating it).
"""

from __future__ import annotations

import collections
import re
import time
from typing import Any

import jax
import jax.numpy as jnp
import optax

from benchmarks import _harness
from jmp_train import half_dtype, half_precision_saveable
from jmp_train import autocast
from jmp_train_examples import models
from jmp_train.flax import apply_policy

NAME = "autocast"
COLUMNS = (
  "model",
  "variant",
  "median_ms",
  "ratio",
  "hlo_dots_match",
  "hlo_instructions",
  "trace_ms",
  "compile_ms",
  "repeats",
)

_DOT = re.compile(r"=\s*(\S+)\s+(dot|convolution)\(([^)]*)\)")


def _cases(quick: bool) -> dict[str, tuple[Any, jax.Array, jax.Array]]:
  """name -> (model, inputs, labels); ``quick``: a tiny MLP only."""
  key = jax.random.key(0)
  batch = 16 if quick else 128
  x = jax.random.uniform(key, (batch, 64))
  labels = jnp.arange(batch) % 10
  seq = 16 if quick else 64
  tokens = jax.random.randint(key, (batch // 8, seq), 0, 256)
  width = 32 if quick else 256
  cases = {
    "mlp": (models.MLP(features=(width, width)), x, labels),
    "resnet": (models.ResNet(stage_features=(32, 64)), x, labels),
    "transformer": (
      models.TransformerBlock(d_model=width // 2 if quick else 128, num_heads=4, mlp_dim=width, max_len=seq),
      tokens,
      tokens,
    ),
  }
  if quick:  # a smoke test: compiling the other models' steps is the slow part
    del cases["resnet"], cases["transformer"]
  return cases


def _step(apply, state):
  def loss(params, x, y):
    logits = apply({"params": params, **state}, x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

  def step(params, x, y):
    value, grads = jax.value_and_grad(loss)(params, x, y)
    return jax.tree.map(lambda p, g: p - 0.01 * g, params, grads), value

  return jax.jit(step)


def _hlo_dots(text: str) -> collections.Counter:
  """(opcode, result type, operand types) of every dot and convolution."""
  found = collections.Counter()
  for match in _DOT.finditer(text):
    result, op, operands = match.groups()
    types = tuple(re.findall(r"(bf16|f16|f32|f64)\[", operands))
    found[(op, result.split("[")[0], types)] += 1
  return found


def _instructions(text: str) -> int:
  return sum(1 for line in text.splitlines() if " = " in line and not line.lstrip().startswith("//"))


# variant -> the apply_policy variant it is compared with.
_REFERENCE = {
  "apply_policy": "apply_policy",
  "autocast": "apply_policy",
  "apply_policy_recompute": "apply_policy_recompute",
  "autocast_recompute": "apply_policy_recompute",
}


def _applies(model, policy: str, quick: bool) -> dict[str, Any]:
  applies = {
    "apply_policy": apply_policy(model, policy, recompute=None).apply,
    "autocast": autocast(model.apply, policy),
  }
  if not quick:
    applies["apply_policy_recompute"] = apply_policy(model, policy).apply
    applies["autocast_recompute"] = jax.checkpoint(autocast(model.apply, policy), policy=half_precision_saveable)
  return applies


def run(quick: bool) -> list[dict[str, Any]]:
  policy = "mixed_float16" if half_dtype() == jnp.float16 else "mixed_bfloat16"
  repeats = 3 if quick else 20
  records = []
  for name, (model, x, y) in _cases(quick).items():
    variables = jax.jit(model.init)(jax.random.key(1), x)  # one compile, not op by op
    params = variables.pop("params")  # batch statistics stay (evaluation mode)
    steps = {v: _step(a, variables) for v, a in _applies(model, policy, quick).items()}
    info, compiled_steps = {}, {}
    for variant, step in steps.items():
      start = time.perf_counter()
      traced = step.trace(params, x, y)
      trace_s = time.perf_counter() - start
      start = time.perf_counter()
      compiled = traced.lower().compile(_harness.compile_options(quick))
      compile_s = time.perf_counter() - start
      compiled_steps[variant] = compiled  # timed below: compiled once
      text = compiled.as_text()
      info[variant] = dict(
        trace_ms=1e3 * trace_s, compile_ms=1e3 * compile_s, dots=_hlo_dots(text), hlo_instructions=_instructions(text)
      )
    times = _harness.interleaved_median_seconds(
      {v: (lambda s=s: s(params, x, y)) for v, s in compiled_steps.items()},
      warmup=1 if quick else 2,
      repeats=repeats,
    )
    for variant in steps:
      ref = _REFERENCE[variant]
      records.append(
        {
          "model": name,
          "variant": variant,
          "policy": policy,
          "median_ms": 1e3 * times[variant],
          "ratio": times[variant] / times[ref],
          "hlo_dots_match": info[variant]["dots"] == info[ref]["dots"],
          "hlo_dots": sorted(f"{op} {r}<-{','.join(t)} x{n}" for (op, r, t), n in info[variant]["dots"].items()),
          "hlo_instructions": info[variant]["hlo_instructions"],
          "trace_ms": info[variant]["trace_ms"],
          "compile_ms": info[variant]["compile_ms"],
          "repeats": repeats,
        }
      )
  return records
