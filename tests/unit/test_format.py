"""The on-disk format: manifest build/read, lookups, version and corruption checks, shard
headers and codecs."""

from __future__ import annotations

import os
import random
import shutil
import struct
from pathlib import Path

import pytest
import zstandard

import stagefs
from conftest import jpeg_bytes, npy_bytes, random_bytes, text_bytes
from stagefs.errors import (
    ChecksumError,
    CorruptManifestError,
    CorruptShardError,
    FormatError,
    StagefsError,
    UnsupportedVersionError,
)
from stagefs.format import (
    KIND_DIR,
    KIND_FILE,
    KIND_SYMLINK,
    MANIFEST_NAME,
    NO_INDEX,
    SUPPORTED_VERSIONS,
    VERSION,
    Manifest,
    ManifestBuilder,
    ShardHeader,
    checksum,
    shard_name,
)
from stagefs.format.codecs import Codec, compress_auto, decode
from stagefs.format.manifest import Entry, ShardInfo
from stagefs.format.spec import MANIFEST_HEADER, SHARD_HEADER
from stagefs.verify import verify_pack

# ------------------------------------------------------------------------------ builders


def _tree_entries() -> list[Entry]:
    """A small namespace: dirs, files, a symlink that resolves and one that dangles."""
    d, f, s = KIND_DIR, KIND_FILE, KIND_SYMLINK
    return [
        Entry(b"", d, 0o40755, 1),
        Entry(b"b", d, 0o40700, 2),
        Entry(b"a", d, 0o40755, 3),
        Entry(b"a/x.txt", f, 0o100644, 4, size=10, shard=0, offset=64, stored=10, checksum=7),
        Entry(b"a/y", f, 0o100600, 5, size=3, shard=1, offset=64, stored=2, codec=1, checksum=9),
        Entry(b"a/sub", d, 0o40755, 6),
        Entry(b"a/sub/z", f, 0o100644, 7, shard=0, offset=79),
        Entry(b"top", f, 0o100644, 8, size=5, shard=0, offset=74, stored=5, checksum=11),
        Entry(b"ln", s, 0o120777, 9, link_target=b"a/x.txt", link_resolved=b"a/x.txt"),
        Entry(b"a/dead", s, 0o120777, 10, link_target=b"../nope", link_resolved=None),
        Entry("b/é n\nx".encode(), f, 0o100644, 11, shard=1, offset=66),
        Entry(b"b/\xff\xfe-raw", f, 0o100644, 12, shard=1, offset=66),
    ]


def _write(path: Path, entries: list[Entry], pack_id: bytes | None = None) -> Path:
    b = ManifestBuilder(pack_id)
    ends: dict[int, int] = {}  # each shard ends where the last of its files does
    for e in entries:
        b.add(e)
        if e.kind == KIND_FILE and e.shard != NO_INDEX:
            ends[e.shard] = max(ends.get(e.shard, 0), e.offset + e.stored)
    b.shards = [ShardInfo(shard_name(i), ends.get(i, SHARD_HEADER.size))
                for i in range(max(ends, default=-1) + 1)]
    b.write(str(path))
    return path


@pytest.fixture
def small_manifest(tmp_path: Path) -> Path:
    return _write(tmp_path / MANIFEST_NAME, _tree_entries(), b"P" * 16)


def test_round_trip_fields(small_manifest: Path) -> None:
    m = Manifest(str(small_manifest))
    try:
        assert len(m) == len(_tree_entries())
        assert m.pack_id == b"P" * 16
        for src in _tree_entries():
            e = m.lookup(src.path)
            assert e >= 0, src.path
            assert m.path_of(e) == src.path
            assert m.kind[e] == src.kind
            assert m.mode[e] == src.mode
            assert m.mtime_ns[e] == src.mtime_ns
            if src.kind == KIND_FILE:
                assert (m.size[e], m.shard[e], m.offset[e], m.stored[e], m.codec[e],
                        m.checksum[e]) == (src.size, src.shard, src.offset, src.stored,
                                           src.codec, src.checksum)
            if src.kind == KIND_SYMLINK:
                assert m.link_target(e) == src.link_target
                assert m.size[e] == len(src.link_target)
        assert m.lookup(b"") == 0
        assert m.first[m.lookup(b"ln")] == m.lookup(b"a/x.txt")
        assert m.first[m.lookup(b"a/dead")] == NO_INDEX
        assert m.name_of(m.lookup(b"a/sub/z")) == b"z"
        assert os.path.exists(str(small_manifest) + ".partial") is False
    finally:
        m.close()


