"""Which weight products stay in high precision: ``keep=`` rules, matched against sites.

A rule is a site's name (``"head/dot_general"``), a shell glob over site
names (``"layer0/attn/*"``), or a glob naming one of the scopes the product
runs in, as :func:`jmp_train.autocast`'s ``"scope:"`` entries and the
policy's unscaled scopes match them (``"head"``, ``"block*/conv1"``). A
kept site's product runs in float32 on its float weight.
"""

from __future__ import annotations

import fnmatch
from typing import Iterable, Mapping

from jmp_train._src.autocast import interpreter
from jmp_train._src.autocast.lists import check_keep

__all__ = ["check_keep", "matches", "resolve"]


def matches(name: str, scope: tuple[str, ...], rule: str) -> bool:
  """Whether ``rule`` names the site ``name`` run within ``scope``."""
  return name == rule or fnmatch.fnmatchcase(name, rule) or interpreter._matches(tuple(scope), rule)


def resolve(keep: Iterable[str], sites: Mapping[str, tuple[str, ...]]) -> frozenset[str]:
  """The names of the sites the rules keep.

  Raises:
    ValueError: for a rule that matches no site, listing the sites.
  """
  kept: set[str] = set()
  for rule in keep:
    found = {name for name, scope in sites.items() if matches(name, scope, rule)}
    if not found:
      raise ValueError(
        f"The keep rule {rule!r} matches no weight product of the function; its sites are {sorted(sites)} "
        "(a rule is a site name, a glob over site names, or a glob naming a scope such as a module's path)."
      )
    kept |= found
  return frozenset(kept)
