"""A daemon stops soon after SIGTERM whatever its peers do, and still removes what it must.

Node 1 of a two-node static job is played by the test (``FakeNode``): it proves the job
token, holds no shard and has not staged; told to ``hang``, it answers nothing more, as a
daemon stopped with SIGSTOP (its kernel still takes the connections and the requests). A
SIGTERM to node 0 while one of its calls waits on the hung node (a staging read, or the
staged barrier's STATUS) took about 30 s to act on (the daemon's peer reply deadline):
longer than Slurm's KillWait, so the daemon was SIGKILLed before it removed its runtime
map, its token and (--clean-on-exit) its tier data.

The exit is awaited for 15 s: a bound well above what a stop takes now (a second or two,
most of it the interpreter's exit) and well below the 30 s deadline that a call not
interrupted waits out, so a loaded machine does not fail the test and the old behaviour
always does."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from cluster_helpers import make_pack, start, tail

from fake_peer import FakePeer
from stagefs.format import Manifest
from stagefs.net import auth
from stagefs.net import protocol as P
from stagefs.net.client import PeerClient, PeerUnavailable
from stagefs.net.sockio import recv_message

pytestmark = pytest.mark.integration
STOP_BOUND = 15.0  # seconds: see the module's docstring


class FakeNode(FakePeer):
    """Node 1: proves the token, answers every READ "not held" and STATUS "not staged"
    (so node 0 copies its shards from the origin and then waits in the staged barrier);
    after ``hang``, answers nothing. ``held`` is set once a request is left unanswered on a
    connection that carried a READ before (node 0's data connection: the stager's, which
    the barrier uses after it), or on any connection with ``on_any``."""

    def __init__(self, token: bytes, pack_id: bytes) -> None:
        super().__init__(token, pack_id)
        self.hung = threading.Event()
        self.held = threading.Event()
        self.on_any = False

    def hang(self, on_any: bool = False) -> None:
        self.on_any = on_any
        self.hung.set()

    def serve(self, conn: socket.socket) -> None:
        if not self.handshake(conn):
            return
        carried_read = False
        while True:
            msg = recv_message(conn)
            if self.hung.is_set():
                if carried_read or self.on_any:
                    self.held.set()
                continue  # never answered
            if isinstance(msg, P.Read):
                carried_read = True
                n = len(msg.ranges)
                conn.sendall(P.encode(P.Data(msg.request_id, (None,) * n,
                                             (P.NOT_HELD,) * n)))
            elif isinstance(msg, P.StatusRequest):
                conn.sendall(P.encode(P.Status({"staging_done": False,
                                                "primary_done": True})))
            else:
                conn.sendall(P.encode(P.Status({"check": "not checked here"})))


@pytest.fixture()
def job(tmp_path: Path) -> Iterator[tuple[str, str, FakeNode]]:
    work = str(tmp_path)
    pack, _ = make_pack(work, files=80, shard_size="128KiB")
    token_file = os.path.join(work, "token")
    subprocess.run([sys.executable, "-m", "stagefs.cli", "serve", "--new-token", token_file],
                   check=True, timeout=60)
    m = Manifest(os.path.join(pack, "manifest.sfm"))
    fake = FakeNode(auth.read_token(token_file), m.pack_id)
    m.close()
    free = socket.socket()
    free.bind(("127.0.0.1", 0))
    port0 = free.getsockname()[1]
    free.close()
    with open(os.path.join(work, "hosts"), "w") as f:
        f.write(f"127.0.0.1:{port0}\n127.0.0.1:{fake.port}\n")
    yield work, pack, fake
    fake.close()


def _node0(work: str, pack: str) -> subprocess.Popen[bytes]:
    return start([sys.executable, "-m", "stagefs.cli", "serve", pack,
                  "--tier", os.path.join(work, "node0", "mem") + ":256MiB",
                  "--runtime", os.path.join(work, "rt0"), "--hosts",
                  os.path.join(work, "hosts"), "--rank", "0", "--token-file",
                  os.path.join(work, "token"), "--replicas", "2", "--progress", "0",
                  "--clean-on-exit"], os.path.join(work, "daemon0.log"))


def _staged_here(work: str) -> bool:
    """Node 0 says it has staged (its own shards: node 1 never does)."""
    with open(os.path.join(work, "hosts")) as f:
        port = int(f.readline().strip().rpartition(":")[2])
    c = PeerClient("127.0.0.1", port, auth.read_token(os.path.join(work, "token")),
                   timeout=10, connect_timeout=10)
    try:
        return bool(c.status().get("staging_done"))
    except PeerUnavailable:
        return False
    finally:
        c.close()


@pytest.mark.parametrize("during", ["staging", "barrier"])
def test_sigterm_while_a_peer_hangs_stops_the_daemon_at_once(
        during: str, job: tuple[str, str, FakeNode]) -> None:
    work, pack, fake = job
    if during == "staging":
        fake.hang(on_any=True)  # node 0's first request to it (a staging read) hangs
    d = _node0(work, pack)
    log = os.path.join(work, "daemon0.log")
    try:
        if during == "barrier":
            for _ in range(1200):  # (a minute at most)
                if _staged_here(work) or d.poll() is not None:
                    break
                threading.Event().wait(0.05)
            assert d.poll() is None and _staged_here(work), tail(log)
            fake.hang()  # the barrier's next STATUS (on the stager's connection) hangs
        assert fake.held.wait(60), tail(log)
        rt = os.path.join(work, "rt0")
        assert os.path.exists(os.path.join(rt, "cluster.json"))
        d.terminate()
        try:
            code = d.wait(STOP_BOUND)
        except subprocess.TimeoutExpired:
            pytest.fail(f"no exit within {STOP_BOUND:g} s of SIGTERM while node 1 hangs "
                        f"(during {during}):\n{tail(log)}")
        assert code == 0, tail(log)
        # what a stop must remove: the runtime map, the token, the fabric socket, and with
        # --clean-on-exit what it staged
        left = set(os.listdir(rt)) if os.path.isdir(rt) else set()  # (clean removes it)
        assert not {"cluster.json", "token", "fabric.sock"} & left, left
        copies = [f for _, _, fs in os.walk(os.path.join(work, "node0")) for f in fs]
        assert not [f for f in copies if f.startswith("shard-")], copies
    finally:
        if d.poll() is None:
            d.kill()
            d.wait(60)

