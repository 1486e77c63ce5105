"""Relayed ranges held in kernel pipes (net/pipes.py), on real sockets and pipes: the bytes
that go out are the bytes that came in, in order, whatever the pipes' fill; a range never
shares a pipe; a dropped range never leaves bytes for the next one; no pipe is leaked."""

from __future__ import annotations

import errno
import os
import select
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from stagefs.net.pipes import PIPE_BYTES, POOL_BYTES, Fill, Piped, PipePool, budget

pytestmark = pytest.mark.skipif(not hasattr(os, "splice"), reason="no splice(2) here")


@pytest.fixture
def tcp() -> Iterator[tuple[socket.socket, socket.socket]]:
    """A connected TCP pair on loopback: (sender, receiver), the receiver blocking."""
    ls = socket.create_server(("127.0.0.1", 0))
    a = socket.create_connection(ls.getsockname())
    b, _ = ls.accept()
    ls.close()
    yield a, b
    a.close()
    b.close()


def _send_later(sock: socket.socket, data: bytes, pause: float = 0.0) -> threading.Thread:
    def run() -> None:
        if pause:
            time.sleep(pause)
        sock.sendall(data)
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def _forward(piped: Piped) -> bytes:
    """``piped`` sent on through a non-blocking Unix socket, and what came out of it."""
    out, back = socket.socketpair()
    out.setblocking(False)
    got = bytearray()
    while not piped.send(out.fileno()):
        got += back.recv(1 << 20)
    out.close()
    while chunk := back.recv(1 << 20):
        got += chunk
    back.close()
    return bytes(got)


def _receive(pool: PipePool | None, sock: socket.socket, n: int) -> Piped | bytes:
    """The next ``n`` bytes of ``sock`` received as the relay receives them (net/relay.py):
    ``Fill.step`` on the non-blocking socket each time it is readable."""
    sock.setblocking(False)
    fill = Fill(pool, n)
    while True:
        try:
            if fill.step(sock):
                return fill.take()
        except BlockingIOError:
            assert select.select([sock], [], [], 30)[0], "no data within 30 s"


def _accounted(pool: PipePool) -> None:
    """Every pipe the pool made is idle again, and empty."""
    assert pool._made == len(pool._idle)
    for p in pool._idle:
        assert p.count == 0
        os.set_blocking(p.r, False)
        with pytest.raises(BlockingIOError):  # nothing left in it
            os.read(p.r, 1)
        os.set_blocking(p.r, True)


@pytest.mark.parametrize("size", [1, 4095, 110_000, PIPE_BYTES, 3 * PIPE_BYTES + 17])
def test_a_range_comes_out_as_it_went_in(tcp: tuple[socket.socket, socket.socket],
                                         size: int) -> None:
    a, b = tcp
    data = os.urandom(size)
    pool = PipePool()
    _send_later(a, data + b"TAIL")
    piped = _receive(pool, b, size)
    assert isinstance(piped, Piped) and len(piped) == size and pool.fallbacks == 0
    b.setblocking(True)
    assert b.recv(4, socket.MSG_WAITALL) == b"TAIL"  # exactly the range was taken
    assert _forward(piped) == data
    _accounted(pool)
    pool.close()


def test_ranges_in_a_row_each_in_pipes_of_their_own(tcp: tuple[socket.socket, socket.socket]
                                                   ) -> None:
    a, b = tcp
    blobs = [os.urandom(n) for n in (70_000, 5, 200_000, 1)]
    pool = PipePool()
    _send_later(a, b"".join(blobs))
    got = [_receive(pool, b, len(x)) for x in blobs]
    pipes = [id(p) for g in got if isinstance(g, Piped) for p in g.pipes]
    assert len(pipes) == len(set(pipes)) >= len(blobs)
    # a range dropped unsent (a hedge that lost) leaves nothing for the next one
    assert isinstance(got[0], Piped)
    got[0].release()
    assert [_forward(g) for g in got[1:] if isinstance(g, Piped)] == blobs[1:]
    _accounted(pool)


def test_no_pipe_to_be_had_is_memory_from_the_first_byte(
        tcp: tuple[socket.socket, socket.socket]) -> None:
    a, b = tcp
    data = os.urandom(50_000)
    pool = PipePool(most=0)
    _send_later(a, data)
    got = _receive(pool, b, len(data))
    assert got == data and pool.fallbacks == 1 and pool._made == 0
    assert _receive(None, b, 0) == b""  # no pool, nothing to receive


def test_a_range_in_memory_that_comes_in_many_pieces_is_whole(
        tcp: tuple[socket.socket, socket.socket]) -> None:
    """A peer that sends a range 1 KiB at a time, into memory: the pieces make the range
    exact, in order, and the bytes after it stay in the socket."""
    a, b = tcp
    data = os.urandom(300_000)

    def dribble() -> None:
        a.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for i in range(0, len(data), 1024):
            a.sendall(data[i : i + 1024])
        a.sendall(b"NEXT")

    t = threading.Thread(target=dribble, daemon=True)
    t.start()
    got = _receive(PipePool(most=0), b, len(data))
    t.join()
    assert got == data
    b.setblocking(True)
    assert b.recv(4, socket.MSG_WAITALL) == b"NEXT"


def test_pipes_running_out_mid_range_end_it_in_memory(
        tcp: tuple[socket.socket, socket.socket], monkeypatch: pytest.MonkeyPatch) -> None:
    a, b = tcp
    data = os.urandom(32 * PIPE_BYTES)  # more than a pipe holds, however full its pages
    pool = PipePool(most=1)
    real = pool.take
    monkeypatch.setattr(pool, "take", lambda over=False: real() if not over else None)
    _send_later(a, data)
    got = _receive(pool, b, len(data))
    assert got == data and pool.fallbacks == 1
    _accounted(pool)


