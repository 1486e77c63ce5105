"""One bad peer never stops a job: hostile, broken and hung peers over real sockets and
real processes.

Server side: deadlines on the handshake and on each request frame, and the separate, bounded
set of unauthenticated connections. Client side: a peer that fails authentication, a foreign
listener (garbage, silence, a frame cut short, bytes trickled), a SIGSTOP'd daemon: each read
returns the exact bytes from the next holder, the peer is suspect, and the next read does not
contact it. Assertions are on outcomes and counters, never on elapsed time.
"""

from __future__ import annotations

import errno
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pytest
from cluster_helpers import make_pack

from stagefs.cluster.cmap import ClusterMap
from stagefs.cluster.connect import ClusterHolders
from stagefs.format import Manifest
from stagefs.format.spec import SHARD_HEADER
from stagefs.net import auth
from stagefs.net import protocol as P
from stagefs.net.client import PeerClient, PeerSource, PeerUnavailable
from stagefs.net.hedge import HedgedPeer, HedgePolicy, ReplyTimes
from stagefs.net.server import ServerLimits, ShardServer
from stagefs.store import Store
from stagefs.tiers.origin import PackOrigin

pytestmark = pytest.mark.integration

Pack = tuple[str, dict[str, bytes]]


@pytest.fixture(scope="module")
def packed(tmp_path_factory: pytest.TempPathFactory) -> Pack:
    return make_pack(str(tmp_path_factory.mktemp("faults")))


def _server(pack: str, token: bytes, limits: ServerLimits | None = None) -> ShardServer:
    m = Manifest(os.path.join(pack, "manifest.sfm"))
    return ShardServer(m, token, lambda s: os.path.join(pack, m.shards[s].name), "127.0.0.1",
                       limits=limits).start()


def _challenge(s: socket.socket) -> P.Challenge:
    dec = P.FrameDecoder()
    while (msg := dec.next_message()) is None:
        chunk = s.recv(4096)
        assert chunk, "the server closed before its CHALLENGE"
        dec.feed(chunk)
    assert isinstance(msg, P.Challenge)
    return msg


def _auth_frame(s: socket.socket, ch: P.Challenge, token: bytes) -> bytes:
    nc = auth.new_nonce()
    end = auth.channel_binding(s, accepted=False)
    return P.encode(P.Auth(nc, auth.client_proof(token, ch.nonce, nc, end)))


def _authed(addr: tuple[str, int], token: bytes) -> socket.socket:
    s = socket.create_connection(addr, timeout=10)
    s.sendall(_auth_frame(s, _challenge(s), token))
    dec = P.FrameDecoder()
    while (msg := dec.next_message()) is None:
        dec.feed(s.recv(4096))
    assert isinstance(msg, P.AuthOk)
    return s


def _trickle(s: socket.socket, data: bytes, every: float = 0.1) -> int:
    """Send ``data`` one byte every ``every`` s until the other side closes; bytes sent."""
    for i in range(len(data)):
        readable, _, _ = select.select([s], [], [], every)
        if readable:
            try:
                if not s.recv(4096, socket.MSG_PEEK):
                    return i  # closed by the other side
            except OSError:
                return i
        try:
            s.send(data[i : i + 1])
        except OSError:
            return i
    return len(data)


def _replies(s: socket.socket) -> list[P.Message]:
    """Every message the server sent until it closed (it must close)."""
    s.settimeout(30)
    dec, out = P.FrameDecoder(), []
    try:
        while chunk := s.recv(65536):
            dec.feed(chunk)
            out += dec.messages()
    except ConnectionError:
        pass
    return out


# -- the server -------------------------------------------------------------------------------


