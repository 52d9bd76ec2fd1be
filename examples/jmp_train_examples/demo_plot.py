"""The ``jmp-train`` figure: each comparison's train loss and its gap to the baseline.

Top row: the train loss of each comparison's rows (they often coincide).
Middle row: each row's train loss as a percentage gap to its baseline's
(:func:`percent_gap`; the baseline is the flat line at zero, a row within
0.1% of it reads as the same flat line, one that trains worse as a curve
above it), with each row's final validation-loss gap written at the right.
Bottom row: the dynamic loss scale and two gradient histograms.

Needs matplotlib (``pip install 'jmp_train[plot]'``); the demo calls
:func:`plot` only when it is installed.
"""

from __future__ import annotations

import pathlib
from typing import Any, Sequence

import numpy as np

import jmp_train

__all__ = ["build_figure", "percent_gap", "plot"]

# Baseline: black solid; the others in distinct colours, line styles and markers.
_STYLES = (
  dict(color="black", ls="-", lw=2.2),
  dict(color="tab:red", ls="--", lw=1.8, marker="o"),
  dict(color="tab:blue", ls="-.", lw=1.8, marker="s"),
  dict(color="tab:green", ls=":", lw=2.2, marker="^"),
  dict(color="tab:purple", ls="--", lw=1.8, marker="v"),
  dict(color="tab:brown", ls="-.", lw=1.8, marker="D"),
)
# A gap panel's y-axis spans at least this many percent either side of zero,
# so that rows within a fraction of a percent of their baseline draw flat.
_MIN_GAP_RANGE = 2.0
_FONT = {
  "font.size": 11,
  "axes.titlesize": 13,
  "axes.labelsize": 11,
  "legend.fontsize": 10,
  "xtick.labelsize": 10,
  "ytick.labelsize": 10,
}


def percent_gap(values: Sequence[float], baseline: Sequence[float]) -> np.ndarray:
  """The gap of a curve to its baseline curve, in percent, step by step.

  ``100 * (values / baseline - 1)``: 0 where the curves agree, 10 where
  ``values`` is 10% above the baseline (a higher loss), negative below it.

  Args:
    values: the curve (e.g. a configuration's train loss at each step).
    baseline: its baseline curve, at the same steps.

  Returns:
    A float64 array over the steps the two curves share (the shorter
    length); NaN where either value is not finite.
  """
  values = np.asarray(values, np.float64)
  baseline = np.asarray(baseline, np.float64)
  n = min(len(values), len(baseline))
  values, baseline = values[:n], baseline[:n]
  with np.errstate(divide="ignore", invalid="ignore"):
    gap = 100.0 * (values / baseline - 1.0)
  gap[~(np.isfinite(values) & np.isfinite(baseline)) | ~np.isfinite(gap)] = np.nan
  return gap


def _smooth(values: Sequence[float], window: int) -> tuple[np.ndarray, np.ndarray]:
  """Moving mean over ``window`` steps, up to the last finite value."""
  loss = np.asarray(values, np.float64)
  finite = np.isfinite(loss)
  if not finite.all():
    loss = loss[: np.argmin(finite)]
  if len(loss) < window:
    return np.arange(0), np.arange(0)
  smooth = np.convolve(loss, np.ones(window) / window, mode="valid")
  return np.arange(len(smooth)) + window, smooth


