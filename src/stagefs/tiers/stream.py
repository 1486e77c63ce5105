"""The cold pipeline: shards stream from the origin into their partial copies (fill.py) in
large sequential reads, several shards at once, in the order they will be needed, and a
read of a file not in a tier yet waits for the stream or, if no stream has it in flight,
reads it itself. Either way each stored file is read from the origin once.

- ``Controller``: how many shards stream at once. From ``FIRST_STREAMS`` it doubles the
  streams while the bytes read from the origin per second rise by ``GAIN`` and settles on
  the best count (a
  parallel file system gives one stream a share of its link, and more streams more of it,
  up to a point: 380 MB/s with one stream, 446 MB/s with six on the test PFS).
- ``Reservations``: who reads which stored file of a shard from the origin now. In this
  process a flag per file; across the node's processes an open-file-description lock
  (``F_OFD_SETLK``) on the file's byte in the shard's ``NAME.fill`` map. A process that ends
  drops its locks with it, so a file a dead reader held is simply free again.
- ``Stream``: the threads. Each streams one shard at a time from the queue (the sampler's
  order of first use when it gave one with ``Store.prefetch``, the latest such order
  first, else the order of the first reads, and once reads missed in a second shard the
  other shards of the directory read after them, in shard order:
  ``TierChain._plan_rest``). It reserves the
  shard's pieces in the tiers (fill.py: in the first tier with room, as many as there is
  room for; the chain counts the room), those of its first ``RESERVE_FIRST`` bytes before
  its first read and the rest after it (``_Ahead``), then reads, copy by copy, the runs of files of the
  pieces reserved there that nobody holds, ``CHUNK`` bytes a read at most (less where the
  stream is slow: a run takes about ``RUN_S``, since its files reach their readers when it
  is read), each file checked as it streams through (placer.py's check) before its fill
  byte is set; a read that fails (EIO: not a check) is tried once more after ``RETRY_S``,
  then the shard is left to its readers. A file that fails its check at the origin is
  never placed (its readers get its ChecksumError, and the shard is never whole in a
  tier); the files read with it, and the rest of the shard, stream on. A shard cut short
  at the origin keeps the whole files its short read brought. A claim per shard
  (claims.py) keeps two processes from streaming the same shard. Pieces no tier has room
  for are not streamed: their readers read them from the origin, once.
- ``StreamSource``: the holder a read of a shard not whole in a tier asks after the partial
  copies of the tiers (chain.py lists them first). A file already in the copy holding its
  piece is read from it; a file a stream (or another reader) holds is waited for, and so
  is a file the stream on its shard will reach within ``STREAM_WAIT_S`` at the rate its
  reads run (a reader's own small read would take throughput from the streams: with a
  uniform shuffle over a few shards, readers reading ahead themselves made 57% of the first
  epoch's origin bytes small reads, and the epoch ran at half the link's limit); any other
  file nobody holds is reserved (its piece too, if no copy holds it yet) and read by the
  caller itself, checked, and written into its piece's copy (a read far ahead of the
  streams does not wait for them). A file whose piece no tier has room for is refused: the origin serves
  it. The Store verifies the bytes it returns like any holder's; the read counters count
  them as the origin's (they were read from it for this epoch's reads).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import struct
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from stagefs.errors import CorruptShardError, StagefsError
from stagefs.tiers.base import CopyLetGo, DamagedCopy, ShortRead, SourceUnavailable, through
from stagefs.tiers.fill import FILL_SUFFIX, ShardFill, runs_of
from stagefs.tiers.placer import _run_verifier, _Verifier

# a listener of streamed files: the manifest entries of the whole files among them, and the
# checked runs of the shard read for them (offset in the shard, bytes)
Arrived = Callable[[npt.NDArray[np.int64], list[tuple[int, bytes]]], None]

if TYPE_CHECKING:
    from stagefs.tiers.chain import Copy, TierChain
    from stagefs.tiers.fill import Extents
    from stagefs.tiers.tier import DirTier

__all__ = ["CHUNK", "FIRST_STREAMS", "GAIN", "MIN_RUN", "MOST_STREAMS", "RUN_S", "Controller",
           "Reservations", "Stream", "StreamSource"]

log = logging.getLogger("stagefs.tiers")

CHUNK = 4 * 2**20  # bytes per sequential origin read of a stream, at most
# and a run of files is about RUN_S of the stream's measured rate, at least MIN_RUN: a
# sample's bytes reach its reader when the run they are in is read (4 MiB at a slow
# origin's 2 MB/s was 2 s), and an origin of 20 MB/s a stream or more is read CHUNK at a
# time still (runs of 50 ms cost 3-4% of a cold epoch under an 800 Mbit cap: a run's own
# work, about 1.5 ms, between two reads)
RUN_S = 0.2
MIN_RUN = 128 * 2**10
MOST_STREAMS = 8  # shards streamed at once, at most
FIRST_STREAMS = 4  # and at first (a parallel file system serves a few at least as fast as one)
GAIN = 1.02  # another stream stays if the origin's throughput rose by this factor
WINDOW_S = 0.5  # throughput is measured over windows this long
STREAM_WAIT_S = 1.0  # a read waits for a stream that brings its bytes within this long
RETRY_S = 0.5  # a stream's read that failed is tried once more after this pause
DIRECT_LIMIT = 8 * 2**20  # a reader reads a run of files itself up to this many bytes
FILE_LIMIT = 64 * 2**20  # and one file up to this size, whole, for any range of it
CLOSE_WAIT_S = 60.0  # close() waits this long at most for the stream threads to end
_POLL_S = (0.0002, 0.004)  # a reader waiting on another process polls from, up to
# a reader waits this long at most for files another reader (or stream) holds: longer, and
# the holder is stopped (kill -STOP, Ctrl-Z, a debugger); the read goes to the origin. Long
# enough for a live holder's read of a whole FILE_LIMIT file on a slow origin (64 MiB at
# 100 Mbit/s: 5.4 s; a wait cut short reads its bytes from the origin a second time). Once
# that happened, a wait lasts HOLDER_RETRY_S until one is answered again (a stopped stream
# holds a run of files: a full wait each was minutes of stall)
HOLDER_WAIT_S = 30.0
HOLDER_RETRY_S = 0.05
_LOOKS = 4  # a read looks for the copies of a shard again at most this often
# a stream reserves its shard's pieces this far into it before its first read, the rest
# after that read (_Ahead)
RESERVE_FIRST = 8 * 2**20


class _Ahead:
    """How far a stream has reserved its shard's pieces: ``next`` is the first piece it has
    not asked a tier for yet. It reserves those of the first ``RESERVE_FIRST`` bytes, reads
    its first run of them, then reserves the rest: a 64 MiB shard is 60 pieces of 1 MiB,
    each a fallocate and a count of the tier's room under the tiers' lock, and a stream that
    reserved them all before its first read began reading 0.13-0.19 s after it took the
    shard, the node's streams one after the other (the fourth 0.5 s into a cold epoch of
    1.2 s, the four the controller added later at 0.64, 0.74, 0.80 and 0.95 s). Reserved as
    it goes, a few pieces at a time, the readers ahead of it reserved most pieces
    themselves, one lock each, and the epoch took 5% more CPU. Where the tiers have no room
    for every shard streaming now, a stream reserves its shard whole first, as before, once
    it has reserved the rest of the shards whose streams began before it
    (``Stream._reserve_rest``): the shards streamed first are held whole, not a part of
    each. (The stream of the shard whose reads missed first began alone; the streams of the
    plan that queued the others a moment later reserved their shards whole before its first
    read was done, and it was held in part, those after it whole.) ``lock``: the rest is
    reserved once, by its stream or by another stream, and ``done`` only once it is."""

    def __init__(self, ext: Extents) -> None:
        self.ext = ext
        self.next = min(ext.pieces, max(1, ext.piece_at(RESERVE_FIRST)))
        self.lock = threading.Lock()

    def done(self) -> bool:
        return self.next >= self.ext.pieces


class _Gone(Exception):
    """The partial copy a read waited on was finished or dropped meanwhile."""


class Controller:
    """The number of streams, found at run time: start with ``first`` and double the count
    each window while the origin's throughput (bytes read by this process per second) rises
    by ``gain``; when a step does not pay, search between the last count that did and the
    one that did not (halving the gap each window), then settle on the best count.

    Why not start with one and add one a window: the first epoch of a small dataset is over
    in a few windows, most of it read with too few streams (5,000 files, 550 MB on the test
    PFS: 3,100 samples/s from one stream, 4,150 from four, medians of 3; one stream's
    sequential limit is 4,300). A shared file system serves four sequential streams at least
    as fast as one (several servers, or one link shared fairly), so starting there costs
    nothing where one would do. A window in which the streams were not all busy (nothing
    more to stream) says nothing and is not judged. ``clock`` is injected for tests."""

    def __init__(self, clock: Callable[[], float] = time.monotonic, *, most: int = MOST_STREAMS,
                 window: float = WINDOW_S, gain: float = GAIN,
                 first: int = FIRST_STREAMS) -> None:
        self.clock, self.most, self.window, self.gain = clock, max(1, most), window, gain
        self.target = max(1, min(first, self.most))
        self.settled = self.most == 1
        self.rates: dict[int, float] = {}  # streams -> throughput measured with them
        self._good = 0  # the best count that paid so far (0: none measured)
        self._bad: int | None = None  # the smallest count found not to pay over _good
        self._t0: float | None = None
        self._b0 = 0

    def update(self, total_bytes: int, busy: bool) -> int:
        """``total_bytes`` read from the origin so far; ``busy``: every stream had a shard
        to stream. Returns the number of streams to run now."""
        now = self.clock()
        if self._t0 is None:
            self._t0, self._b0 = now, total_bytes
            return self.target
        elapsed = now - self._t0
        if elapsed < self.window:
            return self.target
        rate = (total_bytes - self._b0) / elapsed
        self._t0, self._b0 = now, total_bytes
        if self.settled or not busy:
            return self.target
        self.rates[self.target] = rate
        if not self._good or rate >= self.rates[self._good] * self.gain:
            self._good = self.target  # it paid
        else:
            self._bad = self.target
        # double while every step paid, else halve the gap to the count that did not
        nxt = min(2 * self._good, self.most) if self._bad is None else \
            (self._good + self._bad) // 2
        if nxt <= self._good:  # nothing left to try between them (or at the ceiling)
            nxt, self.settled = self._good, True
        self.target = nxt
        return self.target


def _ofd_lock(fd: int, kind: int, start: int, length: int) -> bool:
    """Set (F_WRLCK) or clear (F_UNLCK) an open-file-description lock on bytes
    [start, start + length) of ``fd``, without waiting; False if another holds one there."""
    arg = struct.pack("hhqqi4x", kind, os.SEEK_SET, start, length, 0)
    try:
        fcntl.fcntl(fd, fcntl.F_OFD_SETLK, arg)
    except OSError as exc:
        if exc.errno in (errno.EAGAIN, errno.EACCES):
            return False
        raise
    return True


class _Held:
    """This process's reservations on one partial copy's files. Its descriptor is used and
    closed under the Reservations' lock; a thread still holding it once it is closed (a
    newer copy of the shard took its place) finds it ``closed``, and locks nothing through
    a number another file may have taken."""

    def __init__(self, fill: ShardFill) -> None:
        self.fill = fill
        self.busy = np.zeros(len(fill.ext), dtype=bool)
        self.bad = np.zeros(len(fill.ext), dtype=bool)  # failed their check at the origin
        self.fd = os.open(fill.final + FILL_SUFFIX, os.O_RDWR | os.O_CLOEXEC)
        self.closed = False
        self.replaced = False  # a newer copy's took its place: closed once none is busy

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            with contextlib.suppress(OSError):
                os.close(self.fd)


class Reservations:
    """Which files of which partial copy this process reads from the origin now; the
    other processes of the node see it as locks on the fill map (module docstring)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: dict[tuple[int, str], _Held] = {}  # (shard, copy's final path) ->
        self._replaced: list[_Held] = []  # let go of, busy still: closed at their release

    def held(self, shard: int, fill: ShardFill) -> _Held | None:
        """This process's reservation state of the shard's current partial copy in the
        tier of ``fill`` (None: its fill map is gone: the copy was finished or dropped)."""
        key = (shard, fill.final)
        with self._lock:
            h = self._held.get(key)
            if h is not None and h.fill.ino == fill.ino and not h.fill.closed:
                return h  # the same partial copy (maybe through another handle)
            if h is not None:
                self._let_go(h)
            try:
                h = _Held(fill)
            except FileNotFoundError:
                return None
            self._held[key] = h
            return h

    def take(self, h: _Held, lo: int, hi: int) -> list[tuple[int, int]] | None:
        """Reserve every file of lo..hi-1 not filled yet, in runs; None (nothing taken) if
        some of them are held by this process or another one."""
        bits = h.fill.bits
        with self._lock:
            if h.closed:
                return None
            missing = np.flatnonzero(bits[lo:hi] == 0) + lo
            if not len(missing):
                return []
            if h.busy[missing].any() or h.bad[missing].any():
                return None
            runs = runs_of(missing)
            done: list[tuple[int, int]] = []
            for a, b in runs:
                if not _ofd_lock(h.fd, fcntl.F_WRLCK, a, b - a):
                    break
                done.append((a, b))
            # looked at again once locked: another process may have filled one and let go
            # of it between the look and the lock (its bytes would come over twice)
            if len(done) < len(runs) or bits[missing].any():
                for x, y in done:
                    _ofd_lock(h.fd, fcntl.F_UNLCK, x, y - x)
                return None
            for a, b in runs:
                h.busy[a:b] = True
            return runs

    def take_next(self, h: _Held, cursor: int, limit: int) -> tuple[int, int] | None:
        """Reserve the next run from ``cursor`` of files of the pieces reserved in this copy,
        not filled and held by nobody, up to ``limit`` bytes (one file at least); None if
        there is none."""
        ext, bits = h.fill.ext, h.fill.bits
        n = len(ext)
        free = ~h.fill.mine()  # files of pieces this copy does not hold: never read here
        with self._lock:
            if h.closed:
                return None
            k = cursor
            while k < n:
                if bits[k] or h.busy[k] or h.bad[k] or free[k]:
                    k += 1
                    continue
                a = int(ext.offs[k])
                hi = k + 1
                while (hi < n and not bits[hi] and not h.busy[hi] and not h.bad[hi]
                       and not free[hi] and int(ext.ends[hi]) - a <= limit
                       and not self._cut(ext, hi, a, limit)):
                    hi += 1
                if _ofd_lock(h.fd, fcntl.F_WRLCK, k, hi - k):
                    got = k, hi
                elif hi > k + 1 and _ofd_lock(h.fd, fcntl.F_WRLCK, k, 1):
                    got = k, k + 1
                else:
                    k += 1  # another process reads it now
                    continue
                if bits[got[0] : got[1]].any():  # filled by another process since the look
                    _ofd_lock(h.fd, fcntl.F_UNLCK, got[0], got[1] - got[0])
                    continue  # looked at afresh: the run is shorter or starts later
                h.busy[got[0] : got[1]] = True
                return got
            return None

    @staticmethod
    def _cut(ext: Extents, k: int, a: int, limit: int) -> bool:
        """Would a run from offset ``a`` that took extent ``k``, a file's first checksum
        piece, end inside that file, which a run of its own holds whole? Then the run ends
        before it: a file a run brings whole is handed to the stream's listener (a FUSE
        mount pushes it into the page cache), one cut between two runs is not."""
        if ext.part[k] != 0:
            return False
        end = ext.file_end(k)
        return end - a > limit >= end - int(ext.offs[k])

    def release(self, h: _Held, lo: int, hi: int) -> None:
        with self._lock:
            if not h.closed:
                with contextlib.suppress(OSError):
                    _ofd_lock(h.fd, fcntl.F_UNLCK, lo, hi - lo)
            h.busy[lo:hi] = False
            if h.replaced:
                self._let_go(h)

    def forget(self, shard: int, fill: ShardFill) -> None:
        """The chain let go of ``fill`` (finished, dropped, or another process's doing): so
        does this process's reservation state on it, with its fill map's descriptor (kept,
        each shard a process ever filled held one until it closed: 200 shards of a memory
        tier were 200 descriptors). One on another handle still open (of the same copy, or
        of a newer one that took its inode number) is not this one's."""
        with self._lock:
            h = self._held.get((shard, fill.final))
            if h is not None and (h.fill is fill or h.fill.closed):
                del self._held[(shard, fill.final)]
                self._let_go(h)

    def _let_go(self, h: _Held) -> None:
        """A copy's reservations, replaced by a newer copy's (under the lock): closed now,
        or by the release of its last busy run (closed at once, its number was another
        thread's to lock through; kept open, it was never closed)."""
        h.replaced = True
        if not h.busy.any():
            h.close()
        elif h not in self._replaced:
            self._replaced.append(h)
        self._replaced = [r for r in self._replaced if not r.closed]

    def someone_holds(self, h: _Held, lo: int, hi: int) -> bool:
        """Is any unfilled file of lo..hi-1 being read now (by anyone)?"""
        bits = h.fill.bits
        with self._lock:
            if h.closed:
                return False
            missing = np.flatnonzero(bits[lo:hi] == 0) + lo
            if h.busy[missing].any():
                return True
            for a, b in runs_of(missing):
                if not _ofd_lock(h.fd, fcntl.F_WRLCK, a, b - a):
                    return True
                _ofd_lock(h.fd, fcntl.F_UNLCK, a, b - a)
            return False

    def reset_after_fork(self) -> None:
        """In a forked child: the parent's lock descriptions are not this process's."""
        self._lock = threading.Lock()
        for h in [*self._held.values(), *self._replaced]:
            h.close()
        self._held.clear()
        self._replaced = []

    def close(self) -> None:
        with self._lock:
            for h in [*self._held.values(), *self._replaced]:
                h.close()
            self._held.clear()
            self._replaced = []


