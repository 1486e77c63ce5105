"""Never wrong bytes: large raw files read by range are verified by piece (format version 2),
a version 1 pack verifies a file whole before its first range read, and a bad holder is
passed over for the next one (counted, logged, dropped)."""

from __future__ import annotations

import logging
import shutil
import struct
from collections.abc import Iterator
from pathlib import Path

import pytest

import stagefs
from conftest import flip_byte, random_bytes, reseal_manifest
from stagefs.errors import ChecksumError, CorruptManifestError
from stagefs.format import KIND_FILE, MANIFEST_NAME, PIECE, Manifest, ManifestBuilder
from stagefs.format.checksum import piece_sums
from stagefs.format.manifest import Entry, ShardInfo
from stagefs.format.spec import SHARD_HEADER
from stagefs.verify import verify_pack

MiB = 2**20
FILES = {  # raw (random) files of several MiB, none a multiple of the piece size
    "big/a.bin": random_bytes(5 * MiB + 12_345, 1),
    "big/b.bin": random_bytes(7 * MiB + 999, 2),
    "big/c.bin": random_bytes(9 * MiB - 777, 3),
    "small.bin": random_bytes(70_000, 4),
}
VICTIM = "big/b.bin"
BAD_AT = 3 * MiB + 100  # a byte of piece 3 of VICTIM


@pytest.fixture(scope="module")
def clean_pack(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.mktemp("ranges")
    for rel, data in FILES.items():
        p = base / "src" / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)
    stagefs.pack(base / "src", base / "pack", jobs=1, progress=False, echo=lambda _m: None)
    return base / "pack"


@pytest.fixture
def pack(clean_pack: Path, tmp_path: Path) -> Path:
    shutil.copytree(clean_pack, tmp_path / "pack")
    return tmp_path / "pack"


def _where(pack: Path, rel: str) -> tuple[str, int]:
    """The shard file name and the shard offset of ``rel``'s first byte."""
    m = Manifest(str(pack / MANIFEST_NAME))
    try:
        e = m.lookup(rel.encode())
        return m.shards[m.shard[e]].name, int(m.offset[e])
    finally:
        m.close()



def _corrupt_origin(pack: Path, rel: str = VICTIM, at: int = BAD_AT) -> str:
    name, off = _where(pack, rel)
    flip_byte(pack / name, off + at, 0x5A)
    return name


# ----------------------------------------------------------------------------- the format


def test_pack_writes_piece_checksums_of_large_raw_files(clean_pack: Path) -> None:
    m = Manifest(str(clean_pack / MANIFEST_NAME))
    try:
        assert m.version >= 2 and m.piece_size == PIECE  # pieces came with version 2
        assert m.meta["piece_size"] == PIECE
        for rel, data in FILES.items():
            sums = m.piece_sums(m.lookup(rel.encode()))
            if len(data) > PIECE:
                assert sums is not None and list(sums) == piece_sums(data, PIECE), rel
            else:
                assert sums is None, rel
    finally:
        m.close()


def test_piece_index_beyond_the_array_is_a_format_error(tmp_path: Path) -> None:
    data = FILES["big/a.bin"]
    b = ManifestBuilder()
    b.add(Entry(b"", 1, 0o40755, 0))
    b.add(Entry(b"a", KIND_FILE, 0o100644, 0, len(data), 0, SHARD_HEADER.size, len(data), 0,
                0, pieces=piece_sums(data, PIECE)))
    b.shards.append(ShardInfo("shard-000000.sfs", SHARD_HEADER.size + len(data)))
    raw = bytearray(b.encode())
    path = tmp_path / MANIFEST_NAME
    path.write_bytes(bytes(raw))
    m = Manifest(str(path))
    _, off, _ = m.meta["arrays"]["piece"]
    m.close()
    raw[off + 4 : off + 8] = struct.pack("<I", 3)  # entry 1's first piece: 3 of 6
    bad = tmp_path / "bad.sfm"
    bad.write_bytes(bytes(raw))
    with pytest.raises(CorruptManifestError, match=r"'a' has piece checksums 3\+6 of 6"):
        Manifest(str(bad), verify=False)  # refused at open, before any read


# ------------------------------------------------------------------- range reads, origin


