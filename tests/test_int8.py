"""INT8 products: ``"mixed_int8"`` under autocast and the train step, int8_dot_general / conv."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jmp_train
from jmp_train._src.int8 import products as int8_products
import jmp_train.int8
from helpers.int8 import ConvNet

DN = (((1,), (0,)), ((), ()))


def _products(text: str) -> list[tuple[str, str, str]]:
  """``(lhs, rhs, result)`` element types of every dot_general / convolution of a StableHLO text."""
  sig = re.findall(
    r"stablehlo\.(?:dot_general|convolution)[^\n]*:\s*\((tensor<[^>]*>), (tensor<[^>]*>)\)\s*->\s*(tensor<[^>]*>)", text
  )
  return [tuple(re.search(r"(\w+)>$", t).group(1).split("x")[-1] for t in types) for types in sig]


def _mlp(p, x):
  h = jax.nn.relu(x @ p["w1"] + p["b1"])
  return h @ p["w2"] + p["b2"]


def _mlp_params(key, d=16, h=32, n=4):
  k1, k2 = jax.random.split(key)
  return {
    "w1": jax.random.normal(k1, (d, h)) / np.sqrt(d),
    "b1": jnp.zeros(h),
    "w2": jax.random.normal(k2, (h, n)) / np.sqrt(h),
    "b2": jnp.zeros(n),
  }


def _attention_block(p, x):
  """A small Transformer-like function: attention (two activation products) and an MLP."""
  q, k, v = (jnp.einsum("btd,dhk->bthk", x, p[n]) for n in ("wq", "wk", "wv"))
  s = jnp.einsum("bqhk,bthk->bhqt", q, k) / np.sqrt(q.shape[-1])
  a = jnp.einsum("bhqt,bthk->bqhk", jax.nn.softmax(s, axis=-1), v)
  x = x + jnp.einsum("bqhk,hkd->bqd", a, p["wo"])
  return x + jax.nn.gelu(x @ p["w1"]) @ p["w2"]


def _attention_params(key, d=16, h=2):
  ks = jax.random.split(key, 6)
  shapes = {
    "wq": (d, h, d // h),
    "wk": (d, h, d // h),
    "wv": (d, h, d // h),
    "wo": (h, d // h, d),
    "w1": (d, 2 * d),
    "w2": (2 * d, d),
  }
  return {n: jax.random.normal(k, s) / np.sqrt(s[0]) for k, (n, s) in zip(ks, shapes.items())}


@pytest.fixture(scope="module")
def conv_net():
  model = ConvNet()
  x = jax.random.normal(jax.random.key(1), (2, 8, 8, 3))
  params = model.init(jax.random.key(0), x)["params"]
  return (lambda p, x: model.apply({"params": p}, x)), params, x


def test_every_weight_product_of_an_mlp_is_s8_s8_s32():
  p, x = _mlp_params(jax.random.key(0)), jnp.ones((8, 16))
  products = _products(jax.jit(jmp_train.autocast(_mlp, "mixed_int8")).lower(p, x).as_text())
  assert products == [("i8", "i8", "i32")] * 2, products
  # The same model under mixed_bfloat16 has no int8 product (the check reads the HLO).
  plain = _products(jax.jit(jmp_train.autocast(_mlp, "mixed_bfloat16")).lower(p, x).as_text())
  assert plain == [("bf16", "bf16", "bf16")] * 2, plain


def test_every_weight_product_of_a_conv_net_is_s8_s8_s32(conv_net):
  apply, params, x = conv_net
  products = _products(jax.jit(jmp_train.autocast(apply, "mixed_int8")).lower(params, x).as_text())
  assert products == [("i8", "i8", "i32")] * 3, products


def test_transformer_weight_products_are_int8_attention_products_stay_in_compute_dtype():
  p, x = _attention_params(jax.random.key(0)), jax.random.normal(jax.random.key(1), (2, 5, 16))
  products = _products(jax.jit(jmp_train.autocast(_attention_block, "mixed_int8")).lower(p, x).as_text())
  assert products.count(("i8", "i8", "i32")) == 6, products
  assert sorted(set(products) - {("i8", "i8", "i32")}) == [("bf16", "bf16", "bf16")], products
  assert len(products) == 8, products  # the two activation products: scores and weighted sum
  out = jax.jit(jmp_train.autocast(_attention_block, "mixed_int8"))(p, x)
  ref = _attention_block(p, x)
  assert float(jnp.abs(out - ref).max() / jnp.abs(ref).max()) < 0.05


def _rel_err(a, b):
  return max(float(jnp.linalg.norm(a[k] - b[k]) / jnp.linalg.norm(b[k])) for k in b)


def _fake_quant(x, axis):
  """Symmetric int8 quantize-dequantize over ``axis``, straight-through gradient (the reference)."""
  scale = jnp.max(jnp.abs(x), axis=axis, keepdims=True) / 127
  return x + jax.lax.stop_gradient(jnp.clip(jnp.round(x / scale), -128, 127) * scale - x)


def _fake_quant_mlp(p, x):
  h = jax.nn.relu(_fake_quant(x, 1) @ _fake_quant(p["w1"], 0) + p["b1"])
  return _fake_quant(h, 1) @ _fake_quant(p["w2"], 0) + p["b2"]


def test_gradients_are_the_straight_through_estimators_and_near_the_float_ones():
  p, x = _mlp_params(jax.random.key(0)), jax.random.normal(jax.random.key(1), (32, 16))
  loss = lambda f: lambda p: (f(p, x) ** 2).mean()  # noqa: E731
  g = jax.jit(jax.grad(loss(jmp_train.autocast(_mlp, "p=f32,c=f32,o=f32,matmul=int8"))))(p)
  # Exactly the straight-through estimator of per-row / per-channel fake quantization...
  assert _rel_err(g, jax.grad(loss(_fake_quant_mlp))(p)) < 1e-4
  # ...and near the float gradient, but not equal to it.
  ref = jax.grad(loss(_mlp))(p)
  assert 1e-4 < _rel_err(g, ref) < 0.08


def test_conv_gradients_match_a_float_reference(conv_net):
  apply, params, x = conv_net
  t = jax.random.normal(jax.random.key(3), (2, 4))
  loss = lambda f: lambda p: (f(p, x) * t).sum()  # noqa: E731
  g = jax.jit(jax.grad(loss(jmp_train.autocast(apply, "p=f32,c=f32,o=f32,matmul=int8"))))(params)
  ref = jax.grad(loss(apply))(params)
  # Each leaf's gradient points where the float one does (quantization flips a few relu masks).
  pairs = zip(jax.tree.leaves(g), jax.tree.leaves(ref))
  cosines = [float(jnp.vdot(a, b) / jnp.linalg.norm(a) / jnp.linalg.norm(b)) for a, b in pairs]
  assert 0.97 < min(cosines) < 1 - 1e-6, cosines


def test_int8_dot_general_per_channel_scales_and_straight_through_estimator():
  x = jnp.array([[1.0, -2.0], [0.5, 0.25]])
  w = jnp.array([[1.0, 100.0], [1.0, 100.0]])
  # Per channel: the small column keeps its own scale (per tensor it would round to 0 or 1 codes).
  exact = jmp_train.int8.Int8Recipe(activation="per_tensor")
  y = jmp_train.int8.int8_dot_general(x, w, DN, recipe=exact)
  per_tensor = jmp_train.int8.int8_dot_general(x, w, DN, recipe=jmp_train.int8.Int8Recipe("per_tensor", "per_tensor"))
  # Column 0 (weights 1): exact codes per channel (x's codes are exact multiples of 2/127 here up to
  # rounding), but with one scale for both columns its weights are 0.79 (code 1 of step 100/127).
  assert float(jnp.abs(y[:, 0] - (x @ w)[:, 0]).max()) < 0.02
  assert float(jnp.abs(per_tensor[:, 0] - (x @ w)[:, 0]).max()) > 0.2
  # A given activation scale clips: 2.0 / 0.01 = 200 codes > 127, so that entry passes no gradient.
  g = jax.grad(lambda a: jmp_train.int8.int8_dot_general(a, w, DN, lhs_scale=0.01).sum())(x)
  assert float(g[0, 1]) == 0.0
  np.testing.assert_allclose(g[1], (w.sum(1)), rtol=1e-2)
  np.testing.assert_allclose(g[0, 0], w.sum(1)[0], rtol=1e-2)


def test_int8_conv_is_the_fake_quantized_conv_forward_and_backward():
  x, k = jax.random.normal(jax.random.key(6), (2, 8, 8, 4)), jax.random.normal(jax.random.key(7), (3, 3, 2, 6))
  kw = dict(dimension_numbers=("NHWC", "HWIO", "NHWC"), feature_group_count=2)
  f = lambda a, b: jmp_train.int8.int8_conv_general_dilated(a, b, (2, 2), "SAME", **kw)  # noqa: E731
  # One scale for the input, one per output feature (HWIO's last axis) for the kernel.
  ref = lambda a, b: jax.lax.conv_general_dilated(
    _fake_quant(a, (0, 1, 2, 3)), _fake_quant(b, (0, 1, 2)), (2, 2), "SAME", **kw
  )  # noqa: E731
  t = jax.random.normal(jax.random.key(8), (2, 4, 4, 6))
  grads = jax.jit(jax.grad(lambda a, b: (f(a, b) * t).sum(), (0, 1)))(x, k)
  want = jax.grad(lambda a, b: (ref(a, b) * t).sum(), (0, 1))(x, k)
  np.testing.assert_allclose(jax.jit(f)(x, k), ref(x, k), atol=1e-4)
  for g, w in zip(grads, want):
    np.testing.assert_allclose(g, w, atol=1e-4)


def test_int8_quantize_and_scale():
  assert jmp_train.int8.int8_quantize(jnp.array([2.5, 3.5, -300.0]), jnp.float32(1.0)).tolist() == [2, 4, -128]
  np.testing.assert_allclose(jmp_train.int8.int8_scale(jnp.float32(254.0)), 2.0)
  with pytest.raises(TypeError, match="floating"):
    jmp_train.int8.int8_quantize(jnp.arange(3), 1.0)
  with pytest.raises(TypeError, match="Int8Recipe"):
    jmp_train.int8.int8_dot_general(jnp.ones((2, 2)), jnp.ones((2, 2)), DN, recipe="int8")


def test_policy_spec_and_errors():
  p = jmp_train.get_policy("mixed_int8")
  assert p.int8 == jmp_train.int8.Int8Recipe() and p.fp8 is None and p.product_format is p.int8
  assert str(p) == "params=float32,compute=bfloat16,output=float32,matmul=int8"
  q = jmp_train.get_policy("p=f32,c=f16,o=f32,matmul=int8,int8_activation=per_tensor")
  assert q.int8.activation == "per_tensor" and jmp_train.get_policy(str(q)) == q
  with pytest.raises(ValueError, match="int8_weight.*matmul=int8"):
    jmp_train.get_policy("p=f32,c=f16,o=f32,matmul=fp8,int8_weight=per_tensor")
  with pytest.raises(ValueError, match="fp8_margin.*matmul=int8"):
    jmp_train.get_policy("p=f32,c=f16,o=f32,matmul=int8,fp8_margin=1")
  with pytest.raises(ValueError, match="per_row"):
    jmp_train.get_policy("p=f32,c=f16,o=f32,matmul=int8,int8_activation=per_batch")
  with pytest.raises(ValueError, match="not both"):
    jmp_train.Policy("float32", "bfloat16", "float32", fp8=jmp_train.Fp8Recipe(), int8=jmp_train.int8.Int8Recipe())


def test_loss_scaling_under_float16_compute():
  # float16 gradients of a tiny loss underflow; scaled by 2**14 they do not, and come back right.
  p, x = _mlp_params(jax.random.key(0)), jax.random.normal(jax.random.key(1), (32, 16))
  f = jmp_train.autocast(_mlp, "p=f32,c=f16,o=f32,matmul=int8")
  scale = 2.0**14
  loss = lambda p: 1e-6 * (f(p, x) ** 2).mean()  # noqa: E731
  unscaled = jax.jit(jax.grad(loss))(p)
  scaled = jax.tree.map(lambda g: g / scale, jax.jit(jax.grad(lambda p: scale * loss(p)))(p))
  ref = jax.grad(lambda p: 1e-6 * (_mlp(p, x) ** 2).mean())(p)
  assert _rel_err(scaled, ref) < 0.05
  assert _rel_err(unscaled, ref) > 0.1  # float16 gradient products lose it without the scale


def _task(n=256, d=16, classes=4):
  kx, kw = jax.random.split(jax.random.key(42))
  x = jax.random.normal(kx, (n, d))
  y = jnp.argmax(x @ jax.random.normal(kw, (d, classes)), -1)
  return x, y


def _train(policy, steps=40, loss_scale=None):
  x, y = _task()
  loss_fn = lambda logits, y: optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()  # noqa: E731
  step = jmp_train.make_train_step(
    lambda v, x: _mlp(v["params"], x),
    loss_fn,
    optax.adam(1e-2),
    policy=policy,
    model_policy="autocast",
    loss_scale=loss_scale,
  )
  state = step.init(_mlp_params(jax.random.key(0)))
  losses = []
  for i in range(steps):
    sl = slice((i % 4) * 64, (i % 4 + 1) * 64)
    state, metrics = step(state, (x[sl], y[sl]))
    losses.append(float(metrics["loss"]))
  return np.array(losses), step, state


def test_mixed_int8_training_tracks_mixed_bfloat16():
  int8, step, state = _train("mixed_int8")
  bf16, _, _ = _train("mixed_bfloat16")
  assert int8[-1] < 0.5 * int8[0]
  assert abs(int8[-5:].mean() - bf16[-5:].mean()) < 0.05 * bf16[-5:].mean() + 0.02, (int8[-5:], bf16[-5:])
  # The step's own lowered HLO multiplies int8 codes.
  x, y = _task()
  assert ("i8", "i8", "i32") in _products(step.lower(state, (x[:64], y[:64])).as_text())


# ---------------------------------------------------------------------------
# The opt-in int8 backward: stochastically rounded gradients, int8 codes.


def test_stochastic_rounding_is_unbiased_where_rounding_to_nearest_loses_the_value():
  x = jnp.full((20000,), 0.3)
  q = jmp_train.int8.int8_quantize(x, jnp.float32(1.0))
  sr = int8_products.stochastic_quantize(x, jnp.float32(1.0), jax.random.key(3))
  assert not np.any(np.asarray(q))  # nearest: every 0.3 step is lost
  assert sorted(set(np.asarray(sr).tolist())) == [0, 1] and abs(float(sr.astype(jnp.float32).mean()) - 0.3) < 0.02
  # The gradient's own bits seed the rounding: another gradient, other noise.
  g1, g2 = jnp.full((8, 8), 0.3), jnp.full((8, 8), 0.31)
  assert not np.array_equal(
    jax.random.key_data(int8_products._gradient_key(g1)), jax.random.key_data(int8_products._gradient_key(g2))
  )


@pytest.mark.parametrize("product", ["dot", "conv"])
def test_int8_backward_runs_every_gradient_product_on_int8_codes(product):
  recipe = jmp_train.int8.Int8Recipe(backward="int8")
  rng = np.random.default_rng(0)
  if product == "dot":
    x, w = jnp.asarray(rng.normal(size=(64, 32)), jnp.float32), jnp.asarray(rng.normal(size=(32, 16)) / 6, jnp.float32)
    f = lambda a, b, r: jmp_train.int8.int8_dot_general(a, b, DN, recipe=r)  # noqa: E731
    ref = lambda a, b: a @ b  # noqa: E731
  else:
    x, w = (
      jnp.asarray(rng.normal(size=(4, 8, 8, 8)), jnp.float32),
      jnp.asarray(rng.normal(size=(3, 3, 8, 8)) / 8, jnp.float32),
    )
    kw = dict(dimension_numbers=("NHWC", "HWIO", "NHWC"))
    f = lambda a, b, r: jmp_train.int8.int8_conv_general_dilated(a, b, (1, 1), "SAME", recipe=r, **kw)  # noqa: E731
    ref = lambda a, b: jax.lax.conv_general_dilated(a, b, (1, 1), "SAME", **kw)  # noqa: E731
  grad = jax.jit(jax.grad(lambda a, b, r: jnp.sum(jnp.sin(f(a, b, r))), (0, 1)), static_argnums=2)
  types = _products(grad.lower(x, w, recipe).as_text())
  assert len(types) == 3 and all(t == ("i8", "i8", "i32") for t in types), types
  # The float backward keeps float gradient products (the default).
  assert _products(grad.lower(x, w, jmp_train.int8.Int8Recipe()).as_text())[1][0] == "f32"
  want = jax.grad(lambda a, b: jnp.sum(jnp.sin(ref(a, b))), (0, 1))(x, w)
  assert _rel_err(dict(enumerate(grad(x, w, recipe))), dict(enumerate(want))) < 0.05


def test_mixed_int8_with_an_int8_backward_trains_and_its_step_multiplies_int8_codes_only():
  policy = jmp_train.get_policy("p=f32,c=bf16,o=f32,matmul=int8,int8_backward=int8")
  assert policy.int8.backward == "int8" and jmp_train.get_policy(str(policy)) == policy
  losses, step, state = _train(policy)
  bf16, _, _ = _train("mixed_bfloat16")
  assert losses[-1] < 0.5 * losses[0]
  assert abs(losses[-5:].mean() - bf16[-5:].mean()) < 0.1 * bf16[-5:].mean() + 0.02, (losses[-5:], bf16[-5:])
  x, y = _task()
  types = _products(step.lower(state, (x[:64], y[:64])).as_text())
  # Two forward products, both weight gradients and the hidden activation's: all on int8 codes.
  assert len(types) == 5 and all(t == ("i8", "i8", "i32") for t in types), types
  with pytest.raises(ValueError, match=r"backward must be one of \('float', 'int8'\)"):
    jmp_train.int8.Int8Recipe(backward="fp8")
