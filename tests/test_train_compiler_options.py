"""make_train_step's XLA compiler options: FP8 steps on GPUs compile without Triton GEMMs.

XLA autotunes every FP8 GEMM over cuBLAS's kernels and generated Triton
kernels; the Triton candidates make the first call of an FP8 train step take
minutes. ``make_train_step`` compiles FP8 steps on GPUs with
``xla_gpu_enable_triton_gemm=False`` unless told otherwise; these tests
check the choice and that the options reach the compiled step (on CPU, by
an option XLA rejects and one that changes the compiled program).
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh

import jmp_train
from jmp_train._src.train import modes


def _apply(params, x):
  return x @ params["params"]["w"]


def _loss(out, y):
  return jnp.mean((out.astype(jnp.float32) - y) ** 2)


def _params():
  return {"w": jnp.asarray(np.random.default_rng(0).normal(size=(16, 4)), jnp.float32)}


def _batch(n=8):
  rng = np.random.default_rng(1)
  return (rng.normal(size=(n, 16)).astype(np.float32), rng.normal(size=(n, 4)).astype(np.float32))


@pytest.mark.parametrize("policy", ["mixed_float8", "fp8_current"])
def test_fp8_policies_on_gpus_compile_without_triton_gemms(policy):
  policy = (
    jmp_train.get_policy(policy)
    if policy != "fp8_current"
    else jmp_train.Policy(
      param_dtype=jnp.float32,
      compute_dtype=jnp.bfloat16,
      output_dtype=jnp.float32,
      fp8=jmp_train.Fp8Recipe(scaling="current"),
    )
  )
  assert modes.default_compiler_options(policy, "gpu") == {"xla_gpu_enable_triton_gemm": False}
  assert modes.default_compiler_options(policy, "cpu") == {}


@pytest.mark.parametrize("policy", ["float32", "mixed_bfloat16", "mixed_float16"])
def test_other_policies_keep_xla_defaults(policy):
  assert modes.default_compiler_options(jmp_train.get_policy(policy), "gpu") == {}


@pytest.mark.parametrize("mode", ["single", "shard_map"])
def test_options_reach_the_compiled_step(mode):
  kwargs = {}
  if mode == "shard_map":
    kwargs["mesh"] = Mesh(np.array(jax.devices()), ("batch",))
  batch_size = 8 if mode == "single" else 8 * jax.device_count()
  # An option name XLA does not know fails the compilation: the options are passed.
  step = jmp_train.make_train_step(
    _apply, _loss, optax.sgd(0.1), mode=mode, compiler_options={"xla_no_such_option": True}, **kwargs
  )
  state = step.init(_params())
  with pytest.raises(Exception, match="xla_no_such_option"):
    step(state, step.shard_batch(_batch(batch_size)))
  # A known one compiles, runs and gives the same result as the defaults.
  results = []
  for options in ({"xla_gpu_enable_triton_gemm": False}, None):
    step = jmp_train.make_train_step(_apply, _loss, optax.sgd(0.1), mode=mode, compiler_options=options, **kwargs)
    state, metrics = step(step.init(_params()), step.shard_batch(_batch(batch_size)))
    results.append(float(metrics["loss"]))
  assert results[0] == results[1]


def test_bad_compiler_options_are_named():
  with pytest.raises(TypeError, match="compiler_options must be None .* got str"):
    jmp_train.make_train_step(_apply, _loss, optax.sgd(0.1), compiler_options="triton=false")
  with pytest.raises(TypeError, match="compiler_options"):
    jmp_train.make_train_step(_apply, _loss, optax.sgd(0.1), compiler_options={1: False})
  with pytest.raises(ValueError, match="mode='pmap'.*XLA_FLAGS"):
    jmp_train.make_train_step(
      _apply, _loss, optax.sgd(0.1), mode="pmap", compiler_options={"xla_gpu_enable_triton_gemm": False}
    )


def test_pmap_keeps_xla_flags_without_options():
  # No options given: pmap compiles as before (the default options are empty on CPU).
  step = jmp_train.make_train_step(_apply, _loss, optax.sgd(0.1), mode="pmap", policy="mixed_float8")
  n = jax.local_device_count()
  state, metrics = step(step.init(_params(), inputs=_batch()[0]), step.shard_batch(_batch(8 * n)))
  assert np.isfinite(float(metrics["loss"]))
