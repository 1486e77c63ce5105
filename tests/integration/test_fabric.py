"""One fabric per node, over real daemons, sockets and processes.

Training processes and their forked workers send every read that is not local to their
node's daemon (a Unix socket); the daemons hold at most two connections per peer, whatever
the number of readers. Assertions are on bytes and counters, never on elapsed time.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import resource
import signal
import socket
import struct
import subprocess
import sys
import termios
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from cluster_helpers import (
    free_ports,
    make_pack,
    serve_args,
    start,
    status_json,
    stop,
    tail,
    wait_staged,
    write_expected,
)
from xxhash import xxh3_64_hexdigest

import stagefs
from fake_peer import authed
from stagefs._fsutil import raise_fd_limit
from stagefs.cluster.fabric import FABRIC_PATIENCE
from stagefs.format import Manifest
from stagefs.net import auth
from stagefs.net import protocol as P
from stagefs.net.client import PeerClient, PeerSource
from stagefs.net.hedge import HedgedPeer, HedgePolicy, ReplyTimes
from stagefs.net.pipes import PipePool
from stagefs.net.relay import Relay
from stagefs.net.server import UNIX_SNDBUF, ShardServer

pytestmark = pytest.mark.integration
READER = str(Path(__file__).resolve().parent / "fabric_reader.py")




class Cluster:
    """``n`` daemons on loopback (static bootstrap), staged."""

    def __init__(self, work: str, n: int, files: int = 120, replicas: int = 2) -> None:
        self.work, self.n, self.replicas = work, n, replicas
        self.pack, content = make_pack(work, files=files, shard_size="64KiB")
        write_expected(work, content)
        with open(os.path.join(work, "hosts"), "w") as f:
            f.write("".join(f"127.0.0.1:{p}\n" for p in free_ports(n)))
        subprocess.run([sys.executable, "-m", "stagefs.cli", "serve", "--new-token",
                        os.path.join(work, "token")], check=True, timeout=60)
        self.daemons = [self.daemon(r) for r in range(n)]
        for r, d in enumerate(self.daemons):
            wait_staged(work, n, d, log=os.path.join(work, f"daemon{r}.log"))
        with open(os.path.join(work, "token")) as f:
            self.token = bytes.fromhex(f.read().strip())

    def daemon(self, r: int) -> subprocess.Popen[bytes]:
        return start(serve_args(self.work, self.pack, "--hosts",
                                os.path.join(self.work, "hosts"), "--rank", str(r),
                                "--token-file", os.path.join(self.work, "token"),
                                "--replicas", str(self.replicas), "--wait"),
                     os.path.join(self.work, f"daemon{r}.log"))

    def readers(self, per_node: int, workers: int, rounds: int, until: str | None = None
                ) -> list[subprocess.Popen[bytes]]:
        return [start([sys.executable, READER, self.work, str(node), str(i), str(workers),
                       str(rounds), *([until] if until else [])],
                      os.path.join(self.work, f"reader{node}-{i}.log"))
                for node in range(self.n) for i in range(per_node)]

    def results(self) -> list[dict[str, Any]]:
        out = []
        for name in sorted(os.listdir(self.work)):
            if name.startswith("fabric") and name.endswith(".json"):
                with open(os.path.join(self.work, name)) as f:
                    out.append(json.load(f))
        return out

    def wait_readers(self, readers: list[subprocess.Popen[bytes]]) -> None:
        for p, name in zip(readers, [f"reader{node}-{i}" for node in range(self.n)
                                     for i in range(len(readers) // self.n)], strict=True):
            assert p.wait(300) == 0, tail(os.path.join(self.work, name + ".log"))

    def close(self) -> list[int]:
        return [stop(d) for d in self.daemons]


@pytest.fixture()
def cluster4(tmp_path: Path) -> Iterator[Cluster]:
    c = Cluster(str(tmp_path), 4, replicas=1)  # every peer holds shards no other holds
    try:
        yield c
    finally:
        c.close()


def test_connections_grow_with_nodes_not_readers(cluster4: Cluster) -> None:
    c = cluster4
    readers = c.readers(per_node=4, workers=2, rounds=1)  # 16 readers x 3 processes
    c.wait_readers(readers)
    results = c.results()
    assert len(results) == 16
    for res in results:
        assert res["exits"] == [0, 0]
        for proc in res["procs"]:
            assert proc["bad"] == 0, res  # exact bytes
            assert proc["origin_bytes"] == 0, res  # no origin fallback
            assert proc["peer_connects"] == 0, res  # no reader talks to a peer itself
            assert proc["fabric_requests"] > 0 and proc["fabric_failures"] == 0, res
    st = status_json(c.work, 0)
    for node in st["nodes"]:
        srv, relay = node["server"], node["fabric"]["relay"]
        assert srv["refused_busy"] == 0
        # two per peer (one for staging and status; the relay's, for relayed ranges and
        # probes), plus this status request
        assert srv["tcp_peak"] <= 2 * (c.n - 1) + 1, srv
        assert srv["unix_peak"] >= 4  # the readers came through the fabric
        assert srv["relayed_ranges"] > 0 and srv["relayed_missing"] == 0, node["fabric"]
        assert srv["relayed_piped"] > 0, srv  # sent on from pipes, not copied (pipes.py)
        # a batch touching every peer had a part in flight to each of them at once
        assert relay["peak_parts"] == c.n - 1, relay
        assert relay["missing"] == 0 and relay["late"] == 0
        # the readers are done: every pipe of the relay's pool is back in it, empty
        pipes = node["fabric"]["pipes"]
        assert pipes["made"] == pipes["idle"] <= pipes["most"] and pipes["ranges"] > 0, pipes
    text = subprocess.run([sys.executable, "-m", "stagefs.cli", "status", "--runtime",
                           os.path.join(c.work, "rt0")], capture_output=True, text=True,
                          timeout=60).stdout
    assert "relayed for readers" in text, text
    for n, node in enumerate(st["nodes"]):  # each node's row says what it relayed
        row = next(line for line in text.splitlines() if line.split()[:1] == [str(n)])
        assert f"{node['server']['relayed_ranges']:,} (0 to the origin)" in row, text


def test_300_idle_and_unauthenticated_connections_do_not_stop_a_reader(tmp_path: Path) -> None:
    c = Cluster(str(tmp_path), 2)
    held: list[socket.socket] = []
    try:
        with open(os.path.join(c.work, "hosts")) as f:
            host, port = f.readline().strip().rsplit(":", 1)
        addr = (host, int(port))
        held += [authed(addr, c.token) for _ in range(250)]  # idle peers, token proven
        held += [socket.create_connection(addr, timeout=30) for _ in range(50)]  # silent
        held.append(socket.create_connection(addr, timeout=30))
        held[-1].sendall(P.encode(P.Read(1, (P.Range(0, 0, 8),)))[:5])  # a frame cut short
        # a reader on node 1: its daemon relays node 0's shards to node 0, which holds
        # the 300; one on node 0 reads through it too
        readers = [start([sys.executable, READER, c.work, str(node), "0", "1", "2"],
                         os.path.join(c.work, f"reader{node}-0.log")) for node in (0, 1)]
        c.wait_readers(readers)
        for res in c.results():
            for proc in res["procs"]:
                assert proc["bad"] == 0 and proc["origin_bytes"] == 0, res
        srv = status_json(c.work, 1)["nodes"][0]["server"]
        assert srv["refused_busy"] == 0
        assert srv["tcp_peers"] >= 250  # the idle ones are still open: they cost a socket
        # the 51 in the handshake (or timed out of it meanwhile): none pushed out by another
        assert srv["unauthenticated"] <= 51 and srv["dropped_unauthenticated"] == 0
        assert srv["tcp_peak"] >= 250 + 1
        assert srv["relayed_missing"] == 0
    finally:
        for s in held:
            s.close()
        c.close()


def test_a_killed_daemon_costs_its_readers_nothing(tmp_path: Path) -> None:
    c = Cluster(str(tmp_path), 3)
    try:
        readers = c.readers(per_node=1, workers=2, rounds=2, until="killed")
        deadline = time.monotonic() + 120
        while not all(os.path.exists(os.path.join(c.work, f"reading{n}-0"))
                      for n in range(c.n)):
            assert time.monotonic() < deadline, [tail(os.path.join(c.work, f"reader{n}-0.log"))
                                                 for n in range(c.n)]
            time.sleep(0.05)
        c.daemons[1].send_signal(signal.SIGKILL)  # mid-read: readers on node 1 and others
        assert c.daemons[1].wait(30) == -signal.SIGKILL
        open(os.path.join(c.work, "killed"), "w").close()
        c.wait_readers(readers)
        results = {res["node"]: res for res in c.results()}
        for res in results.values():
            assert res["exits"] == [0, 0]
            for proc in res["procs"]:
                assert proc["bad"] == 0, res  # every byte exact, no error
                # a stopped daemon would cost its readers this and a probe, not 10 s
                assert proc["fabric_patience"] == FABRIC_PATIENCE
        # node 1's readers lost their daemon: they read the peers themselves
        assert all(p["fabric_failures"] > 0 and p["peer_connects"] > 0
                   for p in results[1]["procs"]), results[1]
        # the others' daemons relayed around the dead node: their readers never went to
        # a peer themselves (an origin read is allowed: a peer slow in the kill's wake)
        for node in (0, 2):
            for proc in results[node]["procs"]:
                assert proc["peer_connects"] == 0 and proc["fabric_failures"] == 0, proc
    finally:
        c.close()


# -- the server's fabric socket, in one process ------------------------------------------------


def _relay_to(peer: ShardServer, token: bytes, shards: Callable[[int], bool],
              pool: PipePool | None, patience: float = 0.5) -> tuple[Relay, PeerClient]:
    """A relay that reads the shards ``shards`` names from ``peer`` (its only holder),
    giving up on it after ``patience`` seconds; and the peer's client."""
    client = PeerClient(*peer.address, token, name="peer")
    times = ReplyTimes(HedgePolicy(initial=patience, cap=patience, to_origin=patience))
    holder = HedgedPeer(PeerSource(client, "peer"), batch_times=times)
    return Relay(lambda s: [holder] if shards(s) else [], 4.0, pool), client


