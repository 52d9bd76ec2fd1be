"""The default policy decides per operation, whatever layers the model is built from.

Models of their own layers (``helpers/user_layer_models.py``: a norm class,
an ``Embed`` subclass, hand-written einsum attention, ``nnx.Einsum``
projections, a tied head), in linen and NNX, through
``make_train_step(model, ..., policy=...)`` with default settings. On the
step's program, as lowered (StableHLO) and as compiled (HLO): every weight
product in the compute dtype (in FP8 under ``mixed_float8``, attention's two
activation products staying bfloat16), no exp or log in half precision, no
half-precision sum over 1,024 elements or more (norm-scale and bias
gradients are such sums: 1,024 tokens a step), no half-precision scatter
(the embedding's gradient). The audits read the step itself and name the
model's own source lines.
"""

from __future__ import annotations

import functools
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jmp_train
import jmp_train.diagnostics as diag
import jmp_train.flax

from helpers import user_layer_models as ulm

HALF = {"mixed_bfloat16": "bf16", "mixed_float16": "f16"}
KINDS = ("linen", "nnx")
BATCH = ulm.token_batch()


def _loss(logits, targets):
  return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), targets).mean()


@functools.cache
def _linen_variables():
  return ulm.LinenUserLayersLM().init(jax.random.key(0), BATCH[0])


@functools.cache
def _built(kind: str, policy: str):
  """``(step, state)`` with default settings, the model passed as users pass it."""
  kwargs = {"policy": policy}
  if policy == "mixed_float16":
    kwargs["loss_scale"] = jmp_train.DynamicLossScale(2.0**15)
  if kind == "linen":
    step = jmp_train.make_train_step(ulm.LinenUserLayersLM(), _loss, optax.adam(1e-3), **kwargs)
    return step, step.init(_linen_variables()["params"], inputs=BATCH[0])
  step = jmp_train.make_train_step(ulm.NnxUserLayersLM(nnx.Rngs(0)), _loss, optax.adam(1e-3), **kwargs)
  return step, step.init(inputs=BATCH[0])


@functools.cache
def _lowered(kind: str, policy: str):
  step, state = _built(kind, policy)
  return step.lower(state, BATCH)


# ---------------------------------------------------------------------------
# Reading the programs (independent of the library's own readers).

_MLIR_TYPE = r"tensor<((?:\d+x)*)(\w+)>"
_MLIR_PRODUCT = re.compile(rf"stablehlo\.(?:dot_general|convolution)\b.*:\s*\({_MLIR_TYPE},\s*{_MLIR_TYPE}\)")
_MLIR_REDUCE = re.compile(
  rf"stablehlo\.reduce\(.*applies stablehlo\.(\w+) across dimensions = \[([\d, ]*)\] : \({_MLIR_TYPE}"
)
_MLIR_ELEMENTWISE = re.compile(rf"stablehlo\.(exponential|log|exponential_minus_one|log_plus_one)\b.*{_MLIR_TYPE}")
_MLIR_SCATTER = re.compile(rf"stablehlo\.scatter.*:\s*\({_MLIR_TYPE}")


def _dims(text: str) -> tuple[int, ...]:
  return tuple(int(d) for d in text.split("x") if d)


def _mlir_findings(text: str, half: str) -> dict[str, list[str]]:
  """Products by operand types, and half-precision exp/log, large sums, scatters."""
  found = {"products": [], "half_math": [], "half_sums": [], "half_scatters": []}
  for line in text.splitlines():
    if m := _MLIR_PRODUCT.search(line):
      found["products"].append(f"{m.group(2)} x {m.group(4)}")
    if (m := _MLIR_ELEMENTWISE.search(line)) and m.group(3) == half:
      found["half_math"].append(line.strip())
    if (m := _MLIR_REDUCE.search(line)) and m.group(1) == "add" and m.group(4) == half:
      shape = _dims(m.group(3))
      if math.prod(shape[int(a)] for a in m.group(2).split(",") if a.strip()) >= 1024:
        found["half_sums"].append(line.strip())
    if (m := _MLIR_SCATTER.search(line)) and m.group(2) == half:
      found["half_scatters"].append(line.strip())
  return found


