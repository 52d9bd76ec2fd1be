"""The GPT example model, and make_train_step against a hand-written bfloat16 step of it.

The library's mixed step must cost nothing over the step a user would write
by hand (parameters cast to bfloat16 once, float32 loss, ``optax.adam``):
the same matmuls with the same operand dtypes, and no more converts of
weight-sized arrays (a second cast pass, or a float32 copy of an output,
would show here before it shows in a GPU profile).
"""

from __future__ import annotations

import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

_ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:  # `pytest` run without `python -m`.
  sys.path.insert(0, str(_ROOT))

import jmp_train  # noqa: E402
from benchmarks import bench_gpt  # noqa: E402
from jmp_train_examples import models  # noqa: E402
from jmp_train_examples.models.gpt import GPT, GPTConfig, chunked_cross_entropy  # noqa: E402
from jmp_train_examples.models.gpt import gpt_train_fns  # noqa: E402


def _pattern_batch(vocab: int, batch: int = 8, seq: int = 32):
  """Windows of a repeated random pattern of 13 tokens: learnable in a few steps."""
  pattern = np.random.default_rng(0).integers(0, vocab, 13)
  stream = np.tile(pattern, (batch + seq) // 13 + 2)
  rows = np.stack([stream[i : i + seq + 1] for i in range(batch)])
  return jnp.asarray(rows[:, :-1], jnp.int32), jnp.asarray(rows[:, 1:], jnp.int32)


def test_exported_from_models():
  assert models.GPT is GPT and models.GPTConfig is GPTConfig
  assert {"GPT", "GPTBlock", "GPTConfig"} <= set(models.__all__)


@pytest.mark.parametrize(
  "overrides",
  [
    {},
    {"positions": "rope", "mlp": "swiglu", "tie_embeddings": False, "use_bias": False},
  ],
)
def test_param_count_and_chunked_loss_match_full_logits(overrides):
  cfg = GPTConfig.tiny(num_layers=1, loss_chunk=12, **overrides)  # 12 does not divide 2 x 15
  model = GPT(cfg)
  tokens, targets = _pattern_batch(cfg.vocab_size, batch=2, seq=15)
  shapes = jax.eval_shape(model.init, jax.random.key(0), tokens)["params"]
  assert sum(p.size for p in jax.tree.leaves(shapes)) == cfg.num_params()
  assert ("lm_head" in shapes) != cfg.tie_embeddings and ("wpe" in shapes) == (cfg.positions == "learned")

  @jax.jit
  def both(key):  # one program: init, then both losses
    params = model.init(key, tokens)["params"]
    logits = model.apply({"params": params}, tokens)
    full = optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()
    return full, model.apply({"params": params}, tokens, targets)

  full, chunked = both(jax.random.key(0))
  assert chunked.dtype == jnp.float32
  np.testing.assert_allclose(chunked, full, rtol=1e-5)


def test_chunked_cross_entropy_gradient_and_float32_softmax():
  rng = np.random.default_rng(1)
  h = jnp.asarray(rng.standard_normal((7, 8)), jnp.bfloat16)
  w = jnp.asarray(rng.standard_normal((8, 32)), jnp.bfloat16)
  t = jnp.arange(7) % 32
  full = lambda h, w: optax.softmax_cross_entropy_with_integer_labels((h @ w).astype(jnp.float32), t).mean()
  chunked = lambda h, w: chunked_cross_entropy(h, w, t, 3)
  grads = jax.jit(lambda h, w: (jax.grad(chunked, (0, 1))(h, w), jax.grad(full, (0, 1))(h, w)))
  for a, b in zip(*grads(h, w)):
    assert a.dtype == jnp.bfloat16
    np.testing.assert_allclose(a.astype(jnp.float32), b.astype(jnp.float32), atol=2e-2)
  # The log-softmax runs in float32 inside the chunk loop, whatever the inputs.
  jaxpr = str(jax.make_jaxpr(chunked)(h, w))
  assert "reduce_max" in jaxpr and "f32[3,32]" in jaxpr


def test_presets_and_config_checks():
  assert 120e6 < GPTConfig.gpt_125m().num_params() < 130e6
  one_b = GPTConfig.gpt_1b()
  assert (one_b.d_model, one_b.num_layers, one_b.num_heads, one_b.vocab_size, one_b.max_len) == (
    2048,
    24,
    16,
    32768,
    2048,
  )
  assert 1.2e9 < one_b.num_params() < 1.4e9
  assert 1.5e9 < GPTConfig.gpt_1_5b().num_params() < 1.6e9
  for bad in ({"remat": "all"}, {"positions": "alibi"}, {"mlp": "relu"}, {"num_heads": 5}):
    with pytest.raises(ValueError, match="GPTConfig"):
      GPTConfig.tiny(**bad)


@pytest.mark.parametrize("remat", ["dots_saveable", "nothing_saveable"])
def test_remat_wraps_each_block(remat):
  cfg = GPTConfig.tiny(num_layers=2, remat=remat)
  model = GPT(cfg)
  tokens, targets = _pattern_batch(cfg.vocab_size, batch=1, seq=8)
  params = jax.eval_shape(model.init, jax.random.key(0), tokens)["params"]
  grad = jax.grad(lambda p: model.apply({"params": p}, tokens, targets))
  jaxpr = str(jax.make_jaxpr(grad)(params))
  assert jaxpr.count("checkpoint[") + jaxpr.count("remat") >= cfg.num_layers


def test_tiny_gpt_trains_with_make_train_step():
  cfg = GPTConfig.tiny(num_layers=1)
  model = GPT(cfg)
  tokens, targets = _pattern_batch(cfg.vocab_size)
  params = jax.jit(model.init)(jax.random.key(0), tokens)["params"]
  step = jmp_train.make_train_step(*gpt_train_fns(model), optax.adam(3e-3), policy="mixed_bfloat16")
  state = step.init(params)
  losses = []
  for _ in range(12):
    state, metrics = step(state, ((tokens, targets), None))
    losses.append(float(metrics["loss"]))
  assert np.all(np.isfinite(losses))
  assert losses[-1] < 0.6 * losses[0], losses
  assert jax.tree.leaves(state.params)[0].dtype == jnp.float32


@pytest.fixture(scope="module")
def measured():
  """bench_gpt's measurement of both steps on CPU, tiny (also its code path)."""
  return bench_gpt.measure(GPTConfig.tiny(num_layers=1), 2, 16, repeats=1, warmup=1)


def test_mixed_step_has_the_floors_matmuls_and_no_extra_weight_casts(measured):
  floor, library = measured
  assert (floor["variant"], library["variant"]) == ("floor", "library")
  # The same dot ops with the same operand dtypes, all bfloat16.
  assert library["hlo_dot_dtypes"] == floor["hlo_dot_dtypes"]
  assert library["hlo_dots"] == floor["hlo_dots"] > 0
  assert all(k.startswith("bf16xbf16x") for k in floor["hlo_dot_dtypes"]), floor
  # A cast down and a gradient cast back per weight, and nothing more.
  assert 0 < library["weight_converts"] <= floor["weight_converts"]


def test_measure_records(measured):
  for r in measured:
    assert set(bench_gpt.COLUMNS) <= r.keys()
    assert r["median_ms"] > 0 and r["tokens_per_s"] > 0 and r["tflops"] > 0
    assert r["peak_tflops"] is None and r["fraction_of_peak"] is None  # a CPU: no peak
    assert isinstance(r["xla_flags"], str)
    # The roofline's prediction of the step on the detected chip (the CPU here), next to the measured time.
    assert r["roofline_chip"] == "cpu" and r["roofline_ms"] > 0 and "roofline_error" not in r
    assert r["roofline_over_measured"] == pytest.approx(r["roofline_ms"] / r["median_ms"])
  assert measured[0]["vs_floor"] == 1.0


def test_hlo_profile_counts_dots_and_weight_sized_converts():
  def f(w, x):
    return (x @ w.astype(jnp.bfloat16)).astype(jnp.float32).sum()

  w, x = jnp.ones((8, 16)), jnp.ones((4, 8), jnp.bfloat16)
  text = jax.jit(jax.grad(f, (0, 1))).lower(w, x).as_text()
  profile = bench_gpt.hlo_profile(text, [w.shape])
  assert profile["dots"] == {("bf16", "bf16", "bf16"): 2}
  assert profile["weight_converts_by"] == {((8, 16), "f32", "bf16"): 1, ((8, 16), "bf16", "f32"): 1}
