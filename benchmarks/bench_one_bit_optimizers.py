"""1-bit Adam and 1-bit momentum SGD against their uncompressed optimizers.

Digits MLP (64-64-10), 8 data-parallel replicas, 16 examples per replica per
step, 400 steps, the same initialisation, batches, learning rate and
schedule for every row of a seed; 3 seeds. Rows (``mode``):

* momentum SGD (0.9), constant learning rates 0.1 and 0.3:
  ``sgdm_float32`` (exact ``pmean`` + ``optax.sgd``), ``sgdm_grad_1bit``
  (:func:`jmp_train.sign_compression` of the gradients before
  ``optax.sgd``), ``one_bit_momentum`` (column scales) and
  ``one_bit_momentum_l2``;
* Adam, 1-bit warm-up (``freeze_step``) 20% of the steps, with a constant
  learning rate 3e-3 (``schedule="constant"``) and with the demo's schedule
  (``"cosine"``: linear warm-up over 10% of the steps, cosine decay to 1%)
  at peaks 3e-3 and 1e-2: ``adam_float32`` (``optax.adam`` on the
  ``pmean``), ``adam_grad_1bit`` (gradient compression before
  ``optax.adam``, for contrast), ``adam_frozen_v`` (exact exchange, ``v``
  frozen after the warm-up: what 1-bit Adam would do with a lossless
  exchange), ``one_bit_adam`` (the momentum exchanged, as in Tang et al. /
  DeepSpeed), ``one_bit_adam_clipped`` (``clip_step=True``: each step
  clipped to Kingma & Ba's bound), ``one_bit_adam_rescaled`` and
  ``one_bit_adam_rescaled_clipped`` (``rescale_variance=True``, without and
  with ``clip_step``: each tensor's frozen ``v`` follows its mean squared
  gradient, one float per tensor exchanged), ``one_bit_adam_preconditioned``
  (``m / (sqrt(v)+eps)`` exchanged), ``one_bit_adam_refresh``
  (``variance_refresh`` every 50 steps: an exact step that updates ``v``,
  as in 0/1 Adam), ``one_bit_adam_refresh_clipped`` (refreshes and
  ``clip_step``) and ``one_bit_adam_preconditioned_refresh`` (both).

Columns: final training loss (whole training set) as mean and spread over
seeds, test accuracy (mean), ``rel_to_float32``: the mean over seeds of
each seed's final loss over the uncompressed row's of the same seed,
optimizer, learning rate and schedule, minus 1 (paired), and
``rel_to_float32_max`` the worst seed's; ``test_loss`` (the held-out 20%,
mean over seeds) with ``rel_test_loss`` / ``rel_test_loss_max`` paired in
the same way; ``wire_ratio``: bytes one device
sends per step after warm-up (compiled HLO, :func:`jmp_train.diagnostics.collective_bytes`
with ``wire=True``, the exact branch excluded: with ``variance_refresh``
every 50th step sends a float all-reduce instead) over a float32 ring
all-reduce of the gradients, for the digits MLP (4,810 parameters: the
(hi, lo) pairs and padding weigh) and ``wire_ratio_2m`` for a
784-2048-1024-10 MLP (2.7M parameters; not with ``--quick``).

Environment (full runs): ``BENCH_ONE_BIT_OPTIMIZERS_STEPS`` (default 400;
the schedules, the 1-bit warm-up and the refresh interval scale with it),
``BENCH_ONE_BIT_OPTIMIZERS_WARMUP`` (the 1-bit warm-up in percent of the
steps, default 20, less than 100), ``BENCH_ONE_BIT_OPTIMIZERS_SEEDS``
(``N``: seeds 0 to N-1, default 3; ``A-B``: seeds A to B) and
``BENCH_ONE_BIT_OPTIMIZERS_MODES``
(comma-separated rows; default all; keep each optimizer's ``*_float32``
row).
"""

from __future__ import annotations

import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax

