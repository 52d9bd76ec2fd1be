"""Sphinx extension: the API pages and the notebooks, made at build time.

* ``api_pages()`` writes one reStructuredText page per public namespace
  (``jmp_train``, ``jmp_train.flax``, ``jmp_train.diagnostics``) from its
  ``__all__``, grouped by the ``jmp_train._src`` module each name comes from:
  a new public name gets its entry without editing the docs.
* ``copy_notebooks()`` copies ``notebooks/*.ipynb`` into ``docs/_notebooks/``
  (myst-nb reads only inside the source directory); they render without
  being executed.

Both run on ``builder-inited`` and write a file only when its text changed,
so an incremental build re-reads only what changed. ``tests/test_docs.py``
calls them without building the site.
"""

from __future__ import annotations

import ast
import functools
import importlib
import inspect
import re
import shutil
import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parent.parent
ROOT = DOCS.parent
API_DIR = DOCS / "api"
NOTEBOOKS_SRC = ROOT / "notebooks"
NOTEBOOKS_DIR = DOCS / "_notebooks"

# (page file stem, namespace, title, sections). A section is (title, module
# prefixes under ``jmp_train._src``); a name goes to the section with the
# longest matching prefix, a name matching none to "Other".
NAMESPACES = (
  (
    "jmp_train",
    "jmp_train",
    "``jmp_train``",
    (
      ("Dtype policies", ("policy", "dtypes")),
      ("Autocast", ("autocast",)),
      ("Loss scaling", ("loss_scaling", "leaf_checks")),
      (
        "Half-precision weights",
        ("low_precision.kahan_compensation", "low_precision.modified_momentum", "low_precision.stochastic_rounding"),
      ),
      ("8-bit optimizer state", ("low_precision.quantized_state", "low_precision.optimizers_8bit")),
      ("FP8", ("fp8",)),
      ("Data parallelism and compression", ("compression", "buckets")),
      ("Train step and checkpoints", ("train",)),
    ),
  ),
  (
    "flax",
    "jmp_train.flax",
    "``jmp_train.flax``",
    (
      ("Policies on modules", ("flax.policy", "flax.nnx_modules")),
      ("Attention", ("flax.attention",)),
      ("FP8 layers", ("fp8",)),
    ),
  ),
  (
    "diagnostics",
    "jmp_train.diagnostics",
    "``jmp_train.diagnostics``",
    (
      ("Value ranges and loss scales", ("diagnostics.histograms", "diagnostics.fractions", "diagnostics.plotting")),
      ("FP8 casts", ("diagnostics.fp8_casts",)),
      ("FP8 products", ("diagnostics.fp8_products",)),
      ("Tensor Cores", ("diagnostics.tensor_cores",)),
      ("Precision audit", ("diagnostics.precision_audit",)),
      ("Saved residuals", ("diagnostics.residuals",)),
      ("Collectives", ("diagnostics.hlo",)),
      (
        "Roofline",
        ("diagnostics.chips", "diagnostics.roofline", "diagnostics.format_compare", "diagnostics.exchange"),
      ),
      ("Tables", ("tables",)),
    ),
  ),
  (
    "int8",
    "jmp_train.int8",
    "``jmp_train.int8``",
    (
      ("INT8 products", ("int8.recipe", "int8.products")),
      ("Calibration", ("deployment.calibration",)),
      ("Quantized models", ("deployment.quantized",)),
      ("Sensitivity and diagnostics", ("deployment.sensitivity", "deployment.report")),
      ("ONNX export", ("deployment.onnx_export",)),
    ),
  ),
)

_SRC = "jmp_train._src."


def _import_sources(module) -> dict[str, str]:
  """Name -> module it is imported from, read from the module's source."""
  tree = ast.parse(Path(inspect.getsourcefile(module)).read_text())
  sources = {}
  for node in ast.walk(tree):
    if isinstance(node, ast.ImportFrom) and node.module:
      for alias in node.names:
        sources[alias.asname or alias.name] = node.module
  return sources


