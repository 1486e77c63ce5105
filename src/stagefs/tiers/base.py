"""The seam every holder of shard bytes implements: a tier, the origin, later a peer."""

from __future__ import annotations

import functools
import os
import resource
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field, fields
from typing import Any, NamedTuple, Protocol, overload, runtime_checkable

from xxhash import xxh3_64_intdigest

from stagefs._fsutil import in_parts
from stagefs.errors import CorruptShardError

try:
    from stagefs._speedups import gather as _c_gather  # type: ignore[import-not-found]
except ImportError:  # not built: the Python loop below, same results
    _c_gather = None
# The C form survives a mapping whose file is cut short under a copy (the item is None);
# in Python that copy is a SIGBUS, which kills the process: without it, tiers never map.
MAPPINGS_GUARDED = _c_gather is not None

__all__ = ["DESCRIPTORS", "GATHER_PART_BYTES", "MAPPINGS_GUARDED", "READER_DESCRIPTORS",
           "CopyLetGo", "Descriptors", "Gathered", "OriginStats", "PreadMany", "ShardSource",
           "ShortRead", "SourceUnavailable", "gather", "pread_full", "through"]


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


class Gathered(NamedTuple):
    """What ``gather`` read: each item's bytes (None where they could not all be read), the
    XXH3-64 of each (0 where None), the items read (fewer than asked if the reads stopped
    at one that waited), and whether the last read waited."""

    datas: list[bytes | None]
    sums: list[int]
    done: int
    waited: bool = False


GATHER_PART = 8  # items: a batch is split over threads in parts of at least this many
GATHER_PART_BYTES = 256 * 1024
"""Bytes: and of at least this many. A smaller part is copied sooner than a thread wakes
(64 documents of 5 KB from a memory tier, split in two: 2.5-3.1 us a file against 1.35 in
one part)."""


