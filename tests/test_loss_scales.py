"""Tests for jmp_train._src.loss_scaling.scales: loss-scale values and all_finite."""

from __future__ import annotations

import dataclasses
import pickle

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jmp_train
from jmp_train import DynamicLossScale, NoOpLossScale, StaticLossScale, all_finite

DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]
NON_DEFAULT = dict(
  scale=3.0,
  growth_interval=7,
  growth_factor=3.0,
  backoff_factor=0.25,
  min_scale=0.125,
  max_scale=1000.0,
  counter=5,
)
CONFIG_FIELDS = ("growth_interval", "growth_factor", "backoff_factor", "min_scale", "max_scale")


def _config(ls):
  return {name: getattr(ls, name) for name in CONFIG_FIELDS}


def _assert_same_dynamic(a, b):
  assert type(a) is type(b) is DynamicLossScale
  assert _config(a) == _config(b)
  np.testing.assert_array_equal(a.loss_scale, b.loss_scale)
  np.testing.assert_array_equal(a.counter, b.counter)
  assert a.loss_scale.dtype == jnp.float32 and a.counter.dtype == jnp.int32


# --- pytree behaviour --------------------------------------------------------


def test_every_field_is_a_leaf_or_static_metadata():
  ls = DynamicLossScale(**NON_DEFAULT)
  leaves, treedef = jax.tree.flatten(ls)
  assert [float(x) for x in leaves] == [3.0, 5.0]
  fields = {f.name for f in dataclasses.fields(DynamicLossScale)}
  assert fields == {"loss_scale", "counter", *CONFIG_FIELDS}
  # The static metadata is exactly the configuration, in field order.
  assert treedef.node_data()[1] == (7, 3.0, 0.25, 0.125, 1000.0)
  paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(ls)[0]]
  assert paths == [".loss_scale", ".counter"]


def test_round_trip_keeps_every_non_default_field():
  ls = DynamicLossScale(**NON_DEFAULT)
  leaves, treedef = jax.tree.flatten(ls)
  _assert_same_dynamic(jax.tree.unflatten(treedef, leaves), ls)
  _assert_same_dynamic(jax.tree.map(lambda x: x, ls), ls)
  _assert_same_dynamic(jax.jit(lambda x: x)(ls), ls)
  _assert_same_dynamic(pickle.loads(pickle.dumps(ls)), ls)
  # Placeholder leaves (as JAX and orbax use) are not validated on unflatten.
  shapes = jax.eval_shape(lambda: ls)
  assert _config(shapes) == _config(ls)
  assert shapes.loss_scale.dtype == jnp.float32
  assert jax.tree.unflatten(treedef, [None, None]).loss_scale is None


def test_config_survives_jit_in_the_arithmetic():
  # After a jitted round trip the floor (0.125) and factors still apply:
  # 3 * 0.25 = 0.75, 0.1875, then clamped at 0.125.
  ls = jax.jit(lambda x: x)(DynamicLossScale(**NON_DEFAULT))
  adjust = jax.jit(lambda s, f: s.adjust(f))
  scales = []
  for _ in range(4):
    ls = adjust(ls, False)
    scales.append(float(ls.loss_scale))
  assert scales == [0.75, 0.1875, 0.125, 0.125]
  assert int(ls.counter) == 0
  _assert_same_dynamic(ls, ls.replace())  # replace() keeps everything


def test_static_and_noop_are_pytrees():
  s = StaticLossScale(512)
  assert [float(x) for x in jax.tree.leaves(s)] == [512.0]
  s2 = jax.jit(lambda x: x)(s)
  assert type(s2) is StaticLossScale and float(s2.loss_scale) == 512.0
  assert s2.loss_scale.dtype == jnp.float32
  n = NoOpLossScale()
  assert jax.tree.leaves(n) == []
  assert type(jax.jit(lambda x: x)(n)) is NoOpLossScale
  assert n.loss_scale.dtype == jnp.float32 and float(n.loss_scale) == 1.0


def test_replace_rejects_unknown_fields():
  with pytest.raises(ValueError, match="'scale'.*fields: .*counter"):
    DynamicLossScale().replace(scale=2.0)


def test_defaults():
  ls = DynamicLossScale()
  assert float(ls.loss_scale) == 2.0**15 and int(ls.counter) == 0
  assert _config(ls) == dict(
    growth_interval=2000, growth_factor=2.0, backoff_factor=0.5, min_scale=1.0, max_scale=2.0**24
  )


