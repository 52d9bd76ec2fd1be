"""Test configuration: 8 simulated CPU devices, set before jax is imported."""

import os

# Must happen before the first `import jax` anywhere in the test session.
# XLA:CPU's collective timeouts stay at their defaults, as a user has them:
# a loop that queues steps with collectives waits for each (as
# make_train_step does on CPU devices, and the README asks of hand-written
# loops). The tests' programs are small and most run once or twice, so
# LLVM's optimization passes are skipped (XLA's HLO passes, fusion included,
# still run), and XLA:CPU's fusion emitters are off (its older loop
# emitter compiles a program in about half the time; results agree to about
# six significant digits): compilation dominates the suite's time. If an
# XLA release drops either flag, every process refuses to start: drop it here.
os.environ["XLA_FLAGS"] = (
  "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false "
  + os.environ.get("XLA_FLAGS", "")
  + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# No persistent compilation cache by default: CI starts from a clean clone,
# where writing a cold cache costs more than it saves.
# To reuse compilations across local runs, set JAX_COMPILATION_CACHE_DIR
# (the xdist workers and the processes the tests start inherit it).
if os.environ.get("JAX_COMPILATION_CACHE_DIR"):
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.2")

import jax  # noqa: E402
import pytest  # noqa: E402

NUM_DEVICES = 8


def pytest_configure(config):
  del config
  # Fail loudly (not skip) when the simulated devices are missing.
  assert jax.device_count() == NUM_DEVICES, f"expected {NUM_DEVICES} simulated CPU devices, got {jax.devices()}"


# The long runs (marked ``slow``: notebooks, the demo's processes,
# convergence) go first: with ``--dist worksteal`` the two workers then share
# out the short tests and finish together, instead of one waiting on a long
# run queued last.
def pytest_collection_modifyitems(config, items):
  del config
  items.sort(key=lambda item: item.get_closest_marker("slow") is None)


@pytest.fixture
def num_devices():
  return NUM_DEVICES
