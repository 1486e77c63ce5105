"""The origin's sequential limit: how fast the link reads the pack's shard files from the
origin, in large sequential reads, with one stream and with several at once (page cache
dropped before each pass when the runner can). A cold epoch cannot beat it: its samples/s
is held against ``files / seconds`` of the best pass (docs/benchmarks.md).

And one pass more, of ``KEPT`` streams that also write what they read into node-local
storage (where the bench puts its tiers): the least any loader that keeps the data for the
next epochs must do with each byte. Where the node's CPUs, not the link, set the limit (a
file system's client and servers on the same few cores), it is the nearer reference; it
does not replace the others."""

from __future__ import annotations

import errno
import mmap
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from stagefs._fsutil import pwrite_all

__all__ = ["KEPT", "READ", "STREAMS", "label", "origin_limit", "read_files"]

READ = 4 * 2**20  # bytes per read: the size the stream reads (tiers/stream.py CHUNK)
STREAMS = (1, 6)  # passes: one stream, then this many files read at once
KEPT = 6  # streams of the pass that also keeps what it reads


def label(p: dict[str, Any]) -> str:
    """A pass's name in the report: "1 stream", "6 streams", "6 streams kept"."""
    n = p["streams"]
    return f"{n} stream{'s' if n > 1 else ''}" + (" kept" if p.get("kept") else "")


def read_files(paths: Sequence[str], streams: int,
               keep: str | None = None) -> tuple[float, int]:
    """Read every file whole, ``streams`` at a time, READ bytes a call; (seconds, bytes).
    ``keep``: a directory each file is also written into as it is read (``NNNNNN``, its
    place in ``paths``; the caller removes them), the files read past the page cache
    (``O_DIRECT``) where their file system allows, as stagefs's streams read what they keep
    (tiers/origin.py ``pread_through``): the least work keeping costs.

    Ctrl-C (or any exception in the caller's thread) stops the readers at their next read
    and waits for them: they read the whole pack otherwise, minutes on a slow link, before
    the process could end, or failed with tracebacks once the run removed the pack."""
    todo = list(enumerate(paths))
    lock = threading.Lock()
    total = [0]
    stop = threading.Event()
    ended = [threading.Event() for _ in range(max(1, streams))]

    direct = [keep is not None]  # until a file system refuses it

    def work(done: threading.Event) -> None:
        buf = mmap.mmap(-1, READ)  # page-aligned, as O_DIRECT wants
        try:
            while not stop.is_set():
                with lock:
                    if not todo:
                        return
                    i, path = todo.pop(0)
                fd = _open(path, direct)
                out = -1
                try:
                    if keep is not None:
                        out = os.open(os.path.join(keep, f"{i:06d}"),
                                      os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
                    n = 0
                    while not stop.is_set() and (k := os.readv(fd, [buf])):
                        if out >= 0:
                            pwrite_all(out, memoryview(buf)[:k], n)
                        n += k
                finally:
                    os.close(fd)
                    if out >= 0:
                        os.close(out)
                with lock:
                    total[0] += n
        finally:
            done.set()

    t0 = time.perf_counter()
    threads = [threading.Thread(target=work, args=(e,), daemon=True) for e in ended]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        stop.set()
        # each reader's own event, not is_alive(): a join that Ctrl-C interrupted can
        # mark a thread that still runs as stopped (CPython's bpo-45274 handling)
        for t, done in zip(threads, ended, strict=True):
            if t.ident is not None:
                done.wait()
    return time.perf_counter() - t0, total[0]


def _open(path: str, direct: list[bool]) -> int:
    """``path`` opened to read, past the page cache while ``direct[0]`` (set False for
    good where the file system refuses it)."""
    if direct[0]:
        try:
            return os.open(path, os.O_RDONLY | os.O_DIRECT)
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
            direct[0] = False
    return os.open(path, os.O_RDONLY)


def origin_limit(pack_dir: str, files: int, drop: Callable[[], bool],
                 streams: Sequence[int] = STREAMS,
                 keep: str | None = None) -> list[dict[str, Any]]:
    """One pass per stream count over the pack's shard files: seconds, MB/s, and the
    samples/s an epoch would reach if it moved its bytes at that speed; with ``keep`` (a
    node-local directory), a pass of ``KEPT`` streams writing what they read under it
    (removed after the pass)."""
    from stagefs.format import MANIFEST_NAME, Manifest

    m = Manifest(os.path.join(pack_dir, MANIFEST_NAME))
    try:
        paths = [os.path.join(pack_dir, s.name) for s in m.shards]
    finally:
        m.close()
    out = []
    for n, kept in [(n, False) for n in streams] + ([(KEPT, True)] if keep else []):
        cold = drop()
        where = tempfile.mkdtemp(prefix="limit-kept-", dir=keep) if kept else None
        try:
            seconds, nbytes = read_files(paths, n, where)
        finally:
            if where is not None:
                shutil.rmtree(where, ignore_errors=True)
        out.append({"streams": n, "kept": kept, "seconds": seconds, "bytes": nbytes,
                    "cold": cold, "mb_per_s": nbytes / seconds / 1e6 if seconds else 0.0,
                    "samples_per_s": files / seconds if seconds else 0.0})
    return out