def source_modules(namespace: str) -> dict[str, str]:
  """Each public name of ``namespace`` -> its module under ``jmp_train._src``."""
  module = importlib.import_module(namespace)
  exports = getattr(module, "_EXPORTS", None)
  if exports is not None:
    return {name: exports[name].removeprefix(_SRC) for name in module.__all__}
  imports = _import_sources(module)
  result = {}
  for name in module.__all__:
    origin = imports.get(name, "")
    obj = getattr(module, name)
    if (inspect.isclass(obj) or inspect.isfunction(obj)) and obj.__module__:
      origin = obj.__module__
    result[name] = origin.removeprefix(_SRC)
  return result


def _section(origin: str, sections) -> str:
  best, best_len = "Other", -1
  for title, prefixes in sections:
    for prefix in prefixes:
      if (origin == prefix or origin.startswith(prefix + ".")) and len(prefix) > best_len:
        best, best_len = title, len(prefix)
  return best


def _kind(obj) -> str:
  if inspect.isclass(obj):
    return "class"
  if callable(obj):
    return "function"
  return "data"


def _entry(namespace: str, name: str, obj) -> list[str]:
  kind = _kind(obj)
  target = f"{namespace}.{name}"
  if kind == "class":
    lines = [f".. autoclass:: {target}", "   :members:", f"   :inherited-members: {inherited_stop_classes(obj)}"]
    if public_bases(obj) != [object]:
      lines.append("   :show-inheritance:")
    return lines + [""]
  if kind == "function":
    return [f".. autofunction:: {target}", ""]
  if _holds_classes(obj):  # its repr would be a wall of <class '...'>
    return [f".. autodata:: {target}", "   :no-value:", ""]
  return [f".. autodata:: {target}", ""]


def _holds_classes(obj) -> bool:
  return isinstance(obj, (tuple, list, frozenset, set)) and any(inspect.isclass(x) for x in obj)


def _heading(text: str, char: str) -> list[str]:
  return [text, char * len(text), ""]


def api_page(stem: str, namespace: str, title: str, sections) -> str:
  """The reStructuredText of one namespace's page."""
  module = importlib.import_module(namespace)
  origins = source_modules(namespace)
  groups: dict[str, list[str]] = {}
  for name in module.__all__:
    groups.setdefault(_section(origins[name], sections), []).append(name)
  order = [t for t, _ in sections] + ["Other"]
  lines = [
    f".. This page is written by docs/_ext/jmp_api.py from {namespace}.__all__; do not edit.",
    "",
    f".. _api-{stem}:",
    "",
  ]
  lines += _heading(title, "=")
  if namespace == "jmp_train":
    lines += [".. module:: jmp_train", ""]
    lines += [
      "Every name below is reached as ``jmp_train.NAME`` (loaded on first "
      "use: ``import jmp_train`` imports no JAX until a name is used). "
      "Optimizers are optax ``GradientTransformation`` objects and chain "
      "with optax's own.",
      "",
    ]
  else:
    lines += [f".. automodule:: {namespace}", "", f".. currentmodule:: {namespace}", ""]
  for section in order:
    names = groups.get(section)
    if not names:
      continue
    lines += _heading(section, "-")
    lines += [".. autosummary::", "   :nosignatures:", ""]
    lines += [f"   {name}" for name in names] + [""]
    for name in names:
      lines += _entry(namespace, name, getattr(module, name))
  return "\n".join(lines).rstrip() + "\n"


def _write_if_changed(path: Path, text: str) -> None:
  if not path.exists() or path.read_text() != text:
    path.write_text(text)


def api_pages(out_dir: Path = API_DIR) -> dict[str, str]:
  """Writes ``out_dir/<stem>.rst`` for each namespace; returns stem -> text."""
  out_dir.mkdir(parents=True, exist_ok=True)
  pages = {}
  for stem, namespace, title, sections in NAMESPACES:
    pages[stem] = api_page(stem, namespace, title, sections)
    _write_if_changed(out_dir / f"{stem}.rst", pages[stem])
  return pages


def copy_notebooks(src: Path = NOTEBOOKS_SRC, dst: Path = NOTEBOOKS_DIR) -> list[str]:
  """Copies the notebooks into the docs source; returns their stems."""
  dst.mkdir(parents=True, exist_ok=True)
  stems = []
  for path in sorted(src.glob("*.ipynb")):
    target = dst / path.name
    if not target.exists() or target.read_bytes() != path.read_bytes():
      shutil.copyfile(path, target)
    stems.append(path.stem)
  for stale in dst.glob("*.ipynb"):  # a notebook removed from notebooks/
    if stale.stem not in stems:
      stale.unlink()
  return stems


