"""1-bit Adam and 1-bit momentum SGD against NumPy references, step by step."""

from __future__ import annotations


import jax
import numpy as np
import optax
import pytest

from jmp_train import one_bit_adam, one_bit_momentum

from helpers.sign_reference import buffer_residual, ref_from_chunks, ref_step
from helpers.one_bit import AXIS, B1, B2, EPS, SHAPES, adam, leaves_of, make_tree, momentum, pmapped


# ---------------------------------------------------------------------------
# NumPy reference: the 1-bit exchange (worker + server error feedback, K
# owners, tests/helpers/sign_reference.py) and 1-bit Adam on top of it, from the
# papers' description.
# ---------------------------------------------------------------------------


def ref_exchange(values, r, e, scale):
  """1-bit average of K replicas' trees (the reference exchange). values: K lists of leaves.

  Returns (averaged leaves, new worker residuals (K, N), new server
  residuals (K, S)).
  """
  return ref_step(values, r, e, scale)[:3]


def ref_covered(t, warmup, refresh):
  """Steps of gradient history v stands for after t steps."""
  after = max(t - warmup, 0)
  return min(t, warmup) + (after - after % refresh if refresh else 0)


def ref_adam_step(grads, params, state, *, lr, wd, warmup, scale, exchange, refresh=0, clip_step=False, rescale=False):
  """One step of 1-bit Adam for K replicas from the (replicated) state.

  grads: K lists of leaves; params, mu, nu: lists of leaves; state: dict with
  count, mu, nu, r (K, n_pad), e (K, S). ``refresh``: an exact step every
  ``refresh`` steps after warm-up, v decayed by B2**refresh. ``clip_step``:
  the steps after warm-up (refreshes too) are clipped to Kingma & Ba's
  bound. ``rescale``: v is multiplied per leaf by the bias-corrected B2
  average of the replicas' mean squared gradient over its value when v was
  last updated (state s, s_ref). Returns (updates, new state).
  """
  k, count = len(grads), state["count"]
  mu, nu, r, e = state["mu"], state["nu"], state["r"], state["e"]
  exact = count < warmup or (refresh and (count + 1 - warmup) % refresh == 0)
  t = count + 1
  factor = [np.float32(1)] * len(mu)
  s, s_ref = state.get("s"), state.get("s_ref")
  if rescale:
    sq = [np.mean([np.mean(np.square(grads[j][i])) for j in range(k)]) for i in range(len(mu))]
    s = [B2 * a + (1 - B2) * q for a, q in zip(s, sq)]
    s_ref = list(s) if exact else s_ref
    # In float32, as the optimizer computes them (1 - B2**t cancels digits).
    c_now, c_ref = (np.float32(1) - np.float32(B2) ** np.float32(n) for n in (t, ref_covered(t, warmup, refresh)))
    factor = [(a / c_now) / (b / c_ref) if b > 0 else 1.0 for a, b in zip(s, s_ref)]
  if exact:
    keep = B2 if count < warmup else B2**refresh
    g = [np.mean([grads[j][i] for j in range(k)], axis=0, dtype=np.float32) for i in range(len(mu))]
    live = [np.full(v.shape, count < warmup) | (v > 0) for v in nu]
    mu = [np.where(ok, B1 * m + (1 - B1) * x, 0) for m, x, ok in zip(mu, g, live)]
    nu = [np.where(ok, keep * v + (1 - keep) * x * x, v) for v, x, ok in zip(nu, g, live)]
  else:
    # Frozen preconditioner d (m/d is exchanged) or none (m is exchanged);
    # elements with v == 0 keep m == 0.
    if exchange == "preconditioned":
      c2 = np.float32(1) - np.float32(B2) ** np.float32(ref_covered(count, warmup, refresh))
      d = [np.sqrt(v / c2 * f) + EPS for v, f in zip(nu, factor)]
      # No element beyond Kingma & Ba's step bound, (1 - B1) / sqrt(1 - B2) for m_hat.
      limit = np.float32(max((1 - B1) / np.sqrt(1 - B2), 1.0)) * np.float32(1 - B1 ** (count + 1))
    else:
      d = [np.ones_like(v) for v in nu]
      limit = np.inf
    local = [
      [
        np.where(v > 0, np.clip((B1 * m + (1 - B1) * x) / dd, -limit, limit), 0)
        for m, x, v, dd in zip(mu, grads[j], nu, d)
      ]
      for j in range(k)
    ]
    avg, r, e = ref_exchange(local, r, e, scale)
    mu = [np.where(v > 0, a * dd, 0) for a, v, dd in zip(avg, nu, d)]
  c1, c2 = 1 - B1**t, 1 - B2 ** ref_covered(t, warmup, refresh)
  bound = np.inf if count < warmup or not clip_step else max((1 - B1) / np.sqrt(1 - B2), 1.0)
  updates = [
    -lr * (np.clip((m / c1) / (np.sqrt(v / c2 * f) + EPS), -bound, bound) + wd * p)
    for m, v, p, f in zip(mu, nu, params, factor)
  ]
  return updates, dict(count=t, mu=mu, nu=nu, r=r, e=e, s=s, s_ref=s_ref)


