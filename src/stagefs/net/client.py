"""The peer client: pooled, authenticated connections to one daemon, batched range reads.

``PeerClient.read`` sends many (shard, offset, length) ranges in one READ and gets one DATA
reply. Connections are kept in a small pool per peer and never shared between processes: a
forked child finds the pool of its parent's pid and starts its own. A peer that fails is
marked down for a short, growing while, so that readers go straight to the next holder
instead of waiting for the same timeout again; ``PeerSource`` turns every failure into
``SourceUnavailable`` for the Store.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from typing import Any

from stagefs._malloc import tune_malloc
from stagefs.errors import AuthenticationError, ProtocolError
from stagefs.net import auth
from stagefs.net import protocol as P
from stagefs.net.sockio import recv_message, send_message, set_timeouts
from stagefs.tiers.base import SourceUnavailable

__all__ = ["ClientStats", "PeerClient", "PeerSource", "PeerUnavailable"]

_REPLY_LIMIT = 64 * 2**20  # must not exceed the server's max_reply
_SCRATCH = 16 * 2**20  # replies up to this size are received into a reused buffer
_BATCH_BYTES = 4 * 2**20  # data asked for in one READ; larger reads are pipelined requests
_WINDOW = 32  # requests in flight on one connection
_BACKOFF = (0.5, 30.0)


_tls = threading.local()


def _scratch(n: int) -> bytearray | None:
    """This thread's receive buffer, shared by every peer client of the thread (one buffer
    per thread, not per peer: a thousand peers cost no more memory than one) and reused
    across replies, which are copied out of it before the next one is received."""
    if n > _SCRATCH:
        return None
    buf: bytearray | None = getattr(_tls, "buf", None)
    if buf is None or len(buf) < n:
        buf = _tls.buf = bytearray(min(_SCRATCH, max(n, 2**20, 2 * len(buf or b""))))
    return buf


class PeerUnavailable(SourceUnavailable):
    """The peer is down, timed out, refused us or spoke nonsense: try the next holder."""


@dataclass
class ClientStats:
    requests: int = 0
    ranges: int = 0
    bytes: int = 0
    connects: int = 0
    failures: int = 0

    def as_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


class PeerClient:
    """Talk to the daemon at ``host:port``, proving ``token``."""

    def __init__(self, host: str, port: int, token: bytes, *, pack_id: bytes | None = None,
                 timeout: float = 10.0, connect_timeout: float = 3.0, pool_size: int = 8,
                 name: str | None = None) -> None:
        self.host, self.port = host, port
        self.name = name or f"{host}:{port}"
        self._token = token
        self.pack_id = pack_id
        self.timeout = timeout
        self.connect_timeout = connect_timeout
        self.pool_size = pool_size
        self.stats = ClientStats()
        self._ids = itertools.count(1)
        tune_malloc()  # replies become sample-sized bytes: keep their memory for reuse
        self._reset()

    def _reset(self) -> None:
        self._pid = os.getpid()
        self._lock = threading.Lock()
        self._idle: list[socket.socket] = []
        self._down_until = 0.0
        self._backoff = _BACKOFF[0]

    def _check_pid(self) -> None:
        if self._pid != os.getpid():  # forked: the parent's sockets are not ours to use
            for s in self._idle:
                with contextlib.suppress(OSError):
                    s.detach()  # forget the fd without shutting the parent's connection
            self._reset()

    # -- connections ---------------------------------------------------------------------------

    def _connect(self) -> socket.socket:
        try:
            sock = socket.create_connection((self.host, self.port), self.connect_timeout)
        except OSError as exc:
            self._failed(None)
            raise PeerUnavailable(f"{self.name}: cannot connect ({exc})") from exc
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            set_timeouts(sock, self.timeout)
            self._handshake(sock)
        except BaseException:
            sock.close()
            raise
        self.stats.connects += 1
        return sock

    def _handshake(self, sock: socket.socket) -> None:
        msg = recv_message(sock, 4096)
        if isinstance(msg, P.Error):
            raise PeerUnavailable(f"{self.name}: refused: {msg.message}")
        if not isinstance(msg, P.Challenge):
            raise ProtocolError(f"{self.name}: expected CHALLENGE, got {type(msg).__name__}")
        if self.pack_id is not None and msg.pack_id != self.pack_id:
            raise AuthenticationError(f"{self.name}: serves another dataset (pack id differs)")
        nc = auth.new_nonce()
        send_message(sock, P.Auth(nc, auth.client_proof(self._token, msg.nonce, nc)))
        reply = recv_message(sock, 4096)
        if isinstance(reply, P.Error):
            raise AuthenticationError(f"{self.name}: {reply.message} (wrong job token?)")
        if not isinstance(reply, P.AuthOk):
            raise ProtocolError(f"{self.name}: expected AUTH_OK, got {type(reply).__name__}")
        if not auth.verify(auth.server_proof(self._token, msg.nonce, nc), reply.mac):
            raise AuthenticationError(f"{self.name}: the server could not prove the job token")

    def is_down(self) -> bool:
        """Marked down after a recent failure (for a growing while): skip it for now."""
        self._check_pid()
        return time.monotonic() < self._down_until

    def _take(self) -> socket.socket:
        self._check_pid()
        if time.monotonic() < self._down_until:
            raise PeerUnavailable(f"{self.name}: marked down after a recent failure")
        with self._lock:
            if self._idle:
                return self._idle.pop()
        return self._connect()

    def _give(self, sock: socket.socket) -> None:
        with self._lock:
            if len(self._idle) < self.pool_size and self._pid == os.getpid():
                self._idle.append(sock)
                return
        sock.close()

    def _failed(self, sock: socket.socket | None) -> None:
        self.stats.failures += 1
        if sock is not None:
            sock.close()
        with self._lock:
            self._down_until = time.monotonic() + self._backoff
            self._backoff = min(self._backoff * 2, _BACKOFF[1])
            idle, self._idle = self._idle, []
        for s in idle:
            s.close()

    def _exchange(self, msg: P.Message) -> P.Message:
        replies: list[P.Message] = []
        self._pipeline([msg], lambda _i, reply: replies.append(reply))
        return replies[0]

    def _pipeline(self, msgs: Sequence[P.Message],
                  handle: Callable[[int, P.Message], None]) -> None:
        """Send every request at once on one pooled connection, then take the replies in
        order, handing each to ``handle`` before the next is received (its DATA chunks are
        views of the reused receive buffer). The server works on request k+1 while we copy
        reply k out."""
        sock: socket.socket | None = None
        try:
            sock = self._take()
            if len(msgs) == 1:
                send_message(sock, msgs[0])
            else:
                sock.sendall(b"".join(P.encode(m) for m in msgs))
            for i in range(len(msgs)):
                reply = recv_message(sock, scratch=_scratch)
                if isinstance(reply, P.Error):
                    raise PeerUnavailable(f"{self.name}: error {reply.code}: {reply.message}")
                handle(i, reply)
        except AuthenticationError:
            self._failed(sock)
            raise
        except PeerUnavailable:
            if sock is not None:
                self._failed(sock)
            raise
        except (OSError, ProtocolError) as exc:
            self._failed(sock)
            raise PeerUnavailable(f"{self.name}: {exc}") from exc
        self._backoff = _BACKOFF[0]
        self._give(sock)

    # -- requests --------------------------------------------------------------------------

    def read(self, ranges: Sequence[tuple[int, int, int]]) -> list[bytes | None]:
        """The bytes of each (shard, offset, length), or None where the peer does not hold
        it. Raises PeerUnavailable (or AuthenticationError) if the peer cannot answer.

        The ranges go in requests of about ``_BATCH_BYTES`` each, pipelined on one
        connection (a range over the reply limit is split and joined again)."""
        out: list[bytes | None] = [None] * len(ranges)
        pieces: list[tuple[int, int, int, int]] = []  # index, shard, offset, length
        for i, (s, o, n) in enumerate(ranges):
            for start in range(0, max(n, 1), _REPLY_LIMIT):
                pieces.append((i, s, o + start, min(_REPLY_LIMIT, n - start)))
        batches: list[list[tuple[int, int, int, int]]] = [[]]
        size = 0
        for p in pieces:
            if batches[-1] and (size + p[3] > _BATCH_BYTES or len(batches[-1]) >= P.MAX_RANGES):
                batches.append([])
                size = 0
            batches[-1].append(p)
            size += p[3]
        parts: dict[int, list[bytes | None]] = {}
        for w in range(0, len(batches), _WINDOW):
            self._read_batches(batches[w : w + _WINDOW], parts)
        for i, chunks in parts.items():
            if all(c is not None for c in chunks):
                out[i] = chunks[0] if len(chunks) == 1 else b"".join(
                    c for c in chunks if c is not None)
        return out

    def _read_batches(self, batches: list[list[tuple[int, int, int, int]]],
                      parts: dict[int, list[bytes | None]]) -> None:
        rids = [next(self._ids) & 0xFFFFFFFF for _ in batches]
        reqs = [P.Read(rid, tuple(P.Range(s, o, n) for _, s, o, n in b))
                for rid, b in zip(rids, batches, strict=True)]

        def handle(k: int, reply: P.Message) -> None:
            batch = batches[k]
            if not isinstance(reply, P.Data) or reply.request_id != rids[k] or len(
                    reply.chunks) != len(batch):
                raise ProtocolError(f"{self.name}: reply does not match the request")
            self.stats.requests += 1
            self.stats.ranges += len(batch)
            for (i, _, _, n), c in zip(batch, reply.chunks, strict=True):
                data = None if c is None or len(c) != n else bytes(c)
                if data is not None:
                    self.stats.bytes += n
                parts.setdefault(i, []).append(data)

        self._pipeline(reqs, handle)

    def status(self) -> dict[str, Any]:
        reply = self._exchange(P.StatusRequest())
        if not isinstance(reply, P.Status):
            raise PeerUnavailable(f"{self.name}: expected STATUS, got {type(reply).__name__}")
        return reply.info

    def close(self) -> None:
        self._check_pid()
        with self._lock:
            idle, self._idle = self._idle, []
        for s in idle:
            s.close()

    def __del__(self) -> None:
        # pooled sockets die with the client, quietly (no ResourceWarning in users' tests)
        with contextlib.suppress(Exception):
            self.close()

    def __repr__(self) -> str:
        return f"<PeerClient {self.name}>"


class PeerSource:
    """A peer as a ShardSource for the Store: any failure is SourceUnavailable."""

    def __init__(self, client: PeerClient, name: str | None = None) -> None:
        self.client = client
        self.name = name or f"peer {client.name}"

    def pread(self, shard: int, offset: int, length: int) -> bytes:
        if shard < 0 or offset < 0 or length < 0:
            raise PeerUnavailable(f"{self.name}: no range [{offset}, {offset + length}) in "
                                  f"shard {shard}")
        try:
            data = self.client.read([(shard, offset, length)])[0]
        except AuthenticationError as exc:
            raise PeerUnavailable(str(exc)) from exc
        if data is None:
            raise PeerUnavailable(f"{self.name}: does not hold shard {shard} (yet)")
        return data

    def close(self) -> None:
        self.client.close()
