"""Tests for jmp_train.autocast (a dtype policy as a jaxpr transformation)."""

from __future__ import annotations

import collections
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jmp_train
import jmp_train.diagnostics as diag
import jmp_train.flax as jflax
from jmp_train._src.autocast.transform import autocast

from helpers.autocast import (
  BF16,
  F16,
  F32,
  HALF,
  POLICIES,
  TOKENS,
  X_IMG,
  _dtypes_of,
  _eqns,
  _flax_cases,
  _flax_variables,
  _matmul_signature,
  _rel_err,
  _xent,
)


# ---------------------------------------------------------------------------
# The library's Flax models: autocast(model.apply) against apply_policy.


# float16 is slow to compile on XLA:CPU: the larger models' float16 cases are slow tests.
_FLAX_PARAMS = [
  pytest.param(name, half, id=f"{name}-{half.name}", marks=[pytest.mark.slow] if name != "mlp" and half == F16 else [])
  for name in ("mlp", "resnet", "transformer")
  for half in HALF
]


def _out_and_grad(apply, variables, x):
  return apply(variables, x), jax.grad(lambda v: jnp.mean(apply(v, x) ** 2))(variables)


@functools.cache
def _float32_out_and_grad(name):
  """The float32 model's output and gradients (shared by both half dtypes)."""
  model, x = _flax_cases()[name]
  return jax.jit(lambda v: _out_and_grad(model.apply, v, x))(_flax_variables(name))


@pytest.mark.parametrize("name, half", _FLAX_PARAMS)
def test_flax_models_match_apply_policy(name, half):
  model, x = _flax_cases()[name]
  policy = POLICIES[half]
  variables = _flax_variables(name)
  reference = functools.partial(jflax.apply_policy(model, policy).apply)
  cast = autocast(model.apply, policy)

  # The same matmuls in the same dtypes, forward and backward.
  report = diag.tensor_core_report(cast, variables, x, backward=True)
  assert _matmul_signature(report) == _matmul_signature(diag.tensor_core_report(reference, variables, x, backward=True))
  assert _dtypes_of(cast, variables, x) == {half}
  # Float32 regions: both audits clean (exp, log, rsqrt, large sums in
  # float32; no float32 matmul; float32 outputs).
  diag.precision_audit(reference, variables, x, backward=True).assert_clean()
  diag.precision_audit(cast, variables, x, backward=True).assert_clean()
  assert _dtypes_of(cast, variables, x, names=("exp", "rsqrt", "log")) <= {F32}
  assert report.half_precision_fraction == 1.0

  # Outputs and gradients within half-precision rounding of each other and
  # of float32.
  (out, g), (out_ref, g_ref) = jax.jit(lambda v: [_out_and_grad(a, v, x) for a in (cast, reference)])(variables)
  out32, g32 = _float32_out_and_grad(name)
  assert out.dtype == F32
  tol = 8 * float(jnp.finfo(half).eps)
  assert _rel_err(out, out32) < tol and _rel_err(out_ref, out32) < tol
  for leaf, leaf_ref, leaf32 in zip(*(jax.tree.leaves(t) for t in (g, g_ref, g32))):
    assert leaf.dtype == F32
    leaf, leaf_ref, leaf32 = (np.asarray(a) for a in (leaf, leaf_ref, leaf32))
    scale = float(np.linalg.norm(leaf32)) + 1e-6
    err = float(np.linalg.norm(leaf - leaf32)) / scale
    err_ref = float(np.linalg.norm(leaf_ref - leaf32)) / scale
    assert err < max(4 * err_ref, 16 * float(jnp.finfo(half).eps)), (err, err_ref)


def test_resnet_train_mode_keeps_batch_stats_float32():
  model, x = _flax_cases()["resnet"]
  variables = _flax_variables("resnet")
  fn = autocast(functools.partial(model.apply, train=True, mutable=["batch_stats"]), "mixed_float16")
  (out, state), (_, state32) = jax.jit(lambda v: (fn(v, x), model.apply(v, x, train=True, mutable=["batch_stats"])))(
    variables
  )
  assert out.dtype == F32
  for leaf, leaf32 in zip(jax.tree.leaves(state), jax.tree.leaves(state32)):
    assert leaf.dtype == F32
    np.testing.assert_allclose(leaf, leaf32, rtol=2e-2, atol=2e-3)


