"""The demo behind ``jmp-train``: each fix of the mixed-precision papers, on a real task.

Trains one model, from the same initial weights, on the same batches, under
one learning-rate schedule (linear warm-up, then cosine decay to a small
rate), in each configuration of :data:`CONFIGS`, in three comparisons:

* **loss scaling**: float32; mixed float16 without loss scaling (gradients
  below float16's range flush to zero); mixed float16 with dynamic loss
  scaling; mixed bfloat16 (float32's range, no scaling needed);
* **weight updates**: float16 weights (no float32 master copy) with the
  float32 row's momentum SGD (``optax.sgd``), whose step ``lr·G`` is lost
  once it falls below half an ulp of the weights as the rate decays, and
  with :func:`jmp_train.modified_momentum_sgd` (the modified momentum of
  NVIDIA's mixed-precision training guide, with error feedback of what
  rounding drops);
* **compression**: data parallelism over 8 devices with a float32
  all-reduce, 1-bit compression without error feedback, and 1-bit SGD with
  error feedback (Seide et al.).

Reports one table (final train and validation loss and accuracy, the
validation loss relative to the comparison's float32 reference, steps per
second, skipped steps, final loss scale, the share of gradients that would
underflow float16 without loss scaling, bytes of parameters + optimizer
state, and wire bytes per step read from the compiled HLO) and writes
``results.json`` and, with matplotlib, ``results.png``
(:mod:`jmp_train.examples.demo_plot`).

The task is a character-level Transformer language model on the Python
standard library's own source (:func:`jmp_train.examples.data.load_text_corpus`),
or an MLP on scikit-learn's 8x8 digits (``--task digits``). Single-device
rows run on JAX's default device (a GPU when there is one); the 8-device rows
need 8 devices of one kind, which on a one-GPU machine are 8 simulated CPU
devices (:func:`jmp_train.examples.cli.main` creates them).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import pathlib
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh

import jmp_train
from jmp_train.examples import data as data_lib

__all__ = [
    "CONFIGS", "COLUMNS", "DemoError", "DemoSettings", "RunConfig", "format_table", "run_demo",
    "learning_rate_schedule", "data_parallel_optimizer",
]

NUM_DEVICES = 8


class DemoError(Exception):
  """A user-facing error: printed as one line by the CLI, no traceback."""


class RunConfig(NamedTuple):
  """One row of the demo.

  Attributes:
    name: short name (``--configs`` takes these).
    description: what the row shows.
    policy: the dtype policy spec.
    loss_scale: ``"none"`` or ``"dynamic"``.
    optimizer: ``"momentum"`` (``optax.sgd`` with momentum: the buffer
      accumulates gradients, the learning rate is applied last),
      ``"momentum-lr-in-buffer"`` (``H ← mH − λg; W ← W + H``, the plain form
      that keeps the learning rate inside the buffer) or
      ``"modified-momentum"`` (:func:`jmp_train.modified_momentum_sgd`).
    devices: 1 (``jit``) or 8 (``shard_map`` over a data-parallel mesh).
    compression: ``"none"``, ``"1bit"`` (with error feedback) or
      ``"1bit-noef"`` (without).
    reference: the row this one is compared with (``val_loss_gap``).
  """

  name: str
  description: str
  policy: str
  loss_scale: str = "none"
  optimizer: str = "momentum"
  devices: int = 1
  compression: str = "none"
  reference: str = "f32"


_F16_WEIGHTS = "params=float16,compute=float16,output=float32"

CONFIGS: dict[str, RunConfig] = {
    c.name: c
    for c in (
        RunConfig("f32", "float32", "float32"),
        RunConfig("f16", "mixed float16, no loss scaling", "mixed_float16"),
        RunConfig("f16-dls", "mixed float16, dynamic loss scaling", "mixed_float16", "dynamic"),
        RunConfig("bf16", "mixed bfloat16", "mixed_bfloat16"),
        RunConfig("f16w-sgd", "float16 weights, momentum SGD (optax.sgd)",
                  _F16_WEIGHTS, "dynamic", "momentum"),
        RunConfig("f16w-mmsgd", "float16 weights, modified momentum SGD",
                  _F16_WEIGHTS, "dynamic", "modified-momentum"),
        RunConfig("8dev-f32", "8 devices, float32 all-reduce", "float32",
                  devices=NUM_DEVICES, reference="8dev-f32"),
        RunConfig("8dev-1bit-noef", "8 devices, 1-bit, no error feedback", "float32",
                  devices=NUM_DEVICES, compression="1bit-noef", reference="8dev-f32"),
        RunConfig("8dev-1bit", "8 devices, 1-bit SGD + error feedback", "float32",
                  devices=NUM_DEVICES, compression="1bit", reference="8dev-f32"),
    )
}

# The three comparisons of the figure, each with its reference first.
COMPARISONS = {
    "loss scaling": ("f32", "f16", "f16-dls", "bf16"),
    "weight updates": ("f32", "f16w-sgd", "f16w-mmsgd"),
    "compression": ("8dev-f32", "8dev-1bit-noef", "8dev-1bit"),
}

COLUMNS = (
    "config", "train_loss", "val_loss", "val_loss_gap", "val_acc", "steps_per_s", "skipped",
    "loss_scale", "underflow_f16", "underflow_f16_logits", "state_bytes",
    "wire_bytes_per_step",
)


@dataclasses.dataclass(frozen=True)
class DemoSettings:
  """The demo's knobs (the CLI flags)."""

  task: str = "text"
  steps: int = 200
  batch: int = 32
  seq_len: int = 64
  d_model: int = 64
  layers: int = 1
  hidden: int = 128
  learning_rate: float = 0.15
  warmup_fraction: float = 0.1
  final_lr_fraction: float = 0.01
  momentum: float = 0.9
  one_bit_warmup_steps: int = 0
  one_bit_scale: str = "l1"
  init: str = "flax"
  configs: tuple[str, ...] = tuple(CONFIGS)
  out: str = "jmp_train_output"
  seed: int = 0
  eval_batches: int = 4
  num_processes: int = 1
  plot: bool = True
  progress: bool = True