@pytest.mark.parametrize(
    "missing",
    [b"nope", b"a/", b"/a", b"a/x", b"a/x.txt/", b"a/x.txtt", b"A", b"a/sub/z/q", b"\x00",
     b"b/\xff"],
)
def test_lookup_missing(small_manifest: Path, missing: bytes) -> None:
    m = Manifest(str(small_manifest))
    try:
        assert m.lookup(missing) == -1
    finally:
        m.close()


def test_children_ranges(small_manifest: Path) -> None:
    m = Manifest(str(small_manifest))
    try:
        entries = _tree_entries()
        for src in entries:
            e = m.lookup(src.path)
            kids = m.children(e)
            expect = sorted(x.path for x in entries
                            if x.path and x.path.rpartition(b"/")[0] == src.path)
            if src.kind != KIND_DIR:
                assert list(kids) == []
                continue
            assert sorted(m.path_of(c) for c in kids) == expect
            # children are listed in name order, and each one points back at its parent
            assert [m.name_of(c) for c in kids] == sorted(m.name_of(c) for c in kids)
            assert all(m.parent[c] == e for c in kids)
        assert list(m.children(m.lookup(b"a/sub"))) == [m.lookup(b"a/sub/z")]
    finally:
        m.close()


def test_hash_table_with_many_entries(tmp_path: Path) -> None:
    rng = random.Random(5)
    entries = [Entry(b"", KIND_DIR, 0o40755, 0)]
    dirs = [f"d{i:03d}".encode() for i in range(64)]
    entries += [Entry(d, KIND_DIR, 0o40755, 0) for d in dirs]
    names = set()
    while len(names) < 30_000:
        names.add(rng.choice(dirs) + b"/" + rng.randbytes(rng.randint(1, 12)).hex().encode())
    entries += [Entry(n, KIND_FILE, 0o100644, i, shard=0, offset=64)
                for i, n in enumerate(sorted(names))]
    m = Manifest(str(_write(tmp_path / MANIFEST_NAME, entries)))
    try:
        assert len(m) == len(entries)
        # the table has at least one free slot per entry, so a miss always terminates
        assert len(m.slots) >= 2 * len(entries) - 1
        seen = set()
        for src in entries:
            e = m.lookup(src.path)
            assert m.path_of(e) == src.path
            seen.add(e)
        assert len(seen) == len(entries)
        for _ in range(2000):
            assert m.lookup(rng.choice(dirs) + b"/zz" + rng.randbytes(4).hex().encode()) == -1
        total = sum(len(m.children(m.lookup(d))) for d in dirs)
        assert total == len(names)
    finally:
        m.close()


def test_builder_rejects_bad_trees(tmp_path: Path) -> None:
    orphan = [Entry(b"", KIND_DIR, 0o40755, 0), Entry(b"x/y", KIND_FILE, 0o100644, 0)]
    with pytest.raises(ValueError, match="x/y"):
        _write(tmp_path / "m1", orphan)
    dup = [Entry(b"", KIND_DIR, 0o40755, 0), Entry(b"x", KIND_FILE, 0o100644, 0),
           Entry(b"x", KIND_FILE, 0o100644, 0)]
    with pytest.raises(ValueError, match="duplicate"):
        _write(tmp_path / "m2", dup)
    with pytest.raises(ValueError, match="root"):
        _write(tmp_path / "m3", [Entry(b"x", KIND_FILE, 0o100644, 0)])
    assert not any(p.name.startswith("m") for p in tmp_path.iterdir())


# ----------------------------------------------------------------- refused manifests