_FIELD_ALIAS = re.compile(r"Alias for field number \d+$")


@functools.cache
def _public_objects() -> dict[int, str]:
  """id(object) -> its public name, over the three namespaces."""
  result = {}
  for _, namespace, _, _ in NAMESPACES:
    module = importlib.import_module(namespace)
    for name in module.__all__:
      result.setdefault(id(getattr(module, name)), f"{namespace}.{name}")
  return result


def _is_ours(cls) -> bool:
  return getattr(cls, "__module__", "").split(".")[0] == "jmp_train"


def _foreign_docstring(obj) -> bool:
  """Whether a method without a docstring would show one from Flax/optax."""
  func = obj.fget if isinstance(obj, property) else obj
  if not inspect.isfunction(func) or func.__doc__:
    return False
  owner_name, _, member = func.__qualname__.rpartition(".")
  owner = sys.modules.get(func.__module__)
  for part in owner_name.split("."):
    owner = getattr(owner, part, None)
  if not inspect.isclass(owner):
    return False
  for cls in owner.__mro__[1:]:
    attr = cls.__dict__.get(member)
    if attr is not None and getattr(attr, "__doc__", None):
      return not _is_ours(cls)
  return False


def _skip_member(app, what, name, obj, skip, options):
  """Hides NamedTuple field accessors (the class's Attributes section says
  it) and methods whose only docstring is Flax's or optax's."""
  del app, what, name, options
  if _FIELD_ALIAS.match(getattr(obj, "__doc__", None) or ""):
    return True
  if _foreign_docstring(obj):
    return True
  return skip


def inherited_stop_classes(cls) -> str:
  """``:inherited-members:``: members of jmp_train's own bases, none above."""
  names = [b.__name__ for b in cls.__mro__[1:] if not _is_ours(b)]
  return ", ".join(dict.fromkeys(names))


def public_bases(cls) -> list[type]:
  """``cls``'s bases, a private jmp_train base replaced by its own bases."""
  public = _public_objects()
  result = []

  def add(base):
    if _is_ours(base) and id(base) not in public:
      for b in base.__bases__:
        add(b)
    elif base not in result:
      result.append(base)

  for base in cls.__bases__:
    add(base)
  if len(result) > 1 and object in result:
    result.remove(object)
  return result


def _process_bases(app, name, obj, options, bases):
  del app, name, options
  if _is_ours(obj):
    bases[:] = public_bases(obj)


def _constant_comment(namespace: str, name: str) -> list[str]:
  """The ``#`` comment above a public constant's assignment in its module
  (following ``from ... import`` re-exports to the defining module)."""
  origin = source_modules(namespace)[name]
  modname = origin if origin.startswith("jmp_train") else _SRC + origin
  for _ in range(8):
    source = Path(inspect.getsourcefile(importlib.import_module(modname))).read_text()
    tree = ast.parse(source)
    lines = source.splitlines()
    follow = None
    for node in tree.body:
      targets = (
        node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
      )
      if any(isinstance(t, ast.Name) and t.id == name for t in targets):
        comment = []
        for above in reversed(lines[: node.lineno - 1]):
          if not above.startswith("#"):
            break
          comment.insert(0, above.lstrip("#:").removeprefix(" "))
        # Comments are Markdown-ish: `x` is code.
        return [re.sub(r"(?<!`)`([^`]+)`(?!`)", r"``\1``", c) for c in comment]
      if isinstance(node, ast.ImportFrom) and node.module and any((a.asname or a.name) == name for a in node.names):
        follow = node.module
    if follow is None:
      return []
    modname = follow
  return []


def _process_docstring(app, what, name, obj, options, lines):
  """A public constant: its source comment, not its type's docstring."""
  del app, options
  if what != "data":
    return
  namespace, _, attr = name.rpartition(".")
  if namespace not in {n for _, n, _, _ in NAMESPACES}:
    return
  lines[:] = _constant_comment(namespace, attr)
  if _holds_classes(obj):
    lines += ["", "Value:", ""]
    lines += [f"* ``{x.__module__}.{x.__qualname__}``" for x in obj]