def warmup_steps(s: DemoSettings) -> int:
  """Steps of the learning-rate warm-up (``warmup_fraction`` of the steps, at least 1)."""
  return max(1, int(s.warmup_fraction * s.steps))


def learning_rate_schedule(s: DemoSettings) -> optax.Schedule:
  """Linear warm-up over ``warmup_fraction`` of the steps, then cosine decay.

  From 0 to ``learning_rate``, then down to ``learning_rate *
  final_lr_fraction`` at the last step (``optax.warmup_cosine_decay_schedule``).
  """
  return optax.warmup_cosine_decay_schedule(
      init_value=0.0,
      peak_value=s.learning_rate,
      warmup_steps=warmup_steps(s),
      decay_steps=max(2, s.steps),
      end_value=s.learning_rate * s.final_lr_fraction,
  )


# ----------------------------------------------------------------------------
# Tasks: deterministic batches (batch ``i`` depends on (seed, i) only).


class Task(NamedTuple):
  model: Any
  example_input: np.ndarray
  train_batch: Callable[[int], tuple[np.ndarray, np.ndarray]]
  eval_sets: dict[str, list[tuple[np.ndarray, np.ndarray]]]


def _loss_fn(logits, targets):
  # The mean over every token of the batch: the usual language-model loss.
  loss = optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()
  accuracy = jnp.mean((jnp.argmax(logits, -1) == targets).astype(jnp.float32))
  return loss, {"accuracy": accuracy}


