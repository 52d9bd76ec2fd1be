"""Delayed FP8 scaling state for the products autocast makes, keyed by site.

Under an FP8 policy with delayed scaling (``"mixed_float8"``), each weight
product :func:`jmp_train.autocast` runs in FP8 keeps its own scaling state
(Transformer Engine's ``DelayedScaling``: the scales and amax histories of
its two operands and its output gradient), whatever layer it sits in: a
``jnp.einsum`` of the model's own attention, an ``nnx.Einsum``, a tied
output head. The state is keyed by the product's *site*, its name in the
model (the named scope and the primitive, numbered in evaluation order:
``"blocks/0/attn/dot_general"``), the names the site hook of
``autocast.scaled`` gives:

* :func:`traced` traces a function once and lists its sites;
* :func:`initial` makes each site's state (the variables of Flax's FP8
  layers: ``input_scale``, ``input_amax_history``, ...);
* within :func:`delayed`, each site found in the state is bound as an FP8
  product with that state, and the new state comes back as the state's
  gradient, as for :func:`jmp_train.fp8_dot_general`
  (:func:`jmp_train.update_fp8_meta` stores it).

Sites inside a loop or a conditional (``lax.scan``, ``while_loop``,
``cond``: a scanned stack of layers) keep current scaling: the gradient of
a state read once per iteration is the sum over the iterations, not a new
state, and a branch not taken gives a zero one.

A train step keeps the state in its model state: a linen model's under
:data:`SITES` in the ``"fp8_meta"`` collection (Flax passes variables no
module reads through unchanged), an NNX model's under :data:`SITES` of its
``nnx.State`` as :class:`jmp_train.flax.Fp8Meta` variables.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import jax

from jmp_train._src.autocast import scaled

__all__ = ["LOOPS", "SITES", "delayed", "has_state", "in_loop", "initial", "traced"]

# The key of the site states in a train step's model state.
SITES = "autocast_sites"
# The scope names autocast's handlers give the bodies of loops and branches.
LOOPS = frozenset({"scan", "while", "cond"})


def has_state(policy: Any) -> bool:
  """Whether ``policy``'s products keep scaling state (FP8 with delayed scaling)."""
  return policy is not None and policy.fp8 is not None and policy.fp8.scaling == "delayed"


def in_loop(site: scaled.Site) -> bool:
  """Whether ``site`` runs inside a loop or a conditional (no state there)."""
  return any(name in LOOPS for name in site.scope)


def traced(fn: Callable[..., Any], *args: Any) -> tuple[Any, list[str]]:
  """``(jax.eval_shape(fn, *args), sites)``: the sites of ``fn(*args)`` that take a state.

  ``fn`` is traced once (``args`` may be shapes); its products have sites
  where it runs under :func:`jmp_train.autocast`. The sites are listed in
  evaluation order, those in loops left out.
  """
  found: list[str] = []

  def record(site, vals, policy):
    del vals, policy
    if not in_loop(site):
      found.append(site.name)

  with scaled.hooked(record):
    shapes = jax.eval_shape(fn, *args)
  return shapes, found


def initial(recipe: Any, names: list[str], wrap: Callable[[Any], Any] = lambda x: x) -> dict[str, dict[str, Any]]:
  """Each site's initial state: Flax's FP8 layer variables, each passed through ``wrap``."""
  from jmp_train._src.fp8 import flax_layers

  values = flax_layers.initial_fp8_values(recipe)
  return {name: {k: wrap(v) for k, v in values.items()} for name in names}


@contextlib.contextmanager
def delayed(states: dict[str, dict[str, Any]]) -> Iterator[None]:
  """Within the block, each site in ``states`` is an FP8 product with that state.

  ``states`` maps site names to the variables of :func:`initial` (arrays);
  its gradient is the new state. Sites not in ``states`` and sites in
  loops keep autocast's current scaling.
  """
  from jmp_train._src.fp8 import flax_layers
  from jmp_train._src.fp8 import narrow
  from jmp_train._src.fp8 import products as fp8_products

  def bind(site, vals, policy):
    if site.name not in states or in_loop(site):
      return None
    meta = flax_layers.to_meta(states[site.name])
    lhs, rhs = vals
    fmt = fp8_products.Fp8Format(policy.fp8)
    product = narrow.narrow_product(scaled.op_of(site.eqn), fmt, lhs.dtype, rhs.dtype, policy.compute_dtype)
    return product(lhs, rhs, meta)

  if not states:
    yield
    return
  with scaled.hooked(bind):
    yield
