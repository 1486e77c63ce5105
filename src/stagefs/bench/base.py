"""What every system of ``stagefs bench`` is: the protocol, the shared context, and the
defaults a system class starts from. The systems are in systems.py (stagefs and plain reads)
and peers.py (other loaders); both build on this module, so neither imports the other."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol

__all__ = ["Context", "System", "write_index"]


@dataclass(frozen=True, slots=True)
class Context:
    """Where everything is, the same for every system (plain JSON for the worker process)."""

    raw: str  # the raw dataset (on the origin)
    conv: str  # where conversions are written (next to the raw dataset: on the origin)
    local: str  # node-local scratch: local copies, caches, tiers
    index: str  # the files' relative paths and sizes, sorted (write_index, by the runner)
    fuse_mount: str = ""  # the mount point of a running 'stagefs mount' (FUSE only)

    def out(self, system: str) -> str:
        return os.path.join(self.conv, system)

    def scratch(self, system: str) -> str:
        return os.path.join(self.local, system)

    def files(self) -> list[str]:
        with open(self.index) as f:
            return [rel for rel, _ in json.load(f)]


def write_index(path: str, rows: list[tuple[str, int]]) -> None:
    """The index of ``Context.files``: JSON, so any name is one entry (a tab, a newline, and
    bytes that are not UTF-8, which os.walk gives as surrogates, JSON escapes and restores)."""
    with open(path, "w") as f:
        json.dump(rows, f)


class System(Protocol):
    """One way of reading the dataset."""

    name: str  # short id used in files and on the command line
    title: str  # what the report calls it
    interpreter: str  # "main" (this Python) or "peers" (the peers' Python)
    settings: str  # the settings used for shuffled reading, and where they are documented
    on_origin: bool  # reads its data from the origin (else from a node-local copy)

    def missing(self) -> str | None:
        """Why it cannot run here, or None. Called in the interpreter that runs it."""
        ...

    def convert(self, ctx: Context) -> str:
        """Write this system's form of the dataset; return the directory it is in."""
        ...

    def open(self, ctx: Context, run: int) -> None:
        """Get ready to read (run ``run`` starts from empty local caches)."""
        ...

    def epoch(self, ctx: Context, run: int, epoch: int) -> Iterator[tuple[str, Any]]:
        """One shuffled epoch: every sample once, as (key, bytes-like)."""
        ...

    def origin_bytes(self) -> int | None:
        """Bytes read from the origin so far, if the system counts them itself."""
        ...

    def close(self) -> None: ...



class _Base:
    name = ""
    title = ""
    interpreter = "main"
    settings = ""
    on_origin = True

    def missing(self) -> str | None:
        return None

    def open(self, ctx: Context, run: int) -> None:
        self.files = ctx.files()

    def origin_bytes(self) -> int | None:
        return None

    def close(self) -> None:
        return None