def test_a_daemon_that_hangs_costs_its_readers_its_patience_and_a_probe(
        tmp_path: Path) -> None:
    """A node daemon that does not answer (stopped; here its loop blocked) is given the
    fabric's patience (FABRIC_PATIENCE, here 0.1 s) and a probe that it does not answer
    either (0.2 s), not the reply deadline (30 s here): a batch gives None for each range
    (the Store reads them from the direct holders), a single read goes to the direct
    holders itself, and the daemon is suspect until it answers again. A daemon that is
    only slow (it answers the probe) is waited for."""
    from stagefs.cluster.fabric import FABRIC_PATIENCE, FabricHolder
    from stagefs.tiers.origin import PackOrigin

    assert FABRIC_PATIENCE <= 1.0
    pack, _ = make_pack(str(tmp_path), files=40, shard_size="32KiB")
    m = Manifest(os.path.join(pack, "manifest.sfm"))
    token = auth.new_token()
    shard_bytes = [Path(pack, sh.name).read_bytes() for sh in m.shards]
    go = threading.Event()
    go.set()

    def locate(shard: int) -> str:
        assert go.wait(60)  # cleared: the daemon's loop hangs in its next read
        return os.path.join(pack, m.shards[shard].name)

    path = str(tmp_path / "fabric.sock")
    srv = ShardServer(m, token, locate, "127.0.0.1", unix_path=path).start()
    origin = PackOrigin(pack, m)
    client = PeerClient("", 0, token, unix=path, timeout=30.0, connect_timeout=0.2,
                        backoff=(0.01, 0.01))
    fabric = FabricHolder(client, lambda s: [origin], patience=0.1)
    last = len(m.shards) - 1  # (the server opens each shard once: a shard new to it hangs)
    assert last >= 2
    ranges = [(s, 1, 50) for s in range(1, last)]
    try:
        assert fabric.pread_many([(0, 1, 50)]) == [shard_bytes[0][1:51]]  # it answers
        go.clear()
        assert fabric.pread_many(ranges) == [None] * len(ranges)
        failed = client.stats.failures  # the request's, and its probe's
        assert client.is_suspect() and failed >= 1 and client.stats.probes == 1
        assert fabric.pread(0, 2, 9) == shard_bytes[0][2:11]  # suspect: from the peers
        go.set()  # it wakes up: a probe finds it answering
        deadline = time.monotonic() + 60
        while client.suspect():
            assert time.monotonic() < deadline
            client.wait_probe(1)
        go.clear()
        assert fabric.pread(last, 0, 20) == shard_bytes[last][:20]  # one read: the peers'
        assert client.is_suspect() and client.stats.failures > failed
    finally:
        go.set()
        client.close()
        srv.close()
        origin.close()
        m.close()


