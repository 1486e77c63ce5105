"""What the FUSE server keeps of the files it reads whole (posix/fuse.py, ``Whole``): a
compressed file is read whole whatever its size, so the files kept are bounded in bytes,
not only in number (24 compressed arrays of 32 MB read through a mount held 826 MB in the
server for the life of the mount)."""

from __future__ import annotations

import tracemalloc
from typing import Any

import pytest

from stagefs.posix import fuse

MiB = 2**20


class _Store:
    """What Whole asks of a Store: each file's bytes (fresh, as a real read's are)."""

    def __init__(self, sizes: list[int]) -> None:
        self.sizes, self.reads = sizes, 0
        self.manifest: Any = type("M", (), {"stored": sizes})()

    def read_entry(self, e: int, path: str, count: bool = True) -> bytes:
        self.reads += 1
        return bytes(self.sizes[e])  # calloc'd: traced, never touched

    def count_kept(self, n: int, stored: int) -> None:
        pass


def test_large_compressed_files_read_whole_are_not_all_kept() -> None:
    store = _Store([32 * MiB] * 24)
    whole = fuse.Whole(store, fuse.Served(24))
    tracemalloc.start()
    try:
        for e in range(24):
            for offset in range(0, 32 * MiB, 8 * MiB):  # the kernel's READs of it
                assert len(whole.read(e, f"/a{e}.npy", offset == 0)) == 32 * MiB
        held, _peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert store.reads == 24  # each read once for all its READs
    assert held <= fuse._RECENT_BYTES + 32 * MiB + MiB, held


def test_the_file_being_read_is_kept_whatever_its_size() -> None:
    """A file larger than the bound is kept while it is the last read: its other READs
    find it (reading it whole again for each would cost its size per READ)."""
    store = _Store([8 * MiB, 8 * MiB])
    whole = fuse.Whole(store, fuse.Served(2), keep_bytes=4 * MiB)
    for offset in range(0, 8 * MiB, MiB):
        whole.read(0, "/big", offset == 0)
    assert store.reads == 1
    for offset in range(0, 8 * MiB, MiB):
        whole.read(1, "/big2", offset == 0)
    assert store.reads == 2
    whole.read(0, "/big", False)  # let go of for the last one: read again
    assert store.reads == 3


@pytest.mark.parametrize("keep", [1, 3])
def test_at_most_keep_files_are_kept(keep: int) -> None:
    store = _Store([100] * 6)
    whole = fuse.Whole(store, fuse.Served(6), keep=keep)
    for e in range(6):
        whole.read(e, f"/f{e}", True)
    whole.read(5, "/f5", False)
    assert store.reads == 6
    whole.read(0, "/f0", False)
    assert store.reads == 7
