"""The INT8 product recipe: a static, hashable value (no JAX import)."""

from __future__ import annotations

import dataclasses

__all__ = ["ACTIVATION_SCALES", "BACKWARD_PRODUCTS", "Int8Recipe", "WEIGHT_SCALES"]

ACTIVATION_SCALES = ("per_row", "per_tensor")
WEIGHT_SCALES = ("per_channel", "per_tensor")
BACKWARD_PRODUCTS = ("float", "int8")


@dataclasses.dataclass(frozen=True)
class Int8Recipe:
  r"""How INT8 products scale their operands (hashable, a static value).

  Symmetric quantization, :math:`\Delta = \mathrm{amax} / 127`,
  :math:`q = \mathrm{clip}(\mathrm{round}(x / \Delta), -128, 127)`, the amax
  of the operand itself in the same step (current scaling) over the axes
  the granularity names; int8 codes multiplied with int32 accumulation and
  rescaled by :math:`\Delta_a \Delta_b`. The backward pass is the
  straight-through estimator, its products in the compute dtype, or, with
  ``backward="int8"``, on int8 codes too: the output gradient quantized
  per tensor with stochastic rounding
  (:math:`q = \lfloor g/\Delta + u \rfloor`, :math:`u \sim U[0, 1)`, so
  that :math:`E[q\Delta] = g`: small gradients survive on average instead
  of rounding to zero), the forward operands requantized per tensor (a
  per-row or per-channel scale lies on the backward product's contracting
  axis), int32 accumulation (AQT's and Qwix's quantized backward).

  Attributes:
    activation: the activation operand's scale: ``"per_row"`` (one per
      row, i.e. per token: the amax over the contracting axes; a
      convolution's input takes one per tensor) or ``"per_tensor"``.
    weight: the weight's scale: ``"per_channel"`` (one per output channel)
      or ``"per_tensor"``.
    backward: the backward products' operands: ``"float"`` (the compute
      dtype; the default) or ``"int8"`` (stochastically rounded int8
      gradients, opt-in).

  Examples:
    >>> Int8Recipe().activation, Int8Recipe().weight
    ('per_row', 'per_channel')
    >>> Int8Recipe(weight="per_row")
    Traceback (most recent call last):
    ...
    ValueError: Int8Recipe's weight must be one of ('per_channel', 'per_tensor'), got 'per_row'.

  References:
    Jacob et al., "Quantization and Training of Neural Networks for
    Efficient Integer-Arithmetic-Only Inference", CVPR 2018.
    https://arxiv.org/abs/1712.05877

    Gupta et al., "Deep Learning with Limited Numerical Precision", ICML
    2015 (stochastic rounding).
  """

  activation: str = "per_row"
  weight: str = "per_channel"
  backward: str = "float"

  def __post_init__(self):
    for field, accepted in (
      ("activation", ACTIVATION_SCALES),
      ("weight", WEIGHT_SCALES),
      ("backward", BACKWARD_PRODUCTS),
    ):
      value = getattr(self, field)
      if value not in accepted:
        raise ValueError(f"Int8Recipe's {field} must be one of {accepted}, got {value!r}.")
