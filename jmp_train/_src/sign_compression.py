r"""1-bit SGD with error feedback: compressed gradient exchange as optax.

Each replica quantizes its local gradient to one bit per element plus a few
float reconstruction values, and keeps what the quantization lost (the
residual) to add to its next gradient (Seide et al., 2014). The replicas then
average the quantized gradients with two collectives that move packed bits:

1. **worker side** (every replica): ``v = g + r``; bit ``b = [v >= 0]``;
   reconstruction values ``(hi, lo)`` per segment (see *Scales*);
   ``r <- v - decode(b)``. The bits of the whole gradient tree are laid out
   in one flat buffer of ``N`` elements, padded to ``N_pad``, a multiple of
   ``8·K`` for ``K`` replicas, packed eight to a ``uint8``, and cut into
   ``K`` chunks of ``S = N_pad / K`` elements: chunk ``k`` is *owned* by
   replica ``k``.
2. **all-to-all**: replica ``j`` sends chunk ``k`` (``S/8`` bytes) to replica
   ``k``, with the ``(hi, lo)`` pairs of the segments that overlap chunk ``k``
   (a few floats).
3. **owner side** (replica ``k``): decode the ``K`` received chunks, average
   them, add the server residual ``e``: ``u = mean_j decode_j + e``;
   re-quantize ``u`` to bits and pairs, ``e <- u - decode(u)``.
4. **all-gather** of the owners' packed chunks and pairs; every replica
   decodes the whole buffer, the same bits and floats everywhere, so the
   output is identical on every replica.

Bytes each replica sends per step: ``2·(K-1)/K·N/8`` plus the pairs, against
``2·(K-1)/K·4N`` for a float32 ring all-reduce: 32 times fewer. Gathering
every replica's packed bits instead would cost ``(K-1)·N/8``.

Scales
------
A *segment* is a set of elements that share reconstruction values:

* ``scale="column"`` (Seide et al.): every column of a weight, i.e. every
  index of its **last axis** (Flax's output feature of a ``Dense`` kernel
  ``(in, out)``, the output channel of a ``Conv`` kernel ``(h, w, in, out)``);
  vectors and scalars are one column. ``hi`` is the mean of the non-negative
  entries of the column, ``lo`` the mean of the negative ones (``0`` when
  there are none). The flat buffer stores each leaf column by column, so a
  column is a contiguous run of elements.
* ``scale="l1"`` (EF-SignSGD, Karimireddy et al., 2019): one segment per
  leaf, ``hi = -lo = ‖v‖₁/d``.
* ``scale="l2"`` (1-bit Adam, Tang et al., 2021): one segment per leaf,
  ``hi = -lo = ‖v‖₂/√d``.

Element ``x`` decodes to ``hi`` when ``x >= 0`` (so ``0`` maps to ``hi``;
``jnp.sign(0) == 0`` is not used) and to ``lo`` otherwise.

A segment may straddle chunk boundaries. The worker sends owner ``k`` the
pairs of the ``M`` segments overlapping chunk ``k`` (``M`` is the most any
chunk overlaps, about ``#segments / K + 2``; unused rows are padding): an
all-to-all of ``K·M·2`` float32, small next to the bits. The owner uses
the same kind of scale **restricted to its chunk**: with ``"column"`` the
part of each column that lies in its chunk gets its own ``(hi, lo)``, with
``"l1"``/``"l2"`` the part of each leaf in its chunk gets its own norm.
Its ``M`` pairs are all-gathered with the bits. The padding is a segment of
its own whose values are always zero and decode to zero.

Residuals
---------
The worker residual ``r`` is a float32 buffer of ``N_pad`` elements per
replica, in the flat layout above; the server residual ``e`` is float32 of
``S`` elements, the replica's own chunk. Both depend on ``K``: ``init`` must
know the replica count (it reads it when it runs inside ``pmap`` /
``shard_map``, or takes ``num_replicas``). Conservation holds exactly up to
one float32 rounding per step: ``v = decode(b) + r`` and ``u = decode(u) +
e``. A residual is never updated from a non-finite ``v`` (or ``u``): the
previous residual is kept, and the non-finite values still reach the output
so that a wrapper (:func:`jmp_train.loss_scaled` with ``axis_name``) can
skip the step on every replica.

Local gradients under ``shard_map``
-----------------------------------
The input must be each replica's *own* gradient. Under ``shard_map``,
parameters passed with ``P()`` are invariant along the data axis, and
``jax.grad`` with respect to an invariant input returns the gradient
*summed over the axis* (JAX inserts a float ``psum``): the float all-reduce
this transformation exists to avoid. Mark the parameters varying first::

  local_params = jax.lax.pcast(params, "data", to="varying")
  grads = jax.grad(loss_fn)(local_params, batch)   # this replica's gradient
  updates, opt_state = tx.update(grads, opt_state, params)

(``pmap`` has no such coupling: its gradients are always local.) Check the
compiled step with :func:`jmp_train.collective_bytes`: its ``"all-reduce"``
entry must be ``0``.

Several hosts
-------------
The transformation only uses named-axis collectives (``all_to_all``,
``all_gather``; ``psum`` during warm-up), so the same code runs on one
device, several devices of one process, and several processes. On each
host, before any other JAX call::

  jax.distributed.initialize(coordinator_address="host0:1234",
                             num_processes=P, process_id=i)
  # CPU only: jax.config.update("jax_cpu_collectives_implementation", "gloo")

then build a ``Mesh`` over ``jax.devices()`` (all processes' devices), put
the batch on it with ``jax.make_array_from_process_local_data``, create the
state with ``shard_map(tx.init, ...)`` (residuals sharded along the data
axis: :func:`sign_compression_specs`) and run the same
``jax.jit(jax.shard_map(step, ...))`` in every process. The test
``tests/test_sign_compression_multiprocess.py`` does this with two processes
on ``127.0.0.1``.

References:
  Seide, Fu, Droppo, Li, Yu, "1-Bit Stochastic Gradient Descent and its
  Application to Data-Parallel Distributed Training of Speech DNNs",
  Interspeech 2014. https://www.isca-archive.org/interspeech_2014/seide14_interspeech.html

  Karimireddy, Rebjock, Stich, Jaggi, "Error Feedback Fixes SignSGD and
  other Gradient Compression Schemes", ICML 2019.
  https://arxiv.org/abs/1901.09847

  Tang et al., "1-bit Adam: Communication Efficient Large-Scale Training
  with Adam's Convergence Speed", ICML 2021. https://arxiv.org/abs/2102.02888
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

__all__ = [
    "SignCompressionState",
    "sign_compression",
    "sign_compression_specs",
    "SCALES",
]

SCALES = ("column", "l1", "l2")


class SignCompressionState(NamedTuple):
  """State of :func:`sign_compression`, per replica.

  Attributes:
    count: int32 scalar, the number of updates so far (the same on every
      replica).
    worker_residual: float32 ``(N_pad,)``, this replica's quantization error
      over the whole flattened gradient tree (zeros without error feedback).
    server_residual: float32 ``(N_pad // K,)``, the error of re-quantizing
      the chunk this replica owns (zeros without server error feedback;
      ``(0,)`` when ``axis_name`` is ``None``).
  """

  count: jax.Array
  worker_residual: jax.Array
  server_residual: jax.Array


@dataclasses.dataclass(frozen=True)
class _Layout:
  """Static (trace-time) description of the flat buffer for K replicas."""

  shapes: tuple[tuple[int, ...], ...]
  columns: tuple[int, ...]  # segments per leaf
  offsets: tuple[int, ...]
  transpose: tuple[bool, ...]  # leaf stored column by column
  n: int
  n_pad: int
  k: int
  chunk: int
  num_segments: int
  max_local: int
  send_index: np.ndarray  # (K, M): global segment of owner k's m-th local one
  local_lengths: np.ndarray  # (K, M): its number of elements in chunk k
  # (N_pad,): element -> k*M + m, its chunk and segment within the chunk. A
  # NumPy constant: computed in the graph, XLA would constant-fold it slowly.
  ids: np.ndarray

  @property
  def sizes(self) -> tuple[int, ...]:
    return tuple(int(np.prod(s, dtype=np.int64)) for s in self.shapes)


def _make_layout(shapes, scale: str, k: int) -> _Layout:
  columns, offsets, transpose, seg_lengths = [], [], [], []
  offset = 0
  for shape in shapes:
    size = int(np.prod(shape, dtype=np.int64))
    by_column = scale == "column" and len(shape) >= 2
    c = 0 if size == 0 else (shape[-1] if by_column else 1)
    columns.append(c)
    offsets.append(offset)
    transpose.append(by_column)
    seg_lengths += [size // c] * c if c else []
    offset += size
  n = offset
  n_pad = max(8 * k, -(-n // (8 * k)) * 8 * k)
  if n_pad > n:
    seg_lengths.append(n_pad - n)
  lengths = np.asarray(seg_lengths, np.int64)
  starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
  ends = starts + lengths
  chunk = n_pad // k
  lo_edge = np.arange(k) * chunk
  first = np.searchsorted(starts, lo_edge, side="right") - 1
  last = np.searchsorted(starts, lo_edge + chunk - 1, side="right") - 1
  m = int(np.max(last - first + 1))
  g = len(lengths)
  send = np.minimum(first[:, None] + np.arange(m)[None, :], g - 1)
  overlap = np.minimum(ends[send], (lo_edge + chunk)[:, None]) - np.maximum(
      starts[send], lo_edge[:, None]
  )
  valid = (first[:, None] + np.arange(m)[None, :]) <= last[:, None]
  local_lengths = np.where(valid, np.maximum(overlap, 0), 0)
  assert (local_lengths.sum(axis=1) == chunk).all()
  ids = np.repeat(np.arange(k * m), local_lengths.reshape(-1))
  ids = ids.astype(np.int16 if k * m < 2**15 else np.int32)
  return _Layout(
      shapes=tuple(tuple(s) for s in shapes),
      columns=tuple(columns),
      offsets=tuple(offsets),
      transpose=tuple(transpose),
      n=n,
      n_pad=n_pad,
      k=k,
      chunk=chunk,
      num_segments=g,
      max_local=m,
      send_index=send.astype(np.int32),
      local_lengths=local_lengths.astype(np.int32),
      ids=ids,
  )


def _check_leaves(tree: Any, what: str) -> tuple[list[jax.Array], Any]:
  leaves_with_path, treedef = jax.tree_util.tree_flatten_with_path(tree)
  leaves = []
  for path, leaf in leaves_with_path:
    dtype = getattr(leaf, "dtype", None)
    if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
      raise ValueError(
          f"sign_compression needs floating {what}; the leaf at "
          f"{jax.tree_util.keystr(path)!r} has dtype "
          f"{getattr(dtype, 'name', type(leaf).__name__)}. Valid dtypes: float16, "
          "bfloat16, float32, float64. Mask integer leaves out with optax.masked."
      )
    leaves.append(leaf)
  return leaves, treedef


def _axis_size(axis_name: str, num_replicas: int | None, where: str) -> int:
  try:
    size = lax.axis_size(axis_name)
  except NameError:
    if num_replicas is not None:
      return num_replicas
    raise ValueError(
        f"sign_compression(axis_name={axis_name!r}).{where} runs outside a "
        f"mapped context with axis {axis_name!r}: call it inside "
        f"jax.pmap(..., axis_name={axis_name!r}) or jax.shard_map over a "
        f"Mesh with an axis named {axis_name!r}"
        + (" (or give num_replicas= to sign_compression)." if where == "init" else ".")
    ) from None
  if num_replicas is not None and num_replicas != size:
    raise ValueError(
        f"sign_compression got num_replicas={num_replicas}, but axis "
        f"{axis_name!r} has size {size}."
    )
  return int(size)


def _to_flat(leaves, layout: _Layout) -> jax.Array:
  parts = []
  for leaf, shape, t in zip(leaves, layout.shapes, layout.transpose):
    x = leaf.astype(jnp.float32)
    if t:
      x = jnp.moveaxis(x, -1, 0)
    parts.append(x.reshape(-1))
  parts.append(jnp.zeros((layout.n_pad - layout.n,), jnp.float32))
  return jnp.concatenate(parts)


def _from_flat(flat: jax.Array, layout: _Layout, dtypes) -> list[jax.Array]:
  out = []
  for shape, off, size, t, dtype in zip(
      layout.shapes, layout.offsets, layout.sizes, layout.transpose, dtypes
  ):
    x = flat[off : off + size]
    if t:
      x = jnp.moveaxis(x.reshape((shape[-1],) + shape[:-1]), 0, -1)
    out.append(x.reshape(shape).astype(dtype))
  return out


def _pairs(pos_sum, pos_cnt, neg_sum, neg_cnt, sq_sum, scale: str) -> jax.Array:
  """Reconstruction values ``(hi, lo)`` from per-segment sums, ``(..., 2)``."""
  if scale == "column":
    hi = pos_sum / jnp.maximum(pos_cnt, 1).astype(jnp.float32)
    lo = neg_sum / jnp.maximum(neg_cnt, 1).astype(jnp.float32)
  else:
    cnt = jnp.maximum(pos_cnt + neg_cnt, 1).astype(jnp.float32)
    if scale == "l1":
      hi = (pos_sum - neg_sum) / cnt
    else:
      hi = jnp.sqrt(sq_sum / cnt)
    lo = -hi
  return jnp.stack([hi, lo], axis=-1)


def _row_sums(fns, x: jax.Array) -> list[jax.Array]:
  """``[jnp.sum(f(x), axis=1) for f in fns]``, one pass each on CPU.

  XLA:CPU fuses sibling reductions of the same input into one multi-output
  fusion that runs several times slower than the separate reductions
  (measured: two row sums of a 2048x2048 float32 array, 15 ms fused against
  1.5 ms each). An optimization barrier between them keeps them apart; on
  other backends the fused single pass is the fast one, so it is kept.
  """
  separate = jax.default_backend() == "cpu"
  out = []
  for fn in fns:
    out.append(jnp.sum(fn(x), axis=1))
    if separate:
      x, out[-1] = lax.optimization_barrier((x, out[-1]))
  return out


def _quantize_rows(x: jax.Array, scale: str):
  """Quantizes each row of ``x`` (one segment per row): bits, pairs, decoded."""
  bits = x >= 0
  n = x.shape[1]
  if scale == "column":
    # Counts in float32: exact up to 2**24 entries per column.
    pos_sum, neg_sum, pos_cnt = _row_sums(
        (
            lambda v: jnp.maximum(v, 0.0),
            lambda v: jnp.minimum(v, 0.0),
            lambda v: (v >= 0).astype(jnp.float32),
        ),
        x,
    )
    hi = pos_sum / jnp.maximum(pos_cnt, 1.0)
    lo = neg_sum / jnp.maximum(n - pos_cnt, 1.0)
  else:
    (total,) = _row_sums((jnp.abs,) if scale == "l1" else (jnp.square,), x)
    hi = total / max(n, 1)
    if scale == "l2":
      hi = jnp.sqrt(hi)
    lo = -hi
  pairs = jnp.stack([hi, lo], axis=-1)
  decoded = jnp.where(bits, hi[:, None], lo[:, None])
  return bits, pairs, decoded


def _quantize_segments(x: jax.Array, ids: jax.Array, m: int, scale: str):
  """Quantizes ``x`` with segment ids in ``[0, m)``: bits, pairs, decoded."""
  bits = x >= 0
  zero = jnp.zeros_like(x)
  seg = lambda v: jax.ops.segment_sum(v, ids, num_segments=m)
  pairs = _pairs(
      seg(jnp.where(bits, x, zero)),
      seg(bits.astype(jnp.int32)),
      seg(jnp.where(bits, zero, x)),
      seg((~bits).astype(jnp.int32)),
      seg(x * x) if scale == "l2" else None,
      scale,
  )
  decoded = jnp.where(bits, pairs[ids, 0], pairs[ids, 1])
  return bits, pairs, decoded


def _worker_quantize(v: jax.Array, layout: _Layout, scale: str):
  """Per-segment worker quantization of the flat buffer ``v``."""
  bits, pairs, decoded = [], [], []
  for off, size, c in zip(layout.offsets, layout.sizes, layout.columns):
    if size == 0:
      continue
    b, p, d = _quantize_rows(v[off : off + size].reshape(c, size // c), scale)
    bits.append(b.reshape(-1))
    pairs.append(p)
    decoded.append(d.reshape(-1))
  pad = layout.n_pad - layout.n
  if pad:
    bits.append(jnp.ones((pad,), bool))
    pairs.append(jnp.zeros((1, 2), jnp.float32))
    decoded.append(jnp.zeros((pad,), jnp.float32))
  return jnp.concatenate(bits), jnp.concatenate(pairs), jnp.concatenate(decoded)


def _pack(bits: jax.Array) -> jax.Array:
  return jnp.packbits(bits, axis=-1, bitorder="little")


def _unpack(packed: jax.Array) -> jax.Array:
  return jnp.unpackbits(packed, axis=-1, bitorder="little").astype(bool)


def _all_finite(x: jax.Array) -> jax.Array:
  # One fused reduction (see jmp_train.all_finite): x * 0 is NaN exactly
  # where x is inf or NaN.
  return jnp.isfinite(jnp.sum(x * jnp.zeros((), x.dtype)))


def sign_compression(
    axis_name: str | None = None,
    *,
    scale: str = "column",
    error_feedback: bool = True,
    server_error_feedback: bool = True,
    warmup_steps: int = 0,
    num_replicas: int | None = None,
) -> optax.GradientTransformation:
  r"""Averages gradients across replicas with 1-bit compression and error feedback.

  Input: each replica's *local* gradients (not averaged). Output: their
  average, compressed as described in the module docstring, identical on
  every replica and in the input leaves' dtypes. Put it first in an
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

  Returns:
    An ``optax.GradientTransformation`` whose state is a
    :class:`SignCompressionState`.

  Raises:
    ValueError: at construction for an unknown ``scale`` or a negative
      ``warmup_steps``; at trace time when ``axis_name`` is not bound,
      when a gradient leaf is not floating, or when the state does not
      match the gradients (other parameters or another replica count).

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
  if scale not in SCALES:
    raise ValueError(f"Unknown scale {scale!r}; valid scales: {', '.join(SCALES)}.")
  if not isinstance(warmup_steps, (int, np.integer)) or warmup_steps < 0:
    raise ValueError(f"warmup_steps must be a non-negative int, got {warmup_steps!r}.")
  if axis_name is not None and not isinstance(axis_name, str):
    raise ValueError(
        f"axis_name must be a string or None, got {axis_name!r}; to compress over "
        "several mesh axes, name one combined axis."
    )
  if num_replicas is not None and (
      not isinstance(num_replicas, (int, np.integer)) or num_replicas < 1
  ):
    raise ValueError(f"num_replicas must be a positive int, got {num_replicas!r}.")

  def layout_for(leaves, where: str) -> _Layout:
    k = 1 if axis_name is None else _axis_size(axis_name, num_replicas, where)
    return _make_layout([tuple(x.shape) for x in leaves], scale, k)

  def init_fn(params):
    leaves, _ = _check_leaves(params, "parameters")
    layout = layout_for(leaves, "init")
    return SignCompressionState(
        count=jnp.zeros((), jnp.int32),
        worker_residual=jnp.zeros((layout.n_pad,), jnp.float32),
        server_residual=jnp.zeros(
            (0 if axis_name is None else layout.chunk,), jnp.float32
        ),
    )

  def compress(leaves, state: SignCompressionState, layout: _Layout):
    g = _to_flat(leaves, layout)
    r = state.worker_residual
    v = g + r if error_feedback else g
    bits, pairs, decoded = _worker_quantize(v, layout, scale)
    if error_feedback:
      r = jnp.where(_all_finite(v), v - decoded, r)
    if axis_name is None:
      return decoded, r, state.server_residual
    k, s, m = layout.k, layout.chunk, layout.max_local
    # Phase 1: packed chunks (and their segments' pairs) to their owners.
    packed = _pack(bits).reshape(k, s // 8)
    recv_bits = lax.all_to_all(packed, axis_name, 0, 0)
    recv_pairs = lax.all_to_all(pairs[layout.send_index], axis_name, 0, 0)
    # Owner: decode, average, add the server residual, re-quantize.
    owner = lax.axis_index(axis_name)
    table = jnp.asarray(layout.ids)
    ids = (lax.dynamic_slice_in_dim(table, owner * s, s) - owner * m).astype(jnp.int32)
    received = jnp.where(
        _unpack(recv_bits), recv_pairs[:, ids, 0], recv_pairs[:, ids, 1]
    )
    u = jnp.sum(received, axis=0) / k
    e = state.server_residual
    if server_error_feedback:
      u = u + e
    o_bits, o_pairs, o_decoded = _quantize_segments(u, ids, m, scale)
    if server_error_feedback:
      e = jnp.where(_all_finite(u), u - o_decoded, e)
    # Phase 2: everyone gathers the owners' packed chunks and pairs.
    all_bits = lax.all_gather(_pack(o_bits), axis_name, to="invarying")
    all_pairs = lax.all_gather(o_pairs, axis_name, to="invarying").reshape(k * m, 2)
    out = jnp.where(_unpack(all_bits).reshape(-1), all_pairs[table, 0], all_pairs[table, 1])
    return out, r, e

  def exact(leaves, state: SignCompressionState, layout: _Layout):
    g = _to_flat(leaves, layout)
    if axis_name is not None:
      g = lax.pmean(g, axis_name)
    return g, state.worker_residual, state.server_residual

  def update_fn(updates, state, params=None):
    del params
    leaves, treedef = _check_leaves(updates, "gradients")
    layout = layout_for(leaves, "update")
    expected = (layout.n_pad,), (0 if axis_name is None else layout.chunk,)
    got = tuple(state.worker_residual.shape), tuple(state.server_residual.shape)
    if got != expected:
      raise ValueError(
          f"SignCompressionState residual shapes {got} do not match the gradients "
          f"and {layout.k} replica(s), which need {expected}: init the state with "
          "the same parameters and replica count."
      )
    if warmup_steps == 0:
      out, r, e = compress(leaves, state, layout)
    else:
      out, r, e = lax.cond(
          state.count < warmup_steps,
          lambda: exact(leaves, state, layout),
          lambda: compress(leaves, state, layout),
      )
    dtypes = [x.dtype for x in leaves]
    new_updates = jax.tree.unflatten(treedef, _from_flat(out, layout, dtypes))
    return new_updates, SignCompressionState(
        count=optax.safe_increment(state.count),
        worker_residual=r,
        server_residual=e,
    )

  return optax.GradientTransformation(init_fn, update_fn)


def sign_compression_specs(opt_state: Any, axis_name: str) -> Any:
  """``PartitionSpec`` s for an optimizer state holding sign-compression states.

  Under ``shard_map``, every replica keeps its own residuals: their global
  arrays are the replicas' buffers concatenated along ``axis_name``
  (``P(axis_name)``); every other leaf (the counter, an optimizer's moments
  of replicated parameters) is replicated (``P()``).

  Args:
    opt_state: an optimizer state (or its ``jax.eval_shape``) that may
      contain :class:`SignCompressionState` s anywhere.
    axis_name: the mesh axis of the replicas.

  Returns:
    A pytree of ``jax.sharding.PartitionSpec`` matching ``opt_state``.

  Examples:
    >>> from jax.sharding import PartitionSpec as P
    >>> state = SignCompressionState(jnp.zeros((), jnp.int32), jnp.zeros(8), jnp.zeros(4))
    >>> sign_compression_specs(state, "data")
    SignCompressionState(count=P(), worker_residual=P('data',), server_residual=P('data',))
  """
  P = jax.sharding.PartitionSpec
  is_state = lambda x: isinstance(x, SignCompressionState)

  def spec(x):
    if is_state(x):
      return SignCompressionState(P(), P(axis_name), P(axis_name))
    return P()

  return jax.tree.map(spec, opt_state, is_leaf=is_state)