from benchmarks import _harness
from benchmarks import bench_one_bit_convergence as digits

NAME = "one_bit_optimizers"
COLUMNS = (
  "optimizer",
  "mode",
  "learning_rate",
  "schedule",
  "steps",
  "seeds",
  "final_loss",
  "final_loss_min",
  "final_loss_max",
  "rel_to_float32",
  "rel_to_float32_max",
  "test_loss",
  "rel_test_loss",
  "rel_test_loss_max",
  "test_accuracy",
  "wire_ratio",
  "wire_ratio_2m",
)
AXIS = digits.AXIS
B1, B2, EPS = 0.9, 0.999, 1e-8


def _one_bit_adam(learning_rate, warmup_steps, **options):
  """``one_bit_adam`` on ``AXIS``; each option left out takes the paper's rule.

  The rows name what they turn on, so ``one_bit_adam`` is Tang et al.'s
  frozen-``v`` rule whatever the library's defaults.
  """
  from jmp_train import one_bit_adam

  options = {"clip_step": False, "rescale_variance": False, **options}
  return one_bit_adam(learning_rate, axis_name=AXIS, warmup_steps=warmup_steps, **options)


def _frozen_v_adam(learning_rate, warmup_steps: int) -> optax.GradientTransformation:
  """Adam on the exact ``pmean`` with ``v`` frozen after warm-up (no compression).

  Elements with ``v == 0`` at the freeze keep ``m = 0``, as in
  :func:`jmp_train.one_bit_adam`.
  """

  def init(params):
    zeros = jax.tree.map(jnp.zeros_like, params)
    return jnp.zeros((), jnp.int32), zeros, zeros

  def update(grads, state, params=None):
    del params
    count, mu, nu = state
    g = jax.lax.pmean(grads, AXIS)
    warm = count < warmup_steps
    mu = jax.tree.map(lambda m, x: B1 * m + (1 - B1) * x, mu, g)
    nu = jax.tree.map(lambda v, x: jnp.where(warm, B2 * v + (1 - B2) * x * x, v), nu, g)
    mu = jax.tree.map(lambda m, v: jnp.where(warm | (v > 0), m, 0.0), mu, nu)
    t = optax.safe_increment(count)
    c1 = 1 - B1 ** t.astype(jnp.float32)
    c2 = 1 - B2 ** jnp.minimum(t, warmup_steps).astype(jnp.float32)
    lr = learning_rate(count) if callable(learning_rate) else learning_rate
    step = jax.tree.map(lambda m, v: -lr * (m / c1) / (jnp.sqrt(v / c2) + EPS), mu, nu)
    return step, (t, mu, nu)

  return optax.GradientTransformation(init, update)


