"""The origin of an in-place dataset: a raw directory read through virtual shards.

An in-place manifest (stagefs/inplace.py) cuts the files, in path order, into shards that
exist only as numbers: a "shard" is a header followed by its files' bytes back to back, at
the offsets the manifest gives. ``InPlaceOrigin.pread(shard, offset, length)`` turns that
range into reads of the underlying files, and synthesises the header. Placing such a shard
therefore writes a real shard file in the tier layout.

Verification: the checksums of raw files are not known before they are read. Each file the
origin opens is checked against the scan (``fstat``: same size and mtime, else a
``SourceChangedError`` names it); its xxh3 is computed and recorded in the ``SumTable`` when
its shard is placed, and every read of a tier copy is verified against that record.
"""

from __future__ import annotations

import bisect
import mmap
import os
import stat
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from stagefs._fsutil import open_read, write_out
from stagefs.errors import SourceChangedError, UnreadableSourceError
from stagefs.format import Manifest, ShardHeader
from stagefs.format.spec import SHARD_HEADER
from stagefs.tiers.base import OriginStats, SourceUnavailable
from stagefs.tiers.placer import Layout

__all__ = ["InPlaceOrigin", "SumTable"]

_PARALLEL_FILES = 8  # a range covering more files than this is read by a thread pool
_THREADS = 24  # files opened at once: each costs metadata round trips, so overlap them


class SumTable:
    """xxh3 of each file, learnt when its shard is placed; shared by the node's processes
    through a small mmap'd file: ``n`` u64 sums, then ``n`` bytes "known"."""

    def __init__(self, path: str, n: int) -> None:
        self.path = path
        self.n = n
        want = 9 * n
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            if os.fstat(fd).st_size > want:
                os.ftruncate(fd, want)
            write_out(fd, want)  # (a hole in it: a SIGBUS at a sum learnt on a full disk)
            self._mm = mmap.mmap(fd, max(want, 1), mmap.MAP_SHARED) if want else None
        finally:
            os.close(fd)
        self._view = memoryview(self._mm) if self._mm is not None else memoryview(b"")
        self.sums = self._view[: 8 * n].cast("Q")  # indexable like Manifest.checksum
        self._known = self._view[8 * n : 9 * n]

    def known(self, e: int) -> bool:
        return bool(self._known[e])

    def get(self, e: int) -> int | None:
        return self.sums[e] if self._known[e] else None

    def record(self, e: int, digest: int) -> None:
        self.sums[e] = digest
        self._known[e] = 1  # written after the sum: a reader never sees a half-set pair

    def close(self) -> None:
        self.sums.release()
        self._known.release()
        self._view.release()
        if self._mm is not None:
            self._mm.close()


class InPlaceOrigin:
    """Serves byte ranges of virtual shards from the raw files under ``root``."""

    name = "origin"

    def __init__(self, root: str, manifest: Manifest) -> None:
        self.root = root
        self.manifest = manifest
        self.stats = OriginStats()
        self._layout = Layout(manifest)
        self._cache: dict[int, tuple[list[int], list[int]]] = {}
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._pool_pid = 0  # the process whose threads the pool has (a forked child has none)
        # told of a file changed since the scan (the cache then scans again at the next open)
        self.on_changed: Callable[[str], None] | None = None

    def _changed(self, what: str) -> SourceChangedError:
        """The error for a file changed since the scan; the scan is marked stale first."""
        if self.on_changed is not None:
            self.on_changed(what)
        return SourceChangedError(f"{what}; reopen the dataset to scan it again")

    def reset_after_fork(self) -> None:
        self._lock = threading.Lock()
        self._pool = None
        self.stats = OriginStats(sink=self.stats.sink)  # the job's counters: its own file

    def _files(self, shard: int) -> tuple[list[int], list[int]]:
        got = self._cache.get(shard)
        if got is None:
            ents = self._layout.entries(shard)
            got = (ents, [self.manifest.offset[e] for e in ents])
            self._cache[shard] = got
        return got

    def pread(self, shard: int, offset: int, length: int) -> bytes:
        m = self.manifest
        if (not 0 <= shard < len(m.shards) or offset < 0 or length < 0
                or offset + length > m.shards[shard].size):
            raise SourceUnavailable(f"{self.root}: no range [{offset}, {offset + length}) in "
                                    f"shard {shard}")
        ents, offs = self._files(shard)
        end = offset + length
        parts: list[tuple[int, int, int, int]] = []  # (entry, start in file, length, out pos)
        i = max(0, bisect.bisect_right(offs, offset) - 1)
        while i < len(ents) and offs[i] < end:
            e = ents[i]
            lo, hi = max(offset, offs[i]), min(end, offs[i] + m.stored[e])
            if lo < hi:
                parts.append((e, lo - offs[i], hi - lo, lo - offset))
            i += 1
        out = bytearray(length)
        if offset < SHARD_HEADER.size:
            data_len = m.shards[shard].size - SHARD_HEADER.size
            head = ShardHeader(shard, m.pack_id, data_len).encode()
            n = min(length, SHARD_HEADER.size - offset)
            out[:n] = head[offset : offset + n]
        if len(parts) > _PARALLEL_FILES:
            with self._lock:
                if self._pool is None or self._pool_pid != os.getpid():
                    self._pool = ThreadPoolExecutor(_THREADS, thread_name_prefix="stagefs-inplace")
                    self._pool_pid = os.getpid()
            pieces = list(self._pool.map(lambda p: self._read_file(p[0], p[1], p[2]), parts))
        else:
            pieces = [self._read_file(e, start, n) for e, start, n, _ in parts]
        for (_, _, n, pos), data in zip(parts, pieces, strict=True):
            out[pos : pos + n] = data
        self.stats.read(sum(p[2] for p in parts), len(parts))  # a read of each file
        return bytes(out)

    def _read_file(self, e: int, start: int, n: int) -> bytes:
        m = self.manifest
        rel = os.fsdecode(m.path_of(e))
        path = os.path.join(self.root, rel)
        try:
            # a file replaced by a FIFO since the scan: refused below as changed, not waited on
            fd, s = open_read(path)
        except PermissionError as exc:  # not a change: scanning again would not help
            raise UnreadableSourceError(
                f"{path}: {exc.strerror} (a file of {self.root}). Give this user read "
                "permission on it (chmod u+r, or a+r for a shared dataset), or open the "
                "dataset as a user who has it") from exc
        except OSError as exc:
            if not os.path.isdir(self.root):
                raise SourceUnavailable(f"{self.root}: {exc.strerror}") from exc
            raise self._changed(f"{path}: {exc.strerror} (it was there when {self.root} was "
                                "scanned)") from exc
        try:
            # the fstat on the descriptor just opened (open_read: is it still the file
            # scanned?) is counted with the open, not as a stat: a stat is of a path, as
            # stagefs bench counts every reader's and the demo plain files' (whose open()
            # makes one or two of its own)
            self.stats.opens += 1
            if not stat.S_ISREG(s.st_mode):
                raise self._changed(f"{path} is no longer a regular file (it was one when "
                                    f"{self.root} was scanned)")
            if s.st_size != m.size[e] or s.st_mtime_ns != m.mtime_ns[e]:
                raise self._changed(f"{path} changed since {self.root} was scanned (size "
                                    f"{m.size[e]} → {s.st_size}, or its mtime)")
            data = os.pread(fd, n, start)
        except OSError as exc:
            raise SourceUnavailable(f"{path}: {exc.strerror}") from exc
        finally:
            os.close(fd)
        if len(data) != n:
            raise self._changed(f"{path}: shorter than scanned")
        return data

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
