"""diloco: local steps, outer updates every H steps, exact or 1-bit, under pmap and make_train_step."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jmp_train
from jmp_train import DiLoCoState, diloco
from jmp_train.diagnostics import collective_ops
from jmp_train.diagnostics import conditional_branches

AXIS = "i"
K = 8


def _tree(rng, k=K):
  return {"w": rng.normal(size=(k, 16, 4)).astype(np.float32), "b": rng.normal(size=(k, 4)).astype(np.float32)}


def _replicated(tree, k=K):
  return jax.tree.map(lambda x: np.broadcast_to(x[:1], x.shape).copy(), tree)


@functools.lru_cache(maxsize=None)
def _pmapped(tx):
  init = jax.pmap(tx.init, axis_name=AXIS)

  def step(p, s, g):
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s

  return init, jax.pmap(step, axis_name=AXIS)


def test_sync_every_step_with_unit_outer_sgd_is_synchronous_sgd():
  rng = np.random.default_rng(0)
  params = _replicated(_tree(rng))
  tx = diloco(optax.sgd(0.1), optax.sgd(1.0), sync_every=1, axis_name=AXIS)
  init, step = _pmapped(tx)
  state = init(params)
  expected = jax.tree.map(lambda x: x[0], params)
  p = params
  for _ in range(3):
    g = _tree(rng)
    p, state = step(p, state, g)
    expected = jax.tree.map(lambda e, g: e - 0.1 * g.mean(0), expected, g)
  for name in expected:
    np.testing.assert_allclose(
      np.asarray(p[name]), np.broadcast_to(expected[name], p[name].shape), rtol=1e-5, atol=1e-6
    )
  assert int(state.count[0]) == 3


def test_default_outer_step_averages_the_replicas_weights():
  # Three local steps of SGD on each replica's own gradients, then the
  # default outer step: every replica takes the average of the replicas'
  # weights (DiLoCo's Nesterov outer step would overshoot it).
  rng = np.random.default_rng(1)
  params = _replicated(_tree(rng))
  init, step = _pmapped(diloco(optax.sgd(0.1), sync_every=3, axis_name=AXIS))
  p, state = params, init(params)
  total = jax.tree.map(np.zeros_like, params)
  for _ in range(3):
    g = _tree(rng)
    p, state = step(p, state, g)
    total = jax.tree.map(np.add, total, g)
  for name in p:
    average = params[name][0] - 0.1 * total[name].mean(0)
    np.testing.assert_allclose(np.asarray(p[name]), np.broadcast_to(average, p[name].shape), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("compression", [None, "sign"])
def test_replicas_move_apart_between_synchronisations_and_meet_at_them(compression):
  rng = np.random.default_rng(1)
  comp = jmp_train.sign_compression(AXIS) if compression else None
  tx = diloco(optax.adam(1e-2), sync_every=3, axis_name=AXIS, compression=comp)
  init, step = _pmapped(tx)
  p = _replicated(_tree(rng))
  state = init(p)
  for t in range(1, 7):
    p, state = step(p, state, _tree(rng))
    spread = max(float(np.abs(np.asarray(x) - np.asarray(x)[:1]).max()) for x in jax.tree.leaves(p))
    anchor_spread = max(float(np.abs(np.asarray(x) - np.asarray(x)[:1]).max()) for x in jax.tree.leaves(state.anchor))
    assert anchor_spread == 0.0  # the shared weights are the same everywhere, always
    if t % 3:
      assert spread > 1e-4, t  # local steps: each replica its own way
    else:
      assert spread < 1e-6, t  # synchronised (up to params + (anchor - params))
      np.testing.assert_allclose(np.asarray(p["w"][0]), np.asarray(state.anchor["w"][0]), atol=1e-6)
  if compression:
    assert int(state.compression_state.count[0]) == 2  # the compressor ran at the 2 syncs only
    assert float(np.abs(np.asarray(state.compression_state.worker_residual[0])).max()) > 0


def test_only_the_synchronising_branch_communicates():
  rng = np.random.default_rng(2)
  for compression in (None, jmp_train.sign_compression(AXIS)):
    tx = diloco(optax.adamw(1e-3), sync_every=16, axis_name=AXIS, compression=compression)
    init, step = _pmapped(tx)
    p = _replicated(_tree(rng))
    state = init(p)
    text = step.lower(p, state, p).compile().as_text()
    ops = collective_ops(text)
    branches = conditional_branches(text)
    assert ops, "the synchronisation communicates"
    outside = [op for op in ops if op.computation not in branches]
    assert not outside, outside  # local steps run no collective


@pytest.mark.parametrize("compression", [None, "sign"])
def test_outer_updates_exact_or_1_bit_train_a_regression(compression):
  rng = np.random.default_rng(3)
  w_true = rng.normal(size=(16, 4)).astype(np.float32)
  comp = jmp_train.sign_compression(AXIS) if compression else None
  tx = diloco(
    optax.adam(3e-2), optax.sgd(0.7, momentum=0.5, nesterov=True), sync_every=4, axis_name=AXIS, compression=comp
  )

  def loss(p, x):
    return jnp.mean((x @ p["w"] + p["b"] - x @ w_true) ** 2)

  def step(p, s, x):
    g = jax.grad(loss)(p, x)
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s, jax.lax.pmean(loss(p, x), AXIS)

  init = jax.pmap(tx.init, axis_name=AXIS)
  run = jax.pmap(step, axis_name=AXIS)
  p = {"w": np.zeros((K, 16, 4), np.float32), "b": np.zeros((K, 4), np.float32)}
  state = init(p)
  losses = []
  for _ in range(96):
    p, state, value = run(p, state, rng.normal(size=(K, 32, 16)).astype(np.float32))
    losses.append(float(value[0]))
  # 24 synchronisations take the loss below 5% of its start, 1-bit too
  # (its error feedback carries what the signs drop into the next one).
  assert losses[-1] < 0.05 * losses[0], np.round(losses[::8], 3)


def _train_step(compression, loss_scale=None):
  tx = diloco(optax.adam(1e-2), sync_every=4, axis_name="batch", compression=compression)

  def apply_fn(variables, x):
    return x @ variables["params"]["w"] + variables["params"]["b"]

  return jmp_train.make_train_step(
    apply_fn, lambda out, y: jnp.mean((out - y) ** 2), None, mode="shard_map", compression=tx, loss_scale=loss_scale
  )


def _batches(n, seed=4):
  rng = np.random.default_rng(seed)
  for _ in range(n):
    x = rng.normal(size=(2 * K, 16)).astype(np.float32)
    yield x, (x @ np.ones((16, 4), np.float32)).astype(np.float32)


def _diloco_state(state):
  found = [
    s
    for s in jax.tree.leaves(state.opt_state, is_leaf=lambda s: isinstance(s, DiLoCoState))
    if isinstance(s, DiLoCoState)
  ]
  assert len(found) == 1
  return found[0]


def _init_params():
  return {"w": jnp.zeros((16, 4)), "b": jnp.zeros((4,))}


@pytest.mark.parametrize("compression", [None, "sign"])
def test_make_train_step_resumes_bit_for_bit(tmp_path, compression):
  comp = (lambda: jmp_train.sign_compression("batch")) if compression else (lambda: None)
  step = _train_step(comp())
  batches = list(_batches(7))
  state = step.init(_init_params())
  for i, batch in enumerate(batches):
    state, _ = step(state, step.shard_batch(batch))
    if i == 2:  # between synchronisations: the replicas' weights differ
      jmp_train.save_checkpoint(tmp_path / "ckpt", state)
  restored = jmp_train.restore_checkpoint(tmp_path / "ckpt", step.init(_init_params()))
  for batch in batches[3:]:
    restored, _ = step(restored, step.shard_batch(batch))
  for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(restored)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert int(np.asarray(_diloco_state(state).count).max()) == 7


def test_a_skipped_step_leaves_every_state_bit_for_bit():
  step = _train_step(jmp_train.sign_compression("batch"), loss_scale=jmp_train.DynamicLossScale(2.0**15))
  state = step.init(_init_params())
  batches = list(_batches(3))
  for batch in batches[:2]:
    state, _ = step(state, step.shard_batch(batch))
  before = jax.tree.map(np.asarray, state)
  x, y = batches[2]
  x = x.copy()
  x[0, 0] = np.inf
  state, metrics = step(state, step.shard_batch((x, y)))
  assert int(metrics["skipped_steps"]) == 1
  after = jax.tree.map(np.asarray, state)
  # The loss scale changes (it halves); the parameters and everything DiLoCo
  # holds (counter, shared weights, inner and outer state, residuals) do not.
  for a, b in zip(jax.tree.leaves(_diloco_state(before)), jax.tree.leaves(_diloco_state(after))):
    np.testing.assert_array_equal(a, b)
  for a, b in zip(jax.tree.leaves(before.params), jax.tree.leaves(after.params)):
    np.testing.assert_array_equal(a, b)


def test_bad_arguments_are_named():
  with pytest.raises(ValueError, match="sync_every must be a positive int"):
    diloco(optax.sgd(0.1), sync_every=0, axis_name=AXIS)
  with pytest.raises(TypeError, match="inner must be an optax.GradientTransformation"):
    diloco("adam", axis_name=AXIS)
  with pytest.raises(TypeError, match="compression must be None"):
    diloco(optax.sgd(0.1), axis_name=AXIS, compression=optax.sgd(0.1))
  with pytest.raises(TypeError, match="averages replicas itself"):
    diloco(jmp_train.one_bit_adam(1e-3, axis_name=AXIS, warmup_steps=1), axis_name=AXIS)
  with pytest.raises(ValueError, match="axis_name must be"):
    diloco(optax.sgd(0.1), axis_name=None)
  tx = diloco(optax.sgd(0.1), axis_name=AXIS)
  params = {"w": jnp.zeros(3)}
  with pytest.raises(ValueError, match=rf"diloco\(axis_name='{AXIS}'\)\.update found no mapped axis"):
    tx.update(params, tx.init(params), params)  # no mapped axis here


def test_init_returns_fresh_buffers():
  params = {"w": jnp.ones(3)}
  state = diloco(optax.sgd(0.1), axis_name=AXIS).init(params)
  assert state.anchor["w"] is not params["w"]
  assert state.anchor["w"].unsafe_buffer_pointer() != params["w"].unsafe_buffer_pointer()


def _mean_over(axis_name):
  """The exact ``pmean`` of the updates over ``axis_name``: a synchronous group's step."""
  return optax.GradientTransformation(
    lambda _: optax.EmptyState(), lambda u, s, p=None: (jax.lax.pmean(u, axis_name), s)
  )


