"""Tests of the half-precision weight updates: small steps survive, unbiased and exact landing.

kahan_compensation, stochastic_rounding, modified_momentum_sgd.
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jmp_train
from helpers.low_precision import F32
from helpers.low_precision import F16
from helpers.low_precision import HALF_DTYPES
from helpers.low_precision import _eps
from helpers.low_precision import _run


# ---------------------------------------------------------------------------
# The failure being fixed: small steps vanish in half precision.
# ---------------------------------------------------------------------------

N_PARAMS, N_STEPS = 4096, 100


def _vanishing_setup(dtype):
  """Weights in (0.5, 1), gradients in [0.5, 1.5], lr*g < half an ulp."""
  rng = np.random.default_rng(0)
  w0 = jnp.asarray(rng.uniform(0.55, 0.95, N_PARAMS), F32).astype(dtype)
  grads = jnp.asarray(rng.uniform(0.5, 1.5, (N_STEPS, N_PARAMS)), F32)
  half_ulp = _eps(dtype) / 4  # ulp on [0.5, 1) is eps/2
  lr = 0.6 * half_ulp / 1.5  # every step is below 0.6 of half an ulp
  return w0, grads, lr


@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=lambda d: d.__name__)
def test_plain_sgd_leaves_half_weights_unchanged(dtype):
  w0, grads, lr = _vanishing_setup(dtype)
  w, _ = _run(optax.sgd(lr), w0, grads.astype(dtype))
  np.testing.assert_array_equal(np.asarray(w), np.asarray(w0))
  # Whereas float32 moves them by ~30% of an ulp per step (sanity check).
  w32, _ = _run(optax.sgd(lr), w0.astype(F32), grads)
  assert float(jnp.abs(w32 - w0.astype(F32)).min()) > 10 * lr


@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=lambda d: d.__name__)
def test_kahan_tracks_float32_within_one_ulp(dtype):
  w0, grads, lr = _vanishing_setup(dtype)
  opt = optax.chain(optax.sgd(lr), jmp_train.kahan_compensation())
  w, state = _run(opt, w0, grads.astype(dtype))
  w32, _ = _run(optax.sgd(lr), w0.astype(F32), grads.astype(dtype).astype(F32))
  ulp = _eps(dtype) / 2
  err = jnp.abs(w.astype(F32) - w32)
  # Stated tolerance: every weight within one ulp of the float32 trajectory.
  assert float(err.max()) <= ulp, float(err.max()) / ulp
  # And what rounding dropped is in the buffer: p + c is the float32 weight,
  # up to the buffer's own rounding, at most 2^-p ulp per step (p the
  # dtype's precision bits): here at most 0.2 ulp (bfloat16), 0.025 (float16).
  comp = state[1].compensation
  assert comp.dtype == dtype
  total = w.astype(F32) + comp.astype(F32)
  bound = N_STEPS * ulp * _eps(dtype) / 4
  assert float(jnp.abs(total - w32).max()) <= bound
  moved = jnp.abs(w32 - w0.astype(F32))
  assert float(moved.min()) > 10 * ulp  # the float32 weights moved far


@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=lambda d: d.__name__)
def test_stochastic_rounding_tracks_float32_on_average(dtype):
  w0, grads, lr = _vanishing_setup(dtype)
  grads = grads.astype(dtype)
  opt = optax.chain(optax.sgd(lr), jmp_train.stochastic_rounding(seed=3))
  w, _ = _run(opt, w0, grads)
  w32, _ = _run(optax.sgd(lr), w0.astype(F32), grads.astype(F32))
  moved = w.astype(F32) - w0.astype(F32)
  moved32 = w32 - w0.astype(F32)
  # Per weight the error is a sum of N_STEPS independent roundings (std at
  # most sqrt(N_STEPS)/2 ulp = 5 ulp); the mean over 4096 weights has a std
  # below 0.08 ulp, 0.5% of the ~15 ulp displacement. Tolerance: 3%.
  rel = abs(float(moved.mean() - moved32.mean())) / abs(float(moved32.mean()))
  assert rel < 0.03, rel
  ulp = _eps(dtype) / 2
  assert float(jnp.abs(moved - moved32).max()) <= 8 * np.sqrt(N_STEPS) / 2 * ulp


@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=lambda d: d.__name__)
def test_modified_momentum_moves_half_weights_like_float32(dtype):
  w0, grads, lr = _vanishing_setup(dtype)
  grads = grads.astype(dtype)
  # Plain SGD at this lr is frozen (test above); the modified momentum's step
  # settles at lr*g/(1-m) = 10 lr*g, several ulps, which survives rounding.
  w, state = _run(jmp_train.modified_momentum_sgd(lr, momentum=0.9), w0, grads)
  assert state.momentum.dtype == dtype
  w32, _ = _run(optax.sgd(lr, momentum=0.9), w0.astype(F32), grads.astype(F32))
  moved = w.astype(F32) - w0.astype(F32)
  moved32 = w32 - w0.astype(F32)
  # Stated tolerance: the total displacement within 5% (relative L2 error);
  # each step is rounded to nearest, so the error is a fraction of an ulp per
  # step against a step of several ulps.
  rel = float(jnp.linalg.norm(moved - moved32) / jnp.linalg.norm(moved32))
  assert rel < 0.05, rel
  # Plain SGD at the same lr does not move at all (relative error 1).
  frozen, _ = _run(optax.sgd(lr), w0, grads)
  assert float(jnp.linalg.norm(frozen.astype(F32) - w0.astype(F32))) == 0.0


def _tiny_momentum_setup(dtype):
  """As _vanishing_setup, but even the momentum's step lr*g/(1-m) vanishes."""
  w0, grads, lr = _vanishing_setup(dtype)
  return w0, grads.astype(dtype), lr / 10  # lr*g/(1-0.9) < 0.6 half-ulp


