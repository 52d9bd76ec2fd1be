"""Local steps with periodic outer updates (DiLoCo), optionally through a compressor.

Each replica runs ``sync_every`` steps of its own ``inner`` optimizer on its
local gradients, with no communication; then the replicas average their
pseudo-gradient (how far each moved from the weights of the last
synchronisation) exactly or through a compressor (``sign_compression``:
1 bit per element with error feedback), and the ``outer`` optimizer moves
the shared weights by it.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jmp_train._src import varying_axes
from jmp_train._src.hyperparams import check_int
from jmp_train._src.compression.replica_averaging import ReplicaCompressor, ReplicaOptimizer
from jmp_train._src.compression.sign_layout import axis_size

__all__ = ["DiLoCoState", "diloco"]


class DiLoCoState(NamedTuple):
  """State of :func:`diloco`.

  Attributes:
    count: ``int32`` steps taken (local steps and synchronisations).
    anchor: the weights of the last synchronisation (the outer optimizer's
      parameters), equal on every replica.
    inner_state: the inner optimizer's state (this replica's own).
    outer_state: the outer optimizer's state (equal on every replica).
    compression_state: the compressor's state (e.g.
      :class:`~jmp_train.SignCompressionState` with this replica's
      residuals), or ``optax.EmptyState()`` for the exact average.
  """

  count: jax.Array
  anchor: Any
  inner_state: Any
  outer_state: Any
  compression_state: Any


def _check(inner, outer, sync_every, axis_name, compression, reset_inner):
  for name, tx in (("inner", inner), ("outer", outer)):
    if not isinstance(tx, optax.GradientTransformation):
      raise TypeError(
        f"diloco's {name} must be an optax.GradientTransformation, e.g. "
        f"{'optax.adamw(1e-3)' if name == 'inner' else 'optax.sgd(0.7, momentum=0.9, nesterov=True)'}"
        f", got {type(tx).__name__}: {tx!r}."
      )
    if isinstance(tx, (ReplicaCompressor, ReplicaOptimizer)):
      raise TypeError(
        f"diloco's {name} optimizer averages replicas itself ({type(tx).__name__}); pass "
        "a plain optax optimizer, and a compressor (sign_compression, compressed_mean) "
        "as compression=."
      )
  check_int(sync_every, "sync_every", 1, note=" (local steps per synchronisation, e.g. 16)")
  if not isinstance(axis_name, str):
    raise ValueError(f"axis_name must be the name of the replicas' mapped axis (a str), got {axis_name!r}.")
  if compression is not None and not isinstance(compression, ReplicaCompressor):
    raise TypeError(
      "compression must be None (the exact float32 average) or a compressor of local "
      "values that averages them across replicas, e.g. jmp_train.sign_compression("
      f"axis_name) or jmp_train.compressed_mean(axis_name), got {type(compression).__name__}: "
      f"{compression!r}."
    )
  if not isinstance(reset_inner, bool):
    raise ValueError(f"reset_inner must be a bool, got {reset_inner!r}.")


def diloco(
  inner: optax.GradientTransformation,
  outer: optax.GradientTransformation | None = None,
  sync_every: int = 16,
  *,
  axis_name: str,
  compression: optax.GradientTransformation | None = None,
  reset_inner: bool = False,
) -> optax.GradientTransformation:
  r"""Local steps with an outer update every ``sync_every`` steps (DiLoCo).

  Every replica applies ``inner`` to its own gradients; every
  ``sync_every``-th step it also computes its pseudo-gradient against the
  weights of the last synchronisation :math:`\bar\theta`, the replicas
  average it, and ``outer`` moves :math:`\bar\theta`:

  .. math::

    \theta_r \leftarrow \theta_r + \mathrm{inner}(g_r) \quad
    \text{(every step)}; \qquad
    \Delta = \mathrm{mean}_r(\bar\theta - \theta_r), \quad
    \bar\theta \leftarrow \bar\theta + \mathrm{outer}(\Delta), \quad
    \theta_r \leftarrow \bar\theta \quad \text{(every } H\text{-th step)}

  where :math:`H` is ``sync_every``. The mean is an exact ``pmean`` or,
  with ``compression``, the compressor's average: with
  :func:`jmp_train.sign_compression` one bit per element plus scales, with
  its error feedback carrying what the bits lose into the next
  synchronisation, so the bytes per step are about
  :math:`1/(32 H)` of a float32 all-reduce's. Only the synchronising
  steps communicate: the exchange sits in one branch of a ``lax.cond``.

  With ``outer = optax.sgd(1.0)``, ``sync_every=1`` and no compression this
  is data-parallel training with ``inner`` applied to the mean of the
  replicas' updates (for SGD: synchronous SGD).

  Args:
    inner: the optimizer of the local steps (the paper: AdamW).
    outer: the optimizer of the pseudo-gradients; ``None`` is
      ``optax.sgd(1.0)``, which sets the shared weights to the replicas'
      average (local SGD): the best outer step of this project's DiLoCo
      benchmark (tens of local steps, a short run; see the benchmarks
      report). The paper's ``optax.sgd(0.7, momentum=0.9, nesterov=True)``
      is tuned for hundreds of local steps on long runs.
    sync_every: local steps per synchronisation (``H``); the paper uses
      hundreds, 16 and more save most of the communication.
    axis_name: the replicas' mapped axis (``pmap``'s ``axis_name`` or a
      ``shard_map`` mesh axis).
    compression: ``None`` for the exact mean of the pseudo-gradients, or a
      compressor built for ``axis_name`` (:func:`jmp_train.sign_compression`,
      :func:`jmp_train.compressed_mean`).
    reset_inner: restart ``inner``'s state at every synchronisation (by
      default it carries over, as in the paper).

  Returns:
    An ``optax.GradientTransformation`` on local gradients whose state is a
    :class:`DiLoCoState`. Use it as :func:`jmp_train.make_train_step`'s
    ``compression=`` (with ``optimizer=None``), or in a ``shard_map`` /
    ``pmap`` step of your own. The replicas' parameters differ between
    synchronisations; a synchronisation's update takes each replica to the
    new shared weights :math:`\bar\theta` (up to the rounding of
    ``params + (new - params)`` in ``optax.apply_updates``), and the next
    pseudo-gradients are taken against :math:`\bar\theta` itself, so that
    rounding does not accumulate.

  Raises:
    TypeError: if ``inner``/``outer`` is not an optax transformation or
      averages replicas itself, or ``compression`` is not a compressor.
    ValueError: for a ``sync_every`` that is not a positive int, a
      non-string ``axis_name`` or a non-bool ``reset_inner``; at trace
      time, when ``axis_name`` is not bound.

  Examples:
    >>> import jax, jax.numpy as jnp, optax
    >>> import jmp_train
    >>> tx = jmp_train.diloco(optax.sgd(0.1), optax.sgd(1.0), sync_every=2,
    ...                       axis_name="i")
    >>> k = jax.local_device_count()
    >>> params = {"w": jnp.zeros((k, 3))}
    >>> state = jax.pmap(tx.init, axis_name="i")(params)
    >>> grads = {"w": jnp.arange(k * 3.0).reshape(k, 3)}
    >>> def step(p, s, g):
    ...   u, s = tx.update(g, s, p)
    ...   return optax.apply_updates(p, u), s
    >>> params, state = jax.pmap(step, axis_name="i")(params, state, grads)
    >>> bool((params["w"] == params["w"][0]).all()) or k == 1  # local step: apart
    False
    >>> params, state = jax.pmap(step, axis_name="i")(params, state, grads)
    >>> bool(jnp.allclose(params["w"], params["w"][0]))  # synchronised
    True

  References:
    Douillard et al., "DiLoCo: Distributed Low-Communication Training of
    Language Models", 2023. https://arxiv.org/abs/2311.08105

    Seide et al., "1-Bit Stochastic Gradient Descent and its Application to
    Data-Parallel Distributed Training of Speech DNNs", Interspeech 2014.
  """
  if outer is None:
    outer = optax.sgd(1.0)
  _check(inner, outer, sync_every, axis_name, compression, reset_inner)
  sync_every = int(sync_every)

  def init(params):
    # Fresh buffers: a donated step must not delete the caller's params.
    anchor = jax.tree.map(lambda p: jnp.array(p, copy=True), params)
    return DiLoCoState(
      count=jnp.zeros((), jnp.int32),
      anchor=anchor,
      inner_state=inner.init(params),
      outer_state=outer.init(anchor),
      compression_state=optax.EmptyState() if compression is None else compression.init(params),
    )

  def update(grads, state, params=None):
    if params is None:
      raise ValueError("diloco's update needs the parameters: tx.update(grads, state, params).")
    # A clear error at trace time when the axis is unbound (JAX's NameError says
    # to call axis_index under shard_map, where the step already is).
    axis_size(axis_name, None, "update", "diloco", leaves=jax.tree.leaves(grads))
    updates, inner_state = inner.update(grads, state.inner_state, params)
    local = optax.apply_updates(params, updates)
    count = state.count + 1

    def synchronise(operand):
      local, inner_state, outer_state, compression_state = operand
      delta = jax.tree.map(lambda a, p: (a - p).astype(a.dtype), state.anchor, local)
      if compression is None:
        mean = jax.lax.pmean(delta, axis_name)
      else:
        mean, compression_state = compression.update(delta, compression_state, params)
      outer_updates, outer_state = outer.update(mean, outer_state, state.anchor)
      anchor = optax.apply_updates(state.anchor, outer_updates)
      if reset_inner:
        inner_state = inner.init(anchor)
      return anchor, anchor, inner_state, outer_state, compression_state

    def stay(operand):
      local, inner_state, outer_state, compression_state = operand
      return local, state.anchor, inner_state, outer_state, compression_state

    new_params, anchor, inner_state, outer_state, compression_state = varying_axes.cond(
      count % sync_every == 0, synchronise, stay, (local, inner_state, state.outer_state, state.compression_state)
    )
    new_updates = jax.tree.map(lambda n, p: (n - p).astype(p.dtype), new_params, params)
    return new_updates, DiLoCoState(count, anchor, inner_state, outer_state, compression_state)

  return ReplicaOptimizer(init, update)