def test_a_trickled_handshake_is_dropped_at_its_total_deadline(packed: Pack) -> None:
    token = auth.new_token()
    srv = _server(packed[0], token, ServerLimits(handshake_timeout=0.5))
    try:
        with socket.create_connection(srv.address, timeout=10) as s:
            frame = _auth_frame(s, _challenge(s), token)
            sent = _trickle(s, frame)  # 1 byte per 100 ms: 7.6 s for the whole AUTH
            got = _replies(s)
        assert sent < len(frame)  # the server closed before the AUTH was whole
        assert not any(isinstance(m, P.AuthOk) for m in got)
        assert srv.stats.handshake_timeouts == 1 and srv.stats.unauthenticated == 0
        c = PeerClient(*srv.address, token)
        assert c.read([(0, 0, 8)]) == [b"STGFSSHD"]  # and it serves the others
        c.close()
    finally:
        srv.close()


def test_a_trickled_request_frame_is_dropped_at_its_total_deadline(packed: Pack) -> None:
    token = auth.new_token()
    srv = _server(packed[0], token, ServerLimits(frame_timeout=0.5))
    try:
        with _authed(srv.address, token) as s:
            frame = P.encode(P.Read(1, tuple(P.Range(0, 0, 8) for _ in range(8))))
            sent = _trickle(s, frame)
            got = _replies(s)
        assert sent < len(frame) and not any(isinstance(m, P.Data) for m in got)
        assert srv.stats.frame_timeouts == 1 and srv.stats.requests == 0
    finally:
        srv.close()


def test_unauthenticated_connections_cannot_take_the_slots_of_peers(packed: Pack) -> None:
    token = auth.new_token()
    srv = _server(packed[0], token, ServerLimits(max_unauthenticated=16, handshake_timeout=60))
    idle: list[socket.socket] = []
    try:
        for _ in range(300):  # more than the 256 connections a daemon takes
            idle.append(socket.create_connection(srv.address, timeout=10))
        # generous deadlines: the server may still be accepting the 300 (a loaded machine)
        c = PeerClient(*srv.address, token, timeout=60, connect_timeout=60)
        assert c.read([(0, 0, 8)]) == [b"STGFSSHD"]
        assert srv.stats.refused_busy == 0
        assert srv.stats.unauthenticated <= 16
        # the oldest idle ones were dropped to make room: they see their connection closed
        closed = 0
        for s in idle[:200]:
            s.settimeout(10)
            try:
                while s.recv(65536):
                    pass  # the CHALLENGE, then the end
                closed += 1
            except ConnectionError:
                closed += 1
        assert closed == 200
        assert srv.stats.dropped_unauthenticated >= 300 - 16
        c.close()
    finally:
        for s in idle:
            s.close()
        srv.close()


def test_a_malformed_frame_closes_that_connection_only(
        packed: Pack, caplog: pytest.LogCaptureFixture) -> None:
    token = auth.new_token()
    srv = _server(packed[0], token)
    try:
        good = PeerClient(*srv.address, token)
        assert good.read([(0, 0, 8)]) == [b"STGFSSHD"]
        with caplog.at_level(logging.INFO, logger="stagefs.server"), \
                _authed(srv.address, token) as bad:
            port = bad.getsockname()[1]
            bad.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            got = _replies(bad)
        assert [type(m) for m in got] == [P.Error] and srv.stats.protocol_errors == 1
        lines = [r.getMessage() for r in caplog.records if r.name == "stagefs.server"]
        assert len(lines) == 1 and f"127.0.0.1:{port}" in lines[0]
        assert good.read([(0, 0, 8)]) == [b"STGFSSHD"]  # the other connection is untouched
        assert good.stats.connects == 1
        good.close()
    finally:
        srv.close()


