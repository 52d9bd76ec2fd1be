"""The op lists of :func:`~jmp_train.autocast`, as data.

AMP (NVIDIA apex, ``torch.autocast``) sorts ops into three lists:

* allow (half precision): matmuls and convolutions, which run on Tensor
  Cores and accumulate in float32 in hardware;
* deny (float32): ops whose results lose range or precision in 16 bits:
  ``exp``, ``log``, ``pow``, ``rsqrt``, the error function, and the
  accumulating reductions (sums, products, cumulative sums) from which
  softmax, log-softmax, losses and normalization statistics are built;
* infer: everything else follows its inputs.

A fourth list, lookups, holds the ops that read rows of a parameter table
(an embedding's ``gather``): their result is an activation, cast to the
compute dtype right after the lookup, as a Flax ``Embed`` with a half
``dtype`` returns it; the table and its gradient stay in the parameter
dtype.

Here the lists hold JAX primitive names (``eqn.primitive.name`` in a jaxpr),
so that they apply to any JAX function. An entry ``"scope:PATTERN"`` names a
region instead: a ``jax.named_scope``, or a ``jax.jit``-ed, ``custom_jvp``
or ``custom_vjp`` function by name (``"scope:log_softmax"``), matched as a
shell-style glob (``fnmatch``) against each name and against the
``/``-joined path; every floating-point op inside runs in that list's dtype.

References:
  Micikevicius et al., "Mixed Precision Training", ICLR 2018.
  https://arxiv.org/abs/1710.03740
  PyTorch, "Automatic Mixed Precision package - torch.amp", op reference.
  https://pytorch.org/docs/stable/amp.html
"""

from __future__ import annotations

import difflib
import functools
import sys
from typing import Any, Iterable

import jax  # noqa: F401  (loads jax.lax, whose primitives are listed)
from jax.extend import core as jex_core

__all__ = [
  "DEFAULT_HALF_OPS",
  "DEFAULT_FLOAT32_OPS",
  "DEFAULT_LOOKUP_OPS",
  "SCOPE_PREFIX",
  "known_primitives",
  "check_keep",
  "check_op_list",
]

# The allow list: the ops that use Tensor Cores.
DEFAULT_HALF_OPS: tuple[str, ...] = ("dot_general", "conv_general_dilated")

# The deny list. Elementwise ops with a large dynamic range or a steep
# derivative, and the accumulating reductions (torch.autocast's float32 list:
# exp, log, log1p, pow, rsqrt, erf..., sum, prod, cumsum, cumprod, softmax,
# log_softmax, norms and losses, which in a jaxpr are built from these).
DEFAULT_FLOAT32_OPS: tuple[str, ...] = (
  "exp",
  "exp2",
  "expm1",
  "log",
  "log1p",
  "logistic",
  "pow",
  "rsqrt",
  "erf",
  "erfc",
  "erf_inv",
  "lgamma",
  "digamma",
  "tan",
  "sinh",
  "cosh",
  "asin",
  "acos",
  "reduce_sum",
  "reduce_prod",
  "cumsum",
  "cumprod",
  "cumlogsumexp",
)

# The lookups: reading rows of a floating parameter table by (integer)
# indices, as ``jnp.take``, ``table[ids]`` and Flax's ``Embed`` do. The rows
# are activations: cast to the compute dtype after the lookup, so the
# table's gradient is scattered back in the parameter dtype.
DEFAULT_LOOKUP_OPS: tuple[str, ...] = ("gather",)

SCOPE_PREFIX = "scope:"


@functools.lru_cache(maxsize=1)
def _primitive_names() -> frozenset[str]:
  names = set()
  for name, module in list(sys.modules.items()):
    if module is None or not (name.startswith("jax.") or name.startswith("jaxlib.")):
      continue
    for value in list(vars(module).values()):
      if isinstance(value, jex_core.Primitive):
        names.add(value.name)
  return frozenset(names)


def known_primitives() -> frozenset[str]:
  """The names of the JAX primitives loaded in this process.

  Returns:
    A frozenset such as ``{"add", "dot_general", "exp", ...}``.

  Examples:
    >>> "dot_general" in known_primitives()
    True
  """
  return _primitive_names()


def check_op_list(ops: Any, name: str) -> tuple[str, ...]:
  """Validates an op list: primitive names and ``"scope:PATTERN"`` entries.

  Args:
    ops: an iterable of strings (a single string is one entry).
    name: the argument's name, for the error message.

  Returns:
    The entries as a tuple.

  Raises:
    TypeError: if ``ops`` is not an iterable of strings.
    ValueError: if an entry is neither a known primitive name nor
      ``"scope:PATTERN"``; the message lists close matches and the defaults.

  Examples:
    >>> check_op_list(["exp", "scope:attention"], "float32_ops")
    ('exp', 'scope:attention')
  """
  if isinstance(ops, str):
    ops = (ops,)
  try:
    entries = tuple(ops)
  except TypeError:
    raise TypeError(f"{name} must be a sequence of primitive names (e.g. {DEFAULT_HALF_OPS}), got {ops!r}.") from None
  known = known_primitives()
  for entry in entries:
    if not isinstance(entry, str):
      raise TypeError(f"{name} entries must be strings, got {entry!r}.")
    if entry.startswith(SCOPE_PREFIX):
      if not entry[len(SCOPE_PREFIX) :]:
        raise ValueError(f"Empty scope pattern {entry!r} in {name}.")
      continue
    if entry not in known:
      close = difflib.get_close_matches(entry, sorted(known), n=5)
      hint = f" Did you mean {', '.join(map(repr, close))}?" if close else ""
      raise ValueError(
        f"{entry!r} in {name} is not a JAX primitive name.{hint} Valid "
        f"entries are primitive names as they appear in a jaxpr (e.g. "
        f"{', '.join(DEFAULT_HALF_OPS)}, {', '.join(DEFAULT_FLOAT32_OPS[:6])}; "
        f"the names jax.make_jaxpr(fun)(...) prints), or "
        f"'{SCOPE_PREFIX}PATTERN' for a jax.named_scope or a jitted / custom_jvp "
        f"function name (e.g. '{SCOPE_PREFIX}{entry}')."
      )
  return entries


def split_op_list(entries: Iterable[str]) -> tuple[frozenset[str], tuple[str, ...]]:
  """``(primitive names, scope patterns)`` of a checked list."""
  prims, scopes = set(), []
  for entry in entries:
    if entry.startswith(SCOPE_PREFIX):
      scopes.append(entry[len(SCOPE_PREFIX) :])
    else:
      prims.add(entry)
  return frozenset(prims), tuple(scopes)


def check_keep(keep: Any) -> tuple[str, ...]:
  """``keep`` (products kept out of the narrow format) as a tuple of rules.

  ``None``: none; one string: one rule.

  Raises:
    TypeError: for anything but a string or a sequence of non-empty strings.
  """
  if keep is None:
    return ()
  if isinstance(keep, str):
    return (keep,)
  try:
    rules = tuple(keep)
  except TypeError:
    rules = None
  if rules is None or not all(isinstance(r, str) and r for r in rules):
    raise TypeError(
      f"keep must be a site name or glob pattern, or a sequence of them (e.g. ['head', 'stem/*']), got {keep!r}."
    )
  return rules
