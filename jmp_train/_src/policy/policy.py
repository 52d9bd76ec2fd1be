"""Dtype policies: which dtype parameters, computation and outputs use.

A policy is three dtypes (after Micikevicius et al., "Mixed Precision
Training", ICLR 2018, section 3): parameters are stored in ``param_dtype``
(float32 masters), the forward and backward pass compute in ``compute_dtype``
(float16 or bfloat16 so matmuls and convolutions use Tensor Cores), and the
model returns ``output_dtype`` (float32, so the loss is computed in float32).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

from jmp_train._src.dtypes import DTYPE_ALIASES as _DTYPE_ALIASES
from jmp_train._src.dtypes import is_floating_array, parse_dtype
from jmp_train._src.fp8.products import Fp8Recipe
from jmp_train._src.int8.recipe import Int8Recipe

__all__ = [
  "Policy",
  "get_policy",
  "cast_floating",
]

_KEY_ALIASES: dict[str, str] = {
  "params": "param",
  "param": "param",
  "p": "param",
  "compute": "compute",
  "c": "compute",
  "output": "output",
  "o": "output",
}
_PRESETS: dict[str, tuple[str, str, str]] = {
  "mixed_float16": ("float32", "float16", "float32"),
  "mixed_bfloat16": ("float32", "bfloat16", "float32"),
  "mixed_half": ("float32", "half", "float32"),
  "float32": ("float32", "float32", "float32"),
}
_FP8_PRESETS: dict[str, Fp8Recipe | Int8Recipe] = {
  "mixed_float8": Fp8Recipe(),
  "mixed_int8": Int8Recipe(),
}
# Keys of a spec that choose narrow (FP8, INT8) matmuls and their scaling recipe.
_MATMUL_VALUES = {"fp8": "delayed", "fp8_delayed": "delayed", "fp8_current": "current", "int8": "int8"}
_INT8_KEYS = {"int8_activation": "activation", "int8_weight": "weight", "int8_backward": "backward"}
_FP8_KEYS = ("matmul", "fp8_history", "fp8_margin", "fp8_amax", *_INT8_KEYS)
_ACCEPTED_DTYPES = sorted(set(_DTYPE_ALIASES) | {"half"})
_ACCEPTED_KEYS = sorted(set(_KEY_ALIASES) | set(_FP8_KEYS))


def cast_floating(tree: Any, dtype: Any) -> Any:
  """Casts the floating-point array leaves of ``tree`` to ``dtype``.

  Integer, boolean and key arrays, ``None`` and non-array leaves (Python
  numbers, strings) are returned untouched; leaves already in ``dtype`` are
  returned as they are (no copy).

  Args:
    tree: any pytree.
    dtype: the target floating dtype (name or dtype).

  Returns:
    A pytree of the same structure.

  Examples:
    >>> tree = {"w": jnp.ones(2), "step": jnp.zeros((), jnp.int32)}
    >>> out = cast_floating(tree, "bf16")
    >>> out["w"].dtype, out["step"].dtype
    (dtype(bfloat16), dtype('int32'))
  """
  dtype = parse_dtype(dtype)

  def cast(x):
    if is_floating_array(x) and hasattr(x, "astype") and x.dtype != dtype:
      return x.astype(dtype)
    return x

  return jax.tree.map(cast, tree)


@dataclasses.dataclass(frozen=True)
class Policy:
  """An immutable, hashable mixed-precision policy.

  Attributes:
    param_dtype: dtype parameters are created and stored in.
    compute_dtype: dtype of the forward and backward computation.
    output_dtype: dtype of the model's outputs; ``None`` keeps them in
      ``compute_dtype``.
    fp8: ``None``, or the :class:`~jmp_train.Fp8Recipe` with which matmuls
      and convolutions run in FP8 (E4M3 operands, E5M2 gradients; the rest
      of the computation stays in ``compute_dtype``).
    int8: ``None``, or the :class:`~jmp_train.int8.Int8Recipe` with which
      weight products run on int8 operands with int32 accumulation under
      :func:`~jmp_train.autocast` (gradients in ``compute_dtype``). At
      most one of ``fp8`` and ``int8``.

  Being frozen and hashable, a policy can be a static argument of
  ``jax.jit``. ``str(policy)`` is a spec that :func:`get_policy` parses back.

  Examples:
    >>> policy = Policy("float32", "bfloat16", "float32")
    >>> x = policy.cast_to_compute({"x": jnp.ones(3), "label": jnp.arange(3)})
    >>> x["x"].dtype, x["label"].dtype
    (dtype(bfloat16), dtype('int32'))
    >>> str(policy)
    'params=float32,compute=bfloat16,output=float32'

  References:
    Micikevicius et al., "Mixed Precision Training", ICLR 2018.
    https://arxiv.org/abs/1710.03740
  """

  param_dtype: np.dtype
  compute_dtype: np.dtype
  output_dtype: np.dtype
  fp8: Fp8Recipe | None = None
  int8: Int8Recipe | None = None

  def __post_init__(self):
    if self.output_dtype is None:
      object.__setattr__(self, "output_dtype", self.compute_dtype)
    for field in ("param_dtype", "compute_dtype", "output_dtype"):
      value = getattr(self, field)
      try:
        object.__setattr__(self, field, parse_dtype(value))
      except ValueError as e:
        raise ValueError(f"Policy's {field}: {e}") from None
    if self.fp8 is not None and not isinstance(self.fp8, Fp8Recipe):
      raise TypeError(f"fp8 must be None or a jmp_train.Fp8Recipe, got {self.fp8!r}.")
    if self.int8 is not None and not isinstance(self.int8, Int8Recipe):
      raise TypeError(f"int8 must be None or a jmp_train.int8.Int8Recipe, got {self.int8!r}.")
    if self.fp8 is not None and self.int8 is not None:
      raise ValueError("A policy runs its products in one narrow format: give fp8= or int8=, not both.")

  def cast_to_param(self, tree: Any) -> Any:
    """Casts floating leaves of ``tree`` to ``param_dtype``."""
    return cast_floating(tree, self.param_dtype)

  def cast_to_compute(self, tree: Any) -> Any:
    """Casts floating leaves of ``tree`` to ``compute_dtype``."""
    return cast_floating(tree, self.compute_dtype)

  def cast_to_output(self, tree: Any) -> Any:
    """Casts floating leaves of ``tree`` to ``output_dtype``."""
    return cast_floating(tree, self.output_dtype)

  def with_output_dtype(self, dtype: Any) -> "Policy":
    """Returns a copy of this policy with another output dtype."""
    return dataclasses.replace(self, output_dtype=dtype)

  @property
  def product_format(self) -> Fp8Recipe | Int8Recipe | None:
    """The recipe of the narrow format weight products run in (``fp8`` or ``int8``), or ``None``."""
    return self.fp8 if self.fp8 is not None else self.int8

  @property
  def is_mixed(self) -> bool:
    """Whether computation runs in a narrower dtype than the parameters."""
    return self.compute_dtype.itemsize < self.param_dtype.itemsize

  def __str__(self) -> str:
    text = f"params={self.param_dtype.name},compute={self.compute_dtype.name},output={self.output_dtype.name}"
    return text + _fp8_spec(self.product_format)


def _fp8_spec(recipe: Fp8Recipe | Int8Recipe | None) -> str:
  """The spec keys of an FP8 or INT8 recipe (its non-default fields only)."""
  if recipe is None:
    return ""
  if isinstance(recipe, Int8Recipe):
    default_int8 = Int8Recipe()
    keys = [
      f"{k}={getattr(recipe, f)}" for k, f in _INT8_KEYS.items() if getattr(recipe, f) != getattr(default_int8, f)
    ]
    return ",".join([",matmul=int8", *keys])
  default = Fp8Recipe()
  text = f",matmul=fp8_{recipe.scaling}"
  if recipe.amax_history_len != default.amax_history_len:
    text += f",fp8_history={recipe.amax_history_len}"
  if recipe.margin != default.margin:
    text += f",fp8_margin={recipe.margin}"
  if recipe.amax_compute_algo != default.amax_compute_algo:
    text += f",fp8_amax={recipe.amax_compute_algo}"
  return text


def _parse_fp8(spec: str, fp8_parts: dict[str, str]) -> Fp8Recipe | Int8Recipe | None:
  """The recipe named by a spec's ``matmul=``/``fp8_*=``/``int8_*=`` parts."""
  if not fp8_parts:
    return None
  matmul = fp8_parts.get("matmul")
  if matmul is None:
    raise ValueError(
      f"Policy spec {spec!r} sets {', '.join(sorted(fp8_parts))} without "
      f"matmul=; add matmul= one of {', '.join(sorted(_MATMUL_VALUES))}."
    )
  if matmul not in _MATMUL_VALUES:
    raise ValueError(f"In policy spec {spec!r}, matmul={matmul!r}; accepted: {', '.join(sorted(_MATMUL_VALUES))}.")
  int8_parts = {k: v for k, v in fp8_parts.items() if k in _INT8_KEYS}
  fp8_only = sorted(k for k in fp8_parts if k.startswith("fp8_"))
  if matmul == "int8":
    if fp8_only:
      raise ValueError(f"In policy spec {spec!r}, {', '.join(fp8_only)} set FP8 scaling, but matmul=int8.")
    try:
      return Int8Recipe(**{_INT8_KEYS[k]: v for k, v in int8_parts.items()})
    except ValueError as e:
      raise ValueError(f"In policy spec {spec!r}: {e}") from None
  if int8_parts:
    raise ValueError(
      f"In policy spec {spec!r}, {', '.join(sorted(int8_parts))} need matmul=int8, got matmul={matmul!r}."
    )
  kwargs: dict[str, Any] = {"scaling": _MATMUL_VALUES[matmul]}
  for key, field in (("fp8_history", "amax_history_len"), ("fp8_margin", "margin")):
    if key in fp8_parts:
      try:
        kwargs[field] = int(fp8_parts[key])
      except ValueError:
        raise ValueError(f"In policy spec {spec!r}, {key} must be an integer, got {fp8_parts[key]!r}.") from None
  if "fp8_amax" in fp8_parts:
    kwargs["amax_compute_algo"] = fp8_parts["fp8_amax"]
  try:
    return Fp8Recipe(**kwargs)
  except ValueError as e:
    raise ValueError(f"In policy spec {spec!r}: {e}") from None