_HLO_COMPUTATION = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) .*\{$")
_HLO_REDUCE = re.compile(r"\breduce\((\w+)\[([\d,]*)\][^)]*\), dimensions=\{([\d,]*)\}, to_apply=%?([\w.\-]+)")
_HLO_MATH = re.compile(r"= (\w+)\[[\d,]*\][^ ]* (exponential|log|exponential-minus-one|log-plus-one)\(")
_HLO_SCATTER = re.compile(r"= (\w+)\[[\d,]*\][^ ]* scatter\(")


def _hlo_findings(text: str, half: str) -> dict[str, list[str]]:
  """The compiled program's half-precision exp/log, sums over 1,024+ elements, scatters."""
  bodies, name = {}, None
  for line in text.splitlines():
    if m := _HLO_COMPUTATION.match(line.strip()):
      name = m.group(1)
      bodies[name] = []
    elif name is not None:
      bodies[name].append(line)
  adds = {n for n, body in bodies.items() if any(" add(" in b for b in body) and len(body) <= 6}
  found = {"half_math": [], "half_sums": [], "half_scatters": []}
  for line in text.splitlines():
    if (m := _HLO_MATH.search(line)) and m.group(1) == half:
      found["half_math"].append(line.strip())
    if (m := _HLO_REDUCE.search(line)) and m.group(1) == half and m.group(4) in adds:
      shape = tuple(int(d) for d in m.group(2).split(",") if d)
      if math.prod(shape[int(a)] for a in m.group(3).split(",") if a) >= 1024:
        found["half_sums"].append(line.strip())
    if (m := _HLO_SCATTER.search(line)) and m.group(1) == half:
      found["half_scatters"].append(line.strip())
  return found


# ---------------------------------------------------------------------------


@pytest.mark.parametrize("policy", tuple(HALF))
@pytest.mark.parametrize("kind", KINDS)
def test_every_product_narrow_and_every_sensitive_op_in_float32(kind, policy):
  half = HALF[policy]
  lowered = _lowered(kind, policy)
  found = _mlir_findings(lowered.as_text(), half)
  # 2 blocks x (qkv or q+kv, 2 attention products, out, up, down) plus the
  # head, each with its backward pass: far more than a lost model would leave.
  assert len(found["products"]) >= 30, found["products"]
  assert set(found["products"]) == {f"{half} x {half}"}, found["products"]
  for what in ("half_math", "half_sums", "half_scatters"):
    assert not found[what], f"{what}:\n" + "\n".join(found[what][:10])
  if policy == "mixed_bfloat16":  # what XLA made of it: still no half-precision sums
    compiled = _hlo_findings(lowered.compile().as_text(), half)
    for what, lines in compiled.items():
      assert not lines, f"compiled {what}:\n" + "\n".join(lines[:10])


@pytest.mark.parametrize("kind", KINDS)
def test_fp8_reaches_every_weight_product_of_layers_of_its_own(kind):
  step, state = _built(kind, "mixed_float8")
  report = diag.fp8_products(step, state, BATCH)
  found = _mlir_findings(step.lower(state, BATCH).as_text(), "bf16")["products"]
  assert len(report.products) == len(found)
  fp8 = [p for p in found if p.startswith("f8")]
  # Attention's activation products (scores and weighted sum: 2 forward, 4
  # backward per block) stay in the compute dtype, as Transformer Engine's
  # recipe keeps them; every other product is FP8.
  assert len(found) - len(fp8) == 6 * ulm.LAYERS, found
  assert len(report.not_fp8) == 6 * ulm.LAYERS, str(report)
  assert all(p.lhs_dtype == jnp.bfloat16 and p.rhs_dtype == jnp.bfloat16 for p in report.not_fp8), str(report)


def _site_states(kind: str, state) -> dict:
  """The FP8 site states of a step's state (arrays), by site name."""
  if kind == "nnx":
    return nnx.to_pure_dict(state.model_state["autocast_sites"])
  return state.model_state["fp8_meta"]["autocast_sites"]


@pytest.mark.parametrize("kind", KINDS)
def test_fp8_products_keep_delayed_scaling_state_by_site(kind):
  # Transformer Engine's delayed scaling for every FP8 product, whatever layer
  # it sits in: nnx.Einsum projections, einsums of parameters, the tied head.
  step, state = _built(kind, "mixed_float8")
  states = _site_states(kind, state)
  fp8 = [p for p in _mlir_findings(step.lower(state, BATCH).as_text(), "bf16")["products"] if p.startswith("f8")]
  assert 3 * len(states) == len(fp8), (sorted(states), len(fp8))  # forward and both gradients, each site
  assert all(not np.any(np.asarray(v)) for s in states.values() for k, v in s.items() if "history" in k)
  state = jax.tree.map(jnp.copy, state)  # the step donates its state; _built's is shared
  if kind == "nnx":
    kernel = np.asarray(state.params["blocks"][0]["down"]["kernel"])
  else:
    kernel = np.asarray(state.params["Block_0"]["Dense_1"]["kernel"])
  new_state, metrics = step(state, BATCH)
  assert np.isfinite(float(metrics["loss"]))
  new = _site_states(kind, new_state)
  assert sorted(new) == sorted(states)
  for name, s in new.items():
    for operand in ("input", "kernel", "output_grad"):
      history = np.asarray(s[f"{operand}_amax_history"])
      assert history[0] > 0 and not np.any(history[1:]), (name, operand, history)
  # The kernel's amax is the weight's own (bfloat16) max |w| before the step.
  (site,) = [n for n in new if n.startswith("blocks/0/down/") or "Block_0/Dense_1/" in n]
  expected = np.max(np.abs(np.asarray(jnp.asarray(kernel, jnp.bfloat16), np.float32)))
  assert float(new[site]["kernel_amax_history"][0]) == expected


def test_fp8_site_states_survive_a_checkpoint_and_resume_bit_for_bit(tmp_path):
  step, state = _built("nnx", "mixed_float8")
  state, _ = step(jax.tree.map(jnp.copy, state), BATCH)
  jmp_train.save_checkpoint(tmp_path / "step_1", state)
  restored = jmp_train.restore_checkpoint(tmp_path / "step_1", state)
  saved = _site_states("nnx", restored)
  assert saved and all(np.asarray(s["input_amax_history"])[0] > 0 for s in saved.values())
  after, _ = step(jax.tree.map(jnp.copy, state), BATCH)
  resumed, _ = step(restored, BATCH)
  jax.tree.map(np.testing.assert_array_equal, _site_states("nnx", resumed), _site_states("nnx", after))
  jax.tree.map(np.testing.assert_array_equal, resumed.params, after.params)


@pytest.mark.parametrize("kind", KINDS)
def test_keep_leaves_the_chosen_weight_products_in_the_compute_dtype(kind):
  # The first block out of FP8 (as one keeps a first layer or a head), by its
  # path; every other weight product stays FP8, and no site state is made
  # for the kept ones.
  block = "blocks/0" if kind == "nnx" else "Block_0"
  model = ulm.NnxUserLayersLM(nnx.Rngs(0)) if kind == "nnx" else ulm.LinenUserLayersLM()
  step = jmp_train.make_train_step(model, _loss, optax.adam(1e-3), policy="mixed_float8", keep=block)
  if kind == "nnx":
    state = step.init(inputs=BATCH[0])
  else:
    state = step.init(_linen_variables()["params"], inputs=BATCH[0])
  found = _mlir_findings(step.lower(state, BATCH).as_text(), "bf16")["products"]
  base_step, base_state = _built(kind, "mixed_float8")
  base = _mlir_findings(base_step.lower(base_state, BATCH).as_text(), "bf16")["products"]
  kept_sites = [n for n in _site_states(kind, base_state) if block in n]
  assert kept_sites and len(found) == len(base)
  fp8 = [p for p in found if p.startswith("f8")]
  assert len(fp8) == len([p for p in base if p.startswith("f8")]) - 3 * len(kept_sites)
  assert sorted(_site_states(kind, state)) == sorted(set(_site_states(kind, base_state)) - set(kept_sites))


def test_keep_rules_that_match_nothing_or_cannot_apply_name_the_fix():
  step = jmp_train.make_train_step(ulm.LinenUserLayersLM(), _loss, optax.adam(1e-3), policy="mixed_int8", keep="hed")
  with pytest.raises(ValueError, match=r"keep rule\(s\) \['hed'\] match no weight product.*Block_0"):
    step.lower(step.init(_linen_variables()["params"]), BATCH)
  with pytest.raises(ValueError, match=r"model_policy='flax' does not run the model under autocast"):
    jmp_train.make_train_step(ulm.LinenUserLayersLM(), _loss, optax.sgd(0.1), keep="head", model_policy="flax")
  with pytest.raises(TypeError, match=r"keep must be a site name or glob pattern"):
    jmp_train.make_train_step(ulm.LinenUserLayersLM(), _loss, optax.sgd(0.1), keep=[3])


def _scanned_stack(variables, x):
  """A plain function: an input projection, a scanned stack of layers, a head."""
  p = variables["params"]
  h = x @ p["w_in"]
  h, _ = jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), h, p["stack"])
  return h @ p["head"]


