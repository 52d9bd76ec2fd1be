"""Tests for jmp_train._src.train: the train-step builder and checkpoints."""

from __future__ import annotations

import pathlib
import sys
import textwrap

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jmp_train
from jmp_train._src.compression.sign_compression import sign_compression
from jmp_train_examples.processes import run_processes

from helpers import processes
from helpers.train_net import batch as _batch
from helpers.train_net import cached as _cached
from helpers.train_net import init as _init
from helpers.train_net import make as _make
from helpers.train_net import xent as _xent

F16, BF16, F32 = np.dtype(jnp.float16), np.dtype(jnp.bfloat16), np.dtype(jnp.float32)
ROOT = pathlib.Path(__file__).resolve().parents[1]


def _run(step, state, steps, start=0):
  history = []
  for i in range(start, start + steps):
    state, metrics = step(state, step.shard_batch(_batch(i)))
    history.append(jax.device_get(metrics))
  return state, history


def _dtypes(tree):
  return jax.tree.map(lambda x: np.dtype(x.dtype), tree)


@pytest.mark.parametrize("policy", ["float32", "mixed_bfloat16", "mixed_float16"])
def test_single_step_metrics_dtypes_and_learning(policy):
  step = _cached("single", policy, "dynamic")
  assert isinstance(step, jmp_train.TrainStep)
  state = _init(step)
  assert isinstance(state, jmp_train.TrainState)
  before = jax.tree.map(np.asarray, state)
  state, history = _run(step, state, 6)
  metrics = history[-1]
  assert set(metrics) == {"loss", "loss_scale", "skipped_steps", "consecutive_skipped_steps", "grad_norm", "accuracy"}
  for name in ("loss", "loss_scale", "grad_norm", "accuracy"):
    assert metrics[name].shape == () and metrics[name].dtype == F32, name
  assert metrics["skipped_steps"].dtype == np.int32
  assert metrics["consecutive_skipped_steps"].dtype == np.int32
  # Dtypes of the whole state are stable: params stay float32 masters, the
  # batch statistics stay float32 even though the model computed in half.
  chex.assert_trees_all_equal_shapes_and_dtypes(before, jax.tree.map(np.asarray, state))
  assert int(state.step) == 6
  assert history[-1]["loss"] < history[0]["loss"]
  assert not np.array_equal(
    before.model_state["batch_stats"]["BatchNorm_0"]["mean"],
    np.asarray(state.model_state["batch_stats"]["BatchNorm_0"]["mean"]),
  )
  # A scale that changes value does not retrace the step.
  assert step._step._cache_size() == 1
  evaluation = step.evaluate(state, step.shard_batch(_batch(100)))
  assert set(evaluation) == {"loss", "accuracy"} and np.isfinite(evaluation["loss"])


def test_compute_dtype_reaches_the_model():
  seen = []

  def apply_fn(variables, x):
    seen.append((variables["params"]["w"].dtype, x.dtype))
    return x @ variables["params"]["w"]

  batch = (np.ones((4, 3), np.float32), np.zeros((4, 2), np.float32))
  loss_fn = lambda out, y: (assert_f32(out), jnp.mean((out - y) ** 2))[1]  # noqa: E731
  for policy, expected in [("mixed_float16", (F16, F16)), ("mixed_bfloat16", (BF16, BF16)), ("float32", (F32, F32))]:
    # The jmp way: the function receives cast parameters and inputs.
    step = jmp_train.make_train_step(apply_fn, loss_fn, optax.sgd(0.1), policy=policy, model_policy="inputs")
    state = step.init({"w": jnp.ones((3, 2))})
    state, _ = step(state, batch)
    assert seen[-1] == expected
    assert state.params["w"].dtype == F32
    # The default decides per operation: the function is traced as given
    # (float32 parameters), its product runs on compute-dtype operands.
    step = jmp_train.make_train_step(apply_fn, loss_fn, optax.sgd(0.1), policy=policy)
    state = step.init({"w": jnp.ones((3, 2))})
    products = [e for e in step.lower(state, batch).as_text().splitlines() if "stablehlo.dot_general" in e]
    short = {F16: "f16", BF16: "bf16", F32: "f32"}[expected[0]]
    assert any(f"tensor<4x3x{short}>, tensor<3x2x{short}>" in p for p in products), products
    assert all(short == "f32" or "xf32>" not in p.split("->")[0] for p in products), products


def assert_f32(x):
  # The policy casts outputs to output_dtype before the loss.
  assert x.dtype == F32, x.dtype
  return x


