"""The train-step tests' model, variables, batches and steps (tests/test_train.py).

A module of its own, light to import: the worker processes of the
multi-process test build the same step from it.
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import jmp_train
from helpers.fill import fill


class Net(nn.Module):
  """Dense -> BatchNorm -> ReLU -> Dropout -> Dense: params, state and rng."""

  @nn.compact
  def __call__(self, x, train: bool = True):
    x = nn.Dense(16)(x)
    x = nn.BatchNorm(use_running_average=not train, momentum=0.9)(x)
    x = nn.relu(x)
    x = nn.Dropout(0.25, deterministic=not train)(x)
    return nn.Dense(4)(x)


NET = Net()
# NumPy-filled variables: an eager init compiles each op, in this process and
# in each worker of the multi-process test.
VARS = fill(
  jax.eval_shape(NET.init, {"params": jax.random.PRNGKey(0), "dropout": jax.random.PRNGKey(1)}, jnp.ones((2, 6)))
)


def xent(logits, labels):
  loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
  return loss, {"accuracy": jnp.mean(jnp.argmax(logits, -1) == labels)}


def batch(i, n=16):
  rng = np.random.default_rng(i)
  y = rng.integers(0, 4, n).astype(np.int32)
  x = rng.normal(size=(n, 6)).astype(np.float32) + np.eye(4, 6, dtype=np.float32)[y]
  return x, y


def make(mode="single", policy="float32", **kwargs):
  kwargs.setdefault("optimizer", optax.sgd(0.1, momentum=0.9))
  return jmp_train.make_train_step(
    NET.apply,
    xent,
    kwargs.pop("optimizer"),
    policy=policy,
    mode=mode,
    has_aux=True,
    eval_apply_fn=functools.partial(NET.apply, train=False),
    **kwargs,
  )


def init(step, rng=0):
  return step.init(VARS["params"], model_state={"batch_stats": VARS["batch_stats"]}, rng=rng)


@functools.lru_cache(maxsize=None)
def cached(mode, policy, loss_scale_name=None, compression=False):
  loss_scale = {
    None: None,
    "dynamic": jmp_train.DynamicLossScale(2.0**10, growth_interval=3),
    "huge": jmp_train.StaticLossScale(2.0**24),
  }[loss_scale_name]
  return make(
    mode,
    policy,
    loss_scale=loss_scale,
    compression=jmp_train.sign_compression("batch") if compression else None,
  )
