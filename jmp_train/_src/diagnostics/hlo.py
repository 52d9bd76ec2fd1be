"""What crosses devices: collectives and their bytes, read from compiled HLO.

A compressed gradient exchange only saves bandwidth if the arrays that the
collectives move are the packed ones. XLA is free to move converts across
collectives (a ``u8`` all-to-all fed by a ``convert`` of a ``pred`` is fine; a
``pred`` or ``f32`` all-to-all of gradient size is not), so the only reliable
check is the compiled program: ``jax.jit(f).lower(*args).compile().as_text()``.

This module parses that text. It resolves every collective's operands to the
instructions that define them (compiled HLO prints operands by name only) and
reports their dtypes, shapes and bytes. The program is the one each device
runs (SPMD), so every figure is per device.

Two byte counts are given:

* ``operand_bytes``: the bytes a device hands to the collective;
* ``wire_bytes``: the bytes a device sends with the usual bandwidth-optimal
  algorithms over a group of ``k`` devices: ``2 (k-1)/k · n`` for an
  all-reduce of ``n`` bytes (ring: reduce-scatter then all-gather),
  ``(k-1)/k · n`` for an all-to-all of ``n`` bytes, ``(k-1) · n`` for an
  all-gather whose operand is ``n`` bytes, ``(k-1)/k · n`` for a
  reduce-scatter of an ``n``-byte operand, ``n`` for a collective-permute.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

__all__ = ["CollectiveOp", "collective_ops", "collective_bytes", "COLLECTIVE_KINDS"]

COLLECTIVE_KINDS = (
  "all-reduce",
  "all-gather",
  "all-to-all",
  "reduce-scatter",
  "collective-permute",
  "collective-broadcast",
)

_DTYPE_BYTES = {
  "pred": 1,
  "s8": 1,
  "u8": 1,
  "s4": 0.5,
  "u4": 0.5,
  "s2": 0.25,
  "u2": 0.25,
  "s16": 2,
  "u16": 2,
  "f16": 2,
  "bf16": 2,
  "s32": 4,
  "u32": 4,
  "f32": 4,
  "s64": 8,
  "u64": 8,
  "f64": 8,
  "c64": 8,
  "c128": 16,
  "f8e4m3fn": 1,
  "f8e5m2": 1,
  "f8e4m3": 1,
  "f8e5m2fnuz": 1,
  "f8e4m3fnuz": 1,
  "f8e4m3b11fnuz": 1,
  "f8e3m4": 1,
  "f8e8m0fnu": 1,
  "f4e2m1fn": 0.5,
  "token": 0,
}

_ARRAY_RE = re.compile(r"\b([a-z][a-z0-9]*)\[([0-9,]*)\]")
_COMMENT_RE = re.compile(r"/\*.*?\*/")
_OP_NAME_RE = re.compile(r'op_name="([^"]*)"')
_INSTR_RE = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_COMP_RE = re.compile(r"^\s*(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_GROUPS_RE = re.compile(r"replica_groups=\{(\{[0-9,]*\}(?:,\{[0-9,]*\})*)\}")
_IOTA_GROUPS_RE = re.compile(r"replica_groups=\[(\d+),(\d+)\]")
# Newer XLA names the mesh and the axes a collective spans:
# replica_groups=mesh['data'=4,'model'=2] {'data'}; a sub-axis reads 'data':(1)2.
_MESH_GROUPS_RE = re.compile(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}")
_MESH_AXIS_RE = re.compile(r"'([^']+)'\s*=\s*(\d+)")
_GROUP_AXIS_RE = re.compile(r"'([^']+)'(?::\((\d+)\)(\d+))?")


@dataclasses.dataclass(frozen=True)
class CollectiveOp:
  """One collective instruction of a compiled HLO module.

  Attributes:
    kind: the collective, one of ``COLLECTIVE_KINDS`` (``"all-reduce"``,
      ``"all-to-all"``, ...; async ``-start`` forms are reported under
      their base kind).
    name: the instruction's name.
    computation: the name of the computation it belongs to (a collective
      inside a ``conditional`` branch lives in that branch's computation).
    operand_types: ``(dtype, shape)`` of each operand.
    operand_bytes: bytes of all operands together.
    group_size: devices per replica group (1 when not given).
    wire_bytes: bytes one device sends with bandwidth-optimal algorithms
      (see :func:`collective_bytes`' ``wire``).
    scope: where JAX traced it (the instruction's ``op_name``, e.g.
      ``"jit(step)/shard_map/cond/branch_1_fun/one_bit_adam/warmup/psum"``:
      the functions, ``jax.named_scope`` s and ``cond`` branches around
      it), or ``""`` where the program does not say.
  """

  kind: str
  name: str
  computation: str
  operand_types: tuple[tuple[str, tuple[int, ...]], ...]
  operand_bytes: int
  group_size: int
  wire_bytes: float
  scope: str = ""

  @property
  def dtypes(self) -> tuple[str, ...]:
    """The distinct operand dtypes, e.g. ``("u8",)``."""
    return tuple(sorted({d for d, _ in self.operand_types}))


def _hlo_text(compiled_or_text: Any) -> str:
  if isinstance(compiled_or_text, str):
    return compiled_or_text
  as_text = getattr(compiled_or_text, "as_text", None)
  if as_text is None:
    raise ValueError(
      "collective_bytes needs HLO text or an object with .as_text() (a "
      "jax.stages.Compiled from jax.jit(f).lower(...).compile()), got "
      f"{type(compiled_or_text).__name__}."
    )
  text = as_text()
  if not isinstance(text, str):
    raise ValueError(f"{type(compiled_or_text).__name__}.as_text() returned no text.")
  return text


def _split_type(rest: str) -> tuple[str, str]:
  """Splits ``'TYPE opcode(...)...'`` into the type and what follows it."""
  rest = rest.lstrip()
  if rest.startswith("("):
    depth = 0
    for i, c in enumerate(rest):
      depth += c == "("
      depth -= c == ")"
      if depth == 0:
        return rest[: i + 1], rest[i + 1 :].lstrip()
    return rest, ""
  head, _, tail = rest.partition(" ")
  return head, tail


def _array_types(type_text: str) -> list[tuple[str, tuple[int, ...]]]:
  out = []
  for dtype, dims in _ARRAY_RE.findall(type_text):
    if dtype not in _DTYPE_BYTES:
      continue
    shape = tuple(int(d) for d in dims.split(",") if d)
    out.append((dtype, shape))
  return out


def _nbytes(types: list[tuple[str, tuple[int, ...]]]) -> int:
  total = 0.0
  for dtype, shape in types:
    n = 1
    for d in shape:
      n *= d
    total += n * _DTYPE_BYTES[dtype]
  return int(total)


def _operand_names(args: str) -> list[str]:
  depth, cur, names = 0, [], []
  for c in args:
    if c in "([{":
      depth += 1
    elif c in ")]}":
      if depth == 0:
        break
      depth -= 1
    if c == "," and depth == 0:
      names.append("".join(cur))
      cur = []
    else:
      cur.append(c)
  names.append("".join(cur))
  return [n.strip() for n in names if n.strip()]


def _unreadable(line: str) -> ValueError:
  # A spelling this parser does not know: a silent group of 1 would count no bytes.
  return ValueError(f"collective_bytes cannot read the replica groups of: {line.strip()}")


def _mesh_group_size(mesh_text: str, axes_text: str, line: str) -> int:
  sizes = {name: int(n) for name, n in _MESH_AXIS_RE.findall(mesh_text)}
  k = 1
  for name, _, sub_size in _GROUP_AXIS_RE.findall(axes_text):
    if name not in sizes:
      raise _unreadable(line)
    k *= int(sub_size) if sub_size else sizes[name]
  return k


def _group_size(line: str) -> int:
  m = _IOTA_GROUPS_RE.search(line)
  if m:
    return int(m.group(2))
  m = _GROUPS_RE.search(line)
  if m:
    first = m.group(1).split("}")[0].strip("{")
    return max(1, len([x for x in first.split(",") if x]))
  m = _MESH_GROUPS_RE.search(line)
  if m:
    return _mesh_group_size(m.group(1), m.group(2), line)
  if re.search(r"replica_groups=(?!\{\})", line):
    raise _unreadable(line)
  m = re.search(r"source_target_pairs=\{", line)
  return 2 if m else 1


def _wire_bytes(kind: str, operand_bytes: int, k: int) -> float:
  if k <= 1:
    return 0.0
  if kind == "all-reduce":
    return 2.0 * (k - 1) / k * operand_bytes
  if kind in ("all-to-all", "reduce-scatter"):
    return (k - 1) / k * operand_bytes
  if kind == "all-gather":
    return float((k - 1) * operand_bytes)
  return float(operand_bytes)


def collective_ops(compiled_or_hlo_text: Any) -> list[CollectiveOp]:
  """Lists the collectives of a compiled HLO module with their operand types.

  Args:
    compiled_or_hlo_text: a ``jax.stages.Compiled`` (anything with
      ``.as_text()``) or the HLO text itself.

  Returns:
    One ``CollectiveOp`` per collective instruction, in program order.

  Raises:
    ValueError: if the argument is neither text nor has ``.as_text()``, or
      a collective's ``replica_groups`` are in a spelling it cannot read
      (lists of ids, ``[g,k]<=[n]`` and ``mesh[...] {axes}`` are read).
  """
  text = _hlo_text(compiled_or_hlo_text)
  types: dict[str, list[tuple[str, tuple[int, ...]]]] = {}
  pending = []
  computation = ""
  for line in text.splitlines():
    line = _COMMENT_RE.sub("", line)
    m = _INSTR_RE.match(line)
    if not m:
      c = _COMP_RE.match(line)
      if c and "=" not in line.split("{")[0]:
        computation = c.group(1)
      continue
    name, rest = m.group(1), m.group(2)
    type_text, tail = _split_type(rest)
    types[name] = _array_types(type_text)
    opcode, _, args = tail.partition("(")
    opcode = opcode.strip()
    base = opcode[: -len("-start")] if opcode.endswith("-start") else opcode
    if base in COLLECTIVE_KINDS:
      pending.append((base, name, computation, args, line))
  ops = []
  for kind, name, computation, args, line in pending:
    operand_types: list[tuple[str, tuple[int, ...]]] = []
    for operand in _operand_names(args):
      inline = _array_types(operand)  # older HLO prints operand types inline
      ref = operand.split()[-1].lstrip("%")
      operand_types.extend(inline or types.get(ref, []))
    nbytes = _nbytes(operand_types)
    k = _group_size(line)
    ops.append(
      CollectiveOp(
        kind=kind,
        name=name,
        computation=computation,
        operand_types=tuple(operand_types),
        operand_bytes=nbytes,
        group_size=k,
        wire_bytes=_wire_bytes(kind, nbytes, k),
        scope=scope.group(1) if (scope := _OP_NAME_RE.search(line)) else "",
      )
    )
  return ops


def collective_bytes(compiled_or_hlo_text: Any, *, wire: bool = False) -> dict[str, int]:
  """Bytes per collective kind in a compiled HLO module, per device.

  Examples:
    >>> import jax, jax.numpy as jnp
    >>> f = jax.pmap(lambda x: jax.lax.psum(x, "i"), axis_name="i")
    >>> x = jnp.zeros((jax.local_device_count(), 256), jnp.float32)
    >>> collective_bytes(f.lower(x).compile())["all-reduce"]  # doctest: +SKIP
    1024

  Args:
    compiled_or_hlo_text: a ``jax.stages.Compiled`` (from
      ``jax.jit(f).lower(...).compile()``) or its ``as_text()``.
    wire: count the bytes each device sends with bandwidth-optimal
      algorithms over a group of ``k`` devices instead of the operand
      bytes: ``2(k-1)/k·n`` for an all-reduce of ``n`` bytes (ring:
      reduce-scatter then all-gather), ``(k-1)/k·n`` for an all-to-all or a
      reduce-scatter, ``(k-1)·n`` for an all-gather of an ``n``-byte
      operand, ``n`` for a collective-permute.

  Returns:
    ``{kind: bytes}`` for every kind (``"all-reduce"``, ``"all-gather"``,
    ``"all-to-all"``, ``"reduce-scatter"``, ``"collective-permute"``,
    ``"collective-broadcast"``; 0 when absent), ``"total"`` over all
    kinds, and ``"<kind>:<dtype>"`` entries splitting each kind by operand
    dtype (e.g. ``"all-to-all:u8"``). Wire bytes are rounded to the nearest
    integer.

  Raises:
    ValueError: if the argument is neither text nor has ``.as_text()``, or
      a collective's ``replica_groups`` are in a spelling it cannot read
      (lists of ids, ``[g,k]<=[n]`` and ``mesh[...] {axes}`` are read).
  """
  out: dict[str, float] = {kind: 0 for kind in COLLECTIVE_KINDS}
  for op in collective_ops(compiled_or_hlo_text):
    share = op.wire_bytes if wire else op.operand_bytes
    out[op.kind] += share
    per_dtype = _nbytes(list(op.operand_types)) or 1
    for dtype in op.dtypes:
      part = _nbytes([t for t in op.operand_types if t[0] == dtype])
      key = f"{op.kind}:{dtype}"
      out[key] = out.get(key, 0) + share * part / per_dtype
  out["total"] = sum(out[k] for k in COLLECTIVE_KINDS)
  return {k: int(round(v)) for k, v in out.items()}


def conditional_branches(compiled_or_hlo_text: Any) -> set[str]:
  """Names of the computations that are branches of a conditional in the module.

  A collective whose ``computation`` (see :func:`collective_ops`) is among them runs
  only on the steps that take its branch (a warm-up, a refresh); one in the
  entry computation runs on every step.

  Args:
    compiled_or_hlo_text: a ``jax.stages.Compiled`` or its ``as_text()``.

  Returns:
    The branch computations' names, without the ``%`` prefix.

  Examples:
    >>> import jax
    >>> import jax.numpy as jnp
    >>> f = lambda x: jax.lax.cond(x.sum() > 0, lambda: x + 1, lambda: x * x)
    >>> branches = conditional_branches(jax.jit(f).lower(jnp.ones(3)).compile())
    >>> len(branches)
    2
  """
  text = _hlo_text(compiled_or_hlo_text)
  groups = re.findall(r"branch_computations=\{([^}]*)\}", text)
  groups += [
    ",".join(pair) for pair in re.findall(r"true_computation=%?([\w.\-]+), false_computation=%?([\w.\-]+)", text)
  ]
  return {name.strip().lstrip("%") for group in groups for name in group.split(",")}
