"""Relayed bytes kept in the kernel: a range received from a peer's socket into pipes with
``splice`` and sent on from them to a reader's socket with ``splice`` again.

The node daemon relays its readers' ranges of shards it does not hold (net/server.py,
cluster/daemon.py). Received into memory, each relayed byte costs the daemon two copies (the
socket into a bytes object, that object into the reader's socket) besides the reader's own;
held in pipes, the kernel moves references to the socket buffers' pages instead, so a
relayed byte costs what a direct read from the peer costs, plus a few system calls a range.

Each range gets pipes of its own (never shared with another range), so a range that is
dropped (a hedge that lost, a reply the reader no longer waits for) can never put its bytes
in front of another's: its pipes are closed or emptied, whenever that happens. A pool
bounds the pipes a process keeps: past it, or where the kernel refuses a pipe of the size
asked, a range is received into memory as before, and nothing else changes. The bound is
half the user's pipe budget (``/proc/sys/fs/pipe-user-pages-soft``, 64 MiB by default,
counted over all of a user's processes by the pipes' sizes, not their contents), at most
``POOL_BYTES``: past that budget the kernel gives every new pipe of that user, its
DataLoader queues' too, two pages only; the other half leaves room for 500 pipes of the
default size.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import select
import socket
import threading

__all__ = ["PIPE_BYTES", "POOL_BYTES", "Fill", "PipePool", "Piped", "budget", "pipe_descriptors",
           "pool_pipes"]

log = logging.getLogger("stagefs.net")

PIPE_BYTES = 128 * 2**10  # each pipe's capacity: 32 slots, a 110 KB sample in pages
POOL_BYTES = 32 * 2**20  # the most a pool's pipes hold in all (256 ranges in flight)
_F_SETPIPE_SZ = getattr(fcntl, "F_SETPIPE_SZ", 1031)
_MOVE = getattr(os, "SPLICE_F_MOVE", 1)
_NONBLOCK = getattr(os, "SPLICE_F_NONBLOCK", 2)
_UNSUPPORTED = (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP)  # splice refused outright


class _Pipe:
    __slots__ = ("count", "r", "w")

    def __init__(self, r: int, w: int) -> None:
        self.r, self.w, self.count = r, w, 0  # count: bytes in it not sent on yet

    def close(self) -> None:
        for fd in (self.r, self.w):
            with contextlib.suppress(OSError):
                os.close(fd)


class PipePool:
    """At most ``most`` pipes of ``PIPE_BYTES`` each (default: ``budget()``), kept empty
    between uses; shared by the threads of one process (relays take, the event loop gives
    back)."""

    def __init__(self, most: int | None = None) -> None:
        self.most = budget() // PIPE_BYTES if most is None else most
        self._idle: list[_Pipe] = []
        self._made = 0
        self._lock = threading.Lock()
        self.broken = not hasattr(os, "splice")
        self.ranges = 0  # ranges received into pipes
        self.fallbacks = 0  # ranges received into memory (all or part): no pipe to be had

    @property
    def max_fds(self) -> int:
        """The descriptors its pipes may hold at most (two a pipe)."""
        return 2 * _ceiling(self.most)

    def take(self, over: bool = False) -> _Pipe | None:
        """An empty pipe, or None when the pool is spent (``over``: for a range already
        begun, up to half as many again) or the kernel refuses one."""
        with self._lock:
            if self._idle:
                return self._idle.pop()
            if self.broken or self._made >= (_ceiling(self.most) if over else self.most):
                return None
            self._made += 1
        try:
            r, w = os.pipe2(os.O_CLOEXEC)
        except OSError:
            with self._lock:
                self._made -= 1
            return None
        try:
            fcntl.fcntl(w, _F_SETPIPE_SZ, PIPE_BYTES)
        except OSError as exc:  # EPERM past the user's pipe pages: keep to memory
            for fd in (r, w):
                os.close(fd)
            with self._lock:
                self._made -= 1
                if not self.broken:
                    self.broken = True
                    log.info("relayed ranges go through memory: the kernel refuses pipes "
                             "of %d KiB (%s)", PIPE_BYTES // 1024, exc.strerror)
            return None
        return _Pipe(r, w)

    def give(self, p: _Pipe) -> None:
        """A pipe back: kept if empty and room, else closed."""
        if p.count == 0:
            with self._lock:
                if len(self._idle) < self.most:
                    self._idle.append(p)
                    return
        p.close()
        with self._lock:
            self._made -= 1

    def status(self) -> dict[str, int]:
        """Its counters: the pipes it may keep (``most``), those open now (``made``: idle,
        or holding a range in flight) and idle, the ranges received into pipes and those
        that went to memory."""
        with self._lock:
            return {"most": self.most, "made": self._made, "idle": len(self._idle),
                    "ranges": self.ranges, "fallbacks": self.fallbacks}

    def _unsupported(self, exc: OSError) -> None:
        """Splice from a socket failed here: every range goes to memory from now on."""
        with self._lock:
            if self.broken:
                return
            self.broken = True
        log.info("relayed ranges go through memory: splice from a socket fails here (%s)",
                 exc.strerror)

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
            self._made -= len(idle)
        for p in idle:
            p.close()


class Fill:
    """One range of ``n`` bytes being received from a non-blocking socket: into pipes of
    ``pool`` of its own while the pool gives them, else (``pool`` None, spent, or splice
    refused) into memory, from the first byte or from where the pipes ran out."""

    __slots__ = ("got", "mem", "n", "piped", "pool")
    # in memory: the bytes received so far, each as ``recv`` gave it (mostly one: a range
    # that is all in the socket comes in one receive, with no buffer to clear first)

    def __init__(self, pool: PipePool | None, n: int) -> None:
        self.pool = pool
        self.n = n
        self.got = 0
        self.piped: Piped | None = None
        self.mem: list[bytes] | None = None if n else []

    def step(self, sock: socket.socket) -> bool:
        """Move what has come, as far as the socket has it now; True once all ``n`` bytes
        are in. Raises BlockingIOError when the socket has no more now, ConnectionError
        when the peer closed it, OSError when it fails."""
        fd = sock.fileno()
        while self.got < self.n:
            left = self.n - self.got
            if self.mem is not None:
                data = sock.recv(left)
                k = len(data)
                self.mem.append(data)
            else:
                k = self._splice(fd, left)
                if k < 0:
                    continue  # another pipe, or memory from here on
            if k == 0:
                raise ConnectionError(errno.ECONNRESET, "connection closed by peer")
            self.got += k
        return True

    def _splice(self, fd: int, left: int) -> int:
        pool = self.pool
        if self.piped is None:
            first = None if pool is None else pool.take()
            if first is None:
                self._to_memory()
                return -1
            assert pool is not None
            self.piped = Piped(pool, [first])
        assert pool is not None
        pipe = self.piped.pipes[-1]
        for tries in (1, 2):
            try:
                k = os.splice(fd, pipe.w, left, flags=_MOVE | _NONBLOCK)
                break
            except BlockingIOError:
                # nothing moved: no data yet, or this pipe is full. Data that came just
                # after the refusal is moved by a second try; refused again with data
                # waiting, the pipe is full
                if not _readable(fd):
                    raise
                if tries == 1:
                    continue
                nxt = pool.take(over=True)
                if nxt is None:  # no pipe to be had: the rest of this range in memory
                    self._to_memory()
                else:
                    self.piped.pipes.append(nxt)
                return -1
            except OSError as exc:
                if self.got or exc.errno not in _UNSUPPORTED:
                    raise
                pool._unsupported(exc)  # this socket cannot be spliced: memory
                self._to_memory()
                return -1
        if k > 0:
            pipe.count += k
        return k

    def _to_memory(self) -> None:
        if self.pool is not None:
            self.pool.fallbacks += 1
        self.mem = []
        if self.piped is not None:
            self.mem.append(self.piped.to_bytes())
            self.piped = None

    def take(self) -> Piped | bytes:
        """The range, once ``step`` said it is all in."""
        if self.piped is not None:
            self.piped.size = self.n
            self.piped.pool.ranges += 1
            return self.piped
        assert self.mem is not None
        return self.mem[0] if len(self.mem) == 1 else b"".join(self.mem)

    def release(self) -> None:
        """Dropped: its pipes go back (the bytes in them with them)."""
        if self.piped is not None:
            self.piped.release()
            self.piped = None


class Piped:
    """One range's bytes, in pipes of its own, in order; ``len()`` is its size. ``send``
    moves them on to a socket; ``release`` gives the pipes back (the bytes not sent are
    dropped with them)."""

    __slots__ = ("pipes", "pool", "size")

    def __init__(self, pool: PipePool, pipes: list[_Pipe]) -> None:
        self.pool, self.pipes, self.size = pool, pipes, 0

    def __len__(self) -> int:
        return self.size

    def send(self, out: int) -> bool:
        """Move what is left on to ``out`` (a non-blocking socket) as far as it takes now;
        True when all of it is out. Raises OSError if the socket fails."""
        while self.pipes:
            p = self.pipes[0]
            while p.count:
                try:
                    k = os.splice(p.r, out, p.count, flags=_MOVE | _NONBLOCK)
                except BlockingIOError:
                    return False
                if k <= 0:
                    raise OSError(errno.EPIPE, "relay pipe ended early")
                p.count -= k
            self.pool.give(self.pipes.pop(0))
        return True

    def to_bytes(self) -> bytes:
        """The bytes themselves (read out of the pipes, which go back)."""
        parts = []
        for p in self.pipes:
            while p.count:
                b = os.read(p.r, p.count)
                if not b:
                    raise OSError(errno.EPIPE, "relay pipe ended early")
                parts.append(b)
                p.count -= len(b)
        self.release()
        return b"".join(parts)

    def release(self) -> None:
        pipes, self.pipes = self.pipes, []
        for p in pipes:
            self.pool.give(p)

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.release()


def budget(soft_file: str = "/proc/sys/fs/pipe-user-pages-soft") -> int:
    """Bytes of pipes a pool may keep: half the user's soft budget (0 there: no budget), at
    most ``POOL_BYTES``."""
    try:
        with open(soft_file) as f:
            pages = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        pages = 0
    if pages <= 0:
        return POOL_BYTES
    return min(POOL_BYTES, pages * 4096 // 2)


def pool_pipes(fd_limit: int) -> int:
    """The pipes a daemon's pool may keep under ``fd_limit`` open descriptors: as the pipe
    budget allows (``budget()``), and no more than a sixteenth of the descriptors (two a
    pipe, half as many again for a range begun: under a fifth of them), so that a node whose
    limit is 1024 still has room for its connections."""
    return min(budget() // PIPE_BYTES, fd_limit // 16)


def pipe_descriptors(fd_limit: int) -> int:
    """The descriptors the pool of a process whose limit is ``fd_limit`` may hold."""
    return 2 * _ceiling(pool_pipes(fd_limit))


def _ceiling(most: int) -> int:
    """The pipes a pool of ``most`` may make in all: half as many again for ranges begun."""
    return most * 3 // 2


def _readable(fd: int, timeout: float = 0.0) -> bool:
    """``fd`` has data to read (within ``timeout`` seconds)."""
    poll = select.poll()
    poll.register(fd, select.POLLIN)
    return bool(poll.poll(max(0, int(timeout * 1000 + 0.999)) if timeout > 0 else 0))