# ---------------------------------------------------------------------------
# Models written without Flax.


def _mlp_params(key, sizes=(64, 32, 16)):
  keys = jax.random.split(key, len(sizes))
  return [
    {"w": jax.random.normal(k, (m, n)) / np.sqrt(m), "b": jnp.zeros(n)} for k, m, n in zip(keys, sizes[:-1], sizes[1:])
  ]


def _mlp(params, x):
  for layer in params[:-1]:
    x = jax.nn.gelu(x @ layer["w"] + layer["b"])
  return x @ params[-1]["w"] + params[-1]["b"]


def _layer_norm(x, scale, eps=1e-6):
  mean = x.mean(-1, keepdims=True)
  var = ((x - mean) ** 2).mean(-1, keepdims=True)
  return (x - mean) * jax.lax.rsqrt(var + eps) * scale


def _transformer_params(key, vocab=32, d=16, mlp=32):
  k = jax.random.split(key, 6)
  init = lambda kk, shape: jax.random.normal(kk, shape) / np.sqrt(shape[0])
  return {
    "embed": init(k[0], (vocab, d)),
    "qkv": init(k[1], (d, 3 * d)),
    "out": init(k[2], (d, d)),
    "mlp_in": init(k[3], (d, mlp)),
    "mlp_out": init(k[4], (mlp, d)),
    "head": init(k[5], (d, vocab)),
    "ln1": jnp.ones(d),
    "ln2": jnp.ones(d),
    "bias": jnp.zeros(mlp),
  }


