"""The shard server: byte ranges of this node's shards, to peers that prove the job token.

What reaches the file system from the network is a shard *index* checked against the
manifest and a range checked against that shard's size: never a path.

One event loop (``selectors``: epoll on Linux) in one thread serves every connection, TCP
from peers and, when a Unix socket path is given, the node's own training processes
(docs/decisions/0013-event-driven-daemon.md). An idle connection costs a socket, a small
object and a selector entry: no thread, no buffer. A reply is a list of parts sent with
``sendmsg`` (the frame header and slot table, then ranges read with ``preadv`` into one
buffer per reply) and ``os.sendfile`` for large ranges, so no range is copied through
Python more than the one read that fetches it.

A request the server fails to handle (out of descriptors: EMFILE; a bug) is answered with an
ERROR (E_INTERNAL: its client takes the next holder) and logged once for each kind of
failure; the connection and the loop go on. No failure in one connection's events ends the
loop: that connection is closed, and the others are served.

A connection is *unauthenticated* until its peer has proven the job token: such connections
live in their own small set (the oldest is dropped when it is full) and have a total
deadline for the whole handshake, so slow, silent or hostile connections never take the
slots that authenticated peers need. Authenticated connections are limited only by the
descriptors the process may open (``_fsutil.raise_fd_limit``), less a reserve. Once a request frame
begins, all of it must arrive within a total deadline too; a malformed frame closes that
connection, and only that one. A handshake that fails to prove the job token is counted
(``auth_failures``) and logged for the first few of each source address only, then summed up
in one line a minute at most (``AuthFailures``): whoever reaches the port cannot flood the log.

Requests from a Unix-socket reader for shards this node does not hold go to ``relay``
(net/relay.py: the node's peers, from this same loop, which it drives through ``watch``,
``later`` and ``soon``); the reply is sent, in request order, when the relay has every
range (None for a range: NOT_HELD, the reader's next holder answers it). A reader's
connection has a send buffer of ``UNIX_SNDBUF``.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import heapq
import itertools
import logging
import os
import resource
import selectors
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, fields
from typing import Any

from stagefs._malloc import trim_malloc
from stagefs.errors import ConfigError, ProtocolError
from stagefs.format import Manifest
from stagefs.net import auth
from stagefs.net import protocol as P
from stagefs.net.pipes import Piped
from stagefs.net.relay import Relay
from stagefs.net.sockio import host_port

__all__ = ["AuthFailures", "HeldFiles", "ServerLimits", "ServerStats", "ShardServer",
           "connection_room"]

log = logging.getLogger("stagefs.server")

Locate = Callable[[int], str | None]
Pieces = Callable[[int, int, int], bytes | None]  # (shard, offset, length) -> bytes or None
_SENDFILE_MIN = 64 * 2**10  # a range this large goes by sendfile; smaller: preadv + sendmsg
_FD_RESERVE = 256  # descriptors kept for shard files, the stager, logs, the relay's peers
_RECV = 256 * 2**10  # the loop's receive buffer (requests are small)
_MAX_QUEUED = 64  # replies queued on one connection before it is read again
_MAX_HELD = 32 * 2**20  # and bytes those replies hold in memory (a reader that stopped
# reading its replies held up to 64 of 64 MiB each: 250 MB a connection, seen)
_TRIM_AFTER = 8 * 2**20  # a connection closed holding this much: the heap trimmed after
_TRIM_DELAY = 5.0  # seconds (the relays out for it end within their 4 s deadline)
_IOV = 512  # buffers per sendmsg (IOV_MAX is 1024)
# send buffer of a reader's Unix connection: a relayed reply of a few MB goes out in a few
# rounds, not one per default buffer (208 KiB: the loop waits for the reader to drain it 30
# times a 6 MB reply); the kernel caps it at net.core.wmem_max (stagefs doctor says)
UNIX_SNDBUF = 4 * 2**20
_TICK = 1.0  # the loop wakes at least this often (stop, paused accepts)
_HEAP_SLACK = 1024  # deadline entries of closed connections let be before the heap is compacted


@dataclass(frozen=True, slots=True)
class ServerLimits:
    """What one daemon grants its peers. Every time is a total deadline, not a timeout that
    restarts at each byte."""

    max_connections: int | None = None  # authenticated; None: the descriptor limit allows
    # connections still in the handshake (the oldest is dropped when full), at most a
    # quarter of the descriptors a server leaves its connections: to push a real peer's
    # handshake (one round trip) out, an attacker must open this many within it
    max_unauthenticated: int = 1024
    max_request: int = 2 * 2**20  # bytes of one request frame (a READ of 131k ranges)
    max_reply: int = 64 * 2**20  # bytes of data in one DATA reply
    handshake_timeout: float = 5.0  # connect to AUTH_OK, all of it
    frame_timeout: float = 10.0  # a request frame, from its first byte to its last
    idle_timeout: float = 900.0  # an idle pooled connection is closed after this
    io_timeout: float = 30.0  # sending one reply, all of it
    fd_reserve: int = 0  # descriptors the process keeps for itself beyond the usual
    # reserve (the relay's pipes: net/pipes.py)


@dataclass
class ServerStats:
    connections: int = 0
    active: int = 0  # connections open now, authenticated or not
    unauthenticated: int = 0  # of which still in the handshake
    tcp_peers: int = 0  # authenticated TCP connections open now (other nodes)
    unix_readers: int = 0  # authenticated Unix-socket connections open now (this node)
    tcp_peak: int = 0  # the most tcp_peers at once
    unix_peak: int = 0
    refused_busy: int = 0
    dropped_unauthenticated: int = 0  # dropped to make room for a newer connection
    auth_failures: int = 0
    handshake_timeouts: int = 0
    frame_timeouts: int = 0
    io_timeouts: int = 0
    protocol_errors: int = 0
    requests: int = 0
    ranges: int = 0
    ranges_not_held: int = 0
    relayed_requests: int = 0  # requests of this node's readers that went to peers too
    relayed_ranges: int = 0
    relayed_missing: int = 0  # of which no peer gave: NOT_HELD, the reader goes on
    relayed_piped: int = 0  # of which sent on from pipes, never copied here (net/pipes.py)
    bytes_served: int = 0
    bytes_served_partial: int = 0  # of which from partial copies (the pieces held here)
    internal_errors: int = 0  # requests answered E_INTERNAL (out of descriptors, a bug)

    def as_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def connection_room(fd_limit: int, fd_reserve: int = 0) -> int:
    """Descriptors a server leaves to its connections under ``fd_limit``: less its own
    reserve (shard files, the stager, logs) and ``fd_reserve`` (ServerLimits.fd_reserve)."""
    return fd_limit - _FD_RESERVE - fd_reserve


class _File:
    """A range to send with sendfile."""

    __slots__ = ("count", "fd", "offset")

    def __init__(self, fd: int, offset: int, count: int) -> None:
        self.fd, self.offset, self.count = fd, offset, count


class _Reply:
    """One reply frame as parts to send; not ready while a relay is still out."""

    __slots__ = ("close_after", "held", "parts", "ready", "started")

    def __init__(self, parts: list[_Part] | None = None, close_after: bool = False,
                 held: int = 0) -> None:
        self.parts: collections.deque[_Part] = collections.deque(parts or ())
        self.ready = parts is not None
        self.started = False
        self.close_after = close_after
        self.held = held  # bytes of its parts in memory (not files, not pipes)


_HANDSHAKE, _READY, _CLOSED = 0, 1, 2


class _Conn:
    __slots__ = ("authed_at", "closed", "deadline", "decoder", "events", "fd", "frame_at",
                 "held", "io_at", "last", "nonce", "replies", "sock", "source", "state",
                 "taking", "unix", "where")

    def __init__(self, sock: socket.socket, where: str, unix: bool, now: float,
                 source: str = "") -> None:
        self.sock = sock
        self.fd = sock.fileno()
        self.where = where
        self.source = source or where  # the peer's address, without its port
        self.unix = unix
        self.state = _HANDSHAKE
        self.closed = False
        self.decoder = P.FrameDecoder(4096)
        self.nonce = b""
        self.replies: collections.deque[_Reply] = collections.deque()
        self.events = 0
        self.authed_at = now  # the handshake's deadline counts from here
        self.frame_at = 0.0  # when the partial request frame began (0: none)
        self.io_at = 0.0  # when the reply being sent must be out
        self.last = now  # last activity: the idle deadline counts from here
        self.deadline = 0.0
        self.held = 0  # bytes its queued replies hold in memory
        self.taking = False  # its requests are being handled (_take_requests)


class _Watch:
    __slots__ = ("fn",)

    def __init__(self, fn: Callable[[int], None]) -> None:
        self.fn = fn


def _nothing() -> None:
    pass


class _Timer:
    """A call the loop makes at its time, unless cancelled. A cancelled timer stays in the
    loop's heap until it comes to the top, so it lets go of its call at once: the relay's
    deadline of a batch is 4 s, and its call holds the batch's ranges. Held until then,
    ranges relayed in memory (no pipe to be had) piled up to gigabytes in a daemon. Nor
    does the loop wake up for it: a relayed batch leaves three cancelled timers."""

    __slots__ = ("fn",)

    def __init__(self, fn: Callable[[], None]) -> None:
        self.fn = fn

    @property
    def cancelled(self) -> bool:
        return self.fn is _nothing

    def cancel(self) -> None:
        self.fn = _nothing


class _Listener:
    __slots__ = ("sock", "unix")

    def __init__(self, sock: socket.socket, unix: bool) -> None:
        self.sock, self.unix = sock, unix


class HeldFiles:
    """The shard files this node's tiers hold, each opened once and checked against the
    manifest's size: what a server (TCP, or the MPI transport) reads ranges from. What
    reaches the file system is a shard index and ``locate``'s answer, never a path from
    the wire."""

    RECHECK = 0.05  # seconds between two looks at whether an open copy was deleted

    def __init__(self, manifest: Manifest, locate: Locate,
                 clock: Callable[[], float] = time.monotonic,
                 damaged: Callable[[int], object] | None = None) -> None:
        self.sizes = [s.size for s in manifest.shards]
        self.locate = locate
        # told of a copy of the wrong size (cut short, written past its end): served as not
        # held, it is the daemon's to check, delete and place again (a CHECK); untold, its
        # node went on relaying the shard, or sending its readers to the origin, for good
        self.damaged = damaged
        self._fds: dict[int, int] = {}
        self._checked: dict[int, float] = {}
        self._gone: list[int] = []  # deleted copies' fds, closed with the others
        self._clock = clock
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._fds)

    def fd(self, shard: int) -> int | None:
        """The open file of ``shard``, or None if this node does not hold a whole copy.

        A copy deleted since it was opened (a reader found it corrupt and dropped it) is
        not served any more: its file stayed readable through the open fd, and peers were
        given its bad bytes until the daemon ended (it looks again at most every
        ``RECHECK`` seconds: one fstat)."""
        fd = self._fds.get(shard)
        if fd is not None:
            now = self._clock()
            if now - self._checked.get(shard, 0.0) < self.RECHECK:
                return fd
            self._checked[shard] = now
            try:
                linked = os.fstat(fd).st_nlink > 0
            except OSError:
                linked = False
            if linked:
                return fd
            with self._lock:
                if self._fds.get(shard) == fd:
                    del self._fds[shard]
                    self._gone.append(fd)  # a send queued may still read from it
        path = self.locate(shard)
        if path is None:
            return None
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError as exc:
            if exc.errno in _NO_FDS:  # served as not held: its reader takes the next holder
                _say_once(exc, f"a copy held here ({path}) cannot be opened: it is served "
                          "as not held")
            return None
        if os.fstat(fd).st_size != self.sizes[shard]:
            os.close(fd)
            if self.damaged is not None:
                self.damaged(shard)
            return None
        with self._lock:
            old = self._fds.setdefault(shard, fd)
        if old != fd:
            os.close(fd)
        return old

    def pop(self, shard: int) -> int | None:
        """Stop using ``shard``'s file (dropped or replaced): its fd, for the caller to
        close once nothing it queued still reads from it."""
        with self._lock:
            return self._fds.pop(shard, None)

    def shed(self, busy: set[int]) -> int:
        """Close every file but the ``busy`` ones (a reply queued reads from them): out of
        descriptors, the server makes room for connections; a file is opened again when
        next read. How many were closed."""
        with self._lock:
            keep = {s: fd for s, fd in self._fds.items() if fd in busy}
            fds = [fd for fd in self._fds.values() if fd not in busy]
            fds += [fd for fd in self._gone if fd not in busy]
            self._fds = keep
            self._gone = [fd for fd in self._gone if fd in busy]
        for fd in fds:
            os.close(fd)
        return len(fds)

    def close(self) -> None:
        with self._lock:
            fds, self._fds = list(self._fds.values()) + self._gone, {}
            self._gone = []
        for fd in fds:
            os.close(fd)


class AuthFailures:
    """What the log says of failed handshakes (a peer that did not prove the job token),
    with no I/O: ``failed`` gives the line to log now, if any. The first ``per_source``
    failures of each source address get a line each (a node of the job given another token
    is named there, by its address); the others are summed up in one line at most every
    ``every`` seconds (``summary``: how many, from how many addresses, since when, and the
    addresses most of them came from). One WARNING line per failed handshake let anyone who
    reaches the port write the log without limit (17,000 lines in 5 s). At most ``sources``
    addresses are remembered. ``clock``: seconds, monotonic; ``wall``: seconds since the
    epoch, to say since when."""

    def __init__(self, clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], float] = time.time, *, per_source: int = 3,
                 every: float = 60.0, sources: int = 1024) -> None:
        self.clock, self.wall = clock, wall
        self.per_source, self.every, self.sources = per_source, every, sources
        self._said: dict[str, int] = {}  # source -> its failures that had a line
        self._quiet: dict[str, int] = {}  # source -> its failures not said since the summary
        self._quiet_more = 0  # and those of sources past ``sources``
        self._since = 0.0  # (wall) the first failure not said
        self._summed_at: float | None = None  # (clock) the last summary, or the first failure

    def failed(self, source: str, where: str) -> str | None:
        """A failed handshake from ``source`` (an address) on ``where`` (the connection, as
        the log names it): the line to log now, or None."""
        if self._summed_at is None:
            self._summed_at = self.clock()  # the first summary comes ``every`` after this
        said = self._said.get(source, 0)
        if said < self.per_source and (said or len(self._said) < self.sources):
            self._said[source] = said + 1
            more = (f"; the next failures from {source} are summed up, in a line a minute "
                    "at most" if said + 1 == self.per_source else "")
            return (f"{where} did not prove the job token; refused (a node or a reader with "
                    "another token or through NAT or port forwarding, a relay, or a "
                    f"stranger){more}")
        if not self._quiet and not self._quiet_more:
            self._since = self.wall()
        if source in self._quiet or len(self._quiet) < self.sources:
            self._quiet[source] = self._quiet.get(source, 0) + 1
        else:
            self._quiet_more += 1
        return self.summary()

    def due(self) -> float | None:
        """When (``clock``) the failures not said yet may be summed up; None: there are none."""
        if not self._quiet and not self._quiet_more:
            return None
        return (0.0 if self._summed_at is None else self._summed_at) + self.every

    def summary(self, now: bool = False) -> str | None:
        """The line that sums up the failures not said yet, if it is due (``now``: whether
        or not, as the server closes); None if there is none to say."""
        due = self.due()
        if due is None or (not now and self.clock() < due):
            return None
        n = sum(self._quiet.values()) + self._quiet_more
        top = sorted(self._quiet.items(), key=lambda kv: -kv[1])[:3]
        addresses = len(self._quiet) + (1 if self._quiet_more else 0)
        line = (f"{n} failed authentication{'s' * (n != 1)} from "
                f"{addresses}{'+' * bool(self._quiet_more)} address"
                f"{'es' * (addresses != 1)} since "
                f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(self._since))} (the "
                f"first {self.per_source} of each address logged; most from "
                f"{', '.join(f'{a} ({k})' for a, k in top)}): refused")
        self._quiet, self._quiet_more = {}, 0
        self._summed_at = self.clock()
        return line


class ShardServer:
    """Serve ranges of the shards ``locate(shard)`` finds on this node (None: not held), to
    peers over TCP at ``host:port`` and, with ``unix_path``, to this node's readers over a
    Unix socket; ``relay`` answers those readers' ranges of shards not held here."""

    def __init__(self, manifest: Manifest, token: bytes, locate: Locate, host: str,
                 port: int = 0, *, limits: ServerLimits | None = None,
                 status: Callable[[], dict[str, Any]] | None = None,
                 unix_path: str | None = None, relay: Relay | None = None,
                 check: Callable[[int], str] | None = None,
                 pieces: Pieces | None = None) -> None:
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
        self.relay = relay
        # a CHECK (a reader found bad bytes of a shard from here): queued, never run in
        # the loop; what it says back (the daemon's _check_shard)
        self.check = check
        # the bytes of a range of a shard held here in part (a tier too small for the
        # whole shard keeps the pieces it has room for), None where they are not here
        self.pieces = pieces
        self.stats = ServerStats()
        self.auth_failures = AuthFailures()  # what the log says of them (a test's clock)
        self._auth_timer: _Timer | None = None  # their summary to come
        self._sizes = [s.size for s in manifest.shards]
        self._held = HeldFiles(manifest, locate, damaged=check)
        self._lock = threading.Lock()
        self._authed: set[_Conn] = set()
        self._pending: dict[_Conn, None] = {}  # unauthenticated, oldest first
        self._stop = threading.Event()
        self._sel = selectors.DefaultSelector()
        self._heap: list[tuple[float, int, _Conn]] = []
        self._seq = itertools.count()
        self._rbuf = bytearray(_RECV)
        self._trim: _Timer | None = None  # a malloc_trim to come (_close)
        self._freed = 0  # bytes closed connections let go of since the last trim
        self._done: collections.deque[Callable[[], None]] = collections.deque()
        self._timers: list[tuple[float, int, _Timer]] = []  # the loop's own (the relay's)
        self._accept_paused: list[_Listener] = []
        self._paused_until = 0.0
        self._torn_down = False
        self._fd_limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        # a descriptor kept in reserve: out of them, it is let go of to take one connection
        # (a STATUS, a reader), and taken again once one is free (``_accept``)
        self._spare: int | None = _spare()
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        tcp = socket.socket(family, socket.SOCK_STREAM)
        tcp.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            tcp.bind((host, port))
        except OSError as exc:
            tcp.close()
            taken = exc.errno == errno.EADDRINUSE  # another job's daemon, or another user's
            raise ConfigError(
                f"cannot listen on {host_port(host, port)}: {exc.strerror}"
                + ("; another process listens there (a daemon of another job, or any "
                   "program of another user: a port derived from the job id can be taken "
                   "first): give the daemons another --port" if taken else "")) from exc
        self.address: tuple[str, int] = tcp.getsockname()[:2]
        self.unix_path = unix_path
        self._listeners = [_Listener(tcp, False)]
        if unix_path is not None:
            self._listeners.append(_Listener(self._bind_unix(unix_path, tcp), True))
        for lst in self._listeners:
            lst.sock.listen(1024)
            lst.sock.setblocking(False)
            self._sel.register(lst.sock, selectors.EVENT_READ, lst)
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._sel.register(self._wake_r, selectors.EVENT_READ, None)
        self._thread = threading.Thread(target=self._loop, name="stagefs-server", daemon=True)

    @staticmethod
    def _bind_unix(path: str, tcp: socket.socket) -> socket.socket:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)  # a daemon killed before it could remove it
            s.bind(path)
            os.chmod(path, 0o600)
        except OSError as exc:
            s.close()
            tcp.close()
            raise ConfigError(f"cannot listen on the Unix socket {path}: {exc.strerror or exc}"
                              " (a path over 107 bytes is too long: give a shorter --runtime)"
                              ) from exc
        return s

    def start(self) -> ShardServer:
        if self.relay is not None:
            self.relay.attach(self)
        self._thread.start()
        return self

    # -- what the loop does for others (the relay: net/relay.py), in its thread ---------------

    def watch(self, sock: socket.socket, events: int, handler: Callable[[int], None]) -> None:
        """Call ``handler(events)`` from the loop when ``sock`` is ready for ``events``."""
        try:
            self._sel.modify(sock, events, _Watch(handler))
        except KeyError:
            self._sel.register(sock, events, _Watch(handler))

    def unwatch(self, sock: socket.socket) -> None:
        self._sel.unregister(sock)

    def later(self, delay: float, fn: Callable[[], None]) -> _Timer:
        """Call ``fn`` from the loop in ``delay`` seconds, unless cancelled."""
        t = _Timer(fn)
        heapq.heappush(self._timers, (time.monotonic() + delay, next(self._seq), t))
        return t

    def _run_timers(self, now: float) -> None:
        timers = self._timers
        while timers and timers[0][0] <= now:
            t = heapq.heappop(timers)[2]
            if not t.cancelled:
                fn = t.fn
                t.cancel()
                _guarded(fn)

    # -- the loop ----------------------------------------------------------------------------

    def _loop(self) -> None:
        sel = self._sel
        while not self._stop.is_set():
            now = time.monotonic()
            timeout = _TICK if not self._accept_paused else 0.1
            if self._heap:
                timeout = min(timeout, max(0.0, self._heap[0][0] - now))
            timers = self._timers
            while timers and timers[0][2].cancelled:  # no waking up for a cancelled one
                heapq.heappop(timers)
            if timers:
                timeout = min(timeout, max(0.0, timers[0][0] - now))
            try:
                ready = sel.select(timeout)
                for key, ev in ready:
                    self._event(key.data, ev)
                now = time.monotonic()
                self._expire(now)
                self._run_timers(now)
                if self._spare is None:
                    self._spare = _spare()  # (None while every descriptor is taken)
                if self._accept_paused and now >= self._paused_until and \
                        not self._stop.is_set():
                    for lst in self._accept_paused:
                        self._sel.register(lst.sock, selectors.EVENT_READ, lst)
                    self._accept_paused.clear()
            except Exception as exc:  # the loop serves every connection: it never ends so
                _say_once(exc, "the server's loop met an error; it goes on")
                time.sleep(0.01)  # (not a busy loop, if it recurs)
        self._teardown()

    def _event(self, obj: Any, ev: int) -> None:
        """One ready object of the loop; a failure closes that connection only."""
        try:
            if obj is None:
                self._run_done()
            elif isinstance(obj, _Watch):
                _guarded(obj.fn, ev)
            elif isinstance(obj, _Listener):
                self._accept(obj)
            elif not obj.closed:
                if ev & selectors.EVENT_READ:
                    self._on_read(obj)
                if ev & selectors.EVENT_WRITE and not obj.closed:
                    self._flush(obj)
        except Exception as exc:
            _say_once(exc, f"serving {getattr(obj, 'where', 'a connection')} failed; closed")
            if isinstance(obj, _Conn):
                self._close(obj)

    def soon(self, fn: Callable[[], None]) -> None:
        """Call ``fn`` from the loop (from any thread)."""
        self._done.append(fn)
        with contextlib.suppress(BlockingIOError, OSError):
            self._wake_w.send(b"\0")

    def _run_done(self) -> None:
        with contextlib.suppress(BlockingIOError, OSError):
            while self._wake_r.recv(4096):
                pass
        while self._done:
            _guarded(self._done.popleft())

    # -- accepting ---------------------------------------------------------------------------

    def _cap(self) -> int:
        """Authenticated connections allowed now."""
        if self.limits.max_connections is not None:
            return self.limits.max_connections
        return max(16, connection_room(self._fd_limit, self.limits.fd_reserve) - len(self._held)
                   - len(self._pending))

    def _accept(self, lst: _Listener) -> None:
        for _ in range(256):  # a burst of connections: take many per wake, not one
            try:
                sock, peer = lst.sock.accept()
            except BlockingIOError:
                return
            except OSError as exc:
                if exc.errno in _NO_FDS and (self._shed_files() or self._use_spare()):
                    continue  # room made: take it
                if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    # out of descriptors: stop accepting for a tick, not a busy loop
                    log.log(logging.DEBUG if "paused" in _said else logging.WARNING,
                            "cannot accept a connection: %s; paused (said once)",
                            exc.strerror)
                    _said.add("paused")
                    self._sel.unregister(lst.sock)
                    self._accept_paused.append(lst)
                    self._paused_until = time.monotonic() + 0.1
                return
            where = "reader (unix socket)" if lst.unix else f"peer {peer[0]}:{peer[1]}"
            try:
                self._admit(sock, where, lst.unix, "unix socket" if lst.unix else peer[0])
            except Exception as exc:
                _say_once(exc, f"cannot take a connection of a {where}; closed")
                sock.close()

    def make_room(self) -> None:
        """The process is out of descriptors: close the shard files no reply queued reads
        from (each is opened again when next read). From any thread."""
        self.soon(self._make_room)

    def _make_room(self) -> None:
        self._shed_files()

    def _shed_files(self) -> int:
        """Out of descriptors: close the shard files that no queued reply reads from (each
        is opened again when next read), to take connections. How many were closed."""
        busy = {p.fd for conn in (*self._authed, *self._pending) for r in conn.replies
                for p in r.parts if isinstance(p, _File)}
        freed = self._held.shed(busy)
        if freed and "shed" not in _said:
            _said.add("shed")
            log.warning("out of descriptors (the open-file limit, %d): %d shard files "
                        "closed to make room (each opened again when read; said once)",
                        self._fd_limit, freed)
        return freed

    def _use_spare(self) -> bool:
        """Let go of the descriptor kept in reserve, if it is held, for one connection."""
        if self._spare is None:
            return False
        os.close(self._spare)
        self._spare = None
        return True

    def _admit(self, sock: socket.socket, where: str, unix: bool, source: str = "") -> None:
        """Take a new connection into the unauthenticated set, dropping the oldest one there
        if the set is full; refuse it if every authenticated slot is taken."""
        if len(self._authed) >= self._cap():
            self.stats.refused_busy += 1
            self._refuse(sock)
            return
        pending_cap = min(self.limits.max_unauthenticated,
                          max(32, connection_room(self._fd_limit, self.limits.fd_reserve) // 4))
        while len(self._pending) >= pending_cap:
            oldest = next(iter(self._pending))
            self.stats.dropped_unauthenticated += 1
            self._close(oldest)
        sock.setblocking(False)
        if not unix:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        else:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, UNIX_SNDBUF)
        now = time.monotonic()
        conn = _Conn(sock, where, unix, now, source)
        self._pending[conn] = None
        self.stats.connections += 1
        self.stats.active += 1
        self.stats.unauthenticated = len(self._pending)
        conn.nonce = auth.new_nonce()
        self._sel.register(sock, selectors.EVENT_READ, conn)
        conn.events = selectors.EVENT_READ
        self._queue(conn, P.encode_parts(P.Challenge(conn.nonce, self.manifest.pack_id)))
        self._arm(conn)

    def _refuse(self, sock: socket.socket) -> None:
        """Tell a connection with no slot so (one send: the frame fits the socket buffer)."""
        with contextlib.suppress(OSError):
            sock.setblocking(False)
            sock.send(P.encode(P.Error(P.E_BUSY, "too many connections; try another holder")))
        sock.close()

    # -- reading requests --------------------------------------------------------------------

    def _on_read(self, conn: _Conn) -> None:
        try:
            k = conn.sock.recv_into(self._rbuf)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._close(conn)
            return
        if k == 0:
            self._close(conn)
            return
        conn.last = time.monotonic()
        conn.decoder.feed(memoryview(self._rbuf)[:k])
        self._take_requests(conn)

    @staticmethod
    def _room(conn: _Conn) -> bool:
        """Whether the connection's queue takes another request: few replies queued, and
        little memory held by them (a reader that stops taking its replies holds at most
        that, and one request's, in this daemon; the rest wait in its socket)."""
        return len(conn.replies) < _MAX_QUEUED and conn.held < _MAX_HELD

    def _take_requests(self, conn: _Conn) -> None:
        """Handle the whole requests the connection's decoder holds, while its queue has
        room; the rest wait there (then in the socket) until its replies go out."""
        dec = conn.decoder
        conn.taking = True
        try:
            while not conn.closed and self._room(conn) and \
                    (msg := dec.next_message()) is not None:
                self._handle(conn, msg)
            waiting = not conn.closed and dec.has_frame()  # whole, left for later
        except ProtocolError as exc:
            self.stats.protocol_errors += 1
            log.info("%s: %s; closed", conn.where, exc)
            self._fail(conn, P.E_PROTOCOL, str(exc))
            return
        finally:
            conn.taking = False
        if conn.closed:
            return
        if dec.pending and conn.state == _READY and not waiting:
            if not conn.frame_at:
                conn.frame_at = conn.last  # a request frame began: all of it before its deadline
        else:
            conn.frame_at = 0.0
        self._interest(conn)
        self._arm(conn)

    def _handle(self, conn: _Conn, msg: P.Message) -> None:
        """Handle one request; one that fails (other than by a malformed frame) is
        answered E_INTERNAL, and the connection goes on."""
        try:
            self._dispatch(conn, msg)
        except ProtocolError:
            raise
        except Exception as exc:
            self.stats.internal_errors += 1
            _say_once(exc, f"a {type(msg).__name__} from {conn.where} failed; answered with "
                      "an error (its client takes the next holder)")
            if conn.state == _HANDSHAKE:
                self._fail(conn, P.E_INTERNAL, f"internal error: {_why(exc)}")
            elif not conn.closed:
                self._queue(conn, P.encode_parts(P.Error(P.E_INTERNAL,
                                                         f"internal error: {_why(exc)}")))

    def _dispatch(self, conn: _Conn, msg: P.Message) -> None:
        if conn.state == _HANDSHAKE:
            self._auth(conn, msg)
        elif isinstance(msg, P.Read):
            self._read(conn, msg)
        elif isinstance(msg, P.StatusRequest):
            self._queue(conn, P.encode_parts(P.Status(self._status())))
        elif isinstance(msg, P.Check):
            outcome = self.check(msg.shard) if self.check is not None else "not checked here"
            self._queue(conn, P.encode_parts(P.Status({"check": outcome})))
        else:
            raise ProtocolError(f"unexpected {type(msg).__name__} from a client")

    def _auth(self, conn: _Conn, msg: P.Message) -> None:
        if not isinstance(msg, P.Auth):
            raise ProtocolError(f"expected AUTH, got {type(msg).__name__}")
        end = auth.channel_binding(conn.sock, accepted=True)
        if not auth.verify(auth.client_proof(self.token, conn.nonce, msg.nonce, end), msg.mac):
            self.stats.auth_failures += 1
            self._auth_failed(conn)
            self._fail(conn, P.E_AUTH, f"job token not proven for a connection to {end}: "
                       "refused")
            return
        del self._pending[conn]
        self.stats.unauthenticated = len(self._pending)
        if len(self._authed) >= self._cap():
            self.stats.refused_busy += 1
            self._fail(conn, P.E_BUSY, "too many connections; try another holder")
            return
        self._authed.add(conn)
        conn.state = _READY
        conn.decoder.max_frame = self.limits.max_request
        st = self.stats
        if conn.unix:
            st.unix_readers += 1
            st.unix_peak = max(st.unix_peak, st.unix_readers)
        else:
            st.tcp_peers += 1
            st.tcp_peak = max(st.tcp_peak, st.tcp_peers)
        self._queue(conn, P.encode_parts(P.AuthOk(auth.server_proof(self.token, conn.nonce,
                                                                     msg.nonce, end))))

    def _auth_failed(self, conn: _Conn) -> None:
        """Log a failed handshake as ``AuthFailures`` says: its line, or a summary of the
        others later (a timer of the loop, so the last of a burst is said too)."""
        line = self.auth_failures.failed(conn.source, conn.where)
        if line is not None:
            log.warning("%s", line)
        self._arm_auth_summary()

    def _arm_auth_summary(self) -> None:
        due = self.auth_failures.due()
        if due is not None and self._auth_timer is None:
            self._auth_timer = self.later(max(0.0, due - self.auth_failures.clock()),
                                          self._auth_summary)

    def _auth_summary(self, final: bool = False) -> None:
        """Say the summary of the failed handshakes if it is due (``final``: now, as the
        server closes), and arm the timer for the next one."""
        self._auth_timer = None
        line = self.auth_failures.summary(now=final)
        if line is not None:
            log.warning("%s", line)
        if not final:
            self._arm_auth_summary()

    def _read(self, conn: _Conn, req: P.Read) -> None:
        st = self.stats
        st.requests += 1
        st.ranges += len(req.ranges)
        n = len(req.ranges)
        status = [P.INVALID] * n
        fds = [-1] * n
        budget = self.limits.max_reply
        relay: list[int] = []
        small = 0
        held: dict[int, int] = {}  # a shard's file, looked up once per request
        part: dict[int, bytes] = {}  # ranges read from a partial copy's pieces
        for i, r in enumerate(req.ranges):
            if r.shard >= len(self._sizes) or r.offset + r.length > self._sizes[r.shard] \
                    or r.length > budget:
                continue
            budget -= r.length
            fd = held.get(r.shard)
            if fd is None:
                fd = held[r.shard] = self._fd(r.shard)
            if fd >= 0:
                status[i], fds[i] = P.OK, fd
                if r.length < _SENDFILE_MIN:
                    small += r.length
            elif self.pieces is not None and \
                    (got := self.pieces(r.shard, r.offset, r.length)) is not None:
                status[i], part[i] = P.OK, got  # the pieces a partial copy holds
                small += r.length
            elif conn.unix and self.relay is not None:
                relay.append(i)
            else:
                status[i] = P.NOT_HELD
                st.ranges_not_held += 1
        # ranges held here: the small ones read now into one buffer (the reply's), the
        # large ones sent from the file by sendfile when their turn comes
        buf = memoryview(bytearray(small - sum(len(b) for b in part.values())))
        data: list[_Chunk | None] = [None] * n
        pos = served = 0
        for i, r in enumerate(req.ranges):
            if status[i] != P.OK:
                continue
            if i in part:
                data[i] = memoryview(part[i])
                served += r.length
                st.bytes_served_partial += r.length
                continue
            if r.length >= _SENDFILE_MIN:
                data[i] = _File(fds[i], r.offset, r.length)
                served += r.length
                continue
            view = buf[pos : pos + r.length]
            if r.length and os.preadv(fds[i], [view], r.offset) != r.length:
                status[i], data[i] = P.NOT_HELD, None  # shorter than the manifest says
                self.forget(req.ranges[i].shard)
                continue
            data[i] = view
            pos += r.length
            served += r.length
        st.bytes_served += served
        if not relay:
            self._queue(conn, _data_parts(req.request_id, status, data), held=small)
            return
        st.relayed_requests += 1
        st.relayed_ranges += len(relay)
        asked = [(req.ranges[i].shard, req.ranges[i].offset, req.ranges[i].length)
                 for i in relay]
        # what the relay will bring counts from now: the requests after this one wait
        # while it is out (its ranges come into memory, or pipes: counted alike)
        reply = _Reply(held=small + sum(a[2] for a in asked))
        conn.held += reply.held
        conn.replies.append(reply)

        def finish(got: list[bytes | Piped | None]) -> None:
            for i, (_, _, length), chunk in zip(relay, asked, got, strict=True):
                if chunk is not None and len(chunk) == length:
                    status[i], data[i] = P.OK, chunk
                    if isinstance(chunk, Piped):
                        st.relayed_piped += 1
                else:
                    status[i] = P.NOT_HELD
                    st.relayed_missing += 1
            reply.parts.extend(_data_parts(req.request_id, status, data))
            reply.ready = True
            if conn.closed:
                _release(reply.parts)
            else:
                self._flush(conn)
                self._arm(conn)

        assert self.relay is not None
        try:
            self.relay.begin(asked, finish)
        except Exception:  # a relay that fails leaves the reader to go on (NOT_HELD)
            log.exception("relay of %d ranges failed", len(asked))
            if not reply.ready:
                finish([None] * len(asked))

    # -- writing replies ---------------------------------------------------------------------

    def _queue(self, conn: _Conn, parts: list[bytes | memoryview] | list[_Part],
               close_after: bool = False, held: int = 0) -> None:
        views: list[_Part] = [p if isinstance(p, _File | Piped) else memoryview(p)
                              for p in parts if isinstance(p, _File) or len(p)]
        conn.replies.append(_Reply(views, close_after, held))
        conn.held += held
        self._flush(conn)

    def _flush(self, conn: _Conn) -> None:
        """Send what is ready, in order, as far as the socket takes it now."""
        if conn.closed:
            return
        replies = conn.replies
        try:
            while replies and replies[0].ready:
                r = replies[0]
                if not r.started:
                    r.started = True
                    conn.io_at = time.monotonic() + self.limits.io_timeout
                if not self._send(conn, r.parts):
                    break
                replies.popleft()
                conn.held -= r.held
                if r.close_after:
                    self._close(conn)
                    return
        except OSError:  # reset, broken pipe, a shard file cut short: this connection ends
            self._close(conn)
            return
        if not conn.taking and conn.decoder.pending and self._room(conn):
            self._take_requests(conn)  # requests left waiting for room (it has some now)
            return
        self._interest(conn)

    def _send(self, conn: _Conn, parts: collections.deque[_Part]) -> bool:
        """Send ``parts`` from the front; True when all of them are out."""
        sock, out = conn.sock, conn.fd
        while parts:
            head = parts[0]
            if isinstance(head, Piped):
                if not head.send(out):
                    return False
                parts.popleft()
                continue
            if isinstance(head, _File):
                try:
                    k = os.sendfile(out, head.fd, head.offset, head.count)
                except BlockingIOError:
                    return False
                if k == 0:
                    raise OSError(errno.EIO, "shard file shorter than the manifest says")
                head.offset += k
                head.count -= k
                if not head.count:
                    parts.popleft()
                continue
            views: list[memoryview] = []
            for p in itertools.islice(parts, _IOV):
                if not isinstance(p, memoryview):
                    break
                views.append(p)
            try:
                k = sock.sendmsg(views)
            except BlockingIOError:
                return False
            while k:  # no view is empty (_queue, _data_parts): each byte sent moves on
                v = parts[0]
                assert isinstance(v, memoryview)
                if k >= len(v):
                    k -= len(v)
                    parts.popleft()
                else:
                    parts[0] = v[k:]
                    k = 0
        return True

    def _interest(self, conn: _Conn) -> None:
        """Read while few replies are queued, holding little memory (the other requests
        wait in the socket: backpressure); wait for room to write while a ready reply is
        not out."""
        if conn.closed:
            return
        ev = 0
        if self._room(conn):
            ev |= selectors.EVENT_READ
        if conn.replies and conn.replies[0].ready:
            ev |= selectors.EVENT_WRITE
        if ev == conn.events:
            return
        if not ev:
            self._sel.unregister(conn.sock)  # until a relay answers (finish flushes)
        elif not conn.events:
            self._sel.register(conn.sock, ev, conn)
        else:
            self._sel.modify(conn.sock, ev, conn)
        conn.events = ev

    def _fail(self, conn: _Conn, code: int, message: str) -> None:
        """Send an ERROR, then close (what the socket does not take now is dropped)."""
        for r in conn.replies:
            _release(r.parts)
        conn.replies.clear()
        self._queue(conn, P.encode_parts(P.Error(code, message)), close_after=True)
        if not conn.closed:
            self._close(conn)

    # -- deadlines ---------------------------------------------------------------------------

    def _due(self, conn: _Conn) -> float:
        """When this connection's current deadline passes (inf: none now)."""
        lim = self.limits
        if conn.state == _HANDSHAKE:
            return conn.authed_at + lim.handshake_timeout
        if conn.replies and conn.replies[0].started:
            return conn.io_at
        if conn.frame_at:
            return conn.frame_at + lim.frame_timeout
        if conn.replies:
            return float("inf")  # a relay is out: its batch has its own deadline
        return conn.last + lim.idle_timeout

    def _arm(self, conn: _Conn) -> None:
        """Keep one timer entry per connection, for its earliest deadline: a deadline that
        moves later (each request pushes the idle one) is found when the entry comes due."""
        if conn.closed:
            return
        at = self._due(conn)
        if at != float("inf") and (not conn.deadline or at < conn.deadline):
            conn.deadline = at
            heapq.heappush(self._heap, (at, next(self._seq), conn))

    def _expire(self, now: float) -> None:
        if len(self._heap) > _HEAP_SLACK + 4 * (len(self._authed) + len(self._pending)):
            self._compact()
        heap = self._heap
        while heap and heap[0][0] <= now:
            at, _, conn = heapq.heappop(heap)
            if conn.closed or at != conn.deadline:
                continue  # replaced by an earlier one
            conn.deadline = 0.0
            if self._due(conn) > now:
                self._arm(conn)  # moved later meanwhile
                continue
            if conn.state == _HANDSHAKE:
                self.stats.handshake_timeouts += 1
                log.info("%s: no handshake within %g s; dropped", conn.where,
                         self.limits.handshake_timeout)
            elif conn.replies and conn.replies[0].started:
                self.stats.io_timeouts += 1
                log.info("%s: reply not taken within %g s; closed", conn.where,
                         self.limits.io_timeout)
            elif conn.frame_at:
                self.stats.frame_timeouts += 1
                log.info("%s: request frame not whole within %g s; closed", conn.where,
                         self.limits.frame_timeout)
            self._close(conn)

    def _compact(self) -> None:
        """Keep only the deadline entries still in force: one per open connection. A closed
        connection's entry stayed until it came due (its idle deadline: 900 s), holding the
        connection: a daemon whose readers come and go kept every one of the last 15
        minutes'."""
        self._heap = [e for e in self._heap if not e[2].closed and e[0] == e[2].deadline]
        heapq.heapify(self._heap)

    def _close(self, conn: _Conn) -> None:
        if conn.closed:
            return
        conn.closed = True
        with contextlib.suppress(KeyError, ValueError, OSError):
            self._sel.unregister(conn.sock)
        if conn in self._pending:
            del self._pending[conn]
            self.stats.unauthenticated = len(self._pending)
        elif conn in self._authed:
            self._authed.discard(conn)
            if conn.unix:
                self.stats.unix_readers -= 1
            else:
                self.stats.tcp_peers -= 1
        self.stats.active -= 1
        for r in conn.replies:
            _release(r.parts)
        conn.replies.clear()
        conn.sock.close()
        # the part of a request frame it had sent (up to max_request): let go of now. The
        # closed connection stays in the deadline heap until its entry comes due (its idle
        # deadline: 900 s), and its decoder with it: readers killed while sending a large
        # request held a MB each there, 100 of them 100 MB, for 15 minutes
        self._freed += conn.held + conn.decoder.pending
        conn.decoder = _CLOSED_DECODER
        if self._freed >= _TRIM_AFTER and self._trim is None:
            # readers gone with replies they never took or frames cut short: once the
            # relays out for them have ended (their deadline), the memory goes back to the
            # kernel (glibc keeps it)
            self._trim = self.later(_TRIM_DELAY, self._trim_now)

    def _trim_now(self) -> None:
        self._trim = None
        self._freed = 0
        trim_malloc()

    # -- shard files -------------------------------------------------------------------------

    def _fd(self, shard: int) -> int:
        fd = self._held.fd(shard)
        return -1 if fd is None else fd

    def forget(self, shard: int) -> None:
        """A shard file was dropped or replaced: reopen it on next use (in the loop's
        thread, so no reply queued with its descriptor is sent from a reused one)."""
        if threading.current_thread() is not self._thread and self._thread.is_alive():
            self.soon(lambda: self.forget(shard))
            return
        fd = self._held.pop(shard)
        if fd is None:
            return
        for conn in [*self._authed, *self._pending]:
            if any(isinstance(p, _File) and p.fd == fd for r in conn.replies for p in r.parts):
                self._close(conn)
        os.close(fd)

    def _status(self) -> dict[str, Any]:
        info = dict(self.status_fn())
        info["server"] = self.stats.as_dict()
        return info

    # -- lifecycle -------------------------------------------------------------------------

    def close(self) -> None:
        """Stop serving: every connection is closed. Callable from any thread, the loop's
        own too (a shard lookup that finds the node going away)."""
        self._stop.set()
        if threading.current_thread() is not self._thread and self._thread.is_alive():
            with contextlib.suppress(OSError):
                self._wake_w.send(b"\0")
            self._thread.join(timeout=5)
        self._teardown()

    def _teardown(self) -> None:
        with self._lock:
            if self._torn_down:
                return
            self._torn_down = True
        if self.relay is not None:
            self.relay.close()
        self._auth_summary(final=True)  # the failed handshakes not said yet
        for conn in [*self._authed, *self._pending]:
            self._close(conn)
        for lst in self._listeners:
            with contextlib.suppress(OSError):
                lst.sock.close()
        if self.unix_path is not None:
            with contextlib.suppress(OSError):
                os.unlink(self.unix_path)
        for s in (self._wake_r, self._wake_w):
            s.close()
        self._sel.close()
        self._held.close()
        if self._spare is not None:
            os.close(self._spare)
            self._spare = None

    def __enter__(self) -> ShardServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


_TABLE = struct.Struct("!BI")
_Chunk = memoryview | _File | bytes | Piped
_Part = memoryview | _File | Piped  # what a reply is sent as


_NO_FDS = (errno.EMFILE, errno.ENFILE)
_CLOSED_DECODER = P.FrameDecoder(0)  # a closed connection's (it is never fed)
# the kinds of failure logged (_say_once); "shed", "paused": that it closed files, paused
_said: set[object] = set()


def _spare() -> int | None:
    """A descriptor to keep in reserve (None if none is free)."""
    try:
        return os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None


def _why(exc: BaseException) -> str:
    """A failure in words; out of descriptors, with the limit and what to do."""
    if isinstance(exc, OSError) and exc.errno in _NO_FDS:
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        return (f"out of descriptors ({exc.strerror}): this process's open-file limit "
                f"({soft}) is reached; raise it (ulimit -n) where the daemons start")
    return f"{type(exc).__name__}: {exc}"


def _say_once(exc: BaseException, what: str) -> None:
    """Log a failure of the server's: the first of its kind (type and errno) with its
    traceback, at error level; the next ones at debug level."""
    kind = (type(exc), getattr(exc, "errno", None))
    if kind in _said:
        log.debug("%s: %s", what, _why(exc))
        return
    _said.add(kind)
    log.error("%s: %s (said once: the next failures of this kind are not logged)", what,
              _why(exc), exc_info=exc)


def _guarded(fn: Callable[..., None], *args: Any) -> None:
    """``fn(*args)`` for the loop, on another's behalf (the relay's handlers, timers and
    calls): a failure there is logged and must not stop the loop."""
    try:
        fn(*args)
    except Exception:
        log.exception("a call in the server's loop failed")


def _release(parts: Iterable[_Part]) -> None:
    """The pipes of relayed ranges that will not be sent (their connection closed)."""
    for p in parts:
        if isinstance(p, Piped):
            p.release()


def _data_parts(request_id: int, status: list[int], data: Sequence[_Chunk | None]
                ) -> list[_Part]:
    """A DATA frame as parts: header and slot table in one buffer, then each OK range (a
    view of the reply's buffer, a relayed chunk in memory or in pipes, or a file range for
    sendfile)."""
    table = bytearray(struct.pack("!II", request_id, len(status)))
    body: list[_Part] = []
    size = 0
    for st, d in zip(status, data, strict=True):
        if st == P.OK and d is not None:
            part = d if isinstance(d, _File | Piped) else memoryview(d)
            n = (part.count if isinstance(part, _File) else len(part) if isinstance(part, Piped)
                 else part.nbytes)
            table += _TABLE.pack(P.OK, n)
            if n:
                body.append(part)
            size += n
        else:
            table += _TABLE.pack(st if st != P.OK else P.NOT_HELD, 0)
    head = P.HEADER.pack(P.MAGIC, P.VERSION, P.T_DATA, 0, len(table) + size)
    return [memoryview(head + table), *body]