@pytest.mark.parametrize(
  "kwargs, fragments",
  [
    (dict(scale=0.0), ["scale", "0.0", "> 0"]),
    (dict(scale=-4.0), ["scale", "-4.0", "> 0"]),
    (dict(scale=float("inf")), ["scale", "inf", "finite"]),
    (dict(scale=float("nan")), ["scale", "nan", "finite"]),
    (dict(scale=2.0**25), ["scale", r"\[min_scale, max_scale\]"]),
    (dict(scale=0.5), ["scale", "0.5", r"\[min_scale, max_scale\]"]),
    (dict(growth_factor=1.0), ["growth_factor", "1.0", "> 1"]),
    (dict(growth_factor=0.5), ["growth_factor", "0.5", "> 1"]),
    (dict(backoff_factor=1.0), ["backoff_factor", r"\(0, 1\)"]),
    (dict(backoff_factor=0.0), ["backoff_factor", r"\(0, 1\)"]),
    (dict(backoff_factor=-0.5), ["backoff_factor", r"\(0, 1\)"]),
    (dict(growth_interval=0), ["growth_interval", "0", "a positive int"]),
    (dict(growth_interval=2.5), ["growth_interval", "2.5", "a positive int"]),
    (dict(min_scale=0.0, scale=1.0), ["min_scale", "> 0"]),
    (dict(min_scale=4.0, max_scale=2.0, scale=2.0), ["min_scale", "4.0", "max_scale", "2.0"]),
    (dict(max_scale=float("inf")), ["max_scale", "inf", "finite"]),
    (dict(counter=-1), ["counter", "-1", "growth_interval"]),
    (dict(counter=2000), ["counter", "2000", "growth_interval"]),
    (dict(growth_factor="fast"), ["growth_factor", "'fast'", "number"]),
  ],
)
def test_bad_configuration_raises(kwargs, fragments):
  with pytest.raises(ValueError) as err:
    DynamicLossScale(**kwargs)
  for fragment in fragments:
    assert err.match(fragment)


@pytest.mark.parametrize("scale", [0.0, -1.0, float("inf"), float("nan")])
def test_bad_static_scale_raises(scale):
  with pytest.raises(ValueError, match="scale must be finite and > 0"):
    StaticLossScale(scale)
  with pytest.raises(ValueError, match="scalar"):
    StaticLossScale(jnp.ones(2))


def test_construction_under_jit_skips_value_checks_on_tracers():
  out = jax.jit(lambda s: DynamicLossScale(s, growth_interval=3).adjust(True))(jnp.float32(8.0))
  assert float(out.loss_scale) == 8.0 and int(out.counter) == 1


def test_the_pytree_is_a_registered_dataclass():
  # One mechanism: jax.tree_util.register_dataclass, with the configuration
  # declared static; JAX rebuilds a value by calling the class with every
  # field as a keyword, which takes the leaves as they are.
  ls = DynamicLossScale(**NON_DEFAULT)
  static = {f.name for f in dataclasses.fields(ls) if f.metadata.get("static")}
  assert static == set(CONFIG_FIELDS)
  rebuilt = DynamicLossScale(**{f.name: getattr(ls, f.name) for f in dataclasses.fields(ls)})
  _assert_same_dynamic(rebuilt, ls)
  assert StaticLossScale(loss_scale=None).loss_scale is None  # placeholder
  with pytest.raises(ValueError, match="StaticLossScale takes the scale"):
    StaticLossScale()


@pytest.mark.parametrize(
  "value, template",
  [
    (DynamicLossScale(**NON_DEFAULT), DynamicLossScale(**{**NON_DEFAULT, "scale": 1.0, "counter": 0})),
    (StaticLossScale(3.0), StaticLossScale(1.0)),
    (NoOpLossScale(), NoOpLossScale()),
  ],
  ids=["dynamic", "static", "noop"],
)
def test_flax_serialization_round_trip(value, template):
  # As for Flax's DynamicScale: the leaves are saved by field name and come
  # back from the bytes; the static configuration comes from the template.
  from flax import serialization

  state_dict = serialization.to_state_dict(value)
  assert set(state_dict) == {f.name for f in dataclasses.fields(value) if not f.metadata.get("static")}
  for restored in (
    serialization.from_state_dict(template, state_dict),
    serialization.from_bytes(template, serialization.to_bytes(value)),
  ):
    restored = jax.tree.map(jnp.asarray, restored)
    assert type(restored) is type(value)
    chex.assert_trees_all_equal_shapes_and_dtypes(restored, value)
    chex.assert_trees_all_equal(restored, value)
  with pytest.raises(ValueError, match="Cannot restore a StaticLossScale"):
    serialization.from_state_dict(StaticLossScale(1.0), {"scale": 2.0})


