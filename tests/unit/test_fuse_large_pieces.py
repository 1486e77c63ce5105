"""The FUSE server's READs of a large file (posix/fuse.py, ``Pieces``), called as libfuse
calls them, without a mount: the kernel asks for a large file in requests of up to 1 MiB
that need not start on a piece, several at once and out of order (its read-ahead); each
piece is read, verified and counted once, so ``stagefs status`` says what was read."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

import stagefs
from stagefs.errors import ConfigError

MiB = 2**20
SIZE = 9 * MiB + 12345


def _ops(store: Any) -> Any:
    from stagefs.posix import fuse

    try:
        fuse._binding()
    except ConfigError as exc:
        pytest.skip(str(exc))
    return fuse._operations(store, "/mnt/ds")


@pytest.fixture(scope="module")
def pack(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, bytes]:
    base = tmp_path_factory.mktemp("large")
    data = random.Random(3).randbytes(SIZE)
    (base / "raw").mkdir()
    (base / "raw" / "big.bin").write_bytes(data)
    stagefs.pack(base / "raw", base / "pack", jobs=1, progress=False, echo=lambda _m: None)
    return base / "pack", data


def _packed(tmp_path: Path, files: dict[str, bytes]) -> None:
    """``files`` written under tmp_path/raw and packed into tmp_path/pack."""
    (tmp_path / "raw").mkdir()
    for name, data in files.items():
        (tmp_path / "raw" / name).write_bytes(data)
    stagefs.pack(tmp_path / "raw", tmp_path / "pack", jobs=1, progress=False,
                 echo=lambda _m: None)


def _kernel_order(size: int, start: int = 7 * 128 * 1024) -> list[tuple[int, int]]:
    """READs as the kernel's read-ahead sent them for ``sha256sum`` of a large file: the
    first ones small, then 1 MiB requests at ``start`` + k MiB (across two pieces each),
    every pair answered in the other order."""
    reads = [(0, 128 * 1024), (128 * 1024, 128 * 1024), (256 * 1024, start - 256 * 1024)]
    at = start
    big = []
    while at < size:
        big.append((at, MiB))
        at += MiB
    for k in range(0, len(big) - 1, 2):
        big[k], big[k + 1] = big[k + 1], big[k]
    return reads + big


def test_each_piece_is_read_and_counted_once_whatever_the_order(
        pack: tuple[Path, bytes]) -> None:
    path, data = pack
    with stagefs.open(path) as store:
        ops = _ops(store)
        got = {off: ops.read("/big.bin", n, off, 0) for off, n in _kernel_order(len(data))}
        assert b"".join(got[k] for k in sorted(got)) == data
        assert (store.stats.reads, store.stats.bytes) == (1, len(data))


def test_reads_past_the_end_and_at_odd_offsets(pack: tuple[Path, bytes]) -> None:
    path, data = pack
    rng = random.Random(4)
    with stagefs.open(path) as store:
        ops = _ops(store)
        for _ in range(200):
            off = rng.randrange(0, len(data) + 3 * MiB)
            n = rng.choice([1, 4095, 4097, MiB - 1, MiB, MiB + 1, 3 * MiB])
            assert ops.read("/big.bin", n, off, 0) == data[off : off + n]
        assert ops.read("/big.bin", MiB, len(data), 0) == b""


def test_many_large_files_read_at_once_read_each_piece_once(tmp_path: Path) -> None:
    """24 large files read at once (xargs -P 24 md5sum, DataLoader workers), their READs
    interleaved and each as the kernel sends it for a sequential read: each piece read and
    counted once, each file one sample. Only the last 16 files' reads were followed: each
    READ of the others found its file let go of and read its pieces again (a piece 1.5-4
    times, a file up to 4 samples)."""
    from stagefs.posix import fuse

    rng = random.Random(9)
    files = {f"f{i:02d}.bin": rng.randbytes(5 * MiB + 1000 * i) for i in range(24)}
    _packed(tmp_path, files)
    with stagefs.open(tmp_path / "pack") as store:
        ops = _ops(store)
        order = {name: _kernel_order(len(data)) for name, data in files.items()}
        got: dict[str, dict[int, bytes]] = {name: {} for name in files}
        for step in range(max(map(len, order.values()))):
            for name, reads in order.items():
                if step < len(reads):
                    off, n = reads[step]
                    got[name][off] = ops.read(f"/{name}", n, off, 0)
        for name, data in files.items():
            assert b"".join(got[name][k] for k in sorted(got[name])) == data
        assert store.stats.reads == len(files)
        assert store.stats.bytes == sum(map(len, files.values()))
        held = sum(r.held() for r in ops._readers.values())
        assert held <= fuse._PIECES_HELD + 2 * store.manifest.piece_size  # + the last READ's


def test_a_file_read_on_from_inside_its_last_piece_keeps_it_when_pieces_are_shed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Large files read at once past the bytes of pieces kept across them: the pieces let
    go of are the oldest, never a file's last one, which its next READ (unaligned: inside
    it) still wants. Let go of, that piece was read again, and a file's piece 0 counted as
    a second sample (25 samples for 24 files, 1 run in 11 of `xargs -P 24 md5sum`)."""
    from stagefs.posix import fuse

    rng = random.Random(11)
    files = {f"f{i}.bin": rng.randbytes(5 * MiB + 999 * i) for i in range(3)}
    _packed(tmp_path, files)
    monkeypatch.setattr(fuse, "_PIECES_HELD", 2 * MiB)  # less than a piece a file
    with stagefs.open(tmp_path / "pack") as store:
        ops = _ops(store)
        half = MiB // 2
        for name in files:  # each file's first half piece: the third sheds the others'
            assert ops.read(f"/{name}", half, 0, 0) == files[name][:half]
        for name in files:  # the rest of each file's piece 0
            assert ops.read(f"/{name}", half, half, 0) == files[name][half:MiB]
        assert store.stats.reads == len(files)  # one sample a file
        assert store.stats.bytes == len(files) * MiB  # each piece read once
