"""sign_compression across processes: 2 processes x 2 CPU devices vs 4 devices.

Two Python processes join a ``jax.distributed`` job on the loopback interface
(gloo CPU collectives), the same code path as several hosts, and train with
1-bit compressed gradients; the parameters must equal, bit for bit, those of
the same training on 4 devices of this one process.
"""

from __future__ import annotations

import pathlib
import sys

import jax
import numpy as np
import pytest

from helpers import one_bit_multiprocess_worker as worker
from helpers import processes

HERE = pathlib.Path(__file__).parent
NUM_PROCESSES = 2


def test_two_processes_equal_one_process(tmp_path):
  outs = [tmp_path / f"params_{i}.npz" for i in range(NUM_PROCESSES)]
  processes.run_workers(
    "one_bit_multiprocess_worker.py",
    [[str(i), str(NUM_PROCESSES), "{port}", str(out), "sign_compression", "2"] for i, out in enumerate(outs)],
    timeout=240,
  )

  collectives = {}
  expected = worker.train(jax.devices()[: 2 * NUM_PROCESSES], "sign_compression", collectives=collectives)
  # The training step moves packed bits, not float gradients.
  assert collectives["all-reduce"] == 0 and collectives["all-to-all:u8"] > 0
  initial = worker.initial_params()
  for out in outs:
    with np.load(out) as f:
      # Every process holds the parameters (and its own devices' residuals).
      for name in initial:
        np.testing.assert_array_equal(f[name], expected[name], err_msg=name)
  # The run did train: parameters moved from their initial values.
  for name in initial:
    assert not np.array_equal(initial[name], expected[name]), name


def test_loopback_cap_without_rate_touches_nothing():
  sys.path.insert(0, str(HERE.parent))
  from benchmarks import bench_multiprocess

  with bench_multiprocess.loopback_cap(None) as link:
    assert link["cap"] is None and link["link"] == "loopback"


def test_pinning_without_affinity_support_raises_before_launching(monkeypatch):
  sys.path.insert(0, str(HERE.parent))
  from benchmarks import bench_multiprocess

  monkeypatch.setattr(bench_multiprocess, "_CAN_PIN", False)
  with pytest.raises(ValueError, match="sched_setaffinity"):
    bench_multiprocess.launch(2, "tiny", 1, ("float32",), pin=True)
