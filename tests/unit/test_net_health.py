"""Peer health without a daemon: deadlines on real socket pairs, the suspect back-off with an
injected clock, and the hedging decisions over stand-in replicas (pure logic)."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from typing import cast

import pytest

from stagefs.net import protocol as P
from stagefs.net.client import ClientStats, PeerClient, PeerSource, PeerUnavailable
from stagefs.net.hedge import HedgedPeers, HedgePolicy, ReplyTimes
from stagefs.net.sockio import Deadline, recv_message, set_timeouts


@pytest.fixture()
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    a, b = socket.socketpair()
    yield a, b
    a.close()
    b.close()


def test_a_trickled_frame_misses_its_total_deadline(
        pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    frame = P.encode(P.Challenge(b"n" * 32, b"p" * 16))
    stop = threading.Event()

    def trickle() -> None:  # one byte every 50 ms: each within any per-call timeout
        for i in range(len(frame)):
            if stop.wait(0.05):
                return
            b.send(frame[i : i + 1])

    t = threading.Thread(target=trickle)
    t.start()
    try:
        set_timeouts(a, 0.3)
        with pytest.raises(TimeoutError):
            recv_message(a, deadline=Deadline(a, 0.3))
    finally:
        stop.set()
        t.join()


def test_a_frame_whose_first_bytes_came_already(
        pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    msg = P.Challenge(b"n" * 32, b"p" * 16)
    b.sendall(P.encode(msg))
    set_timeouts(a, 5)
    first = a.recv(5)  # as the server waits for a request to begin
    assert recv_message(a, first=first, deadline=Deadline(a, 5)) == msg


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _refused_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port: int = s.getsockname()[1]
    s.close()
    return port


def test_a_suspect_peer_is_probed_in_the_background_after_its_backoff() -> None:
    clock = Clock()
    c = PeerClient("127.0.0.1", _refused_port(), b"t" * 32, clock=clock, backoff=(1.0, 4.0))
    with pytest.raises(PeerUnavailable, match="cannot connect"):
        c.read([(0, 0, 1)])
    for _ in range(3):  # within the back-off: skipped, never contacted
        with pytest.raises(PeerUnavailable, match="suspect"):
            c.read([(0, 0, 1)])
    assert c.stats.attempts == 1 and c.stats.skipped == 3
    clock.now = 1.0  # back-off over: the read is still skipped, a probe goes in the background
    with pytest.raises(PeerUnavailable, match="suspect"):
        c.read([(0, 0, 1)])
    c.wait_probe(30)
    assert c.stats.probes == 1 and c.stats.attempts == 2
    clock.now = 2.9  # the probe failed: the next one waits twice as long (from t=1: 3.0)
    assert c.suspect()
    c.wait_probe(30)
    assert c.stats.probes == 1
    clock.now = 3.0
    assert c.suspect()
    c.wait_probe(30)
    assert c.stats.probes == 2


class StandIn:
    """A replica whose answers the test releases (pure logic: the hedging decisions)."""

    def __init__(self, name: str, answer: bytes | None = b"data") -> None:
        self.name = name
        self.answer = answer
        self.release = threading.Event()
        self.calls = 0
        self.client = self
        self.stats = ClientStats()
        self.marked: list[str] = []

    def suspect(self) -> bool:
        return bool(self.marked)

    def mark_suspect(self, why: str) -> None:
        self.marked.append(why)

    def pread(self, shard: int, offset: int, length: int) -> bytes:
        self.calls += 1
        self.release.wait(30)
        if self.answer is None:
            raise PeerUnavailable(f"{self.name}: not held")
        return self.answer


def _hedged(*replicas: StandIn, delay: float = 0.05) -> HedgedPeers:
    times = ReplyTimes(HedgePolicy(floor=delay, cap=delay, initial=delay))
    return HedgedPeers(cast("list[PeerSource]", list(replicas)), times)


def test_a_slow_replica_is_hedged_and_marked_suspect() -> None:
    slow, fast = StandIn("slow", b"late"), StandIn("fast", b"data")
    fast.release.set()
    h = _hedged(slow, fast)
    assert h.pread(0, 0, 4) == b"data"
    assert h.hedged == 1 and slow.marked and not fast.marked
    assert h.pread(0, 0, 4) == b"data"  # the suspect one is not asked again
    assert slow.calls == 1 and fast.calls == 2 and h.hedged == 1
    slow.release.set()


def test_a_failing_replica_hands_over_at_once() -> None:
    missing, other = StandIn("missing", None), StandIn("other")
    missing.release.set()
    other.release.set()
    h = _hedged(missing, other, delay=30.0)  # a hedge would wait 30 s: a failure does not
    assert h.pread(0, 0, 4) == b"data"
    assert h.hedged == 0 and not missing.marked  # not held is no reason for suspicion


def test_no_replica_answers() -> None:
    a, b = StandIn("a", None), StandIn("b", None)
    a.release.set()
    b.release.set()
    with pytest.raises(PeerUnavailable, match="no replica answered"):
        _hedged(a, b).pread(0, 0, 4)
    a.marked.append("x")
    b.marked.append("x")
    with pytest.raises(PeerUnavailable, match="every replica is suspect"):
        _hedged(a, b).pread(0, 0, 4)


def test_the_hedging_delay_follows_the_replies_within_its_bounds() -> None:
    t = ReplyTimes(HedgePolicy(floor=0.01, cap=0.2, initial=0.1, window=100, min_samples=20))
    assert t.delay() == 0.1
    for _ in range(100):
        t.add(0.001)
    assert t.delay() == 0.01  # the floor
    for _ in range(100):
        t.add(0.05)
    assert t.delay() == 0.05
    for _ in range(3):
        t.add(5.0)  # three slow replies in 100: the 99th percentile, capped
    for _ in range(13):
        t.add(0.05)
    assert t.delay() == 0.2


def test_batched_reads_of_an_unavailable_peer_are_none() -> None:
    c = PeerClient("127.0.0.1", _refused_port(), b"t" * 32)
    src = PeerSource(c)
    assert src.pread_many([(0, 0, 1), (1, 0, 1)]) == [None, None]
    assert src.is_down()
    h = HedgedPeers([src, PeerSource(PeerClient("127.0.0.1", _refused_port(), b"t" * 32))])
    assert h.pread_many([(0, 0, 1)]) == [None]  # neither answers: no exception
    assert h.is_down()
