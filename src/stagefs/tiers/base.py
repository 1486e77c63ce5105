"""The seam every holder of shard bytes implements: a tier, the origin, later a peer."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from typing import Protocol, runtime_checkable

__all__ = ["OriginStats", "PreadMany", "ShardSource", "SourceUnavailable", "pread_full"]


_MAX_ONE_READ = 1 << 30  # Linux returns at most 0x7ffff000 bytes from one read


def pread_full(fd: int, length: int, offset: int) -> bytes:
    """``os.pread`` that returns all ``length`` bytes unless the file ends first.

    One call for anything up to 1 GiB (every sample); larger ranges (a whole multi-GiB file)
    are read in parts, since one read never returns more than about 2 GiB on Linux.
    """
    if length <= _MAX_ONE_READ:
        return os.pread(fd, length, offset)
    parts, done = [], 0
    while done < length:
        part = os.pread(fd, min(_MAX_ONE_READ, length - done), offset + done)
        if not part:
            break
        parts.append(part)
        done += len(part)
    return b"".join(parts)


class SourceUnavailable(Exception):
    """A holder cannot serve now (gone, timed out): the reader tries the next one.

    Internal to the read path: callers of the Store never see it.
    """


class DamagedCopy(SourceUnavailable):
    """A tier copy is shorter than its shard (cut short under us): it is dropped."""


@runtime_checkable
class ShardSource(Protocol):
    """Something that can return a byte range of a shard.

    A source with a true ``local`` attribute (a whole shard copy in a node-local tier) is
    read in the calling thread; Store.read_many reads the others from several threads.
    """

    name: str

    def pread(self, shard: int, offset: int, length: int) -> bytes:
        """Return exactly ``length`` bytes at ``offset`` of ``shard``, or raise."""
        ...

    def close(self) -> None: ...


PreadMany = Callable[[Sequence[tuple[int, int, int]]], list[bytes | None]]
"""``pread_many(ranges)``, offered besides ``pread`` by a peer and by a node-local tier: the
bytes of each (shard, offset, length) in one exchange or call, None where it cannot give
them (down, not held). Store.read_many sends each such holder all its ranges at once (a
local one in the calling thread) and verifies each."""


@dataclass
class OriginStats:
    """Every operation stagefs made on the origin (the shared file system): what it cost."""

    opens: int = 0
    stats: int = 0
    reads: int = 0
    bytes_read: int = 0
    # where a read is counted for the job as well (``stagefs status``: the Store's counters)
    sink: Callable[[int], None] | None = field(default=None, repr=False, compare=False)

    def read(self, nbytes: int) -> None:
        """One read of ``nbytes`` from the origin: counted here and in the job's counters."""
        self.reads += 1
        self.bytes_read += nbytes
        sink = self.sink
        if sink is not None:
            sink(nbytes)

    def as_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "sink"}