def test_range_reads_verify_only_the_pieces_they_cover(pack: Path) -> None:
    shard = _corrupt_origin(pack)
    data = FILES[VICTIM]
    with stagefs.open(pack) as fs:
        st = fs.origin.stats
        with fs.open(VICTIM) as f:
            before = st.bytes_read
            f.seek(5 * MiB - 10)
            assert f.read(20) == data[5 * MiB - 10 : 5 * MiB + 10]
            assert st.bytes_read - before == 2 * PIECE  # pieces 4 and 5, nothing else
            before = st.bytes_read
            f.seek(len(data) - 5)
            assert f.read(100) == data[-5:]
            assert st.bytes_read - before == len(data) % PIECE  # the short last piece
            f.seek(BAD_AT - 50)
            with pytest.raises(ChecksumError) as info:
                f.read(100)
        assert VICTIM in str(info.value) and shard in str(info.value)
        assert "origin" in str(info.value)  # the holders tried
        e = fs.namespace.file_entry(VICTIM)
        before = st.bytes_read
        assert fs.read_entry(e, VICTIM, 6 * MiB + 1, 1000) == data[6 * MiB + 1 : 6 * MiB + 1001]
        assert st.bytes_read - before == PIECE
        with pytest.raises(ChecksumError, match=VICTIM):
            fs.read_entry(e, VICTIM, 2 * MiB, 2 * MiB)
        with pytest.raises(ChecksumError, match=VICTIM):
            fs.read(VICTIM)
        with pytest.raises(ChecksumError, match=VICTIM):
            fs.read_many(["big/a.bin", VICTIM])
        assert fs.read_many(["big/a.bin", "big/c.bin"]) == [FILES["big/a.bin"],
                                                            FILES["big/c.bin"]]


def test_the_error_names_the_bad_piece(pack: Path) -> None:
    """Which bytes of a damaged large file cannot be read: the piece and its range, for a
    range over it and for the whole file (the other pieces still read)."""
    _corrupt_origin(pack)
    bad = "piece 3, bytes 3145728-4194303 of the file"
    with stagefs.open(pack) as fs:
        e = fs.namespace.file_entry(VICTIM)
        for read in (lambda: fs.read_entry(e, VICTIM, BAD_AT, 10), lambda: fs.read(VICTIM),
                     lambda: fs.read_many([VICTIM, "small.bin"])):
            with pytest.raises(ChecksumError, match=VICTIM) as info:
                read()
            assert bad in str(info.value)
        assert fs.read_entry(e, VICTIM, 4 * MiB, 10) == FILES[VICTIM][4 * MiB : 4 * MiB + 10]


def test_a_range_before_the_file_is_refused(clean_pack: Path) -> None:
    with stagefs.open(clean_pack) as fs:
        for rel in ("big/a.bin", "small.bin"):
            e = fs.namespace.file_entry(rel)
            with pytest.raises(ValueError, match=f"{rel}: a range starts at .* not -5"):
                fs.read_entry(e, rel, -5, 3)


def test_sequential_reads_read_each_piece_once(clean_pack: Path) -> None:
    data = FILES["big/c.bin"]
    with stagefs.open(clean_pack) as fs:
        st = fs.origin.stats
        before = st.bytes_read
        with fs.open("big/c.bin", buffering=64 * 1024) as f:
            got = b"".join(iter(lambda: f.read(300_000), b""))
        assert got == data
        assert st.bytes_read - before == len(data)


# --------------------------------------------------------------- a corrupt tier copy


