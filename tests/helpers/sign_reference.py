"""NumPy reference of 1-bit compression and helpers shared by tests/test_sign_*.py.

The reference is written from the description (segments, each leaf split
among the owners by whole columns or by rows, owners' pieces),
independently of the implementation's tables. The workers' side works in
*leaf order* (the leaves end to end, a column-scale leaf column by column);
:func:`buffer_residual` puts the per-leaf worker residuals of
:class:`jmp_train.SignCompressionState` in it. The owners' side works in
*chunk order* (``(K, S)``, as the server residual): :func:`ref_layout` says
where each chunk element comes from.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from jmp_train import sign_compression

AXIS = "i"
# In jax.tree order (sorted keys), so that leaf order matches the flat buffer.
SHAPES = {"bias": (3,), "conv": (2, 2, 3, 4), "dense": (5, 3), "scalar": ()}
MIXED_DTYPES = {"conv": jnp.float32, "dense": jnp.bfloat16, "bias": jnp.float16, "scalar": jnp.float32}
# Column-scale leaves whose bits cross to buffer order as uint32, uint16 and
# uint8 words ("a", "c", "i"; "g"; "h"), one at an offset that is not a
# multiple of 8 (bits transposed one per byte: "e"), columns cut by chunk
# boundaries for K = 3 and 8, a chunk boundary on a column start (K = 8) and
# columns longer than a chunk ("i", K = 8).
WIDE_SHAPES = {
  "a": (64, 24),
  "b": (8,),
  "c": (4, 8, 6),
  "d": (3,),
  "e": (48, 5),
  "f": (5,),
  "g": (48, 40),
  "h": (24, 3),
  "i": (1024, 2),
}


def ref_flatten(leaves, scale):
  parts, seg_len = [], []
  for x in leaves:
    x = np.asarray(x, np.float32)
    if x.size == 0:
      continue
    if scale == "column" and x.ndim >= 2:
      parts.append(np.moveaxis(x, -1, 0).ravel())
      seg_len += [x.size // x.shape[-1]] * x.shape[-1]
    else:
      parts.append(x.ravel())
      seg_len.append(x.size)
  return np.concatenate(parts), seg_len


def ref_unflatten(flat, like, scale):
  out, off = [], 0
  for x in like:
    size = x.size
    part = flat[off : off + size]
    if scale == "column" and x.ndim >= 2:
      part = np.moveaxis(part.reshape((x.shape[-1],) + x.shape[:-1]), 0, -1)
    out.append(part.reshape(x.shape))
    off += size
  return out


def buffer_residual(residual, shapes, scale):
  """Per-leaf worker residuals (arrays ``(..., *leaf shape)``) in leaf order, ``(..., N)``.

  ``shapes``: the leaves' shapes (a dict in tree order or a list).
  """
  shapes = list(shapes.values()) if isinstance(shapes, dict) else list(shapes)
  parts = []
  for r, shape in zip(residual, shapes, strict=True):
    r = np.asarray(r, np.float32)
    lead = r.shape[: r.ndim - max(len(shape), 1)]
    r = r.reshape(lead + (-1,))
    if scale == "column" and len(shape) >= 2:
      r = np.moveaxis(r.reshape(lead + tuple(shape)), -1, len(lead)).reshape(lead + (-1,))
    parts.append(r)
  return np.concatenate(parts, axis=-1)


def ref_layout(shapes, scale, k):
  """Where each element of each owner's chunk comes from, from the layout's description.

  A leaf of ``cols`` segments of ``rows`` entries (columns of a column-scale
  matrix; else one segment, the whole leaf) is split among the ``k`` owners
  by whole columns (owner ``o`` holds columns ``o·w .. o·w + w - 1``, column
  by column; columns past the leaf are zeros), each column possibly cut
  into ``sub`` sub-columns of ``rows / sub`` consecutive rows (``sub`` divides
  ``rows``, and keeps sub-columns whole bytes if columns are) that count as
  columns, or by rows (owner ``o`` holds rows ``o·w .. o·w + w - 1`` of every
  column, row by row; rows past the leaf are zeros), whichever sends fewest
  bits per owner (the part's bits plus 64 per pair: one pair per
  (sub-)column held, or per column of the leaf; ties: by columns, the
  fewest sub-columns); a one-segment leaf always by rows. ``w`` is the
  fewest (sub-)columns (rows) that cover the leaf, rounded up to make the
  part whole bytes. Chunk ``o`` is owner ``o``'s parts, leaf after leaf. A
  piece (re-quantized on its own) is a (sub-)column held whole, or an
  owner's rows of a column.

  Returns:
    ``(index, piece)``, ``(k, S)`` ints: each chunk element's position in
    leaf order (``-1``: an appended zero) and its piece (distinct across
    owners and leaves).
  """
  shapes = list(shapes.values()) if isinstance(shapes, dict) else list(shapes)
  index, piece, off, base = [], [], 0, 0
  owners = np.arange(k)[:, None, None]
  for shape in shapes:
    size = int(np.prod(shape, dtype=int))
    if size == 0:
      continue
    cols = shape[-1] if scale == "column" and len(shape) >= 2 else 1
    rows = size // cols
    up = lambda x, m: -(-x // m) * m
    w_rows = up(-(-rows // k), 8 // math.gcd(cols, 8))
    best = None  # (bits, sub, width) by columns
    for sub in range(1, rows + 1):
      if rows % sub or (rows % 8 == 0 and (rows // sub) % 8):
        continue
      plen = rows // sub
      w = up(-(-(cols * sub) // k), 8 // math.gcd(plen, 8))
      if best is None or w * plen + 64 * w < best[0]:
        best = (w * plen + 64 * w, sub, w)
    if cols > 1 and best[0] <= w_rows * cols + 64 * cols:
      _, sub, w_cols = best
      plen = rows // sub
      sc = owners * w_cols + np.arange(w_cols)[None, :, None]  # (k, w, 1) sub-columns
      row = np.arange(plen)[None, None, :]  # (1, 1, plen)
      sc, row = np.broadcast_arrays(sc, row)
      # Sub-column sc holds rows (sc % sub)·plen on of column sc // sub.
      idx = np.where(sc < cols * sub, off + (sc // sub) * rows + (sc % sub) * plen + row, -1)
      pc = base + sc
      base += k * w_cols
    else:
      row = owners * w_rows + np.arange(w_rows)[None, :, None]  # (k, w, 1)
      col = np.arange(cols)[None, None, :]  # (1, 1, cols)
      row, col = np.broadcast_arrays(row, col)
      idx = np.where(row < rows, off + col * rows + row, -1)
      pc = base + owners * cols + col
      base += k * cols
    index.append(idx.reshape(k, -1))
    piece.append(pc.reshape(k, -1))
    off += size
  if not index:
    return np.zeros((k, 0), int), np.zeros((k, 0), int)
  return np.concatenate(index, axis=1), np.concatenate(piece, axis=1)


def ref_to_chunks(flat, shapes, scale, k):
  """Leaf-order values ``(N,)`` in chunk order ``(k, S)`` (zeros where the chunks hold none)."""
  index, _ = ref_layout(shapes, scale, k)
  return np.where(index >= 0, np.asarray(flat)[np.maximum(index, 0)], 0).astype(np.float32)


def ref_from_chunks(chunks, shapes, scale, k):
  """Chunk-order values ``(k, S)`` in leaf order ``(N,)`` (the appended zeros dropped)."""
  index, _ = ref_layout(shapes, scale, k)
  n = sum(int(np.prod(s, dtype=int)) for s in (shapes.values() if isinstance(shapes, dict) else shapes))
  out = np.zeros(n, np.float32)
  valid = index >= 0
  out[index[valid]] = np.asarray(chunks).reshape(index.shape)[valid]
  return out


def assert_residual_zero(residual):
  for r in residual:
    np.testing.assert_array_equal(np.asarray(r), 0.0)


def ref_quantize(x, scale):
  """Decoded values of one segment ``x``."""
  nonneg = x >= 0
  if scale == "column":
    hi = x[nonneg].mean() if nonneg.any() else 0.0
    lo = x[~nonneg].mean() if (~nonneg).any() else 0.0
  elif scale == "l1":
    hi = np.abs(x).mean()
    lo = -hi
  else:
    hi = np.sqrt((x * x).mean())
    lo = -hi
  return np.where(nonneg, np.float32(hi), np.float32(lo)).astype(np.float32)


def ref_step(grads, r, e, scale, error_feedback=True, server_error_feedback=True):
  """One step for K replicas. grads: K lists of leaves; r: (K, N) leaf order; e: (K, S) or None (zeros).

  Returns (per-replica outputs as leaves, new r, new e, v (K, N), u (K, S),
  the re-quantized chunks (K, S)).
  """
  k = len(grads)
  flats = [ref_flatten(g, scale) for g in grads]
  seg_len = flats[0][1]
  shapes = [np.shape(x) for x in grads[0]]
  ids = np.repeat(np.arange(len(seg_len)), seg_len)
  g = np.stack([f for f, _ in flats])
  v = g + r if error_feedback else g
  dec = np.zeros_like(v)
  for j in range(k):
    for s in np.unique(ids):
      dec[j, ids == s] = ref_quantize(v[j, ids == s], scale)
  r_new = v - dec if error_feedback else r
  # Owners: every sender's decoded values of chunk o go to replica o.
  index, piece = ref_layout(shapes, scale, k)
  valid = index >= 0
  e = np.zeros(index.shape, np.float32) if e is None else np.asarray(e, np.float32).reshape(index.shape)
  avg = dec.sum(axis=0, dtype=np.float32) / np.float32(k)
  u = np.where(valid, avg[np.maximum(index, 0)], 0).astype(np.float32)
  if server_error_feedback:
    u = np.where(valid, u + e, 0).astype(np.float32)
  out = np.zeros_like(u)
  for p in np.unique(piece[valid]):
    mask = valid & (piece == p)
    out[mask] = ref_quantize(u[mask], scale)
  e_new = np.where(valid, u - out, 0).astype(np.float32) if server_error_feedback else e
  flat_out = np.zeros(g.shape[1], np.float32)
  flat_out[index[valid]] = out[valid]
  return ref_unflatten(flat_out, grads[0], scale), r_new, e_new, v, u, out


# NumPy arrays (the values jnp.asarray would give): pmap and shard_map put
# them on the devices as they are, where a device array would first be
# split by a program compiled for each leaf shape.
def make_grads(k, seed, dtypes=None, shapes=SHAPES):
  rng = np.random.default_rng(seed)
  dtypes = dtypes or {}
  return {name: rng.normal(size=(k,) + shape).astype(dtypes.get(name, jnp.float32)) for name, shape in shapes.items()}


def replicated_zeros(k, shapes=SHAPES, dtypes=None):
  dtypes = dtypes or {}
  return {n: np.zeros((k,) + s, dtypes.get(n, jnp.float32)) for n, s in shapes.items()}


@functools.lru_cache(maxsize=None)
def pmapped(k, **kwargs):
  tx = sign_compression(AXIS, **kwargs)
  devices = jax.devices()[:k]
  init = jax.pmap(tx.init, axis_name=AXIS, devices=devices)
  update = jax.pmap(tx.update, axis_name=AXIS, devices=devices)
  return init, update


def per_replica_leaves(tree, j):
  # Indexed on the host: indexing a device array compiles a program per leaf shape.
  return [np.asarray(tree[n], np.float32)[j] for n in sorted(tree)]
