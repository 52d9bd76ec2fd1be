r"""1-bit SGD with error feedback: compressed gradient exchange as optax.

Each replica quantizes its local gradient to one bit per element plus a few
float reconstruction values, and keeps what the quantization lost (the
residual) to add to its next gradient (Seide et al., 2014). The replicas then
average the quantized gradients with two collectives that move packed bits:

1. **worker** (every replica): ``v = g + r``; bit ``b = [v >= 0]``;
   reconstruction values ``(hi, lo)`` per segment; ``r <- v - decode(b)``.
   Each leaf is split among the ``K`` replicas, by whole columns or by
   rows (whichever sends fewer bytes, padded with zeros to whole bytes):
   chunk ``k``, *owned* by replica ``k``, holds part ``k`` of every leaf,
   its bits packed eight to a ``uint8``. Every chunk has the same shape, so
   every owner runs the same program, whose size does not grow with ``K``.
2. **all-to-all**: every replica sends chunk ``k`` to replica ``k``, with
   the ``(hi, lo)`` pairs of the segments it holds (one ``uint8`` message).
3. **owner** (replica ``k``): ``u = mean_j decode_j + e`` with the server
   residual ``e``; each *piece* of ``u`` (a whole column, or the owner's
   rows of a column) is re-quantized and ``e <- u - decode(u)``.
4. **all-gather** of the owners' packed chunks and pairs: every replica
   decodes the same bytes, so the output is identical on every replica.

Bytes each replica sends per step: ``2·(K-1)/K·N/8`` plus the pairs and
padding, against ``2·(K-1)/K·4N`` for a float32 ring all-reduce.

Scales: a *segment* shares one ``(hi, lo)``; ``x`` decodes to ``hi`` when
``x >= 0`` and to ``lo`` otherwise. ``"column"`` (Seide et al.): each index
of a leaf's last axis (the output feature of a ``Dense`` kernel), ``hi`` and
``lo`` the means of its non-negative and of its negative entries; ``"l1"``
(Karimireddy et al., 2019): one segment per leaf, ``hi = -lo = ‖v‖₁/d``;
``"l2"`` (Tang et al., 2021): one per leaf, ``hi = -lo = ‖v‖₂/√d``. An owner
applies the same kind of scale to each piece of its chunk, leaving the
padding out.

Residuals: the worker residual is float32 in each leaf's shape; the server
residual is float32, the replica's own chunk, so it depends on ``K``
(``init`` reads the axis size inside ``pmap``/``shard_map``, or takes
``num_replicas``). Conservation holds up to one float32 rounding per step:
``v = decode(b) + r`` and ``u = decode(u) + e``. A residual is never updated
from non-finite values: the previous one is kept, and the non-finite values
reach the output, so that :func:`jmp_train.loss_scaled` with ``axis_name``
skips the step on every replica.

The input must be each replica's *own* gradient. Under ``shard_map``,
``jax.grad`` with respect to parameters passed with ``P()`` returns their
gradient summed over the axis (a float ``psum``); mark them varying first::

  local_params = jax.lax.pcast(params, "data", to="varying")
  grads = jax.grad(loss_fn)(local_params, batch)  # this replica's gradient

Only named-axis collectives are used: the same code runs on one device,
several devices and several processes.

References:
  Seide et al., "1-Bit Stochastic Gradient Descent and its Application to
  Data-Parallel Distributed Training of Speech DNNs", Interspeech 2014.
  Karimireddy et al., "Error Feedback Fixes SignSGD and other Gradient
  Compression Schemes", ICML 2019. https://arxiv.org/abs/1901.09847
  Tang et al., "1-bit Adam: Communication Efficient Large-Scale Training
  with Adam's Convergence Speed", ICML 2021. https://arxiv.org/abs/2102.02888
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from jmp_train._src.varying_axes import all_gather_invariant
from jmp_train._src import varying_axes
from jmp_train._src.compression import sign_codec
from jmp_train._src.buckets import bucket_sizes, check_bucket_bytes
from jmp_train._src.compression.compressed_mean import CompressedMeanState
from jmp_train._src.hyperparams import check_bool, check_int
from jmp_train._src.leaf_checks import check_leaves
from jmp_train._src.compression.replica_averaging import ReplicaCompressor
from jmp_train._src.compression.sign_layout import Layout, axis_size, make_layout
from jmp_train._src.compression.wire_messages import append_floats, split_floats

__all__ = [
  "SignCompressionState",
  "sign_compression",
  "sign_compression_specs",
  "sign_compression_wire_bytes",
  "SCALES",
]

SCALES = ("column", "l1", "l2")


class SignCompressionState(NamedTuple):
  """State of :func:`sign_compression`, per replica.

  Attributes:
    count: int32 scalar, the number of updates so far (the same on every
      replica).
    worker_residual: a tuple of float32 arrays, one per gradient leaf (in
      ``jax.tree.leaves`` order) and in the leaf's shape (``(1,)`` for a
      scalar leaf), each the leaf's quantization error on this replica
      (zeros without error feedback).
    server_residual: float32 ``(S,)``, the error of re-quantizing the chunk
      this replica owns: its part of every leaf, in leaf order, with or
      without ``bucket_bytes`` (zeros without server error feedback;
      ``(0,)`` when ``axis_name`` is ``None``).
  """

  count: jax.Array
  worker_residual: tuple[jax.Array, ...]
  server_residual: jax.Array


@dataclasses.dataclass(frozen=True)
class _Config:
  """The factory's arguments, validated once (see :func:`_validate`)."""

  axis_name: str | None
  scale: str
  error_feedback: bool
  server_error_feedback: bool
  warmup_steps: int
  num_replicas: int | None
  bucket_bytes: int | None


