"""Half-precision weight updates without a float32 master copy.

In float16 (11 significant bits) or bfloat16 (8 bits) the sum ``w + u``
rounds back to ``w`` whenever ``|u|`` is below half a unit in the last place
of ``w`` (``|u| < |w|·2^-11`` in float16, ``|u| < |w|·2^-8`` in bfloat16):
small learning-rate steps vanish. Mixed-precision training therefore keeps a
float32 master copy of every weight (4 extra bytes per parameter). This
module offers three optax pieces that keep the weights in half precision and
still move them as a float32 update would:

* :func:`modified_momentum_sgd`: the momentum accumulates gradients, not
  learning-rate-scaled steps (Naruse, NVIDIA, "Training DL models fast and
  accurately with Volta Tensor Cores", 2017), so the buffer stays
  representable and the applied step is ``1/(1-m)`` times larger than a
  plain SGD step.
* :func:`kahan_compensation`: a per-parameter buffer holds what rounding
  dropped and adds it back at the next step (compensated summation).
* :func:`stochastic_rounding`: rounds the new weight up or down at random
  with probability proportional to the distance, so it is right on average.

The last two are placed last in an ``optax.chain`` after any optimizer and
need ``params``; they rewrite the updates so that ``optax.apply_updates``
(which computes ``(p + u).astype(p.dtype)``) lands exactly on the chosen
half-precision value.
"""

from __future__ import annotations

import math
import numbers
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jmp_train._src.policy import is_floating_array
from jmp_train._src.policy import parse_dtype

__all__ = [
    "KahanCompensationState",
    "ModifiedMomentumState",
    "StochasticRoundingState",
    "kahan_compensation",
    "modified_momentum_sgd",
    "stochastic_rounding",
]


def _accumulation_dtype(dtype: Any) -> np.dtype:
  """float32 for half types, the dtype itself for float32 and wider."""
  dtype = np.dtype(dtype)
  return np.dtype(jnp.float32) if dtype.itemsize < 4 else dtype


def _is_narrower_than_float32(dtype: Any) -> bool:
  return np.dtype(dtype).itemsize < 4


def _check_params(params: Any, name: str) -> None:
  if params is None:
    raise ValueError(
        f"{name} needs the current parameters: call "
        "`update(updates, state, params)` with params (and place it last in "
        "an optax.chain, so the updates it receives are the final ones)."
    )


def _check_structure(updates: Any, params: Any, name: str) -> None:
  updates_def = jax.tree.structure(updates)
  params_def = jax.tree.structure(params)
  if updates_def != params_def:
    raise ValueError(
        f"{name}: updates and params must have the same tree structure; got "
        f"updates {updates_def} and params {params_def}."
    )


def _land(p: jax.Array, step: jax.Array, update_dtype: Any) -> tuple[jax.Array, jax.Array]:
  """The update landing ``p`` on ``round(p + step)``, and the step it applies.

  Args:
    p: the parameter.
    step: the wanted step, in ``p``'s accumulation dtype.
    update_dtype: dtype of the returned update.

  Returns:
    ``(update, applied)``: ``update`` in ``update_dtype``, and ``applied``,
    the accumulation-dtype difference between what ``optax.apply_updates``
    (``(p + update).astype(p.dtype)``) will produce and ``p``.
  """
  acc = step.dtype
  p_acc = p.astype(acc)
  target = (p_acc + step).astype(p.dtype)
  update = (target.astype(acc) - p_acc).astype(update_dtype)
  # Exactly what optax.apply_updates will compute.
  landed = jnp.asarray(p + update).astype(p.dtype)
  return update, landed.astype(acc) - p_acc


# ---------------------------------------------------------------------------
# Modified momentum SGD.
# ---------------------------------------------------------------------------


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


