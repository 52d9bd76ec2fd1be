"""Sphinx configuration of the jmp_train documentation.

Build: ``make docs``, or
``sphinx-build -W --keep-going -n -b html docs docs/_build/html``.
The API pages (``docs/api/*.rst``) and the notebooks (``docs/_notebooks/``)
are written at build time by ``docs/_ext/jmp_api.py``.
"""

import os
import sys

DOCS = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(DOCS, "_ext"))
sys.path.insert(0, os.path.dirname(DOCS))

import jmp_train  # noqa: E402  (after the sys.path lines)

project = "jmp_train"
author = "The jmp_train Authors"
copyright = "The jmp_train Authors"
version = release = jmp_train.__version__

extensions = [
  "myst_nb",  # Markdown (MyST) pages and notebooks; brings myst_parser.
  "sphinx.ext.autodoc",
  "sphinx.ext.autosummary",
  "sphinx.ext.napoleon",
  "sphinx.ext.mathjax",
  "jmp_api",  # docs/_ext: the API pages and the notebooks, at build time.
]

root_doc = "index"
exclude_patterns = ["_build", "**.ipynb_checkpoints", "Thumbs.db", ".DS_Store"]
templates_path = []

# Markdown: guides and notebooks. Notebooks are committed without outputs and
# executed by the test suite, never here.
myst_enable_extensions = ["colon_fence", "deflist", "dollarmath", "amsmath"]
myst_heading_anchors = 3
nb_execution_mode = "off"
nb_merge_streams = True

# API reference: Google docstrings, signatures with short type names.
autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_typehints_format = "short"
autodoc_preserve_defaults = True
autodoc_default_options = {"exclude-members": "__init__, __new__"}
autosummary_generate = False
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False
napoleon_attr_annotations = True
python_use_unqualified_type_names = True
add_module_names = False

# -n: every cross-reference to a jmp_train name must resolve. There is no
# network (no intersphinx), so references to other packages and to Python's
# own types are left as text.
nitpicky = True
_EXTERNAL = (
  "jax",
  "jnp",
  "lax",
  "jaxlib",
  "np",
  "numpy",
  "optax",
  "flax",
  "nn",
  "nnx",
  "linen",
  "chex",
  "orbax",
  "ocp",
  "typing",
  "typing_extensions",
  "collections",
  "collections.abc",
  "abc",
  "dataclasses",
  "functools",
  "enum",
  "types",
  "os",
  "pathlib",
  "matplotlib",
  "plt",
  "ml_dtypes",
  "tqdm",
)
nitpick_ignore_regex = [
  (r"py:.*", r"(%s)(\..*)?" % "|".join(_EXTERNAL).replace(".", r"\.")),
  # Python builtins and common informal type words in docstrings.
  (
    r"py:.*",
    r"(None|True|False|Ellipsis|NotImplemented|callable|Callable|"
    r"object|type|int|float|complex|bool|str|bytes|list|tuple|dict|set|"
    r"frozenset|Any|Sequence|Mapping|Iterable|Iterator|Hashable|Literal|"
    r"Optional|Union|NamedTuple|Protocol|TypeVar|Generic|ParamSpec|"
    r"Exception|ValueError|TypeError|RuntimeError|KeyError|"
    r"pytree|PyTree|PyTreeDef|Array|ArrayLike|DTypeLike|DType|dtype|"
    r"ArrayTree|Params|Updates|Shape|PRNGKey|Pytree|optional)",
  ),
]

# Theme: the one optax, Flax and JAX use; search is Sphinx's own.
html_theme = "sphinx_book_theme"
html_title = "jmp_train"
html_theme_options = {
  "show_toc_level": 2,
  "navigation_with_keys": False,
}
html_static_path = []
html_show_sourcelink = False
