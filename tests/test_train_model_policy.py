"""make_train_step's policy reaches every product of a model that declares its dtypes.

Flax's example models declare ``dtype=jnp.float32`` on every layer; these
tests check, on the lowered step (StableHLO), that the default
``model_policy="auto"`` computes their products in the compute dtype
whatever form the model takes (a linen module, its ``apply``, a
``functools.partial`` of it, a plain function, an NNX module), that FP8
policies reach them as well, that products the policy cannot reach are
named in a warning, and the errors a Flax user meets on the way.
"""

import functools
import re
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import Mesh

import jmp_train
import jmp_train.diagnostics as diag
import jmp_train.flax

F32 = jnp.float32
_PRODUCT = re.compile(
  r"stablehlo\.(?:dot_general|convolution).*:\s*\(tensor<(?:\d+x)*(\w+)>, "
  r"tensor<(?:\d+x)*(\w+)>\)"
)


def product_dtypes(lowered) -> list[tuple[str, str]]:
  """The operand element types of every dot_general and convolution, read from StableHLO."""
  found = []
  for line in lowered.as_text().splitlines():
    if "stablehlo.dot_general" in line or "stablehlo.convolution" in line:
      match = _PRODUCT.search(line)
      assert match, line
      found.append(match.groups())
  return found


class DeclaredNet(nn.Module):
  """A conv net written as Flax's examples are: every layer declares its dtype."""

  dtype: jnp.dtype = F32

  @nn.compact
  def __call__(self, x, train: bool = True):
    x = nn.Conv(8, (3, 3), dtype=self.dtype, param_dtype=F32)(x)
    x = nn.BatchNorm(use_running_average=not train, dtype=self.dtype)(x)
    x = nn.relu(x).mean((1, 2))
    return nn.Dense(10, dtype=self.dtype, param_dtype=F32)(x)


class DeclaredNNX(nnx.Module):
  def __init__(self, rngs):
    self.conv = nnx.Conv(3, 8, (3, 3), dtype=F32, param_dtype=F32, rngs=rngs)
    self.bn = nnx.BatchNorm(8, dtype=F32, rngs=rngs)
    self.head = nnx.Linear(8, 10, dtype=F32, param_dtype=F32, rngs=rngs)

  def __call__(self, x):
    return self.head(nnx.relu(self.bn(self.conv(x))).mean((1, 2)))


def _ce(logits, labels):
  return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


X = jnp.asarray(np.random.default_rng(0).standard_normal((4, 8, 8, 3)), F32)
Y = jnp.arange(4) % 10
NET = DeclaredNet()
VARIABLES = jax.jit(NET.init)(jax.random.key(0), X)


def _linen_step(apply_fn, **kwargs):
  step = jmp_train.make_train_step(apply_fn, _ce, optax.sgd(0.1), **kwargs)
  state = step.init(VARIABLES["params"], model_state={"batch_stats": VARIABLES["batch_stats"]})
  return step, state


def _plain_apply(variables, x, **kwargs):
  return NET.apply(variables, x, train=True, **kwargs)


@pytest.mark.parametrize("form", ["module", "apply", "partial", "plain function"])
@pytest.mark.parametrize("policy", ["mixed_bfloat16", "mixed_float16"])
def test_products_of_a_declared_float32_linen_model_run_in_the_compute_dtype(form, policy):
  apply_fn = {
    "module": NET,
    "apply": NET.apply,
    "partial": functools.partial(NET.apply, train=True),
    "plain function": _plain_apply,
  }[form]
  half = {"mixed_bfloat16": "bf16", "mixed_float16": "f16"}[policy]
  step, state = _linen_step(apply_fn, policy=policy, loss_scale=jmp_train.StaticLossScale(1.0))
  with warnings.catch_warnings():
    warnings.simplefilter("error")  # no warning: every product is reached
    dtypes = product_dtypes(step.lower(state, (X, Y)))
  assert len(dtypes) == 5 and set(dtypes) == {(half, half)}, dtypes


def test_model_policy_inputs_keeps_the_declared_dtypes_and_float32_policies_change_nothing():
  step, state = _linen_step(NET.apply, policy="mixed_bfloat16", model_policy="inputs")
  assert set(product_dtypes(step.lower(state, (X, Y)))) == {("f32", "f32")}
  step, state = _linen_step(NET.apply, policy="float32")
  assert set(product_dtypes(step.lower(state, (X, Y)))) == {("f32", "f32")}