@pytest.mark.parametrize("flag", [jnp.array([True, False]), np.ones((1,), bool), [True]])
@pytest.mark.parametrize("make", [DynamicLossScale, lambda: StaticLossScale(2.0), NoOpLossScale])
def test_adjust_rejects_a_non_scalar_flag(make, flag):
  with pytest.raises(ValueError, match=r"one boolean scalar.*shape \((2|1),\)"):
    make().adjust(flag)
  with pytest.raises(ValueError, match="one boolean scalar"):
    jax.jit(lambda ls, f: ls.adjust(f))(make(), jnp.asarray(flag))


@pytest.mark.parametrize("make", [lambda v: DynamicLossScale(scale=v), lambda v: StaticLossScale(scale=v)])
@pytest.mark.parametrize("value", ["big", None, object()])
def test_a_scale_that_is_no_number_names_the_parameter(make, value):
  with pytest.raises(ValueError, match=r"^scale must be a positive number.*got"):
    make(value)


def test_a_counter_that_is_no_number_names_the_parameter():
  with pytest.raises(ValueError, match=r"^counter must be an integer.*'x'"):
    DynamicLossScale(counter="x")


# --- scale / unscale ---------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("make", [lambda: StaticLossScale(2.0**10), lambda: DynamicLossScale(2.0**10)])
def test_scale_unscale_keep_dtypes(dtype, make):
  ls = make()
  tree = {"g": jnp.array([0.5, -3.0, 1e-3], dtype), "step": jnp.arange(3)}
  scaled = ls.scale(tree)
  assert scaled["g"].dtype == dtype
  assert scaled["step"] is tree["step"]  # integer leaves untouched
  expected = (np.asarray(tree["g"], np.float32) * 1024).astype(dtype)
  np.testing.assert_array_equal(np.asarray(scaled["g"]), expected)
  back = ls.unscale(scaled)
  assert back["g"].dtype == dtype
  # Multiplying by a power of two is exact in every dtype here.
  np.testing.assert_array_equal(np.asarray(back["g"]), np.asarray(tree["g"]))


def test_python_floats_are_scaled_and_checked():
  ls = StaticLossScale(8.0)
  out = ls.scale({"loss": 1.5, "n": 3})
  assert out["loss"].dtype == jnp.float32 and float(out["loss"]) == 12.0
  assert out["n"] == 3  # Python ints are not floating: untouched
  assert not bool(all_finite([1.0, float("nan")]))
  assert bool(all_finite([1.0, 3]))


@pytest.mark.filterwarnings("ignore:overflow encountered in cast")
def test_unscale_float16_without_overflow():
  # 2**17 does not fit float16 (max 65504): a naive `g / S.astype(f16)`
  # divides by inf and returns 0. Ours multiplies by 1/S in float32.
  ls = StaticLossScale(2.0**17)
  g = jnp.array([65504.0, 2.0**-10, -8.0], jnp.float16)
  out = ls.unscale(g)
  assert out.dtype == jnp.float16
  np.testing.assert_array_equal(
    np.asarray(out, np.float32),
    (np.asarray(g, np.float32) / 2.0**17).astype(np.float16).astype(np.float32),
  )
  assert float(out[0]) == pytest.approx(65504 / 2**17, rel=1e-3)
  naive = g / jnp.asarray(2.0**17, jnp.float16)
  assert float(naive[0]) == 0.0  # the failure the float32 path avoids


def test_scale_of_float16_overflows_to_inf_signal():
  # Scaling a float16 value beyond 65504 gives inf, which is what makes
  # dynamic loss scaling back off.
  out = StaticLossScale(2.0**16).scale(jnp.float16(2.0))
  assert out.dtype == jnp.float16 and np.isinf(float(out))


@pytest.mark.parametrize("dtype", DTYPES)
def test_no_implicit_promotion(dtype):
  ls = DynamicLossScale(2.0**4, growth_interval=1, min_scale=0.5)
  with jax.numpy_dtype_promotion("strict"):
    g = jnp.array([1.0, -2.0], dtype)
    assert ls.unscale(ls.scale(g)).dtype == dtype
    ls2 = ls.adjust(all_finite(g)).adjust(jnp.array(False))
  assert float(ls2.loss_scale) == 2.0**4
  assert ls2.loss_scale.dtype == jnp.float32 and ls2.counter.dtype == jnp.int32


