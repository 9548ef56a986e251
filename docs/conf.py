"""Sphinx configuration: MyST Markdown pages, executed notebooks (myst-nb), API reference from docstrings."""

import os
import shutil
import sys

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), '..'))
sys.path.insert(0, ROOT)

project = 'brainpy-accum'
author = 'brainpy-accum developers'
extensions = ['myst_nb', 'sphinx.ext.autodoc', 'sphinx.ext.napoleon', 'sphinx.ext.viewcode']
exclude_patterns = ['_build', 'benchmark.json']
html_theme = 'alabaster'
autodoc_member_order = 'bysource'
autodoc_typehints = 'none'
napoleon_numpy_docstring = True
napoleon_google_docstring = False
suppress_warnings = ['mystnb.unknown_mime_type']
# GitHub-style anchors for headings down to level 3, so that links like guide.md#uneven-batches work in the
# built docs as they do on GitHub.
myst_heading_anchors = 3

# The notebooks live in ../notebooks (committed without outputs); they are copied here and executed
# on every build, so a notebook that fails breaks the build.
nb_execution_mode = 'force'
nb_execution_timeout = 600
nb_execution_raise_on_error = True
_NOTEBOOKS = os.path.join(os.path.dirname(__file__), 'notebooks')
shutil.rmtree(_NOTEBOOKS, ignore_errors=True)
shutil.copytree(os.path.join(ROOT, 'notebooks'), _NOTEBOOKS)
