r"""Per-site quantization diagnostics: the share of values clipped, and signal-to-noise ratios.

A pass over batches runs the function in float32 and, at each weight
product, quantizes its operands as the quantized model would (the
activation with its calibrated scale :math:`\Delta`, the weight per output
channel) to measure, in isolation (the product's float result goes on):

* the share of the activation's values clipped, :math:`|\mathrm{round}(x/\Delta)|`
  beyond the int8 range;
* the signal-to-quantization-noise ratio, in decibels,
  :math:`10 \log_{10} (\sum x^2 / \sum (x - \hat x)^2)`, of the activation,
  of the weight and of the product's output (int8 against float32).

At a site the calibration smoothed (SmoothQuant), the activation and weight
are those the quantized model quantizes, :math:`X/s` and
:math:`\mathrm{diag}(s) W`.

References:
  Wu et al., "Integer Quantization for Deep Learning Inference: Principles
  and Empirical Evaluation", 2020. https://arxiv.org/abs/2004.09602
"""

from __future__ import annotations

import math
from typing import Any, Callable, Iterable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jmp_train._src.autocast import scaled
from jmp_train._src.deployment import calibration as calib
from jmp_train._src.int8 import products as int8_products
from jmp_train._src.deployment import quantized as quantized_lib
from jmp_train._src.deployment import smoothquant as smooth_lib

__all__ = ["SiteQuantization", "quantization_report"]

_QMIN, _QMAX = -128, 127


class SiteQuantization(NamedTuple):
  """One site's quantization, over the batches of :func:`~jmp_train.int8.quantization_report`.

  Attributes:
    clipped: the share of the activation's values beyond the int8 range at
      the calibrated scale (0 to 1).
    activation_sqnr_db: the activation's signal-to-quantization-noise ratio (dB).
    weight_sqnr_db: the weight's, quantized per output channel (dB).
    output_sqnr_db: the product's output, int8 against float32 (dB).
    scale: the activation's scale :math:`\\Delta`.
  """

  clipped: float
  activation_sqnr_db: float
  weight_sqnr_db: float
  output_sqnr_db: float
  scale: float


def _db(signal: float, noise: float) -> float:
  if noise <= 0:
    return math.inf
  if signal <= 0:
    return -math.inf
  return 10.0 * math.log10(signal / noise)


def _sums(x, xhat):
  x, xhat = jnp.asarray(x, jnp.float32), jnp.asarray(xhat, jnp.float32)
  return jnp.sum(x * x), jnp.sum((x - xhat) ** 2)


def quantization_report(
  apply_fn: Callable[..., Any], params: Any, calibration: calib.Calibration, batches: Iterable[Any]
) -> dict[str, SiteQuantization]:
  r"""Per weight product: the share of its activation clipped, and its quantization's SQNR.

  The function runs in float32 on each batch; at each site with a
  calibrated scale :math:`\Delta` the activation's codes
  :math:`\mathrm{clip}(\mathrm{round}(x/\Delta), -128, 127)`, the weight's
  per-channel codes and the int8 product are compared with the float
  values (each site in isolation: the float result goes on). Kept sites
  are left out.

  Args:
    apply_fn: the function, ``apply_fn(params, x)``.
    params: its float parameters.
    calibration: from :func:`~jmp_train.int8.calibrate` on this function.
    batches: an iterable of batches (e.g. held-out data).

  Returns:
    site name -> :class:`~jmp_train.int8.SiteQuantization`, in evaluation order.

  Raises:
    TypeError: if ``calibration`` is not a :class:`~jmp_train.int8.Calibration`.
    ValueError: for no batches, or a calibration that is not this function's.

  Examples:
    >>> from jmp_train.int8 import calibrate
    >>> def f(p, x):
    ...   return x @ p["w"]
    >>> p = {"w": jnp.eye(4)}
    >>> cal = calibrate(f, p, [jnp.ones((2, 4))])  # amax 1
    >>> r = quantization_report(f, p, cal, [jnp.array([[0.5, 1.0, 2.0, 4.0]])])["dot_general"]
    >>> r.clipped, r.weight_sqnr_db > 100  # 2.0 and 4.0 clipped; the identity's codes are nearly exact
    (0.5, True)
  """
  if not isinstance(calibration, calib.Calibration):
    raise TypeError(
      f"quantization_report needs a jmp_train.int8.Calibration (from jmp_train.int8.calibrate), got "
      f"{type(calibration).__name__}."
    )
  batches = list(batches)
  if not batches:
    raise ValueError("quantization_report needs batches: an iterable of at least one input batch.")
  scales = {s: jnp.float32(v) for s, v in calibration.scales.items()}
  smoothing = {s: np.asarray(v, np.float32) for s, v in (calibration.smoothing or {}).items()}

  def run(p, x):
    from jmp_train._src.autocast.transform import autocast

    stats: dict[str, Any] = {}

    def hook(site, vals, policy):
      del policy
      out = calib.bind(site, vals)
      if site.name not in scales:
        return out
      if site.name in smoothing:  # as the quantized model: X/s and diag(s) W
        s = smoothing[site.name]
        vals = quantized_lib.smoothed(site, vals, smooth_lib.inverse(s))
        w = vals[site.weight]
        vals[site.weight] = w * smooth_lib.laid_out(jnp.asarray(s), w.ndim, smooth_lib.axes_of(site)[1])
      a, w = vals[site.activation], vals[site.weight]
      delta = scales[site.name]
      r = jnp.round(jnp.asarray(a, jnp.float32) / delta)
      clipped = jnp.sum((r > _QMAX) | (r < _QMIN))
      a_hat = jnp.clip(r, _QMIN, _QMAX) * delta
      op = scaled.op_of(site.eqn)
      w_amax = jnp.max(jnp.abs(w.astype(jnp.float32)), axis=op.fine_axes(site.weight, w.ndim), keepdims=True)
      w_scale = int8_products.int8_scale(w_amax)
      w_hat = int8_products.int8_quantize(w, w_scale).astype(jnp.float32) * w_scale
      out_q = quantized_lib.static_product(site, vals, delta)
      stats[site.name] = (clipped, jnp.size(a), *_sums(a, a_hat), *_sums(w, w_hat), *_sums(out, out_q))
      return out

    with scaled.hooked(hook):
      autocast(apply_fn, calib.float_policy())(p, x)
    return stats

  step = jax.jit(run)
  totals: dict[str, np.ndarray] = {}
  for batch in batches:
    for site, values in jax.device_get(step(params, batch)).items():
      v = np.array([float(t) for t in values], np.float64)
      if site in totals:
        totals[site][:2] += v[:2]
        totals[site][2:4] += v[2:4]
        totals[site][6:] += v[6:]
      else:
        totals[site] = v  # the weight's sums: the same every batch
  missing = set(scales) - set(totals)
  if missing:
    raise ValueError(
      f"The calibration's sites {sorted(missing)} are not this function's weight products {sorted(totals)}: "
      "calibrate the same function."
    )
  return {
    site: SiteQuantization(
      clipped=float(t[0] / max(t[1], 1.0)),
      activation_sqnr_db=_db(t[2], t[3]),
      weight_sqnr_db=_db(t[4], t[5]),
      output_sqnr_db=_db(t[6], t[7]),
      scale=float(scales[site]),
    )
    for site, t in totals.items()
  }
