r"""1-bit Adam: Adam whose momentum crosses devices as 1 bit per element.

1-bit gradients in front of Adam feed it ``ḡ_t + r_{t-1} - r_t`` (``r`` the
error-feedback residual): part of every gradient arrives steps late, and
Adam's second moment squares that error. Here each replica updates the
momentum with its *own* gradient and the momentum goes through the 1-bit
exchange ``C`` of :func:`jmp_train.sign_compression`; the average replaces
it on every replica (Tang et al., 2021):

.. math::
  m_j = \beta_1 m + (1-\beta_1) g_j, \qquad m \leftarrow C(m_1, \dots, m_K).

What the residuals hold back is then part of a slowly varying average, and
no gradient arrives late.

* **warm-up** (``count < warmup_steps``): ``optax.adamw`` on the ``pmean``
  of the gradients (a float all-reduce); **after**, ``v`` is frozen and the
  update is :math:`-\eta_t(\mathrm{clip}_B(\hat m/(\sqrt{\hat v}+\epsilon))
  + \lambda p)`. The switch is a ``lax.cond`` on the step counter, the same
  on every replica: after warm-up no float all-reduce of gradient size runs.
* ``clip_step`` (default on): ``clip_B`` clips each element to
  :math:`B = \max((1-\beta_1)/\sqrt{1-\beta_2}, 1)`, Kingma & Ba's bound on
  an Adam step (Sec. 2.1), which exact Adam does not exceed and a frozen
  ``v`` can; off, ``clip_B`` is the identity (the paper).
* ``rescale_variance`` (default on): each tensor's frozen ``v`` follows the
  change of its gradients' size. With ``s_ℓ`` the bias-corrected
  ``β2``-average of the replicas' mean of ``mean(g_j²)`` over tensor ``ℓ``
  (one float per tensor, all in one all-reduce), the step's :math:`\hat v_\ell`
  is the frozen one times :math:`s_\ell(t) / s_\ell(f)`, ``f`` the
  last step that updated ``v``. Off: ``v`` stays as frozen (the paper).
* ``variance_refresh=k`` (0/1 Adam, Lu et al.): every ``k``-th step after
  warm-up is exact (a float all-reduce): ``m`` takes the exact average and
  :math:`v \leftarrow \beta_2^k v + (1-\beta_2^k)\bar g^2`.
* ``exchange="preconditioned"`` sends ``m / (sqrt(v_hat) + eps)``, each
  element clipped to the same bound, and multiplies back (the preconditioner
  is the same on every replica).

Elements whose frozen ``v`` is 0 keep ``m = 0``: a later gradient there
would step by ``m/eps``. Bias corrections follow ``optax.adamw``; with
``warmup_steps`` past the last step the optimizer is ``optax.adamw`` on the
averaged gradients.

State: ``mu`` and ``nu`` are the same on every replica; the residuals inside
``compression`` are per replica (:func:`jmp_train.sign_compression_specs`).
They survive checkpoints, depend on the replica count (``update`` raises
``ValueError`` on a state made for another) and need the same
``bucket_bytes``. Moments are float32; updates come out in the gradients'
dtypes.

References:
  Tang et al., "1-bit Adam: Communication Efficient Large-Scale Training
  with Adam's Convergence Speed", ICML 2021. https://arxiv.org/abs/2102.02888
  Lu et al., "Maximizing Communication Efficiency for Large-scale Training
  via 0/1 Adam", ICLR 2023. https://arxiv.org/abs/2202.06009
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from jmp_train._src.hyperparams import check_axis_name, check_bool, check_int, check_learning_rate, check_non_negative
from jmp_train._src.hyperparams import check_unit, check_warmup_steps, is_number, is_static_zero, value_at
from jmp_train._src.leaf_checks import check_leaves
from jmp_train._src.compression.replica_averaging import ReplicaOptimizer
from jmp_train._src.compression.sign_compression import SignCompressionState, sign_compression
from jmp_train._src.compression.sign_layout import axis_size
from jmp_train._src.varying_axes import cond

__all__ = ["OneBitAdamState", "one_bit_adam"]

EXCHANGES = ("momentum", "preconditioned")


class OneBitAdamState(NamedTuple):
  """State of :func:`one_bit_adam`.

  Attributes:
    count: int32 scalar, steps taken (the same on every replica).
    mu: float32 first moment, the same on every replica.
    nu: float32 second moment, frozen after warm-up.
    compression: the :class:`jmp_train.SignCompressionState` of the
      momentum exchange (per-replica worker and server residuals).
    sq_mean: with ``rescale_variance``, per tensor, the float32 scalar
      ``β2``-average of the replicas' mean squared gradient (else ``None``).
    sq_mean_ref: with ``rescale_variance``, ``sq_mean`` at the last step that
      updated ``nu`` (else ``None``).
  """

  count: jax.Array
  mu: Any
  nu: Any
  compression: SignCompressionState
  sq_mean: Any = None
  sq_mean_ref: Any = None


def one_bit_adam(
  learning_rate: optax.ScalarOrSchedule,
  b1: float = 0.9,
  b2: float = 0.999,
  eps: float = 1e-8,
  weight_decay: float = 0.0,
  *,
  axis_name: str,
  warmup_steps: int,
  scale: str = "l2",
  exchange: str = "momentum",
  variance_refresh: int = 0,
  clip_step: bool = True,
  rescale_variance: bool = True,
  num_replicas: int | None = None,
  bucket_bytes: int | None = None,
) -> optax.GradientTransformation:
  r"""1-bit Adam (AdamW): Adam whose momentum crosses devices as 1 bit per element.

  Input: each replica's *local* gradients. Warm-up, for ``warmup_steps``
  steps: ``optax.adamw`` on their ``pmean``. Then, with ``v`` frozen:

  .. math::
    m_j = \beta_1 m + (1-\beta_1) g_j,\quad m \leftarrow C(m_1..m_K),\quad
    u = -\eta_t \Big(\mathrm{clip}_B\Big(\frac{m/(1-\beta_1^t)}{\sqrt{v/(1-\beta_2^W)}
    +\epsilon}\Big) + \lambda p\Big)

  where ``C`` is :func:`jmp_train.sign_compression` (worker and server error
  feedback, packed all-to-all + all-gather) and ``clip_B`` clips each
  element to Kingma & Ba's bound on an Adam step,
  ``B = max((1-β1)/sqrt(1-β2), 1)``, with ``clip_step`` (else the
  identity). With ``rescale_variance``, each tensor's ``v`` is multiplied by
  the change of its mean squared gradient since the freeze. Both are on by
  default: a ``v`` frozen early keeps the size of the early, large
  gradients and holds back every later step, and a step whose momentum
  outgrew the frozen ``v`` can throw the weights out of a minimum. Pass
  ``clip_step=False, rescale_variance=False`` for Tang et al.'s frozen-``v``
  rule.

  Args:
    learning_rate: a float or a schedule ``count -> lr``.
    b1: decay of the first moment.
    b2: decay of the second moment (during warm-up).
    eps: added to ``sqrt(v_hat)``.
    weight_decay: decoupled weight decay ``λ`` (AdamW); needs ``params``.
    axis_name: the replicas' mapped axis (``pmap`` / ``shard_map``).
    warmup_steps: exact Adam steps before ``v`` freezes (DeepSpeed's
      ``freeze_step``; its tutorials freeze after a sixth to a quarter of
      the steps). At least 1.
    scale: reconstruction values of the exchange: ``"l2"`` (1-bit Adam's
      ``‖m‖₂/√d`` per tensor), ``"l1"`` or ``"column"``.
    exchange: what crosses devices: ``"momentum"`` (``m``, Tang et al.)
      or ``"preconditioned"`` (``m / (sqrt(v_hat) + eps)``, each element
      clipped to Kingma & Ba's bound on an Adam step, multiplied back: the
      1-bit scales and residuals are then those of the update, and a few
      elements with a tiny ``v`` cannot amplify the quantization error).
    variance_refresh: ``0`` (default): ``v`` stays frozen after warm-up.
      ``k > 0``: every ``k``-th step after warm-up is an exact step (a float
      all-reduce of the gradients) that updates ``m`` and ``v`` (0/1 Adam's
      sparse variance updates): ``v <- b2**k v + (1 - b2**k) ḡ²``, what
      ``k`` Adam steps with that gradient would give. Pair it with
      ``clip_step`` or ``exchange="preconditioned"``.
    clip_step: clip each element of every step after warm-up (refreshes
      included) to Kingma & Ba's bound ``B`` on an Adam step, which exact
      Adam does not exceed; a frozen ``v`` and the 1-bit exchange's error
      can. ``True`` (default): without it, one step whose momentum outgrew
      the frozen ``v`` can throw the weights out of a minimum, or to NaN.
      ``False`` with ``rescale_variance=False``: the paper's rule as written.
    rescale_variance: let each tensor's frozen ``v`` follow the change of
      its gradients' size: ``v · ŝ_t / ŝ_f``, where ``ŝ`` is the
      bias-corrected ``β2``-average of the replicas' mean of
      ``mean(g_j²)`` over the tensor (one float per tensor crosses devices
      each step, in one all-reduce) and ``ŝ_f`` its value when ``v`` was
      last updated. ``True`` (default); ``False``: ``v`` stays as frozen
      (the paper's rule).
    num_replicas: size of ``axis_name``, for ``init`` outside a mapped
      context.
    bucket_bytes: ``None``: one 1-bit exchange for the whole tree; an int:
      one per bucket of about this many float32 bytes, last leaves first
      (:func:`jmp_train.sign_compression`'s ``bucket_bytes``: the results
      and the state do not depend on it).

  Returns:
    An ``optax.GradientTransformation`` with state :class:`OneBitAdamState`.

  Raises:
    ValueError: for a bad ``axis_name``, ``warmup_steps``, ``scale``,
      ``exchange``, ``variance_refresh``, ``clip_step``, ``rescale_variance``
      or ``bucket_bytes``, a
      ``learning_rate`` number that is not finite and > 0, ``b1`` or ``b2``
      outside ``[0, 1)``, or a negative ``eps`` or ``weight_decay``; at trace time
      for a non-floating leaf (mask it out with ``optax.masked``) or a state
      made for another replica count or other parameters.

  Examples:
    >>> import jax, jax.numpy as jnp, optax
    >>> k = jax.local_device_count()
    >>> tx = one_bit_adam(1e-2, axis_name="i", warmup_steps=1)
    >>> params = {"w": jnp.ones((k, 4, 3))}
    >>> state = jax.pmap(tx.init, axis_name="i")(params)
    >>> grads = {"w": jnp.arange(k * 12.0).reshape(k, 4, 3)}
    >>> step = jax.pmap(tx.update, axis_name="i")
    >>> for _ in range(2):  # one exact step, one compressed
    ...   updates, state = step(grads, state, params)
    >>> bool((updates["w"] == updates["w"][0]).all()), int(state.count[0])
    (True, 2)

  References:
    Tang et al., "1-bit Adam: Communication Efficient Large-Scale Training
    with Adam's Convergence Speed", ICML 2021. https://arxiv.org/abs/2102.02888

    Loshchilov, Hutter, "Decoupled Weight Decay Regularization", ICLR 2019.
    https://arxiv.org/abs/1711.05101

    Lu, Li, Zhang, De Sa, He, "Maximizing Communication Efficiency for
    Large-scale Training via 0/1 Adam", ICLR 2023.
    https://arxiv.org/abs/2202.06009
  """
  _check_arguments(
    learning_rate,
    b1,
    b2,
    eps,
    weight_decay,
    axis_name,
    warmup_steps,
    exchange,
    variance_refresh,
    clip_step,
    rescale_variance,
  )
  compression = sign_compression(axis_name, scale=scale, num_replicas=num_replicas, bucket_bytes=bucket_bytes)
  k, warmup_steps = int(variance_refresh), int(warmup_steps)
  decay = not is_static_zero(weight_decay)
  step_bound = _step_bound(b1, b2)
  covered = functools.partial(_covered, warmup_steps=warmup_steps, refresh=k)
  exact_step = functools.partial(_exact_step, warmup_steps=warmup_steps, refresh=k)
  # The second moment's bias correction (frozen between refreshes).
  c2 = lambda t: 1 - b2 ** covered(t).astype(jnp.float32)

  def init_fn(params):
    check_leaves(params, "parameters", "one_bit_adam")

    def zeros(per_tensor=False):
      # New buffers on every call: a donated step cannot donate one buffer
      # twice, so no two leaves (mu and nu) may share one.
      shape = (lambda p: ()) if per_tensor else jnp.shape
      return jax.tree.map(lambda p: jnp.zeros(shape(p), jnp.float32), params)

    mu = zeros()
    return OneBitAdamState(
      count=jnp.zeros((), jnp.int32),
      mu=mu,
      nu=zeros(),
      compression=compression.init(mu),
      sq_mean=zeros(per_tensor=True) if rescale_variance else None,
      sq_mean_ref=zeros(per_tensor=True) if rescale_variance else None,
    )

  def scaled(nu, c, factor):
    """``v_hat``: ``v / c``, times each tensor's factor with ``rescale_variance``."""
    if factor is None:
      return jax.tree.map(lambda v: v / c, nu)
    return jax.tree.map(lambda v, f: v / c * f, nu, factor)

  def sq_means(grads, state, t):
    """The new ``(sq_mean, sq_mean_ref)`` and each tensor's factor ``ŝ_t / ŝ_f`` on ``v``."""
    mean = _replicas_mean_square(grads, axis_name)
    sq = jax.tree.map(lambda s, x: b2 * s + (1 - b2) * x, state.sq_mean, mean)
    ref = jax.tree.map(lambda r, s: jnp.where(exact_step(state.count), s, r), state.sq_mean_ref, sq)
    # Both averages bias-corrected: sq over t steps, ref over those v covers.
    c_now, c_ref = 1 - b2 ** t.astype(jnp.float32), c2(t)
    factor = jax.tree.map(lambda s, r: jnp.where(r > 0, (s / c_now) / (r / c_ref), 1.0), sq, ref)
    return sq, ref, factor

  def warmup(grads, state, factor):
    del factor  # v is updated here, not scaled
    g = lax.pmean(optax.tree.cast(grads, jnp.float32), axis_name)
    mu = jax.tree.map(lambda m, x: b1 * m + (1 - b1) * x, state.mu, g)
    if not k:
      nu = jax.tree.map(lambda v, x: b2 * v + (1 - b2) * x * x, state.nu, g)
      return mu, nu, state.compression
    return (*_warmup_or_refresh(mu, state.nu, g, state.count < warmup_steps, b2, k), state.compression)

  def compressed(grads, state, factor):
    # Elements whose frozen v is 0 (no gradient in warm-up) keep m = 0: a
    # later gradient there would step by g/eps (DeepSpeed's exp_avg_mask,
    # derived from v instead of given).
    live = jax.tree.map(lambda v: v > 0, state.nu)
    mask = lambda tree: jax.tree.map(lambda x, ok: jnp.where(ok, x, 0.0), tree, live)
    local = jax.tree.map(lambda m, x: b1 * m + (1 - b1) * x, state.mu, optax.tree.cast(grads, jnp.float32))
    if exchange == "momentum":
      mu, cstate = compression.update(mask(local), state.compression)
      return mask(mu), state.nu, cstate
    # The frozen preconditioner d is the same on every replica: exchange m/d,
    # each element bounded by Kingma & Ba's bound on an Adam step: a stale v
    # cannot make a larger one, nor a tail that sets the chunks' scales.
    nu = scaled(state.nu, c2(state.count), factor)
    d = jax.tree.map(lambda v: jnp.sqrt(v) + eps, nu)
    limit = step_bound * (1 - b1 ** (state.count + 1).astype(jnp.float32))
    local = mask(jax.tree.map(lambda m, dd: jnp.clip(m / dd, -limit, limit), local, d))
    avg, cstate = compression.update(local, state.compression)
    return mask(jax.tree.map(jnp.multiply, avg, d)), state.nu, cstate

  def update_fn(updates, state, params=None):
    if decay and params is None:
      raise ValueError("one_bit_adam with weight_decay needs params in update.")
    leaves, _ = check_leaves(updates, "gradients", "one_bit_adam")
    # Before the first collective: its own error for an unbound axis is raw.
    axis_size(axis_name, None, "update", "one_bit_adam", leaves=leaves)
    # lax.cond, not jnp.where: a step runs either the float all-reduce or
    # the 1-bit exchange, never both; the counter is the same everywhere.
    t = optax.safe_increment(state.count)
    sq, ref, factor = sq_means(updates, state, t) if rescale_variance else (None, None, None)
    mu, nu, cstate = cond(exact_step(state.count), warmup, compressed, updates, state, factor)
    c1 = 1 - b1 ** t.astype(jnp.float32)
    c2_t = c2(t)
    lr = value_at(learning_rate, state.count)
    step = jax.tree.map(lambda m, v: (m / c1) / (jnp.sqrt(v) + eps), mu, scaled(nu, c2_t, factor))
    if clip_step:  # warm-up steps are Adam's own: no clip (an infinite bound)
      bound = jnp.where(state.count < warmup_steps, jnp.inf, step_bound)
      step = jax.tree.map(lambda x: jnp.clip(x, -bound, bound), step)
    if decay:
      step = jax.tree.map(lambda s, p: s + weight_decay * p.astype(jnp.float32), step, params)
    new = jax.tree.map(lambda s: -lr * s, step)
    return optax.tree.cast_like(new, updates), OneBitAdamState(t, mu, nu, cstate, sq, ref)

  return ReplicaOptimizer(init_fn, update_fn)


def _check_arguments(
  learning_rate,
  b1,
  b2,
  eps,
  weight_decay,
  axis_name,
  warmup_steps,
  exchange,
  variance_refresh,
  clip_step,
  rescale_variance,
) -> None:
  check_axis_name(axis_name)
  check_warmup_steps(warmup_steps, 1)
  check_learning_rate(learning_rate)
  check_unit(b1, "b1")
  check_unit(b2, "b2")
  check_non_negative(eps, "eps")
  check_non_negative(weight_decay, "weight_decay")
  if exchange not in EXCHANGES:
    raise ValueError(f"Unknown exchange {exchange!r}; valid: {', '.join(EXCHANGES)}.")
  check_bool(clip_step, "clip_step")
  check_bool(rescale_variance, "rescale_variance")
  check_int(variance_refresh, "variance_refresh", 0, note=" (0: v frozen)")


def _step_bound(b1, b2):
  """Kingma & Ba's bound on ``|m_hat / sqrt(v_hat)|`` (Sec. 2.1).

  ``(1 - b1) / sqrt(1 - b2)``, the step after a lone gradient spike, where
  that exceeds 1, else about 1. In ``jnp`` for injected (traced) rates.
  """
  if is_number(b1) and is_number(b2):
    return max((1 - b1) / float(np.sqrt(1 - b2)), 1.0)
  return jnp.maximum((1 - b1) / jnp.sqrt(1 - b2), 1.0)


def _covered(t, warmup_steps: int, refresh: int):
  """Steps of gradient history ``v`` stands for after ``t`` steps."""
  if not refresh:
    return jnp.minimum(t, warmup_steps)
  after = jnp.maximum(t - warmup_steps, 0)
  return jnp.minimum(t, warmup_steps) + after - after % refresh


def _exact_step(count, warmup_steps: int, refresh: int):
  """Warm-up, or (with refreshes) every ``refresh``-th step after it."""
  if not refresh:
    return count < warmup_steps
  return (count < warmup_steps) | ((count + 1 - warmup_steps) % refresh == 0)


def _replicas_mean_square(grads, axis_name: str):
  """Per leaf, the replicas' mean of ``mean(g**2)``: one all-reduce for the whole tree."""
  leaves, treedef = jax.tree.flatten(grads)
  if not leaves:  # no parameters: nothing to average (optax's empty-tree no-op)
    return grads
  local = jnp.stack([jnp.mean(jnp.square(x.astype(jnp.float32))) for x in leaves])
  return jax.tree.unflatten(treedef, list(lax.pmean(local, axis_name)))


def _warmup_or_refresh(mu, nu, g, in_warmup, b2, k: int):
  """``(mu, nu)`` after an exact step when ``v`` is refreshed every ``k`` steps.

  A refresh stands for the ``k`` steps since the last one, and revives no
  element whose ``v`` was 0 at the freeze (it keeps ``m = 0``, as after
  warm-up); a warm-up step is Adam's own.
  """
  keep, take = jnp.where(in_warmup, b2, b2**k), jnp.where(in_warmup, 1 - b2, 1 - b2**k)
  live = jax.tree.map(lambda v: in_warmup | (v > 0), nu)
  nu = jax.tree.map(lambda v, x, ok: jnp.where(ok, keep * v + take * x * x, v), nu, g, live)
  mu = jax.tree.map(lambda m, ok: jnp.where(ok, m, 0.0), mu, live)
  return mu, nu
