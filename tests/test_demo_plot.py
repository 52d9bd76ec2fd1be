"""Tests for the ``jmp-train`` figure (examples/jmp_train_examples/demo_plot.py), on synthetic curves."""

from __future__ import annotations

import numpy as np
import pytest

from jmp_train_examples import demo_configs
from jmp_train_examples import demo_plot

pytest.importorskip("matplotlib")

STEPS = 20


def test_percent_gap_of_identical_curves_is_zero():
  loss = np.linspace(6.0, 3.0, STEPS)
  np.testing.assert_array_equal(demo_plot.percent_gap(loss, loss), np.zeros(STEPS))


def test_percent_gap_is_the_percent_above_the_baseline():
  base = np.linspace(6.0, 3.0, STEPS)
  np.testing.assert_allclose(demo_plot.percent_gap(1.1 * base, base), 10.0)
  np.testing.assert_allclose(demo_plot.percent_gap(0.95 * base, base), -5.0)
  np.testing.assert_allclose(demo_plot.percent_gap([2.0, 3.0], [2.0, 2.0]), [0.0, 50.0])


def test_percent_gap_over_the_shared_steps_nan_where_not_finite():
  gap = demo_plot.percent_gap([1.0, np.nan, np.inf, 2.0, 5.0], [1.0, 1.0, 1.0, 0.0])
  assert gap.dtype == np.float64 and len(gap) == 4
  assert gap[0] == 0.0 and np.isnan(gap[1:]).all()


def _synthetic():
  """Rows and curves of a default run's configurations: no training, known gaps."""
  base = np.linspace(6.0, 3.0, STEPS)
  factor = {"8dev-1bit-noef": 1.2, "8dev-1bit": 1.1}
  curves, rows = {}, []
  for name in demo_configs.DEFAULT_CONFIGS:
    cfg = demo_configs.CONFIGS[name]
    loss = factor.get(name, 1.0) * base
    scaled = cfg.loss_scale == "dynamic"
    curves[name] = {"loss": loss.tolist(), "loss_scale": [2.0**15 if scaled else 1.0] * STEPS}
    rows.append(
      {
        "config": name,
        "reference": cfg.reference,
        "val_loss": float(loss[-1]),
        "val_loss_gap": factor.get(name, 1.0) - 1.0,
        "loss_scale": 2.0**15 if scaled else 1.0,
        "underflow_f16": 0.0,
        "underflow_f16_logits": 0.0,
      }
    )
  return rows, curves


@pytest.fixture(scope="module")
def figure():
  from matplotlib.backends.backend_agg import FigureCanvasAgg

  rows, curves = _synthetic()
  s = demo_configs.DemoSettings(steps=STEPS, batch=16)
  fig = demo_plot.build_figure(rows, curves, s, demo_configs.learning_rate_schedule(s))
  FigureCanvasAgg(fig).draw()  # lays the figure out: window extents below
  return fig


def _gap_axes(fig):
  return [ax for ax in fig.axes if "gap" in ax.get_ylabel()]


def _lines(ax):
  return {line.get_label(): np.asarray(line.get_ydata(), np.float64) for line in ax.get_lines()}


def test_figure_has_one_gap_panel_per_comparison_in_percent(figure):
  gap_axes = _gap_axes(figure)
  assert len(gap_axes) == len(demo_configs.COMPARISONS)
  for ax, names in zip(gap_axes, demo_configs.COMPARISONS.values()):
    assert "%" in ax.get_ylabel() and names[0] in ax.get_ylabel()
    lines = _lines(ax)
    # The baseline is the line at zero; every other row of the comparison
    # that ran has a curve (a default run leaves the DiLoCo rows out).
    np.testing.assert_array_equal(lines[f"{names[0]} (baseline)"], 0.0)
    for name in names[1:]:
      assert (name in lines) == (name in demo_configs.DEFAULT_CONFIGS), (name, list(lines))


def test_gap_curves_are_the_percent_gaps(figure):
  scaling, updates, compression = (_lines(ax) for ax in _gap_axes(figure))
  for name in ("f16", "f16-dls", "bf16"):
    np.testing.assert_allclose(scaling[name], 0.0, atol=1e-9)
  np.testing.assert_allclose(updates["f16w-sgd"], 0.0, atol=1e-9)
  np.testing.assert_allclose(compression["8dev-1bit-noef"], 20.0)
  np.testing.assert_allclose(compression["8dev-1bit"], 10.0)


def test_rows_at_their_baseline_draw_flat_at_zero(figure):
  """A panel whose rows all match the baseline spans ±2%: no noise blown up to fill it."""
  scaling, _, compression = _gap_axes(figure)
  lo, hi = scaling.get_ylim()
  assert lo <= -2.0 and hi >= 2.0
  lo, hi = compression.get_ylim()
  assert lo <= 0.0 and hi >= 20.0


def test_final_validation_gaps_are_written_and_do_not_overlap(figure):
  from matplotlib import text

  compression = _gap_axes(figure)[2]
  labels = {t.get_text(): t for t in compression.texts if t.get_text().endswith("%")}
  assert set(labels) == {"+20.0%", "+10.0%"}
  scaling = _gap_axes(figure)[0]
  zeros = [t for t in scaling.texts if t.get_text() == "±0.0%"]
  assert len(zeros) == 3
  # The text alone, not the connector line each annotation draws to its value.
  boxes = [text.Text.get_window_extent(t) for t in zeros]
  for i, a in enumerate(boxes):
    for b in boxes[i + 1 :]:
      assert not a.overlaps(b)


def test_legends_sit_below_their_axes_in_a_legible_size(figure):
  for ax in _gap_axes(figure):
    legend = ax.get_legend()
    assert legend is not None
    assert legend.get_window_extent().y1 <= ax.get_window_extent().y0
    assert min(t.get_fontsize() for t in legend.get_texts()) >= 9


def test_coinciding_loss_scales_are_one_line_named_together(figure):
  (ax,) = [ax for ax in figure.axes if ax.get_title().startswith("Dynamic loss scale")]
  assert [line.get_label() for line in ax.get_lines()] == ["f16-dls = f16w-sgd = f16w-mmsgd"]


def test_plot_writes_a_png(tmp_path):
  rows, curves = _synthetic()
  s = demo_configs.DemoSettings(steps=STEPS, batch=16)
  demo_plot.plot(tmp_path / "results.png", rows, curves, s, demo_configs.learning_rate_schedule(s))
  assert (tmp_path / "results.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
