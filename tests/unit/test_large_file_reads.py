"""A file object of a large raw file reads the pieces a read needs, not the ones its buffer
straddles, and does not keep a large read's bytes once they are handed over
(docs/decisions/0002-large-file-reads.md)."""

from __future__ import annotations

import random
import tracemalloc
from pathlib import Path

import pytest

import stagefs
from conftest import random_bytes
from stagefs.format import PIECE

MiB = 2**20
DATA = random_bytes(9 * MiB + 4321, 11)  # not a multiple of the piece


@pytest.fixture(scope="module")
def pack(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.mktemp("large")
    (base / "src").mkdir()
    (base / "src" / "big.bin").write_bytes(DATA)
    stagefs.pack(base / "src", base / "pack", jobs=1, progress=False, echo=lambda _m: None)
    return base / "pack"


def test_a_small_unaligned_read_reads_one_piece(pack: Path) -> None:
    with stagefs.open(pack) as fs, fs.open("big.bin") as f:
        st = fs.origin.stats
        for at in (5 * MiB + 3, 2 * MiB + 700_000, 7 * MiB + 1):
            before = st.bytes_read
            f.seek(at)
            assert f.read(100) == DATA[at : at + 100]
            assert st.bytes_read - before == PIECE  # the piece that holds them, not two
        before = st.bytes_read
        f.seek(3 * MiB + 5)  # three pieces' worth from inside a piece: the four it covers
        assert f.read(3 * MiB) == DATA[3 * MiB + 5 : 6 * MiB + 5]
        assert st.bytes_read - before == 4 * PIECE


def test_a_large_read_is_not_kept_by_the_file(pack: Path) -> None:
    with stagefs.open(pack) as fs, fs.open("big.bin") as f:
        tracemalloc.start()
        try:
            for read in (lambda: f.read(8 * MiB), lambda: f.readinto(bytearray(8 * MiB))):
                f.seek(0)
                read()  # 8 MiB handed over: the file object keeps at most a piece of them
                held, _ = tracemalloc.get_traced_memory()
                assert held < 2 * MiB
        finally:
            tracemalloc.stop()
        f.seek(PIECE - 7)
        assert f.read(10) == DATA[PIECE - 7 : PIECE + 3]


def test_every_offset_and_length_reads_the_right_bytes(pack: Path) -> None:
    r = random.Random(5)
    size = len(DATA)
    at = [0, 1, PIECE - 1, PIECE, PIECE + 1, size - size % PIECE - 1, size - size % PIECE,
          size - 1, size, size + 1, *(r.randrange(size) for _ in range(40))]
    lengths = [0, 1, 99, PIECE - 1, PIECE, PIECE + 1, 3 * PIECE + 7, size]
    with stagefs.open(pack) as fs, fs.open("big.bin") as f:
        for a in at:
            for n in lengths:
                f.seek(a)
                assert f.read(n) == DATA[a : a + n], (a, n)
                back = max(0, a - r.randrange(1, 2 * PIECE))  # backwards, into a kept piece
                f.seek(back)
                buf = bytearray(n)
                got = f.readinto(buf)
                assert bytes(buf[:got]) == DATA[back : back + n], (back, n)