def test_a_slow_daemon_that_answers_a_probe_is_waited_for(tmp_path: Path) -> None:
    """The daemon relays to a peer that takes its time (its loop answers, its peer does
    not yet): past the fabric's patience a probe finds the daemon alive, and the reader
    waits for its reply rather than going around it."""
    from stagefs.cluster.fabric import FabricHolder

    gate = threading.Event()
    with _peer_and_fabric(tmp_path, relay_gate=gate) as c:
        client = PeerClient("", 0, c.token, unix=c.path, timeout=60.0, connect_timeout=5.0)
        fabric = FabricHolder(client, lambda s: [], patience=0.05)
        want = Path(c.pack, c.m.shards[1].name).read_bytes()[64:164]
        got: list[bytes | None] = []
        t = threading.Thread(target=lambda: got.extend(fabric.pread_many([(1, 64, 100)])))
        t.start()
        deadline = time.monotonic() + 60
        while client.stats.probes < 2:  # it asked twice whether the daemon lives: it does
            assert time.monotonic() < deadline and t.is_alive()
            time.sleep(0.01)
        gate.set()
        t.join(60)
        assert got == [want]
        assert client.stats.failures == 0 and not client.is_suspect()
        client.close()


def test_one_request_mixes_held_and_relayed_ranges_in_order(tmp_path: Path) -> None:
    pack, _ = make_pack(str(tmp_path), files=40, shard_size="32KiB")
    m = Manifest(os.path.join(pack, "manifest.sfm"))
    token = auth.new_token()
    shard_bytes = [Path(pack, sh.name).read_bytes() for sh in m.shards]
    # the peer holds the odd shards but shard 1; this node the even ones
    peer = ShardServer(m, token, lambda s: os.path.join(pack, m.shards[s].name)
                       if s % 2 and s != 1 else None, "127.0.0.1").start()
    relay, client = _relay_to(peer, token, lambda s: s % 2 == 1, None)
    path = str(tmp_path / "fabric.sock")
    srv = ShardServer(m, token, lambda s: os.path.join(pack, m.shards[s].name)
                      if s % 2 == 0 else None, "127.0.0.1", unix_path=path, relay=relay).start()
    try:
        assert os.stat(path).st_mode & 0o777 == 0o600
        reader = PeerClient("", 0, token, unix=path)
        ranges = [(s, 3, min(100, len(b) - 3)) for s, b in enumerate(shard_bytes)]
        ranges.append((0, 0, 8))
        got = reader.read(ranges)
        for (s, o, n), data in zip(ranges, got, strict=True):
            assert data == (None if s == 1 else shard_bytes[s][o : o + n])
        odd = sum(1 for r in ranges if r[0] % 2)
        # one relayed batch of the odd shards only, in one part to the peer
        assert relay.stats.batches == 1 and relay.stats.ranges == odd
        assert relay.stats.parts == 1 and peer.stats.requests == 1
        # over TCP (another node) nothing is relayed: not held is NOT_HELD
        other = PeerClient(*srv.address, token)
        assert other.read([(1, 0, 8), (0, 0, 8)]) == [None, b"STGFSSHD"]
        assert relay.stats.batches == 1
        st = srv.stats
        assert st.unix_readers == 1 and st.tcp_peers == 1
        assert st.relayed_ranges == len(m.shards) // 2 and st.relayed_missing == 1
        reader.close()
        other.close()
    finally:
        srv.close()
        peer.close()
        client.close()
        m.close()
    assert not os.path.exists(path)


