"""What one epoch cost the process doing it: time, CPU, peak memory, bytes, origin operations.

Origin operations are counted by wrapping the path-taking calls of ``os`` and ``builtins``
(open, os.open, stat, lstat, access, listdir, scandir) in the reading process and keeping
those whose path is under one of the origin directories. Every reader measured here opens
its files through these calls (WebDataset's ``gopen``, Streaming's and LitData's ``open`` and
``shutil.copy``, stagefs's ``os.open``); calls on an already open descriptor (fstat, read)
are not metadata operations on a path and are not counted.

Origin bytes: what the process asked of origin files. For stagefs, the store's own count
(``Store.origin.stats``). For the others, the size of every origin file opened: each of
them reads the files it opens whole (plain files; tar shards streamed end to end; MDS shards
and LitData chunks copied whole into their local cache). The kernel's page cache may serve
part of these bytes in warm epochs, for every system alike.
"""

from __future__ import annotations

import builtins
import io
import os
import resource
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import xxhash

__all__ = ["EpochFigures", "OriginCounter", "Proc", "Tally"]


class OriginCounter:
    """Counts path-based calls under ``roots`` while installed (``with counter:``)."""

    _WRAPPED = (("os", "stat"), ("os", "lstat"), ("os", "access"), ("os", "listdir"),
                ("os", "scandir"), ("os", "open"), ("builtins", "open"), ("io", "open"))

    def __init__(self, roots: Iterable[str], sizes: dict[str, int] | None = None) -> None:
        self.roots = tuple(os.path.join(os.path.abspath(r), "") for r in roots)
        self.sizes = sizes or {}
        self.opens = self.stats = self.bytes_opened = 0
        self._saved: list[tuple[Any, str, Any]] = []

    def _under(self, path: Any) -> str | None:
        if isinstance(path, int) or path is None:
            return None
        try:
            p = os.fsdecode(os.fspath(path))
        except TypeError:
            return None
        if not p.startswith("/"):
            p = os.path.join(os.getcwd(), p)
        return p if p.startswith(self.roots) else None

    def _wrap(self, fn: Callable[..., Any], is_open: bool) -> Callable[..., Any]:
        under, sizes = self._under, self.sizes

        def counted(*args: Any, **kw: Any) -> Any:
            p = under(args[0] if args else kw.get("path", kw.get("file")))
            if p is not None:
                if is_open:
                    self.opens += 1
                    self.bytes_opened += sizes.get(os.path.normpath(p), 0)
                else:
                    self.stats += 1
            return fn(*args, **kw)

        counted.__wrapped__ = fn  # type: ignore[attr-defined]
        return counted

    def __enter__(self) -> OriginCounter:
        mods = {"os": os, "builtins": builtins, "io": io}
        for mod, name in self._WRAPPED:
            m = mods[mod]
            fn = getattr(m, name)
            self._saved.append((m, name, fn))
            setattr(m, name, self._wrap(fn, name == "open"))
        return self

    def __exit__(self, *exc: object) -> None:
        for m, name, fn in reversed(self._saved):
            setattr(m, name, fn)
        self._saved.clear()

    def snapshot(self) -> tuple[int, int, int]:
        return self.opens, self.stats, self.bytes_opened


@dataclass
class Proc:
    """Counters of one process read from /proc (this one, or a helper such as a FUSE server)."""

    pid: int | None = None  # None: this process

    def _path(self, name: str) -> str:
        return f"/proc/{self.pid or 'self'}/{name}"

    def io(self) -> dict[str, int]:
        try:
            with open(self._path("io")) as f:
                return {k: int(v) for k, v in (line.split(":") for line in f)}
        except OSError:
            return {}

    def cpu(self) -> float:
        """User + system CPU seconds of the process (and, for this one, its waited children)."""
        if self.pid is None:
            s, c = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(
                resource.RUSAGE_CHILDREN)
            return s.ru_utime + s.ru_stime + c.ru_utime + c.ru_stime
        with open(self._path("stat")) as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def reset_peak(self) -> None:
        """Reset the RSS high-water mark (Linux: write 5 to clear_refs)."""
        try:
            with open(self._path("clear_refs"), "w") as f:
                f.write("5")
        except OSError:
            pass

    def peak_rss(self) -> int:
        return self._status_kib("VmHWM:") * 1024

    def shared_rss(self) -> int:
        """The shared memory pages in its RSS now (``RssShmem``: for a stagefs reader, the
        memory tier's pages it mapped; they are the tier's, counted once by the system)."""
        return self._status_kib("RssShmem:") * 1024

    def _status_kib(self, key: str) -> int:
        try:
            with open(self._path("status")) as f:
                for line in f:
                    if line.startswith(key):
                        return int(line.split()[1])
        except OSError:
            pass
        return 0

    def origin_fds(self, roots: tuple[str, ...]) -> int:
        """Open descriptors of the process on files under ``roots``."""
        d = self._path("fd")
        n = 0
        try:
            for fd in os.listdir(d):
                try:
                    if os.readlink(os.path.join(d, fd)).startswith(roots):
                        n += 1
                except OSError:
                    continue
        except OSError:
            pass
        return n


@dataclass
class Tally:
    """Samples seen in one epoch: how many, their bytes, and an order-free checksum.

    ``digest`` hashes the sorted list of (key, xxh3 of the sample's bytes): equal for two
    epochs iff they returned the same samples with the same bytes, whatever the order.
    Hashing also makes every reader touch every byte (memoryviews and mmaps included).
    """

    samples: int = 0
    bytes: int = 0
    seen: list[tuple[str, int]] = field(default_factory=list)

    def add(self, key: str, data: Any) -> None:
        self.samples += 1
        self.bytes += len(data)
        self.seen.append((key, xxhash.xxh3_64_intdigest(data)))

    def consume(self, items: Iterator[tuple[str, Any]]) -> None:
        for key, data in items:
            self.add(key, data)

    def digest(self) -> tuple[str, int]:
        """The checksum and the number of distinct keys."""
        self.seen.sort()
        h = xxhash.xxh3_128()
        keys = 0
        last = None
        for key, d in self.seen:
            h.update(os.fsencode(f"{key}\0{d:016x}\n"))  # a name not UTF-8: its bytes
            if key != last:
                keys += 1
                last = key
        return h.hexdigest(), keys


@dataclass
class EpochFigures:
    """Everything measured for one epoch of one system in one run."""

    system: str
    run: int
    epoch: int
    cold: bool
    seconds: float
    samples: int
    bytes: int
    distinct: int
    checksum: str
    cpu_seconds: float
    peak_rss: int
    origin_opens: int
    origin_stats: int
    origin_bytes: int
    rchar: int
    read_bytes: int
    setup_seconds: float = 0.0
    shared_rss: int = 0  # of peak_rss, pages shared with others (a mapped memory tier)
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.seconds if self.seconds else 0.0

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["samples_per_s"] = self.samples_per_s
        d["mb_per_s"] = self.bytes / self.seconds / 1e6 if self.seconds else 0.0
        d["cpu_s_per_1k"] = self.cpu_seconds / self.samples * 1000 if self.samples else 0.0
        return d


def now() -> float:
    return time.perf_counter()
