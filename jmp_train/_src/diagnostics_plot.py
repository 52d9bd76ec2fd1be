"""Moved to :mod:`jmp_train._src.diagnostics.plotting`; kept for the demo's import."""

from jmp_train._src.diagnostics.plotting import plot_gradient_histogram

__all__ = ["plot_gradient_histogram"]
