"""Blocking socket helpers shared by the server and the client: exact reads, frames, timeouts.

Sockets are kept in blocking mode with kernel-level timeouts (SO_RCVTIMEO/SO_SNDTIMEO), so
``os.sendfile`` can be used on them and no Python-level poll is paid per call; a timeout
surfaces as ``TimeoutError``.
"""

from __future__ import annotations

import errno
import os
import socket
import struct
from collections.abc import Callable

from stagefs.net import protocol as P

__all__ = ["recv_exact", "recv_message", "send_message", "send_parts", "sendfile_all",
           "set_timeouts"]


def set_timeouts(sock: socket.socket, seconds: float) -> None:
    sock.settimeout(None)
    sec = int(seconds)
    tv = struct.pack("ll", sec, int((seconds - sec) * 1e6))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)


def _timeout(exc: OSError) -> OSError:
    if exc.errno in (errno.EAGAIN, errno.EWOULDBLOCK):
        return TimeoutError(errno.ETIMEDOUT, "peer did not answer in time")
    return exc


def recv_exact(sock: socket.socket, n: int, into: memoryview | None = None
               ) -> bytearray | memoryview:
    """Exactly ``n`` bytes, or ConnectionError (closed), TimeoutError or OSError. With
    ``into`` (at least ``n`` bytes), they are received there and a view of them returned."""
    buf: bytearray | memoryview = bytearray(n) if into is None else into[:n]
    view = memoryview(buf)
    got = 0
    try:
        while got < n:
            k = sock.recv_into(view[got:], n - got)
            if k == 0:
                raise ConnectionError(errno.ECONNRESET, "connection closed by peer")
            got += k
    except BlockingIOError as exc:
        raise _timeout(exc) from None
    return buf


def recv_message(sock: socket.socket, max_frame: int = P.MAX_FRAME,
                 scratch: Callable[[int], bytearray | None] | None = None) -> P.Message:
    """The next message. With ``scratch`` (n -> a buffer of at least n bytes, or None), the
    payload is received into that buffer (no allocation per message): the message's DATA
    chunks are then views of it, valid until the buffer's next use."""
    mtype, length = P.parse_header(recv_exact(sock, P.HEADER.size), max_frame)
    if not length:
        return P.decode_payload(mtype, b"")
    buf = scratch(length) if scratch is not None else None
    into = memoryview(buf) if buf is not None else None
    return P.decode_payload(mtype, recv_exact(sock, length, into))


def send_message(sock: socket.socket, msg: P.Message) -> None:
    parts = P.encode_parts(msg)
    try:
        if len(parts) == 1:
            sock.sendall(parts[0])
            return
        _sendmsg_all(sock, [memoryview(p).cast("B") for p in parts if len(p)])
    except BlockingIOError as exc:
        raise _timeout(exc) from None


def send_parts(sock: socket.socket, parts: list[bytes | memoryview]) -> None:
    try:
        _sendmsg_all(sock, [memoryview(p).cast("B") for p in parts if len(p)])
    except BlockingIOError as exc:
        raise _timeout(exc) from None


def _sendmsg_all(sock: socket.socket, views: list[memoryview]) -> None:
    i = 0
    while i < len(views):
        sent = sock.sendmsg(views[i : i + 512])
        while i < len(views) and sent >= len(views[i]):
            sent -= len(views[i])
            i += 1
        if sent:
            views[i] = views[i][sent:]


def sendfile_all(sock: socket.socket, fd: int, offset: int, count: int) -> None:
    out = sock.fileno()
    try:
        while count > 0:
            n = os.sendfile(out, fd, offset, count)
            if n == 0:
                raise ConnectionError(errno.EIO, "shard file shorter than the manifest says")
            offset += n
            count -= n
    except BlockingIOError as exc:
        raise _timeout(exc) from None
