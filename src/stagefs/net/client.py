"""The peer client: pooled, authenticated connections to one daemon, batched range reads.

``PeerClient.read`` sends many (shard, offset, length) ranges in one READ and gets one DATA
reply. Connections are kept in a small pool per peer, at most ``pool_size`` open at once (a
thread that finds them all busy waits for one), and never shared between processes: a
forked child finds the pool of its parent's pid and starts its own. The peer is a daemon's
TCP address, or (``unix=PATH``) its node's Unix socket: the node fabric, through which a
training process sends every read that is not local (cluster/connect.py).

Every exchange has a total deadline (connect and handshake together; each reply frame), so
a peer that hangs, trickles bytes or speaks nonsense costs one deadline at most. Then it is
*suspect*: reads skip it at once (``PeerUnavailable``, the next holder answers) until a
probe in the background, after a growing back-off, finds it answering again. Every failure
reaches the Store as ``PeerUnavailable``, a ``SourceUnavailable``: never an exception to the
training job.

A peer that refuses the handshake (another job token, another pack) is a misconfiguration,
not a crash: ``refused`` says so while it lasts, and the log says it once, naming the peer and
the fix (unless ``explains_refusal`` says why: the daemons were started again).
``interrupt`` ends every call blocked on the peer at once (a daemon that stops must not wait
out a hung peer's deadlines).
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import logging
import os
import socket
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from typing import Any

from stagefs._malloc import tune_malloc
from stagefs.errors import AuthenticationError, ProtocolError, ProtocolVersionError
from stagefs.net import auth
from stagefs.net import protocol as P
from stagefs.net.health import BACKOFF, PeerHealth
from stagefs.net.sockio import (
    Deadline,
    host_port,
    recv_message,
    send_message,
    send_parts,
    set_recv_timeout,
    set_timeouts,
)
from stagefs.tiers.base import SourceUnavailable

__all__ = ["ClientStats", "PeerAuthenticationError", "PeerClient", "PeerSource",
           "PeerUnavailable"]

log = logging.getLogger("stagefs.client")
REPORT_EVERY = 10.0  # seconds between two reports of one shard's bad bytes to one peer

_REPLY_LIMIT = 64 * 2**20  # must not exceed the server's max_reply
_BATCH_BYTES = 16 * 2**20  # data in one READ (relayed: one relay each); more: pipelined
_WINDOW = 32  # requests in flight on one connection


_Bytes = bytes  # (inside _ReplyRecv, ``bytes`` is its method)
Patience = tuple[float, Callable[[], bool]]
_fork = [0]  # how many times this process's line has forked: a child's pools are not its own
os.register_at_fork(after_in_child=lambda: _fork.__setitem__(0, _fork[0] + 1))


class _ReplyRecv:
    """Receives of one reply frame under its total deadline. The kernel timeout of each
    receive is the time left when it was last armed, and it is armed again once 1/16 of the
    deadline has passed since: a setsockopt before each of a reply's ranges would cost more
    than receiving it, and a peer that trickles bytes gets at most 1/16 more than the
    deadline."""

    __slots__ = ("armed", "at", "begun", "patience", "seconds", "sock", "step")

    def __init__(self, sock: socket.socket, seconds: float,
                 patience: Patience | None = None) -> None:
        self.sock = sock
        self.seconds = seconds
        self.at = time.monotonic() + seconds
        self.step = seconds / 16
        self.armed = float("-inf")
        # each silence waited for patience[0] seconds at a time, and on only while the peer
        # answers a probe (see PeerClient.patience): before the reply's first byte, and
        # between its bytes (a daemon stopped in the middle of a reply cost its readers
        # the whole deadline, 10 s)
        self.patience = patience
        self.begun = False

    def _arm(self) -> None:
        now = time.monotonic()
        if now - self.armed > self.step:
            left = self.at - now
            if left <= 0:
                raise TimeoutError(errno.ETIMEDOUT, f"peer did not send its reply within "
                                   f"{self.seconds:g} s")
            if self.patience is not None:
                left = min(left, self.patience[0])
            set_recv_timeout(self.sock, left)
            self.armed = now

    def bytes(self, n: int) -> bytes:
        """Exactly ``n`` bytes, received straight into the bytes object returned (no copy
        in user space; one system call unless the kernel timeout or a signal cuts it)."""
        self._arm()
        if self.patience is not None and not self.begun:
            return self._first(n)
        parts: list[bytes] = []
        got = 0
        while got < n:
            try:
                data = self.sock.recv(n - got, socket.MSG_WAITALL)
            except BlockingIOError:  # the kernel timeout passed with nothing received
                if not self._wait_on():
                    raise TimeoutError(errno.ETIMEDOUT, "peer did not answer in time") from None
                continue
            if not data:
                raise ConnectionError(errno.ECONNRESET, "connection closed by peer")
            if not parts and len(data) == n:
                return data
            parts.append(data)
            got += len(data)
            if got < n:
                self._arm()
        return b"".join(parts)

    def _wait_on(self) -> bool:
        """A receive timed out: wait on (armed again) if the deadline is not past and the
        peer answers a probe (with patience), else not."""
        if self.patience is None or time.monotonic() >= self.at or not self.patience[1]():
            return False
        self.armed = float("-inf")
        self._arm()
        return True

    def _first(self, n: int) -> _Bytes:
        """The reply's first bytes, waited for ``patience[0]`` seconds at a time: each time
        none has come, ``patience[1]()`` says whether to wait on (the peer is alive, just
        slow: its whole deadline), else TimeoutError now."""
        assert self.patience is not None
        wait, alive = self.patience
        while True:
            try:
                self.sock.recv(n, socket.MSG_WAITALL | socket.MSG_PEEK)
            except BlockingIOError:
                if time.monotonic() >= self.at or not alive():
                    raise TimeoutError(errno.ETIMEDOUT, f"peer did not answer within "
                                       f"{wait:g} s, nor a probe") from None
                self.armed = float("-inf")
                self._arm()
                continue
            break
        self.begun = True  # it answers: the rest of the reply as it comes (bytes)
        self.armed = float("-inf")
        return self.bytes(n)  # (what was peeked, and the rest: closed, if nothing came)

    def message(self) -> P.Message:
        """The next message; a DATA reply's ranges each received into its own bytes
        object, the frame checked as ``protocol.decode_payload`` checks it."""
        mtype, length = P.parse_header(self.bytes(P.HEADER.size))
        if mtype != P.T_DATA:
            return P.decode_payload(mtype, self.bytes(length) if length else b"")
        rid, count = P.data_head(self.bytes(P.DATA_HEAD), length)
        statuses, lengths = P.data_slots(self.bytes(count * P.SLOT_SIZE) if count else b"",
                                         count, length)
        chunks = [self.bytes(n) if st == P.OK else None
                  for st, n in zip(statuses, lengths, strict=True)]
        return P.Data(rid, tuple(chunks), tuple(statuses))


class PeerUnavailable(SourceUnavailable):
    """The peer is down, timed out, refused us or spoke nonsense: try the next holder."""


class PeerAuthenticationError(PeerUnavailable, AuthenticationError):
    """The peer did not prove the job token (or serves another pack): to a reader, one
    more unavailable holder; to ``except AuthenticationError``, what went wrong."""


class _Refusal(AuthenticationError):
    """The handshake failed on a misconfiguration: ``kind`` is ``TOKEN`` (the two sides
    hold different job tokens, or the connection is relayed), ``PACK`` (the peer serves
    another pack) or ``VERSION`` (it speaks another protocol version)."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


