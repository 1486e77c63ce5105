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
from stagefs.net.health import PeerHealth
from stagefs.net.hedge import HedgedPeer, HedgePolicy, ReplyTimes
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



def test_one_health_rule_backs_off_doubling_to_its_cap_and_an_answer_clears_it() -> None:
    clock, probes, woken = Clock(), [], []
    h = PeerHealth("p", lambda: probes.append(clock.now) or False, clock, backoff=(1.0, 4.0),
                   on_suspect=lambda: woken.append(clock.now))
    assert not h.suspect()
    h.mark_suspect("slow")  # a slow answer: suspect for the first back-off, which stays
    h.mark_suspect("slow again")
    assert h.retry_at == 1.0 and woken == [0]
    for now, retry_at in ((1.0, 2.0), (2.0, 4.0), (4.0, 8.0), (8.0, 12.0)):
        clock.now = now
        assert h.suspect()  # due: probed in the background, the caller not kept waiting
        h.wait_probe(30)
        h.failed("refused")  # the probe's failure: twice the wait, at most 4 s
        assert h.retry_at == retry_at
    assert probes == [1.0, 2.0, 4.0, 8.0] and len(woken) == 5
    clock.now = 9.0
    h.answered()
    assert not h.suspect() and h.answered_at == 9.0
    h.failed("reset")  # the back-off starts over after an answer
    assert h.retry_at == 10.0


class StandIn:
    """A peer whose answers the test releases (pure logic: the hedging decisions). Like a
    real client, it refuses at once while it is suspect."""

    def __init__(self, name: str, answer: bytes | None = b"data") -> None:
        self.name = name
        self.answer = answer
        self.release = threading.Event()
        self.calls = 0
        self.batches: list[list[tuple[int, int, int]]] = []
        self.client = self
        self.stats = ClientStats()
        self.marked: list[str] = []
        self.then: threading.Event | None = None  # set once this one has answered

    def suspect(self) -> bool:
        return bool(self.marked)

    def mark_suspect(self, why: str) -> None:
        self.marked.append(why)

    def _answer(self) -> bytes:
        self.release.wait(30)
        if self.then is not None:
            self.then.set()
        if self.answer is None:
            raise PeerUnavailable(f"{self.name}: not held")
        return self.answer

    def _send(self) -> None:
        if self.marked:
            raise PeerUnavailable(f"{self.name}: suspect; skipped")

    def pread(self, shard: int, offset: int, length: int) -> bytes:
        self._send()
        self.calls += 1
        return self._answer()

    def read(self, ranges: list[tuple[int, int, int]]) -> list[bytes | None]:
        self._send()
        self.batches.append(list(ranges))
        return [self._answer() + b"%d" % s for s, _, _ in ranges]


class Delays(ReplyTimes):
    """Hedging delays given in order, the last one for good (pure logic: a short delay for
    a peer that never answers in time, then a long one for a peer that answers at once)."""

    def __init__(self, *delays: float) -> None:
        super().__init__()
        self.delays = list(delays)

    def delay(self) -> float:
        return self.delays.pop(0) if len(self.delays) > 1 else self.delays[0]


def _peers(placement: dict[int, list[StandIn]], delay: float = 0.05,
           times: ReplyTimes | None = None) -> dict[str, HedgedPeer]:
    """One holder per stand-in, each told the replicas of every shard (``placement``)."""
    times = times or ReplyTimes(HedgePolicy(floor=delay, cap=delay, initial=delay,
                                            to_origin=2 * delay))
    out: dict[str, HedgedPeer] = {}

    def replicas(shard: int) -> list[HedgedPeer]:
        return [out[p.name] for p in placement[shard]]

    for p in {p.name: p for ps in placement.values() for p in ps}.values():
        out[p.name] = HedgedPeer(cast("PeerSource", p), replicas, times, times)
    return out


def test_a_slow_peer_is_hedged_and_marked_suspect() -> None:
    slow, fast = StandIn("slow", b"late"), StandIn("fast", b"data")
    fast.release.set()
    h = _peers({0: [slow, fast]}, times=Delays(0.05, 30.0))
    assert h["slow"].pread(0, 0, 4) == b"data"
    assert h["slow"].hedged == 1 and slow.marked and not fast.marked
    # the Store's next read: the suspect peer refuses at once, its next holder answers
    with pytest.raises(PeerUnavailable, match="suspect"):
        h["slow"].pread(0, 0, 4)
    assert h["fast"].pread(0, 0, 4) == b"data"
    assert slow.calls == 1 and fast.calls == 2 and h["fast"].hedged == 0
    assert h["slow"].is_down() and not h["fast"].is_down()
    slow.release.set()


