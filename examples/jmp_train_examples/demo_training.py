"""Training and evaluating one configuration of the demo: its table row and curves."""

from __future__ import annotations

import functools
import os
import time
import warnings
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

import jmp_train
from jmp_train_examples.demo_configs import CONFIGS
from jmp_train_examples.demo_configs import NUM_DEVICES
from jmp_train_examples.demo_configs import DemoError
from jmp_train_examples.demo_configs import DemoSettings
from jmp_train_examples.demo_configs import RunConfig
from jmp_train_examples.demo_configs import DILOCO_SYNC_EVERY
from jmp_train_examples.demo_configs import data_parallel_optimizer
from jmp_train_examples.demo_configs import single_device_optimizer
from jmp_train_examples.demo_tasks import TASKS
from jmp_train_examples.demo_tasks import Task
from jmp_train_examples.demo_tasks import init_params as init_task_params
from jmp_train_examples.demo_tasks import loss_fn
from jmp_train_examples.stopping import Terminated
from jmp_train_examples.stopping import deferred
from jmp_train_examples.stopping import preempted

__all__ = ["data_parallel_devices", "run_config", "run_configs"]


def _build_step(cfg: RunConfig, task: Task, s: DemoSettings) -> jmp_train.TrainStep:
  model = jmp_train.flax.apply_policy(task.model, cfg.policy)
  loss_scale = None
  if cfg.loss_scale == "dynamic":
    # Growth after 50 good steps (2000 is the usual default for long runs;
    # a short demo would never see it grow).
    loss_scale = jmp_train.DynamicLossScale(2.0**15, growth_interval=50)
  if cfg.devices > 1:
    compression, optimizer = data_parallel_optimizer(cfg, s)
  else:
    compression, optimizer = None, single_device_optimizer(cfg, s)
  with warnings.catch_warnings():
    # The "f16" row leaves loss scaling out on purpose: it shows what that costs.
    warnings.filterwarnings("ignore", "float16 compute without loss scaling", UserWarning)
    # The "f16w-sgd" row trains float16 weights with optax.sgd on purpose: it
    # shows what the modified momentum SGD of "f16w-mmsgd" fixes.
    warnings.filterwarnings("ignore", "Half-precision parameters", UserWarning)
    return jmp_train.make_train_step(
      functools.partial(model.apply, train=True),
      loss_fn,
      optimizer,
      policy=cfg.policy,
      loss_scale=loss_scale,
      compression=compression,
      mode="shard_map" if cfg.devices > 1 else "single",
      mesh=_data_parallel_mesh() if cfg.devices > 1 else None,
      has_aux=True,
      # apply_policy casts inside the model, keeping normalisation in float32.
      cast_params=False,
      eval_apply_fn=functools.partial(model.apply, train=False),
    )


def _wire_bytes_per_step(compiled: Any, cfg: RunConfig) -> float:
  """Bytes one device sends per step, read from the compiled step's HLO.

  A DiLoCo row's exchange runs in a ``lax.cond`` branch taken once every
  :data:`DILOCO_SYNC_EVERY` steps: its bytes count for that share of the
  steps; collectives outside any branch (the metrics) run every step.
  """
  if cfg.devices == 1:
    return 0
  if not cfg.compression.startswith("diloco"):
    return jmp_train.diagnostics.collective_bytes(compiled, wire=True)["total"]
  branches = jmp_train.diagnostics.conditional_branches(compiled)
  ops = jmp_train.diagnostics.collective_ops(compiled)
  every = sum(op.wire_bytes for op in ops if op.computation not in branches)
  synced = sum(op.wire_bytes for op in ops if op.computation in branches)
  return every + synced / DILOCO_SYNC_EVERY


def data_parallel_devices() -> list[Any]:
  """8 devices for the data-parallel rows: the default backend's, else CPUs.

  On a one-GPU machine the 8-device rows run on the 8 simulated CPU devices
  while the single-device rows use the GPU.
  """
  devices = jax.devices()
  if len(devices) < NUM_DEVICES:
    try:
      devices = jax.devices("cpu")
    except RuntimeError:
      pass
  return devices[:NUM_DEVICES]


