"""The origin of a pack: its shard files where they were written (usually the shared FS)."""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Sequence
from concurrent.futures import Executor

from stagefs._fsutil import open_read, user_name
from stagefs.config import env
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
    """

    name = "origin"

    def __init__(self, pack_dir: str, manifest: Manifest, *, check_headers: bool = False) -> None:
        self.pack_dir = pack_dir
        self.manifest = manifest
        self.check_headers = check_headers
        self._random = _readahead() == "off"  # checked here: a bad value fails the open
        self.stats = OriginStats()
        self._fds: dict[int, int] = {}
        self._bulk_fds: dict[int, int] = {}
        self._lock = threading.Lock()

    def path(self, shard: int) -> str:
        return os.path.join(self.pack_dir, self.manifest.shards[shard].name)

    def _fd(self, shard: int, bulk: bool = False) -> int:
        fds = self._bulk_fds if bulk else self._fds
        fd = fds.get(shard)
        if fd is not None:
            return fd
        with self._lock:
            fd = fds.get(shard)
            if fd is None:
                fd = self._open(shard, bulk)
                fds[shard] = fd
        return fd

    def _open(self, shard: int, bulk: bool = False) -> int:
        if not 0 <= shard < len(self.manifest.shards):
            raise SourceUnavailable(f"{self.pack_dir}: no shard {shard} in this pack")
        path = self.path(shard)
        try:
            # a FIFO named as a shard (a crafted pack) fails its reads (ESPIPE) instead of
            # hanging the open for a writer
            fd, _ = open_read(path)
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
            raise SourceUnavailable(f"{path}: {exc.strerror}") from exc
        self.stats.opens += 1
        if bulk:
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
            fd = self._fd(shard)
        except SourceUnavailable:
            return
        try:
            self._check_header(shard, fd, size_too=True)
        except OSError:
            return

    def pread(self, shard: int, offset: int, length: int) -> bytes:
        fd = self._fd(shard, length >= BULK_READ)
        try:
            data = pread_full(fd, length, offset)
        except OSError as exc:
            raise SourceUnavailable(f"{self.path(shard)}: {exc.strerror}") from exc
        self.stats.read(len(data))
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
            raise ShortRead(why, data)
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
        for shard, _, length in ranges:
            key = (shard, length >= BULK_READ)
            fd = fd_of.get(key)
            if fd is None:
                try:
                    fd = self._fd(*key)
                except (OSError, SourceUnavailable, CorruptShardError):
                    fd = -1  # none: pread then says what is wrong
                fd_of[key] = fd
            fds.append(fd)
        offs, lens = [r[1] for r in ranges], [r[2] for r in ranges]
        got = gather(fds, offs, lens, slow_s, copy_rate, pool, parts)
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
        self._lock = threading.Lock()
        self.stats = OriginStats(sink=self.stats.sink)  # the job's counters: its own file

    def fileno(self, shard: int) -> int:
        return self._fd(shard)

    def close(self) -> None:
        with self._lock:
            for fds in (self._fds, self._bulk_fds):
                for fd in fds.values():
                    os.close(fd)
                fds.clear()
