"""Compensated (Kahan) summation of updates into half-precision parameters."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jmp_train._src.low_precision.half_updates import accumulation_dtype
from jmp_train._src.low_precision.half_updates import check_params
from jmp_train._src.low_precision.half_updates import check_structure
from jmp_train._src.low_precision.half_updates import land
from jmp_train._src.low_precision.half_updates import unzip_pairs
from jmp_train._src.dtypes import is_floating_array
from jmp_train._src.dtypes import parse_dtype

__all__ = ["KahanCompensationState", "kahan_compensation"]


class KahanCompensationState(NamedTuple):
  """State of :func:`kahan_compensation`.

  Attributes:
    compensation: per parameter, the part of past updates that rounding to
      the parameters' dtype dropped (``c`` below), in the parameters' dtype
      unless ``compensation_dtype`` was given.
  """

  compensation: optax.Updates


def kahan_compensation(
  compensation_dtype: Any | None = None,
) -> optax.GradientTransformation:
  r"""Compensated (Kahan) summation of updates into low-precision parameters.

  Place it last in a chain. With ``p`` the current parameter (say bfloat16),
  ``u`` the incoming update and ``c`` the compensation buffer, each step
  computes in float32

  .. math::

    y = u + c, \qquad p' = \mathrm{round}(p + y), \qquad c' = y - (p' - p)

  and returns the update ``p' - p`` (in ``u``'s dtype), so that
  ``optax.apply_updates(params, updates)`` produces ``p'`` bit for bit
  whenever ``p' - p`` is representable in ``u``'s dtype: always when
  ``p'/2 <= p <= 2p'`` (Sterbenz's lemma), e.g. for any step of at most half
  the weight's magnitude. The buffer carries what rounding dropped: small
  updates accumulate in ``c`` until they move ``p`` by an ulp, and ``p + c``
  tracks the float32 trajectory to within the buffer's own rounding. ``c'``
  is computed from the value ``apply_updates`` will really produce, so it
  stays exact even for the rare larger steps where ``p' - p`` is rounded. A
  non-finite ``c'`` (an overflowed or NaN update) is reset to zero so one bad
  step cannot poison later ones; wrap the optimizer in
  ``jmp_train.loss_scaled`` to skip such steps altogether.

  Leaves that are not floating point pass through unchanged; float32
  parameters get classic same-precision Kahan summation.

  Memory: one buffer per parameter in the parameters' dtype, 2 bytes for
  half types, against 4 for a float32 master copy.

  Args:
    compensation_dtype: dtype of the buffer; ``None`` (default) uses each
      parameter's dtype. A wider type (float32) keeps more of the residual
      at twice the memory.

  Returns:
    An ``optax.GradientTransformation`` whose ``update`` requires ``params``;
    its state is a :class:`KahanCompensationState`.

  Raises:
    ValueError: if ``compensation_dtype`` is not a floating dtype, or (at
      trace time) if ``update`` is called without ``params`` or with params
      whose tree differs from the updates'.

  Examples:
    >>> import jax.numpy as jnp, optax
    >>> params = jnp.ones(4, jnp.bfloat16)
    >>> opt = optax.chain(optax.sgd(1e-3), kahan_compensation())
    >>> state = opt.init(params)
    >>> grads = jnp.ones(4, jnp.bfloat16)  # each step 1e-3 < half an ulp
    >>> for _ in range(100):
    ...   updates, state = opt.update(grads, state, params)
    ...   params = optax.apply_updates(params, updates)
    >>> round(float(params[0]), 2)  # float32 gives 0.9; plain bfloat16 stays 1
    0.9

  References:
    Kahan, "Further remarks on reducing truncation errors", Communications
    of the ACM 8(1), 1965. https://doi.org/10.1145/363707.363723
    Zamirai et al., "Revisiting BFloat16 Training", 2020.
    https://arxiv.org/abs/2010.06192
  """
  if compensation_dtype is not None:
    try:
      compensation_dtype = parse_dtype(compensation_dtype)
    except ValueError as e:
      raise ValueError(f"compensation_dtype must be a floating dtype or None: {e}") from None

  def init_fn(params):
    def zeros(p):
      if not is_floating_array(p):
        return jnp.zeros([], jnp.float32)  # placeholder, never read
      dtype = p.dtype if compensation_dtype is None else compensation_dtype
      return jnp.zeros(jnp.shape(p), dtype)

    return KahanCompensationState(compensation=jax.tree.map(zeros, params))

  def update_fn(updates, state, params=None):
    check_params(params, "kahan_compensation")
    check_structure(updates, params, "kahan_compensation")

    def leaf(u, c, p):
      if not (is_floating_array(p) and is_floating_array(u)):
        return u, c
      acc = accumulation_dtype(p.dtype)
      y = u.astype(acc) + c.astype(acc)
      new_u, applied = land(p, y, u.dtype)
      new_c = y - applied
      new_c = jnp.where(jnp.isfinite(new_c), new_c, jnp.zeros_like(new_c))
      return new_u, new_c.astype(c.dtype)

    pairs = jax.tree.map(leaf, updates, state.compensation, params)
    new_updates, new_comp = unzip_pairs(updates, pairs)
    return new_updates, KahanCompensationState(compensation=new_comp)

  return optax.GradientTransformation(init_fn, update_fn)


# ---------------------------------------------------------------------------
# Stochastic rounding.
# ---------------------------------------------------------------------------
