"""The origin's reads for the tiers past the page cache (PackOrigin.pread_through): the same
bytes as pread for any range, each page moved once by a stream reading a shard in order,
short and missing ranges named as pread names them, and the page cache where O_DIRECT is
refused or turned off."""

from __future__ import annotations

import errno
import os
import random
from pathlib import Path

import pytest

import stagefs
from stagefs.format import MANIFEST_NAME, Manifest
from stagefs.tiers.base import ShortRead, SourceUnavailable, through
from stagefs.tiers.origin import ALIGN, BULK_READ, PackOrigin


@pytest.fixture(scope="module")
def pack(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.mktemp("direct")
    rng = random.Random(7)
    raw = base / "raw"
    raw.mkdir()
    for i in range(40):  # sizes that put every file boundary off a page boundary
        (raw / f"f{i:02d}.bin").write_bytes(rng.randbytes(rng.randrange(50_000, 400_000)))
    stagefs.pack(raw, base / "pack", shard_size="6MiB", jobs=1, compress="none",
                 progress=False, echo=lambda _m: None)
    return base / "pack"


def _origin(pack: Path) -> tuple[PackOrigin, Manifest, bytes]:
    m = Manifest(str(pack / MANIFEST_NAME))
    return PackOrigin(str(pack), m), m, (pack / m.shards[0].name).read_bytes()


def test_ranges_read_past_the_cache_are_the_bytes_of_pread(pack: Path) -> None:
    origin, _, shard = _origin(pack)
    rng = random.Random(1)
    try:
        for _ in range(30):
            n = rng.randrange(BULK_READ, 3 * BULK_READ)
            at = rng.randrange(0, len(shard) - n)
            assert origin.pread_through(0, at, n) == shard[at : at + n]
        # the last bytes of the shard, ending at its end
        assert origin.pread_through(0, len(shard) - BULK_READ, BULK_READ) == shard[-BULK_READ:]
        # below BULK_READ: a sample's read, through the page cache as pread
        assert origin.pread_through(0, 1234, 5000) == shard[1234:6234]
        assert origin.descriptors("direct"), "the large reads went past the page cache"
    finally:
        origin.close()


@pytest.mark.parametrize("view", [False, True])
def test_a_stream_in_order_moves_each_page_once(pack: Path, monkeypatch: pytest.MonkeyPatch,
                                                view: bool) -> None:
    """Each range the bytes of pread, each page moved once; ``view``: as a view of the read
    buffer (a stream's chunks: written and checked before the next read), taken as it
    comes."""
    origin, _, shard = _origin(pack)
    rng = random.Random(2)
    got, pos = [], 0
    pages: list[int] = []  # the pages each read past the cache asked of the file system
    real = os.preadv

    def seen(fd: int, bufs: list[memoryview], at: int) -> int:
        n = real(fd, bufs, at)
        if n > 0 and fd in origin.descriptors("direct").values():
            pages.extend(range(at // ALIGN, -(-(at + n) // ALIGN)))
        return n

    monkeypatch.setattr(os, "preadv", seen)
    try:
        while pos < len(shard):  # runs of files: boundaries anywhere in a page
            n = min(len(shard) - pos, rng.randrange(BULK_READ, 2 * BULK_READ) + rng.randrange(ALIGN))
            data = through(origin, view=view)(0, pos, n)
            assert isinstance(data, memoryview) == view  # a view: no copy of the chunk
            got.append(bytes(data))
            pos += n
        assert b"".join(got) == shard
        assert origin.stats.bytes_read == len(shard)  # as asked, each byte once
        # and each page moved once: the part of a read's last page past its range starts
        # the next read, not read again
        assert sorted(pages) == list(range(-(-len(shard) // ALIGN)))
    finally:
        origin.close()


def test_a_view_held_while_the_buffer_grows_keeps_its_bytes(pack: Path) -> None:
    """A view of the read buffer still held when a larger read needs a larger buffer: the
    old buffer is let go of, not closed under the view (closing it raised BufferError)."""
    origin, _, shard = _origin(pack)
    try:
        first = origin.pread_through(0, 0, BULK_READ, view=True)
        more = origin.pread_through(0, BULK_READ, len(shard) - BULK_READ, view=True)
        assert first == shard[:BULK_READ]
        assert more == shard[BULK_READ:]
    finally:
        origin.close()


def test_short_and_missing_ranges_are_named(pack: Path, tmp_path: Path) -> None:
    origin, m, shard = _origin(pack)
    try:
        with pytest.raises(SourceUnavailable, match="no range"):
            origin.pread_through(0, len(shard) - 1000, BULK_READ)
    finally:
        origin.close()
    cut = tmp_path / "cut"
    cut.mkdir()
    for name in os.listdir(pack):
        os.symlink(pack / name, cut / name)
    first = m.shards[0].name
    os.unlink(cut / first)
    keep = len(shard) - 3 * ALIGN - 17
    (cut / first).write_bytes(shard[:keep])  # cut short after the pack was made
    origin = PackOrigin(str(cut), m)
    try:
        at = keep - BULK_READ + 1000  # in the shard by the manifest, past its cut
        with pytest.raises(ShortRead) as info:
            origin.pread_through(0, at, BULK_READ, view=True)
        assert info.value.got == shard[at:keep]
        assert isinstance(info.value.got, bytes)  # kept by the error: not the buffer's
        assert "truncated" in str(info.value)
    finally:
        origin.close()


def test_turned_off_or_refused_it_reads_through_the_page_cache(
        pack: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STAGEFS_ORIGIN_DIRECT", "0")
    origin, _, shard = _origin(pack)
    try:
        assert origin.pread_through(0, 100, 2 * BULK_READ) == shard[100 : 100 + 2 * BULK_READ]
        assert not origin.descriptors("direct")
    finally:
        origin.close()
    monkeypatch.delenv("STAGEFS_ORIGIN_DIRECT")
    origin, _, shard = _origin(pack)
    real = os.preadv

    def refused(fd: int, bufs: list[memoryview], at: int) -> int:
        if fd in origin.descriptors("direct").values():  # a file system that takes no O_DIRECT reads
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))
        return real(fd, bufs, at)

    monkeypatch.setattr(os, "preadv", refused)
    try:
        for at in (0, 5000, 3 * BULK_READ):
            assert origin.pread_through(0, at, BULK_READ) == shard[at : at + BULK_READ]
    finally:
        origin.close()


def test_a_bad_switch_is_named(pack: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STAGEFS_ORIGIN_DIRECT", "maybe")
    with pytest.raises(stagefs.ConfigError, match="STAGEFS_ORIGIN_DIRECT"):
        _origin(pack)
