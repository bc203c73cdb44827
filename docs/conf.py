"""Sphinx configuration of fastattn's documentation: `sphinx-build -W -b html docs build/html`.

The API reference is generated from the docstrings (numpydoc) of the installed fastattn;
the other pages are Markdown (MyST)."""

import fastattn

project = "fastattn"
author = "the fastattn developers"
copyright = "2026, the fastattn developers"
release = version = fastattn.__version__

extensions = ["sphinx.ext.autodoc", "numpydoc", "myst_parser"]
source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
exclude_patterns = ["_build"]
myst_heading_anchors = 3
numpydoc_show_class_members = False
numpydoc_xref_param_type = False
autodoc_typehints = "none"          # the docstrings give the types
autodoc_mock_imports = ["torch", "jax"]   # the autodiff adapters' frameworks: optional
html_theme = "alabaster"
html_title = f"fastattn {release}"
suppress_warnings = ["myst.xref_missing"]