def _transformer(p, tokens, heads=2):
  x = p["embed"][tokens]
  b, t, d = x.shape
  h = _layer_norm(x, p["ln1"])
  q, k, v = jnp.split(h @ p["qkv"], 3, axis=-1)
  split = lambda a: a.reshape(b, t, heads, d // heads)
  logits = jnp.einsum("bqhd,bkhd->bhqk", split(q), split(k)) / np.sqrt(d // heads)
  mask = jnp.tril(jnp.ones((t, t), bool))
  logits = jnp.where(mask, logits, -1e9)
  attn = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(logits, axis=-1), split(v))
  x = x + attn.reshape(b, t, d) @ p["out"]
  h = jax.nn.relu(_layer_norm(x, p["ln2"]) @ p["mlp_in"] + p["bias"]) @ p["mlp_out"]
  return (x + h) @ p["head"]


@functools.cache
def _plain_case(name):
  """(params, x, loss, float32 (value, grads)), shared by both half dtypes."""
  if name == "mlp":
    params, x, fn, labels = _mlp_params(jax.random.key(0)), X_IMG, _mlp, jnp.arange(8) % 16
  else:
    params, x, fn, labels = _transformer_params(jax.random.key(0)), TOKENS, _transformer, TOKENS
  loss = lambda p, x: _xent(fn(p, x), labels)
  return params, x, loss, jax.jit(jax.value_and_grad(loss))(params, x)


@pytest.mark.parametrize("half", HALF, ids=lambda d: d.name)
@pytest.mark.parametrize("name", ["mlp", "transformer"])
def test_plain_jax_models(name, half):
  params, x, loss, (v32, g32) = _plain_case(name)
  cast = autocast(loss, POLICIES[half])
  # Strict promotion: any implicit float16/bfloat16 -> float32 mix would raise.
  with jax.numpy_dtype_promotion("strict"):
    value, grads = jax.jit(jax.value_and_grad(cast))(params, x)
    jaxpr = jax.make_jaxpr(cast)(params, x).jaxpr
  assert value.dtype == F32
  assert all(g.dtype == F32 for g in jax.tree.leaves(grads))
  assert _dtypes_of(cast, params, x) == {half}
  assert _dtypes_of(cast, params, x, names=("exp", "log", "rsqrt", "reduce_sum")) == {F32}
  diag.precision_audit(cast, params, x, backward=True).assert_clean()
  # The bias adds right after a matmul stay in half precision: the float32
  # parameter is cast down, the activation is not promoted.
  eqns = list(_eqns(jaxpr))
  produced_by_dot = {e.outvars[0] for e in eqns if e.primitive.name == "dot_general"}
  adds = [
    e
    for e in eqns
    if e.primitive.name == "add" and any(v in produced_by_dot for v in e.invars if isinstance(v, jax.extend.core.Var))
  ]
  assert adds and all(np.dtype(e.outvars[0].aval.dtype) == half for e in adds)
  assert abs(float(value) - float(v32)) < 16 * float(jnp.finfo(half).eps) * abs(float(v32))
  assert _rel_err(jax.flatten_util.ravel_pytree(grads)[0], jax.flatten_util.ravel_pytree(g32)[0]) < 32 * float(
    jnp.finfo(half).eps
  )


def test_softmax_and_variance_patterns_run_in_float32():
  def f(w, x):
    h = x @ w
    mean = h.mean(-1, keepdims=True)
    var = jnp.mean(jnp.square(h - mean), -1, keepdims=True)
    return jax.nn.log_softmax((h - mean) / jnp.sqrt(var + 1e-5))

  jaxpr = jax.make_jaxpr(autocast(f, "mixed_float16"))(jnp.ones((8, 8)), jnp.ones((4, 8))).jaxpr
  by_name = collections.defaultdict(set)
  for e in _eqns(jaxpr):
    by_name[e.primitive.name].add(np.dtype(e.outvars[0].aval.dtype))
  assert by_name["dot_general"] == {F16}
  for name in ("reduce_max", "exp", "log", "reduce_sum", "square", "sqrt"):
    assert by_name[name] == {F32}, (name, by_name[name])


def test_params_stay_in_param_dtype_and_inputs_in_compute_dtype():
  seen = {}

  def f(p, x, n):
    seen["p"], seen["x"], seen["n"] = p.dtype, x.dtype, n.dtype
    return (x @ p) * 2 + p[0] + n

  policy = jmp_train.Policy("bfloat16", "float16", "float32")
  jaxpr = jax.make_jaxpr(autocast(f, policy))(jnp.ones((4, 4)), jnp.ones((2, 4)), jnp.ones((), jnp.int32)).jaxpr
  ins = [np.dtype(e.outvars[0].aval.dtype) for e in jaxpr.eqns if e.primitive.name == "convert_element_type"]
  assert BF16 in ins and F16 in ins  # params to bfloat16 storage, input to float16
  assert jaxpr.outvars[0].aval.dtype == F32
  assert seen == {"p": F32, "x": F32, "n": np.dtype(jnp.int32)}  # traced as given


def test_params_argnums():
  def f(x, w):
    return x * w

  for argnums, expect in (((1,), F16), (None, F16), (0, F16)):
    jaxpr = jax.make_jaxpr(autocast(f, "mixed_float16", params_argnums=argnums))(jnp.ones(4), jnp.ones(4)).jaxpr
    (mul,) = [e for e in jaxpr.eqns if e.primitive.name == "mul"]
    assert mul.outvars[0].aval.dtype == expect
  # Both parameters: nothing in half precision (no matmul), all float32.
  jaxpr = jax.make_jaxpr(autocast(f, "mixed_float16", params_argnums=(0, 1)))(jnp.ones(4), jnp.ones(4)).jaxpr
  (mul,) = [e for e in jaxpr.eqns if e.primitive.name == "mul"]
  assert mul.outvars[0].aval.dtype == F32


def test_static_arguments_and_pytrees():
  def f(params, batch, *, train, scale=2.0):
    out = batch["x"] @ params["w"]
    return {"out": out * scale if train else out, "label": batch["y"]}

  params = {"w": jnp.ones((4, 8))}
  batch = {"x": jnp.ones((2, 4)), "y": jnp.arange(2)}
  out = autocast(f, "mixed_bfloat16")(params, batch, train=True, scale=3.0)
  assert out["out"].dtype == F32 and out["label"].dtype == jnp.int32
  np.testing.assert_allclose(out["out"], 12.0)
