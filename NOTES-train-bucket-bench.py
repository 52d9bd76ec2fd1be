import sys, time, json
import jax
pid, n, port, root = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
jax.config.update("jax_num_cpu_devices", 1)
jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=n, process_id=pid)
sys.path.insert(0, root)
import numpy as np, jax.numpy as jnp, optax, flax.linen as nn
import jmp_train

class Mlp(nn.Module):
  @nn.compact
  def __call__(self, x):
    for _ in range(16):
      x = nn.relu(nn.Dense(256)(x))
    return nn.Dense(4)(x)

params = Mlp().init(jax.random.PRNGKey(0), jnp.ones((1, 256)))["params"]
nparams = sum(x.size for x in jax.tree.leaves(params))
xent = lambda o, y: optax.softmax_cross_entropy_with_integer_labels(o, y).mean()
steps = {}
for name, bb in [("per_leaf", 1), ("bucketed_25MiB", 25 * 2**20)]:
  step = jmp_train.make_train_step(Mlp().apply, xent, optax.sgd(0.01), mode="shard_map", bucket_bytes=bb)
  state = step.init(params)
  batch = step.shard_batch((np.ones((8, 256), np.float32), np.zeros(8, np.int32)))
  for _ in range(3):
    state, m = step(state, batch); jax.block_until_ready(state)
  steps[name] = (step, state, batch)
times = {k: [] for k in steps}
for r in range(5):
  for k, (step, state, batch) in steps.items():
    t = time.perf_counter()
    for _ in range(10):
      state, m = step(state, batch); jax.block_until_ready(state)
    times[k].append((time.perf_counter() - t) / 10)
    steps[k] = (step, state, batch)
if pid == 0:
  med = {k: float(np.median(v)) for k, v in times.items()}
  print(json.dumps({"processes": n, "params": int(nparams), "leaves": len(jax.tree.leaves(params)),
                    "median_step_s": med, "bucketed_over_per_leaf": med["bucketed_25MiB"] / med["per_leaf"]}))