TOKEN, PACK, VERSION = "token", "pack", "version"  # PeerClient.refused
# what a refused handshake means: the proofs cover the token and the address and port the
# connection was made to, which both sides must see alike (docs/PROTOCOL.md)
_WHY_REFUSED = ("another job token, or a connection through NAT or port forwarding, where "
                "the daemon sees another address than the one connected to")
_FIX = {
    TOKEN: "refused this node's job token: every node of the job must use the same token "
           "(the same --token-file for every daemon; without one under Slurm, the same "
           "$STAGEFS_SECRET, by default ~/.config/stagefs/secret) and reach each daemon "
           "at the address it listens on (not through NAT or port forwarding: the "
           "handshake is bound to that address)",
    PACK: "serves another pack: every node of the job must serve the same ORIGIN",
    VERSION: "speaks another protocol version: every node of the job must run the same "
             "stagefs version",
}


@dataclass
class ClientStats:
    requests: int = 0  # replies received
    ranges: int = 0
    bytes: int = 0
    attempts: int = 0  # connections tried (reads and probes)
    connects: int = 0  # connections made and authenticated
    sent: int = 0  # requests sent
    failures: int = 0
    skipped: int = 0  # reads that went straight to the next holder: the peer was suspect
    probes: int = 0

    def as_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