def _check_momentum_hyperparams(
    learning_rate: Any, momentum: Any, nesterov: Any, error_feedback: Any
) -> None:
  """Raises a ValueError naming the first invalid hyperparameter.

  Numbers are checked here; a schedule (a callable of the step count) and
  arrays (e.g. from ``optax.inject_hyperparams``, possibly traced) are taken
  as they are.
  """
  if not callable(learning_rate) and _is_number(learning_rate) and not (
      math.isfinite(learning_rate) and learning_rate > 0):
    raise ValueError(
        f"learning_rate must be finite and > 0 (or a schedule, a callable of "
        f"the step count), got {learning_rate!r}: a negative rate ascends the "
        "loss and 0 never moves the weights."
    )
  if not (callable(learning_rate) or _is_number(learning_rate)
          or isinstance(learning_rate, (jax.Array, np.ndarray))):
    raise ValueError(
        f"learning_rate must be a number > 0 or a schedule (a callable of "
        f"the step count), got {learning_rate!r}."
    )
  if _is_number(momentum) and not 0.0 <= momentum < 1.0:
    raise ValueError(
        f"momentum must be in [0, 1), got {momentum!r} (0 disables momentum)."
    )
  for name, value in (("nesterov", nesterov), ("error_feedback", error_feedback)):
    if not isinstance(value, (bool, np.bool_)):
      raise ValueError(f"{name} must be True or False, got {value!r}.")


def _is_number(x: Any) -> bool:
  """A Python or NumPy real number (not a bool, not an array)."""
  return isinstance(x, numbers.Real) and not isinstance(x, (bool, np.bool_))


def _momentum_step(
    g: jax.Array, buf: jax.Array, lr: Any, momentum: Any, nesterov: bool
) -> tuple[jax.Array, jax.Array]:
  """The modified momentum rule: the step (accumulation dtype), new buffer.

  ``G <- m G + g`` rounded once to the buffer's dtype; the step is
  ``-lr G`` (``-lr (g + m G)`` with Nesterov), in float32 for half buffers.
  """
  acc = _accumulation_dtype(buf.dtype)
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
  acc = _accumulation_dtype(buf.dtype)
  step, new_buf = _momentum_step(g, buf, lr, momentum, nesterov)
  new_u, applied = _land(p, step, g.dtype)
  dropped = step - applied
  m = jnp.asarray(momentum, acc)
  # A unit of G moves W by -lr * m**k / (1 - m) over the next steps.
  reach = jnp.asarray(lr, acc) * (m * m if nesterov else m)
  feedback = -dropped * (1 - m) / jnp.where(reach > 0, reach, jnp.ones_like(reach))
  # Nothing to carry with m = 0 or lr = 0; never carry inf/NaN forward.
  ok = (reach > 0) & jnp.isfinite(feedback)
  feedback = jnp.where(ok, feedback, jnp.zeros_like(feedback))
  return new_u, (new_buf.astype(acc) + feedback).astype(buf.dtype)


def _unzip_pairs(pairs: Any) -> tuple[Any, Any]:
  """A tree of ``(a, b)`` pairs as a tree of ``a`` and a tree of ``b``."""
  is_pair = lambda x: isinstance(x, tuple)
  return (jax.tree.map(lambda x: x[0], pairs, is_leaf=is_pair),
          jax.tree.map(lambda x: x[1], pairs, is_leaf=is_pair))


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
  0.9``); ``G``'s own rounding is not fed back. Measured on the digits MLP
  (``benchmarks/bench_half_weights_training.py``): float16 within 1% of
  float32 master weights where the rule without feedback is 4% off; bfloat16 (8
  significant bits) 1.5% off instead of 105%, not within 1%: there the
  rule without feedback followed by :func:`stochastic_rounding` or
  :func:`kahan_compensation` is. With ``momentum=0`` there
  is no buffer to carry the error and nothing is fed back. The same idea as
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
    Tensor Cores" (in Japanese), slides, 2017-12-12 (section "updating the
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
      _check_params(params, caller)
      _check_structure(updates, params, caller)
      pairs = jax.tree.map(
          lambda g, b, p: _feedback_leaf(g, b, p, lr, momentum, nesterov),
          updates, state.momentum, params)
    else:
      pairs = jax.tree.map(
          lambda g, b: _plain_leaf(g, b, lr, momentum, nesterov),
          updates, state.momentum)
    new_updates, new_momentum = _unzip_pairs(pairs)
    return new_updates, ModifiedMomentumState(
        count=optax.safe_increment(state.count), momentum=new_momentum
    )

  return optax.GradientTransformation(init_fn, update_fn)