def _validate(axis_name, scale, warmup_steps, num_replicas, bucket_bytes, **flags) -> None:
  if scale not in SCALES:
    raise ValueError(f"Unknown scale {scale!r}; valid scales: {', '.join(SCALES)}.")
  for name, value in flags.items():
    check_bool(value, name)
  check_int(warmup_steps, "warmup_steps", 0)
  if axis_name is not None and not isinstance(axis_name, str):
    raise ValueError(
      f"axis_name must be a string or None, got {axis_name!r}; to compress over "
      "several mesh axes, name one combined axis."
    )
  check_int(num_replicas, "num_replicas", 1, allow_none=True)
  check_bucket_bytes(bucket_bytes, allow_none=True)


# A bucket: the indices of its leaves (in tree order) and their layout.
_Bucket = tuple[tuple[int, ...], Layout]


def _buckets(cfg: _Config, leaves, where: str) -> tuple[_Bucket, ...]:
  """The leaves' buckets, last leaves first: each is exchanged on its own."""
  return _layouts(leaves, cfg.scale, cfg.bucket_bytes, axis_size(cfg.axis_name, cfg.num_replicas, where, leaves=leaves))


def _layouts(leaves, scale: str, bucket_bytes: int | None, k: int) -> tuple[_Bucket, ...]:
  if bucket_bytes is None:
    groups = [range(len(leaves))]
  else:
    like = [jax.ShapeDtypeStruct(np.shape(x), jnp.float32) for x in leaves]
    groups = [sorted(b) for b in bucket_sizes(like, bucket_bytes)]
  return tuple((tuple(g), make_layout([tuple(np.shape(leaves[i])) for i in g], scale, k)) for g in groups)


def _residual_shapes(leaves, buckets: tuple[_Bucket, ...], cfg: _Config):
  worker = tuple(tuple(np.shape(x)) or (1,) for x in leaves)
  server = 0 if cfg.axis_name is None else sum(layout.chunk for _, layout in buckets)
  return worker, (server,)


def _check_state(state: SignCompressionState, leaves, buckets, cfg: _Config) -> None:
  expected = _residual_shapes(leaves, buckets, cfg)
  workers = state.worker_residual
  got = (
    tuple(tuple(np.shape(r)) for r in workers) if isinstance(workers, (tuple, list)) else tuple(np.shape(workers)),
    tuple(state.server_residual.shape),
  )
  if got != expected:
    raise ValueError(
      f"SignCompressionState residual shapes {got} do not match the gradients "
      f"and {buckets[0][1].k if buckets else 1} replica(s), which need {expected}: "
      "the state was made (or checkpointed) for another replica count or other "
      "parameters, or by a jmp_train whose 1-bit chunks differ; init a new state "
      "(1-bit residuals cannot be moved between replica counts)."
    )


def _zero_leaves(layout: Layout) -> list[jax.Array]:
  return [jnp.zeros(shape, jnp.float32) for shape in layout.shapes]


