"""jmp_train: mixed-precision training and 1-bit data parallelism for JAX.

The public surface, re-exported from ``jmp_train._src``. Every name loads on
first use (PEP 562), so ``import jmp_train`` imports neither JAX nor Flax
until something is used. The ``TYPE_CHECKING`` block below is the one list
of public names: type checkers and IDEs read it, and at run time each name
loads from the module it names. Two submodules too:

* ``jmp_train.flax``: policies on linen and NNX modules;
* ``jmp_train.diagnostics``: histograms, Tensor Core shapes, precision
  audits, saved residuals;
* ``jmp_train.int8``: INT8 products, calibration, quantized models.

The ``jmp-train`` demo, its data and example models are not part of the
library: they live beside it, in the repository's ``examples/``
(``jmp_train_examples``).
"""

import importlib as _importlib
from typing import TYPE_CHECKING

__version__ = "0.1.0"

if TYPE_CHECKING:  # What type checkers and IDEs read; at run time each name loads on first use.
  from jmp_train._src.policy.policy import Policy as Policy
  from jmp_train._src.policy.policy import cast_floating as cast_floating
  from jmp_train._src.policy.policy import get_policy as get_policy
  from jmp_train._src.dtypes import half_dtype as half_dtype
  from jmp_train._src.policy.remat import half_precision_saveable as half_precision_saveable
  from jmp_train._src.autocast.transform import autocast as autocast
  from jmp_train._src.autocast.lists import DEFAULT_FLOAT32_OPS as DEFAULT_FLOAT32_OPS
  from jmp_train._src.autocast.lists import DEFAULT_HALF_OPS as DEFAULT_HALF_OPS
  from jmp_train._src.autocast.lists import DEFAULT_LOOKUP_OPS as DEFAULT_LOOKUP_OPS
  from jmp_train._src.fp8.scaling import Fp8DotMeta as Fp8DotMeta
  from jmp_train._src.fp8.scaling import Fp8Recipe as Fp8Recipe
  from jmp_train._src.fp8.scaling import Fp8TensorMeta as Fp8TensorMeta
  from jmp_train._src.fp8.products import fp8_conv_general_dilated as fp8_conv_general_dilated
  from jmp_train._src.fp8.scaling import fp8_dequantize as fp8_dequantize
  from jmp_train._src.fp8.products import fp8_dot_general as fp8_dot_general
  from jmp_train._src.fp8.scaling import fp8_quantize as fp8_quantize
  from jmp_train._src.fp8.scaling import fp8_scale as fp8_scale
  from jmp_train._src.fp8.scaling import init_fp8_meta as init_fp8_meta
  from jmp_train._src.fp8.scaling import update_fp8_meta as update_fp8_meta
  from jmp_train._src.loss_scaling.scales import DynamicLossScale as DynamicLossScale
  from jmp_train._src.loss_scaling.scales import NoOpLossScale as NoOpLossScale
  from jmp_train._src.loss_scaling.scales import StaticLossScale as StaticLossScale
  from jmp_train._src.leaf_checks import all_finite as all_finite
  from jmp_train._src.loss_scaling.wrapper import LossScaledState as LossScaledState
  from jmp_train._src.loss_scaling.lookup import get_loss_scale as get_loss_scale
  from jmp_train._src.loss_scaling.lookup import loss_scale_metrics as loss_scale_metrics
  from jmp_train._src.loss_scaling.wrapper import loss_scaled as loss_scaled
  from jmp_train._src.loss_scaling.scaled_grad import scaled_value_and_grad as scaled_value_and_grad
  from jmp_train._src.low_precision.kahan_compensation import KahanCompensationState as KahanCompensationState
  from jmp_train._src.low_precision.modified_momentum import ModifiedMomentumState as ModifiedMomentumState
  from jmp_train._src.low_precision.stochastic_rounding import StochasticRoundingState as StochasticRoundingState
  from jmp_train._src.low_precision.kahan_compensation import kahan_compensation as kahan_compensation
  from jmp_train._src.low_precision.modified_momentum import modified_momentum_sgd as modified_momentum_sgd
  from jmp_train._src.low_precision.stochastic_rounding import stochastic_rounding as stochastic_rounding
  from jmp_train._src.compression.sign_compression import SignCompressionState as SignCompressionState
  from jmp_train._src.compression.sign_compression import sign_compression as sign_compression
  from jmp_train._src.compression.sign_compression import sign_compression_specs as sign_compression_specs
  from jmp_train._src.compression.sign_compression import sign_compression_wire_bytes as sign_compression_wire_bytes
  from jmp_train._src.compression.compressed_mean import CompressedMeanState as CompressedMeanState
  from jmp_train._src.compression.compressed_mean import compressed_mean as compressed_mean
  from jmp_train._src.buckets import bucketed_mean as bucketed_mean
  from jmp_train._src.low_precision.quantized_state import QuantizedArray as QuantizedArray
  from jmp_train._src.low_precision.optimizers_8bit import QuantizedTraceState as QuantizedTraceState
  from jmp_train._src.low_precision.optimizers_8bit import adam_8bit as adam_8bit
  from jmp_train._src.low_precision.optimizers_8bit import scale_by_narrow_adam as scale_by_narrow_adam
  from jmp_train._src.low_precision.optimizers_8bit import sgd_8bit as sgd_8bit
  from jmp_train._src.compression.one_bit_adam import OneBitAdamState as OneBitAdamState
  from jmp_train._src.compression.one_bit_momentum import OneBitMomentumState as OneBitMomentumState
  from jmp_train._src.compression.one_bit_adam import one_bit_adam as one_bit_adam
  from jmp_train._src.compression.one_bit_momentum import one_bit_momentum as one_bit_momentum
  from jmp_train._src.compression.diloco import DiLoCoState as DiLoCoState
  from jmp_train._src.compression.diloco import diloco as diloco
  from jmp_train._src.train.state import TrainState as TrainState
  from jmp_train._src.train.state import TrainStep as TrainStep
  from jmp_train._src.train.step import make_train_step as make_train_step
  from jmp_train._src.train.checkpoint import checkpoint_save_args as checkpoint_save_args
  from jmp_train._src.train.checkpoint_restore import restore_checkpoint as restore_checkpoint
  from jmp_train._src.train.checkpoint_restore import restore_latest_checkpoint as restore_latest_checkpoint
  from jmp_train._src.train.checkpoint import save_checkpoint as save_checkpoint
  from jmp_train import diagnostics as diagnostics
  from jmp_train import flax as flax
  from jmp_train import int8 as int8


