r"""1-bit Adam and 1-bit momentum SGD: the momentum, not the gradient, is compressed.

Why not compress the gradients in front of the optimizer
--------------------------------------------------------
:func:`jmp_train.sign_compression` chained *before* an optimizer averages the
replicas' gradients with 1-bit error feedback. With the worker residual
``r`` (the server residual adds a second, similar term), the optimizer sees

.. math::
  \hat g_t = \bar g_t + r_{t-1} - r_t ,

the true average plus what the quantizer held back at the previous step,
minus what it holds back now: part of every gradient reaches the optimizer
one or more steps late.

* Adam's second moment is not linear in its input: the error enters ``v``
  squared and never leaves it (Tang et al., 2021).
* Momentum SGD is linear, and the residual is conserved exactly and stays
  bounded, yet it is the *delay* that hurts: at the learning rates where
  momentum SGD trains fastest, it runs beyond plain SGD's stability limit
  (the heavy ball is stable up to ``lr·λ < 2(1+m)``, plain SGD up to
  ``lr·λ < 2``) and a gradient applied a step late destabilises it. The
  delayed part is then integrated by the momentum for ``~1/(1-m)`` steps.

So the divergence is inherent to error feedback on gradients in front of
momentum, not a defect of the compressor. The evidence (digits MLP, 8
replicas, momentum 0.9; ``benchmarks/bench_one_bit_convergence.py``, study
``momentum_lr``): both residuals stay bounded at every learning rate,
diverging runs included; exact momentum SGD fed the *exact* average
gradient one step late fails at the learning rates where gradient
compression fails, while the undelayed one trains; at those learning
rates, dropping the second delay stage (the server residual) helps, though
it costs accuracy at small ones; and per-tensor RMS scales
(``scale="l2"``) hold back more than ``"column"`` and fail earlier.

Compressing the momentum (1-bit Adam)
-------------------------------------
Each replica updates the momentum with its *own* gradient and the momentum
goes through the 1-bit exchange; its average replaces the momentum on every
replica. With ``K`` replicas, local gradient :math:`g_j` and the compressed
average :math:`C(\cdot)` (worker + server error feedback):

.. math::
  m_j = \beta_1 m + (1-\beta_1) g_j, \qquad m \leftarrow C(m_1, \dots, m_K).

The error per step is not smaller than with gradient compression (the
momentum is the larger vector), but what the residual holds back is now
part of the momentum, a slowly varying average, so releasing it a step
late barely changes the trajectory; no gradient arrives late.

1-bit Adam (Tang et al., 2021; DeepSpeed's ``OnebitAdam``):

* **warm-up** (``count < warmup_steps``): exact Adam on the ``pmean`` of the
  gradients (a float all-reduce), ``v`` updated as usual;
* **after**: ``v`` is frozen; the update is
  :math:`-\eta_t\,(\hat m / (\sqrt{\hat v} + \epsilon) + \lambda p)` with
  ``m`` from the compressed exchange (decoupled weight decay, AdamW).

For elements whose frozen ``v`` is zero (the weights of an input that is
always zero, an embedding row not seen during warm-up) a later gradient
would step by ``m/eps``: they keep ``m = 0`` (DeepSpeed asks the user for
such an ``exp_avg_mask``; here it comes from ``v``). Where ``v`` is tiny
but not zero, ``m/(sqrt(v)+eps)`` still amplifies the quantization error
of ``m``; ``exchange="preconditioned"`` exchanges ``m / d`` instead, with
the frozen preconditioner ``d = sqrt(v_hat) + eps`` (the same on every
replica, so the average is unchanged), and multiplies back: the 1-bit
scales and residuals are then those of the *update*. The default,
``exchange="momentum"``, exchanges ``m`` itself, as in the paper; on the
digits benchmark it did at least as well.

Bias corrections follow ``optax.adamw``: :math:`\hat m = m/(1-\beta_1^t)`;
the frozen :math:`\hat v = v/(1-\beta_2^{W})` with ``W = warmup_steps``. Run
with ``warmup_steps`` past the last step, the optimizer is
``optax.adamw`` on the averaged gradients.

Refreshing the second moment (0/1 Adam)
---------------------------------------
A ``v`` frozen early is the size of the early, large gradients: as they
shrink, every later step is smaller than Adam's. 0/1 Adam (Lu et al., 2022)
updates ``v`` on a sparse set of steps instead. ``variance_refresh=k``
(default 0: frozen, no float all-reduce after warm-up) makes every
``k``-th step after warm-up an *exact* step: the gradients are averaged
with a float all-reduce (as in warm-up), ``m`` takes the exact average and
``v`` takes it for the ``k`` steps since the last refresh,

.. math::
  v \leftarrow \beta_2^k v + (1-\beta_2^k)\,\bar g^2,

what ``k`` Adam steps with that gradient would give (the bias correction
then counts the steps ``v`` stands for: ``W`` plus the steps up to the last
refresh). Elements whose ``v`` is 0 at the freeze stay still (a refresh
gives them a tiny ``v`` that would amplify the quantization error of
``m``). The residuals are left as they are on those steps. The other
steps are 1-bit; a step's bytes on the wire average
``(1/k)·float + (1-1/k)·1-bit``. Pair refreshes with
``exchange="preconditioned"``: a refreshed ``v`` is smaller, and with
``exchange="momentum"`` the per-tensor quantization error of ``m`` is divided
by each element's own ``sqrt(v)``.

1-bit momentum SGD does the same with the momentum (trace) of
``optax.sgd(learning_rate, momentum)``: ``m_j = μ m + g_j``, the update is
:math:`-\eta_t\, C(m_1..m_K)`; with ``nesterov=True`` it is
:math:`-\eta_t\,((1+\mu) m_{new} - \mu m_{old})`, which equals
``g + μ m_new`` when the exchange is exact.

The switch is a ``lax.cond`` on the step counter, identical on every replica:
after warm-up the compiled step runs no float all-reduce of gradient size
(check with :func:`jmp_train.collective_bytes`: the float all-reduce lives
only in the warm-up branch; with ``warmup_steps=0`` there is no branch).

State and replicas
------------------
``mu``/``nu`` (``trace``) are identical on every replica (replicated,
``P()`` under ``shard_map``); the residuals inside ``compression`` are per
replica (``P(axis_name)``): :func:`jmp_train.sign_compression_specs` gives
the specs of the whole state. The residuals survive checkpoints (unlike
DeepSpeed, which resets them on load); they depend on the replica count,
and ``update`` raises ``ValueError`` on a state made for another count.
The moments are kept in float32; updates come out in the gradients' dtypes.

References:
  Tang, Gan, Awan, Rajbhandari, Li, Lian, Liu, Zhang, He, "1-bit Adam:
  Communication Efficient Large-Scale Training with Adam's Convergence
  Speed", ICML 2021. https://arxiv.org/abs/2102.02888

  Karimireddy, Rebjock, Stich, Jaggi, "Error Feedback Fixes SignSGD and
  other Gradient Compression Schemes", ICML 2019.
  https://arxiv.org/abs/1901.09847
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from jmp_train._src.sign_compression import SignCompressionState, sign_compression

__all__ = [
    "OneBitAdamState",
    "OneBitMomentumState",
    "one_bit_adam",
    "one_bit_momentum",
]

ScalarOrSchedule = float | Callable[[jax.Array], Any]
EXCHANGES = ("momentum", "preconditioned")


class OneBitAdamState(NamedTuple):
  """State of :func:`one_bit_adam`.

  Attributes:
    count: int32 scalar, steps taken (the same on every replica).
    mu: float32 first moment, the same on every replica.
    nu: float32 second moment, frozen after warm-up.
    compression: the :class:`jmp_train.SignCompressionState` of the
      momentum exchange (per-replica worker and server residuals).
  """

  count: jax.Array
  mu: Any
  nu: Any
  compression: SignCompressionState


class OneBitMomentumState(NamedTuple):
  """State of :func:`one_bit_momentum`.

  Attributes:
    count: int32 scalar, steps taken (the same on every replica).
    trace: float32 momentum buffer, the same on every replica.
    compression: the :class:`jmp_train.SignCompressionState` of the
      momentum exchange (per-replica worker and server residuals).
  """

  count: jax.Array
  trace: Any
  compression: SignCompressionState


def _check_common(axis_name, warmup_steps, minimum: int) -> None:
  if not isinstance(axis_name, str):
    raise ValueError(
        f"axis_name must be a string (the replicas' mapped axis), got {axis_name!r}."
    )
  if not isinstance(warmup_steps, (int, np.integer)) or warmup_steps < minimum:
    raise ValueError(
        f"warmup_steps must be an int >= {minimum}, got {warmup_steps!r}"
        + (": the frozen second moment comes from the warm-up." if minimum else ".")
    )


def _f32(tree):
  return jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), tree)


def _lr(learning_rate: ScalarOrSchedule, count: jax.Array) -> jax.Array:
  return jnp.asarray(learning_rate(count) if callable(learning_rate) else learning_rate, jnp.float32)


def _exchange(compression, local: Any, cstate: SignCompressionState, name: str):
  """``compression.update`` with a clear error for another replica count."""
  expected = jax.eval_shape(compression.init, local)
  for field in ("worker_residual", "server_residual"):
    want, got = getattr(expected, field).shape, getattr(cstate, field).shape
    if want != got:
      raise ValueError(
          f"{name} state's {field} has shape {got}, but these parameters on this "
          f"replica count need {want}: the state was made (or checkpointed) for "
          "another replica count or other parameters; init a new state (1-bit "
          "residuals cannot be moved between replica counts)."
      )
  return compression.update(local, cstate)


def _cast_like(tree, like):
  return jax.tree.map(lambda x, g: x.astype(g.dtype), tree, like)


def _varying(aval) -> frozenset:
  """The mesh axes over which a value varies under ``shard_map`` (else none)."""
  mat = getattr(aval, "manual_axis_type", None)
  return frozenset(mat.varying if mat is not None else getattr(aval, "vma", ()))


def _cond(pred, true_fun, false_fun, *operands):
  """``lax.cond`` whose branches may differ in ``shard_map``'s varying axes.

  Under ``shard_map`` a warm-up branch that ``pmean``s is invariant across
  replicas where the compressed branch's outputs vary (or the reverse), and
  ``lax.cond`` requires equal types: each output is marked varying over the
  union of both branches' axes (``lax.pcast``), which changes no value.
  """
  outs = [jax.make_jaxpr(f)(*operands).out_avals for f in (true_fun, false_fun)]
  axes = [_varying(a) | _varying(b) for a, b in zip(*outs)]

  def unified(fun):
    def branch(*args):
      flat, tree = jax.tree.flatten(fun(*args))
      flat = [
          lax.pcast(x, tuple(sorted(want - _varying(jax.typeof(x)))), to="varying")
          if want - _varying(jax.typeof(x)) else x
          for x, want in zip(flat, axes)
      ]
      return jax.tree.unflatten(tree, flat)
    return branch

  return lax.cond(pred, unified(true_fun), unified(false_fun), *operands)


def one_bit_adam(
    learning_rate: ScalarOrSchedule,
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
    num_replicas: int | None = None,
) -> optax.GradientTransformation:
  r"""1-bit Adam (AdamW): Adam whose momentum crosses devices as 1 bit per element.

  Input: each replica's *local* gradients. Warm-up, for ``warmup_steps``
  steps: ``optax.adamw`` on their ``pmean``. Then, with ``v`` frozen:

  .. math::
    m_j = \beta_1 m + (1-\beta_1) g_j,\quad m \leftarrow C(m_1..m_K),\quad
    u = -\eta_t \Big(\frac{m/(1-\beta_1^t)}{\sqrt{v/(1-\beta_2^W)}+\epsilon}
    + \lambda p\Big)

  where ``C`` is :func:`jmp_train.sign_compression` (worker and server error
  feedback, packed all-to-all + all-gather). See the module docstring.

  Args:
    learning_rate: a float or a schedule ``count -> lr``.
    b1: decay of the first moment.
    b2: decay of the second moment (during warm-up).
    eps: added to ``sqrt(v_hat)``.
    weight_decay: decoupled weight decay ``λ`` (AdamW); needs ``params``.
    axis_name: the replicas' mapped axis (``pmap`` / ``shard_map``).
    warmup_steps: exact Adam steps before ``v`` freezes (DeepSpeed's
      ``freeze_step``; their tutorials use 15–25% of the steps). At least 1.
    scale: reconstruction values of the exchange: ``"l2"`` (1-bit Adam's
      ``‖m‖₂/√d`` per tensor), ``"l1"`` or ``"column"``.
    exchange: what crosses devices: ``"momentum"`` (``m``, Tang et al.)
      or ``"preconditioned"`` (``m / (sqrt(v_hat) + eps)``, multiplied
      back after; see the module docstring).
    variance_refresh: ``0`` (default): ``v`` stays frozen after warm-up.
      ``k > 0``: every ``k``-th step after warm-up is an exact step (a float
      all-reduce of the gradients) that updates ``m`` and ``v`` (0/1 Adam's
      sparse variance updates; see the module docstring).
    num_replicas: size of ``axis_name``, for ``init`` outside a mapped
      context.

  Returns:
    An ``optax.GradientTransformation`` with state :class:`OneBitAdamState`.

  Raises:
    ValueError: for a bad ``axis_name``, ``warmup_steps``, ``scale``,
      ``exchange`` or ``variance_refresh``; at trace time for a state made for another replica count.

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
  _check_common(axis_name, warmup_steps, 1)
  if exchange not in EXCHANGES:
    raise ValueError(f"Unknown exchange {exchange!r}; valid: {', '.join(EXCHANGES)}.")
  if not isinstance(variance_refresh, (int, np.integer)) or variance_refresh < 0:
    raise ValueError(
        f"variance_refresh must be an int >= 0 (0: v frozen), got {variance_refresh!r}."
    )
  compression = sign_compression(axis_name, scale=scale, num_replicas=num_replicas)
  k = int(variance_refresh)

  def covered(t):
    """Steps of gradient history ``v`` stands for after ``t`` steps."""
    if not k:
      return jnp.minimum(t, warmup_steps)
    after = jnp.maximum(t - warmup_steps, 0)
    return jnp.minimum(t, warmup_steps) + after - after % k

  # The second moment's bias correction (frozen between refreshes).
  c2 = lambda t: 1 - b2 ** covered(t).astype(jnp.float32)

  def exact_step(count):
    """Warm-up, or (with refreshes) every k-th step after it."""
    if not k:
      return count < warmup_steps
    return (count < warmup_steps) | ((count + 1 - warmup_steps) % k == 0)

  def init_fn(params):
    zeros = jax.tree.map(lambda p: jnp.zeros(jnp.shape(p), jnp.float32), params)
    return OneBitAdamState(
        count=jnp.zeros((), jnp.int32), mu=zeros, nu=zeros, compression=compression.init(zeros)
    )

  def warmup(grads, state):
    g = lax.pmean(_f32(grads), axis_name)
    mu = jax.tree.map(lambda m, x: b1 * m + (1 - b1) * x, state.mu, g)
    if not k:
      nu = jax.tree.map(lambda v, x: b2 * v + (1 - b2) * x * x, state.nu, g)
      return mu, nu, state.compression
    # A refresh stands for the k steps since the last one, and revives no
    # element whose v was 0 at the freeze (it keeps m = 0, as after warm-up).
    in_warmup = state.count < warmup_steps
    keep, take = jnp.where(in_warmup, b2, b2**k), jnp.where(in_warmup, 1 - b2, 1 - b2**k)
    live = jax.tree.map(lambda v: in_warmup | (v > 0), state.nu)
    nu = jax.tree.map(lambda v, x, ok: jnp.where(ok, keep * v + take * x * x, v), state.nu, g, live)
    mu = jax.tree.map(lambda m, ok: jnp.where(ok, m, 0.0), mu, live)
    return mu, nu, state.compression

  def compressed(grads, state):
    # Elements whose frozen v is 0 (no gradient in warm-up) keep m = 0: a
    # later gradient there would step by g/eps (DeepSpeed's exp_avg_mask,
    # derived from v instead of given).
    live = jax.tree.map(lambda v: v > 0, state.nu)
    mask = lambda tree: jax.tree.map(lambda x, ok: jnp.where(ok, x, 0.0), tree, live)
    local = jax.tree.map(lambda m, x: b1 * m + (1 - b1) * x, state.mu, _f32(grads))
    if exchange == "momentum":
      mu, cstate = _exchange(compression, mask(local), state.compression, "one_bit_adam")
      return mask(mu), state.nu, cstate
    # The frozen preconditioner d is the same on every replica: exchange m/d.
    frozen = c2(state.count)
    d = jax.tree.map(lambda v: jnp.sqrt(v / frozen) + eps, state.nu)
    local = mask(jax.tree.map(jnp.divide, local, d))
    avg, cstate = _exchange(compression, local, state.compression, "one_bit_adam")
    return mask(jax.tree.map(jnp.multiply, avg, d)), state.nu, cstate

  def update_fn(updates, state, params=None):
    if weight_decay and params is None:
      raise ValueError("one_bit_adam with weight_decay needs params in update.")
    # lax.cond, not jnp.where: a step runs either the float all-reduce or
    # the 1-bit exchange, never both; the counter is the same everywhere.
    mu, nu, cstate = _cond(exact_step(state.count), warmup, compressed, updates, state)
    t = optax.safe_increment(state.count)
    c1 = 1 - b1 ** t.astype(jnp.float32)
    c2_t = c2(t)
    lr = _lr(learning_rate, state.count)
    step = jax.tree.map(lambda m, v: (m / c1) / (jnp.sqrt(v / c2_t) + eps), mu, nu)
    if weight_decay:
      step = jax.tree.map(lambda s, p: s + weight_decay * p.astype(jnp.float32), step, params)
    new = jax.tree.map(lambda s: -lr * s, step)
    return _cast_like(new, updates), OneBitAdamState(t, mu, nu, cstate)

  return optax.GradientTransformation(init_fn, update_fn)


