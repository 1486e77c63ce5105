"""The node daemon's relay in its event loop (net/relay.py), on real servers and sockets: a
fabric server relaying its reader's ranges to peer servers over TCP. Slow peers are hedged,
a peer that dies or lies mid-reply costs its ranges one more holder, never a wrong byte,
and a hung peer fails its probe. Counted, never timed (the delays only bound waits)."""

from __future__ import annotations

import contextlib
import os
import socket
import struct
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from cluster_helpers import make_pack

from stagefs.errors import ProtocolError
from stagefs.format import Manifest
from stagefs.net import auth
from stagefs.net import protocol as P
from stagefs.net.client import PeerClient, PeerSource
from stagefs.net.hedge import HedgedPeer, HedgePolicy, ReplyTimes
from stagefs.net.pipes import PipePool
from stagefs.net.relay import Relay
from stagefs.net.server import ShardServer
from stagefs.net.sockio import recv_message, send_message


def _holder(address: tuple[str, int], token: bytes, name: str, hedge_after: float,
            give_up_after: float) -> HedgedPeer:
    client = PeerClient(*address, token, name=name, timeout=30.0)
    times = ReplyTimes(HedgePolicy(initial=hedge_after, floor=hedge_after, cap=hedge_after,
                                   to_origin=give_up_after))
    return HedgedPeer(PeerSource(client, name), batch_times=times)


@contextlib.contextmanager
def _fabric(tmp_path: Path, peers: Callable[[SimpleNamespace], list[HedgedPeer]],
            timeout: float = 20.0, pipes: bool = True) -> Iterator[SimpleNamespace]:
    """A fabric server holding no shard, whose relay asks ``peers(c)`` (in that order) for
    every shard (receiving into pipes, or into memory); ``c`` has the pack, its manifest,
    the token and ``serve(locate)`` that starts a peer server."""
    pack, _ = make_pack(str(tmp_path), files=30, shard_size="48KiB")
    m = Manifest(os.path.join(pack, "manifest.sfm"))
    c = SimpleNamespace(pack=pack, m=m, token=auth.new_token(), servers=[])

    def serve(locate: Callable[[int], str | None]) -> ShardServer:
        srv = ShardServer(m, c.token, locate, "127.0.0.1").start()
        c.servers.append(srv)
        return srv

    def every(s: int) -> str:
        return os.path.join(pack, m.shards[s].name)

    c.serve, c.every = serve, every
    c.shard_bytes = [Path(pack, sh.name).read_bytes() for sh in m.shards]
    c.holders = peers(c)
    c.pool = PipePool()
    c.relay = Relay(lambda s: c.holders, timeout, c.pool if pipes else None)
    c.fabric = ShardServer(m, c.token, lambda s: None, "127.0.0.1",
                           unix_path=str(tmp_path / "fabric.sock"), relay=c.relay).start()
    c.reader = PeerClient("", 0, c.token, unix=str(tmp_path / "fabric.sock"), timeout=60.0)
    c.ranges = [(s, 5, len(b) - 9) for s, b in enumerate(c.shard_bytes)]
    c.want = [b[5:-4] for b in c.shard_bytes]
    try:
        yield c
    finally:
        c.reader.close()
        c.fabric.close()
        for h in c.holders:
            h.client.close()
        for srv in c.servers:
            srv.close()
        c.pool.close()
        m.close()


def _pipes_back(pool: PipePool) -> bool:
    """Every pipe the pool made is idle and empty again, once the loop has given back the
    last ones (after their bytes reached the reader)."""
    for _ in range(3000):
        if pool._made == len(pool._idle) and all(p.count == 0 for p in pool._idle):
            return True
        threading.Event().wait(0.01)
    return False


class _CraftedPeer:
    """A peer that proves the token, then answers each READ with what ``reply(sock, req)``
    sends (a dying or lying daemon); the connections it took are counted."""

    def __init__(self, token: bytes, pack_id: bytes,
                 reply: Callable[[socket.socket, P.Read], None]) -> None:
        self.token, self.pack_id, self.reply = token, pack_id, reply
        self.ls = socket.create_server(("127.0.0.1", 0))
        self.address: tuple[str, int] = self.ls.getsockname()[:2]
        self.connections = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                s, _ = self.ls.accept()
            except OSError:
                return
            self.connections += 1
            threading.Thread(target=self._serve, args=(s,), daemon=True).start()

    def _serve(self, s: socket.socket) -> None:
        with s:
            nonce = auth.new_nonce()
            send_message(s, P.Challenge(nonce, self.pack_id))
            msg = recv_message(s)
            assert isinstance(msg, P.Auth)
            send_message(s, P.AuthOk(auth.server_proof(self.token, nonce, msg.nonce,
                                                       auth.channel_binding(s, accepted=True))))
            while True:
                try:
                    req = recv_message(s)
                except (OSError, ProtocolError):
                    return
                if isinstance(req, P.StatusRequest):
                    continue  # a hung peer: never answers a probe
                assert isinstance(req, P.Read)
                self.reply(s, req)

    def close(self) -> None:
        self.ls.close()


