"""The demo's tasks (deterministic batches: batch ``i`` depends on (seed, i) only).

A character-level Transformer language model on the Python standard
library's source (``"text"``) or an MLP on scikit-learn's 8x8 digits
(``"digits"``), and their initial parameters.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jmp_train_examples import data as data_lib
from jmp_train_examples.demo_configs import NUM_DEVICES
from jmp_train_examples.demo_configs import DemoError
from jmp_train_examples.demo_configs import DemoSettings

__all__ = ["TASKS", "Task", "gpt2_init", "init_params", "loss_fn"]


class Task(NamedTuple):
  model: Any
  example_input: np.ndarray
  train_batch: Callable[[int], tuple[np.ndarray, np.ndarray]]
  eval_sets: dict[str, list[tuple[np.ndarray, np.ndarray]]]


def loss_fn(logits, targets):
  """Token-mean cross-entropy, and the accuracy as an aux metric."""
  # The mean over every token of the batch: the usual language-model loss.
  loss = optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()
  accuracy = jnp.mean((jnp.argmax(logits, -1) == targets).astype(jnp.float32))
  return loss, {"accuracy": accuracy}


def _text_task(s: DemoSettings) -> Task:
  from jmp_train_examples.models import TransformerBlock

  corpus = data_lib.load_text_corpus(1_000_000)
  split = int(len(corpus) * 0.9)
  train, val = corpus[:split], corpus[split:]
  if s.seq_len + 1 >= len(val):
    raise DemoError(
      f"--seq-len {s.seq_len} does not fit in the {len(val):,}-byte validation "
      f"text; use --seq-len {len(val) - 2} or less"
    )

  def windows(source, rng, n):
    return data_lib.text_windows(source, rng, n, s.seq_len)

  def train_batch(i):
    return windows(train, np.random.default_rng((s.seed, i)), s.batch)

  def eval_set(source, seed):
    rng = np.random.default_rng((s.seed, seed, 7))
    return [windows(source, rng, s.batch) for _ in range(s.eval_batches)]

  model = TransformerBlock(
    vocab_size=data_lib.TEXT_VOCAB_SIZE,
    d_model=s.d_model,
    num_heads=max(1, s.d_model // 16),
    mlp_dim=4 * s.d_model,
    num_layers=s.layers,
    max_len=s.seq_len,
  )
  return Task(
    model,
    np.zeros((1, s.seq_len), np.int32),
    train_batch,
    {"train": eval_set(train, 1), "val": eval_set(val, 2)},
  )


def _digits_task(s: DemoSettings) -> Task:
  from jmp_train_examples.models import MLP

  try:
    ds = data_lib.load_digits(seed=s.seed)
  except ImportError as e:
    raise DemoError(f"{e} (or use --task text)") from None
  if s.batch > len(ds.x_test):
    # Validation runs over whole batches of the held-out images.
    most = len(ds.x_test) // NUM_DEVICES * NUM_DEVICES
    raise DemoError(
      f"--batch {s.batch} is more than the {len(ds.x_test)} held-out digits "
      f"images the validation loss is taken over; use --batch {most} or less"
    )

  def train_batch(i):
    idx = np.random.default_rng((s.seed, i)).integers(0, len(ds.x_train), s.batch)
    return ds.x_train[idx], ds.y_train[idx]

  def eval_set(x, y):
    n = (len(x) // s.batch) * s.batch
    return [(x[j : j + s.batch], y[j : j + s.batch]) for j in range(0, n, s.batch)]

  model = MLP(features=(s.hidden,) * max(1, s.layers), num_classes=10)
  return Task(
    model,
    np.zeros((1, 64), np.float32),
    train_batch,
    {"train": eval_set(ds.x_train, ds.y_train)[: s.eval_batches * 4], "val": eval_set(ds.x_test, ds.y_test)},
  )


TASKS = {"text": _text_task, "digits": _digits_task}


def gpt2_init(params: Any, key: jax.Array, num_layers: int, std: float = 0.02) -> Any:
  """GPT-2's initialization of a :class:`~jmp_train_examples.models.TransformerBlock`.

  Every ``kernel`` and ``embedding`` drawn from ``N(0, std²)``, the projections
  back into the residual stream (``attn/out``, ``mlp_out``) from
  ``N(0, std² / (2 · num_layers))``; biases and norm scales keep their values
  (0 and 1). Radford et al., "Language Models are Unsupervised Multitask
  Learners", 2019, section 2.3.
  """

  def draw(path, x, k):
    names = [getattr(p, "key", str(p)) for p in path]
    if names[-1] not in ("kernel", "embedding"):
      return x
    scale = std / np.sqrt(2 * num_layers) if names[-2] in ("out", "mlp_out") else std
    return scale * jax.random.normal(k, np.shape(x), np.float32)

  return jax.tree.map_with_path(draw, params, optax.tree.split_key_like(key, params))


def init_params(task: Task, s: DemoSettings):
  """The task model's initial parameters (Flax's or GPT-2's initialization), on the host."""
  variables = jax.jit(task.model.init)(jax.random.PRNGKey(s.seed), task.example_input)
  params = variables["params"]
  if s.init not in ("flax", "gpt2"):
    raise ValueError(f"Unknown init {s.init!r}; valid: 'flax', 'gpt2'.")
  if s.init == "gpt2" and s.task == "text":
    draw = jax.jit(gpt2_init, static_argnums=2)
    params = draw(params, jax.random.PRNGKey(s.seed + 1), max(1, s.layers))
  return jax.device_get(params)