@pytest.mark.parametrize("nesterov", [False, True], ids=["heavy_ball", "nesterov"])
@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=lambda d: d.__name__)
def test_error_feedback_moves_where_the_plain_rule_freezes(dtype, nesterov):
  w0, grads, lr = _tiny_momentum_setup(dtype)
  m = 0.9
  ulp = _eps(dtype) / 2  # weights in [0.5, 1)
  run = lambda ef: _run(jmp_train.modified_momentum_sgd(lr, m, nesterov=nesterov, error_feedback=ef), w0, grads)
  plain, _ = run(False)
  with_feedback, state = run(True)
  w32, _ = _run(optax.sgd(lr, m, nesterov=nesterov), w0.astype(F32), grads.astype(F32))
  assert state.momentum.dtype == dtype and with_feedback.dtype == dtype
  moved32 = w32 - w0.astype(F32)
  # float32 moves every weight by several ulps ...
  assert float(jnp.min(jnp.abs(moved32))) > 3 * ulp
  # ... the modified momentum rule without feedback moves none: every step
  # is below half an ulp ...
  np.testing.assert_array_equal(np.asarray(plain), np.asarray(w0))
  # ... and with error feedback each weight ends where float32's does, up to
  # the documented lag (what is still in the buffer, at most about
  # m/(1-m) = 9 half-ulps) plus a rounding.
  err = jnp.abs(with_feedback.astype(F32) - w32)
  assert float(jnp.max(err)) <= (m / (1 - m) / 2 + 1) * ulp, float(jnp.max(err) / ulp)
  # It lags behind float32, never overshoots on average.
  moved = with_feedback.astype(F32) - w0.astype(F32)
  assert float(jnp.mean(moved / moved32)) == pytest.approx(1.0, abs=0.35)
  assert float(jnp.mean(moved / moved32)) <= 1.0


@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=lambda d: d.__name__)
def test_error_feedback_conserves_the_dropped_steps(dtype):
  # What the weights did not take is in the buffer: the weights plus the
  # displacement the buffer will still cause, lr*m/(1-m)*G, equal float32's
  # weights plus its own pending displacement, to the buffer's rounding.
  w0, grads, lr = _tiny_momentum_setup(dtype)
  m = 0.9
  w, state = _run(jmp_train.modified_momentum_sgd(lr, m), w0, grads)
  w32, state32 = _run(optax.sgd(lr, m), w0.astype(F32), grads.astype(F32))
  pending = lambda buf: -lr * m / (1 - m) * buf.astype(F32)
  ours = w.astype(F32) + pending(state.momentum)
  ref = w32 + pending(state32[0].trace)
  # Each step rounds G (relative eps/2); the error each leaves in the
  # pending displacement is lr*m/(1-m)*|G|*eps/2.
  per_step = lr * m / (1 - m) * float(jnp.max(jnp.abs(state32[0].trace))) * _eps(dtype) / 2
  assert float(jnp.max(jnp.abs(ours - ref))) <= N_STEPS * per_step
  # Without feedback the rule loses all of it: far more than the bound above.
  w_plain, st = _run(jmp_train.modified_momentum_sgd(lr, m, error_feedback=False), w0, grads)
  plain_err = jnp.abs(w_plain.astype(F32) + pending(st.momentum) - ref)
  assert float(jnp.min(plain_err)) > 10 * N_STEPS * per_step