def schedule(name: str, peak: float, steps: int):
  """``"constant"``, or ``"cosine"``: the demo's warm-up + cosine decay to 1%."""
  if name == "constant":
    return peak
  return optax.warmup_cosine_decay_schedule(0.0, peak, max(1, steps // 10), steps, peak * 0.01)


def _optimizers(lr_momentum, adam_settings, steps: int, warmup_percent: int = 20):
  """(optimizer, mode, learning rate, schedule name, factory) per row."""
  from jmp_train import one_bit_momentum, sign_compression

  exact = digits._exact_mean(AXIS)
  warmup, refresh = steps * warmup_percent // 100, max(1, steps // 8)
  rows = []
  for lr in lr_momentum:
    rows += [
      ("sgdm", "sgdm_float32", lr, "constant", lambda lr=lr: optax.chain(exact, optax.sgd(lr, momentum=0.9))),
      (
        "sgdm",
        "sgdm_grad_1bit",
        lr,
        "constant",
        lambda lr=lr: optax.chain(sign_compression(AXIS), optax.sgd(lr, momentum=0.9)),
      ),
      (
        "sgdm",
        "one_bit_momentum",
        lr,
        "constant",
        lambda lr=lr: one_bit_momentum(lr, 0.9, axis_name=AXIS, scale="column"),
      ),
      (
        "sgdm",
        "one_bit_momentum_l2",
        lr,
        "constant",
        lambda lr=lr: one_bit_momentum(lr, 0.9, axis_name=AXIS, scale="l2"),
      ),
    ]
  for name, peak in adam_settings:
    lr = schedule(name, peak, steps)
    rows += [
      ("adam", "adam_float32", peak, name, lambda lr=lr: optax.chain(exact, optax.adam(lr))),
      ("adam", "adam_grad_1bit", peak, name, lambda lr=lr: optax.chain(sign_compression(AXIS), optax.adam(lr))),
      ("adam", "adam_frozen_v", peak, name, lambda lr=lr: _frozen_v_adam(lr, warmup)),
      ("adam", "one_bit_adam", peak, name, lambda lr=lr: _one_bit_adam(lr, warmup)),
      ("adam", "one_bit_adam_clipped", peak, name, lambda lr=lr: _one_bit_adam(lr, warmup, clip_step=True)),
      ("adam", "one_bit_adam_rescaled", peak, name, lambda lr=lr: _one_bit_adam(lr, warmup, rescale_variance=True)),
      (
        "adam",
        "one_bit_adam_rescaled_clipped",
        peak,
        name,
        lambda lr=lr: _one_bit_adam(lr, warmup, rescale_variance=True, clip_step=True),
      ),
      (
        "adam",
        "one_bit_adam_preconditioned",
        peak,
        name,
        lambda lr=lr: _one_bit_adam(lr, warmup, exchange="preconditioned"),
      ),
      ("adam", "one_bit_adam_refresh", peak, name, lambda lr=lr: _one_bit_adam(lr, warmup, variance_refresh=refresh)),
      (
        "adam",
        "one_bit_adam_refresh_clipped",
        peak,
        name,
        lambda lr=lr: _one_bit_adam(lr, warmup, variance_refresh=refresh, clip_step=True),
      ),
      (
        "adam",
        "one_bit_adam_preconditioned_refresh",
        peak,
        name,
        lambda lr=lr: _one_bit_adam(lr, warmup, variance_refresh=refresh, exchange="preconditioned"),
      ),
    ]
  return rows


def wire_ratio(tx: optax.GradientTransformation, params, replicas: int, compiler_options=None) -> float:
  """Bytes sent per device per step after warm-up over a float32 all-reduce's.

  Read from the update's program, compiled with ``compiler_options``.
  """
  from jmp_train.diagnostics import collective_ops, conditional_branches

  devices = jax.devices()[:replicas]
  stacked = jax.tree.map(lambda x: jnp.broadcast_to(x, (replicas,) + x.shape), params)
  state = jax.pmap(tx.init, axis_name=AXIS, devices=devices)(stacked)
  lowered = jax.pmap(tx.update, axis_name=AXIS, devices=devices).lower(stacked, state, stacked)
  text = lowered.compile(compiler_options).as_text()
  ops = collective_ops(text)
  # The exact (warm-up) branch: the conditional branch holding the float
  # all-reduce. Collectives outside any branch run every step.
  warmup = {op.computation for op in ops if op.kind == "all-reduce"} & conditional_branches(text)
  sent = sum(op.wire_bytes for op in ops if op.computation not in warmup)
  n = sum(x.size for x in jax.tree.leaves(params))
  return sent / (2 * (replicas - 1) / replicas * 4 * n)


def _seeds(value: str) -> tuple[int, ...]:
  """``""``: 0, 1, 2; ``"N"``: 0 to N-1; ``"A-B"``: A to B."""
  found = re.fullmatch(r"(\d+)(?:-(\d+))?", value.strip() or "3")
  if (
    found is None
    or (found[2] is None and int(found[1]) < 1)
    or (found[2] is not None and int(found[2]) < int(found[1]))
  ):
    raise ValueError(
      f"BENCH_ONE_BIT_OPTIMIZERS_SEEDS must be a count N >= 1 or a range A-B with A <= B, got {value!r}."
    )
  if found[2] is None:
    return tuple(range(int(found[1])))
  return tuple(range(int(found[1]), int(found[2]) + 1))


# one_bit_momentum's quick smoke test is in bench_one_bit_convergence.
QUICK_MODES = ("sgdm_float32", "adam_float32", "one_bit_adam")


def run(quick: bool) -> list[dict]:
  # --quick (a smoke test, run by the test suite): a linear classifier (one
  # tensor: compiling the 1-bit exchange dominates), 10 steps, 1 seed, one
  # learning rate, three rows.
  steps = 10 if quick else _harness.env_int("BENCH_ONE_BIT_OPTIMIZERS_STEPS", 400)
  hidden = None if quick else 64
  seeds = (0,) if quick else _seeds(os.environ.get("BENCH_ONE_BIT_OPTIMIZERS_SEEDS", ""))
  lr_momentum = (0.1,) if quick else (0.1, 0.3)
  adam = (("cosine", 3e-3),) if quick else (("constant", 3e-3), ("cosine", 3e-3), ("cosine", 1e-2))
  warmup_percent = 20 if quick else _harness.env_int("BENCH_ONE_BIT_OPTIMIZERS_WARMUP", 20)
  if warmup_percent >= 100:
    raise ValueError(f"BENCH_ONE_BIT_OPTIMIZERS_WARMUP must be below 100 (percent), got {warmup_percent}.")
  params = digits._init_model(jax.random.key(0), hidden)
  large = None if quick else digits._init_mlp(jax.random.key(0), (784, 2048, 1024, 10))
  options = _harness.compile_options(quick)
  records, wire = [], {}
  rows = _optimizers(lr_momentum, adam, steps, warmup_percent)
  if not quick:
    rows = _harness.selected_rows(rows, "BENCH_ONE_BIT_OPTIMIZERS_MODES")
  for optimizer, mode, lr, sched, make in rows:
    if quick and mode not in QUICK_MODES:
      continue
    runs = [digits.train_digits(make(), steps=steps, seed=s, hidden=hidden, compiler_options=options) for s in seeds]
    losses = np.asarray([r["final_loss"] for r in runs])
    records.append(
      {
        "optimizer": optimizer,
        "mode": mode,
        "learning_rate": lr,
        "schedule": sched,
        "steps": steps,
        "warmup_steps": steps * warmup_percent // 100,
        "seeds": len(seeds),
        "seed_list": list(seeds),
        "final_loss": float(losses.mean()),
        "final_loss_min": float(losses.min()),
        "final_loss_max": float(losses.max()),
        "final_losses": [float(x) for x in losses],
        "test_loss": float(np.mean([r["test_loss"] for r in runs])),
        "test_losses": [float(r["test_loss"]) for r in runs],
        "test_accuracy": float(np.mean([r["test_accuracy"] for r in runs])),
      }
    )
    if mode not in wire:  # the bytes do not depend on the learning rate
      wire[mode] = (wire_ratio(make(), params, 8, options), None if quick else wire_ratio(make(), large, 8))
    records[-1]["wire_ratio"], records[-1]["wire_ratio_2m"] = wire[mode]
  for r in records:
    base = next(
      b
      for b in records
      if (b["optimizer"], b["learning_rate"], b["schedule"]) == (r["optimizer"], r["learning_rate"], r["schedule"])
      and b["mode"].endswith("float32")
    )
    rel = np.asarray(r["final_losses"]) / np.asarray(base["final_losses"]) - 1.0
    r["rel_to_float32"], r["rel_to_float32_max"] = float(rel.mean()), float(rel.max())
    rel = np.asarray(r["test_losses"]) / np.asarray(base["test_losses"]) - 1.0
    r["rel_test_loss"], r["rel_test_loss_max"] = float(rel.mean()), float(rel.max())
  return records
