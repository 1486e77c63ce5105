"""Shared partial copies: the tier copy of a shard fills as reads pass through it.

In the first epoch every sample is read once from the origin. Each verified read also writes
its bytes into the shard's copy in a tier, so the epoch places the data as a side effect and
the background placer only copies what no read brought in (its "gaps"). Every origin byte is
then read once (MONARCH's placement during the first epoch, at shard granularity).

Files beside the shard's final name in the tier, shared by every process of the node:

- ``NAME.partial``: the shard's full size, reserved with ``fallocate`` when it is created;
  its 64-byte header is written then (it follows from the manifest).
- ``NAME.fill``: one byte per stored file of the shard, in offset order (files of size 0
  are left out): 1 once the file's bytes are in ``NAME.partial`` and were checked against
  the manifest's checksum. A byte is set only after its bytes are written.

The copy is complete when every byte is 1; whoever sets the last one (a reader or the
placer) renames ``NAME.partial`` to ``NAME`` and deletes ``NAME.fill``, under the tiers'
lock. Every read of a copy, partial or whole, is still verified by the Store, so a torn or
stale byte never reaches a caller: it falls through to the origin.

Only a shard whose stored files tile it exactly (the pack format: header, then the files
back to back, with zero padding shorter than the pack's alignment before an aligned file) is
filled this way; another shard is copied whole by the placer.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from stagefs.format import Manifest, ShardHeader
from stagefs.format.spec import SHARD_HEADER
from stagefs.tiers.base import SourceUnavailable, pread_full

__all__ = ["Activity", "Extents", "ShardFill", "create_fill", "open_fill"]

FILL_SUFFIX = ".fill"
PARTIAL_SUFFIX = ".partial"


@dataclass(frozen=True)
class Extents:
    """The stored files of one shard with bytes, in offset order: [offs[i], ends[i])."""

    offs: npt.NDArray[np.int64]
    ends: npt.NDArray[np.int64]
    entries: npt.NDArray[np.int64]  # manifest entry of each extent
    tiles: bool  # header, then the extents back to back, to the shard's end

    @classmethod
    def of(cls, m: Manifest, entries: npt.NDArray[np.int64], size: int) -> Extents:
        a = m.arrays
        stored = a["stored"][entries].astype(np.int64)
        keep = stored > 0
        ents = entries[keep]
        offs = a["offset"][ents].astype(np.int64)
        ends = offs + stored[keep]
        if len(offs):
            # back to back, but for the zero padding before aligned files (shorter than the
            # alignment), which the reserved copy already holds
            gaps = offs - np.append(np.int64(SHARD_HEADER.size), ends[:-1])
            tiles = bool(ends[-1] == size and (gaps >= 0).all()
                         and (gaps < m.align.to).all())
        else:
            tiles = size == SHARD_HEADER.size
        return cls(offs, ends, ents, tiles)

    def __len__(self) -> int:
        return len(self.offs)

    def inside(self, a: int, b: int) -> tuple[int, int]:
        """Extents lying wholly inside [a, b): positions lo..hi-1."""
        return (int(np.searchsorted(self.offs, a, "left")),
                int(np.searchsorted(self.ends, b, "right")))

    def touching(self, a: int, b: int) -> tuple[int, int]:
        """Extents that overlap [a, b): positions lo..hi-1."""
        return (int(np.searchsorted(self.ends, a, "right")),
                int(np.searchsorted(self.offs, b, "left")))


_reader = threading.local()


@contextlib.contextmanager
def reading_for(ident: int) -> Iterator[None]:
    """Reads in this thread count as thread ``ident``'s (a helper thread of one batched read:
    the batch is one reader, however many threads fetch it)."""
    _reader.ident = ident
    try:
        yield
    finally:
        _reader.ident = None


_SLOT_OF: dict[int, int] = {}  # this process's reading threads -> their activity slot
_SLOT_LOCK = threading.Lock()


def _forget_slots() -> None:
    global _SLOT_LOCK
    _SLOT_OF.clear()  # a forked child is another process: its threads start anew
    _SLOT_LOCK = threading.Lock()


os.register_at_fork(after_in_child=_forget_slots)


def _slot(slots: int) -> int:
    """This reading thread's slot: the threads of one process take consecutive slots from
    one that depends on the process, so they never share one (up to ``slots`` threads) and
    processes rarely do."""
    ident = getattr(_reader, "ident", None) or threading.get_ident()
    slot = _SLOT_OF.get(ident)
    if slot is None:
        with _SLOT_LOCK:
            if len(_SLOT_OF) >= 4 * slots:  # threads come and go: start the count again
                _SLOT_OF.clear()
            slot = _SLOT_OF.setdefault(ident, (hash(os.getpid()) * 7 + len(_SLOT_OF)) % slots)
    return slot


class Activity:
    """When reads last went to the origin, and how many readers did, shared by the node's
    processes of one job (a small mapped file in the runtime dir): the placer gives way.

    Each reading thread stamps one of SLOTS slots (by process and thread; the helper threads
    of a batched read as the thread that asked, ``reading_for``) with the monotonic clock
    (the same for every process of the machine), in nanoseconds; ``clock`` (tests) replaces it.
    """

    SLOTS = 64

    def __init__(self, path: str, clock: Callable[[], int] = time.monotonic_ns) -> None:
        self._clock = clock
        size = 8 * self.SLOTS
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            if os.fstat(fd).st_size < size:
                os.ftruncate(fd, size)
            self._mm = mmap.mmap(fd, size, mmap.MAP_SHARED)
        finally:
            os.close(fd)
        self._slots = np.frombuffer(self._mm, dtype=np.int64, count=self.SLOTS)

    def touch(self) -> None:
        self._slots[_slot(self.SLOTS)] = self._clock()

    def quiet_for(self) -> float:
        """Seconds since the last origin read of any of the job's processes on this node."""
        return (self._clock() - int(self._slots.max())) / 1e9

    def readers(self, within: float) -> int:
        """Threads (of any process) that read from the origin in the last ``within`` s."""
        return int(np.count_nonzero(self._slots > self._clock() - int(within * 1e9)))

    def close(self) -> None:
        self._slots = np.zeros(self.SLOTS, np.int64)
        with contextlib.suppress(BufferError):
            self._mm.close()


