"""The real-task check of half-precision weight updates: a digits MLP.

Shared by ``tests/test_low_precision_digits.py``, ``benchmarks/bench_half_weights_training.py``
and ``notebooks/03_half_precision_weights.ipynb`` so the three report the same
experiment. A two-layer MLP is trained on scikit-learn's 8x8 digits
(:func:`jmp_train_examples.data.load_digits`) with the forward and backward pass
in a half dtype in every setup; what differs is only how the weights are
stored and updated:

* ``"float32 master"``: float32 parameters, cast to the half dtype for the
  forward pass (the classic mixed-precision recipe);
* half parameters with a plain optimizer (updates rounded to nearest),
  including momentum SGD in the plain "H" form that keeps the learning rate
  inside a half-precision buffer (:func:`plain_momentum_sgd`, the baseline of
  the modified momentum SGD);
* half parameters with :func:`jmp_train.kahan_compensation`,
  :func:`jmp_train.stochastic_rounding` or
  :func:`jmp_train.modified_momentum_sgd` (with its
  default error feedback, and as the modified rule without feedback alone or followed by
  Kahan or stochastic rounding).

Every setup starts from the same initial values (drawn in float32 and rounded
to the half dtype) and sees the same minibatches. The setups are built in
:mod:`jmp_train_examples.half_weights_setups`; this module trains them.

:func:`train_text` runs the same comparison on the demo's text task
(:data:`jmp_train_examples.demo_tasks.TASKS` ``["text"]``: a character-level
Transformer on the standard library's source, the last 10% held out),
with its data, model and initialization unchanged.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jmp_train_examples import data as data_lib
from jmp_train_examples import demo_tasks
from jmp_train_examples.demo_configs import DemoSettings
from jmp_train_examples.half_weights_setups import make_8bit_setups
from jmp_train_examples.half_weights_setups import make_momentum_setups
from jmp_train_examples.half_weights_setups import make_setups
from jmp_train_examples.half_weights_setups import make_text_setups
from jmp_train_examples.half_weights_setups import plain_momentum_sgd
from jmp_train_examples.half_weights_setups import with_float32_state

__all__ = [
  "DigitsResult",
  "init_mlp",
  "make_8bit_setups",
  "make_momentum_setups",
  "make_setups",
  "make_text_setups",
  "plain_momentum_sgd",
  "relative_gap",
  "run_all",
  "train_digits",
  "train_digits_together",
  "train_text",
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
    params[f"w{i}"] = jax.random.normal(sub, (fan_in, fan_out), jnp.float32) * (1.0 / np.sqrt(fan_in))
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


@functools.lru_cache(maxsize=64)
def _digits_run(optimizers: tuple[optax.GradientTransformation, ...], compute_dtype: np.dtype, log_every: int):
  """The jitted training run of several setups, stepped side by side in one loop.

  The data are arguments, so seeds share the compiled program; each setup
  sees the same minibatches.
  """

  @jax.jit
  def run(inits, idx, data):
    x_train, y_train, x_test, y_test = data
    opt_states = tuple(opt.init(p) for opt, p in zip(optimizers, inits))

    def step(carry, batch_idx):
      params, opt_states, i = carry
      new_params, new_states = [], []
      for optimizer, p, s in zip(optimizers, params, opt_states):
        grads = jax.grad(_loss)(p, x_train[batch_idx], y_train[batch_idx], compute_dtype)
        updates, s = optimizer.update(grads, s, p)
        new_params.append(optax.apply_updates(p, updates))
        new_states.append(s)
      params, opt_states = tuple(new_params), tuple(new_states)
      if log_every:
        test_loss = jax.lax.cond(
          (i + 1) % log_every == 0,
          lambda: jnp.stack([_loss(p, x_test, y_test, compute_dtype) for p in params]),
          lambda: jnp.full((len(params),), jnp.nan, jnp.float32),
        )
      else:
        test_loss = jnp.zeros((len(params),), jnp.float32)
      return (params, opt_states, i + 1), test_loss

    (params, _, _), curves = jax.lax.scan(step, (tuple(inits), opt_states, jnp.zeros([], jnp.int32)), idx)
    results = []
    for k, p in enumerate(params):
      logits = _logits(p, x_test, compute_dtype)
      test_loss = optax.softmax_cross_entropy_with_integer_labels(logits, y_test).mean()
      accuracy = (logits.argmax(-1) == y_test).mean()
      results.append((test_loss, accuracy, _loss(p, x_train, y_train, compute_dtype), curves[:, k]))
    return results

  return run


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
  setups = {"": (param_dtype, optimizer)}
  kwargs = dict(steps=steps, batch_size=batch_size, hidden=hidden, seed=seed, dataset=dataset, log_every=log_every)
  return train_digits_together(setups, compute_dtype, **kwargs)[""]


def train_digits_together(
  setups: dict[str, tuple[Any, optax.GradientTransformation]],
  compute_dtype: Any = jnp.bfloat16,
  *,
  steps: int = 1000,
  batch_size: int = 64,
  hidden: int = 64,
  seed: int = 0,
  dataset: data_lib.Dataset | None = None,
  log_every: int = 0,
) -> dict[str, tuple[DigitsResult, np.ndarray]]:
  """Trains several setups as :func:`train_digits` does, in one compiled program.

  Every setup starts from the same initial values and sees the same
  minibatches; one loop steps them side by side, so XLA compiles one program
  for all of them (compiling is most of the cost of these small runs). The
  program is cached by the setups' optimizers: calling again with another
  ``seed`` reuses it.

  Args:
    setups: name -> ``(param_dtype, optimizer)``, as :func:`make_setups` returns.
    compute_dtype: dtype of the forward and backward pass.
    steps: minibatch steps.
    batch_size: examples per minibatch.
    hidden: hidden units.
    seed: seed of the initialisation and of the minibatch order.
    dataset: the data (``load_digits()`` when ``None``).
    log_every: record the test loss every this many steps (0: never).

  Returns:
    name -> ``(result, curve)``, as :func:`train_digits` returns for each setup.
  """
  ds = dataset if dataset is not None else data_lib.load_digits()
  data = tuple(jnp.asarray(a) for a in (ds.x_train, ds.y_train, ds.x_test, ds.y_test))
  rng = np.random.default_rng(seed)
  idx = np.stack([rng.choice(len(ds.x_train), batch_size, replace=False) for _ in range(steps)])
  # Same starting point for every setup: drawn in float32, rounded to half.
  init = init_mlp(jax.random.key(seed), (ds.x_train.shape[1], hidden, 10))
  inits = tuple(
    jax.tree.map(lambda p, d=dtype: p.astype(compute_dtype).astype(d), init) for dtype, _ in setups.values()
  )
  log_every = int(log_every)
  run = _digits_run(tuple(opt for _, opt in setups.values()), np.dtype(compute_dtype), log_every)
  out = {}
  trained = jax.device_get(run(inits, jnp.asarray(idx), data))
  for name, (test_loss, accuracy, train_loss, curve) in zip(setups, trained):
    curve = np.asarray(curve)
    curve = curve[log_every - 1 :: log_every] if log_every else curve[:0]
    out[name] = DigitsResult(float(test_loss), float(accuracy), float(train_loss)), curve
  return out


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


def train_text(
  optimizer: optax.GradientTransformation,
  param_dtype: Any,
  compute_dtype: Any = jnp.bfloat16,
  *,
  settings: DemoSettings | None = None,
  seeds: tuple[int, ...] = (0,),
) -> list[DigitsResult]:
  """Trains the demo's text Transformer once per seed; returns the final metrics.

  The task is the demo's (:func:`jmp_train_examples.demo_tasks.TASKS`
  ``["text"]`` and :func:`~jmp_train_examples.demo_tasks.init_params` with
  ``settings``, its seed replaced by each of ``seeds``: the seed sets the
  initial weights and the batches). The parameters are stored in
  ``param_dtype`` (the float32 initial values rounded to ``compute_dtype``
  first, so every setup starts from the same point) and cast to
  ``compute_dtype`` for the forward and backward pass; one compiled program
  serves every seed.

  Args:
    optimizer: the optax optimizer (``params`` are passed to ``update``).
    param_dtype: dtype the parameters are stored and updated in.
    compute_dtype: dtype of the forward and backward pass.
    settings: the demo's settings (``DemoSettings()``, the demo's defaults,
      when ``None``); ``steps``, ``batch``, ``seq_len``, ``d_model``,
      ``layers`` and ``eval_batches`` are used.
    seeds: the seeds to train with.

  Returns:
    One :class:`DigitsResult` per seed: ``test_loss`` and ``test_accuracy``
    are the mean next-byte cross-entropy and accuracy on the held-out
    ``"val"`` batches, ``train_loss`` on the ``"train"`` evaluation batches.
  """
  settings = settings or DemoSettings()

  def loss(params, model, x, y):
    p = jax.tree.map(lambda v: v.astype(compute_dtype), params)
    logits = model.apply({"params": p}, x).astype(jnp.float32)
    return demo_tasks.loss_fn(logits, y)

  @jax.jit
  def run(params, xs, ys, evals):
    def step(carry, batch):
      params, opt_state = carry
      grads = jax.grad(lambda p: loss(p, model, *batch)[0])(params)
      updates, opt_state = optimizer.update(grads, opt_state, params)
      return (optax.apply_updates(params, updates), opt_state), None

    (params, _), _ = jax.lax.scan(step, (params, optimizer.init(params)), (xs, ys))
    return {split: jax.lax.map(lambda b: loss(params, model, *b), (x, y)) for split, (x, y) in evals.items()}

  runs = [dataclasses.replace(settings, task="text", seed=seed) for seed in seeds]
  tasks = [demo_tasks.TASKS["text"](s) for s in runs]
  model = tasks[0].model  # the same for every seed
  results = []
  for s, task in zip(runs, tasks):
    init = demo_tasks.init_params(task, s)
    init = jax.tree.map(lambda p: jnp.asarray(p).astype(compute_dtype).astype(param_dtype), init)
    xs, ys = (np.stack(b) for b in zip(*(task.train_batch(i) for i in range(s.steps))))
    evals = {k: tuple(np.stack(b) for b in zip(*v)) for k, v in task.eval_sets.items()}
    out = jax.device_get(run(init, xs, ys, evals))
    val_loss, val_aux = out["val"]
    results.append(
      DigitsResult(float(np.mean(val_loss)), float(np.mean(val_aux["accuracy"])), float(np.mean(out["train"][0])))
    )
  return results
