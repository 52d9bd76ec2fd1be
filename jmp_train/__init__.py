"""jmp_train: mixed-precision training and 1-bit data parallelism for JAX.

The public surface, re-exported from ``jmp_train._src``. Three submodules load
on first use, so ``import jmp_train`` stays light:

* ``jmp_train.flax``: policies on linen and NNX modules;
* ``jmp_train.diagnostics``: histograms, Tensor Core shapes, precision
  audits, saved residuals;
* ``jmp_train.examples``: the ``jmp-train`` demo, its data and example models
  (not part of the library).
"""

import importlib as _importlib

__version__ = "0.1.0"

# dtype policies
from jmp_train._src.policy import Policy
from jmp_train._src.policy import cast_floating
from jmp_train._src.policy import get_policy
from jmp_train._src.policy import half_dtype
from jmp_train._src.remat import half_precision_saveable

# autocast: a policy as a function transformation
from jmp_train._src.autocast import autocast
from jmp_train._src.autocast_lists import DEFAULT_FLOAT32_OPS
from jmp_train._src.autocast_lists import DEFAULT_HALF_OPS

# FP8 products
from jmp_train._src.fp8 import Fp8DotMeta
from jmp_train._src.fp8 import Fp8Recipe
from jmp_train._src.fp8 import Fp8TensorMeta
from jmp_train._src.fp8 import fp8_conv_general_dilated
from jmp_train._src.fp8 import fp8_dequantize
from jmp_train._src.fp8 import fp8_dot_general
from jmp_train._src.fp8 import fp8_quantize
from jmp_train._src.fp8 import fp8_scale
from jmp_train._src.fp8 import init_fp8_meta
from jmp_train._src.fp8 import update_fp8_meta

# loss scaling
from jmp_train._src.loss_scale import DynamicLossScale
from jmp_train._src.loss_scale import NoOpLossScale
from jmp_train._src.loss_scale import StaticLossScale
from jmp_train._src.loss_scale import all_finite
from jmp_train._src.loss_scaling import LossScaledState
from jmp_train._src.loss_scaling import get_loss_scale
from jmp_train._src.loss_scaling import loss_scale_metrics
from jmp_train._src.loss_scaling import loss_scaled
from jmp_train._src.loss_scaling import scaled_value_and_grad

# half-precision weight updates
from jmp_train._src.low_precision import KahanCompensationState
from jmp_train._src.low_precision import ModifiedMomentumState
from jmp_train._src.low_precision import StochasticRoundingState
from jmp_train._src.low_precision import kahan_compensation
from jmp_train._src.low_precision import modified_momentum_sgd
from jmp_train._src.low_precision import stochastic_rounding

# 1-bit SGD with error feedback
from jmp_train._src.hlo import collective_bytes
from jmp_train._src.hlo import collective_ops
from jmp_train._src.sign_compression import SignCompressionState
from jmp_train._src.sign_compression import sign_compression
from jmp_train._src.sign_compression import sign_compression_specs

# 1-bit Adam and 1-bit momentum SGD
from jmp_train._src.one_bit_optimizers import OneBitAdamState
from jmp_train._src.one_bit_optimizers import OneBitMomentumState
from jmp_train._src.one_bit_optimizers import one_bit_adam
from jmp_train._src.one_bit_optimizers import one_bit_momentum

# train-step builder
from jmp_train._src.train import TrainState
from jmp_train._src.train import TrainStep
from jmp_train._src.train import make_train_step
from jmp_train._src.train import restore_checkpoint
from jmp_train._src.train import save_checkpoint

__all__ = (
    "Policy",
    "cast_floating",
    "get_policy",
    "half_dtype",
    "half_precision_saveable",
    "autocast",
    "DEFAULT_FLOAT32_OPS",
    "DEFAULT_HALF_OPS",
    "Fp8DotMeta",
    "Fp8Recipe",
    "Fp8TensorMeta",
    "fp8_conv_general_dilated",
    "fp8_dequantize",
    "fp8_dot_general",
    "fp8_quantize",
    "fp8_scale",
    "init_fp8_meta",
    "update_fp8_meta",
    "DynamicLossScale",
    "NoOpLossScale",
    "StaticLossScale",
    "all_finite",
    "LossScaledState",
    "get_loss_scale",
    "loss_scale_metrics",
    "loss_scaled",
    "scaled_value_and_grad",
    "KahanCompensationState",
    "ModifiedMomentumState",
    "StochasticRoundingState",
    "kahan_compensation",
    "modified_momentum_sgd",
    "stochastic_rounding",
    "collective_bytes",
    "collective_ops",
    "SignCompressionState",
    "sign_compression",
    "sign_compression_specs",
    "OneBitAdamState",
    "OneBitMomentumState",
    "one_bit_adam",
    "one_bit_momentum",
    "TrainState",
    "TrainStep",
    "make_train_step",
    "restore_checkpoint",
    "save_checkpoint",
)

_SUBMODULES = ("diagnostics", "examples", "flax")


def __getattr__(name):
  # PEP 562: ``jmp_train.flax`` works after a bare ``import jmp_train``.
  if name in _SUBMODULES:
    return _importlib.import_module(f"{__name__}.{name}")
  raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
  return sorted(set(globals()) | set(_SUBMODULES))