def _mse(outputs, targets):
  return jnp.mean(jnp.square(outputs.astype(jnp.float32) - targets))


def test_fp8_sites_in_a_scan_keep_current_scaling_and_replicas_agree_on_the_rest():
  rng = np.random.default_rng(0)
  params = {
    "w_in": jnp.asarray(rng.normal(size=(16, 32)) / 4, jnp.float32),
    "stack": jnp.asarray(rng.normal(size=(3, 32, 32)) / 6, jnp.float32),
    "head": jnp.asarray(rng.normal(size=(32, 4)) / 6, jnp.float32),
  }
  # Each replica's share of the batch has its own max |x|.
  x = (rng.normal(size=(16, 16)) * np.arange(1, 17)[:, None]).astype(np.float32)
  batch = (x, np.zeros((16, 4), np.float32))
  step = jmp_train.make_train_step(_scanned_stack, _mse, optax.sgd(0.1), policy="mixed_float8", mode="shard_map")
  with pytest.raises(ValueError, match=r"inputs="):
    step.init(params)
  state = step.init(params, inputs=x[:2])
  states = state.model_state["fp8_meta"]["autocast_sites"]
  # The two products outside the loop keep a state; the scanned one none.
  assert len(states) == 2 and not any("scan" in n for n in states), sorted(states)
  report = diag.fp8_products(step, state, step.shard_batch(batch))
  assert report.products and not report.not_fp8, str(report)
  state, _ = step(state, step.shard_batch(batch))
  first = step.unreplicate(state.model_state)["fp8_meta"]["autocast_sites"][min(states)]
  # The global batch's max |x| (in bfloat16), whichever replica saw it.
  expected = np.max(np.abs(np.asarray(jnp.asarray(x, jnp.bfloat16), np.float32)))
  assert float(np.asarray(first["input_amax_history"])[0]) == expected


