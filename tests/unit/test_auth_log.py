"""Failed handshakes in the daemon's log: the first few of each source address named, then
one summary line a minute at most. One WARNING line per failed handshake let anyone who can
reach a daemon's port write its log without limit (17,000 lines in 5 s)."""

from __future__ import annotations

import logging
import os
import socket
from pathlib import Path

import pytest

import stagefs
from stagefs.format import Manifest
from stagefs.net import auth, server
from stagefs.net import protocol as P
from stagefs.net.server import ShardServer
from stagefs.net.sockio import recv_message


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_the_first_failures_of_each_address_are_named_then_summed_up_once_a_minute() -> None:
    clock = Clock()
    log = server.AuthFailures(clock, wall=lambda: 0.0, per_source=3, every=60.0)
    said = [log.failed("10.0.0.7", f"peer 10.0.0.7:{4000 + i}") for i in range(1000)]
    named = [s for s in said if s is not None]
    assert len(named) == 3  # the first three, each naming its connection
    assert all(f"peer 10.0.0.7:{4000 + i} did not prove the job token" in s
               for i, s in enumerate(named))
    assert "summed up" in named[-1] and "summed up" not in named[0]  # says what comes next
    assert log.summary() is None and log.due() == 1060.0  # a minute after the first
    # another address is named on its own first failures, however many came before
    assert log.failed("10.0.0.8", "peer 10.0.0.8:5000") is not None
    clock.now += 59.9
    assert log.failed("10.0.0.7", "peer 10.0.0.7:1") is None
    clock.now += 0.1  # a minute: one line sums up the failures not named
    line = log.failed("10.0.0.7", "peer 10.0.0.7:2")
    assert line is not None
    assert line.startswith("999 failed authentications from 1 address since "), line
    assert "10.0.0.7 (999)" in line
    # then nothing for a minute more, however many fail
    assert all(log.failed("10.0.0.7", "x") is None for _ in range(10_000))
    clock.now += 59.9
    assert log.summary() is None
    clock.now += 0.1
    line = log.summary()
    assert line is not None and line.startswith("10000 failed authentications from 1 address")
    assert log.summary() is None and log.due() is None  # nothing left to say


def test_a_flood_from_many_addresses_is_bounded() -> None:
    """Past the addresses it remembers, a new address is not named: only summed up."""
    clock = Clock()
    log = server.AuthFailures(clock, wall=lambda: 0.0, per_source=2, every=60.0, sources=10)
    lines = [log.failed(f"10.0.{i // 256}.{i % 256}", "x") for i in range(20_000)]
    assert sum(s is not None for s in lines) == 10  # one each for the first ten addresses
    clock.now += 60
    line = log.summary()
    assert line is not None and line.startswith("19990 failed authentications from 11+ addresses")
    assert log.summary() is None and log.due() is None
    # at close, what is left is said whether or not a minute has passed
    assert log.failed("10.0.0.1", "x") is not None  # (its second line)
    assert log.failed("10.0.0.1", "x") is None
    assert log.summary() is None
    final = log.summary(now=True)
    assert final is not None and final.startswith("1 failed authentication from 1 address")


@pytest.fixture()
def served(tmp_path: Path) -> tuple[ShardServer, Manifest]:
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.bin").write_bytes(os.urandom(1000))
    stagefs.pack(str(src), str(tmp_path / "pack"), jobs=1)
    m = Manifest(str(tmp_path / "pack" / "manifest.sfm"))
    return ShardServer(m, auth.new_token(), lambda s: None, "127.0.0.1").start(), m


def _wrong_token_handshake(addr: tuple[str, int]) -> P.Message:
    with socket.create_connection(addr, timeout=60) as s:
        ch = recv_message(s, 4096)
        assert isinstance(ch, P.Challenge)
        nc = auth.new_nonce()
        end = auth.channel_binding(s, accepted=False)
        s.sendall(P.encode(P.Auth(nc, auth.client_proof(auth.new_token(), ch.nonce, nc, end))))
        return recv_message(s, 4096)


def test_a_server_refusing_many_handshakes_logs_a_few_lines(
        served: tuple[ShardServer, Manifest], caplog: pytest.LogCaptureFixture) -> None:
    srv, m = served
    caplog.set_level(logging.WARNING, logger="stagefs.server")
    try:
        for _ in range(40):
            reply = _wrong_token_handshake(srv.address)
            assert isinstance(reply, P.Error) and reply.code == P.E_AUTH
        assert srv.stats.auth_failures == 40  # every one counted (stagefs status)
    finally:
        srv.close()
        m.close()
    lines = [r.getMessage() for r in caplog.records if r.name == "stagefs.server"]
    # three named (within the minute), and at close one line for the 37 others
    assert len(lines) == 4, lines
    assert all("127.0.0.1" in s and "did not prove the job token" in s for s in lines[:3])
    assert lines[3].startswith("37 failed authentications from 1 address since "), lines[3]