def get_policy(spec: str | Policy) -> Policy:
  """Parses a policy from a string.

  Accepted forms:

  * ``"params=float32,compute=float16,output=float32"``, with short keys
    and names too: ``"p=f32,c=bf16,o=f32"``; ``half`` is the backend's half
    type (:func:`half_dtype`), ``full`` is float32;
  * one dtype for all three: ``"bfloat16"``;
  * presets: ``"mixed_float16"``, ``"mixed_bfloat16"``, ``"mixed_half"``,
    ``"float32"``, ``"mixed_float8"`` (float32 parameters, FP8 matmuls
    and convolutions with delayed scaling, bfloat16 elsewhere, float32
    output) and ``"mixed_int8"`` (the same with int8 weight products under
    :func:`~jmp_train.autocast`: per-row and per-channel scales, int32
    accumulation, bfloat16 gradient products);
  * FP8 matmuls in any spec: ``matmul=fp8`` (or ``fp8_delayed``) or
    ``matmul=fp8_current``, with optional ``fp8_history=N``,
    ``fp8_margin=M`` and ``fp8_amax=max|most_recent`` (the fields of
    :class:`~jmp_train.Fp8Recipe`), e.g.
    ``"p=f32,c=bf16,o=f32,matmul=fp8_current"``;
  * INT8 matmuls: ``matmul=int8``, with optional
    ``int8_activation=per_row|per_tensor``,
    ``int8_weight=per_channel|per_tensor`` and ``int8_backward=float|int8``
    (the fields of :class:`~jmp_train.int8.Int8Recipe`).

  Args:
    spec: the string, or a :class:`Policy` (returned as is).

  Returns:
    The :class:`Policy`; ``get_policy(str(p)) == p`` for every policy ``p``.

  Raises:
    ValueError: naming the bad part (unknown key or dtype, non-floating dtype,
      a key given twice, a missing key) and the accepted values.

  Examples:
    >>> get_policy("p=f32,c=bf16,o=f32") == get_policy("mixed_bfloat16")
    True
    >>> str(get_policy("mixed_float8"))
    'params=float32,compute=bfloat16,output=float32,matmul=fp8_delayed'
  """
  if isinstance(spec, Policy):
    return spec
  if not isinstance(spec, str):
    raise ValueError(f"A policy spec must be a string or a Policy, got {spec!r}.")
  text = spec.strip().lower()
  if not text:
    raise ValueError(
      "Empty policy spec; give e.g. 'params=float32,compute=float16,"
      f"output=float32' or a preset: {', '.join(sorted(_PRESETS) + sorted(_FP8_PRESETS))}."
    )
  if text in _PRESETS:
    return Policy(*_PRESETS[text])
  if text in _FP8_PRESETS:
    recipe = _FP8_PRESETS[text]
    if isinstance(recipe, Int8Recipe):
      return Policy("float32", "bfloat16", "float32", int8=recipe)
    return Policy("float32", "bfloat16", "float32", fp8=recipe)
  if "=" not in text:
    try:
      dtype = parse_dtype(text)
    except ValueError as e:
      raise ValueError(
        f"Unknown policy spec {spec!r}: {e} Accepted forms: a preset "
        f"({', '.join(sorted(_PRESETS) + sorted(_FP8_PRESETS))}), one dtype for all three, or "
        "'params=...,compute=...,output=...'."
      ) from None
    return Policy(dtype, dtype, dtype)
  values: dict[str, np.dtype] = {}
  fp8_parts: dict[str, str] = {}
  for part in text.split(","):
    if "=" not in part:
      raise ValueError(
        f"Bad part {part.strip()!r} in policy spec {spec!r}: expected "
        f"key=dtype with a key in {', '.join(_ACCEPTED_KEYS)}."
      )
    key, _, value = (s.strip() for s in part.partition("="))
    if key in _FP8_KEYS:
      if key in fp8_parts:
        raise ValueError(f"Key {key!r} given twice in policy spec {spec!r}.")
      fp8_parts[key] = value
      continue
    if key not in _KEY_ALIASES:
      raise ValueError(f"Unknown key {key!r} in policy spec {spec!r}; accepted keys: {', '.join(_ACCEPTED_KEYS)}.")
    canonical = _KEY_ALIASES[key]
    if canonical in values:
      raise ValueError(f"Key {key!r} ({canonical}) given twice in policy spec {spec!r}.")
    try:
      values[canonical] = parse_dtype(value)
    except ValueError as e:
      raise ValueError(f"In policy spec {spec!r}, key {key!r}: {e}") from None
  missing = [k for k in ("param", "compute", "output") if k not in values]
  if missing:
    raise ValueError(
      f"Policy spec {spec!r} is missing {', '.join(missing)}; it needs params=, compute= and output= (or p=, c=, o=)."
    )
  recipe = _parse_fp8(spec, fp8_parts)
  if isinstance(recipe, Int8Recipe):
    return Policy(values["param"], values["compute"], values["output"], int8=recipe)
  return Policy(values["param"], values["compute"], values["output"], fp8=recipe)
