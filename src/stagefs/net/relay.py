"""The node daemon's relay, driven by its event loop: ranges of shards the node does not hold,
read for its readers from the peers that hold them, with no thread between the reader's
request and the peers' replies.

A reader's request (net/server.py) names ranges; ``Relay.begin`` splits them per holder (the
first live holder of each range's shard: ``holders(shard)``, the cluster's holder order) and
sends every part at once, each a READ frame on the relay's own connection to that peer
(one per peer; requests of many readers pipelined on it, the replies in order). The loop
receives each reply as it comes: its header and slot table into a small buffer, each range
into kernel pipes of its own with ``splice`` (net/pipes.py; into memory where no pipe is to
be had), to be spliced on to the reader's socket. When every range of the request is in, or
decided, ``done`` gets them: the reader's reply is sent.

The policy is the one a reader's own hedged reads follow (net/hedge.py), in timers of the
loop, not in threads:

- a part not answered within its peer's hedging delay (``batch_times.delay()``) goes to the
  next live replica of each of its ranges' shards too, and the first answer wins (the slow
  peer is marked suspect when another replica's bytes come first);
- a part not answered within the origin's delay (``origin_delay()``) is given up: its peer
  is suspect (reads skip it until a probe finds it answering again) and its ranges go to
  their next holder, or to none: None, and the reader reads them from the origin;
- a range a peer does not hold, or whose peer fails (its connection reset or closed, a
  malformed frame: the peer is suspect, with a back-off), goes to its next holder;
- the whole request has one deadline (``timeout``): what is not in by then is None.

A peer may give the relay a **channel** instead (``channel(peer)``: the MPI transport's
``MpiPeer`` when the daemons run with ``--transport mpi``): its parts are then read by a
blocking call in a worker thread each, and the answer or the failure is handed back to the
loop, under the same timers and rules.

A late reply is still received (the stream stays in step) and its bytes dropped; it clears
its peer's suspicion, as any answer does. A connection with a reply overdue (a part's
after its client's timeout, a probe's after its own) is closed: one watchdog timer a
connection. The relay does not verify bytes: the reader
does.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import itertools
import logging
import socket
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, fields
from typing import Any, Protocol, cast

from stagefs.errors import ProtocolError
from stagefs.net import protocol as P
from stagefs.net.client import PeerClient
from stagefs.net.hedge import ReplyTimes
from stagefs.net.pipes import Fill, Piped, PipePool

__all__ = ["Channel", "Loop", "Reads", "Relay", "RelayPeer", "RelayStats"]

log = logging.getLogger("stagefs.relay")

Chunk = bytes | Piped
Ranges = Sequence[tuple[int, int, int]]
Done = Callable[[list[Chunk | None]], None]
_IDLE = 60.0  # an upstream connection idle this long is closed before its next use (a
# peer closes idle connections after 900 s: one closed under a request would count as a
# failure)
_SCRATCH = 256 * 2**10  # a range no one wants any more is received into this and dropped
_SMALL = 4 * 2**20  # the most of a frame that is not a DATA reply (an ERROR, a STATUS)


class Loop(Protocol):
    """What the relay needs of the event loop that drives it (net/server.py)."""

    def watch(self, sock: socket.socket, events: int, handler: Callable[[int], None]
              ) -> None: ...
    def unwatch(self, sock: socket.socket) -> None: ...
    def later(self, delay: float, fn: Callable[[], None]) -> Timer: ...
    def soon(self, fn: Callable[[], None]) -> None: ...


class Timer(Protocol):
    def cancel(self) -> None: ...


class RelayPeer(Protocol):
    """A peer as the relay's holder (net/hedge.py HedgedPeer): its client (suspicion,
    probes, the connection's handshake), its reply times, its load and its counters."""

    name: str
    client: PeerClient
    batch_times: ReplyTimes
    outstanding: int
    hedged: int
    gave_up: int

    def is_down(self) -> bool: ...
    def begin(self) -> None: ...
    def end(self) -> None: ...


Holders = Callable[[int], Sequence[RelayPeer]]


class Reads(Protocol):
    """A blocking reader of one peer's ranges by another transport (the MPI transport's
    ``MpiPeer``): each range's bytes, None where it does not give them; PeerUnavailable
    (any exception) if the peer cannot answer."""

    def read(self, ranges: Sequence[tuple[int, int, int]],
             timeout: float | None = None) -> list[bytes | None]: ...


