"""`stagefs unpack` of a crafted pack never writes, chmods or links outside DEST.

Each crafted pack is written with the real manifest writer, in the entry order the test
gives (duplicates kept), with its files' bytes in a real shard. Every test lists the
directory around DEST before and after: nothing may appear outside DEST.
"""

from __future__ import annotations

import os
import stat as st
import uuid
from pathlib import Path
from typing import Any

import pytest

import stagefs
from conftest import BASE_NS, Node, patch_manifest, snapshot_tree
from stagefs.cli import main
from stagefs.errors import CorruptManifestError, DestinationExistsError
from stagefs.format import (
    KIND_DIR,
    KIND_FILE,
    KIND_SYMLINK,
    MANIFEST_NAME,
    ManifestBuilder,
    ShardWriter,
    checksum,
    shard_name,
)
from stagefs.format.manifest import Entry, ShardInfo

DIR, FILE = 0o40755, 0o100644


class _AsGiven(ManifestBuilder):
    """The manifest writer, keeping the caller's order and repeated paths (a crafted pack)."""

    def _ordered(self) -> list[Entry]:
        return list(self.entries)


def _d(path: bytes, mode: int = DIR) -> Entry:
    return Entry(path, KIND_DIR, mode, BASE_NS)


def _f(path: bytes, data: bytes = b"payload\n", mode: int = FILE) -> Entry:
    e = Entry(path, KIND_FILE, mode, BASE_NS, size=len(data))
    e.link_target = data  # the bytes to store: moved into the shard by _crafted
    return e


def _l(path: bytes, target: bytes) -> Entry:
    return Entry(path, KIND_SYMLINK, 0o120777, BASE_NS, link_target=target)


def _crafted(pack: Path, *entries: Entry) -> Path:
    pack.mkdir()
    b = _AsGiven()
    writer = ShardWriter(str(pack / shard_name(0)), 0, b.pack_id)
    for e in entries:
        if e.kind == KIND_FILE:
            data, e.link_target = e.link_target, b""
            e.shard, e.offset, e.stored, e.checksum = 0, writer.append(data), len(data), \
                checksum(data)
        b.add(e)
    writer.close()
    b.shards.append(ShardInfo(shard_name(0), os.path.getsize(pack / shard_name(0))))
    b.write(str(pack / MANIFEST_NAME))
    return pack


def _listing(root: Path) -> set[str]:
    out = set()
    for dirpath, dirnames, filenames in os.walk(root):
        out.update(os.path.join(dirpath, n) for n in dirnames + filenames)
    return out


@pytest.fixture
def area(tmp_path: Path) -> Path:
    """tmp_path/area holds DEST (area/dest) and an 'outside' directory a link may name."""
    (tmp_path / "area" / "outside").mkdir(parents=True)
    return tmp_path / "area"


def _refused(pack: Path, area: Path, entry: str, why: str) -> Path:
    """Unpack ``pack`` into a new DEST in ``area``: refused, naming ``entry`` and ``why``,
    and nothing new anywhere but in DEST. Returns DEST."""
    dest = area / f"dest-{pack.name}"
    before = _listing(area.parent)
    with pytest.raises(CorruptManifestError) as info:
        stagefs.unpack(pack, dest, progress=False)
    msg = str(info.value)
    # refused when the manifest is opened (format/validate.py), or else by unpack's own
    # checks of each entry (for a manifest that passes the reader's checks)
    at_open = f"{pack / MANIFEST_NAME}: corrupt manifest:" in msg and "re-pack" in msg
    assert at_open or (repr(entry) in msg and why in msg and "refusing to unpack" in msg), msg
    after = _listing(area.parent)
    assert {p for p in after - before if not p.startswith(str(dest))} == set()
    assert os.listdir(area / "outside") == []
    return dest


def test_dotdot_is_refused(tmp_path: Path, area: Path) -> None:
    pack = _crafted(tmp_path / "p", _d(b""), _d(b".."), _f(b"../evil"))
    _refused(pack, area, "..", "'..' part")
    assert not (area / "evil").exists()


def test_dotdot_inside_a_path_is_refused(tmp_path: Path, area: Path) -> None:
    pack = _crafted(tmp_path / "p", _d(b""), _d(b"a"), _d(b"a/.."), _d(b"a/../.."),
                    _f(b"a/../../x"))
    _refused(pack, area, "a/..", "'..' part")
    assert not (area / "x").exists() and not (tmp_path / "x").exists()


def test_absolute_path_is_refused(tmp_path: Path, area: Path) -> None:
    name = f"/stagefs-unpack-test-{uuid.uuid4().hex}"
    pack = _crafted(tmp_path / "p", _d(b""), _f(name.encode()))
    try:
        _refused(pack, area, name, "absolute path")
        assert not os.path.exists(name)
    finally:
        if os.path.lexists(name):
            os.unlink(name)


def test_nul_and_empty_parts_are_refused(tmp_path: Path, area: Path) -> None:
    _refused(_crafted(tmp_path / "p1", _d(b""), _f(b"a\0b")), area, "a\0b", "NUL")
    _refused(_crafted(tmp_path / "p2", _d(b""), _d(b"a"), _d(b"a/"), _f(b"a//b")), area,
             "a/", "empty")


def test_a_file_through_a_symlink_it_wrote_is_refused(tmp_path: Path, area: Path) -> None:
    """A symlink 'l' to a directory outside, then a directory 'l' and a file 'l/x'."""
    outside = os.fsencode(area / "outside")
    pack = _crafted(tmp_path / "p", _d(b""), _l(b"l", outside), _d(b"l"), _f(b"l/x"))
    _refused(pack, area, "l", "repeats a path")