# ---------------------------------------------------------------------------
# Kahan-compensated weight updates.
# ---------------------------------------------------------------------------


class KahanCompensationState(NamedTuple):
  """State of :func:`kahan_compensation`.

  Attributes:
    compensation: per parameter, the part of past updates that rounding to
      the parameters' dtype dropped (``c`` below), in the parameters' dtype
      unless ``compensation_dtype`` was given.
  """

  compensation: optax.Updates


def kahan_compensation(
    compensation_dtype: Any | None = None,
) -> optax.GradientTransformation:
  r"""Compensated (Kahan) summation of updates into low-precision parameters.

  Place it last in a chain. With ``p`` the current parameter (say bfloat16),
  ``u`` the incoming update and ``c`` the compensation buffer, each step
  computes in float32

  .. math::

    y = u + c, \qquad p' = \mathrm{round}(p + y), \qquad c' = y - (p' - p)

  and returns the update ``p' - p`` (in ``u``'s dtype), so that
  ``optax.apply_updates(params, updates)`` produces ``p'`` bit for bit
  whenever ``p' - p`` is representable in ``u``'s dtype: always when
  ``p'/2 <= p <= 2p'`` (Sterbenz's lemma), e.g. for any step of at most half
  the weight's magnitude. The buffer carries what rounding dropped: small
  updates accumulate in ``c`` until they move ``p`` by an ulp, and ``p + c``
  tracks the float32 trajectory to within the buffer's own rounding. ``c'``
  is computed from the value ``apply_updates`` will really produce, so it
  stays exact even for the rare larger steps where ``p' - p`` is rounded. A
  non-finite ``c'`` (an overflowed or NaN update) is reset to zero so one bad
  step cannot poison later ones; wrap the optimizer in
  ``jmp_train.loss_scaled`` to skip such steps altogether.

  Leaves that are not floating point pass through unchanged; float32
  parameters get classic same-precision Kahan summation.

  Memory: one buffer per parameter in the parameters' dtype, 2 bytes for
  half types, against 4 for a float32 master copy.

  Args:
    compensation_dtype: dtype of the buffer; ``None`` (default) uses each
      parameter's dtype. A wider type (float32) keeps more of the residual
      at twice the memory.

  Returns:
    An ``optax.GradientTransformation`` whose ``update`` requires ``params``;
    its state is a :class:`KahanCompensationState`.

  Raises:
    ValueError: if ``compensation_dtype`` is not a floating dtype, or (at
      trace time) if ``update`` is called without ``params`` or with params
      whose tree differs from the updates'.

  Examples:
    >>> import jax.numpy as jnp, optax
    >>> params = jnp.ones(4, jnp.bfloat16)
    >>> opt = optax.chain(optax.sgd(1e-3), kahan_compensation())
    >>> state = opt.init(params)
    >>> grads = jnp.ones(4, jnp.bfloat16)  # each step 1e-3 < half an ulp
    >>> for _ in range(100):
    ...   updates, state = opt.update(grads, state, params)
    ...   params = optax.apply_updates(params, updates)
    >>> round(float(params[0]), 2)  # float32 gives 0.9; plain bfloat16 stays 1
    0.9

  References:
    Kahan, "Further remarks on reducing truncation errors", Communications
    of the ACM 8(1), 1965. https://doi.org/10.1145/363707.363723
    Zamirai et al., "Revisiting BFloat16 Training", 2020.
    https://arxiv.org/abs/2010.06192
  """
  if compensation_dtype is not None:
    try:
      compensation_dtype = parse_dtype(compensation_dtype)
    except ValueError as e:
      raise ValueError(f"compensation_dtype must be a floating dtype or None: {e}") from None

  def init_fn(params):
    def zeros(p):
      if not is_floating_array(p):
        return jnp.zeros([], jnp.float32)  # placeholder, never read
      dtype = p.dtype if compensation_dtype is None else compensation_dtype
      return jnp.zeros(jnp.shape(p), dtype)

    return KahanCompensationState(compensation=jax.tree.map(zeros, params))

  def update_fn(updates, state, params=None):
    _check_params(params, "kahan_compensation")
    _check_structure(updates, params, "kahan_compensation")

    def leaf(u, c, p):
      if not (is_floating_array(p) and is_floating_array(u)):
        return u, c
      acc = _accumulation_dtype(p.dtype)
      y = u.astype(acc) + c.astype(acc)
      new_u, applied = _land(p, y, u.dtype)
      new_c = y - applied
      new_c = jnp.where(jnp.isfinite(new_c), new_c, jnp.zeros_like(new_c))
      return new_u, new_c.astype(c.dtype)

    pairs = jax.tree.map(leaf, updates, state.compensation, params)
    is_pair = lambda x: isinstance(x, tuple)
    new_updates = jax.tree.map(lambda x: x[0], pairs, is_leaf=is_pair)
    new_comp = jax.tree.map(lambda x: x[1], pairs, is_leaf=is_pair)
    return new_updates, KahanCompensationState(compensation=new_comp)

  return optax.GradientTransformation(init_fn, update_fn)


