"""Half-precision weights on real tasks: final held-out loss and accuracy (digits, text).

A 64-64-10 MLP on scikit-learn's 8x8 digits (``jmp_train_examples.data.
load_digits``: 1,437 training and 360 test images), trained with minibatches
of 64 for 2,000 steps (quick mode: 100 steps, one seed, two bfloat16 SGD
rows only), forward and backward pass in the half dtype in every setup; same
initial values (rounded to the half dtype), same minibatches. Learning rates
are small on purpose (SGD and momentum SGD 0.01, momentum 0.9, Adam 1e-4):
most steps are below half an ulp of the half-precision weights, the regime
where float32 master weights are needed.

Every setup runs with seeds 0, 1 and 2 (the seed sets the initial weights
and the minibatch order; a setup and its float32 reference share it). The
reported test loss and accuracy are the means over the seeds, and the gaps
are between means: at these learning rates one seed's final test loss moves
by a few percent under any perturbation of the trajectory, which a single
run would mistake for a difference between methods.
``worst_seed_loss_gap`` is the largest gap of one seed against the
reference run with the same seed.

The comparison of Micikevicius et al. (``half == "float16"`` rows of the group
``momentum sgd lr=0.0001 m=0.99``): momentum SGD in the plain H form
(``H <- m*H - lr*g``, ``lr*g`` rounded to float16, the plain-momentum baseline;
``experiment.plain_momentum_sgd``) against the modified form, at a
small learning rate with a long momentum (effective step ``lr/(1-m) =
0.01``), where every ``lr*g`` is a float16 subnormal and many flush to zero
while the modified buffer ``G`` holds the unscaled gradients; each form alone
and followed by Kahan compensation.

Each setup's ``loss_gap`` and ``accuracy_gap`` are relative to the float32
master row of the same optimizer (``sgd``, ``momentum sgd``, ``adam``);
``within_1pct`` says whether both are at most 1%. The half-weight Adam rows
keep Adam's moments in float32 except the row marked ``bfloat16 moments``
(there Adam's second moment, an EMA with weight 0.001 per step, itself stops
moving). See ``jmp_train_examples.half_weights`` for the code.

The ``8-bit moments`` and ``sgd_8bit`` rows keep no float32 state at all:
:func:`jmp_train.adam_8bit` / :func:`jmp_train.sgd_8bit` (blockwise 8-bit
moments, 256 per float32 scale; ``all leaves``: every leaf 8-bit, otherwise
leaves under 4,096 elements keep float32 moments) followed by stochastic
rounding or Kahan on the half weights. One row rounds the 8-bit codes to
nearest instead of stochastically.

The ``task == "text"`` rows train the demo's character-level Transformer
(:data:`jmp_train_examples.demo_tasks.TASKS` ``["text"]`` with the demo's
defaults: 1 layer, width 64, sequences of 64 bytes, batches of 32, 200
steps, its initialization and batches) with Adam under the demo's schedule
(warm-up over 10% of the steps, cosine decay to 1%) at a peak learning rate
of ``TEXT_ADAM_LR``, the forward and backward pass in bfloat16. Rows: float32
master weights (``optax.adam``, the reference), bfloat16 weights with
float32 moments and stochastic rounding, and bfloat16 weights with
:func:`jmp_train.adam_8bit` followed by stochastic rounding, by Kahan
compensation or by nothing, and with every leaf 8-bit in blocks of 2,048
(the smallest state) followed by stochastic rounding. ``test_loss`` and
``test_accuracy`` are the next-byte cross-entropy and accuracy on 16 fixed
batches of the held-out last 10% of the corpus, means over seeds 0, 1, 2;
``paired_loss_gap`` is the mean over seeds of each seed's loss over the
reference's with the same seed, minus 1 (signed), ``worst_seed_loss_gap``
the largest such gap in absolute value. Not in ``--quick`` (each text
setup compiles a Transformer).

The results are in ``benchmarks/results/half_weights_training-<device>.json``
and the generated report.
"""

from __future__ import annotations

import dataclasses
import time

import jax.numpy as jnp
import numpy as np

from jmp_train_examples import data as data_lib
from jmp_train_examples.demo_configs import DemoSettings
from jmp_train_examples.demo_configs import learning_rate_schedule
from jmp_train_examples import half_weights as experiment

NAME = "half_weights_training"
COLUMNS = (
  "task",
  "half",
  "setup",
  "test_loss",
  "test_accuracy",
  "loss_gap",
  "accuracy_gap",
  "within_1pct",
  "paired_loss_gap",
  "worst_seed_loss_gap",
  "seconds",
)