def gather(sources: Sequence[Any], offsets: Sequence[int], lengths: Sequence[int],
           slow_s: float = -1.0, copy_rate: float = 1.0, pool: Executor | None = None,
           parts: int = 1) -> Gathered:
    """Read many stored files at once: item k is ``lengths[k]`` bytes at ``offsets[k]`` of
    ``sources[k]``, a file descriptor (read with pread; -1: none, the item is None; items
    next to each other in one file with one ``preadv``) or a bytes-like mapping of a copy
    (copied out). Each item is hashed as it arrives, while its bytes are in the CPU's cache
    (on this project's machine a batch copied out of a mapping, then hashed, ran at 0.81 of
    that). An item not read whole (an error, the file or mapping ended first) is None: the
    caller reads it again by its one-item path, which says what is wrong.

    With ``slow_s >= 0`` the reads stop after the first that waited (longer than ``slow_s``
    plus its bytes at ``copy_rate``: a file system's latency, not a copy from memory), so
    that the caller can hand the rest to threads. Else, with a ``pool``, the batch is read in
    up to ``parts`` parts at once (``GATHER_PART`` items and ``GATHER_PART_BYTES`` at
    least), one in this thread: the C accelerator reads and hashes without the interpreter
    lock, so parts run on as many cores (page-cache reads of 64 samples of 110 KB in two
    parts: 1.5x one part, on two cores). The Python loop below is the C code's reference
    (same results)."""
    n = len(sources)
    parts = min(parts, n // GATHER_PART) if _c_gather is not None else 1  # Python: the GIL
    if parts > 1 and pool is not None and slow_s < 0:
        parts = min(parts, sum(lengths) // GATHER_PART_BYTES)
    if pool is None or parts < 2 or slow_s >= 0:
        return _gather(sources, offsets, lengths, slow_s, copy_rate)
    got = in_parts(pool, n, parts, lambda a, b: _gather(sources[a:b], offsets[a:b], lengths[a:b]))
    datas, sums = got[0].datas, got[0].sums
    for more in got[1:]:
        datas += more.datas
        sums += more.sums
    return Gathered(datas, sums, n)


def _gather(sources: Sequence[Any], offsets: Sequence[int], lengths: Sequence[int],
            slow_s: float = -1.0, copy_rate: float = 1.0) -> Gathered:
    """``gather`` of one part, in this thread."""
    if _c_gather is not None:
        return Gathered(*_c_gather(sources, offsets, lengths, slow_s, copy_rate))
    n = len(sources)
    out: list[bytes | None] = [None] * n
    hashes = [0] * n
    clock = time.perf_counter
    for k in range(n):
        src, offset, length = sources[k], offsets[k], lengths[k]
        t0 = clock()
        data: bytes | None = None
        if isinstance(src, int):
            if src < -1:
                raise ValueError(f"item {k}: fd {src}")
            try:
                data = pread_full(src, length, offset)
            except OSError:
                data = None
        elif offset + length <= len(src):
            data = bytes(src[offset : offset + length])
        if data is not None and len(data) == length:
            out[k], hashes[k] = data, xxh3_64_intdigest(data)
        if slow_s >= 0 and clock() - t0 > slow_s + length / copy_rate:
            return Gathered(out, hashes, k + 1, True)
    return Gathered(out, hashes, n)


READER_DESCRIPTORS = 128  # a process's own beyond its shards: the manifest, sockets, logs


class Descriptors:
    """The descriptors this process's tier copies hold (a whole copy's one, and its mapping;
    a partial copy's ``COPY``), and how many they may: the open-file limit (the chain raises
    it to the hard one) less the origin's quarter (``PackOrigin``) and the process's own
    (``READER_DESCRIPTORS``). Past it a copy is not opened (read from the origin) and no
    partial copy is made for a read (the stream makes its own): held without a bound, a job
    whose tiers held a thousand shards under a hard limit of 4,096 ran out, and a read's
    open of the origin, or of a lock file, failed with 'Too many open files'."""

    COPY = 3  # a partial copy: its descriptor, its fill map's mapping, the stream's locks'

    def __init__(self, limit: int | None = None) -> None:
        self._lock = threading.Lock()
        self.held = 0
        self._limit = limit

    @property
    def limit(self) -> int:
        if self._limit is not None:
            return self._limit
        # the limit as it is now (a copy is opened now and then: one getrlimit each), so
        # that it follows the chain's or connect()'s raise of it, whenever that came
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        return 1 << 62 if soft == resource.RLIM_INFINITY else \
            max(0, soft - soft // 4 - READER_DESCRIPTORS)

    def take(self, n: int = 1) -> bool:
        """Count ``n`` more if they fit; False (nothing counted) if not."""
        with self._lock:
            if self.held + n > self.limit:
                return False
            self.held += n
            return True

    def force(self, n: int) -> None:
        """Count ``n`` more, whatever the limit (a partial copy the stream fills)."""
        with self._lock:
            self.held += n

    def room(self) -> int:
        return self.limit - self.held

    def give(self, n: int = 1) -> None:
        with self._lock:
            self.held -= n


DESCRIPTORS = Descriptors()


class SourceUnavailable(Exception):
    """A holder cannot serve now (gone, timed out): the reader tries the next one.

    Internal to the read path: callers of the Store never see it.
    """


class ShortRead(CorruptShardError):
    """A shard file ended inside a range its manifest puts in it (truncated, or overwritten
    by a shorter one): ``got`` is what it still held of the range, whose whole files a copy
    may check and keep instead of reading them again."""

    def __init__(self, message: str, got: bytes) -> None:
        super().__init__(message)
        self.got = got


class DamagedCopy(SourceUnavailable):
    """A tier copy is shorter than its shard (cut short under us): it is dropped."""


class CopyLetGo(SourceUnavailable, ValueError):
    """A partial copy's handle was let go of (the copy finished, or dropped) while a thread
    still held it: nothing more is read or written through it; the chain has what is next
    in hand. (A ValueError too: what a closed file's use raises.)"""


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


@overload
def through(src: ShardSource) -> Callable[[int, int, int], bytes]: ...


@overload
def through(src: ShardSource, *, view: bool) -> Callable[[int, int, int], bytes | memoryview]: ...


def through(src: ShardSource, *, view: bool = False
            ) -> Callable[[int, int, int], bytes | memoryview]:
    """How to read ``src`` for bytes bound for a tier (a stream's, the placer's): its
    ``pread_through`` where it has one (the origin: past the page cache, which would hold a
    second copy of them), else its ``pread``. ``view``: the bytes may be a view of the
    reading thread's buffer, good until that thread's next read of ``src`` (a pack's origin
    reading past the page cache gives one instead of a copy)."""
    read = getattr(src, "pread_through", None)
    if read is None:
        return src.pread
    return functools.partial(read, view=True) if view else read  # type: ignore[no-any-return]


PreadMany = Callable[[Sequence[tuple[int, int, int]]], list[bytes | None]]
"""``pread_many(ranges)``, offered besides ``pread`` by a peer: the bytes of each (shard,
offset, length) in one exchange, None where it cannot give them (down, not held).
Store.read_many sends each such holder all its ranges at once and verifies each. A
node-local tier offers ``gather_many`` instead (the same, with each range's hash: ``gather``),
read in the calling thread."""


@dataclass
class OriginStats:
    """Every operation stagefs made on the origin (the shared file system): what it cost."""

    opens: int = 0
    stats: int = 0  # of paths (the scan, a check for changes); not fstat of a file opened
    reads: int = 0
    bytes_read: int = 0
    # where a read is counted for the job as well (``stagefs status``: the Store's counters)
    sink: Callable[[int, int], None] | None = field(default=None, repr=False, compare=False)

    def read(self, nbytes: int, reads: int = 1) -> None:
        """``reads`` reads of ``nbytes`` in all from the origin: counted here and in the
        job's counters."""
        self.reads += reads
        self.bytes_read += nbytes
        sink = self.sink
        if sink is not None:
            sink(nbytes, reads)

    def as_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "sink"}