def test_nnx_module_with_declared_dtypes_runs_in_the_compute_dtype_and_comes_back_as_given():
  module = DeclaredNNX(nnx.Rngs(0))
  step = jmp_train.make_train_step(module, _ce, optax.sgd(0.1), policy="mixed_bfloat16")
  state = step.init()
  assert set(product_dtypes(step.lower(state, (X, Y)))) == {("bf16", "bf16")}
  state, metrics = step(state, (X, Y))
  assert np.isfinite(metrics["loss"])
  trained = step.to_nnx(state)
  assert type(trained) is DeclaredNNX and trained.head.dtype == F32
  assert trained.head.kernel[...].dtype == F32


def test_autocast_and_flax_mechanisms_and_bad_values():
  step, state = _linen_step(NET.apply, policy="mixed_bfloat16", model_policy="autocast")
  assert set(product_dtypes(step.lower(state, (X, Y)))) == {("bf16", "bf16")}
  with pytest.raises(TypeError, match="model_policy='flax'.*model_policy='autocast'"):
    jmp_train.make_train_step(_plain_apply, _ce, optax.sgd(0.1), policy="mixed_bfloat16", model_policy="flax")
  with pytest.raises(ValueError, match="model_policy must be one of"):
    jmp_train.make_train_step(NET.apply, _ce, optax.sgd(0.1), model_policy="everything")


def test_a_product_the_policy_cannot_reach_is_named_in_a_warning():

  @jax.custom_vjp
  def float32_matmul(a, b):  # a rule of its own: autocast runs it as traced
    return jnp.asarray(a, F32) @ jnp.asarray(b, F32)

  float32_matmul.defvjp(lambda a, b: (float32_matmul(a, b), (a, b)), lambda r, g: (g @ r[1].T, r[0].T @ g))

  class ForcedFloat32(nn.Module):
    @nn.compact
    def __call__(self, x):
      h = nn.Dense(8)(x.mean((1, 2)))
      w = self.param("w", nn.initializers.lecun_normal(), (8, 10))
      return float32_matmul(h, w)

  model = ForcedFloat32()
  params = model.init(jax.random.key(0), X)["params"]
  step = jmp_train.make_train_step(model.apply, _ce, optax.sgd(0.1), policy="mixed_bfloat16")
  with pytest.warns(
    UserWarning,
    match=r"1 matrix product.*wider than bfloat16.*"
    r"dot_general float32\[4, 8\] x float32\[8, 10\] at .*test_train_model_policy.py.*custom_vjp",
  ):
    step.lower(step.init(params), (X, Y))
  quiet = jmp_train.make_train_step(model.apply, _ce, optax.sgd(0.1), policy="mixed_bfloat16", model_policy="inputs")
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    quiet.lower(quiet.init(params), (X, Y))


def test_linen_model_under_mixed_float8_gets_fp8_products_from_example_inputs():
  step = jmp_train.make_train_step(NET.apply, _ce, optax.sgd(0.1), policy="mixed_float8")
  model_state = {"batch_stats": VARIABLES["batch_stats"]}
  with pytest.raises(ValueError, match=r"fp8_meta.*step.init\(params, \.\.\., inputs="):
    step.init(VARIABLES["params"], model_state=model_state)
  state = step.init(VARIABLES["params"], model_state=model_state, inputs=jax.ShapeDtypeStruct(X.shape, X.dtype))
  assert sorted(state.model_state) == ["batch_stats", "fp8_meta"]
  report = diag.fp8_products(step.lower(state, (X, Y)))
  assert len(report.products) >= 5 and not report.not_fp8, str(report)


def test_regularizer_adds_flax_examples_l2_penalty_to_the_objective():
  weight_decay, lr = 1e-2, 0.1

  def l2(params):  # Flax's ImageNet example: kernels only, 0.5 * wd * sum of squares.
    return weight_decay * 0.5 * sum(jnp.sum(p**2) for p in jax.tree.leaves(params) if p.ndim > 1)

  step = jmp_train.make_train_step(functools.partial(NET.apply, train=True), _ce, optax.sgd(lr), regularizer=l2)
  params, stats = VARIABLES["params"], {"batch_stats": VARIABLES["batch_stats"]}
  new_state, metrics = step(step.init(params, model_state=stats), (X, Y))

  def objective(p):
    logits, _ = NET.apply({"params": p, **stats}, X, mutable=["batch_stats"])
    return _ce(logits, Y) + l2(p)

  loss, grads = jax.jit(jax.value_and_grad(objective))(params)
  np.testing.assert_allclose(metrics["loss"], loss, rtol=1e-6)
  expected = jax.tree.map(lambda p, g: p - lr * g, params, grads)
  jax.tree.map(functools.partial(np.testing.assert_allclose, rtol=1e-5, atol=1e-7), new_state.params, expected)
  with pytest.raises(TypeError, match="regularizer must be None or a function"):
    jmp_train.make_train_step(NET.apply, _ce, optax.sgd(lr), regularizer=1e-4)
  bad = jmp_train.make_train_step(
    functools.partial(NET.apply, train=True), _ce, optax.sgd(lr), regularizer=lambda p: jax.tree.leaves(p)[0]
  )
  with pytest.raises(ValueError, match="regularizer must return a scalar"):
    bad.lower(bad.init(params, model_state=stats), (X, Y))


