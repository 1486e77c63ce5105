"""The origin's sequential limit: how fast the link reads the pack's shard files from the
origin, in large sequential reads, with one stream and with several at once (page cache
dropped before each pass when the runner can). A cold epoch cannot beat it: its samples/s
is held against ``files / seconds`` of the best pass (docs/benchmarks.md)."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["READ", "STREAMS", "origin_limit", "read_files"]

READ = 4 * 2**20  # bytes per read: the size the stream reads (tiers/stream.py CHUNK)
STREAMS = (1, 6)  # passes: one stream, then this many files read at once


def read_files(paths: Sequence[str], streams: int) -> tuple[float, int]:
    """Read every file whole, ``streams`` at a time, READ bytes a call; (seconds, bytes).

    Ctrl-C (or any exception in the caller's thread) stops the readers at their next read
    and waits for them: they read the whole pack otherwise, minutes on a slow link, before
    the process could end, or failed with tracebacks once the run removed the pack."""
    todo = list(paths)
    lock = threading.Lock()
    total = [0]
    stop = threading.Event()
    ended = [threading.Event() for _ in range(max(1, streams))]

    def work(done: threading.Event) -> None:
        buf = bytearray(READ)
        try:
            while not stop.is_set():
                with lock:
                    if not todo:
                        return
                    path = todo.pop(0)
                fd = os.open(path, os.O_RDONLY)
                try:
                    n = 0
                    while not stop.is_set() and (k := os.readv(fd, [buf])):
                        n += k
                finally:
                    os.close(fd)
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


def origin_limit(pack_dir: str, files: int, drop: Callable[[], bool],
                 streams: Sequence[int] = STREAMS) -> list[dict[str, Any]]:
    """One pass per stream count over the pack's shard files: seconds, MB/s, and the
    samples/s an epoch would reach if it moved its bytes at that speed."""
    from stagefs.format import MANIFEST_NAME, Manifest

    m = Manifest(os.path.join(pack_dir, MANIFEST_NAME))
    try:
        paths = [os.path.join(pack_dir, s.name) for s in m.shards]
    finally:
        m.close()
    out = []
    for n in streams:
        cold = drop()
        seconds, nbytes = read_files(paths, n)
        out.append({"streams": n, "seconds": seconds, "bytes": nbytes, "cold": cold,
                    "mb_per_s": nbytes / seconds / 1e6 if seconds else 0.0,
                    "samples_per_s": files / seconds if seconds else 0.0})
    return out