Channel = Callable[[RelayPeer], Reads | None]
_CHANNEL_THREADS = 64  # parts in flight at once through a blocking channel (a part to a
# peer that hangs holds its thread until its batch's deadline, not the channel's own)


@dataclass
class RelayStats:
    batches: int = 0
    ranges: int = 0
    parts: int = 0  # requests sent: one per holder per round, hedges too
    peak_parts: int = 0  # the most parts of one batch's first round
    rounds: int = 0  # rounds after the first: ranges sent on to another holder
    late: int = 0  # parts not answered by their batch's deadline
    missing: int = 0  # ranges no holder gave in time
    skipped: int = 0  # ranges every holder of which was down (suspect): none was asked
    late_replies: int = 0  # replies that came after their batch was answered: dropped
    upstream_failures: int = 0  # relay connections that failed (reset, closed, malformed)

    def as_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


class _Batch:
    __slots__ = ("deadline", "done", "finished", "first", "open", "out", "pending", "ranges",
                 "resolved", "timer", "tried")

    def __init__(self, ranges: Ranges, done: Done, deadline: float) -> None:
        n = len(ranges)
        self.ranges = ranges
        self.done = done
        self.deadline = deadline
        self.out: list[Chunk | None] = [None] * n
        self.resolved = [False] * n  # its bytes are in, or no one is left to ask
        self.pending = [0] * n  # parts in flight that ask for it
        self.tried: list[tuple[int, ...]] = [()] * n  # id() of the peers asked
        self.open = n
        self.finished = False
        self.first = True
        self.timer: Timer | None = None


class _Part:
    """One READ to one peer: some ranges of one batch."""

    __slots__ = ("batch", "due", "hedge", "hedged_by", "idx", "live", "peer", "rid", "sent",
                 "timers")

    def __init__(self, batch: _Batch, peer: RelayPeer, idx: list[int], hedge: bool) -> None:
        self.batch = batch
        self.peer = peer
        self.idx = idx
        self.hedge = hedge
        self.hedged_by: _Part | None = None  # for a hedge: the slow part it races
        self.live = True  # still waited for (not answered, failed or given up)
        self.rid = 0
        self.sent = 0.0
        self.due = 0.0  # its reply must have come by then, or the connection is closed
        self.timers: list[Timer] = []


class _Query:
    """A STATUS request on the relay's connection: a probe (``Relay.probe``)."""

    __slots__ = ("answered", "due", "event")

    def __init__(self) -> None:
        self.answered = False
        self.due = 0.0
        self.event = threading.Event()


class _Sink:
    """Where one range of a reply goes while it arrives: its Fill (pipes or memory), or
    nowhere (no one wants it any more: received into scratch and dropped)."""

    __slots__ = ("fill", "got", "n")

    def __init__(self, n: int, fill: Fill | None) -> None:
        self.n = n
        self.got = 0
        self.fill = fill


class _Upstream:
    """The relay's connection to one peer, driven by the loop."""

    __slots__ = ("closed", "connecting", "events", "head", "inflight", "last", "lengths", "out",
                 "peer", "phase", "reply", "sink", "sinks", "slot", "sock", "statuses", "want",
                 "watch_at", "watchdog")

    def __init__(self, peer: RelayPeer) -> None:
        self.peer = peer
        self.sock: socket.socket | None = None
        self.connecting = False
        self.closed = False
        self.events = 0  # what the loop watches its socket for
        self.out = bytearray()  # frames not sent yet
        self.inflight: collections.deque[_Part | _Query] = collections.deque()  # sent, in order
        self.last = 0.0
        self.watchdog: Timer | None = None  # armed for the earliest ``due`` of the requests out
        self.watch_at = 0.0
        # the reply being received
        self.phase = 0  # _HEAD, _TABLE, _BODY, _OTHER
        self.head = bytearray()
        self.want = P.HEADER.size
        self.reply = (0, 0)  # message type, payload length
        self.statuses: list[int] = []
        self.lengths: list[int] = []
        self.slot = 0
        self.sink: _Sink | None = None
        self.sinks: list[Chunk | None] = []