class PeerClient:
    """Talk to the daemon at ``host:port``, proving ``token``.

    ``timeout``: the total deadline of each reply frame; ``connect_timeout``: of connecting
    and the handshake together. ``clock`` (seconds, monotonic) times the back-off of a
    suspect peer."""

    def __init__(self, host: str, port: int, token: bytes, *, pack_id: bytes | None = None,
                 timeout: float = 10.0, connect_timeout: float = 3.0, pool_size: int = 8,
                 name: str | None = None, clock: Callable[[], float] = time.monotonic,
                 backoff: tuple[float, float] = BACKOFF, unix: str | None = None) -> None:
        self.host, self.port = host, port
        self.unix = unix
        self.name = name or (f"unix:{unix}" if unix else host_port(host, port))
        self._token = token
        self.pack_id = pack_id
        self.timeout = timeout
        self.connect_timeout = connect_timeout
        self.pool_size = pool_size
        self._clock = clock
        self.backoff_range = backoff
        # (seconds, alive): a reply whose first byte has not come within ``seconds`` is
        # waited for on (up to ``timeout``) only while ``alive()`` says the peer answers
        # otherwise (the node daemon: a probe on another connection); None: ``timeout``
        self.patience: Patience | None = None
        self._reported: dict[int, float] = {}  # shard -> when its copy was reported bad
        # the peer's refusal of our handshake while it lasts (TOKEN, PACK, VERSION),
        # else None
        self.refused: str | None = None
        # asked when the peer first refuses: True if its owner knows why (the daemons were
        # started again with a new token: cluster/connect.py), not a misconfiguration
        self.explains_refusal: Callable[[], bool] | None = None
        self._interrupted = False  # ``interrupt``: every call fails at once from now on
        self.stats = ClientStats()
        self._ids = itertools.count(1)
        tune_malloc()  # replies become sample-sized bytes: keep their memory for reuse
        self._reset()

    def _reset(self) -> None:
        self._fork = _fork[0]
        self._lock = threading.Lock()
        self._free = threading.Condition(self._lock)  # a connection came back
        self._out = 0  # connections taken from the pool or being made
        self._idle: list[socket.socket] = []
        # the generation each connection was made in: one made before the last ``shed``
        # is closed when it comes back, not pooled
        self._gen = 0
        self._born: weakref.WeakKeyDictionary[socket.socket, int] = \
            weakref.WeakKeyDictionary()
        # every socket made, from before it connects: ``interrupt`` shuts down those in use
        self._made: weakref.WeakSet[socket.socket] = weakref.WeakSet()
        answered_at = getattr(self, "health", None)
        self.health = PeerHealth(self.name, self.probe, self._clock, backoff=self.backoff_range,
                                 lock=self._lock, on_suspect=self._free.notify_all)
        if answered_at is not None:
            self.health.answered_at = answered_at.answered_at

    def _check_fork(self) -> None:
        if self._fork != _fork[0]:  # forked: the parent's sockets are not ours to use
            # closed here, pooled or in use by a thread of the parent's: close(2) ends only
            # this process's descriptor (the parent's connection goes on; no shutdown). A
            # forked child that only forgot them kept them open for its life, and with them
            # the parent's connections past the parent's close (a daemon's, a peer's)
            for s in list(self._made):
                with contextlib.suppress(OSError):
                    s.close()
            self._reset()

    # -- health (net/health.py; a request waiting for a connection gives up when the peer
    # turns suspect) --------------------------------------------------------------------------

    @property
    def clock(self) -> Callable[[], float]:
        """Seconds, monotonic: times the back-off of a suspect peer (settable in tests)."""
        return self._clock

    @clock.setter
    def clock(self, clock: Callable[[], float]) -> None:
        self._clock = self.health.clock = clock

    @property
    def answered_at(self) -> float:
        """When the peer last answered (``clock``), -inf if never."""
        return self.health.answered_at

    def suspect(self) -> bool:
        """True while the peer is suspect (it failed or was slow lately): skip it. Once its
        back-off has passed, a probe in the background (never the caller) checks it."""
        self._check_fork()
        return self.health.suspect()

    def is_down(self) -> bool:
        return self.suspect()

    def is_suspect(self) -> bool:
        """Suspect now, without starting a probe (for status reports)."""
        return self._fork == _fork[0] and self.health.is_suspect()

    def mark_suspect(self, why: str) -> None:
        """Skip this peer until it answers again (a hedged read found it slow)."""
        self.health.mark_suspect(why)

    def probe(self) -> bool:
        """Ask the peer now, within ``connect_timeout``, whatever its back-off: True if it
        answered (it is no longer suspect). An idle pooled connection is asked for its
        STATUS (a probe every second opens no connection); else a new one is made, which
        proves the token, and joins the pool."""
        self._check_fork()
        if self._interrupted:
            return False
        self.stats.probes += 1
        with self._lock:
            sock = self._idle.pop() if self._idle else None
        try:
            if sock is None:
                sock = self._connect()
            else:
                dl = Deadline(sock, self.connect_timeout)
                send_message(sock, P.StatusRequest(), dl)
                if not isinstance(recv_message(sock, P.MAX_FRAME, deadline=dl), P.Status):
                    raise ProtocolError(f"{self.name}: expected STATUS")
        except (PeerUnavailable, ProtocolError, OSError):
            if sock is not None:
                sock.close()
            return False
        set_timeouts(sock, self.timeout)
        self.health.answered()
        self._give(sock)
        return True

    def wait_probe(self, timeout: float | None = None) -> None:
        """Wait for the background probe, if one is running."""
        self.health.wait_probe(timeout)

    def _failed(self, sock: socket.socket | None, exc: BaseException) -> None:
        if sock is not None:
            sock.close()
        if self._interrupted:  # our own doing (``interrupt``), not the peer's
            return
        self.stats.failures += 1
        self.health.failed(exc)
        with self._lock:
            idle, self._idle = self._idle, []
        for s in idle:
            s.close()

    def failed(self, exc: BaseException) -> None:
        """A request on a connection of the caller's own failed (the daemon's relay): the
        peer is suspect, with a growing back-off, as when one of the pool's fails."""
        self._failed(None, exc)

    def answered(self) -> None:
        """The peer answered a request on a connection of the caller's own."""
        self.health.answered()

    # -- connections ---------------------------------------------------------------------------

    def open_connection(self) -> socket.socket:
        """A new authenticated connection that is the caller's, not the pool's (blocking,
        its timeouts set), or PeerUnavailable (the failure counted: the peer is suspect)."""
        self._check_fork()
        return self._connect()

    def _connect(self) -> socket.socket:
        """A new authenticated connection, or PeerUnavailable (the failure counted). It is
        of the pool's generation when it began: a ``shed`` while it connected closes it
        once its request is done (pooled, it outlived the shed)."""
        self._check_open()
        self.stats.attempts += 1
        gen = self._gen
        sock: socket.socket | None = None
        try:
            try:
                sock = self._dial()
            except OSError as exc:
                raise PeerUnavailable(f"{self.name}: cannot connect ({exc})") from exc
            if self.unix is None:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            set_timeouts(sock, self.connect_timeout)
            self._handshake(sock, Deadline(sock, self.connect_timeout))
        except PeerUnavailable as exc:
            self._failed(sock, exc)
            raise
        except AuthenticationError as exc:
            self._failed(sock, exc)
            if not self._interrupted:
                self._refused(exc)
            raise PeerAuthenticationError(str(exc)) from None
        except (OSError, ProtocolError) as exc:
            self._failed(sock, exc)
            raise PeerUnavailable(f"{self.name}: handshake failed ({exc})") from exc
        except BaseException:
            if sock is not None:
                sock.close()
            raise
        set_timeouts(sock, self.timeout)
        self.stats.connects += 1
        with self._lock:
            self._born[sock] = gen
            interrupted = self._interrupted
        if interrupted:  # (after interrupt looked at the sockets made)
            sock.close()
            self._check_open()
        if self.refused is not None:
            self.refused = None
            log.info("%s accepts this node's handshake again", self._who())
        return sock

    def _dial(self) -> socket.socket:
        """A connected socket (within ``connect_timeout`` for each address tried), known to
        ``interrupt`` from before it connects."""
        if self.unix is not None:
            targets: list[tuple[int, Any]] = [(socket.AF_UNIX, self.unix)]
        else:
            targets = [(family, addr) for family, _, _, _, addr in
                       socket.getaddrinfo(self.host, self.port, 0, socket.SOCK_STREAM)]
        err: OSError = OSError(errno.EADDRNOTAVAIL, f"no address for {self.host}")
        for family, addr in targets:
            sock = socket.socket(family, socket.SOCK_STREAM)
            with self._lock:
                self._made.add(sock)
                interrupted = self._interrupted
            try:
                if interrupted:
                    raise OSError(errno.ECANCELED, "interrupted")
                sock.settimeout(self.connect_timeout)
                sock.connect(addr)
            except OSError as exc:
                sock.close()
                err = exc
                continue
            return sock
        raise err

    def _who(self) -> str:
        """The peer's name and address, for the log."""
        where = f"unix:{self.unix}" if self.unix is not None else host_port(self.host, self.port)
        return self.name if where == self.name else f"{self.name} ({where})"

    def _refused(self, exc: AuthenticationError) -> None:
        """The peer refused our handshake (or failed its own): ``refused`` says so, and the
        log once until it accepts again (a peer probed every second was one line each)."""
        kind = exc.kind if isinstance(exc, _Refusal) else TOKEN
        if self.refused == kind:
            return
        self.refused = kind
        explains = self.explains_refusal
        if explains is not None and explains():
            log.info("%s refused the handshake of the daemons it was started again after",
                     self._who())
            return
        log.warning("%s %s; skipped until it accepts (its shards read from other holders)",
                    self._who(), _FIX[kind])

    def _check_open(self) -> None:
        """PeerUnavailable once ``interrupt`` has been called."""
        if self._interrupted:
            raise PeerUnavailable(f"{self.name}: client interrupted (its owner stops)")

    def interrupt(self) -> None:
        """End every call on this peer now, from any thread, and fail the next ones at
        once (PeerUnavailable, not counted against the peer): its owner stops (a daemon on
        SIGTERM) and must not wait out the deadlines of a peer that hangs. The sockets in use
        are shut down, which wakes a thread blocked on one (closing it would not), and those
        in the pool closed."""
        self._check_fork()
        with self._free:
            self._interrupted = True
            idle, self._idle = self._idle, []
            made = list(self._made)
            self._free.notify_all()  # a call waiting for a pooled connection
        for s in made:
            with contextlib.suppress(OSError):  # (closed already: nothing to wake)
                s.shutdown(socket.SHUT_RDWR)
        for s in idle:
            s.close()

    def _handshake(self, sock: socket.socket, dl: Deadline) -> None:
        try:
            msg = recv_message(sock, 4096, deadline=dl)
        except ProtocolVersionError as exc:
            raise _Refusal(VERSION, f"{self.name}: {exc}") from None
        if isinstance(msg, P.Error):
            raise PeerUnavailable(f"{self.name}: refused: {msg.message}")
        if not isinstance(msg, P.Challenge):
            raise ProtocolError(f"{self.name}: expected CHALLENGE, got {type(msg).__name__}")
        if self.pack_id is not None and msg.pack_id != self.pack_id:
            raise _Refusal(PACK, f"{self.name}: serves another dataset (pack id differs)")
        nc = auth.new_nonce()
        end = auth.channel_binding(sock, accepted=False)
        send_message(sock, P.Auth(nc, auth.client_proof(self._token, msg.nonce, nc, end)), dl)
        reply = recv_message(sock, 4096, deadline=dl)
        if isinstance(reply, P.Error):
            if reply.code != P.E_AUTH:
                raise PeerUnavailable(f"{self.name}: refused: {reply.message}")
            raise _Refusal(TOKEN, f"{self.name}: {reply.message} (this node connected to "
                           f"{end}: {_WHY_REFUSED})")
        if not isinstance(reply, P.AuthOk):
            raise ProtocolError(f"{self.name}: expected AUTH_OK, got {type(reply).__name__}")
        if not auth.verify(auth.server_proof(self._token, msg.nonce, nc, end), reply.mac):
            raise _Refusal(TOKEN, f"{self.name}: the server could not prove the job token "
                           f"for a connection to {end} ({_WHY_REFUSED}, or another process "
                           "listens there and relays another daemon's handshake)")

    def _take(self) -> tuple[socket.socket, bool]:
        """A connection (from the pool: True), or PeerUnavailable if the peer is suspect.
        At most ``pool_size`` are out at once: a caller that finds them all busy waits for
        one (its request then goes on it, pipelined behind no other); ``_release`` after."""
        self._check_open()
        if self.suspect():
            self.stats.skipped += 1
            raise PeerUnavailable(f"{self.name}: suspect after a recent failure; skipped")
        with self._free:
            ok = self._free.wait_for(lambda: self._idle or self._out < self.pool_size
                                     or self.health.retry_at is not None
                                     or self._interrupted, self.timeout)
            self._check_open()
            if self.health.retry_at is not None:  # found slow or failing while it waited
                self.stats.skipped += 1
                raise PeerUnavailable(f"{self.name}: suspect after a recent failure; skipped")
            if not ok:
                raise PeerUnavailable(f"{self.name}: all {self.pool_size} connections busy "
                                      f"for {self.timeout:g} s")
            self._out += 1
            if self._idle:
                return self._idle.pop(), True
        try:
            return self._connect(), False
        except BaseException:
            self._release()
            raise

    def _release(self) -> None:
        """A connection taken by ``_take`` is back in the pool or closed."""
        with self._free:
            self._out -= 1
            self._free.notify()

    def _give(self, sock: socket.socket) -> None:
        with self._lock:
            if len(self._idle) < self.pool_size and self._fork == _fork[0] and \
                    self._born.get(sock, self._gen) == self._gen:
                self._idle.append(sock)
                return
        sock.close()

    def shed(self) -> None:
        """Close the pooled connections, and those in use now as each comes back (a
        request in flight, a probe): the caller reads this peer another way for now (a
        reader back on its node daemon's fabric, cluster/connect.py). A connection made
        after this call is pooled as usual."""
        self._check_fork()
        with self._lock:
            self._gen += 1
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
        order, handing each to ``handle`` (a DATA reply's ranges received each straight into
        its own bytes object: the bytes the caller gets, no copy). The server works on
        request k+1 while we receive reply k. Each reply has its own total deadline."""
        sock, pooled = self._take()
        try:
            self._exchange_on(sock, pooled, msgs, handle)
        finally:
            self._release()

    def _exchange_on(self, sock: socket.socket, pooled: bool, msgs: Sequence[P.Message],
                     handle: Callable[[int, P.Message], None]) -> None:
        received = False
        try:
            send_parts(sock, [P.encode(m) for m in msgs], Deadline(sock, self.timeout))
            self.stats.sent += len(msgs)
            for i in range(len(msgs)):
                reply = _ReplyRecv(sock, self.timeout, self.patience).message()
                received = True
                if isinstance(reply, P.Error):
                    raise PeerUnavailable(f"{self.name}: error {reply.code}: {reply.message}")
                handle(i, reply)
        except PeerUnavailable as exc:
            self._failed(sock, exc)
            raise
        except ConnectionError as exc:
            if pooled and not received:
                # the peer closed this pooled connection while it sat idle (its idle
                # timeout, a restart): not a failure of the peer; once more on a new one
                sock.close()
                self._exchange_on(self._connect(), False, msgs, handle)  # same slot
                return
            self._failed(sock, exc)
            raise PeerUnavailable(f"{self.name}: {exc}") from exc
        except (OSError, ProtocolError) as exc:
            self._failed(sock, exc)
            raise PeerUnavailable(f"{self.name}: {exc}") from exc
        except BaseException:
            sock.close()
            raise
        self.health.answered()
        self._give(sock)

    # -- requests --------------------------------------------------------------------------

    def read(self, ranges: Sequence[tuple[int, int, int]]) -> list[bytes | None]:
        """The bytes of each (shard, offset, length), or None where the peer does not hold
        it. Raises PeerUnavailable if the peer cannot answer.

        The ranges go in requests of about ``_BATCH_BYTES`` each, pipelined on one
        connection (a range over the reply limit is split and joined again)."""
        return self._read(ranges)

    def _read(self, ranges: Sequence[tuple[int, int, int]]) -> list[bytes | None]:
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
        parts: dict[int, list[Any]] = {}
        for w in range(0, len(batches), _WINDOW):
            self._read_batches(batches[w : w + _WINDOW], parts)
        for i, chunks in parts.items():
            if all(c is not None for c in chunks):
                out[i] = chunks[0] if len(chunks) == 1 else b"".join(
                    c for c in chunks if c is not None)
        return out

    def _read_batches(self, batches: list[list[tuple[int, int, int, int]]],
                      parts: dict[int, list[Any]]) -> None:
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
                data: bytes | None = None
                if c is not None and len(c) == n:
                    data = bytes(c)  # the same object: no copy
                    self.stats.bytes += n
                parts.setdefault(i, []).append(data)

        self._pipeline(reqs, handle)

    def status(self) -> dict[str, Any]:
        reply = self._exchange(P.StatusRequest())
        if not isinstance(reply, P.Status):
            raise PeerUnavailable(f"{self.name}: expected STATUS, got {type(reply).__name__}")
        return reply.info

    def check(self, shard: int) -> str:
        """Ask the peer to check its copy of ``shard`` (bytes of it from there failed their
        checksum): what it says it does (``"queued"``, ``"recent"``, ...)."""
        reply = self._exchange(P.Check(shard))
        if not isinstance(reply, P.Status):
            raise PeerUnavailable(f"{self.name}: expected STATUS, got {type(reply).__name__}")
        return str(reply.info.get("check"))

    def report_bad(self, shard: int) -> None:
        """Bytes of ``shard`` from this peer failed their checksum: ask it to check its copy
        (``check``), in a thread of its own, at most once per ``REPORT_EVERY`` seconds a
        shard (a reader that meets a bad copy meets it at every read until it is gone)."""
        now = time.monotonic()
        with self._lock:
            if now - self._reported.get(shard, float("-inf")) < REPORT_EVERY:
                return
            self._reported[shard] = now

        def send() -> None:
            try:
                got = self.check(shard)
            except (SourceUnavailable, OSError) as exc:
                log.debug("%s: could not ask for a check of shard %d: %s", self.name, shard,
                          exc)
                return
            log.debug("%s: shard %d: check %s", self.name, shard, got)

        threading.Thread(target=send, name="stagefs-report-bad", daemon=True).start()

    def close(self) -> None:
        self._check_fork()
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

    def report_bad(self, shard: int) -> None:
        """Its bytes of ``shard`` failed their checksum: it is asked to check its copy
        (and deletes it if bad; a holder that ``drop``s stops serving at once)."""
        report = getattr(self.client, "report_bad", None)  # (the MPI transport's has none)
        if report is not None:
            report(shard)

    def pread(self, shard: int, offset: int, length: int) -> bytes:
        if shard < 0 or offset < 0 or length < 0:
            raise PeerUnavailable(f"{self.name}: no range [{offset}, {offset + length}) in "
                                  f"shard {shard}")
        data = self.client.read([(shard, offset, length)])[0]
        if data is None:
            raise PeerUnavailable(f"{self.name}: does not hold shard {shard} (yet)")
        return data

    def pread_many(self, ranges: Sequence[tuple[int, int, int]]) -> list[bytes | None]:
        """Many ranges in one batched READ; None for each the peer cannot give (all of them
        if it is suspect or fails mid-batch)."""
        try:
            return self.client.read(ranges)
        except SourceUnavailable:
            return [None] * len(ranges)

    def is_down(self) -> bool:
        return self.client.is_down()

    def close(self) -> None:
        self.client.close()
