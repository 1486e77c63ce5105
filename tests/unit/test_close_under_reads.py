"""A Store closed while another thread is in the middle of reading it: the reader gets the
closed Store's error (open the dataset again), not a KeyError, a released memoryview or a
reader pool shut down, whatever close() let go of first."""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import pytest

import stagefs
from conftest import pack_files, random_bytes

FILES = {f"d{i % 3}/f{i:03d}.bin": random_bytes(3000 + 97 * i, seed=i) for i in range(40)}


@pytest.fixture(scope="module")
def pack(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return pack_files(tmp_path_factory.mktemp("close"), "src", FILES)


def _closing_origin(fs: stagefs.Store) -> None:
    """The origin's next read closes the store first (another thread's close, landing in the
    middle of this read), then returns the right bytes."""
    real = fs.origin.pread

    def pread(shard: int, offset: int, length: int) -> Any:
        fs.close()
        return real(shard, offset, length)

    fs.origin.pread = pread


def test_a_read_under_way_when_the_store_closes_says_it_is_closed(pack: Path) -> None:
    fs = stagefs.open(pack)
    _closing_origin(fs)
    with pytest.raises(ValueError, match=r"closed Store .* open the dataset again"):
        fs.read("d1/f001.bin")


def test_a_walk_under_way_when_the_store_closes_says_it_is_closed(pack: Path) -> None:
    fs = stagefs.open(pack)
    walk = fs.walk("")
    next(walk)
    fs.close()
    with pytest.raises(ValueError, match=r"closed Store .* open the dataset again"):
        list(walk)


def test_errors_of_an_open_store_are_its_own(pack: Path) -> None:
    with stagefs.open(pack) as fs:
        with pytest.raises(FileNotFoundError):
            fs.read("d1/nothing.bin")
        assert fs.read_many(["d0/f000.bin", "d2/f002.bin"]) == [FILES["d0/f000.bin"],
                                                                FILES["d2/f002.bin"]]
        assert [d for d, _, _ in fs.walk("")] == ["", "d0", "d1", "d2"]


class _Closing:
    """A holder whose read lands as another thread closes the store, and whose bytes are then
    wrong (what a read of a descriptor close() let go of, and the system gave to another
    file, returns): it must not be told to drop its copy, which was good."""

    name = "memory tier"
    holder = "memory"

    def __init__(self, store: list[stagefs.Store]) -> None:
        self.store, self.dropped = store, 0

    def pread(self, shard: int, offset: int, length: int) -> bytes:
        self.store[0].close()
        return b"\0" * length

    def drop(self, shard: int) -> None:
        self.dropped += 1


def test_bad_bytes_of_a_read_cut_by_close_drop_no_copy(pack: Path) -> None:
    box: list[stagefs.Store] = []
    tier = _Closing(box)
    fs = stagefs.Store(str(pack), sources=lambda shard: [tier])
    box.append(fs)
    with pytest.raises(ValueError, match="closed Store"):
        fs.read("d1/f001.bin")
    assert tier.dropped == 0


def test_a_closed_store_is_not_pickled_to_be_reopened(pack: Path) -> None:
    """A spawned DataLoader worker gets the dataset pickled: a closed Store's copy reopened
    the pack there and read on, where a forked worker, and the Store itself, said it was
    closed. It says so when pickled, as a closed file does."""
    fs = stagefs.open(pack)
    assert pickle.loads(pickle.dumps(fs)).read("d0/f000.bin") == FILES["d0/f000.bin"]
    fs.close()
    with pytest.raises(ValueError, match=r"closed Store .* open the dataset again"):
        pickle.dumps(fs)
