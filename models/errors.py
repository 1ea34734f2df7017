"""Errors raised by the `models` package.

Hierarchy::

    ValueError
     └── ModelLoadError   any failure to obtain, convert or load a model

The message always says what the user can do next (a flag to pass, a package to install,
a file to delete). The HTTP/CLI layer shows it verbatim; it maps it to a start-up failure,
never to a request error.
"""

from __future__ import annotations

__all__ = ["ModelLoadError"]


class ModelLoadError(ValueError):
    """A model could not be obtained, converted or loaded; the message says how to fix it."""
