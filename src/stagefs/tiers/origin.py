"""The origin of a pack: its shard files where they were written (usually the shared FS)."""

from __future__ import annotations

import contextlib
import errno
import functools
import logging
import mmap
import os
import threading
from collections.abc import Sequence
from concurrent.futures import Executor
from typing import TypeVar

from stagefs._fsutil import InUse, OpenFiles, open_read, raise_fd_limit, user_name
from stagefs.config import env, env_flag
from stagefs.errors import ConfigError, CorruptShardError, NotFoundError
from stagefs.format import MANIFEST_NAME, Manifest, ShardHeader
from stagefs.format.manifest import pack_id_at
from stagefs.format.spec import SHARD_HEADER
from stagefs.tiers.base import (
    Gathered,
    OriginStats,
    ShortRead,
    SourceUnavailable,
    gather,
    pread_full,
)

__all__ = ["PackOrigin"]

_B = TypeVar("_B", bound=bytes | memoryview)

log = logging.getLogger("stagefs.tiers")

_BULK, _DIRECT = 1, 2  # a shard's descriptors: the samples' (0), the streams', O_DIRECT


def _reads_are_random(fd: int) -> None:
    """Tell the kernel not to read ahead on this shard (``STAGEFS_ORIGIN_READAHEAD=kernel``
    keeps its read-ahead). Samples are read in a random order, and the read-ahead a small
    read sets off fetches its neighbours long before they are needed: under an 800 Mbit/s
    cap on the test PFS, the first 300 samples of an epoch (107 KB each, 4 threads) took 52
    MB over the link for 32 MB of samples, 60 MB/s of useful bytes on a 95 MB/s link; with
    the hint, 35 MB and 89 MB/s. On an idle link the early neighbours cost nothing and save
    round trips: a cold epoch read with no compute ran 10-15% faster with the kernel's
    read-ahead (decision 0005, "Reading the origin"). The copy reads pieces of megabytes,
    several in flight, and loses nothing either way."""
    advise = getattr(os, "posix_fadvise", None)
    if advise is None:
        return
    with contextlib.suppress(OSError):
        advise(fd, 0, 0, os.POSIX_FADV_RANDOM)


def _readahead() -> str:
    mode = (env("origin_readahead") or "off").lower()
    if mode not in ("off", "kernel"):
        raise ConfigError(f"STAGEFS_ORIGIN_READAHEAD must be 'off' or 'kernel', not {mode!r}")
    return mode


BULK_READ = 1 << 20  # a read this large is a stream's or the placer's: its own descriptor
ALIGN = 4096  # what a read that bypasses the page cache (O_DIRECT) aligns its range and buffer to


