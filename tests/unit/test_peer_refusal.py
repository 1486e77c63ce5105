"""A peer that refuses this node's job token (or serves another pack) is a misconfiguration,
not an unreachable peer: its client says so once, naming the peer, its address and the
fix; ``refused`` holds while it lasts; staging does not wait for it as for a peer still
starting; re-replication shows it apart (``refused_token``) and says why it is dead.
Before, it was one more "unreachable" peer, and the only clue was the refusing server's
WARNING naming an ephemeral port."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import stagefs
from stagefs.cluster.placement import place
from stagefs.cluster.rereplicate import Rereplicator
from stagefs.cluster.staging import Stager
from stagefs.format import Manifest
from stagefs.net import auth
from stagefs.net.client import PeerAuthenticationError, PeerClient
from stagefs.net.server import ShardServer


@pytest.fixture()
def served(tmp_path: Path) -> Iterator[tuple[ShardServer, Manifest]]:
    src = tmp_path / "src"
    src.mkdir()
    for i in range(4):
        (src / f"f{i}.bin").write_bytes(os.urandom(3000))
    stagefs.pack(str(src), str(tmp_path / "pack"), jobs=1, shard_size="4KiB")
    m = Manifest(str(tmp_path / "pack" / "manifest.sfm"))
    srv = ShardServer(m, auth.new_token(), lambda s: None, "127.0.0.1").start()
    yield srv, m
    srv.close()
    m.close()


def _client(srv: ShardServer, token: bytes, **kw: Any) -> PeerClient:
    return PeerClient(*srv.address, token, name="node 1", timeout=60, connect_timeout=60,
                      pool_size=1, **kw)


def _said(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == "stagefs.client" and r.levelno >= logging.WARNING]


def test_a_refused_token_is_said_once_naming_the_peer_and_the_fix(
        served: tuple[ShardServer, Manifest], caplog: pytest.LogCaptureFixture) -> None:
    srv, m = served
    caplog.set_level(logging.INFO, logger="stagefs.client")
    mine = auth.new_token()
    c = _client(srv, mine, pack_id=m.pack_id)
    assert [c.probe() for _ in range(5)] == [False] * 5  # probed every second: 5 times
    c.health.retry_at = None  # (its back-off passed: a read tries it, and is refused again)
    with pytest.raises(PeerAuthenticationError):
        c.status()
    said = _said(caplog)
    host, port = srv.address
    assert len(said) == 1, said
    assert said[0].startswith(f"node 1 ({host}:{port}) refused this node's job token: every "
                              "node of the job must use the same token"), said[0]
    assert "--token-file" in said[0]
    assert c.refused == "token"
    # fixed (here: the server takes this token now): the refusal is over...
    srv.token = mine
    assert c.probe() and c.refused is None
    c.close()
    # ...and a new one is said again
    srv.token = auth.new_token()
    assert not c.probe() and c.refused == "token"
    assert len(_said(caplog)) == 2
    c.close()


def test_another_pack_is_said_as_such(served: tuple[ShardServer, Manifest],
                                      caplog: pytest.LogCaptureFixture) -> None:
    srv, _ = served
    caplog.set_level(logging.INFO, logger="stagefs.client")
    c = _client(srv, srv.token, pack_id=b"\0" * 16)
    assert not c.probe() and not c.probe()
    said = _said(caplog)
    assert len(said) == 1 and "serves another pack" in said[0], said
    assert c.refused == "pack"
    c.close()


class _Chain:
    """What ``Stager._stage_one`` asks of the tier chain: every shard placed."""

    full = False
    corrupt = 0
    origin = None

    def __init__(self) -> None:
        self.placed: list[tuple[int, object]] = []

    def place(self, shard: int, source: object = None) -> str:
        self.placed.append((shard, source))
        return "placed"


def test_staging_does_not_wait_for_a_holder_that_refuses_it(
        served: tuple[ShardServer, Manifest]) -> None:
    """A shard whose other holder refuses this node's token: read from the origin at once.
    It was waited for as if its holder were still starting (``unreachable_after``, 30 s),
    and the refusal counted as an unreachable peer."""
    srv, m = served
    c = _client(srv, auth.new_token())
    chain = _Chain()
    # node 1 (the refusing server) is the shard's primary, this node (0) its other holder
    stager = Stager(m, [(1, 0)] * len(m.shards), 0, chain, {1: c},  # type: ignore[arg-type]
                    threading.Event(), unreachable_after=300.0)
    assert not stager._peer_holds(1, 0)
    assert stager.stats.peers_refused == 1 and stager.stats.peers_unreachable == 0
    assert stager._stage_one(0, time.monotonic(), {})  # done: from the origin
    assert chain.placed == [(0, None)] and stager.stats.forward_fallbacks == 1
    c.close()


def test_rereplication_shows_a_refusing_peer_apart(
        served: tuple[ShardServer, Manifest], caplog: pytest.LogCaptureFixture) -> None:
    srv, _ = served
    c = _client(srv, auth.new_token())
    assert not c.probe()
    r = Rereplicator(None, place(100, 3, 2), 0, None, {1: c},  # type: ignore[arg-type]
                     {1: lambda: False, 2: lambda: True}, threading.Event(), dead_after=30)
    try:
        st = r.status()
        assert st["refused_token"] == [1] and st["other_pack"] == []
        caplog.set_level(logging.WARNING, logger="stagefs.rereplicate")
        r._start_round = lambda todo: None  # type: ignore[method-assign]  # (not the point)
        r.update(frozenset({1}))
        line = [rec.getMessage() for rec in caplog.records if "dead nodes now" in
                rec.getMessage()]
        assert len(line) == 1 and "[1] refuse this node's handshake" in line[0], line
        assert "not crashed" in line[0]
    finally:
        r._pool.shutdown()
        c.close()
