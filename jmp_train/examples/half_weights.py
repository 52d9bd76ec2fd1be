"""The real-task check of half-precision weight updates: a digits MLP.

Shared by ``tests/test_low_precision.py``, ``benchmarks/bench_half_weights_training.py``
and ``notebooks/03_half_precision_weights.ipynb`` so the three report the same
experiment. A two-layer MLP is trained on scikit-learn's 8x8 digits
(:func:`jmp_train.examples.data.load_digits`) with the forward and backward pass
in a half dtype in every setup; what differs is only how the weights are
stored and updated:

* ``"float32 master"``: float32 parameters, cast to the half dtype for the
  forward pass (the classic mixed-precision recipe);
* half parameters with a plain optimizer (updates rounded to nearest),
  including momentum SGD in the plain "H" form that keeps the learning rate
  inside a half-precision buffer (:func:`plain_momentum_sgd`, the baseline of
  the modified momentum SGD);
* half parameters with :func:`~jmp_train._src.low_precision.kahan_compensation`,
  :func:`~jmp_train._src.low_precision.stochastic_rounding` or
  :func:`~jmp_train._src.low_precision.modified_momentum_sgd` (with its
  default error feedback, and as the modified rule without feedback alone or followed by
  Kahan or stochastic rounding).

Every setup starts from the same initial values (drawn in float32 and rounded
to the half dtype) and sees the same minibatches.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jmp_train.examples import data as data_lib
from jmp_train._src import low_precision
from jmp_train._src import optimizers_8bit

__all__ = [
    "DigitsResult",
    "init_mlp",
    "make_8bit_setups",
    "make_momentum_setups",
    "make_setups",
    "plain_momentum_sgd",
    "relative_gap",
    "run_all",
    "train_digits",
    "with_float32_state",
]


class DigitsResult(NamedTuple):
  """Final metrics of one training run."""

  test_loss: float
  test_accuracy: float
  train_loss: float


def init_mlp(key: jax.Array, sizes: tuple[int, ...]) -> dict[str, Any]:
  """float32 MLP parameters ``{w0, b0, w1, b1, ...}``, LeCun-normal weights."""
  params = {}
  for i, (fan_in, fan_out) in enumerate(zip(sizes[:-1], sizes[1:])):
    key, sub = jax.random.split(key)
    params[f"w{i}"] = jax.random.normal(sub, (fan_in, fan_out), jnp.float32) * (
        1.0 / np.sqrt(fan_in)
    )
    params[f"b{i}"] = jnp.zeros((fan_out,), jnp.float32)
  return params


def _logits(params: dict[str, Any], x: jax.Array, compute_dtype: Any) -> jax.Array:
  n_layers = len(params) // 2
  h = x.astype(compute_dtype)
  for i in range(n_layers):
    w = params[f"w{i}"].astype(compute_dtype)
    b = params[f"b{i}"].astype(compute_dtype)
    h = h @ w + b
    if i < n_layers - 1:
      h = jax.nn.relu(h)
  return h.astype(jnp.float32)


def _loss(params, x, y, compute_dtype):
  logits = _logits(params, x, compute_dtype)
  return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


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


def plain_momentum_sgd(
    learning_rate: float, momentum: float = 0.9
) -> optax.GradientTransformation:
  r"""Momentum SGD with the learning rate inside the buffer (the "H" form).

  The Caffe-style rule that :func:`~jmp_train._src.low_precision.
  modified_momentum_sgd` replaces, :math:`H \leftarrow m H - \lambda g,\
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
      f"sgd / {h} + kahan": (half, optax.chain(sgd(), low_precision.kahan_compensation())),
      f"sgd / {h} + stochastic rounding": (
          half,
          optax.chain(sgd(), low_precision.stochastic_rounding(seed)),
      ),
      "momentum sgd / float32 master": (jnp.float32, optax.sgd(learning_rate, momentum)),
      f"momentum sgd / {h} plain (H form)": (half, plain_momentum_sgd(learning_rate, momentum)),
      f"momentum sgd / {h} + modified momentum (no feedback)": (
          half,
          low_precision.modified_momentum_sgd(
              learning_rate, momentum, error_feedback=False),
      ),
      f"momentum sgd / {h} + modified momentum (error feedback)": (
          half,
          low_precision.modified_momentum_sgd(learning_rate, momentum),
      ),
      f"momentum sgd / {h} + modified momentum (no feedback) + kahan": (
          half,
          optax.chain(
              low_precision.modified_momentum_sgd(
                  learning_rate, momentum, error_feedback=False),
              low_precision.kahan_compensation(),
          ),
      ),
      f"momentum sgd / {h} + modified momentum (no feedback) + stochastic rounding": (
          half,
          optax.chain(
              low_precision.modified_momentum_sgd(
                  learning_rate, momentum, error_feedback=False),
              low_precision.stochastic_rounding(seed),
          ),
      ),
  }
  if adam_learning_rate is not None:
    adam = lambda: with_float32_state(optax.adam(adam_learning_rate))
    setups.update({
        "adam / float32 master": (jnp.float32, optax.adam(adam_learning_rate)),
        f"adam / {h}": (half, adam()),
        f"adam / {h} + kahan": (half, optax.chain(adam(), low_precision.kahan_compensation())),
        f"adam / {h} + stochastic rounding": (
            half,
            optax.chain(adam(), low_precision.stochastic_rounding(seed)),
        ),
        f"adam / {h} + kahan, {h} moments": (
            half,
            optax.chain(optax.adam(adam_learning_rate), low_precision.kahan_compensation()),
        ),
    })
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

  :func:`~jmp_train._src.optimizers_8bit.adam_8bit` and
  :func:`~jmp_train._src.optimizers_8bit.sgd_8bit` followed by stochastic
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
  o8 = optimizers_8bit
  sr = lambda: low_precision.stochastic_rounding(seed)
  kahan = low_precision.kahan_compensation
  adam8 = lambda **kw: o8.adam_8bit(adam_learning_rate, seed=seed, **kw)
  return {
      f"adam / {h} + stochastic rounding, 8-bit moments": (half, optax.chain(adam8(), sr())),
      f"adam / {h} + stochastic rounding, 8-bit moments (all leaves)": (
          half, optax.chain(adam8(min_8bit_size=0), sr())),
      f"adam / {h} + kahan, 8-bit moments (all leaves)": (
          half, optax.chain(adam8(min_8bit_size=0), kahan())),
      f"adam / {h} + kahan, 8-bit moments (all leaves, rounded to nearest)": (
          half, optax.chain(adam8(min_8bit_size=0, rounding="nearest"), kahan())),
      f"momentum sgd / {h} + sgd_8bit (all leaves) + stochastic rounding": (
          half,
          optax.chain(o8.sgd_8bit(learning_rate, momentum, min_8bit_size=0, seed=seed), sr())),
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
  mm = lambda: low_precision.modified_momentum_sgd(
      learning_rate, momentum, error_feedback=False)
  plain = lambda: plain_momentum_sgd(learning_rate, momentum)
  return {
      f"{g} / float32 master": (jnp.float32, optax.sgd(learning_rate, momentum)),
      f"{g} / {h} plain (H form)": (half, plain()),
      f"{g} / {h} + modified momentum (no feedback)": (half, mm()),
      f"{g} / {h} + modified momentum (error feedback)": (
          half, low_precision.modified_momentum_sgd(learning_rate, momentum)),
      f"{g} / {h} plain (H form) + kahan": (
          half, optax.chain(plain(), low_precision.kahan_compensation())),
      f"{g} / {h} + modified momentum (no feedback) + kahan": (
          half, optax.chain(mm(), low_precision.kahan_compensation())),
  }


def train_digits(
    optimizer: optax.GradientTransformation,
    param_dtype: Any,
    compute_dtype: Any = jnp.bfloat16,
    *,
    steps: int = 1000,
    batch_size: int = 64,
    hidden: int = 64,
    seed: int = 0,
    dataset: data_lib.Dataset | None = None,
    log_every: int = 0,
) -> tuple[DigitsResult, np.ndarray]:
  """Trains the digits MLP and returns its final metrics.

  Args:
    optimizer: the optax optimizer (``params`` are passed to ``update``).
    param_dtype: dtype the parameters are stored and updated in.
    compute_dtype: dtype of the forward and backward pass.
    steps: minibatch steps.
    batch_size: examples per minibatch.
    hidden: hidden units.
    seed: seed of the initialisation and of the minibatch order.
    dataset: the data (``load_digits()`` when ``None``).
    log_every: record the test loss every this many steps (0: never).

  Returns:
    ``(result, curve)``: the final :class:`DigitsResult` and the test losses
    recorded every ``log_every`` steps (empty when ``log_every`` is 0).
  """
  ds = dataset if dataset is not None else data_lib.load_digits()
  x_train, y_train = jnp.asarray(ds.x_train), jnp.asarray(ds.y_train)
  x_test, y_test = jnp.asarray(ds.x_test), jnp.asarray(ds.y_test)
  rng = np.random.default_rng(seed)
  idx = np.stack([
      rng.choice(len(ds.x_train), batch_size, replace=False) for _ in range(steps)
  ])
  # Same starting point for every setup: drawn in float32, rounded to half.
  init = init_mlp(jax.random.key(seed), (x_train.shape[1], hidden, 10))
  init = jax.tree.map(lambda p: p.astype(compute_dtype).astype(param_dtype), init)
  log_every = int(log_every)

  @jax.jit
  def run(params, idx):
    opt_state = optimizer.init(params)

    def step(carry, batch_idx):
      params, opt_state, i = carry
      grads = jax.grad(_loss)(params, x_train[batch_idx], y_train[batch_idx], compute_dtype)
      updates, opt_state = optimizer.update(grads, opt_state, params)
      params = optax.apply_updates(params, updates)
      if log_every:
        test_loss = jax.lax.cond(
            (i + 1) % log_every == 0,
            lambda: _loss(params, x_test, y_test, compute_dtype),
            lambda: jnp.full((), jnp.nan, jnp.float32),
        )
      else:
        test_loss = jnp.zeros((), jnp.float32)
      return (params, opt_state, i + 1), test_loss

    (params, _, _), curve = jax.lax.scan(
        step, (params, opt_state, jnp.zeros([], jnp.int32)), idx
    )
    logits = _logits(params, x_test, compute_dtype)
    test_loss = optax.softmax_cross_entropy_with_integer_labels(logits, y_test).mean()
    accuracy = (logits.argmax(-1) == y_test).mean()
    train_loss = _loss(params, x_train, y_train, compute_dtype)
    return test_loss, accuracy, train_loss, curve

  test_loss, accuracy, train_loss, curve = run(init, jnp.asarray(idx))
  curve = np.asarray(curve)
  curve = curve[log_every - 1 :: log_every] if log_every else curve[:0]
  return DigitsResult(float(test_loss), float(accuracy), float(train_loss)), curve


def relative_gap(value: float, reference: float) -> float:
  """``|value - reference| / |reference|``."""
  return abs(value - reference) / abs(reference)


def run_all(
    setups: dict[str, tuple[Any, optax.GradientTransformation]],
    compute_dtype: Any,
    progress: Callable[[str], None] | None = None,
    **kwargs: Any,
) -> dict[str, DigitsResult]:
  """Trains every setup with the same data, seed and steps."""
  dataset = kwargs.pop("dataset", None) or data_lib.load_digits()
  results = {}
  for name, (dtype, opt) in setups.items():
    if progress:
      progress(name)
    results[name], _ = train_digits(opt, dtype, compute_dtype, dataset=dataset, **kwargs)
  return results