# ---------------------------------------------------------------------------
# 1-bit Adam against the NumPy reference, step by step; conservation.
# ---------------------------------------------------------------------------


def adam_steps(
  k, *, lr=1e-2, wd=0.05, warmup=2, scale="l2", exchange="momentum", refresh=0, clip_step=False, rescale=False
):
  """(init, update) of 1-bit Adam pmapped over k devices, compiled once per configuration.

  The tests below build their optimizers here, so that the same
  configuration reuses the same compiled step (compiling is most of their
  time).
  """
  _, init, update = pmapped(
    k,
    adam,
    learning_rate=lr,
    weight_decay=wd,
    warmup_steps=warmup,
    scale=scale,
    exchange=exchange,
    variance_refresh=refresh,
    clip_step=clip_step,
    rescale_variance=rescale,
  )
  return init, update


# Each configuration compiles its own step (most of the test's time), so the
# options are combined rather than crossed: every replica count (2, 4, 8),
# scale, exchange and refresh period appears, the paper's rule (no clip, no
# rescale) with both exchanges, and clip_step and rescale_variance each with
# both exchanges and with refresh steps (which they also act on). The steps
# before the first refresh are those of variance_refresh=0. Four of the
# configurations are those of the tests below, which reuse their steps.
@pytest.mark.parametrize(
  "k, scale, exchange, refresh, clip_step, rescale",
  [
    (2, "column", "momentum", 0, False, False),
    (8, "l2", "momentum", 2, False, False),
    (4, "l2", "preconditioned", 3, False, False),
    (4, "l2", "preconditioned", 3, True, False),
    (4, "l2", "momentum", 2, True, False),
    (4, "l2", "momentum", 0, True, True),
    (4, "l2", "preconditioned", 3, False, True),
  ],
)
def test_adam_matches_numpy_reference_step_by_step(k, scale, exchange, refresh, clip_step, rescale):
  lr, wd, warmup = 1e-2, 0.05, 2
  init, update = adam_steps(
    k,
    lr=lr,
    wd=wd,
    warmup=warmup,
    scale=scale,
    exchange=exchange,
    refresh=refresh,
    clip_step=clip_step,
    rescale=rescale,
  )
  params = make_tree(k, seed=1)
  params = jax.tree.map(lambda x: np.broadcast_to(x[:1], x.shape), params)  # replicated
  state = init(params)
  p_np = leaves_of(params, 0)
  for step in range(7 if refresh else 5):
    grads = make_tree(k, seed=10 + step)
    before = dict(
      count=int(np.asarray(state.count)[0]),
      mu=leaves_of(state.mu, 0),
      nu=leaves_of(state.nu, 0),
      r=buffer_residual(state.compression.worker_residual, SHAPES, scale),
      e=np.asarray(state.compression.server_residual),
    )
    if rescale:
      before["s"], before["s_ref"] = leaves_of(state.sq_mean, 0), leaves_of(state.sq_mean_ref, 0)
    ref_u, ref = ref_adam_step(
      [leaves_of(grads, j) for j in range(k)],
      p_np,
      before,
      lr=lr,
      wd=wd,
      warmup=warmup,
      scale=scale,
      exchange=exchange,
      refresh=refresh,
      clip_step=clip_step,
      rescale=rescale,
    )
    residuals = (
      buffer_residual(state.compression.worker_residual, SHAPES, scale),
      np.asarray(state.compression.server_residual),
    )
    updates, state = update(grads, state, params)
    for j in range(k):  # every replica holds the same update and moments
      for a, b in zip(leaves_of(updates, j), ref_u):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-7)
      for a, b in zip(leaves_of(state.mu, j), ref["mu"]):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-7)
      for a, b in zip(leaves_of(state.nu, j), ref["nu"]):
        np.testing.assert_allclose(a, b, rtol=2e-6, atol=1e-9)
      if rescale:
        np.testing.assert_allclose(leaves_of(state.sq_mean, j), ref["s"], rtol=2e-6)
        np.testing.assert_allclose(leaves_of(state.sq_mean_ref, j), ref["s_ref"], rtol=2e-6)
    r_new = buffer_residual(state.compression.worker_residual, SHAPES, scale)
    np.testing.assert_allclose(r_new, ref["r"], rtol=2e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(state.compression.server_residual), ref["e"], rtol=2e-5, atol=1e-6)
    assert int(np.asarray(state.count)[0]) == step + 1
    if step < warmup:  # residuals untouched during warm-up
      np.testing.assert_array_equal(r_new, 0.0)
    else:
      assert np.abs(r_new).max() > 0
    exact = step < warmup or (refresh and (step + 1 - warmup) % refresh == 0)
    if exact:  # an exact step leaves both residuals as they were
      np.testing.assert_array_equal(r_new, residuals[0])
      np.testing.assert_array_equal(np.asarray(state.compression.server_residual), residuals[1])
    if refresh and step >= warmup:  # v moves on refresh steps only
      assert (ref["nu"][0] != before["nu"][0]).any() == bool(exact)