# ---------------------------------------------------------------------------
# Stochastic rounding.
# ---------------------------------------------------------------------------


class StochasticRoundingState(NamedTuple):
  """State of :func:`stochastic_rounding`.

  Attributes:
    key: the raw ``uint32`` data of the PRNG key of the next step (split
      once per step; a raw array so it checkpoints, ``pmap``s and passes
      through ``jnp.where`` like any other leaf).
  """

  key: jax.Array


def _stochastic_round(x: jax.Array, dtype: Any, key: jax.Array) -> jax.Array:
  """Rounds float32 ``x`` to ``dtype`` up or down, unbiased.

  The result is the neighbour below or above ``x`` in ``dtype``, the far one
  with probability ``distance to the near one / gap``, so its mean is ``x``.
  Values already in ``dtype`` are kept; non-finite values and values beyond
  the largest finite one round to nearest.
  """
  near = x.astype(dtype)
  near_f = near.astype(x.dtype)
  towards = jnp.where(near_f > x, -jnp.inf, jnp.inf).astype(dtype)
  far = jnp.nextafter(near, towards)
  far_f = far.astype(x.dtype)
  # Both differences are exact: x, near and far are within one ulp.
  gap = jnp.abs(far_f - near_f)
  safe_gap = jnp.where(gap > 0, gap, jnp.ones_like(gap))
  p_far = jnp.abs(x - near_f) / safe_gap
  draw = jax.random.uniform(key, x.shape, x.dtype)
  ok = jnp.isfinite(x) & jnp.isfinite(far_f) & jnp.isfinite(near_f)
  return jnp.where(ok & (draw < p_far), far, near)


def _key_data(seed: Any) -> tuple[jax.Array, Any]:
  """Raw key data and key implementation from an int seed or a key."""
  if isinstance(seed, (int, np.integer)) and not isinstance(seed, bool):
    key = jax.random.key(int(seed))
  elif isinstance(seed, jax.Array) and jnp.issubdtype(
      seed.dtype, jax.dtypes.prng_key
  ):
    key = seed
  elif (
      isinstance(seed, (jax.Array, np.ndarray))
      and seed.dtype == np.uint32
      and seed.ndim == 1
  ):
    key = jax.random.wrap_key_data(seed)
  else:
    raise ValueError(
        f"seed must be a Python int, a typed key (jax.random.key) or a raw "
        f"uint32 key (jax.random.PRNGKey), got {seed!r}."
    )
  if key.shape:
    raise ValueError(f"seed must be a single key, got a key array of shape {key.shape}.")
  return jax.random.key_data(key), jax.random.key_impl(key)