def test_a_request_that_fails_is_answered_and_the_server_serves_on(packed: Pack) -> None:
    """Out of descriptors while a STATUS lists the tiers, or while a READ opens a shard's
    copy: each is answered with an error that names the limit (its client takes the next
    holder), and the server serves on. An exception there once ended the server's thread,
    leaving a live daemon that served nothing."""
    pack, token = packed[0], auth.new_token()
    m = Manifest(os.path.join(pack, "manifest.sfm"))

    def emfile(*_: object) -> Any:
        raise OSError(errno.EMFILE, os.strerror(errno.EMFILE))

    def locate(shard: int) -> str:
        return emfile() if shard == 0 else os.path.join(pack, m.shards[shard].name)

    srv = ShardServer(m, token, locate, "127.0.0.1", status=emfile).start()
    clients = [PeerClient(*srv.address, token) for _ in range(3)]
    try:
        with pytest.raises(PeerUnavailable, match="open-file limit"):
            clients[0].status()
        with pytest.raises(PeerUnavailable, match="open-file limit"):
            clients[1].read([(0, 0, 8)])
        assert clients[2].read([(1, 0, 8)]) == [b"STGFSSHD"]
        assert srv.stats.internal_errors == 2 and srv.stats.tcp_peers >= 1
    finally:
        for c in clients:
            c.close()
        srv.close()
        m.close()


_OUT_OF_DESCRIPTORS = """
import os, resource, sys, time
from stagefs.format import Manifest
from stagefs.net.server import ShardServer
pack, token = sys.argv[1], bytes.fromhex(sys.argv[2])
m = Manifest(os.path.join(pack, "manifest.sfm"))
resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))
srv = ShardServer(m, token, lambda s: os.path.join(pack, m.shards[s].name), "127.0.0.1",
                  status=lambda: {"alive": True}).start()
held = []
try:
    while True:
        held.append(os.open(os.devnull, os.O_RDONLY))
except OSError:
    pass
print(srv.address[1], len(held), flush=True)
time.sleep(60)
"""


def test_a_server_out_of_descriptors_still_answers(packed: Pack) -> None:
    """Every descriptor of the process taken (a daemon whose staging reached the limit):
    the server lets go of the one it keeps in reserve to take a connection, and answers
    it. It could not accept any: `stagefs status` saw the node unreachable."""
    token = auth.new_token()
    with subprocess.Popen([sys.executable, "-c", _OUT_OF_DESCRIPTORS, packed[0],
                           token.hex()], stdout=subprocess.PIPE, text=True) as proc:
        try:
            assert proc.stdout is not None
            port, held = map(int, proc.stdout.readline().split())
            assert held > 100  # it was out of descriptors
            for _ in range(3):  # one after another: the reserve is taken again each time
                c = PeerClient("127.0.0.1", port, token, timeout=5, connect_timeout=5)
                assert c.status()["alive"] is True
                c.close()
                time.sleep(1.5)  # (closed on its side too, and the reserve taken again)
        finally:
            proc.kill()


# -- bad peers, seen from a reader --------------------------------------------------------------


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class ForeignPeer:
    """A process listening on a dead node's port that is not a stagefs daemon: it runs
    ``behave(conn, stop)`` on each connection it accepts, and counts them."""

    def __init__(self, behave: Callable[[socket.socket, threading.Event], None]) -> None:
        self.behave = behave
        self.accepts = 0
        self.stop = threading.Event()
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.sock.settimeout(0.1)
        self.address: tuple[str, int] = self.sock.getsockname()
        self._threads = [threading.Thread(target=self._loop, daemon=True)]
        self._threads[0].start()

    def _loop(self) -> None:
        while not self.stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            self.accepts += 1
            t = threading.Thread(target=self._one, args=(conn,), daemon=True)
            self._threads.append(t)
            t.start()

    def _one(self, conn: socket.socket) -> None:
        with conn:
            try:
                conn.settimeout(30)
                self.behave(conn, self.stop)
            except OSError:
                pass

    def close(self) -> None:
        self.stop.set()
        self.sock.close()
        for t in self._threads:
            t.join(30)


def _until_closed(conn: socket.socket, stop: threading.Event) -> None:
    while not stop.is_set() and conn.recv(4096):
        pass


