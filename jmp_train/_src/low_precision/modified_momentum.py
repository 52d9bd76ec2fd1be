r"""Momentum SGD whose buffer accumulates gradients, for half-precision weights.

The modified momentum rule (Naruse, NVIDIA, "Training DL models fast and
accurately with Volta Tensor Cores", 2017; Micikevicius et al., "Mixed
Precision Training", 2018): the momentum accumulates gradients, not
learning-rate-scaled steps, so the buffer stays representable in float16 and
the weights need no float32 master copy; optional error feedback puts the
part of each step that rounding dropped back into the buffer.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jmp_train._src.low_precision.half_updates import accumulation_dtype
from jmp_train._src.low_precision.half_updates import check_params
from jmp_train._src.low_precision.half_updates import check_structure
from jmp_train._src.low_precision.half_updates import land
from jmp_train._src.low_precision.half_updates import unzip_pairs
from jmp_train._src.hyperparams import check_bool
from jmp_train._src.hyperparams import check_learning_rate
from jmp_train._src.hyperparams import check_unit
from jmp_train._src.dtypes import is_floating_array

__all__ = ["ModifiedMomentumState", "modified_momentum_sgd"]


class ModifiedMomentumState(NamedTuple):
  """State of :func:`modified_momentum_sgd`.

  Attributes:
    count: ``int32`` number of updates so far (the learning-rate schedule's
      argument), bumped with ``optax.safe_increment``.
    momentum: the accumulated gradients ``G``, one leaf per parameter, in the
      parameters' dtype.
  """

  count: jax.Array
  momentum: optax.Updates


def _check_momentum_hyperparams(learning_rate: Any, momentum: Any, nesterov: Any, error_feedback: Any) -> None:
  """Raises a ValueError naming the first invalid hyperparameter."""
  check_learning_rate(learning_rate)
  check_unit(momentum, "momentum", " (0 disables momentum)")
  check_bool(nesterov, "nesterov")
  check_bool(error_feedback, "error_feedback")


def _momentum_step(g: jax.Array, buf: jax.Array, lr: Any, momentum: Any, nesterov: bool) -> tuple[jax.Array, jax.Array]:
  """The modified momentum rule: the step (accumulation dtype), new buffer.

  ``G <- m G + g`` rounded once to the buffer's dtype; the step is
  ``-lr G`` (``-lr (g + m G)`` with Nesterov), in float32 for half buffers.
  """
  acc = accumulation_dtype(buf.dtype)
  g_acc = g.astype(acc)
  m = jnp.asarray(momentum, acc)  # may be an injected hyperparameter
  new_buf = (m * buf.astype(acc) + g_acc).astype(buf.dtype)
  direction = new_buf.astype(acc)
  if nesterov:
    direction = g_acc + m * direction
  return -jnp.asarray(lr, acc) * direction, new_buf


def _plain_leaf(g, buf, lr, momentum, nesterov):
  """One leaf without error feedback: (update in g's dtype, new buffer)."""
  step, new_buf = _momentum_step(g, buf, lr, momentum, nesterov)
  return step.astype(g.dtype), new_buf


def _feedback_leaf(g, buf, p, lr, momentum, nesterov):
  """One leaf with error feedback: the update landing ``p`` exactly, and
  the buffer with the step's rounding loss fed back into it."""
  if not (is_floating_array(p) and is_floating_array(g)):
    return _plain_leaf(g, buf, lr, momentum, nesterov)
  acc = accumulation_dtype(buf.dtype)
  step, new_buf = _momentum_step(g, buf, lr, momentum, nesterov)
  new_u, applied = land(p, step, g.dtype)
  dropped = step - applied
  m = jnp.asarray(momentum, acc)
  # A unit of G moves W by -lr * m**k / (1 - m) over the next steps.
  reach = jnp.asarray(lr, acc) * (m * m if nesterov else m)
  feedback = -dropped * (1 - m) / jnp.where(reach > 0, reach, jnp.ones_like(reach))
  # Nothing to carry with m = 0 or lr = 0; never carry inf/NaN forward.
  ok = (reach > 0) & jnp.isfinite(feedback)
  feedback = jnp.where(ok, feedback, jnp.zeros_like(feedback))
  return new_u, (new_buf.astype(acc) + feedback).astype(buf.dtype)


def modified_momentum_sgd(
  learning_rate: optax.ScalarOrSchedule,
  momentum: float = 0.9,
  nesterov: bool = False,
  error_feedback: bool = True,
) -> optax.GradientTransformation:
  r"""Momentum SGD whose buffer accumulates gradients, for half-precision weights.

  Plain (Caffe-style) momentum keeps the learning rate inside the buffer,
  :math:`H \leftarrow m H - \lambda \Delta W,\ W \leftarrow W + H`, and in
  float16 the product :math:`\lambda \Delta W` underflows or is lost when
  added to :math:`H`. The modified form accumulates raw gradients and
  applies the learning rate last:

  .. math::

    G_{t+1} = m\,G_t + \Delta W_t, \qquad
    W_{t+1} = W_t - \lambda_t\,G_{t+1}

  (with ``nesterov=True`` the step is :math:`\lambda_t (\Delta W_t + m
  G_{t+1})`). ``G`` stays at the gradients' scale, representable in float16,
  and the applied step settles at :math:`\lambda g / (1 - m)`, ten times a
  plain SGD step for ``m = 0.9``. ``G`` is stored in the parameters' dtype
  (no float32 state); each step computes in float32 and rounds once.

  **Error feedback** (``error_feedback=True``, the default). The rule above
  still loses every step below half an ulp of the weight (``|step| <
  |W|·2^-11`` in float16, ``2^-8`` in bfloat16), so at small learning rates
  the weights stop where float32 would go on. With error feedback the part
  ``e`` of the step that rounding ``W`` dropped is put back into the buffer,
  scaled so that the momentum's future steps re-apply exactly ``e``:

  .. math::

    G_{t+1} \leftarrow G_{t+1} + \frac{1-m}{\lambda_t\, m^k}\, e_t,
    \qquad e_t = (W_t - \lambda_t G_{t+1}) - W_{t+1}

  (``k = 1``, or 2 with ``nesterov``: a unit in ``G`` moves ``W`` by
  :math:`\lambda m^k / (1 - m)` over the following steps, for a constant
  learning rate). No memory is added: ``W`` and ``G`` are the only state,
  2 + 2 bytes per parameter in float16. The dropped part is re-applied over
  the momentum's time scale, not at once, so the weights may lag the float32
  trajectory by up to about ``m / (1 - m)`` half-ulps (4.5 ulps at ``m =
  0.9``); ``G``'s own rounding is not fed back. In float16 the feedback
  brings the weights close to float32 master weights. bfloat16 keeps 8
  significant bits, too few for the feedback alone: there use the rule
  without feedback followed by :func:`stochastic_rounding` or
  :func:`kahan_compensation`. With ``momentum=0`` there is no buffer to
  carry the error and nothing is fed back. The same idea as
  the error feedback of 1-bit SGD (:func:`jmp_train.sign_compression`):
  what a lossy step dropped is added to what is sent next.

  ``error_feedback=False`` is the modified momentum rule above exactly; it equals
  ``optax.sgd(learning_rate, momentum, nesterov)`` in exact arithmetic (whose
  ``trace`` also accumulates gradients), with the buffer pinned to the
  parameters' dtype.

  Args:
    learning_rate: a finite number > 0, or an ``optax.Schedule`` (a
      callable of the step count, e.g. ``optax.cosine_decay_schedule(0.1,
      1000)``; a schedule may return 0, e.g. at the start of a warm-up).
      Under a schedule, error fed back at step ``t`` is scaled with
      :math:`\lambda_t` and re-applied with the later rates.
    momentum: the decay ``m`` of the gradient accumulator, in ``[0, 1)``.
    nesterov: whether to take the Nesterov step.
    error_feedback: whether to feed the rounding loss of the weight update
      back through the buffer (see above). When true, ``update`` needs
      ``params`` and must be the last transformation before
      ``optax.apply_updates``: it returns the updates that land ``params``
      exactly on the rounded target. Pass ``False`` to follow it with
      :func:`kahan_compensation` or :func:`stochastic_rounding` instead.

  Returns:
    An ``optax.GradientTransformation`` whose state is a
    :class:`ModifiedMomentumState`; the updates keep the gradients' dtype.

  Raises:
    ValueError: if ``learning_rate`` is a number that is not finite and
      > 0 (or neither a number nor a callable), ``momentum`` is a number
      outside ``[0, 1)``, ``nesterov``
      or ``error_feedback`` is not a bool, or (at trace time, with error
      feedback) if ``update`` is called without ``params`` or with params
      whose tree differs from the gradients'.

  Examples:
    >>> import jax.numpy as jnp, optax
    >>> params = {"w": jnp.ones(3, jnp.float16)}
    >>> grads = {"w": jnp.ones(3, jnp.float16)}
    >>> def train(opt, params, steps=200):
    ...   state = opt.init(params)
    ...   for _ in range(steps):
    ...     updates, state = opt.update(grads, state, params)
    ...     params = optax.apply_updates(params, updates)
    ...   return params, state
    >>> # Each step, lr * G <= 1e-5 * 10, is below half an ulp of 1 (2^-11).
    >>> plain, _ = train(modified_momentum_sgd(1e-5, error_feedback=False), params)
    >>> with_feedback, state = train(modified_momentum_sgd(1e-5), params)
    >>> float(plain["w"][0]), float(with_feedback["w"][0])  # float32: 0.9809
    (1.0, 0.982421875)
    >>> with_feedback["w"].dtype, state.momentum["w"].dtype
    (dtype('float16'), dtype('float16'))

  References:
    Naruse (NVIDIA), "Training DL models fast and accurately with Volta
    Tensor Cores" (in Japanese), slides, 2017 (section "updating the
    weights in FP16", modified momentum SGD).
    Micikevicius et al., "Mixed Precision Training", ICLR 2018.
    https://arxiv.org/abs/1710.03740
    Seide et al., "1-Bit Stochastic Gradient Descent and its Application to
    Data-Parallel Distributed Training of Speech DNNs", Interspeech 2014
    (error feedback).
  """
  _check_momentum_hyperparams(learning_rate, momentum, nesterov, error_feedback)
  caller = "modified_momentum_sgd(error_feedback=True)"

  def init_fn(params):
    return ModifiedMomentumState(
      count=jnp.zeros([], jnp.int32),
      momentum=jax.tree.map(jnp.zeros_like, params),
    )

  def update_fn(updates, state, params=None):
    lr = learning_rate(state.count) if callable(learning_rate) else learning_rate
    if error_feedback:
      check_params(params, caller)
      check_structure(updates, params, caller)
      pairs = jax.tree.map(
        lambda g, b, p: _feedback_leaf(g, b, p, lr, momentum, nesterov), updates, state.momentum, params
      )
    else:
      pairs = jax.tree.map(lambda g, b: _plain_leaf(g, b, lr, momentum, nesterov), updates, state.momentum)
    new_updates, new_momentum = unzip_pairs(updates, pairs)
    return new_updates, ModifiedMomentumState(count=optax.safe_increment(state.count), momentum=new_momentum)

  return optax.GradientTransformation(init_fn, update_fn)


# ---------------------------------------------------------------------------
