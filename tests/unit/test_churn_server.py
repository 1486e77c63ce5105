"""A daemon's server over a long job's churn of readers: what a closed connection leaves.

Readers come and go by the thousand over a job (DataLoader workers of every epoch, killed
ones among them). Whatever a reader's connection held must go with it: the bytes of a
request frame it had begun to send, the connection itself. Memory is measured with
tracemalloc (the server's loop runs in this process), after the server has seen every
connection close; no assertion is on time.
"""

from __future__ import annotations

import os
import socket
import threading
import tracemalloc
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

import stagefs
from fake_peer import authed
from stagefs.format import Manifest
from stagefs.net import auth
from stagefs.net import protocol as P
from stagefs.net.server import ServerLimits, ShardServer


@pytest.fixture()
def manifest(tmp_path: Path) -> Iterator[Manifest]:
    src = tmp_path / "src"
    src.mkdir()
    for i in range(4):
        (src / f"f{i}.bin").write_bytes(os.urandom(3000))
    stagefs.pack(str(src), str(tmp_path / "pack"), jobs=1, shard_size="4KiB")
    m = Manifest(str(tmp_path / "pack" / "manifest.sfm"))
    yield m
    m.close()


def _server(m: Manifest, tmp_path: Path, token: bytes, **limits: float) -> ShardServer:
    return ShardServer(m, token, lambda s: None, "127.0.0.1",
                       unix_path=str(tmp_path / "fabric.sock"),
                       limits=ServerLimits(**limits)).start()  # type: ignore[arg-type]


def _seen(srv: ShardServer, cond: Callable[[], bool]) -> None:
    """Wait until the server's loop has made ``cond`` true (and gone round once more)."""
    done = threading.Event()
    for _ in range(3000):
        if cond():
            break
        done.clear()
        srv.soon(done.set)  # one turn of the loop
        done.wait(1)
    assert cond()
    done.clear()
    srv.soon(done.set)
    assert done.wait(30)


def test_a_reader_gone_inside_a_large_request_leaves_no_bytes(
        manifest: Manifest, tmp_path: Path) -> None:
    token = auth.new_token()
    srv = _server(manifest, tmp_path, token)
    # a READ of 60,000 ranges: ~1 MB, within max_request; its last byte never sent
    frame = P.encode(P.Read(7, tuple(P.Range(0, 0, 1) for _ in range(60_000))))[:-1]
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for _ in range(16):
            s = authed(srv.unix_path or "", token)
            s.sendall(frame)
            s.close()  # a killed reader: its frame cut short
        _seen(srv, lambda: srv.stats.active == 0)
        kept = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
        srv.close()
    assert srv.stats.unix_readers == 0 and srv.stats.protocol_errors == 0
    # 16 MB were sent in frames cut short; the server kept them until each closed
    # connection's deadline came due (10 s, 900 s once a reader had lived 5 s)
    assert kept < 4 * 2**20, f"{kept:,} bytes kept after 16 readers of 1 MB frames left"


def test_connections_that_come_and_go_are_not_kept(manifest: Manifest, tmp_path: Path
                                                   ) -> None:
    token = auth.new_token()
    # every connection's deadline far off (a reader's idle one is 900 s)
    srv = _server(manifest, tmp_path, token, handshake_timeout=600.0)
    path = srv.unix_path or ""
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for _ in range(6000):  # readers that connected and went (not one left open)
            s = socket.socket(socket.AF_UNIX)
            s.connect(path)
            s.recv(1)  # its challenge: the server has it in its set
            s.close()
        _seen(srv, lambda: srv.stats.connections == 6000 and srv.stats.active == 0)
        kept = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
        srv.close()
    # each closed connection (its socket object, its queue, its decoder: ~1 KB) stayed in
    # the deadline heap until its deadline came due
    assert kept < 2 * 2**20, f"{kept:,} bytes kept after 6,000 connections closed"