def _garbage(conn: socket.socket, stop: threading.Event) -> None:
    conn.sendall(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")
    _until_closed(conn, stop)


def _silent(conn: socket.socket, stop: threading.Event) -> None:
    _until_closed(conn, stop)


def _cut_short(conn: socket.socket, stop: threading.Event) -> None:
    conn.sendall(P.encode(P.Challenge(b"n" * 32, b"p" * 16))[:20])


def _trickler(conn: socket.socket, stop: threading.Event) -> None:
    """A header announcing a 4000-byte CHALLENGE, then one byte every 100 ms."""
    conn.sendall(P.HEADER.pack(P.MAGIC, P.VERSION, P.T_CHALLENGE, 0, 4000))
    while not stop.wait(0.1):
        conn.send(b"x")


def _cluster_store(tmp: str, pack: str, peer: tuple[str, int], token: bytes,
                   timeout: float = 0.5, *, others: Sequence[tuple[str, int]] = (),
                   replicas: int = 1) -> tuple[Store, ClusterHolders, FakeClock]:
    """The Store of connect() for this node (rank 0, tiers empty), one peer (rank 1) at
    ``peer`` and ``others`` (ranks 2...)."""
    m = Manifest(os.path.join(pack, "manifest.sfm"))
    os.makedirs(os.path.join(tmp, "tier"), exist_ok=True)
    cmap = ClusterMap(pack=pack, pack_id=m.pack_id.hex(), rank=0,
                      nodes=[("127.0.0.1", 9), peer, *others], replicas=replicas, seed=0,
                      everywhere=[], replicate_all=[], tiers=[(os.path.join(tmp, "tier"), None)])
    origin = PackOrigin(pack, m)
    holders = ClusterHolders(os.path.join(tmp, "rt"), cmap, token, m, origin, verify=True,
                             timeout=timeout)
    store = Store(pack, manifest=m, origin=origin, policy=holders)
    clock = FakeClock()
    holders.clients[1].clock = clock
    return store, holders, clock


def _on_peer(store: Store, holders: ClusterHolders, content: dict[str, bytes]) -> list[str]:
    """Files of size > 0 whose shard only node 1 holds."""
    m = store.manifest
    out = []
    for p, data in sorted(content.items()):
        shard = m.shard[store.namespace.file_entry(p)]
        if data and list(holders.placement.holders[shard]) == [1]:
            out.append(p)
    assert len(out) >= 4
    return out


FOREIGN = {"garbage": _garbage, "silent": _silent, "cut_short": _cut_short,
           "trickle": _trickler}


@pytest.mark.parametrize("kind", sorted(FOREIGN))
def test_a_foreign_listener_is_skipped(kind: str, packed: Pack, tmp_path: object) -> None:
    pack, content = packed
    fake = ForeignPeer(FOREIGN[kind])
    store, holders, _ = _cluster_store(str(tmp_path), pack, fake.address, auth.new_token())
    try:
        paths = _on_peer(store, holders, content)
        assert store.read(paths[0]) == content[paths[0]]  # from the origin
        client = holders.clients[1]
        assert client.suspect() and fake.accepts == 1
        attempts = client.stats.attempts
        assert store.read_many(paths[1:]) == [content[p] for p in paths[1:]]
        assert store.read(paths[1]) == content[paths[1]]
        assert client.stats.attempts == attempts and fake.accepts == 1  # not asked again
        # read skips it; read_many's batch goes to the origin at once (the peer is down)
        assert client.stats.skipped >= 1
    finally:
        store.close()
        fake.close()


def test_a_peer_with_another_token_is_skipped(packed: Pack, tmp_path: object) -> None:
    pack, content = packed
    srv = _server(pack, auth.new_token())
    store, holders, _ = _cluster_store(str(tmp_path), pack, srv.address, auth.new_token(), timeout=5.0)
    try:
        paths = _on_peer(store, holders, content)
        assert [store.read(p) for p in paths] == [content[p] for p in paths]
        assert store.read_many(paths) == [content[p] for p in paths]
        assert srv.stats.auth_failures == 1 and srv.stats.bytes_served == 0
        assert holders.clients[1].suspect()
    finally:
        store.close()
        srv.close()


SERVE = """
import os, sys
from stagefs.format import Manifest
from stagefs.format.spec import SHARD_HEADER
from stagefs.net.server import ShardServer
pack, token = sys.argv[1], bytes.fromhex(sys.argv[2])
m = Manifest(os.path.join(pack, "manifest.sfm"))
srv = ShardServer(m, token, lambda s: os.path.join(pack, m.shards[s].name), "127.0.0.1")
srv.start()
print(srv.address[1], flush=True)
sys.stdin.read()
"""


def _sigstop(proc: subprocess.Popen[bytes]) -> None:
    """Stop the process, and wait until it is stopped (the signal takes effect later)."""
    proc.send_signal(signal.SIGSTOP)
    for _ in range(3000):
        with open(f"/proc/{proc.pid}/stat") as f:
            if f.read().rpartition(")")[2].split()[0] == "T":
                return
        threading.Event().wait(0.01)
    raise AssertionError(f"process {proc.pid} did not stop")


@pytest.fixture()
def daemon(packed: Pack) -> Iterator[tuple[subprocess.Popen[bytes], tuple[str, int], bytes]]:
    """A shard server in a process of its own, which a test may stop (SIGSTOP)."""
    token = auth.new_token()
    proc = subprocess.Popen([sys.executable, "-c", SERVE, packed[0], token.hex()],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert proc.stdout is not None
        port = int(proc.stdout.readline())
        yield proc, ("127.0.0.1", port), token
    finally:
        proc.send_signal(signal.SIGCONT)
        proc.kill()
        proc.wait(30)
        for f in (proc.stdin, proc.stdout):
            if f is not None:
                f.close()


def _polled(cond: Callable[[], bool], what: str) -> None:
    """Wait until ``cond()`` holds (a counter another thread moves), at most a minute."""
    for _ in range(6000):
        if cond():
            return
        threading.Event().wait(0.01)
    raise AssertionError(f"never {what}")


def _hedge_after(holders: ClusterHolders, seconds: float) -> None:
    """Every peer's reads and batches hedged after ``seconds``."""
    times = ReplyTimes(HedgePolicy(floor=seconds, cap=seconds, initial=seconds))
    for h in holders.peers.values():
        h.times = h.batch_times = times


def test_a_stopped_daemon_costs_one_hedging_delay_then_is_skipped(
        daemon: tuple[subprocess.Popen[bytes], tuple[str, int], bytes], packed: Pack,
        tmp_path: object) -> None:
    proc, addr, token = daemon
    pack, content = packed
    # one copy per shard: no replica to hedge with, so the hedge goes to the origin after
    # 0.2 s, far below the client's 10 s reply deadline
    store, holders, clock = _cluster_store(str(tmp_path), pack, addr, token, timeout=10.0)
    try:
        client = holders.clients[1]
        paths = _on_peer(store, holders, content)
        _hedge_after(holders, 30.0)  # the first read connects: no hedge while it does
        assert store.read(paths[0]) == content[paths[0]]
        assert client.stats.requests == 1 and store.origin.stats.reads == 0  # the peer served
        _hedge_after(holders, 0.2)
        _sigstop(proc)
        assert store.read(paths[1]) == content[paths[1]]  # one hedging delay, then origin
        assert client.stats.failures == 0  # returned before the request's deadline failed
        assert client.stats.sent == 2 and store.origin.stats.reads > 0
        assert client.is_suspect() and store.status()["suspect_peers"] == [1]
        sent, attempts = client.stats.sent, client.stats.attempts
        assert store.read(paths[2]) == content[paths[2]]
        assert store.read_many(paths[2:]) == [content[p] for p in paths[2:]]
        assert (client.stats.sent, client.stats.attempts) == (sent, attempts)  # not asked
        # the request left in flight ends at its deadline, counted as a failure
        _polled(lambda: client.stats.failures == 1, "failed the request left in flight")
        assert client.is_suspect() and client.stats.requests == 1
        # after its back-off a probe checks it in the background; the reader never waits
        clock.now += 60
        assert store.read(paths[3]) == content[paths[3]]
        assert client.stats.sent == sent  # the read itself did not go to the peer
        client.wait_probe(30)
        assert client.suspect() and client.stats.attempts == attempts + 1
        # it wakes up: the next probe finds it answering and reads go to it again
        proc.send_signal(signal.SIGCONT)
        clock.now += 600
        client.suspect()
        client.wait_probe(30)
        assert not client.suspect()
        served = client.stats.requests
        assert store.read(paths[0]) == content[paths[0]]
        assert client.stats.requests == served + 1
    finally:
        store.close()


def test_a_late_answer_of_a_stopped_daemon_clears_its_suspicion(
        daemon: tuple[subprocess.Popen[bytes], tuple[str, int], bytes], packed: Pack,
        tmp_path: object) -> None:
    proc, addr, token = daemon
    pack, content = packed
    store, holders, _clock = _cluster_store(str(tmp_path), pack, addr, token, timeout=60.0)
    try:
        client = holders.clients[1]
        paths = _on_peer(store, holders, content)
        _hedge_after(holders, 30.0)
        assert store.read(paths[0]) == content[paths[0]]
        _hedge_after(holders, 0.2)
        _sigstop(proc)
        assert store.read(paths[1]) == content[paths[1]]  # from the origin
        assert client.is_suspect() and client.stats.requests == 1
        # it wakes up before the deadline: the request left in flight is answered, and that
        # answer clears the suspicion (the clock stands still: no probe did it)
        proc.send_signal(signal.SIGCONT)
        _polled(lambda: client.stats.requests == 2, "answered the request left in flight")
        _polled(lambda: not client.is_suspect(), "cleared the suspicion")
        assert client.stats.failures == 0 and client.stats.probes == 0
        served = store.origin.stats.reads
        _hedge_after(holders, 30.0)
        assert store.read(paths[2]) == content[paths[2]]
        assert client.stats.requests == 3 and store.origin.stats.reads == served
    finally:
        store.close()


def _hedged_pair(stopped: PeerClient, live: PeerClient) -> list[HedgedPeer]:
    """Two peers holding every shard, one holder each (placement order: the stopped one
    first), hedging after 0.2 s."""
    times = ReplyTimes(HedgePolicy(floor=0.2, cap=0.2, initial=0.2))
    peers: list[HedgedPeer] = []
    peers += [HedgedPeer(PeerSource(c), lambda shard: peers, times, times)
              for c in (stopped, live)]
    return peers


def test_a_hedged_read_does_not_wait_for_a_stopped_replica(
        daemon: tuple[subprocess.Popen[bytes], tuple[str, int], bytes], packed: Pack) -> None:
    proc, addr, token = daemon
    pack, content = packed
    srv = _server(pack, token)
    stopped = PeerClient(*addr, token, name="stopped", timeout=10.0)
    live = PeerClient(*srv.address, token, name="live")
    peers = _hedged_pair(stopped, live)
    store = Store(pack, sources=lambda shard: [*peers, store.origin])
    try:
        assert stopped.probe() and live.probe()  # both answer: connections in the pools
        _sigstop(proc)
        paths = [p for p, d in sorted(content.items()) if d]
        assert store.read(paths[0]) == content[paths[0]]
        assert stopped.stats.sent == 1  # asked first (placement order)
        assert peers[0].hedged == 1 and live.stats.requests == 1  # then the second answered
        assert store.origin.stats.reads == 0
        assert stopped.suspect()
        assert [store.read(p) for p in paths[1:6]] == [content[p] for p in paths[1:6]]
        assert stopped.stats.sent == 1 and peers[0].hedged == 1  # no delay paid again
        assert live.stats.requests == 6 and peers[1].hedged == 0
    finally:
        store.close()
        srv.close()


def test_a_batch_to_a_stopped_peer_is_hedged_to_the_other_in_one_request(
        daemon: tuple[subprocess.Popen[bytes], tuple[str, int], bytes], packed: Pack) -> None:
    proc, addr, token = daemon
    pack, content = packed
    srv = _server(pack, token)
    stopped = PeerClient(*addr, token, name="stopped", timeout=10.0)
    live = PeerClient(*srv.address, token, name="live")
    peers = _hedged_pair(stopped, live)
    store = Store(pack, sources=lambda shard: [*peers, store.origin])
    try:
        assert stopped.probe() and live.probe()
        _sigstop(proc)
        paths, size = [], 0
        for p, d in sorted(content.items()):  # well below the bytes of one READ request
            if d and size + len(d) < 2**20:
                paths.append(p)
                size += len(d)
        assert len(paths) > 4
        assert store.read_many(paths) == [content[p] for p in paths]
        assert stopped.stats.sent == 1 and stopped.suspect()  # one batch, never answered
        assert peers[0].hedged == 1 and live.stats.sent == 1  # the batch in one request
        assert store.origin.stats.reads == 0 and store.stats.unavailable == 0
        # the stopped peer is suspect: the next batch goes to the other peer at once
        assert store.read_many(paths) == [content[p] for p in paths]
        assert live.stats.sent == 2 and peers[0].hedged == 1 and peers[1].hedged == 0
    finally:
        store.close()
        srv.close()


_FLIP = bytes(range(255, -1, -1))


def _flipped_copies(m: Manifest, pack: str, where: str) -> str:
    """Copies of the pack's shards with every byte past the header flipped (every sample is
    hit), in ``where``."""
    os.makedirs(where)
    for sh in m.shards:
        with open(os.path.join(pack, sh.name), "rb") as f:
            data = bytearray(f.read())
        data[SHARD_HEADER.size :] = data[SHARD_HEADER.size :].translate(_FLIP)
        with open(os.path.join(where, sh.name), "wb") as f:
            f.write(data)
    return where


def test_a_peer_serving_wrong_bytes_is_caught(packed: Pack, tmp_path: object) -> None:
    """A peer with the token (a broken disk, a hostile node of the job) serves shard copies
    with flipped bytes: every read still returns the origin's bytes, each mismatch counted."""
    pack, content = packed
    token = auth.new_token()
    m = Manifest(os.path.join(pack, "manifest.sfm"))
    bad_dir = _flipped_copies(m, pack, os.path.join(str(tmp_path), "bad"))
    srv = ShardServer(m, token, lambda s: os.path.join(bad_dir, m.shards[s].name),
                      "127.0.0.1").start()
    store, holders, _ = _cluster_store(str(tmp_path), pack, srv.address, token, timeout=5.0)
    try:
        paths = _on_peer(store, holders, content)
        assert [store.read(p) for p in paths] == [content[p] for p in paths]
        assert store.read_many(paths) == [content[p] for p in paths]
        assert srv.stats.bytes_served > 0  # the peer did answer, wrongly
        assert store.stats.checksum_failures >= 2 * len(paths)
    finally:
        store.close()
        srv.close()
        m.close()


def test_wrong_bytes_from_one_replica_are_read_from_the_other(packed: Pack,
                                                               tmp_path: object) -> None:
    """Two replicas of a shard on other nodes, the first (node 1) serving flipped bytes:
    the Store reads the shard from the second (node 2), not the origin."""
    pack, content = packed
    token = auth.new_token()
    m = Manifest(os.path.join(pack, "manifest.sfm"))
    bad_dir = _flipped_copies(m, pack, os.path.join(str(tmp_path), "bad"))
    bad = ShardServer(m, token, lambda s: os.path.join(bad_dir, m.shards[s].name),
                      "127.0.0.1").start()
    good = _server(pack, token)
    store, holders, _ = _cluster_store(str(tmp_path), pack, bad.address, token, timeout=5.0,
                                       others=[good.address], replicas=2)
    try:
        shard = {p: int(m.shard[store.namespace.file_entry(p)]) for p in content}
        paths = [p for p, d in sorted(content.items()) if d and list(
            holders.placement.holders[shard[p]]) == [1, 2]]
        assert len(paths) >= 2
        # node 2 looks busier (a request in flight): the power of two choices asks node 1
        # first, every time
        holders.peers[2].outstanding = 1
        assert [h.name for h in holders.holders(shard[paths[0]])] == [
            "node 1", "node 2", store.origin.name]
        assert [store.read(p) for p in paths] == [content[p] for p in paths]
        assert store.read_many(paths) == [content[p] for p in paths]
        assert bad.stats.bytes_served > 0 and good.stats.bytes_served > 0
        assert store.stats.checksum_failures >= 1 and store.origin.stats.reads == 0
    finally:
        store.close()
        bad.close()
        good.close()
        m.close()


def test_a_peer_whose_status_cannot_be_read_is_named_not_a_traceback(
        packed: Pack, tmp_path: object, caplog: pytest.LogCaptureFixture,
        capsys: pytest.CaptureFixture[str]) -> None:
    # a peer with the job token that answers STATUS with valid frames but not a daemon's
    # counters (another stagefs, a listener of another kind): `stagefs status` ended in a
    # KeyError, and so did rank 0's daemon at its final report of staging
    from stagefs.cluster import status
    from stagefs.cluster.cmap import write_map
    from stagefs.cluster.daemon import Daemon

    pack, _ = packed
    token = auth.new_token()
    m = Manifest(os.path.join(pack, "manifest.sfm"))
    odd = ShardServer(m, token, lambda s: None, "127.0.0.1",
                      status=lambda: {"rank": 1, "staging_done": True, "state": "staged",
                                      "tiers": [], "staging": {"bytes_held": 1}}).start()
    try:
        rt = os.path.join(str(tmp_path), "rt")
        os.makedirs(rt, mode=0o700)
        write_map(rt, ClusterMap(pack=pack, pack_id=m.pack_id.hex(), rank=0,
                                 nodes=[odd.address, odd.address], replicas=1, seed=0,
                                 everywhere=[], replicate_all=[], tiers=[]), token)
        with caplog.at_level(logging.WARNING, "stagefs.status"):
            assert status.print_cluster_status(rt) == 1  # (no node could be read)
        out = capsys.readouterr().out
        assert [line.split()[2] for line in out.splitlines()[2:4]] == ["unreachable"] * 2
        said = [r.getMessage() for r in caplog.records]
        assert any("node 1 answered a STATUS this stagefs cannot read" in w for w in said)
        assert "no number staging.shards_held" in said[0] and "same stagefs" in said[0]
        # the daemon's own gathering of its peers' counters: the odd peer is None, said once
        d = Daemon.__new__(Daemon)
        d.rank, d.size, d.progress_unreachable, d._unreadable = 0, 2, 0, {}
        d.peers = {1: PeerClient(*odd.address, token, pack_id=m.pack_id, name="node 1")}
        d.status = lambda: {"rank": 0}  # type: ignore[method-assign]
        caplog.clear()
        with caplog.at_level(logging.WARNING, "stagefs.status"):
            assert d._gather() == [{"rank": 0}, None]
            assert d._gather() == [{"rank": 0}, None]
        assert len(caplog.records) == 1
        d.peers[1].close()
    finally:
        odd.close()
