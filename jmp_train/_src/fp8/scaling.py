r"""Per-tensor FP8 scaling: the recipe, the scaling state and its update.

The scale :math:`s = \mathrm{fp8\_max} / \mathrm{amax} \cdot 2^{-\mathrm{margin}}`
of each operand of an FP8 product, from the tensor's own amax (current
scaling) or from a history of earlier steps' (delayed scaling), the
quantization with it, and the state (:class:`Fp8DotMeta`) the products keep
and :func:`update_fp8_meta` stores after each step. The products themselves
are in ``products``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jmp_train._src.hyperparams import check_int

__all__ = [
  "E4M3",
  "E5M2",
  "FP8_SCOPE",
  "Fp8DotMeta",
  "Fp8Recipe",
  "Fp8TensorMeta",
  "calibrate",
  "fp8_dequantize",
  "fp8_dtype",
  "fp8_quantize",
  "fp8_scale",
  "init_fp8_meta",
  "pmax_together",
  "push_amax",
  "update_fp8_meta",
]

E4M3 = np.dtype(jnp.float8_e4m3fn)
E5M2 = np.dtype(jnp.float8_e5m2)
_FP8_NAMES = {"e4m3": E4M3, "float8_e4m3fn": E4M3, "e5m2": E5M2, "float8_e5m2": E5M2}
_SCALINGS = ("delayed", "current")
# The name scope of the FP8 products (on FP8 operands, forward and backward): the diagnostics
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
      raise ValueError(f"amax_compute_algo must be one of {_AMAX_ALGOS}, got {self.amax_compute_algo!r}.")
    check_int(self.amax_history_len, "amax_history_len", 1)
    check_int(self.margin, "margin", 0)


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

  Args:
    recipe: the :class:`Fp8Recipe` whose ``amax_history_len`` sizes the
      histories.

  Returns:
    An :class:`Fp8DotMeta` for the left operand, the right one and the
    output gradient.

  Raises:
    TypeError: if ``recipe`` is not an :class:`Fp8Recipe`.

  Examples:
    >>> meta = init_fp8_meta(Fp8Recipe(amax_history_len=4))
    >>> meta.grad.amax_history.shape, float(meta.lhs.scale)
    ((4,), 1.0)
  """
  if not isinstance(recipe, Fp8Recipe):
    raise TypeError(
      f"init_fp8_meta needs an Fp8Recipe, e.g. Fp8Recipe(scaling='current'), got {type(recipe).__name__}: {recipe!r}."
    )
  one = lambda: Fp8TensorMeta(  # noqa: E731
    jnp.ones((), jnp.float32), jnp.zeros((recipe.amax_history_len,), jnp.float32)
  )
  return Fp8DotMeta(one(), one(), one())


def fp8_dtype(dtype: Any) -> np.dtype:
  """The FP8 dtype ``dtype`` names: ``"e4m3"``, ``"e5m2"`` or the jnp dtypes.

  Raises:
    ValueError: naming the valid ones, for anything else.
  """
  try:
    key = dtype if isinstance(dtype, str) else np.dtype(dtype).name
  except TypeError:
    key = None
  if key not in _FP8_NAMES:
    raise ValueError(
      f"Bad FP8 dtype {dtype!r}; valid: {', '.join(map(repr, sorted(_FP8_NAMES)))} "
      "or jnp.float8_e4m3fn, jnp.float8_e5m2."
    )
  return _FP8_NAMES[key]


def _fp8_max(dtype: Any) -> float:
  return float(jnp.finfo(fp8_dtype(dtype)).max)


def fp8_scale(amax: jax.Array, previous: jax.Array, dtype: Any, margin: int = 0) -> jax.Array:
  r"""The scale :math:`\mathrm{fp8\_max}/\mathrm{amax}/2^{\mathrm{margin}}`.

  Keeps ``previous`` where ``amax`` is zero or not finite (nothing to
  calibrate on), as Transformer Engine does.

  Args:
    amax: the largest magnitude to represent.
    previous: the scale to keep where ``amax`` cannot give one.
    dtype: the FP8 format (``jnp.float8_e4m3fn`` / ``"e4m3"`` or
      ``jnp.float8_e5m2`` / ``"e5m2"``).
    margin: powers of two of headroom.

  Returns:
    The float32 scale.

  Raises:
    ValueError: if ``dtype`` is not an FP8 format.

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

  Args:
    x: a floating array.
    dtype: the FP8 format (``jnp.float8_e4m3fn`` / ``"e4m3"`` or
      ``jnp.float8_e5m2`` / ``"e5m2"``).
    scale: the float32 scale (:func:`fp8_scale`).

  Returns:
    ``x * scale`` in ``dtype``, clipped to its largest finite value.

  Raises:
    TypeError: if ``x`` is not floating.
    ValueError: if ``dtype`` is not an FP8 format.

  Examples:
    >>> fp8_quantize(jnp.array([1.0, 1000.0]), jnp.float8_e4m3fn, jnp.float32(1.0)).tolist()
    [1.0, 448.0]
  """
  dtype = fp8_dtype(dtype)
  if not jnp.issubdtype(jnp.result_type(x), jnp.floating):
    raise TypeError(f"fp8_quantize needs a floating array, got {jnp.result_type(x)}.")
  limit = _fp8_max(dtype)
  scaled = jnp.asarray(x).astype(jnp.float32) * scale
  return jnp.clip(scaled, -limit, limit).astype(dtype)


