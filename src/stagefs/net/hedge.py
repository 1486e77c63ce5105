"""Hedged reads: a peer as a holder for the Store, that does not let one slow peer stall a read.

Each peer is one holder (so ``Store.read_many`` sends each peer one batch). A read that the
peer has not answered within the hedging delay (the 99th percentile of recent reply times,
between a floor and a cap) goes to another live replica of the shard too, and the first
answer wins; the slow peer is marked suspect, so later reads skip it until it answers
again. With no other live replica to ask (one copy per shard, the default), the read goes
to the Store's next holder (the origin) instead: the peer is marked suspect, ``pread``
raises PeerUnavailable and ``pread_many`` gives None for every range. The request left in
flight runs on to the client's deadline: a late answer clears the suspicion, a late failure
counts as one. A batch whose hedges do not answer either (every replica cut off) gives
its ranges to the next holder once the hedges have had the origin's delay, and every peer
asked is suspect: the batch that finds a partition pays the two delays, never a request's
deadline, and the next batches ask no one. A peer that fails outright is not hedged: the
Store goes to its next holder (the shard's next replica, then the origin). So a hung
holder costs at most one short delay, not a timeout; the Store verifies what comes back and goes to its next holder if it is
wrong. Each request to a peer that is not suspect is sent from a pool thread (one hop); a
suspect peer refuses at once, from the caller's thread. Each peer counts its requests in
flight (``outstanding``): the cluster's holder choice sends a read to the less busy of two
replicas (cluster/connect.py).
"""

from __future__ import annotations

import collections
import os
import threading
import weakref
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from time import perf_counter
from typing import Any

from stagefs.net.client import PeerSource, PeerUnavailable

__all__ = ["HedgePolicy", "HedgedPeer", "ReplyTimes"]


@dataclass(frozen=True, slots=True)
class HedgePolicy:
    """When to send a read to another replica: after the ``quantile`` of the last ``window``
    reply times, never sooner than ``floor`` nor later than ``cap`` seconds; ``initial``
    until ``min_samples`` replies have been timed."""

    floor: float = 0.005
    cap: float = 0.5
    initial: float = 0.1
    to_origin: float = 0.5
    """At least this long before a read with no other live replica gives way to the origin:
    the shared file system that every node falls back on is the dearest place to hedge to
    (about 1% of replies are slower than a p99 delay)."""
    quantile: float = 0.99
    window: int = 512
    min_samples: int = 20


_ALL_TIMES: weakref.WeakSet[ReplyTimes] = weakref.WeakSet()
_ALL_PEERS: weakref.WeakSet[HedgedPeer] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    """A lock another thread held at the fork stays held in the child: make new ones (and
    the parent's requests in flight are not the child's)."""
    for t in list(_ALL_TIMES):
        t._lock = threading.Lock()
    for p in list(_ALL_PEERS):
        p._count = threading.Lock()
        p.outstanding = 0


os.register_at_fork(after_in_child=_after_fork_in_child)


class ReplyTimes:
    """Recent reply times of the peers of one process, and the hedging delay they give."""

    def __init__(self, policy: HedgePolicy | None = None) -> None:
        self.policy = policy or HedgePolicy()
        self._times: collections.deque[float] = collections.deque(maxlen=self.policy.window)
        self._lock = threading.Lock()
        _ALL_TIMES.add(self)
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

    def origin_delay(self) -> float:
        """How long to wait before giving up on a peer for the origin."""
        return max(self._delay, self.policy.to_origin)


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