_HEAD, _DHEAD, _TABLE, _BODY, _OTHER = range(5)


class Relay:
    """Relay batches of ranges to their holders from the loop ``attach`` gives; one per
    daemon. ``holders(shard)``: the shard's peers in the order to ask them; ``timeout``:
    each batch's deadline; ``pipes``: where relayed ranges are received (None: memory)."""

    def __init__(self, holders: Holders, timeout: float, pipes: PipePool | None,
                 channel: Channel | None = None) -> None:
        self.holders = holders
        self.timeout = timeout
        self.pipes = pipes
        # a peer's parts go through the channel it gives (the MPI transport), if any,
        # in threads of their own: a blocking call each, its outcome handed to the loop
        self.channel = channel
        self._through: set[_Part] = set()  # parts out through a channel
        self._workers: ThreadPoolExecutor | None = None
        self.stats = RelayStats()
        self._loop: Loop | None = None
        self._ups: dict[int, _Upstream] = {}  # id(peer) ->
        self._ids = itertools.count(1)
        self._scratch = bytearray(_SCRATCH)
        self._connector: ThreadPoolExecutor | None = None
        self._closed = False
        self._probes: set[_Query] = set()  # waited for by callers of ``probe`` now

    def attach(self, loop: Loop) -> None:
        self._loop = loop

    # -- a batch ------------------------------------------------------------------------------

    def begin(self, ranges: Ranges, done: Done) -> None:
        """Read ``ranges`` (shard, offset, length) from their holders; ``done(chunks)`` in
        the loop's thread once each is in or decided (None: no holder gave it in time),
        perhaps before this returns."""
        assert self._loop is not None, "Relay.attach first"
        st = self.stats
        st.batches += 1
        st.ranges += len(ranges)
        b = _Batch(ranges, done, time.monotonic() + self.timeout)
        b.timer = self._loop.later(self.timeout, lambda: self._expire(b))
        self._assign(b, range(len(ranges)))
        self._check(b)

    def _assign(self, b: _Batch, idx: Sequence[int] | range) -> None:
        """Send each range of ``idx`` to its first holder not asked yet and not down; a range
        with none left (and no part out for it) is decided: None."""
        groups: dict[int, tuple[RelayPeer, list[int]]] = {}
        of: dict[int, Sequence[RelayPeer]] = {}
        up: dict[int, bool] = {}
        late = time.monotonic() >= b.deadline
        for i in idx:
            if b.resolved[i]:
                continue
            shard = b.ranges[i][0]
            hs = of.get(shard)
            if hs is None:
                hs = of[shard] = self.holders(shard)
            h = None if late else _next(hs, b.tried[i], up)
            if h is not None:
                b.tried[i] += (id(h),)
                groups.setdefault(id(h), (h, []))[1].append(i)
            elif not b.pending[i]:
                if b.first:
                    self.stats.skipped += 1
                self._decide(b, i, None)
        if groups:
            if b.first:
                self.stats.peak_parts = max(self.stats.peak_parts, len(groups))
            else:
                self.stats.rounds += 1
        b.first = False
        for h, ix in groups.values():
            self._send(_Part(b, h, ix, hedge=False))

    def _send(self, part: _Part) -> None:
        b = part.batch
        for i in part.idx:
            b.pending[i] += 1
        self.stats.parts += 1
        part.peer.begin()
        part.rid = next(self._ids) & 0xFFFFFFFF
        part.sent = time.monotonic()
        loop = self._loop
        assert loop is not None
        delays = part.peer.batch_times
        if not part.hedge:
            part.timers.append(loop.later(delays.delay(), lambda: self._hedge(part)))
        part.timers.append(loop.later(delays.origin_delay(), lambda: self._give_up(part)))
        # plain (shard, offset, length) tuples: the READ is packed from them as they are
        asked = cast("tuple[P.Range, ...]", tuple(b.ranges[i] for i in part.idx))
        reads = self.channel(part.peer) if self.channel is not None else None
        if reads is not None:
            self._send_through(reads, part, asked)
            return
        self._request(part.peer, part, P.Read(part.rid, asked), part.peer.client.timeout)

    def _send_through(self, reads: Reads, part: _Part, asked: Sequence[tuple[int, int, int]]
                      ) -> None:
        """Read ``part`` through the peer's channel in a worker thread; its answer, or its
        failure (the part's ranges go on to their next holder), comes back to the loop."""
        loop = self._loop
        assert loop is not None
        if self._workers is None:
            self._workers = ThreadPoolExecutor(_CHANNEL_THREADS,
                                               thread_name_prefix="stagefs-relay-channel")
        self._through.add(part)
        timeout = max(0.05, part.batch.deadline - time.monotonic())

        def work() -> None:
            try:
                chunks = reads.read(asked, timeout)
            except Exception as exc:  # PeerUnavailable, or the channel is gone
                err = exc
                loop.soon(lambda: self._through_failed(part, err))
                return
            loop.soon(lambda: self._through_answered(part, chunks))

        try:
            self._workers.submit(work)
        except RuntimeError as exc:  # shut down: the relay is closing
            self._through_failed(part, exc)

    def _through_answered(self, part: _Part, chunks: list[bytes | None]) -> None:
        self._through.discard(part)
        self._answered(part, list(chunks))

    def _through_failed(self, part: _Part, exc: BaseException) -> None:
        """The channel could not read ``part`` (its own health rules count it): its ranges
        go on to their next holder."""
        self._through.discard(part)
        self.stats.upstream_failures += 1
        log.info("relay to %s: %s", part.peer.name, exc)
        if part.live:
            self._drop(part)

    def _request(self, peer: RelayPeer, item: _Part | _Query, msg: P.Message,
                 timeout: float) -> None:
        """Send ``msg`` to ``peer`` on the relay's connection (made first if there is none);
        its reply, in order, goes to ``item``. A connection whose reply to it has not come
        within ``timeout`` is closed: the peer hangs."""
        up = self._upstream(peer)
        item.due = time.monotonic() + timeout
        up.inflight.append(item)
        up.out += P.encode(msg)
        if up.watchdog is None or item.due < up.watch_at:  # (a probe's is sooner)
            if up.watchdog is not None:
                up.watchdog.cancel()
            self._watch(up, timeout)
        if up.sock is not None:
            self._write(up)
        elif not up.connecting:
            self._connect(up)

    def _watch(self, up: _Upstream, delay: float) -> None:
        assert self._loop is not None
        up.watchdog = self._loop.later(delay, lambda: self._overdue(up))
        up.watch_at = time.monotonic() + delay

    def _overdue(self, up: _Upstream) -> None:
        """The connection's watchdog: a request whose reply is overdue closes it (one timer
        a connection, armed for the earliest reply due)."""
        up.watchdog = None
        if up.closed or not up.inflight:
            return
        now = time.monotonic()
        due = min(item.due for item in up.inflight)
        if up.sock is None:  # still connecting: that ends within the client's connect
            # timeout, and its failure fails every request here (one attempt at a time)
            self._watch(up, max(due - now, 0.1))
        elif due <= now:
            self._fail(up, TimeoutError(errno.ETIMEDOUT, "a reply did not come in time"))
        else:
            self._watch(up, due - now)

    def probe(self, peer: RelayPeer, timeout: float) -> bool:
        """Ask ``peer`` for its STATUS on the relay's connection (made again if it failed,
        whatever the peer's back-off) and wait for the answer (from any thread but the
        loop's): True if it came within ``timeout`` seconds. An answer clears the peer's
        suspicion; none within ``timeout`` fails the connection (the peer is suspect).
        Closing the relay ends the wait at once (False): a probe handed to a loop that has
        ended was waited for to its timeout, holding up the daemon's stop."""
        loop = self._loop
        if loop is None:
            return False
        q = _Query()
        self._probes.add(q)
        try:
            if self._closed:  # (after the add: close sets every event it finds)
                return False
            loop.soon(lambda: self._request(peer, q, P.StatusRequest(), timeout))
            q.event.wait(timeout + 1.0)  # set by the answer, the connection's failure, close
        finally:
            self._probes.discard(q)
        return q.answered

    def _hedge(self, part: _Part) -> None:
        """The hedging delay passed: each range still out goes to its shard's next live
        replica too."""
        if not part.live:
            return
        b = part.batch
        groups: dict[int, tuple[RelayPeer, list[int]]] = {}
        up: dict[int, bool] = {}
        for i in part.idx:
            if b.resolved[i]:
                continue
            h = _next(self.holders(b.ranges[i][0]), b.tried[i], up)
            if h is not None:
                b.tried[i] += (id(h),)
                groups.setdefault(id(h), (h, []))[1].append(i)
        part.peer.hedged += len(groups)
        for h, ix in groups.values():
            hp = _Part(b, h, ix, hedge=True)
            hp.hedged_by = part
            self._send(hp)

    def _give_up(self, part: _Part) -> None:
        """The origin's delay passed with no answer: the peer is suspect, and the part's
        ranges go to their next holder (none: the reader's origin)."""
        if not part.live:
            return
        peer = part.peer
        peer.gave_up += 1
        delay = peer.batch_times.origin_delay()
        peer.client.mark_suspect(f"no answer within {delay:.3f} s; read from the next holder")
        self._drop(part)

    def _drop(self, part: _Part) -> None:
        """``part`` is not waited for any more: its ranges go on to their next holder."""
        self._settle(part)
        b = part.batch
        if not b.finished:
            self._assign(b, [i for i in part.idx if not b.resolved[i] and not b.pending[i]])
            self._check(b)

    def _settle(self, part: _Part) -> None:
        """``part`` answered, failed or was given up: no longer counted as out."""
        if not part.live:
            return
        part.live = False
        for t in part.timers:
            t.cancel()
        part.timers.clear()
        part.peer.end()
        b = part.batch
        for i in part.idx:
            b.pending[i] -= 1

    def _answered(self, part: _Part, chunks: list[Chunk | None]) -> None:
        """A reply: each range's bytes (None: not held there)."""
        was_live = part.live
        peer = part.peer
        peer.batch_times.add(time.monotonic() - part.sent)
        peer.client.answered()
        self._settle(part)
        b = part.batch
        if not was_live or b.finished:
            self.stats.late_replies += 1
            _release(chunks)
            return
        gave = False
        for i, c in zip(part.idx, chunks, strict=True):
            if c is None:
                continue
            if b.resolved[i]:
                _release([c])
                continue
            gave = True
            self._decide(b, i, c)
        slow = part.hedged_by
        if gave and slow is not None and slow.live:
            slow.peer.client.mark_suspect(
                f"no answer within {slow.peer.batch_times.delay():.3f} s; another replica "
                "answered first")
        self._assign(b, [i for i in part.idx if not b.resolved[i] and not b.pending[i]])
        self._check(b)

    def _decide(self, b: _Batch, i: int, chunk: Chunk | None) -> None:
        b.resolved[i] = True
        b.out[i] = chunk
        b.open -= 1

    def _check(self, b: _Batch) -> None:
        if not b.open and not b.finished:
            self._finish(b)

    def _expire(self, b: _Batch) -> None:
        """The batch's deadline: what is not in is None."""
        if b.finished:
            return
        self.stats.late += sum(p.live for p in self._parts_of(b))
        self._finish(b)

    def _parts_of(self, b: _Batch) -> list[_Part]:
        """The parts of ``b`` still out, on the connections and through the channels."""
        out = [p for up in self._ups.values() for p in up.inflight
               if isinstance(p, _Part) and p.batch is b]
        return out + [p for p in self._through if p.batch is b]

    def _finish(self, b: _Batch) -> None:
        b.finished = True
        if b.timer is not None:
            b.timer.cancel()
        for p in self._parts_of(b):  # the parts still out are not waited for
            self._settle(p)
        out = b.out
        self.stats.missing += sum(c is None for c in out)
        b.done(out)

    # -- connections to peers -----------------------------------------------------------------

    def _upstream(self, peer: RelayPeer) -> _Upstream:
        up = self._ups.get(id(peer))
        if up is None or up.closed:
            up = self._ups[id(peer)] = _Upstream(peer)
        elif up.sock is not None and not up.inflight and \
                time.monotonic() - up.last > _IDLE:
            self._close(up)  # idle long: the peer may be about to close it
            up = self._ups[id(peer)] = _Upstream(peer)
        return up

    def _connect(self, up: _Upstream) -> None:
        """Connect and prove the token in a thread (the client's handshake, blocking), then
        hand the socket to the loop."""
        up.connecting = True
        if self._connector is None:
            self._connector = ThreadPoolExecutor(4, thread_name_prefix="stagefs-relay-connect")
        loop = self._loop
        assert loop is not None

        def work() -> None:
            try:
                sock = up.peer.client.open_connection()
            except Exception as exc:  # counted by the client; the parts go on
                err = exc
                loop.soon(lambda: self._fail(up, err, counted=True))
                return
            loop.soon(lambda: self._connected(up, sock))

        try:
            self._connector.submit(work)
        except RuntimeError as exc:  # shut down: the relay is closing
            self._fail(up, exc, counted=True)

    def _connected(self, up: _Upstream, sock: socket.socket) -> None:
        up.connecting = False
        if up.closed or self._closed:
            sock.close()
            return
        sock.setblocking(False)
        up.sock = sock
        up.last = time.monotonic()
        self._write(up)

    def _event(self, up: _Upstream, ev: int) -> None:
        if ev & _READ:
            self._on_read(up)
        if ev & _WRITE and not up.closed:
            self._write(up)

    def _write(self, up: _Upstream) -> None:
        sock = up.sock
        if sock is None or up.closed:
            return
        try:
            while up.out:
                k = sock.send(up.out)
                del up.out[:k]
        except BlockingIOError:
            pass
        except OSError as exc:
            self._fail(up, exc)
            return
        up.last = time.monotonic()
        ev = _READ | (_WRITE if up.out else 0)
        if ev != up.events:
            assert self._loop is not None
            self._loop.watch(sock, ev, lambda e: self._event(up, e))
            up.events = ev

    def _fail(self, up: _Upstream, exc: BaseException, counted: bool = False) -> None:
        """The connection failed: the peer is suspect (with a back-off; ``counted``: the
        client already knows) and every part on it goes on to its next holder."""
        if up.closed:
            return
        self.stats.upstream_failures += 1
        log.info("relay to %s: %s", up.peer.name, exc)
        if not counted:
            up.peer.client.failed(exc)
        items = list(up.inflight)
        self._close(up)  # (its probes are told there)
        for p in items:
            if isinstance(p, _Part) and p.live:
                self._drop(p)

    def _close(self, up: _Upstream) -> None:
        up.closed = True
        if up.watchdog is not None:
            up.watchdog.cancel()
            up.watchdog = None
        for q in up.inflight:
            if isinstance(q, _Query):
                q.event.set()
        up.inflight.clear()
        if up.sink is not None and up.sink.fill is not None:
            up.sink.fill.release()
        _release(up.sinks)
        up.sink, up.sinks = None, []
        if up.sock is not None:
            if self._loop is not None:
                with contextlib.suppress(KeyError, ValueError, OSError):
                    self._loop.unwatch(up.sock)
            up.sock.close()
            up.sock = None
        if self._ups.get(id(up.peer)) is up:
            del self._ups[id(up.peer)]

    # -- receiving replies --------------------------------------------------------------------

    def _on_read(self, up: _Upstream) -> None:
        """Take what the peer sent, as far as it goes now."""
        try:
            while not up.closed and self._step(up):
                pass
        except BlockingIOError:
            return
        except (OSError, ProtocolError) as exc:
            self._fail(up, exc)

    def _step(self, up: _Upstream) -> bool:
        """One step of the reply being received; False when the socket has no more now."""
        if up.phase == _BODY:
            return self._body(up)
        if not self._fill(up):
            return False
        if up.phase == _HEAD:
            if not up.inflight:
                raise ProtocolError("a reply with no request out")
            mtype, length = P.parse_header(up.head, P.HEADER.size + P.DATA_HEAD
                                           + P.MAX_RANGES * P.SLOT_SIZE + 64 * 2**20)
            up.reply = (mtype, length)
            up.head = bytearray()
            if mtype == P.T_DATA and isinstance(up.inflight[0], _Part):
                up.phase, up.want = _DHEAD, P.DATA_HEAD
            elif length > _SMALL:
                raise ProtocolError(f"a frame of {length} bytes where a reply was due")
            else:
                up.phase, up.want = _OTHER, length
            return True
        item = up.inflight[0]
        if up.phase == _OTHER:
            msg = P.decode_payload(up.reply[0], bytes(up.head))
            if isinstance(msg, P.Error):
                raise ConnectionError(errno.ECONNABORTED, f"error {msg.code}: {msg.message}")
            if not isinstance(msg, P.Status) or not isinstance(item, _Query):
                raise ProtocolError(f"unexpected {type(msg).__name__} as a reply")
            up.inflight.popleft()
            up.head = bytearray()
            up.phase, up.want = _HEAD, P.HEADER.size
            up.peer.client.answered()
            item.answered = True
            item.event.set()
            return True
        part = item
        assert isinstance(part, _Part)
        if up.phase == _DHEAD:
            rid, count = P.data_head(up.head, up.reply[1])
            if rid != part.rid or count != len(part.idx):
                raise ProtocolError("a reply that does not match its request")
            up.head = bytearray()
            up.phase, up.want = _TABLE, count * P.SLOT_SIZE
            return True
        # _TABLE
        up.statuses, up.lengths = P.data_slots(up.head, len(part.idx), up.reply[1])
        up.head = bytearray()
        up.phase, up.slot, up.sinks = _BODY, 0, []
        return True

    def _fill(self, up: _Upstream) -> bool:
        """Receive into ``up.head`` until it has ``up.want`` bytes; True when it has."""
        need = up.want - len(up.head)
        if need > 0:
            assert up.sock is not None
            data = up.sock.recv(need)
            if not data:
                if not up.inflight and not up.head:
                    self._close(up)  # closed while idle: not a failure
                    return False
                raise ConnectionError(errno.ECONNRESET, "connection closed by peer")
            up.head += data
            up.last = time.monotonic()
        return len(up.head) >= up.want

    def _body(self, up: _Upstream) -> bool:
        """Receive the current range (into its sink), then go on to the next."""
        part = up.inflight[0]
        assert isinstance(part, _Part)
        while up.slot < len(up.statuses):
            j = up.slot
            if up.statuses[j] != P.OK:
                up.sinks.append(None)
                up.slot += 1
                continue
            sink = up.sink
            if sink is None:
                b = part.batch
                wanted = part.live and not b.finished and not b.resolved[part.idx[j]]
                sink = up.sink = _Sink(up.lengths[j],
                                       Fill(self.pipes, up.lengths[j]) if wanted else None)
            if not self._receive(up, sink):
                return False
            up.sinks.append(None if sink.fill is None else sink.fill.take())
            up.sink = None
            up.slot += 1
        # the whole reply is in
        up.inflight.popleft()
        up.phase, up.want = _HEAD, P.HEADER.size
        chunks, up.sinks = up.sinks, []
        self._answered(part, chunks)
        return True

    def _receive(self, up: _Upstream, s: _Sink) -> bool:
        """Move the range's bytes from the socket into its sink as far as they have come;
        True when all are in."""
        sock = up.sock
        assert sock is not None
        if s.fill is not None:
            done = s.fill.step(sock)
            up.last = time.monotonic()
            return done
        while s.got < s.n:
            k = sock.recv_into(self._scratch, min(s.n - s.got, _SCRATCH))
            if k == 0:
                raise ConnectionError(errno.ECONNRESET, "connection closed by peer")
            s.got += k
            up.last = time.monotonic()
        return True

    # -- lifecycle ----------------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        return self.stats.as_dict()

    def close(self) -> None:
        self._closed = True
        for q in list(self._probes):  # not answered now: the callers go on
            q.event.set()
        for up in list(self._ups.values()):
            self._close(up)
        if self._connector is not None:
            self._connector.shutdown(wait=False, cancel_futures=True)
        if self._workers is not None:
            self._workers.shutdown(wait=False, cancel_futures=True)


_READ, _WRITE = 1, 2  # selectors.EVENT_READ, EVENT_WRITE


def _next(hs: Sequence[RelayPeer], tried: tuple[int, ...], up: dict[int, bool]
          ) -> RelayPeer | None:
    """The first holder not asked yet that is not down (``up``: the answers of ``is_down``
    so far this round)."""
    for h in hs:
        if id(h) in tried:
            continue
        ok = up.get(id(h))
        if ok is None:
            ok = up[id(h)] = not h.is_down()
        if ok:
            return h
    return None


def _release(chunks: Sequence[Chunk | None]) -> None:
    for c in chunks:
        if isinstance(c, Piped):
            c.release()