def _data_parallel_mesh() -> Mesh:
  return Mesh(np.asarray(data_parallel_devices()), ("batch",))


def _local_rows(batch, step: jmp_train.TrainStep):
  """This process's rows of a global batch (all rows on one process)."""
  if step.mode == "single" or jax.process_count() == 1:
    return batch
  n, i = jax.process_count(), jax.process_index()
  return jax.tree.map(lambda x: x[i * len(x) // n : (i + 1) * len(x) // n], batch)


def _make_probe(task: Task):
  """Float32 gradients (parameters and logits) and their float16 underflow at scale 1."""

  @jax.jit
  def probe(params, batch):
    inputs, targets = batch
    logits, vjp = jax.vjp(lambda p: task.model.apply({"params": p}, inputs), params)
    g_logits = jax.grad(lambda z: loss_fn(z, targets)[0])(logits)
    (g_params,) = vjp(g_logits)
    return {
      "params": g_params,
      "logits": g_logits,
      "underflow_f16": jmp_train.diagnostics.underflow_fraction(g_params, jnp.float16),
      "underflow_f16_logits": jmp_train.diagnostics.underflow_fraction(g_logits, jnp.float16),
    }

  return probe


def _tree_bytes(tree: Any) -> int:
  return int(sum(np.dtype(x.dtype).itemsize * np.size(x) for x in jax.tree.leaves(tree)))


def _check_skipped(metrics, s: DemoSettings, name: str, step: int) -> None:
  """Raises once ``s.max_skipped_steps`` steps in a row were skipped.

  With dynamic loss scaling a model that makes NaN or inf by itself has
  every step skipped: the scale falls to its floor and training stops
  without a word. Called every 10 steps, where the loop already waits for
  the metrics (one more scalar read, no extra host sync per step).

  Raises:
    DemoError: naming the count, the configuration and the step.
  """
  consecutive = int(metrics.get("consecutive_skipped_steps", 0))
  if consecutive >= s.max_skipped_steps:
    raise DemoError(
      f"configuration {name!r} cannot learn: the last {consecutive} steps (to step "
      f"{step}) were all skipped for non-finite gradients, at loss scale "
      f"{float(metrics['loss_scale']):g} (--max-skipped-steps {s.max_skipped_steps}); "
      "the model makes NaN or inf by itself (try a float32 or bfloat16 policy, or a "
      "lower --lr)."
    )


class _ScaleFloorWatch:
  """Warns once when a dynamic loss scale has sat at its floor for a whole growth interval.

  Rare isolated overflows (one every ``growth_interval`` steps or more
  often) halve the scale faster than it grows back, so it ends at
  ``min_scale`` for good, and float16 gradients below ``2^-24 / min_scale``
  flush to zero. Fed the metrics where the loop already reads them (every
  10 steps): no host sync of its own. Silent without a
  :class:`jmp_train.DynamicLossScale`.
  """

  def __init__(self, state: Any, name: str):
    try:
      scale = jmp_train.get_loss_scale(state.opt_state)
    except ValueError:  # no loss scaling
      scale = None
    self.floor = getattr(scale, "min_scale", None)
    self.interval = getattr(scale, "growth_interval", None)
    self.name, self.since, self.warned = name, None, False

  def update(self, metrics: Any, step: int) -> None:
    if self.floor is None or self.warned:
      return
    if float(metrics["loss_scale"]) > self.floor:
      self.since = None
      return
    self.since = step if self.since is None else self.since
    if step - self.since >= self.interval:
      self.warned = True
      warnings.warn(
        f"configuration {self.name!r}: the dynamic loss scale has sat at its floor min_scale="
        f"{self.floor:g} from step {self.since} to step {step}, a whole growth_interval "
        f"({self.interval}): overflows back it off faster than it grows, and float16 gradients "
        f"below {2.0**-24 / self.floor:.3g} flush to zero. Use a shorter growth_interval, a lower "
        "min_scale, or a bfloat16 policy.",
        UserWarning,
        stacklevel=2,
      )


# Settings that change what a configuration computes: a checkpoint written
# under others cannot be resumed.
_RUN_SETTINGS = (
  "task",
  "steps",
  "batch",
  "seq_len",
  "d_model",
  "layers",
  "hidden",
  "learning_rate",
  "warmup_fraction",
  "final_lr_fraction",
  "momentum",
  "one_bit_warmup_steps",
  "one_bit_scale",
  "init",
  "seed",
)


class _Checkpoints:
  """One configuration's checkpoints under ``s.checkpoint_dir/<name>`` (orbax).

  Each checkpoint holds the :class:`~jmp_train.TrainState` and, as JSON, the
  curves so far, the last metrics, the settings it was trained under and
  how it ran (``layout``: the process count, the backend, JAX's version).
  Saves are asynchronous, at every multiple of ``s.checkpoint_every`` and at
  the last step; the last two are kept.

  A resume continues bit for bit only under the same settings, the same
  process count (a cross-process sum adds in another order with another
  count) and the same backend: :meth:`check` refuses a checkpoint made
  otherwise, before anything is compiled. A JAX version that differs is
  only warned about (its compiler may round differently).
  """

  def __init__(self, name: str, s: DemoSettings, processes: int = 1, backend: str | None = None):
    import orbax.checkpoint as ocp

    self._ocp, self._s, self.name = ocp, s, name
    self.directory = os.path.abspath(os.path.join(s.checkpoint_dir, name))
    self.settings = {k: getattr(s, k) for k in _RUN_SETTINGS}
    self.layout = {"processes": processes, "backend": backend or jax.default_backend(), "jax": jax.__version__}
    self.manager = ocp.CheckpointManager(
      self.directory, options=ocp.CheckpointManagerOptions(max_to_keep=2, enable_async_checkpointing=True)
    )

  def check(self) -> None:
    """Raises if the latest checkpoint cannot be resumed here (reads its JSON only)."""
    latest = self.manager.latest_step()
    if latest is None:
      return
    with deferred():
      try:
        restored = self.manager.restore(latest, args=self._ocp.args.Composite(record=self._ocp.args.JsonRestore()))
      except (ValueError, OSError, KeyError):
        return  # a damaged record: restore() passes over its step, with a warning
    self._check_record(restored["record"], warn=True)

  def _check_record(self, record: dict, warn: bool = False) -> None:
    if record.get("settings") != self.settings:
      changed = sorted(k for k in self.settings if record.get("settings", {}).get(k) != self.settings[k])
      raise DemoError(
        f"the checkpoint of {self.name!r} in {self.directory} was trained with other "
        f"settings ({', '.join(changed)} differ); rerun with those, or pass another "
        "--checkpoint-dir."
      )
    # Checkpoints written before the layout was recorded resume as before.
    layout = record.get("layout", {})
    then, now = layout.get("processes"), self.layout["processes"]
    if then is not None and then != now:
      raise DemoError(
        f"the checkpoint of {self.name!r} in {self.directory} was written by {then} "
        f"process(es) (--num-processes {then}); this run has {now}, and would not "
        "continue bit for bit (the cross-process sums add in another order); rerun "
        f"with --num-processes {then}, or pass another --checkpoint-dir."
      )
    then, now = layout.get("backend"), self.layout["backend"]
    if then is not None and then != now:
      raise DemoError(
        f"the checkpoint of {self.name!r} in {self.directory} was written on {then}, "
        f"this run is on {now}, and would not continue bit for bit; rerun on {then} "
        "(JAX_PLATFORMS), or pass another --checkpoint-dir."
      )
    if warn and layout.get("jax") not in (None, self.layout["jax"]):
      warnings.warn(
        f"the checkpoint of {self.name!r} was written with jax {layout['jax']}, this is "
        f"jax {self.layout['jax']}: the resumed run may differ from an uninterrupted one "
        "in the last bits",
        RuntimeWarning,
        stacklevel=3,
      )

  def restore(self, state):
    """``(state, step, record)`` of the newest intact checkpoint, else ``(state, 0, None)``.

    A damaged or incomplete step (its arrays or its record differ from the
    checksums saved with them, a file is missing or truncated) is passed
    over with a warning naming it (:func:`jmp_train.restore_latest_checkpoint`).
    """
    if self.manager.latest_step() is None:
      return state, 0, None
    ocp = self._ocp
    with deferred():
      latest, state = jmp_train.restore_latest_checkpoint(self.directory, state)
      for damaged in [n for n in self.manager.all_steps() if n > latest]:
        self.manager.delete(damaged)  # passed over: the run saves that step again
      record = self.manager.restore(latest, args=ocp.args.Composite(record=ocp.args.JsonRestore()))["record"]
    self._check_record(record)
    return state, latest, record

  def due(self, n: int) -> bool:
    return n % self._s.checkpoint_every == 0 or n == self._s.steps

  def save(self, n: int, state, curves: dict[str, list[float]], metrics) -> None:
    record = {
      "settings": self.settings,
      "layout": self.layout,
      **curves,
      "metrics": {k: float(metrics[k]) for k in ("loss_scale", "skipped_steps")},
    }
    with deferred():  # SIGTERM: after the save has started
      # Items "state" and "record", with their checksums (restore() verifies them).
      self.manager.save(n, force=True, args=jmp_train.checkpoint_save_args(state, record=record))

  def close(self) -> None:
    with deferred():
      self.manager.close()  # waits for a save in flight


def _host_curve(prior: list[float], values: list[Any]) -> list[float]:
  if not values:
    return list(prior)
  return list(prior) + np.asarray(jax.device_get(jnp.stack(values)), np.float64).tolist()


def _train(step, compiled, state, task, s, progress, name="?", checkpoints=None):
  """Runs the steps; returns the state, the last metrics, curves and steps/s.

  Every 10 steps, when the metrics are fetched for the progress bar, it
  checks the consecutive skipped steps (:func:`_check_skipped`) and whether
  the loss scale is stuck at its floor (:class:`_ScaleFloorWatch`). With
  ``checkpoints`` (a :class:`_Checkpoints`), it starts from the latest
  complete checkpoint and saves periodically.
  """
  begin, prior = 0, {"loss": [], "loss_scale": []}
  metrics = None
  if checkpoints is not None:
    state, begin, record = checkpoints.restore(state)
    if record is not None:
      prior = {k: record[k] for k in prior}
      metrics = record["metrics"]
      progress(begin, {"resumed": begin})
  losses, scales, start = [], [], None
  floor = _ScaleFloorWatch(state, name)
  for i in range(begin, s.steps):
    batch = step.shard_batch(_local_rows(task.train_batch(i), step))
    state, metrics = compiled(state, batch)
    losses.append(metrics["loss"])
    scales.append(metrics["loss_scale"])
    if step.mode != "single" or i == begin:
      # Wait for each multi-device step before queueing the next: queued
      # collectives can starve on XLA:CPU.
      jax.block_until_ready(metrics)
    if i == begin:
      start = time.perf_counter()
    # SIGTERM to any worker process: all save this step and stop.
    stop = preempted(i + 1)
    if checkpoints is not None and (checkpoints.due(i + 1) or stop):
      curves = {"loss": _host_curve(prior["loss"], losses), "loss_scale": _host_curve(prior["loss_scale"], scales)}
      checkpoints.save(i + 1, state, curves, metrics)
    if stop:
      raise Terminated()
    if (i + 1) % 10 == 0 or i + 1 == s.steps:
      progress(i + 1, {"loss": float(metrics["loss"])})
      _check_skipped(metrics, s, name, i + 1)
      floor.update(metrics, i + 1)
  jax.block_until_ready(state)
  ran = s.steps - begin
  elapsed = time.perf_counter() - start if start is not None else 0.0
  steps_per_s = (ran - 1) / elapsed if ran > 1 and elapsed > 0 else float("nan")
  curves = {"loss": _host_curve(prior["loss"], losses), "loss_scale": _host_curve(prior["loss_scale"], scales)}
  return state, metrics, curves, steps_per_s


def _evaluate(step, state, task) -> dict[str, dict[str, float]]:
  evals = {}
  for split, batches in task.eval_sets.items():
    results = [jax.device_get(step.evaluate(state, step.shard_batch(_local_rows(b, step)))) for b in batches]
    evals[split] = {k: float(np.mean([r[k] for r in results])) for k in results[0]}
  return evals


def run_config(
  cfg: RunConfig,
  task: Task,
  s: DemoSettings,
  init_params: Any,
  probe: Callable[..., Any],
  progress: Callable[[int, dict[str, float]], None],
) -> tuple[dict[str, Any], dict[str, Any]]:
  """Trains one configuration; returns its table row and its curves."""
  step = _build_step(cfg, task, s)
  checkpoints = None
  if s.checkpoint_dir:
    devices = list(step.mesh.devices.flat) if step.mesh is not None else jax.devices()[:1]
    checkpoints = _Checkpoints(
      cfg.name, s, processes=len({d.process_index for d in devices}), backend=devices[0].platform
    )
  try:
    if checkpoints is not None:
      checkpoints.check()  # before the compile: a refusal comes at once
    state = step.init(init_params)
    t0 = time.perf_counter()
    compiled = step.lower(state, step.shard_batch(_local_rows(task.train_batch(0), step))).compile()
    compile_s = time.perf_counter() - t0
    wire = _wire_bytes_per_step(compiled, cfg)
    state_bytes = _tree_bytes(step.unreplicate((state.params, state.opt_state)))
    state, metrics, curves, steps_per_s = _train(step, compiled, state, task, s, progress, cfg.name, checkpoints)
  finally:
    if checkpoints is not None:
      checkpoints.close()
  evals = _evaluate(step, state, task)
  params = jax.tree.map(lambda x: np.asarray(x, np.float32), step.unreplicate(state.params))
  probed = jax.device_get(probe(params, task.eval_sets["val"][0]))
  row = {
    "config": cfg.name,
    "description": cfg.description,
    "policy": cfg.policy,
    "reference": cfg.reference,
    "train_loss": evals["train"]["loss"],
    "val_loss": evals["val"]["loss"],
    "train_acc": evals["train"]["accuracy"],
    "val_acc": evals["val"]["accuracy"],
    "steps_per_s": steps_per_s,
    "compile_s": compile_s,
    "skipped": int(metrics["skipped_steps"]),
    "loss_scale": float(metrics["loss_scale"]),
    "underflow_f16": float(probed["underflow_f16"]),
    "underflow_f16_logits": float(probed["underflow_f16_logits"]),
    "state_bytes": state_bytes,
    "wire_bytes_per_step": int(wire),
    "devices": cfg.devices,
    "processes": jax.process_count() if cfg.devices > 1 else 1,
    "backend": (step.mesh.devices.flat[0] if step.mesh is not None else jax.devices()[0]).platform,
  }
  curves["grads"] = {"params": probed["params"], "logits": probed["logits"]}
  return row, curves


def run_configs(s: DemoSettings, names: Sequence[str], bar=None, task: Task | None = None) -> tuple[list[dict], dict]:
  """Runs ``names`` in this process (on ``task``, else ``s``'s); returns rows and curves."""
  task = TASKS[s.task](s) if task is None else task
  params = init_task_params(task, s)
  probe = _make_probe(task)
  rows, curves = [], {}
  for name in names:
    cfg = CONFIGS[name]
    done = [0]

    def progress(i, postfix, cfg=cfg, done=done):
      if bar is not None:
        bar.update(i - done[0])
        bar.set_postfix(config=cfg.name, **postfix)
      done[0] = i

    row, curve = run_config(cfg, task, s, params, probe, progress)
    rows.append(row)
    curves[name] = curve
  return rows, curves
