"""Which matmuls and convolutions of a compiled program take FP8 operands.

A product written as "dequantize the FP8 operands, then a high-precision
dot" is an FP8 GEMM only if the compiler recognises the pattern; when it
does not, the product runs in high precision without a word. A product
whose operands are FP8 arrays states it outright. :func:`fp8_products` reads
a lowered step (StableHLO) or a compiled one (HLO) and lists every
``dot_general`` and convolution with its operand and result dtypes, and
those whose operands are not both FP8: ``assert not report.not_fp8`` in a
test keeps a model's products FP8.

The lowered program is what the step asks for, on any backend. The
compiled one is what runs: XLA:CPU converts FP8 operands to float32 before
its dot, and XLA:GPU turns an FP8 dot into a cuBLASLt custom call
(``__cublas$lt$matmul$f8``), which the report lists too.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jmp_train._src import tables
from jmp_train._src.diagnostics import jaxprs

__all__ = ["Fp8ProductReport", "ProductEntry", "fp8_products"]

# StableHLO: `%3 = stablehlo.dot_general %1, %2, ... : (tensor<..>, tensor<..>) -> tensor<..>`
_MLIR_OP = re.compile(r'(?:^|\s|")stablehlo\.(dot_general|dot|convolution)\b')
_MLIR_SIGNATURE = re.compile(r":\s*\((tensor<[^()]*?>),\s*(tensor<[^()]*?>)\)\s*->\s*(tensor<[^()]*?>)")
_MLIR_TENSOR = re.compile(r"tensor<((?:[0-9?]+x)*)([A-Za-z][A-Za-z0-9]*)")
_MLIR_LOC_USE = re.compile(r"loc\((#loc\d*)\)\s*$")
_MLIR_LOC_NAME = re.compile(r'^(#loc\d*) = loc\("([^"]*)"')
# HLO: `%dot.1 = f32[4,8]{1,0} dot(%a, %b), ...` (operand types may be inline).
_HLO_INSTR = re.compile(
  r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*"
  r"(\((?:[^()]|\([^()]*\))*\)|[a-z][a-z0-9]*\[[0-9,]*\]\S*)\s+"  # a shape or a tuple
  r"([\w\-]+)\((.*)$"
)
_HLO_SHAPE = re.compile(r"([a-z][a-z0-9]*)\[([0-9,]*)\]")
_HLO_OPERAND = re.compile(r"%([\w.\-]+)")
_HLO_TARGET = re.compile(r'custom_call_target="([^"]*)"')
_HLO_OP_NAME = re.compile(r'op_name="([^"]*)"')
_GEMM_TARGETS = re.compile(r"gemm|matmul|conv", re.IGNORECASE)


class ProductEntry(NamedTuple):
  """One matmul or convolution of a program, read by :func:`fp8_products`.

  Attributes:
    op: ``"dot_general"``, ``"dot"``, ``"convolution"``, or an HLO custom
      call's target (e.g. ``"__cublas$lt$matmul$f8"``).
    lhs_dtype: dtype of the left operand (a string if NumPy has no name
      for it).
    rhs_dtype: dtype of the right operand.
    out_dtype: dtype of the result.
    lhs_shape: shape of the left operand.
    rhs_shape: shape of the right operand.
    out_shape: shape of the result.
    name: the op's name in the program (its JAX name stack, e.g.
      ``"jit(step)/transpose(jvp(fp8_product))/dot_general"``), or ``""``.
  """

  op: str
  lhs_dtype: Any
  rhs_dtype: Any
  out_dtype: Any
  lhs_shape: tuple[int, ...]
  rhs_shape: tuple[int, ...]
  out_shape: tuple[int, ...]
  name: str = ""

  @property
  def fp8(self) -> bool:
    """Whether both operands are 8-bit floats."""
    return _is_fp8(self.lhs_dtype) and _is_fp8(self.rhs_dtype)


def _is_fp8(dtype: Any) -> bool:
  return str(getattr(dtype, "name", dtype)).startswith("float8_")


def _dtype(name: str) -> Any:
  """A StableHLO or HLO element type (``f8E4M3FN``, ``bf16``, ``s8``) as a dtype."""
  n = name.lower()
  if n.startswith("f8"):
    n = "float8_" + n[2:]
  elif n == "bf16":
    n = "bfloat16"
  elif n in ("pred", "i1"):
    n = "bool"
  else:
    match = re.fullmatch(r"(f|s|i|u|ui)(\d+)", n)
    if match:
      kind = {"f": "float", "s": "int", "i": "int", "u": "uint", "ui": "uint"}[match.group(1)]
      n = kind + match.group(2)
  try:
    return np.dtype(jnp.dtype(n))
  except TypeError:
    return name


def _mlir_tensor(text: str) -> tuple[Any, tuple[int, ...]]:
  match = _MLIR_TENSOR.search(text)
  dims = tuple(int(d) if d != "?" else -1 for d in match.group(1).split("x") if d)
  return _dtype(match.group(2)), dims


def _from_mlir(text: str) -> list[ProductEntry]:
  names = {}
  for line in text.splitlines():
    match = _MLIR_LOC_NAME.match(line)
    if match:
      names[match.group(1)] = match.group(2)
  out = []
  for line in text.splitlines():
    op = _MLIR_OP.search(line)
    sig = _MLIR_SIGNATURE.search(line) if op else None
    if sig is None:
      continue
    (l_dt, l_shape), (r_dt, r_shape), (o_dt, o_shape) = map(_mlir_tensor, sig.groups())
    loc = _MLIR_LOC_USE.search(line)
    out.append(
      ProductEntry(op.group(1), l_dt, r_dt, o_dt, l_shape, r_shape, o_shape, names.get(loc.group(1), "") if loc else "")
    )
  return out


def _hlo_shape(text: str) -> tuple[Any, tuple[int, ...]]:
  match = _HLO_SHAPE.search(text)
  return _dtype(match.group(1)), tuple(int(d) for d in match.group(2).split(",") if d)


def _from_hlo(text: str) -> list[ProductEntry]:
  instrs = []
  shapes = {}
  for line in text.splitlines():
    match = _HLO_INSTR.match(line)
    if match:
      name, shape, opcode, rest = match.groups()
      shapes[name] = shape
      instrs.append((opcode, shape, rest))
  out = []
  for opcode, shape, rest in instrs:
    op = opcode
    if opcode == "custom-call":
      target = _HLO_TARGET.search(rest)
      if not target or not _GEMM_TARGETS.search(target.group(1)):
        continue
      op = target.group(1)
    elif opcode not in ("dot", "convolution"):
      continue
    operands = [o for o in _HLO_OPERAND.findall(rest.split(")", 1)[0]) if o in shapes][:2]
    if len(operands) < 2:
      continue
    (l_dt, l_shape), (r_dt, r_shape) = (_hlo_shape(shapes[o]) for o in operands)
    o_dt, o_shape = _hlo_shape(shape)
    name = _HLO_OP_NAME.search(rest)
    out.append(ProductEntry(op, l_dt, r_dt, o_dt, l_shape, r_shape, o_shape, name.group(1) if name else ""))
  return out


def _dtype_name(dtype: Any) -> str:
  return str(getattr(dtype, "name", dtype))


@dataclasses.dataclass(frozen=True)
class Fp8ProductReport:
  """The matmuls and convolutions of a program, with their dtypes.

  ``str(report)`` is a table, one row per product, and a summary.

  Attributes:
    products: the :class:`ProductEntry` rows, in program order.
    dialect: ``"stablehlo"`` (a lowered program) or ``"hlo"`` (a compiled
      one).
  """

  products: tuple[ProductEntry, ...]
  dialect: str

  @property
  def fp8(self) -> tuple[ProductEntry, ...]:
    """Products whose operands are both FP8."""
    return tuple(p for p in self.products if p.fp8)

  @property
  def not_fp8(self) -> tuple[ProductEntry, ...]:
    """Products with an operand that is not FP8."""
    return tuple(p for p in self.products if not p.fp8)

  def to_rows(self) -> list[dict[str, Any]]:
    """One dict per product, for tables and dataframes."""
    return [
      {
        "op": p.op,
        "dtypes": f"{_dtype_name(p.lhs_dtype)} x {_dtype_name(p.rhs_dtype)} -> {_dtype_name(p.out_dtype)}",
        "shapes": f"{list(p.lhs_shape)} x {list(p.rhs_shape)} -> {list(p.out_shape)}",
        "fp8": "yes" if p.fp8 else "no",
        "name": p.name,
      }
      for p in self.products
    ]

  def summary(self) -> str:
    return (
      f"{len(self.products)} matmul/conv ops ({self.dialect}): "
      f"{len(self.fp8)} with FP8 operands, {len(self.not_fp8)} without"
    )

  def __str__(self) -> str:
    return tables.format_table(self.to_rows()) + "\n" + self.summary()


def fp8_products(program: Any, *args: Any) -> Fp8ProductReport:
  """Lists a program's matmuls and convolutions, and those not on FP8 operands.

  Reads the text of the program: nothing runs. Every ``dot_general``,
  ``dot`` and convolution is listed (in every function, loop body and
  ``shard_map`` region of the module) with its operand and result dtypes and
  shapes; in compiled HLO, also the custom calls to cuBLAS and cuDNN GEMMs
  and convolutions.

  Args:
    program: a lowered step (``jax.stages.Lowered``, from
      ``jax.jit(f).lower(*args)`` or ``step.lower(state, batch)`` of
      :func:`jmp_train.make_train_step`; read as StableHLO), a compiled one
      (``jax.stages.Compiled``; read as HLO), the text of either, or a
      :class:`jmp_train.TrainStep` followed by its state and batch (lowered
      for them).
    *args: with a train step, its state and batch.

  Returns:
    An :class:`Fp8ProductReport`: ``report.not_fp8`` lists the products with
    an operand that is not FP8; ``print(report)`` shows the table.

  Raises:
    TypeError: if ``program`` is none of these.
    ValueError: if the text is neither StableHLO nor HLO.

  Examples:
    >>> import jmp_train
    >>> recipe = jmp_train.Fp8Recipe(scaling="current")
    >>> meta = jmp_train.init_fp8_meta(recipe)
    >>> def loss(x, w):
    ...   y = jmp_train.fp8_dot_general(x, w, (((1,), (0,)), ((), ())),
    ...                                 meta=meta, recipe=recipe)
    ...   return (y * y).sum()
    >>> x, w = jnp.ones((8, 16)), jnp.ones((16, 4))
    >>> report = fp8_products(jax.jit(jax.grad(loss, argnums=(0, 1))).lower(x, w))
    >>> [f"{p.lhs_dtype.name} x {p.rhs_dtype.name}" for p in report.products]
    ['float8_e4m3fn x float8_e4m3fn', 'float8_e5m2 x float8_e4m3fn', 'float8_e5m2 x float8_e4m3fn']
    >>> report.not_fp8
    ()
    >>> plain = fp8_products(jax.jit(jnp.dot).lower(x, w))
    >>> [p.lhs_dtype.name for p in plain.not_fp8]
    ['float32']
  """
  if jaxprs.train_step_program(program) is not None:
    if len(args) != 2:
      raise TypeError(
        f"fp8_products(step, state, batch) reads a train step's program as lowered for its "
        f"state and batch; got {len(args)} argument(s) after the step."
      )
    program = program.lower(*args)
  elif args:
    raise TypeError(
      f"fp8_products takes arguments only after a jmp_train.TrainStep (its state and batch); "
      f"got {len(args)} after a {type(program).__name__}."
    )
  if isinstance(program, jax.stages.Lowered):
    text = program.as_text(debug_info=True)
  elif isinstance(program, jax.stages.Compiled):
    text = program.as_text()
  elif isinstance(program, str):
    text = program
  else:
    raise TypeError(
      "fp8_products needs a jax.stages.Lowered (jax.jit(f).lower(*args)), a "
      f"jax.stages.Compiled or the text of either; got {type(program).__name__}."
    )
  if "HloModule" in text:
    return Fp8ProductReport(tuple(_from_hlo(text)), "hlo")
  if "stablehlo." in text or "func.func" in text:
    return Fp8ProductReport(tuple(_from_mlir(text)), "stablehlo")
  raise ValueError(
    "fp8_products could not read the program: its text is neither StableHLO "
    "(jax.jit(f).lower(*args).as_text()) nor HLO (an HloModule)."
  )
