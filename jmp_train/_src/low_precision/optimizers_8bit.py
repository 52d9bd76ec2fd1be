"""Adam and momentum SGD with a dtype per moment, down to 8 bits.

Adam keeps two moments per parameter: in float32 that is 8 bytes, four times
a bfloat16 weight. optax's ``scale_by_adam`` has a ``mu_dtype`` but stores
the second moment ``nu`` in the parameters' dtype, and in bfloat16 that EMA
stops moving (its weight ``1 - b2 = 0.001`` per step is below half an ulp).
:func:`scale_by_narrow_adam` takes a dtype for each moment: a floating
dtype, or ``"8bit"`` for blockwise 8-bit quantization
(:class:`~jmp_train.QuantizedArray`: a ``uint8`` code per element plus a
float32 scale per block, a signed code for ``mu`` and an unsigned one for
``nu``). The moments are dequantized to float32 inside the update, updated,
used, and requantized. :func:`adam_8bit` and :func:`sgd_8bit` are the
optimizers with every moment in 8 bits.

Leaves with fewer than ``min_8bit_size`` elements (biases, norm scales) keep
an ``"8bit"`` moment in float32, as bitsandbytes does (its
``min_8bit_size``): they are a small share of the parameters, and a block
scale per few elements would save little.

The states are optax's (``optax.ScaleByAdamState``; for :func:`sgd_8bit`
:class:`QuantizedTraceState`, ``optax.TraceState`` with a step count),
their moment leaves :class:`~jmp_train.QuantizedArray` where quantized;
shapes and dtypes do not change between steps. Blocks are taken over each
whole leaf, so the state is meant to be replicated (data
parallelism); to shard it, build it inside the sharded computation.

References:
  Dettmers, Lewis, Shleifer and Zettlemoyer, "8-bit Optimizers via Block-wise
  Quantization", ICLR 2022, https://arxiv.org/abs/2110.02861.
  Loshchilov and Hutter, "Decoupled Weight Decay Regularization", ICLR 2019,
  https://arxiv.org/abs/1711.05101.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jmp_train._src.hyperparams import check_learning_rate
from jmp_train._src.hyperparams import check_non_negative
from jmp_train._src.hyperparams import check_unit
from jmp_train._src.hyperparams import is_static_zero
from jmp_train._src.leaf_checks import check_leaves
from jmp_train._src.low_precision.moment_storage import STATE_DTYPES
from jmp_train._src.low_precision.moment_storage import Moment
from jmp_train._src.low_precision.moment_storage import check_options
from jmp_train._src.low_precision.moment_storage import map_leaves
from jmp_train._src.low_precision.moment_storage import parse_state_dtype
from jmp_train._src.low_precision.moment_storage import step_key

__all__ = [
  "QuantizedTraceState",
  "STATE_DTYPES",
  "adam_8bit",
  "scale_by_narrow_adam",
  "sgd_8bit",
]


def scale_by_narrow_adam(
  b1: float = 0.9,
  b2: float = 0.999,
  eps: float = 1e-8,
  eps_root: float = 0.0,
  *,
  mu_dtype: Any = None,
  nu_dtype: Any = None,
  block_size: int = 256,
  code: str = "dynamic",
  min_8bit_size: int = 4096,
  rounding: str = "stochastic",
  seed: int = 0,
) -> optax.GradientTransformation:
  r"""Adam's rescaling with a storage dtype for each moment, 8 bits included.

  Per element, with :math:`\mathrm{D}` dequantization to float32 and
  :math:`\mathrm{Q}` storage in the moment's dtype:

  .. math::

    m &= \beta_1 \mathrm{D}(\hat m) + (1 - \beta_1) g, \quad
    v = \beta_2 \mathrm{D}(\hat v) + (1 - \beta_2) g^2, \\
    u &= \frac{m / (1 - \beta_1^t)}{\sqrt{v / (1 - \beta_2^t) + \epsilon_{root}}
    + \epsilon}, \quad \hat m \leftarrow \mathrm{Q}(m), \ \hat v \leftarrow
    \mathrm{Q}(v)

  all in float32; the update :math:`u` is computed from the float32 moments
  before they are stored. Equal to ``optax.scale_by_adam`` when both dtypes
  are ``None`` or float32 (up to float32 rounding).

  **8-bit moments.** :math:`\mathrm{Q}` is blockwise quantization (see
  :class:`~jmp_train.QuantizedArray`), signed for :math:`m`; for :math:`v`
  the unsigned code stores :math:`\sqrt v`, the quantity the update divides
  by, so the code's seven decades cover fourteen
  of :math:`v`. Rounding is stochastic by default (unbiased: the expected
  stored value is the float32 one). Rounding to nearest loses every EMA step
  smaller than half a code interval: with :math:`1 - \beta_2 = 0.001` the
  stored :math:`v` stops following :math:`v`, and the bias correction then
  shrinks it, so the steps grow. The random bits come from ``seed``, the
  step count and the leaf's position, so a resumed run draws the same ones
  and replicas with the same state stay identical.

  Args:
    b1: decay of the first moment.
    b2: decay of the second moment.
    eps: added to the root of the second moment.
    eps_root: added to the second moment inside the root.
    mu_dtype: storage of the first moment: ``None`` (the parameters' dtype,
      as optax), a floating dtype or its name (``"float32"``,
      ``"bfloat16"``, ...), or ``"8bit"`` (alias ``"int8"``) for blockwise
      8-bit codes.
    nu_dtype: the same for the second moment. With bfloat16 parameters pass
      ``"float32"`` or ``"8bit"``: a bfloat16 ``nu`` stops moving.
    block_size: elements per quantization block (one float32 scale each).
    code: ``"dynamic"`` (bitsandbytes' exponent code) or ``"linear"``.
    min_8bit_size: leaves with fewer elements keep an ``"8bit"`` moment in
      float32.
    rounding: ``"stochastic"`` or ``"nearest"`` rounding into 8-bit codes.
    seed: seed of the stochastic rounding.

  Returns:
    An ``optax.GradientTransformation`` with state ``optax.ScaleByAdamState(
    count, mu, nu)``; an 8-bit moment's leaves are
    :class:`~jmp_train.QuantizedArray` (for ``nu``, the codes of
    :math:`\sqrt v`). The updates keep the gradients' dtype.

  Raises:
    ValueError: for a dtype not in ``STATE_DTYPES``, ``b1`` or ``b2`` outside
      ``[0, 1)``, a negative ``eps`` or ``eps_root``, or a bad
      ``block_size``, ``code``, ``min_8bit_size`` or ``rounding``; from
      ``init`` and ``update``, for a non-floating leaf (mask it out with
      ``optax.masked``).

  Examples:
    >>> import jax.numpy as jnp, jmp_train
    >>> params = {"w": jnp.ones((64, 64), jnp.bfloat16)}
    >>> tx = jmp_train.scale_by_narrow_adam(mu_dtype="bfloat16", nu_dtype="8bit", min_8bit_size=0)
    >>> state = tx.init(params)
    >>> state.mu["w"].dtype, state.nu["w"].codes.dtype, state.nu["w"].absmax.shape
    (dtype(bfloat16), dtype('uint8'), (16,))
    >>> updates, state = tx.update(params, state)
    >>> updates["w"].dtype
    dtype(bfloat16)

  References:
    Kingma and Ba, "Adam: A Method for Stochastic Optimization", ICLR 2015,
    https://arxiv.org/abs/1412.6980.
  """
  mu_dtype = parse_state_dtype(mu_dtype, "mu_dtype")
  nu_dtype = parse_state_dtype(nu_dtype, "nu_dtype")
  check_unit(b1, "b1")
  check_unit(b2, "b2")
  check_non_negative(eps, "eps")
  check_non_negative(eps_root, "eps_root")
  check_options(block_size, code, min_8bit_size, rounding)
  mu = Moment(mu_dtype, True, block_size, code, min_8bit_size, rounding)
  nu = Moment(nu_dtype, False, block_size, code, min_8bit_size, rounding)

  def init_fn(params):
    check_leaves(params, "parameters", "scale_by_narrow_adam")
    return optax.ScaleByAdamState(
      count=jnp.zeros([], jnp.int32),
      mu=jax.tree.map(mu.init, params),
      nu=jax.tree.map(nu.init, params),
    )

  def update_fn(updates, state, params=None):
    del params
    check_leaves(updates, "gradients", "scale_by_narrow_adam")
    count = optax.safe_increment(state.count)
    t = count.astype(jnp.float32)
    correction1 = 1 - jnp.asarray(b1, jnp.float32) ** t
    correction2 = 1 - jnp.asarray(b2, jnp.float32) ** t
    key = step_key(seed, count)

    def leaf(i, g, m_stored, v_stored):
      g32 = g.astype(jnp.float32)
      m = b1 * mu.load(m_stored) + (1 - b1) * g32
      v = b2 * nu.load(v_stored) + (1 - b2) * jnp.square(g32)
      u = (m / correction1) / (jnp.sqrt(v / correction2 + eps_root) + eps)
      key_m, key_v = jax.random.split(jax.random.fold_in(key, i))
      return u.astype(g.dtype), mu.store(m, m_stored, key_m), nu.store(v, v_stored, key_v)

    new_updates, new_mu, new_nu = map_leaves(leaf, updates, state.mu, state.nu)
    return new_updates, optax.ScaleByAdamState(count=count, mu=new_mu, nu=new_nu)

  return optax.GradientTransformation(init_fn, update_fn)


def adam_8bit(
  learning_rate: optax.ScalarOrSchedule,
  b1: float = 0.9,
  b2: float = 0.999,
  eps: float = 1e-8,
  weight_decay: float = 0.0,
  *,
  eps_root: float = 0.0,
  mask: Any = None,
  block_size: int = 256,
  code: str = "dynamic",
  min_8bit_size: int = 4096,
  rounding: str = "stochastic",
  seed: int = 0,
) -> optax.GradientTransformation:
  r"""Adam (AdamW with ``weight_decay``) whose moments are stored in 8 bits.

  ``optax.chain(scale_by_narrow_adam(b1, b2, eps, eps_root, mu_dtype="8bit",
  nu_dtype="8bit", ...), optax.add_decayed_weights(weight_decay, mask),
  optax.scale_by_learning_rate(learning_rate))``, the structure of
  ``optax.adamw``: the step is :math:`-\lambda_t (u + w\,\theta)` with
  :math:`u` Adam's direction (see :func:`scale_by_narrow_adam`). Per parameter of a
  large leaf the state costs 2 bytes plus ``8 / block_size`` for the two
  block scales (2.03 bytes at the default 256) instead of 8 in float32.
  With bfloat16 weights, chain :func:`jmp_train.stochastic_rounding` (no
  extra state) or :func:`jmp_train.kahan_compensation` after it. With
  ``weight_decay=0`` the decay step is ``optax.identity()`` and ``update``
  does not need ``params``.

  Args:
    learning_rate: a scalar or an ``optax.Schedule`` of the step count.
    b1: decay of the first moment.
    b2: decay of the second moment.
    eps: added to the root of the second moment.
    weight_decay: decoupled weight decay ``w`` (0: plain Adam).
    eps_root: added to the second moment inside the root.
    mask: which leaves weight decay applies to (as ``optax.adamw``).
    block_size: elements per quantization block.
    code: ``"dynamic"`` (default) or ``"linear"`` code maps.
    min_8bit_size: leaves with fewer elements keep float32 moments.
    rounding: ``"stochastic"`` (default) or ``"nearest"`` rounding into the
      8-bit codes (see :func:`scale_by_narrow_adam`).
    seed: seed of the stochastic rounding.

  Returns:
    An ``optax.GradientTransformation``; its state is the tuple of
    ``optax.chain`` with an ``optax.ScaleByAdamState`` first.

  Raises:
    ValueError: for a ``learning_rate`` number that is not finite and > 0,
      ``b1`` or ``b2`` outside ``[0, 1)``, a negative ``eps``, ``eps_root``
      or ``weight_decay``, or a bad ``block_size``, ``code``,
      ``min_8bit_size`` or ``rounding``; from ``init`` and ``update``, for
      a non-floating leaf (mask it out with ``optax.masked``).

  Examples:
    >>> import jax, jax.numpy as jnp, optax
    >>> import jmp_train
    >>> params = {"w": jnp.zeros((128, 64), jnp.bfloat16)}
    >>> tx = optax.chain(jmp_train.adam_8bit(1e-3), jmp_train.stochastic_rounding(0))
    >>> state = tx.init(params)
    >>> grads = {"w": jnp.ones((128, 64), jnp.bfloat16)}
    >>> updates, state = tx.update(grads, state, params)
    >>> params = optax.apply_updates(params, updates)
    >>> params["w"].dtype, bool(jnp.all(params["w"] < 0))
    (dtype(bfloat16), True)
    >>> state[0][0].mu["w"].codes.dtype, state[0][0].mu["w"].absmax.shape
    (dtype('uint8'), (32,))
  """
  check_learning_rate(learning_rate)
  check_non_negative(weight_decay, "weight_decay")
  return optax.chain(
    scale_by_narrow_adam(
      b1,
      b2,
      eps,
      eps_root,
      mu_dtype="8bit",
      nu_dtype="8bit",
      block_size=block_size,
      code=code,
      min_8bit_size=min_8bit_size,
      rounding=rounding,
      seed=seed,
    ),
    # Without decay, no params needed (as optax.adam): 8-bit Adam can follow
    # a transformation that does not pass them on.
    optax.identity() if is_static_zero(weight_decay) else optax.add_decayed_weights(weight_decay, mask),
    optax.scale_by_learning_rate(learning_rate),
  )


class QuantizedTraceState(NamedTuple):
  """State of the momentum of :func:`sgd_8bit` (``optax.TraceState`` plus a count).

  Attributes:
    count: ``int32`` number of updates so far (the stochastic rounding's
      step), bumped with ``optax.safe_increment``.
    trace: the momentum buffer, one leaf per parameter: a
      :class:`~jmp_train.QuantizedArray`, or float32 for leaves below
      ``min_8bit_size``.
  """

  count: jax.Array
  trace: optax.Updates


def _trace(decay, nesterov, moment: Moment, seed) -> optax.GradientTransformation:
  """``optax.trace`` with the trace stored by ``moment``."""

  def init_fn(params):
    check_leaves(params, "parameters", "sgd_8bit")
    return QuantizedTraceState(count=jnp.zeros([], jnp.int32), trace=jax.tree.map(moment.init, params))

  def update_fn(updates, state, params=None):
    del params
    check_leaves(updates, "gradients", "sgd_8bit")
    count = optax.safe_increment(state.count)
    key = step_key(seed, count)

    def leaf(i, g, stored):
      g32 = g.astype(jnp.float32)
      t = decay * moment.load(stored) + g32
      u = g32 + decay * t if nesterov else t
      return u.astype(g.dtype), moment.store(t, stored, jax.random.fold_in(key, i))

    new_updates, new_trace = map_leaves(leaf, updates, state.trace)
    return new_updates, QuantizedTraceState(count=count, trace=new_trace)

  return optax.GradientTransformation(init_fn, update_fn)


def sgd_8bit(
  learning_rate: optax.ScalarOrSchedule,
  momentum: float = 0.9,
  nesterov: bool = False,
  *,
  block_size: int = 256,
  code: str = "dynamic",
  min_8bit_size: int = 4096,
  rounding: str = "stochastic",
  seed: int = 0,
) -> optax.GradientTransformation:
  r"""Momentum SGD whose momentum buffer is stored in 8 bits.

  ``optax.sgd(learning_rate, momentum, nesterov)`` with the trace
  :math:`t \leftarrow m\,t + g` kept as blockwise signed 8-bit codes
  (dequantized to float32 for the step): the step is :math:`-\lambda_t t`
  (:math:`-\lambda_t (g + m\,t)` with Nesterov). One byte plus
  ``4 / block_size`` per parameter of a large leaf, instead of 4. Rounding
  into the codes is stochastic by default, for the reason given in
  :func:`scale_by_narrow_adam`: when the gradient changes slowly, the trace's
  changes are below half a code interval and rounding to nearest freezes it.

  Args:
    learning_rate: a scalar or an ``optax.Schedule`` of the step count.
    momentum: the decay ``m`` of the trace, in ``[0, 1)``.
    nesterov: whether to take the Nesterov step.
    block_size: elements per quantization block.
    code: ``"dynamic"`` (default) or ``"linear"``.
    min_8bit_size: leaves with fewer elements keep a float32 trace.
    rounding: ``"stochastic"`` (default) or ``"nearest"``.
    seed: seed of the stochastic rounding.

  Returns:
    An ``optax.GradientTransformation`` whose state is the tuple of
    ``optax.chain`` with a :class:`QuantizedTraceState` first.

  Raises:
    ValueError: for a ``learning_rate`` number that is not finite and > 0,
      ``momentum`` outside ``[0, 1)``, a non-bool ``nesterov``, or a bad
      ``block_size``, ``code``, ``min_8bit_size`` or ``rounding``; from
      ``init`` and ``update``, for a non-floating leaf (mask it out with
      ``optax.masked``).

  Examples:
    >>> import jax.numpy as jnp, jmp_train
    >>> params = {"w": jnp.zeros((64, 64))}
    >>> tx = jmp_train.sgd_8bit(0.1, momentum=0.9, min_8bit_size=0)
    >>> state = tx.init(params)
    >>> state[0].trace["w"].codes.dtype
    dtype('uint8')
    >>> updates, state = tx.update({"w": jnp.ones((64, 64))}, state)
    >>> float(updates["w"][0, 0])
    -0.10000000149011612
  """
  check_learning_rate(learning_rate)
  check_unit(momentum, "momentum")
  if not isinstance(nesterov, (bool, np.bool_)):
    raise ValueError(f"nesterov must be a bool; got {nesterov!r}.")
  check_options(block_size, code, min_8bit_size, rounding)
  moment = Moment("8bit", True, block_size, code, min_8bit_size, rounding)
  return optax.chain(
    _trace(momentum, bool(nesterov), moment, seed),
    optax.scale_by_learning_rate(learning_rate),
  )
