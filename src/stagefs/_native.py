"""Where the compiled parts of the package are (each one optional: built when a C compiler
was present at install)."""

from __future__ import annotations

import importlib.machinery
import os

__all__ = ["preload_library"]

_POSIX = os.path.join(os.path.dirname(os.path.abspath(__file__)), "posix")


def preload_library() -> str | None:
    """The path of the preload library (posix/preload.c, built as ``stagefs/posix/_preload``
    with the package), or None when it was not built."""
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = os.path.join(_POSIX, "_preload" + suffix)
        if os.path.isfile(path):
            return path
    return None