def _check_islands(tx, mesh, ref_tx, h):
  """``tx`` on ``mesh`` (axes: islands, devices per island) is ``ref_tx`` under pmap fed each island's mean gradient.

  Checked step by step over two synchronisations: an island's devices agree
  bit for bit every step, the islands differ between synchronisations and
  meet at them.
  """
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  islands, size = mesh.devices.shape
  spec = P(*mesh.axis_names)
  put = lambda t: jax.device_put(t, NamedSharding(mesh, spec))
  one = lambda t: jax.tree.map(lambda x: x[0, 0], t)
  two = lambda t: jax.tree.map(lambda x: x[None, None], t)

  def step(p, s, g):
    p, s, g = one(p), one(s), one(g)
    u, s = tx.update(g, s, p)
    return two(optax.apply_updates(p, u)), two(s)

  init = jax.jit(jax.shard_map(lambda p: two(tx.init(one(p))), mesh=mesh, in_specs=spec, out_specs=spec))
  run = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(spec, spec, spec), out_specs=(spec, spec)))
  ref_init, ref_step = _pmapped(ref_tx)

  rng = np.random.default_rng(3)
  start = jax.tree.map(lambda x: x[0], _tree(rng, 1))
  p = put(jax.tree.map(lambda x: np.broadcast_to(x, (islands, size) + x.shape).copy(), start))
  ref_p = jax.tree.map(lambda x: np.broadcast_to(x, (islands,) + x.shape).copy(), start)
  state, ref_state = init(p), ref_init(ref_p)
  for t in range(1, 2 * h + 1):
    grads = jax.tree.map(lambda x: x.reshape((islands, size) + x.shape[1:]), _tree(rng, islands * size))
    p, state = run(p, state, put(grads))
    ref_p, ref_state = ref_step(ref_p, ref_state, jax.tree.map(lambda g: g.mean(1), grads))
    for name in p:
      got = np.asarray(p[name])
      assert (got == got[:, :1]).all(), (t, name)  # an island's devices agree bit for bit, every step
      np.testing.assert_allclose(got[:, 0], np.asarray(ref_p[name]), rtol=1e-5, atol=1e-6)
      apart = float(np.abs(got[0] - got[1]).max())
      assert (apart > 1e-4) if t % h else (apart < 1e-6), (t, name, apart)


