"""A daemon that stops ends the calls blocked on its peers at once: a peer that hangs (SIGSTOP:
its kernel still takes connections and requests) held a stopping daemon for a reply
deadline per call (30 s: the staged barrier's STATUS, a staging read; then the close that
waits for the stager), past Slurm's KillWait, which then SIGKILLed it before it removed its
runtime map and token.

The deadlines here are 300 s, and every wait for a call to end is bounded by 60 s: a bound
far above what an interrupted call takes (milliseconds) and far below the deadline, so a
call that was not interrupted fails the test, however loaded the machine."""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from fake_peer import FakePeer
from stagefs.cluster.placement import place
from stagefs.cluster.rereplicate import Rereplicator
from stagefs.net import auth
from stagefs.net.client import PeerClient, PeerUnavailable
from stagefs.net.relay import Relay
from stagefs.net.sockio import recv_message

BOUND = 60.0  # seconds; the deadlines are 300


class HungPeer(FakePeer):
    """A peer that proves the job token (unless ``handshake`` is False: it then says
    nothing at all), then never answers a request: a daemon stopped after its handshake."""

    def __init__(self, token: bytes, handshake: bool = True) -> None:
        super().__init__(token)
        self.answers = handshake
        self.requests = threading.Semaphore(0)  # one release per request held

    def serve(self, conn: socket.socket) -> None:
        if not self.answers:
            conn.recv(1)  # until the client goes
            return
        if not self.handshake(conn):
            return
        while True:
            recv_message(conn)
            self.requests.release()  # and never answered


@pytest.fixture()
def token() -> bytes:
    return auth.new_token()


@pytest.fixture()
def hung(token: bytes) -> Iterator[HungPeer]:
    peer = HungPeer(token)
    yield peer
    peer.close()


def _client(peer: HungPeer, token: bytes) -> PeerClient:
    return PeerClient(*peer.address, token, name="node 1", timeout=300, connect_timeout=300,
                      pool_size=1)


def _in_thread(fn: Callable[[], Any]) -> tuple[threading.Thread, list[BaseException]]:
    errors: list[BaseException] = []

    def run() -> None:
        try:
            fn()
        except BaseException as exc:
            errors.append(exc)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, errors


def _held(sem: threading.Semaphore, what: str) -> None:
    assert sem.acquire(timeout=BOUND), f"the peer never got {what}"


@pytest.mark.parametrize("where", ["reply", "pool", "handshake"])
def test_interrupt_ends_the_calls_blocked_on_a_hung_peer(where: str, token: bytes) -> None:
    """Blocked waiting for a reply (the barrier's STATUS, a staging read), for the pool's
    only connection (a second caller), or in the handshake: each ends at once with
    PeerUnavailable, the peer not blamed for it, and every later call fails at once."""
    peer = HungPeer(token, handshake=where != "handshake")
    c = _client(peer, token)
    try:
        calls = [_in_thread(c.status)]
        if where == "handshake":
            _held(peer.accepted, "a connection")
        else:
            _held(peer.requests, "a request")
        if where == "pool":
            calls.append(_in_thread(lambda: c.read([(0, 0, 10)])))  # waits for the pool
            for _ in range(int(BOUND * 100)):  # (until it does)
                if c._free._waiters:  # type: ignore[attr-defined]
                    break
                calls[-1][0].join(0.01)
            assert c._free._waiters  # type: ignore[attr-defined]
        attempts = c.stats.attempts
        c.interrupt()
        for t, errors in calls:
            t.join(BOUND)
            assert not t.is_alive(), f"a call blocked in the {where} was not interrupted"
            assert len(errors) == 1 and isinstance(errors[0], PeerUnavailable), errors
        assert c.stats.failures == 0 and not c.is_suspect()  # our doing, not the peer's
        with pytest.raises(PeerUnavailable, match="interrupted"):
            c.read([(0, 0, 10)])
        assert not c.probe()
        assert c.stats.attempts == attempts  # no connection tried since
    finally:
        c.close()
        peer.close()


def test_the_monitor_interrupts_the_daemons_peers_when_it_stops(
        hung: HungPeer, token: bytes) -> None:
    """The staged barrier's STATUS, blocked on a hung peer, ends once the daemon's stop is
    set: its monitor (re-replication) interrupts the daemon's peer clients."""
    c = _client(hung, token)
    stop = threading.Event()
    r = Rereplicator(None, place(10, 2, 2), 0, None, {1: c},  # type: ignore[arg-type]
                     {1: lambda: True}, stop, dead_after=30, every=0.05)
    monitor = threading.Thread(target=r.run, daemon=True)
    monitor.start()
    barrier, errors = _in_thread(c.status)
    try:
        _held(hung.requests, "the STATUS")
        stop.set()  # SIGTERM
        barrier.join(BOUND)
        assert not barrier.is_alive(), "the blocked STATUS was not interrupted by the stop"
        assert len(errors) == 1 and isinstance(errors[0], PeerUnavailable)
        monitor.join(BOUND)
        assert not monitor.is_alive()
    finally:
        stop.set()
        c.close()


class _EndedLoop:
    """The server's loop after it ended: what is handed to it is never run."""

    def __init__(self) -> None:
        self.handed = threading.Event()

    def soon(self, fn: Callable[[], None]) -> None:
        self.handed.set()

    def later(self, delay: float, fn: Callable[[], None]) -> Any:
        raise AssertionError("not used")

    def watch(self, *args: object) -> None:
        raise AssertionError("not used")

    def unwatch(self, *args: object) -> None:
        raise AssertionError("not used")


def test_closing_the_relay_ends_a_probe_waiting_on_it() -> None:
    """The monitor's probe (a STATUS on the relay's connection) handed to a loop that has
    ended was waited for to its timeout (up to 6 s in a daemon; 300 here), holding up the
    daemon's close, which joins the monitor."""
    relay = Relay(lambda shard: (), timeout=4.0, pipes=None)
    loop = _EndedLoop()
    relay.attach(loop)
    got: list[bool] = []
    t, errors = _in_thread(lambda: got.append(relay.probe(object(), 300.0)))  # type: ignore[arg-type]
    try:
        assert loop.handed.wait(BOUND)  # the probe waits for its answer now
        relay.close()
        t.join(BOUND)
        assert not t.is_alive(), "the probe was not ended by the relay's close"
        assert got == [False] and not errors
    finally:
        relay.close()
