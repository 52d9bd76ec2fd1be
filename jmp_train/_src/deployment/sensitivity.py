"""The sensitivity scan: each weight product quantized alone, and the sites to keep for a target.

For each site, the function's metric with that site's product alone in
int8 (the others in float32) says how much that one product costs; the
proposal keeps the costliest sites in high precision, one more at a time,
until the model with the rest in int8 meets the target.

References:
  NVIDIA, "TensorRT Model Optimizer: per-layer sensitivity analysis";
  Wu et al., "Integer Quantization for Deep Learning Inference: Principles
  and Empirical Evaluation", 2020, section 5.1. https://arxiv.org/abs/2004.09602
"""

from __future__ import annotations

import math
from typing import Any, Callable, NamedTuple

import jax

from jmp_train._src.deployment import calibration as calib
from jmp_train._src.deployment import quantized as quantized_lib

__all__ = ["Sensitivity", "sensitivity"]


class Sensitivity(NamedTuple):
  """The result of :func:`~jmp_train.int8.sensitivity`.

  Attributes:
    float_metric: the metric of the float function.
    quantized_metric: the metric with every site in int8.
    by_site: site name -> the metric with that site alone in int8.
    ranking: the site names, the costliest first.
    keep: the proposed sites to keep in high precision (the costliest first).
    proposed_metric: the metric with ``keep`` in high precision, the rest in int8.
    target: the value the metric was to reach.
    met: whether ``proposed_metric`` reaches ``target``.
  """

  float_metric: float
  quantized_metric: float
  by_site: dict[str, float]
  ranking: tuple[str, ...]
  keep: tuple[str, ...]
  proposed_metric: float
  target: float
  met: bool


def _value(metric: Callable[[Callable[[Any], Any]], Any], predict: Callable[[Any], Any], what: str) -> float:
  value = metric(predict)
  try:
    value = float(jax.device_get(value))
  except (TypeError, ValueError):
    raise TypeError(f"sensitivity's metric must return a number, got {type(value).__name__} for {what}.") from None
  if not math.isfinite(value):
    raise ValueError(f"sensitivity's metric returned {value} for {what}: it must be finite.")
  return value


def sensitivity(
  apply_fn: Callable[..., Any],
  params: Any,
  calibration: calib.Calibration,
  metric: Callable[[Callable[[Any], Any]], Any],
  *,
  target: float | None = None,
  higher_is_better: bool = True,
) -> Sensitivity:
  r"""Quantizes one weight product at a time and proposes the sites to keep in high precision.

  ``metric(predict)`` scores a model given as ``predict(x)`` (e.g. its
  accuracy on held-out data). It is taken of the float function, of the
  :func:`~jmp_train.int8.quantize` d model with every site in int8, and of
  each site alone in int8 (the others kept in float32). Sites are ranked by
  their cost, :math:`m_{\mathrm{float}} - m_s` (or :math:`m_s -
  m_{\mathrm{float}}` when lower is better); the proposal keeps the first
  :math:`k` of the ranking, for the least :math:`k` whose model reaches
  ``target`` (at most every site: the float function). Pass the proposal
  as ``keep=`` to :func:`~jmp_train.int8.quantize`.

  Args:
    apply_fn: the function, ``apply_fn(params, x)``.
    params: its float parameters.
    calibration: from :func:`~jmp_train.int8.calibrate` on this function
      (with every site to scan: none kept).
    metric: ``metric(predict) -> float``.
    target: the value the metric must reach (at least, or at most when
      ``higher_is_better=False``); default the float function's.
    higher_is_better: whether a larger metric is better (accuracy) or
      worse (a loss).

  Returns:
    A :class:`~jmp_train.int8.Sensitivity`.

  Raises:
    TypeError: if ``calibration`` is not a :class:`~jmp_train.int8.Calibration`,
      or the metric returns something other than a number.
    ValueError: if the calibration kept sites or is not this function's, or
      the metric is not finite.

  Examples:
    >>> from jmp_train.int8 import calibrate
    >>> def mlp(p, x):
    ...   return jax.nn.relu(x @ p["w1"]) @ p["w2"]
    >>> p = {"w1": jax.random.normal(jax.random.key(0), (8, 16)), "w2": jnp.ones((16, 2))}
    >>> x = jax.random.normal(jax.random.key(1), (32, 8))
    >>> error = lambda predict: jnp.abs(predict(x) - mlp(p, x)).mean()
    >>> scan = sensitivity(mlp, p, calibrate(mlp, p, [x]), error, target=0.0, higher_is_better=False)
    >>> scan.float_metric, sorted(scan.by_site), scan.keep, scan.met
    (0.0, ['dot_general', 'dot_general#1'], ('dot_general', 'dot_general#1'), True)

  References:
    Wu et al., "Integer Quantization for Deep Learning Inference: Principles
    and Empirical Evaluation", 2020. https://arxiv.org/abs/2004.09602
  """
  if not isinstance(calibration, calib.Calibration):
    raise TypeError(
      f"sensitivity needs a jmp_train.int8.Calibration (from jmp_train.int8.calibrate), got "
      f"{type(calibration).__name__}."
    )
  if calibration.kept:
    raise ValueError(
      f"sensitivity scans every site; the calibration kept {list(calibration.kept)}: calibrate without keep=."
    )
  sites = list(calib.site_table(apply_fn, params, calibration.inputs))

  def quantized(keep: list[str]) -> Callable[[Any], Any]:
    return quantized_lib.quantize(apply_fn, params, calibration, keep=keep or None)

  float_fn = jax.jit(apply_fn)
  float_metric = _value(metric, lambda x: float_fn(params, x), "the float function")
  quantized_metric = _value(metric, quantized([]), "every site in int8")
  by_site = {s: _value(metric, quantized([o for o in sites if o != s]), f"site {s!r} alone in int8") for s in sites}
  sign = 1.0 if higher_is_better else -1.0
  cost = {s: sign * (float_metric - v) for s, v in by_site.items()}
  ranking = tuple(sorted(sites, key=lambda s: -cost[s]))
  target = float_metric if target is None else float(target)

  def meets(v: float) -> bool:
    return v >= target if higher_is_better else v <= target

  value = quantized_metric
  k = 0
  while not meets(value) and k < len(ranking):
    k += 1
    keep = list(ranking[:k])
    value = float_metric if k == len(ranking) else _value(metric, quantized(keep), f"keeping {keep}")
  return Sensitivity(float_metric, quantized_metric, by_site, ranking, ranking[:k], value, target, meets(value))
