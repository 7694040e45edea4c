"""Sphinx configuration of lort's documentation site (``make docs``).

Built with warnings as errors (``-W --keep-going -n``): a broken cross-reference, a
missing page, or a public name that autodoc documents without a docstring fails the
build (see ``_warn_missing_docstring`` below).
"""

from __future__ import annotations

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "src"))
sys.path.insert(0, os.path.join(HERE, "_ext"))

from lort._version import __version__  # noqa: E402 - after the path is set

project = "lort"
author = "lort's authors"
copyright = "lort's authors"
version = release = __version__

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "benchpages",  # docs/_ext: benchmarks/results and studies as pages
]

source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
root_doc = "index"
exclude_patterns = ["_build", "_ext", "_generated/charts.md", "Thumbs.db", ".DS_Store"]

myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3

html_theme = "furo"
html_title = f"lort {__version__}"
html_static_path: list[str] = []

# API reference: members in source order, each documented name needs a docstring.
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_typehints_format = "short"
autodoc_preserve_defaults = True
# undoc-members: a public member without a docstring is listed, so the check below sees it.
autodoc_default_options = {"show-inheritance": True, "undoc-members": True}

# No network when the site is built (no intersphinx): names of other libraries that
# lort's signatures and docstrings mention are left unresolved on purpose.
nitpick_ignore_regex = [
    (r"py:.*", r"(torch|onnx|onnxruntime|collections|typing|enum|logging|os|dataclasses)(\..*)?"),
    (r"py:class", r"(Callable|Any|Mapping|Iterator|Path|GraphModule|Tensor|Module|Parameter|Counter)"),
    (r"py:class", r"lort\.diagnostics\.records\.GroupInfo|GroupInfo"),
    (r"py:class", r"lort\.compile\.tuner\.Tuner|Tuner"),
    (r"py:class", r"lort\.diagnostics\.records\.GraphRecord|GraphRecord"),
    (r"py:class", r"lort\.module\.transition\.TransitionManager|TransitionManager"),
]


def _warn_missing_docstring(app, what, name, obj, options, lines) -> None:
    """A public name that autodoc documents with no docstring is a warning, which the
    ``-W`` build turns into an error: every public name of the reference is documented."""
    short = name.rsplit(".", 1)[-1]
    if short.startswith("_") or what == "module":
        return
    if not any(line.strip() for line in lines):
        from sphinx.util import logging

        logging.getLogger("lort.docs").warning(
            "%s %s has no docstring: document it in src/lort (the API reference shows every public name)",
            what, name, type="lort", subtype="missing-docstring",
        )


def _always_reread(app, env, added, changed, removed):
    """The API reference is read again on every build: its docstrings live in src/lort,
    which Sphinx does not watch, so an incremental build would miss a removed one."""
    return ["api"]


def setup(app):
    app.connect("autodoc-process-docstring", _warn_missing_docstring)
    app.connect("env-get-outdated", _always_reread)
    return {"parallel_read_safe": True}
