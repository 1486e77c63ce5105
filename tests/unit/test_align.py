"""File alignment in shards (docs/FORMAT.md, "File alignment"): raw files of at least
64 KiB start at a multiple of 4096 in their shard, the padding is zeros and counted in no
file, a crafted alignment is refused, and a tier's copy of a shard (placed whole, or filled
by reads) keeps every offset."""

from __future__ import annotations

import struct
import subprocess
import sys
from pathlib import Path

import pytest
from test_fill import hold_claims

import stagefs
from conftest import patch_manifest, random_bytes, reseal_manifest, text_bytes
from stagefs.errors import CorruptManifestError, PackError
from stagefs.format import MANIFEST_NAME, Manifest
from stagefs.format.spec import FILE_ALIGN, FILE_ALIGN_MIN, SHARD_HEADER
from stagefs.format.validate import FileAlign

SIZES = {  # raw unless said: which are aligned follows from size and codec
    "a/big0.bin": 70_000, "a/big1.bin": 100_003, "a/small.bin": 1_000, "b/huge.bin": 1_500_000,
    "b/tiny.bin": 5, "b/edge.bin": FILE_ALIGN_MIN, "b/under.bin": FILE_ALIGN_MIN - 1,
    "c/empty.bin": 0, "c/big2.bin": 90_001,
}


def make_tree(root: Path) -> dict[str, bytes]:
    files = {rel: random_bytes(n, i) for i, (rel, n) in enumerate(SIZES.items())}
    files["c/text.txt"] = text_bytes(200_000)  # zstd: never aligned
    for rel, data in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    return files


@pytest.fixture(scope="module")
def tree(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, bytes]]:
    root = tmp_path_factory.mktemp("align") / "raw"
    return root, make_tree(root)


def do_pack(src: Path, dest: Path, **kw: object) -> stagefs.PackReport:
    return stagefs.pack(src, dest, shard_size="256KiB", jobs=1, progress=False,
                        echo=lambda _m: None, **kw)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def aligned(tree: tuple[Path, dict[str, bytes]], tmp_path_factory: pytest.TempPathFactory
            ) -> tuple[Path, stagefs.PackReport]:
    dest = tmp_path_factory.mktemp("aligned") / "pack"
    return dest, do_pack(tree[0], dest)


def layout(pack: Path) -> dict[str, tuple[int, int, int, int]]:
    """path -> (shard, offset, stored, codec)."""
    m = Manifest(str(pack / MANIFEST_NAME))
    try:
        return {m.path_of(e).decode(): (int(m.shard[e]), int(m.offset[e]), int(m.stored[e]),
                                        int(m.codec[e])) for e in m.files()}
    finally:
        m.close()


def test_raw_files_from_the_threshold_start_on_a_page(
        tree: tuple[Path, dict[str, bytes]], aligned: tuple[Path, stagefs.PackReport]) -> None:
    pack, report = aligned
    files = tree[1]
    where = layout(pack)
    for rel, (_shard, off, _stored, codec) in where.items():
        want = codec == 0 and len(files[rel]) >= FILE_ALIGN_MIN
        assert (off % FILE_ALIGN == 0) or not want, (rel, off)
    assert where["c/text.txt"][3] == 1  # compressed: left where it falls
    # small files are not padded: each follows the file before it directly
    pad, end = 0, {}  # shard -> where its last file ended
    for rel, (s, off, n, codec) in sorted(where.items(), key=lambda kv: kv[1][:2]):
        gap = off - end.get(s, SHARD_HEADER.size)
        end[s] = off + n
        pad += gap
        if codec or len(files[rel]) < FILE_ALIGN_MIN:
            assert gap == 0, rel
        else:
            assert 0 <= gap < FILE_ALIGN, rel
    assert report.padding_bytes == pad > 0
    with stagefs.open(pack) as fs:
        assert fs.manifest.align == FileAlign(FILE_ALIGN, FILE_ALIGN_MIN)


def test_padding_is_zeros_and_reads_are_exact(
        tree: tuple[Path, dict[str, bytes]], aligned: tuple[Path, stagefs.PackReport]) -> None:
    pack, _ = aligned
    files = tree[1]
    m = Manifest(str(pack / MANIFEST_NAME))
    shards = [(pack / s.name).read_bytes() for s in m.shards]
    m.close()
    covered = [bytearray(len(s)) for s in shards]
    for _rel, (s, off, n, _c) in layout(pack).items():
        covered[s][off : off + n] = b"\1" * n
    for data, cov in zip(shards, covered, strict=True):
        gaps = bytes(b for b, c in zip(data[SHARD_HEADER.size :], cov[SHARD_HEADER.size :],
                                       strict=True) if not c)
        assert gaps == bytes(len(gaps))
    with stagefs.open(pack) as fs:
        for rel, data in files.items():
            assert fs.read(rel) == data, rel
            assert fs.stat(rel).st_size == len(data)


