"""Copying the rest of one shard from the origin into its partial copy in a tier (see
fill.py: reads may have filled parts of it already): large reads of the runs still missing,
then a rename, and nothing wrong ever renamed into place.

Every stored file copied is checked while it streams through (xxh3 of its raw content against the
manifest; a large raw file piece by piece, against its piece checksums), or, for an in-place dataset whose checksums are not known yet, its checksum is
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
from stagefs.tiers.fill import FILL_SUFFIX, Extents, ShardFill

__all__ = ["BUSY_CHUNK", "CHUNK", "IN_FLIGHT", "CopyAborted", "Layout", "OriginFailed", "Pace",
           "extents_ok", "fill_gaps", "finish_copy"]

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

    def extents(self, shard: int, size: int, piece_size: int | None = None) -> Extents:
        """The shard's extents and placement pieces (fill.Extents), ``size`` its file's."""
        ents = self.idx[self.bounds[shard] : self.bounds[shard + 1]]
        return Extents.of(self.m, ents, size, piece_size)


Check = Callable[[int, int, int], None]
"""``check(entry, part, xxh3)``: raise if wrong, or record it. ``part`` -1: the xxh3 of the
file's raw content; k >= 0: of its k-th checksum piece (fill.Extents)."""


class _Verifier:
    """Feeds the bytes of a shard, in order, through one hasher per extent (a stored file,
    or one checksum piece of a large raw file: fill.Extents) of extents lo..hi-1;
    ``done(i)`` is called for extent i once it passed. An extent that fails raises its
    CorruptShardError, or, with ``failed``, is handed to ``failed(i, error)`` and the
    extents after it are checked on (their bytes were read with it)."""

    def __init__(self, m: Manifest, ext: Extents, lo: int, hi: int, check: Check,
                 where: str, done: Callable[[int], None] | None = None,
                 failed: Callable[[int, CorruptShardError], None] | None = None) -> None:
        self.items = [(int(ext.entries[i]), int(ext.offs[i]), int(ext.ends[i]), int(ext.part[i]))
                      for i in range(lo, hi)]
        self.lo = lo
        self.m = m
        self.i = 0
        self.check = check
        self.where = where
        self.done = done
        self.failed = failed
        self.hasher = xxhash.xxh3_64()
        self.buf: list[bytes] = []

    def feed(self, pos: int, data: bytes | memoryview) -> None:
        end = pos + len(data)
        view = memoryview(data)
        m = self.m
        while self.i < len(self.items):
            e, off, stop, part = self.items[self.i]
            if off >= end:
                return
            codec = int(m.codec[e]) if part < 0 else 0
            lo, hi = max(off, pos), min(stop, end)
            if lo < hi:
                piece = view[lo - pos : hi - pos]
                if codec:
                    self.buf.append(bytes(piece))
                else:
                    self.hasher.update(piece)
            if stop > end:
                return  # continues in the next chunk
            try:
                if codec:
                    raw = decode(codec, b"".join(self.buf), int(m.size[e]), self.where)
                    self.check(e, part, xxhash.xxh3_64_intdigest(raw))
                else:
                    self.check(e, part, self.hasher.intdigest())
            except CorruptShardError as exc:
                if self.failed is None:
                    raise
                self.failed(self.lo + self.i, exc)
            else:
                if self.done is not None:
                    self.done(self.lo + self.i)
            finally:
                self.buf.clear()
                self.hasher.reset()
            self.i += 1

    def finish(self) -> None:
        if self.i != len(self.items):
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
    """Copy from the origin every stored file of the pieces reserved in this copy that no
    read has filled yet.

    The copy walks the shard's files in offset order and reads the next run of missing
    files, up to CHUNK bytes, as ``pace()`` allows (IN_FLIGHT pieces at full speed). What is
    missing is looked up when each piece is planned, so files the reads fill meanwhile are
    not read again. Each piece is written, then each file in it is checked (a file larger
    than CHUNK is read in pieces and checked as they stream through) and its fill byte set.
    ``progress(n)`` gets the bytes done so far (filled before or copied now); ``stop()``
    aborts it.
    """
    ext, bits = fill.ext, fill.bits
    n_ext = len(ext)
    offs, ends = ext.offs, ext.ends
    # the files of the pieces not reserved in this copy are some other copy's (or none's)
    mine = fill.mine()
    done = int(np.sum((ends - offs)[bits.astype(bool)])) if n_ext else 0
    if progress is not None:
        progress(done)
    cursor = 0
    big: tuple[int, int] | None = None  # the rest of a large file being read

    def next_piece(chunk: int) -> tuple[int, int] | None:
        nonlocal cursor, big
        if big is not None:
            a, b = big
            n = min(chunk, b - a)
            big = (a + n, b) if a + n < b else None
            return a, n
        k = cursor
        while k < n_ext and (bits[k] or not mine[k]):
            k += 1
        if k >= n_ext:
            cursor = k
            return None
        a = int(offs[k])
        if int(ends[k]) - a > chunk:
            cursor = k + 1
            big = (a + chunk, int(ends[k]))
            return a, chunk
        hi = k + 1
        while hi < n_ext and not bits[hi] and mine[hi] and int(ends[hi]) - a <= chunk:
            hi += 1
        cursor = hi
        return a, int(ends[hi - 1]) - a

    streaming: _Verifier | None = None
    for pos, data in _read_ahead(read, next_piece, pace, stop):
        fill.put(pos, data)
        end = pos + len(data)
        lo, hi = ext.inside(pos, end)
        if hi > lo:
            _run_verifier(fill, lo, hi, m, check, where).feed(pos, data)
        else:  # a piece of a file larger than CHUNK
            k = ext.touching(pos, end)[0]
            if streaming is None:
                streaming = _run_verifier(fill, k, k + 1, m, check, where)
            streaming.feed(pos, data)
            if end >= int(ends[k]):
                streaming.finish()
                streaming = None
        done += len(data)
        if progress is not None:
            progress(done)
        if stop is not None and stop():
            raise CopyAborted(fill.final)
    if stop is not None and stop():
        raise CopyAborted(fill.final)
    if streaming is not None:
        streaming.finish()


