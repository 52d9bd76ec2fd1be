r"""SmoothQuant: activation outliers migrated into the weights, per input channel.

For a weight product :math:`Y = X W` contracting the input channels
:math:`j`, SmoothQuant divides the activation by a per-channel factor and
multiplies the weight by it,

.. math::

  s_j = \frac{\max |X_j|^{\alpha}}{\max |W_j|^{1-\alpha}}, \qquad
  X' = X \,\mathrm{diag}(s)^{-1}, \qquad W' = \mathrm{diag}(s)\, W, \qquad X' W' = X W,

so that a few channels with outlier activations (as Transformers' inputs to
their projections have) no longer set the activation's per-tensor scale;
:math:`\alpha` (the migration strength, in :math:`[0, 1]`) sets how much of
the range moves to the weight, whose scales are per output channel. Where
either maximum is 0, :math:`s_j = 1`.

A site is smoothed when it is a ``dot_general`` without batch axes whose
weight is a parameter leaf used as stored, by that product alone (the
folded weight :math:`W'` then replaces the leaf). Convolutions, products
with batch axes and shared weights are left unsmoothed. The activation is
multiplied by :math:`1/s` (float32), in the quantized model and in its ONNX
export alike.

References:
  Xiao et al., "SmoothQuant: Accurate and Efficient Post-Training
  Quantization for Large Language Models", ICML 2023.
  https://arxiv.org/abs/2211.10438
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend import core as jex_core

from jmp_train._src.autocast import scaled

__all__ = ["axes_of", "channel_amax", "check_alpha", "factors", "inverse", "laid_out", "leaf_uses"]

_BODIES = {"pjit": "jaxpr", "jit": "jaxpr", "closed_call": "call_jaxpr", "custom_jvp_call": "call_jaxpr"}


def check_alpha(alpha: Any) -> float | None:
  """``alpha`` as a float, ``None`` for none; a ValueError outside [0, 1]."""
  if alpha is None:
    return None
  ok = isinstance(alpha, (int, float, np.floating)) and not isinstance(alpha, bool)
  if not ok or not math.isfinite(float(alpha)) or not 0.0 <= float(alpha) <= 1.0:
    raise ValueError(
      f"smoothquant is SmoothQuant's migration strength alpha: a number in [0, 1] (0.5 is the paper's default; "
      f"None for no smoothing), got {alpha!r}."
    )
  return float(alpha)


def axes_of(site: scaled.Site) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
  """``(activation axes, weight axes)`` a site contracts (paired, in order), or ``None`` when it
  cannot be smoothed (a convolution, or a ``dot_general`` with batch axes)."""
  if site.eqn.primitive is not lax.dot_general_p:
    return None
  contract, batch = site.eqn.params["dimension_numbers"]
  if any(len(b) for b in batch) or not len(contract[0]):
    return None
  return tuple(int(a) for a in contract[site.activation]), tuple(int(a) for a in contract[site.weight])


def channel_amax(x: Any, axes: Sequence[int]) -> jax.Array:
  """``max |x|`` over every axis but ``axes``, laid out in the order of ``axes`` (float32)."""
  x = jnp.abs(jnp.asarray(x, jnp.float32))
  others = tuple(d for d in range(x.ndim) if d not in axes)
  kept = jnp.max(x, axis=others) if others else x
  order = sorted(axes)
  return jnp.transpose(kept, [order.index(a) for a in axes])


def laid_out(v: Any, ndim: int, axes: Sequence[int]) -> Any:
  """A per-channel vector ``v`` (in the order of ``axes``) shaped to broadcast against an operand
  of rank ``ndim``, its entries along ``axes`` (numpy in, numpy out; jax in, jax out)."""
  xp = np if isinstance(v, np.ndarray) else jnp
  order = sorted(axes)
  v = xp.transpose(v, [list(axes).index(a) for a in order])
  shape = [1] * ndim
  for a, n in zip(order, v.shape):
    shape[a] = n
  return xp.reshape(v, shape)


def factors(act_amax: np.ndarray, weight_amax: np.ndarray, alpha: float) -> np.ndarray:
  r"""The smoothing factors :math:`s_j = a_j^{\alpha} / w_j^{1-\alpha}` (float32); 1 where either is 0.

  Args:
    act_amax: the activation's amax per input channel.
    weight_amax: the weight's amax per input channel (over its output channels).
    alpha: the migration strength, in [0, 1].

  Returns:
    The factors, positive and finite (float32).

  Examples:
    >>> factors(np.array([4.0, 0.0, 9.0]), np.array([1.0, 2.0, 4.0]), 0.5).tolist()
    [2.0, 1.0, 1.5]
  """
  a = np.asarray(act_amax, np.float64)
  w = np.asarray(weight_amax, np.float64)
  ok = (a > 0) & (w > 0) & np.isfinite(a) & np.isfinite(w)
  with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
    s = np.where(ok, np.power(np.where(ok, a, 1.0), alpha) / np.power(np.where(ok, w, 1.0), 1.0 - alpha), 1.0)
  s = s.astype(np.float32)
  return np.where(np.isfinite(s) & (s > 0) & np.isfinite(np.float32(1) / s), s, np.float32(1)).astype(np.float32)


def inverse(s: Any) -> np.ndarray:
  """``1 / s`` in float32: what the activation is multiplied by (the model and its ONNX export)."""
  return (np.float32(1) / np.asarray(s, np.float32)).astype(np.float32)


def leaf_uses(apply_fn: Any, params: Any, inputs: Any) -> list[int]:
  """Per parameter leaf, how many equations of ``apply_fn``'s jaxpr read it (calls followed)."""
  leaves, treedef = jax.tree.flatten(params)
  closed = jax.make_jaxpr(lambda flat, x: apply_fn(jax.tree.unflatten(treedef, flat), x))(leaves, inputs)
  counts = [0] * len(leaves)

  def walk(jaxpr, origin):
    def use(v):
      if not isinstance(v, jex_core.Literal) and v in origin:
        counts[origin[v]] += 1

    for eqn in jaxpr.eqns:
      key = _BODIES.get(eqn.primitive.name)
      if key in eqn.params:
        inner = getattr(eqn.params[key], "jaxpr", eqn.params[key])
        walk(
          inner,
          {
            b: origin[a]
            for a, b in zip(eqn.invars, inner.invars)
            if not isinstance(a, jex_core.Literal) and a in origin
          },
        )
        continue
      for v in eqn.invars:
        use(v)
    for v in jaxpr.outvars:
      use(v)

  walk(closed.jaxpr, {v: i for i, v in enumerate(closed.jaxpr.invars[: len(leaves)])})
  return counts