@pytest.mark.parametrize("kind", KINDS)
def test_audits_read_the_step_and_name_the_models_lines(kind):
  step, state = _built(kind, "mixed_bfloat16")
  report = diag.precision_audit(step, state, BATCH)
  report.assert_clean()
  assert report.half_ops > 0 and report.float32_ops > 0
  tensor_cores = diag.tensor_core_report(step, state, BATCH)
  attention = [e for e in tensor_cores.entries if "user_layer_models.py" in e.where]
  assert len(attention) >= 2 * ulm.LAYERS, [e.where for e in tensor_cores.entries]
  assert not any("interpreter.py" in e.where or "autocast" in e.where for e in tensor_cores.entries), [
    e.where for e in tensor_cores.entries
  ]


def test_fp8_products_takes_a_step_with_its_state_and_batch_only():
  step, state = _built("linen", "mixed_bfloat16")
  with pytest.raises(TypeError, match=r"fp8_products\(step, state, batch\)"):
    diag.fp8_products(step, state)
  with pytest.raises(TypeError, match="only after a jmp_train.TrainStep"):
    diag.fp8_products(step.lower(state, BATCH), state)


class _TwoInputs(nnx.Module):
  """Called as Flax's Gemma is: tokens and positions (and an optional mask)."""

  def __init__(self):
    self.embed = nnx.Embed(ulm.VOCAB, 8, rngs=nnx.Rngs(0))
    self.pos = nnx.Embed(ulm.LENGTH, 8, rngs=nnx.Rngs(1))

  def __call__(self, tokens, positions, attention_mask=None):
    x = self.embed(tokens) + self.pos(positions)
    return self.embed.attend(x if attention_mask is None else x * attention_mask[..., None])


