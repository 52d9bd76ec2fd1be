"""Tests for jmp_train.diagnostics.plot_gradient_histogram."""

from __future__ import annotations

import sys

import jax.numpy as jnp
import numpy as np
import pytest

from jmp_train import diagnostics as diag

F16, BF16, F32 = np.dtype(jnp.float16), np.dtype(jnp.bfloat16), np.dtype(jnp.float32)


def _log_uniform(rng, n, lo, hi, dtype=np.float32):
  signs = rng.choice([-1.0, 1.0], n)
  return (signs * np.exp2(rng.uniform(lo, hi, n))).astype(dtype)


# ---------------------------------------------------------------------------
# Plots.


@pytest.fixture(scope="module")
def pyplot():
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  yield plt
  plt.close("all")


def test_plot_before_and_after_scaling_writes_png(pyplot, tmp_path):
  rng = np.random.default_rng(5)
  grads = {"act": jnp.asarray(_log_uniform(rng, 2000, -34, -6)), "n": jnp.arange(2)}
  ax = diag.plot_gradient_histogram(grads)  # scales (1, suggested)
  labels = [t.get_text() for t in ax.get_legend().get_texts()]
  suggested = float(diag.suggest_loss_scale(grads).loss_scale)
  assert any(label.startswith("scale 1:") for label in labels)
  assert any(label.startswith(f"scale {suggested:g}:") for label in labels)
  assert any("subnormal" in label for label in labels) and any("65504" in label for label in labels)
  # 60 bars per scale (half a bin wide: two scales side by side); all the
  # values lie inside the bins, so no hatched end bars.
  heights = [p.get_height() for p in ax.patches if p.get_width() == 0.5]
  assert len(heights) == 120
  assert "hatched" not in ax.get_xlabel()
  for i, scale in enumerate((1.0, suggested)):
    h = diag.gradient_histogram(grads, scale=scale).total
    share = 100 * np.asarray(h.counts) / int(h.nonzero)
    np.testing.assert_allclose(heights[60 * i : 60 * (i + 1)], share)
  path = tmp_path / "hist.png"
  ax.figure.savefig(path)
  assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 5000
  pyplot.close(ax.figure)


def test_plot_given_histograms_and_an_axes(pyplot):
  fig, ax = pyplot.subplots()
  x = jnp.asarray(np.geomspace(1e-12, 1e3, 100))
  hists = [diag.gradient_histogram(x, target_dtype="bf16", scale=s) for s in (1.0, 8.0)]
  out = diag.plot_gradient_histogram(hists, ax=ax)
  assert out is ax and "bfloat16" in ax.get_title()
  labels = [t.get_text() for t in ax.get_legend().get_texts()]
  # bfloat16's range (2**-133 .. 3.4e38) lies outside the bins: no marks.
  assert [label.split(":")[0] for label in labels] == ["scale 1", "scale 8"]
  assert "hatched" not in ax.get_xlabel()  # every value lies in the bins
  ax.cla()
  # Values past both ends of narrower bins: hatched end bars, and the label says so.
  diag.plot_gradient_histogram(x, scales=(1.0,), ax=ax, min_exponent=-20, max_exponent=0)
  assert "hatched: outside the bins" in ax.get_xlabel()
  assert sum(p.get_hatch() == "//" for p in ax.patches) == 2
  ax.cla()
  diag.plot_gradient_histogram(hists[1].total, ax=ax, title="one")
  assert ax.get_title() == "one" and len(ax.get_legend().get_texts()) == 1
  with pytest.raises(ValueError, match="scales"):
    diag.plot_gradient_histogram(hists[0], scales=(1, 2))
  pyplot.close(fig)


def test_plot_without_matplotlib_names_the_extra(monkeypatch):
  monkeypatch.setitem(sys.modules, "matplotlib", None)
  monkeypatch.setitem(sys.modules, "matplotlib.pyplot", None)
  with pytest.raises(ImportError, match=r"jmp_train\[plot\]"):
    diag.plot_gradient_histogram(jnp.ones(3))