def fp8_dequantize(q: jax.Array, scale: jax.Array, dtype: Any) -> jax.Array:
  """``q / scale`` in ``dtype`` (written as a product with ``1/scale``).

  Args:
    q: FP8 codes (:func:`fp8_quantize`).
    scale: the scale they were quantized with.
    dtype: the floating dtype of the result.

  Returns:
    The values, in ``dtype``.

  Raises:
    ValueError: if ``dtype`` is not a floating dtype.

  Examples:
    >>> fp8_dequantize(jnp.array([2.0], jnp.float8_e4m3fn), jnp.float32(4.0), jnp.float32).tolist()
    [0.5]
  """
  try:
    floating = jnp.issubdtype(dtype, jnp.floating)
  except TypeError:
    floating = False
  if not floating:
    raise ValueError(f"fp8_dequantize needs a floating result dtype, got {dtype!r}.")
  return q.astype(dtype) * (1.0 / scale).astype(dtype)


def _amax(x: jax.Array) -> jax.Array:
  return jnp.max(jnp.abs(x)).astype(jnp.float32)


def calibrate(x, meta: Fp8TensorMeta, dtype, recipe: Fp8Recipe):
  """The scale for ``x`` now, and the meta to store after this step."""
  amax = _amax(x)
  history = meta.amax_history
  if recipe.scaling == "current":
    scale = fp8_scale(amax, meta.scale, dtype, recipe.margin)
  else:
    past = jnp.max(history) if recipe.amax_compute_algo == "max" else history[0]
    scale = fp8_scale(past, meta.scale, dtype, recipe.margin)
  return scale, Fp8TensorMeta(scale, push_amax(history, amax))


def pmax_together(leaves: list[jax.Array], axis_name: Any) -> list[jax.Array]:
  """The ``pmax`` over ``axis_name`` of several arrays, as one reduction.

  The arrays are flattened into one float32 vector (amaxes and scales are
  float32), reduced with a single collective instead of one per array, and
  split back into their shapes and dtypes.

  Examples:
    >>> out = jax.pmap(lambda a, b: pmax_together([a, b], "d"), axis_name="d")(
    ...     jnp.arange(2.0)[:, None] * jnp.ones((2, 3)), jnp.arange(2.0))
    >>> out[0][0].tolist(), out[1].tolist()
    ([1.0, 1.0, 1.0], [1.0, 1.0])
  """
  if not leaves:
    return []
  flat = jax.lax.pmax(jnp.concatenate([jnp.ravel(x).astype(jnp.float32) for x in leaves]), axis_name)
  out, start = [], 0
  for x in leaves:
    out.append(flat[start : start + x.size].reshape(x.shape).astype(x.dtype))
    start += x.size
  return out


def update_fp8_meta(fp8_meta: Any, fp8_grads: Any, axis_name: Any = None) -> Any:
  """The FP8 state to store after a step: its "gradient", agreed over replicas.

  Args:
    fp8_meta: the current state (linen: ``variables["fp8_meta"]``; NNX:
      ``nnx.state(model, jmp_train.flax.Fp8Meta)``).
    fp8_grads: the gradient of the loss with respect to ``fp8_meta``, which
      the FP8 products set to their new state.
    axis_name: a mapped axis (``pmap``/``shard_map``) whose replicas must
      agree (max of the amax histories, one reduction for the whole state),
      or ``None``.

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
    return jnp.where(jnp.all(jnp.isfinite(new)), new, old).astype(old.dtype)

  new = jax.tree.map(leaf, fp8_meta, fp8_grads)
  if axis_name is None:
    return new
  leaves, treedef = jax.tree.flatten(new)
  return jax.tree.unflatten(treedef, pmax_together(leaves, axis_name))
