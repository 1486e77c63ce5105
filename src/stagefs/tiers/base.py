"""The seam every holder of shard bytes implements: a tier, the origin, later a peer."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Protocol, runtime_checkable

__all__ = ["OriginStats", "ShardSource", "SourceUnavailable"]


class SourceUnavailable(Exception):
    """A holder cannot serve now (gone, timed out): the reader tries the next one.

    Internal to the read path: callers of the Store never see it.
    """


@runtime_checkable
class ShardSource(Protocol):
    """Something that can return a byte range of a shard."""

    name: str

    def pread(self, shard: int, offset: int, length: int) -> bytes:
        """Return exactly ``length`` bytes at ``offset`` of ``shard``, or raise."""
        ...

    def close(self) -> None: ...


@dataclass
class OriginStats:
    """Every operation stagefs made on the origin (the shared file system): what it cost."""

    opens: int = 0
    stats: int = 0
    reads: int = 0
    bytes_read: int = 0

    def as_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}