def _compress_bucket(leaves, r, e, layout: Layout, cfg: _Config):
  """One bucket's worker step, exchange, owner step and final decode: ``(leaves, r, e)``."""
  local = cfg.axis_name is None
  bits, pairs, new_r, decoded = sign_codec.worker_step(
    leaves, r if cfg.error_feedback else None, layout, cfg.scale, decode=local
  )
  r = r if new_r is None else new_r
  if local:
    return decoded, r, e
  axis, s = cfg.axis_name, layout.chunk
  if not s:  # only empty leaves: nothing to exchange
    return _zero_leaves(layout), r, e
  # Phase 1: packed chunks, each with its pieces' pairs, to their owners.
  recv = lax.all_to_all(append_floats(bits, pairs), axis, 0, 0)
  o_bits, o_pairs, new_e = sign_codec.owner_step(
    *split_floats(recv, s // 8, pairs.shape[1:]),
    e if cfg.server_error_feedback else None,
    lax.axis_index(axis),
    layout,
    cfg.scale,
  )
  e = e if new_e is None else new_e
  # Phase 2: everyone gathers the owners' packed chunks and pairs.
  gathered = all_gather_invariant(append_floats(o_bits, o_pairs), axis)
  all_bits, all_pairs = split_floats(gathered, s // 8, o_pairs.shape)
  out = sign_codec.final_decode(all_bits, all_pairs, layout, [jnp.float32] * len(leaves))
  return out, r, e


def _chunk_starts(buckets, cfg: _Config) -> list[int]:
  """Where each bucket's chunk starts in the server residual: the buckets in leaf order.

  A leaf's part of the chunk depends on the leaf alone, so the server
  residual is every leaf's part in leaf order whatever the buckets: a state
  serves any ``bucket_bytes``.
  """
  sizes = [0 if cfg.axis_name is None else layout.chunk for _, layout in buckets]
  order = sorted(range(len(buckets)), key=lambda b: min(buckets[b][0], default=0))
  starts, start = [0] * len(buckets), 0
  for b in order:
    starts[b] = start
    start += sizes[b]
  return starts


def _compress(leaves, state: SignCompressionState, buckets, cfg: _Config):
  """Every bucket compressed and exchanged, last leaves first: ``(leaves, r, e)``."""
  out, r = list(leaves), list(state.worker_residual)
  e_parts = []
  for (idx, layout), start in zip(buckets, _chunk_starts(buckets, cfg)):
    size = 0 if cfg.axis_name is None else layout.chunk
    o, r_b, e_b = _compress_bucket(
      [leaves[i] for i in idx],
      tuple(r[i] for i in idx),
      state.server_residual[start : start + size],
      layout,
      cfg,
    )
    for j, i in enumerate(idx):
      out[i], r[i] = o[j], r_b[j]
    e_parts.append((start, e_b))
  if len(e_parts) <= 1:  # no leaves, or one exchange
    return out, tuple(r), e_parts[0][1] if e_parts else state.server_residual
  return out, tuple(r), jnp.concatenate([e for _, e in sorted(e_parts, key=lambda p: p[0])])


def _exact(leaves, state: SignCompressionState, cfg: _Config):
  """The warm-up branch: a float32 ``pmean`` of the leaves, residuals kept."""
  out = [x.astype(jnp.float32) for x in leaves]
  if cfg.axis_name is not None:
    out = lax.pmean(out, cfg.axis_name)
  return out, state.worker_residual, state.server_residual


def _init(cfg: _Config, params) -> SignCompressionState:
  leaves, _ = check_leaves(params, "parameters", "sign_compression")
  worker, server = _residual_shapes(leaves, _buckets(cfg, leaves, "init"), cfg)
  return SignCompressionState(
    count=jnp.zeros((), jnp.int32),
    worker_residual=tuple(jnp.zeros(shape, jnp.float32) for shape in worker),
    server_residual=jnp.zeros(server, jnp.float32),
  )


def _update(cfg: _Config, updates, state: SignCompressionState, params=None):
  del params
  leaves, treedef = check_leaves(updates, "gradients", "sign_compression")
  buckets = _buckets(cfg, leaves, "update")
  _check_state(state, leaves, buckets, cfg)
  if cfg.warmup_steps == 0:
    out, r, e = _compress(leaves, state, buckets, cfg)
  else:

    def warmup():
      return _exact(leaves, state, cfg)

    def one_bit():
      return _compress(leaves, state, buckets, cfg)

    out, r, e = varying_axes.cond(state.count < cfg.warmup_steps, warmup, one_bit)
  out = [o.astype(x.dtype) for o, x in zip(out, leaves)]
  return jax.tree.unflatten(treedef, out), SignCompressionState(
    count=optax.safe_increment(state.count),
    worker_residual=r,
    server_residual=e,
  )


def sign_compression(
  axis_name: str | None = None,
  *,
  scale: str = "column",
  error_feedback: bool = True,
  server_error_feedback: bool = True,
  warmup_steps: int = 0,
  num_replicas: int | None = None,
  bucket_bytes: int | None = None,
) -> optax.GradientTransformation:
  r"""Averages gradients across replicas with 1-bit compression and error feedback.

  Input: each replica's *local* gradients (not averaged). Output: their
  average, identical on every replica and in the input leaves' dtypes,
  exchanged as packed bits: an all-to-all of chunks to their owners, then
  an all-gather of the owners' re-quantized chunks (1/32 of the bytes of a
  float32 all-reduce, plus a few floats). Put it first in an
  ``optax.chain``, before the optimizer::

    tx = optax.chain(sign_compression("data"), optax.sgd(0.1, momentum=0.9))

  Worker side, per element with residual :math:`r` and segment
  reconstruction values :math:`(h, l)`:

  .. math::
    v = g + r, \quad \hat v = \begin{cases} h & v \ge 0 \\ l & v < 0
    \end{cases}, \quad r \leftarrow v - \hat v;

  owner side, for its chunk with server residual :math:`e`:
  :math:`u = \frac1K \sum_j \hat v_j + e`, :math:`e \leftarrow u - \hat u`;
  the output is :math:`\hat u` everywhere.

  Args:
    axis_name: the named axis of the replicas (``pmap``'s ``axis_name`` or a
      ``Mesh`` axis under ``shard_map``). ``None``: no communication; each
      replica quantizes its own gradient with error feedback (to study the
      quantization on one device).
    scale: reconstruction values: ``"column"`` (per column, Seide et al.),
      ``"l1"`` (per tensor ``‖v‖₁/d``) or ``"l2"`` (per tensor ``‖v‖₂/√d``).
    error_feedback: keep the worker residual (otherwise it stays zero).
    server_error_feedback: keep the owner's residual (otherwise zero).
    warmup_steps: average exactly (a float32 ``pmean``) for this many first
      steps, then compress. The branch is a ``lax.cond`` on the step
      counter, which is the same on every replica: no compression work is
      done during warm-up and no float all-reduce runs after it (the
      compiled program holds both branches; the float all-reduce sits in
      the warm-up branch's computation only). Residuals stay untouched
      during warm-up.
    num_replicas: the size of ``axis_name``, needed by ``init`` only when it
      runs outside ``pmap``/``shard_map``; checked against the axis
      otherwise.
    bucket_bytes: ``None``: one exchange for the whole tree. An int: the
      leaves are cut into buckets of about this many float32 bytes, last
      leaves first (as ``make_train_step``'s ``bucket_bytes``; a leaf is
      never split), and each bucket is compressed and exchanged on its own,
      so the exchange of the last layers' gradients depends on those
      gradients only and may start while the backward pass still computes
      earlier layers' (PyTorch DDP's buckets; Seide et al.'s double
      buffering). A leaf's part of each chunk does not depend on the
      buckets, so the results are the same bit for bit with any
      ``bucket_bytes`` (for finite gradients; a non-finite one keeps the
      worker residuals of its bucket only), and so is the state: a state
      made with one ``bucket_bytes`` serves another.

  Returns:
    An ``optax.GradientTransformation`` whose state is a
    :class:`SignCompressionState`.

  Raises:
    ValueError: at construction for an unknown ``scale``, a negative
      ``warmup_steps``, a non-positive ``bucket_bytes`` or a non-bool
      ``error_feedback`` / ``server_error_feedback``; at trace time when
      ``axis_name`` is not bound, when a gradient leaf is not floating, or
      when the state does not match the gradients (other parameters or
      another replica count).

  Examples:
    >>> import jax, jax.numpy as jnp, optax
    >>> tx = optax.chain(sign_compression("i"), optax.sgd(0.1))
    >>> k = jax.local_device_count()
    >>> params = {"w": jnp.zeros((k, 4, 3))}
    >>> state = jax.pmap(tx.init, axis_name="i")(params)
    >>> grads = {"w": jnp.arange(k * 12.0).reshape(k, 4, 3)}
    >>> updates, state = jax.pmap(tx.update, axis_name="i")(grads, state)
    >>> bool((updates["w"] == updates["w"][0]).all())  # same everywhere
    True

  References:
    Seide et al., "1-Bit Stochastic Gradient Descent and its Application to
    Data-Parallel Distributed Training of Speech DNNs", Interspeech 2014.
    https://www.isca-archive.org/interspeech_2014/seide14_interspeech.html

    Karimireddy et al., "Error Feedback Fixes SignSGD and other Gradient
    Compression Schemes", ICML 2019. https://arxiv.org/abs/1901.09847
  """
  _validate(
    axis_name,
    scale,
    warmup_steps,
    num_replicas,
    bucket_bytes,
    error_feedback=error_feedback,
    server_error_feedback=server_error_feedback,
  )
  cfg = _Config(
    axis_name=axis_name,
    scale=scale,
    error_feedback=error_feedback,
    server_error_feedback=server_error_feedback,
    warmup_steps=int(warmup_steps),
    num_replicas=None if num_replicas is None else int(num_replicas),
    bucket_bytes=None if bucket_bytes is None else int(bucket_bytes),
  )
  return ReplicaCompressor(functools.partial(_init, cfg), functools.partial(_update, cfg))


def sign_compression_specs(opt_state: Any, axis_name: str) -> Any:
  """``PartitionSpec`` s for an optimizer state holding compression states.

  Under ``shard_map``, every replica keeps its own residuals: their global
  arrays are the replicas' residuals concatenated along their first axis
  over ``axis_name`` (``P(axis_name)``); every other leaf (the counter, an
  optimizer's moments of replicated parameters) is replicated (``P()``).

  Args:
    opt_state: an optimizer state (or its ``jax.eval_shape``) that may
      contain :class:`SignCompressionState` s or
      :class:`~jmp_train.CompressedMeanState` s anywhere.
    axis_name: the mesh axis of the replicas.

  Returns:
    A pytree of ``jax.sharding.PartitionSpec`` matching ``opt_state``.

  Examples:
    >>> from jax.sharding import PartitionSpec as P
    >>> state = SignCompressionState(jnp.zeros((), jnp.int32), (jnp.zeros(8),), jnp.zeros(4))
    >>> sign_compression_specs(state, "data")
    SignCompressionState(count=P(), worker_residual=P('data',), server_residual=P('data',))
  """
  P = jax.sharding.PartitionSpec
  is_state = lambda x: isinstance(x, (SignCompressionState, CompressedMeanState))

  def residual(r):
    # An absent residual (optax.EmptyState) has no arrays to place.
    return r if isinstance(r, optax.EmptyState) else P(axis_name)

  def spec(x):
    if is_state(x):
      return type(x)(P(), residual(x.worker_residual), residual(x.server_residual))
    return P()

  return jax.tree.map(spec, opt_state, is_leaf=is_state)


def sign_compression_wire_bytes(
  params: Any,
  num_replicas: int,
  *,
  scale: str = "column",
  bucket_bytes: int | None = None,
) -> int:
  r"""Bytes one replica sends in one :func:`sign_compression` exchange, without compiling it.

  Each bucket's flattened gradients are cut into :math:`K` chunks of
  :math:`s` elements (padded so that chunks fall on whole words), and each
  chunk carries :math:`m` reconstruction pairs (two float32 values per
  scale segment it holds). A replica sends :math:`K-1` chunks to their
  owners (the all-to-all), then its owned chunk to the :math:`K-1` others
  (the all-gather, as a ring sends it):

  .. math::
    B = \sum_{\text{buckets}} 2 (K - 1) \left(\frac{s}{8} + 8 m\right)

  the figure :func:`jmp_train.diagnostics.collective_bytes` reads from a
  compiled step with ``wire=True``, here for any replica count (no devices
  needed): to size a cluster's exchange, or to compare it with a ring
  all-reduce's :math:`2 (K-1)/K \cdot 4n` bytes.

  Args:
    params: the gradients' pytree, or anything with the same shapes
      (parameters, ``jax.ShapeDtypeStruct`` s).
    num_replicas: :math:`K`, the replicas the gradients are averaged over.
    scale: as in :func:`sign_compression`.
    bucket_bytes: as in :func:`sign_compression`.

  Returns:
    The bytes, an ``int``.

  Raises:
    ValueError: for a bad ``num_replicas``, ``scale`` or ``bucket_bytes``,
      or a leaf that is not floating (which :func:`sign_compression` refuses
      too: mask it out with ``optax.masked``).

  Examples:
    >>> grads = {"w": jnp.zeros((1024, 1024)), "b": jnp.zeros((1024,))}
    >>> one_bit = sign_compression_wire_bytes(grads, 8)
    >>> ring = 2 * 7 / 8 * 4 * (1024 * 1024 + 1024)
    >>> round(ring / one_bit)  # a 32nd of float32's bytes, and the pairs
    30
  """
  k = check_int(num_replicas, "num_replicas", 1)
  _validate(None, scale, 0, num_replicas, bucket_bytes)
  # The leaves sign_compression sends: it refuses a non-floating one, so this does too.
  leaves, _ = check_leaves(params, "parameters", "sign_compression")
  buckets = _layouts(leaves, scale, bucket_bytes, k)
  return sum(2 * (k - 1) * (layout.chunk // 8 + 8 * layout.max_local) for _, layout in buckets)
