"""Hedged reads: the replicas of a shard on other nodes, as one holder for the Store.

A read goes to the first replica that is not suspect. If no answer comes within the hedging
delay (the 99th percentile of recent reply times, between a floor and a cap), the same
request goes to the next replica too, and the first answer wins; the slow replica is marked
suspect, so later reads skip it until it answers again. A replica that fails outright hands
the read to the next one at once. So a hung holder costs at most one short delay, not a
timeout; the Store verifies what comes back and goes to its next holder (the origin) if
every replica fails or answers wrong.
"""

from __future__ import annotations

import collections
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from time import perf_counter
from typing import TypeVar

from stagefs.net.client import PeerSource, PeerUnavailable

__all__ = ["HedgePolicy", "HedgedPeers", "ReplyTimes"]

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class HedgePolicy:
    """When to send a read to another replica: after the ``quantile`` of the last ``window``
    reply times, never sooner than ``floor`` nor later than ``cap`` seconds; ``initial``
    until ``min_samples`` replies have been timed."""

    floor: float = 0.005
    cap: float = 0.5
    initial: float = 0.1
    quantile: float = 0.99
    window: int = 512
    min_samples: int = 20


class ReplyTimes:
    """Recent reply times of the peers of one process, and the hedging delay they give."""

    def __init__(self, policy: HedgePolicy | None = None) -> None:
        self.policy = policy or HedgePolicy()
        self._times: collections.deque[float] = collections.deque(maxlen=self.policy.window)
        self._lock = threading.Lock()
        self._delay = self.policy.initial
        self._new = 0

    def add(self, seconds: float) -> None:
        with self._lock:
            self._times.append(seconds)
            self._new += 1
            if self._new >= 16 and len(self._times) >= self.policy.min_samples:
                self._new = 0  # re-sorting a few hundred floats every 16 replies is cheap
                ranked = sorted(self._times)
                q = ranked[min(len(ranked) - 1, int(self.policy.quantile * len(ranked)))]
                self._delay = min(max(q, self.policy.floor), self.policy.cap)

    def delay(self) -> float:
        return self._delay


_pool: tuple[int, ThreadPoolExecutor] | None = None
_pool_lock = threading.Lock()


def _executor() -> ThreadPoolExecutor:
    """This process's threads for hedged requests (a forked child makes its own)."""
    global _pool
    got = _pool
    if got is None or got[0] != os.getpid():
        with _pool_lock:
            got = _pool
            if got is None or got[0] != os.getpid():
                got = _pool = (os.getpid(), ThreadPoolExecutor(
                    32, thread_name_prefix="stagefs-hedge"))
    return got[1]


class HedgedPeers:
    """The replicas of a shard on other nodes (in placement order), as one ShardSource."""

    def __init__(self, replicas: Sequence[PeerSource], times: ReplyTimes | None = None,
                 name: str | None = None) -> None:
        if not replicas:
            raise ValueError("a hedged holder needs at least one replica")
        self.replicas = list(replicas)
        self.times = times or ReplyTimes()
        self.name = name or "peers " + ", ".join(r.name for r in self.replicas)
        self.hedged = 0  # reads sent to a second replica

    def pread(self, shard: int, offset: int, length: int) -> bytes:
        return self._first(lambda r: r.pread(shard, offset, length))

    def pread_many(self, ranges: Sequence[tuple[int, int, int]]) -> list[bytes | None]:
        """Many ranges in one request to a replica (hedged like ``pread``); None for each
        that no replica gave (all of them if none answered)."""
        try:
            return self._first(lambda r: r.client.read(ranges))
        except PeerUnavailable:
            return [None] * len(ranges)

    def is_down(self) -> bool:
        """Every replica is suspect: a reader goes straight to the next holder."""
        return all(r.client.suspect() for r in self.replicas)

    def close(self) -> None:
        """The replicas' connections belong to their clients, which the owner closes."""

    def _timed(self, replica: PeerSource, call: Callable[[PeerSource], T]) -> T:
        t0 = perf_counter()
        out = call(replica)
        self.times.add(perf_counter() - t0)
        return out

    def _first(self, call: Callable[[PeerSource], T]) -> T:
        live = [r for r in self.replicas if not r.client.suspect()]
        if not live:
            for r in self.replicas:
                r.client.stats.skipped += 1
            raise PeerUnavailable(f"{self.name}: every replica is suspect; skipped")
        if len(live) == 1:
            return self._timed(live[0], call)  # nothing to hedge with: no thread hop
        pool = _executor()
        waiting: dict[Future[T], PeerSource] = {}
        errors: list[str] = []
        nxt, launch = 0, True
        while True:
            if launch and nxt < len(live):
                if waiting:
                    self.hedged += 1
                waiting[pool.submit(self._timed, live[nxt], call)] = live[nxt]
                nxt += 1
            if not waiting:
                raise PeerUnavailable(f"{self.name}: no replica answered ({'; '.join(errors)})")
            delay = self.times.delay()
            done, _ = wait(waiting, delay if nxt < len(live) else None, FIRST_COMPLETED)
            if not done:  # no answer within the delay: the ones asked are slow
                for r in waiting.values():
                    r.client.mark_suspect(f"no answer within {delay:.3f} s")
                launch = True
                continue
            for f in done:
                waiting.pop(f)
                exc = f.exception()
                if exc is None:
                    return f.result()
                if not isinstance(exc, PeerUnavailable):
                    raise exc
                errors.append(str(exc))
            launch = not waiting