@pytest.mark.parametrize("how", ["range", "read", "read_many"])
def test_corrupt_tier_copy_is_passed_over(pack: Path, tmp_path: Path, runtime: Path,
                                          caplog: pytest.LogCaptureFixture, how: str) -> None:
    caplog.set_level(logging.WARNING, logger="stagefs")
    data = FILES[VICTIM]
    with stagefs.open(pack, tiers=[str(tmp_path / "tier")]) as fs:
        assert fs.chain is not None
        fs.chain.stage()
        e = fs.namespace.file_entry(VICTIM)
        shard = int(fs.manifest.shard[e])
        name = fs.manifest.shards[shard].name
        flip_byte(fs.chain.tiers[0].path(shard), int(fs.manifest.offset[e]) + BAD_AT, 0x5A)
        if how == "range":
            with fs.open(VICTIM) as f:
                f.seek(BAD_AT - 50)
                assert f.read(100) == data[BAD_AT - 50 : BAD_AT + 50]
        elif how == "read":
            assert fs.read(VICTIM) == data
        else:
            assert fs.read_many(["small.bin", VICTIM]) == [FILES["small.bin"], data]
        assert fs.stats.checksum_failures == 1
        assert fs.chain.tiers[0].stats.dropped == 1
    bad = [r.getMessage() for r in caplog.records if r.name == "stagefs"]
    assert len(bad) == 1 and name in bad[0] and VICTIM in bad[0], bad


# ------------------------------------------------------------------------- version 1


def _as_version_1(pack: Path) -> None:
    """Rewrite the pack in the version 1 layout: no piece checksums, v1 headers."""
    path = str(pack / MANIFEST_NAME)
    m = Manifest(path)
    b = ManifestBuilder(m.pack_id, version=1)
    for e in range(len(m)):
        b.add(Entry(m.path_of(e), m.kind[e], m.mode[e], m.mtime_ns[e], m.size[e], m.shard[e],
                    m.offset[e], m.stored[e], m.codec[e], m.checksum[e]))
    b.shards = list(m.shards)
    b.meta = {k: v for k, v in m.meta.items() if k in ("options", "source")}
    m.close()
    b.write(path)
    for s in pack.glob("shard-*.sfs"):
        with open(s, "r+b") as f:
            f.seek(8)
            f.write(struct.pack("<I", 1))


@pytest.fixture
def v1_pack(pack: Path) -> Iterator[Path]:
    _as_version_1(pack)
    yield pack


def test_version_1_pack_reads_ranges_verified(v1_pack: Path,
                                             caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="stagefs")
    shard = _corrupt_origin(v1_pack)
    data = FILES["big/c.bin"]
    with stagefs.open(v1_pack) as fs:
        assert fs.manifest.version == 1 and fs.manifest.piece_sums(1) is None
        st = fs.origin.stats
        before = st.bytes_read
        with fs.open("big/c.bin") as f:
            f.seek(4 * MiB + 3)
            assert f.read(10) == data[4 * MiB + 3 : 4 * MiB + 13]
            # the first range read verifies the whole file once, then reads the piece
            # that holds the ten bytes (the reader's 1 MiB buffer straddles two)
            assert st.bytes_read - before == len(data) + PIECE
            before = st.bytes_read
            f.seek(8 * MiB)
            assert f.read(10) == data[8 * MiB : 8 * MiB + 10]
            assert st.bytes_read - before == len(data) - 8 * MiB  # the last piece only
        with fs.open(VICTIM) as f:  # a range over intact pieces of a corrupt file
            f.seek(6 * MiB)
            with pytest.raises(ChecksumError) as info:
                f.read(10)
        assert VICTIM in str(info.value) and shard in str(info.value)
        assert fs.read_many(["big/a.bin", "small.bin"]) == [FILES["big/a.bin"],
                                                            FILES["small.bin"]]
    notices = [r.getMessage() for r in caplog.records if "version 1" in r.getMessage()]
    assert len(notices) == 1 and "Re-pack" in notices[0]
    assert verify_pack(str(v1_pack), jobs=1, progress=False).corrupt[0].path == VICTIM


# ------------------------------------------------------------------------ stagefs verify


def test_verify_checks_the_piece_checksums(pack: Path) -> None:
    path = str(pack / MANIFEST_NAME)
    m = Manifest(path)
    _, off, _ = m.meta["arrays"]["pieces"]
    m.close()
    raw = bytearray((pack / MANIFEST_NAME).read_bytes())
    raw[off + 8 * 2] ^= 1  # the third piece checksum of the first large file
    reseal_manifest(raw)
    (pack / MANIFEST_NAME).write_bytes(bytes(raw))
    report = verify_pack(str(pack), jobs=1, progress=False)
    assert [(c.path, c.reason) for c in report.corrupt] == [
        ("big/a.bin", "piece 2 does not match its checksum")]
