"""Sphinx configuration of the pz_sparsecore documentation.

Build with `make docs` (`sphinx-build -W --keep-going -b html docs
docs/_build/html`): warnings are errors. Notebooks are rendered from
`notebooks/` (linked as `docs/notebooks`), executed at build time so that
their outputs (Treescope figures included) are on the pages: a cell error
fails the build. So are the `code-cell` blocks of `concepts.md` (a MyST
text notebook; its plain `python` blocks are not run here but by
tests/test_readme.py). Executed notebooks are cached under
`docs/_build/.jupyter_cache` and run again only when their code changes;
`PZSC_DOCS_EXECUTE=force` runs them all (`off`: none).
"""

from __future__ import annotations

import os
import re
import sys

sys.path.insert(0, os.path.abspath(".."))
# Importing the package for autodoc must not need more than one CPU device.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

project = "pz_sparsecore"
author = "pz_sparsecore authors"
copyright = "pz_sparsecore authors"  # noqa: A001
release = version = "0.1.0"

extensions = [
  "myst_nb",
  "sphinx.ext.autodoc",
  "sphinx.ext.napoleon",
  "sphinx.ext.viewcode",
]

source_suffix = {".md": "myst-nb", ".ipynb": "myst-nb"}
exclude_patterns = ["_build", "**.ipynb_checkpoints"]

# Notebooks are stored without outputs and executed here (see above).
nb_execution_mode = os.environ.get("PZSC_DOCS_EXECUTE", "cache")
nb_execution_cache_path = os.path.join(
  os.path.dirname(os.path.abspath(__file__)), "_build", ".jupyter_cache"
)
nb_execution_timeout = 300
nb_execution_raise_on_error = True
myst_enable_extensions = ["colon_fence", "dollarmath"]
myst_heading_anchors = 3

napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_default_options = {"members": True, "show-inheritance": True}
# Cross-references to third-party types (jax.Array, pz.nx.NamedArray, ...)
# are not resolved (no intersphinx: the build must work offline).
nitpicky = False

html_theme = "furo"
# Treescope outputs wrap at the column's width (see the file).
html_static_path = ["_static"]
html_css_files = ["treescope.css"]
html_title = "pz_sparsecore"
# Attributes sections as `:ivar:` fields: autodoc also documents NamedTuple
# fields as attributes, and two attribute directives for one name are a
# "duplicate object description" warning.
napoleon_use_ivar = True

# The library's docstrings write inline code Markdown-style, in single
# backticks (as Penzai's sources do), and often glue a plural "s" to it
# (`FeatureSpec`s); spans may cross a line break. In reStructuredText that
# is an unterminated interpreted text (a warning), so single-backtick spans
# become ``literals`` here, with an escaped space before a glued suffix.
# Roles (:func:`x`), ``literals`` and `references`_ are left alone.
_INLINE_CODE = re.compile(
  r"(?<![`:\w\\])`((?:[^`\n]|\n(?!\s*\n))+)`(?![`_])(\w?)"
)


def _inline_code(match: re.Match) -> str:
  code, suffix = match.group(1), match.group(2)
  return f"``{code}``" + (f"\\ {suffix}" if suffix else "")


def _process_docstring(app, what, name, obj, options, lines):
  del app, what, name, obj, options
  text = _INLINE_CODE.sub(_inline_code, "\n".join(lines))
  lines[:] = text.split("\n")


def _treescope_run_here(app, pagename, templatename, context, doctree):
  """Loads `_static/treescope_run_here.js` in the page's head, before any
  output (the theme puts `html_js_files` at the end of the body, too late):
  Treescope's inline scripts then run once whole (see the file)."""
  del app, pagename, templatename, doctree
  src = context["pathto"]("_static/treescope_run_here.js", 1)
  context["metatags"] = (
    context.get("metatags", "") + f'\n<script src="{src}"></script>'
  )


def setup(app):
  app.connect("autodoc-process-docstring", _process_docstring)
  app.connect("html-page-context", _treescope_run_here)
