"""Peer reads through MPI, for daemons launched as MPI ranks (``stagefs serve --transport mpi``).

Point-to-point, not one-sided (docs/decisions/0012-mpi-transport.md has the figures): a
reader sends the serving rank one request message (tag ``REQ_TAG``) naming a reply tag of
its own and the (shard, offset, length) ranges it wants, with the receive for the reply
already posted, into a buffer of the exact size the reply can have. The serving rank's
thread checks each range against the manifest and against the copies its tiers hold (what
reaches the file system is a shard *index* and a range inside that shard's size, never a
path), fills one buffer with ``os.preadv`` from the tier files, and sends it back in one
message. Over InfiniBand or Slingshot, MPICH and Open MPI move that message by RDMA.

The reply is ``[count, status, length_0 .. length_{count-1}]`` as int64, then the bytes of
the ranges that are given, in order. A length of ``NOT_HELD`` or ``INVALID`` gives no bytes.
A request with no ranges is a ping (a suspect peer is probed with one).

MPICH's progress engine busy-polls: a blocking probe or wait spins a core for as long as it
waits. The serving thread therefore probes without blocking and sleeps between probes, the
sleep doubling up to ``MpiLimits.idle_poll`` (2 ms) while nothing comes: an idle daemon
makes about 500 probes a second, about 2% of one core measured here (a blocking probe: 100%),
and the first request after a quiet spell waits up to 2 ms more. It polls without sleeping
only while its replies are in flight. A reply that comes after its reader gave up is
received by the reader's rank's serving thread and dropped (MPI cannot cancel the send,
which would hold the serving rank's buffer for good); what MPI may still use of requests
given up on is held until MPI completes them (``abandoned_held`` in ``status``). A
reader waits for its reply the same way, within a total deadline: a peer rank that died,
hangs or answers nonsense is ``PeerUnavailable`` (net/client.py), the Store's next holder
answers, and the peer is skipped until a ping in the background finds it answering again.

The ranks of one MPI job are the job's own processes: no job token is exchanged here (the
TCP server, which training processes and their DataLoader workers use, still asks for it).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import threading
import time
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from typing import Any

from stagefs.errors import ClusterError
from stagefs.format import Manifest
from stagefs.net.client import PeerUnavailable
from stagefs.net.health import BACKOFF, PeerHealth
from stagefs.net.server import HeldFiles, Pieces

__all__ = ["INVALID", "NOT_HELD", "REQ_TAG", "MpiLimits", "MpiPeer", "MpiStats",
           "MpiTransport", "mpi_library"]

log = logging.getLogger("stagefs.mpi")

REQ_TAG = 1  # requests; replies carry the tag the reader chose, from _FIRST_TAG up
_FIRST_TAG = 16
NOT_HELD, INVALID = -1, -2  # a reply's length for a range it does not give
_OK, _MALFORMED = 0, 1  # a reply's status
_SCRATCH = 16 * 2**20  # replies of one window up to this size land in a reused buffer
_HOT = 1e-3  # a reader polls MPI without sleeping for this long, then sleeps between polls

Locate = Callable[[int], str | None]


@dataclass(frozen=True, slots=True)
class MpiLimits:
    """What a reader asks for at once and how long it waits; what a server grants."""

    max_ranges: int = 65536  # ranges in one request
    max_reply: int = 64 * 2**20  # bytes of data in one reply
    batch_bytes: int = 4 * 2**20  # data asked for in one request
    window: int = 32  # requests in flight from one read
    timeout: float = 30.0  # a reader's wait for the replies of one window, all of them
    probe_timeout: float = 3.0  # a ping's wait
    send_timeout: float = 30.0  # a reply the reader has not taken by then is abandoned
    idle_poll: float = 2e-3  # longest sleep between two probes of an idle serving thread


@dataclass
class MpiStats:
    requests: int = 0  # replies received
    ranges: int = 0
    bytes: int = 0
    sent: int = 0  # requests sent
    failures: int = 0
    skipped: int = 0  # reads that went straight to the next holder: the peer was suspect
    probes: int = 0

    def as_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass
class MpiServerStats:
    requests: int = 0
    ranges: int = 0
    ranges_not_held: int = 0
    ranges_invalid: int = 0
    malformed: int = 0
    bytes_served: int = 0
    bytes_served_partial: int = 0  # of which from partial copies (the pieces held here)
    abandoned: int = 0  # replies no reader took within send_timeout
    late_replies: int = 0  # replies that came after this rank's reader gave up: dropped
    polls: int = 0  # probes that found no request

    def as_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def mpi_library(why: str) -> Any:
    """mpi4py's ``MPI``, initialised with MPI_THREAD_MULTIPLE (the serving thread and the
    readers call MPI at once), or ClusterError saying what is missing. ``why``: what asked
    for MPI, for the message."""
    try:
        import mpi4py

        mpi4py.rc.thread_level = "multiple"
        from mpi4py import MPI
    except (ImportError, RuntimeError, OSError) as exc:  # no mpi4py, or no libmpi
        raise ClusterError(
            f"{why} but MPI cannot be used: mpi4py or the MPI library it loads (MPICH) is "
            f"missing ({exc}). Install both with: pip install 'stagefs[mpi]'; or serve "
            "peers over TCP (--transport tcp, the default)") from None
    # refused here, before the daemon takes anything (its runtime, port, fabric socket):
    # every rank gets the same level, so every rank stops here
    _check_threads(MPI)
    return MPI


def _check_threads(mpi: Any) -> None:
    got = mpi.Query_thread()
    if got < mpi.THREAD_MULTIPLE:
        names = {mpi.THREAD_SINGLE: "single", mpi.THREAD_FUNNELED: "funneled",
                 mpi.THREAD_SERIALIZED: "serialized"}
        raise ClusterError(
            f"--transport mpi needs MPI_THREAD_MULTIPLE, and this MPI library gave "
            f"MPI_THREAD_{names.get(got, str(got)).upper()} (MPI was initialised before "
            "stagefs asked, or the library is built without thread support: MPICH from "
            "'pip install mpich' has it; Open MPI needs --enable-mpi-thread-multiple). "
            "Or serve peers over TCP (--transport tcp)")


def _check(files: HeldFiles, shard: int, offset: int, length: int, budget: int) -> int:
    """The fd to read a requested range from, or NOT_HELD / INVALID."""
    if not (0 <= shard < len(files.sizes) and offset >= 0 and 0 <= length <= budget
            and offset + length <= files.sizes[shard]):
        return INVALID
    fd = files.fd(shard)
    return NOT_HELD if fd is None else fd


class MpiTransport:
    """This rank's side of the MPI transport: the thread that serves this node's shards to
    the other ranks, and a holder (``peer``) for each of them.

    Made by every rank at the same point (it duplicates ``comm``, a collective), before any
    of them reads. ``locate(shard)``: the path of this node's whole copy, or None;
    ``pieces(shard, offset, length)``: the bytes of a range this node's partial copies hold,
    or None (the TCP server's ``pieces``: a tier too small for the node's share keeps the
    pieces it has room for, and they serve its peers too)."""

    def __init__(self, comm: Any, manifest: Manifest, locate: Locate, *,
                 limits: MpiLimits | None = None, pieces: Pieces | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.mpi = mpi_library("--transport mpi was given")
        _check_threads(self.mpi)
        self.comm = comm.Dup()  # our own tag space, apart from the bootstrap's collectives
        self.rank, self.size = int(self.comm.Get_rank()), int(self.comm.Get_size())
        self.limits = limits or MpiLimits()
        self.clock = clock
        self.stats = MpiServerStats()
        self.files = HeldFiles(manifest, locate)
        self.pieces = pieces
        self._tag_span = int(self.comm.Get_attr(self.mpi.TAG_UB)) - _FIRST_TAG
        self._tags = itertools.count()
        self._tag_lock = threading.Lock()
        self._sending: list[tuple[Any, bytearray, float]] = []  # request, buffer, deadline
        self._free: list[bytearray] = []  # reply buffers to reuse
        # requests given up on that MPI may still use, each with the buffer it may use; the
        # serving thread lets go of them once MPI has completed them (_release)
        self.abandoned: list[tuple[list[Any], bytearray]] = []
        self._held_lock = threading.Lock()
        self.peers: dict[int, MpiPeer] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="stagefs-mpi-serve",
                                        daemon=True)

    def start(self) -> MpiTransport:
        self._thread.start()
        return self

    def peer(self, rank: int, name: str | None = None) -> MpiPeer:
        if not 0 <= rank < self.size or rank == self.rank:
            raise ClusterError(f"no peer rank {rank} (ranks 0..{self.size - 1}, this is "
                               f"{self.rank})")
        got = self.peers.get(rank)
        if got is None:
            got = self.peers[rank] = MpiPeer(self, rank, name or f"node {rank}")
        return got

    def next_tag(self) -> int:
        with self._tag_lock:
            return _FIRST_TAG + next(self._tags) % self._tag_span

    # -- serving -----------------------------------------------------------------------------

    def _serve(self) -> None:
        mpi = self.mpi
        status = mpi.Status()
        wait = 0.0
        try:
            while not self._stop.is_set():
                if self._sending:
                    self._progress()
                if self.abandoned:
                    self._release()
                # any tag: a request, or a reply its reader gave up on (a reader posts its
                # receives before it asks, so no reply it still waits for comes here)
                msg = self.comm.Improbe(mpi.ANY_SOURCE, mpi.ANY_TAG, status)
                if msg is not None:
                    buf = bytearray(status.Get_count(mpi.BYTE))
                    if status.Get_tag() == REQ_TAG:
                        msg.Recv([buf, mpi.BYTE])
                        self._answer(status.Get_source(), buf)
                    else:
                        self._drop_late(msg, buf)
                    wait = 0.0
                elif self._sending:
                    time.sleep(0)  # a reply is in flight: keep MPI progressing it
                else:
                    self.stats.polls += 1
                    wait = min(max(wait * 2, 2e-5), self.limits.idle_poll)
                    self._stop.wait(wait)
        except Exception as exc:  # a broken MPI library: the peers fall back to TCP/origin
            log.error("rank %d: the MPI serving thread stopped: %s", self.rank, exc)
        finally:
            self._drain(min(1.0, self.limits.send_timeout))

    def _drop_late(self, msg: Any, buf: bytearray) -> None:
        """Take a reply whose reader gave up (``MpiPeer._abandon``) off MPI's queue: until
        it is received, MPICH keeps it (a small one in this rank's memory; a large one as
        the serving rank's send, which never completes and cannot be cancelled). Received
        without waiting, the serving rank may be stopped again: released once done."""
        self.stats.late_replies += 1
        self.hold([msg.Irecv([buf, self.mpi.BYTE])], buf)

    def _answer(self, source: int, buf: bytearray) -> None:
        self.stats.requests += 1
        if len(buf) < 16 or len(buf) % 8:
            self.stats.malformed += 1  # no reply tag to answer on
            log.warning("rank %d: a malformed MPI request from rank %d; ignored", self.rank,
                        source)
            return
        req = array("q")
        req.frombytes(buf)
        tag, n = req[0], req[1]
        if not _FIRST_TAG <= tag < _FIRST_TAG + self._tag_span:
            self.stats.malformed += 1
            return
        if not 0 <= n <= self.limits.max_ranges or len(req) != 2 + 3 * n:
            self.stats.malformed += 1
            self._send(source, tag, bytearray(array("q", [0, _MALFORMED]).tobytes()), 16)
            return
        lengths = array("q", bytes(8 * n))
        plan: list[tuple[int, int, int, int]] = []  # slot, fd, offset, length
        part: dict[int, bytes] = {}  # slot -> a range read from a partial copy's pieces
        budget = self.limits.max_reply
        for i in range(n):
            shard, offset, length = req[2 + 3 * i : 5 + 3 * i]
            fd = _check(self.files, shard, offset, length, budget)
            if fd == NOT_HELD and self.pieces is not None and \
                    (held := self.pieces(shard, offset, length)) is not None:
                part[i], fd = held, -1  # (the plan's fd: none, the bytes are here)
                budget -= length
                plan.append((i, fd, offset, length))
                lengths[i] = length
            elif fd >= 0:
                budget -= length
                plan.append((i, fd, offset, length))
                lengths[i] = length
            else:
                lengths[i] = fd
                self.stats.ranges_not_held += fd == NOT_HELD
                self.stats.ranges_invalid += fd == INVALID
        self.stats.ranges += n
        head = 8 * (2 + n)
        out = self._buffer(head + sum(p[3] for p in plan))
        view = memoryview(out)
        pos = head
        for i, fd, offset, length in plan:
            if i in part:
                view[pos : pos + length] = part[i]
                pos += length
                self.stats.bytes_served_partial += length
                continue
            got = os.preadv(fd, [view[pos : pos + length]], offset) if length else 0
            if got != length:  # shorter than the manifest says: not a copy we can give
                dropped = self.files.pop(req[2 + 3 * i])
                if dropped is not None:
                    os.close(dropped)
                lengths[i] = NOT_HELD
                self.stats.ranges_not_held += 1
                continue
            pos += length
        view[:head] = array("q", [n, _OK]).tobytes() + lengths.tobytes()
        self.stats.bytes_served += pos - head
        self._send(source, tag, out, pos)

    def _buffer(self, n: int) -> bytearray:
        for i, b in enumerate(self._free):
            if len(b) >= n:
                return self._free.pop(i)
        return bytearray(max(n, 2**20))

    def _send(self, dest: int, tag: int, buf: bytearray, n: int) -> None:
        req = self.comm.Isend([buf, n, self.mpi.BYTE], dest=dest, tag=tag)
        self._sending.append((req, buf, self.clock() + self.limits.send_timeout))

    def _progress(self) -> None:
        """Take back the buffers of replies sent; give up on the ones no reader takes."""
        now = self.clock()
        keep = []
        for req, buf, deadline in self._sending:
            if req.Test():
                if len(self._free) < 4 and len(buf) <= self.limits.max_reply + 2**20:
                    self._free.append(buf)
            elif now >= deadline:
                # MPI may still read it (MPICH cannot cancel a send): held until the reader's
                # rank drops it as a late reply (_drop_late), off the hot polling path
                self.stats.abandoned += 1
                self.hold([req], buf)
                log.warning("rank %d: a reply was not taken within %g s; abandoned",
                            self.rank, self.limits.send_timeout)
            else:
                keep.append((req, buf, deadline))
        self._sending = keep

    def _drain(self, seconds: float) -> None:
        end = self.clock() + seconds
        while self._sending and self.clock() < end:
            self._progress()
            time.sleep(1e-3)
        for r, b, _ in self._sending:
            self.hold([r], b)
        self._sending = []

    def hold(self, reqs: list[Any], buf: bytearray) -> None:
        """Keep ``buf`` alive while MPI may still use it for ``reqs`` (given up on)."""
        with self._held_lock:
            self.abandoned.append((reqs, buf))

    def _release(self) -> None:
        """Let go of the abandoned requests MPI has completed (taken, received, or
        cancelled), and of their buffers."""
        with self._held_lock:
            self.abandoned = [(reqs, buf) for reqs, buf in self.abandoned
                              if not self.mpi.Request.Testall(reqs)]

    def status(self) -> dict[str, Any]:
        with self._held_lock:
            held = {id(b): len(b) for _, b in self.abandoned}
            requests = sum(len(reqs) for reqs, _ in self.abandoned)
        return {"rank": self.rank, "size": self.size, "server": self.stats.as_dict(),
                "peers": {n: p.stats.as_dict() for n, p in sorted(self.peers.items())},
                "abandoned_held": requests, "abandoned_held_bytes": sum(held.values())}

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        self.files.close()

    def __enter__(self) -> MpiTransport:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


_tls = threading.local()


def _scratch(n: int) -> bytearray:
    """This thread's receive buffer for replies up to ``_SCRATCH`` bytes, reused."""
    if n > _SCRATCH:
        return bytearray(n)
    buf: bytearray | None = getattr(_tls, "buf", None)
    if buf is None or len(buf) < n:
        buf = _tls.buf = bytearray(min(_SCRATCH, max(n, 2**20)))
    return buf


class MpiPeer:
    """Reads from one peer rank through MPI. What ``PeerSource`` (net/client.py) and
    ``HedgedPeer`` (net/hedge.py) use of a ``PeerClient``: ``read``, ``suspect``,
    ``is_down``, ``mark_suspect``, ``stats``, ``close``, ``name``."""

    def __init__(self, transport: MpiTransport, rank: int, name: str,
                 backoff: tuple[float, float] = BACKOFF) -> None:
        self.transport = transport
        self.rank = rank
        self.name = name
        self.stats = MpiStats()
        self.health = PeerHealth(name, self.probe, transport.clock, backoff=backoff,
                                 thread_name=f"stagefs-mpi-probe-{rank}")

    # -- health (net/health.py, as PeerClient's) ------------------------------------------------

    def suspect(self) -> bool:
        return self.health.suspect()

    def is_down(self) -> bool:
        return self.health.suspect()

    def is_suspect(self) -> bool:
        return self.health.is_suspect()

    def mark_suspect(self, why: str) -> None:
        self.health.mark_suspect(why)

    def probe(self) -> bool:
        """A ping within ``probe_timeout``: True if the peer answered (no longer suspect)."""
        self.stats.probes += 1
        try:
            self._exchange([[]], self.transport.limits.probe_timeout, {})
        except PeerUnavailable:
            return False
        self.health.answered()
        return True

    def wait_probe(self, timeout: float | None = None) -> None:
        self.health.wait_probe(timeout)

    def _failed(self, why: str) -> PeerUnavailable:
        self.stats.failures += 1
        self.health.failed(why)
        return PeerUnavailable(f"{self.name} (MPI rank {self.rank}): {why}")

    # -- reading -------------------------------------------------------------------------------

    def read(self, ranges: Sequence[tuple[int, int, int]],
             timeout: float | None = None) -> list[bytes | None]:
        """The bytes of each (shard, offset, length), or None where the peer does not give
        it. Raises PeerUnavailable if the peer cannot answer (or is suspect), or has not
        answered every request of a window within ``timeout`` (default: the limits')."""
        if self.suspect():
            self.stats.skipped += 1
            raise PeerUnavailable(f"{self.name}: suspect after a recent failure; skipped")
        lim = self.transport.limits
        pieces: list[tuple[int, int, int, int]] = []  # index, shard, offset, length
        for i, (s, o, n) in enumerate(ranges):
            if n < 0:
                continue  # no such range: None
            for start in range(0, max(n, 1), lim.max_reply):
                pieces.append((i, s, o + start, min(lim.max_reply, n - start)))
        batches: list[list[tuple[int, int, int, int]]] = [[]]
        size = 0
        for p in pieces:
            if batches[-1] and (size + p[3] > lim.batch_bytes or len(batches[-1]) >= lim.max_ranges):
                batches.append([])
                size = 0
            batches[-1].append(p)
            size += p[3]
        parts: dict[int, list[bytes | None]] = {}
        for w in range(0, len(batches), lim.window):
            self._exchange(batches[w : w + lim.window],
                           lim.timeout if timeout is None else timeout, parts)
        self.health.answered()
        out: list[bytes | None] = [None] * len(ranges)
        for i, chunks in parts.items():
            if all(c is not None for c in chunks):
                out[i] = chunks[0] if len(chunks) == 1 else b"".join(
                    c for c in chunks if c is not None)
        return out

    def _exchange(self, batches: list[list[tuple[int, int, int, int]]], timeout: float,
                  parts: dict[int, list[bytes | None]]) -> None:
        """Post a receive for each batch's reply, send the requests, wait for every reply
        within ``timeout``, and add the pieces to ``parts``."""
        t = self.transport
        mpi, comm = t.mpi, t.comm
        sizes = [8 * (2 + len(b)) + sum(p[3] for p in b) for b in batches]
        buf = _scratch(sum(sizes))
        view = memoryview(buf)
        recvs, sends, tags = [], [], []
        pos = 0
        try:
            for b, n in zip(batches, sizes, strict=True):
                tag = t.next_tag()
                tags.append(tag)
                recvs.append(comm.Irecv([view[pos : pos + n], mpi.BYTE], source=self.rank,
                                        tag=tag))
                pos += n
                msg = array("q", [tag, len(b)])
                for _, s, o, n_ in b:
                    msg.extend((s, o, n_))
                sends.append(comm.Isend([msg, mpi.BYTE], dest=self.rank, tag=REQ_TAG))
            self.stats.sent += len(batches)
            statuses = [mpi.Status() for _ in recvs]
            if not _wait(mpi, recvs + sends, statuses, t.clock, t.clock() + timeout):
                self._abandon(recvs, sends, buf)
                raise self._failed(f"no reply within {timeout:g} s")
        except mpi.Exception as exc:
            self._abandon(recvs, sends, buf)
            raise self._failed(f"MPI error: {exc.Get_error_string()}") from exc
        pos = 0
        for b, n, st in zip(batches, sizes, statuses[: len(recvs)], strict=True):
            self._unpack(b, view[pos : pos + n], st.Get_count(mpi.BYTE), parts)
            pos += n

    def _unpack(self, batch: list[tuple[int, int, int, int]], reply: memoryview, got: int,
                parts: dict[int, list[bytes | None]]) -> None:
        head = 8 * (2 + len(batch))
        vals = reply[:head].cast("q") if got >= head else None
        if vals is None or vals[0] != len(batch) or vals[1] != _OK:
            raise self._failed("a reply that does not match the request")
        pos = head
        for k, (i, _, _, n) in enumerate(batch):
            length = vals[2 + k]
            if length == n:
                parts.setdefault(i, []).append(bytes(reply[pos : pos + n]))
                pos += n
                self.stats.bytes += n
            elif length in (NOT_HELD, INVALID):
                parts.setdefault(i, []).append(None)
            else:
                raise self._failed("a reply that does not match the request")
        if pos != got:
            raise self._failed("a reply that does not match the request")
        self.stats.requests += 1
        self.stats.ranges += len(batch)

    def _abandon(self, recvs: list[Any], sends: list[Any], buf: bytearray) -> None:
        """Cancel the receives that did not complete (a reply that comes after is dropped
        by this rank's serving thread); what MPI may still use (a receive under way, a
        request not yet taken: sends cannot be cancelled) is held until it completes."""
        for r in recvs:
            if r:
                with contextlib.suppress(Exception):
                    r.Cancel()
        pending = [r for r in recvs + sends if r]
        mpi = self.transport.mpi
        if pending and not _wait(mpi, pending, None, self.transport.clock,
                                 self.transport.clock() + 0.1):
            self.transport.hold(pending, buf)  # released once MPI completes them
            if getattr(_tls, "buf", None) is buf:
                _tls.buf = None  # never reuse it

    def close(self) -> None:
        """The transport owns the communicator: nothing to release per peer."""

    def __repr__(self) -> str:
        return f"<MpiPeer {self.name} rank {self.rank}>"


def _wait(mpi: Any, reqs: list[Any], statuses: list[Any] | None,
          clock: Callable[[], float], deadline: float) -> bool:
    """Wait until every request completes (True) or ``deadline`` passes (False), without
    spinning a core for long: polls freely for the first millisecond, then sleeps between
    polls, up to 0.5 ms (a large reply moves while MPI is polled)."""
    start = clock()
    pause = 0.0
    while True:
        if mpi.Request.Testall(reqs, statuses):
            return True
        now = clock()
        if now >= deadline:
            return False
        if now - start < _HOT:
            time.sleep(0)
        else:
            pause = min(max(pause * 2, 2e-5), 5e-4)
            time.sleep(pause)
