"""Copying one shard from the origin into a tier: large sequential reads, ``.partial`` then
rename, and nothing wrong ever renamed into place.

Every stored file is checked while it streams through (xxh3 of its raw content against the
manifest), or, for an in-place dataset whose checksums are not known yet, its checksum is
computed and handed to ``record``. Before the rename the partial file's size and header are
checked. The copy is pure I/O on file descriptors; the decisions (which tier, whether there
is room, who holds the claim) live in chain.py.
"""

from __future__ import annotations

import contextlib
import errno
import os
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

__all__ = ["CHUNK", "CopyAborted", "Layout", "OriginFailed", "copy_shard", "open_partial"]

CHUNK = 8 * 2**20  # bytes per origin read while placing
IN_FLIGHT = 4  # origin reads of one shard in flight at once: one stream rarely fills a PFS link


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
                     if m.size[e] > 0]
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


def open_partial(final: str, size: int) -> int:
    """Create ``final.partial`` and reserve ``size`` bytes for it (ENOSPC shows up here)."""
    partial = final + ".partial"
    fd = os.open(partial, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            os.close(fd)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(partial)
            raise
    return fd


def copy_shard(
    fd: int,
    final: str,
    *,
    read: Callable[[int, int], bytes],
    size: int,
    index: int,
    pack_id: bytes,
    m: Manifest,
    entries: list[int],
    check: Check,
    progress: Callable[[int], None] | None = None,
    stop: Callable[[], bool] | None = None,
) -> None:
    """Fill the partial file ``fd`` (from ``open_partial``) with the shard and rename it to
    ``final``. On any failure the partial file is deleted and ``fd`` is closed."""
    partial = final + ".partial"
    done = False
    try:
        verifier = _Verifier(m, entries, check, f"shard {index} from the origin")
        for pos, data in _read_ahead(read, size):
            verifier.feed(pos, data)
            _pwrite_all(fd, data, pos)
            if progress is not None:
                progress(pos + len(data))
            if stop is not None and stop():
                raise CopyAborted(final)
        verifier.finish()
        got = os.fstat(fd).st_size
        if got != size:
            raise CorruptShardError(f"{partial}: {got} bytes written, expected {size}")
        header = ShardHeader.decode(os.pread(fd, SHARD_HEADER.size, 0), partial)
        header.check(partial, index=index, pack_id=pack_id, file_size=size)
        os.rename(partial, final)
        done = True
    finally:
        os.close(fd)
        if not done:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(partial)


def _read_ahead(read: Callable[[int, int], bytes], size: int) -> Iterator[tuple[int, bytes]]:
    """The chunks of ``[0, size)`` in order, with up to IN_FLIGHT reads running ahead."""
    chunk = CHUNK
    starts = deque(range(0, size, chunk))
    with ThreadPoolExecutor(IN_FLIGHT, thread_name_prefix="stagefs-read") as pool:
        pending: deque[tuple[int, Future[bytes]]] = deque()
        try:
            while starts or pending:
                while starts and len(pending) < IN_FLIGHT:
                    pos = starts.popleft()
                    pending.append((pos, pool.submit(read, pos, min(chunk, size - pos))))
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