def test_overflow_skips_the_whole_update():
  step = _cached("single", "mixed_float16", "huge")
  state = _init(step)
  before = jax.tree.map(np.asarray, state)
  state, history = _run(step, state, 2)
  assert [int(h["skipped_steps"]) for h in history] == [1, 2]
  assert not np.isfinite(history[0]["grad_norm"])
  chex.assert_trees_all_equal(before.params, jax.tree.map(np.asarray, state.params))
  chex.assert_trees_all_equal(before.model_state, jax.tree.map(np.asarray, state.model_state))
  assert int(state.step) == 2  # the step counter indexes the data, skipped or not


def test_dynamic_scale_backs_off_then_trains():
  step = _make("single", "mixed_float16", loss_scale=jmp_train.DynamicLossScale(2.0**24, growth_interval=100))
  state = _init(step)
  state, history = _run(step, state, 14)
  scales = [float(h["loss_scale"]) for h in history]
  skipped = [int(h["skipped_steps"]) for h in history]
  assert scales[0] == 2.0**23 and skipped[0] == 1
  assert all(b <= a for a, b in zip(scales, scales[1:]))
  assert skipped[-1] == skipped[-2] and history[-1]["loss"] < history[0]["loss"]


@pytest.mark.parametrize("mode", ["pmap", "shard_map"])
def test_data_parallel_matches_single_device(mode):
  # No dropout rng and no batch statistics: then the mean of per-device mean
  # gradients equals the full-batch gradient.
  def apply_fn(variables, x):
    return nn.Dense(4).apply({"params": variables["params"]}, x)

  params = nn.Dense(4).init(jax.random.PRNGKey(0), jnp.ones((1, 6)))["params"]
  results = {}
  for m in ("single", mode):
    step = jmp_train.make_train_step(
      apply_fn, _xent, optax.sgd(0.1, momentum=0.9), policy="float32", mode=m, has_aux=True
    )
    state = step.init(params)
    state, history = _run(step, state, 3)
    results[m] = (step.unreplicate(state.params), history)
  chex.assert_trees_all_close(results["single"][0], results[mode][0], atol=1e-6)
  np.testing.assert_allclose(results["single"][1][-1]["loss"], results[mode][1][-1]["loss"], rtol=1e-6)


def test_compressed_step_learns_and_keeps_replicas_identical():
  step = _cached("shard_map", "mixed_float16", "dynamic", True)
  state, history = _run(step, _init(step), 5)
  assert history[-1]["loss"] < history[0]["loss"]
  # Every replica holds the same parameters after the all-gather, while the
  # error-feedback residuals differ per replica (they are local state).
  kernel = np.asarray(state.params["Dense_0"]["kernel"])
  assert kernel.shape[0] == 8
  np.testing.assert_array_equal(kernel, np.broadcast_to(kernel[0], kernel.shape))
  # Batch statistics are averaged over replicas too.
  for stat in jax.tree.leaves(state.model_state):
    stat = np.asarray(stat)
    np.testing.assert_array_equal(stat, np.broadcast_to(stat[0], stat.shape))
  residuals = [
    np.asarray(x)
    for x in jax.tree.leaves(state.opt_state)
    if np.ndim(x) > 1 and np.asarray(x).dtype == F32 and np.asarray(x).shape[0] == 8
  ]
  assert any(not np.array_equal(r[0], r[1]) for r in residuals)


@pytest.mark.parametrize("mode, compression", [("single", False), ("shard_map", True)])
def test_checkpoint_resume_is_bit_for_bit(tmp_path, mode, compression):
  step = _cached(mode, "mixed_float16", "dynamic", compression)
  straight, _ = _run(step, _init(step), 6)
  state, _ = _run(step, _init(step), 3)
  path = jmp_train.save_checkpoint(tmp_path / "ckpt", state)
  del state
  restored = jmp_train.restore_checkpoint(path, _init(step, rng=123))
  resumed, _ = _run(step, restored, 3, start=3)
  chex.assert_trees_all_equal(jax.tree.map(np.asarray, straight), jax.tree.map(np.asarray, resumed))
  # The loss scale's static configuration survives the round trip.
  scale = jmp_train.get_loss_scale(step.unreplicate(resumed.opt_state))
  assert scale.growth_interval == 3