@pytest.mark.parametrize("off", [0, 1])
def test_align_off_packs_back_to_back(tree: tuple[Path, dict[str, bytes]], tmp_path: Path,
                                      off: int) -> None:
    report = do_pack(tree[0], tmp_path / "p", align=off)
    assert report.padding_bytes == 0
    m = Manifest(str(tmp_path / "p" / MANIFEST_NAME))
    try:
        assert "align" not in m.meta and m.align == FileAlign()
        ends = {}
        for e in m.files():
            s = int(m.shard[e])
            assert int(m.offset[e]) == ends.get(s, SHARD_HEADER.size)
            ends[s] = int(m.offset[e] + m.stored[e])
    finally:
        m.close()


def test_align_zero_threshold_and_other_boundaries(tree: tuple[Path, dict[str, bytes]],
                                                    tmp_path: Path) -> None:
    do_pack(tree[0], tmp_path / "p", align=65536, align_min=0)
    for rel, (_s, off, _n, codec) in layout(tmp_path / "p").items():
        if codec == 0 and tree[1][rel]:
            assert off % 65536 == 0, rel
    with stagefs.open(tmp_path / "p") as fs:
        assert all(fs.read(rel) == data for rel, data in tree[1].items())


@pytest.mark.parametrize("bad", [3000, 2, -4096, 1 << 31])
def test_bad_align_is_refused(tree: tuple[Path, dict[str, bytes]], tmp_path: Path,
                              bad: int) -> None:
    if bad == 2:
        do_pack(tree[0], tmp_path / "p", align=bad)  # 2 is a power of two: accepted
        return
    with pytest.raises(PackError, match=rf"--align {bad}: give a power of two"):
        do_pack(tree[0], tmp_path / "p", align=bad)
    assert not (tmp_path / "p" / MANIFEST_NAME).exists()


def test_cli_align(tree: tuple[Path, dict[str, bytes]], tmp_path: Path) -> None:
    run = [sys.executable, "-m", "stagefs", "pack", str(tree[0])]
    bad = subprocess.run([*run, str(tmp_path / "bad"), "--align", "3000"], capture_output=True,
                         text=True, check=False)
    assert bad.returncode != 0 and "--align 3000: give a power of two" in bad.stderr
    ok = subprocess.run([*run, str(tmp_path / "ok"), "--align", "8KiB"], capture_output=True,
                        text=True, check=True)
    assert "of alignment padding" in ok.stdout
    for rel, (_s, off, _n, codec) in layout(tmp_path / "ok").items():
        if codec == 0 and len(tree[1][rel]) >= FILE_ALIGN_MIN:
            assert off % 8192 == 0, rel


# ------------------------------------------------------------------ a crafted alignment

ALIGN_JSON = b'"align": {"min_size": 65536, "to": 4096}'


@pytest.mark.parametrize(("new", "message"), [
    (b'"align": {"min_size": 65536, "to": 4095}', "align.to is 4095, not a power of two"),
    (b'"align": {"min_size": 65536, "to": 0   }', "align.to is 0, not a power of two"),
    (b'"align": {"min_size":0, "to":2147483648}', "align.to is 2147483648, not a power of two"),
    (b'"align": {"min_size": 65536, "to": "4k"}', "align is {'min_size': 65536, 'to': '4k'}"),
    (b'"align": [65536, 4096]                  ', "align is [65536, 4096], not"),
    (b'"align": {"min_size":    -1, "to": 4096}', "align.min_size is -1"),
    # the promise is wider than what was written: small raw files are not aligned
    (b'"align": {"min_size":     1, "to": 4096}', "does not start at a multiple of 4096"),
    (b'"align": {"min_size": 65536, "to": 8192}', "does not start at a multiple of 8192"),
])
def test_crafted_alignment_is_refused(aligned: tuple[Path, stagefs.PackReport],
                                      tmp_path: Path, new: bytes, message: str) -> None:
    assert len(new) == len(ALIGN_JSON)
    copy = tmp_path / "pack"
    copy.mkdir()
    for p in aligned[0].iterdir():
        (copy / p.name).write_bytes(p.read_bytes())
    patch_manifest(copy / MANIFEST_NAME, ALIGN_JSON, new)
    with pytest.raises(CorruptManifestError, match="corrupt manifest") as info:
        stagefs.open(copy)
    assert message in str(info.value)
    assert str(copy / MANIFEST_NAME) in str(info.value)