def stochastic_rounding(seed: int | jax.Array = 0) -> optax.GradientTransformation:
  r"""Stochastic rounding of updated low-precision parameters.

  Place it last in a chain. For each parameter ``p`` narrower than float32
  (float16, bfloat16) and incoming update ``u``, computes the float32 target
  :math:`x = p + u` and rounds it to the neighbour below,
  :math:`\lfloor x \rfloor`, or above, :math:`\lceil x \rceil`, in ``p``'s
  dtype:

  .. math::

    P(\lceil x \rceil) = \frac{x - \lfloor x \rfloor}
                              {\lceil x \rceil - \lfloor x \rfloor},
    \qquad \mathbb{E}[p'] = x.

  It returns ``p' - p`` (in ``u``'s dtype) so that ``optax.apply_updates``
  produces ``p'`` exactly whenever ``p' - p`` is representable in ``u``'s
  dtype (always when ``p'/2 <= p <= 2p'``, e.g. for steps of at most half
  the weight's magnitude; larger steps land within rounding of ``p'``). An
  update too small to survive round-to-nearest now moves the weight by one
  ulp with the matching probability: unbiased, with no extra buffer (the
  state is one PRNG key). Float32 and wider parameters, and non-floating
  leaves, pass through unchanged.

  The key is split once per step. In data-parallel training every replica
  starts from the same seed and receives the same (all-reduced) updates, so
  all replicas draw the same roundings and their weights stay identical.

  Args:
    seed: a Python int, a typed key (``jax.random.key``) or a raw ``uint32``
      key (``jax.random.PRNGKey``).

  Returns:
    An ``optax.GradientTransformation`` whose ``update`` requires ``params``;
    its state is a :class:`StochasticRoundingState`.

  Raises:
    ValueError: if ``seed`` is none of the above, or (at trace time) if
      ``update`` is called without ``params`` or with params whose tree
      differs from the updates'.

  Examples:
    >>> import jax.numpy as jnp, optax
    >>> params = jnp.ones(1000, jnp.bfloat16)
    >>> opt = optax.chain(optax.sgd(1e-3), stochastic_rounding(seed=0))
    >>> state = opt.init(params)
    >>> grads = jnp.ones(1000, jnp.bfloat16)  # 1e-3 < half an ulp of 1
    >>> updates, state = opt.update(grads, state, params)
    >>> new = optax.apply_updates(params, updates)
    >>> bool(abs(float(new.astype(jnp.float32).mean()) - 0.999) < 5e-4)
    True

  References:
    Gupta et al., "Deep Learning with Limited Numerical Precision", ICML
    2015. https://arxiv.org/abs/1502.02551
    Zamirai et al., "Revisiting BFloat16 Training", 2020.
    https://arxiv.org/abs/2010.06192
  """
  key_data, impl = _key_data(seed)

  def init_fn(params):
    del params
    return StochasticRoundingState(key=key_data)

  def update_fn(updates, state, params=None):
    _check_params(params, "stochastic_rounding")
    _check_structure(updates, params, "stochastic_rounding")
    key = jax.random.wrap_key_data(state.key, impl=impl)
    next_key, step_key = jax.random.split(key)
    leaves_u, treedef = jax.tree.flatten(updates)
    leaves_p = treedef.flatten_up_to(params)
    keys = jax.random.split(step_key, max(len(leaves_u), 1))
    out = []
    for i, (u, p) in enumerate(zip(leaves_u, leaves_p)):
      if not (
          is_floating_array(p) and is_floating_array(u) and _is_narrower_than_float32(p.dtype)
      ):
        out.append(u)
        continue
      p32 = p.astype(jnp.float32)
      target = _stochastic_round(p32 + u.astype(jnp.float32), p.dtype, keys[i])
      out.append((target.astype(jnp.float32) - p32).astype(u.dtype))
    new_updates = jax.tree.unflatten(treedef, out)
    return new_updates, StochasticRoundingState(key=jax.random.key_data(next_key))

  return optax.GradientTransformation(init_fn, update_fn)
