r"""Gradient averaging that moves bfloat16 or float8 bytes, with float32 sums.

``lax.pmean`` of bfloat16 gradients does not move bfloat16 bytes on every
backend: XLA may run the all-reduce in float32 (it does on CPU), and a ring
all-reduce accumulates in the wire dtype at every hop. This transformation
spells the exchange out in two phases that carry the promised bytes:

1. **worker side** (every replica): the gradient leaves are flattened into
   one float32 buffer of ``N`` elements (leaf after leaf, padded to ``N_pad``,
   a multiple of ``K``) and cut into ``K`` chunks of ``S = N_pad / K``;
   ``v = g + r`` (worker residual ``r`` with error feedback) is quantized to
   the wire format: ``q = cast(v)`` for bfloat16, ``q = cast(v·s)`` with one
   float32 scale ``s = min(max / amax, 2**126)`` per chunk for float8
   (``max`` the format's largest finite value, ``amax`` the chunk's largest
   magnitude);
   ``r <- v - dequantize(q)``.
2. **all-to-all**: chunk ``k`` (``S`` wire elements, bitcast to unsigned
   integers so that no converter can widen it) and its scale go to
   replica ``k`` (for float8, the scale's 4 bytes follow the chunk's in
   one ``uint8`` message: one collective per phase).
3. **owner side** (replica ``k``): ``u = (1/K) Σ_j dequantize(q_j) + e`` in
   float32 (``e`` the server residual), re-quantized to the wire format,
   ``e <- u - dequantize(u)``.
4. **all-gather** of the owners' quantized chunks and scales (again one
   message each); every replica
   dequantizes the same bytes, so the output is identical everywhere.

Bytes each replica sends: ``2·(K-1)/K·b·N`` for ``b`` bytes per wire element
(2 for bfloat16, 1 for float8) plus ``2(K-1)`` scales, against
``2·(K-1)/K·4N`` for a float32 ring all-reduce: half, or a quarter.

With ``bucket_bytes``, the leaves are split into buckets (in reverse leaf
order, the order in which backpropagation produces them), each exchanged on
its own, so that a bucket's collectives can start while the gradients of
earlier layers are still being computed (the buckets of PyTorch's
``DistributedDataParallel``).

References:
  Seide et al., "1-Bit Stochastic Gradient Descent and its Application to
  Data-Parallel Distributed Training of Speech DNNs", Interspeech 2014 (the
  two-phase exchange and error feedback).

  Micikevicius et al., "FP8 Formats for Deep Learning", 2022.
  https://arxiv.org/abs/2209.05433

  Li et al., "PyTorch Distributed: Experiences on Accelerating Data Parallel
  Training", VLDB 2020. https://arxiv.org/abs/2006.15704
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from jmp_train._src.varying_axes import all_gather_invariant
from jmp_train._src import buckets as buckets_lib
from jmp_train._src.hyperparams import check_int
from jmp_train._src.leaf_checks import check_leaves
from jmp_train._src.leaf_checks import all_finite
from jmp_train._src.compression.replica_averaging import ReplicaCompressor
from jmp_train._src.compression.sign_layout import axis_size
from jmp_train._src.compression.wire_messages import append_floats, split_floats

__all__ = ["CompressedMeanState", "compressed_mean", "WIRE_FORMATS"]

# wire format -> (dtype, unsigned integer of the same width)
_FORMATS = {
  "bfloat16": (jnp.bfloat16, jnp.uint16),
  "float8_e4m3": (jnp.float8_e4m3fn, jnp.uint8),
  "float8_e5m2": (jnp.float8_e5m2, jnp.uint8),
}
WIRE_FORMATS = tuple(_FORMATS)
_NAME = "compressed_mean"


class CompressedMeanState(NamedTuple):
  """State of :func:`compressed_mean`, per replica.

  Attributes:
    count: int32 scalar, the number of updates so far.
    worker_residual: float32 ``(N_pad,)``, this replica's quantization error
      over the flattened gradients (``optax.EmptyState()`` without error
      feedback).
    server_residual: float32 ``(N_pad // K,)``, the error of re-quantizing
      the chunks this replica owns (``optax.EmptyState()`` without error
      feedback or when ``axis_name`` is ``None``).
  """

  count: jax.Array
  worker_residual: jax.Array | optax.EmptyState
  server_residual: jax.Array | optax.EmptyState


@dataclasses.dataclass(frozen=True)
class _Bucket:
  leaves: tuple[int, ...]  # leaf indices, in buffer order
  n: int  # elements of its leaves
  n_pad: int  # padded to a multiple of k
  offset: int  # in the residual buffer


def _buckets(sizes, k: int, bucket_bytes: int | None) -> tuple[_Bucket, ...]:
  """Leaves in reverse order, grouped into buckets of about ``bucket_bytes``."""
  if bucket_bytes:
    shapes = [jax.ShapeDtypeStruct((s,), jnp.float32) for s in sizes]
    groups = buckets_lib.bucket_sizes(shapes, bucket_bytes, jnp.float32)
  else:
    groups = [list(range(len(sizes)))]
  out, offset = [], 0
  for g in groups:
    n = sum(sizes[i] for i in g)
    n_pad = max(k, -(-n // k) * k)
    out.append(_Bucket(tuple(g), n, n_pad, offset))
    offset += n_pad
  return tuple(out)


def _lane_max(y: jax.Array) -> jax.Array:
  """``jnp.max(y, axis=-1)`` through up to 128 independent lanes (vectorizes)."""
  n = y.shape[-1]
  w = next(w for w in (128, 64, 32, 16, 8, 4, 2, 1) if n % w == 0)
  y = y.reshape(y.shape[:-1] + (n // w, w))
  return jnp.max(jnp.max(y, axis=-2), axis=-1)


def _quantize(v: jax.Array, wire: str):
  """``v`` ``(..., S)`` float32 to wire integers and per-row scales ``(..., 1)``."""
  dtype, uint = _FORMATS[wire]
  if wire == "bfloat16":
    scale = jnp.ones(v.shape[:-1] + (1,), jnp.float32)
    q = v.astype(dtype)
  else:
    fmax = float(jnp.finfo(dtype).max)
    amax = _lane_max(jnp.abs(v))[..., None]
    # amax == 0: any scale; inf/NaN: the scale is 0 or NaN and v·s is NaN.
    # At most 2**126, whose reciprocal is still a normal float32: a larger
    # one (amax below fmax / 2**126, about 5e-36 for E4M3) would decode to
    # zeros where XLA multiplies by a flushed reciprocal, or be inf and turn
    # zeros into NaN.
    scale = jnp.where(amax == 0, 1.0, jnp.minimum(fmax / amax, 2.0**126))
    q = jnp.clip(v * scale, -fmax, fmax).astype(dtype)
  return lax.bitcast_convert_type(q, uint), scale


def _dequantize(q: jax.Array, scale: jax.Array, wire: str) -> jax.Array:
  x = lax.bitcast_convert_type(q, _FORMATS[wire][0]).astype(jnp.float32)
  return x if wire == "bfloat16" else x / scale


def _keep_if_finite(new: jax.Array, old: jax.Array, v: jax.Array, scale, wire: str) -> jax.Array:
  """``new`` where ``v`` is finite, else ``old``.

  For float8, ``v`` is finite exactly where every chunk's scale is positive
  (``amax`` inf gives a scale of 0, NaN a NaN scale), which spares a pass
  over ``v``.
  """
  finite = all_finite(v) if wire == "bfloat16" else jnp.all(scale > 0)
  return jnp.where(finite, new, old)


def _exchange(q, scale, e, axis_name: str, k: int, wire: str):
  """Phases 2-4 for one bucket's quantized ``(K, S)`` chunks: mean and new ``e``."""
  if wire == "bfloat16":  # no scales: each phase moves the values alone
    recv_q, recv_s = lax.all_to_all(q, axis_name, 0, 0), scale
  else:  # one message per chunk: its bytes, then its scale's 4 bytes
    recv = lax.all_to_all(append_floats(q, scale), axis_name, 0, 0)
    recv_q, recv_s = split_floats(recv, q.shape[-1], scale.shape[-1:])
  # Owner: exact float32 sum of the K dequantized chunks, in sender order.
  u = _dequantize(recv_q[0], recv_s[0], wire)
  for j in range(1, k):
    u = u + _dequantize(recv_q[j], recv_s[j], wire)
  u = u / k
  if e is not None:
    u = u + e
  o_q, o_s = _quantize(u, wire)
  if e is not None:
    e = _keep_if_finite(u - _dequantize(o_q, o_s, wire), e, u, o_s, wire)
  if wire == "bfloat16":
    all_q, all_s = all_gather_invariant(o_q, axis_name), o_s
  else:
    gathered = all_gather_invariant(append_floats(o_q, o_s), axis_name)
    all_q, all_s = split_floats(gathered, o_q.shape[-1], o_s.shape[-1:])
  return _dequantize(all_q, all_s, wire).reshape(-1), e


@dataclasses.dataclass(frozen=True)
class _Config:
  axis_name: str | None
  wire: str
  error_feedback: bool
  num_replicas: int | None
  bucket_bytes: int | None


def _plan(cfg: _Config, leaves, where: str):
  k = axis_size(cfg.axis_name, cfg.num_replicas, where, _NAME, leaves)
  sizes = [int(np.prod(x.shape, dtype=np.int64)) for x in leaves]
  return k, _buckets(sizes, k, cfg.bucket_bytes)


def _residual(n: int) -> jax.Array | optax.EmptyState:
  # No zero-size array: XLA:CPU (jax 0.11) crashes compiling one beside a collective.
  return jnp.zeros((n,), jnp.float32) if n else optax.EmptyState()


def _length(residual: jax.Array | optax.EmptyState) -> tuple[int, ...]:
  return tuple(residual.shape) if hasattr(residual, "shape") else (0,)


def _init(cfg: _Config, params) -> CompressedMeanState:
  leaves, _ = check_leaves(params, "parameters", _NAME)
  k, buckets = _plan(cfg, leaves, "init")
  n_pad = sum(b.n_pad for b in buckets)
  ef = cfg.error_feedback
  server = n_pad // k if ef and cfg.axis_name is not None else 0
  return CompressedMeanState(
    count=jnp.zeros((), jnp.int32),
    worker_residual=_residual(n_pad if ef else 0),
    server_residual=_residual(server),
  )


def _bucket_step(cfg: _Config, leaves, bucket: _Bucket, k: int, r, e):
  """Worker quantization and exchange of one bucket: (flat mean, r, e)."""
  parts = [leaves[i].astype(jnp.float32).reshape(-1) for i in bucket.leaves]
  pad = jnp.zeros((bucket.n_pad - bucket.n,), jnp.float32)
  if cfg.wire == "bfloat16":
    # Elementwise from here on: XLA fuses the concatenation into the rounding.
    v = jnp.concatenate(parts + [pad] if pad.size else parts)
  else:
    # The per-chunk amax reads the buffer before it is rounded: build it once
    # by in-place copies (a materialized concatenation is slow on XLA:CPU).
    starts = np.cumsum([0] + [p.size for p in parts[:-1]]).tolist()
    v = buckets_lib.assemble(list(zip(starts, parts)), jnp.zeros((bucket.n_pad,), jnp.float32))
  if r is not None:
    v = v + r
  v = v.reshape(k, bucket.n_pad // k)
  q, scale = _quantize(v, cfg.wire)
  if cfg.axis_name is None:
    out = _dequantize(q, scale, cfg.wire).reshape(-1)
  else:
    out, e = _exchange(q, scale, e, cfg.axis_name, k, cfg.wire)
  if r is not None:
    r = _keep_if_finite((v - _dequantize(q, scale, cfg.wire)).reshape(-1), r, v, scale, cfg.wire)
  return out, r, e


def _update(cfg: _Config, updates, state: CompressedMeanState, params=None):
  del params
  leaves, treedef = check_leaves(updates, "gradients", _NAME)
  k, buckets = _plan(cfg, leaves, "update")
  n_pad = sum(b.n_pad for b in buckets)
  ef = cfg.error_feedback
  expected = ((n_pad if ef else 0,), (n_pad // k if ef and cfg.axis_name is not None else 0,))
  got = (_length(state.worker_residual), _length(state.server_residual))
  if got != expected:
    raise ValueError(
      f"CompressedMeanState residual shapes {got} do not match the gradients and "
      f"{k} replica(s), which need {expected}: init the state with the same "
      "parameters, replica count and bucket_bytes."
    )
  out = [None] * len(leaves)
  new_r, new_e = [], []
  for b in buckets:
    r = state.worker_residual[b.offset : b.offset + b.n_pad] if ef else None
    lo = b.offset // k
    e = state.server_residual[lo : lo + b.n_pad // k] if expected[1][0] else None
    flat, r, e = _bucket_step(cfg, leaves, b, k, r, e)
    off = 0
    for i in b.leaves:
      size = int(np.prod(leaves[i].shape, dtype=np.int64))
      out[i] = flat[off : off + size].reshape(leaves[i].shape).astype(leaves[i].dtype)
      off += size
    new_r += [] if r is None else [r]
    new_e += [] if e is None else [e]

  def cat(xs, old):
    starts = np.cumsum([0] + [x.size for x in xs[:-1]]).tolist()
    return buckets_lib.assemble(list(zip(starts, xs)), old) if xs else old

  return jax.tree.unflatten(treedef, out), CompressedMeanState(
    count=optax.safe_increment(state.count),
    worker_residual=cat(new_r, state.worker_residual),
    server_residual=cat(new_e, state.server_residual),
  )


def compressed_mean(
  axis_name: str | None = None,
  *,
  wire: str = "bfloat16",
  error_feedback: bool | None = None,
  num_replicas: int | None = None,
  bucket_bytes: int | None = None,
) -> optax.GradientTransformation:
  r"""Averages gradients across replicas, moving ``wire``-format bytes only.

  Input: each replica's *local* gradients. Output: their average, the same
  on every replica, in the input leaves' dtypes. The exchange has two
  phases: an all-to-all of chunks to their owners (the wire elements
  bitcast to unsigned integers, so that no compiler pass widens them), a
  float32 sum at the owner, an all-gather of the owners' results. Per chunk of ``S``
  elements, with residuals :math:`r` (worker) and :math:`e` (owner):

  .. math::
    v = g + r,\quad q = Q(v),\quad r \leftarrow v - D(q),\quad
    u = \tfrac1K \textstyle\sum_j D(q_j) + e,\quad e \leftarrow u - D(Q(u)),

  and every replica outputs :math:`D(Q(u))`. :math:`Q` rounds to bfloat16,
  or scales by :math:`s = \min(\max/\operatorname{amax}, 2^{126})` and
  rounds to float8;
  :math:`D` is its inverse up to rounding.

  Args:
    axis_name: the named axis of the replicas (``pmap`` / ``shard_map``).
      ``None``: no communication, the quantization alone.
    wire: ``"bfloat16"``, ``"float8_e4m3"`` or ``"float8_e5m2"``.
    error_feedback: keep worker and server residuals. ``None`` (default):
      on for the float8 formats, off for bfloat16 (then the output is the
      bfloat16 rounding of the exact float32 mean of bfloat16 gradients).
    num_replicas: the size of ``axis_name``, for ``init`` outside a mapped
      context; checked against the axis otherwise.
    bucket_bytes: exchange the gradients in buckets of about this many
      float32 bytes, last leaves first, so that XLA can overlap a bucket's
      collectives with the computation of the others. ``None``: one bucket.

  Returns:
    An ``optax.GradientTransformation`` with :class:`CompressedMeanState`.

  Raises:
    ValueError: at construction for an unknown ``wire``, bad numbers or an
      ``error_feedback`` that is not a bool or ``None``; at
      trace time when ``axis_name`` is not bound, a leaf is not floating,
      or the state does not match the gradients.

  Examples:
    >>> import jax, jax.numpy as jnp, optax
    >>> k = jax.local_device_count()
    >>> tx = optax.chain(compressed_mean("i", wire="bfloat16"), optax.sgd(0.1))
    >>> grads = {"w": jnp.arange(k * 6.0).reshape(k, 2, 3)}
    >>> state = jax.pmap(tx.init, axis_name="i")(grads)
    >>> updates, state = jax.pmap(tx.update, axis_name="i")(grads, state)
    >>> bool((updates["w"] == updates["w"][0]).all())
    True

  References:
    Micikevicius et al., "FP8 Formats for Deep Learning", 2022.
    https://arxiv.org/abs/2209.05433
  """
  if wire not in _FORMATS:
    raise ValueError(f"Unknown wire {wire!r}; valid formats: {', '.join(WIRE_FORMATS)}.")
  if axis_name is not None and not isinstance(axis_name, str):
    raise ValueError(f"axis_name must be a string or None, got {axis_name!r}.")
  num_replicas = check_int(num_replicas, "num_replicas", 1, allow_none=True)
  bucket_bytes = check_int(bucket_bytes, "bucket_bytes", 1, allow_none=True)
  if error_feedback is not None and not isinstance(error_feedback, (bool, np.bool_)):
    raise ValueError(f"error_feedback must be True, False or None (the wire's default), got {error_feedback!r}.")
  if error_feedback is None:
    error_feedback = wire != "bfloat16"
  cfg = _Config(axis_name, wire, bool(error_feedback), num_replicas, bucket_bytes)
  return ReplicaCompressor(functools.partial(_init, cfg), functools.partial(_update, cfg))
