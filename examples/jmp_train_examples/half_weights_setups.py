"""The optimizer setups the half-precision weights experiment compares.

Each ``make_*setups`` returns an ordered dict name -> (parameter dtype,
optimizer) for :func:`jmp_train_examples.half_weights.run_all`: a float32
master copy, half weights with a plain optimizer, with
:func:`jmp_train.kahan_compensation`, :func:`jmp_train.stochastic_rounding`
or :func:`jmp_train.modified_momentum_sgd`, and with 8-bit optimizer state.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jmp_train

__all__ = [
  "make_8bit_setups",
  "make_momentum_setups",
  "make_setups",
  "make_text_setups",
  "plain_momentum_sgd",
  "with_float32_state",
]


def with_float32_state(
  inner: optax.GradientTransformation,
) -> optax.GradientTransformation:
  """Runs ``inner`` on float32 copies of the updates, so its state is float32.

  Adam's second moment is an EMA with weight ``1 - b2 = 0.001`` per step: in
  bfloat16 (``|u| < |v|·2^-9`` vanishes) it stops moving, just like the
  weights. This keeps Adam's moments in float32 (8 bytes per parameter)
  while the weights stay in half precision; the returned updates are cast
  back to the incoming updates' dtype.
  """

  def to32(tree):
    return jax.tree.map(lambda x: x.astype(jnp.float32), tree)

  def init_fn(params):
    return inner.init(to32(params))

  def update_fn(updates, state, params=None):
    new, state = inner.update(to32(updates), state, None if params is None else to32(params))
    return jax.tree.map(lambda n, u: n.astype(u.dtype), new, updates), state

  return optax.GradientTransformation(init_fn, update_fn)


def plain_momentum_sgd(learning_rate: float, momentum: float = 0.9) -> optax.GradientTransformation:
  r"""Momentum SGD with the learning rate inside the buffer (the "H" form).

  The Caffe-style rule that :func:`jmp_train.modified_momentum_sgd` replaces, :math:`H \leftarrow m H - \lambda g,\
  W \leftarrow W + H`, computed as a framework computes it on half-precision
  tensors: ``optax.chain(optax.scale(-lambda), optax.trace(m))``, so
  :math:`\lambda g`, :math:`m H` and their sum are each rounded to the
  parameters' dtype and ``H`` is stored in it. In float16, :math:`\lambda g`
  falls below ``2^-14`` (subnormal: fewer bits) or ``2^-25`` (flushed to
  zero) long before ``g`` does, and below ``2^-14`` :math:`m H` rounds back to
  ``H`` whenever ``(1 - m)|H| < 2^-25`` (the buffer stops decaying). The
  damage is done by these roundings, not by storing ``H``: computing
  :math:`m H - \lambda g` in float32 and rounding once into a float16 ``H``
  follows the modified form to within 0.02% of test loss on digits (lr 1e-4,
  m 0.99, with Kahan). Not public API: the plain-momentum baseline in this
  experiment only.

  Args:
    learning_rate: the learning rate ``lambda`` (a scalar).
    momentum: the decay ``m``.

  Returns:
    An ``optax.GradientTransformation`` (state: ``optax.TraceState``).
  """
  return optax.chain(optax.scale(-learning_rate), optax.trace(decay=momentum))


def make_setups(
  learning_rate: float,
  half: Any = jnp.bfloat16,
  *,
  momentum: float = 0.9,
  adam_learning_rate: float | None = None,
  seed: int = 0,
) -> dict[str, tuple[Any, optax.GradientTransformation]]:
  """The compared setups: name -> (parameter dtype, optimizer).

  Args:
    learning_rate: SGD and momentum-SGD learning rate.
    half: the half dtype (weights of the half setups, and compute dtype).
    momentum: momentum of the momentum-SGD setups.
    adam_learning_rate: Adam's learning rate; ``None`` leaves Adam out. The
      half-weight Adam setups keep Adam's moments in float32
      (:func:`with_float32_state`), except the last one, which shows what
      half-precision moments cost.
    seed: stochastic rounding's seed.

  Returns:
    An ordered dict; the names say the weights' dtype and the method.
  """
  h = np.dtype(half).name
  sgd = lambda: optax.sgd(learning_rate)
  setups = {
    "sgd / float32 master": (jnp.float32, sgd()),
    f"sgd / {h}": (half, sgd()),
    f"sgd / {h} + kahan": (half, optax.chain(sgd(), jmp_train.kahan_compensation())),
    f"sgd / {h} + stochastic rounding": (
      half,
      optax.chain(sgd(), jmp_train.stochastic_rounding(seed)),
    ),
    "momentum sgd / float32 master": (jnp.float32, optax.sgd(learning_rate, momentum)),
    f"momentum sgd / {h} plain (H form)": (half, plain_momentum_sgd(learning_rate, momentum)),
    f"momentum sgd / {h} + modified momentum (no feedback)": (
      half,
      jmp_train.modified_momentum_sgd(learning_rate, momentum, error_feedback=False),
    ),
    f"momentum sgd / {h} + modified momentum (error feedback)": (
      half,
      jmp_train.modified_momentum_sgd(learning_rate, momentum),
    ),
    f"momentum sgd / {h} + modified momentum (no feedback) + kahan": (
      half,
      optax.chain(
        jmp_train.modified_momentum_sgd(learning_rate, momentum, error_feedback=False),
        jmp_train.kahan_compensation(),
      ),
    ),
    f"momentum sgd / {h} + modified momentum (no feedback) + stochastic rounding": (
      half,
      optax.chain(
        jmp_train.modified_momentum_sgd(learning_rate, momentum, error_feedback=False),
        jmp_train.stochastic_rounding(seed),
      ),
    ),
  }
  if adam_learning_rate is not None:
    adam = lambda: with_float32_state(optax.adam(adam_learning_rate))
    setups.update(
      {
        "adam / float32 master": (jnp.float32, optax.adam(adam_learning_rate)),
        f"adam / {h}": (half, adam()),
        f"adam / {h} + kahan": (half, optax.chain(adam(), jmp_train.kahan_compensation())),
        f"adam / {h} + stochastic rounding": (
          half,
          optax.chain(adam(), jmp_train.stochastic_rounding(seed)),
        ),
        f"adam / {h} + kahan, {h} moments": (
          half,
          optax.chain(optax.adam(adam_learning_rate), jmp_train.kahan_compensation()),
        ),
      }
    )
  return setups


def make_8bit_setups(
  learning_rate: float,
  adam_learning_rate: float,
  half: Any = jnp.bfloat16,
  *,
  momentum: float = 0.9,
  seed: int = 0,
) -> dict[str, tuple[Any, optax.GradientTransformation]]:
  """Half-precision weights with 8-bit optimizer state (no float32 anywhere).

  :func:`jmp_train.adam_8bit` and
  :func:`jmp_train.sgd_8bit` followed by stochastic
  rounding or Kahan compensation. ``"all leaves"`` rows quantize every leaf
  (``min_8bit_size=0``); the others keep the moments of leaves under 4,096
  elements in float32 (on the digits MLP: all but the first weight matrix).
  One row rounds the codes to nearest instead of stochastically. Names are
  grouped like :func:`make_setups`' (``"adam / ..."``, ``"momentum sgd /
  ..."``), whose ``"float32 master"`` rows are the references.

  Args:
    learning_rate: momentum-SGD learning rate.
    adam_learning_rate: Adam's learning rate.
    half: the half dtype of the weights.
    momentum: momentum of the SGD rows.
    seed: seed of the stochastic roundings.

  Returns:
    An ordered dict name -> (parameter dtype, optimizer).
  """
  h = np.dtype(half).name
  sr = lambda: jmp_train.stochastic_rounding(seed)
  kahan = jmp_train.kahan_compensation
  adam8 = lambda **kw: jmp_train.adam_8bit(adam_learning_rate, seed=seed, **kw)
  return {
    f"adam / {h} + stochastic rounding, 8-bit moments": (half, optax.chain(adam8(), sr())),
    f"adam / {h} + stochastic rounding, 8-bit moments (all leaves)": (half, optax.chain(adam8(min_8bit_size=0), sr())),
    f"adam / {h} + kahan, 8-bit moments (all leaves)": (half, optax.chain(adam8(min_8bit_size=0), kahan())),
    f"adam / {h} + kahan, 8-bit moments (all leaves, rounded to nearest)": (
      half,
      optax.chain(adam8(min_8bit_size=0, rounding="nearest"), kahan()),
    ),
    f"momentum sgd / {h} + sgd_8bit (all leaves) + stochastic rounding": (
      half,
      optax.chain(jmp_train.sgd_8bit(learning_rate, momentum, min_8bit_size=0, seed=seed), sr()),
    ),
  }


def make_text_setups(
  learning_rate: optax.ScalarOrSchedule,
  half: Any = jnp.bfloat16,
  *,
  seed: int = 0,
) -> dict[str, tuple[Any, optax.GradientTransformation]]:
  """Adam on the text task: float32 master weights against half weights with 8-bit moments.

  The reference ``"adam / float32 master"`` (``optax.adam``, float32
  moments); half weights with float32 moments and stochastic rounding; half
  weights with :func:`jmp_train.adam_8bit` (default ``min_8bit_size``)
  followed by stochastic rounding, by Kahan compensation, or by nothing
  (updates rounded to nearest: what the 8-bit moments alone give); and the
  smallest state, every leaf 8-bit in blocks of 2,048, with stochastic
  rounding.

  Args:
    learning_rate: Adam's learning rate or schedule (the same for every row).
    half: the half dtype of the weights.
    seed: seed of the stochastic roundings.

  Returns:
    An ordered dict name -> (parameter dtype, optimizer).
  """
  h = np.dtype(half).name
  adam8 = lambda **kw: jmp_train.adam_8bit(learning_rate, seed=seed, **kw)
  return {
    "adam / float32 master": (jnp.float32, optax.adam(learning_rate)),
    f"adam / {h} + stochastic rounding": (
      half,
      optax.chain(with_float32_state(optax.adam(learning_rate)), jmp_train.stochastic_rounding(seed)),
    ),
    f"adam / {h} + stochastic rounding, 8-bit moments": (
      half,
      optax.chain(adam8(), jmp_train.stochastic_rounding(seed)),
    ),
    f"adam / {h} + kahan, 8-bit moments": (half, optax.chain(adam8(), jmp_train.kahan_compensation())),
    f"adam / {h}, 8-bit moments": (half, adam8()),
    f"adam / {h} + stochastic rounding, 8-bit moments (all leaves, blocks of 2048)": (
      half,
      optax.chain(adam8(min_8bit_size=0, block_size=2048), jmp_train.stochastic_rounding(seed)),
    ),
  }


def make_momentum_setups(
  learning_rate: float = 1e-4,
  momentum: float = 0.99,
  half: Any = jnp.float16,
) -> dict[str, tuple[Any, optax.GradientTransformation]]:
  """Modified momentum SGD against the plain-momentum baseline, plain (H-form) momentum.

  The default regime is where the two differ in float16: a small learning
  rate with a long momentum (effective step ``1e-4 / (1 - 0.99) = 0.01``, the
  learning rate of :func:`make_setups`), so that every ``lr * g`` is a
  float16 subnormal and 10-17% of them flush to zero. The modified rule without feedback
  (``error_feedback=False``) is compared with the H form alone and followed
  by Kahan; the default rule with error feedback is there too (at ``m =
  0.99`` its documented lag, up to ``m/(1-m)`` half-ulps, is 11 times that
  at ``m = 0.9``). The group name (before ``" / "``) carries the
  hyperparameters; its reference is the ``"float32 master"`` row.

  Args:
    learning_rate: the learning rate.
    momentum: the momentum.
    half: the half dtype.

  Returns:
    An ordered dict name -> (parameter dtype, optimizer).
  """
  h = np.dtype(half).name
  g = f"momentum sgd lr={learning_rate:g} m={momentum:g}"
  mm = lambda: jmp_train.modified_momentum_sgd(learning_rate, momentum, error_feedback=False)
  plain = lambda: plain_momentum_sgd(learning_rate, momentum)
  return {
    f"{g} / float32 master": (jnp.float32, optax.sgd(learning_rate, momentum)),
    f"{g} / {h} plain (H form)": (half, plain()),
    f"{g} / {h} + modified momentum (no feedback)": (half, mm()),
    f"{g} / {h} + modified momentum (error feedback)": (half, jmp_train.modified_momentum_sgd(learning_rate, momentum)),
    f"{g} / {h} plain (H form) + kahan": (half, optax.chain(plain(), jmp_train.kahan_compensation())),
    f"{g} / {h} + modified momentum (no feedback) + kahan": (half, optax.chain(mm(), jmp_train.kahan_compensation())),
  }