def test_a_failing_peer_is_not_hedged() -> None:
    missing, other = StandIn("missing", None), StandIn("other")
    missing.release.set()
    other.release.set()
    h = _peers({0: [missing, other]}, delay=30.0)  # a hedge would wait 30 s: no hedge here
    with pytest.raises(PeerUnavailable, match="not held"):
        h["missing"].pread(0, 0, 4)  # the Store goes to its next holder: the other replica
    assert h["missing"].hedged == 0 and not missing.marked and other.calls == 0
    assert h["missing"].pread_many([(0, 0, 4), (0, 4, 4)]) == [None, None]
    assert h["missing"].hedged == 0 and other.batches == []


def test_a_hedged_read_that_no_replica_answers_raises() -> None:
    slow, gone = StandIn("slow", None), StandIn("gone", None)
    gone.release.set()
    gone.then = slow.release  # the slow one fails once the hedge has failed
    h = _peers({0: [slow, gone]}, times=Delays(0.05, 30.0))
    with pytest.raises(PeerUnavailable) as err:
        h["slow"].pread(0, 0, 4)
    assert "gone: not held" in str(err.value) and "slow: not held" in str(err.value)
    # the hedge answered "not held" (a node yet to copy a dead one's shard): no proof that
    # the slow one is slower than a replica, so it is not suspect for it
    assert h["slow"].hedged == 1 and not slow.marked


def test_a_slow_sole_replica_gives_way_to_the_next_holder() -> None:
    slow = StandIn("slow", b"late")
    slow.then = threading.Event()
    h = _peers({0: [slow], 1: [slow]})  # no other replica to hedge with
    with pytest.raises(PeerUnavailable, match=r"no answer within 0\.100 s"):
        h["slow"].pread(0, 0, 4)  # the Store reads it from its next holder, the origin
    assert slow.marked and slow.calls == 1 and h["slow"].hedged == 0
    # suspect: refused at once, without a request
    with pytest.raises(PeerUnavailable, match="suspect"):
        h["slow"].pread(0, 0, 4)
    assert h["slow"].pread_many([(0, 0, 1), (1, 0, 1)]) == [None, None]
    assert slow.calls == 1 and slow.batches == [] and slow.stats.skipped == 2
    slow.release.set()  # the request left in flight runs on to its end
    assert slow.then.wait(30)


def test_a_slow_batch_to_a_sole_replica_gives_way_to_the_next_holder() -> None:
    slow = StandIn("slow")
    slow.then = threading.Event()
    h = _peers({0: [slow], 1: [slow]})
    ranges = [(0, 0, 1), (1, 0, 1)]
    assert h["slow"].pread_many(ranges) == [None, None]  # the Store reads them one by one
    assert slow.marked and slow.batches == [ranges] and h["slow"].hedged == 0
    with pytest.raises(PeerUnavailable, match="suspect"):
        h["slow"].pread(0, 0, 1)  # ... and this peer, suspect, refuses each at once
    assert h["slow"].pread_many(ranges) == [None, None]
    assert slow.batches == [ranges] and slow.calls == 0 and slow.stats.skipped == 2
    slow.release.set()
    assert slow.then.wait(30)


def test_a_sole_replica_that_answers_in_time_is_read() -> None:
    a = StandIn("a", b"A")
    a.release.set()
    h = _peers({0: [a]}, delay=30.0)
    assert h["a"].pread(0, 0, 1) == b"A"
    assert h["a"].pread_many([(0, 0, 1), (0, 5, 1)]) == [b"A0", b"A0"]
    assert not a.marked and a.calls == 1 and len(a.batches) == 1


def test_a_sole_replica_has_the_longer_origin_delay_to_answer() -> None:
    """The origin is dearer than a replica: a sole replica slower than the hedging delay
    (here 0) but within the origin's delay is read, and not marked."""
    times = ReplyTimes(HedgePolicy(floor=0.0, cap=0.0, initial=0.0, to_origin=30.0))
    a = StandIn("a", b"A")
    a.release.set()
    h = _peers({0: [a]}, times=times)
    assert h["a"].pread(0, 0, 1) == b"A"
    assert h["a"].pread_many([(0, 0, 1), (0, 5, 1)]) == [b"A0", b"A0"]
    assert not a.marked and a.calls == 1 and len(a.batches) == 1