def _patch(path: Path, offset: int, data: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def test_wrong_version_is_refused(small_manifest: Path) -> None:
    _patch(small_manifest, 8, struct.pack("<I", 99))
    with pytest.raises(UnsupportedVersionError) as info:
        Manifest(str(small_manifest))
    msg = str(info.value)
    assert str(small_manifest) in msg  # the file
    assert "version 99" in msg  # the version found
    assert f"versions {', '.join(map(str, SUPPORTED_VERSIONS))}" in msg  # the ones read
    assert "upgrade" in msg and "re-pack" in msg  # what to do
    assert isinstance(info.value, FormatError) and isinstance(info.value, StagefsError)


@pytest.mark.parametrize("keep", [0, 10, MANIFEST_HEADER.size, -1])
def test_truncated_manifest(small_manifest: Path, keep: int) -> None:
    size = small_manifest.stat().st_size
    os.truncate(small_manifest, keep if keep >= 0 else size + keep)
    with pytest.raises(CorruptManifestError, match=str(small_manifest)) as info:
        Manifest(str(small_manifest))
    assert "truncated" in str(info.value)


def test_flipped_byte_fails_the_checksum(small_manifest: Path) -> None:
    size = small_manifest.stat().st_size
    for off in (MANIFEST_HEADER.size + 3, size // 2, size - 1):
        data = bytearray(small_manifest.read_bytes())
        data[off] ^= 0x10
        bad = small_manifest.with_name(f"bad{off}")
        bad.write_bytes(bytes(data))
        with pytest.raises(CorruptManifestError, match=str(bad)) as info:
            Manifest(str(bad))
        assert "checksum" in str(info.value)


def test_bad_magic(small_manifest: Path) -> None:
    _patch(small_manifest, 0, b"NOTAPACK")
    with pytest.raises(CorruptManifestError, match=str(small_manifest)) as info:
        Manifest(str(small_manifest))
    assert "magic" in str(info.value)


def test_missing_manifest(tmp_path: Path) -> None:
    where = str(tmp_path / MANIFEST_NAME)
    with pytest.raises(CorruptManifestError, match=where):
        Manifest(where)
    # through the public API: a directory that is not a pack
    with pytest.raises(CorruptManifestError, match=str(tmp_path)):
        stagefs.open(tmp_path)


def test_garbage_with_valid_header_and_checksum(tmp_path: Path) -> None:
    """A manifest whose checksum is right but whose metadata is not JSON is still refused."""
    body = b"{not json" + b"\x00" * 40
    meta_off = MANIFEST_HEADER.size
    from xxhash import xxh3_64_intdigest

    from stagefs.format.spec import MANIFEST_MAGIC

    header = MANIFEST_HEADER.pack(MANIFEST_MAGIC, VERSION, 0, meta_off, len(body),
                                  meta_off + len(body), xxh3_64_intdigest(body))
    p = tmp_path / MANIFEST_NAME
    p.write_bytes(header + body)
    with pytest.raises(CorruptManifestError, match=str(p)):
        Manifest(str(p))


# ------------------------------------------------------------------------------ shards


@pytest.fixture
def two_shard_pack(tmp_path: Path) -> Path:
    src = tmp_path / "src"
    src.mkdir()
    for i in range(6):
        (src / f"f{i}").write_bytes(random_bytes(3000, i))
    dest = tmp_path / "pack"
    report = stagefs.pack(src, dest, shard_size=9000, jobs=1, progress=False,
                          echo=lambda _m: None)
    assert report.shards == 2
    return dest


def test_shard_header_round_trip() -> None:
    h = ShardHeader(7, b"Q" * 16, 12345)
    raw = h.encode()
    assert len(raw) == SHARD_HEADER.size == 64
    assert ShardHeader.decode(raw, "x") == h
    with pytest.raises(CorruptShardError, match="where"):
        ShardHeader.decode(raw[:20], "where")
    with pytest.raises(CorruptShardError, match="magic"):
        ShardHeader.decode(b"X" + raw[1:], "where")
    bad_version = raw[:8] + struct.pack("<I", VERSION + 1) + raw[12:]
    with pytest.raises(UnsupportedVersionError, match="where"):
        ShardHeader.decode(bad_version, "where")


def _read_all(pack: Path) -> None:
    with stagefs.open(pack) as fs:
        fs.read_many(sorted(fs.listdir("")))


def _read_all_checked(pack: Path, src: Path) -> None:
    with stagefs.open(pack) as fs:
        names = sorted(fs.listdir(""))
        assert fs.read_many(names) == [(src / n).read_bytes() for n in names]


def test_shard_of_another_pack_with_the_same_bytes(two_shard_pack: Path, tmp_path: Path) -> None:
    """The same source re-packed: every file's bytes are where the manifest says and match
    their checksums, so reads are right; the shard headers are checked only when something
    is wrong (a read's checksum, verify=False, `stagefs verify`)."""
    other = tmp_path / "other"
    stagefs.pack(tmp_path / "src", other, shard_size=9000, jobs=1, progress=False,
                 echo=lambda _m: None)
    shutil.copyfile(other / shard_name(1), two_shard_pack / shard_name(1))
    _read_all_checked(two_shard_pack, tmp_path / "src")
    with stagefs.open(two_shard_pack, verify=False) as fs, \
            pytest.raises(CorruptShardError, match=shard_name(1)) as info:
        fs.read_many(sorted(fs.listdir("")))
    assert "another pack" in str(info.value)
    report = verify_pack(str(two_shard_pack), jobs=1)
    assert not report.ok and all("another pack" in c.reason for c in report.corrupt)
    assert {c.shard for c in report.corrupt} == {shard_name(1)}


def test_shard_of_another_pack(two_shard_pack: Path, tmp_path: Path) -> None:
    src2 = tmp_path / "src2"
    shutil.copytree(tmp_path / "src", src2)
    for f in src2.iterdir():  # same sizes, other bytes
        f.write_bytes(bytes(b ^ 0x5A for b in f.read_bytes()))
    stagefs.pack(src2, tmp_path / "other", shard_size=9000, jobs=1, progress=False,
                 echo=lambda _m: None)
    shutil.copyfile(tmp_path / "other" / shard_name(1), two_shard_pack / shard_name(1))
    with pytest.raises(CorruptShardError, match=shard_name(1)) as info:
        _read_all(two_shard_pack)
    assert "another pack" in str(info.value)


@pytest.mark.parametrize("new_files", [1, 6])
def test_pack_packed_again_under_an_open_store(two_shard_pack: Path, tmp_path: Path,
                                               new_files: int) -> None:
    """`stagefs pack --force` over a pack a Store has open: a shard the Store opened before
    still reads the old bytes; one it had not is gone (1 file: one shard now) or another
    pack's (6 files: two shards), and the error says the pack was packed again and to open
    it again, not to re-pack it (the manifest it has is the old one, and right)."""
    src2 = tmp_path / "src2"
    src2.mkdir()
    for i in range(new_files):
        (src2 / f"f{i}").write_bytes(random_bytes(3000, 100 + i))
    fs = stagefs.open(two_shard_pack)
    assert fs.read("f0") == (tmp_path / "src" / "f0").read_bytes()  # opens shard 0
    stagefs.pack(src2, two_shard_pack, shard_size=9000, jobs=1, progress=False,
                 overwrite=True, echo=lambda _m: None)
    try:
        assert fs.read("f1") == (tmp_path / "src" / "f1").read_bytes()
        with pytest.raises(StagefsError, match=shard_name(1)) as info:
            fs.read("f5")
        assert "was packed again since this process opened it" in str(info.value)
        assert "Open the pack again" in str(info.value)
        assert "re-pack" not in str(info.value)
    finally:
        fs.close()
    with stagefs.open(two_shard_pack) as fs:  # opened again: the new pack
        assert fs.read("f0") == (src2 / "f0").read_bytes()


def test_shard_with_wrong_index(two_shard_pack: Path) -> None:
    s0, s1 = two_shard_pack / shard_name(0), two_shard_pack / shard_name(1)
    tmp = two_shard_pack / "swap"
    os.rename(s0, tmp)
    os.rename(s1, s0)
    os.rename(tmp, s1)
    with pytest.raises(CorruptShardError, match=shard_name(0)) as info:
        _read_all(two_shard_pack)
    assert "expected 0" in str(info.value)


@pytest.mark.parametrize("cut", [1, 5000, SHARD_HEADER.size + 5, 30])
def test_truncated_shard(two_shard_pack: Path, cut: int) -> None:
    shard = two_shard_pack / shard_name(1)
    os.truncate(shard, max(0, shard.stat().st_size - cut) if cut < 100 else cut)
    with pytest.raises(CorruptShardError, match=shard_name(1)):
        _read_all(two_shard_pack)


def test_missing_shard(two_shard_pack: Path) -> None:
    os.unlink(two_shard_pack / shard_name(0))
    with pytest.raises(FileNotFoundError, match=shard_name(0)) as info:
        _read_all(two_shard_pack)
    assert isinstance(info.value, StagefsError)


# ------------------------------------------------------------------------------ codecs


def test_auto_keeps_jpeg_raw() -> None:
    data = jpeg_bytes(100_000, 1)
    assert compress_auto(data, "auto") == (Codec.NONE, data)


@pytest.mark.parametrize("data", [text_bytes(200_000, 2), text_bytes(300, 3), npy_bytes(50_000)],
                         ids=["text", "short-text", "npy"])
def test_auto_compresses_text_and_npy(data: bytes) -> None:
    codec, stored = compress_auto(data, "auto")
    assert codec == Codec.ZSTD and len(stored) < len(data) * 0.95
    assert decode(codec, stored, len(data), "w") == data


def test_auto_keeps_random_raw() -> None:
    for n in (100, 10_000, 300_000):
        data = random_bytes(n, n)
        assert compress_auto(data, "auto") == (Codec.NONE, data)


def test_none_never_compresses() -> None:
    for data in (text_bytes(100_000), npy_bytes(1000), b"\x00" * 50_000):
        assert compress_auto(data, "none") == (Codec.NONE, data)


def test_zstd_always_compresses() -> None:
    for data in (jpeg_bytes(50_000), random_bytes(5000), text_bytes(10), b"x"):
        codec, stored = compress_auto(data, "zstd")
        assert codec == Codec.ZSTD
        assert decode(codec, stored, len(data), "w") == data


def test_empty_file_is_never_compressed() -> None:
    for mode in ("auto", "zstd", "none"):
        assert compress_auto(b"", mode) == (Codec.NONE, b"")


def test_corrupt_zstd_raises() -> None:
    data = text_bytes(50_000, 9)
    stored = zstandard.ZstdCompressor().compress(data)
    with pytest.raises(CorruptShardError, match="shard-x"):
        decode(Codec.ZSTD, stored[: len(stored) // 2], len(data), "shard-x")
    with pytest.raises(CorruptShardError, match="shard-x"):
        decode(Codec.ZSTD, b"\x00" * 100, len(data), "shard-x")
    with pytest.raises(CorruptShardError, match="unknown codec"):
        decode(9, stored, len(data), "shard-x")


def test_corrupt_compressed_file_never_returns_wrong_bytes(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    data = text_bytes(100_000, 4)
    (src / "t.txt").write_bytes(data)
    dest = tmp_path / "pack"
    stagefs.pack(src, dest, compress="zstd", jobs=1, progress=False, echo=lambda _m: None)
    with stagefs.open(dest) as fs:
        m = fs.manifest
        e = m.lookup(b"t.txt")
        assert m.codec[e] == Codec.ZSTD
        offset, stored = int(m.offset[e]), int(m.stored[e])
    shard = dest / shard_name(0)
    for where in (offset + 2, offset + stored // 2, offset + stored - 3):
        raw = bytearray(shard.read_bytes())
        raw[where] ^= 0x5A
        shard.write_bytes(bytes(raw))
        with stagefs.open(dest) as fs:
            with pytest.raises(ChecksumError) as info:
                fs.read("t.txt")
            assert "t.txt" in str(info.value) and shard_name(0) in str(info.value)
            with pytest.raises(ChecksumError):
                fs.read_many(["t.txt", "t.txt"])
            with pytest.raises(ChecksumError), fs.open("t.txt") as f:
                f.read()
        raw[where] ^= 0x5A
        shard.write_bytes(bytes(raw))
    with stagefs.open(dest) as fs:
        assert fs.read("t.txt") == data


def test_checksum_is_xxh3_of_raw_content(sample_store: stagefs.Store) -> None:
    fs = sample_store
    for path in ("a.txt", "data/arr.npy", "img/cat.jpg"):
        e = fs.manifest.lookup(path.encode())
        assert fs.manifest.checksum[e] == checksum(fs.read(path))


def test_bit_flips_in_a_zstd_frame_never_raise_anything_else() -> None:
    """A flipped bit may make the frame header declare any size: decode must neither trust
    it (MemoryError, a huge allocation) nor fail with anything but CorruptShardError."""
    data = text_bytes(100_000, 1)
    stored = zstandard.ZstdCompressor(level=3).compress(data)
    refused = 0
    for i in range(min(len(stored), 40)):
        for bit in range(8):
            bad = bytearray(stored)
            bad[i] ^= 1 << bit
            try:
                out = decode(Codec.ZSTD, bytes(bad), len(data), "shard-y")
            except CorruptShardError as exc:
                assert "shard-y" in str(exc)
                refused += 1
            else:
                assert isinstance(out, bytes) and len(out) <= len(data)
    assert refused > 100
