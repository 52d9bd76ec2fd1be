"""The models users bring: Flax-style models that declare ``dtype=float32``, under ``make_train_step``.

Flax's example models declare ``dtype=jnp.float32`` (and ``param_dtype``)
on every layer. Two such models, written the way Flax's ImageNet and lm1b
examples write them:

* ``resnet50``: ResNet-50 (bottleneck blocks 3-4-6-3, BatchNorm with
  running statistics), 224 x 224 images, batch 128, 1,000 classes;
* ``transformer``: a pre-norm decoder language model (``nn.Embed`` with a
  tied ``attend`` head, ``nn.MultiHeadDotProductAttention`` with a causal
  mask, ``nn.LayerNorm``, ``nn.Dense``), d_model 1,024, 8 layers, 16 heads,
  sequence 1,024, batch 16, vocabulary 32,768.

Each is trained by ``jmp_train.make_train_step(model.apply, loss,
optax.adam(1e-4), policy=...)`` in these ways, from the same parameters on
the same batch:

* ``float32``: ``policy="float32"`` (on NVIDIA GPUs JAX's default precision
  runs float32 matmuls as TF32);
* ``mixed_bfloat16``: ``policy="mixed_bfloat16"`` with default settings: the
  step applies the policy inside the model (``model_policy="auto"``);
* ``by_hand``: the model wrapped by hand in
  ``jmp_train.flax.apply_policy(model, "mixed_bfloat16")``, the step told
  only to cast its inputs (``model_policy="inputs"``);
* ``by_hand_half_norms``: the same with ``float32_modules=()``: the
  normalization layers run in bfloat16 too (Flax computes their statistics
  in float32 whatever their ``dtype``), as Flax's ImageNet example runs
  them under ``half_precision``;
* ``by_hand_no_recompute``: the same with ``recompute=None``: the backward
  pass keeps what JAX keeps by default instead of recomputing the float32
  regions and the half copies of the weights.

The last two say what the defaults cost. The steps are timed round-robin.
``ms_per_step`` (median of the timed steps after warm-up),
``speedup_vs_float32`` (float32's time over the variant's, same run),
``vs_by_hand`` (the variant's time over ``by_hand``'s: 1.0 means the
default step is as fast as wrapping by hand), ``compile_s``, and the
lowered step's products (``dot_general`` and convolutions) with bfloat16
operands out of all products (:func:`jmp_train.diagnostics.fp8_products`
lists them).

Runs only on a GPU (the sizes are too large for a CPU); elsewhere it
returns one record saying it was skipped.
"""

from __future__ import annotations

import collections
import functools
import re
import time
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import jmp_train
from benchmarks import _harness

NAME = "user_models"
COLUMNS = (
  "model",
  "variant",
  "ms_per_step",
  "speedup_vs_float32",
  "vs_by_hand",
  "compile_s",
  "bf16_products",
  "products",
)
VARIANTS = ("float32", "mixed_bfloat16", "by_hand", "by_hand_half_norms", "by_hand_no_recompute")


class Bottleneck(nn.Module):
  """ResNet-50's bottleneck block, as Flax's ImageNet example writes it."""

  filters: int
  strides: tuple[int, int] = (1, 1)
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x, train: bool = True):
    conv = functools.partial(nn.Conv, use_bias=False, dtype=self.dtype, param_dtype=jnp.float32)
    norm = functools.partial(
      nn.BatchNorm, use_running_average=not train, momentum=0.9, epsilon=1e-5, dtype=self.dtype, param_dtype=jnp.float32
    )
    residual = x
    y = nn.relu(norm()(conv(self.filters, (1, 1))(x)))
    y = nn.relu(norm()(conv(self.filters, (3, 3), self.strides)(y)))
    y = norm(scale_init=nn.initializers.zeros_init())(conv(self.filters * 4, (1, 1))(y))
    if residual.shape != y.shape:
      residual = norm()(conv(self.filters * 4, (1, 1), self.strides)(residual))
    return nn.relu(residual + y)


