"""Blocking socket helpers shared by the server and the client: exact reads, frames, deadlines.

Sockets are kept in blocking mode with kernel-level timeouts (SO_RCVTIMEO/SO_SNDTIMEO), so
``os.sendfile`` can be used on them and no Python-level poll is paid per call; a timeout
surfaces as ``TimeoutError``. A kernel timeout bounds one system call, and a peer that sends
one byte just before each timeout would stretch a frame forever; so every exchange with a
peer has a ``Deadline``, a total time limit that re-arms the kernel timeout with the time
left before each call.
"""

from __future__ import annotations

import errno
import os
import socket
import struct
import time

from stagefs.net import protocol as P

__all__ = ["Deadline", "host_port", "recv_exact", "recv_message", "send_message", "send_parts",
           "sendfile_all", "set_recv_timeout", "set_timeouts"]

def host_port(host: str, port: int) -> str:
    """``host:port`` as users write it: an IPv6 address in brackets (``[::1]:7070``)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


_MIN_TIMEOUT = 1e-3  # a kernel timeout of 0 means "wait forever": never arm one


def _timeval(seconds: float) -> bytes:
    seconds = max(seconds, _MIN_TIMEOUT)
    sec = int(seconds)
    return struct.pack("ll", sec, int((seconds - sec) * 1e6))


def set_timeouts(sock: socket.socket, seconds: float) -> None:
    """Blocking mode, and ``seconds`` as the kernel timeout of each send and receive call."""
    sock.settimeout(None)
    tv = _timeval(seconds)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)


def set_recv_timeout(sock: socket.socket, seconds: float) -> None:
    """``seconds`` as the kernel timeout of each receive call (the socket already blocks)."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, _timeval(seconds))


class Deadline:
    """A total time limit for one exchange (a handshake, a frame, a reply) on a socket in
    blocking mode (``set_timeouts``): each call made under it waits at most the time left."""

    __slots__ = ("at", "seconds", "sock")

    def __init__(self, sock: socket.socket, seconds: float) -> None:
        self.sock = sock
        self.seconds = seconds
        self.at = time.monotonic() + seconds

    def left(self) -> float:
        left = self.at - time.monotonic()
        if left <= 0:
            raise TimeoutError(errno.ETIMEDOUT,
                               f"peer did not complete the exchange within {self.seconds:g} s")
        return left

    def arm_recv(self) -> None:
        set_recv_timeout(self.sock, self.left())

    def arm_send(self) -> None:
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, _timeval(self.left()))


def _timeout(exc: OSError) -> OSError:
    if exc.errno in (errno.EAGAIN, errno.EWOULDBLOCK):
        return TimeoutError(errno.ETIMEDOUT, "peer did not answer in time")
    return exc


def recv_exact(sock: socket.socket, n: int, deadline: Deadline | None = None) -> bytearray:
    """Exactly ``n`` bytes, or ConnectionError (closed), TimeoutError or OSError. With
    ``deadline``, all of them arrive before it or TimeoutError."""
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    try:
        while got < n:
            if deadline is not None:
                deadline.arm_recv()
            k = sock.recv_into(view[got:], n - got)
            if k == 0:
                raise ConnectionError(errno.ECONNRESET, "connection closed by peer")
            got += k
    except BlockingIOError as exc:
        raise _timeout(exc) from None
    return buf


def recv_message(sock: socket.socket, max_frame: int = P.MAX_FRAME, *,
                 deadline: Deadline | None = None,
                 first: bytes | bytearray | memoryview = b"") -> P.Message:
    """The next message, whole before ``deadline``. ``first``: bytes of its header already
    received. (A peer client receives DATA replies range by range instead: net/client.py.)"""
    head = recv_exact(sock, P.HEADER.size - len(first), deadline=deadline)
    mtype, length = P.parse_header(bytes(first) + bytes(head) if first else head, max_frame)
    if not length:
        return P.decode_payload(mtype, b"")
    return P.decode_payload(mtype, recv_exact(sock, length, deadline))


def send_message(sock: socket.socket, msg: P.Message, deadline: Deadline | None = None) -> None:
    send_parts(sock, P.encode_parts(msg), deadline)


def send_parts(sock: socket.socket, parts: list[bytes | memoryview],
               deadline: Deadline | None = None) -> None:
    try:
        _sendmsg_all(sock, [memoryview(p).cast("B") for p in parts if len(p)], deadline)
    except BlockingIOError as exc:
        raise _timeout(exc) from None


def _sendmsg_all(sock: socket.socket, views: list[memoryview],
                 deadline: Deadline | None) -> None:
    i = 0
    while i < len(views):
        if deadline is not None:
            deadline.arm_send()
        sent = sock.sendmsg(views[i : i + 512])
        while i < len(views) and sent >= len(views[i]):
            sent -= len(views[i])
            i += 1
        if sent:
            views[i] = views[i][sent:]


def sendfile_all(sock: socket.socket, fd: int, offset: int, count: int,
                 deadline: Deadline | None = None) -> None:
    out = sock.fileno()
    try:
        while count > 0:
            if deadline is not None:
                deadline.arm_send()
            n = os.sendfile(out, fd, offset, count)
            if n == 0:
                raise ConnectionError(errno.EIO, "shard file shorter than the manifest says")
            offset += n
            count -= n
    except BlockingIOError as exc:
        raise _timeout(exc) from None
