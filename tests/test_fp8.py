"""FP8 products: the scaling rules against NumPy, the products, Flax layers."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import Mesh, PartitionSpec as P

import jmp_train
import jmp_train.flax
from jmp_train._src.fp8 import products as fp8_lib
from jmp_train._src.fp8 import flax_layers as fp8_flax

E4M3, E5M2 = ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2
DN = (((1,), (0,)), ((), ()))


# --- NumPy reference of the scaling rules -----------------------------------


def np_scale(amax, previous, fmax, margin=0):
  if not np.isfinite(amax) or amax <= 0:
    return np.float32(previous)
  new = np.float32(fmax / 2.0**margin) / np.float32(amax)
  return np.float32(new) if np.isfinite(new) else np.float32(previous)


def np_calibrate(x, scale, history, fmax, recipe):
  amax = np.float32(np.max(np.abs(x)))
  if recipe.scaling == "current":
    s = np_scale(amax, scale, fmax, recipe.margin)
  else:
    past = history.max() if recipe.amax_compute_algo == "max" else history[0]
    s = np_scale(past, scale, fmax, recipe.margin)
  new_hist = np.concatenate([[amax], history[:-1]]) if np.isfinite(amax) else history
  return s, new_hist.astype(np.float32)


def np_qdq(x, s, fp8, fmax):
  q = np.clip(x.astype(np.float32) * s, -fmax, fmax).astype(fp8)
  return q.astype(np.float32) * np.float32(1.0 / s)


@pytest.mark.parametrize("amax", [0.0, 1e-30, 3.0, 448.0, 1e30, np.inf, np.nan])
@pytest.mark.parametrize("dtype, fmax", [(jnp.float8_e4m3fn, 448.0), (jnp.float8_e5m2, 57344.0)])
@pytest.mark.parametrize("margin", [0, 2])
def test_scale_matches_numpy(amax, dtype, fmax, margin):
  got = jmp_train.fp8_scale(jnp.float32(amax), jnp.float32(7.0), dtype, margin)
  want = np_scale(np.float32(amax), 7.0, fmax, margin)
  np.testing.assert_array_equal(np.asarray(got), want)
  assert np.isfinite(got)


def test_push_amax_never_stores_non_finite():
  h = jnp.array([3.0, 2.0, 1.0])
  for bad in (jnp.inf, -jnp.inf, jnp.nan):
    np.testing.assert_array_equal(fp8_lib.push_amax(h, jnp.float32(bad)), h)
  np.testing.assert_array_equal(fp8_lib.push_amax(h, jnp.float32(5.0)), [5.0, 3.0, 2.0])


@pytest.mark.parametrize("dtype, fmax", [(jnp.float8_e4m3fn, 448.0), (jnp.float8_e5m2, 57344.0)])
def test_quantize_saturates_and_matches_ml_dtypes(dtype, fmax):
  x = np.array([0.0, 1e-9, -0.3, 1.7, 500.0, -1e6, 60000.0], np.float32)
  got = np.asarray(jmp_train.fp8_quantize(jnp.asarray(x), dtype, jnp.float32(2.0)))
  fp8 = E4M3 if dtype == jnp.float8_e4m3fn else E5M2
  want = np.clip(x * 2.0, -fmax, fmax).astype(fp8)
  np.testing.assert_array_equal(got.astype(np.float32), want.astype(np.float32))
  assert np.all(np.isfinite(got.astype(np.float32)))


def test_recipe_rejects_bad_values():
  for kwargs in (
    {"scaling": "later"},
    {"amax_compute_algo": "mean"},
    {"amax_history_len": 0},
    {"margin": -1},
    {"amax_history_len": True},
  ):
    with pytest.raises(ValueError, match=next(iter(kwargs))):
      jmp_train.Fp8Recipe(**kwargs)


# --- the product ---------------------------------------------------------------


def _reference_steps(xs, w, gs, recipe):
  """Forward outputs, input gradients and meta of a few steps, in NumPy."""
  n = recipe.amax_history_len
  meta = {k: (np.float32(1.0), np.zeros(n, np.float32)) for k in ("l", "r", "g")}
  outs = []
  for x, g in zip(xs, gs):
    s_l, h_l = np_calibrate(x, *meta["l"], 448.0, recipe)
    s_r, h_r = np_calibrate(w, *meta["r"], 448.0, recipe)
    s_g, h_g = np_calibrate(g, *meta["g"], 57344.0, recipe)
    x_hat, w_hat = np_qdq(x, s_l, E4M3, 448.0), np_qdq(w, s_r, E4M3, 448.0)
    g_hat = np_qdq(g, s_g, E5M2, 57344.0)
    outs.append((x_hat @ w_hat, g_hat @ w_hat.T, x_hat.T @ g_hat))
    meta = {"l": (s_l, h_l), "r": (s_r, h_r), "g": (s_g, h_g)}
  return outs, meta


@pytest.mark.parametrize(
  "recipe",
  [
    jmp_train.Fp8Recipe(amax_history_len=3),
    jmp_train.Fp8Recipe(amax_history_len=3, amax_compute_algo="most_recent", margin=1),
    jmp_train.Fp8Recipe(scaling="current", amax_history_len=2),
  ],
  ids=["delayed-max", "delayed-recent-margin", "current"],
)
def test_product_and_gradients_match_numpy_over_steps(recipe):
  rng = np.random.default_rng(0)
  xs = [rng.normal(size=(4, 16)).astype(np.float32) * 10.0**k for k in (0, 2, -3, 1)]
  w = rng.normal(size=(16, 8)).astype(np.float32) * 0.1
  gs = [rng.normal(size=(4, 8)).astype(np.float32) * 10.0**k for k in (-6, 0, -2, 3)]
  want, want_meta = _reference_steps(xs, w, gs, recipe)

  @jax.jit
  def step(x, w, g, meta):
    out, pullback = jax.vjp(lambda x, w, m: jmp_train.fp8_dot_general(x, w, DN, meta=m, recipe=recipe), x, w, meta)
    return (out,) + pullback(g)

  meta = jmp_train.init_fp8_meta(recipe)
  for (x, g), (y_ref, dx_ref, dw_ref) in zip(zip(xs, gs), want):
    y, dx, dw, meta = step(x, w, g, meta)
    np.testing.assert_allclose(y, y_ref, rtol=1e-6, atol=1e-6 * np.abs(y_ref).max())
    np.testing.assert_allclose(dx, dx_ref, rtol=1e-6, atol=1e-6 * np.abs(dx_ref).max())
    np.testing.assert_allclose(dw, dw_ref, rtol=1e-6, atol=1e-6 * np.abs(dw_ref).max())
  for got, key in zip(meta, ("l", "r", "g")):
    np.testing.assert_array_equal(got.scale, want_meta[key][0])
    np.testing.assert_array_equal(got.amax_history, want_meta[key][1])


def test_product_output_dtype_and_float32_accumulation():
  x = jnp.full((2, 4096), 1.0, jnp.bfloat16)
  w = jnp.full((4096, 16), 1.0, jnp.bfloat16)
  meta = jmp_train.init_fp8_meta(jmp_train.Fp8Recipe(scaling="current"))
  y = jax.jit(
    lambda x, w: jmp_train.fp8_dot_general(x, w, DN, meta=meta, recipe=jmp_train.Fp8Recipe(scaling="current"))
  )(x, w)
  # 4096 is exact in float32 accumulation; a bfloat16 accumulator stops at 256.
  assert y.dtype == jnp.bfloat16 and float(y[0, 0]) == 4096.0
  jaxpr = str(jax.make_jaxpr(lambda x, w: jmp_train.fp8_dot_general(x, w, DN, meta=meta))(x, w))
  assert "f8_e4m3fn" in jaxpr and "preferred_element_type=float32" in jaxpr


def test_non_finite_gradient_leaves_meta_finite():
  meta = jmp_train.init_fp8_meta(jmp_train.Fp8Recipe(amax_history_len=2))
  x, w = jnp.ones((2, 8)), jnp.ones((8, 4))

  @jax.jit
  def meta_grad(meta, g):
    _, pullback = jax.vjp(lambda m: jmp_train.fp8_dot_general(x, w, DN, meta=m), meta)
    return pullback(g)[0]

  new = meta_grad(meta, jnp.full((2, 4), jnp.inf))
  assert all(bool(jnp.all(jnp.isfinite(leaf))) for leaf in jax.tree.leaves(new))
  np.testing.assert_array_equal(new.grad.amax_history, meta.grad.amax_history)


def test_conv_matches_dequantized_reference():
  recipe = jmp_train.Fp8Recipe(scaling="current")
  rng = np.random.default_rng(1)
  x = rng.normal(size=(2, 6, 6, 16)).astype(np.float32)
  k = rng.normal(size=(3, 3, 16, 16)).astype(np.float32)
  conv = functools.partial(
    jax.lax.conv_general_dilated, window_strides=(1, 1), padding="SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
  )
  y = jax.jit(
    lambda x, k: jmp_train.fp8_conv_general_dilated(
      x,
      k,
      (1, 1),
      "SAME",
      dimension_numbers=("NHWC", "HWIO", "NHWC"),
      meta=jmp_train.init_fp8_meta(recipe),
      recipe=recipe,
    )
  )(x, k)
  s_x, s_k = 448.0 / np.abs(x).max(), 448.0 / np.abs(k).max()
  want = jax.jit(conv)(np_qdq(x, np.float32(s_x), E4M3, 448.0), np_qdq(k, np.float32(s_k), E4M3, 448.0))
  np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("strides, groups", [((1, 1), 1), ((2, 2), 2)])
def test_conv_gradients_on_fp8_operands_match_dequantized_reference(strides, groups):
  # The backward convolutions take the E5M2 gradient and the E4M3 operand
  # split exactly into two E5M2 parts: the same value as the convolution of
  # the dequantized operands, up to float32 summation order.
  recipe = jmp_train.Fp8Recipe(scaling="current")
  rng = np.random.default_rng(2)
  x = rng.normal(size=(2, 6, 6, 16)).astype(np.float32)
  k = rng.normal(size=(3, 3, 16 // groups, 16)).astype(np.float32) * 0.1
  kw = dict(
    window_strides=strides, padding="SAME", feature_group_count=groups, dimension_numbers=("NHWC", "HWIO", "NHWC")
  )
  fp8_conv = lambda x, k: jmp_train.fp8_conv_general_dilated(  # noqa: E731
    x, k, meta=jmp_train.init_fp8_meta(recipe), recipe=recipe, **kw
  )
  g = rng.normal(size=jax.eval_shape(fp8_conv, x, k).shape).astype(np.float32) * 1e-3
  s = [np.float32(fmax / np.abs(a).max()) for a, fmax in ((x, 448.0), (k, 448.0), (g, 57344.0))]
  hats = [
    np_qdq(a, sa, fp8, fmax)
    for a, sa, fp8, fmax in ((x, s[0], E4M3, 448.0), (k, s[1], E4M3, 448.0), (g, s[2], E5M2, 57344.0))
  ]
  conv = lambda a, b: jax.lax.conv_general_dilated(  # noqa: E731
    a, b, precision=jax.lax.Precision.HIGHEST, **kw
  )

  @functools.partial(jax.jit, static_argnums=0)
  def value_and_pullback(f, a, b, g):
    y, pullback = jax.vjp(f, a, b)
    return (y, *pullback(g))

  got_all = value_and_pullback(fp8_conv, x, k, jnp.asarray(g))
  want_all = value_and_pullback(conv, *hats)
  for got, want in zip(got_all, want_all):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6 * np.abs(want).max())


def test_bad_meta_and_operands_raise():
  with pytest.raises(TypeError, match="Fp8DotMeta"):
    jmp_train.fp8_dot_general(jnp.ones((2, 2)), jnp.ones((2, 2)), DN, meta={})
  with pytest.raises(TypeError, match="floating"):
    jmp_train.fp8_dot_general(jnp.ones((2, 2), jnp.int32), jnp.ones((2, 2)), DN, meta=jmp_train.init_fp8_meta())


# --- policies and Flax layers ----------------------------------------------------


def test_policy_specs_round_trip():
  p = jmp_train.get_policy("mixed_float8")
  assert (p.param_dtype, p.compute_dtype, p.output_dtype) == (jnp.float32, jnp.bfloat16, jnp.float32)
  assert p.fp8 == jmp_train.Fp8Recipe()
  q = jmp_train.get_policy("p=f32,c=bf16,o=f32,matmul=fp8_current,fp8_history=8,fp8_margin=1,fp8_amax=most_recent")
  assert q.fp8 == jmp_train.Fp8Recipe("current", 8, 1, "most_recent")
  assert jmp_train.get_policy(str(q)) == q and hash(q) == hash(jmp_train.get_policy(str(q)))
  with pytest.raises(ValueError, match="fp8_current, fp8_delayed, int8"):
    jmp_train.get_policy("p=f32,c=bf16,o=f32,matmul=int4")
  with pytest.raises(ValueError, match="mixed_float8"):
    jmp_train.get_policy("mixed_float4")


class _Mlp(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = nn.relu(nn.Dense(32)(x))
    return nn.Dense(16)(x)


def _linen_fp8(recipe):
  fields = lambda: dict(fp8_flax.linen_fp8_fields({"dot_general_cls"}, recipe))  # noqa: E731
  return nn.Sequential([nn.Dense(32, **fields()), nn.relu, nn.Dense(16, **fields())])


def test_linen_layers_keep_meta_out_of_params_and_update_it():
  recipe = jmp_train.Fp8Recipe(amax_history_len=4)
  model = _linen_fp8(recipe)
  x = jnp.linspace(-3.0, 3.0, 4 * 16).reshape(4, 16)
  variables = jax.jit(model.init)(jax.random.key(0), x)
  assert set(variables) == {"params", jmp_train.flax.FP8_COLLECTION}
  assert isinstance(model.layers[0].dot_general_cls(), jmp_train.flax.Fp8DotGeneral)
  assert not any("amax" in "/".join(map(str, p)) for p, _ in jax.tree_util.tree_leaves_with_path(variables["params"]))

  def loss(params, meta):
    return model.apply({"params": params, jmp_train.flax.FP8_COLLECTION: meta}, x).sum()

  @jax.jit
  def grads_and_new_meta(params, meta):
    g_params, g_meta = jax.grad(loss, argnums=(0, 1))(params, meta)
    return g_params, jmp_train.update_fp8_meta(meta, g_meta)

  g_params, new = grads_and_new_meta(variables["params"], variables["fp8_meta"])
  first = new["layers_0"]["Fp8DotGeneral_0"]
  assert float(first["input_amax_history"][0]) == 3.0
  assert float(first["output_grad_amax_history"][0]) > 0
  chex_dtypes = jax.tree.map(lambda a: a.dtype, new) == jax.tree.map(lambda a: a.dtype, variables["fp8_meta"])
  assert chex_dtypes
  assert jax.tree.structure(g_params) == jax.tree.structure(variables["params"])


def test_nnx_optimizer_leaves_fp8_meta_alone():
  recipe = jmp_train.Fp8Recipe(amax_history_len=4)
  model = nnx.Linear(16, 8, rngs=nnx.Rngs(0), dot_general=jmp_train.flax.NNXFp8DotGeneral(recipe))
  opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
  x = jnp.full((4, 16), 2.0)

  @nnx.jit
  def step(model, opt):
    diff = nnx.DiffState(0, nnx.Any(nnx.Param, jmp_train.flax.Fp8Meta))
    grads = nnx.grad(lambda m: m(x).sum(), argnums=diff)(model)
    opt.update(model, nnx.state(grads, nnx.Param))
    meta = nnx.state(model, jmp_train.flax.Fp8Meta)
    nnx.update(model, jmp_train.update_fp8_meta(meta, nnx.state(grads, jmp_train.flax.Fp8Meta)))

  before = nnx.state(model, nnx.Param)
  before = jax.tree.map(jnp.copy, before)
  step(model, opt)
  hist = model.dot_general.input_amax_history[...]
  assert float(hist[0]) == 2.0 and float(hist[1]) == 0.0
  after = nnx.state(model, nnx.Param)
  assert not np.array_equal(after["kernel"][...], before["kernel"][...])


@pytest.mark.parametrize("mode", ["pmap", "shard_map"])
def test_replicas_agree_on_meta(mode):
  # Two replicas show the max over replicas as well as eight would.
  num_devices = 2
  devices = jax.devices()[:num_devices]
  recipe = jmp_train.Fp8Recipe(amax_history_len=2)
  meta = jmp_train.init_fp8_meta(recipe)
  w = jnp.ones((8, 4))
  xs = jnp.arange(1.0, num_devices + 1.0)[:, None, None] * jnp.ones((num_devices, 2, 8))

  def local(x, meta):
    g = jax.grad(lambda m: jmp_train.fp8_dot_general(x, w, DN, meta=m, recipe=recipe).sum())(meta)
    return jmp_train.update_fp8_meta(meta, g, axis_name="d")

  if mode == "pmap":
    rep = jax.tree.map(lambda a: jnp.broadcast_to(a, (num_devices,) + a.shape), meta)
    out = jax.pmap(local, axis_name="d", devices=devices)(xs, rep)
    hist = np.asarray(out.lhs.amax_history)
    assert np.all(hist[:, 0] == num_devices)
  else:
    mesh = Mesh(np.array(devices), ("d",))
    f = jax.jit(jax.shard_map(lambda x, m: local(x[0], m), mesh=mesh, in_specs=(P("d"), P()), out_specs=P()))
    out = f(xs, meta)
    assert float(out.lhs.amax_history[0]) == num_devices


def test_meta_survives_orbax_bit_for_bit(tmp_path):
  ocp = pytest.importorskip("orbax.checkpoint")
  recipe = jmp_train.Fp8Recipe(amax_history_len=3)
  model = _linen_fp8(recipe)
  x = jnp.linspace(-1.0, 5.0, 64).reshape(4, 16)
  v = jax.jit(model.init)(jax.random.key(0), x)
  meta = jax.jit(
    lambda m: jmp_train.update_fp8_meta(m, jax.grad(lambda m: model.apply({**v, "fp8_meta": m}, x).sum())(m))
  )(v["fp8_meta"])
  with ocp.StandardCheckpointer() as ckpt:
    ckpt.save(tmp_path / "meta", meta)
    ckpt.wait_until_finished()
    back = ckpt.restore(tmp_path / "meta", jax.tree.map(jnp.zeros_like, meta))
  for a, b in zip(jax.tree.leaves(meta), jax.tree.leaves(back)):
    assert a.dtype == b.dtype
    np.testing.assert_array_equal(a, b)


# --- apply_policy with an FP8 policy -------------------------------------------


def _train_digits(policy, steps=60, seed=0):
  from jmp_train_examples import data as data_lib
  from jmp_train_examples import models

  ds = data_lib.load_digits(seed=0)
  model = jmp_train.flax.apply_policy(models.MLP(features=(64, 64)), policy)
  variables = jax.jit(model.init)(jax.random.key(seed), jnp.zeros((1, 64)))
  params = variables.pop("params")
  tx = optax.adam(3e-3)
  opt_state = tx.init(params)

  def loss_fn(params, meta, x, y):
    logits = model.apply({"params": params, **meta}, x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

  def step(carry, batch):
    params, meta, opt_state = carry
    g, g_meta = jax.grad(loss_fn, argnums=(0, 1))(params, meta, *batch)
    updates, opt_state = tx.update(g, opt_state, params)
    return (optax.apply_updates(params, updates), jmp_train.update_fp8_meta(meta, g_meta), opt_state), None

  @jax.jit
  def train_and_test(carry, xs, ys, x_test, y_test):  # one program: the steps, the test loss
    (params, meta, _), _ = jax.lax.scan(step, carry, (xs, ys))
    return loss_fn(params, meta, x_test, y_test), meta

  idx = np.stack([np.random.default_rng((seed, i)).integers(0, len(ds.x_train), 128) for i in range(steps)])
  loss, variables = train_and_test(
    (params, variables, opt_state), ds.x_train[idx], ds.y_train[idx], ds.x_test, ds.y_test
  )
  return float(loss), variables


@pytest.mark.slow
def test_digits_with_fp8_matches_bfloat16():
  # A short single-seed run: one seed moves the final loss by a few percent
  # (the 1% criterion over 3 seeds is the `fp8` benchmark's); FP8 must train
  # as bfloat16 does, with its state updated every step.
  bf16, _ = _train_digits("mixed_bfloat16")
  fp8, meta = _train_digits("mixed_float8")
  assert bf16 < 0.5 and fp8 < 1.05 * bf16, (fp8, bf16)
  hist = meta["fp8_meta"]["dense0"]["Fp8DotGeneral_0"]["output_grad_amax_history"]
  assert int(jnp.sum(hist > 0)) == 60


@pytest.mark.parametrize("kind", ["linen", "nnx"])
def test_apply_policy_fp8_on_resnet_and_float32_modules(kind):
  from jmp_train_examples import models

  x = jnp.ones((2, 8, 8, 1))
  if kind == "linen":
    model = jmp_train.flax.apply_policy(models.ResNet(num_classes=16), "mixed_float8", float32_paths=("head",))
    # One program: init, then apply on the initial variables.
    out = jax.jit(lambda key, x: model.apply(model.init(key, x), x, mutable=["batch_stats"])[0])(jax.random.key(0), x)
    metas = jax.eval_shape(model.init, jax.random.key(0), x)[jmp_train.flax.FP8_COLLECTION]
    paths = ["/".join(str(getattr(k, "key", k)) for k in p) for p, _ in jax.tree_util.tree_leaves_with_path(metas)]
    assert any("Fp8ConvGeneralDilated" in p for p in paths)
    assert not any(p.startswith("head") for p in paths)  # float32 path: no FP8
  else:
    model = jmp_train.flax.apply_policy(models.NNXResNet(num_classes=16, rngs=nnx.Rngs(0)), "mixed_float8")
    out = nnx.jit(lambda model, x: model(x))(model, x)
    assert isinstance(model.module.stem.conv_general_dilated, jmp_train.flax.NNXFp8ConvGeneralDilated)
    assert len(jax.tree.leaves(nnx.state(model, jmp_train.flax.Fp8Meta))) > 0
  assert out.dtype == jnp.float32 and out.shape == (2, 16)


def test_fp8_policy_changes_nothing_without_fp8():
  model = jmp_train.flax.apply_policy(_Mlp(), "mixed_bfloat16")
  assert set(jax.eval_shape(model.init, jax.random.key(0), jnp.ones((1, 16)))) == {"params"}


@pytest.mark.parametrize("mode", ["single", "shard_map"])
@pytest.mark.parametrize("kind", ["linen", "nnx"])
def test_make_train_step_updates_and_agrees_on_fp8_state(kind, mode):
  from jmp_train_examples import models

  if kind == "linen":
    model = jmp_train.flax.apply_policy(models.MLP(features=(32,), num_classes=16), "mixed_float8")
    variables = jax.jit(model.init)(jax.random.key(0), jnp.zeros((1, 64)))
    params = variables.pop("params")
    init_args = {"params": params, "model_state": variables}
  else:
    model = jmp_train.flax.apply_policy(
      models.NNXMLP(64, features=(32,), num_classes=16, rngs=nnx.Rngs(0)), "mixed_float8"
    )
    init_args = {}
  # Two replicas show agreement (the max over replicas) as well as eight would.
  mesh = Mesh(np.array(jax.devices()[:2]), ("batch",)) if mode == "shard_map" else None
  step = jmp_train.make_train_step(
    model if kind == "nnx" else model.apply,
    lambda logits, y: optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(),
    optax.adam(1e-3),
    policy="float32",
    mode=mode,
    mesh=mesh,
    loss_scale=jmp_train.DynamicLossScale(),
  )
  state = step.init(**init_args)
  x = jnp.linspace(-2.0, 2.0, 16 * 64).reshape(16, 64)
  y = jnp.arange(16) % 16
  for _ in range(2):
    state, metrics = step(state, step.shard_batch((x, y)))
    jax.block_until_ready(state)
  fp8_state, _ = jmp_train._src.fp8.flax_layers.split_fp8_state(state.model_state)
  leaves = {
    "/".join(str(getattr(k, "key", k)) for k in p).removesuffix("/.value"): np.asarray(v)
    for p, v in jax.tree_util.tree_leaves_with_path(fp8_state)
  }
  hist = [v for k, v in leaves.items() if k.endswith("input_amax_history")][0]
  grads = [v for k, v in leaves.items() if k.endswith("output_grad_amax_history")][0]
  if mode == "shard_map":  # one copy per replica: all equal (max over replicas)
    assert np.all(hist == hist[:1]) and np.all(grads == grads[:1])
    hist, grads = hist[0], grads[0]
  assert np.count_nonzero(hist) == 2 and np.count_nonzero(grads) == 2
  assert int(metrics["skipped_steps"]) == 0


# --- diagnostics ----------------------------------------------------------------


def test_tensor_core_report_holds_fp8_products_to_multiples_of_16():
  import jmp_train.diagnostics as diag

  meta = jmp_train.init_fp8_meta()

  def f(x, w):
    return jmp_train.fp8_dot_general(x, w, DN, meta=meta).astype(jnp.float32).sum()

  # K = 24 is a multiple of 8 (bfloat16's rule) but not of 16 (FP8's).
  report = diag.tensor_core_report(f, jnp.ones((32, 24), jnp.bfloat16), jnp.ones((24, 32), jnp.bfloat16))
  fp8 = [e for e in report.entries if e.fp8]
  assert fp8 and all(e.required_multiple == 16 for e in fp8)
  assert any("K" in e.misaligned for e in fp8)
  plain = diag.tensor_core_report(
    lambda x, w: (x @ w).astype(jnp.float32).sum(), jnp.ones((32, 24), jnp.bfloat16), jnp.ones((24, 32), jnp.bfloat16)
  )
  assert not plain.misaligned and not any(e.fp8 for e in plain.entries)
  assert "fp8 (" in str(report)


@pytest.mark.parametrize("dtype, fp8", [("e4m3", E4M3), ("e5m2", E5M2)])
def test_fp8_cast_fractions_match_numpy(dtype, fp8):
  import jmp_train.diagnostics as diag

  rng = np.random.default_rng(0)
  x = (rng.standard_normal(4096) * 10.0 ** rng.uniform(-12, 6, 4096)).astype(np.float32)
  x[:7] = 0.0
  scale = 3.0
  got = jax.jit(lambda tree: diag.fp8_cast_fractions(tree, dtype, scale))(
    {"a": jnp.asarray(x[:1000]), "b": jnp.asarray(x[1000:])}
  )
  info = ml_dtypes.finfo(fp8)
  v = x * np.float32(scale)
  nz = v != 0
  q = np.abs(np.clip(v, -float(info.max), float(info.max)).astype(fp8).astype(np.float32))
  want = [
    np.sum(nz & (np.abs(v) > float(info.max))),
    np.sum(nz & (q == 0)),
    np.sum(nz & (q > 0) & (q < float(info.smallest_normal))),
  ]
  np.testing.assert_allclose([float(g) for g in got], np.array(want) / nz.sum(), rtol=1e-6)
  assert isinstance(got, diag.Fp8CastFractions)
  assert all(0 < float(g) < 1 for g in got)
  with pytest.raises(ValueError, match="e4m3"):
    diag.fp8_cast_fractions(x, "float16")


def test_initial_meta_structure_and_dtypes():
  meta = jmp_train.init_fp8_meta(jmp_train.Fp8Recipe(amax_history_len=5))
  assert isinstance(meta, jmp_train.Fp8DotMeta)
  assert all(isinstance(t, jmp_train.Fp8TensorMeta) for t in meta)
  assert all(t.scale.dtype == jnp.float32 and t.amax_history.shape == (5,) for t in meta)
  q = jmp_train.fp8_quantize(jnp.array([3.0]), jnp.float8_e4m3fn, jnp.float32(2.0))
  assert float(jmp_train.fp8_dequantize(q, jnp.float32(2.0), jnp.float32)[0]) == 3.0


@pytest.mark.parametrize(
  "call, error, message",
  [
    (
      lambda: jmp_train.fp8_quantize(jnp.ones(2), jnp.float16, jnp.float32(1.0)),
      ValueError,
      r"Bad FP8 dtype .*float16.*'e4m3', 'e5m2'",
    ),
    (
      lambda: jmp_train.fp8_quantize(jnp.arange(2), "e4m3", jnp.float32(1.0)),
      TypeError,
      "fp8_quantize needs a floating array, got int32",
    ),
    (lambda: jmp_train.fp8_scale(jnp.float32(1.0), jnp.float32(1.0), "e9m9"), ValueError, "Bad FP8 dtype 'e9m9'"),
    (lambda: jmp_train.fp8_scale(jnp.float32(1.0), jnp.float32(1.0), 5), ValueError, "Bad FP8 dtype 5"),
    (
      lambda: jmp_train.fp8_dequantize(jnp.ones(2, jnp.float8_e4m3fn), jnp.float32(1.0), jnp.int32),
      ValueError,
      "fp8_dequantize needs a floating result dtype",
    ),
    (lambda: jmp_train.init_fp8_meta("delayed"), TypeError, "init_fp8_meta needs an Fp8Recipe.*got str"),
  ],
)
def test_bad_fp8_arguments_are_named(call, error, message):
  with pytest.raises(error, match=message):
    call()


def test_fp8_formats_by_name_equal_the_dtypes():
  x = jnp.array([0.3, -1000.0, 7.0])
  for name, dtype in (("e4m3", jnp.float8_e4m3fn), ("e5m2", jnp.float8_e5m2)):
    by_name = jmp_train.fp8_quantize(x, name, jnp.float32(2.0))
    assert by_name.dtype == dtype
    np.testing.assert_array_equal(
      np.asarray(by_name, np.float32), np.asarray(jmp_train.fp8_quantize(x, dtype, jnp.float32(2.0)), np.float32)
    )
    assert float(jmp_train.fp8_scale(jnp.float32(2.0), jnp.float32(1.0), name)) == float(jnp.finfo(dtype).max) / 2.0