def _markevery(i: int, n: int, length: int) -> tuple[int, int]:
  """Markers every ``length / 8`` points, staggered so coinciding curves all show theirs."""
  every = max(1, length // 8)
  return (i * every // max(1, n)) % every, every


def _diverged_at(values: Sequence[float]) -> int | None:
  """The first step (from 1) with a non-finite loss; None if every loss is finite."""
  finite = np.isfinite(np.asarray(values, np.float64))
  return None if finite.all() else int(np.argmin(finite)) + 1


def _loss_panel(ax, title: str, names: Sequence[str], curves: dict, window: int) -> None:
  drawn, kept = [], []
  for i, (style, name) in enumerate(zip(_STYLES, names)):
    if name not in curves:
      continue
    x, y = _smooth(curves[name]["loss"], window)
    if not len(x):
      continue
    ax.plot(x, y, markevery=_markevery(i - 1, len(names) - 1, len(x)), markersize=5, label=name, **style)
    drawn.append(y)
    if _diverged_at(curves[name]["loss"]) is None:
      kept.append(y)
  ax.set_title(title)
  if not drawn:
    ax.text(0.5, 0.5, "not run", ha="center", va="center", transform=ax.transAxes)
    return
  ax.set_ylabel("train loss" if window == 1 else f"train loss\n(mean of {window} steps)")
  # Zoom on the later steps, where the curves separate; keep the start
  # visible. A row whose loss went non-finite leaves the top of the panel.
  drawn = kept or drawn
  tail = np.concatenate([y[len(y) // 3 :] for y in drawn])
  lo, hi = float(tail.min()), float(np.concatenate(drawn).max())
  top = min(hi, lo + 3 * (float(tail.max()) - lo) + 1e-3)
  ax.set_ylim(lo - 0.05 * (top - lo), top)
  ax.grid(alpha=0.3)


def _gap_limits(gaps: Sequence[np.ndarray], diverged: Sequence[bool]) -> tuple[float, float]:
  """y-limits: every gap but spikes, at least ``_MIN_GAP_RANGE`` either side of zero.

  A curve whose loss went non-finite counts only up to ±100%: its blow-up
  leaves the panel instead of flattening the others.
  """
  finite = np.concatenate(
    [np.clip(g[np.isfinite(g)], -100, 100) if d else g[np.isfinite(g)] for g, d in zip(gaps, diverged)] + [np.zeros(1)]
  )
  lo = min(-_MIN_GAP_RANGE, float(np.percentile(finite, 1)))
  hi = max(_MIN_GAP_RANGE, float(np.percentile(finite, 99)))
  pad = 0.08 * (hi - lo)
  return lo - pad, hi + pad


def _percent(v: float) -> str:
  """``+1.2%``; ``±0.0%`` for what rounds to zero (no ``-0.0%``)."""
  return "±0.0%" if abs(v) < 0.05 else f"{v:+.1f}%"


def _spread(ys: Sequence[float], gap: float) -> list[float]:
  """Positions near ``ys``, at least ``gap`` apart, in the order of ``ys``."""
  order = np.argsort(ys)
  out = np.asarray(ys, np.float64)[order].copy()
  for k in range(1, len(out)):
    out[k] = max(out[k], out[k - 1] + gap)
  # Centre the moved block on the original positions.
  out -= (out.mean() - np.mean(ys)) if len(out) else 0.0
  result = [0.0] * len(ys)
  for k, j in enumerate(order):
    result[j] = float(out[k])
  return result


def _gap_panel(ax, names: Sequence[str], rows: dict, curves: dict, window: int, steps: int) -> None:
  """Each row's train loss as a percent gap to its baseline's, and its validation gap."""
  base = names[0]
  ax.set_xlabel("step")
  if base not in curves:
    ax.text(0.5, 0.5, f"{base} (the baseline) not run", ha="center", va="center", transform=ax.transAxes)
    return
  ax.axhline(0.0, label=f"{base} (baseline)", **_STYLES[0])
  _, yb = _smooth(curves[base]["loss"], window)
  gaps, diverged, ends = [], [], []
  others = list(names[1:])
  for i, name in enumerate(others):
    style = _STYLES[1 + i]
    if name not in curves:
      continue
    ref = rows.get(name, {}).get("reference", base)
    if ref != base:
      continue
    x, y = _smooth(curves[name]["loss"], window)
    n = min(len(y), len(yb))
    gap = percent_gap(y[:n], yb[:n])
    label = name
    step = _diverged_at(curves[name]["loss"])
    if step is not None:
      label += f" (non-finite loss from step {step})"
    ax.plot(x[:n], gap, markevery=_markevery(i, len(others), n), markersize=5, label=label, **style)
    gaps.append(gap)
    diverged.append(step is not None)
    val_gap = rows.get(name, {}).get("val_loss_gap")
    if val_gap is not None and np.isfinite(val_gap):
      ends.append((name, 100.0 * val_gap, style["color"]))
  ax.set_ylabel(f"train-loss gap to {base} (%)\n+: higher loss than {base}")
  ax.set_xlim(1, steps)
  ax.xaxis.get_major_locator().set_params(integer=True)
  lo, hi = _gap_limits(gaps, diverged)
  ax.set_ylim(lo, hi)
  ax.yaxis.set_major_formatter("{x:+g}%")
  ax.grid(alpha=0.3)
  if not gaps:
    ax.text(0.5, 0.75, "no other row run", ha="center", va="center", transform=ax.transAxes)
  # The final validation-loss gaps, right of the axes (a marker on the
  # axis at the value, the number beside it), spread so none overlap.
  if ends:
    ax.text(
      1.01,
      1.01,
      "validation\nloss gap\nat the end",
      transform=ax.transAxes,
      ha="left",
      va="bottom",
      fontsize="small",
      color="dimgrey",
    )
    at = [min(max(v, lo), hi) for _, v, _ in ends]
    ys = _spread(at, 0.08 * (hi - lo))
    for (_, v, color), y0, y in zip(ends, at, ys):
      ax.plot([1.0], [y0], marker="<", color=color, markersize=8, clip_on=False, transform=ax.get_yaxis_transform())
      ax.annotate(
        _percent(v),
        xy=(1.0, y0),
        xycoords=("axes fraction", "data"),
        xytext=(1.035, y),
        textcoords=("axes fraction", "data"),
        va="center",
        ha="left",
        color=color,
        fontweight="bold",
        annotation_clip=False,
        arrowprops=dict(arrowstyle="-", color=color, lw=0.8, shrinkA=0, shrinkB=4),
      )
  ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=2, frameon=False)


def _loss_scale_panel(ax, curves: dict) -> None:
  order = ("f16-dls", "f16w-sgd", "f16w-mmsgd")
  styles = dict(zip(order, _STYLES[1:]))
  names = [n for n in order if n in curves]
  # Rows with the same scale at every step are one line, named together.
  groups: list[list[str]] = []
  for name in names:
    for group in groups:
      if np.array_equal(curves[group[0]]["loss_scale"], curves[name]["loss_scale"]):
        group.append(name)
        break
    else:
      groups.append([name])
  values = []
  for i, group in enumerate(groups):
    scale = np.log2(np.asarray(curves[group[0]]["loss_scale"], np.float64))
    values.append(scale)
    ax.step(
      np.arange(1, len(scale) + 1),
      scale,
      where="post",
      label=" = ".join(group),
      markevery=_markevery(i, len(groups), len(scale)),
      markersize=5,
      **styles[group[0]],
    )
  ax.set_title("Dynamic loss scale after each step")
  ax.set_xlabel("step")
  ax.set_ylabel("log2(loss scale)")
  if not names:
    ax.text(0.5, 0.5, "no row with loss scaling", ha="center", va="center", transform=ax.transAxes)
    return
  finite = np.concatenate(values)
  finite = finite[np.isfinite(finite)]
  if len(finite):
    ax.set_ylim(np.floor(finite.min()) - 1, np.ceil(finite.max()) + 1)
  ax.yaxis.get_major_locator().set_params(integer=True)
  ax.xaxis.get_major_locator().set_params(integer=True)
  ax.grid(alpha=0.3)
  ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=3, frameon=False)


def _histogram_panels(axes, rows: dict, curves: dict) -> None:
  source = "f32" if "f32" in curves else next(iter(curves), None)
  scaled = rows.get("f16-dls", {}).get("loss_scale")
  scales = (1.0, float(scaled)) if scaled else (1.0, 2.0**15)
  which = (("params", "parameter", "underflow_f16"), ("logits", "logit", "underflow_f16_logits"))
  for ax, (key, noun, column) in zip(axes, which):
    if source is None or "grads" not in curves[source]:
      ax.set_axis_off()
      continue
    jmp_train.diagnostics.plot_gradient_histogram(
      curves[source]["grads"][key],
      scales=scales,
      target_dtype="float16",
      ax=ax,
      title=(
        f"float32 {noun} gradients of {source}'s final weights, 1 validation batch\n"
        f"scale 1 (column {column} = {rows[source][column]:.2%})\n"
        f"and scale {scales[1]:g} (" + ("f16-dls's final loss scale" if scaled else "the initial loss scale") + ")"
      ),
    )
    ax.title.set_fontsize("medium")
    # The legend below the axes, clear of the x label.
    handles, labels = ax.get_legend_handles_labels()
    ax.legend(handles, labels, fontsize="small", loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=1, frameon=False)


def build_figure(rows: Sequence[dict], curves: dict, s: Any, schedule: Any = None):
  """The demo's figure, as a ``matplotlib.figure.Figure`` (no pyplot).

  Args:
    rows: the table rows (``config``, ``reference``, ``val_loss_gap``,
      ``loss_scale`` and the underflow columns are read).
    curves: per configuration, ``loss`` and ``loss_scale`` at each step
      (and ``grads`` for the histograms, which are left empty without it).
    s: the settings (``steps``, ``task``, ``batch``, ``seed`` are read).
    schedule: the learning-rate schedule, drawn in grey behind the weight
      updates' losses; None draws none.

  Returns:
    The figure: for each comparison a train-loss panel above a gap panel,
    then the loss-scale panel and two gradient histograms.
  """
  # A Figure without pyplot: no backend is chosen or changed (notebooks keep theirs).
  import matplotlib
  from matplotlib.figure import Figure

  from jmp_train_examples.demo import COMPARISONS

  by_name = {r["config"]: r for r in rows}
  window = max(1, s.steps // 20)
  with matplotlib.rc_context(_FONT):
    fig = Figure(figsize=(20, 17), layout="constrained")
    grid = fig.add_gridspec(3, 3, height_ratios=(1.0, 1.5, 1.7))
    for col, (title, names) in enumerate(COMPARISONS.items()):
      loss_ax = fig.add_subplot(grid[0, col])
      gap_ax = fig.add_subplot(grid[1, col], sharex=loss_ax)
      _loss_panel(loss_ax, f"{title.capitalize()}: train loss", names, curves, window)
      loss_ax.tick_params(labelbottom=False)
      _gap_panel(gap_ax, names, by_name, curves, window, s.steps)
      gap_ax.set_title(f"{title.capitalize()}: gap to {names[0]}")
      if schedule is not None and title == "weight updates":
        lr = np.asarray([float(schedule(i)) for i in range(s.steps)])
        twin = loss_ax.twinx()
        twin.plot(np.arange(1, s.steps + 1), lr, color="grey", lw=0.8, alpha=0.6)
        twin.set_ylabel("learning rate (grey)", color="grey")
    _loss_scale_panel(fig.add_subplot(grid[2, 0]), curves)
    _histogram_panels([fig.add_subplot(grid[2, 1]), fig.add_subplot(grid[2, 2])], by_name, curves)
    fig.suptitle(
      f"jmp-train: {s.task}, batch {s.batch}, {s.steps} steps, seed {s.seed}; gap = 100 · (loss / baseline's loss − 1)",
      fontsize="x-large",
    )
  return fig


def plot(path: pathlib.Path, rows: Sequence[dict], curves: dict, s: Any, schedule: Any) -> None:
  """Writes the figure to ``path`` (PNG)."""
  build_figure(rows, curves, s, schedule).savefig(path, dpi=100)