def test_noop_is_identity():
  tree = {"g": jnp.array([1.0, jnp.inf], jnp.float16)}
  n = NoOpLossScale()
  assert n.scale(tree) is tree and n.unscale(tree) is tree
  assert n.adjust(jnp.array(False)) is n
  s = StaticLossScale(4.0)
  assert s.adjust(jnp.array(False)) is s


# --- dynamic trajectories ----------------------------------------------------


def pytorch_grad_scaler_reference(scale, growth_interval, growth_factor, backoff_factor, pattern):
  """PyTorch GradScaler's update rule (``_amp_update_scale_``), in Python.

  From torch/csrc (ATen AmpKernels): the scale is a float32 tensor, the
  factors are doubles and the product is cast back to float32; growth only
  when the product is finite.

      if found_inf: scale *= backoff_factor; growth_tracker = 0
      else:
        successful = growth_tracker + 1
        if successful == growth_interval:
          new_scale = float(scale * growth_factor)
          if isfinite(new_scale): scale = new_scale
          growth_tracker = 0
        else:
          growth_tracker = successful
  """
  scale = np.float32(scale)
  tracker = 0
  out = []
  for finite in pattern:
    if not finite:
      scale = np.float32(np.float64(scale) * backoff_factor)
      tracker = 0
    else:
      successful = tracker + 1
      if successful == growth_interval:
        new_scale = np.float32(np.float64(scale) * growth_factor)
        if np.isfinite(new_scale):
          scale = new_scale
        tracker = 0
      else:
        tracker = successful
    out.append((scale, tracker))
  return out


@jax.jit
def _run_pattern(ls, pattern):
  def body(ls, finite):
    ls = ls.adjust(finite)
    return ls, (ls.loss_scale, ls.counter)

  return jax.lax.scan(body, ls, pattern)[1]


def _pattern(seed, n=300, p_overflow=0.15):
  rng = np.random.default_rng(seed)
  pattern = rng.random(n) > p_overflow
  pattern[:5] = True
  pattern[40:60] = True  # a long good run so growth happens
  pattern[100:103] = False  # consecutive overflows
  return pattern


@pytest.mark.parametrize(
  "scale, growth_interval, growth_factor, backoff_factor, p_overflow",
  [
    (2.0**15, 1, 2.0, 0.5, 0.45),
    (2.0**16, 3, 2.0, 0.5, 0.15),
    (1000.0, 5, 1.5, 0.75, 0.1),  # non-power-of-two factors and scale
    (3.0, 2, 4.0, 0.25, 0.3),
  ],
)
def test_trajectory_matches_pytorch_grad_scaler(scale, growth_interval, growth_factor, backoff_factor, p_overflow):
  # The factors are exactly representable in float32, so the float32
  # product here and PyTorch's float64 product rounded to float32 agree
  # bit for bit. Bounds far away so PyTorch's unbounded rule applies.
  pattern = _pattern(growth_interval, p_overflow=p_overflow)
  ls = DynamicLossScale(scale, growth_interval, growth_factor, backoff_factor, min_scale=2.0**-100, max_scale=2.0**100)
  scales, counters = _run_pattern(ls, jnp.asarray(pattern))
  ref = pytorch_grad_scaler_reference(scale, growth_interval, growth_factor, backoff_factor, pattern)
  assert all(2.0**-100 < s < 2.0**100 for s, _ in ref)  # bounds never hit
  np.testing.assert_array_equal(np.asarray(scales), [s for s, _ in ref])
  np.testing.assert_array_equal(np.asarray(counters), [t for _, t in ref])
  assert scales.dtype == jnp.float32 and counters.dtype == jnp.int32
  assert len(set(np.asarray(scales).tolist())) > 3  # it moved both ways


def test_growth_after_exactly_growth_interval_good_steps():
  ls = DynamicLossScale(8.0, growth_interval=4)
  scales, counters = _run_pattern(ls, jnp.array([True] * 9))
  np.testing.assert_array_equal(scales, [8, 8, 8, 16, 16, 16, 16, 32, 32])
  np.testing.assert_array_equal(counters, [1, 2, 3, 0, 1, 2, 3, 0, 1])
  # An overflow resets the count: growth needs 4 new good steps.
  scales, counters = _run_pattern(ls, jnp.array([True, True, True, False, True, True, True, True]))
  np.testing.assert_array_equal(scales, [8, 8, 8, 4, 4, 4, 4, 8])
  np.testing.assert_array_equal(counters, [1, 2, 3, 0, 1, 2, 3, 0])