def test_error_feedback_without_momentum_or_learning_rate_is_the_plain_rule():
  w0, grads, lr = _tiny_momentum_setup(F16)
  schedule = lambda count: jnp.where(count % 2 == 0, lr, 0.0)  # lr = 0 half the time
  for m, rate in ((0.0, lr), (0.9, schedule)):
    ours, state = _run(jmp_train.modified_momentum_sgd(rate, m), w0, grads)
    plain, plain_state = _run(jmp_train.modified_momentum_sgd(rate, m, error_feedback=False), w0, grads)
    chex.assert_tree_all_finite(state.momentum)
    if m == 0.0:  # nothing to carry the error in: bit for bit the plain rule
      np.testing.assert_array_equal(np.asarray(ours), np.asarray(plain))
      np.testing.assert_array_equal(np.asarray(state.momentum), np.asarray(plain_state.momentum))


def test_error_feedback_is_a_no_op_when_nothing_rounds():
  # float32 weights, steps far above an ulp: the same weights as the rule
  # without feedback, up to float32 roundings.
  params = jnp.asarray([1.0, -2.0, 3.0], F32)
  grads = jnp.asarray(np.random.default_rng(0).normal(size=(6, 3)), F32)
  ours, _ = _run(jmp_train.modified_momentum_sgd(0.1, 0.8), params, grads)
  plain, _ = _run(jmp_train.modified_momentum_sgd(0.1, 0.8, error_feedback=False), params, grads)
  np.testing.assert_allclose(np.asarray(ours), np.asarray(plain), rtol=1e-6)


# ---------------------------------------------------------------------------
# Stochastic rounding is unbiased and lands exactly.
# ---------------------------------------------------------------------------


_SR_UNBIASED = jmp_train.stochastic_rounding(seed=11)


@jax.jit
def _two_rounded_steps(params, u32):
  """Two stochastic_rounding steps of u32 from params, and round to nearest."""
  state = _SR_UNBIASED.init(params)
  updates, new_state = _SR_UNBIASED.update(u32, state, params)
  updates2, _ = _SR_UNBIASED.update(u32, new_state, params)
  new = optax.apply_updates(params, updates)
  nearest = (params.astype(F32) + u32).astype(params.dtype)
  return updates, updates2, new, nearest, state.key, new_state.key


@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=lambda d: d.__name__)
@pytest.mark.parametrize("fraction", [0.3, -0.1, 0.5])
def test_stochastic_rounding_is_unbiased(dtype, fraction):
  # One compiled program per dtype, shared by the fractions.
  n = 1 << 15
  params = np.ones(n, dtype)  # ulp above 1 is eps, below 1 is eps/2
  ulp = _eps(dtype) if fraction > 0 else _eps(dtype) / 2
  u32 = np.full(n, fraction * ulp, np.float32)
  updates, updates2, new, nearest, key, new_key = _two_rounded_steps(params, u32)
  assert updates.dtype == F32
  new32 = np.asarray(new.astype(F32))
  # Every draw is one of the two neighbours of 1 + u.
  lo, hi = (1.0, 1.0 + ulp) if fraction > 0 else (1.0 - ulp, 1.0)
  assert set(np.unique(new32)) <= {lo, hi}
  # Mean of the rounded updates vs the float32 update, within 5 sigma.
  p = abs(fraction)
  sigma = ulp * np.sqrt(p * (1 - p) / n)
  mean = float(np.mean(new32 - 1.0))
  assert abs(mean - fraction * ulp) < 5 * sigma, (mean, fraction * ulp, sigma)
  # Round to nearest is biased: every weight lands on the same value.
  nearest = np.asarray(nearest.astype(F32))
  assert abs(float(np.mean(nearest - 1.0)) - fraction * ulp) > 5 * sigma
  # The key advances, so the next step draws differently.
  assert not np.array_equal(np.asarray(new_key), np.asarray(key))
  assert not np.array_equal(np.asarray(updates2), np.asarray(updates))


