"""1-bit momentum SGD: the momentum crosses devices as 1 bit per element.

1-bit gradients with error feedback (:func:`jmp_train.sign_compression`)
in front of ``optax.sgd(momentum=...)`` deliver part of every gradient one
or more steps late, and the momentum integrates that delay for about
``1/(1-μ)`` steps. At the learning rates where momentum SGD trains fastest
it runs beyond plain SGD's stability limit (the heavy ball is stable up to
``lr·λ < 2(1+μ)``, plain SGD up to ``lr·λ < 2``), and a late gradient
destabilises it, while the residuals themselves stay bounded. So the
momentum is compressed instead: each replica adds its *own* gradient to the
momentum, the momenta go through the 1-bit exchange, and their average
replaces the momentum on every replica. What the residuals hold back is
then part of a slowly varying average, and no gradient arrives late.

References:
  Tang et al., "1-bit Adam: Communication Efficient Large-Scale Training
  with Adam's Convergence Speed", ICML 2021. https://arxiv.org/abs/2102.02888
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax

from jmp_train._src.hyperparams import check_axis_name, check_bool, check_learning_rate, check_non_negative
from jmp_train._src.hyperparams import check_unit, check_warmup_steps, is_static_zero, value_at
from jmp_train._src.leaf_checks import check_leaves
from jmp_train._src.compression.replica_averaging import ReplicaOptimizer
from jmp_train._src.compression.sign_compression import SignCompressionState, sign_compression
from jmp_train._src.compression.sign_layout import axis_size
from jmp_train._src.varying_axes import cond

__all__ = ["OneBitMomentumState", "one_bit_momentum"]


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


def one_bit_momentum(
  learning_rate: optax.ScalarOrSchedule,
  momentum: float = 0.9,
  *,
  axis_name: str,
  warmup_steps: int = 0,
  scale: str = "l2",
  nesterov: bool = False,
  weight_decay: float = 0.0,
  num_replicas: int | None = None,
  bucket_bytes: int | None = None,
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
  by it (no gradient arrives late), so it trains at the uncompressed
  learning rate.

  Args:
    learning_rate: a float or a schedule ``count -> lr``.
    momentum: the momentum ``μ``.
    axis_name: the replicas' mapped axis (``pmap`` / ``shard_map``).
    warmup_steps: exact (float all-reduce) steps first; ``0``: none, and
      the compiled step holds no float all-reduce at all.
    scale: reconstruction values: ``"l2"`` (one per tensor, as 1-bit Adam),
      ``"column"`` (Seide et al.; more bytes on small models) or
      ``"l1"``.
    nesterov: Nesterov momentum.
    weight_decay: L2 term ``λ p`` added to the gradient (as
      ``torch.optim.SGD``); needs ``params``.
    num_replicas: size of ``axis_name``, for ``init`` outside a mapped
      context.
    bucket_bytes: ``None``: one 1-bit exchange for the whole tree; an int:
      one per bucket of about this many float32 bytes, last leaves first
      (:func:`jmp_train.sign_compression`'s ``bucket_bytes``: the results
      and the state do not depend on it).

  Returns:
    An ``optax.GradientTransformation`` with state :class:`OneBitMomentumState`.

  Raises:
    ValueError: for a bad ``axis_name``, ``warmup_steps``, ``scale`` or
      ``bucket_bytes``, a ``learning_rate`` number that is not finite and
      > 0, ``momentum`` outside ``[0, 1)``, a negative ``weight_decay`` or a
      non-bool ``nesterov``; at trace time for a non-floating leaf (mask it
      out with ``optax.masked``) or a state made for another replica count or
      other parameters.

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
  check_axis_name(axis_name)
  warmup_steps = check_warmup_steps(warmup_steps, 0)
  check_learning_rate(learning_rate)
  check_unit(momentum, "momentum")
  check_non_negative(weight_decay, "weight_decay")
  check_bool(nesterov, "nesterov")
  compression = sign_compression(axis_name, scale=scale, num_replicas=num_replicas, bucket_bytes=bucket_bytes)

  decay = not is_static_zero(weight_decay)

  def init_fn(params):
    check_leaves(params, "parameters", "one_bit_momentum")
    zeros = jax.tree.map(lambda p: jnp.zeros(jnp.shape(p), jnp.float32), params)
    return OneBitMomentumState(count=jnp.zeros((), jnp.int32), trace=zeros, compression=compression.init(zeros))

  def local_trace(grads, state, params):
    g = optax.tree.cast(grads, jnp.float32)
    if decay:
      g = jax.tree.map(lambda x, p: x + weight_decay * p.astype(jnp.float32), g, params)
    return g

  def warmup(g, state):
    g = lax.pmean(g, axis_name)
    return jax.tree.map(lambda m, x: momentum * m + x, state.trace, g), state.compression

  def compressed(g, state):
    local = jax.tree.map(lambda m, x: momentum * m + x, state.trace, g)
    return compression.update(local, state.compression)

  def update_fn(updates, state, params=None):
    if decay and params is None:
      raise ValueError("one_bit_momentum with weight_decay needs params in update.")
    leaves, _ = check_leaves(updates, "gradients", "one_bit_momentum")
    # Before the warm-up's pmean: its own error for an unbound axis is raw.
    axis_size(axis_name, None, "update", "one_bit_momentum", leaves=leaves)
    g = local_trace(updates, state, params)
    if warmup_steps:
      trace, cstate = cond(state.count < warmup_steps, warmup, compressed, g, state)
    else:
      trace, cstate = compressed(g, state)
    lr = value_at(learning_rate, state.count)
    if nesterov:
      step = jax.tree.map(lambda new, old: (1 + momentum) * new - momentum * old, trace, state.trace)
    else:
      step = trace
    new = jax.tree.map(lambda s: -lr * s, step)
    return optax.tree.cast_like(new, updates), OneBitMomentumState(optax.safe_increment(state.count), trace, cstate)

  return ReplicaOptimizer(init_fn, update_fn)
