"""The demo's configurations, settings, learning-rate schedule and optimizers.

Each row of the demo is a :class:`RunConfig` of :data:`CONFIGS`; the CLI
flags are a :class:`DemoSettings`. Every row trains under
:func:`learning_rate_schedule`, with the optimizer
:func:`single_device_optimizer` or :func:`data_parallel_optimizer` builds.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import optax

import jmp_train

__all__ = [
  "COLUMNS",
  "COMPARISONS",
  "CONFIGS",
  "DEFAULT_CONFIGS",
  "DILOCO_SYNC_EVERY",
  "DemoError",
  "DemoSettings",
  "NUM_DEVICES",
  "RunConfig",
  "data_parallel_optimizer",
  "learning_rate_schedule",
  "single_device_optimizer",
  "warmup_steps",
]

NUM_DEVICES = 8
# Steps between the DiLoCo rows' synchronisations: the demo's 200 steps are
# 25 rounds.
DILOCO_SYNC_EVERY = 8


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
    compression: ``"none"``, ``"1bit"`` (with error feedback),
      ``"1bit-noef"`` (without), ``"diloco"`` (local steps, an exact
      average every :data:`DILOCO_SYNC_EVERY` steps) or ``"diloco-1bit"``
      (the average through 1-bit compression with error feedback).
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
    RunConfig("f16w-sgd", "float16 weights, momentum SGD (optax.sgd)", _F16_WEIGHTS, "dynamic", "momentum"),
    RunConfig("f16w-mmsgd", "float16 weights, modified momentum SGD", _F16_WEIGHTS, "dynamic", "modified-momentum"),
    RunConfig("8dev-f32", "8 devices, float32 all-reduce", "float32", devices=NUM_DEVICES, reference="8dev-f32"),
    RunConfig(
      "8dev-1bit-noef",
      "8 devices, 1-bit, no error feedback",
      "float32",
      devices=NUM_DEVICES,
      compression="1bit-noef",
      reference="8dev-f32",
    ),
    RunConfig(
      "8dev-1bit",
      "8 devices, 1-bit SGD + error feedback",
      "float32",
      devices=NUM_DEVICES,
      compression="1bit",
      reference="8dev-f32",
    ),
    RunConfig(
      "8dev-diloco",
      f"8 devices, DiLoCo: local steps, average every {DILOCO_SYNC_EVERY}",
      "float32",
      devices=NUM_DEVICES,
      compression="diloco",
      reference="8dev-f32",
    ),
    RunConfig(
      "8dev-diloco-1bit",
      f"8 devices, DiLoCo, 1-bit average every {DILOCO_SYNC_EVERY}",
      "float32",
      devices=NUM_DEVICES,
      compression="diloco-1bit",
      reference="8dev-f32",
    ),
  )
}

# What a run without --configs trains: every row but the DiLoCo ones (asked
# for by name: ``--configs 8dev-f32,8dev-diloco,8dev-diloco-1bit``).
DEFAULT_CONFIGS = tuple(name for name in CONFIGS if "diloco" not in name)

# The three comparisons of the figure, each with its reference first.
COMPARISONS = {
  "loss scaling": ("f32", "f16", "f16-dls", "bf16"),
  "weight updates": ("f32", "f16w-sgd", "f16w-mmsgd"),
  "compression": ("8dev-f32", "8dev-1bit-noef", "8dev-1bit", "8dev-diloco", "8dev-diloco-1bit"),
}

COLUMNS = (
  "config",
  "train_loss",
  "val_loss",
  "val_loss_gap",
  "val_acc",
  "steps_per_s",
  "skipped",
  "loss_scale",
  "underflow_f16",
  "underflow_f16_logits",
  "state_bytes",
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
  configs: tuple[str, ...] = DEFAULT_CONFIGS
  out: str = "jmp_train_output"
  seed: int = 0
  eval_batches: int = 4
  max_skipped_steps: int = 100
  checkpoint_dir: str | None = None
  checkpoint_every: int = 50
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
    f"Unknown optimizer {cfg.optimizer!r}; valid: 'momentum', 'momentum-lr-in-buffer', 'modified-momentum'."
  )


def data_parallel_optimizer(
  cfg: RunConfig, s: DemoSettings, axis_name: str = "batch"
) -> tuple[optax.GradientTransformation | None, optax.GradientTransformation | None]:
  """``(compression, optimizer)`` of an 8-device row, for ``make_train_step``.

  The rows whose compression is a complete optimizer (``one_bit_momentum``,
  ``diloco``) have no optimizer (``None``).

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

  * ``8dev-diloco``: :func:`jmp_train.diloco`: each replica takes
    :data:`DILOCO_SYNC_EVERY` local steps of the same momentum SGD, then
    the replicas average their weights' change (float32) and the outer
    step (``diloco``'s default, ``optax.sgd(1.0)``) moves the shared
    weights by it: every replica continues from the replicas' average;
  * ``8dev-diloco-1bit``: the same, the change averaged by
    :func:`jmp_train.sign_compression` (1 bit per element, error feedback).

  The 1-bit rows reconstruct with ``s.one_bit_scale``: ``"l1"`` (default;
  one value per tensor chunk, the mean ``|v|``, as EF-SignSGD), ``"l2"`` or
  ``"column"`` (one value per column, Seide et al.). ``s.one_bit_warmup_steps``
  exact steps come first in ``8dev-1bit``.
  """
  lr, m = learning_rate_schedule(s), s.momentum
  if cfg.compression == "none":
    return None, optax.sgd(lr, momentum=m)
  if cfg.compression == "1bit-noef":
    compression = jmp_train.sign_compression(
      axis_name, error_feedback=False, server_error_feedback=False, scale=s.one_bit_scale
    )
    return compression, optax.sgd(lr, momentum=m)
  if cfg.compression == "1bit":
    # It averages across replicas and applies the learning rate itself.
    tx = jmp_train.one_bit_momentum(
      lr, m, axis_name=axis_name, warmup_steps=s.one_bit_warmup_steps, scale=s.one_bit_scale
    )
    return tx, None
  if cfg.compression in ("diloco", "diloco-1bit"):
    exchange = (
      jmp_train.sign_compression(axis_name, scale=s.one_bit_scale) if cfg.compression == "diloco-1bit" else None
    )
    tx = jmp_train.diloco(
      optax.sgd(lr, momentum=m), sync_every=DILOCO_SYNC_EVERY, axis_name=axis_name, compression=exchange
    )
    return tx, None
  raise ValueError(
    f"Unknown compression {cfg.compression!r}; valid: 'none', '1bit', '1bit-noef', 'diloco', 'diloco-1bit'."
  )
