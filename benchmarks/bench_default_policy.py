"""The policy decided per operation against the layer rewriting it replaced.

``make_train_step(model, ..., policy=...)`` decides every operation of the
model by :func:`jmp_train.autocast` (``model_policy="auto"``); before, a
Flax module's layers were configured instead (``model_policy="flax"``,
:func:`jmp_train.flax.apply_policy`). Both run here on the demo's text
Transformer (``jmp_train_examples.models.TransformerBlock`` at the demo's
sizes: width 64, 1 layer, 64 tokens, batch 32) and the example ResNet
(``models.ResNet`` on 8x8 digits-sized images, batch 128), under the
backend's mixed policy, Adam, from the same parameters on the same batch
(``--quick``: a small ``models.MLP``, one compile per variant).

Figures per model and variant: the time to trace, lower and compile the
step (``step.lower(state, batch).compile()``, median of ``COMPILES``
fresh steps), the step's median time (interleaved rounds), and each as a
ratio to ``model_policy="flax"`` measured in the same run (target: within
1.05).
"""

from __future__ import annotations

import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from benchmarks import _harness
from jmp_train import half_dtype, make_train_step
from jmp_train_examples import models

NAME = "default_policy"
COLUMNS = ("model", "model_policy", "compile_ms", "compile_ratio", "median_ms", "step_ratio", "repeats")
VARIANTS = ("flax", "auto")


def _cases(quick: bool) -> dict[str, tuple[Any, Any]]:
  rng = np.random.default_rng(0)
  images = rng.uniform(size=(128, 64)).astype(np.float32)
  labels = np.arange(128, dtype=np.int32) % 10
  if quick:  # a smoke test: the MLP's steps compile fastest
    return {"mlp": (models.MLP(features=(32,)), (images[:16], labels[:16]))}
  tokens = rng.integers(0, 256, (32, 65)).astype(np.int32)
  text = models.TransformerBlock(vocab_size=256, d_model=64, num_heads=4, mlp_dim=256, num_layers=1, max_len=64)
  return {
    "transformer": (text, (tokens[:, :-1], tokens[:, 1:])),
    "resnet": (models.ResNet(stage_features=(32, 64)), (images, labels)),
  }


def _loss(logits, targets):
  return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), targets).mean()


def run(quick: bool) -> list[dict[str, Any]]:
  policy = "mixed_float16" if half_dtype() == jnp.float16 else "mixed_bfloat16"
  compiles = 1 if quick else 3
  repeats = 3 if quick else 20
  records = []
  for name, (model, batch) in _cases(quick).items():
    variables = jax.jit(model.init)(jax.random.key(0), batch[0])
    params = variables["params"]
    model_state = {k: v for k, v in variables.items() if k != "params"} or None
    compile_s, steps = {}, {}
    for variant in VARIANTS:
      seconds = []
      for _ in range(compiles):  # a fresh step each time: no trace is reused
        step = make_train_step(
          model,
          _loss,
          optax.adam(1e-3),
          policy=policy,
          model_policy=variant,
          compiler_options=_harness.compile_options(quick),
        )
        state = step.init(params, model_state=model_state, rng=0)
        start = time.perf_counter()
        compiled = step.lower(state, batch).compile()
        seconds.append(time.perf_counter() - start)
      compile_s[variant] = float(np.median(seconds))
      holder = [state]

      def call(compiled=compiled, holder=holder):
        holder[0], metrics = compiled(holder[0], batch)
        return metrics

      steps[variant] = call
    times = _harness.interleaved_median_seconds(steps, warmup=1 if quick else 2, repeats=repeats)
    for variant in VARIANTS:
      records.append(
        {
          "model": name,
          "model_policy": variant,
          "policy": policy,
          "compile_ms": 1e3 * compile_s[variant],
          "compile_ratio": compile_s[variant] / compile_s["flax"],
          "median_ms": 1e3 * times[variant],
          "step_ratio": times[variant] / times["flax"],
          "compiles": compiles,
          "repeats": repeats,
        }
      )
  return records
