"""Shared partial copies, held in pieces: a tier copy of a shard fills as reads pass.

In the first epoch every sample is read once from the origin. Each verified read also writes
its bytes into the shard's copy in a tier, so the epoch places the data as a side effect and
the background placer only copies what no read brought in (its "gaps"). Every origin byte is
then read once (MONARCH's placement during the first epoch).

The unit of placement is a **piece** (docs/decisions/0015-pieces.md): the extents of a
shard whose first byte lies in one window of ``piece_size`` bytes (the manifest's checksum
piece, 1 MiB as packed today) after the header. An **extent** is a stored file, or one
checksum piece of a raw file larger than a piece (``Extents``): each is checked on its own,
so a large file is placed, read and held piece by piece. A piece is reserved in one tier (its room
counted) before any of its bytes are written there, and stays there: a tier of a piece or more
holds a share of the dataset, and a shard may have pieces in several tiers (one partial
copy in each).

Files beside the shard's final name in a tier, shared by every process of the node:

- ``NAME.partial``: a sparse file of the shard's full size; its 64-byte header is written
  when it is created (it follows from the manifest). Each piece's bytes are allocated
  (``fallocate``) when the piece is reserved.
- ``NAME.fill``: one byte per extent of the shard, in offset order (files of size 0 are
  left out), then one byte per piece. An extent's byte is 1 once its bytes are in
  ``NAME.partial`` and were checked against the manifest's checksum (the file's, or the
  piece's; set only after they are written); a piece's byte is 1 once the piece is
  reserved in this copy.

The copy is complete when every extent's byte is 1 (every piece is here); whoever sets the
last one (a reader or the placer) renames ``NAME.partial`` to ``NAME`` and deletes
``NAME.fill``, under the tiers' lock. A copy whose tier had no room for all its pieces stays
partial and serves the pieces it holds. Every read of a copy, partial or whole, is still
verified by the Store, so a torn or stale byte never reaches a caller: it falls through to
the next holder.

Only a shard whose stored files tile it exactly (the pack format: header, then the files
back to back, with zero padding shorter than the pack's alignment before an aligned file) is
filled this way; another shard is not placed.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from stagefs._fsutil import InUse, open_own_file, pwrite_all, write_out
from stagefs.format import KIND_FILE, NO_INDEX, Manifest, ShardHeader
from stagefs.format.spec import SHARD_HEADER
from stagefs.tiers.base import (
    DESCRIPTORS,
    CopyLetGo,
    DamagedCopy,
    SourceUnavailable,
    pread_full,
)

__all__ = ["Activity", "Extents", "ShardFill", "create_fill", "open_fill", "placement_piece",
           "usual_piece"]

FILL_SUFFIX = ".fill"
PARTIAL_SUFFIX = ".partial"
PLACEMENT_WINDOWS = 512
"""A dataset spans at least this many placement pieces where it can (``placement_piece``)."""
MIN_PLACEMENT_PIECE = 64 * 1024


def placement_piece(m: Manifest) -> int:
    """The window of a placement piece for ``m``'s dataset: its checksum piece (1 MiB as
    packed today), halved while the shards span fewer than ``PLACEMENT_WINDOWS`` windows, to
    no less than ``MIN_PLACEMENT_PIECE`` (halves of it: it nests in the checksum grid).
    A tier loses up to about one piece of its capacity (the first that does not fit stops
    it): with 1 MiB pieces, a 2 MB tier of a 4 MB dataset held one piece and epochs 2 on
    read 47% more than D - C from the origin. At least 512 pieces keep that under 0.4% of
    D per tier, and their cost (a lock and an ``fallocate`` each) under a few milliseconds
    for the whole dataset. The same for every process: it follows from the manifest."""
    got = _PLACEMENT.get(m)
    if got is not None:
        return got
    piece = m.piece_size
    total = sum(s.size for s in m.shards)
    while piece % 2 == 0 and piece // 2 >= MIN_PLACEMENT_PIECE and \
            total < PLACEMENT_WINDOWS * piece:
        piece //= 2
    _PLACEMENT[m] = piece
    return piece


def usual_piece(m: Manifest, window: int) -> int:
    """The most a piece of ``m``'s usual files takes in windows of ``window`` bytes: a
    window and its last file's overhang (the median stored file, in files smaller than a
    window), or one file (larger ones; a raw file larger than a checksum piece is placed by
    checksum piece). A piece larger than this that does not fit in a tier is passed over
    while one of this size still fits; one of this size that does not stops the tier
    (``TierChain._reserve_one``). Counted by the window alone, a tier of 64 KiB windows and
    200 KB files was never full: every piece was larger than a window, and a window fitted."""
    a = m.arrays
    files = np.flatnonzero((a["kind"] == KIND_FILE) & (a["stored"] > 0))
    if not len(files):
        return window
    step = max(1, len(files) // 65536)  # a sample: the median of 10 M files costs 0.3 s
    f = min(int(np.median(a["stored"][files[::step]])), m.piece_size)
    return window + f if f <= window else f


_PLACEMENT: weakref.WeakKeyDictionary[Manifest, int] = weakref.WeakKeyDictionary()


@dataclass(frozen=True)
class Extents:
    """The stored byte runs of one shard that are checked on their own, in offset order:
    [offs[i], ends[i]). Each is a whole stored file (``part[i] == -1``), or one checksum
    piece of a raw file larger than a piece that has piece checksums (``part[i] == k``: its
    raw bytes [k * P, (k + 1) * P), checked against ``manifest.piece_sums(e)[k]``), so that a
    large file is placed, reserved and read piece by piece like the small ones. And the
    placement pieces they form: piece ``piece[i]`` holds extent i; piece p is extents
    ``pstart[p]`` to ``pstart[p + 1] - 1``."""

    offs: npt.NDArray[np.int64]
    ends: npt.NDArray[np.int64]
    entries: npt.NDArray[np.int64]  # manifest entry of each extent
    part: npt.NDArray[np.int64]  # -1: the whole file; k: its k-th checksum piece
    tiles: bool  # header, then the extents back to back, to the shard's end
    piece: npt.NDArray[np.int64]
    pstart: npt.NDArray[np.int64]

    @classmethod
    def of(cls, m: Manifest, entries: npt.NDArray[np.int64], size: int,
           piece_size: int | None = None) -> Extents:
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
        offs, ends, ents, part = _split(m, ents, offs, ends)
        # an extent belongs to the piece window its first byte lies in; empty windows
        # (inside a large compressed file) are skipped, so pieces are numbered 0.. with no gap
        window = (offs - SHARD_HEADER.size) // (piece_size or placement_piece(m))
        new = np.ones(len(offs), bool)
        new[1:] = window[1:] != window[:-1]
        piece = np.cumsum(new, dtype=np.int64) - 1
        pstart = np.append(np.flatnonzero(new), len(offs)).astype(np.int64)
        return cls(offs, ends, ents, part, tiles, piece, pstart)

    def whole(self, lo: int, hi: int, keep: npt.NDArray[np.bool_] | None = None
              ) -> npt.NDArray[np.int64]:
        """The entries of the files extents lo..hi-1 hold whole (each extent of them marked
        by ``keep``): a file stored as one extent, or a file cut in checksum pieces whose
        first and last piece are both among them (a file of 1-4 MiB a stream read in one
        run; only files of one extent were named, so a FUSE mount pushed none of those)."""
        if hi <= lo:
            return self.entries[lo:lo]
        part = self.part[lo:hi]
        first = part <= 0  # a file's first (or only) extent
        after = int(self.part[hi]) if hi < len(self.part) else -1
        last = np.append(part[1:], after) <= 0  # a file's last (or only) extent
        group = np.cumsum(first)  # the file of each extent: 0 for one begun before lo
        n = int(group[-1]) + 1
        ends = np.bincount(group, weights=last, minlength=n) > 0
        spoilt = (np.zeros(n, bool) if keep is None
                  else np.bincount(group, weights=~keep, minlength=n) > 0)
        good = ends & ~spoilt
        good[0] = False
        return self.entries[lo:hi][first & good[group]]

    def file_end(self, i: int) -> int:
        """Where the file of extent ``i`` ends in the shard: its last piece's end."""
        j = i
        while j + 1 < len(self.part) and self.part[j + 1] > 0:
            j += 1
        return int(self.ends[j])

    def one_file(self, lo: int, hi: int) -> bool:
        """Are extents lo..hi-1 (some) pieces of one file?"""
        return hi > lo and (hi == lo + 1 or (self.entries[lo] == self.entries[hi - 1]
                                             and self.part[lo] >= 0))

    def __len__(self) -> int:
        return len(self.offs)

    @property
    def pieces(self) -> int:
        return len(self.pstart) - 1

    def span(self, p: int) -> tuple[int, int]:
        """The bytes [a, b) of piece ``p`` in the shard."""
        return int(self.offs[self.pstart[p]]), int(self.ends[self.pstart[p + 1] - 1])

    def piece_at(self, offset: int) -> int:
        """The first piece that starts at or after ``offset`` (``pieces`` if none does)."""
        starts = self.offs[self.pstart[:-1]]
        return int(np.searchsorted(starts, offset, "left"))

    def at(self, offset: int) -> int:
        """The extent starting at ``offset`` (-1 if none does)."""
        k = int(np.searchsorted(self.offs, offset))
        return k if k < len(self.offs) and self.offs[k] == offset else -1

    def sizes(self) -> npt.NDArray[np.int64]:
        """Bytes of each piece."""
        return self.ends[self.pstart[1:] - 1] - self.offs[self.pstart[:-1]]

    def charged(self, held: npt.NDArray[np.bool_], block: int) -> int:
        """What a tier counts for a copy holding the pieces ``held``: the blocks of
        ``block`` bytes they occupy (a file system allocates whole pages or blocks). Each
        piece is counted from the block after the one the piece before it ends in (so the
        padding between them, and the header before the first, which a copy holds too) to
        the end of the block it ends in, and a run of pieces that starts after one not held
        one more block, the one it shares with that piece: a copy never occupies more than
        it is counted, and a whole copy is counted the same however it was made
        (``whole_charge``). Counted by the pieces' bytes alone, a tier went over its
        capacity by the blocks their ends share (0.2% of a 40 MiB tier), and a whole copy
        freed more than it had been counted."""
        if not self.pieces:
            return 0
        b = self.ends[self.pstart[1:] - 1]
        up = (b + block - 1) // block * block
        part = np.diff(np.concatenate([np.zeros(1, np.int64), up]))
        shared = np.zeros(self.pieces, bool)
        shared[1:] = held[1:] & ~held[:-1] & (b[:-1] % block != 0)
        return int(part[held].sum()) + block * int(shared.sum())

    def added(self, held: npt.NDArray[np.uint8] | None, p: int, block: int) -> int:
        """What ``charged`` grows by when piece ``p`` joins the pieces ``held`` (a copy's
        reservation bytes; None: none), without counting the whole copy again: a reservation
        counted so took 37 us in shards of 256 pieces (``charged`` twice), a tenth of a
        small dataset's first epoch from the page cache."""
        if held is not None and held[p]:
            return 0
        ps, ends = self.pstart, self.ends

        def up(i: int) -> int:  # the end of the block piece i ends in
            return -(-int(ends[ps[i + 1] - 1]) // block) * block

        n = self.pieces
        grow = up(p) - (up(p - 1) if p else 0)
        if p and not (held is not None and held[p - 1]) and int(ends[ps[p] - 1]) % block:
            grow += block  # a run begins at p: the block it shares with piece p - 1
        if p + 1 < n and held is not None and held[p + 1] and int(ends[ps[p + 1] - 1]) % block:
            grow -= block  # the run after p no longer begins after a piece not held
        return grow

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
        fd = open_own_file(path)  # (a directory or a FIFO a damaged runtime left: made anew)
        try:
            write_out(fd, size)  # (a hole in it: a SIGBUS at a stamp on a full /dev/shm)
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


def _split(m: Manifest, ents: npt.NDArray[np.int64], offs: npt.NDArray[np.int64],
           ends: npt.NDArray[np.int64]) -> tuple[npt.NDArray[np.int64], ...]:
    """The extents of these stored files: each raw file with piece checksums cut at its
    checksum pieces, every other file whole. Returns (offs, ends, entries, part)."""
    part = np.full(len(ents), -1, np.int64)
    if m.piece is None or not len(ents):
        return offs, ends, ents, part
    big = m.arrays["piece"][ents] != NO_INDEX  # raw and over one piece
    if not big.any():
        return offs, ends, ents, part
    p = m.piece_size
    count = np.where(big, (ends - offs + p - 1) // p, 1)
    first = np.repeat(np.cumsum(count) - count, count)  # each new extent's first one
    rep = np.repeat(np.arange(len(ents)), count)
    k = np.arange(len(rep), dtype=np.int64) - first
    o = offs[rep] + np.where(big[rep], k * p, 0)
    e = np.where(big[rep], np.minimum(o + p, ends[rep]), ends[rep])
    return o, e, ents[rep], np.where(big[rep], k, -1)


def map_size(ext: Extents) -> int:
    """Bytes of a shard's fill map: one per extent (a stored file, or a checksum piece of a
    large one), one per piece."""
    return len(ext) + ext.pieces


def runs_of(idx: npt.NDArray[np.int64] | Sequence[int]) -> list[tuple[int, int]]:
    """Sorted indices -> runs [a, b) of consecutive ones."""
    if not len(idx):
        return []
    cut = np.flatnonzero(np.diff(idx) != 1) + 1
    starts = np.concatenate([[0], cut])
    stops = np.concatenate([cut, [len(idx)]])
    return [(int(idx[s]), int(idx[e - 1]) + 1) for s, e in zip(starts, stops, strict=True)]


def copy_charge(ext: Extents, block: int) -> int:
    """What a partial copy is counted before any piece: the block of its header and the
    blocks of its fill map."""
    return block + -(-map_size(ext) // block) * block


def whole_charge(ext: Extents, block: int) -> int:
    """What a whole copy is counted: every piece, and the copy (``Extents.charged``)."""
    return ext.charged(np.ones(ext.pieces, bool), block) + copy_charge(ext, block)


class ShardFill:
    """This process's handle on one shard's partial copy in one tier."""

    def __init__(self, final: str, fd: int, fill_fd: int, ext: Extents) -> None:
        self.final = final
        self._fd = fd
        self._use = InUse()  # closed once no thread reads or writes through ``_fd``
        self.ext = ext
        st = os.fstat(fd)
        self.ino = (st.st_dev, st.st_ino)
        n = len(ext)
        size = map_size(ext)
        self._mm = mmap.mmap(fill_fd, size, mmap.MAP_SHARED) if size else None
        if self._mm is not None:
            self.bits: npt.NDArray[np.uint8] = np.frombuffer(self._mm, np.uint8, n)
            self.res: npt.NDArray[np.uint8] = np.frombuffer(self._mm, np.uint8, ext.pieces, n)
        else:
            self.bits = self.res = np.ones(0, np.uint8)
        DESCRIPTORS.force(DESCRIPTORS.COPY)  # given back as it is let go of (_release)

    def reserved(self, p: int) -> bool:
        """Is piece ``p`` reserved in this copy?"""
        return bool(self.res[p])

    def reserve(self, p: int, q: int | None = None) -> None:
        """Reserve piece ``p`` here (pieces ``p`` to ``q - 1``, given ``q``: one allocation;
        the caller holds the tiers' lock and counts their room, ``Extents.charged``): their
        bytes are allocated now, so a full file system shows up here (ENOSPC), before any
        byte is written, and the room the tier's file system reports is true."""
        q = p + 1 if q is None else q
        a, b = self.ext.span(p)[0], self.ext.span(q - 1)[1]
        with self.descriptor() as fd:
            _reserve(fd, a, b - a)
        self.res[p:q] = 1

    @contextlib.contextmanager
    def descriptor(self) -> Iterator[int]:
        """The copy's descriptor, not closed until the caller is done with it (``CopyLetGo``
        once this handle is closed)."""
        with self._use.use(lambda: CopyLetGo(f"{self.partial}: let go of")):
            yield self._fd

    def reserved_bytes(self, block: int) -> int:
        """What the pieces reserved in this copy are counted (``Extents.charged``)."""
        return self.ext.charged(self.res.astype(bool), block) if len(self.res) else 0

    def held_pieces(self) -> npt.NDArray[np.int64]:
        """The pieces whose every file is here."""
        if not len(self.bits):
            return np.zeros(0, np.int64)
        missing = np.zeros(self.ext.pieces, bool)
        missing[self.ext.piece[self.bits == 0]] = True
        return np.flatnonzero(~missing & self.res.astype(bool))

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
        if not self._use.enter():
            raise CopyLetGo(f"{self.partial}: let go of")
        try:
            data = pread_full(self._fd, length, offset)
        except OSError as exc:
            raise SourceUnavailable(f"{self.partial}: {exc.strerror}") from exc
        finally:
            self._use.leave()
        if len(data) != length:
            raise DamagedCopy(f"{self.partial}: short read (cut short?)")
        return data

    def reset_after_fork(self) -> None:
        self._use.reset_after_fork()

    def put(self, offset: int, data: bytes | memoryview) -> None:
        """Write bytes at ``offset``, marking nothing (their checks mark the files)."""
        with self.descriptor() as fd:
            pwrite_all(fd, data, offset)

    def write(self, offset: int, data: bytes | memoryview) -> int:
        """Write verified bytes at ``offset``; mark the files they hold whole. Returns the
        number of files newly marked."""
        lo, hi = self.ext.inside(offset, offset + len(data))
        if hi <= lo or self.bits[lo:hi].all():
            return 0
        with self.descriptor() as fd:
            pwrite_all(fd, data, offset)
        new = int(hi - lo - np.count_nonzero(self.bits[lo:hi]))
        self.bits[lo:hi] = 1
        return new

    def mark(self, lo: int, hi: int) -> None:
        self.bits[lo:hi] = 1

    def complete(self) -> bool:
        return bool(self.bits.all())

    def mine(self) -> npt.NDArray[np.bool_]:
        """Per stored file: is its piece reserved in this copy? (The files of the other
        pieces are another copy's, or no copy's.)"""
        if not len(self.bits):
            return np.zeros(0, bool)
        return self.res[self.ext.piece].astype(bool)  # type: ignore[no-any-return]

    def filled_mine(self) -> bool:
        """Is every file of the pieces reserved in this copy here?"""
        return bool(self.bits[self.mine()].all())

    def linked(self) -> bool:
        """Is this still the partial copy the tier names (not dropped, not finished), with
        its fill map (without one no other process can use it: it is let go, and deleted
        by the next reservation)?"""
        try:
            st = os.stat(self.partial)
        except FileNotFoundError:
            return False
        return (st.st_dev, st.st_ino) == self.ino and os.path.exists(self.final + FILL_SUFFIX)

    @property
    def closed(self) -> bool:
        """Let go of (``close``): nothing is read or written through this handle again."""
        return self._use.closed

    def close(self) -> None:
        """Let go of the copy: at once, or as the last thread reading or writing it is done
        (``InUse``). A thread holding the handle still (a stream between two pieces) finds
        it closed: its reads and writes raise, and its fill and reservation bytes are a
        copy of what they last were (of the copy's length, never an empty array indexed by
        the copy's files), kept in memory, not in the fill map."""
        self._use.close(self._release)

    def _release(self) -> None:
        self.bits, self.res = self.bits.copy(), self.res.copy()
        mm, self._mm = self._mm, None
        if mm is not None:  # (a view of it a thread holds still: unmapped when it is done)
            with contextlib.suppress(BufferError):
                mm.close()
        with contextlib.suppress(OSError):
            os.close(self._fd)
        DESCRIPTORS.give(DESCRIPTORS.COPY)


def open_fill(final: str, size: int, ext: Extents,
              unusable: set[str] | None = None) -> ShardFill | None:
    """Open an existing partial copy, or None if there is none (or it is not a whole one:
    cut short, its fill map gone or of another size; then ``final`` is added to
    ``unusable``)."""
    try:
        fd = os.open(final + PARTIAL_SUFFIX, os.O_RDWR | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    try:
        ffd = os.open(final + FILL_SUFFIX, os.O_RDWR | os.O_CLOEXEC)
    except FileNotFoundError:
        os.close(fd)
        if unusable is not None:
            unusable.add(final)
        return None
    try:
        if os.fstat(fd).st_size != size or os.fstat(ffd).st_size != map_size(ext):
            os.close(fd)
            if unusable is not None:
                unusable.add(final)
            return None
        return ShardFill(final, fd, ffd, ext)
    except BaseException:
        os.close(fd)
        raise
    finally:
        os.close(ffd)


def create_fill(final: str, size: int, ext: Extents, index: int, pack_id: bytes) -> ShardFill:
    """Create (replacing any leftover) the sparse partial copy and its fill map, with no
    piece reserved yet; the caller holds the tiers' lock."""
    partial, fmap = final + PARTIAL_SUFFIX, final + FILL_SUFFIX
    for p in (fmap, partial):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(p)
    fd = ffd = -1
    try:
        fd = os.open(partial, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        os.ftruncate(fd, size)
        header = ShardHeader(index, pack_id, size - SHARD_HEADER.size).encode()
        os.pwrite(fd, header, 0)
        ffd = os.open(fmap, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        # its pages written now (counted in copy_charge): a hole in it was a SIGBUS at the
        # first fill byte set once the tier's file system was full
        write_out(ffd, map_size(ext))
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


def _reserve(fd: int, offset: int, length: int) -> None:
    try:
        os.posix_fallocate(fd, offset, length)
    except OSError as exc:
        if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            raise