class HedgedPeer:
    """One peer as a holder for the Store, whose slow reads are hedged.

    A read this peer has not answered within the hedging delay goes to another live replica
    of the shard too (``replicas(shard)``: the holders of the shard's replicas on other
    nodes, in placement order), the first answer wins, and this peer is marked suspect. A
    batch (``pread_many``) is hedged range by range: each range goes to the first other live
    replica of its shard, one request per replica. When no one else is left to ask, the
    read goes to the Store's next holder after the delay: the peers asked are marked
    suspect, ``pread`` raises PeerUnavailable and ``pread_many`` gives None for every range
    (the Store reads those items one by one; this peer, suspect, refuses them at once). A
    failure is not hedged: ``pread`` raises PeerUnavailable (the Store's next holder is the
    shard's next replica) and ``pread_many`` gives None for what the peer did not give."""

    def __init__(self, source: PeerSource,
                 replicas: Callable[[int], Sequence[HedgedPeer]] | None = None,
                 times: ReplyTimes | None = None, batch_times: ReplyTimes | None = None
                 ) -> None:
        self.source = source
        self.client = source.client
        self.name = source.name
        self.replicas = replicas or _alone
        self.times = times or ReplyTimes()  # of single reads
        self.batch_times = batch_times or ReplyTimes()  # of batches: longer replies
        self.hedged = 0  # requests also sent to another replica: this peer was slow
        self.outstanding = 0  # requests sent and not answered yet (the holder choice's load)
        self.gave_up = 0  # requests not answered within the delays, left to the next holder
        self._count = threading.Lock()
        _ALL_PEERS.add(self)

    def begin(self) -> None:
        with self._count:
            self.outstanding += 1

    def end(self) -> None:
        with self._count:
            self.outstanding -= 1

    def is_down(self) -> bool:
        """Suspect: a reader goes straight to the next holder."""
        return self.client.suspect()

    def report_bad(self, shard: int) -> None:
        """Its bytes of ``shard`` failed their checksum: the peer checks its copy."""
        self.source.report_bad(shard)

    def close(self) -> None:
        """The peer's connections belong to its client, which the owner closes."""

    def __repr__(self) -> str:
        return f"<HedgedPeer {self.name}>"

    def _other(self, shard: int, asked: Sequence[HedgedPeer]) -> HedgedPeer | None:
        """The first replica of ``shard`` not asked yet and not suspect."""
        for h in self.replicas(shard):
            if h is not self and h not in asked and not h.client.suspect():
                return h
        return None

    def _slow(self, peers: Iterable[HedgedPeer], delay: float, then: str) -> None:
        for h in peers:
            h.client.mark_suspect(f"no answer within {delay:.3f} s; {then}")

    def _give_up(self, peers: Iterable[HedgedPeer], delay: float) -> None:
        """Requests to ``peers`` not answered within ``delay`` (the hedging and origin
        delays): what they were asked goes to the next holder, and they are suspect."""
        peers = list(peers)
        for h in peers:
            h.gave_up += 1
        self._slow(peers, delay, "read from the next holder")

    def _refuse(self) -> PeerUnavailable:
        """This peer is suspect: the Store's next holder answers, with no request sent."""
        self.client.stats.skipped += 1
        return PeerUnavailable(f"{self.name}: suspect after a recent failure; skipped")

    # -- one range -----------------------------------------------------------------------

    def _pread(self, shard: int, offset: int, length: int) -> bytes:
        self.begin()
        try:
            t0 = perf_counter()
            out = self.source.pread(shard, offset, length)
            self.times.add(perf_counter() - t0)
        finally:
            self.end()
        return out

    def pread(self, shard: int, offset: int, length: int) -> bytes:
        if self.client.suspect():
            raise self._refuse()
        pool = _executor()
        asked: list[HedgedPeer] = [self]
        waiting = {pool.submit(self._pread, shard, offset, length): self}
        errors: list[str] = []
        while True:
            delay = self.times.delay()
            done, _ = wait(waiting, delay, FIRST_COMPLETED)
            nxt = None if done else self._other(shard, asked)
            if not done and nxt is None:  # the origin is dearer than a replica: wait longer
                more = self.times.origin_delay() - delay
                if more > 0:
                    done, _ = wait(waiting, more, FIRST_COMPLETED)
                    delay += more
            if not done:  # no answer within the delay: the ones asked are slow
                if nxt is None:  # no one else to ask: the Store's next holder (the origin)
                    self._give_up(waiting.values(), delay)
                    raise PeerUnavailable(
                        f"{self.name}: no answer within {delay:.3f} s and no other live "
                        f"replica of shard {shard}; read from the next holder")
                # the slow ones are suspect once another answers first: a node that has
                # not copied the shard yet (it takes over a dead one's) says so at once,
                # which proves nothing against the slow one
                self.hedged += 1
                asked.append(nxt)
                waiting[pool.submit(nxt._pread, shard, offset, length)] = nxt
                continue
            for f in done:
                who = waiting.pop(f)
                exc = f.exception()
                if exc is None:
                    if who is not self and self in waiting.values():
                        self._slow(waiting.values(), delay, "another replica answered first")
                    return f.result()
                if not isinstance(exc, PeerUnavailable):
                    raise exc
                errors.append(str(exc))
            if not waiting:  # the Store goes on to its next holder
                raise PeerUnavailable("; ".join(errors))

    # -- a batch -------------------------------------------------------------------------

    def _read(self, ranges: Sequence[tuple[int, int, int]]) -> list[Any]:
        self.begin()
        try:
            t0 = perf_counter()
            out = self.client.read(ranges)
            self.batch_times.add(perf_counter() - t0)
        finally:
            self.end()
        return out

    def pread_many(self, ranges: Sequence[tuple[int, int, int]]) -> list[bytes | None]:
        """Many ranges in one request to this peer; None for each it did not give (all of
        them if it is suspect or fails). Ranges it has not answered within the delay come
        from the other replicas of their shards, where they have one."""
        return self._many(ranges)

    def _many(self, ranges: Sequence[tuple[int, int, int]]) -> list[Any]:
        n = len(ranges)
        if self.client.suspect():
            self.client.stats.skipped += 1
            return [None] * n
        pool = _executor()
        first = pool.submit(self._read, ranges)
        delay = self.batch_times.delay()
        if not wait([first], delay).done:
            # slow: each range to the first other live replica of its shard, one request each
            groups: dict[HedgedPeer, list[int]] = {}
            for i, (s, _, _) in enumerate(ranges):
                h = self._other(s, ())
                if h is not None:
                    groups.setdefault(h, []).append(i)
            if not groups:  # no one else to ask: the Store reads them from its next holder
                wait_more = self.batch_times.origin_delay() - delay  # the origin is dearer
                if wait_more <= 0 or not wait([first], wait_more).done:
                    self._give_up((self,), delay + max(0.0, wait_more))
                    return [None] * n
                groups = {}
            else:
                self.hedged += len(groups)
                return self._race(first, {pool.submit(h._read, [ranges[i] for i in idx]):
                                          (h, idx) for h, idx in groups.items()}, n, delay)
        try:
            return first.result()
        except PeerUnavailable:
            return [None] * n

    def _race(self, first: Future[list[Any]],
              hedges: dict[Future[list[Any]], tuple[HedgedPeer, list[int]]], n: int,
              delay: float) -> list[Any]:
        """The slow peer's whole answer if it comes before every hedge has; else what the
        hedges gave, and for the ranges they did not give (another replica that has not
        copied the shard yet says "not held" at once) the slow peer's answer; None where no
        one gave a range. The race lasts the origin's delay from the hedges, no longer: a
        peer asked that has not answered by then is given up on (suspect: later batches
        skip it at once), so peers that are all cut off cost one batch the two delays, not
        the caller's deadline, and the next batches nothing. The slow peer is suspect
        sooner if another replica gave bytes first; a "not held" proves nothing."""
        wait_more = self.batch_times.origin_delay()
        end = perf_counter() + wait_more
        out: list[Any] = [None] * n
        pending = set(hedges)
        watch: set[Future[list[Any]]] = pending | {first}
        won = False
        while pending:
            done, _ = wait(watch, max(end - perf_counter(), 0.0), FIRST_COMPLETED)
            if not done:
                break
            for f in done:
                watch.discard(f)
                pending.discard(f)
                exc = f.exception()
                if exc is not None:
                    if not isinstance(exc, PeerUnavailable):
                        raise exc
                    continue
                got = f.result()
                if f is first:
                    return [a if a is not None else b for a, b in zip(got, out, strict=True)]
                for i, data in zip(hedges[f][1], got, strict=True):
                    if data is not None:
                        out[i] = data
                        won = True
        if pending:
            self._give_up([hedges[f][0] for f in pending], wait_more)
        if won and not first.done():
            self._slow((self,), delay, "another replica answered first")
        if None in out:
            if not wait([first], max(end - perf_counter(), 0.0)).done:
                self._give_up((self,), delay + wait_more)
            elif first.exception() is None:
                got = first.result()
                return [b if b is not None else a for a, b in zip(got, out, strict=True)]
        return out


def _alone(shard: int) -> Sequence[HedgedPeer]:
    return ()
