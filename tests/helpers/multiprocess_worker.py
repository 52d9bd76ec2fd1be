"""One process of the multi-process sign_compression test (and its training).

Run as ``python tests/helpers/multiprocess_worker.py PROCESS_ID NUM_PROCESSES PORT
OUT.npz``: the process joins a ``jax.distributed`` job on ``127.0.0.1:PORT``
with 2 CPU devices and gloo collectives, trains a small model with
``sign_compression`` over all processes' devices, and writes the final
parameters to ``OUT.npz``. The test imports :func:`train` to run the same
training on the devices of one process.
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__":
  # Before jax is imported: 2 CPU devices in this process.
  os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"
  os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

AXIS = "data"
STEPS = 5
PER_DEVICE_BATCH = 8


def initial_params(rng: np.random.Generator | None = None) -> dict[str, np.ndarray]:
  """The MLP's initial parameters (drawn first from ``rng``, seed 0 by default)."""
  rng = np.random.default_rng(0) if rng is None else rng
  return {
    "w1": (rng.normal(size=(6, 16)) * 0.3).astype(np.float32),
    "b1": np.zeros((16,), np.float32),
    "w2": (rng.normal(size=(16, 3)) * 0.3).astype(np.float32),
  }


def train(devices, steps: int = STEPS, collectives: dict | None = None) -> dict[str, np.ndarray]:
  """Trains a small MLP with 1-bit compressed gradients over ``devices``.

  Returns the parameters after ``steps`` steps of
  ``chain(sign_compression, sgd with momentum)``; each replica sees its own
  shard of every batch. When ``collectives`` is a dict, it receives
  :func:`jmp_train.diagnostics.collective_bytes` of the compiled step.
  """
  from jmp_train import sign_compression, sign_compression_specs
  from jmp_train.diagnostics import collective_bytes

  mesh = Mesh(np.asarray(devices), (AXIS,))
  k = len(devices)
  rng = np.random.default_rng(0)
  params = jax.tree.map(jnp.asarray, initial_params(rng))
  x_all = rng.normal(size=(steps, k * PER_DEVICE_BATCH, 6)).astype(np.float32)
  y_all = np.tanh(x_all @ rng.normal(size=(6, 3))).astype(np.float32)
  tx = optax.chain(sign_compression(AXIS, scale="column"), optax.sgd(0.1, momentum=0.9))

  params = jax.device_put(params, NamedSharding(mesh, P()))
  state_shapes = jax.eval_shape(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=P()), params)
  specs = sign_compression_specs(state_shapes, AXIS)
  opt_state = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=specs))(params)

  def loss_fn(p, batch):
    x, y = batch
    h = jnp.tanh(x @ p["w1"] + p["b1"])
    return jnp.mean((h @ p["w2"] - y) ** 2)

  def local_step(p, s, batch):
    # Under shard_map the replicated parameters are invariant along AXIS, and
    # the gradient with respect to an invariant input is summed over AXIS (a
    # float all-reduce). Mark them varying to get each replica's own gradient.
    local_p = jax.lax.pcast(p, AXIS, to="varying")
    grads = jax.grad(loss_fn)(local_p, batch)  # local gradients, not averaged
    updates, s = tx.update(grads, s, p)
    return optax.apply_updates(p, updates), s

  step = jax.jit(jax.shard_map(local_step, mesh=mesh, in_specs=(P(), specs, P(AXIS)), out_specs=(P(), specs)))
  batch_sharding = NamedSharding(mesh, P(AXIS))
  for t in range(steps):
    # Each process builds only the shards of its own devices.
    batch = tuple(
      jax.make_array_from_callback(a.shape, batch_sharding, lambda i, a=a: a[i]) for a in (x_all[t], y_all[t])
    )
    if collectives is not None and t == 0:
      collectives.update(collective_bytes(step.lower(params, opt_state, batch).compile()))
    # Each step waits for itself: XLA:CPU must not queue more collectives than it can run.
    params, opt_state = jax.block_until_ready(step(params, opt_state, batch))
  return {name: np.asarray(v.addressable_data(0)) for name, v in params.items()}


def main(argv: list[str]) -> int:
  process_id, num_processes, port, out = int(argv[1]), int(argv[2]), int(argv[3]), argv[4]
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(
    coordinator_address=f"127.0.0.1:{port}",
    num_processes=num_processes,
    process_id=process_id,
  )
  assert jax.process_count() == num_processes
  assert jax.local_device_count() == 2
  params = train(jax.devices())
  np.savez(out, **params)
  jax.distributed.shutdown()
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv))
