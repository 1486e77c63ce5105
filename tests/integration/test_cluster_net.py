"""The shard server and the peer client over real TCP on loopback."""

from __future__ import annotations

import contextlib
import itertools
import os
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest
from cluster_helpers import make_pack
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stagefs.errors import AuthenticationError, ConfigError
from stagefs.format import Manifest
from stagefs.net import auth
from stagefs.net import protocol as P
from stagefs.net.client import _BATCH_BYTES, PeerClient, PeerSource, PeerUnavailable
from stagefs.net.server import ServerLimits, ShardServer
from stagefs.tiers.base import SourceUnavailable

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def packed(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[str, bytes]]:
    return make_pack(str(tmp_path_factory.mktemp("net")))


@pytest.fixture()
def server(packed: tuple[str, dict[str, bytes]]) -> Iterator[tuple[ShardServer, bytes, Manifest]]:
    pack, _ = packed
    m = Manifest(os.path.join(pack, "manifest.sfm"))
    token = auth.new_token()
    held = set(range(0, len(m.shards), 2))  # this "node" holds the even shards

    def locate(s: int) -> str | None:
        return os.path.join(pack, m.shards[s].name) if s in held else None

    srv = ShardServer(m, token, locate, "127.0.0.1", 0,
                      limits=ServerLimits(max_connections=4, handshake_timeout=1.0),
                      status=lambda: {"rank": 0}).start()
    yield srv, token, m
    srv.close()
    m.close()


def _shard_bytes(pack: str, m: Manifest, s: int) -> bytes:
    with open(os.path.join(pack, m.shards[s].name), "rb") as f:
        return f.read()


def test_batched_ranges_one_request(server: tuple[ShardServer, bytes, Manifest],
                                    packed: tuple[str, dict[str, bytes]]) -> None:
    srv, token, m = server
    c = PeerClient(*srv.address, token, pack_id=m.pack_id)
    ranges = [(s, o, n) for s in range(len(m.shards)) for o, n in ((0, 64), (100, 1000))]
    ranges.append((0, 0, 0))
    out = c.read(ranges)
    assert c.stats.requests == 1 and srv.stats.requests == 1  # one request, one reply
    for (s, o, n), got in zip(ranges, out, strict=True):
        if s % 2 or o + n > m.shards[s].size:
            assert got is None  # not held here, or past the end of the shard
        else:
            assert got == _shard_bytes(packed[0], m, s)[o : o + n]
    # out of bounds or unknown shard: not served, nothing else breaks
    assert c.read([(0, m.shards[0].size - 1, 2), (10**6, 0, 1)]) == [None, None]
    assert c.read([(0, 0, 8)]) == [b"STGFSSHD"]
    assert c.stats.connects == 1  # the pooled connection was reused
    assert c.status()["rank"] == 0
    c.close()