class ShardFill:
    """This process's handle on one shard's partial copy in one tier."""

    def __init__(self, final: str, fd: int, fill_fd: int, ext: Extents) -> None:
        self.final = final
        self.fd = fd
        self.ext = ext
        st = os.fstat(fd)
        self.ino = (st.st_dev, st.st_ino)
        n = len(ext)
        self._mm = mmap.mmap(fill_fd, max(n, 1), mmap.MAP_SHARED) if n else None
        self.bits: npt.NDArray[np.uint8] = (np.frombuffer(self._mm, dtype=np.uint8, count=n)
                                            if self._mm is not None else np.ones(0, np.uint8))

    @property
    def partial(self) -> str:
        return self.final + PARTIAL_SUFFIX

    def covered(self, a: int, b: int) -> bool:
        """Are all bytes of [a, b) written and checked?"""
        lo, hi = self.ext.touching(a, b)
        return bool(self.bits[lo:hi].all())

    def pread(self, offset: int, length: int) -> bytes:
        if not self.covered(offset, offset + length):
            raise SourceUnavailable("not filled yet")
        try:
            data = pread_full(self.fd, length, offset)
        except OSError as exc:
            raise SourceUnavailable(f"{self.partial}: {exc.strerror}") from exc
        if len(data) != length:
            raise SourceUnavailable("short read of a partial copy")
        return data

    def write(self, offset: int, data: bytes | memoryview) -> int:
        """Write verified bytes at ``offset``; mark the files they hold whole. Returns the
        number of files newly marked."""
        lo, hi = self.ext.inside(offset, offset + len(data))
        if hi <= lo or self.bits[lo:hi].all():
            return 0
        view = memoryview(data)
        pos = offset
        while view:
            n = os.pwrite(self.fd, view, pos)
            view, pos = view[n:], pos + n
        new = int(hi - lo - np.count_nonzero(self.bits[lo:hi]))
        self.bits[lo:hi] = 1
        return new

    def mark(self, lo: int, hi: int) -> None:
        self.bits[lo:hi] = 1

    def complete(self) -> bool:
        return bool(self.bits.all())

    def linked(self) -> bool:
        """Is this still the partial copy the tier names (not dropped, not finished)?"""
        try:
            st = os.stat(self.partial)
        except FileNotFoundError:
            return False
        return (st.st_dev, st.st_ino) == self.ino

    def close(self) -> None:
        self.bits = np.ones(0, np.uint8)
        if self._mm is not None:
            with contextlib.suppress(BufferError):
                self._mm.close()
        with contextlib.suppress(OSError):
            os.close(self.fd)


def open_fill(final: str, size: int, ext: Extents) -> ShardFill | None:
    """Open an existing partial copy, or None if there is none (or it is not a whole one)."""
    try:
        fd = os.open(final + PARTIAL_SUFFIX, os.O_RDWR | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    try:
        ffd = os.open(final + FILL_SUFFIX, os.O_RDWR | os.O_CLOEXEC)
    except FileNotFoundError:
        os.close(fd)
        return None
    try:
        if os.fstat(fd).st_size != size or os.fstat(ffd).st_size != len(ext):
            os.close(fd)
            return None
        return ShardFill(final, fd, ffd, ext)
    except BaseException:
        os.close(fd)
        raise
    finally:
        os.close(ffd)


def create_fill(final: str, size: int, ext: Extents, index: int, pack_id: bytes, *,
                reserve: bool = True) -> ShardFill:
    """Create (replacing any leftover) the partial copy and its fill map; the caller holds
    the tiers' lock and checked the room. With ``reserve`` the space is allocated now
    (``fallocate``: a disk tier), and ENOSPC shows up here with nothing left behind; in
    memory the file is left sparse (allocating would zero pages the reads are about to
    write: 4 ms per 16 MiB on the critical path), and a full file system shows up as the
    write's ENOSPC, which stops the tier."""
    partial, fmap = final + PARTIAL_SUFFIX, final + FILL_SUFFIX
    for p in (fmap, partial):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(p)
    fd = ffd = -1
    try:
        fd = os.open(partial, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        if reserve:
            _reserve(fd, size)
        else:
            os.ftruncate(fd, size)
        header = ShardHeader(index, pack_id, size - SHARD_HEADER.size).encode()
        os.pwrite(fd, header, 0)
        ffd = os.open(fmap, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        os.ftruncate(ffd, len(ext))
        fill = ShardFill(final, fd, ffd, ext)
    except BaseException:
        if fd >= 0:
            os.close(fd)
        for p in (fmap, partial):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(p)
        raise
    finally:
        if ffd >= 0:
            os.close(ffd)
    return fill


def remove_fill(final: str) -> None:
    for suffix in (FILL_SUFFIX, PARTIAL_SUFFIX):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(final + suffix)


def _reserve(fd: int, size: int) -> None:
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            raise
        os.ftruncate(fd, size)
