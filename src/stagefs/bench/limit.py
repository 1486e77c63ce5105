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
    """Read every file whole, ``streams`` at a time, READ bytes a call; (seconds, bytes)."""
    todo = list(paths)
    lock = threading.Lock()
    total = [0]

    def work() -> None:
        buf = bytearray(READ)
        while True:
            with lock:
                if not todo:
                    return
                path = todo.pop(0)
            fd = os.open(path, os.O_RDONLY)
            try:
                n = 0
                while k := os.readv(fd, [buf]):
                    n += k
            finally:
                os.close(fd)
            with lock:
                total[0] += n

    t0 = time.perf_counter()
    threads = [threading.Thread(target=work) for _ in range(max(1, streams))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
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