class SyncBatchNorm(nn.Module):
  @nn.compact
  def __call__(self, x, train: bool = True):
    x = nn.Dense(4, dtype=F32)(x)
    return nn.BatchNorm(use_running_average=not train, axis_name="batch", dtype=F32)(x)


def _mse(outputs, targets):
  return jnp.mean((outputs - targets) ** 2)


def test_flax_users_mistakes_give_errors_naming_the_fix():
  model = SyncBatchNorm()
  variables = model.init(jax.random.key(0), jnp.ones((2, 3)))
  params, stats = variables["params"], variables["batch_stats"]
  batch = (jnp.ones((4, 3)), jnp.zeros((4, 4)))
  single = jmp_train.make_train_step(model, _mse, optax.sgd(0.1), policy="mixed_bfloat16")
  with pytest.raises(ValueError, match=r"axis named 'batch'.*mode='shard_map'.*axis_name=None"):
    single.lower(single.init(params, model_state={"batch_stats": stats}), batch)
  mesh = Mesh(np.asarray(jax.devices()[:2]), ("data",))
  other_axis = jmp_train.make_train_step(model, _mse, optax.sgd(0.1), mode="shard_map", axis_name="data", mesh=mesh)
  state = other_axis.init(params, model_state={"batch_stats": stats})
  with pytest.raises(ValueError, match=r"the step maps 'data'.*axis_name='data'"):
    other_axis.lower(state, other_axis.shard_batch(batch))

  mesh = Mesh(np.asarray(jax.devices()[:2]), ("batch",))
  step = jmp_train.make_train_step(model, _mse, optax.sgd(0.1), mode="shard_map", mesh=mesh)
  sharded = step.shard_batch(batch)
  forgot = r"'batch_stats' collection.*model_state=\{'batch_stats': variables\['batch_stats'\]\}"
  with pytest.raises(ValueError, match=forgot) as info:
    step.lower(step.init(params), sharded)
  assert "remat()" not in str(info.value)
  with pytest.raises(ValueError, match=forgot + r".*model_state holds \['BatchNorm_0'\]"):
    step.lower(step.init(params, model_state=stats), sharded)
  state = step.init(params, model_state={"batch_stats": stats})
  with pytest.raises(
    ValueError,
    match=r"evaluate.*eval_apply_fn=functools.partial\("
    r"model.apply, train=False\)",
  ):
    step.evaluate(state, sharded)


def test_hand_wrapped_fp8_model_without_its_scaling_state_names_the_fix():
  model = jmp_train.flax.apply_policy(
    SyncBatchNorm(), jmp_train.get_policy("p=f32,c=bf16,o=f32,matmul=fp8,fp8_history=16")
  )
  variables = model.init(jax.random.key(0), jnp.ones((2, 3)))
  mesh = Mesh(np.asarray(jax.devices()[:2]), ("batch",))
  step = jmp_train.make_train_step(
    model.apply, _mse, optax.sgd(0.1), policy="mixed_float8", cast_params=False, mode="shard_map", mesh=mesh
  )
  stats = {"batch_stats": variables["batch_stats"]}
  batch = step.shard_batch((jnp.ones((4, 3)), jnp.zeros((4, 4))))
  with pytest.raises(ValueError, match=r"scaling state in the 'fp8_meta' collection.*inputs="):
    step.lower(step.init(variables["params"], model_state=stats), batch)
  state = step.init(variables["params"], model_state=stats, inputs=jnp.ones((4, 3)))
  made = jax.tree.map(lambda x: x[0], state.model_state["fp8_meta"])  # replica 0
  jax.tree.map(np.testing.assert_array_equal, made, variables["fp8_meta"])
