"""A reply that stops in the middle (its daemon stopped while sending it): with patience
(the node fabric's client), each silence is waited for on only while the peer answers a
probe, as before its first byte; it waited the whole deadline (10 s) once a byte had come."""

from __future__ import annotations

import socket

import pytest

from stagefs.net import protocol as P
from stagefs.net.client import _ReplyRecv


@pytest.mark.parametrize("where", ["before", "inside"])
def test_a_reply_that_stalls_is_given_up_at_the_first_failed_probe(where: str) -> None:
    a, b = socket.socketpair()
    try:
        rid, n = 7, 1000
        body = P.encode(P.Data(rid, (b"x" * n,)))
        sent = body[: len(body) - n // 2] if where == "inside" else b""
        a.sendall(sent)  # the rest never comes: the sender is stopped
        probes: list[bool] = []

        def alive() -> bool:  # it answers twice, then not
            probes.append(len(probes) < 2)
            return probes[-1]

        with pytest.raises(TimeoutError):
            _ReplyRecv(b, 300.0, (0.02, alive)).message()
        assert probes == [True, True, False]
    finally:
        a.close()
        b.close()


def test_a_reply_that_comes_whole_asks_no_probe() -> None:
    a, b = socket.socketpair()
    try:
        a.sendall(P.encode(P.Data(3, (b"abc", None))))
        probes: list[bool] = []
        got = _ReplyRecv(b, 30.0, (0.5, lambda: probes.append(True) or True)).message()
        assert isinstance(got, P.Data) and got.chunks == (b"abc", None) and not probes
    finally:
        a.close()
        b.close()
