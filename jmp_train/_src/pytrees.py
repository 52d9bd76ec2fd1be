"""One way to make pytrees: frozen dataclasses, registered with JAX and Flax."""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.serialization
import jax
import jax.numpy as jnp

__all__ = ["fresh_arrays", "register_pytree_dataclass"]


def fresh_arrays(tree: Any) -> Any:
  """Copies of the JAX arrays of ``tree``, in buffers of their own.

  optax's contract is that ``init`` returns buffers it made: a train step
  jitted with ``donate_argnums`` on the optimizer state frees them, and must
  not free an array a caller still holds. An ``init`` that puts into its
  state an array captured when the transformation was built (a loss scale's
  ``loss_scale``, a PRNG key) returns it through this function. Traced
  (an ``init`` under ``jit`` or ``shard_map``), the copy costs nothing: the
  compiled program's outputs are new buffers anyway. Leaves that are not JAX
  arrays (NumPy arrays, Python scalars) are kept: ``jit`` copies them to the
  device.

  Args:
    tree: a pytree.

  Returns:
    ``tree`` with every ``jax.Array`` leaf replaced by a copy (same dtype,
    shape and sharding, new buffer); its treedef (static fields included)
    unchanged.

  Examples:
    >>> scale = jnp.float32(2.0 ** 15)
    >>> copy = fresh_arrays({"s": scale})["s"]
    >>> copy is scale, float(copy)
    (False, 32768.0)
  """
  return jax.tree.map(lambda x: jnp.array(x, copy=True) if isinstance(x, jax.Array) else x, tree)


def register_pytree_dataclass(cls: type) -> type:
  """Registers a frozen dataclass as a pytree and for Flax serialization.

  ``jax.tree_util.register_dataclass`` takes the leaves and the static
  metadata from the fields (``static`` metadata marks the latter), so no
  field can be forgotten; it rebuilds a value by calling the class with every
  field as a keyword, which a class must take as is, without
  validation: JAX and orbax rebuild pytrees with placeholder leaves
  (tracers, ``ShapeDtypeStruct``, ``None``) that must not be converted.
  ``flax.serialization`` then saves the leaves by field name (``to_bytes``,
  ``to_state_dict``), as for Flax's own ``DynamicScale``.

  The one way the library makes pytrees of its own classes (the loss scales,
  :class:`jmp_train.TrainState`). A class needs a ``replace(**changes)``
  method.

  Examples:
    >>> @register_pytree_dataclass
    ... @dataclasses.dataclass(frozen=True)
    ... class Pair:
    ...   a: Any
    ...   b: Any
    ...   def replace(self, **changes):
    ...     return dataclasses.replace(self, **changes)
    >>> jax.tree.leaves(Pair(1, 2)), flax.serialization.to_state_dict(Pair(1, 2))
    ([1, 2], {'a': 1, 'b': 2})
  """
  jax.tree_util.register_dataclass(cls)
  names = tuple(f.name for f in dataclasses.fields(cls) if not f.metadata.get("static"))

  def to_state_dict(x: Any) -> dict[str, Any]:
    return {n: flax.serialization.to_state_dict(getattr(x, n)) for n in names}

  def from_state_dict(x: Any, state: dict[str, Any]) -> Any:
    if set(state) != set(names):
      raise ValueError(
        f"Cannot restore a {cls.__name__} with fields {sorted(names)} from "
        f"a state dict with keys {sorted(state)} at "
        f"{flax.serialization.current_path()!r}."
      )
    return x.replace(**{n: flax.serialization.from_state_dict(getattr(x, n), state[n], name=n) for n in names})

  flax.serialization.register_serialization_state(cls, to_state_dict, from_state_dict)
  return cls
