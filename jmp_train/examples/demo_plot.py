"""The ``jmp-train`` figure: one panel per comparison, the loss scale, two histograms.

Needs matplotlib (``pip install 'jmp_train[plot]'``); the demo calls
:func:`plot` only when it is installed.
"""

from __future__ import annotations

import pathlib
from typing import Any, Sequence

import numpy as np

import jmp_train

__all__ = ["plot"]

# Reference: black solid; the others in distinct colours and line styles.
_STYLES = (
    dict(color="black", ls="-", lw=2.2),
    dict(color="tab:red", ls="--", lw=1.6),
    dict(color="tab:blue", ls="-.", lw=1.6),
    dict(color="tab:green", ls=":", lw=2.0),
)


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


def _comparison_panel(ax, title: str, names: Sequence[str], rows: dict, curves: dict,
                      window: int) -> None:
  drawn = []
  for style, name in zip(_STYLES, names):
    if name not in curves:
      continue
    x, y = _smooth(curves[name]["loss"], window)
    if not len(x):
      continue
    gap = rows[name].get("val_loss_gap")
    label = f"{name}: val {rows[name]['val_loss']:.3f}" + (
        f" ({gap:+.1%})" if gap is not None and name != rows[name]["reference"] else "")
    ax.plot(x, y, label=label, **style)
    drawn.append(y)
  ax.set_title(title)
  ax.set_xlabel("step")
  if not drawn:
    ax.text(0.5, 0.5, "not run", ha="center", va="center", transform=ax.transAxes)
    return
  ax.set_ylabel("train loss" if window == 1 else f"train loss (mean of {window} steps)")
  # Zoom on the second half, where the curves separate; keep the start visible.
  tail = np.concatenate([y[len(y) // 3:] for y in drawn])
  lo, hi = float(tail.min()), float(np.concatenate(drawn).max())
  top = min(hi, lo + 3 * (float(tail.max()) - lo) + 1e-3)
  ax.set_ylim(lo - 0.05 * (top - lo), top)
  ax.legend(fontsize="small", title="validation loss (vs reference)", title_fontsize="small")


def _loss_scale_panel(ax, curves: dict) -> None:
  names = [n for n in ("f16-dls", "f16w-sgd", "f16w-mmsgd") if n in curves]
  styles = dict(zip(("f16-dls", "f16w-sgd", "f16w-mmsgd"), _STYLES[1:]))
  for name in names:
    scale = np.asarray(curves[name]["loss_scale"], np.float64)
    ax.step(np.arange(1, len(scale) + 1), np.log2(scale), where="post", label=name,
            **styles[name])
  ax.set_title("Dynamic loss scale after each step")
  ax.set_xlabel("step")
  ax.set_ylabel("log2(loss scale)")
  if names:
    ax.legend(fontsize="small")
  else:
    ax.text(0.5, 0.5, "no row with loss scaling", ha="center", va="center",
            transform=ax.transAxes)


def _histogram_panels(axes, rows: dict, curves: dict) -> None:
  source = "f32" if "f32" in curves else next(iter(curves), None)
  scaled = rows.get("f16-dls", {}).get("loss_scale")
  scales = (1.0, float(scaled)) if scaled else (1.0, 2.0**15)
  which = (("params", "parameter", "underflow_f16"),
           ("logits", "logit", "underflow_f16_logits"))
  for ax, (key, noun, column) in zip(axes, which):
    if source is None or "grads" not in curves[source]:
      ax.set_axis_off()
      continue
    jmp_train.diagnostics.plot_gradient_histogram(
        curves[source]["grads"][key], scales=scales, target_dtype="float16", ax=ax,
        title=(f"float32 {noun} gradients of {source}'s final weights, 1 validation batch\n"
               f"scale 1 (column {column} = {rows[source][column]:.2%}) and "
               f"scale {scales[1]:g} (" + ("f16-dls's final loss scale" if scaled
                                          else "the initial loss scale") + ")"),
    )
    ax.title.set_fontsize("small")
    # The legend below the axes, clear of the x label.
    handles, labels = ax.get_legend_handles_labels()
    ax.legend(handles, labels, fontsize="x-small", loc="upper center",
              bbox_to_anchor=(0.5, -0.16), ncol=2)


def plot(path: pathlib.Path, rows: Sequence[dict], curves: dict, s: Any, schedule: Any) -> None:
  """Writes the figure to ``path`` (PNG)."""
  # A Figure without pyplot: no backend is chosen or changed (notebooks keep theirs).
  from matplotlib.figure import Figure  # pylint: disable=g-import-not-at-top

  from jmp_train.examples.demo import COMPARISONS  # pylint: disable=g-import-not-at-top

  by_name = {r["config"]: r for r in rows}
  fig = Figure(figsize=(19, 12), layout="constrained")
  axes = fig.subplots(2, 3)
  window = max(1, s.steps // 20)
  for ax, (title, names) in zip(axes[0], COMPARISONS.items()):
    _comparison_panel(ax, title.capitalize(), names, by_name, curves, window)
  lr = np.asarray([float(schedule(i)) for i in range(s.steps)])
  twin = axes[0][1].twinx()
  twin.plot(np.arange(1, s.steps + 1), lr, color="grey", lw=0.8, alpha=0.6)
  twin.set_ylabel("learning rate (grey)", color="grey")
  _loss_scale_panel(axes[1][0], curves)
  _histogram_panels(axes[1][1:], by_name, curves)
  fig.suptitle(f"jmp-train: {s.task}, batch {s.batch}, {s.steps} steps, seed {s.seed}")
  fig.savefig(path, dpi=100)