SGD_LR = 0.01
ADAM_LR = 1e-4
TEXT_ADAM_LR = 3e-3
SEEDS = (0, 1, 2)


def _mean(runs, field: str) -> float:
  return float(np.mean([getattr(r, field) for r in runs]))


def run(quick: bool) -> list[dict]:
  # The text rows compile a Transformer per setup: left out of the quick
  # smoke test.
  return run_digits(quick) + ([] if quick else run_text())


def run_digits(quick: bool) -> list[dict]:
  """The digits rows."""
  steps = 100 if quick else 2000
  seeds = SEEDS[:1] if quick else SEEDS
  dataset = data_lib.load_digits()
  records = []
  for half in (jnp.bfloat16,) if quick else (jnp.bfloat16, jnp.float16):
    setups = experiment.make_setups(SGD_LR, half, adam_learning_rate=None if quick else ADAM_LR)
    if not quick:
      setups.update(experiment.make_8bit_setups(SGD_LR, ADAM_LR, half))
    if quick:  # a smoke test: two plain SGD rows only
      setups = {k: setups[k] for k in ("sgd / float32 master", "sgd / bfloat16 + stochastic rounding")}
    if not quick and half == jnp.float16:  # the float16 regime of Micikevicius et al., see above
      setups.update(experiment.make_momentum_setups(1e-4, 0.99, half))
    results = {}
    for name, (dtype, opt) in setups.items():
      start = time.perf_counter()
      # Seed s: the same initial values and minibatches for every setup.
      runs = [
        experiment.train_digits(opt, dtype, half, steps=steps, batch_size=64, hidden=64, dataset=dataset, seed=seed)[0]
        for seed in seeds
      ]
      seconds = (time.perf_counter() - start) / len(seeds)
      results[name] = runs
      ref = results[name.split(" / ")[0] + " / float32 master"]
      loss_gap = experiment.relative_gap(_mean(runs, "test_loss"), _mean(ref, "test_loss"))
      acc_gap = experiment.relative_gap(_mean(runs, "test_accuracy"), _mean(ref, "test_accuracy"))
      records.append(
        {
          "task": "digits",
          "half": jnp.dtype(half).name,
          "setup": name,
          "test_loss": _mean(runs, "test_loss"),
          "test_accuracy": _mean(runs, "test_accuracy"),
          "loss_gap": loss_gap,
          "accuracy_gap": acc_gap,
          "within_1pct": bool(loss_gap <= 0.01 and acc_gap <= 0.01),
          "paired_loss_gap": float(np.mean([r.test_loss / q.test_loss - 1.0 for r, q in zip(runs, ref)])),
          "worst_seed_loss_gap": max(experiment.relative_gap(r.test_loss, q.test_loss) for r, q in zip(runs, ref)),
          "seconds": seconds,
          "steps": steps,
          "seeds": len(seeds),
        }
      )
  return records


def run_text(steps: int | None = None, seeds: tuple[int, ...] = SEEDS) -> list[dict]:
  """The text rows: the demo's Transformer, Adam, validation loss at the end."""
  settings = DemoSettings(learning_rate=TEXT_ADAM_LR, eval_batches=16)
  if steps is not None:
    settings = dataclasses.replace(settings, steps=steps)
  setups = experiment.make_text_setups(learning_rate_schedule(settings), jnp.bfloat16)
  records, ref = [], None
  for name, (dtype, opt) in setups.items():
    start = time.perf_counter()
    runs = experiment.train_text(opt, dtype, jnp.bfloat16, settings=settings, seeds=seeds)
    seconds = (time.perf_counter() - start) / len(seeds)
    ref = ref or runs  # the first row: float32 master weights
    loss_gap = experiment.relative_gap(_mean(runs, "test_loss"), _mean(ref, "test_loss"))
    acc_gap = experiment.relative_gap(_mean(runs, "test_accuracy"), _mean(ref, "test_accuracy"))
    paired = [r.test_loss / q.test_loss - 1.0 for r, q in zip(runs, ref)]
    records.append(
      {
        "task": "text",
        "half": "bfloat16",
        "setup": name,
        "test_loss": _mean(runs, "test_loss"),
        "test_accuracy": _mean(runs, "test_accuracy"),
        "loss_gap": loss_gap,
        "accuracy_gap": acc_gap,
        "within_1pct": bool(loss_gap <= 0.01 and acc_gap <= 0.01),
        "paired_loss_gap": float(np.mean(paired)),
        "worst_seed_loss_gap": float(max(abs(p) for p in paired)),
        "test_losses": [r.test_loss for r in runs],
        "train_loss": _mean(runs, "train_loss"),
        "seconds": seconds,
        "steps": settings.steps,
        "seeds": len(seeds),
      }
    )
  return records