@pytest.mark.parametrize(
  "exchange, clip_step, refresh",
  [("preconditioned", True, 3), ("momentum", False, 0), ("preconditioned", False, 3), ("momentum", True, 2)],
)
def test_steps_never_go_beyond_adams_bound_unless_asked(exchange, clip_step, refresh):
  # After the freeze, gradients 1000x those of the warm-up: the frozen v no
  # longer holds the steps back. Kingma & Ba bound Adam's steps by
  # lr * (1 - B1) / sqrt(1 - B2) (Sec. 2.1); clip_step clips each element
  # of the step there, and the preconditioned exchange clips what it sends;
  # the momentum exchange without clip_step (the paper's rule) does not.
  # Steps 2 and 4 (refresh=2), 2, 3 and 5 (refresh=3) are compressed. The
  # parameters stay zero, so weight decay adds nothing: the cases with a
  # refresh reuse the steps of test_adam_matches_numpy_reference_step_by_step.
  k, lr, warmup = 4, 1e-2, 2
  init, update = adam_steps(k, lr=lr, warmup=warmup, exchange=exchange, refresh=refresh, clip_step=clip_step)
  params = jax.tree.map(np.zeros_like, make_tree(k, seed=0))
  state = init(params)
  largest = 0.0
  for step in range(warmup + 4):  # refreshes: steps 3 and 5 (refresh=2), step 4 (refresh=3)
    grads = make_tree(k, seed=30 + step, scale=1.0 if step < warmup else 1000.0)
    updates, state = update(grads, state, params)
    if step >= warmup:
      largest = max([largest] + [float(np.abs(u).max()) for u in leaves_of(updates)])
  bound = lr * (1 - B1) / np.sqrt(1 - B2)
  if exchange == "preconditioned" or clip_step:
    assert largest <= bound * (1 + 1e-5), (largest, bound)
  else:
    assert largest > 10 * bound, (largest, bound)


