"""Clairvoyant read-ahead: the bytes of the samples a rank will ask for next, read into
memory ahead of use by a few threads, never holding more than a byte budget.

The sampler knows the order; the reader is passed in as a function (sample indices → their
bytes), so this module knows nothing of stores or torch. Bytes are held until taken once;
a sample asked for before its read-ahead started is simply read by the caller.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Self

import numpy as np
import numpy.typing as npt

__all__ = ["PrefetchStats", "Prefetcher", "TierAhead", "TierAheadStats"]

Reader = Callable[[Sequence[int]], list[bytes] | tuple[list[bytes], Callable[[], None]]]
"""Sample indices → their bytes; or their bytes and a function that counts them as read
(``Store.read_ahead``), which the Prefetcher calls once the first of them is taken."""


@dataclass
class PrefetchStats:
    hits: int = 0  # samples served from read-ahead
    misses: int = 0  # samples the caller had to read itself
    waits: int = 0  # takes that waited for a read already in flight
    read: int = 0  # samples read ahead
    bytes_read: int = 0
    errors: int = 0  # read-ahead reads that failed (the caller then reads, and sees the error)
    peak_bytes: int = 0  # the most bytes held or reserved at once


class _Ahead:
    """What the two read-aheads share: an order, a byte budget, ``threads`` threads that
    claim ``chunk`` samples at a time, the consumer's and the producers' positions."""

    thread_name = "stagefs-ahead"

    def __init__(self, order: npt.NDArray[np.int64], budget: int, chunk: int,
                 threads: int) -> None:
        if budget <= 0:
            raise ValueError(f"prefetch budget must be positive, not {budget}")
        self.budget, self.chunk, self.nthreads = budget, max(1, chunk), max(1, threads)
        self.order = np.asarray(order, dtype=np.int64)
        self.pid = os.getpid()
        self._cv = threading.Condition()
        self._pos = 0  # the consumer's position in order
        self._next = 0  # the producers' position in order
        self._closed = False
        self._threads: list[threading.Thread] = []

    @property
    def started(self) -> bool:
        """Whether ``start`` started the threads."""
        return bool(self._threads)

    def start(self) -> Self:
        if not self._threads and not self._closed:
            for k in range(self.nthreads):
                t = threading.Thread(target=self._run, name=f"{self.thread_name}-{k}",
                                     daemon=True)
                t.start()
                self._threads.append(t)
        return self

    def _run(self) -> None:
        raise NotImplementedError

    def _on_close(self) -> None:
        """Under the lock, as the read-ahead closes."""

    def close(self, *, wait: bool = True) -> None:
        """Stop; ``wait``: until the reads under way have ended (else they end on their
        own, and nothing more is read)."""
        with self._cv:
            self._closed = True
            self._on_close()
            self._cv.notify_all()
        if not wait:
            return
        for t in self._threads:
            if t is not threading.current_thread():
                t.join(timeout=10)


class Prefetcher(_Ahead):
    """Read ``order``'s samples ahead of ``take``, within ``budget`` bytes.

    ``sizes[i]`` is sample i's size in memory. Reads are claimed in order, ``chunk`` samples
    at a time, by ``threads`` threads; a claim reserves its bytes first, so the bytes held
    plus the bytes being read never exceed ``budget`` (a sample larger than the whole budget
    is never read ahead). ``take(i)`` must be called in ``order``'s order. A reader that
    returns a count with the bytes (``Reader``) has a chunk's samples counted when the
    first of them is taken: a loop left early has counted the chunk it was in, not the
    budget's worth read ahead and never handed out.
    """

    thread_name = "stagefs-prefetch"

    def __init__(self, read: Reader, sizes: npt.NDArray[np.int64], order: npt.NDArray[np.int64],
                 budget: int, *, chunk: int = 16, threads: int = 4) -> None:
        super().__init__(order, budget, chunk, threads)
        self.stats = PrefetchStats()
        self._read, self._sizes = read, sizes
        self._ready: dict[int, bytes] = {}
        self._pending: set[int] = set()
        self._used = 0
        self._uncounted: dict[int, Callable[[], None]] = {}  # sample -> its chunk's count

    @property
    def used(self) -> int:
        """Bytes held or reserved now."""
        return self._used

    def follows(self, i: int) -> bool:
        """Whether sample ``i`` is the next one of ``order`` (the next ``take``'s)."""
        with self._cv:
            return self._pos < len(self.order) and int(self.order[self._pos]) == i

    def take(self, i: int) -> bytes | None:
        """Sample ``i``'s bytes if read ahead (waiting for a read in flight), else None."""
        with self._cv:
            self._pos += 1
            if i in self._pending:
                self.stats.waits += 1
                while i in self._pending and not self._closed:
                    self._cv.wait(0.1)
            data = self._ready.pop(i, None)
            if data is None:
                self.stats.misses += 1
                self._cv.notify_all()  # the producers may now skip ahead
                return None
            self._used -= len(data)
            self.stats.hits += 1
            self._cv.notify_all()
            counted = self._uncounted.pop(i, None)
        if counted is not None:
            counted()  # (the chunk's others were handed the same function: it counts once)
        return data

    def _claim(self) -> list[int] | None:
        """Under the lock: reserve the next chunk, or None when there is nothing left."""
        n = len(self.order)
        while not self._closed:
            self._next = max(self._next, self._pos)
            claim: list[int] = []
            need = 0
            while self._next < n and len(claim) < self.chunk:
                i = int(self.order[self._next])
                size = int(self._sizes[i])
                if i in self._ready or i in self._pending or i in claim or size > self.budget:
                    self._next += 1
                    continue
                if self._used + need + size > self.budget:
                    break
                claim.append(i)
                need += size
                self._next += 1
            if claim:
                self._used += need
                self.stats.peak_bytes = max(self.stats.peak_bytes, self._used)
                self._pending.update(claim)
                return claim
            if self._next >= n:
                return None
            self._cv.wait(0.02)  # the budget is full: wait
        return None

    def _run(self) -> None:
        while True:
            with self._cv:
                claim = self._claim()
            if claim is None:
                return
            counted: Callable[[], None] | None = None
            try:
                got = self._read(claim)
                datas: list[bytes] | None = got[0] if isinstance(got, tuple) else got
                counted = got[1] if isinstance(got, tuple) else None
            except Exception:  # the caller reads it again and sees the error itself
                datas = None
            with self._cv:
                for k, i in enumerate(claim):
                    self._pending.discard(i)
                    reserved = int(self._sizes[i])
                    data = datas[k] if datas is not None else None
                    if data is None or self._closed or len(data) != reserved:
                        self.stats.errors += data is None
                        self._used -= reserved
                        continue
                    self._ready[i] = data
                    if counted is not None:
                        self._uncounted[i] = counted
                    self.stats.read += 1
                    self.stats.bytes_read += reserved
                self._cv.notify_all()

    def _on_close(self) -> None:
        self._ready.clear()
        self._uncounted.clear()  # read, never handed out: not counted

    def close(self, *, wait: bool = True) -> None:
        super().close(wait=wait)
        self._used = 0

    def __repr__(self) -> str:
        return (f"<Prefetcher {self._pos}/{len(self.order)} taken, {self._used} of "
                f"{self.budget} bytes, {self.stats}>")


@dataclass
class TierAheadStats:
    read: int = 0  # samples read ahead into the tiers
    bytes_read: int = 0
    skipped: int = 0  # samples the consumer reached before the read-ahead did
    errors: int = 0  # reads that failed (the worker that reads the sample sees the error)


class TierAhead(_Ahead):
    """Read ``order``'s samples ahead of the consumer into the node's tiers (for DataLoader
    workers): a Store with tiers writes every sample it reads from the origin into the
    shard's copy in a tier, where the workers then find it. Nothing is held in this
    process; the bytes between the consumer's position and the read-ahead's stay within
    ``budget``.

    ``read(indices)`` reads the samples through the store (its result is dropped).
    ``advance(pos)``: the consumer has reached position ``pos`` of ``order``. The Sampler
    never advances it: it reads the epoch's first ``budget`` bytes before the loop starts,
    and is stopped then. ``room()``: whether the tiers still take what is read; once they do
    not, reading ahead stops (what it read would be read again by the workers: with a tier
    of a tenth of the dataset, the first epoch read 1.6 times the dataset from the origin).
    """

    thread_name = "stagefs-tier-ahead"

    def __init__(self, read: Callable[[Sequence[int]], object], sizes: npt.NDArray[np.int64],
                 order: npt.NDArray[np.int64], budget: int, *, chunk: int = 16,
                 threads: int = 4, room: Callable[[], bool] = lambda: True) -> None:
        super().__init__(order, budget, chunk, threads)
        self._cum = np.concatenate([[0], np.cumsum(np.asarray(sizes)[self.order])])
        self.stats = TierAheadStats()
        self._read = read
        self._room = room

    def ahead_bytes(self) -> int:
        """Bytes claimed ahead of the consumer now."""
        return int(self._cum[max(self._next, self._pos)] - self._cum[self._pos])

    def advance(self, pos: int) -> None:
        with self._cv:
            if pos > self._pos:
                self._pos = pos
                self._cv.notify_all()

    def _claim(self) -> tuple[list[int], int] | None:
        n = len(self.order)
        while not self._closed:
            if self._next < self._pos:
                self.stats.skipped += self._pos - self._next
                self._next = self._pos
            if self._next >= n or not self._room():
                return None
            stop = min(n, self._next + self.chunk)
            limit = self._cum[self._pos] + self.budget  # the furthest byte we may reach
            stop = min(stop, int(np.searchsorted(self._cum, limit, "right")) - 1)
            if stop > self._next:
                claim = [int(i) for i in self.order[self._next : stop]]
                nbytes = int(self._cum[stop] - self._cum[self._next])
                self._next = stop
                return claim, nbytes
            self._cv.wait()  # the budget is used: wait for the consumer (advance) or close
        return None

    def _run(self) -> None:
        while True:
            with self._cv:
                claim = self._claim()
            if claim is None:
                return
            try:
                self._read(claim[0])
            except Exception:
                self.stats.errors += 1
                continue
            self.stats.read += len(claim[0])
            self.stats.bytes_read += claim[1]

    def __repr__(self) -> str:
        return (f"<TierAhead {self._next}/{len(self.order)} read ahead, consumer at "
                f"{self._pos}, {self.ahead_bytes()} of {self.budget} bytes, {self.stats}>")
