"""1-bit SGD convergence on a real task: digits MLP, 8 data-parallel replicas.

Three runs from the same initialisation and the same batches, differing only
in how the replicas' gradients are averaged:

* ``float32``: exact ``pmean``;
* ``1bit_ef``: :func:`jmp_train.sign_compression` (column scales, worker and
  server error feedback);
* ``1bit_no_ef``: the same quantization without any error feedback.

Reported: final training loss (full training set), test accuracy, the final
loss relative to the uncompressed run, and the worker residual's norm
(largest over replicas) at the end and its maximum over training: error
feedback needs it bounded. ``seconds`` is the wall time of the whole
training call, compilation included (the steps run in one ``lax.scan``).

A second study (``study="momentum_lr"``, seed 0, 300 steps, momentum 0.9)
asks why gradient compression in front of momentum SGD fails at large
learning rates. At each learning rate: ``float32``; ``float32_delayed``
(the exact average gradient, applied one step late: a pure delay, no
quantization); ``1bit_ef`` (column scales), ``1bit_ef_l2`` (per-tensor RMS
scales), ``1bit_worker_ef`` (worker error feedback only: one delay stage
instead of two); and ``one_bit_momentum`` (the momentum exchanged instead,
:func:`jmp_train.one_bit_momentum`).
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from benchmarks import _harness

NAME = "one_bit_convergence"
COLUMNS = (
  "study",
  "mode",
  "learning_rate",
  "replicas",
  "steps",
  "final_loss",
  "rel_to_float32",
  "test_accuracy",
  "residual_norm_final",
  "residual_norm_max",
  "seconds",
)
AXIS = "data"
MODES = ("float32", "1bit_ef", "1bit_no_ef")


def _init_mlp(key, sizes, bias: bool = True):
  params = {}
  for i, (m, n) in enumerate(zip(sizes[:-1], sizes[1:])):
    key, sub = jax.random.split(key)
    params[f"w{i}"] = jax.random.normal(sub, (m, n), jnp.float32) * np.sqrt(2.0 / m)
    if bias:
      params[f"b{i}"] = jnp.zeros((n,), jnp.float32)
  return params


def _logits(params, x):
  n = sum(k.startswith("w") for k in params)
  for i in range(n):
    x = x @ params[f"w{i}"] + params.get(f"b{i}", 0.0)
    if i < n - 1:
      x = jax.nn.relu(x)
  return x


def _init_model(key, hidden: int | None):
  """The 64-hidden-10 MLP, or for ``hidden=None`` one 64x10 matrix (no bias)."""
  if hidden is None:
    return _init_mlp(key, (64, 10), bias=False)
  return _init_mlp(key, (64, hidden, 10))


def _loss(params, x, y):
  return optax.softmax_cross_entropy_with_integer_labels(_logits(params, x), y).mean()


def _exact_mean(axis_name):
  """``pmean`` of the gradients as an optax transformation (the baseline)."""

  def update_fn(updates, state, params=None):
    del params
    return jax.lax.pmean(updates, axis_name), state

  return optax.GradientTransformation(lambda _: optax.EmptyState(), update_fn)


def run_digits(
  mode: str,
  *,
  steps: int = 200,
  replicas: int = 8,
  per_replica_batch: int = 16,
  hidden: int | None = 64,
  learning_rate: float = 0.1,
  momentum: float = 0.9,
  seed: int = 0,
  compiler_options=None,
) -> dict:
  """Trains the digits MLP data-parallel over ``replicas`` devices.

  Args:
    mode: one of ``MODES``.
    steps: optimizer steps.
    replicas: devices on the data axis (``jax.devices()[:replicas]``).
    per_replica_batch: examples per replica per step.
    hidden: hidden width of the 64-hidden-10 MLP; ``None``: a linear
      classifier, one 64x10 matrix without bias (one tensor: the 1-bit
      exchange compiles quicker).
    learning_rate: SGD learning rate.
    momentum: SGD momentum.
    seed: initialisation and batch-order seed.
    compiler_options: the XLA options of the training program (``jax.jit``'s).

  Returns:
    A record: final training loss, test accuracy, residual norms (per step
    in ``residual_norms``), wall time.
  """
  from jmp_train import sign_compression

  if mode not in MODES:
    raise ValueError(f"Unknown mode {mode!r}; valid modes: {', '.join(MODES)}.")
  if mode == "float32":
    compress = _exact_mean(AXIS)
  else:
    ef = mode == "1bit_ef"
    compress = sign_compression(AXIS, error_feedback=ef, server_error_feedback=ef)
  tx = optax.chain(compress, optax.sgd(learning_rate, momentum=momentum))
  record = train_digits(
    tx,
    steps=steps,
    replicas=replicas,
    per_replica_batch=per_replica_batch,
    hidden=hidden,
    seed=seed,
    compiler_options=compiler_options,
  )
  return {"mode": mode, **record}


def train_digits(
  tx: optax.GradientTransformation,
  *,
  steps: int = 200,
  replicas: int = 8,
  per_replica_batch: int = 16,
  hidden: int | None = 64,
  seed: int = 0,
  compiler_options=None,
) -> dict:
  """Trains the digits MLP with ``tx`` (fed each replica's local gradients).

  ``tx`` must average the gradients itself (``_exact_mean`` in a chain,
  :func:`jmp_train.sign_compression`, :func:`jmp_train.one_bit_adam`, ...).
  Same data, initialisation and batches for a given ``seed``; the programs
  compiled with ``compiler_options`` (``jax.jit``'s). Returns the record
  described in :func:`run_digits` (without ``mode``).
  """
  from jmp_train import sign_compression_specs
  from jmp_train_examples.data import load_digits

  if jax.device_count() < replicas:
    raise ValueError(
      f"train_digits needs {replicas} devices, found {jax.device_count()}: set "
      f"XLA_FLAGS=--xla_force_host_platform_device_count={replicas} before JAX starts."
    )
  data = load_digits(seed=seed)
  mesh = jax.make_mesh((replicas,), (AXIS,), devices=jax.devices()[:replicas])
  params = _init_model(jax.random.key(seed), hidden)

  rng = np.random.default_rng(seed)
  global_batch = replicas * per_replica_batch
  idx = np.stack([rng.choice(len(data.x_train), global_batch, replace=False) for _ in range(steps)])
  xs = jax.device_put(data.x_train[idx], NamedSharding(mesh, P(None, AXIS)))
  ys = jax.device_put(data.y_train[idx], NamedSharding(mesh, P(None, AXIS)))

  state_shapes = jax.eval_shape(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=P()), params)
  specs = sign_compression_specs(state_shapes, AXIS)
  init = jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=specs)
  opt_state = jax.jit(init, compiler_options=compiler_options)(params)

  def residual_norm(state):
    found = [
      s
      for s in jax.tree.leaves(state, is_leaf=lambda s: hasattr(s, "worker_residual"))
      if hasattr(s, "worker_residual")
    ]
    if not found:
      return jnp.zeros(())
    return jax.lax.pmax(optax.tree.norm(found[0].worker_residual), AXIS)

  def train(params, opt_state, xs, ys):
    def body(carry, batch):
      p, s = carry
      # Replicated parameters are invariant along AXIS: mark them varying so
      # that grad returns this replica's own gradient (not a psum).
      local_p = jax.lax.pcast(p, AXIS, to="varying")
      grads = jax.grad(_loss)(local_p, *batch)
      updates, s = tx.update(grads, s, p)
      return (optax.apply_updates(p, updates), s), residual_norm(s)

    (params, opt_state), norms = jax.lax.scan(body, (params, opt_state), (xs, ys))
    return params, opt_state, norms

  run = jax.jit(
    jax.shard_map(
      train,
      mesh=mesh,
      in_specs=(P(), specs, P(None, AXIS), P(None, AXIS)),
      out_specs=(P(), specs, P()),
    ),
    compiler_options=compiler_options,
  )
  start = time.perf_counter()
  params, opt_state, norms = jax.block_until_ready(run(params, opt_state, xs, ys))
  seconds = time.perf_counter() - start
  final_loss = float(_loss(params, data.x_train, data.y_train))
  test_loss = float(_loss(params, data.x_test, data.y_test))
  accuracy = float((_logits(params, data.x_test).argmax(-1) == data.y_test).mean())
  norms = np.asarray(norms)
  return {
    "replicas": replicas,
    "steps": steps,
    "final_loss": final_loss,
    "test_loss": test_loss,
    "test_accuracy": accuracy,
    "residual_norm_final": float(norms[-1]),
    "residual_norm_max": float(norms.max()),
    "residual_norms": norms,
    "seconds": seconds,
  }


def _delayed_mean(axis_name):
  """The exact ``pmean`` of the gradients, returned one step late."""

  def init_fn(params):
    return jax.tree.map(jnp.zeros_like, params)

  def update_fn(updates, state, params=None):
    del params
    return state, jax.lax.pmean(updates, axis_name)

  return optax.GradientTransformation(init_fn, update_fn)


STUDY_MODES = (
  "float32",
  "float32_delayed",
  "1bit_ef",
  "1bit_ef_l2",
  "1bit_worker_ef",
  "one_bit_momentum",
)
QUICK_MODES = ("float32", "1bit_ef")
QUICK_STUDY_MODES = ("float32", "float32_delayed")


def momentum_study(
  learning_rates,
  *,
  steps: int = 300,
  seed: int = 0,
  modes=STUDY_MODES,
  hidden: int | None = 64,
  compiler_options=None,
) -> list[dict]:
  """Gradient compression vs a pure delay vs momentum compression (see above).

  ``modes``: a subset of ``STUDY_MODES``, ``"float32"`` first (the reference
  of ``rel_to_float32``); ``compiler_options``: :func:`train_digits`'s.
  """
  from jmp_train import one_bit_momentum, sign_compression

  records = []
  for lr in learning_rates:
    sgdm = lambda: optax.sgd(lr, momentum=0.9)
    txs = {
      "float32": optax.chain(_exact_mean(AXIS), sgdm()),
      "float32_delayed": optax.chain(_delayed_mean(AXIS), sgdm()),
      "1bit_ef": optax.chain(sign_compression(AXIS), sgdm()),
      "1bit_ef_l2": optax.chain(sign_compression(AXIS, scale="l2"), sgdm()),
      "1bit_worker_ef": optax.chain(sign_compression(AXIS, server_error_feedback=False), sgdm()),
      "one_bit_momentum": one_bit_momentum(lr, 0.9, axis_name=AXIS, scale="column"),
    }
    rows = []
    for mode in modes:
      tx = txs[mode]
      r = train_digits(tx, steps=steps, seed=seed, hidden=hidden, compiler_options=compiler_options)
      r.pop("residual_norms")
      rows.append({"study": "momentum_lr", "mode": mode, "learning_rate": lr, **r})
    for r in rows:
      r["rel_to_float32"] = r["final_loss"] / rows[0]["final_loss"] - 1.0
    records += rows
  return records


def run(quick: bool) -> list[dict]:
  # --quick (a smoke test of the benchmark's code, run by the test suite): a
  # linear classifier (one tensor: compiling the 1-bit exchange dominates),
  # fewer steps, one compressed row (1bit_ef) and the uncompressed ones; the
  # full run is what the tables report.
  steps = 20 if quick else 600
  hidden = None if quick else 64
  options = _harness.compile_options(quick)
  modes = QUICK_MODES if quick else MODES
  records = [run_digits(mode, steps=steps, hidden=hidden, compiler_options=options) for mode in modes]
  base = records[0]["final_loss"]
  for r in records:
    r["study"] = "ef_on_off"
    r["learning_rate"] = 0.1
    r["rel_to_float32"] = r["final_loss"] / base - 1.0
    r.pop("residual_norms")
  if quick:
    study = momentum_study((0.1,), steps=10, modes=QUICK_STUDY_MODES, hidden=None, compiler_options=options)
  else:
    study = momentum_study((0.1, 0.3, 0.6, 1.0))
  return records + study
