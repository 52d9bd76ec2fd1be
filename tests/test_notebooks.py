"""Executes every notebook in notebooks/ (committed without outputs)."""

from __future__ import annotations

import pathlib

import nbformat
import pytest
from nbclient import NotebookClient

from helpers import processes

ROOT = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


def test_there_are_notebooks():
  names = [p.name for p in NOTEBOOKS]
  assert "01_policies_on_flax.ipynb" in names and "02_loss_scaling.ipynb" in names, names


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_is_committed_without_outputs(path):
  nb = nbformat.read(path, as_version=4)
  for cell in nb.cells:
    if cell.cell_type == "code":
      assert not cell.outputs and cell.execution_count is None, f"{path.name} has outputs"


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs(path, tmp_path):
  nb = nbformat.read(path, as_version=4)
  # A fresh kernel, with the devices the notebooks expect (8 simulated CPUs).
  env = processes.worker_env()
  env["JAX_PLATFORMS"] = "cpu"
  env["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8"
  env["MPLBACKEND"] = "Agg"
  client = NotebookClient(nb, timeout=120, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}})
  client.execute(env=env)  # raises CellExecutionError on the first failing cell
  if "matplotlib" in "".join(c.source for c in nb.cells if c.cell_type == "code"):
    # Plots render inline in Jupyter: the executed notebook holds the images.
    images = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if "image/png" in o.get("data", {})]
    assert images, f"{path.name} draws with matplotlib but its outputs hold no image"