def test_a_slow_batch_goes_range_by_range_to_each_shards_other_replica() -> None:
    a, b, c = StandIn("a"), StandIn("b", b"B"), StandIn("c", b"C")
    b.release.set()
    c.release.set()
    h = _peers({0: [a, b], 1: [c, a], 2: [a], 3: [a, b]})
    ranges = [(0, 0, 1), (1, 0, 1), (2, 0, 1), (3, 0, 1)]
    assert h["a"].pread_many(ranges) == [b"B0", b"C1", None, b"B3"]  # 2: only a holds it
    assert b.batches == [[(0, 0, 1), (3, 0, 1)]] and c.batches == [[(1, 0, 1)]]
    assert h["a"].hedged == 2 and a.marked and a.batches == [ranges]
    a.release.set()
    assert h["a"].pread_many(ranges) == [None] * 4  # suspect: the Store reads them one by one
    assert len(a.batches) == 1


def test_a_slow_batch_whose_other_replicas_do_not_answer_either_gives_way_in_time() -> None:
    """Every replica cut off (a partition): the hedges do not answer either. The batch
    gives its ranges to the next holder (the origin) after the delays, not when the
    requests' own deadlines end; every peer asked is suspect, so the next batch asks no
    one."""
    a, b, c = StandIn("a"), StandIn("b"), StandIn("c")
    b.then, c.then = threading.Event(), threading.Event()
    h = _peers({0: [a, b], 1: [a, c]})
    ranges = [(0, 0, 1), (1, 0, 1)]
    assert h["a"].pread_many(ranges) == [None, None]  # the Store reads them from its origin
    assert h["a"].hedged == 2 and b.batches == [[(0, 0, 1)]] and c.batches == [[(1, 0, 1)]]
    assert a.marked and b.marked and c.marked
    assert (h["a"].gave_up, h["b"].gave_up, h["c"].gave_up) == (1, 1, 1)
    assert h["a"].pread_many(ranges) == [None, None]  # suspect: asked at once, no request
    assert h["b"].pread_many(ranges[:1]) == [None]
    assert len(a.batches) == 1 and len(b.batches) == 1 and a.stats.skipped == 1
    for p in (a, b, c):
        p.release.set()  # the requests left in flight run on to their end
    assert b.then.wait(30) and c.then.wait(30)


def test_a_slow_batch_whose_hedge_says_not_held_waits_the_origin_delay_at_most() -> None:
    """A taker that has not copied the shard yet says "not held" at once; the slow holder
    has the origin's delay more to answer, then it is suspect and the origin answers."""
    slow, taker = StandIn("slow"), StandIn("taker", None)
    taker.release.set()
    slow.then = threading.Event()
    h = _peers({0: [slow, taker]})
    assert h["slow"].pread_many([(0, 0, 1)]) == [None]
    assert slow.marked and not taker.marked
    assert h["slow"].gave_up == 1 and h["taker"].gave_up == 0
    slow.release.set()
    assert slow.then.wait(30)


def test_a_request_waiting_for_a_connection_gives_up_when_the_peer_turns_suspect() -> None:
    """The one connection to a peer is out (a request the peer does not answer): a second
    request waiting for it gives up once the peer is found slow, instead of holding its
    thread until the first one's deadline."""
    c = PeerClient("127.0.0.1", _refused_port(), b"t" * 32, pool_size=1, timeout=600.0)
    with c._free:
        c._out = 1  # the connection is out
    got: list[BaseException] = []

    def second() -> None:
        try:
            c.read([(0, 0, 1)])
        except PeerUnavailable as exc:
            got.append(exc)

    t = threading.Thread(target=second)
    t.start()
    c.mark_suspect("no answer within the hedging delay")
    t.join(60)
    assert not t.is_alive() and len(got) == 1 and "suspect" in str(got[0])
    assert c.stats.skipped == 1 and c.stats.attempts == 0


def test_a_batch_answered_in_time_is_not_hedged() -> None:
    a, b = StandIn("a", b"A"), StandIn("b", b"B")
    a.release.set()
    b.release.set()
    h = _peers({0: [a, b]}, delay=30.0)
    assert h["a"].pread_many([(0, 0, 1), (0, 5, 1)]) == [b"A0", b"A0"]
    assert h["a"].hedged == 0 and b.batches == [] and not a.marked


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
    other = PeerClient("127.0.0.1", _refused_port(), b"t" * 32)
    peers: list[HedgedPeer] = []
    peers += [HedgedPeer(PeerSource(other), lambda shard: peers), HedgedPeer(src)]
    assert peers[0].pread_many([(0, 0, 1), (1, 0, 1)]) == [None, None]  # no exception
    assert peers[0].is_down() and peers[1].is_down()
    assert peers[1].pread_many([(0, 0, 1)]) == [None]  # suspect: not asked
    assert other.stats.attempts == 1 and c.stats.attempts == 1 and c.stats.skipped == 1
