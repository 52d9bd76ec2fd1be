"""Tests for jmp_train._src.policy.policy."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jmp_train
from jmp_train import Policy, get_policy

F16, BF16, F32 = np.dtype(jnp.float16), np.dtype(jnp.bfloat16), np.dtype(jnp.float32)
HALF_TYPES = [jnp.float16, jnp.bfloat16]


def test_devices_are_simulated(num_devices):
  assert jax.device_count() == num_devices == 8


@pytest.mark.parametrize(
  "spec, expected",
  [
    ("params=float32,compute=float16,output=float32", (F32, F16, F32)),
    ("p=f32,c=bf16,o=f32", (F32, BF16, F32)),
    ("param=full,compute=bfloat16,output=full", (F32, BF16, F32)),
    (" P = F32 , C = FP16 , O = BF16 ", (F32, F16, BF16)),
    ("o=f16,c=f16,p=f32", (F32, F16, F16)),
    ("bfloat16", (BF16, BF16, BF16)),
    ("f16", (F16, F16, F16)),
    ("mixed_float16", (F32, F16, F32)),
    ("mixed_bfloat16", (F32, BF16, F32)),
    ("float32", (F32, F32, F32)),
    ("full", (F32, F32, F32)),
  ],
)
def test_get_policy_parses(spec, expected):
  p = get_policy(spec)
  assert (p.param_dtype, p.compute_dtype, p.output_dtype) == expected


def test_half_resolves_to_backend_half_type():
  # The test suite runs on CPU: bfloat16 there.
  assert jmp_train.half_dtype() == BF16
  assert get_policy("half").compute_dtype == jmp_train.half_dtype()
  assert get_policy("p=f32,c=half,o=f32").compute_dtype == BF16
  assert get_policy("mixed_half") == get_policy("mixed_bfloat16")


def test_half_dtype_on_gpu(monkeypatch):
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  assert jmp_train.half_dtype() == F16
  monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
  assert jmp_train.half_dtype() == BF16


@pytest.mark.parametrize("p", [F16, BF16, F32, np.dtype(jnp.float64)])
@pytest.mark.parametrize("c", [F16, BF16, F32])
@pytest.mark.parametrize("o", [F16, BF16, F32])
def test_str_round_trip(p, c, o):
  policy = Policy(p, c, o)
  assert get_policy(str(policy)) == policy
  assert hash(get_policy(str(policy))) == hash(policy)


@pytest.mark.parametrize(
  "spec, fragments",
  [
    ("params=float32,compute=float16,outptu=float32", ["'outptu'", "output"]),
    ("p=f32,c=float17,o=f32", ["'float17'", "bfloat16"]),
    ("p=f32,c=int8,o=f32", ["'int8'", "not a floating dtype"]),
    ("int32", ["'int32'", "not a floating dtype"]),
    ("p=f32,p=f16,c=f16,o=f32", ["'p'", "twice"]),
    ("p=f32,c=f16", ["missing output"]),
    ("p=f32,c=f16,o", ["'o'", "key=dtype"]),
    ("", ["Empty policy spec", "mixed_float16"]),
    ("mixed_float4", ["'mixed_float4'", "mixed_bfloat16"]),
  ],
)
def test_bad_specs_name_the_bad_part(spec, fragments):
  with pytest.raises(ValueError) as info:
    get_policy(spec)
  for fragment in fragments:
    assert fragment in str(info.value)


def test_bad_constructor_arguments():
  with pytest.raises(ValueError, match="'int32' is not a floating dtype"):
    Policy(jnp.float32, jnp.int32, jnp.float32)
  with pytest.raises(ValueError, match="Unknown dtype 'f8'"):
    Policy("f32", "f8", "f32")
  with pytest.raises(ValueError, match="string or a Policy"):
    get_policy(16)


def test_get_policy_passes_policies_through():
  p = get_policy("mixed_float16")
  assert get_policy(p) is p


def test_policy_is_immutable_and_hashable():
  p = get_policy("mixed_float16")
  with pytest.raises(dataclasses.FrozenInstanceError):
    p.compute_dtype = F32
  assert p == Policy("f32", "f16", "f32")
  assert len({p, Policy("f32", "f16", "f32"), get_policy("float32")}) == 2
  assert p.is_mixed and not get_policy("float32").is_mixed
  assert p.with_output_dtype("f16").output_dtype == F16


def test_policy_is_a_static_jit_argument():
  traces = []

  @jax.jit
  def f(x, policy):
    traces.append(policy)
    return policy.cast_to_output(policy.cast_to_compute(x) * 2)

  f = jax.jit(f.__wrapped__, static_argnums=1)
  x = jnp.ones(3)
  assert f(x, get_policy("mixed_float16")).dtype == F32
  assert f(x, get_policy("mixed_float16")).dtype == F32
  assert f(x, get_policy("bfloat16")).dtype == BF16
  assert len(traces) == 2  # one trace per distinct policy


@pytest.mark.parametrize("half", HALF_TYPES)
@pytest.mark.parametrize("use_jit", [False, True], ids=["nojit", "jit"])
def test_casts_only_floating_leaves(half, use_jit):
  policy = Policy(jnp.float32, half, jnp.float32)
  key = jax.random.key(0)
  raw_key = jax.random.PRNGKey(0)
  tree = {
    "w": jnp.ones((2, 3), jnp.float32),
    "w64": np.ones(2, np.float64),
    "ids": jnp.arange(3, dtype=jnp.int32),
    "mask": jnp.array([True, False]),
    "key": key,
    "raw_key": raw_key,
    "z": jnp.ones(2, jnp.complex64),
    "lr": 0.5,
    "name": "dense",
    "none": None,
  }
  arrays = {k: v for k, v in tree.items() if k not in ("lr", "name", "none")}
  statics = {k: tree[k] for k in ("lr", "name", "none")}

  def cast(t):
    return policy.cast_to_compute(t)

  out = jax.jit(cast)(arrays) if use_jit else cast(arrays)
  assert out["w"].dtype == np.dtype(half)
  assert out["w64"].dtype == np.dtype(half)
  assert out["ids"].dtype == jnp.int32
  np.testing.assert_array_equal(out["ids"], arrays["ids"])
  assert out["mask"].dtype == jnp.bool_
  assert jax.dtypes.issubdtype(out["key"].dtype, jax.dtypes.prng_key)
  assert out["raw_key"].dtype == jnp.uint32
  assert out["z"].dtype == jnp.complex64
  static_out = cast(statics)
  assert static_out == statics  # Python scalars, strings and None untouched
  # Round trip back to params and output.
  back = policy.cast_to_param(out)
  assert back["w"].dtype == F32 and back["ids"].dtype == jnp.int32
  assert policy.cast_to_output(out)["w"].dtype == F32


def test_cast_leaves_matching_dtype_alone():
  x = jnp.ones(3, jnp.float32)
  assert jmp_train.cast_floating({"x": x}, "f32")["x"] is x


def test_cast_under_pmap(num_devices):
  policy = get_policy("mixed_float16")
  xs = jnp.ones((num_devices, 4))
  out = jax.pmap(lambda x: policy.cast_to_compute({"x": x, "i": jnp.int32(1)}))(xs)
  assert out["x"].dtype == F16 and out["x"].shape == (num_devices, 4)
  assert out["i"].dtype == jnp.int32


def test_cast_under_vmap_and_strict_promotion():
  policy = get_policy("mixed_bfloat16")
  with jax.numpy_dtype_promotion("strict"):
    out = jax.vmap(lambda x: policy.cast_to_compute(x) * jnp.bfloat16(2))(jnp.ones((3, 2)))
  assert out.dtype == BF16