class PackOrigin:
    """Reads shard ranges with ``os.pread`` from the pack directory, one fd per shard (two
    for a shard that is also streamed: below).

    Each shard is opened on first use, so a whole job costs the origin one open per shard
    (two if streamed), counted in ``stats``. Its header is checked against the manifest only when something
    is wrong (``diagnose``: a read failed its checksum or came up short), or at once with
    ``check_headers=True`` (a Store that does not verify checksums): every file read is
    verified against its own checksum anyway, and on a parallel file system the first read
    at offset 0 of a file sets off the client's sequential read-ahead (about 0.5 MB on the
    test PFS), per shard and per process, before the first sample arrives.

    Reads of ``BULK_READ`` bytes or more (the streams' and the placer's, each in offset
    order through a shard) go through a second descriptor of the shard, opened when first
    needed and marked sequential: the kernel then reads ahead while the stream checks and
    writes the chunk it has (one stream on the test PFS: 365 MB/s against 315 MB/s with the
    random hint, medians of 5), and the samples' descriptor keeps its random hint.

    ``pread_through``, the read of a stream or the placer whose bytes go into a tier, goes
    through a third descriptor opened with ``O_DIRECT`` (``STAGEFS_ORIGIN_DIRECT=0``: the
    second one): the bytes pass the page cache by, where they were a second copy of what
    the tier holds, and the kernel's work per byte (allocating and filling the page cache,
    copying from it) is not done. A cold epoch through a memory tier on the test PFS: 10%
    more samples/s, 0.89 CPU-s in the reading process against 0.98 and 1.40 in the file
    system's client and chunk server against 1.58 (decision 0005, "Past the page
    cache"). A file system
    that refuses ``O_DIRECT`` (the open or a read fails with EINVAL) is read through the
    page cache.

    At most three quarters of the process's open-file limit (raised to the hard one) of
    these descriptors are open at once (``open_limit``; a quarter with tiers, whose copies
    take the rest, ``limit_open``):
    past it, the least recently read is closed (``OpenFiles``), and opened again if read
    again (counted as an open). A pack of more shards than that is read all the same, under
    a hard limit of 4,096 too.
    """

    name = "origin"

    def __init__(self, pack_dir: str, manifest: Manifest, *, check_headers: bool = False,
                 open_limit: int | None = None) -> None:
        self.pack_dir = pack_dir
        self.manifest = manifest
        self.check_headers = check_headers
        self._random = _readahead() == "off"  # checked here: a bad value fails the open
        self.stats = OriginStats()
        if open_limit is None:  # (a tier chain gives it a quarter: limit_open)
            open_limit = max(16, raise_fd_limit()[1] * 3 // 4)
        # (shard, 0 | BULK | DIRECT) -> its descriptor: the samples', the streams', O_DIRECT
        self._files: OpenFiles[tuple[int, int]] = OpenFiles(open_limit)
        self._direct = env_flag("origin_direct")
        # per shard, the bytes [at, next page) a read through the cache by-pass brought
        # beyond its range: the next stream read of the shard starts there (no page read twice)
        self._tails: dict[int, tuple[int, bytes]] = {}
        self._bufs = threading.local()

    def path(self, shard: int) -> str:
        return os.path.join(self.pack_dir, self.manifest.shards[shard].name)

    def _fd(self, shard: int, bulk: bool = False, direct: bool = False
            ) -> contextlib.AbstractContextManager[int]:
        """The shard's descriptor of that kind, open until the block is done."""
        return self._files.using((shard, _DIRECT if direct else _BULK if bulk else 0),
                                 lambda: self._open(shard, bulk, direct))

    def _open(self, shard: int, bulk: bool = False, direct: bool = False) -> int:
        if not 0 <= shard < len(self.manifest.shards):
            raise SourceUnavailable(f"{self.pack_dir}: no shard {shard} in this pack")
        path = self.path(shard)
        try:
            # a FIFO named as a shard (a crafted pack) fails its reads (ESPIPE) instead of
            # hanging the open for a writer
            fd, _ = open_read(path, os.O_DIRECT if direct else 0)
        except FileNotFoundError:
            if not os.path.isdir(self.pack_dir):  # the whole origin went away
                raise SourceUnavailable(f"{self.pack_dir} is gone") from None
            raise NotFoundError(path, self._replaced() or "shard file missing from the pack; "
                                "re-pack") from None
        except PermissionError as exc:  # not a mount gone: the file's mode (chmod, another user)
            raise SourceUnavailable(
                f"{path}: {exc.strerror}: the shard file is not readable by "
                f"{user_name(os.getuid())}; its owner can make the pack readable (chmod -R "
                f"a+rX {self.pack_dir})") from exc
        except OSError as exc:
            if direct and exc.errno == errno.EINVAL:
                raise  # no O_DIRECT here: pread_through reads through the page cache
            raise SourceUnavailable(f"{path}: {exc.strerror}") from exc
        self.stats.opens += 1
        if direct:
            pass  # no page cache: no read-ahead to hint
        elif bulk:
            with contextlib.suppress(OSError, AttributeError):
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        elif self._random:
            _reads_are_random(fd)
        # no fstat: the manifest knows the size, and a truncated shard shows up as a short
        # read; on a parallel file system a stat of an open file is not free
        if self.check_headers:
            try:
                self._check_header(shard, fd)
            except BaseException:
                os.close(fd)
                raise
        return fd

    def _check_header(self, shard: int, fd: int, *, size_too: bool = False) -> None:
        path = self.path(shard)
        size = self.manifest.shards[shard].size
        header = ShardHeader.decode(os.pread(fd, SHARD_HEADER.size, 0), path)
        if header.pack_id != self.manifest.pack_id and (why := self._replaced()):
            raise CorruptShardError(f"{path}: {why}")
        header.check(path, index=shard, pack_id=self.manifest.pack_id, file_size=size)
        if size_too and os.fstat(fd).st_size != size:
            raise CorruptShardError(f"{path}: shard is {os.fstat(fd).st_size} bytes, the "
                                    f"manifest says {size}: truncated or overwritten; copy the pack again or re-pack")

    def _replaced(self) -> str | None:
        """Why a shard is missing or another pack's, if the pack was packed again (``stagefs
        pack --force``) since its manifest was read: the open manifest names the old pack's
        shards, which are gone (read right until then: a shard opened before stays the old
        one). None if the pack's manifest is still this one."""
        now = pack_id_at(os.path.join(self.pack_dir, MANIFEST_NAME))
        if now == self.manifest.pack_id:
            return None
        what = ("was packed again" if now is not None else
                "has no manifest now (it is being packed again, or was removed)")
        return (f"the pack {self.pack_dir} {what} since this process opened it: its shards "
                "are no longer the ones its manifest named. Open the pack again (restart "
                "the job) once it is complete; a pack that a job reads must not be packed "
                "again under it")

    def diagnose(self, shard: int) -> None:
        """A read of ``shard`` was wrong: raise a CorruptShardError naming the cause if the
        shard file itself is the wrong one (another pack's, another index, another size)."""
        try:
            with self._fd(shard) as fd:
                self._check_header(shard, fd, size_too=True)
        except (SourceUnavailable, OSError):
            return

    def pread(self, shard: int, offset: int, length: int) -> bytes:
        bulk = length >= BULK_READ
        fd, use = self._files.take((shard, _BULK if bulk else 0),  # (the open's error: raised)
                                   lambda: self._open(shard, bulk))
        try:
            data = pread_full(fd, length, offset)
        except OSError as exc:
            raise SourceUnavailable(f"{self.path(shard)}: {exc.strerror}") from exc
        finally:
            use.leave()
        self.stats.read(len(data))
        return self._whole(shard, offset, length, data)

    def pread_through(self, shard: int, offset: int, length: int, *, view: bool = False
                      ) -> bytes | memoryview:
        """``pread`` for a large read whose bytes go into a tier (a stream's, the placer's):
        past the page cache where the file system allows (the class's doc). ``view``: the
        bytes may be a view of this thread's read buffer, good until this thread's next
        read of the origin (a stream writes and checks them before it reads on: their copy
        into a bytes object was 0.07 of 0.35 CPU seconds a cold epoch of 548 MB cost this
        process on the test PFS)."""
        tail = self._tails.get(shard)
        if not self._direct or (length < BULK_READ and (tail is None or tail[0] != offset)):
            return self.pread(shard, offset, length)
        try:
            with self._fd(shard, direct=True) as fd:
                data = self._read_direct(shard, fd, offset, length, view)
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise SourceUnavailable(f"{self.path(shard)}: {exc.strerror}") from exc
            # this file system takes no O_DIRECT (or not at this alignment): the page cache
            log.debug("%s: no reads past the page cache (%s): read through it",
                      self.pack_dir, exc.strerror)
            self._direct = False
            return self.pread(shard, offset, length)
        # counted as pread counts: the bytes asked for (a file system moves whole pages
        # either way; the part of a page past a stream's read is not asked for again)
        self.stats.read(len(data))
        return self._whole(shard, offset, length, data)

    def _read_direct(self, shard: int, fd: int, offset: int, length: int, view: bool = False
                     ) -> bytes | memoryview:
        """Bytes [offset, offset + length) of the shard (fewer if it ends first) read with
        ``O_DIRECT`` in whole pages into this thread's aligned buffer (``view``: a view of
        it, not a copy). The part of the last page beyond the range is kept for the next
        read of the shard if it starts there (a stream reads a shard in order): no page is
        read twice."""
        tail = self._tails.pop(shard, None)
        head = b""
        if tail is not None and tail[0] == offset:
            if len(tail[1]) >= length:  # all of it came with the read before
                self._tails[shard] = (offset + length, tail[1][length:])
                return tail[1][:length]
            head = tail[1]
        start = offset + len(head)
        a = start - start % ALIGN
        end = offset + length
        b = -(-end // ALIGN) * ALIGN
        # read at ALIGN into the buffer, the head (under a page) put just before it: the
        # bytes come out with one copy
        buf = self._buffer(ALIGN + b - a)
        whole = memoryview(buf)
        got = 0
        try:
            while got < b - a:
                n = os.preadv(fd, [whole[ALIGN + got : ALIGN + b - a]], a + got)
                if n <= 0:
                    break
                got += n
            lo = ALIGN + start - a
            whole[lo - len(head) : lo] = head
            part = whole[lo - len(head) : max(lo, min(ALIGN + got, ALIGN + end - a))]
            data: bytes | memoryview = part if view else bytes(part)
            if got > end - a:
                if len(self._tails) >= 64:  # streams stopped mid-shard: a bound, not a leak
                    self._tails.clear()
                self._tails[shard] = (end, bytes(whole[ALIGN + end - a : ALIGN + got]))
        finally:
            whole.release()
        return data

    def _buffer(self, n: int) -> mmap.mmap:
        """This thread's page-aligned buffer of ``n`` bytes at least."""
        buf: mmap.mmap | None = getattr(self._bufs, "buf", None)
        if buf is None or len(buf) < n:
            if buf is not None:
                with contextlib.suppress(BufferError):  # a view of it still held: its own
                    buf.close()  # end unmaps it
            buf = mmap.mmap(-1, max(n, 4 * BULK_READ + 3 * ALIGN))  # a stream's CHUNK, widened
            self._bufs.buf = buf
        return buf

    def _whole(self, shard: int, offset: int, length: int, data: _B) -> _B:
        """``data``, read at ``offset`` for ``length`` bytes, if whole; else the error that
        says why it is short (the range is not in the shard, or the shard is cut short)."""
        if len(data) != length:
            if offset + length > self.manifest.shards[shard].size:
                raise SourceUnavailable(f"{self.path(shard)}: no range [{offset}, "
                                        f"{offset + length}) in the shard")
            why = (f"{self.path(shard)}: short read at offset {offset} ({len(data)} of "
                   f"{length} bytes): the shard is truncated; copy the pack again or re-pack")
            try:
                self.diagnose(shard)
            except CorruptShardError as exc:  # the cause, named
                why = str(exc)
            raise ShortRead(why, bytes(data))  # (kept by the error: not a view of a buffer)
        return data

    def gather_many(self, ranges: Sequence[tuple[int, int, int]], slow_s: float = -1.0,
                    copy_rate: float = 1.0, pool: Executor | None = None, parts: int = 1
                    ) -> Gathered:
        """The bytes of each (shard, offset, length) and their hashes, read by ``gather``
        (stopping after the first read that waited, with ``slow_s``; in ``parts`` at once
        with a ``pool``); None for a range that could not be read whole, which the caller
        reads again by ``pread`` (which says why)."""
        fds: list[int] = []
        fd_of: dict[tuple[int, bool], int] = {}
        held: list[InUse] = []  # every shard's descriptor open till the end
        try:
            for shard, _, length in ranges:
                key = (shard, length >= BULK_READ)
                fd = fd_of.get(key)
                if fd is None:
                    try:
                        fd, use = self._files.take(
                            (shard, _BULK if key[1] else 0),
                            functools.partial(self._open, shard, key[1]))
                        held.append(use)
                    except (OSError, SourceUnavailable, CorruptShardError):
                        fd = -1  # none: pread then says what is wrong
                    fd_of[key] = fd
                fds.append(fd)
            offs, lens = [r[1] for r in ranges], [r[2] for r in ranges]
            got = gather(fds, offs, lens, slow_s, copy_rate, pool, parts)
        finally:
            for use in held:
                use.leave()
        # one read a run of adjacent files (one preadv), as the origin saw them
        datas = got.datas
        nbytes = reads = 0
        for k in range(got.done):
            data = datas[k]
            if data is not None:
                nbytes += len(data)
                reads += k == 0 or fds[k] != fds[k - 1] or offs[k] != offs[k - 1] + lens[k - 1]
        if nbytes or reads:
            self.stats.read(nbytes, reads)
        return got

    def reset_after_fork(self) -> None:
        """In a forked child: count afresh (the fds stay valid)."""
        self._files.reset_after_fork()
        self._bufs = threading.local()
        self._tails = {}
        self.stats = OriginStats(sink=self.stats.sink)  # the job's counters: its own file

    def limit_open(self, n: int) -> None:
        """Keep at most ``n`` of the shards' descriptors open."""
        self._files.limit = max(1, n)

    def descriptors(self, kind: str = "samples") -> dict[int, int]:
        """The shards open now for ``kind``'s reads (samples, bulk, direct): their
        descriptors."""
        k = {"samples": 0, "bulk": _BULK, "direct": _DIRECT}[kind]
        return {shard: fd for (shard, j), fd in self._files.opened().items() if j == k}

    def open_check(self, shard: int) -> None:
        """Open the shard (its header checked with ``check_headers``): what is wrong with
        it raised, as a read would."""
        with self._fd(shard):
            pass

    def close(self) -> None:
        self._files.close()