def test_defaults_clip_the_step_and_rescale_the_variance():
  # The defaults are the best measured configuration (clip_step and
  # rescale_variance on), not the paper's rule, which a user's CNN drove to
  # NaN: gradients 1000x the warm-up's must not make a step past Adam's bound.
  k, lr, warmup = 4, 1e-2, 2
  devices = jax.devices()[:k]
  tx = one_bit_adam(lr, axis_name=AXIS, warmup_steps=warmup)
  init = jax.pmap(tx.init, axis_name=AXIS, devices=devices)
  update = jax.pmap(tx.update, axis_name=AXIS, devices=devices)
  # The parameters stay zero: the reference's weight decay adds exactly
  # nothing, and its steps are those of test_adam_matches_numpy_reference_step_by_step.
  ref_init, ref_update = adam_steps(k, lr=lr, warmup=warmup, clip_step=True, rescale=True)
  params = jax.tree.map(np.zeros_like, make_tree(k, seed=0))
  state, ref_state = init(params), ref_init(params)
  assert state.sq_mean is not None
  largest = 0.0
  for step in range(warmup + 4):
    grads = make_tree(k, seed=30 + step, scale=1.0 if step < warmup else 1000.0)
    updates, state = update(grads, state, params)
    ref_updates, ref_state = ref_update(grads, ref_state, params)
    for a, b in zip(leaves_of(updates), leaves_of(ref_updates)):
      np.testing.assert_array_equal(a, b)
    if step >= warmup:
      largest = max([largest] + [float(np.abs(u).max()) for u in leaves_of(updates)])
  assert largest <= lr * (1 - B1) / np.sqrt(1 - B2) * (1 + 1e-5)


@pytest.mark.parametrize(
  "factory, exchange",
  [(adam, "momentum"), (adam, "preconditioned"), (momentum, None)],
  ids=["adam", "adam-preconditioned", "momentum"],
)
def test_both_residuals_conserve_the_exchanged_momentum_each_step(factory, exchange):
  # mean_j (m_j + r_j) == new momentum + mean_j r_j' + (e' - e), per element:
  # nothing the quantization drops is lost, with worker and server residuals.
  k = 4
  extra = {"exchange": exchange} if exchange else {}
  _, init, update = pmapped(k, factory, warmup_steps=1, scale="l2", **extra)
  params = jax.tree.map(lambda x: x * 0, make_tree(k, seed=0))
  state = init(params)
  coef = (B1, 1 - B1) if factory is adam else (0.9, 1.0)
  flat = lambda leaves: np.concatenate([x.ravel() for x in leaves])
  for step in range(4):
    grads = make_tree(k, seed=20 + step)
    trace = state.mu if factory is adam else state.trace
    limit = np.inf
    if exchange == "preconditioned":  # the exchange runs on m / (sqrt(v_hat) + eps), clipped
      d = flat(np.sqrt(v / (np.float32(1) - np.float32(B2))) + EPS for v in leaves_of(state.nu, 0))
      limit = max((1 - B1) / np.sqrt(1 - B2), 1.0) * (1 - B1 ** (step + 1))
    else:
      d = 1.0
    local = np.stack(
      [
        np.clip(
          flat(coef[0] * m + coef[1] * g for m, g in zip(leaves_of(trace, j), leaves_of(grads, j))) / d, -limit, limit
        )
        for j in range(k)
      ]
    )
    r0 = buffer_residual(state.compression.worker_residual, SHAPES, "l2")
    e0 = np.asarray(state.compression.server_residual).reshape(-1)
    _, state = update(grads, state, params)
    if step < 1:
      continue
    r1 = buffer_residual(state.compression.worker_residual, SHAPES, "l2")
    e1 = np.asarray(state.compression.server_residual).reshape(-1)
    new = state.mu if factory is adam else state.trace
    out = flat(leaves_of(new, 0)) / d
    decoded = local + r0 - r1  # each worker's message
    # Per leaf, every worker's decoded message takes the two values +-h.
    off = 0
    for shape in SHAPES.values():
      size = int(np.prod(shape))
      for j in range(k):
        part = np.abs(decoded[j, off : off + size])
        np.testing.assert_allclose(part, part.max(), rtol=1e-5)
      off += size
    # The server residuals in leaf order: what each owner kept of its part.
    e0, e1 = (ref_from_chunks(e, SHAPES, "l2", k) for e in (e0, e1))
    received = decoded.sum(0, dtype=np.float32) / k + e0 - e1
    np.testing.assert_allclose(out, received, rtol=1e-5, atol=1e-6)