def test_pool_concurrent_and_peersource(server: tuple[ShardServer, bytes, Manifest],
                                        packed: tuple[str, dict[str, bytes]]) -> None:
    import threading

    srv, token, m = server
    c = PeerClient(*srv.address, token)
    src = PeerSource(c, "node 0")
    errors: list[BaseException] = []

    def worker() -> None:
        try:
            for _ in range(20):
                assert src.pread(0, 64, 512) == _shard_bytes(packed[0], m, 0)[64:576]
        except BaseException as exc:
            errors.append(exc)

    ts = [threading.Thread(target=worker) for _ in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(30)
    assert not errors
    assert 1 <= c.stats.connects <= 4
    with pytest.raises(SourceUnavailable):
        src.pread(1, 0, 10)  # odd shard: not held


def test_wrong_token_refused(server: tuple[ShardServer, bytes, Manifest]) -> None:
    srv, _, _ = server
    c = PeerClient(*srv.address, auth.new_token())
    with pytest.raises(AuthenticationError, match="another job token"):
        c.read([(0, 0, 10)])  # also a PeerUnavailable: to a reader, the next holder
    assert srv.stats.auth_failures == 1 and srv.stats.bytes_served == 0
    with pytest.raises(SourceUnavailable):  # as a source: just unavailable
        PeerSource(PeerClient(*srv.address, auth.new_token())).pread(0, 0, 10)


class _Relay:
    """A listener on another port that passes the bytes of each connection to ``target``
    and back, unchanged: port forwarding, or another user's process on the port of a dead
    node, relaying a live daemon's handshake."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.lst = socket.create_server(("127.0.0.1", 0))
        self.address: tuple[str, int] = self.lst.getsockname()[:2]
        self.socks: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        with contextlib.suppress(OSError):
            while True:
                a, _ = self.lst.accept()
                b = socket.create_connection(self.target, timeout=10)
                self.socks += [a, b]
                for src, dst in ((a, b), (b, a)):
                    threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(65536):
                dst.sendall(data)
            dst.shutdown(socket.SHUT_WR)

    def close(self) -> None:
        self.lst.close()
        for s in self.socks:
            s.close()


def test_a_relayed_handshake_is_refused_and_a_direct_one_logs_in(
        server: tuple[ShardServer, bytes, Manifest], packed: tuple[str, dict[str, bytes]]
) -> None:
    """A process between a reader and a daemon that passes the bytes both ways (protocol
    1: the daemon took the relayed AUTH, and the relay kept a proven connection to read
    shards on): the proofs cover the server end each side sees, which differ, so the daemon
    refuses and counts it, and the reader is told why."""
    srv, token, m = server
    relay = _Relay(srv.address)
    try:
        c = PeerClient(*relay.address, token, pack_id=m.pack_id)
        with pytest.raises(AuthenticationError, match=rf"connection to 127\.0\.0\.1:"
                           rf"{srv.address[1]}.*connected to 127\.0\.0\.1:"
                           rf"{relay.address[1]}.*NAT or port forwarding"):
            c.read([(0, 0, 10)])
        assert c.refused == "token" and c.stats.connects == 0 and c.stats.failures == 1
        assert srv.stats.auth_failures == 1 and srv.stats.bytes_served == 0
        assert srv.stats.tcp_peers == 0
        c.close()
    finally:
        relay.close()
    direct = PeerClient(*srv.address, token, pack_id=m.pack_id)
    assert direct.read([(0, 0, 10)]) == [_shard_bytes(packed[0], m, 0)[:10]]
    assert direct.refused is None and srv.stats.auth_failures == 1
    direct.close()


def test_a_client_refuses_a_proof_made_for_another_server_end(
        server: tuple[ShardServer, bytes, Manifest]) -> None:
    """A daemon behind a relay that takes any AUTH (as a daemon of protocol 1 took a relayed
    one) and proves the token for its own end: the client, which connected to the relay,
    does not take that proof."""
    _, token, _ = server
    lst = socket.create_server(("127.0.0.1", 0))

    def run() -> None:
        conn, _ = lst.accept()
        with conn:
            ns = auth.new_nonce()
            conn.sendall(P.encode(P.Challenge(ns, b"\0" * 16)))
            dec = P.FrameDecoder()
            while (msg := dec.next_message()) is None:
                dec.feed(conn.recv(4096))
            assert isinstance(msg, P.Auth)
            end = auth.channel_binding(conn, accepted=True)
            conn.sendall(P.encode(P.AuthOk(auth.server_proof(token, ns, msg.nonce, end))))
            with contextlib.suppress(OSError):
                while conn.recv(4096):
                    pass

    t = threading.Thread(target=run, daemon=True)
    t.start()
    relay = _Relay(lst.getsockname()[:2])
    try:
        c = PeerClient(*relay.address, token)
        with pytest.raises(AuthenticationError, match=r"could not prove the job token for a "
                           rf"connection to 127\.0\.0\.1:{relay.address[1]}"):
            c.read([(0, 0, 10)])
        assert c.refused == "token" and c.stats.connects == 0
        c.close()
    finally:
        relay.close()
        lst.close()
    t.join(10)


def test_a_daemon_of_another_protocol_version_is_refused_naming_both(
        caplog: pytest.LogCaptureFixture) -> None:
    """A daemon that runs another stagefs (protocol 1, before the handshake named the server
    end): a refusal that names both versions and the fix, said once at WARNING, not a peer
    taken for unreachable and probed again in silence (at INFO) for as long as it runs."""
    old = P.VERSION - 1
    lst = socket.create_server(("127.0.0.1", 0))
    conns: list[socket.socket] = []

    def run() -> None:
        with contextlib.suppress(OSError):
            while True:
                conn, _ = lst.accept()
                conns.append(conn)
                payload = auth.new_nonce() + b"\0" * 16
                conn.sendall(P.HEADER.pack(P.MAGIC, old, P.T_CHALLENGE, 0, len(payload))
                             + payload)

    threading.Thread(target=run, daemon=True).start()
    c = PeerClient(*lst.getsockname()[:2], auth.new_token())
    try:
        for attempt in (lambda: c.read([(0, 0, 10)]), c.open_connection):
            with caplog.at_level("WARNING", logger="stagefs"), \
                    pytest.raises(AuthenticationError, match=rf"version {old}, this stagefs "
                                  rf"speaks {P.VERSION}: run the same stagefs version"):
                attempt()
        assert c.refused == "version" and c.stats.connects == 0 and c.stats.failures == 2
        said = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
        assert len(said) == 1 and "another protocol version" in said[0], said
    finally:
        c.close()
        lst.close()
        for conn in conns:
            conn.close()


def test_dead_peer_and_timeout(server: tuple[ShardServer, bytes, Manifest]) -> None:
    _, token, _ = server
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    c = PeerClient("127.0.0.1", port, token, connect_timeout=1.0)
    with pytest.raises(PeerUnavailable, match="cannot connect"):
        c.read([(0, 0, 1)])
    with pytest.raises(PeerUnavailable, match="suspect"):
        c.read([(0, 0, 1)])  # fails fast without another connect
    assert c.stats.attempts == 1 and c.stats.skipped == 1
    # a listener that never answers: the client gives up at its handshake deadline
    mute = socket.socket()
    mute.bind(("127.0.0.1", 0))
    mute.listen(1)
    try:
        c = PeerClient(*mute.getsockname(), token, connect_timeout=0.5)
        with pytest.raises(PeerUnavailable, match="handshake failed"):
            c.read([(0, 0, 1)])
    finally:
        mute.close()


def test_garbage_never_crashes_or_hangs_the_server(
        server: tuple[ShardServer, bytes, Manifest], packed: tuple[str, dict[str, bytes]]) -> None:
    import random

    srv, token, _m = server
    rnd = random.Random(1)
    payloads = [rnd.randbytes(rnd.randint(1, 3000)) for _ in range(30)]
    payloads += [b"GET / HTTP/1.1\r\n\r\n", P.HEADER.pack(P.MAGIC, 1, 4, 0, 2**31)]
    payloads += [P.encode(P.Auth(b"x" * 32, b"y" * 32))[:20]]
    for data in payloads:
        with socket.create_connection(srv.address, timeout=5) as s:
            try:
                s.sendall(data)
                s.shutdown(socket.SHUT_WR)
                while s.recv(65536):
                    pass  # the server answers (challenge, error) and closes: never hangs
            except TimeoutError:
                pytest.fail(f"server hung on {data[:20]!r}")
            except OSError:
                pass  # or it closed on us first (reset, broken pipe)
    # a client that connects and says nothing is dropped at the handshake deadline
    timeouts = srv.stats.handshake_timeouts
    idle = socket.create_connection(srv.address, timeout=30)
    while idle.recv(65536):
        pass
    idle.close()
    assert srv.stats.handshake_timeouts == timeouts + 1
    assert srv.stats.protocol_errors > 0
    c = PeerClient(*srv.address, token)
    assert c.read([(0, 0, 8)]) == [b"STGFSSHD"]  # still serving


@pytest.fixture(scope="module")
def shared_server(packed: tuple[str, dict[str, bytes]]) -> Iterator[tuple[ShardServer, bytes]]:
    pack, _ = packed
    m = Manifest(os.path.join(pack, "manifest.sfm"))
    token = auth.new_token()
    srv = ShardServer(m, token, lambda s: os.path.join(pack, m.shards[s].name), "127.0.0.1",
                      limits=ServerLimits(handshake_timeout=0.25, frame_timeout=0.25,
                                          idle_timeout=0.25)).start()
    yield srv, token
    srv.close()
    m.close()


def _authed(srv: ShardServer, token: bytes) -> socket.socket:
    s = socket.create_connection(srv.address, timeout=5)
    ch = P.FrameDecoder()
    while (msg := ch.next_message()) is None:
        ch.feed(s.recv(4096))
    assert isinstance(msg, P.Challenge)
    nc = auth.new_nonce()
    s.sendall(P.encode(P.Auth(nc, auth.client_proof(token, msg.nonce, nc,
                                                auth.channel_binding(s, accepted=False)))))
    return s


@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.binary(max_size=600), authed=st.booleans(), cut=st.booleans())
def test_hypothesis_frames_never_crash_or_hang(
        shared_server: tuple[ShardServer, bytes], data: bytes, authed: bool, cut: bool) -> None:
    srv, token = shared_server
    if cut:  # a valid READ frame, truncated
        data = P.encode(P.Read(1, (P.Range(0, 0, 8),)))[: len(data) % 40]
    s = _authed(srv, token) if authed else socket.create_connection(srv.address, timeout=5)
    try:
        s.sendall(data)
        s.settimeout(30)
        while s.recv(65536):
            pass  # the server answers and closes, or drops us at its deadline: never hangs
    except TimeoutError:
        pytest.fail("the server hung")
    except OSError:
        pass
    finally:
        s.close()
    c = PeerClient(*srv.address, token)
    assert c.read([(0, 0, 8)]) == [b"STGFSSHD"]  # and it still serves
    c.close()


def test_connection_limit(server: tuple[ShardServer, bytes, Manifest]) -> None:
    srv, token, _ = server
    clients = [PeerClient(*srv.address, token) for _ in range(4)]
    for c in clients:
        c.read([(0, 0, 1)])  # each holds one pooled connection open
    extra = PeerClient(*srv.address, token)
    with pytest.raises(PeerUnavailable, match="too many connections"):
        extra.read([(0, 0, 1)])
    assert srv.stats.refused_busy == 1
    for c in clients:
        c.close()


def test_never_binds_all_interfaces(packed: tuple[str, dict[str, bytes]]) -> None:
    m = Manifest(os.path.join(packed[0], "manifest.sfm"))
    with pytest.raises(ConfigError, match="all interfaces"):
        ShardServer(m, b"t" * 32, lambda s: None, "0.0.0.0")
    m.close()


def test_a_port_another_process_took_first_says_to_give_another(
        packed: tuple[str, dict[str, bytes]]) -> None:
    m = Manifest(os.path.join(packed[0], "manifest.sfm"))
    squatter = socket.socket()  # another user's program on the job's (derived) port
    squatter.bind(("127.0.0.1", 0))
    squatter.listen()
    try:
        # before: "cannot listen on 127.0.0.1:N: Address already in use", and no way out
        with pytest.raises(ConfigError, match=r"another process listens there.*--port"):
            ShardServer(m, b"t" * 32, lambda s: None, "127.0.0.1",
                        squatter.getsockname()[1])
    finally:
        squatter.close()
        m.close()


def test_a_batch_of_every_kind_of_range_returns_the_right_bytes(tmp_path: Path) -> None:
    """Ranges sent by sendfile and by preadv, empty ones, ranges of shards not held and
    past the end, in one batch over the size at which the client cuts requests: each range
    the bytes of the shard file, in order, None where not served."""
    pack, _ = make_pack(str(tmp_path), files=60, shard_size="4MiB")
    m = Manifest(os.path.join(pack, "manifest.sfm"))
    held = set(range(0, len(m.shards), 2))
    srv = ShardServer(m, auth.new_token(), lambda s: os.path.join(pack, m.shards[s].name)
                      if s in held else None, "127.0.0.1", 0).start()
    c = PeerClient(*srv.address, srv.token, pack_id=m.pack_id)
    try:
        shards = {s: _shard_bytes(pack, m, s) for s in range(len(m.shards))}
        ranges = []
        for s, data in shards.items():
            for n in (1, 4096, 64 * 2**10 - 1, 64 * 2**10, 200_000, len(data) // 2):
                ranges += [(s, 0, n), (s, len(data) - n, n), (s, 7, 0)]
            ranges.append((s, len(data) - 1, 2))  # past the end
        ranges.append((len(m.shards), 0, 1))  # no such shard
        ranges *= 1 + 2 * _BATCH_BYTES // sum(n for _, _, n in ranges)  # 3 requests or more
        out = c.read(ranges)
        for (s, o, n), got in zip(ranges, out, strict=True):
            if s in held and o + n <= len(shards[s]):
                assert type(got) is bytes and got == shards[s][o : o + n]
            else:
                assert got is None
    finally:
        c.close()
        srv.close()
        m.close()


def _fake_peer(token: bytes, pack_id: bytes, reply: Callable[[P.Read], list[bytes]]
               ) -> tuple[tuple[str, int], threading.Thread]:
    """A peer that proves the token, then answers one READ with ``reply(read)``: pieces
    sent one after the other, a short pause between them."""
    lst = socket.socket()
    lst.bind(("127.0.0.1", 0))
    lst.listen(1)

    def run() -> None:
        conn, _ = lst.accept()
        lst.close()
        with conn:
            ns = auth.new_nonce()
            conn.sendall(P.encode(P.Challenge(ns, pack_id)))
            dec = P.FrameDecoder()
            msgs: list[P.Message] = []
            while len(msgs) < 2:
                data = conn.recv(65536)
                if not data:
                    return
                dec.feed(data)
                for msg in dec.messages():
                    msgs.append(msg)
                    if isinstance(msg, P.Auth):
                        conn.sendall(P.encode(P.AuthOk(auth.server_proof(
                            token, ns, msg.nonce, auth.channel_binding(conn, accepted=True)))))
            assert isinstance(msgs[1], P.Read)
            for piece in reply(msgs[1]):
                conn.sendall(piece)
                time.sleep(0.01)
            with contextlib.suppress(OSError):
                while conn.recv(65536):
                    pass

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return lst.getsockname(), t


def _data(rid: int, slots: list[tuple[int, int]], body: bytes, extra: int = 0) -> bytes:
    table = struct.pack("!II", rid, len(slots)) + b"".join(struct.pack("!BI", *s)
                                                          for s in slots)
    return P.HEADER.pack(P.MAGIC, P.VERSION, P.T_DATA, 0, len(table) + len(body) + extra
                         ) + table + body


def _cut(frame: bytes, at: Sequence[int]) -> list[bytes]:
    edges = [0, *at, len(frame)]
    return [frame[a:b] for a, b in itertools.pairwise(edges) if b > a]


_A, _B = b"a" * 70_000, b"b" * 300

HOSTILE = {
    # the frame announces fewer bytes than its slots do
    "short frame": lambda r: [_data(r.request_id, [(P.OK, 70_000), (P.OK, 300)], _A + _B,
                                    extra=-1)],
    # a slot that is not served but has a length
    "not held with bytes": lambda r: [_data(r.request_id, [(P.OK, 70_000),
                                                           (P.NOT_HELD, 300)], _A + _B)],
    # an unknown status
    "unknown status": lambda r: [_data(r.request_id, [(P.OK, 70_000), (9, 0)], _A)],
    # a slot table that does not fit in the frame
    "table past the frame": lambda r: [P.HEADER.pack(P.MAGIC, P.VERSION, P.T_DATA, 0, 10)
                                       + struct.pack("!II", r.request_id, 2) + b"\0\0"],
    # the connection ends inside a range
    "cut inside a range": lambda r: [_data(r.request_id, [(P.OK, 70_000), (P.OK, 300)],
                                           _A + _B)[:40_000]],
}


@pytest.mark.parametrize("kind", sorted(HOSTILE))
def test_a_malformed_data_reply_is_never_bytes(kind: str) -> None:
    token, pack_id = auth.new_token(), b"p" * 16
    addr, t = _fake_peer(token, pack_id, HOSTILE[kind])
    c = PeerClient(*addr, token, pack_id=pack_id, timeout=5.0)
    try:
        with pytest.raises(PeerUnavailable):
            c.read([(0, 0, 70_000), (0, 70_000, 300)])
        assert c.suspect()
    finally:
        c.close()
        t.join(10)


def test_a_reply_that_comes_in_pieces_is_whole() -> None:
    """A DATA reply cut anywhere (inside the header, the slot table, a range) and sent in
    pieces: the ranges are whole and in order."""
    token, pack_id = auth.new_token(), b"p" * 16
    frame: list[bytes] = []

    def reply(r: P.Read) -> list[bytes]:
        frame.append(_data(r.request_id, [(P.OK, 70_000), (P.INVALID, 0), (P.OK, 300)],
                           _A + _B))
        return _cut(frame[0], [5, 14, 22, 30, 1000, 69_000, 70_025])

    addr, t = _fake_peer(token, pack_id, reply)
    c = PeerClient(*addr, token, pack_id=pack_id, timeout=5.0)
    try:
        assert c.read([(0, 0, 70_000), (5, 0, 1), (0, 70_000, 300)]) == [_A, None, _B]
    finally:
        c.close()
        t.join(10)


_RESERVE_PROBE = r"""
import os, resource, sys
from stagefs.format import Manifest
from stagefs.net import auth
from stagefs.net.client import PeerClient, PeerUnavailable
from stagefs.net.server import ServerLimits, ShardServer
resource.setrlimit(resource.RLIMIT_NOFILE, (400, 400))
pack, reserve = sys.argv[1], int(sys.argv[2])
m = Manifest(os.path.join(pack, "manifest.sfm"))
token = auth.new_token()
srv = ShardServer(m, token, lambda s: os.path.join(pack, m.shards[s].name), "127.0.0.1", 0,
                  limits=ServerLimits(fd_reserve=reserve)).start()
ok = refused = 0
clients = []
for _ in range(60):
    c = PeerClient(*srv.address, token)
    clients.append(c)
    try:
        c.read([(0, 0, 8)])
        ok += 1
    except PeerUnavailable:
        refused += 1
print(ok, refused, srv.stats.refused_busy)
"""


def test_descriptors_kept_for_the_relay_are_not_given_to_connections(
        packed: tuple[str, dict[str, bytes]]) -> None:
    """With 400 descriptors, 256 kept as always and 100 more for the relay's pipes, a
    server takes 43 connections (one descriptor is the shard file it reads) and refuses the
    rest (E_BUSY); without those 100, all 60."""
    got = {}
    for reserve in (0, 100):
        out = subprocess.run([sys.executable, "-c", _RESERVE_PROBE, packed[0], str(reserve)],
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        got[reserve] = [int(x) for x in out.stdout.split()]
    assert got[0] == [60, 0, 0]
    ok, refused, busy = got[100]
    assert ok == 400 - 256 - 100 - 1 and refused == busy == 60 - ok  # (- 1: shard 0's file)


def test_a_storm_of_silent_connections_does_not_keep_a_peer_out(
        packed: tuple[str, dict[str, bytes]]) -> None:
    """100 connections that say nothing and connect again as soon as they are dropped:
    with 32 handshakes kept, each new one pushed a real client's out before its proof came
    (every attempt failed while the storm lasted). Now a server keeps up to 1024 (a quarter
    of its connections' descriptors): the storm is never dropped, nobody is pushed out."""
    pack, _ = packed
    m = Manifest(os.path.join(pack, "manifest.sfm"))
    token = auth.new_token()
    srv = ShardServer(m, token, lambda s: os.path.join(pack, m.shards[s].name), "127.0.0.1",
                      0, limits=ServerLimits(handshake_timeout=60)).start()
    stop = threading.Event()

    def storm() -> None:
        socks = [socket.create_connection(srv.address, timeout=10) for _ in range(100)]
        for s in socks:
            s.setblocking(False)
        while not stop.is_set():
            for i, s in enumerate(socks):
                try:
                    if s.recv(65536) == b"":  # dropped: connect again at once
                        raise ConnectionResetError
                except BlockingIOError:
                    continue
                except OSError:
                    s.close()
                    socks[i] = socket.create_connection(srv.address, timeout=10)
                    socks[i].setblocking(False)
            time.sleep(0.001)
        for s in socks:
            s.close()

    t = threading.Thread(target=storm, daemon=True)
    t.start()
    try:
        deadline = time.monotonic() + 60
        while srv.stats.connections < 100:  # the storm is in
            assert time.monotonic() < deadline and t.is_alive()
            time.sleep(0.01)
        for _ in range(20):  # a new connection each time, as a restarted reader makes
            c = PeerClient(*srv.address, token, timeout=30, connect_timeout=30)
            try:
                assert c.read([(0, 0, 8)]) == [b"STGFSSHD"]
            finally:
                c.close()
        assert srv.stats.dropped_unauthenticated == 0
    finally:
        stop.set()
        t.join(30)
        srv.close()
        m.close()
