"""Copying the rest of one shard from the origin into its partial copy in a tier (see
fill.py: reads may have filled parts of it already): large reads of the runs still missing,
then a rename, and nothing wrong ever renamed into place.

Every stored file copied is checked while it streams through (xxh3 of its raw content against the
manifest), or, for an in-place dataset whose checksums are not known yet, its checksum is
computed and handed to ``record``. Before the rename the partial file's size and header are
checked. The copy is pure I/O on file descriptors; the decisions (which tier, whether there
is room, who holds the claim) live in chain.py.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import numpy.typing as npt
import xxhash

from stagefs.errors import CorruptShardError
from stagefs.format import KIND_FILE, Manifest, ShardHeader
from stagefs.format.codecs import decode
from stagefs.format.spec import SHARD_HEADER
from stagefs.tiers.fill import FILL_SUFFIX, ShardFill

__all__ = ["BUSY_CHUNK", "CHUNK", "IN_FLIGHT", "CopyAborted", "Layout", "OriginFailed", "Pace",
           "fill_gaps", "finish_copy"]

CHUNK = 8 * 2**20  # bytes per origin read while placing
IN_FLIGHT = 4  # origin reads of one shard in flight at once: one stream rarely fills a PFS link
BUSY_CHUNK = 1 << 20  # while reads use the origin, the copy reads one piece this big at a time


class CopyAborted(Exception):
    """The store is closing: the copy stopped and its partial file was deleted."""


class OriginFailed(Exception):
    """Reading the origin failed while placing (the cause is chained)."""


class Layout:
    """The files of each shard in offset order, from the manifest's arrays (built once)."""

    def __init__(self, m: Manifest) -> None:
        a = m.arrays
        idx = np.flatnonzero(a["kind"] == KIND_FILE)
        shard, offset = a["shard"][idx], a["offset"][idx]
        order = np.lexsort((offset, shard))
        self.idx: npt.NDArray[np.int64] = idx[order].astype(np.int64)
        self.bounds = np.searchsorted(shard[order], np.arange(len(m.shards) + 1))
        self.m = m

    def entries(self, shard: int) -> list[int]:
        return [int(e) for e in self.idx[self.bounds[shard] : self.bounds[shard + 1]]]


Check = Callable[[int, int], None]
"""``check(entry, xxh3 of its raw content)``: raise if wrong, or record it."""


class _Verifier:
    """Feeds the bytes of a shard, in order, through one hasher per stored file."""

    def __init__(self, m: Manifest, entries: list[int], check: Check, where: str) -> None:
        self.ents = [(e, m.offset[e], m.stored[e], m.codec[e], m.size[e]) for e in entries
                     if m.stored[e] > 0]
        self.i = 0
        self.check = check
        self.where = where
        self.hasher = xxhash.xxh3_64()
        self.buf: list[bytes] = []

    def feed(self, pos: int, data: bytes) -> None:
        end = pos + len(data)
        view = memoryview(data)
        while self.i < len(self.ents):
            e, off, stored, codec, size = self.ents[self.i]
            if off >= end:
                return
            lo, hi = max(off, pos), min(off + stored, end)
            if lo < hi:
                piece = view[lo - pos : hi - pos]
                if codec:
                    self.buf.append(bytes(piece))
                else:
                    self.hasher.update(piece)
            if off + stored > end:
                return  # continues in the next chunk
            if codec:
                raw = decode(codec, b"".join(self.buf), size, self.where)
                self.buf.clear()
                self.check(e, xxhash.xxh3_64_intdigest(raw))
            else:
                self.check(e, self.hasher.intdigest())
                self.hasher.reset()
            self.i += 1

    def finish(self) -> None:
        if self.i != len(self.ents):
            raise CorruptShardError(f"{self.where}: shard shorter than its files")