@contextlib.contextmanager
def _peer_and_fabric(tmp_path: Path, relay_gate: threading.Event | None = None
                     ) -> Iterator[SimpleNamespace]:
    """A peer over TCP holding the odd shards, and a fabric server holding the even ones
    that relays the odd ones to it into a pipe pool (the peer answers once ``relay_gate``
    is set, if given: it opens no shard file before); all closed after."""
    pack, _ = make_pack(str(tmp_path), files=60, shard_size="48KiB")
    m = Manifest(os.path.join(pack, "manifest.sfm"))
    token = auth.new_token()

    def where(odd: bool) -> Any:
        return lambda s: os.path.join(pack, m.shards[s].name) if s % 2 == odd else None

    def gated(s: int) -> str | None:
        if relay_gate is not None:
            relay_gate.wait(30)
        return where(True)(s)

    peer = ShardServer(m, token, gated, "127.0.0.1").start()
    pool = PipePool()
    relay, client = _relay_to(peer, token, lambda s: s % 2 == 1, pool, patience=30.0)
    path = str(tmp_path / "fabric.sock")
    fabric = ShardServer(m, token, where(False), "127.0.0.1", unix_path=path,
                         relay=relay).start()
    try:
        yield SimpleNamespace(pack=pack, m=m, token=token, pool=pool, fabric=fabric, path=path,
                              relay=relay, peer=peer)
    finally:
        fabric.close()
        peer.close()
        client.close()
        pool.close()
        m.close()


def _pool_idle(pool: PipePool) -> bool:
    return pool._made == len(pool._idle) and all(p.count == 0 for p in pool._idle)


def test_relayed_ranges_go_from_the_peer_to_the_reader_through_pipes(tmp_path: Path) -> None:
    with _peer_and_fabric(tmp_path) as c:
        shard_bytes = [Path(c.pack, sh.name).read_bytes() for sh in c.m.shards]
        reader = PeerClient("", 0, c.token, unix=c.path)
        # held and relayed, whole shards and pieces, an empty range, interleaved
        ranges = [(s, o, n) for s, b in enumerate(shard_bytes)
                  for o, n in ((0, len(b)), (17, min(5000, len(b) - 17)), (3, 0))]
        for _ in range(3):  # the pool's pipes are reused: nothing of a range stays behind
            got = reader.read(ranges)
            assert got == [shard_bytes[s][o : o + n] for s, o, n in ranges]
        odd_ok = sum(1 for s, _, n in ranges if s % 2 and n)
        st = c.fabric.stats
        assert st.relayed_piped == 3 * odd_ok and st.relayed_missing == 0
        assert c.pool.ranges == 3 * odd_ok and c.pool.fallbacks == 0
        assert _pool_idle(c.pool)
        reader.close()


def test_a_reader_gone_before_its_relay_answers_leaves_no_pipe_behind(tmp_path: Path) -> None:
    gate = threading.Event()
    fds = len(os.listdir("/proc/self/fd"))
    with _peer_and_fabric(tmp_path, gate) as c:
        s = authed(c.path, c.token)
        odd = [P.Range(sh, 0, c.m.shards[sh].size) for sh in range(1, len(c.m.shards), 2)]
        s.sendall(P.encode(P.Read(7, tuple(odd))))
        while c.fabric.stats.relayed_requests == 0:
            time.sleep(0.01)
        s.close()  # the reader goes away while its relay is out
        gate.set()
        while c.fabric.stats.relayed_piped < len(odd):
            time.sleep(0.01)
        deadline = time.monotonic() + 30
        while not _pool_idle(c.pool) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert _pool_idle(c.pool)  # every pipe of the dropped reply closed or back, empty
        assert c.fabric.stats.active == 0
    assert len(os.listdir("/proc/self/fd")) <= fds


def _queued(s: socket.socket) -> int:
    """Bytes waiting in ``s`` for it to receive them, once that stops growing."""
    prev, same = -1, 0
    while same < 20:
        q = struct.unpack("i", fcntl.ioctl(s, termios.FIONREAD, b"\0" * 4))[0]
        same = same + 1 if q == prev else 0
        prev = q
        time.sleep(0.01)
    return prev


def test_a_reply_of_megabytes_waits_in_the_reader_s_socket_not_in_the_daemon(
        tmp_path: Path) -> None:
    """A reader's Unix connection has a send buffer of UNIX_SNDBUF (as far as the kernel's
    net.core.wmem_max lets it): a reply of a few MB goes into its socket at once, not in
    rounds of the default 208 KiB, each waiting for the reader to drain the last."""
    with open("/proc/sys/net/core/wmem_max") as f:
        cap = int(f.read())
    with _peer_and_fabric(tmp_path) as c:
        s = authed(c.path, c.token)
        held = tuple([P.Range(0, 0, c.m.shards[0].size)] * 60)  # shard 0: the fabric's own
        total = sum(r.length for r in held)
        assert total > 2 * 2**20
        s.sendall(P.encode(P.Read(1, held)))
        queued = _queued(s)  # the reader has not received a byte yet
        if cap >= UNIX_SNDBUF:
            assert queued >= total  # the whole reply, frame and all
        else:  # the kernel's cap: stagefs doctor warns
            assert queued >= min(total, cap)
        reply = P.FrameDecoder(2 * total)
        while not (msgs := reply.messages()):
            reply.feed(s.recv(1 << 20))
        data = msgs[0]
        assert isinstance(data, P.Data)
        want = Path(c.pack, c.m.shards[0].name).read_bytes()
        assert all(bytes(ch) == want for ch in data.chunks if ch is not None)
        assert len([ch for ch in data.chunks if ch is not None]) == len(held)
        s.close()