def with_version(manifest: Path, version: int) -> None:
    raw = bytearray(manifest.read_bytes())
    raw[8:12] = struct.pack("<I", version)
    manifest.write_bytes(reseal_manifest(raw))


@pytest.mark.parametrize("version", [2, 3])
def test_a_pack_without_alignment_still_opens(tree: tuple[Path, dict[str, bytes]],
                                              tmp_path: Path, version: int) -> None:
    """A pack of version 2 (written before alignment existed: files back to back, no
    ``align``) or one packed with --align 1: no promise, read as it always was."""
    do_pack(tree[0], tmp_path / "p", align=1)
    with_version(tmp_path / "p" / MANIFEST_NAME, version)
    with stagefs.open(tmp_path / "p") as fs:
        assert fs.manifest.version == version
        assert fs.manifest.align == FileAlign()
        assert all(fs.read(rel) == data for rel, data in tree[1].items())


def test_version_2_ignores_an_align_key(aligned: tuple[Path, stagefs.PackReport],
                                        tree: tuple[Path, dict[str, bytes]],
                                        tmp_path: Path) -> None:
    """Before version 3 ``align`` is a key readers ignore: it promises nothing."""
    copy = tmp_path / "pack"
    copy.mkdir()
    for p in aligned[0].iterdir():
        (copy / p.name).write_bytes(p.read_bytes())
    patch_manifest(copy / MANIFEST_NAME, ALIGN_JSON, b'"align": {"min_size": 65536, "to": 3000}')
    with_version(copy / MANIFEST_NAME, 2)
    with stagefs.open(copy) as fs:
        assert fs.manifest.align == FileAlign()
        assert all(fs.read(rel) == data for rel, data in tree[1].items())


# ------------------------------------------------------------------ tier copies


def aligned_in(copy: Path, pack: Path, files: dict[str, bytes]) -> None:
    """The tier copy is the shard byte for byte, so each aligned file's bytes are at its
    aligned offset in the tier file."""
    for rel, (s, off, n, codec) in layout(pack).items():
        name = f"shard-{s:06d}.sfs"
        if codec == 0 and len(files[rel]) >= FILE_ALIGN_MIN:
            assert off % FILE_ALIGN == 0
            with open(copy / name, "rb") as f:
                f.seek(off)
                assert f.read(n) == files[rel], rel
    for shard in pack.glob("shard-*.sfs"):
        assert (copy / shard.name).read_bytes() == shard.read_bytes()


def test_a_placed_tier_copy_keeps_the_alignment(
        tree: tuple[Path, dict[str, bytes]], aligned: tuple[Path, stagefs.PackReport],
        tmp_path: Path, runtime: Path) -> None:
    pack = aligned[0]
    with stagefs.open(pack, tiers=[str(tmp_path / "t")]) as fs:
        assert fs.chain is not None
        fs.chain.stage()
        assert fs.held_shards() == set(range(len(fs.manifest.shards)))
        copy = tmp_path / "t" / fs.manifest.pack_id.hex()
    aligned_in(copy, pack, tree[1])


def test_reads_fill_an_aligned_shard_in_place(
        tree: tuple[Path, dict[str, bytes]], aligned: tuple[Path, stagefs.PackReport],
        tmp_path: Path, runtime: Path) -> None:
    """Padding does not stop reads from filling the tier copy (the first epoch places the
    data): the copy the reads made is the shard, byte for byte."""
    pack = aligned[0]
    m = Manifest(str(pack / MANIFEST_NAME))
    hold_claims(runtime, m.pack_id.hex(), len(m.shards))  # no placer: only reads fill
    m.close()
    with stagefs.open(pack, tiers=[str(tmp_path / "t")]) as fs:
        assert fs.chain is not None
        for rel, data in tree[1].items():
            assert fs.read(rel) == data
        assert fs.chain.tiers[0].stats.placed == len(fs.manifest.shards)
        # every extent (a file, or a checksum piece of a large raw one), once
        extents = sum(len(fs.chain._extents_of(s)) for s in range(len(fs.manifest.shards)))
        assert extents > sum(1 for d in tree[1].values() if d)  # a file over one piece
        assert fs.chain.tiers[0].stats.filled == extents
        copy = tmp_path / "t" / fs.manifest.pack_id.hex()
    aligned_in(copy, pack, tree[1])
