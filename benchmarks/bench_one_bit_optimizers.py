"""1-bit Adam and 1-bit momentum SGD against their uncompressed optimizers.

Digits MLP (64-64-10), 8 data-parallel replicas, 16 examples per replica per
step, the same initialisation, batches and learning rate for every row of a
seed; 3 seeds. Rows (``mode``):

* momentum SGD (0.9), at two learning rates:
  ``sgdm_float32`` (exact ``pmean`` + ``optax.sgd``), ``sgdm_grad_1bit``
  (:func:`jmp_train.sign_compression` of the gradients before
  ``optax.sgd``), ``one_bit_momentum`` (column scales) and
  ``one_bit_momentum_l2``;
* Adam, warm-up 20% of the steps: ``adam_float32`` (``optax.adam`` on the
  ``pmean``), ``adam_grad_1bit`` (gradient compression before
  ``optax.adam``, for contrast), ``adam_frozen_v`` (exact exchange, ``v``
  frozen after the warm-up: what 1-bit Adam would do with a lossless
  exchange), ``one_bit_adam`` (the momentum exchanged, as in Tang et al. /
  DeepSpeed) and ``one_bit_adam_preconditioned`` (``m / (sqrt(v)+eps)``
  exchanged).

Columns: final training loss (whole training set) as mean and spread over
seeds, test accuracy (mean), ``rel_to_float32`` (mean final loss over the
uncompressed row's of the same optimizer and learning rate, minus 1) and
``wire_ratio``: bytes one device sends per step after warm-up (compiled
HLO, :func:`jmp_train.collective_bytes` with ``wire=True``, warm-up branch
excluded) over a float32 ring all-reduce of the gradients, for the digits
MLP (4,810 parameters: the (hi, lo) pairs and padding weigh) and
``wire_ratio_2m`` for a 784-2048-1024-10 MLP (2.7M parameters; not with
``--quick``).
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax

from benchmarks import bench_one_bit_convergence as digits

NAME = "one_bit_optimizers"
COLUMNS = (
    "optimizer", "mode", "learning_rate", "steps", "seeds", "final_loss", "final_loss_min",
    "final_loss_max", "rel_to_float32", "test_accuracy", "wire_ratio", "wire_ratio_2m",
)
AXIS = digits.AXIS
B1, B2, EPS = 0.9, 0.999, 1e-8


def _frozen_v_adam(learning_rate: float, warmup_steps: int) -> optax.GradientTransformation:
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
    step = jax.tree.map(lambda m, v: -learning_rate * (m / c1) / (jnp.sqrt(v / c2) + EPS), mu, nu)
    return step, (t, mu, nu)

  return optax.GradientTransformation(init, update)


def _optimizers(lr_momentum: tuple[float, ...], lr_adam: float, steps: int):
  from jmp_train import sign_compression
  from jmp_train._src.one_bit_optimizers import one_bit_adam, one_bit_momentum

  exact = digits._exact_mean(AXIS)  # pylint: disable=protected-access
  warmup = steps // 5
  rows = []
  for lr in lr_momentum:
    rows += [
        ("sgdm", "sgdm_float32", lr, optax.chain(exact, optax.sgd(lr, momentum=0.9))),
        ("sgdm", "sgdm_grad_1bit", lr, optax.chain(sign_compression(AXIS), optax.sgd(lr, momentum=0.9))),
        ("sgdm", "one_bit_momentum", lr, one_bit_momentum(lr, 0.9, axis_name=AXIS)),
        ("sgdm", "one_bit_momentum_l2", lr, one_bit_momentum(lr, 0.9, axis_name=AXIS, scale="l2")),
    ]
  lr = lr_adam
  rows += [
      ("adam", "adam_float32", lr, optax.chain(exact, optax.adam(lr))),
      ("adam", "adam_grad_1bit", lr, optax.chain(sign_compression(AXIS), optax.adam(lr))),
      ("adam", "adam_frozen_v", lr, _frozen_v_adam(lr, warmup)),
      ("adam", "one_bit_adam", lr, one_bit_adam(lr, axis_name=AXIS, warmup_steps=warmup)),
      ("adam", "one_bit_adam_preconditioned", lr,
       one_bit_adam(lr, axis_name=AXIS, warmup_steps=warmup, exchange="preconditioned")),
  ]
  return rows


def wire_ratio(tx: optax.GradientTransformation, params, replicas: int) -> float:
  """Bytes sent per device per step after warm-up over a float32 all-reduce's."""
  from jmp_train import collective_ops

  devices = jax.devices()[:replicas]
  stacked = jax.tree.map(lambda x: jnp.broadcast_to(x, (replicas,) + x.shape), params)
  state = jax.pmap(tx.init, axis_name=AXIS, devices=devices)(stacked)
  text = (
      jax.pmap(tx.update, axis_name=AXIS, devices=devices)
      .lower(stacked, state, stacked)
      .compile()
      .as_text()
  )
  ops = collective_ops(text)
  has_cond = bool(re.search(r"branch_computations=|true_computation=", text))
  # With a warm-up branch, the float all-reduce lives in its computation only.
  warmup = {op.computation for op in ops if op.kind == "all-reduce"} if has_cond else set()
  sent = sum(op.wire_bytes for op in ops if op.computation not in warmup)
  n = sum(x.size for x in jax.tree.leaves(params))
  return sent / (2 * (replicas - 1) / replicas * 4 * n)


# one_bit_momentum's quick smoke test is in bench_one_bit_convergence.
QUICK_MODES = ("sgdm_float32", "adam_float32", "one_bit_adam")


def run(quick: bool) -> list[dict]:
  # --quick (a smoke test, run by the test suite): a linear classifier (one
  # tensor: compiling the 1-bit exchange dominates), 10 steps, 1 seed, one
  # learning rate, three rows.
  steps = 10 if quick else 400
  hidden = None if quick else 64
  seeds = (0,) if quick else (0, 1, 2)
  lr_momentum = (0.1,) if quick else (0.1, 0.3)
  lr_adam = 3e-3
  params = digits._init_model(jax.random.key(0), hidden)  # pylint: disable=protected-access
  large = digits._init_mlp(jax.random.key(0), (784, 2048, 1024, 10))  # pylint: disable=protected-access
  records = []
  for optimizer, mode, lr, tx in _optimizers(lr_momentum, lr_adam, steps):
    if quick and mode not in QUICK_MODES:
      continue
    runs = [digits.train_digits(tx, steps=steps, seed=s, hidden=hidden) for s in seeds]
    losses = np.asarray([r["final_loss"] for r in runs])
    records.append({
        "optimizer": optimizer,
        "mode": mode,
        "learning_rate": lr,
        "steps": steps,
        "seeds": len(seeds),
        "final_loss": float(losses.mean()),
        "final_loss_min": float(losses.min()),
        "final_loss_max": float(losses.max()),
        "final_losses": [float(x) for x in losses],
        "test_accuracy": float(np.mean([r["test_accuracy"] for r in runs])),
        "wire_ratio": wire_ratio(tx, params, 8),
        "wire_ratio_2m": None if quick else wire_ratio(tx, large, 8),
    })
  for r in records:
    base = next(
        b for b in records
        if b["optimizer"] == r["optimizer"] and b["learning_rate"] == r["learning_rate"]
        and b["mode"].endswith("float32")
    )
    r["rel_to_float32"] = r["final_loss"] / base["final_loss"] - 1.0
  return records