def _text_task(s: DemoSettings) -> Task:
  from jmp_train.examples.models import TransformerBlock  # pylint: disable=g-import-not-at-top

  corpus = data_lib.load_text_corpus(1_000_000)
  split = int(len(corpus) * 0.9)
  train, val = corpus[:split], corpus[split:]
  offsets = np.arange(s.seq_len + 1)

  def windows(source, rng, n):
    starts = rng.integers(0, len(source) - s.seq_len - 1, size=n)
    w = source[starts[:, None] + offsets].astype(np.int32)
    return w[:, :-1], w[:, 1:]

  def train_batch(i):
    return windows(train, np.random.default_rng((s.seed, i)), s.batch)

  def eval_set(source, seed):
    rng = np.random.default_rng((s.seed, seed, 7))
    return [windows(source, rng, s.batch) for _ in range(s.eval_batches)]

  model = TransformerBlock(
      vocab_size=data_lib.TEXT_VOCAB_SIZE,
      d_model=s.d_model,
      num_heads=max(1, s.d_model // 16),
      mlp_dim=4 * s.d_model,
      num_layers=s.layers,
      max_len=s.seq_len,
  )
  return Task(
      model,
      np.zeros((1, s.seq_len), np.int32),
      train_batch,
      {"train": eval_set(train, 1), "val": eval_set(val, 2)},
  )


def _digits_task(s: DemoSettings) -> Task:
  from jmp_train.examples.models import MLP  # pylint: disable=g-import-not-at-top

  try:
    ds = data_lib.load_digits(seed=s.seed)
  except ImportError as e:
    raise DemoError(f"{e} (or use --task text)") from None

  def train_batch(i):
    idx = np.random.default_rng((s.seed, i)).integers(0, len(ds.x_train), s.batch)
    return ds.x_train[idx], ds.y_train[idx]

  def eval_set(x, y):
    n = (len(x) // s.batch) * s.batch
    return [(x[j:j + s.batch], y[j:j + s.batch]) for j in range(0, n, s.batch)]

  model = MLP(features=(s.hidden,) * max(1, s.layers), num_classes=10)
  return Task(
      model,
      np.zeros((1, 64), np.float32),
      train_batch,
      {"train": eval_set(ds.x_train, ds.y_train)[: s.eval_batches * 4],
       "val": eval_set(ds.x_test, ds.y_test)},
  )


TASKS = {"text": _text_task, "digits": _digits_task}


# ----------------------------------------------------------------------------
# Optimizers.


def single_device_optimizer(cfg: RunConfig, s: DemoSettings) -> optax.GradientTransformation:
  """The optimizer of a single-device row (all under one schedule)."""
  lr, m = learning_rate_schedule(s), s.momentum
  if cfg.optimizer == "momentum":
    return optax.sgd(lr, momentum=m)
  if cfg.optimizer == "momentum-lr-in-buffer":
    # H <- m H - lr g ; W <- W + H, with H in the parameters' dtype.
    return optax.chain(optax.scale_by_learning_rate(lr), optax.trace(decay=m))
  if cfg.optimizer == "modified-momentum":
    return jmp_train.modified_momentum_sgd(lr, momentum=m)
  raise ValueError(
      f"Unknown optimizer {cfg.optimizer!r}; valid: 'momentum', 'momentum-lr-in-buffer', "
      "'modified-momentum'."
  )


def _one_bit_momentum():
  # Public as jmp_train.one_bit_momentum once exported; the module until then.
  if hasattr(jmp_train, "one_bit_momentum"):
    return jmp_train.one_bit_momentum
  from jmp_train._src.one_bit_optimizers import one_bit_momentum  # pylint: disable=g-import-not-at-top

  return one_bit_momentum


def data_parallel_optimizer(
    cfg: RunConfig, s: DemoSettings, axis_name: str = "batch"
) -> tuple[optax.GradientTransformation | None, optax.GradientTransformation]:
  """``(compression, optimizer)`` of an 8-device row, for ``make_train_step``.

  Every 8-device row runs the single-device rows' momentum SGD (momentum
  ``s.momentum``) under the same schedule:

  * ``8dev-f32``: float32 ``pmean`` of the gradients, then ``optax.sgd``;
  * ``8dev-1bit-noef``: each replica's gradient sent as 1 bit per element
    (:func:`jmp_train.sign_compression` with ``error_feedback=False``: what
    the quantization drops is lost), then ``optax.sgd``;
  * ``8dev-1bit``: 1-bit SGD with error feedback on the momentum
    (``one_bit_momentum``): each replica adds its gradient to the momentum,
    and the momentum crosses devices as 1 bit per element with worker and
    server residuals. (Compressing gradients *before* a momentum buffer
    lets the momentum integrate the quantization error, which diverged on
    this task at momentum 0.9.)

  Both 1-bit rows reconstruct with ``s.one_bit_scale``: ``"l1"`` (default;
  one value per tensor chunk, the mean ``|v|``, as EF-SignSGD), ``"l2"`` or
  ``"column"`` (one value per column, Seide et al.). ``s.one_bit_warmup_steps``
  exact steps come first in ``8dev-1bit``.
  """
  lr, m = learning_rate_schedule(s), s.momentum
  if cfg.compression == "none":
    return None, optax.sgd(lr, momentum=m)
  if cfg.compression == "1bit-noef":
    compression = jmp_train.sign_compression(
        axis_name, error_feedback=False, server_error_feedback=False, scale=s.one_bit_scale)
    return compression, optax.sgd(lr, momentum=m)
  if cfg.compression == "1bit":
    # It averages across replicas and applies the learning rate itself.
    tx = _one_bit_momentum()(
        lr, m, axis_name=axis_name, warmup_steps=s.one_bit_warmup_steps,
        scale=s.one_bit_scale)
    return tx, optax.identity()
  raise ValueError(
      f"Unknown compression {cfg.compression!r}; valid: 'none', '1bit', '1bit-noef'."
  )


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
  return jmp_train.make_train_step(
      functools.partial(model.apply, train=True),
      _loss_fn,
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


def _data_parallel_devices() -> list[Any]:
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
  return Mesh(np.asarray(_data_parallel_devices()), ("batch",))


def _local_rows(batch, step: jmp_train.TrainStep):
  """This process's rows of a global batch (all rows on one process)."""
  if step.mode == "single" or jax.process_count() == 1:
    return batch
  n, i = jax.process_count(), jax.process_index()
  return jax.tree.map(lambda x: x[i * len(x) // n:(i + 1) * len(x) // n], batch)


def _make_probe(task: Task):
  """Float32 gradients (parameters and logits) and their float16 underflow at scale 1."""

  @jax.jit
  def probe(params, batch):
    inputs, targets = batch
    logits, vjp = jax.vjp(lambda p: task.model.apply({"params": p}, inputs), params)
    g_logits = jax.grad(lambda z: _loss_fn(z, targets)[0])(logits)
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


def _train(step, compiled, state, task, s, progress):
  """Runs the steps; returns the state, the last metrics, curves and steps/s."""
  losses, scales, start, metrics = [], [], None, None
  first = step.shard_batch(_local_rows(task.train_batch(0), step))
  for i in range(s.steps):
    batch = first if i == 0 else step.shard_batch(_local_rows(task.train_batch(i), step))
    state, metrics = compiled(state, batch)
    losses.append(metrics["loss"])
    scales.append(metrics["loss_scale"])
    if step.mode != "single" or i == 0:
      # Wait for each multi-device step before queueing the next: queued
      # collectives can starve on XLA:CPU.
      jax.block_until_ready(metrics)
    if i == 0:
      start = time.perf_counter()
    if (i + 1) % 10 == 0 or i + 1 == s.steps:
      progress(i + 1, {"loss": float(metrics["loss"])})
  jax.block_until_ready(state)
  elapsed = time.perf_counter() - start
  steps_per_s = (s.steps - 1) / elapsed if s.steps > 1 and elapsed > 0 else float("nan")
  curves = {
      "loss": np.asarray(jax.device_get(jnp.stack(losses)), np.float64).tolist(),
      "loss_scale": np.asarray(jax.device_get(jnp.stack(scales)), np.float64).tolist(),
  }
  return state, metrics, curves, steps_per_s


def _evaluate(step, state, task) -> dict[str, dict[str, float]]:
  evals = {}
  for split, batches in task.eval_sets.items():
    results = [
        jax.device_get(step.evaluate(state, step.shard_batch(_local_rows(b, step))))
        for b in batches
    ]
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
  state = step.init(init_params)
  t0 = time.perf_counter()
  compiled = step.lower(state, step.shard_batch(_local_rows(task.train_batch(0), step))).compile()
  compile_s = time.perf_counter() - t0
  wire = jmp_train.collective_bytes(compiled, wire=True)["total"] if cfg.devices > 1 else 0
  state_bytes = _tree_bytes(step.unreplicate((state.params, state.opt_state)))
  state, metrics, curves, steps_per_s = _train(step, compiled, state, task, s, progress)
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
      "backend": (step.mesh.devices.flat[0] if step.mesh is not None
                  else jax.devices()[0]).platform,
  }
  curves["grads"] = {"params": probed["params"], "logits": probed["logits"]}
  return row, curves


# ----------------------------------------------------------------------------
# The whole demo.


def gpt2_init(params: Any, key: jax.Array, num_layers: int, std: float = 0.02) -> Any:
  """GPT-2's initialization of a :class:`~jmp_train.examples.models.TransformerBlock`.

  Every ``kernel`` and ``embedding`` drawn from ``N(0, std²)``, the projections
  back into the residual stream (``attn/out``, ``mlp_out``) from
  ``N(0, std² / (2 · num_layers))``; biases and norm scales keep their values
  (0 and 1). Radford et al., "Language Models are Unsupervised Multitask
  Learners", 2019, section 2.3.
  """
  flat, treedef = jax.tree_util.tree_flatten_with_path(params)
  keys = jax.random.split(key, len(flat))
  out = []
  for (path, x), k in zip(flat, keys):
    names = [getattr(p, "key", str(p)) for p in path]
    if names[-1] in ("kernel", "embedding"):
      scale = std / np.sqrt(2 * num_layers) if names[-2] in ("out", "mlp_out") else std
      x = scale * jax.random.normal(k, np.shape(x), np.float32)
    out.append(x)
  return jax.tree_util.tree_unflatten(treedef, out)


def _init_params(task: Task, s: DemoSettings):
  variables = task.model.init(jax.random.PRNGKey(s.seed), task.example_input)
  params = variables["params"]
  if s.init not in ("flax", "gpt2"):
    raise ValueError(f"Unknown init {s.init!r}; valid: 'flax', 'gpt2'.")
  if s.init == "gpt2" and s.task == "text":
    params = gpt2_init(params, jax.random.PRNGKey(s.seed + 1), max(1, s.layers))
  return jax.device_get(params)


def run_configs(s: DemoSettings, names: Sequence[str], bar=None) -> tuple[list[dict], dict]:
  """Runs ``names`` in this process; returns rows and curves."""
  task = TASKS[s.task](s)
  params = _init_params(task, s)
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


def _free_port() -> int:
  with socket.socket() as sock:
    sock.bind(("127.0.0.1", 0))
    return sock.getsockname()[1]


def _run_processes(s: DemoSettings, names: Sequence[str], argv_base: list[str]) -> tuple[list[dict], dict]:
  """Runs ``names`` in ``s.num_processes`` local processes (jax.distributed)."""
  port = _free_port()
  with tempfile.TemporaryDirectory(prefix="jmp_train_mp_") as tmp:
    procs = []
    for pid in range(s.num_processes):
      cmd = [
          sys.executable, "-m", "jmp_train", *argv_base,
          "--configs", ",".join(names), "--out", tmp, "--no-plot", "--no-progress",
          "--num-processes", "1",
          "--_process", f"{pid},{s.num_processes},{port}",
      ]
      env = dict(os.environ)
      env.pop("XLA_FLAGS", None)
      procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, text=True))
    logs = [p.communicate()[0] for p in procs]
    for pid, (p, log) in enumerate(zip(procs, logs)):
      if p.returncode != 0:
        last = [l for l in log.strip().splitlines() if l.strip()][-1:] or ["(no output)"]
        raise DemoError(f"process {pid} of {s.num_processes} failed: {last[0]}")
    payload = json.loads((pathlib.Path(tmp) / "worker.json").read_text())
  return payload["rows"], payload["curves"]


def _add_gaps(rows: list[dict]) -> None:
  """``val_loss_gap``: validation loss relative to the row's reference."""
  by_name = {r["config"]: r for r in rows}
  for r in rows:
    ref = by_name.get(r["reference"])
    r["val_loss_gap"] = (r["val_loss"] / ref["val_loss"] - 1.0) if ref else None


def _run_all(s: DemoSettings, argv_base: Sequence[str]) -> tuple[list[dict], dict]:
  local = [n for n in s.configs if s.num_processes == 1 or CONFIGS[n].devices == 1]
  remote = [n for n in s.configs if n not in local]
  bar = None
  if s.progress:
    from tqdm.auto import tqdm  # pylint: disable=g-import-not-at-top

    bar = tqdm(total=s.steps * len(local), desc="jmp-train", unit="step",
               dynamic_ncols=True, file=sys.stderr)
  try:
    rows, curves = run_configs(s, local, bar)
  finally:
    if bar is not None:
      bar.close()
  if remote:
    if s.progress:
      print(f"running {', '.join(remote)} in {s.num_processes} processes "
            "(jax.distributed, gloo on 127.0.0.1)...", file=sys.stderr, flush=True)
    more_rows, more_curves = _run_processes(s, remote, list(argv_base))
    rows += more_rows
    curves.update(more_curves)
  order = {n: i for i, n in enumerate(s.configs)}
  rows.sort(key=lambda r: order[r["config"]])
  _add_gaps(rows)
  return rows, curves


def run_demo(s: DemoSettings, *, argv_base: Sequence[str] = (), worker: bool = False) -> list[dict]:
  """Runs the demo; writes ``results.json`` (and ``results.png``) to ``s.out``.

  Args:
    s: the settings.
    argv_base: the CLI flags that describe ``s`` (passed on to worker
      processes with ``--num-processes``).
    worker: this process is one of ``--num-processes`` workers.

  Returns:
    The table rows.
  """
  if (len(_data_parallel_devices()) < NUM_DEVICES
      and any(CONFIGS[n].devices > 1 for n in s.configs)):
    raise DemoError(
        f"the 8-device configurations need {NUM_DEVICES} devices, JAX has "
        f"{jax.device_count()}; run through `jmp-train` (it sets them up), or "
        "leave the 8dev-* configurations out of --configs."
    )
  out = pathlib.Path(s.out)
  out.mkdir(parents=True, exist_ok=True)
  if worker:
    rows, curves = run_configs(s, s.configs)
    if jax.process_index() == 0:
      (out / "worker.json").write_text(json.dumps(
          {"rows": rows, "curves": {k: _json_curves(v) for k, v in curves.items()}}))
    return rows
  t0, cpu0 = time.perf_counter(), time.process_time()
  rows, curves = _run_all(s, argv_base)
  payload = {
      "settings": dataclasses.asdict(s),
      "machine": {
          "backend": jax.default_backend(),
          "devices": jax.device_count(),
          "cpu_count": os.cpu_count(),
          "jax": jax.__version__,
      },
      "timing": {"wall_s": time.perf_counter() - t0, "cpu_s": time.process_time() - cpu0},
      "columns": list(COLUMNS),
      "comparisons": {k: list(v) for k, v in COMPARISONS.items()},
      "rows": rows,
      "curves": {k: _json_curves(v) for k, v in curves.items()},
  }
  (out / "results.json").write_text(json.dumps(payload, indent=2, default=_jsonable) + "\n")
  if s.plot:
    from jmp_train.examples import demo_plot  # pylint: disable=g-import-not-at-top

    demo_plot.plot(out / "results.png", rows, curves, s, learning_rate_schedule(s))
  return rows


def _json_curves(curve: dict) -> dict:
  return {k: v for k, v in curve.items() if k in ("loss", "loss_scale")}


def _jsonable(x: Any) -> Any:
  if isinstance(x, dict):
    return {k: _jsonable(v) for k, v in x.items()}
  if isinstance(x, (list, tuple)):
    return [_jsonable(v) for v in x]
  if hasattr(x, "tolist"):
    return x.tolist()
  return x


def _cell(v: Any, column: str) -> str:
  if v is None:
    return "-"
  if column == "val_loss_gap":
    return f"{v:+.1%}"
  if isinstance(v, float):
    return str(v) if not np.isfinite(v) else (f"{v:.4g}" if abs(v) < 1e5 else f"{v:.3g}")
  return str(v)


def format_table(rows: Sequence[dict[str, Any]], columns: Sequence[str] = COLUMNS) -> str:
  """The rows as a GitHub-markdown table, in the demo's column order."""
  if not rows:
    return "(no rows)"
  cells = [[_cell(r.get(c), c) for c in columns] for r in rows]
  widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]

  def line(values):
    return "| " + " | ".join(v.ljust(w) for v, w in zip(values, widths)) + " |"

  sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
  return "\n".join([line(columns), sep, *(line(r) for r in cells)])