def extents_ok(m: Manifest, ext: Extents, lo: int, hi: int, data: bytes, check: Check,
               where: str) -> bool:
    """Do extents lo..hi-1, whose bytes are ``data`` (from the first one's offset), pass
    their checks?"""
    v = _Verifier(m, ext, lo, hi, check, where)
    try:
        v.feed(int(ext.offs[lo]), data)
        v.finish()
    except CorruptShardError:
        return False
    return True


def _run_verifier(fill: ShardFill, lo: int, hi: int, m: Manifest, check: Check,
                  where: str, failed: Callable[[int, CorruptShardError], None] | None = None
                  ) -> _Verifier:
    """A verifier for extents lo..hi-1 that sets each one's fill byte once it is right
    (``failed``: as _Verifier's)."""

    def checked(i: int) -> None:
        fill.mark(i, i + 1)

    return _Verifier(m, fill.ext, lo, hi, check, where, checked, failed)


def finish_copy(fill: ShardFill, index: int, pack_id: bytes, size: int) -> None:
    """Check a complete partial copy (size, header) and rename it to its final name."""
    partial = fill.partial
    with fill.descriptor() as fd:
        got = os.fstat(fd).st_size
        if got != size:
            raise CorruptShardError(f"{partial}: {got} bytes written, expected {size}")
        header = ShardHeader.decode(os.pread(fd, SHARD_HEADER.size, 0), partial)
    header.check(partial, index=index, pack_id=pack_id, file_size=size)
    os.rename(partial, fill.final)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(fill.final + FILL_SUFFIX)


Pace = Callable[[], tuple[int, int] | None]
"""How the copy may read now: (pieces in flight, bytes per piece), or None: wait."""


def _read_ahead(read: Callable[[int, int], bytes],
                next_piece: Callable[[int], tuple[int, int] | None],
                pace: Pace | None = None,
                stop: Callable[[], bool] | None = None) -> Iterator[tuple[int, bytes]]:
    """Pieces ``next_piece(max bytes) -> (offset, length)`` (None: no more), read in order
    and ahead as ``pace`` allows (default: IN_FLIGHT pieces of CHUNK bytes)."""
    with ThreadPoolExecutor(IN_FLIGHT, thread_name_prefix="stagefs-read") as pool:
        pending: deque[tuple[int, Future[bytes]]] = deque()
        more = True
        try:
            while more or pending:
                how = pace() if pace is not None else (IN_FLIGHT, CHUNK)
                if how is None and not pending:
                    if stop is not None and stop():
                        return
                    time.sleep(0.005)
                    continue
                if how is not None:
                    room, chunk = how
                    while more and len(pending) < room:
                        piece = next_piece(chunk)
                        if piece is None:
                            more = False
                        else:
                            pending.append((piece[0], pool.submit(read, *piece)))
                if not pending:
                    continue
                pos, fut = pending.popleft()
                try:
                    data = fut.result()
                except Exception as exc:
                    raise OriginFailed(str(exc)) from exc
                yield pos, data
        finally:
            for _, fut in pending:
                fut.cancel()