# Defaults whose repr is not Python (Flax's sentinels, classes, functions):
# they would break the signature's parsing.
_REPRS = (
  # jax.typing.ArrayLike, expanded by typing.
  (re.compile(r"Array \| ndarray \| bool \| number \| bool \| int \| float \| complex"), "ArrayLike"),
  (re.compile(r"<class '(?:[\w.]+\.)?(\w+)'>"), r"\1"),
  (re.compile(r"<function (?:[\w.<>]+\.)?(\w+) at 0x[0-9a-f]+>"), r"\1"),
  (re.compile(r"<[\w.]+ object(?: at 0x[0-9a-f]+)?>"), "..."),
)


def _keep_property_prose(app, what, name, obj, options, lines):
  """Napoleon reads a property's docstring "Bytes stored: the codes." as
  ``type: description``. Our properties are annotated (autodoc shows that
  type), so such a prefix is prose: put it back. Runs after napoleon."""
  del app, name, options
  fget = getattr(obj, "fget", None)
  if what != "property" or fget is None or "return" not in getattr(fget, "__annotations__", {}):
    return
  while lines and not lines[-1].strip():
    lines.pop()
  if len(lines) >= 2 and lines[-1].startswith(":type: ") and not lines[-2].strip():
    prefix = lines[-1].removeprefix(":type: ")
    del lines[-2:]
    if lines:
      lines[0] = f"{prefix}: {lines[0]}"


def _process_signature(app, what, name, obj, options, signature, return_annotation):
  """Shows a default that is a public constant by its name, not its repr."""
  del app, what, name, obj, options
  from sphinx.util.inspect import object_description

  if not signature:
    return None
  changed = signature
  for _, namespace, _, _ in NAMESPACES:
    module = importlib.import_module(namespace)
    for const in module.__all__:
      value = getattr(module, const)
      if _kind(value) != "data":
        continue
      if isinstance(value, tuple) and value:
        for text in {repr(value), object_description(value)}:
          changed = changed.replace(text, const)
      # autodoc_preserve_defaults shows the source text: ``lists.NAME``.
      changed = re.sub(rf"\b[\w.]+\.{const}\b", const, changed)
  for pattern, repl in _REPRS:
    changed = pattern.sub(repl, changed)
  if changed == signature:
    return None
  return changed, return_annotation


@functools.cache
def _internal_classes() -> dict[str, object]:
  """Names (bare and dotted) of the classes defined in ``jmp_train._src``."""
  result = {}
  for modname, module in list(sys.modules.items()):
    if not modname.startswith("jmp_train._src") or module is None:
      continue
    for attr, value in vars(module).items():
      if inspect.isclass(value) and value.__module__ == modname:
        result[f"{modname}.{attr}"] = value
        result.setdefault(attr, value)
  return result


def _missing_reference(app, env, node, contnode):
  """A type that names a non-public class of ``jmp_train._src`` (in a
  signature, a base class list or a docstring's Args/Attributes type): left
  as text. Roles written in docstrings (``:class:`X```) are still checked."""
  del app, env
  if node.get("refdomain") != "py" or node.get("reftype") != "class" or "refwarn" in node:
    return None
  target = node.get("reftarget", "")
  if target.startswith("jmp_train.") and not target.startswith("jmp_train._src."):
    return None  # public names must resolve
  value = _internal_classes().get(target)
  if value is not None and id(value) not in _public_objects():
    return contnode
  return None


def _builder_inited(app) -> None:
  api_pages(Path(app.srcdir) / "api")
  copy_notebooks(NOTEBOOKS_SRC, Path(app.srcdir) / "_notebooks")


def setup(app):
  app.connect("builder-inited", _builder_inited)
  app.connect("autodoc-skip-member", _skip_member)
  app.connect("autodoc-process-bases", _process_bases)
  app.connect("autodoc-process-docstring", _process_docstring)
  app.connect("autodoc-process-docstring", _keep_property_prose, priority=600)
  app.connect("autodoc-process-signature", _process_signature)
  app.connect("missing-reference", _missing_reference)
  return {"parallel_read_safe": True, "parallel_write_safe": True}
