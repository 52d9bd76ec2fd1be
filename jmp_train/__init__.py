"""jmp_train: mixed-precision training and 1-bit data parallelism for JAX.

The public surface, re-exported from ``jmp_train._src``. Every name loads on
first use (PEP 562), so ``import jmp_train`` imports neither JAX nor Flax
until something is used (the ``jmp-train --help`` command stays fast); three
submodules too:

* ``jmp_train.flax``: policies on linen and NNX modules;
* ``jmp_train.diagnostics``: histograms, Tensor Core shapes, precision
  audits, saved residuals;
* ``jmp_train.examples``: the ``jmp-train`` demo, its data and example models
  (not part of the library).
"""

import importlib as _importlib

__version__ = "0.1.0"

# Public name -> the module of jmp_train._src that defines it.
_EXPORTS = {
    # dtype policies
    "Policy": "policy",
    "cast_floating": "policy",
    "get_policy": "policy",
    "half_dtype": "policy",
    "half_precision_saveable": "remat",
    # autocast: a policy as a function transformation
    "autocast": "autocast",
    "DEFAULT_FLOAT32_OPS": "autocast_lists",
    "DEFAULT_HALF_OPS": "autocast_lists",
    "DEFAULT_LOOKUP_OPS": "autocast_lists",
    # FP8 products
    "Fp8DotMeta": "fp8_scaling",
    "Fp8Recipe": "fp8_scaling",
    "Fp8TensorMeta": "fp8_scaling",
    "fp8_conv_general_dilated": "fp8",
    "fp8_dequantize": "fp8_scaling",
    "fp8_dot_general": "fp8",
    "fp8_quantize": "fp8_scaling",
    "fp8_scale": "fp8_scaling",
    "init_fp8_meta": "fp8_scaling",
    "update_fp8_meta": "fp8_scaling",
    # loss scaling
    "DynamicLossScale": "loss_scale",
    "NoOpLossScale": "loss_scale",
    "StaticLossScale": "loss_scale",
    "all_finite": "loss_scale",
    "LossScaledState": "loss_scaling",
    "get_loss_scale": "loss_scale_lookup",
    "loss_scale_metrics": "loss_scale_lookup",
    "loss_scaled": "loss_scaling",
    "scaled_value_and_grad": "scaled_grad",
    # half-precision weight updates
    "KahanCompensationState": "kahan_compensation",
    "ModifiedMomentumState": "modified_momentum",
    "StochasticRoundingState": "stochastic_rounding",
    "kahan_compensation": "kahan_compensation",
    "modified_momentum_sgd": "modified_momentum",
    "stochastic_rounding": "stochastic_rounding",
    # 1-bit SGD with error feedback
    "collective_bytes": "hlo",
    "collective_ops": "hlo",
    "SignCompressionState": "sign_compression",
    "sign_compression": "sign_compression",
    "sign_compression_specs": "sign_compression",
    "CompressedMeanState": "compressed_mean",
    "compressed_mean": "compressed_mean",
    # 8-bit optimizer state
    "QuantizedArray": "quantized_state",
    "QuantizedTraceState": "optimizers_8bit",
    "adam_8bit": "optimizers_8bit",
    "scale_by_adam": "optimizers_8bit",
    "sgd_8bit": "optimizers_8bit",
    # 1-bit Adam and 1-bit momentum SGD
    "OneBitAdamState": "one_bit_adam",
    "OneBitMomentumState": "one_bit_momentum",
    "one_bit_adam": "one_bit_adam",
    "one_bit_momentum": "one_bit_momentum",
    # train-step builder
    "TrainState": "train",
    "TrainStep": "train",
    "make_train_step": "train",
    "restore_checkpoint": "train",
    "save_checkpoint": "train",
}

_SUBMODULES = ("diagnostics", "examples", "flax")

__all__ = tuple(_EXPORTS)


def __getattr__(name):
  if name in _EXPORTS:
    value = getattr(_importlib.import_module(f"jmp_train._src.{_EXPORTS[name]}"), name)
    globals()[name] = value  # once loaded, a plain attribute
    return value
  if name in _SUBMODULES:
    return _importlib.import_module(f"{__name__}.{name}")
  raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
  return sorted(set(globals()) | set(_EXPORTS) | set(_SUBMODULES))
