"""Sphinx configuration of the mpidag documentation.

Build (warnings are errors, as in ``tests/test_docs.py``)::

    .venv/bin/python -m sphinx -W --keep-going -b html docs docs/_build/html

Everything renders offline: no intersphinx, no graphviz; the diagrams are text.
"""

from __future__ import annotations

import inspect
import os
import re
import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parent
ROOT = DOCS.parent
sys.path.insert(0, str(ROOT))  # document the checkout, installed or not

import mpidag  # noqa: E402

project = "mpidag"
author = "the mpidag authors"
copyright = "the mpidag authors"  # noqa: A001 - Sphinx's name
release = mpidag.__version__
version = ".".join(release.split(".")[:2])

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.viewcode",
]

source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build", "Thumbs.db", ".DS_Store", "README.md", "examples"]
templates_path: list[str] = []

# the pages written in Markdown: `#slug` links to headings, GitHub tables
myst_heading_anchors = 3

# autodoc: document what the API pages name, in source order, with base classes (mpidag's
# errors derive from the builtins torch raises)
# (module pages list their members one by one, so a class asks for ``:members:`` itself)
autodoc_default_options = {
    "member-order": "bysource",
    "show-inheritance": True,
}
autodoc_typehints = "signature"
autodoc_preserve_defaults = True  # `timeout=UNSET_RPC_TIMEOUT`, not `timeout=-1.0`

# the package's docstrings are Google style (`Args:`) with `Example::` literal blocks
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False

# every literal block is Python (shell lines are comments or `.. code-block:: sh`), so a
# broken example warns, and under -W fails the build
highlight_language = "python3"
pygments_style = "sphinx"

html_theme = "alabaster"
html_title = f"mpidag {release}"
html_static_path: list[str] = []
html_theme_options = {
    "description": "torch.distributed.rpc, RRefs, distributed autograd and the distributed "
                   "optimizer on MPI",
    "fixed_sidebar": True,
    "page_width": "1100px",
    "sidebar_width": "240px",
}

# Parameters whose names start with "_" are private (e.g. MPIRpcBackendOptions' torch
# compatibility slots): leave them out of the rendered signatures.
_PRIVATE_PARAM = re.compile(r",\s*_\w+(?:\s*:\s*[^=,()\[\]]+)?(?:\s*=\s*[^,()]+)?(?=[,)])")


def _hide_private_parameters(app, what, name, obj, options, signature, return_annotation):
    if signature and "_" in signature:
        signature = _PRIVATE_PARAM.sub("", signature)
    return signature, return_annotation


def _drop_type_docstrings(app, what, name, obj, options, lines):
    """A constant (``UNSET_RPC_TIMEOUT = -1.0``) has no docstring of its own; autodoc would
    show the docstring of its type (``float``) instead. The API pages say what it means."""
    if what == "data" and lines and type(obj).__module__ == "builtins":
        doc = inspect.getdoc(type(obj)) or ""
        if doc and "\n".join(lines).strip().startswith(doc.splitlines()[0].strip()):
            lines.clear()


def _relative_diff_headers() -> None:
    """``literalinclude :diff:`` names both files by absolute path in the ``---``/``+++``
    lines; name them relative to docs/ so the page is the same on every machine."""
    from sphinx.directives.code import LiteralIncludeReader

    original = LiteralIncludeReader.show_diff
    if getattr(original, "_mpidag_relative", False):
        return

    def show_diff(self, location=None):
        lines = original(self, location)
        for i, line in enumerate(lines[:2]):
            if line.startswith(("--- ", "+++ ")):
                path = line[4:].rstrip("\n")
                rel = os.path.relpath(path, DOCS) if os.path.isabs(path) else path
                lines[i] = f"{line[:4]}{rel}\n"
        return lines

    show_diff._mpidag_relative = True
    LiteralIncludeReader.show_diff = show_diff


def setup(app):
    _relative_diff_headers()
    app.connect("autodoc-process-signature", _hide_private_parameters)
    app.connect("autodoc-process-docstring", _drop_type_docstrings)
    return {"parallel_read_safe": True}
