"""``stagefs mount``: a read-only FUSE file system over a Store (libfuse 3 through mfusepy).

Multithreaded; the kernel keeps file data (``kernel_cache``) and attributes, names and
missing names (``attr_timeout``, ``entry_timeout``, ``negative_timeout``) cached for as
long as the mount lives, since a dataset never changes under a job. Mounted read-only
(``-o ro``), so the kernel answers every write, create, rename and delete with EROFS itself.

Reads use the same readers as ``Store.open`` (small files read whole and verified, large
ones by range, each range verified by the pieces that cover it); reads of different files
run in parallel. With tiers, the store's cold pipeline (tiers/stream.py) serves a cold
mount as it serves the API: the first read of a shard queues it for streaming, so the
shard's other files arrive in large sequential reads before they are asked for (read-ahead
in shard order across files), and a file is read from the origin once; each file a stream
brings is pushed into the kernel's page cache (``Pusher``), so a later read of it asks this
process nothing. The kernel may keep
up to ``MAX_BACKGROUND`` reads in flight (its read-ahead of several files at once) and read
``MAX_READ`` bytes per request, read-ahead included where the server may raise the mount's
window (root; see ``raise_readahead``).

A listing answers READDIRPLUS with every entry's attributes, so a program that lists its
dataset (an ImageFolder, ``os.walk``) then opens and stats each file with no LOOKUP: cold,
a file costs this process one READ. Warm, nothing reaches this process but the ``isatty``
ioctl of each buffered ``open()`` (Python < 3.14), which the kernel always forwards and
libfuse answers in C.

A file read whole (up to 4 MiB, or compressed) is read once for all the READs the kernel
sends for it at once, and counted once (``Whole``). Errors (``Failures``): a name not in
the dataset is ENOENT (ENOTDIR, ELOOP: the namespace's own errno); a read of damaged or
unavailable data is EIO whatever the stagefs error (a shard truncated, another pack's,
missing from the pack, bytes that fail their checksum, an origin gone), as under
``stagefs run``; no error reaches the binding, which answers one without an errno with
EINVAL and logs its traceback. The reason, the error's own message, goes to the log once
per shard, on one line. A detached server (``mount_background``) logs to a
``stagefs-mount-*.log`` in the temp directory: removed when the server ends if it is
empty, kept if anything was logged (warnings and errors, at the default level), and then
``unmount`` (``stagefs umount``) names it and shows its first lines.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import hashlib
import itertools
import logging
import os
import queue
import stat as st
import struct
import subprocess
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import Any

from stagefs._sysinfo import memory_available
from stagefs.config import env_flag
from stagefs.errors import ConfigError, PathError, StagefsError
from stagefs.format import MANIFEST_NAME
from stagefs.runtime import job_id

__all__ = ["CACHE_TIMEOUT", "check_mountpoint", "fuse_available", "is_mounted", "mount", "unmount"]

log = logging.getLogger("stagefs.fuse")

CACHE_TIMEOUT = 86400.0  # seconds: the dataset is immutable for the life of the mount
# fuse_main's return codes (libfuse 3, lib/helper.c)
_FUSE_MAIN_ERRORS = {
    1: "invalid options", 2: "no mount point given", 3: "fuse_new failed",
    4: "the kernel refused the mount (is /dev/fuse usable? are you allowed to mount?)",
    5: "could not daemonise", 6: "could not set signal handlers", 7: "bad loop configuration",
}
_CAP_EXPORT_SUPPORT = 1 << 4  # libfuse 3 FUSE_CAP_* bits
_CAP_NO_OPEN_SUPPORT = 1 << 17
_CAP_CACHE_SYMLINKS = 1 << 23
MAX_READ = 1 << 20  # bytes per read request (the kernel's default is 128 KiB)
MAX_BACKGROUND = 64  # read requests (read-ahead) the kernel keeps in flight (default 12)
_RECENT_FILES = 64  # files read whole kept while the kernel reads them (Whole)
# bytes of them kept: a compressed file of any size is read whole (its stored bytes are not
# its content), and 64 of them kept held 64 files' worth (826 MB for 24 arrays of 32 MB)
_RECENT_BYTES = 256 << 20
# and files the kernel has not asked for whole yet are kept among this many times as many
_UNASKED_SHARE = 4
_PAGE = 4096  # what Whole tracks the READs of a file by
# large files whose reads are followed (Pieces: the program's passes, the last pieces read),
# and the bytes of pieces kept across them (16 files' worth): 16 files followed, 24 read at
# once (xargs -P 24 md5sum, DataLoader workers) read each piece 1.5-4 times and counted a
# file up to 4 samples
_OPEN_READERS = 256
_PIECES_HELD = 16 * (8 << 20)
# bytes of pieces kept per large file (at least two pieces): the kernel's READs of it come
# unaligned and out of order, up to a few MiB apart (4 MiB kept still read pieces again)
_PIECES_KEPT = 8 << 20
FUSE_IDLE_THREADS = 10  # libfuse's worker threads kept waiting for requests


def _binding() -> Any:
    try:
        import mfusepy
    except ImportError as exc:
        raise ConfigError(
            "stagefs mount needs the FUSE extra: pip install 'stagefs[fuse]' "
            f"(and libfuse 3: apt-get install fuse3) ({exc})"
        ) from None
    except OSError as exc:  # the binding loads libfuse at import
        raise ConfigError(f"libfuse could not be loaded ({exc}): apt-get install fuse3") from None
    return mfusepy


def fuse_available() -> str | None:
    """None if a mount can work here, else the reason it cannot."""
    instead = ("use 'stagefs run --dataset D --at PATH -- CMD' (no FUSE, no root) or the "
               "Python API instead")
    if not os.path.exists("/dev/fuse"):
        return f"/dev/fuse is missing (FUSE is not available on this machine): {instead}"
    try:  # libfuse opens it itself and gives up when it cannot (no fusermount3 fallback)
        os.close(os.open("/dev/fuse", os.O_RDWR | os.O_CLOEXEC))
    except OSError as exc:
        return (f"/dev/fuse cannot be opened by this user ({exc.strerror}): 'stagefs mount' "
                f"cannot work on this node; {instead}")
    try:
        _binding()
    except ConfigError as exc:
        return str(exc)
    return None


def is_mounted(mountpoint: str) -> bool:
    """Whether a file system is mounted exactly at ``mountpoint`` (per /proc/self/mountinfo)."""
    target = os.path.realpath(mountpoint)
    try:
        return _mount_at(target) is not None
    except OSError:
        return os.path.ismount(target)


_FSTYPE = "fuse.stagefs"  # what /proc/self/mountinfo calls a stagefs mount (its subtype)


def _unescape(field: bytes) -> bytes:
    """A path as /proc/self/mountinfo writes it, with its octal escapes (``\\040`` for a
    space, ``\\012`` for a newline, ``\\134`` for a backslash) undone; bytes, since a
    name need not be ASCII (decoding it as one made a mount point named ``données`` never
    mounted: ``stagefs mount`` waited 60 s and killed a server that was serving)."""
    if b"\\" not in field:
        return field
    out = bytearray()
    i = 0
    while i < len(field):
        c = field[i : i + 4]
        if len(c) == 4 and c[:1] == b"\\" and all(48 <= d <= 55 for d in c[1:]):
            out.append(int(c[1:], 8))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return bytes(out)


def _mounts() -> Iterator[tuple[bytes, str, str, str]]:
    """Every mount, per /proc/self/mountinfo, which asks no file system, in mount order:
    its mount point, its ``major:minor`` (its BDI's name in /sys/class/bdi), its type
    (``fuse.stagefs`` for a stagefs mount) and its source."""
    with open("/proc/self/mountinfo", "rb") as f:
        for line in f:
            fields = line.rstrip(b"\n").split(b" ")
            rest = fields[fields.index(b"-", 6) + 1 :] if b"-" in fields[6:] else []
            fstype = rest[0].decode(errors="replace") if rest else ""
            source = os.fsdecode(_unescape(rest[1])) if len(rest) > 1 else ""
            yield _unescape(fields[4]), fields[2].decode(), fstype, source


def _mount_at(mountpoint: str) -> tuple[str, str, str] | None:
    """The file system mounted at ``mountpoint`` (the topmost): its ``major:minor``, its
    type and its source (``_mounts``); or None."""
    want = os.fsencode(mountpoint)
    found = None
    for at, dev, fstype, source in _mounts():
        if at == want:
            found = (dev, fstype, source)
    return found


def _mounts_under(mountpoint: str) -> list[str]:
    """The mount points inside ``mountpoint`` (which keep it busy: ``umount`` of it fails
    while one is there, whatever no program uses it)."""
    inside = os.fsencode(mountpoint.rstrip("/") + "/")
    try:
        return [os.fsdecode(at) for at, *_ in _mounts() if at.startswith(inside)]
    except OSError:
        return []


def _mount_device(mountpoint: str) -> str | None:
    """The ``major:minor`` of the file system mounted at ``mountpoint`` (the topmost, and
    its BDI's name in /sys/class/bdi), or None."""
    at = _mount_at(mountpoint)
    return at[0] if at else None


def raise_readahead(mountpoint: str, kib: int = MAX_READ >> 10) -> int | None:
    """Let the kernel read ahead ``kib`` KiB in one request on this mount; the new window,
    or None where this process may not set it (it needs root).

    The kernel caps a FUSE mount's read-ahead at its BDI's ``read_ahead_kb`` (128 KiB by
    default), whatever ``max_readahead`` the server asks for; a cold read of a larger file
    then costs one request to this server per 128 KiB, one after another.
    """
    knob = "/proc/self/mountinfo"
    try:
        dev = _mount_device(mountpoint)
        if dev is None:
            return None
        knob = f"/sys/class/bdi/{dev}/read_ahead_kb"
        with open(knob, "r+") as f:
            if int(f.read()) < kib:
                f.seek(0)
                f.write(str(kib))
        with open(knob) as f:
            return int(f.read())
    except (OSError, ValueError) as exc:
        log.debug("read-ahead of %s left as it is (%s: %s)", mountpoint, knob, exc)
        return None


PUSH_SHARE = 0.5  # of the memory available at mount (within the job's cgroup limit)


class _FileHandle(ctypes.Structure):
    _fields_ = [("handle_bytes", ctypes.c_uint), ("handle_type", ctypes.c_int),
                ("f_handle", ctypes.c_ubyte * 64)]


class _Buf(ctypes.Structure):  # libfuse 3's struct fuse_buf (and room for 3.17's mem_size)
    _fields_ = [("size", ctypes.c_size_t), ("flags", ctypes.c_int), ("mem", ctypes.c_void_p),
                ("fd", ctypes.c_int), ("pos", ctypes.c_int64), ("mem_size", ctypes.c_size_t)]


class _BufVec(ctypes.Structure):  # struct fuse_bufvec with one buffer
    _fields_ = [("count", ctypes.c_size_t), ("idx", ctypes.c_size_t), ("off", ctypes.c_size_t),
                ("buf", _Buf * 1)]


@functools.cache
def _libc() -> Any:
    return ctypes.CDLL(None, use_errno=True)


def _node_id(path: str) -> int:
    """The kernel's node id of a file on a FUSE mount (what libfuse's high-level API numbers
    it by, not its ``st_ino``), from its file handle: the kernel encodes a FUSE file as the
    node id's two halves and the generation (fs/fuse/inode.c, ``fuse_encode_fh``)."""
    libc = _libc()
    h = _FileHandle()
    h.handle_bytes = ctypes.sizeof(h.f_handle)
    mount_id = ctypes.c_int()
    if libc.name_to_handle_at(-100, os.fsencode(path), ctypes.byref(h),  # AT_FDCWD
                              ctypes.byref(mount_id), 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), path)
    if h.handle_bytes < 8:
        raise OSError(errno.EOPNOTSUPP, "not a FUSE file handle", path)
    hi, lo = struct.unpack_from("=II", bytes(h.f_handle[:8]))
    return int(hi) << 32 | int(lo)


class Served:
    """Which small files this mount has handed the kernel, so that each delivery is counted
    once (``Store.count_delivered`` for a push, the Store's own count for a READ) and none is
    pushed after a program read it: per manifest entry, 0 (neither), 1 (being pushed), 3
    (pushed), 2 (read through a READ).

    A READ while its file is being pushed is the program's read of it (the kernel asked
    before the push landed): the push counts it. A READ of a file pushed before asks for
    pages the kernel let go of since, which the program read (a later epoch) or had not
    read yet (memory short: the push budget keeps that rare): counted, as a new read.
    Counted only as pushed, a later epoch's reads of the files pushed in the first were
    never counted (0% hit rate for a mount that read 14% from its tiers)."""

    def __init__(self, entries: int) -> None:
        self._state = bytearray(entries)
        self._lock = threading.Lock()

    def claim(self, e: int) -> bool:
        """For a push: whether nobody pushed or read it yet (now it is the pusher's)."""
        with self._lock:
            if self._state[e]:
                return False
            self._state[e] = 1
            return True

    def unclaim(self, e: int) -> None:
        """The push failed: a READ of it will be counted."""
        with self._lock:
            if self._state[e] == 1:
                self._state[e] = 0

    def pushed(self, e: int) -> None:
        """The push landed: a READ from now on is a new read (its pages were let go of)."""
        with self._lock:
            if self._state[e] == 1:
                self._state[e] = 3

    def read_before(self, e: int) -> bool:
        """Whether a READ of file ``e`` was served (and counted) before."""
        with self._lock:
            return self._state[e] == 2

    def read(self, e: int) -> bool:
        """For a READ: whether to count it (not while its push, which counts it, is under
        way)."""
        with self._lock:
            pushing = self._state[e] == 1
            self._state[e] = 2
            return not pushing


class Pusher:
    """Read-ahead across files into the kernel's page cache.

    The cold pipeline streams a shard's files before any reader asks for them (tiers/
    stream.py) and checks each against its checksum as it streams; the files a stream has
    placed are queued here with the checked bytes it read, and handed to the kernel with
    ``fuse_lowlevel_notify_store``, which puts them in each file's page cache. A program's
    later ``open()`` + ``read()`` of one is a warm read: no READ reaches this process,
    whose round trip through Python costs more than the read itself.

    Only raw files (a compressed file's stored bytes are not its content) up to
    ``WHOLE_READ_LIMIT``, only files the kernel knows (a listed directory's, or found by
    path: looking up the handle makes the kernel know it), and at most ``budget`` bytes a
    mount (``push_budget``: ``PUSH_SHARE`` of the memory available at mount, within the
    job's control-group limit, less what its memory tiers will still take: the page cache
    is the kernel's to evict, and a dataset larger than memory is not pushed whole). A
    backlog over ``BACKLOG`` bytes, or over what the budget has left to push (the kernel
    slower than the streams), is dropped, not kept: the streams' reads it holds are this
    process's memory until pushed, and past the budget would never be pushed (under a job's
    memory limit, a budget of 100 MB still let 256 MB of them wait here).
    ``STAGEFS_FUSE_PUSH=0`` turns it off. A kernel that refuses (no file handles on this
    mount, no notify) turns it off for the mount with one log line; a file the kernel has
    forgotten meanwhile is skipped.
    """

    BACKLOG = 256 * 2**20

    def __init__(self, store: Any, mountpoint: str, notify: Any, session: int,
                 budget: int, served: Served) -> None:
        from stagefs.fileobj import WHOLE_READ_LIMIT

        self.store, self.mountpoint, self.served = store, mountpoint, served
        self._notify, self._session = notify, ctypes.c_void_p(session)
        self.budget, self.limit = budget, WHOLE_READ_LIMIT
        self.files = self.bytes = self.skipped = 0
        self.off: str | None = None  # why pushing stopped, if it did
        self._queued = 0  # bytes waiting in the queue
        self._lock = threading.Lock()
        self._q: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._t = threading.Thread(target=self._run, name="stagefs-fuse-push", daemon=True)
        self._t.start()

    def arrived(self, entries: Any, runs: list[tuple[int, bytes]]) -> None:
        """A stream's listener (``Stream.arrived``): queue them, return at once."""
        size = sum(len(r[1]) for r in runs)
        with self._lock:
            if self.off is not None or \
                    self._queued + size > min(self.BACKLOG, self.budget - self.bytes):
                self.skipped += len(entries)
                return
            self._queued += size
        self._q.put((entries, runs, size))

    def close(self) -> None:
        """Stop (at unmount, before libfuse frees the session the pushes name)."""
        with self._lock:
            why, self.off = self.off, self.off or "unmounted"
        self._q.put(None)
        self._t.join(10)
        log.info("pushed %d files (%d bytes) into the page cache, skipped %d%s", self.files,
                 self.bytes, self.skipped, f"; stopped: {why}" if why else "")

    def _run(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                return
            entries, runs, size = item
            try:
                for e in entries.tolist():
                    if self.off is not None:
                        break
                    self._push(e, runs)
            except Exception as exc:  # never take the mount down: stop pushing
                self._stop(f"{type(exc).__name__}: {exc}")
            finally:
                with self._lock:
                    self._queued -= size

    def _stop(self, why: str) -> None:
        self.off = why
        log.info("streamed files are no longer pushed into the page cache: %s", why)

    def _push(self, e: int, runs: list[tuple[int, bytes]]) -> None:
        m = self.store.manifest
        size, off = int(m.size[e]), int(m.offset[e])
        if size > self.limit or not size or m.codec[e] or int(m.stored[e]) != size:
            return  # large, empty, or compressed (its stored bytes are not its content)
        if self.bytes + size > self.budget:
            self._stop(f"{self.bytes} bytes pushed, the budget of this mount")
            return
        keep: bytes | None = None  # the buffer the kernel copies from, alive until it has
        addr = 0
        for at, data in runs:
            if at <= off and off + size <= at + len(data):
                keep = data
                addr = ctypes.cast(ctypes.c_char_p(data), ctypes.c_void_p).value or 0
                addr += off - at
                break
        else:  # across two reads of the stream
            keep = b"".join(memoryview(d)[max(0, off - at) : max(0, off + size - at)]
                            for at, d in runs if at < off + size and off < at + len(d))
            if len(keep) != size:
                return
            addr = ctypes.cast(ctypes.c_char_p(keep), ctypes.c_void_p).value or 0
        if not self.served.claim(e):
            return  # a program read it already (it waited for the stream)
        rel = os.fsdecode(m.path_of(e))
        r = 0
        try:
            node = _node_id(os.path.join(self.mountpoint, rel))
            vec = _BufVec(1, 0, 0)
            vec.buf[0].size, vec.buf[0].mem, vec.buf[0].fd = size, addr, -1
            r = self._notify(self._session, node, 0, ctypes.byref(vec), 0)  # copies `keep`
        except OSError as exc:
            r = -(exc.errno or errno.EIO)
            if exc.errno not in (errno.ENOENT, errno.ESTALE):
                self._stop(f"no file handle for {rel}: {exc.strerror}")
        finally:
            if r < 0:
                self.served.unclaim(e)
        if r == -errno.ENOENT or r == -errno.ESTALE:  # the kernel let go of the inode
            with self._lock:
                self.skipped += 1
        elif r < 0:
            if self.off is None:
                self._stop(f"the kernel refused to store {rel}: {os.strerror(-r)}")
        else:
            self.files += 1
            self.bytes += size
            self.store.count_delivered(size)
            self.served.pushed(e)


def push_budget(store: Any) -> int:
    """The bytes a mount pushes at most: ``PUSH_SHARE`` of the memory available at mount,
    less what the store's memory tiers will still take of this dataset (their pages are
    memory too, charged to the same job: a budget taken before they filled had the kernel
    evict pushed pages, whose files were then read and counted again)."""
    from stagefs.tiers.tier import dir_bytes

    left = int(store.manifest.arrays["stored"].sum())
    coming = 0
    for t in getattr(store.chain, "tiers", ()):
        if t.kind != "memory":
            continue
        if t.capacity is not None:
            room = t.capacity - t.used_bytes()
        else:
            try:
                v = os.statvfs(t.root)
            except OSError:
                continue
            room = v.f_bavail * v.f_frsize
        coming += max(0, min(room, left - dir_bytes(t.dir)))
    return int(max(0, memory_available() - coming) * PUSH_SHARE)


def _pusher(store: Any, mountpoint: str, served: Served) -> Pusher | None:
    """A Pusher for this mount, once the session runs (called in INIT); None where pushing
    is off, the store has no cold pipeline, or libfuse lacks the call."""
    chain = getattr(store, "chain", None)
    if not env_flag("FUSE_PUSH") or chain is None:
        return None
    lib = _binding()._libfuse
    try:
        get_session, notify = lib.fuse_get_session, lib.fuse_lowlevel_notify_store
    except AttributeError:
        return None
    get_session.restype, get_session.argtypes = ctypes.c_void_p, [ctypes.c_void_p]
    notify.restype = ctypes.c_int
    notify.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_int64, ctypes.c_void_p,
                       ctypes.c_int]
    ctx = lib.fuse_get_context()
    if not ctx or not ctx.contents.fuse:
        return None
    session = get_session(ctypes.c_void_p(ctx.contents.fuse))
    if not session:
        return None
    p = Pusher(store, mountpoint, notify, session, push_budget(store), served)
    chain.stream.arrived = p.arrived
    return p


class Whole:
    """The small (and compressed) files the kernel is reading: each read whole and verified
    once, kept for its other READs (the kernel asks for a file in requests of at most
    ``MAX_READ``, several at once), the last ``keep`` of them.

    A file's first READ reads it; its other READs meanwhile (the kernel's read-ahead asks
    for the file's second MiB before the first is answered) wait for that read, and are
    not counted: one sample, whichever of them came first. Then a READ from the start of a
    file kept (its pages let go of: the program's next epoch) is a new read of it, a sample
    from this process's memory; the READ from the start that the first read served is not
    (it may come second, after a READ further on started the read). Before, each READ
    that found the file not kept yet read and counted it: a cold read of a file of 1-4 MiB
    was two samples and twice its bytes.

    At most ``keep`` files and ``keep_bytes`` bytes are kept, but always the file read
    last: a compressed file is read whole whatever its size, and a byte bound keeps a
    dataset of large compressed arrays from holding 64 of them in this process (the one
    being read stays, or each of its READs would read it whole again). The ``keep``
    files let go of are the oldest the kernel has asked for whole since they were read;
    one it has not (its READs come over time: a program reading it in pieces, read-ahead
    answered late by a busy server) stays while it is among the last ``keep * 4`` files
    and within ``keep_bytes``. Let go of by count alone, a file of 1-4 MiB whose last READ
    came after other readers' 64 files was read whole again, from the origin when no tier
    held it, and counted as a second sample.

    A file read before through a READ, let go of here, that a READ further into it asks
    for again (the program reading it slowly while others read 64 files, or the kernel
    letting go of its pages mid-read) is read whole again: its bytes are counted, not a
    sample (the program's read of it was counted at its start). Counted as a sample, a
    warm epoch said more samples than files read, and the program's next pass from the
    start, finding the file kept with no READ from its start, was not counted at all. A
    READ from the start that comes while such a file is kept counts the sample then (the
    next pass, or the same pass's first READ, come after the one further in)."""

    def __init__(self, store: Any, served: Served, keep: int = _RECENT_FILES,
                 keep_bytes: int = _RECENT_BYTES) -> None:
        self.store, self.served, self.keep, self.keep_bytes = store, served, keep, keep_bytes
        self._files: dict[int, _Kept] = {}  # most recent last
        self._bytes = 0  # of the files kept that were read
        self._lock = threading.Lock()

    def _trim(self) -> None:
        """Drop the oldest files read (not one being read, not the last one; first those
        the kernel has asked for whole) while more than ``keep`` files or ``keep_bytes``
        bytes are kept; under the lock."""
        while len(self._files) > 1 and (len(self._files) > self.keep
                                        or self._bytes > self.keep_bytes):
            done = [x for x, v in itertools.islice(self._files.items(), len(self._files) - 1)
                    if v.data.done()]
            old = next((x for x in done if self._files[x].asked_whole()), None)
            if old is None and (self._bytes > self.keep_bytes
                                or len(self._files) > self.keep * _UNASKED_SHARE):
                old = done[0] if done else None
            if old is None:
                break
            self._bytes -= self._files.pop(old).size

    def read(self, e: int, path: str, offset: int, size: int) -> bytes:
        """File ``e``'s bytes for a READ of ``size`` bytes at ``offset``."""
        start = offset == 0
        with self._lock:
            k = self._files.pop(e, None)
            mine = k is None
            if k is None:
                k = _Kept()
            again = start and k.started  # a read from the start served before
            owed = start and k.owed and not again  # read again further in, not counted
            if again:
                k.asked = 0  # the program's next pass: kept until it has asked for all
            k.started |= start
            k.owed &= not start
            # read again from further in: the bytes, not a sample (see above)
            sample = 0 if mine and not start and self.served.read_before(e) else None
            k.owed |= sample == 0
            k.ask(offset, size)
            self._files[e] = k
            self._trim()
        if not mine:
            kept = k.data.result()  # another READ's read of it, or its error
            if again:
                self.store.count_kept(len(kept), stored=int(self.store.manifest.stored[e]))
            elif owed:  # its bytes were counted when it was read again
                self.store.count_kept(0, stored=0)
            return kept
        try:
            data: bytes = self.store.read_entry(e, path, count=self.served.read(e),
                                                sample=sample)
        except BaseException as exc:
            with self._lock:
                if self._files.get(e) is k:  # the next READ tries again
                    del self._files[e]
            k.data.set_exception(exc)
            raise
        with self._lock:
            if self._files.get(e) is k:
                k.size = len(data)
                self._bytes += k.size
        k.data.set_result(data)
        with self._lock:
            self._trim()
        return data


class Pieces:
    """A large raw file's verified pieces, the last ``keep`` bytes of them read, for the kernel's READs of
    it: each piece is read (and verified, and counted) once for all the READs that want it
    while it is kept, however they come: unaligned to pieces, out of order, at once (the
    kernel keeps up to ``MAX_BACKGROUND`` READs of read-ahead in flight, answered by
    several threads). A READ that wants a piece being read waits for that read.

    Before, one file object served a file's READs one at a time, keeping only the span of
    its last read: a READ behind it read and counted its pieces again (``sha256sum`` of a
    70 MiB file counted 73 MiB read: ``stagefs status`` said more than was read).

    A READ from the start of the file after one before it begins the program's next pass
    (the kernel let go of the pages, or the program reads with O_DIRECT): a piece still
    kept is counted again, once in the pass, as this process's memory's (as ``Whole``
    counts a file kept); not counted, a file of up to 8 MiB read again was not counted at
    all."""

    def __init__(self, store: Any, e: int, path: str, keep: int = _PIECES_KEPT) -> None:
        self.store, self.e, self.path = store, e, path
        self.size = int(store.manifest.size[e])
        self.piece = int(store.manifest.piece_size)
        self.keep = max(2, keep // self.piece)
        self._pieces: dict[int, Future[bytes]] = {}  # most recent last
        self._lock = threading.Lock()
        self._pass = 0  # the program's passes over the file: a READ from its start begins one
        self._started = False  # a READ from the start of the file came
        self._counted: dict[int, int] = {}  # piece kept -> the pass it was counted in

    def read(self, offset: int, size: int) -> bytes:
        if offset == 0:
            with self._lock:
                self._pass += self._started
                self._started = True
        end = min(self.size, offset + size)
        parts = []
        pos = offset
        while pos < end:
            k = pos // self.piece
            data = self._get(k)
            rel = pos - k * self.piece
            part = data[rel : rel + end - pos]
            if not part:
                break
            parts.append(part)
            pos += len(part)
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def held(self) -> int:
        """The bytes of the pieces kept that were read."""
        with self._lock:
            return self.piece * sum(1 for f in self._pieces.values() if f.done())

    def shed(self, nbytes: int) -> int:
        """Let go of the oldest pieces read (not one being read, not the one read last: the
        kernel's next READ of the file may start inside it, and found it gone it read it
        again, a piece 0 counted as a second sample) until ``nbytes`` bytes of them are gone
        or none is left; the bytes let go of."""
        gone = 0
        with self._lock:
            for k in [k for k, f in list(self._pieces.items())[:-1] if f.done()]:
                if gone >= nbytes:
                    break
                del self._pieces[k]
                self._counted.pop(k, None)
                gone += self.piece
        return gone

    def _get(self, k: int) -> bytes:
        with self._lock:
            f = self._pieces.pop(k, None)
            mine = f is None
            if f is None:
                f = Future()
            self._pieces[k] = f
            again = not mine and self._counted.get(k, self._pass) != self._pass
            self._counted[k] = self._pass
            while len(self._pieces) > self.keep:  # the oldest read (not one being read)
                old = next((x for x, v in self._pieces.items() if v.done()), None)
                if old is None:
                    break
                del self._pieces[old]
                self._counted.pop(old, None)
        if not mine:
            kept = f.result()  # another READ's read of it, or its error
            if again:  # kept from a pass before: this pass's read of it (a sample: the first)
                self.store.count_kept(len(kept), int(k == 0), stored=len(kept))
            return kept
        try:  # a sample for the read of the first piece: a read from the start of the file
            data: bytes = self.store.read_entry(self.e, self.path, k * self.piece, self.piece)
        except BaseException as exc:
            with self._lock:
                if self._pieces.get(k) is f:  # the next READ tries again
                    del self._pieces[k]
            f.set_exception(exc)
            raise
        f.set_result(data)
        return data


class _Kept:
    __slots__ = ("asked", "data", "owed", "size", "started")

    def __init__(self) -> None:
        self.data: Future[bytes] = Future()
        self.size = 0  # its bytes, once read (counted in Whole's bytes kept)
        self.started = False  # a READ from the start of the file was served
        self.owed = False  # read again from further in: its sample not counted yet
        self.asked = 0  # the pages (bit k: bytes k * _PAGE on) READs asked for in this pass

    def ask(self, offset: int, size: int) -> None:
        """A READ of ``size`` bytes at ``offset`` (within the file) asked for these pages."""
        if size > 0:
            lo, hi = offset // _PAGE, -(-(offset + size) // _PAGE)
            self.asked |= ((1 << (hi - lo)) - 1) << lo

    def asked_whole(self) -> bool:
        """Whether READs asked for every page of the file (once read: its size known)."""
        full = (1 << -(-self.size // _PAGE)) - 1
        return self.asked & full == full


class Failures:
    """How the operations answer errors: the kernel passes a program an errno only, so
    the reason goes to this process's log, once.

    A name the kernel asked about that the dataset does not have (or that cannot be used
    as asked: ENOTDIR, ELOOP) is answered with its own errno, silently: that is ordinary
    traffic. Anything else is EIO: a read of damaged or unavailable data, whatever the
    error (a shard file missing from the pack is not a file missing from the dataset:
    EIO, not ENOENT; a shard truncated or from another pack is a ``FormatError``, a
    ``ValueError``, which the binding would answer with EINVAL and a traceback). Its
    reason, the stagefs error's own message (the shard, what is wrong with it, what to
    do), is logged as one line, once per shard (per operation for errors that are not a
    read's); an error that is not a stagefs or system error is a bug, logged as an error
    with where it was raised."""

    def __init__(self, fuse_error: type[OSError], mountpoint: str, manifest: Any) -> None:
        self._fuse_error, self._mountpoint, self._m = fuse_error, mountpoint, manifest
        self._told: set[Any] = set()
        self._lock = threading.Lock()

    def answer(self, op: str, path: str | None, exc: Exception) -> OSError:
        """The error that operation ``op`` of ``path`` answers for ``exc``."""
        code = getattr(exc, "errno", None)
        if isinstance(exc, (self._fuse_error, PathError)) and isinstance(code, int) \
                and code > 0:
            return exc  # type: ignore[return-value]  # an errno chosen, or a name's
        self._tell(("op", op), f"{op} of {self._show(path)} failed with EIO", exc)
        return self._fuse_error(errno.EIO)

    def unreadable(self, e: int, path: str, exc: Exception) -> OSError:
        """A read of file ``e`` failed with ``exc``: EIO, and the reason told once for its
        shard."""
        name = self._m.shards[int(self._m.shard[e])].name
        self._tell(("shard", name), f"reads from {name} fail with EIO (first: "
                   f"{self._show(path)})", exc)
        return self._fuse_error(errno.EIO)

    def _tell(self, key: Any, what: str, exc: Exception) -> None:
        with self._lock:
            first = key not in self._told
            self._told.add(key)
        ours = isinstance(exc, (StagefsError, OSError))  # the data's or the system's
        level = logging.DEBUG if not first else logging.WARNING if ours else logging.ERROR
        log.log(level, "stagefs mount: %s: %s", what, _reason(exc))

    def _show(self, path: str | None) -> str:
        return os.path.join(self._mountpoint, (path or "").lstrip("/"))


def _reason(exc: BaseException) -> str:
    """An error's own message on one line: an OSError's without the "[Errno N]" that
    ``str`` puts first; for an error that is not stagefs's or the system's (a bug), its
    type and the line that raised it."""
    text = str(exc)
    if isinstance(exc, OSError) and exc.strerror and text.startswith("[Errno"):
        text = exc.strerror if exc.filename is None else \
            f"{os.fsdecode(exc.filename)}: {exc.strerror}"
    elif not isinstance(exc, (StagefsError, OSError)):
        where = traceback.extract_tb(exc.__traceback__)[-1:] if exc.__traceback__ else []
        at = f" at {os.path.basename(where[0].filename)}:{where[0].lineno}" if where else ""
        text = f"{type(exc).__name__}: {text}{at} (a bug in stagefs: please report it)"
    return " ".join(text.split()) or type(exc).__name__


def _guarded(op: Callable[..., Any]) -> Callable[..., Any]:
    """Operation ``op`` with every error answered as ``Failures.answer`` says (a listing's
    too, which come as the binding reads it), none left to the binding, which answers an
    error without an errno with EINVAL and logs its traceback."""

    @functools.wraps(op)
    def run(self: Any, path: str | None, *args: Any, **kw: Any) -> Any:
        try:
            out = op(self, path, *args, **kw)
        except Exception as exc:
            raise self.failures.answer(op.__name__, path, exc) from None
        if isinstance(out, Iterator):
            return _guarded_items(self.failures, op.__name__, path, out)
        return out

    return run


def _guarded_items(failures: Failures, op: str, path: str | None,
                   items: Iterator[Any]) -> Iterator[Any]:
    try:
        yield from items
    except Exception as exc:
        raise failures.answer(op, path, exc) from None


def _operations(store: Any, mountpoint: str) -> Any:
    fusepy = _binding()
    from stagefs.fileobj import WHOLE_READ_LIMIT

    ns = store.namespace
    m = store.manifest

    class Operations(fusepy.Operations):  # type: ignore[misc,name-defined]
        use_ns = True

        def __init__(self) -> None:
            self._readers: dict[int, Pieces] = {}  # large files, most recent last
            self._lock = threading.Lock()
            self._no_open = False
            self.pusher: Pusher | None = None
            self._served = Served(len(m))
            self._whole = Whole(store, self._served)
            self.failures = Failures(fusepy.FuseOSError, mountpoint, m)

        def init_with_config(self, conn: Any, config: Any) -> None:
            # mounted by now (the kernel sends INIT once mount(2) is done), and the
            # INIT reply below keeps the window within max_readahead
            raise_readahead(mountpoint)
            if conn is not None:
                self._no_open = bool(conn.capable & _CAP_NO_OPEN_SUPPORT)
                # file handles (name_to_handle_at) give the pusher a file's node id; the
                # kernel gives them without this since Linux 6.6
                conn.want |= conn.capable & (_CAP_CACHE_SYMLINKS | _CAP_EXPORT_SUPPORT)
                if hasattr(conn, "max_read"):  # libfuse 3 wants it as the mount option says
                    conn.max_read = MAX_READ
                conn.max_readahead = max(int(conn.max_readahead), MAX_READ)
                conn.max_background = MAX_BACKGROUND
                conn.congestion_threshold = MAX_BACKGROUND * 3 // 4
            if config is not None:
                config.kernel_cache = 1
                config.entry_timeout = CACHE_TIMEOUT
                config.attr_timeout = CACHE_TIMEOUT
                config.negative_timeout = CACHE_TIMEOUT
                config.use_ino = 1
                config.readdir_ino = 1
            self.pusher = _pusher(store, mountpoint, self._served)

        def destroy(self, path: str) -> None:
            if self.pusher is not None:
                self.pusher.close()

        @_guarded
        def getattr(self, path: str, fh: int | None = None) -> dict[str, Any]:
            return self._attrs(ns.lstat(path))

        @staticmethod
        def _attrs(s: Any) -> dict[str, Any]:
            return {
                "st_mode": s.st_mode, "st_ino": s.st_ino, "st_nlink": s.st_nlink,
                "st_uid": s.st_uid, "st_gid": s.st_gid, "st_size": s.st_size,
                "st_atime": s.st_atime_ns, "st_mtime": s.st_mtime_ns,
                "st_ctime": s.st_ctime_ns, "st_blocks": s.st_blocks, "st_blksize": s.st_blksize,
            }

        @_guarded
        def readlink(self, path: str) -> str:
            return str(ns.readlink(path))

        @_guarded
        def readdir(self, path: str, fh: int) -> Iterator[Any]:
            for name, attrs, _ in self._listing(path, 0, False):
                yield name, attrs, 0

        @_guarded
        def readdir_plus(self, path: str, start: int
                         ) -> Iterator[tuple[str, dict[str, Any], bool]]:
            """The listing from its ``start``-th item on, each child with its whole
            attributes (READDIRPLUS: the kernel keeps them as looked up, so opening a
            listed file asks this process nothing)."""
            return self._listing(path, start, True)

        def _listing(self, path: str, start: int, whole: bool
                     ) -> Iterator[tuple[str, dict[str, Any], bool]]:
            """".", "..", then the children, from the ``start``-th on: name, attributes
            (whole, or the mode and inode a plain READDIR carries), whether whole. The dot
            entries carry an inode number too: readdir(3) skips an entry whose is 0."""
            e = ns.dir_entry(path)
            up = int(m.parent[e]) if e else 0
            for dot, d in ((".", e), ("..", up))[start:]:
                yield dot, {"st_mode": st.S_IFDIR, "st_ino": d + 1}, False
            for c in m.children(e)[max(0, start - 2):]:
                name = os.fsdecode(m.name_of(c))
                if whole:
                    yield name, self._attrs(ns.stat_entry(int(c))), True
                else:
                    yield name, {"st_mode": int(m.mode[c]), "st_ino": int(c) + 1}, False

        # No per-open state: the read-only mount makes the kernel refuse opens for writing
        # with EROFS itself, and reads find the file by path.

        @_guarded
        def open(self, path: str, flags: int) -> int:
            # ENOSYS once, where the kernel supports it, and it stops sending OPEN and
            # RELEASE for the life of the mount ("no_open", Linux 4.19+), keeping the page
            # cache; a warm file is then opened and read without asking this process at all.
            if self._no_open:
                raise fusepy.FuseOSError(errno.ENOSYS)
            return 0

        @_guarded
        def read(self, path: str, size: int, offset: int, fh: int) -> bytes:
            e = ns.file_entry(path)  # a name not in the dataset: ENOENT
            try:  # the data: EIO whatever fails (Failures)
                if m.codec[e] or m.size[e] <= WHOLE_READ_LIMIT:
                    size = max(0, min(size, int(m.size[e]) - offset))  # within the file
                    return self._whole.read(e, path, offset, size)[offset : offset + size]
                return self._large(e, path).read(offset, size)
            except Exception as exc:
                raise self.failures.unreadable(e, path, exc) from None

        def _large(self, e: int, path: str) -> Pieces:
            """The pieces of a large file read lately, kept while it is in use: the last
            ``_OPEN_READERS`` files followed, and ``_PIECES_HELD`` bytes of pieces kept
            across them (the least recently read files' let go of first)."""
            with self._lock:
                h = self._readers.pop(e, None)
                if h is None:
                    h = Pieces(store, e, path)
                self._readers[e] = h  # most recent last
                while len(self._readers) > _OPEN_READERS:
                    del self._readers[next(iter(self._readers))]
                if len(self._readers) * _PIECES_KEPT > _PIECES_HELD:  # may hold more
                    held = sum(r.held() for r in self._readers.values())
                    for r in itertools.islice(self._readers.values(),
                                              len(self._readers) - 1):
                        if held <= _PIECES_HELD:
                            break
                        held -= r.shed(held - _PIECES_HELD)
            return h

        @_guarded
        def access(self, path: str, amode: int) -> int:
            s = ns.stat(path)
            if amode & os.W_OK:
                raise fusepy.FuseOSError(errno.EROFS)
            if amode & os.X_OK and not s.st_mode & 0o111:
                raise fusepy.FuseOSError(errno.EACCES)
            return 0

        @_guarded
        def statfs(self, path: str) -> dict[str, int]:
            info = ns.summary()
            blocks = (info["raw_bytes"] + 4095) // 4096
            return {"f_bsize": 4096, "f_frsize": 4096, "f_blocks": blocks, "f_bfree": 0,
                    "f_bavail": 0, "f_files": len(m), "f_ffree": 0, "f_namemax": 255}

    return Operations()


_READDIR_PLUS = 1  # libfuse 3: readdir's flag (FUSE_READDIR_PLUS) and the filler's (FILL_DIR_PLUS)
_FILL_DIR_PLUS = 2


def _fuse_class(fusepy: Any) -> Any:
    """The binding's FUSE with READDIRPLUS answered in full.

    The binding fills a listing with the mode and inode only, so the kernel, which asks
    for READDIRPLUS, learns no entry from it and sends a LOOKUP, one request to this
    process's Python, for each file a program then opens. Here a READDIRPLUS listing
    carries every entry's attributes (libfuse makes the nodes in C), and a training loop
    that lists its dataset (an ImageFolder, os.walk) opens each file with no request at
    all before the READ.
    """

    class Fuse(fusepy.FUSE):  # type: ignore[misc,name-defined]
        def readdir_fuse_3(self, path: bytes | None, buf: Any, filler: Any, offset: int,
                           fip: Any, flags: int) -> int:
            plus = getattr(self.operations, "readdir_plus", None)
            if not flags & _READDIR_PLUS or plus is None or path is None:
                return int(super().readdir_fuse_3(path, buf, filler, offset, fip, flags))
            # each entry with its offset (its place + 1): libfuse 3.14 sends no attributes
            # for entries given at offset 0
            items = plus(path.decode(self.encoding, self.errors), offset)
            for k, (name, attrs, whole) in enumerate(items, start=offset + 1):
                s = fusepy.c_stat()
                fusepy.set_st_attrs(s, attrs, use_ns=True)
                fill = _FILL_DIR_PLUS if whole else 0
                if filler(buf, name.encode(self.encoding, self.errors), s, k, fill):
                    break
            return 0

    return Fuse


def check_mountpoint(mountpoint: str, *, nonempty: bool = False) -> str:
    """The absolute mount point, once it is an existing directory, not mounted, and empty
    (unless ``nonempty``: a mount hides what the directory holds until it is unmounted)."""
    mp = os.path.abspath(mountpoint)
    if is_mounted(mp) and (why := _server_gone(mp)):
        said = ("is gone (killed?): every access there fails with 'Transport endpoint is "
                "not connected'" if why == "gone" else
                "does not answer (stopped? kill -CONT it, or end it)")
        raise ConfigError(f"{mp} is a mount whose server {said}. 'stagefs umount {mp}' "
                          "removes it (--lazy if programs still hold files there); then "
                          "mount again")
    if os.path.lexists(mp) and not os.path.isdir(mp):
        raise ConfigError(f"mount point {mp} is a file, not a directory: name an empty "
                          "directory to mount on")
    if not os.path.isdir(mp):
        raise ConfigError(f"mount point {mp} does not exist: create it first (mkdir -p {mp})")
    if is_mounted(mp):
        raise ConfigError(f"{mp} is already a mount point: 'stagefs umount {mp}' first")
    if not nonempty:
        with os.scandir(mp) as it:
            held = sorted(itertools.islice((e.name for e in it), 3))
        if os.path.exists(os.path.join(mp, MANIFEST_NAME)):  # the arguments swapped
            raise ConfigError(f"mount point {mp} is a pack (it holds {MANIFEST_NAME}): the "
                              "dataset comes first, then the mount point: stagefs mount "
                              "DATASET MOUNTPOINT")
        if held:
            raise ConfigError(
                f"mount point {mp} is not empty (it holds {', '.join(held)}"
                f"{', ...' if len(held) == 3 else ''}): the mount would hide those files "
                "until it is unmounted; name an empty directory, or pass --force-nonempty")
    return mp


def mount(store: Any, mountpoint: str, *, allow_other: bool = False,
          debug: bool = False, nonempty: bool = False) -> None:
    """Serve ``store`` at ``mountpoint`` until it is unmounted or a signal (SIGINT,
    SIGTERM, SIGHUP) ends it; then the mount is gone. Runs in the foreground."""
    fusepy = _binding()
    mp = check_mountpoint(mountpoint, nonempty=nonempty)
    opts: dict[str, Any] = {"ro": True, "fsname": f"stagefs:{store.pack_dir}",
                            "subtype": "stagefs", "default_permissions": True,
                            "max_read": MAX_READ}
    if allow_other:
        opts["allow_other"] = True
    if (fusepy.fuse_version_major, fusepy.fuse_version_minor) >= (3, 2):
        # libfuse's default (unset) makes 3.12-3.16 print "Ignoring invalid max threads
        # value 4294967295" at every mount (libfuse issue 1003); 10 idle workers kept is
        # what that default amounts to (at most 10 workers, none ended)
        opts["max_idle_threads"] = FUSE_IDLE_THREADS
    logging.getLogger("fuse").setLevel(logging.ERROR)  # ENOENT lookups are normal traffic
    try:
        _fuse_class(fusepy)(_operations(store, mp), mp, foreground=True, nothreads=False,
                            debug=debug, **opts)
    except RuntimeError as exc:
        code = exc.args[0] if exc.args else None
        if code == 8:  # libfuse: the loop ended on a signal (SIGINT/SIGTERM/SIGHUP); unmounted
            log.info("stopped by a signal; %s unmounted", mp)
            return
        why = _FUSE_MAIN_ERRORS.get(code, f"libfuse error {code}") if isinstance(code, int) \
            else str(exc)
        raise ConfigError(f"could not mount at {mp}: {why}") from None


def unmount(mountpoint: str, *, timeout: float = 10.0, lazy: bool = False) -> None:
    """Unmount a stagefs mount; the serving process then exits by itself. A detached
    server whose log holds anything (a read that failed, and why) keeps it: a warning
    names it and shows its first lines.

    A mount in use (a process's current directory or open file in it) is busy: the error
    names those processes. ``lazy`` detaches it at once anyway (``fusermount3 -u -z``,
    ``umount -l``): it is gone from the directory tree, and its server ends when the last
    of them lets go."""
    mp = os.path.abspath(mountpoint)
    if not is_mounted(mp):
        raise ConfigError(f"{mp} is not mounted")
    try:
        at = _mount_at(os.path.realpath(mp))
    except OSError:
        at = None
    if at is not None and at[1] != _FSTYPE:
        # fusermount3 and umount unmount whatever is there: a tmpfs, a bind mount, /proc
        raise ConfigError(
            f"{mp} is not a stagefs mount (it is a {at[1] or 'file system'} mount of "
            f"{at[2] or 'an unknown source'}): stagefs umount only ends what stagefs mount "
            "started; use umount for anything else")
    server_log = _server_log(mp)  # while the server runs
    # killed (SIGKILL, the OOM killer)
    gone = server_log is None and _server_gone(mp) == "gone"
    if gone:
        server_log = _dead_server_log(mp)
    error = _run_unmount(mp, timeout, lazy)
    if error is None:  # done: the kernel may take a moment to drop it from the mount table
        deadline = time.monotonic() + timeout
        while is_mounted(mp) and time.monotonic() < deadline:
            time.sleep(0.05)
    if is_mounted(mp):
        under = _mounts_under(os.path.realpath(mp))
        if under and (error is None or "busy" in error.lower()):
            raise ConfigError(
                f"could not unmount {mp}: it is busy: {len(under)} file system"
                f"{'s are' if len(under) > 1 else ' is'} mounted inside it "
                f"({', '.join(under[:3])}{', ...' if len(under) > 3 else ''}): unmount "
                f"{'them' if len(under) > 1 else 'it'} first ('stagefs umount {under[-1]}' "
                "for a stagefs mount, else umount), or 'stagefs umount --lazy "
                f"{mp}' to detach them all now")
        if error is None or "busy" in error.lower():
            users = _users_of(mp)
            who = (f"in use by {', '.join(users[:5])}{', ...' if len(users) > 5 else ''}"
                   if users else "in use")
            if gone:  # nobody serves it: waiting for those programs serves nothing
                kept = f" (its log: {server_log})" if server_log else ""
                raise ConfigError(
                    f"could not unmount {mp}: it is busy ({who}), and its server is gone "
                    f"(killed: SIGKILL, the OOM killer){kept}: every access to it fails with "
                    "'Transport endpoint is not connected'. End those programs and run "
                    f"'stagefs umount {mp}' again, or 'stagefs umount --lazy {mp}' to detach "
                    "it now; then mount it again")
            raise ConfigError(
                f"could not unmount {mp}: it is busy ({who}): end those programs or move them "
                f"out of it (cd elsewhere, close its files) and run 'stagefs umount {mp}' "
                f"again, or 'stagefs umount --lazy {mp}' to detach it now (its server ends "
                "when the last of them lets go)")
        raise ConfigError(f"could not unmount {mp}: {error}")
    if server_log is not None:
        _tell_log(mp, server_log)


def _run_unmount(mp: str, timeout: float, lazy: bool) -> str | None:
    """Unmount ``mp`` with the first of fusermount3, fusermount and umount found: None if it
    did, else that tool's one error (tools not installed are skipped)."""
    error = None
    for cmd in (["fusermount3", "-u", *(["-z"] if lazy else []), mp],
                ["fusermount", "-u", *(["-z"] if lazy else []), mp],
                ["umount", *(["-l"] if lazy else []), mp]):
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                               check=False)
        except FileNotFoundError:
            continue
        except subprocess.TimeoutExpired:
            return f"{cmd[0]} did not answer in {timeout:g} s"
        if r.returncode == 0:
            return None
        said = r.stderr.strip().splitlines()
        error = error or (said[-1] if said else f"{cmd[0]} exited {r.returncode}")
        if "busy" in error.lower():
            return error  # the others would say the same
    return error or ("no unmount tool found (fusermount3, fusermount, umount): install "
                     "fuse3 (apt-get install fuse3)")


def _users_of(mp: str) -> list[str]:
    """The processes whose current directory, root or an open file is in ``mp``, as
    "pid N (name)" (those of other users this process may not look at are left out)."""
    inside = mp.rstrip("/") + "/"
    users = []
    for pid in sorted((p for p in os.listdir("/proc") if p.isdigit()), key=int):
        links = [f"/proc/{pid}/cwd", f"/proc/{pid}/root"]
        with contextlib.suppress(OSError):
            links += [f"/proc/{pid}/fd/{fd}" for fd in os.listdir(f"/proc/{pid}/fd")]
        for link in links:
            try:
                target = os.readlink(link)
            except OSError:
                continue
            if target == mp or target.startswith(inside):
                try:
                    with open(f"/proc/{pid}/comm") as f:
                        name = f.read().strip()
                except OSError:
                    name = "?"
                users.append(f"pid {pid} ({name})")
                break
    return users


_LOG_VAR = "STAGEFS_MOUNT_LOG"  # the detached server's log, named for it to remove
_LOG_SHOWN = 10  # lines of a kept log that unmount shows


def remove_own_log() -> None:
    """Called by a detached server that ended cleanly: its log is removed if it is empty.
    One that holds anything (at the default level, warnings and errors: a read that
    failed, and why) is kept; ``unmount`` names it (as ``stagefs mount`` names the log of
    a server that failed)."""
    path = os.environ.pop(_LOG_VAR, None)
    if path and os.path.basename(path).startswith("stagefs-mount-"):
        with contextlib.suppress(OSError):
            if not os.path.getsize(path):
                os.unlink(path)


def _server_log(mountpoint: str) -> str | None:
    """The log of the detached server (``mount_background``) serving ``mountpoint``, from
    its command line and environment in /proc; None for a server in the foreground (its
    log is its terminal) or one this process may not look at."""
    names = {os.fsencode(mountpoint), os.fsencode(os.path.realpath(mountpoint))}
    var = _LOG_VAR.encode() + b"="
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
            if b"stagefs.cli" not in argv or b"--foreground" not in argv \
                    or not names.intersection(argv):
                continue
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = f.read().split(b"\0")
        except OSError:  # ended meanwhile, or another user's
            continue
        for item in env:
            if item.startswith(var):
                return os.fsdecode(item[len(var):])
    return None


def _log_prefix(mountpoint: str) -> str:
    """How a detached server's log is named: ``stagefs-mount-``, a tag of its mount point,
    and a random part; so ``unmount`` finds the log of a server that was killed (SIGKILL, the
    OOM killer), which /proc no longer shows, and each such kill left one more in /tmp."""
    tag = hashlib.sha1(os.fsencode(os.path.realpath(mountpoint))).hexdigest()[:8]
    return f"stagefs-mount-{tag}-"


def _server_gone(mountpoint: str, wait_s: float = 2.0) -> str | None:
    """Why the mount's server cannot answer: ``"gone"`` (ended: killed, crashed; the kernel
    says ENOTCONN for its mount point), ``"stopped"`` (no answer in ``wait_s``: kill -STOP,
    a debugger), or None. Asked with statfs, which the kernel always sends to the server (a
    stat is answered from its attribute cache), in a thread: a stopped server's would wait
    for as long as it stays stopped."""
    got: list[OSError | None] = []

    def ask() -> None:
        try:
            os.statvfs(mountpoint)
            got.append(None)
        except OSError as exc:
            got.append(exc)

    t = threading.Thread(target=ask, name="stagefs-statfs", daemon=True)
    t.start()
    t.join(wait_s)
    if not got:
        return "stopped"
    exc = got[0]
    return "gone" if exc is not None and exc.errno == errno.ENOTCONN else None


def _dead_server_log(mountpoint: str) -> str | None:
    """The logs this user's servers of ``mountpoint`` left when they were killed: the empty
    ones removed (nothing to tell), the newest of the others returned (kept, to be told)."""
    import tempfile

    where, prefix = tempfile.gettempdir(), _log_prefix(mountpoint)
    kept: list[tuple[float, str]] = []
    try:
        names = [n for n in os.listdir(where) if n.startswith(prefix) and n.endswith(".log")]
    except OSError:
        return None
    for name in names:
        path = os.path.join(where, name)
        try:
            s = os.lstat(path)
        except OSError:
            continue
        if not st.S_ISREG(s.st_mode) or s.st_uid != os.getuid():
            continue
        if s.st_size:
            kept.append((s.st_mtime, path))
        else:
            with contextlib.suppress(OSError):
                os.unlink(path)
    return max(kept)[1] if kept else None


def _tell_log(mountpoint: str, path: str) -> None:
    """A warning naming a detached server's log and showing its first lines, if it holds
    anything (it is then kept)."""
    shown: list[str] = []
    n = 0
    try:
        with open(path, errors="replace") as f:
            for line in f:
                if line.strip():
                    n += 1
                    if n <= _LOG_SHOWN:
                        shown.append(f"  {line.rstrip()}")
    except OSError:
        return
    if n > _LOG_SHOWN:
        shown.append(f"  ... ({n - _LOG_SHOWN} more)")
    if n:
        log.warning("the server of %s logged %d line%s, kept in %s:\n%s", mountpoint, n,
                    "s" if n > 1 else "", path, "\n".join(shown))


def mount_background(dataset: str | None, mountpoint: str, tiers: list[str] | None, *,
                     allow_other: bool = False, nonempty: bool = False,
                     connect: bool = False,
                     runtime: str | None = None, timeout: float = 60.0) -> int:
    """Start ``stagefs mount --foreground`` as a detached process; return once mounted.

    The child runs in its own session (a closed terminal does not end it), writes its log
    next to nothing the user owns (a file in the temp dir, named in any error; kept after
    the server ends if anything was logged, and then named by ``unmount``), and ends with
    ``stagefs umount``, SIGTERM or SIGINT.
    """
    import sys
    import tempfile

    mp = check_mountpoint(mountpoint, nonempty=nonempty)
    reason = fuse_available()
    if reason:
        raise ConfigError(reason)
    cmd = [sys.executable, "-m", "stagefs.cli", "mount", mp, "--foreground"]
    if dataset:
        cmd.insert(4, os.path.abspath(dataset))
    if connect:
        cmd.append("--connect")
    if runtime:
        cmd += ["--runtime", os.path.abspath(runtime)]
    for t in tiers or ():
        cmd += ["--tier", t]
    if allow_other:
        cmd.append("--allow-other")
    if nonempty:
        cmd.append("--force-nonempty")
    with tempfile.NamedTemporaryFile(prefix=_log_prefix(mp), suffix=".log",
                                     delete=False) as logf:
        child = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=logf, stderr=logf,
                                 start_new_session=True, close_fds=True,
                                 env={**os.environ, _LOG_VAR: logf.name,
                                      # its own session, the same job
                                      "STAGEFS_JOB": job_id()})
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if is_mounted(mp):
            print(f"mounted {dataset or 'the cluster dataset'} at {mp} (server pid {child.pid}; "
                  f"'stagefs umount {mp}' to end it)")
            return 0
        if child.poll() is not None:
            break
        time.sleep(0.05)
    else:
        child.terminate()
    with open(logf.name, errors="replace") as f:
        text = f.read().strip()
    raise ConfigError(f"the mount did not come up (log {logf.name}): {text[-2000:] or '-'}")
