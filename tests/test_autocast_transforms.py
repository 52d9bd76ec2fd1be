"""Tests for jmp_train.autocast: custom rules, control flow, composition, the lists, errors."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import jmp_train
import jmp_train.diagnostics as diag
import jmp_train.flax as jflax
from jmp_train._src.autocast.transform import autocast
from jmp_train._src.autocast.lists import DEFAULT_FLOAT32_OPS
from jmp_train._src.autocast.lists import DEFAULT_HALF_OPS
from jmp_train_examples import models

from helpers.autocast import (
  BF16,
  F16,
  F32,
  TOKENS,
  X_IMG,
  _dtypes_of,
  _eqns,
  _flax_variables,
  _rel_err,
  _xent,
)


# ---------------------------------------------------------------------------
# custom_jvp, custom_vjp, control flow, opaque calls.


@pytest.mark.parametrize(
  "act",
  [jax.nn.relu, jax.nn.gelu, jax.nn.silu, jax.nn.softplus, functools.partial(jax.nn.softmax, axis=-1)],
  ids=["relu", "gelu", "silu", "softplus", "softmax"],
)
def test_custom_jvp_activations(act):
  w = jax.random.normal(jax.random.key(0), (8, 8))
  x = jax.random.normal(jax.random.key(1), (4, 8))

  def f(w, x):
    return jnp.sum(act(x @ w) @ w)

  cast = autocast(f, "mixed_float16")

  # One program each (eager op-by-op would compile every op): reverse mode
  # and forward mode, autocast and float32 reference together.
  @jax.jit
  def run(w, x):
    jvp = lambda fn: jax.jvp(lambda x: fn(w, x), (x,), (jnp.ones_like(x),))[1]
    return (jax.value_and_grad(cast)(w, x), jax.value_and_grad(f)(w, x), jvp(cast), jvp(f))

  (value, grad), (v32, g32), tangent, t32 = run(w, x)
  assert grad.dtype == F32
  assert abs(float(value - v32)) < 1e-2 * (1 + abs(float(v32)))
  assert _rel_err(grad, g32) < 1e-2
  # Forward-mode too: the rule is consistent with the primal's dtypes.
  assert abs(float(tangent - t32)) < 2e-2 * (1 + abs(float(t32)))


def test_custom_vjp_rule_is_kept():
  @jax.custom_vjp
  def clip_grad(x):
    return x * 1.0

  clip_grad.defvjp(lambda x: (x, None), lambda _, g: (jnp.clip(g, -0.5, 0.5),))

  def f(w, x):
    return jnp.sum(clip_grad(x @ w) * 3.0)

  g = jax.jit(jax.grad(autocast(f, "mixed_bfloat16"), argnums=1))(jnp.eye(4), jnp.ones((2, 4)))
  # Without the rule the gradient would be 3; the clipped one is 0.5.
  np.testing.assert_allclose(g, 0.5)
  assert g.dtype == F32


def test_scan_counts_read_both_jax_spellings():
  # JAX <= 0.10 counts constants and carries; newer JAX passes a flat tree
  # of (constants, carries, xs) instead, and open jaxprs (no .consts).
  from jmp_train._src.autocast import calls as autocast_calls

  class FlatTree:  # what jax 0.11's scan equation holds in ``ft_in``
    def unpack(self):
      return iter([None, None]), iter([None]), iter([None, None, None])

  assert autocast_calls._scan_counts({"num_consts": 2, "num_carry": 1}) == (2, 1)
  assert autocast_calls._scan_counts({"ft_in": FlatTree()}) == (2, 1)
  jaxpr = jax.make_jaxpr(lambda x: x * 2)(1.0)
  assert autocast_calls._open(jaxpr) == (jaxpr.jaxpr, list(jaxpr.consts))
  assert autocast_calls._open(jaxpr.jaxpr) == (jaxpr.jaxpr, [])


def test_control_flow_and_nested_jit():
  @jax.jit
  def layer(w, h):
    return jnp.tanh(h @ w)

  def f(w, x):
    def body(h, _):
      return layer(w, h), jnp.exp(h).sum()

    h, sums = jax.lax.scan(body, x, None, length=3)
    h = jax.lax.cond(sums[0] > 0, lambda h: h @ w, lambda h: -h, h)
    h = jax.lax.while_loop(lambda c: c[0] < 2, lambda c: (c[0] + 1, c[1] @ w), (0, h))[1]
    h = jax.checkpoint(lambda h: jnp.sin(h @ w))(h)
    return jnp.sum(h) + sums.sum()

  w = jax.random.normal(jax.random.key(0), (8, 8)) / 3
  x = jax.random.normal(jax.random.key(1), (4, 8))
  cast = autocast(f, "mixed_float16")
  assert _dtypes_of(cast, w, x) == {F16}
  assert _dtypes_of(cast, w, x, names=("exp",)) == {F32}
  # Forward mode (reverse mode does not go through while_loop).
  jvp = jax.jit(lambda fn, w, x: jax.jvp(fn, (w, x), (jnp.ones_like(w), jnp.ones_like(x))), static_argnums=0)
  v, t = jvp(cast, w, x)
  v32, t32 = jvp(f, w, x)
  assert abs(float(v - v32)) < 2e-2 * abs(float(v32))
  assert abs(float(t - t32)) < 2e-2 * abs(float(t32))


def test_opaque_call_gets_its_traced_dtypes():
  seen = []

  def host(x):
    seen.append(x.dtype)
    return np.asarray(x) * 2

  def f(w, x):
    h = x @ w
    out = jax.pure_callback(host, jax.ShapeDtypeStruct(h.shape, h.dtype), h)
    return out @ w

  cast = autocast(f, "mixed_float16")
  out = cast(jnp.eye(4), jnp.ones((2, 4)))
  np.testing.assert_allclose(out, 2.0)
  assert seen and all(d == F32 for d in seen)  # the callback was written for float32
  assert _dtypes_of(cast, jnp.eye(4), jnp.ones((2, 4))) == {F16}


# ---------------------------------------------------------------------------
# Composition with JAX transformations and the library.


def _loss(w, x):
  return jnp.mean(jax.nn.log_softmax(jax.nn.relu(x @ w) @ w))


W = jax.random.normal(jax.random.key(0), (8, 8)) / 3
X = jax.random.normal(jax.random.key(1), (16, 8))


@functools.cache
def _loss32():
  """The float32 value and gradient of ``_loss`` at (W, X), compiled once."""
  return jax.jit(jax.value_and_grad(_loss))(W, X)


@pytest.mark.parametrize(
  "order", ["jit_outside", "jit_inside", "vmap_outside", "vmap_inside", "checkpoint_outside", "checkpoint_inside"]
)
def test_composes_with_transformations(order):
  cast = functools.partial(autocast, policy="mixed_bfloat16")
  saveable = jmp_train.half_precision_saveable
  fns = {
    "jit_outside": jax.jit(cast(_loss)),
    "jit_inside": cast(jax.jit(_loss)),
    "vmap_outside": lambda w, x: jax.vmap(cast(_loss), (None, 0))(w, x[:, None]).mean(),
    "vmap_inside": cast(lambda w, x: jax.vmap(_loss, (None, 0))(w, x[:, None]).mean()),
    "checkpoint_outside": jax.checkpoint(cast(_loss), policy=saveable),
    "checkpoint_inside": cast(jax.checkpoint(_loss, policy=saveable)),
  }
  fn = fns[order]
  # Under an outer jit: one compile instead of one per eager op (the
  # order of autocast and the transformation inside is unchanged).
  v, g = jax.jit(jax.value_and_grad(fn))(W, X)
  v32, g32 = _loss32()
  assert v.dtype == F32 and g.dtype == F32
  assert abs(float(v - v32)) < 2e-2 * abs(float(v32)) and _rel_err(g, g32) < 5e-2
  assert _dtypes_of(fn, W, X) == {BF16}


@pytest.mark.parametrize("inside", [False, True], ids=["shard_map_outside", "shard_map_inside"])
def test_composes_with_shard_map(inside):
  # Two devices: the composition does not depend on how many (fewer
  # replicas compile faster).
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("batch",))

  def per_shard(w, x):
    return jax.lax.pmean(_loss(w, x), "batch")

  smap = lambda f: jax.shard_map(f, mesh=mesh, in_specs=(P(), P("batch")), out_specs=P())
  fn = autocast(smap(per_shard), "mixed_bfloat16") if inside else smap(autocast(per_shard, "mixed_bfloat16"))
  v, g = jax.jit(jax.value_and_grad(fn))(W, X)
  jax.block_until_ready((v, g))
  v32, g32 = _loss32()
  assert abs(float(v - v32)) < 2e-2 * abs(float(v32)) and _rel_err(g, g32) < 5e-2
  assert _dtypes_of(jax.jit(fn), W, X) == {BF16}


def test_composes_with_pmap():
  # Two replicas: the composition does not depend on how many.
  replicas = 2
  fn = jax.pmap(jax.grad(autocast(_loss, "mixed_float16")), in_axes=(None, 0), devices=jax.devices()[:replicas])
  g = fn(W, X.reshape(replicas, -1, 8))
  jax.block_until_ready(g)
  assert g.dtype == F32 and g.shape == (replicas, 8, 8)
  g32 = jax.jit(jax.vmap(jax.grad(_loss), (None, 0)))(W, X.reshape(replicas, -1, 8))
  assert _rel_err(g, g32) < 2e-2


def test_with_make_train_step_and_loss_scaling():
  model = models.MLP(features=(32,))
  variables = jax.jit(model.init)(jax.random.key(0), X_IMG)
  step = jmp_train.make_train_step(
    autocast(model.apply, "mixed_float16"),
    _xent,
    optax.sgd(0.1),
    policy="mixed_float16",
    loss_scale=jmp_train.DynamicLossScale(2.0**15),
    cast_params=False,
  )
  state = step.init(variables["params"])
  labels = jnp.arange(8) % 10
  losses = []
  for _ in range(5):
    state, metrics = step(state, (X_IMG, labels))
    losses.append(float(metrics["loss"]))
  assert all(np.isfinite(losses)) and losses[-1] < losses[0]
  assert all(p.dtype == F32 for p in jax.tree.leaves(state.params))


# ---------------------------------------------------------------------------
# NNX and Equinox.


@functools.partial(jax.jit, static_argnums=(0, 1))
def _out_ref_and_grads(cast, apply, params, x, labels):
  """``cast``'s output and loss gradients and ``apply``'s output, in one program."""
  (_, out), grads = jax.value_and_grad(lambda p: (lambda o: (_xent(o, labels), o))(cast(p, x)), has_aux=True)(params)
  return out, apply(params, x), grads


def test_nnx_model_through_split_and_merge():
  # The NNX twin of the linen Transformer of _flax_cases(), built abstractly
  # and given its (NumPy-filled) variables: no initializer runs.
  abstract = nnx.eval_shape(
    lambda: models.NNXTransformerBlock(vocab_size=32, d_model=16, num_heads=2, mlp_dim=32, max_len=8, rngs=nnx.Rngs(0))
  )
  model = models.nnx_with_linen_variables(abstract, _flax_variables("transformer"))
  graphdef, params = nnx.split(model)

  def apply(params, tokens):
    return nnx.merge(graphdef, params)(tokens)

  cast = autocast(apply, "mixed_bfloat16")
  out, out32, grads = _out_ref_and_grads(cast, apply, params, TOKENS, TOKENS)
  assert out.dtype == F32
  assert _rel_err(out, out32) < 8 * float(jnp.finfo(BF16).eps)
  assert _dtypes_of(cast, params, TOKENS) == {BF16}
  diag.precision_audit(cast, params, TOKENS, backward=True).assert_clean()
  assert all(g.dtype == F32 for g in jax.tree.leaves(grads))


def test_equinox_model():
  eqx = pytest.importorskip("equinox")
  model = eqx.nn.MLP(64, 10, 32, depth=2, key=jax.random.key(0))
  params, static = eqx.partition(model, eqx.is_inexact_array)

  def apply(params, x):
    return jax.vmap(eqx.combine(params, static))(x)

  cast = autocast(apply, "mixed_float16")
  out, out32, grads = _out_ref_and_grads(cast, apply, params, X_IMG, jnp.arange(8))
  assert out.dtype == F32
  assert _rel_err(out, out32) < 8 * float(jnp.finfo(F16).eps)
  assert _dtypes_of(cast, params, X_IMG) == {F16}
  assert all(g.dtype == F32 for g in jax.tree.leaves(grads))


# ---------------------------------------------------------------------------
# The lists as data.


def test_public_names():
  if not hasattr(jmp_train, "autocast"):
    pytest.skip("jmp_train.autocast is not exported yet")
  assert jmp_train.autocast is autocast
  assert jmp_train.DEFAULT_FLOAT32_OPS == DEFAULT_FLOAT32_OPS
  assert jmp_train.DEFAULT_HALF_OPS == DEFAULT_HALF_OPS


def test_lists_are_extendable_and_overridable():
  def f(w, x):
    # No sum: an op feeding only a float32 sum would be pulled into float32.
    return jnp.tanh(x @ w), jnp.exp(x @ w)

  args = (jnp.ones((4, 4)), jnp.ones((2, 4)))
  default = autocast(f, "mixed_float16")
  assert _dtypes_of(default, *args, names=("tanh",)) == {F16}
  more = autocast(f, "mixed_float16", float32_ops=(*DEFAULT_FLOAT32_OPS, "tanh"))
  assert _dtypes_of(more, *args, names=("tanh",)) == {F32}
  fewer = autocast(f, "mixed_float16", float32_ops=tuple(o for o in DEFAULT_FLOAT32_OPS if o != "exp"))
  assert _dtypes_of(fewer, *args, names=("exp",)) == {F16}
  f32_matmul = autocast(f, "mixed_float16", half_ops=(), float32_ops=(*DEFAULT_FLOAT32_OPS, "dot_general"))
  assert _dtypes_of(f32_matmul, *args) == {F32}
  assert "dot_general" in DEFAULT_HALF_OPS


def test_scopes_by_named_scope_and_function_name():
  def f(w, x):
    with jax.named_scope("head"):
      y = x @ w
    return jax.nn.log_softmax(x @ w + y)

  args = (jnp.ones((4, 4)), jnp.ones((2, 4)))
  cast = autocast(
    f,
    "mixed_float16",
    float32_ops=(*DEFAULT_FLOAT32_OPS, "scope:head"),
  )
  jaxpr = jax.make_jaxpr(cast)(*args).jaxpr
  dots = [np.dtype(e.outvars[0].aval.dtype) for e in _eqns(jaxpr) if e.primitive.name == "dot_general"]
  assert sorted(d.name for d in dots) == ["float16", "float32"]
  half_softmax = autocast(f, "mixed_float16", half_ops=(*DEFAULT_HALF_OPS, "scope:log_softmax"))
  assert _dtypes_of(half_softmax, *args, names=("exp", "log")) == {F16}


# ---------------------------------------------------------------------------
# Errors.


@pytest.mark.parametrize(
  "call, error, words",
  [
    (lambda: autocast("not a function", "mixed_float16"), TypeError, ["callable", "str"]),
    (lambda: autocast(_loss, "mixed_float4"), ValueError, ["mixed_float4"]),
    (lambda: autocast(_loss, 16), ValueError, ["Policy", "16"]),
    (
      lambda: autocast(_loss, "mixed_float16", float32_ops=("softmax",)),
      ValueError,
      ["'softmax'", "not a JAX primitive", "scope:softmax", "dot_general"],
    ),
    (lambda: autocast(_loss, "mixed_float16", half_ops=("dot",)), ValueError, ["'dot'", "dot_general"]),
    (lambda: autocast(_loss, "mixed_float16", half_ops=(3,)), TypeError, ["strings", "3"]),
    (lambda: autocast(_loss, "mixed_float16", half_ops=("exp",)), ValueError, ["exp", "both"]),
    (lambda: autocast(_loss, "mixed_float16", params_argnums="w"), TypeError, ["params_argnums"]),
    (lambda: autocast(_loss, "mixed_float16", params_argnums=2)(W, X), ValueError, ["params_argnums", "2"]),
  ],
  ids=[
    "not_callable",
    "unknown_policy",
    "policy_type",
    "not_a_primitive",
    "close_match",
    "not_a_string",
    "in_both",
    "argnums_type",
    "argnums_range",
  ],
)
def test_errors(call, error, words):
  with pytest.raises(error) as info:
    call()
  for word in words:
    assert word in str(info.value), (word, str(info.value))


# ---------------------------------------------------------------------------
# Training parity.


@pytest.mark.slow
def test_digits_training_parity():
  data = pytest.importorskip("jmp_train_examples.data")
  try:
    ds = data.load_digits()
  except ImportError as e:
    pytest.skip(str(e))
  model = models.MLP(features=(64, 64))
  variables = jax.jit(model.init)(jax.random.key(0), ds.x_train[:8])
  x, y = jnp.asarray(ds.x_train[:512]), jnp.asarray(ds.y_train[:512])

  def train(apply):
    tx = optax.adam(3e-3)
    params = variables["params"]
    opt_state = tx.init(params)

    def step(_, carry):
      params, opt_state = carry
      g = jax.grad(lambda p: _xent(apply({"params": p}, x), y))(params)
      updates, opt_state = tx.update(g, opt_state, params)
      return optax.apply_updates(params, updates), opt_state

    # The 150 steps and the float32 evaluation in one program.
    @jax.jit
    def run(params, opt_state):
      params, _ = jax.lax.fori_loop(0, 150, step, (params, opt_state))
      return _xent(model.apply({"params": params}, x), y)

    return float(run(params, opt_state))

  f32 = train(model.apply)
  margin = abs(train(jflax.apply_policy(model, "mixed_bfloat16").apply) - f32)
  cast = abs(train(autocast(model.apply, "mixed_bfloat16")) - f32)
  assert cast <= max(2 * margin, 0.02), (f32, margin, cast)
