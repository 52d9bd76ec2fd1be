r"""FP8 matmuls and convolutions with per-tensor scaling.

FP8 has two formats: E4M3 (``jnp.float8_e4m3fn``: largest finite 448,
smallest normal :math:`2^{-6}`, 3 mantissa bits) for the forward operands,
and E5M2 (``jnp.float8_e5m2``: largest 57344, smallest normal
:math:`2^{-14}`, 2 mantissa bits) for gradients, whose range matters more
than their precision (the "hybrid" format of Transformer Engine). Either
range is far narrower than float16's, so every tensor is scaled before the
cast, by a per-tensor factor :math:`s`:

.. math::

  s = \frac{\mathrm{fp8\_max}}{\mathrm{amax}} \cdot 2^{-\mathrm{margin}}, \qquad
  q = \mathrm{fp8}(\mathrm{clip}(x \cdot s)), \qquad \hat x = q / s .

*Current scaling* takes :math:`\mathrm{amax} = \max|x|` of the tensor itself
in the same step. *Delayed scaling* (Transformer Engine's ``DelayedScaling``)
takes it from a history of the last ``amax_history_len`` steps' maxima
(``max`` over the history, or its ``most_recent`` entry) and pushes this
step's :math:`\max|x|` into the history after the cast; a zero or non-finite
amax leaves the previous scale, and a non-finite amax is never stored.

The product runs on the dequantized operands with float32 accumulation
(``preferred_element_type=float32``) and returns the compute dtype; on a GPU,
XLA rewrites "convert from FP8, multiply by 1/s, dot" into one FP8 GEMM.
The backward pass quantizes the incoming gradient to E5M2 with its own scale
and differentiates the same product.

State: each FP8 product keeps an :class:`Fp8DotMeta`, the
:class:`Fp8TensorMeta` (scale, amax history) of its left operand, right
operand and output gradient. The gradient's amax is only known in the
backward pass, so the new meta comes back as the *cotangent* of the meta
argument (the mechanism of Flax's ``fp8_ops``): differentiate with respect to
the meta and store what comes back in place of the old meta (never feed it to
an optimizer). Under data parallelism every replica must keep the same
scales: under ``shard_map`` a replicated meta's new value is already the max
over the replicas (its cotangent must be replicated too); under ``pmap``,
pass the axis to :func:`update_fp8_meta`.

References:
  Micikevicius et al., "FP8 Formats for Deep Learning", 2022.
  https://arxiv.org/abs/2209.05433

  NVIDIA Transformer Engine, "Using FP8 with Transformer Engine" (delayed
  scaling recipe).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

__all__ = [
    "Fp8Recipe",
    "Fp8TensorMeta",
    "Fp8DotMeta",
    "init_fp8_meta",
    "fp8_scale",
    "push_amax",
    "fp8_quantize",
    "fp8_dequantize",
    "fp8_dot_general",
    "fp8_conv_general_dilated",
    "update_fp8_meta",
]

E4M3 = np.dtype(jnp.float8_e4m3fn)
E5M2 = np.dtype(jnp.float8_e5m2)
_SCALINGS = ("delayed", "current")
# The name scope of the products on dequantized FP8 operands: the diagnostics
# read it to apply FP8's shape rules to them.
FP8_SCOPE = "fp8_product"
_AMAX_ALGOS = ("max", "most_recent")


@dataclasses.dataclass(frozen=True)
class Fp8Recipe:
  """How FP8 products scale their operands (hashable, a static value).

  Attributes:
    scaling: ``"delayed"`` (amax from a history of earlier steps) or
      ``"current"`` (amax of the tensor itself, this step).
    amax_history_len: steps of amax kept per tensor (delayed scaling).
    margin: the scale is divided by ``2**margin`` for headroom.
    amax_compute_algo: ``"max"`` over the history or its ``"most_recent"``
      entry.

  Examples:
    >>> Fp8Recipe(scaling="current").scaling
    'current'
    >>> Fp8Recipe(amax_history_len=0)
    Traceback (most recent call last):
    ...
    ValueError: amax_history_len must be a positive int, got 0.
  """

  scaling: str = "delayed"
  amax_history_len: int = 1024
  margin: int = 0
  amax_compute_algo: str = "max"

  def __post_init__(self):
    if self.scaling not in _SCALINGS:
      raise ValueError(f"scaling must be one of {_SCALINGS}, got {self.scaling!r}.")
    if self.amax_compute_algo not in _AMAX_ALGOS:
      raise ValueError(
          f"amax_compute_algo must be one of {_AMAX_ALGOS}, got {self.amax_compute_algo!r}."
      )
    n = self.amax_history_len
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
      raise ValueError(f"amax_history_len must be a positive int, got {n!r}.")
    m = self.margin
    if isinstance(m, bool) or not isinstance(m, (int, np.integer)) or m < 0:
      raise ValueError(f"margin must be a non-negative int, got {m!r}.")


class Fp8TensorMeta(NamedTuple):
  """The scaling state of one tensor of an FP8 product.

  Attributes:
    scale: float32 scalar :math:`s`, the last scale used (``x * s`` is cast).
    amax_history: float32 ``[amax_history_len]``, most recent first.
  """

  scale: jax.Array
  amax_history: jax.Array


class Fp8DotMeta(NamedTuple):
  """The scaling state of one FP8 product: its two operands and its gradient.

  Attributes:
    lhs: :class:`Fp8TensorMeta` of the left operand (E4M3).
    rhs: :class:`Fp8TensorMeta` of the right operand, the weight (E4M3).
    grad: :class:`Fp8TensorMeta` of the output gradient (E5M2).
  """

  lhs: Fp8TensorMeta
  rhs: Fp8TensorMeta
  grad: Fp8TensorMeta


def init_fp8_meta(recipe: Fp8Recipe = Fp8Recipe()) -> Fp8DotMeta:
  """The initial state of one FP8 product: scales 1, empty (zero) histories.

  Examples:
    >>> meta = init_fp8_meta(Fp8Recipe(amax_history_len=4))
    >>> meta.grad.amax_history.shape, float(meta.lhs.scale)
    ((4,), 1.0)
  """
  one = lambda: Fp8TensorMeta(  # noqa: E731
      jnp.ones((), jnp.float32), jnp.zeros((recipe.amax_history_len,), jnp.float32)
  )
  return Fp8DotMeta(one(), one(), one())


def _fp8_max(dtype: Any) -> float:
  return float(jnp.finfo(dtype).max)


def fp8_scale(amax: jax.Array, previous: jax.Array, dtype: Any, margin: int = 0) -> jax.Array:
  r"""The scale :math:`\mathrm{fp8\_max}/\mathrm{amax}/2^{\mathrm{margin}}`.

  Keeps ``previous`` where ``amax`` is zero or not finite (nothing to
  calibrate on), as Transformer Engine does.

  Examples:
    >>> float(fp8_scale(jnp.float32(4.0), jnp.float32(1.0), jnp.float8_e4m3fn))
    112.0
    >>> float(fp8_scale(jnp.float32(0.0), jnp.float32(3.0), jnp.float8_e4m3fn))
    3.0
  """
  amax = jnp.asarray(amax, jnp.float32)
  new = jnp.float32(_fp8_max(dtype) / 2.0**margin) / amax
  ok = jnp.isfinite(amax) & (amax > 0) & jnp.isfinite(new)
  return jnp.where(ok, new, previous).astype(jnp.float32)


def push_amax(history: jax.Array, amax: jax.Array) -> jax.Array:
  """Pushes ``amax`` to the front of ``history``; a non-finite amax is dropped.

  Examples:
    >>> push_amax(jnp.array([3.0, 2.0, 1.0]), jnp.float32(4.0)).tolist()
    [4.0, 3.0, 2.0]
    >>> push_amax(jnp.array([3.0, 2.0, 1.0]), jnp.float32(jnp.inf)).tolist()
    [3.0, 2.0, 1.0]
  """
  amax = jnp.asarray(amax, history.dtype)
  pushed = jnp.concatenate([amax[None], history[:-1]])
  return jnp.where(jnp.isfinite(amax), pushed, history)


def fp8_quantize(x: jax.Array, dtype: Any, scale: jax.Array) -> jax.Array:
  """``fp8(clip(x * scale))``: clipped, so large values saturate, not overflow.

  Examples:
    >>> fp8_quantize(jnp.array([1.0, 1000.0]), jnp.float8_e4m3fn, jnp.float32(1.0)).tolist()
    [1.0, 448.0]
  """
  limit = _fp8_max(dtype)
  scaled = x.astype(jnp.float32) * scale
  return jnp.clip(scaled, -limit, limit).astype(dtype)


def fp8_dequantize(q: jax.Array, scale: jax.Array, dtype: Any) -> jax.Array:
  """``q / scale`` in ``dtype`` (written as a product with ``1/scale``).

  Examples:
    >>> fp8_dequantize(jnp.array([2.0], jnp.float8_e4m3fn), jnp.float32(4.0), jnp.float32).tolist()
    [0.5]
  """
  return q.astype(dtype) * (1.0 / scale).astype(dtype)


def _amax(x: jax.Array) -> jax.Array:
  return jnp.max(jnp.abs(x)).astype(jnp.float32)


def _calibrate(x, meta: Fp8TensorMeta, dtype, recipe: Fp8Recipe):
  """The scale for ``x`` now, and the meta to store after this step."""
  amax = _amax(x)
  history = meta.amax_history
  if recipe.scaling == "current":
    scale = fp8_scale(amax, meta.scale, dtype, recipe.margin)
  else:
    past = jnp.max(history) if recipe.amax_compute_algo == "max" else history[0]
    scale = fp8_scale(past, meta.scale, dtype, recipe.margin)
  return scale, Fp8TensorMeta(scale, push_amax(history, amax))


def _varying_axes(x: Any) -> frozenset[str]:
  """Mesh axes ``x`` varies over inside ``shard_map`` (empty elsewhere)."""
  aval = jax.typeof(x)
  manual = getattr(aval, "manual_axis_type", None)  # jax >= 0.10
  if manual is not None:
    return frozenset(manual.varying)
  return frozenset(getattr(aval, "vma", None) or ())


def _agree(new: jax.Array, axes: frozenset[str]) -> jax.Array:
  """Under ``shard_map``, a meta shared by all replicas gets their max.

  The new meta of a replicated (invariant) meta must be replicated too: the
  max over the axes the data made it vary over is the global batch's amax.
  """
  extra = tuple(sorted(_varying_axes(new) - axes))
  return lax.pmax(new, extra) if extra else new


def _fp8_binary(op: Callable[[jax.Array, jax.Array], jax.Array], recipe: Fp8Recipe,
                l_dtype: Any, r_dtype: Any):
  """``op(lhs, rhs)`` with FP8 operands and gradient, as a ``custom_vjp``."""

  def forward(lhs, rhs, meta: Fp8DotMeta):
    s_l, lhs_meta = _calibrate(lhs, meta.lhs, E4M3, recipe)
    s_r, rhs_meta = _calibrate(rhs, meta.rhs, E4M3, recipe)
    q_l, q_r = fp8_quantize(lhs, E4M3, s_l), fp8_quantize(rhs, E4M3, s_r)
    with jax.named_scope(FP8_SCOPE):
      out = op(fp8_dequantize(q_l, s_l, lhs.dtype), fp8_dequantize(q_r, s_r, rhs.dtype))
    return out, (q_l, s_l, q_r, s_r, lhs_meta, rhs_meta, meta.grad)

  @jax.custom_vjp
  def product(lhs, rhs, meta):
    return forward(lhs, rhs, meta)[0]

  meta_axes: list[Any] = []  # the meta's varying mesh axes, seen by fwd

  def product_bwd(res, g):
    q_l, s_l, q_r, s_r, lhs_meta, rhs_meta, grad_meta = res
    s_g, new_grad_meta = _calibrate(g, grad_meta, E5M2, recipe)
    g_hat = fp8_dequantize(fp8_quantize(g, E5M2, s_g), s_g, g.dtype)
    with jax.named_scope(FP8_SCOPE):
      _, pullback = jax.vjp(
          op, fp8_dequantize(q_l, s_l, l_dtype), fp8_dequantize(q_r, s_r, r_dtype))
      d_lhs, d_rhs = pullback(g_hat)
    new_meta = Fp8DotMeta(lhs_meta, rhs_meta, new_grad_meta)
    new_meta = jax.tree.map(_agree, new_meta, meta_axes[0])
    return d_lhs.astype(l_dtype), d_rhs.astype(r_dtype), new_meta

  def product_fwd(lhs, rhs, meta):
    meta_axes[:] = [jax.tree.map(_varying_axes, meta)]
    return forward(lhs, rhs, meta)

  product.defvjp(product_fwd, product_bwd)
  return product


def _check_meta(meta: Any, fn: str) -> Fp8DotMeta:
  if not isinstance(meta, Fp8DotMeta):
    raise TypeError(
        f"{fn} needs meta=Fp8DotMeta (from jmp_train.init_fp8_meta), got "
        f"{type(meta).__name__}."
    )
  return meta


def _check_operands(lhs, rhs, fn: str) -> None:
  for name, x in (("lhs", lhs), ("rhs", rhs)):
    if not jnp.issubdtype(jnp.result_type(x), jnp.floating):
      raise TypeError(f"{fn}: {name} must be floating, got {jnp.result_type(x)}.")


def fp8_dot_general(
    lhs: jax.Array,
    rhs: jax.Array,
    dimension_numbers: Any,
    precision: Any = None,
    preferred_element_type: Any = None,
    *,
    meta: Fp8DotMeta,
    recipe: Fp8Recipe = Fp8Recipe(),
    out_sharding: Any = None,
) -> jax.Array:
  """``lax.dot_general`` with E4M3 operands and an E5M2 gradient.

  Accumulates in float32 and returns ``preferred_element_type`` (default:
  the operands' common dtype, e.g. bfloat16 under a mixed policy).
  Differentiating with respect to ``meta`` yields the meta to store for the
  next step (see the module docstring); ``precision`` is ignored (FP8 has
  one).

  Args:
    lhs, rhs, dimension_numbers, precision, preferred_element_type: as for
      ``lax.dot_general``.
    meta: this product's :class:`Fp8DotMeta`.
    recipe: the :class:`Fp8Recipe`.
    out_sharding: as for ``lax.dot_general``.

  Returns:
    The product.

  Raises:
    TypeError: for non-floating operands or a ``meta`` of another type.

  Examples:
    >>> meta = init_fp8_meta(Fp8Recipe(scaling="current"))
    >>> x, w = jnp.ones((4, 16), jnp.bfloat16), jnp.full((16, 8), 0.5, jnp.bfloat16)
    >>> y = fp8_dot_general(x, w, (((1,), (0,)), ((), ())), meta=meta,
    ...                     recipe=Fp8Recipe(scaling="current"))
    >>> y.dtype, float(y[0, 0])
    (dtype(bfloat16), 8.0)
    >>> new_meta = jax.grad(lambda m: fp8_dot_general(
    ...     x, w, (((1,), (0,)), ((), ())), meta=m).sum())(meta)
    >>> new_meta.lhs.amax_history[:2].tolist(), new_meta.rhs.amax_history[0].item()
    ([1.0, 0.0], 0.5)
  """
  del precision
  lhs, rhs = jnp.asarray(lhs), jnp.asarray(rhs)
  _check_operands(lhs, rhs, "fp8_dot_general")
  out_dtype = preferred_element_type or jnp.result_type(lhs, rhs)
  extra = {} if out_sharding is None else {"out_sharding": out_sharding}

  def op(a, b):
    out = lax.dot_general(a, b, dimension_numbers, preferred_element_type=jnp.float32, **extra)
    return out.astype(out_dtype)

  product = _fp8_binary(op, recipe, lhs.dtype, rhs.dtype)
  return product(lhs, rhs, _check_meta(meta, "fp8_dot_general"))


def fp8_conv_general_dilated(
    lhs: jax.Array,
    rhs: jax.Array,
    *args: Any,
    meta: Fp8DotMeta,
    recipe: Fp8Recipe = Fp8Recipe(),
    **kwargs: Any,
) -> jax.Array:
  """``lax.conv_general_dilated`` with E4M3 operands and an E5M2 gradient.

  The same scaling as :func:`fp8_dot_general`; the remaining arguments are
  ``lax.conv_general_dilated``'s (``precision`` is ignored).

  Examples:
    >>> meta = init_fp8_meta(Fp8Recipe(scaling="current"))
    >>> x, k = jnp.ones((1, 8, 8, 16)), jnp.full((3, 3, 16, 16), 0.25)
    >>> y = fp8_conv_general_dilated(x, k, (1, 1), "SAME",
    ...     dimension_numbers=("NHWC", "HWIO", "NHWC"), meta=meta,
    ...     recipe=Fp8Recipe(scaling="current"))
    >>> float(y[0, 4, 4, 0])
    36.0
  """
  lhs, rhs = jnp.asarray(lhs), jnp.asarray(rhs)
  _check_operands(lhs, rhs, "fp8_conv_general_dilated")
  kwargs.pop("precision", None)
  out_dtype = kwargs.pop("preferred_element_type", None) or jnp.result_type(lhs, rhs)

  def op(a, b):
    out = lax.conv_general_dilated(a, b, *args, preferred_element_type=jnp.float32, **kwargs)
    return out.astype(out_dtype)

  product = _fp8_binary(op, recipe, lhs.dtype, rhs.dtype)
  return product(lhs, rhs, _check_meta(meta, "fp8_conv_general_dilated"))


def update_fp8_meta(fp8_meta: Any, fp8_grads: Any, axis_name: Any = None) -> Any:
  """The FP8 state to store after a step: its "gradient", agreed over replicas.

  Args:
    fp8_meta: the current state (linen: ``variables["fp8_meta"]``; NNX:
      ``nnx.state(model, jmp_train.flax.Fp8Meta)``).
    fp8_grads: the gradient of the loss with respect to ``fp8_meta``, which
      the FP8 products set to their new state.
    axis_name: a mapped axis (``pmap``/``shard_map``) whose replicas must
      agree (max of the amax histories), or ``None``.

  Returns:
    The new state, of ``fp8_meta``'s structure and dtypes. Leaves whose
    gradient is not finite keep their value (a skipped step).

  Raises:
    ValueError: if the two trees differ in structure.

  Examples:
    >>> import flax.linen as nn, functools, jmp_train, jmp_train.flax
    >>> layer = nn.Dense(8, dot_general_cls=functools.partial(
    ...     jmp_train.flax.Fp8DotGeneral, recipe=Fp8Recipe(amax_history_len=2)))
    >>> v = layer.init(jax.random.key(0), jnp.ones((2, 8)))
    >>> g = jax.grad(lambda m: layer.apply({**v, "fp8_meta": m},
    ...     2 * jnp.ones((2, 8))).sum())(v["fp8_meta"])
    >>> new = update_fp8_meta(v["fp8_meta"], g)
    >>> new["Fp8DotGeneral_0"]["input_amax_history"].tolist()
    [2.0, 0.0]
  """
  if jax.tree.structure(fp8_meta) != jax.tree.structure(fp8_grads):
    raise ValueError(
        "fp8_grads must have fp8_meta's structure (the gradient with respect "
        f"to it); got {jax.tree.structure(fp8_grads)} for {jax.tree.structure(fp8_meta)}."
    )

  def leaf(old, new):
    new = jnp.where(jnp.all(jnp.isfinite(new)), new, old).astype(old.dtype)
    return new if axis_name is None else jax.lax.pmax(new, axis_name)

  return jax.tree.map(leaf, fp8_meta, fp8_grads)
