"""The one version number: the package metadata (pyproject.toml reads it from
here), fastattn.__version__ and the README agree, and a test checks it."""

__version__ = "0.1.0"