def test_warmup_is_adamw_on_the_average_and_momentum_is_sgd():
  k, steps = 4, 3
  sched = optax.linear_schedule(1e-2, 1e-3, 10)
  cases = [
    (one_bit_adam(sched, weight_decay=0.1, axis_name=AXIS, warmup_steps=10), optax.adamw(sched, weight_decay=0.1)),
    (
      one_bit_momentum(sched, 0.9, axis_name=AXIS, warmup_steps=10, nesterov=True),
      optax.sgd(sched, 0.9, nesterov=True),
    ),
  ]
  for tx, ref in cases:
    devices = jax.devices()[:k]
    params = jax.tree.map(lambda x: np.broadcast_to(x[:1], x.shape), make_tree(k, seed=2))
    state = jax.pmap(tx.init, axis_name=AXIS, devices=devices)(params)
    step = jax.pmap(tx.update, axis_name=AXIS, devices=devices)
    rp = jax.tree.map(lambda x: x[0], params)
    rstate = ref.init(rp)
    ref_update = jax.jit(ref.update)
    for t in range(steps):
      grads = make_tree(k, seed=40 + t)
      updates, state = step(grads, state, params)
      # On the host: the next step's parameters as its first's (NumPy), not
      # device arrays, for which the pmapped step would be compiled again.
      params = jax.tree.map(lambda p, u: p + np.asarray(u), params, updates)
      ru, rstate = ref_update(jax.tree.map(lambda x: x.mean(0), grads), rstate, rp)
      rp = jax.tree.map(lambda p, u: p + np.asarray(u), rp, ru)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(rp)):
      np.testing.assert_allclose(np.asarray(a)[0], np.asarray(b), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("exchange", ["momentum", "preconditioned"])
def test_rescaled_variance_follows_adam_when_the_gradients_shrink(exchange):
  # Gradients c_t * S (S a fixed pattern of +-1 per leaf, the same on every
  # replica): the 1-bit exchange carries the momentum exactly, and Adam's v
  # is v_freeze times the change of mean(g^2), the rule rescale_variance
  # follows. After the freeze the gradients shrink 20x: the rescaled steps
  # stay Adam's, those of the frozen v fall behind.
  k, lr, warmup = 4, 1e-2, 3
  rng = np.random.default_rng(0)
  signs = {n: np.sign(rng.normal(size=s)).astype(np.float32) for n, s in SHAPES.items()}
  scales = [1.0] * warmup + [0.05] * 12
  ref = optax.adam(lr)
  rp = {n: np.zeros(s, np.float32) for n, s in SHAPES.items()}
  rstate, ref_steps, ref_update = ref.init(rp), [], jax.jit(ref.update)
  for c in scales:
    u, rstate = ref_update({n: c * x for n, x in signs.items()}, rstate)
    ref_steps.append(leaves_of(u))
  for rescale in (True, False):
    _, init, update = pmapped(
      k, adam, learning_rate=lr, warmup_steps=warmup, exchange=exchange, rescale_variance=rescale
    )
    params = {n: np.zeros((k,) + s, np.float32) for n, s in SHAPES.items()}
    state = init(params)
    for t, c in enumerate(scales):
      grads = {n: np.broadcast_to(c * x, (k,) + x.shape) for n, x in signs.items()}
      updates, state = update(grads, state, params)
      ratio = [np.abs(a[0]) / np.abs(b) for a, b in zip(leaves_of(updates), ref_steps[t])]
      if rescale or t < warmup:
        for r in ratio:
          np.testing.assert_allclose(r, 1.0, rtol=1e-4)
    if not rescale:  # the frozen v is ~3x Adam's sqrt(v) by now
      assert all(r.max() < 0.5 for r in ratio), [r.max() for r in ratio]


def test_adam_elements_without_warmup_gradient_stay_still():
  # v == 0 after warm-up (a dead input, a token never seen): a later gradient
  # would step by g / eps; the momentum there stays zero instead.
  k = 2
  _, init, update = pmapped(k, adam, warmup_steps=2)
  params = jax.tree.map(lambda x: x * 0, make_tree(k, seed=0))
  state = init(params)
  for step in range(4):
    grads = make_tree(k, seed=80 + step)
    if step < 2:
      grads["w"][:, 0, 0] = 0.0
    updates, state = update(grads, state, params)
  assert float(np.asarray(state.nu["w"])[0, 0, 0]) == 0.0
  np.testing.assert_array_equal(np.asarray(updates["w"])[:, 0, 0], 0.0)
  np.testing.assert_array_equal(np.asarray(state.mu["w"])[:, 0, 0], 0.0)
  assert np.all(np.abs(np.asarray(updates["w"])[:, 1:]) > 0)