def test_a_reader_that_stops_reading_its_replies_holds_little_daemon_memory(
        tmp_path: Path) -> None:
    """Requests whose replies a reader does not take (a stopped DataLoader worker) stop
    being read once the replies queued for it hold _MAX_HELD bytes of memory: the rest wait
    in the socket, and are answered once it reads again."""
    from stagefs.net import server as server_mod

    with _peer_and_fabric(tmp_path) as c:
        s = authed(c.path, c.token)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        size = c.m.shards[0].size - 64  # under the sendfile size: read into memory
        assert size < server_mod._SENDFILE_MIN
        ranges = tuple([P.Range(0, 64, size)] * 600)  # ~27 MB a reply
        one = size * len(ranges)
        n = 2 * server_mod._MAX_HELD // one + 4
        sender = threading.Thread(target=lambda: [s.sendall(P.encode(P.Read(k, ranges)))
                                                  for k in range(1, n + 1)], daemon=True)
        sender.start()
        conn = None
        deadline = time.monotonic() + 60
        while conn is None or conn.events & 1 or conn.held < server_mod._MAX_HELD:
            assert time.monotonic() < deadline, (conn and (conn.events, conn.held))
            conns = [k for k in c.fabric._authed if k.unix]
            conn = conns[0] if conns else None
            time.sleep(0.01)
        # it stopped reading: what it holds is the cap and one reply at most
        assert conn.held < server_mod._MAX_HELD + one
        assert c.fabric.stats.requests < n
        want = Path(c.pack, c.m.shards[0].name).read_bytes()[64:]
        dec = P.FrameDecoder(2 * one)
        got = 0
        s.settimeout(60)
        while got < n:  # it reads again: every request is answered, in order
            dec.feed(s.recv(1 << 20))
            for msg in dec.messages():
                assert isinstance(msg, P.Data) and msg.request_id == got + 1
                assert all(bytes(ch) == want for ch in msg.chunks)
                got += 1
        sender.join(60)
        assert conn.held == 0
        s.close()
        # a reader gone with replies it never took: the heap is trimmed after (glibc kept
        # the memory: a daemon stayed at 4 GB once its stalled readers had gone)
        gone = authed(c.path, c.token)
        gone.sendall(b"".join(P.encode(P.Read(k, ranges)) for k in range(1, 4)))
        deadline = time.monotonic() + 60
        while not any(k.held >= server_mod._TRIM_AFTER for k in c.fabric._authed if k.unix):
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert c.fabric._trim is None
        gone.close()
        while c.fabric._trim is None:
            assert time.monotonic() < deadline
            time.sleep(0.01)


def _limit_descriptors(n: int) -> Callable[[], None]:
    return lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (n, n))


def test_a_daemon_under_1024_descriptors_still_takes_its_readers(tmp_path: Path) -> None:
    """1024 open files, as many nodes allow: the relay's pipes are sized to the limit (a
    sixteenth), so the daemon has room for 200 readers; with the pipes' full pool kept
    apart it had room for 16."""
    work = str(tmp_path)
    pack, _ = make_pack(work, files=20)
    log = os.path.join(work, "daemon0.log")
    d = start(serve_args(work, pack, "--bind", "127.0.0.1"), log,
              preexec_fn=_limit_descriptors(1024))
    try:
        wait_staged(work, 1, d, log=log)
        with open(os.path.join(work, "rt0", "token")) as f:
            token = bytes.fromhex(f.read().strip())
        path = os.path.join(work, "rt0", "fabric.sock")
        readers = [authed(path, token) for _ in range(200)]
        srv = PeerClient("", 0, token, unix=path).status()["server"]
        assert srv["unix_readers"] >= 200 and srv["refused_busy"] == 0, srv
        for s in readers:
            s.close()
    finally:
        code = stop(d)
    assert code == 0, tail(log)
    assert "open-file limit" not in tail(log, 100_000)  # one node: nothing to warn of


def test_a_job_larger_than_the_descriptors_allow_is_told_at_start(tmp_path: Path) -> None:
    """200 nodes in the hosts file and 1024 open files (room for about 128 peers): the
    daemon says so at start, with what to raise."""
    work = str(tmp_path)
    pack, _ = make_pack(work, files=20)
    with open(os.path.join(work, "hosts"), "w") as f:
        f.write("".join(f"127.0.0.1:{p}\n" for p in free_ports(1))
                + "".join(f"127.0.0.2:{7000 + i}\n" for i in range(199)))
    subprocess.run([sys.executable, "-m", "stagefs.cli", "serve", "--new-token",
                    os.path.join(work, "token")], check=True, timeout=60)
    log = os.path.join(work, "daemon0.log")
    d = start(serve_args(work, pack, "--hosts", os.path.join(work, "hosts"), "--rank", "0",
                         "--token-file", os.path.join(work, "token")), log,
              preexec_fn=_limit_descriptors(1024))
    try:
        deadline = time.monotonic() + 120
        while "open-file limit" not in tail(log) and d.poll() is None:
            assert time.monotonic() < deadline, tail(log)
            time.sleep(0.1)
        text = tail(log)
    finally:
        stop(d)
    assert "the open-file limit (1024) leaves room for connections with about 128 peers, " \
           "and this job has 199" in text, text
    assert "ulimit -Hn" in text