def test_never_leaves_bounds_and_floor_below_one():
  ls = DynamicLossScale(1.0, growth_interval=1, min_scale=2.0**-4, max_scale=4.0)
  pattern = [False] * 10 + [True] * 10 + [False] * 3
  scales, _ = _run_pattern(ls, jnp.array(pattern))
  expected = [0.5, 0.25, 0.125] + [0.0625] * 7 + [0.125, 0.25, 0.5, 1, 2] + [4] * 5 + [2, 1, 0.5]
  np.testing.assert_array_equal(scales, expected)


def test_growth_clamped_at_max_never_inf():
  ls = DynamicLossScale(2.0**120, growth_interval=1, min_scale=1.0, max_scale=float(np.finfo(np.float32).max))
  scales, _ = _run_pattern(ls, jnp.ones(20, bool))
  assert np.isfinite(np.asarray(scales)).all()
  assert float(scales[-1]) == float(np.finfo(np.float32).max)


def test_no_retrace_when_the_scale_changes():
  @jax.jit
  @chex.assert_max_traces(n=1)
  def adjust(ls, finite):
    return ls.adjust(finite)

  ls = DynamicLossScale(2.0**10, growth_interval=2)
  seen = set()
  for finite in [True, True, False, False, True, True, True]:
    ls = adjust(ls, jnp.asarray(finite))
    seen.add(float(ls.loss_scale))
  assert len(seen) >= 3  # the value changed, the trace did not


# --- all_finite --------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_all_finite(dtype, bad):
  tree = {"a": jnp.ones((2, 3), dtype), "b": [jnp.zeros(4, dtype)], "i": jnp.arange(3), "none": None}
  ok = all_finite(tree)
  assert ok.dtype == jnp.bool_ and ok.shape == () and bool(ok)
  tree["b"][0] = tree["b"][0].at[2].set(bad)
  assert not bool(all_finite(tree))
  assert not bool(jax.jit(all_finite)(tree))


def test_all_finite_large_float16_values_are_finite():
  # Each value is finite, their float16 sum is not: no false overflow.
  tree = [jnp.full((64,), 60000.0, jnp.float16)] * 3
  assert bool(all_finite(tree))
  assert bool(jax.jit(all_finite)(tree))
  assert bool(all_finite({})) and bool(all_finite({"i": jnp.arange(2)}))


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16, jnp.float32], ids=str)
def test_all_finite_extreme_values_and_every_position(dtype):
  # all_finite sums leaf * 0: the extremes of the range (largest finite,
  # smallest subnormal, signed zeros) must count as finite, and a single
  # inf or NaN anywhere must be caught, eagerly and under jit.
  info = jnp.finfo(dtype)
  edge = jnp.asarray([info.max, -info.max, info.tiny, info.smallest_subnormal, -0.0, 0.0, 1.0, -1.0], dtype)
  leaf = jnp.tile(edge, 5)
  jitted = jax.jit(all_finite)
  assert bool(all_finite([leaf])) and bool(jitted([leaf]))
  for position in (0, 7, 21, 39):
    for bad in (jnp.inf, -jnp.inf, jnp.nan):
      tree = [leaf.at[position].set(bad), jnp.ones(3, dtype)]
      assert not bool(all_finite(tree)), (position, bad)
      assert not bool(jitted(tree)), (position, bad)


def test_all_finite_every_replica_agrees_under_pmap(num_devices):
  grads = np.ones((num_devices, 3), np.float16)
  grads[5, 1] = np.inf  # one replica of 8 overflowed
  with_axis = jax.pmap(lambda g: all_finite(g, axis_name="i"), axis_name="i")
  local = jax.pmap(all_finite)
  assert np.asarray(with_axis(grads)).tolist() == [False] * num_devices
  expected_local = [True] * num_devices
  expected_local[5] = False
  assert np.asarray(local(grads)).tolist() == expected_local
  grads[5, 1] = 1.0
  assert np.asarray(with_axis(grads)).tolist() == [True] * num_devices


def test_all_finite_under_vmap_axis():
  grads = jnp.ones((4, 2)).at[1, 0].set(jnp.nan)
  out = jax.vmap(lambda g: all_finite(g, axis_name="b"), axis_name="b")(grads)
  assert np.asarray(out).tolist() == [False] * 4


def test_exported_names():
  for name in ["NoOpLossScale", "StaticLossScale", "DynamicLossScale", "all_finite"]:
    assert name in jmp_train.__all__ and hasattr(jmp_train, name)
