"""One process of the multi-process 1-bit tests (and their training).

Run as ``python tests/helpers/one_bit_multiprocess_worker.py PROCESS_ID
NUM_PROCESSES PORT OUT.npz OPTIMIZER DEVICES``: the process joins a
``jax.distributed`` job on ``127.0.0.1:PORT`` with ``DEVICES`` CPU devices
and gloo collectives, trains a small model with ``OPTIMIZER``
(``sign_compression``: :func:`jmp_train.sign_compression` before momentum
SGD, column scales; ``adam``:
:func:`jmp_train.one_bit_adam` with ``rescale_variance`` and ``clip_step``,
2 warm-up steps then compressed;
``momentum``: :func:`jmp_train.one_bit_momentum`, no warm-up) over all
processes' devices, and writes the final parameters and this process's
residuals to ``OUT.npz``. The test imports :func:`train` to run the same
training on the devices of one process.

Bit-for-bit equality needs every float reduction to add in the same order
in both runs. The exchange after warm-up adds locally, in replica order;
the float ``pmean`` s (the warm-up's, the per-tensor mean squares) are
all-reduces whose order depends on the
backend (gloo across processes, XLA within one): with two replicas it is
one addition, ``a + b == b + a``, so the Adam case runs one device per
process.
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__":
  # Before jax is imported: 2 CPU devices in this process.
  os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={sys.argv[6]}"
  os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

AXIS = "data"
STEPS = 5
WARMUP = 2
PER_DEVICE_BATCH = 8


def initial_params(rng: np.random.Generator | None = None) -> dict[str, np.ndarray]:
  """The MLP's initial parameters (drawn first from ``rng``, seed 0 by default)."""
  rng = np.random.default_rng(0) if rng is None else rng
  return {
    "w1": (rng.normal(size=(6, 16)) * 0.3).astype(np.float32),
    "b1": np.zeros((16,), np.float32),
    "w2": (rng.normal(size=(16, 3)) * 0.3).astype(np.float32),
  }


def train(devices, optimizer: str, steps: int = STEPS, collectives: dict | None = None) -> dict[str, np.ndarray]:
  """Trains a small MLP with ``optimizer`` over ``devices``.

  ``optimizer``: ``"sign_compression"``, ``"adam"`` or ``"momentum"`` (see
  the module's docstring). Returns the parameters after ``steps`` steps
  and, under ``"<field>/<d>"``, the worker and server residuals of each of
  this process's devices ``d`` (by global device id). When ``collectives``
  is a dict, it receives :func:`jmp_train.diagnostics.collective_bytes` of
  the compiled step.
  """
  from jmp_train import one_bit_adam, one_bit_momentum, sign_compression, sign_compression_specs
  from jmp_train.diagnostics import collective_bytes

  mesh = Mesh(np.asarray(devices), (AXIS,))
  k = len(devices)
  rng = np.random.default_rng(0)
  params = jax.tree.map(jnp.asarray, initial_params(rng))
  x_all = rng.normal(size=(steps, k * PER_DEVICE_BATCH, 6)).astype(np.float32)
  y_all = np.tanh(x_all @ rng.normal(size=(6, 3))).astype(np.float32)
  if optimizer == "adam":
    # rescale_variance adds a float all-reduce to every step after warm-up.
    tx = one_bit_adam(
      1e-2, weight_decay=0.01, axis_name=AXIS, warmup_steps=WARMUP, rescale_variance=True, clip_step=True
    )
  elif optimizer == "momentum":
    tx = one_bit_momentum(0.1, 0.9, axis_name=AXIS, nesterov=True)
  else:
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
    local_p = jax.lax.pcast(p, AXIS, to="varying")  # this replica's gradient
    grads = jax.grad(loss_fn)(local_p, batch)
    updates, s = tx.update(grads, s, p)
    return optax.apply_updates(p, updates), s

  step = jax.jit(jax.shard_map(local_step, mesh=mesh, in_specs=(P(), specs, P(AXIS)), out_specs=(P(), specs)))
  batch_sharding = NamedSharding(mesh, P(AXIS))
  for t in range(steps):
    batch = tuple(
      jax.make_array_from_callback(a.shape, batch_sharding, lambda i, a=a: a[i]) for a in (x_all[t], y_all[t])
    )
    if collectives is not None and t == 0:
      collectives.update(collective_bytes(step.lower(params, opt_state, batch).compile()))
    params, opt_state = jax.block_until_ready(step(params, opt_state, batch))
  out = {name: np.asarray(v.addressable_data(0)) for name, v in params.items()}
  c = opt_state[0] if optimizer == "sign_compression" else opt_state.compression
  for name in ("worker_residual", "server_residual"):
    # Per device: the residual leaves' shards, concatenated.
    leaves = jax.tree.leaves(getattr(c, name))
    for shards in zip(*(leaf.addressable_shards for leaf in leaves)):
      assert len({s.device for s in shards}) == 1
      out[f"{name}/{shards[0].device.id}"] = np.concatenate([np.asarray(s.data).reshape(-1) for s in shards])
  return out


def main(argv: list[str]) -> int:
  process_id, num_processes, port, out = int(argv[1]), int(argv[2]), int(argv[3]), argv[4]
  optimizer, devices = argv[5], int(argv[6])
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(
    coordinator_address=f"127.0.0.1:{port}",
    num_processes=num_processes,
    process_id=process_id,
  )
  assert jax.process_count() == num_processes
  assert jax.local_device_count() == devices
  np.savez(out, **train(jax.devices(), optimizer))
  jax.distributed.shutdown()
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv))