def fill_gaps(
    fill: ShardFill,
    *,
    read: Callable[[int, int], bytes],
    m: Manifest,
    check: Check,
    where: str,
    progress: Callable[[int], None] | None = None,
    stop: Callable[[], bool] | None = None,
    pace: Pace | None = None,
) -> None:
    """Copy from the origin every stored file of the shard that no read has filled yet.

    Runs of missing files are read in pieces of at most CHUNK bytes, IN_FLIGHT at a time;
    each piece is written, then streamed through the files' checksums, and a file's fill
    byte is set once it is whole and right. ``pace()`` says how hard to read now (the chain
    makes the copy give way to reads). ``progress(n)`` gets the bytes done so far (filled
    before or copied now); ``stop()`` aborts it.
    """
    ext = fill.ext
    todo = [(int(ext.offs[lo]), int(ext.ends[hi - 1]), lo, hi) for lo, hi in fill.missing()]
    done = int(ext.ends[-1]) - sum(b - a for a, b, _, _ in todo) if len(ext) else 0
    if progress is not None:
        progress(done)
    run = 0
    verifier: _Verifier | None = None
    for pos, data in _read_ahead(read, [(a, b) for a, b, _, _ in todo], pace, stop):
        if verifier is None or pos >= todo[run][1]:
            if verifier is not None:
                verifier.finish()
                run += 1
            _, _, lo, hi = todo[run]
            verifier = _run_verifier(fill, lo, hi, m, check, where)
        _pwrite_all(fill.fd, data, pos)
        verifier.feed(pos, data)
        done += len(data)
        if progress is not None:
            progress(done)
        if stop is not None and stop():
            raise CopyAborted(fill.final)
    if stop is not None and stop():
        raise CopyAborted(fill.final)
    if verifier is not None:
        verifier.finish()


def _run_verifier(fill: ShardFill, lo: int, hi: int, m: Manifest, check: Check,
                  where: str) -> _Verifier:
    """A verifier for extents lo..hi-1 that sets each file's fill byte once it is right."""
    position = {int(e): lo + k for k, e in enumerate(fill.ext.entries[lo:hi])}

    def checked(e: int, digest: int) -> None:
        check(e, digest)
        k = position[e]
        fill.mark(k, k + 1)

    return _Verifier(m, [int(e) for e in fill.ext.entries[lo:hi]], checked, where)


def finish_copy(fill: ShardFill, index: int, pack_id: bytes, size: int) -> None:
    """Check a complete partial copy (size, header) and rename it to its final name."""
    partial = fill.partial
    got = os.fstat(fill.fd).st_size
    if got != size:
        raise CorruptShardError(f"{partial}: {got} bytes written, expected {size}")
    header = ShardHeader.decode(os.pread(fill.fd, SHARD_HEADER.size, 0), partial)
    header.check(partial, index=index, pack_id=pack_id, file_size=size)
    os.rename(partial, fill.final)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(fill.final + FILL_SUFFIX)


Pace = Callable[[], tuple[int, int] | None]
"""How the copy may read now: (pieces in flight, bytes per piece), or None: wait."""


def _read_ahead(read: Callable[[int, int], bytes], spans: list[tuple[int, int]],
                pace: Pace | None = None,
                stop: Callable[[], bool] | None = None) -> Iterator[tuple[int, bytes]]:
    """The bytes of ``spans`` ([start, end) each) in order, in pieces read ahead as ``pace``
    allows (default: IN_FLIGHT pieces of CHUNK bytes)."""
    todo = deque(spans)
    with ThreadPoolExecutor(IN_FLIGHT, thread_name_prefix="stagefs-read") as pool:
        pending: deque[tuple[int, Future[bytes]]] = deque()
        try:
            while todo or pending:
                how = pace() if pace is not None else (IN_FLIGHT, CHUNK)
                if how is None and not pending:
                    if stop is not None and stop():
                        return
                    time.sleep(0.005)
                    continue
                if how is not None:
                    room, chunk = how
                    while todo and len(pending) < room:
                        a, b = todo.popleft()
                        n = min(chunk, b - a)
                        if a + n < b:
                            todo.appendleft((a + n, b))
                        pending.append((a, pool.submit(read, a, n)))
                pos, fut = pending.popleft()
                try:
                    data = fut.result()
                except Exception as exc:
                    raise OriginFailed(str(exc)) from exc
                yield pos, data
        finally:
            for _, fut in pending:
                fut.cancel()


def _pwrite_all(fd: int, data: bytes, pos: int) -> None:
    view = memoryview(data)
    while view:
        n = os.pwrite(fd, view, pos)
        view, pos = view[n:], pos + n
