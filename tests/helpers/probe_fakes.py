"""Benchmarks for the GPU probe's tests: no JAX, instant, one that hangs and one that fails."""

import time


def listed(value=1):
  """Returns its records at once."""
  return [{"case": "listed", "value": value}]


def streamed_then_hangs():
  """Yields one record, then never ends (the probe's deadline has to stop it)."""
  yield {"case": "first", "value": 1}
  yield [{"case": "second", "value": 2}]
  time.sleep(600)
  yield {"case": "never", "value": 3}


def streamed_then_fails():
  """Yields one record, then raises."""
  yield {"case": "first", "value": 1}
  raise RuntimeError("broken on purpose")