@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=lambda d: d.__name__)
def test_updates_land_bit_exactly(dtype):
  rng = np.random.default_rng(1)
  n = 2048
  params = jnp.asarray(rng.normal(0, 1, n), F32).astype(dtype)
  # Mostly tiny updates, some large (a tenth of the weight), some zero.
  scale = np.where(rng.random(n) < 0.1, 1e-1, 1e-4)
  scale[:16] = 0.0
  u = jnp.asarray(rng.normal(0, 1, n) * scale, F32).astype(dtype)
  comp0 = jnp.asarray(rng.normal(0, 1e-4, n), F32).astype(dtype)

  def representable(target):
    # p' - p is exact in the half dtype when p'/2 <= p <= 2p' (Sterbenz).
    t, p = target.astype(dtype).astype(F32), params.astype(F32)
    return ((t / 2 <= p) & (p <= 2 * t)) | ((t / 2 >= p) & (p >= 2 * t))

  kahan = jmp_train.kahan_compensation()
  sr = jmp_train.stochastic_rounding(seed=0)

  # One compiled program for both updates and their references (op by op,
  # every eager operation would compile on its own).
  @jax.jit
  def land(params, u, comp0):
    out, state = kahan.update(u, jmp_train.KahanCompensationState(comp0), params)
    target = params.astype(F32) + (u.astype(F32) + comp0.astype(F32))
    new = optax.apply_updates(params, out)
    left = (u.astype(F32) + comp0.astype(F32)) - (new.astype(F32) - params.astype(F32))
    kahan_out = dict(
      out=out,
      compensation=state.compensation,
      new=new,
      target=target.astype(dtype),
      exact=representable(target),
      left=left.astype(dtype),
    )
    out, _ = sr.update(u, sr.init(params), params)
    new = optax.apply_updates(params, out).astype(F32)
    target = params.astype(F32) + u.astype(F32)
    below = jnp.nextafter(target.astype(dtype), jnp.asarray(-jnp.inf, dtype)).astype(F32)
    above = jnp.nextafter(target.astype(dtype), jnp.asarray(jnp.inf, dtype)).astype(F32)
    nearest = target.astype(dtype).astype(F32)
    sr_out = dict(
      new=new, target=target, below=below, above=above, nearest=nearest, representable=representable(target)
    )
    return kahan_out, sr_out

  k, r = jax.tree.map(np.asarray, land(params, u, comp0))
  assert k["out"].dtype == dtype and k["compensation"].dtype == dtype
  exact = k["exact"]
  assert float(exact.mean()) > 0.97  # all but the few steps ~ the weight
  np.testing.assert_array_equal(k["new"][exact].view(np.uint16), k["target"][exact].view(np.uint16))
  # The new buffer is exactly what was not applied.
  np.testing.assert_array_equal(k["compensation"], k["left"])

  new, target, below, above, nearest = (r["new"], r["target"], r["below"], r["above"], r["nearest"])
  # new is a neighbour of the target in dtype: the nearest or the other one.
  ok = (new == nearest) | ((new == below) & (below < target)) | ((new == above) & (above > target))
  assert bool(ok[r["representable"]].all())
  exact = nearest == target
  np.testing.assert_array_equal(new[exact], target[exact])


def test_kahan_resets_non_finite_compensation():
  params = jnp.ones(3, F16)
  kahan = jmp_train.kahan_compensation()
  u = jnp.asarray([jnp.inf, jnp.nan, 1e5], F32)  # the last overflows float16
  out, state = kahan.update(u, kahan.init(params), params)
  np.testing.assert_array_equal(np.asarray(state.compensation), np.zeros(3))
  assert out.dtype == F32


def test_kahan_in_float32_beats_round_to_nearest():
  # Classic same-precision Kahan summation: 10^4 additions of 1e-8 to 1.0.
  params = jnp.ones(2, F32)
  u = jnp.full(2, 1e-8, F32)
  grads = jnp.broadcast_to(u, (10_000, 2))
  scale = optax.GradientTransformation(lambda p: optax.EmptyState(), lambda g, s, p=None: (g, s))
  plain, _ = _run(scale, params, grads)
  comp, _ = _run(optax.chain(scale, jmp_train.kahan_compensation()), params, grads)
  assert float(plain[0]) == 1.0  # every addition vanished
  np.testing.assert_allclose(np.asarray(comp), 1.0001, rtol=1e-7)