def _own_read(a: int, b: int, one_file: bool, offset: int, end: int) -> bool:
    """Whether a reader reads the extents [a, b) itself, whole, for the range [offset, end)
    of them that it asks (none streaming them soon): extents that add up to ``DIRECT_LIMIT``
    to it, or (some checksum pieces of) one file up to ``FILE_LIMIT``. Their bytes then fill
    the copy, so the shard's stream does not read them again: a read of a few pieces of a
    9 MB file (``read``, or a FUSE mount's 1 MiB requests) read them from the origin, then
    the stream the whole file. A range of a large raw file is its checksum pieces
    (fill.Extents): only those are read, so a raw file over ``FILE_LIMIT`` read whole (or
    most of it) is read by its reader too: served past the copy, its bytes came over again
    when the stream reached them (a 70 MB file read whole by a second process, or before
    the stream began its shard: 56 MiB of a first epoch read twice). A small range of a
    larger compressed file is served from the origin as asked."""
    beyond = (b - a) - (end - offset)  # bytes read that were not asked for
    return a <= offset and end <= b and (beyond <= DIRECT_LIMIT
                                         or (one_file and b - a <= FILE_LIMIT))


class StreamSource:
    """The holder asked first for a shard not whole in a tier (module docstring)."""

    name = "stream"
    holder = "origin"  # what the read counters call it: its bytes came over for this read

    def __init__(self, stream: Stream) -> None:
        self.stream = stream

    def pread(self, shard: int, offset: int, length: int) -> bytes:
        self.stream._served.split = self.stream._served.spans = None
        return self.stream.read(shard, offset, length)

    def served_by(self) -> list[tuple[str, int]] | None:
        """The holders of this thread's last read, with their bytes, the most first (the
        read counters' split: a large file's pieces may come from a copy in each tier and
        the origin); None if not known (counted as the origin's)."""
        split: list[tuple[str, int]] | None = getattr(self.stream._served, "split", None)
        return split

    def served_spans(self) -> list[tuple[int, int, str]] | None:
        """The holder of each part of this thread's last read, ``(start, end, holder)`` in
        the shard, when it came from several (None: from one, ``served_by``'s): the
        holder of each file of a run read at once (read_entries counts each file's sample
        to the holder that gave most of its bytes)."""
        spans: list[tuple[int, int, str]] | None = getattr(self.stream._served, "spans", None)
        return spans

    def last_from(self) -> str:
        """What this thread's last read came from, for a message: the stream and the copies
        it read them in (and the origin)."""
        last = getattr(self.stream._served, "last", None)
        split = getattr(self.stream._served, "split", None) or []
        if last is None:
            return self.name
        tiers = last[1] if isinstance(last[1], list) else [(last[1], 0, 0)]
        names = list(dict.fromkeys(f"the partial copy in {t.name}" for t, _, _ in tiers
                                   if t is not None))
        if any(h == "origin" for h, _ in split):
            names.append("the origin")
        return f"{self.name} ({', '.join(names)})" if names else self.name

    def drop(self, shard: int) -> None:
        """A read found bad bytes in what this thread was given last: start the partial
        copy they came from afresh. If they came from several copies (and the origin, for
        pieces no tier holds), each copy's part is checked again and only a copy whose part
        fails is dropped, counted against its own tier."""
        chain = self.stream.chain
        last = getattr(self.stream._served, "last", None)
        copies = list(chain._fills.get(shard, ()))
        if last is not None and last[0] == shard and isinstance(last[1], list):
            parts: list[tuple[DirTier, int, int]] = last[1]
            bad = {id(t) for t, a, b in parts if not chain._intact(shard, t, a, b)}
            copies = [c for c in copies if id(c[1]) in bad]
        elif last is not None and last[0] == shard and last[1] is not None:
            copies = [c for c in copies if c[1] is last[1]]
        for k, (_, t) in enumerate(copies):
            more = k < len(copies) - 1
            chain._drop_fill(shard, t, again=not more)
            t.stats.dropped += more  # _drop_fill counts the one it places again

    def close(self) -> None:
        pass


