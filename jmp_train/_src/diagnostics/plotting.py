"""Plots of gradient histograms against the half-precision range (matplotlib).

matplotlib is optional (the ``plot`` extra); it is imported when a plot is
drawn, so importing ``jmp_train.diagnostics`` never needs it.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import jax.numpy as jnp
import numpy as np

from jmp_train._src.diagnostics import arguments
from jmp_train._src.diagnostics import fractions
from jmp_train._src.diagnostics import histograms

__all__ = ["plot_gradient_histogram"]

_COLORS = ("tab:blue", "tab:orange", "tab:green", "tab:purple", "tab:brown")


def _import_pyplot(what: str = "plot_gradient_histogram"):
  try:
    import matplotlib.pyplot as plt
  except ImportError as e:
    raise ImportError(
      f"{what} needs matplotlib, which is an optional "
      "dependency of jmp_train; install it with `pip install 'jmp_train[plot]'` "
      "(or `pip install matplotlib`)."
    ) from e
  return plt


def _as_histograms(hist_or_tree: Any, scales, target_dtype, min_exponent, max_exponent):
  if isinstance(hist_or_tree, histograms.GradientHistogram):
    given = [hist_or_tree.total]
  elif isinstance(hist_or_tree, histograms.Histogram):
    given = [hist_or_tree]
  elif (
    isinstance(hist_or_tree, (list, tuple))
    and hist_or_tree
    and all(isinstance(h, (histograms.Histogram, histograms.GradientHistogram)) for h in hist_or_tree)
  ):
    given = [h.total if isinstance(h, histograms.GradientHistogram) else h for h in hist_or_tree]
  else:
    given = None
  if given is not None:
    if scales is not None:
      raise ValueError(
        "scales applies when plot_gradient_histogram is given a pytree of "
        "values; a histogram was already computed at its own scale "
        f"({', '.join(f'{float(h.scale):g}' for h in given)})."
      )
    if any(arguments.is_traced(h) for h in given):
      raise ValueError("plot_gradient_histogram needs concrete histograms, not traced ones.")
    return given
  if scales is None:
    suggestion = fractions.suggest_loss_scale(hist_or_tree, target_dtype)
    scales = (1.0, float(suggestion.loss_scale))
  if isinstance(scales, (int, float)) or np.ndim(scales) == 0:
    scales = (scales,)
  if not len(scales):
    raise ValueError("scales must hold at least one scale, e.g. (1, 2**15).")
  return [
    histograms.gradient_histogram(
      hist_or_tree,
      target_dtype=target_dtype,
      scale=float(s),
      min_exponent=min_exponent,
      max_exponent=max_exponent,
    ).total
    for s in scales
  ]


def plot_gradient_histogram(
  hist_or_tree: Any,
  *,
  scales: Sequence[float] | None = None,
  target_dtype: Any = "float16",
  ax: Any = None,
  min_exponent: int = -40,
  max_exponent: int = 20,
  title: str | None = None,
  log_y: bool = True,
):
  """Bar chart of value magnitudes against float16's (or bfloat16's) range.

  In the style of Micikevicius et al. (2018), figure 3, their plot of
  SSD activation gradients: x is ``log2|value|`` in power-of-two
  bins, y the share of non-zero values per bin; shaded are the values that
  become 0 when cast (below half the smallest subnormal, ``2**-25`` for
  float16), the subnormal band (``2**-24`` to ``2**-14``) and the overflow
  region (``>= 65520``); lines mark the smallest subnormal, the smallest
  normal and the largest finite value. One histogram per scale, overlaid,
  so the shift by a loss scale is visible; the legend gives each one's
  zeros and the share that becomes 0 or inf. Values outside the bins are
  drawn hatched at the ends.

  Args:
    hist_or_tree: a pytree of values (gradients), or histograms already
      computed: a :class:`Histogram`, a :class:`GradientHistogram` (its
      total is drawn) or a list of them.
    scales: for a pytree: the scales to draw; default ``(1, S)`` with ``S``
      from :func:`suggest_loss_scale`. Must be None for histograms.
    target_dtype: for a pytree: ``float16`` or ``bfloat16``.
    ax: a matplotlib Axes to draw on; a new figure if None.
    min_exponent: for a pytree: the lowest bin edge ``2**min_exponent``.
    max_exponent: for a pytree: the highest bin edge.
    title: the Axes title (a default one names the dtype).
    log_y: logarithmic y axis (shares span orders of magnitude).

  Returns:
    The matplotlib Axes (its figure is ``ax.figure``).

  Raises:
    ImportError: without matplotlib, naming the ``jmp_train[plot]`` extra.
    ValueError: for bad input (see :func:`gradient_histogram`), or scales
      given with a histogram.

  Examples:
    >>> import matplotlib
    >>> matplotlib.use("Agg")
    >>> grads = {"w": jnp.asarray(np.random.default_rng(0).lognormal(-14, 3, 1000))}
    >>> ax = plot_gradient_histogram(grads, scales=(1, 2**10))
    >>> import io
    >>> ax.figure.savefig(io.BytesIO(), format="png")
  """
  plt = _import_pyplot()
  hists = _as_histograms(hist_or_tree, scales, target_dtype, min_exponent, max_exponent)
  dtype = hists[0].dtype
  if ax is None:
    _, ax = plt.subplots(figsize=(9, 4.5), layout="constrained")
  lo = min(h.min_exponent for h in hists)
  hi = max(h.max_exponent for h in hists)
  info = jnp.finfo(dtype)
  min_sub = int(np.log2(float(info.smallest_subnormal)))
  min_normal = int(np.log2(float(info.smallest_normal)))
  max_log2 = math.log2(float(info.max))
  xmin, xmax = lo - 1.5, hi + 1.5

  # The range of the target dtype: what happens to a value in each region.
  spans = (
    (xmin, min_sub - 1, "tab:red", 0.10, f"becomes 0 in {dtype.name}"),
    (min_sub - 1, min_normal, "tab:orange", 0.12, f"{dtype.name} subnormal"),
    (max_log2, xmax, "tab:red", 0.10, f"becomes inf in {dtype.name}"),
  )
  for a, b, color, alpha, label in spans:
    a, b = max(a, xmin), min(b, xmax)
    if a < b:
      ax.axvspan(a, b, color=color, alpha=alpha, lw=0, label=label)
  lines = (
    (min_sub, "--", f"smallest subnormal 2^{min_sub}"),
    (min_normal, "-.", f"smallest normal 2^{min_normal}"),
    (max_log2, ":", f"largest {float(info.max):.6g}"),
  )
  for x, style, label in lines:
    if xmin <= x <= xmax:
      ax.axvline(x, color="black", ls=style, lw=1, label=label)

  n = len(hists)
  width = 1.0 / n
  hatched = False
  for i, h in enumerate(hists):
    nonzero = max(int(h.nonzero), 1)
    share = 100.0 * np.asarray(h.counts, dtype=np.float64) / nonzero
    color = _COLORS[i % len(_COLORS)]
    label = (
      f"scale {float(h.scale):g}: zeros {float(h.zero_fraction):.1%} of all; of non-zero: "
      f"become 0 {float(h.underflow_fraction):.2%}, subnormal "
      f"{float(h.subnormal_fraction):.2%}, inf {float(h.overflow_fraction):.2%}"
    )
    ax.bar(h.exponents + i * width, share, width=width, align="edge", color=color, alpha=0.85, label=label)
    ends = [(h.min_exponent - 1, int(h.below)), (h.max_exponent, int(h.above))]
    for x, count in ends:
      if count:
        hatched = True
        ax.bar(
          x + i * width,
          100.0 * count / nonzero,
          width=width,
          align="edge",
          color=color,
          alpha=0.5,
          hatch="//",
          edgecolor=color,
        )
  ax.set_xlim(xmin, xmax)
  if log_y:
    ax.set_yscale("log")
  # Name the hatched end bars only where there are some.
  outside = "; hatched: outside the bins" if hatched else ""
  ax.set_xlabel(f"log2(|value|)  (bins [2^e, 2^(e+1)){outside})")
  ax.set_ylabel("% of non-zero values")
  ax.set_title(title if title is not None else f"Value magnitudes against the {dtype.name} range")
  ax.legend(fontsize="x-small", loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2)
  return ax