@pytest.mark.parametrize("compression", [None, "sign"])
def test_islands_synchronous_inside_and_diloco_across_are_diloco_on_the_islands_means(compression):
  # 2 islands of 4 devices (say two clusters on a slow link): each island
  # averages its gradients every step (inner = pmean over "data", then
  # Adam), DiLoCo runs across "island" only. That is 2-replica DiLoCo fed
  # each island's mean gradient, computed under pmap as the reference.
  h = 3
  mesh = jax.make_mesh((2, 4), ("island", "data"), devices=jax.devices()[:8])
  comp = (lambda axis: jmp_train.sign_compression(axis)) if compression else (lambda axis: None)
  tx = diloco(
    optax.chain(_mean_over("data"), optax.adam(1e-2)), sync_every=h, axis_name="island", compression=comp("island")
  )
  _check_islands(tx, mesh, diloco(optax.adam(1e-2), sync_every=h, axis_name=AXIS, compression=comp(AXIS)), h)


def test_the_guides_across_clusters_recipe_is_diloco_on_the_clusters_means():
  # The compressed data parallelism guide's code for DiLoCo across clusters,
  # run as printed: its mesh and tx are what the islands test checks.
  import pathlib
  import re

  guide = pathlib.Path(__file__).parent.parent / "docs" / "guides" / "compressed_data_parallelism.md"
  blocks = re.findall(r"```python\n(.*?)```", guide.read_text(), re.S)
  (recipe,) = [b for b in blocks if '"cluster"' in b and "make_mesh" in b]
  names = {"jax": jax, "optax": optax, "jmp_train": jmp_train}
  exec(recipe, names)
  ref = diloco(optax.adamw(3e-3), sync_every=16, axis_name=AXIS, compression=jmp_train.sign_compression(AXIS))
  assert names["mesh"].axis_names == ("cluster", "data")
  _check_islands(names["tx"], names["mesh"], ref, 16)