class Stream:
    """The streams of one tier chain in this process (module docstring)."""

    def __init__(self, chain: TierChain, *, clock: Callable[[], float] = time.monotonic,
                 most: int = MOST_STREAMS) -> None:
        self.chain = chain
        self.source = StreamSource(self)
        self._clock, self._most = clock, most
        self.res = Reservations()
        # (shard, tier, or [(tier, a, b)] for several copies) of this thread's last read
        self._served = threading.local()
        # called in a stream thread with the manifest entries of the files a stream has just
        # placed and checked, before any reader asked for them, and the checked bytes it
        # read (runs of the shard: offset, bytes); the FUSE front end pushes them into the
        # kernel's page cache: read-ahead across files
        self.arrived: Arrived | None = None
        self._init()

    def _init(self) -> None:
        self.controller = Controller(self._clock, most=self._most)
        self._cond = threading.Condition()
        self._queue: deque[int] = deque()
        self._urgent: set[int] = set()  # queued shards a read waits for
        self._threads: list[threading.Thread] = []
        self._running = 0
        self._at: dict[int, int] = {}  # shard -> offset its stream (one a node) has reached
        self._ahead: dict[int, _Ahead] = {}  # shard -> its stream's reservations, in start order
        self._rate = 0.0  # bytes/s of one stream's reads, as last measured
        self._closing = False
        self._stuck = False  # a wait for another holder's files ran out (HOLDER_WAIT_S)
        self.started: list[int] = []  # shards in the order this process began streaming them

    # -- the queue ---------------------------------------------------------------------------

    def enqueue(self, shards: Iterable[int], *, urgent: bool) -> None:
        """Stream these shards, in this order: first (a read waits for one of them) or
        after those a read waits for (a prefetch: the order the sampler will need them in).
        A prefetch's order is the latest plan: the shards it names that are queued already
        move to their place in it, ahead of those an earlier plan queued and this one does
        not name (a second Sampler in the process, a new seed, streamed in the first one's
        order until that queue drained)."""
        with self._cond:
            if self._closing:
                return
            new = list(shards)
            if urgent:
                self._queue.extendleft(reversed(new))
                self._urgent.update(new)
            else:
                plan = set(new)
                self._queue = deque([s for s in self._queue if s in self._urgent]
                                    + [s for s in new if s not in self._urgent]
                                    + [s for s in self._queue
                                       if s not in self._urgent and s not in plan])
            self._grow()
            self._cond.notify_all()

    def queued(self) -> list[int]:
        with self._cond:
            return list(self._queue)

    def clear(self) -> None:
        with self._cond:
            self._queue.clear()
            self._urgent.clear()

    def idle(self) -> bool:
        with self._cond:
            return not self._queue and not self._running

    def _grow(self) -> None:
        """Under the lock: threads up to the controller's count."""
        while len(self._threads) < self.controller.target:
            k = len(self._threads)
            t = threading.Thread(target=self._run, args=(k,), name=f"stagefs-stream-{k}",
                                 daemon=True)
            self._threads.append(t)
            t.start()

    def _run(self, k: int) -> None:
        while True:
            with self._cond:
                while not self._closing and (not self._queue or k >= self.controller.target):
                    self._cond.wait(1.0)
                    self.chain._maybe_flush()
                if self._closing:
                    return
                shard = self._queue.popleft()
                self._urgent.discard(shard)
                self._running += 1
            try:
                self._stream_shard(shard)
            except Exception:  # never let a stream die silently: log and go on
                log.exception("streaming shard %d failed", shard)
                self.chain._failed.add(shard)
            finally:
                with self._cond:
                    self._running -= 1
                    self._cond.notify_all()
            self.chain._maybe_flush()

    def _tune(self) -> None:
        origin = getattr(self.chain.origin, "stats", None)
        if origin is None:
            return
        with self._cond:
            busy = bool(self._queue) and self._running >= self.controller.target
            before = self.controller.target
            if self.controller.update(origin.bytes_read, busy) != before:
                self._grow()
                self._cond.notify_all()

    # -- streaming one shard -----------------------------------------------------------------

    def _stream_shard(self, shard: int) -> None:
        chain = self.chain
        if chain._find(shard) or (chain.full and shard not in chain._fills):
            return
        if not chain.claims.acquire(shard):
            return  # another process of the node streams it; reads here wait for it
        try:
            if chain._find(shard):
                return
            ahead = _Ahead(chain._extents_of(shard))
            with self._cond:
                streaming = self._running  # this one too
                before = list(self._ahead.items())  # the streams under way, in start order
                self._ahead[shard] = ahead
            if not chain.room_for(streaming * self.chain._sizes[shard]):
                # room for a part of the shards streaming now: each reserves all its pieces
                # before its first read, so the first to come are whole (not each a part),
                # after those that began before it reserved theirs (_Ahead)
                self._reserve_rest(before)
                ahead.next = ahead.ext.pieces
            copies = chain._copies_to_fill(shard, ahead.next)
            if not copies and not ahead.done() and not chain.full:
                # no room for its first pieces (a large file's, in a tier nearly full): the
                # smaller ones after them may fit
                ahead.next = ahead.ext.pieces
                copies = chain._copies_to_fill(shard)
            if not copies:
                return  # whole, not placeable, or no tier has room for any of its pieces
            with self._cond:
                self.started.append(shard)
                self._at[shard] = 0
            try:
                done: set[str] = set()  # the copies streamed (the next tier's copy may
                # take pieces once the first is full)
                while not self._closing and not chain._find(shard):
                    rest = [c for c in chain._fills.get(shard, ()) if c[0].final not in done]
                    if not rest:
                        break
                    fill, tier = rest[0]
                    done.add(fill.final)
                    self._bulk(shard, fill, tier, ahead)
            finally:
                with self._cond:
                    self._at.pop(shard, None)
                    self._cond.notify_all()
        finally:
            with self._cond:
                self._ahead.pop(shard, None)
            chain.claims.release(shard)

    def coming(self, shard: int, offset: int) -> bool:
        """Whether a stream of this process will bring the shard's bytes at ``offset``
        within ``STREAM_WAIT_S``: it is on the shard, reading it in offset order, and is
        that close to the offset at the rate its reads have run at; or the stream another
        process of the node runs on it (its claim's), by what it published after its last
        run (a file behind it is not coming: that stream passed over it)."""
        at = self._at.get(shard)
        if at is None:
            there = self.chain.claims.progress(shard, STREAM_WAIT_S)
            if there is None:
                return False
            at, rate = there
            return at <= offset and rate > 0 and (offset - at) / rate <= STREAM_WAIT_S
        if offset <= at or not self._rate:  # behind it (held by a reader), or no rate yet
            return True
        return (offset - at) / self._rate <= STREAM_WAIT_S

    def _bulk(self, shard: int, fill: ShardFill, tier: DirTier, ahead: _Ahead) -> None:
        """Read every file of the pieces reserved in this copy that nobody has read or reads
        now, in offset order, reserving the shard's next pieces as it goes; then wait for
        the files others hold, and make the copy whole if every piece of the shard is in
        it."""
        h = self.res.held(shard, fill)
        cursor = 0
        retried = False  # the run after a failed read is read once more before giving up
        while h is not None and not self._closing and fill.linked():
            self._reserve_ahead(shard, ahead)
            if fill.filled_mine():
                if ahead.done():
                    break
                self._reserve_ahead(shard, ahead, now=True)
                continue
            run = self.res.take_next(h, cursor, self.run_bytes())
            if run is None:
                if cursor:
                    cursor = 0  # once more from the start, for what others held then
                    continue
                if h.bad[(fill.bits == 0) & fill.mine()].all():
                    break  # what is left failed its check at the origin: not placed
                with self._cond:  # others read the rest now: wait for them
                    self._cond.wait(0.005)
                continue
            t0 = self._clock()
            try:
                self._copy(shard, fill, tier, h, *run, bulk=True)
            except (OSError, StagefsError, SourceUnavailable) as exc:
                if fill.closed:  # let go of (finished, dropped): the chain has it in hand
                    return
                name = self.chain.manifest.shards[shard].name
                if retried or isinstance(exc, CorruptShardError) or not fill.linked():
                    log.warning("shard %d (%s): streaming stopped: %s", shard, name, exc)
                    self.chain._failed.add(shard)
                    return
                # a shared file system's reads fail now and then (a server failing over):
                # once more after a pause, else the shard's files were left to its readers'
                # small reads for the rest of the job
                log.info("shard %d (%s): %s; read again in %g s", shard, name, exc, RETRY_S)
                retried = True
                with self._cond:
                    self._cond.wait(RETRY_S)
                continue
            finally:
                self.res.release(h, *run)
            retried = False
            cursor = run[1]
            self._measure(shard, int(fill.ext.ends[cursor - 1]), int(fill.ext.ends[cursor - 1])
                          - int(fill.ext.offs[run[0]]), self._clock() - t0)
            self._tune()
        if fill.linked() and fill.complete():
            self.chain._finish(shard, fill, tier)

    def _reserve_ahead(self, shard: int, ahead: _Ahead, *, now: bool = False,
                       whole: bool = False) -> None:
        """Once the stream has read its first run (or ``now``), reserve the rest of the
        shard's pieces: in the first tier with room, each (chain._reserve), but those a
        reader or another process reserved meanwhile. ``whole``: its first pieces too
        (another stream's shard whose stream may not have reserved them yet:
        ``_reserve_rest``)."""
        if ahead.done() or not (now or self._at.get(shard, 0)):
            return
        chain = self.chain
        with ahead.lock:  # (another stream may reserve it: _reserve_rest)
            if ahead.done():
                return
            todo = [p for p in range(0 if whole else ahead.next, ahead.ext.pieces)
                    if chain._owner(shard, p) is None]
            if todo and not chain.full:
                chain._reserve(shard, todo)
            ahead.next = ahead.ext.pieces

    def _reserve_rest(self, before: list[tuple[int, _Ahead]]) -> None:
        """Reserve the shards of the streams that began before this one (``before``, in
        the order they began) whole: a stream about to reserve its shard whole, the tiers
        short of room for every shard streaming (``_Ahead``)."""
        for s, a in before:
            with self._cond:
                if self._ahead.get(s) is not a:  # that stream has ended meanwhile
                    continue
            self._reserve_ahead(s, a, now=True, whole=True)

    def run_bytes(self) -> int:
        """The bytes of a stream's next run of files: ``RUN_S`` of its measured rate,
        between ``MIN_RUN`` and ``CHUNK`` (``CHUNK`` until a rate is measured)."""
        if not self._rate:
            return CHUNK
        return max(MIN_RUN, min(CHUNK, int(self._rate * RUN_S)))

    def _measure(self, shard: int, at: int, nbytes: int, seconds: float) -> None:
        """A stream read ``nbytes`` of the shard in ``seconds``, up to offset ``at``."""
        self._at[shard] = at
        if seconds > 0 and nbytes >= MIN_RUN // 2:  # a short run says little of the rate
            rate = nbytes / seconds
            self._rate = rate if not self._rate else 0.75 * self._rate + 0.25 * rate
        self.chain.claims.publish(shard, at, self._rate)  # for the node's other readers

    def _copy(self, shard: int, fill: ShardFill, tier: DirTier, h: _Held, lo: int, hi: int,
              *, bulk: bool) -> bytes | None:
        """Read files lo..hi-1 (reserved by the caller) from the origin, write them into the
        partial copy, check each (setting its fill byte); the bytes read if in one read.
        A file that fails its check is marked bad here and the files read with it are
        checked and placed on; then the first such file raises CorruptShardError, but for a
        stream (``bulk``), which logs it and goes on with the shard."""
        chain = self.chain
        ext = fill.ext
        a, b = int(ext.offs[lo]), int(ext.ends[hi - 1])
        check = chain._checker(chain.origin)
        bad: list[CorruptShardError] = []

        def failed(i: int, exc: CorruptShardError) -> None:
            h.bad[i] = True
            bad.append(exc)

        verifier = _run_verifier(fill, lo, hi, chain.manifest, check,
                                 f"shard {shard} from {chain.origin.name}", failed)
        data: bytes | memoryview | None = None
        arrived = self.arrived if bulk else None
        runs: list[tuple[int, bytes]] = []
        # a stream's chunks are written and checked before the next is read, and nothing
        # keeps them: a view of the read buffer, not a copy (a listener keeps them, and a
        # reader's run is returned)
        viewed = bulk and arrived is None
        read = through(chain.origin, view=viewed)
        pos = a
        try:
            while pos < b:
                n = min(CHUNK, b - pos) if bulk else b - pos
                try:
                    data = read(shard, pos, n)
                except ShortRead as exc:  # truncated: the whole files before the cut stay
                    self._place(shard, fill, tier, verifier, pos, exc.got)
                    raise
                if arrived is not None:
                    runs.append((pos, bytes(data)))
                self._place(shard, fill, tier, verifier, pos, data)
                pos += n
            verifier.finish()
        except CorruptShardError:  # a short read: the shard is truncated
            chain.corrupt += 1
            k = verifier.i  # the file the shard ends in
            h.bad[lo + k] = True
            raise
        finally:
            with self._cond:
                self._cond.notify_all()
        good = ~h.bad[lo:hi]
        tier.stats.filled += int(good.sum())
        tier.stats.filled_bytes += b - a - int((ext.ends[lo:hi] - ext.offs[lo:hi])[~good].sum())
        if fill.complete():
            chain._finish(shard, fill, tier)
        if arrived is not None:
            try:  # the files that passed their check
                arrived(ext.whole(lo, hi, good), runs)
            except Exception:  # a listener's failure is not the stream's
                log.exception("the listener of streamed files failed")
        if bad:
            chain.corrupt += len(bad)
            if not bulk:
                raise bad[0]
            for why in bad:
                log.warning("shard %d (%s): %s; the rest of the shard streams on", shard,
                            chain.manifest.shards[shard].name, why)
        if viewed or data is None or pos - a != len(data):
            return None
        return bytes(data)  # (a copy only if a source gave a view unasked: never so far)

    def _place(self, shard: int, fill: ShardFill, tier: DirTier, verifier: _Verifier,
               pos: int, data: bytes | memoryview) -> None:
        """Write bytes read from the origin at ``pos`` into the partial copy and check them
        (each file's fill byte is set once it passed)."""
        try:
            fill.put(pos, data)
        except OSError as exc:
            self.chain._drop_fill(shard, tier, again=False)
            self.chain._tier_failed(tier, exc)
            raise SourceUnavailable(f"{tier.name}: {exc}") from exc
        verifier.feed(pos, data)

    # -- reads -------------------------------------------------------------------------------

    def read(self, shard: int, offset: int, length: int) -> bytes:
        """Bytes [offset, offset + length) of the shard, from the copies holding their
        pieces once the stream (or another reader) has them there, or read now by this
        caller."""
        chain = self.chain
        chain.in_shard(shard, offset, length)
        ext = chain._extents_of(shard)
        if not ext.tiles:
            raise SourceUnavailable("not placed in pieces")
        end = offset + length
        lo, hi = ext.touching(offset, end)
        for attempt in range(_LOOKS):
            if attempt:  # a copy was finished or dropped meanwhile: look again
                if chain._find(shard):
                    return self._from_whole(shard, offset, length, "")
                chain._look(shard)
            runs = self._owners(shard, ext, lo, hi)
            if runs is None:
                # (no look in the tiers for a whole copy on every read, the tiers full:
                # holders does; but a copy made whole since this read's holders were
                # looked up is routed, its partial copy let go of: read there, not from
                # the origin, for the bytes the stream has just brought)
                if chain.full and shard not in chain._route:
                    raise SourceUnavailable("no tier has room for its piece")
                return self._from_whole(shard, offset, length, "no tier has room for it")
            try:
                only = runs[0][2]
                if len(runs) == 1 and only is not None:
                    f, t = only
                    self._served.last = (shard, t)
                    data = self._read_in(shard, f, t, offset, length)
                    self._served.split = [(self._served.holder, length)]
                    return data
                # pieces in several tiers, or some in none (those from the origin: a large
                # file a tier holds in part); zero padding between
                out = bytearray(length)
                # each part copied into the buffer through a view: a slice of the bytearray
                # itself copies the part once more first (a whole read of a 190 MiB file,
                # 137 MiB of it from a RAM tier, held 2.44 times its size)
                into = memoryview(out)
                parts: list[tuple[DirTier, int, int]] = []
                split: dict[str, int] = {}
                spans: list[tuple[int, int, str]] = []
                for i, j, c in runs:
                    a, b = max(offset, int(ext.offs[i])), min(end, int(ext.ends[j - 1]))
                    if c is None:
                        into[a - offset : b - offset] = self._from_origin(shard, a, b - a)
                        holder = "origin"
                    else:
                        into[a - offset : b - offset] = self._read_in(shard, *c, a, b - a)
                        parts.append((c[1], a, b))
                        holder = self._served.holder
                    split[holder] = split.get(holder, 0) + b - a
                    spans.append((a, b, holder))
                self._served.last = (shard, parts)
                self._served.spans = spans
                # the padding between the runs (none between a file's pieces) to the largest
                top = max(split, key=split.__getitem__, default="origin")
                split[top] = split.get(top, 0) + length - sum(split.values())
                self._served.split = sorted(split.items(), key=lambda kv: -kv[1])
                into.release()
                return bytes(out)
            except (_Gone, CopyLetGo):  # (a handle let go of as this read used it: the same)
                continue
        raise SourceUnavailable("its partial copies kept changing under the read")

    def _owners(self, shard: int, ext: Extents, lo: int,
                hi: int) -> list[tuple[int, int, Copy | None]] | None:
        """Runs i..j-1 of the extents lo..hi-1 whose pieces one partial copy holds, with that
        copy (None: pieces no tier has room for), the pieces no copy holds reserved now where
        there is room; None if no copy holds any of them."""
        chain = self.chain
        if hi <= lo:  # the header (or padding) alone: every copy has it
            copies = chain._fills.get(shard)
            return [(lo, hi, copies[0])] if copies else None
        pieces = range(int(ext.piece[lo]), int(ext.piece[hi - 1]) + 1)
        missing = [p for p in pieces if chain._owner(shard, p) is None]
        if missing:
            if chain.full and len(missing) == len(pieces):
                # the tiers may have become full with the reservation of these very pieces
                # (a stream's, reserving ahead, after the look above: full is set after
                # them): looked at once more, else this read went to the origin for files
                # the stream was bringing (an origin byte read twice in epoch 1)
                missing = [p for p in pieces if chain._owner(shard, p) is None]
                if len(missing) == len(pieces):
                    return None
            if not chain.full and chain.may_copy(shard):
                chain._reserve(shard, missing)
        runs: list[tuple[int, int, Copy | None]] = []
        for p in pieces:
            got = chain._owner(shard, p)
            i, j = max(lo, int(ext.pstart[p])), min(hi, int(ext.pstart[p + 1]))
            if runs and (runs[-1][2] is got or (got is not None and runs[-1][2] is not None
                                                and runs[-1][2][0] is got[0])):
                runs[-1] = (runs[-1][0], j, got)
            else:
                runs.append((i, j, got))
        if all(c is None for _, _, c in runs):
            return None
        return runs

    def _read_in(self, shard: int, fill: ShardFill, tier: DirTier, offset: int,
                 length: int) -> bytes:
        """Bytes of files whose pieces ``fill`` holds: from it once they are there, waiting
        for whoever reads them, or read now by this caller; ``_Gone`` if the copy is
        finished or dropped meanwhile."""
        end = offset + length
        lo, hi = fill.ext.touching(offset, end)
        whole = hi > lo and _own_read(int(fill.ext.offs[lo]), int(fill.ext.ends[hi - 1]),
                                      fill.ext.one_file(lo, hi), offset, end)
        delay = _POLL_S[0]
        held = True  # the copy held them when asked: its tier's bytes, not the origin's
        deadline = time.monotonic() + (HOLDER_RETRY_S if self._stuck else HOLDER_WAIT_S)
        while True:
            if fill.covered(offset, end):
                if not held:
                    self._stuck = False  # waited for, and brought: holders go on again
                try:
                    data = fill.pread(offset, length)
                except DamagedCopy:
                    self.chain._drop_fill(shard, tier)  # cut short under us: placed anew
                    raise
                tier.stats.hits += 1
                tier.stats.bytes += length
                self._served.holder = tier.holder if held else "origin"
                return data
            held = False
            h = self.res.held(shard, fill)
            if h is None or not fill.linked():  # finished or dropped meanwhile
                raise _Gone
            if h.bad[lo:hi].any():
                raise SourceUnavailable("failed its check at the origin")
            if self.coming(shard, offset):
                pass  # the stream on the shard brings these bytes soon in its large
                # sequential reads: a reader's own small read would slow it down
            elif whole:
                runs = self.res.take(h, lo, hi)
                if runs == []:
                    continue  # filled since the look: read from the copy (a tier hit)
                if runs is not None:
                    self._served.holder = "origin"  # read now for this read
                    return self._read_myself(shard, fill, tier, h, runs, offset, length)
            elif not self.res.someone_holds(h, lo, hi):
                # a small range of a run of files over DIRECT_LIMIT, or of a compressed
                # file over FILE_LIMIT: the origin serves the range directly (the shard's
                # stream reads those files again)
                raise SourceUnavailable("not streamed now")
            if time.monotonic() > deadline:
                # a reservation whose holder lives but does not go on held this read (and
                # every other reader of the node) for as long as the holder stayed stopped
                if not self._stuck:
                    self._stuck = True
                    at = self._at.get(shard)
                    if h.busy[lo:hi].any() or (at is not None and offset > at):
                        # this process's own read of the origin (its stream's, or another
                        # thread's) is under way: no process is stopped, the origin is slow
                        log.warning("shard %d: bytes [%d, %d) not brought in %g s by this "
                                    "process's own read of the origin %s, which is under way "
                                    "(the shared file system is slow or stalled): read from "
                                    "the origin until reads come in again", shard, offset,
                                    end, HOLDER_WAIT_S, self.chain.origin_path)
                    else:
                        log.warning("shard %d: bytes [%d, %d) held by a reader that has not "
                                    "brought them in %g s (a process of this job stopped? "
                                    "kill -CONT it, or end it): read from the origin until "
                                    "holders go on", shard, offset, end, HOLDER_WAIT_S)
                raise SourceUnavailable("held by a reader that does not go on")
            with self._cond:
                self._cond.wait(delay)
            delay = min(2 * delay, _POLL_S[1])

    def _from_origin(self, shard: int, offset: int, length: int) -> bytes:
        """Bytes of pieces no tier has room for, read from the origin for this read (the
        Store checks the whole read)."""
        chain = self.chain
        chain.misses += 1
        chain.activity.touch()
        try:
            return chain.origin.pread(shard, offset, length)
        except (OSError, StagefsError) as exc:  # the Store asks the origin itself next
            raise SourceUnavailable(f"origin read of shard {shard}: {exc}") from exc

    def _from_whole(self, shard: int, offset: int, length: int, why: str) -> bytes:
        """The shard became whole in a tier meanwhile (its last file came in): read it
        there; else (no tier has room for it) the origin serves it."""
        chain = self.chain
        if not chain._find(shard):
            raise SourceUnavailable(why)
        whole = chain._route[shard][0]
        data = whole.pread(shard, offset, length)
        self._served.split = [(getattr(whole, "holder", "origin"), length)]
        return data

    def _read_myself(self, shard: int, fill: ShardFill, tier: DirTier, h: _Held,
                     runs: list[tuple[int, int]], offset: int, length: int) -> bytes:
        chain = self.chain
        chain.misses += 1
        chain.activity.touch()
        one: bytes | None = None
        try:
            for lo, hi in runs:
                one = self._copy(shard, fill, tier, h, lo, hi, bulk=False)
        except (OSError, StagefsError) as exc:
            raise SourceUnavailable(f"origin read of shard {shard}: {exc}") from exc
        finally:
            for lo, hi in runs:
                self.res.release(h, lo, hi)
        if len(runs) == 1 and one is not None and len(one) == length and \
                int(fill.ext.offs[runs[0][0]]) == offset:
            return one
        return fill.pread(offset, length)

    # -- lifecycle ---------------------------------------------------------------------------

    def close(self) -> None:
        with self._cond:
            self._closing = True
            self._queue.clear()
            self._cond.notify_all()
            threads = list(self._threads)
        # one wait for them all: a stream stuck on a stalled origin keeps close() waiting
        # CLOSE_WAIT_S at most, not that long for each stuck stream one after the other
        deadline = self._clock() + CLOSE_WAIT_S
        for t in threads:
            if t is not threading.current_thread():
                t.join(timeout=max(0.0, deadline - self._clock()))
        self.res.close()

    def after_fork(self) -> None:
        """In a forked child: no stream thread was copied; the parent's claims and lock
        descriptions stay the parent's."""
        self._init()
        self.res.reset_after_fork()