class ResNet50(nn.Module):
  """ResNet-50 with every layer declaring ``dtype`` (float32 by default)."""

  num_classes: int = 1000
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x, train: bool = True):
    x = nn.Conv(
      64, (7, 7), (2, 2), padding=[(3, 3), (3, 3)], use_bias=False, dtype=self.dtype, param_dtype=jnp.float32
    )(x)
    x = nn.BatchNorm(
      use_running_average=not train, momentum=0.9, epsilon=1e-5, dtype=self.dtype, param_dtype=jnp.float32
    )(x)
    x = nn.max_pool(nn.relu(x), (3, 3), strides=(2, 2), padding="SAME")
    for i, blocks in enumerate((3, 4, 6, 3)):
      for j in range(blocks):
        strides = (2, 2) if i > 0 and j == 0 else (1, 1)
        x = Bottleneck(64 * 2**i, strides, dtype=self.dtype)(x, train)
    x = jnp.mean(x, axis=(1, 2))
    x = nn.Dense(self.num_classes, dtype=self.dtype, param_dtype=jnp.float32)(x)
    return jnp.asarray(x, self.dtype)


class DecoderBlock(nn.Module):
  """A pre-norm decoder block, as Flax's lm1b example writes it."""

  num_heads: int
  mlp_dim: int
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x, mask):
    kw = dict(dtype=self.dtype, param_dtype=jnp.float32)
    y = nn.LayerNorm(**kw)(x)
    y = nn.MultiHeadDotProductAttention(num_heads=self.num_heads, deterministic=True, **kw)(y, y, mask=mask)
    x = x + y
    z = nn.LayerNorm(**kw)(x)
    z = nn.Dense(self.mlp_dim, **kw)(z)
    z = nn.Dense(x.shape[-1], **kw)(nn.gelu(z))
    return x + z


class TransformerLM(nn.Module):
  """A decoder language model with every layer declaring ``dtype``."""

  vocab_size: int = 32768
  emb_dim: int = 1024
  num_heads: int = 16
  num_layers: int = 8
  mlp_dim: int = 4096
  max_len: int = 1024
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, tokens, train: bool = True):
    del train
    embed = nn.Embed(
      self.vocab_size,
      self.emb_dim,
      dtype=self.dtype,
      param_dtype=jnp.float32,
      embedding_init=nn.initializers.normal(1.0),
    )
    x = embed(tokens)
    x = (
      x
      + self.param("pos", nn.initializers.normal(0.02), (1, self.max_len, self.emb_dim), jnp.float32)[
        :, : tokens.shape[1]
      ]
    )
    mask = nn.make_causal_mask(tokens, dtype=self.dtype)
    for _ in range(self.num_layers):
      x = DecoderBlock(self.num_heads, self.mlp_dim, dtype=self.dtype)(x, mask)
    x = nn.LayerNorm(dtype=self.dtype, param_dtype=jnp.float32)(x)
    return embed.attend(x.astype(self.dtype)) / jnp.sqrt(x.shape[-1]).astype(self.dtype)


def _loss(outputs, targets):
  return optax.softmax_cross_entropy_with_integer_labels(outputs.astype(jnp.float32), targets).mean()


def _case(name: str, rng: np.random.Generator):
  """``(model, inputs, targets)`` of one benchmark model."""
  if name == "resnet50":
    batch = 128
    return (
      ResNet50(),
      rng.normal(size=(batch, 224, 224, 3)).astype(np.float32),
      rng.integers(0, 1000, batch).astype(np.int32),
    )
  if name == "transformer":
    batch, seq, vocab = 16, 1024, 32768
    tokens = rng.integers(0, vocab, (batch, seq + 1)).astype(np.int32)
    return TransformerLM(vocab_size=vocab, max_len=seq), tokens[:, :-1], tokens[:, 1:]
  raise ValueError(f"unknown model {name!r}; expected 'resnet50' or 'transformer'")


# apply_policy's options of each "by_hand" variant.
_BY_HAND = {
  "by_hand": {},
  "by_hand_half_norms": {"float32_modules": ()},
  "by_hand_no_recompute": {"recompute": None},
}


def _step(model, variant: str):
  if variant in _BY_HAND:
    wrapped = jmp_train.flax.apply_policy(model, "mixed_bfloat16", **_BY_HAND[variant])
    return jmp_train.make_train_step(
      functools.partial(wrapped.apply, train=True),
      _loss,
      optax.adam(1e-4),
      policy="mixed_bfloat16",
      model_policy="inputs",
    )
  return jmp_train.make_train_step(functools.partial(model.apply, train=True), _loss, optax.adam(1e-4), policy=variant)


class _Stepper:
  """Calls a donating step on its own state, keeping each call's new state."""

  def __init__(self, step, state, batch):
    self.step, self.state, self.batch = step, state, batch
    self.metrics = None

  def __call__(self):
    self.state, self.metrics = self.step(self.state, self.batch)
    return self.state, self.metrics


