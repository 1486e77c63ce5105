"""One batch of ranges over many holders: split per holder, every part in flight at once,
one deadline for the whole batch, per-range fallback.

``send_all`` is the mechanism (each part a call in a thread of its own, all started before
any is waited for, what has not answered by the deadline left behind); ``Fanout.read`` the
policy for ranges: each range goes to the first live holder of its shard, a range a holder
did not give goes to the shard's next holder in another round while the deadline allows,
and a range no one gave in time is None, so the caller's own next holder (a reader's: the
origin) answers it. The node daemon relays its readers' batches with it
(cluster/daemon.py); a holder is anything with ``pread_many`` and ``is_down`` (HedgedPeer).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, fields
from typing import Any, Protocol, TypeVar, cast

from stagefs.net.pipes import Piped, PipePool
from stagefs.tiers.base import SourceUnavailable

__all__ = ["BatchHolder", "Fanout", "FanoutStats", "send_all"]

H = TypeVar("H")
I = TypeVar("I")  # noqa: E741 - the items of a part
R = TypeVar("R")

Ranges = Sequence[tuple[int, int, int]]


class BatchHolder(Protocol):
    name: str

    def pread_many(self, ranges: Ranges) -> list[bytes | None]: ...
    def is_down(self) -> bool: ...


class RelayHolder(BatchHolder, Protocol):
    def pread_relayed(self, ranges: Ranges, into: PipePool) -> list[bytes | Piped | None]: ...


@dataclass
class FanoutStats:
    batches: int = 0
    ranges: int = 0
    parts: int = 0  # requests sent: one per holder per round
    peak_parts: int = 0  # the most parts of one round in flight at once
    rounds: int = 0  # rounds after the first: ranges sent on to another holder
    late: int = 0  # parts not answered by their batch's deadline
    missing: int = 0  # ranges no holder gave in time
    skipped: int = 0  # ranges every holder of which was down (suspect): none was asked

    def as_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def send_all(parts: Sequence[tuple[H, I]], call: Callable[[H, I], R],
             pool: ThreadPoolExecutor, timeout: float | None
             ) -> list[tuple[bool, R | None]]:
    """``call(holder, items)`` for every part, all submitted before any is waited for;
    wait until all have answered or ``timeout`` seconds passed. Per part: (answered, what
    it returned); a part that raised SourceUnavailable or was still out is (False, None).
    Any other exception is raised, once every part has been seen."""
    futures: list[Future[R]] = [pool.submit(call, h, items) for h, items in parts]
    wait(futures, timeout)
    out: list[tuple[bool, R | None]] = []
    error: BaseException | None = None
    for f in futures:
        if not f.done():
            out.append((False, None))
            continue
        exc = f.exception()
        if exc is None:
            out.append((True, f.result()))
        else:
            out.append((False, None))
            if not isinstance(exc, SourceUnavailable) and error is None:
                error = exc
    if error is not None:
        raise error
    return out


class Fanout:
    """Read batches of ranges from the holders of their shards, every holder's part at
    once; one per process (its threads are made in the process that uses them)."""

    def __init__(self, threads: int = 256) -> None:
        self.threads = threads
        self.stats = FanoutStats()
        self._lock = threading.Lock()
        self._pool: tuple[int, ThreadPoolExecutor] | None = None

    def _executor(self) -> ThreadPoolExecutor:
        got = self._pool
        if got is None or got[0] != os.getpid():
            with self._lock:
                got = self._pool
                if got is None or got[0] != os.getpid():
                    got = self._pool = (os.getpid(), ThreadPoolExecutor(
                        self.threads, thread_name_prefix="stagefs-fanout"))
        return got[1]

    def read(self, ranges: Ranges, holders: Callable[[int], Sequence[BatchHolder]],
             timeout: float) -> list[bytes | None]:
        """The bytes of each (shard, offset, length) from the holders ``holders(shard)``
        names, or None where none gave them within ``timeout`` seconds of the call."""
        return self._read(ranges, holders, timeout, lambda h, r: h.pread_many(r))

    def relay(self, ranges: Ranges, holders: Callable[[int], Sequence[RelayHolder]],
              timeout: float, into: PipePool | None) -> list[bytes | Piped | None]:
        """``read`` for a relay: each range in pipes of ``into`` where it can be (sent on
        without a copy: net/pipes.py), else in memory (all of them if ``into`` is None)."""
        if into is None:
            return self._read(ranges, holders, timeout, lambda h, r: h.pread_many(r))
        return self._read(ranges, holders, timeout,
                          lambda h, r: cast("RelayHolder", h).pread_relayed(r, into))

    def _read(self, ranges: Ranges, holders: Callable[[int], Sequence[BatchHolder]],
              timeout: float, call: Callable[[BatchHolder, Ranges], list[Any]]
              ) -> list[Any]:
        st = self.stats
        st.batches += 1
        st.ranges += len(ranges)
        end = time.monotonic() + timeout
        out: list[Any] = [None] * len(ranges)
        tried: list[set[int]] = [set() for _ in ranges]
        todo = list(range(len(ranges)))
        first = True
        while todo:
            groups: dict[int, tuple[BatchHolder, list[int]]] = {}
            of: dict[int, Sequence[BatchHolder]] = {}  # a shard's holders, once per round
            up: dict[int, bool] = {}  # a holder's health, once per round
            for i in todo:
                shard = ranges[i][0]
                hs = of.get(shard)
                if hs is None:
                    hs = of[shard] = holders(shard)
                h = self._next(hs, tried[i], up)
                if h is not None:
                    tried[i].add(id(h))
                    groups.setdefault(id(h), (h, []))[1].append(i)
                elif first:
                    st.skipped += 1  # left to the caller's next holder at once
            left = end - time.monotonic()
            if not groups or left <= 0:
                break
            st.rounds += not first
            first = False
            parts = list(groups.values())
            st.parts += len(parts)
            with self._lock:
                st.peak_parts = max(st.peak_parts, len(parts))
            done = send_all(parts, lambda h, idx: call(h, [ranges[i] for i in idx]),
                            self._executor(), left)
            todo = []
            for (_, idx), (answered, got) in zip(parts, done, strict=True):
                if not answered:
                    if time.monotonic() >= end:
                        st.late += 1
                        continue  # out of time: these stay None
                    todo += idx
                    continue
                assert got is not None
                for i, data in zip(idx, got, strict=True):
                    if data is None:
                        todo.append(i)
                    else:
                        out[i] = data
        st.missing += sum(d is None for d in out)
        return out

    @staticmethod
    def _next(hs: Sequence[BatchHolder], tried: set[int], up: dict[int, bool]
              ) -> BatchHolder | None:
        """The first holder not asked yet that is not down (``up``: the answers of
        ``is_down`` so far this round)."""
        for h in hs:
            if id(h) in tried:
                continue
            ok = up.get(id(h))
            if ok is None:
                ok = up[id(h)] = not h.is_down()
            if ok:
                return h
        return None

    def close(self) -> None:
        got = self._pool
        if got is not None and got[0] == os.getpid():
            got[1].shutdown(wait=False, cancel_futures=True)