def test_a_range_dropped_mid_way_gives_its_pipes_back_and_keeps_no_bytes(
        tcp: tuple[socket.socket, socket.socket]) -> None:
    a, b = tcp
    pool = PipePool()
    a.sendall(os.urandom(1000))
    b.setblocking(False)
    fill = Fill(pool, 5000)
    select.select([b], [], [], 30)
    with pytest.raises(BlockingIOError):  # 1000 bytes in, the rest not sent
        fill.step(b)
    assert fill.got == 1000
    fill.release()  # its reader or its batch is gone
    assert pool._made == len(pool._idle) == 0  # the pipe with 1000 bytes in it was closed


def test_a_peer_that_closes_mid_range_is_a_connection_error(
        tcp: tuple[socket.socket, socket.socket]) -> None:
    a, b = tcp
    pool = PipePool()
    a.sendall(os.urandom(1000))
    a.close()
    with pytest.raises(ConnectionError):
        _receive(pool, b, 5000)
    assert pool._made == 0


def test_bytes_read_back_out_of_the_pipes(tcp: tuple[socket.socket, socket.socket]) -> None:
    a, b = tcp
    data = os.urandom(2 * PIPE_BYTES + 3)
    pool = PipePool()
    _send_later(a, data)
    got = _receive(pool, b, len(data))
    assert isinstance(got, Piped) and got.to_bytes() == data
    _accounted(pool)


def test_a_reused_pipe_holds_nothing_of_its_last_range(
        tcp: tuple[socket.socket, socket.socket]) -> None:
    a, b = tcp
    pool = PipePool(most=1)
    first, second = os.urandom(9000), os.urandom(7000)
    _send_later(a, first + second)
    p1 = _receive(pool, b, len(first))
    assert isinstance(p1, Piped)
    half = p1.pipes[0]
    p1.release()  # dropped with its bytes in: closed, not kept
    p2 = _receive(pool, b, len(second))
    assert isinstance(p2, Piped) and half not in p2.pipes
    assert _forward(p2) == second
    p3_data = os.urandom(100)
    _send_later(a, p3_data)
    p3 = _receive(pool, b, 100)  # the emptied pipe, reused
    assert isinstance(p3, Piped) and _forward(p3) == p3_data
    _accounted(pool)


def test_data_that_comes_just_after_a_refused_splice_stays_in_the_pipe(
        tcp: tuple[socket.socket, socket.socket], monkeypatch: pytest.MonkeyPatch) -> None:
    """A splice refused for want of data, the data coming before the look at the socket
    (the sender's race): the range stays in its pipe, not taken for a full pipe and sent
    to memory (a pool of one pipe has no second to give)."""
    a, b = tcp
    data = os.urandom(100)
    a.sendall(data)
    assert select.select([b], [], [], 30)[0]
    real, refused = os.splice, []

    def late(*args: object, **kw: object) -> int:
        if not refused:  # the first: as if the data were not there yet
            refused.append(1)
            raise BlockingIOError(errno.EAGAIN, "Resource temporarily unavailable")
        return real(*args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "splice", late)
    pool = PipePool(most=1)
    got = _receive(pool, b, len(data))
    assert refused and isinstance(got, Piped) and pool.fallbacks == 0
    assert got.to_bytes() == data
    _accounted(pool)


def test_a_socket_that_cannot_be_spliced_is_read_into_memory(
        tcp: tuple[socket.socket, socket.socket], monkeypatch: pytest.MonkeyPatch) -> None:
    """A kernel or socket that refuses splice outright (EINVAL) costs nothing but the
    pipes' gain: the range, and every later one, is received into memory."""
    a, b = tcp
    data = os.urandom(20_000)
    pool = PipePool()

    def refuse(*_args: object, **_kw: object) -> int:
        raise OSError(errno.EINVAL, "Invalid argument")

    monkeypatch.setattr(os, "splice", refuse)
    _send_later(a, data + data)
    for _ in range(2):
        assert _receive(pool, b, len(data)) == data
    assert pool.broken and pool.fallbacks == 2 and pool._made == len(pool._idle)


@pytest.mark.parametrize(("soft", "want"), [
    ("16384\n", 32 * 2**20),  # the default 64 MiB a user: half
    ("1024\n", 2 * 2**20),  # a small budget: half of it
    ("0\n", POOL_BYTES),  # no budget
    ("junk", POOL_BYTES), (None, POOL_BYTES),  # unreadable: the cap
])
def test_a_pool_keeps_to_half_the_user_s_pipe_budget(
        tmp_path: Path, soft: str | None, want: int) -> None:
    f = tmp_path / "pipe-user-pages-soft"
    if soft is not None:
        f.write_text(soft)
    assert budget(str(f)) == min(want, POOL_BYTES)
    assert PipePool().most * PIPE_BYTES <= budget()


def test_the_pool_says_what_it_holds(tcp: tuple[socket.socket, socket.socket]) -> None:
    """What ``stagefs status --json`` shows of it (fabric.pipes): a range in flight holds
    its pipes; once it is sent on they are idle, and the pool has made no more."""
    a, b = tcp
    pool = PipePool(most=8)
    data = os.urandom(2 * PIPE_BYTES + 5)
    t = _send_later(a, data)
    piped = _receive(pool, b, len(data))
    t.join()
    assert isinstance(piped, Piped)
    held = pool.status()
    assert held["made"] == len(piped.pipes) >= 1 and held["idle"] == 0, held
    assert held["ranges"] == 1 and held["fallbacks"] == 0, held
    assert _forward(piped) == data
    assert pool.status() == {**held, "idle": held["made"]}
    _accounted(pool)