def test_a_file_under_a_symlink_entry_is_refused(tmp_path: Path, area: Path) -> None:
    """A file 'L/x' where 'L' is a symlink to outside (its path patched from 'D/x')."""
    outside = os.fsencode(area / "outside")
    pack = _crafted(tmp_path / "p", _d(b""), _d(b"D"), _l(b"L", outside), _f(b"D/x"))
    patch_manifest(pack / MANIFEST_NAME, b"D/x", b"L/x")
    _refused(pack, area, "L/x", "not inside a directory")


def test_repeated_paths_are_refused(tmp_path: Path, area: Path) -> None:
    pack = _crafted(tmp_path / "p", _d(b""), _f(b"f", b"first"), _f(b"f", b"second"))
    dest = _refused(pack, area, "f", "repeats a path")
    assert (dest / "f").read_bytes() == b"first"
    pack2 = _crafted(tmp_path / "p2", _d(b""), _d(b"d"), _d(b"d"))
    _refused(pack2, area, "d", "repeats a path")


def test_a_child_listed_before_its_directory_is_refused(tmp_path: Path, area: Path) -> None:
    pack = _crafted(tmp_path / "p", _d(b""), _f(b"d/x"), _d(b"d"))
    _refused(pack, area, "d/x", "not inside a directory")


def test_a_directory_swapped_for_a_symlink_during_unpack_is_not_followed(
        tmp_path: Path, area: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Another process replaces 'd' (made by unpack) with a symlink to outside while unpack
    writes 'd/x': the file still lands in the directory unpack made (its fd), and the final
    pass, which reopens 'd' by name, refuses the symlink."""
    pack = _crafted(tmp_path / "p", _d(b""), _d(b"d"), _f(b"d/x"), _f(b"d/y"))
    dest = area / "dest"
    store_cls = type(stagefs.open(pack))
    real = store_cls.read_entry
    swapped = []

    def read_entry(self: Any, e: int, path: Any = None) -> bytes:
        if not swapped:
            os.rename(dest / "d", dest / "moved")
            os.symlink(area / "outside", dest / "d")
            swapped.append(True)
        return real(self, e, path)

    monkeypatch.setattr(store_cls, "read_entry", read_entry)
    with pytest.raises(CorruptManifestError, match="changed DEST during the unpack"):
        stagefs.unpack(pack, dest, progress=False)
    assert os.listdir(area / "outside") == []
    assert sorted(os.listdir(dest / "moved")) == ["x", "y"]


def test_set_id_and_sticky_bits_are_never_restored(tmp_path: Path, area: Path) -> None:
    pack = _crafted(tmp_path / "p", _d(b"", 0o41777), _d(b"g", 0o42775),
                    _f(b"sgid", b"x", 0o102711), _f(b"g/suid", b"#!/bin/sh\n", 0o104755))
    dest = area / "dest"
    assert stagefs.unpack(pack, dest, progress=False) == 2
    modes = {p: st.S_IMODE(os.lstat(dest / p).st_mode) for p in ("", "g", "g/suid", "sgid")}
    assert modes == {"": 0o777, "g": 0o775, "g/suid": 0o755, "sgid": 0o711}


def test_round_trip_is_byte_exact_with_modes_mtimes_and_symlinks(tmp_path: Path,
                                                                sample_tree: Path) -> None:
    setuid = sample_tree / "tool"
    setuid.write_bytes(b"\x7fELF not really")
    os.chmod(setuid, 0o4755)
    os.utime(setuid, ns=(BASE_NS, BASE_NS))
    os.utime(sample_tree, ns=(BASE_NS, BASE_NS))
    stagefs.pack(sample_tree, tmp_path / "pack", jobs=1, progress=False, echo=lambda _m: None)
    out = tmp_path / "out"
    assert stagefs.unpack(tmp_path / "pack", out, progress=False) == 11
    want = snapshot_tree(sample_tree)
    got = snapshot_tree(out)
    assert st.S_IMODE(got[b"tool"].mode) == 0o755  # the set-user-id bit is not restored
    want[b"tool"] = Node("file", got[b"tool"].mode, BASE_NS, b"\x7fELF not really")
    assert got == want


def test_dest_that_holds_files_or_is_a_file_is_refused(tmp_path: Path, sample_tree: Path
                                                      ) -> None:
    stagefs.pack(sample_tree, tmp_path / "pack", jobs=1, progress=False, echo=lambda _m: None)
    full = tmp_path / "full"
    full.mkdir()
    (full / "mine").write_bytes(b"keep")
    with pytest.raises(DestinationExistsError, match="not empty"):
        stagefs.unpack(tmp_path / "pack", full, progress=False)
    assert os.listdir(full) == ["mine"]
    (tmp_path / "afile").write_bytes(b"x")
    with pytest.raises(DestinationExistsError, match="not a directory"):
        stagefs.unpack(tmp_path / "pack", tmp_path / "afile", progress=False)


def test_cli_unpack_of_a_crafted_pack_is_a_clear_error(tmp_path: Path, area: Path,
                                                      capsys: pytest.CaptureFixture[str]
                                                      ) -> None:
    pack = _crafted(tmp_path / "p", _d(b""), _d(b".."), _f(b"../evil"))
    assert main(["unpack", str(pack), str(area / "dest")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("stagefs: error:") and "'..'" in err and "Traceback" not in err
    assert not (area / "evil").exists()