def _dies_mid_reply(s: socket.socket, req: P.Read) -> None:
    """The reply's header and slot table, half of its first range, then the end."""
    n = req.ranges[0].length
    head = P.HEADER.pack(P.MAGIC, P.VERSION, P.T_DATA, 0, P.DATA_HEAD + P.SLOT_SIZE
                         * len(req.ranges) + sum(r.length for r in req.ranges))
    table = struct.pack("!II", req.request_id, len(req.ranges)) + b"".join(
        struct.pack("!BI", P.OK, r.length) for r in req.ranges)
    s.sendall(head + table + b"\x00" * (n // 2))
    s.shutdown(socket.SHUT_RDWR)


def _lies(s: socket.socket, req: P.Read) -> None:
    s.sendall(b"HTTP/1.1 200 OK\r\n\r\n" + b"x" * 64)


@pytest.mark.parametrize("fault", [_dies_mid_reply, _lies], ids=["dies", "malformed"])
def test_a_peer_that_fails_mid_reply_costs_its_ranges_one_more_holder(
        tmp_path: Path, fault: Callable[[socket.socket, P.Read], None]) -> None:
    crafted: list[_CraftedPeer] = []

    def peers(c: SimpleNamespace) -> list[HedgedPeer]:
        bad = _CraftedPeer(c.token, c.m.pack_id, fault)
        crafted.append(bad)
        good = c.serve(c.every)
        return [_holder(bad.address, c.token, "bad", 10.0, 15.0),
                _holder(good.address, c.token, "good", 10.0, 15.0)]

    with _fabric(tmp_path, peers) as c:
        assert c.reader.read(c.ranges) == c.want  # every byte right, none from the bad one
        st = c.relay.stats
        assert st.upstream_failures == 1 and st.missing == 0 and st.rounds == 1, st
        bad, good = c.holders
        assert bad.client.is_suspect() and not good.client.is_suspect()
        assert bad.client.stats.failures == 1
        # the next batch skips the suspect peer: no new connection to it
        assert c.reader.read(c.ranges[:3]) == c.want[:3]
        assert crafted[0].connections == 1 and c.relay.stats.upstream_failures == 1
        assert _pipes_back(c.pool)  # no pipe of the broken reply kept
        crafted[0].close()


def test_a_slow_peer_is_hedged_to_the_next_replica_and_its_late_reply_dropped(
        tmp_path: Path) -> None:
    gate = threading.Event()

    def peers(c: SimpleNamespace) -> list[HedgedPeer]:
        def slow_locate(s: int) -> str:
            gate.wait(30)  # the slow peer's loop stalls on its first shard file
            return c.every(s)

        slow, fast = c.serve(slow_locate), c.serve(c.every)
        return [_holder(slow.address, c.token, "slow", 0.05, 20.0),
                _holder(fast.address, c.token, "fast", 0.05, 20.0)]

    with _fabric(tmp_path, peers) as c:
        slow, fast = c.holders
        try:
            assert c.reader.read(c.ranges) == c.want
            st = c.relay.stats
            assert slow.hedged == 1 and st.parts == 2 and st.missing == 0, st
            assert slow.client.is_suspect()  # another replica's bytes came first
            assert fast.outstanding == 0 and slow.outstanding == 0
        finally:
            gate.set()
        for _ in range(3000):  # the slow peer's late reply: received and dropped
            if c.relay.stats.late_replies:
                break
            threading.Event().wait(0.01)
        assert c.relay.stats.late_replies == 1
        assert _pipes_back(c.pool)


@pytest.mark.parametrize("pipes", [False, True])
def test_an_answered_batch_is_let_go_at_once(tmp_path: Path, pipes: bool) -> None:
    """Once the reader has a batch, nothing in the daemon holds it: not its deadline's timer
    (20 s here), nor its parts' hedging and give-up timers, all cancelled but left in the
    loop's heap until their time. Held by them, the ranges a daemon relayed in memory (no
    pipe to be had) piled up: 5-7 GB in a daemon relaying 0.7 GB/s for 20 s."""
    import gc

    from stagefs.net.relay import _Batch, _Part

    def peers(c: SimpleNamespace) -> list[HedgedPeer]:
        return [_holder(c.serve(c.every).address, c.token, "peer", 10.0, 15.0)]

    def held() -> int:
        gc.collect()
        kinds = (_Batch, _Part)  # type(), not isinstance: no object's __class__ is asked
        return sum(type(o) in kinds for o in gc.get_objects())

    with _fabric(tmp_path, peers, pipes=pipes) as c:
        for _ in range(5):
            assert c.reader.read(c.ranges) == c.want
        for _ in range(300):  # the loop lets go of its last one as it sends the reply
            if not held():
                break
            threading.Event().wait(0.01)
        assert held() == 0
        assert c.relay.stats.batches == 5 and c.relay.stats.missing == 0


def test_the_loop_does_not_wake_up_for_cancelled_timers(tmp_path: Path) -> None:
    """A relayed batch leaves three cancelled timers in the loop's heap (its deadline, its
    part's hedging and give-up): the loop sleeps through their times, to its next live
    timer. Counted in the loop's calls to select while 30 cancelled timers come due."""
    pack, _ = make_pack(str(tmp_path), files=4, shard_size="48KiB")
    m = Manifest(os.path.join(pack, "manifest.sfm"))
    srv = ShardServer(m, auth.new_token(), lambda s: None, "127.0.0.1").start()
    try:
        sel = srv._sel
        real = sel.select
        calls = [0]

        def counting(timeout: float | None = None) -> Any:
            calls[0] += 1
            return real(timeout)

        fired = threading.Event()

        def arm() -> None:
            for k in range(30):
                srv.later(0.005 * (k + 1), lambda: None).cancel()
            srv.later(0.4, fired.set)
            calls[0] = 0
            sel.select = counting  # type: ignore[method-assign]

        srv.soon(arm)
        assert fired.wait(30)
        # the wake-up the live timer takes, and perhaps the loop's tick; one a cancelled
        # timer made 30 more
        assert calls[0] <= 4, calls[0]
    finally:
        srv.close()
        m.close()


def test_a_batch_no_holder_answers_is_none_by_its_deadline(tmp_path: Path) -> None:
    """Every holder hangs (it proves the token, then never answers) and the hedging delays
    are longer than the batch's deadline: at the deadline every range is NOT_HELD (the
    reader's origin answers), and the parts are counted late."""
    hung: list[_CraftedPeer] = []

    def peers(c: SimpleNamespace) -> list[HedgedPeer]:
        hung.extend(_CraftedPeer(c.token, c.m.pack_id, lambda s, r: None) for _ in range(2))
        return [_holder(h.address, c.token, f"hung {i}", 30.0, 30.0)
                for i, h in enumerate(hung)]

    with _fabric(tmp_path, peers, timeout=0.5) as c:
        assert c.reader.read(c.ranges) == [None] * len(c.ranges)
        st = c.relay.stats
        assert st.late == 1 and st.missing == len(c.ranges) and st.parts == 1, st
        for h in hung:
            h.close()


def test_a_probe_on_the_relay_s_connection(tmp_path: Path) -> None:
    """A live peer answers its probe on the relay's connection (no new connection after
    the first); a hung one does not, within the probe's timeout, and is suspect."""
    hung: list[_CraftedPeer] = []

    def peers(c: SimpleNamespace) -> list[HedgedPeer]:
        hung.append(_CraftedPeer(c.token, c.m.pack_id, lambda s, r: None))
        live = c.serve(c.every)
        return [_holder(live.address, c.token, "live", 1.0, 2.0),
                _holder(hung[0].address, c.token, "hung", 1.0, 2.0)]

    with _fabric(tmp_path, peers) as c:
        live, stuck = c.holders
        assert c.relay.probe(live, 5.0) and c.relay.probe(live, 5.0)
        assert c.reader.read(c.ranges[:2]) == c.want[:2]  # on the same connection
        assert c.servers[0].stats.connections == 1
        assert not c.relay.probe(stuck, 0.3)
        assert stuck.client.is_suspect() and not live.client.is_suspect()
        hung[0].close()


def test_a_probe_s_short_deadline_holds_on_a_connection_with_a_long_request_out(
        tmp_path: Path) -> None:
    """A relayed part waits on a hung peer with a 30 s deadline; a probe of that peer with
    a 0.3 s one still fails by its own deadline (the connection's watchdog is brought
    forward), which closes the connection, so the part goes on too: its ranges to no one
    left, NOT_HELD, and the reader's read returns long before the part's deadline."""
    hung: list[_CraftedPeer] = []

    def peers(c: SimpleNamespace) -> list[HedgedPeer]:
        hung.append(_CraftedPeer(c.token, c.m.pack_id, lambda s, r: None))
        return [_holder(hung[0].address, c.token, "hung", 30.0, 30.0)]

    with _fabric(tmp_path, peers, timeout=60.0) as c:
        got: list[Any] = []
        t = threading.Thread(target=lambda: got.append(c.reader.read(c.ranges[:2])))
        t.start()
        for _ in range(3000):
            if c.relay.stats.parts:
                break
            threading.Event().wait(0.01)
        assert not c.relay.probe(c.holders[0], 0.3)
        t.join(20)
        assert not t.is_alive() and got == [[None, None]]
        st = c.relay.stats
        assert st.upstream_failures == 1 and st.late == 0 and st.missing == 2, st
        hung[0].close()


def test_a_relay_that_fails_leaves_the_reader_to_go_on(tmp_path: Path) -> None:
    """A fault inside the relay (here: the holder lookup raises) answers the relayed
    ranges NOT_HELD, so the reader's origin reads them, and the loop goes on serving."""

    def peers(c: SimpleNamespace) -> list[HedgedPeer]:
        return []

    with _fabric(tmp_path, peers) as c:
        def broken(shard: int) -> list[HedgedPeer]:
            raise RuntimeError("holder lookup failed")

        c.relay.holders = broken
        assert c.reader.read(c.ranges[:3]) == [None] * 3
        assert c.reader.read(c.ranges[:3]) == [None] * 3  # the loop still serves
        assert c.fabric.stats.relayed_missing == 6
