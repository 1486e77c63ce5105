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
                assert len(whole.read(e, f"/a{e}.npy", offset, 8 * MiB)) == 32 * MiB
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
        whole.read(0, "/big", offset, MiB)
    assert store.reads == 1
    for offset in range(0, 8 * MiB, MiB):
        whole.read(1, "/big2", offset, MiB)
    assert store.reads == 2
    whole.read(0, "/big", MiB, MiB)  # let go of for the last one: read again
    assert store.reads == 3


@pytest.mark.parametrize("keep", [1, 3])
def test_at_most_keep_files_are_kept(keep: int) -> None:
    store = _Store([100] * 6)
    whole = fuse.Whole(store, fuse.Served(6), keep=keep)
    for e in range(6):
        whole.read(e, f"/f{e}", 0, 100)
    whole.read(5, "/f5", 50, 50)
    assert store.reads == 6
    whole.read(0, "/f0", 50, 50)
    assert store.reads == 7


def test_a_file_the_kernel_is_still_reading_outlasts_other_files() -> None:
    """A file whose READs come over time (a program reading it in pieces, or read-ahead
    answered late) is kept while other readers' files pass through: its next READ is
    served from what was read, not read (and counted) again. Let go of by count alone,
    64 other files read between two of its READs made a 3 MiB file read twice."""
    store = _Store([3 * MiB] + [1000] * 100)
    whole = fuse.Whole(store, fuse.Served(101), keep=4)
    whole.read(0, "/big", 0, 4096)
    for e in range(1, 101):  # other files, each asked for whole
        whole.read(e, f"/f{e}", 0, 4096)
    whole.read(0, "/big", 2 * MiB, MiB)
    assert store.reads == 101
    whole.read(0, "/big", 4096, 2 * MiB - 4096)  # now asked for whole
    for e in range(1, 6):
        whole.read(e, f"/f{e}", 0, 4096)  # read again: the program's next pass
    whole.read(0, "/big", 3 * MiB - 4096, 4096)  # let go of once asked for whole
    assert store.reads == 101 + 5 + 1


def test_files_never_asked_for_whole_are_bounded() -> None:
    """A program that reads only the start of each file (its header) leaves each
    file kept not asked for whole: they are let go of past ``keep * 4`` files."""
    store = _Store([MiB] * 40)
    whole = fuse.Whole(store, fuse.Served(40), keep=2)
    for e in range(40):
        whole.read(e, f"/h{e}", 0, 4096)
    assert len(whole._files) == 2 * fuse._UNASKED_SHARE
    whole.read(0, "/h0", 4096, 4096)  # the first, let go of: read again
    assert store.reads == 41
