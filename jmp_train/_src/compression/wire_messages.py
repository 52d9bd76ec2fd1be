"""One byte message per collective: codes with a few float32 values appended.

A compressed exchange sends, per chunk, its codes (packed bits, float8
codes) and a few float32 values that decode them (reconstruction pairs, a
scale). Sent in collectives of their own, the floats would cost each phase
a second collective, and on a slow link every collective pays its own
latency. :func:`append_floats` puts the floats' bytes after the codes of
the same chunk; :func:`split_floats` takes them apart again, bit for bit.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

__all__ = ["append_floats", "split_floats"]


def append_floats(codes: jax.Array, floats: jax.Array) -> jax.Array:
  """``(..., B)`` uint8 codes and float32 ``floats`` of shape ``(...) + tail`` as ``(..., B + 4·|tail|)`` uint8."""
  lead = codes.shape[:-1]
  as_bytes = lax.bitcast_convert_type(floats.astype(jnp.float32), jnp.uint8)
  return jnp.concatenate([codes, as_bytes.reshape(lead + (-1,))], axis=-1)


def split_floats(payload: jax.Array, nbytes: int, tail: tuple[int, ...]):
  """Inverse of :func:`append_floats`: ``(codes, floats)``, the codes the first ``nbytes``."""
  rest = payload[..., nbytes:]
  floats = lax.bitcast_convert_type(rest.reshape(rest.shape[:-1] + tuple(tail) + (4,)), jnp.float32)
  return payload[..., :nbytes], floats
