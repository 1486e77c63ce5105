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
        self.samples = self.nbytes = 0  # what the read counters were told
        self.manifest: Any = type("M", (), {"stored": sizes})()

    def read_entry(self, e: int, path: str, count: bool = True,
                   sample: int | None = None) -> bytes:
        self.reads += 1
        if count:
            self.samples += 1 if sample is None else sample
            self.nbytes += self.sizes[e]
        return bytes(self.sizes[e])  # calloc'd: traced, never touched

    def count_kept(self, n: int, reads: int = 1, stored: int | None = None) -> None:
        self.samples += reads
        self.nbytes += n


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


def test_a_file_read_again_further_in_is_one_sample() -> None:
    """A program reads the start of a 2 MiB file, 64 other files pass through (other
    DataLoader workers), then it reads the rest: the server let go of the file and reads it
    again, its bytes counted twice (read twice) but one sample, not two (a warm epoch said
    more samples than files read). Its next pass, from the start while it is kept, is a
    sample (it was not counted at all: no READ from its start had come in that copy)."""
    store = _Store([2 * MiB] + [1000] * 80)
    whole = fuse.Whole(store, fuse.Served(81), keep=4, keep_bytes=MiB)
    whole.read(0, "/big", 0, MiB)
    for e in range(1, 81):
        whole.read(e, f"/f{e}", 0, 4096)
    assert (store.reads, store.samples) == (81, 81)
    whole.read(0, "/big", MiB, MiB)  # the rest of the same read of it
    assert store.reads == 82
    assert store.samples == 81
    assert store.nbytes == 2 * (2 * MiB) + 80 * 1000
    whole.read(0, "/big", 0, MiB)  # the program's next pass
    whole.read(0, "/big", MiB, MiB)
    assert store.reads == 82
    assert store.samples == 82
    whole.read(0, "/big", 0, MiB)  # and the one after: counted as kept, bytes and all
    assert store.samples == 83
    assert store.nbytes == 2 * (2 * MiB) + 80 * 1000 + 2 * MiB


def test_a_file_s_first_read_further_in_is_its_sample() -> None:
    """Read-ahead's READ further into a file can come before the READ from its start: a
    file not read before is one sample whichever comes first, as before."""
    store = _Store([2 * MiB])
    whole = fuse.Whole(store, fuse.Served(1))
    whole.read(0, "/big", MiB, MiB)
    whole.read(0, "/big", 0, MiB)
    assert (store.reads, store.samples, store.nbytes) == (1, 1, 2 * MiB)