def test_bad_arguments_name_the_bad_value():
  with pytest.raises(ValueError, match="'vmap'.*single, pmap, shard_map"):
    _make("vmap")
  with pytest.raises(ValueError, match="compression.*'pmap' or 'shard_map'"):
    _make("single", compression=sign_compression("batch"))
  mesh = jax.sharding.Mesh(np.asarray(jax.devices()), ("data",))
  with pytest.raises(ValueError, match="'batch' is not an axis of the mesh"):
    _make("shard_map", mesh=mesh)
  with pytest.raises(ValueError, match="Unknown policy spec"):
    _make("single", policy="mixed_float17")
  with pytest.raises(ValueError, match="bucket_bytes must be a positive int, got -1"):
    _make("single", bucket_bytes=-1)
  with pytest.raises(ValueError, match="axis_name must be a string, got 3"):
    _make("pmap", axis_name=3)
  with pytest.raises(ValueError, match="donate must be True or False, got 'no'"):
    _make("single", donate="no")
  # A bare string would be taken letter by letter.
  with pytest.raises(ValueError, match="rng_collections must be a sequence .*'dropout'"):
    _make("single", rng_collections="dropout")
  with pytest.raises(TypeError, match="remat_policy must be None or a jax.checkpoint policy"):
    _make("single", remat_policy="dots")
  step = _cached("shard_map", "float32")
  with pytest.raises(ValueError, match="12 examples.*8 local devices"):
    step.shard_batch(_batch(0, n=12))


_WORKER = textwrap.dedent("""
    import sys
    import jax
    pid, n, port, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    jax.config.update("jax_num_cpu_devices", 8 // n)
    if n > 1:
      jax.config.update("jax_cpu_collectives_implementation", "gloo")
      jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=n, process_id=pid)
    import numpy as np
    sys.path.insert(0, sys.argv[5])
    from helpers import train_net as t
    step = t.cached("shard_map", "mixed_float16", "dynamic", True)
    state = t.init(step)
    per = 16 // n
    for i in range(3):
      x, y = t.batch(i)
      state, metrics = step(state, step.shard_batch((x[pid * per:(pid + 1) * per],
                                                     y[pid * per:(pid + 1) * per])))
    kernel = np.asarray(step.unreplicate(state.params)["Dense_0"]["kernel"])
    np.save(f"{out}/kernel{pid}.npy", kernel)
    np.save(f"{out}/loss{pid}.npy", np.asarray(metrics["loss"]))
    # Every process writes its shards of one checkpoint; resume and go on.
    path = t.jmp_train.save_checkpoint(f"{out}/ckpt", state)
    state = t.jmp_train.restore_checkpoint(path, t.init(step, rng=7))
    x, y = t.batch(3)
    state, _ = step(state, step.shard_batch((x[pid * per:(pid + 1) * per],
                                             y[pid * per:(pid + 1) * per])))
    kernel = np.asarray(step.unreplicate(state.params)["Dense_0"]["kernel"])
    np.save(f"{out}/resumed{pid}.npy", kernel)
""")


def test_two_processes_match_one(tmp_path):
  """The same step over jax.distributed (2 processes x 4 devices, gloo),
  checkpointed by both processes and resumed."""
  script = tmp_path / "worker.py"
  script.write_text(_WORKER)
  env = processes.worker_env()
  env["JAX_PLATFORMS"] = "cpu"
  tests_dir = str(ROOT / "tests")
  port = processes.free_port()
  done = run_processes(
    [[sys.executable, str(script), str(i), "2", str(port), str(tmp_path), tests_dir] for i in range(2)],
    env,
    timeout=240,
  )
  assert all(code == 0 for code, _ in done), "\n".join(log for _, log in done)[-3000:]
  # The same run in this process, on its 8 devices.
  step = _cached("shard_map", "mixed_float16", "dynamic", True)
  state, history = _run(step, _init(step), 3)
  reference = np.asarray(step.unreplicate(state.params)["Dense_0"]["kernel"])
  state, _ = _run(step, state, 1, start=3)
  resumed = np.asarray(step.unreplicate(state.params)["Dense_0"]["kernel"])
  for pid in range(2):
    np.testing.assert_array_equal(np.load(tmp_path / f"resumed{pid}.npy"), resumed)
    np.testing.assert_array_equal(np.load(tmp_path / f"kernel{pid}.npy"), reference)
    # The loss is a pmean: its summation order may differ across processes.
    np.testing.assert_allclose(np.load(tmp_path / f"loss{pid}.npy"), history[-1]["loss"], rtol=1e-6)


def test_flax_nnx_model_through_the_documented_adapter():
  from flax import nnx

  model = nnx.Linear(6, 4, rngs=nnx.Rngs(0))
  graphdef, params = nnx.split(model, nnx.Param)
  step = jmp_train.make_train_step(
    lambda v, x: nnx.merge(graphdef, v["params"])(x), _xent, optax.sgd(0.5), policy="mixed_bfloat16", has_aux=True
  )
  state = step.init(params)
  state, history = _run(step, state, 4)
  assert history[-1]["loss"] < history[0]["loss"]
  assert {np.dtype(x.dtype) for x in jax.tree.leaves(state.params)} == {F32}
  nnx.update(model, state.params)  # the trained parameters go back into the module
  assert np.allclose(model.kernel[...], state.params["kernel"][...])
