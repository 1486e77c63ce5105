"""The shard server: byte ranges of this node's shards, to peers that prove the job token.

What reaches the file system from the network is a shard *index* checked against the
manifest and a range checked against that shard's size: never a path. One thread per
connection (bounded), blocking sockets with kernel timeouts, and ``os.sendfile`` from the
tier file to the socket, so the bytes are not copied through Python.

A connection is *unauthenticated* until its peer has proven the job token: such connections
live in their own small set (the oldest is dropped when it is full) and have a total
deadline for the whole handshake, so slow, silent or hostile connections never take the
slots that authenticated peers need. Once a request frame begins, all of it must arrive
within a total deadline too; a malformed frame closes that connection, and only that one.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

from stagefs.errors import ConfigError, ProtocolError
from stagefs.format import Manifest
from stagefs.net import auth
from stagefs.net import protocol as P
from stagefs.net.sockio import (
    Deadline,
    recv_message,
    send_message,
    send_parts,
    sendfile_all,
    set_recv_timeout,
    set_timeouts,
)

__all__ = ["ServerLimits", "ServerStats", "ShardServer"]

log = logging.getLogger("stagefs.server")

Locate = Callable[[int], str | None]
_COPY_LIMIT = 64 * 2**10  # smaller replies: one buffer, one send; larger: sendfile per range


@dataclass(frozen=True, slots=True)
class ServerLimits:
    """What one daemon grants its peers. Every time is a total deadline, not a timeout that
    restarts at each byte."""

    max_connections: int = 256  # authenticated connections
    max_unauthenticated: int = 32  # connections still in the handshake; the oldest is dropped
    max_request: int = 2 * 2**20  # bytes of one request frame (a READ of 131k ranges)
    max_reply: int = 64 * 2**20  # bytes of data in one DATA reply
    handshake_timeout: float = 5.0  # connect to AUTH_OK, all of it
    frame_timeout: float = 10.0  # a request frame, from its first byte to its last
    idle_timeout: float = 900.0  # an idle pooled connection is closed after this
    io_timeout: float = 30.0  # sending one reply, all of it


@dataclass
class ServerStats:
    connections: int = 0
    active: int = 0  # connections open now, authenticated or not
    unauthenticated: int = 0  # of which still in the handshake
    refused_busy: int = 0
    dropped_unauthenticated: int = 0  # dropped to make room for a newer connection
    auth_failures: int = 0
    handshake_timeouts: int = 0
    frame_timeouts: int = 0
    protocol_errors: int = 0
    requests: int = 0
    ranges: int = 0
    ranges_not_held: int = 0
    bytes_served: int = 0

    def as_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


class ShardServer:
    """Serve ranges of the shards ``locate(shard)`` finds on this node (None: not held)."""

    def __init__(self, manifest: Manifest, token: bytes, locate: Locate, host: str,
                 port: int = 0, *, limits: ServerLimits | None = None,
                 status: Callable[[], dict[str, Any]] | None = None) -> None:
        if host in ("", "0.0.0.0", "::"):
            raise ConfigError(
                "the stagefs server does not listen on all interfaces; give the address of "
                "the cluster interface (--bind ADDR or --interface NAME)"
            )
        self.manifest = manifest
        self.token = token
        self.locate = locate
        self.limits = limits or ServerLimits()
        self.status_fn = status or dict
        self.stats = ServerStats()
        self._sizes = [s.size for s in manifest.shards]
        self._fds: dict[int, int] = {}
        self._lock = threading.Lock()
        self._conns: set[socket.socket] = set()  # authenticated
        self._pending: dict[socket.socket, None] = {}  # unauthenticated, oldest first
        self._tls = threading.local()
        self._stop = threading.Event()
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self._sock.bind((host, port))
        except OSError as exc:
            self._sock.close()
            raise ConfigError(f"cannot listen on {host}:{port}: {exc.strerror}") from exc
        self._sock.listen(128)
        self._sock.settimeout(0.25)
        self.address: tuple[str, int] = self._sock.getsockname()[:2]
        self._thread = threading.Thread(target=self._accept_loop, name="stagefs-accept",
                                        daemon=True)

    def start(self) -> ShardServer:
        self._thread.start()
        return self

    # -- accepting ---------------------------------------------------------------------------

    def _accept_loop(self) -> None:
        while not self._stop.is_set():
            try:
                conn, peer = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                if self._stop.is_set():
                    return
                continue
            if not self._admit(conn):
                self.stats.refused_busy += 1
                self._refuse(conn, P.E_BUSY, "too many connections; try another holder")
                continue
            threading.Thread(target=self._serve, args=(conn, peer), daemon=True,
                             name=f"stagefs-conn-{peer[0]}:{peer[1]}").start()

    def _admit(self, conn: socket.socket) -> bool:
        """Take a new connection into the unauthenticated set, dropping the oldest one there
        if the set is full; refuse it if every authenticated slot is taken."""
        with self._lock:
            if len(self._conns) >= self.limits.max_connections:
                return False
            while len(self._pending) >= self.limits.max_unauthenticated:
                oldest = next(iter(self._pending))
                del self._pending[oldest]
                self.stats.dropped_unauthenticated += 1
                # under the lock: its thread closes it only after taking the lock, so the
                # descriptor cannot have been reused by then
                with contextlib.suppress(OSError):
                    oldest.shutdown(socket.SHUT_RDWR)
            self._pending[conn] = None
            self.stats.connections += 1
            self.stats.active += 1
            self.stats.unauthenticated = len(self._pending)
        return True

    def _promote(self, conn: socket.socket) -> bool | None:
        """The peer proved the token: move it to the authenticated set. False: no room;
        None: it was dropped as the oldest meanwhile (its socket is shut down)."""
        with self._lock:
            if conn not in self._pending:
                return None
            del self._pending[conn]
            self.stats.unauthenticated = len(self._pending)
            if len(self._conns) >= self.limits.max_connections:
                return False
            self._conns.add(conn)
        return True

    def _refuse(self, conn: socket.socket, code: int, message: str) -> None:
        with contextlib.suppress(OSError):
            set_timeouts(conn, 1.0)
            send_message(conn, P.Error(code, message), Deadline(conn, 1.0))
        conn.close()

    # -- one connection ------------------------------------------------------------------------

    def _serve(self, conn: socket.socket, peer: tuple[str, int]) -> None:
        lim = self.limits
        where = f"peer {peer[0]}:{peer[1]}"
        try:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            set_timeouts(conn, lim.handshake_timeout)
            try:
                if not self._handshake(conn, peer, Deadline(conn, lim.handshake_timeout)):
                    return
            except TimeoutError:
                self.stats.handshake_timeouts += 1
                log.info("%s: no handshake within %g s; dropped", where, lim.handshake_timeout)
                return
            promoted = self._promote(conn)
            if promoted is None:
                return
            if not promoted:
                self.stats.refused_busy += 1
                self._refuse(conn, P.E_BUSY, "too many connections; try another holder")
                return
            head = bytearray(P.HEADER.size)
            while not self._stop.is_set():
                set_recv_timeout(conn, lim.idle_timeout)
                k = conn.recv_into(head)  # waits for a request to begin (or idle timeout)
                if k == 0:
                    return
                try:
                    msg = recv_message(conn, lim.max_request, first=head[:k],
                                       deadline=Deadline(conn, lim.frame_timeout))
                except TimeoutError:
                    self.stats.frame_timeouts += 1
                    log.info("%s: request frame not whole within %g s; closed", where,
                             lim.frame_timeout)
                    return
                reply = Deadline(conn, lim.io_timeout)
                if isinstance(msg, P.Read):
                    self._read(conn, msg, reply)
                elif isinstance(msg, P.StatusRequest):
                    send_message(conn, P.Status(self._status()), reply)
                else:
                    raise ProtocolError(f"unexpected {type(msg).__name__} from a client")
        except ProtocolError as exc:
            self.stats.protocol_errors += 1
            log.info("%s: %s; closed", where, exc)
            with contextlib.suppress(OSError):
                send_message(conn, P.Error(P.E_PROTOCOL, str(exc)), Deadline(conn, 1.0))
        except OSError:
            pass  # closed, reset or timed out: the peer goes away, nothing to tell it
        finally:
            with self._lock:
                self._conns.discard(conn)
                self._pending.pop(conn, None)
                self.stats.unauthenticated = len(self._pending)
                self.stats.active -= 1
            conn.close()

    def _handshake(self, conn: socket.socket, peer: tuple[str, int], dl: Deadline) -> bool:
        ns = auth.new_nonce()
        send_message(conn, P.Challenge(ns, self.manifest.pack_id), dl)
        msg = recv_message(conn, 4096, deadline=dl)
        if not isinstance(msg, P.Auth):
            raise ProtocolError(f"expected AUTH, got {type(msg).__name__}")
        if not auth.verify(auth.client_proof(self.token, ns, msg.nonce), msg.mac):
            self.stats.auth_failures += 1
            log.warning("peer %s:%s did not prove the job token; refused", peer[0], peer[1])
            send_message(conn, P.Error(P.E_AUTH, "job token not proven: refused"), dl)
            return False
        send_message(conn, P.AuthOk(auth.server_proof(self.token, ns, msg.nonce)), dl)
        return True

    def _read(self, conn: socket.socket, req: P.Read, dl: Deadline) -> None:
        self.stats.requests += 1
        statuses: list[int] = []
        plan: list[tuple[int, int, int]] = []  # fd, offset, length of each OK slot
        table = bytearray(struct.pack("!II", req.request_id, len(req.ranges)))
        budget = self.limits.max_reply
        for r in req.ranges:
            st, fd = self._check(r, budget)
            statuses.append(st)
            if st == P.OK:
                budget -= r.length
                plan.append((fd, r.offset, r.length))
                table += struct.pack("!BI", P.OK, r.length)
            else:
                table += struct.pack("!BI", st, 0)
        total = len(table) + sum(n for _, _, n in plan)
        self.stats.ranges += len(req.ranges)
        self.stats.ranges_not_held += statuses.count(P.NOT_HELD)
        head = P.HEADER.pack(P.MAGIC, P.VERSION, P.T_DATA, 0, total) + bytes(table)
        if total - len(table) <= _COPY_LIMIT:
            # small replies (one sample): pread into one buffer, one send, the lowest
            # latency; larger ones go by sendfile, which copies each byte once, not twice
            buf = self._buffer(total - len(table))
            view = memoryview(buf)
            pos = 0
            for fd, off, n in plan:
                got = os.preadv(fd, [view[pos : pos + n]], off)
                if got != n:
                    raise ConnectionError(f"shard file shorter than the manifest says ({fd})")
                pos += n
            send_parts(conn, [head, view[:pos]], dl)
        else:
            send_parts(conn, [head], dl)
            for fd, off, n in plan:
                sendfile_all(conn, fd, off, n, dl)
        self.stats.bytes_served += total - len(table)

    def _buffer(self, n: int) -> bytearray:
        """This connection thread's send buffer, grown as needed and reused."""
        buf: bytearray | None = getattr(self._tls, "buf", None)
        if buf is None or len(buf) < n:
            buf = self._tls.buf = bytearray(max(n, 2**20))
        return buf

    def _check(self, r: P.Range, budget: int) -> tuple[int, int]:
        if r.shard >= len(self._sizes) or r.offset + r.length > self._sizes[r.shard]:
            return P.INVALID, -1
        if r.length > budget:
            return P.INVALID, -1
        fd = self._fd(r.shard)
        return (P.OK, fd) if fd >= 0 else (P.NOT_HELD, -1)

    def _fd(self, shard: int) -> int:
        fd = self._fds.get(shard)
        if fd is not None:
            return fd
        path = self.locate(shard)
        if path is None:
            return -1
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return -1
        if os.fstat(fd).st_size != self._sizes[shard]:
            os.close(fd)
            return -1
        with self._lock:
            old = self._fds.setdefault(shard, fd)
        if old != fd:
            os.close(fd)
        return old

    def forget(self, shard: int) -> None:
        """A shard file was dropped or replaced: reopen it on next use."""
        with self._lock:
            fd = self._fds.pop(shard, None)
        if fd is not None:
            os.close(fd)

    def _status(self) -> dict[str, Any]:
        info = dict(self.status_fn())
        info["server"] = self.stats.as_dict()
        return info

    # -- lifecycle -------------------------------------------------------------------------

    def close(self) -> None:
        self._stop.set()
        with contextlib.suppress(OSError):
            self._sock.close()
        if self._thread.is_alive():
            self._thread.join(timeout=2)
        with self._lock:
            for c in [*self._conns, *self._pending]:
                with contextlib.suppress(OSError):
                    c.shutdown(socket.SHUT_RDWR)
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()

    def __enter__(self) -> ShardServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