@pytest.mark.parametrize(
  "policy, model_policy", [("float32", "auto"), ("mixed_bfloat16", "auto"), ("mixed_bfloat16", "flax")]
)
def test_an_nnx_module_of_several_arguments_takes_them_from_a_tuple_or_a_dict(policy, model_policy):
  tokens, targets = BATCH
  positions = np.broadcast_to(np.arange(ulm.LENGTH, dtype=np.int32), tokens.shape)
  model = _TwoInputs()
  expected = _loss(model(tokens, positions), targets)
  step = jmp_train.make_train_step(model, _loss, optax.sgd(0.1), policy=policy, model_policy=model_policy)
  rtol = 1e-6 if policy == "float32" else 1e-2
  _, metrics = step(step.init(), ((tokens, positions), targets))
  np.testing.assert_allclose(metrics["loss"], expected, rtol=rtol)
  _, metrics = step(step.init(), ({"tokens": tokens, "positions": positions}, targets))
  np.testing.assert_allclose(metrics["loss"], expected, rtol=rtol)
  with pytest.raises(TypeError, match=r"_TwoInputs.__call__.*module\(\*inputs\).*module\(\*\*inputs\)"):
    step(step.init(), (tokens, targets))


def test_rules_match_nnx_submodules_by_path_as_linen_ones():
  """NNX writes no module path into the trace; autocast names each submodule's call by its path."""
  tokens = BATCH[0]
  rules = dict(float32_ops=(*jmp_train.DEFAULT_FLOAT32_OPS, "scope:blocks/1/attn"))
  nnx_fn = jmp_train.autocast(lambda model, x: model(x), "mixed_bfloat16", **rules)
  jaxpr = jax.make_jaxpr(nnx_fn)(ulm.NnxUserLayersLM(nnx.Rngs(0)), tokens)
  linen_rules = dict(float32_ops=(*jmp_train.DEFAULT_FLOAT32_OPS, "scope:Block_1/EinsumAttention_0"))
  linen_fn = jmp_train.autocast(ulm.LinenUserLayersLM().apply, "mixed_bfloat16", **linen_rules)
  linen_jaxpr = jax.make_jaxpr(linen_fn)(_linen_variables(), tokens)
  # NNX: q, kv, scores, weighted sum, out; linen: qkv, scores, weighted sum, out.
  for found, inside, count in ((jaxpr, "blocks/1/attn", 5), (linen_jaxpr, "Block_1/EinsumAttention_0", 4)):
    products = [
      (str(e.source_info.name_stack), e.invars[0].aval.dtype)
      for e in found.jaxpr.eqns
      if e.primitive.name == "dot_general"
    ]
    assert products, found
    for scope, dtype in products:
      assert dtype == (jnp.float32 if inside in scope else jnp.bfloat16), (scope, dtype)
    assert sum(inside in scope for scope, _ in products) == count, products


def test_mixed_int8_reaches_products_per_operation_and_apply_policy_refuses_it():
  step, state = _built("nnx", "mixed_int8")
  text = step.lower(state, BATCH).as_text()
  products = _mlir_findings(text, "bf16")["products"]
  # Every forward weight product on int8 operands (q, kv, o, up, down per
  # block, and the tied head); attention and the backward pass in the compute
  # dtype (float32 operands for the backward on XLA:CPU, which refuses some
  # bf16 x bf16 -> f32 products).
  assert products.count("i8 x i8") == 5 * ulm.LAYERS + 1, products
  assert products.count("bf16 x bf16") >= 2 * ulm.LAYERS, products
  assert set(products) <= {"i8 x i8", "bf16 x bf16", "f32 x f32"}, products
  with pytest.raises(ValueError, match="no Flax layer runs int8 products.*autocast"):
    jmp_train.flax.apply_policy(ulm.LinenUserLayersLM(), "mixed_int8")


def test_audits_read_a_step_built_with_compiler_options():
  """FP8 steps on GPUs carry compiler options, which an enclosing make_jaxpr refuses."""
  kwargs = dict(policy="mixed_bfloat16", compiler_options={"xla_embed_ir_in_executable": False})
  step = jmp_train.make_train_step(ulm.NnxUserLayersLM(nnx.Rngs(0)), _loss, optax.adam(1e-3), **kwargs)
  diag.precision_audit(step, step.init(), BATCH).assert_clean()
