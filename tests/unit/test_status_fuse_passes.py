"""A FUSE mount's count of a large file read again (posix/fuse.py, ``Pieces``), its READs
called as libfuse calls them, without a mount: a program's next pass over a file whose
pieces the server still keeps (the kernel let go of its pages, or the program reads with
O_DIRECT) is a sample and its bytes, from this process's memory, as for a small file kept;
it was not counted at all (`stagefs status` showed nothing of a 5 MiB file read again).
And a file read whole (``Whole``) whose READs come over time is one sample, however many
other files are read between them."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
from test_fuse_large_pieces import _ops

import stagefs
from stagefs.runtime import Runtime
from stagefs.tiers.status import job_status

MiB = 2**20
SIZE = 5 * MiB + 1  # raw, larger than a file read whole, all its pieces kept


@pytest.fixture(scope="module")
def pack(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, bytes]:
    base = tmp_path_factory.mktemp("passes")
    data = random.Random(5).randbytes(SIZE)
    (base / "raw").mkdir()
    (base / "raw" / "big.bin").write_bytes(data)
    stagefs.pack(base / "raw", base / "pack", jobs=1, progress=False, echo=lambda _m: None)
    return base / "pack", data


def _pass(ops: Any, size: int, block: int) -> bytes:
    """One pass over the file from its start in READs of ``block`` bytes, each pair
    answered in the other order (the kernel's read-ahead)."""
    offs = list(range(0, size, block))
    for k in range(1, len(offs) - 1, 2):
        offs[k], offs[k + 1] = offs[k + 1], offs[k]
    got = {off: ops.read("/big.bin", block, off, 0) for off in offs}
    return b"".join(got[k] for k in sorted(got))


def test_each_pass_over_a_kept_large_file_is_counted_once(
        pack: tuple[Path, bytes], tmp_path: Path) -> None:
    path, data = pack
    rt = tmp_path / "rt"
    with stagefs.open(path, tiers=[str(tmp_path / "tier")], runtime=str(rt)) as store:
        ops = _ops(store)
        assert _pass(ops, len(data), MiB) == data
        assert (store.stats.reads, store.stats.bytes) == (1, len(data))
        # the next passes: every piece from the server's memory, once each
        assert _pass(ops, len(data), 128 * 1024) == data
        assert (store.stats.reads, store.stats.bytes) == (2, 2 * len(data))
        assert _pass(ops, len(data), 777_777) == data
        assert (store.stats.reads, store.stats.bytes) == (3, 3 * len(data))
        # a READ further on within a pass is no new pass: nothing more
        assert ops.read("/big.bin", 4096, 3 * MiB, 0) == data[3 * MiB : 3 * MiB + 4096]
        assert (store.stats.reads, store.stats.bytes) == (3, 3 * len(data))
    st = job_status(Runtime(str(rt)))
    assert (st["reads"], st["bytes"]) == (3, 3 * len(data)), st
    assert st["holders"]["memory"] == {"reads": 2, "bytes": 2 * len(data)}, st


def test_a_small_file_read_in_pieces_between_other_files_is_one_sample(
        tmp_path: Path) -> None:
    """A 3 MiB file (read whole) the kernel asks for in READs spread over time (a program
    reading it in pieces, or read-ahead answered late by a busy server), other readers'
    files read between them: one sample, its bytes once. The server let go of it after 64
    other files and read it whole again for its next READ (from the origin where no tier
    held it), counting a second sample."""
    rnd = random.Random(7)
    big = rnd.randbytes(3 * MiB + 5)
    small = [rnd.randbytes(1000 + i) for i in range(80)]
    (tmp_path / "raw").mkdir()
    (tmp_path / "raw" / "big.bin").write_bytes(big)
    for i, b in enumerate(small):
        (tmp_path / "raw" / f"s{i:03d}.bin").write_bytes(b)
    stagefs.pack(tmp_path / "raw", tmp_path / "pack", jobs=1, progress=False,
                 echo=lambda _m: None)
    with stagefs.open(tmp_path / "pack", tiers=[str(tmp_path / "tier")],
                      runtime=str(tmp_path / "rt")) as store:
        ops = _ops(store)
        assert ops.read("/big.bin", 4096, 0, 0) == big[:4096]
        for i, b in enumerate(small):
            assert ops.read(f"/s{i:03d}.bin", 4096, 0, 0) == b
        assert ops.read("/big.bin", MiB, 2 * MiB, 0) == big[2 * MiB : 3 * MiB]
        assert ops.read("/big.bin", 2 * MiB, MiB, 0) == big[MiB : 3 * MiB]
        assert ops.read("/big.bin", MiB, 1 << 62, 0) == b""  # O_DIRECT far past the end
        reads, nbytes = store.stats.reads, store.stats.bytes
    assert (reads, nbytes) == (81, len(big) + sum(map(len, small)))