def measure(
  name: str, *, variants: tuple[str, ...] = VARIANTS, warmup: int = 3, repeats: int = 10
) -> list[dict[str, Any]]:
  """The records of one model's ``variants`` (see the module docstring).

  Every variant is compiled first; then the steps are timed round-robin
  (:func:`benchmarks._harness.interleaved_median_seconds`), each on its own
  training state, so that their ratios come from the same minutes.
  """
  model, inputs, targets = _case(name, np.random.default_rng(0))
  variables = jax.jit(functools.partial(model.init, train=False))(jax.random.key(0), inputs[:2])
  params = variables["params"]
  model_state = {k: v for k, v in variables.items() if k != "params"} or None
  steppers, rows = {}, {}
  for variant in variants:
    step = _step(model, variant)
    state = step.init(params, model_state=model_state)
    batch = step.shard_batch((inputs, targets))
    t0 = time.perf_counter()
    lowered = step.lower(state, batch)
    report = jmp_train.diagnostics.fp8_products(lowered)
    compiled = lowered.compile()
    rows[variant] = {
      "model": name,
      "variant": variant,
      "compile_s": time.perf_counter() - t0,
      "products": len(report.products),
      "bf16_products": sum(
        1 for p in report.products if np.dtype(p.lhs_dtype) == jnp.bfloat16 and np.dtype(p.rhs_dtype) == jnp.bfloat16
      ),
      "compiled": compiled_profile(compiled.as_text()),
    }
    steppers[variant] = _Stepper(step, state, batch)
  seconds = _harness.interleaved_median_seconds(steppers, warmup=warmup, repeats=repeats)
  for variant, row in rows.items():
    row["ms_per_step"] = 1e3 * seconds[variant]
    row["final_loss"] = float(steppers[variant].metrics["loss"])
    row["speedup_vs_float32"] = seconds["float32"] / seconds[variant] if "float32" in seconds else None
    row["vs_by_hand"] = seconds[variant] / seconds["by_hand"] if "by_hand" in seconds else None
  return list(rows.values())


_TARGET = re.compile(r'custom_call_target="([^"]+)"')
_RESULT = re.compile(r"=\s*\(?([a-z][a-z0-9]*)\[")
_OPS = ("transpose", "copy", "convert", "fusion")


def compiled_profile(hlo_text: str) -> dict[str, Any]:
  """What the compiled step launches, from its optimized HLO text.

  Returns:
    ``custom_calls``: target -> count (cuDNN convolutions, cuBLAS GEMMs);
    ``custom_call_dtypes``: ``"target result-dtype"`` -> count (a float32
    convolution shows as ``__cudnn$convForward f32``); ``transpose``,
    ``copy``, ``convert``, ``fusion``: instructions of that opcode (layout
    changes show as transposes and copies).
  """
  calls, dtypes = collections.Counter(), collections.Counter()
  ops = dict.fromkeys(_OPS, 0)
  for line in hlo_text.splitlines():
    target = _TARGET.search(line)
    if target:
      calls[target.group(1)] += 1
      result = _RESULT.search(line)
      dtypes[f"{target.group(1)} {result.group(1) if result else '?'}"] += 1
    for op in _OPS:
      if re.search(rf"\s{op}\(", line):
        ops[op] += 1
  return {"custom_calls": dict(sorted(calls.items())), "custom_call_dtypes": dict(sorted(dtypes.items())), **ops}


# The ResNet-50 variants of the GPU probe: the default step and the hand-wrapped
# ones around it (float32 is in the full run).
RESNET_PROFILE_VARIANTS = ("mixed_bfloat16", "by_hand", "by_hand_half_norms", "by_hand_no_recompute")


def resnet50_profile_records() -> list[dict[str, Any]]:
  """ResNet-50's :data:`RESNET_PROFILE_VARIANTS`, timed together, each with its compiled step's profile (GPU)."""
  if jax.default_backend() != "gpu":
    return _harness.skipped(f"needs a GPU (backend here: {jax.default_backend()})")
  return measure("resnet50", variants=RESNET_PROFILE_VARIANTS)


def run(quick: bool) -> list[dict[str, Any]]:
  if jax.default_backend() != "gpu" or quick:
    return _harness.skipped(f"needs a GPU and a full run (backend here: {jax.default_backend()}, quick={quick})")
  records = []
  for name in ("transformer", "resnet50"):
    records += measure(name)
    print(_harness.format_table(records[-3:], COLUMNS), flush=True)
  return records
