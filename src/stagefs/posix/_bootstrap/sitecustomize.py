"""Start-up hook of ``stagefs run`` and ``stagefs.intercept``: carries an interception into
every Python process started with this directory on PYTHONPATH and STAGEFS_INTERCEPT_AT set
(spawned DataLoader workers, subprocesses). Then runs the sitecustomize it shadows, if any.
"""

import os
import sys


def _activate() -> None:
    if not os.environ.get("STAGEFS_INTERCEPT_AT"):
        return
    try:
        from stagefs.posix.intercept import from_environment

        from_environment()
    except Exception as exc:  # a broken hook must not stop the user's program silently
        print(f"stagefs: interception not started in this process: {exc}", file=sys.stderr)
        raise SystemExit(1) from exc


def _chain() -> None:
    """Import the next ``sitecustomize`` on sys.path, the one this file hides."""
    here = os.path.dirname(os.path.abspath(__file__))
    mod = sys.modules.pop("sitecustomize", None)
    saved = sys.path[:]
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]
    try:
        import importlib

        importlib.import_module("sitecustomize")
    except ImportError:
        pass
    finally:
        sys.path[:] = saved
        if mod is not None:
            sys.modules["sitecustomize"] = mod


_activate()
_chain()