def one_bit_momentum(
    learning_rate: ScalarOrSchedule,
    momentum: float = 0.9,
    *,
    axis_name: str,
    warmup_steps: int = 0,
    scale: str = "column",
    nesterov: bool = False,
    weight_decay: float = 0.0,
    num_replicas: int | None = None,
) -> optax.GradientTransformation:
  r"""Momentum SGD whose momentum crosses devices as 1 bit per element.

  Input: each replica's *local* gradients. With ``m`` the momentum (the same
  on every replica) and ``C`` the compressed average
  (:func:`jmp_train.sign_compression`, worker and server error feedback):

  .. math::
    m_j = \mu m + g_j + \lambda p,\quad m' = C(m_1..m_K),\quad
    u = -\eta_t\, m' \;\; (\text{Nesterov: } -\eta_t((1+\mu) m' - \mu m)).

  During the first ``warmup_steps`` steps ``C`` is the exact ``pmean``
  (``optax.sgd(learning_rate, momentum)`` on the averaged gradients).
  Unlike gradient compression before ``optax.sgd(momentum=...)``, the
  quantization error is paid back into the momentum rather than integrated
  by it (see the module docstring), so it trains at the uncompressed
  learning rate.

  Args:
    learning_rate: a float or a schedule ``count -> lr``.
    momentum: the momentum ``μ``.
    axis_name: the replicas' mapped axis (``pmap`` / ``shard_map``).
    warmup_steps: exact (float all-reduce) steps first; ``0``: none, and
      the compiled step holds no float all-reduce at all.
    scale: reconstruction values: ``"column"`` (Seide et al.), ``"l1"`` or
      ``"l2"``.
    nesterov: Nesterov momentum.
    weight_decay: L2 term ``λ p`` added to the gradient (as
      ``torch.optim.SGD``); needs ``params``.
    num_replicas: size of ``axis_name``, for ``init`` outside a mapped
      context.

  Returns:
    An ``optax.GradientTransformation`` with state :class:`OneBitMomentumState`.

  Raises:
    ValueError: for a bad ``axis_name``, ``warmup_steps`` or ``scale``; at
      trace time for a state made for another replica count.

  Examples:
    >>> import jax, jax.numpy as jnp, optax
    >>> k = jax.local_device_count()
    >>> tx = one_bit_momentum(0.1, 0.9, axis_name="i")
    >>> params = {"w": jnp.ones((k, 4, 3))}
    >>> state = jax.pmap(tx.init, axis_name="i")(params)
    >>> grads = {"w": jnp.arange(k * 12.0).reshape(k, 4, 3)}
    >>> updates, state = jax.pmap(tx.update, axis_name="i")(grads, state)
    >>> bool((updates["w"] == updates["w"][0]).all())
    True

  References:
    Tang et al., "1-bit Adam: Communication Efficient Large-Scale Training
    with Adam's Convergence Speed", ICML 2021. https://arxiv.org/abs/2102.02888

    Seide et al., "1-Bit Stochastic Gradient Descent and its Application to
    Data-Parallel Distributed Training of Speech DNNs", Interspeech 2014.
  """
  _check_common(axis_name, warmup_steps, 0)
  compression = sign_compression(axis_name, scale=scale, num_replicas=num_replicas)

  def init_fn(params):
    zeros = jax.tree.map(lambda p: jnp.zeros(jnp.shape(p), jnp.float32), params)
    return OneBitMomentumState(
        count=jnp.zeros((), jnp.int32), trace=zeros, compression=compression.init(zeros)
    )

  def local_trace(grads, state, params):
    g = _f32(grads)
    if weight_decay:
      g = jax.tree.map(lambda x, p: x + weight_decay * p.astype(jnp.float32), g, params)
    return g

  def warmup(g, state):
    g = lax.pmean(g, axis_name)
    return jax.tree.map(lambda m, x: momentum * m + x, state.trace, g), state.compression

  def compressed(g, state):
    local = jax.tree.map(lambda m, x: momentum * m + x, state.trace, g)
    return _exchange(compression, local, state.compression, "one_bit_momentum")

  def update_fn(updates, state, params=None):
    if weight_decay and params is None:
      raise ValueError("one_bit_momentum with weight_decay needs params in update.")
    g = local_trace(updates, state, params)
    if warmup_steps:
      trace, cstate = _cond(state.count < warmup_steps, warmup, compressed, g, state)
    else:
      trace, cstate = compressed(g, state)
    lr = _lr(learning_rate, state.count)
    if nesterov:
      step = jax.tree.map(lambda new, old: (1 + momentum) * new - momentum * old, trace, state.trace)
    else:
      step = trace
    new = jax.tree.map(lambda s: -lr * s, step)
    return _cast_like(new, updates), OneBitMomentumState(
        optax.safe_increment(state.count), trace, cstate
    )

  return optax.GradientTransformation(init_fn, update_fn)