def _public_names() -> dict[str, str]:
  """Public name -> the module that defines it, read from the block above.

  The ``TYPE_CHECKING`` imports are the one list of public names: type
  checkers and IDEs read them, and at run time each name loads from the
  module they name on first use. (Read line by line, not with ``ast``:
  ``import jmp_train`` stays a few milliseconds.)
  """
  with open(__file__, encoding="utf-8") as f:
    source = f.read()
  block = source.split("\nif TYPE_CHECKING:", 1)[1].split("\n\n", 1)[0]
  names = {}
  for line in block.splitlines()[1:]:
    module, _, imported = line.strip().removeprefix("from ").partition(" import ")
    name, _, alias = imported.partition(" as ")
    names[alias or name] = module
  return names


_NAMES = _public_names()
_EXPORTS = {name: module for name, module in _NAMES.items() if module != __name__}
_SUBMODULES = tuple(name for name, module in _NAMES.items() if module == __name__)

__all__ = tuple(_EXPORTS)


def __getattr__(name):
  if name in _EXPORTS:
    value = getattr(_importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value  # once loaded, a plain attribute
    return value
  if name in _SUBMODULES:
    return _importlib.import_module(f"{__name__}.{name}")
  raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
  return sorted(set(globals()) | set(_EXPORTS) | set(_SUBMODULES))