def test_a_thousand_idle_connections_take_no_thread(tmp_path: Path) -> None:
    pack, _ = make_pack(str(tmp_path), files=10)
    m = Manifest(os.path.join(pack, "manifest.sfm"))
    token = auth.new_token()
    srv = ShardServer(m, token, lambda s: os.path.join(pack, m.shards[s].name),
                      "127.0.0.1").start()
    conns: list[socket.socket] = []
    n = min(1000, (raise_fd_limit()[1] - 300) // 2)  # both ends are in this process
    try:
        threads = threading.active_count()
        conns = [authed(srv.address, token) for _ in range(n)]
        c = PeerClient(*srv.address, token)
        assert c.read([(0, 0, 8)]) == [b"STGFSSHD"]
        assert srv.stats.tcp_peers == n + 1 and srv.stats.refused_busy == 0
        assert threading.active_count() == threads  # no thread per connection
        c.close()
    finally:
        for s in conns:
            s.close()
        srv.close()
        m.close()


def _stopped(proc: subprocess.Popen[bytes]) -> None:
    """SIGSTOP, and wait until the process is stopped (the signal takes effect later)."""
    proc.send_signal(signal.SIGSTOP)
    for _ in range(3000):
        with open(f"/proc/{proc.pid}/stat") as f:
            if f.read().rpartition(")")[2].split()[0] == "T":
                return
        time.sleep(0.01)
    raise AssertionError(f"process {proc.pid} did not stop")


def test_unreachable_peers_cost_a_relay_one_hedging_delay_then_none(tmp_path: Path) -> None:
    """Every other node stops answering while their connections stay open (SIGSTOP: what a
    partition looks like from this side, no reset, no refusal): the first relayed batch
    that meets them waits the hedging delays, not the relay's deadline, and marks them
    suspect; every later batch goes to the origin at once, without a request to them; once
    they answer again the relay reads them again. Counted, never timed."""
    c = Cluster(str(tmp_path), 3, replicas=2)
    fs = stagefs.connect(os.path.join(c.work, "rt0"))
    daemon0 = PeerClient("", 0, c.token, unix=os.path.join(c.work, "rt0", "fabric.sock"))
    try:
        with open(os.path.join(c.work, "expected.json")) as f:
            expected: dict[str, str] = json.load(f)
        mine = fs.held_shards()
        far = [p for p in sorted(expected) if fs.stat(p).st_size
               and int(fs.manifest.shard[fs.namespace.file_entry(p)]) not in mine]
        assert len(far) >= 8  # files only nodes 1 and 2 hold: node 0's daemon relays them

        def exact(paths: list[str]) -> bool:
            return all(xxh3_64_hexdigest(d) == expected[p]
                       for p, d in zip(paths, fs.read_many(paths), strict=True))

        def relay() -> dict[str, Any]:
            """The daemon's relay counters, once they count every request this process
            sent it (none of these files is held on node 0: each request is one relayed
            batch; the daemon computes its status at most every 0.2 s)."""
            sent = fs.status()["fabric"]["requests"]
            for _ in range(600):
                st = dict(daemon0.status()["fabric"])
                if st["relay"]["batches"] >= sent:
                    return st
                time.sleep(0.05)
            raise AssertionError(f"the relay counted fewer than {sent} batches: {st}")

        assert exact(far) and fs.origin.stats.reads == 0  # the relay's connections are up
        for d in c.daemons[1:]:
            _stopped(d)
        batches = [far[i : i + 2] for i in range(0, 8, 2)]
        assert exact(batches[0])
        first = relay()
        # the batch that met them waited the hedging delays, not the relay's deadline, and
        # gave up on each of them (suspect now)
        assert first["relay"]["late"] == 0 and first["gave_up"] >= 2, first
        assert first["suspect_peers"] == [1, 2], first
        origin = fs.origin.stats.reads
        assert origin > 0
        for b in batches[1:]:
            assert exact(b)
        assert fs.origin.stats.reads > origin
        st = relay()
        # every later batch (and each range read again one by one) went to the origin at
        # once: no request to a stopped peer, none given up on again, nothing late
        assert st["relay"]["late"] == 0 and st["gave_up"] == first["gave_up"], st
        assert st["relay"]["parts"] == first["relay"]["parts"], st
        assert st["relay"]["skipped"] >= first["relay"]["skipped"] + 2 * (len(batches) - 1)
        # they answer again: after a probe (or the late answer of a request left in
        # flight), relayed reads go to them again and nothing more to the origin
        for d in c.daemons[1:]:
            d.send_signal(signal.SIGCONT)
        for _ in range(600):
            if not relay()["suspect_peers"]:
                break
            assert exact(far[:2])  # reads drive the probes of suspect peers
            time.sleep(0.1)
        assert not relay()["suspect_peers"]
        origin, relayed = fs.origin.stats.reads, relay()["relay"]
        assert exact(far)
        st = relay()
        assert fs.origin.stats.reads == origin and st["relay"]["batches"] > relayed["batches"]
        assert st["relay"]["missing"] == relayed["missing"], st  # the peers gave every range
    finally:
        daemon0.close()
        fs.close()
        for d in c.daemons[1:]:
            d.send_signal(signal.SIGCONT)
        c.close()


# -- descriptors: a reader keeps one open for each shard of its node it reads ------------------

_FDS_READER = """
import json, os, resource, sys
from xxhash import xxh3_64_hexdigest
resource.setrlimit(resource.RLIMIT_NOFILE, (int(sys.argv[2]), int(sys.argv[3])))
import stagefs
with open(os.path.join(sys.argv[1], "expected.json")) as f:
    expected = json.load(f)
fs = stagefs.connect(os.path.join(sys.argv[1], "rt0"))
if sys.argv[4] == "read":
    assert all(xxh3_64_hexdigest(fs.read(p)) == h for p, h in expected.items())
    assert fs.status()["origin"]["bytes_read"] == 0
print("read", len(fs.held_shards()), resource.getrlimit(resource.RLIMIT_NOFILE)[0])
"""


def _small_shards(work: str, n: int) -> str:
    """A pack of ``n`` shards, one 3 KB file each (a node of many small shards)."""
    src = os.path.join(work, "src")
    os.makedirs(src)
    content = {}
    for i in range(n):
        content[f"f{i:04d}.bin"] = data = os.urandom(3000)
        with open(os.path.join(src, f"f{i:04d}.bin"), "wb") as f:
            f.write(data)
    write_expected(work, content)
    pack = os.path.join(work, "pack")
    stagefs.pack(src, pack, shard_size="4KiB", jobs=1)
    return pack


def test_a_reader_raises_its_soft_open_file_limit_and_says_when_it_is_short(
        tmp_path: Path) -> None:
    """300 shards on the node, a reader's soft limit 128 (the hard one higher, as usual):
    it raises it, as the single-node tier chain does, and reads them all from the tier.
    It failed at about the 100th shard, with an error blaming the shared file system.
    Under a hard limit of 128 it says at connect what the limit is and to raise it."""
    work = str(tmp_path)
    pack = _small_shards(work, 300)
    log = os.path.join(work, "daemon0.log")
    d = start(serve_args(work, pack, "--bind", "127.0.0.1", "--wait"), log)
    try:
        wait_staged(work, 1, d, log=log)
        run = [sys.executable, "-c", _FDS_READER, work]
        raised = subprocess.run([*run, "128", "4096", "read"], capture_output=True,
                                text=True, timeout=120)
        assert raised.returncode == 0, raised.stderr
        assert raised.stdout.split() == ["read", "300", "4096"], raised.stdout
        assert "open-file limit" not in raised.stderr, raised.stderr
        short = subprocess.run([*run, "128", "128", "connect"], capture_output=True,
                               text=True, timeout=120)
        assert short.returncode == 0, short.stderr
        assert "the open-file limit of this process (128" in short.stderr, short.stderr
        assert "ulimit -n" in short.stderr and "shared file system" not in short.stderr
    finally:
        assert stop(d) == 0, tail(log)


def test_a_daemon_whose_shards_the_limit_cannot_hold_says_so_and_serves_on(
        tmp_path: Path) -> None:
    """400 shards on one node, 1,024 open files: the daemon says at start that its shards
    may take more (2 descriptors each, one more each read from the origin) and what to
    raise the limit to; the daemon answers STATUS, and a reader gets every byte. The limit
    was only checked against the job's peers. Staging stopped at the limit while each
    staged copy kept 4 descriptors; let go of once whole, all 400 are staged."""
    work = str(tmp_path)
    pack = _small_shards(work, 400)
    log = os.path.join(work, "daemon0.log")
    d = start(serve_args(work, pack, "--bind", "127.0.0.1", "--wait"), log,
              preexec_fn=_limit_descriptors(1024))
    try:
        wait_staged(work, 1, d, log=log)
        text = tail(log, 100_000)
        assert "the open-file limit (1024) cannot hold what this node keeps open: about " \
               "1200 descriptors for its shards" in text, text
        assert "ulimit -n" in text
        nodes = status_json(work, 0)["nodes"]
        assert isinstance(nodes, list) and nodes[0]["staging"]["shards_held"] == 400, nodes
        with open(os.path.join(work, "expected.json")) as f:
            expected: dict[str, str] = json.load(f)
        with stagefs.connect(os.path.join(work, "rt0")) as fs:
            assert all(xxh3_64_hexdigest(fs.read(p)) == h for p, h in expected.items())
    finally:
        assert stop(d) == 0, tail(log)


# -- a reader back on its daemon leaves the peers it read directly meanwhile --------------------


def _tcp_to(ports: set[int]) -> int:
    """This process's TCP connections to any of ``ports`` (its own sockets only: the
    daemons' connections to each other are theirs)."""
    mine = set()
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/self/fd/{fd}")
            if target.startswith("socket:["):
                mine.add(target[8:-1])
    n = 0
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        with contextlib.suppress(OSError), open(table) as f:
            for line in f.readlines()[1:]:
                cols = line.split()
                port = int(cols[2].rsplit(":", 1)[1], 16)
                if port in ports and cols[3] == "01" and cols[9] in mine:  # ESTABLISHED
                    n += 1
    return n


def test_a_reader_back_on_its_daemon_closes_its_connections_to_peers(tmp_path: Path) -> None:
    """Node 1's daemon killed: its reader reads the peers directly, with connections of
    its own. Once the daemon is back and answers, the reader closes them (the fabric's
    bound: connections grow with nodes, not with readers). They stayed open, idle, until
    the peers' idle timeout (15 minutes)."""
    c = Cluster(str(tmp_path), 3, replicas=1)  # every peer holds shards no other holds
    fs = stagefs.connect(os.path.join(c.work, "rt1"))
    try:
        with open(os.path.join(c.work, "expected.json")) as f:
            expected: dict[str, str] = json.load(f)
        paths = sorted(expected)
        with open(os.path.join(c.work, "hosts")) as f:
            ports = {int(line.rsplit(":", 1)[1]) for line in f.read().split()}

        def exact() -> bool:
            return all(xxh3_64_hexdigest(d) == expected[p]
                       for p, d in zip(paths, fs.read_many(paths), strict=True))

        assert exact() and _tcp_to(ports) == 0  # through the fabric only
        stop(c.daemons[1], signal.SIGKILL)
        assert exact() and _tcp_to(ports) >= 2  # the peers, directly
        c.daemons[1] = c.daemon(1)
        wait_staged(c.work, c.n, c.daemons[1], log=os.path.join(c.work, "daemon1.log"))
        deadline = time.monotonic() + 60
        while fs.status()["fabric"]["suspect"]:  # reads drive the daemon's probes
            assert time.monotonic() < deadline, "the daemon never answered again"
            assert exact()
            time.sleep(0.2)
        assert exact()
        # (a hedged request in flight closes its own when done; a read the daemon, just
        # back, left to the peers opens them again, and the next read through it sheds
        # them: reads drive it, as a training loop's do)
        while _tcp_to(ports):
            assert time.monotonic() < deadline, f"{_tcp_to(ports)} connections to peers"
            time.sleep(0.1)
            assert exact()
        assert exact() and _tcp_to(ports) == 0
    finally:
        fs.close()
        c.close()


@contextlib.contextmanager
def _one_server(tmp_path: Path) -> Iterator[tuple[PeerClient, bytes]]:
    """A server of a small pack on a Unix socket, a client of it, and the first 4 KiB of its
    first shard."""
    pack, _ = make_pack(str(tmp_path), files=30, shard_size="48KiB")
    m = Manifest(os.path.join(pack, "manifest.sfm"))
    token = auth.new_token()
    path = str(tmp_path / "fabric.sock")
    srv = ShardServer(m, token, lambda s: os.path.join(pack, m.shards[s].name), "127.0.0.1",
                      unix_path=path).start()
    client = PeerClient("", 0, token, unix=path, timeout=30.0)
    try:
        yield client, Path(pack, m.shards[0].name).read_bytes()[:4096]
    finally:
        client.close()
        srv.close()
        m.close()


def test_a_connection_made_while_the_reader_sheds_its_peers_is_not_kept(
        tmp_path: Path) -> None:
    """A reader back on its daemon sheds its connections to peers (``PeerClient.shed``)
    while a direct read is still connecting to one (a hedge, a read begun before the
    daemon answered): that connection is closed when its read is done, not pooled. It was
    counted as made after the shed, kept idle until the peer's idle timeout, and the
    reader's connections to peers outlived its daemon's return (about 1 run in 4 of the
    test above)."""
    with _one_server(tmp_path) as (client, want):
        handshake = client._handshake

        def shed_meanwhile(*args: Any) -> None:  # the reader sheds while this one connects
            handshake(*args)
            client.shed()

        client._handshake = shed_meanwhile  # type: ignore[method-assign]
        assert client.read([(0, 0, 4096)]) == [want]
        assert client._idle == []  # closed once its read was done
        client._handshake = handshake  # type: ignore[method-assign]
        assert client.read([(0, 0, 4096)]) == [want]  # one made after the shed is kept
        assert len(client._idle) == 1 and client.stats.connects == 2


def test_a_forked_child_lets_go_of_its_parent_s_connections(tmp_path: Path) -> None:
    """A DataLoader worker forked from a reader opens its own connection to the node daemon
    and closes its copies of the parent's (its descriptors only): the parent reads on on its
    own, and its connection ends when the parent closes it, not when the last worker exits
    (a child that only forgot them kept them open as long as it lived)."""
    with _one_server(tmp_path) as (client, want):
        assert client.read([(0, 0, 4096)]) == [want]
        inherited = [(s.fileno(), os.fstat(s.fileno()).st_ino) for s in client._idle]
        assert inherited
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child's outcome goes through the pipe
            try:
                ok = client.read([(0, 0, 4096)]) == [want]
                kept = 0
                for fd, ino in inherited:
                    with contextlib.suppress(OSError):
                        kept += os.fstat(fd).st_ino == ino
                os.write(w, json.dumps({"ok": ok, "kept": kept}).encode())
            finally:
                os._exit(0)
        os.close(w)
        with os.fdopen(r) as f:
            got = json.loads(f.read() or "{}")
        assert os.waitpid(pid, 0)[1] == 0
        assert got == {"ok": True, "kept": 0}, got
        # the parent's connection is whole: read on it, no new connection made
        assert client.read([(0, 0, 4096)]) == [want]
        assert client.stats.connects == 1 and client.stats.failures == 0
