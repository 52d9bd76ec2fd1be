"""The checksums a checkpoint is saved with, and their check after a restore.

Each array leaf gets two independent 32-bit sums, over its elements, of a
mix of the element's bits with its flat index: a bijective mix in the bits,
so that any change of one element changes both sums, and one that depends
on the index, so that moved elements change them too. Integer sums do not
depend on the order of the additions: the value is the same for any
sharding, on every process, on every backend. They are saved as the array
item's custom metadata (orbax's ``StandardSave(custom_metadata=...)``), read
back through orbax's metadata, and compared with the sums of the restored
arrays, recomputed on their devices.
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
  "checksum_metadata",
  "checksums",
  "json_checksum",
  "mismatched_leaf",
  "named_leaves",
  "saved_checksums",
]

CHECKSUMS = "jmp_train_checksums"
CHECKSUM_FORMAT = "mix32x2-v1"


def _fmix(h: jax.Array, m1: int, s2: int, m2: int) -> jax.Array:
  """A 32-bit finalizer (xorshift-multiply, bijective)."""
  h = h ^ (h >> jnp.uint32(16))
  h = h * jnp.uint32(m1)
  h = h ^ (h >> jnp.uint32(s2))
  h = h * jnp.uint32(m2)
  return h ^ (h >> jnp.uint32(16))


def _words(x: jax.Array) -> jax.Array:
  """The bits of ``x`` as ``uint32`` words (a trailing axis of 2 for 64-bit dtypes)."""
  if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
    x = jax.random.key_data(x)
  if jnp.issubdtype(x.dtype, jnp.complexfloating):
    x = jnp.stack([jnp.real(x), jnp.imag(x)], axis=-1)
  if x.dtype == jnp.bool_:
    return x.astype(jnp.uint32)
  bits = (jnp.finfo(x.dtype) if jnp.issubdtype(x.dtype, jnp.floating) else jnp.iinfo(x.dtype)).bits
  if bits < 8:  # int4, float4: widened exactly
    x = x.astype(
      jnp.float32
      if jnp.issubdtype(x.dtype, jnp.floating)
      else jnp.int8
      if jnp.issubdtype(x.dtype, jnp.signedinteger)
      else jnp.uint8
    )
    bits = jnp.dtype(x.dtype).itemsize * 8
  unsigned = {8: jnp.uint8, 16: jnp.uint16, 32: jnp.uint32, 64: jnp.uint32}[bits]
  return jax.lax.bitcast_convert_type(x, unsigned).astype(jnp.uint32)


def _leaf_checksum(x: jax.Array) -> jax.Array:
  w = _words(x)
  # The flat (row-major) index, from one iota per axis: no reshape, so a
  # sharded array is not gathered.
  index = jnp.zeros(w.shape, jnp.uint32)
  stride = 1
  for axis in reversed(range(w.ndim)):
    index = index + jax.lax.broadcasted_iota(jnp.uint32, w.shape, axis) * jnp.uint32(stride % 2**32)
    stride *= w.shape[axis]
  a = _fmix(
    w ^ _fmix(index * jnp.uint32(0x9E3779B9) + jnp.uint32(0x6A09E667), 0x85EBCA6B, 13, 0xC2B2AE35),
    0x85EBCA6B,
    13,
    0xC2B2AE35,
  )
  b = _fmix(w + _fmix(index ^ jnp.uint32(0xBB67AE85), 0x7FEB352D, 15, 0x846CA68B), 0x7FEB352D, 15, 0x846CA68B)
  return jnp.stack([jnp.sum(a, dtype=jnp.uint32), jnp.sum(b, dtype=jnp.uint32)])


@jax.jit
def _checksum_leaves(leaves: list[Any]) -> jax.Array:
  return jnp.stack([_leaf_checksum(x) for x in leaves]) if leaves else jnp.zeros((0, 2), jnp.uint32)


def _to_host(x: jax.Array) -> np.ndarray:
  if x.is_fully_addressable:
    return np.asarray(x)
  if x.is_fully_replicated:
    return np.asarray(x.addressable_data(0))
  from jax.experimental import multihost_utils

  return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def _host_words(leaf: Any) -> Any:
  """A 64-bit NumPy leaf as its ``uint32`` word pairs, as :func:`_words` reads them.

  Without ``jax_enable_x64`` JAX would narrow it to 32 bits before hashing.
  """
  if not isinstance(leaf, (np.ndarray, np.generic)):
    return leaf
  if leaf.dtype.kind == "c" and leaf.dtype.itemsize == 16:  # as _words stacks them
    leaf = np.stack([leaf.real, leaf.imag], axis=-1)
  if leaf.dtype.kind in "iuf" and leaf.dtype.itemsize == 8:
    leaf = np.ascontiguousarray(leaf)
    return leaf.view(np.uint32).reshape(leaf.shape + (2,))
  return leaf


def _key_name(key: Any) -> str:
  return str(getattr(key, "key", getattr(key, "name", getattr(key, "idx", key))))


def named_leaves(tree: Any) -> list[tuple[tuple[str, ...], str, Any]]:
  """``(names along the path, keystr, leaf)`` of every leaf of ``tree``.

  Orbax stores a dataclass or NamedTuple as a dict or list of its fields:
  leaves are compared by the names along their paths.
  """
  return [
    (tuple(_key_name(k) for k in path), jax.tree_util.keystr(path), leaf)
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]
  ]


def checksums(state: Any) -> dict[str, dict[str, Any]]:
  """``{leaf name: {"shape", "dtype", "checksum"}}`` of every array leaf of ``state``.

  One program per set of devices the leaves live on (leaves on different
  devices cannot share one); every process must call it.
  """
  named = named_leaves(state)
  groups: dict[Any, list[int]] = {}
  for i, (_, _, leaf) in enumerate(named):
    devices = leaf.sharding.device_set if isinstance(leaf, jax.Array) else None
    groups.setdefault(None if devices is None else frozenset(devices), []).append(i)
  sums: dict[int, np.ndarray] = {}
  for indices in groups.values():
    out = _to_host(_checksum_leaves([_host_words(named[i][2]) for i in indices]))
    sums.update(zip(indices, out))
  return {
    "/".join(names): {
      "shape": list(np.shape(leaf)),
      "dtype": str(leaf.dtype),
      "checksum": f"{int(sums[i][0]):08x}{int(sums[i][1]):08x}",
    }
    for i, (names, _, leaf) in enumerate(named)
  }


def json_checksum(value: Any) -> str:
  """A checksum of a JSON value (as it reads back: keys sorted, no spaces)."""
  text = json.dumps(value, sort_keys=True, separators=(",", ":"))
  return hashlib.sha256(text.encode()).hexdigest()[:16]


def checksum_metadata(state: Any, json_items: dict[str, Any] | None = None) -> dict[str, Any]:
  """The custom metadata of the array item: its leaves' checksums and the JSON items'."""
  metadata: dict[str, Any] = {"format": CHECKSUM_FORMAT, "leaves": checksums(state)}
  if json_items:
    metadata["json_items"] = {name: json_checksum(json.loads(json.dumps(value))) for name, value in json_items.items()}
  return {CHECKSUMS: metadata}


_HEX16 = re.compile(r"[0-9a-f]{16}")


def _well_formed(entry: Any) -> bool:
  return (
    isinstance(entry, dict)
    and isinstance(entry.get("shape"), list)
    and isinstance(entry.get("dtype"), str)
    and isinstance(entry.get("checksum"), str)
    and _HEX16.fullmatch(entry["checksum"]) is not None
  )


def saved_checksums(custom_metadata: Any) -> dict[str, Any] | None:
  """The checksums in an array item's custom metadata (as orbax reads it back), or None.

  None for a checkpoint written without them (before they were written, or
  by ``ocp.args.StandardSave`` without ``checkpoint_save_args``).

  Raises:
    ValueError: ``"not in the form ..."``, if they are there but not in the
      form they are written in (the caller names the folder).
  """
  if not isinstance(custom_metadata, dict) or CHECKSUMS not in custom_metadata:
    return None
  saved = custom_metadata[CHECKSUMS]
  if not (
    isinstance(saved, dict)
    and saved.get("format") == CHECKSUM_FORMAT
    and isinstance(saved.get("leaves"), dict)
    and all(_well_formed(e) for e in saved["leaves"].values())
    and all(isinstance(v, str) for v in (saved.get("json_items") or {}).values())
  ):
    raise ValueError(f"not in the form {CHECKSUM_FORMAT!r} that save_checkpoint writes")
  return saved


def mismatched_leaf(restored: Any, saved: dict[str, Any]) -> tuple[str, str, str | None, str] | None:
  """The first leaf of ``restored`` whose checksum differs from the saved one, or None.

  Returns:
    ``(leaf name, keystr, saved checksum, read checksum)``.
  """
  keystrs = {"/".join(names): keystr for names, keystr, _ in named_leaves(restored)}
  for name, entry in checksums(restored).items():
    want = saved["leaves"].get(name, {}).get("checksum")
    if want != entry["checksum"]:
      return name, keystrs[name], want, entry["checksum"]
  return None
