"""NumPy reference of 1-bit compression and helpers shared by tests/test_sign_*.py.

The reference is written from the description (segments, chunks, owners),
independently of the implementation's tables. It works in *buffer order*
(a column-scale leaf column by column); :func:`buffer_residual` puts the
per-leaf worker residuals of :class:`jmp_train.SignCompressionState` in it.
"""

from __future__ import annotations

import functools

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
    "a": (64, 24), "b": (8,), "c": (4, 8, 6), "d": (3,), "e": (48, 5), "f": (5,),
    "g": (48, 40), "h": (24, 3), "i": (1024, 2),
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


def buffer_residual(residual, shapes, scale, k):
  """Per-leaf worker residuals (arrays ``(..., *leaf shape)``) in buffer order, ``(..., N_pad)``.

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
  flat = np.concatenate(parts, axis=-1)
  n = flat.shape[-1]
  n_pad = max(8 * k, -(-n // (8 * k)) * 8 * k)
  return np.pad(flat, [(0, 0)] * (flat.ndim - 1) + [(0, n_pad - n)])


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
  """One step for K replicas. grads: K lists of leaves; r: (K, n_pad); e: (K, S).

  Returns (per-replica outputs as leaves, new r, new e, v, u).
  """
  k = len(grads)
  flats = [ref_flatten(g, scale) for g in grads]
  seg_len = flats[0][1]
  n = flats[0][0].size
  n_pad = max(8 * k, -(-n // (8 * k)) * 8 * k)
  chunk = n_pad // k
  ids = np.repeat(np.arange(len(seg_len) + 1), seg_len + [n_pad - n])
  g = np.stack([np.pad(f, (0, n_pad - n)) for f, _ in flats])
  v = g + r if error_feedback else g
  dec = np.zeros_like(v)
  for j in range(k):
    for s in np.unique(ids):
      dec[j, ids == s] = ref_quantize(v[j, ids == s], scale)
  r_new = v - dec if error_feedback else r
  # Owners: chunk c of everyone's decoded gradient goes to replica c.
  avg = dec.sum(axis=0, dtype=np.float32) / np.float32(k)
  u = avg + e.reshape(-1) if server_error_feedback else avg
  out = np.zeros(n_pad, np.float32)
  for c in range(k):
    sl = slice(c * chunk, (c + 1) * chunk)
    for s in np.unique(ids[sl]):
      mask = np.zeros(n_pad, bool)
      mask[sl] = ids[sl] == s
      out[mask] = ref_quantize(u[mask], scale)
  e_new = (u - out).reshape(k, chunk) if server_error_feedback else e
  return ref_unflatten(out, grads[0], scale), r_new, e_new, v, u, out


def make_grads(k, seed, dtypes=None, shapes=SHAPES):
  rng = np.random.default_rng(seed)
  dtypes = dtypes or {}
  return {
      name: jnp.asarray(rng.normal(size=(k,) + shape), dtypes.get(name, jnp.float32))
      for name, shape in shapes.items()
  }


def replicated_zeros(k, shapes=SHAPES, dtypes=None):
  dtypes = dtypes or {}
  return {n: jnp.zeros((k,) + s, dtypes.get(n, jnp.float32)) for n, s in shapes.items()}


@functools.lru_cache(maxsize=None)
def pmapped(k, **kwargs):
  tx = sign_compression(AXIS, **kwargs)
  devices = jax.devices()[:k]
  init = jax.pmap(tx.init, axis_name=AXIS, devices=devices)
  update = jax.pmap(tx.update, axis_name=AXIS, devices=devices)
  return init, update


def per_replica_leaves(tree, j):
  return [np.asarray(tree[n][j], np.float32) for n in sorted(tree)]
