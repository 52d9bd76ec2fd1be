"""Bytes of parameters + optimizer state per parameter, per weight-update setup.

For a small Transformer language model (``jmp_train_examples.models.
TransformerBlock``, d_model 256, 2 layers; 64/1 in quick mode) each setup's
parameter tree and optimizer state are built for real (``opt.init`` on the
actual parameters; ``tests/test_low_precision_modes.py`` checks that updates keep
the state's shapes and dtypes) and their ``nbytes`` summed, divided by the
number of parameters:

* float32 master weights: float32 parameters plus the half-precision copy
  the forward pass reads (``half_copy``), with Adam or momentum SGD;
* half-precision weights: float16 + :func:`jmp_train.modified_momentum_sgd`;
  bfloat16 + Adam + :func:`jmp_train.kahan_compensation` (Adam's moments in
  bfloat16, or in float32, which the digits benchmark shows Adam needs);
  bfloat16 + SGD or Adam + :func:`jmp_train.stochastic_rounding`;
* 8-bit optimizer state: bfloat16 + :func:`jmp_train.adam_8bit` (moments as
  blockwise 8-bit codes, one float32 scale per 256; leaves under 4,096
  elements keep float32 moments, or every leaf 8-bit with
  ``min_8bit_size=0``, and with bitsandbytes' blocks of 2,048) + stochastic
  rounding or Kahan; Adam with a bfloat16
  first and float32 second moment (:func:`jmp_train.scale_by_narrow_adam`); and
  :func:`jmp_train.sgd_8bit`.

``codes_per_param`` is the part of the state in 8-bit codes (``uint8``); the
rest of an 8-bit state is float32: one scale per block of each quantized
moment (``8 / block_size`` bytes per parameter for Adam's two moments) and
the moments of the leaves under ``min_8bit_size``, 8 bytes per parameter
of those leaves. ``vs_adam_master`` is the total over the float32-master
Adam total.
Counters and PRNG keys are included (a few bytes, hence the non-integers on
small models).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

from benchmarks import _harness
from jmp_train_examples import models
from jmp_train_examples.half_weights import with_float32_state
from jmp_train import adam_8bit, kahan_compensation, modified_momentum_sgd
from jmp_train import scale_by_narrow_adam, sgd_8bit, stochastic_rounding

NAME = "weight_memory"
COLUMNS = (
  "setup",
  "weights",
  "optimizer",
  "params_per_param",
  "half_copy_per_param",
  "opt_state_per_param",
  "codes_per_param",
  "total_per_param",
  "vs_adam_master",
  "num_params",
)

BF16, F16, F32 = jnp.bfloat16, jnp.float16, jnp.float32


def _nbytes(tree: Any) -> int:
  return sum(x.nbytes for x in jax.tree.leaves(tree) if hasattr(x, "nbytes"))


def _setups() -> list[tuple[str, Any, str, optax.GradientTransformation, bool]]:
  """(setup, weight dtype, optimizer name, optimizer, keeps a half copy)."""
  lr = 1e-3
  return [
    ("adam / float32 master", F32, "adam", optax.adam(lr), True),
    ("momentum sgd / float32 master", F32, "sgd(0.9)", optax.sgd(lr, 0.9), True),
    ("momentum sgd / float32 (no half copy)", F32, "sgd(0.9)", optax.sgd(lr, 0.9), False),
    ("adam / bfloat16 (plain, bf16 moments)", BF16, "adam", optax.adam(lr), False),
    (
      "float16 + modified momentum (error feedback)",
      F16,
      "modified_momentum_sgd(0.9)",
      modified_momentum_sgd(lr, 0.9),
      False,
    ),
    (
      "bfloat16 + modified momentum (no feedback) + kahan",
      BF16,
      "modified_momentum_sgd(0.9, error_feedback=False)",
      optax.chain(modified_momentum_sgd(lr, 0.9, error_feedback=False), kahan_compensation()),
      False,
    ),
    ("bfloat16 + adam + kahan", BF16, "adam (bf16 moments)", optax.chain(optax.adam(lr), kahan_compensation()), False),
    (
      "bfloat16 + adam(f32 moments) + kahan",
      BF16,
      "adam (f32 moments)",
      optax.chain(with_float32_state(optax.adam(lr)), kahan_compensation()),
      False,
    ),
    (
      "bfloat16 + adam(f32 moments) + stochastic rounding",
      BF16,
      "adam (f32 moments)",
      optax.chain(with_float32_state(optax.adam(lr)), stochastic_rounding(0)),
      False,
    ),
    ("bfloat16 + sgd + stochastic rounding", BF16, "sgd", optax.chain(optax.sgd(lr), stochastic_rounding(0)), False),
    ("bfloat16 + sgd + kahan", BF16, "sgd", optax.chain(optax.sgd(lr), kahan_compensation()), False),
    (
      "bfloat16 + adam_8bit + stochastic rounding",
      BF16,
      "adam_8bit",
      optax.chain(adam_8bit(lr), stochastic_rounding(0)),
      False,
    ),
    (
      "bfloat16 + adam_8bit (all leaves 8-bit) + stochastic rounding",
      BF16,
      "adam_8bit(min_8bit_size=0)",
      optax.chain(adam_8bit(lr, min_8bit_size=0), stochastic_rounding(0)),
      False,
    ),
    (
      "bfloat16 + adam_8bit (all leaves 8-bit, blocks of 2048) + stochastic rounding",
      BF16,
      "adam_8bit(block_size=2048, min_8bit_size=0)",
      optax.chain(adam_8bit(lr, block_size=2048, min_8bit_size=0), stochastic_rounding(0)),
      False,
    ),
    ("bfloat16 + adam_8bit + kahan", BF16, "adam_8bit", optax.chain(adam_8bit(lr), kahan_compensation()), False),
    (
      "bfloat16 + adam(bf16 mu, f32 nu) + stochastic rounding",
      BF16,
      "scale_by_narrow_adam(mu_dtype=bf16, nu_dtype=f32)",
      optax.chain(
        scale_by_narrow_adam(mu_dtype="bfloat16", nu_dtype="float32"),
        optax.scale_by_learning_rate(lr),
        stochastic_rounding(0),
      ),
      False,
    ),
    (
      "bfloat16 + sgd_8bit + stochastic rounding",
      BF16,
      "sgd_8bit(0.9)",
      optax.chain(sgd_8bit(lr, 0.9), stochastic_rounding(0)),
      False,
    ),
  ]


def run(quick: bool) -> list[dict]:
  d_model, layers = (64, 1) if quick else (256, 2)
  model = models.TransformerBlock(
    vocab_size=256,
    d_model=d_model,
    num_heads=4,
    mlp_dim=4 * d_model,
    num_layers=layers,
    max_len=128,
  )
  tokens = jnp.zeros((1, 16), jnp.int32)
  params32 = jax.jit(model.init)(jax.random.key(0), tokens)["params"]
  num_params = sum(x.size for x in jax.tree.leaves(params32))
  records = []
  reference = None
  for setup, dtype, opt_name, opt, half_copy in _setups():
    params = jax.tree.map(lambda p: p.astype(dtype), params32)
    # The state as built; tests/test_low_precision_modes.py checks that an update
    # returns a state of the same shapes and dtypes.
    state = jax.jit(opt.init, compiler_options=_harness.compile_options(quick))(params)
    params_bytes = _nbytes(params)
    copy_bytes = _nbytes(jax.tree.map(lambda p: p.astype(BF16), params)) if half_copy else 0
    state_bytes = _nbytes(state)
    codes_bytes = _nbytes([x for x in jax.tree.leaves(state) if x.dtype == jnp.uint8])
    total = params_bytes + copy_bytes + state_bytes
    if reference is None:
      reference = total
    records.append(
      {
        "setup": setup,
        "weights": jnp.dtype(dtype).name,
        "optimizer": opt_name,
        "params_per_param": params_bytes / num_params,
        "half_copy_per_param": copy_bytes / num_params,
        "opt_state_per_param": state_bytes / num_params,
        "codes_per_param": codes_bytes / num_params,
        "total_per_param": total / num_params,
        "vs_adam_master": total / reference,
        "num_params": num_params,
      }
    )
  return records
