"""A compressed file is decoded whole, into memory, by every reader (read, a file object,
FUSE, the preload helper). A tiny crafted zstd frame of RLE blocks decodes to 32768 times
its size, so a manifest may say a 3 MB stored file is 100 GB and stay within zstd's ratio:
every read of it allocated what the manifest said (a MemoryError from inside the decoder, or
the node's memory). No pack stores a file over ``MAX_COMPRESSED`` compressed (the packer
copies a larger one raw), so a manifest that says otherwise is refused when opened."""

from __future__ import annotations

import logging
import os
import stat as st
import struct
from pathlib import Path

import pytest
import zstandard
from xxhash import xxh3_64_intdigest

import stagefs
from stagefs.errors import CorruptManifestError
from stagefs.format import KIND_DIR, KIND_FILE, MANIFEST_NAME
from stagefs.format.codecs import MAX_COMPRESSED, Codec
from stagefs.format.manifest import Entry, ManifestBuilder, ShardInfo
from stagefs.format.shard import ShardWriter, shard_name

PACK_ID = bytes(range(16))
_BLOCK = 1 << 17  # zstd's largest block


def rle_frame(size: int) -> bytes:
    """One zstd frame that decodes to ``size`` zero bytes: a header with the content size,
    then RLE blocks of 4 bytes each (3 of header, 1 repeated byte) for 128 KiB each."""
    out = [b"\x28\xb5\x2f\xfd", b"\xe0", struct.pack("<Q", size)]  # single segment, 8-byte size
    sizes = [_BLOCK] * (size // _BLOCK) + ([size % _BLOCK] if size % _BLOCK else [])
    for i, n in enumerate(sizes):
        header = int(i == len(sizes) - 1) | (1 << 1) | (n << 3)  # last?, type RLE, size
        out.append(header.to_bytes(3, "little") + b"\x00")
    return b"".join(out)


def write_pack(dest: Path, stored: bytes, size: int, checksum: int) -> None:
    """A pack of one zstd file ``big.bin`` (``stored``, said to be ``size`` bytes) and a raw
    ``ok.txt``."""
    dest.mkdir()
    b = ManifestBuilder(PACK_ID)
    b.add(Entry(b"", KIND_DIR, st.S_IFDIR | 0o755, 0))
    w = ShardWriter(str(dest / shard_name(0)), 0, PACK_ID)
    off = w.append(stored)
    ok = w.append(b"hello")
    w.close()
    b.shards.append(ShardInfo(shard_name(0), w.position))
    b.add(Entry(b"big.bin", KIND_FILE, st.S_IFREG | 0o644, 0, size=size, shard=0, offset=off,
                stored=len(stored), codec=int(Codec.ZSTD), checksum=checksum))
    b.add(Entry(b"ok.txt", KIND_FILE, st.S_IFREG | 0o644, 0, size=5, shard=0, offset=ok,
                stored=5, codec=int(Codec.NONE), checksum=xxh3_64_intdigest(b"hello")))
    b.write(str(dest / MANIFEST_NAME))


def test_the_crafted_frame_is_what_it_claims() -> None:
    """The frame the tests craft is a real zstd frame of the size it says."""
    frame = rle_frame(3 * _BLOCK + 5)
    assert zstandard.frame_content_size(frame) == 3 * _BLOCK + 5
    assert zstandard.ZstdDecompressor().decompress(frame) == bytes(3 * _BLOCK + 5)


@pytest.mark.parametrize("size", [MAX_COMPRESSED + 1, 2**31, 100 * 10**9])
def test_a_zstd_bomb_is_refused_when_the_pack_is_opened(tmp_path: Path, size: int) -> None:
    """Within zstd's ratio (4 bytes for each 128 KiB), so the ratio rule let it through, and
    each read decoded it into a buffer of ``size`` bytes. (100 GB: the frame's header and as
    many bytes as the ratio asks; the reader refuses it before it looks at them.)"""
    frame = rle_frame(size) if size <= 2**31 else rle_frame(0)[:13] + bytes(size // 32768)
    frame = frame[:5] + struct.pack("<Q", size) + frame[13:]
    assert size // 32768 <= len(frame)
    write_pack(tmp_path / "p", frame, size, 0)
    with pytest.raises(CorruptManifestError) as info:
        stagefs.open(tmp_path / "p")
    msg = str(info.value)
    assert "big.bin" in msg and "zstd" in msg and str(size) in msg
    assert str(tmp_path / "p" / MANIFEST_NAME) in msg


def test_the_largest_compressed_file_a_packer_writes_still_reads(tmp_path: Path) -> None:
    data = bytes(MAX_COMPRESSED)
    stored = zstandard.ZstdCompressor(level=1).compress(data)
    write_pack(tmp_path / "p", stored, len(data), xxh3_64_intdigest(data))
    with stagefs.open(tmp_path / "p") as fs:
        assert fs.read("big.bin") == data
        assert fs.read("ok.txt") == b"hello"


def test_the_packer_stores_a_file_over_the_bound_raw(tmp_path: Path) -> None:
    """The other half of the rule: what the packer writes, a reader opens."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "big.txt").write_bytes(b"compressible text\n" * (MAX_COMPRESSED // 18 + 2))
    (src / "small.txt").write_bytes(b"compressible text\n" * 1000)
    stagefs.pack(src, tmp_path / "p", jobs=1, progress=False, echo=lambda _m: None)
    with stagefs.open(tmp_path / "p") as fs:
        m = fs.manifest
        codec = {os.fsdecode(m.path_of(e)): int(m.codec[e]) for e in m.files()}
        assert codec == {"big.txt": Codec.NONE, "small.txt": Codec.ZSTD}


@pytest.mark.parametrize("compress", ["zstd", "auto"])
def test_zstd_asked_for_a_file_over_the_bound_says_it_is_stored_raw(
        tmp_path: Path, compress: str, caplog: pytest.LogCaptureFixture) -> None:
    """``--compress zstd`` of a 300 MB log stored it raw (x1.00) without a word; ``auto``
    says in its help that such files are stored raw, and is not warned of each time."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "big.txt").write_bytes(b"compressible text\n" * (MAX_COMPRESSED // 18 + 2))
    (src / "small.txt").write_bytes(b"compressible text\n" * 1000)
    with caplog.at_level(logging.WARNING, logger="stagefs"):
        report = stagefs.pack(src, tmp_path / "p", compress=compress, jobs=1, progress=False,
                              echo=lambda _m: None)
    said = [r.getMessage() for r in caplog.records if "stored raw" in r.getMessage()]
    if compress == "zstd":
        assert report.raw_over_max == 1
        assert len(said) == 1 and "1 file(s) over 64.0 MiB stored raw" in said[0], said
    else:
        assert report.raw_over_max == 0 and not said
