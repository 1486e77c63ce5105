"""Bad input in the packer: every refusal names the thing; nothing half written looks whole;
an interrupted pack resumes."""

from __future__ import annotations

import importlib
import json
import os
import shutil
import socket
import stat as st
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import stagefs
from conftest import as_nobody, patch_manifest, random_bytes, snapshot_tree, text_bytes, world_dir
from stagefs._fsutil import partial_name
from stagefs.errors import (
    DestinationExistsError,
    PackError,
    SourceChangedError,
    StagefsError,
    UnreadableSourceError,
    UnsafeSymlinkError,
)
from stagefs.format import MANIFEST_NAME, ShardWriter, shard_name

packmod = importlib.import_module("stagefs.pack")  # `stagefs.pack` is the function
quiet: Callable[[str], None] = lambda _m: None  # noqa: E731


def _pack(src: Path, dest: Path, **kw: Any) -> stagefs.PackReport:
    kw.setdefault("jobs", 1)
    return stagefs.pack(src, dest, progress=False, echo=kw.pop("echo", quiet), **kw)


def _roundtrip(src: Path, pack: Path, out: Path) -> None:
    stagefs.unpack(pack, out, progress=False)
    assert snapshot_tree(out) == snapshot_tree(src)


def test_empty_files_and_dirs_are_kept(tmp_path: Path) -> None:
    src = tmp_path / "src"
    (src / "e1" / "e2").mkdir(parents=True)
    (src / "e3").mkdir()
    (src / "zero").write_bytes(b"")
    (src / "e1" / "zero2").write_bytes(b"")
    report = _pack(src, tmp_path / "pack")
    assert (report.files, report.directories, report.raw_bytes) == (2, 3, 0)
    with stagefs.open(tmp_path / "pack") as fs:
        assert fs.isdir("e1/e2") and fs.listdir("e1/e2") == [] and fs.listdir("e3") == []
        assert fs.read("zero") == b"" and fs.getsize("e1/zero2") == 0
    _roundtrip(src, tmp_path / "pack", tmp_path / "out")


def test_bytes_paths_of_a_directory_that_is_not_utf8(tmp_path: Path) -> None:
    """pack, open and unpack take bytes paths, as os does (a directory name that is not
    UTF-8, as os.fsencode or os.walk(bytes) gives it)."""
    base = os.path.join(os.fsencode(tmp_path), b"d\xff")
    src, pack, out = (os.path.join(base, n) for n in (b"src", b"pack", b"out"))
    os.makedirs(os.path.join(src, b"sub"))
    Path(os.fsdecode(os.path.join(src, b"sub", b"f\xfe"))).write_bytes(b"data")
    report = stagefs.pack(src, pack, progress=False, echo=quiet, jobs=1)
    assert report.dest == os.fsdecode(pack) and report.files == 1
    with stagefs.open(pack) as fs:
        assert fs.read(b"sub/f\xfe") == b"data"
    with stagefs.open(src) as fs:  # a raw directory, in place
        assert fs.read(b"sub/f\xfe") == b"data"
    assert stagefs.unpack(pack, out, progress=False) == 1
    assert snapshot_tree(out) == snapshot_tree(src)


def test_empty_source(tmp_path: Path) -> None:
    (tmp_path / "src").mkdir()
    report = _pack(tmp_path / "src", tmp_path / "pack")
    assert (report.files, report.shards) == (0, 0)
    with stagefs.open(tmp_path / "pack") as fs:
        assert fs.listdir("") == []
    _roundtrip(tmp_path / "src", tmp_path / "pack", tmp_path / "out")


@pytest.fixture
def outside_link(tmp_path: Path) -> Path:
    outside = tmp_path / "outside"
    (outside / "dir").mkdir(parents=True)
    (outside / "file.txt").write_bytes(b"outside file\n")
    (outside / "dir" / "inner").write_bytes(b"inner\n")
    src = tmp_path / "src"
    src.mkdir()
    (src / "ok").write_bytes(b"ok\n")
    os.symlink(outside / "file.txt", src / "to_file")
    os.symlink("../outside/dir", src / "to_dir")
    return src


def test_symlink_outside_is_refused(tmp_path: Path, outside_link: Path) -> None:
    with pytest.raises(UnsafeSymlinkError) as info:
        _pack(outside_link, tmp_path / "pack")
    msg = str(info.value)
    assert "to_file" in msg and "to_dir" in msg and "../outside/dir" in msg
    assert "--follow-symlinks" in msg
    assert isinstance(info.value, PackError) and isinstance(info.value, StagefsError)
    assert not (tmp_path / "pack" / MANIFEST_NAME).exists()


def test_symlink_outside_is_followed_on_request(tmp_path: Path, outside_link: Path) -> None:
    report = _pack(outside_link, tmp_path / "pack", follow_symlinks=True)
    assert report.symlinks == 0 and report.files == 3
    with stagefs.open(tmp_path / "pack") as fs:
        assert fs.read("to_file") == b"outside file\n" and not fs.islink("to_file")
        assert fs.isdir("to_dir") and fs.read("to_dir/inner") == b"inner\n"


def test_dangling_link_outside_with_follow_is_kept_as_link(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    os.symlink("/nonexistent/stagefs/target", src / "gone")
    _pack(src, tmp_path / "pack", follow_symlinks=True)
    with stagefs.open(tmp_path / "pack") as fs:
        assert fs.islink("gone") and fs.readlink("gone") == "/nonexistent/stagefs/target"


def test_sockets_and_fifos_are_skipped(tmp_path: Path) -> None:
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / "file").write_bytes(b"data")
    os.mkfifo(src / "sub" / "fifo")
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(str(src / "sock"))
        report = _pack(src, tmp_path / "pack")
    assert sorted(report.skipped) == ["sock", "sub/fifo"]
    assert report.files == 1
    with stagefs.open(tmp_path / "pack") as fs:
        assert fs.listdir("") == ["file", "sub"] and fs.listdir("sub") == []


# ------------------------------------------------------------------ unreadable sources


def _unreadable_case(tmp: Path, what: str) -> tuple[Path, Path, str]:
    src = tmp / "src"
    (src / "d").mkdir(parents=True)
    (src / "a").write_bytes(b"a" * 100)
    (src / "d" / "b").write_bytes(b"b" * 100)
    (src / "z").write_bytes(b"z" * 100)
    secret = src / "d" / "secret"
    if what == "file":
        secret.write_bytes(b"secret")
        os.chmod(secret, 0o000)
    else:  # "dir": cannot be listed; "noexec-dir": can be listed, its entries not reached
        secret.mkdir()
        (secret / "x").write_bytes(b"x")
        os.chmod(secret, 0o000 if what == "dir" else 0o744)
    out = tmp / "out"
    out.mkdir()
    if os.geteuid() == 0:
        os.chown(out, 65534, 65534)
    return src, out / "pack", "d/secret"


def _check_unreadable(dest: Path, msg: str, name: str, what: str) -> None:
    assert name in msg
    assert not (dest / MANIFEST_NAME).exists()
    if what == "file":
        # the shard holding the unreadable file was not finished; no partial file is left
        assert shard_name(0) not in os.listdir(dest)
        assert not any(p.name.endswith(".partial") for p in dest.iterdir())


@pytest.mark.parametrize("what", ["file", "dir", "noexec-dir"])
def test_unreadable_source_fails_naming_it(tmp_path: Path, what: str) -> None:
    if os.geteuid() == 0:  # root reads anything: pack as an unprivileged user, for real
        with world_dir() as tmp:
            src, dest, name = _unreadable_case(tmp, what)
            code, msg = as_nobody(lambda: _pack(src, dest))
            assert code == 1 and msg.startswith(UnreadableSourceError.__name__), msg
            _check_unreadable(dest, msg, name, what)
        return
    src, dest, name = _unreadable_case(tmp_path, what)
    if os.access(src / name, os.R_OK):
        pytest.skip("chmod 000 does not stop this user from reading")
    with pytest.raises(UnreadableSourceError) as info:
        _pack(src, dest)
    assert isinstance(info.value, PermissionError)
    _check_unreadable(dest, str(info.value), name, what)


# ------------------------------------------------------------------ changed while packing


def _changing_reader(monkeypatch: pytest.MonkeyPatch, victim: Path,
                     change: Callable[[Path], None]) -> list[int]:
    calls: list[int] = []
    real = packmod._read_whole

    def reader(fd: int, size: int) -> bytes:
        if os.path.samestat(os.fstat(fd), os.stat(victim)) and not calls:
            calls.append(fd)
            change(victim)
        return real(fd, size)

    monkeypatch.setattr(packmod, "_read_whole", reader)
    return calls


@pytest.mark.parametrize("how", ["append", "rewrite", "truncate"])
def test_file_changed_while_packing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                    how: str) -> None:
    src = tmp_path / "src"
    src.mkdir()
    for i in range(5):
        (src / f"f{i}").write_bytes(random_bytes(2000, i))
    victim = src / "f2"

    def change(p: Path) -> None:
        if how == "append":
            with open(p, "ab") as f:
                f.write(b"more")
        elif how == "rewrite":  # same size, new bytes, new mtime
            p.write_bytes(random_bytes(2000, 99))
            os.utime(p, ns=(1, 1))
        else:
            os.truncate(p, 10)

    calls = _changing_reader(monkeypatch, victim, change)
    with pytest.raises(SourceChangedError) as info:
        _pack(src, tmp_path / "pack", shard_size=3000)
    assert calls
    assert "f2" in str(info.value) and "f1" not in str(info.value)
    assert not (tmp_path / "pack" / MANIFEST_NAME).exists()
    # once the source is still, the same command finishes, and the pack has the new bytes
    monkeypatch.undo()
    _pack(src, tmp_path / "pack", shard_size=3000)
    with stagefs.open(tmp_path / "pack") as fs:
        assert fs.read("f2") == victim.read_bytes()


def test_file_deleted_while_packing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src = tmp_path / "src"
    src.mkdir()
    for i in range(3):
        (src / f"f{i}").write_bytes(b"x" * 100)
    real = packmod._write_one

    def write_one(writer: ShardWriter, f: Any, path: bytes, compress: str) -> Any:
        if f.rel == b"f1":
            os.unlink(src / "f1")
        return real(writer, f, path, compress)

    monkeypatch.setattr(packmod, "_write_one", write_one)
    with pytest.raises(SourceChangedError, match="f1"):
        _pack(src, tmp_path / "pack")


# ------------------------------------------------------------------ sizes


def test_file_larger_than_shard_size(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    (src / "a_small").write_bytes(b"s" * 100)
    (src / "big").write_bytes(random_bytes(50_000, 1))
    (src / "c_small").write_bytes(b"c" * 100)
    (src / "huge_text").write_bytes(text_bytes(80_000, 2))
    report = _pack(src, tmp_path / "pack", shard_size="10KiB")
    assert report.shards == 4
    with stagefs.open(tmp_path / "pack") as fs:
        m = fs.manifest
        assert len({m.shard[m.lookup(n)] for n in (b"a_small", b"big", b"c_small")}) == 3
    _roundtrip(src, tmp_path / "pack", tmp_path / "out")


def test_streamed_large_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Files above the streaming limit are copied in chunks (raw), still checksummed."""
    monkeypatch.setattr(packmod, "_STREAM_ABOVE", 10_000)
    monkeypatch.setattr(packmod, "_CHUNK", 3_333)
    src = tmp_path / "src"
    src.mkdir()
    (src / "big.txt").write_bytes(text_bytes(100_000, 5))
    (src / "small.txt").write_bytes(text_bytes(5_000, 6))
    _pack(src, tmp_path / "pack")
    with stagefs.open(tmp_path / "pack") as fs:
        m = fs.manifest
        assert m.codec[m.lookup(b"big.txt")] == 0 and m.codec[m.lookup(b"small.txt")] == 1
        assert fs.read("big.txt") == (src / "big.txt").read_bytes()
    from stagefs.verify import verify_pack

    assert verify_pack(str(tmp_path / "pack"), jobs=1, progress=False).ok


@pytest.mark.parametrize("bad", [0, "0", "-1", "lots", "1.5XB"])
def test_bad_shard_size(tmp_path: Path, sample_tree: Path, bad: int | str) -> None:
    with pytest.raises(StagefsError, match="size"):
        _pack(sample_tree, tmp_path / "pack", shard_size=bad)
    assert not (tmp_path / "pack").exists()


def test_bad_compress_and_missing_source(tmp_path: Path, sample_tree: Path) -> None:
    with pytest.raises(PackError, match="lz4"):
        _pack(sample_tree, tmp_path / "pack", compress="lz4")
    with pytest.raises(PackError, match="nowhere"):
        _pack(tmp_path / "nowhere", tmp_path / "pack")
    (tmp_path / "file").write_bytes(b"")
    with pytest.raises(PackError, match="file"):
        _pack(tmp_path / "file", tmp_path / "pack")


# ------------------------------------------------------------------ interrupted and resumed


@pytest.fixture
def four_shard_src(tmp_path: Path) -> Path:
    src = tmp_path / "src"
    src.mkdir()
    for i in range(8):
        (src / f"f{i}").write_bytes(random_bytes(5000, i) if i % 2 else text_bytes(5000, i))
    return src


def _failing_shard(monkeypatch: pytest.MonkeyPatch, index: int) -> None:
    real = ShardWriter.append

    def append(self: ShardWriter, data: bytes) -> int:
        if self.index == index:
            raise OSError(28, "No space left on device (injected)")
        return real(self, data)

    monkeypatch.setattr(ShardWriter, "append", append)


def test_interrupted_pack_resumes(tmp_path: Path, four_shard_src: Path,
                                  monkeypatch: pytest.MonkeyPatch) -> None:
    dest = tmp_path / "pack"
    _failing_shard(monkeypatch, 2)
    with pytest.raises(OSError, match="injected"):
        _pack(four_shard_src, dest, shard_size=10_000)
    monkeypatch.undo()
    assert not (dest / MANIFEST_NAME).exists()
    names = sorted(os.listdir(dest))
    assert shard_name(0) in names and shard_name(1) in names
    assert not any(n.startswith(shard_name(2)) for n in names)  # no partial left
    with pytest.raises(StagefsError, match="not a pack"):
        stagefs.open(dest)
    said: list[str] = []
    report = _pack(four_shard_src, dest, shard_size=10_000, echo=said.append)
    assert report.shards == 4 and report.reused_shards == 2
    assert any("resum" in s and "2 of 4" in s for s in said), said
    assert not (dest / packmod.STATE_DIR).exists()
    _roundtrip(four_shard_src, dest, tmp_path / "out")
    # the resumed pack holds the same bytes as a clean pack of the same source
    _pack(four_shard_src, tmp_path / "clean", shard_size=10_000)
    for i in range(4):
        a = (dest / shard_name(i)).read_bytes()
        b = (tmp_path / "clean" / shard_name(i)).read_bytes()
        assert a[64:] == b[64:]


def test_resume_rewrites_shards_recorded_for_another_format(
        tmp_path: Path, four_shard_src: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A shard record of an older stagefs (no piece checksums) is not reused."""
    dest = tmp_path / "pack"
    _failing_shard(monkeypatch, 2)
    with pytest.raises(OSError, match="injected"):
        _pack(four_shard_src, dest, shard_size=10_000, jobs=1)
    monkeypatch.undo()
    record = dest / packmod.STATE_DIR / "0.json"
    old = json.loads(record.read_text())
    old.pop("version")
    old["records"] = [r[:4] for r in old["records"]]  # the version 1 record
    record.write_text(json.dumps(old))
    report = _pack(four_shard_src, dest, shard_size=10_000)
    assert report.reused_shards == 1  # shard 1 only; shard 0 was written anew
    _roundtrip(four_shard_src, dest, tmp_path / "out")


def test_resume_after_source_changed(tmp_path: Path, four_shard_src: Path,
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    dest = tmp_path / "pack"
    _failing_shard(monkeypatch, 3)
    with pytest.raises(OSError, match="injected"):
        _pack(four_shard_src, dest, shard_size=10_000, jobs=1)
    monkeypatch.undo()
    # f0 lives in shard 0: same size, new bytes and mtime
    new = random_bytes(5000, 1234)
    (four_shard_src / "f0").write_bytes(new)
    report = _pack(four_shard_src, dest, shard_size=10_000)
    assert report.reused_shards == 2  # shards 1 and 2; shard 0 was written anew
    with stagefs.open(dest) as fs:
        assert fs.read("f0") == new
    _roundtrip(four_shard_src, dest, tmp_path / "out")


def test_resume_with_other_options_starts_clean(tmp_path: Path, four_shard_src: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    dest = tmp_path / "pack"
    _failing_shard(monkeypatch, 1)
    with pytest.raises(OSError):
        _pack(four_shard_src, dest, shard_size=10_000)
    monkeypatch.undo()
    report = _pack(four_shard_src, dest, shard_size=20_000)
    assert report.reused_shards == 0
    _roundtrip(four_shard_src, dest, tmp_path / "out")


def test_resume_removes_the_manifest_a_killed_run_was_writing(
        tmp_path: Path, four_shard_src: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A run killed (kill -9) while it writes the manifest leaves its partial file, which
    the next run removes instead of keeping it in the finished pack."""
    dest = tmp_path / "pack"
    _failing_shard(monkeypatch, 3)
    with pytest.raises(OSError, match="injected"):
        _pack(four_shard_src, dest, shard_size=10_000)
    monkeypatch.undo()
    left = Path(partial_name(str(dest / MANIFEST_NAME)))
    left.write_bytes(b"the start of a manifest")
    report = _pack(four_shard_src, dest, shard_size=10_000)
    assert report.reused_shards == 3
    assert sorted(os.listdir(dest)) == [MANIFEST_NAME] + [shard_name(i) for i in range(4)]


def test_resume_forgets_the_record_of_a_shard_it_writes_again(
        tmp_path: Path, four_shard_src: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A run that writes a shard again and dies before its record must not leave the old
    record beside the new shard: a later run whose source is the first one's again (files
    restored with their mtimes) would take the new bytes for the old files."""
    dest = tmp_path / "pack"
    _failing_shard(monkeypatch, 3)
    with pytest.raises(OSError, match="injected"):
        _pack(four_shard_src, dest, shard_size=10_000)
    monkeypatch.undo()
    f1 = four_shard_src / "f1"  # in shard 0; raw (random bytes), so the shard keeps its size
    old, old_mtime = f1.read_bytes(), f1.stat().st_mtime_ns
    f1.write_bytes(random_bytes(len(old), 99))
    os.utime(f1, ns=(old_mtime + 10**9, old_mtime + 10**9))
    real = packmod._write_json

    def dies_after_shard_0(path: str, obj: Any) -> None:
        if os.path.basename(path) == "0.json":
            raise KeyboardInterrupt  # shard 0 is in place, its record not yet
        real(path, obj)

    monkeypatch.setattr(packmod, "_write_json", dies_after_shard_0)
    with pytest.raises(KeyboardInterrupt):
        _pack(four_shard_src, dest, shard_size=10_000)
    monkeypatch.undo()
    f1.write_bytes(old)  # restored as it was, mtime included
    os.utime(f1, ns=(old_mtime, old_mtime))
    _pack(four_shard_src, dest, shard_size=10_000)
    _roundtrip(four_shard_src, dest, tmp_path / "out")


def test_interrupted_pack_with_processes(tmp_path: Path, four_shard_src: Path) -> None:
    """The pool path: a pack over 2 processes gives the same files as one process."""
    _pack(four_shard_src, tmp_path / "p2", shard_size=10_000, jobs=2)
    _roundtrip(four_shard_src, tmp_path / "p2", tmp_path / "out")


# ------------------------------------------------------------------ destinations


def test_destination_with_a_complete_pack(tmp_path: Path, sample_tree: Path) -> None:
    dest = tmp_path / "pack"
    _pack(sample_tree, dest)
    with pytest.raises(DestinationExistsError) as info:
        _pack(sample_tree, dest)
    assert str(dest) in str(info.value) and "--force" in str(info.value)
    assert isinstance(info.value, FileExistsError)
    (sample_tree / "a.txt").write_bytes(b"changed")
    _pack(sample_tree, dest, overwrite=True)
    with stagefs.open(dest) as fs:
        assert fs.read("a.txt") == b"changed"


def test_destination_not_empty(tmp_path: Path, sample_tree: Path) -> None:
    dest = tmp_path / "pack"
    dest.mkdir()
    (dest / "precious").write_bytes(b"keep me")
    with pytest.raises(DestinationExistsError, match=str(dest)):
        _pack(sample_tree, dest)
    assert (dest / "precious").read_bytes() == b"keep me"


def test_destination_inside_source(tmp_path: Path, sample_tree: Path) -> None:
    dest = sample_tree / "the_pack"
    report = _pack(sample_tree, dest)
    with stagefs.open(dest) as fs:
        assert "the_pack" not in fs.listdir("")
        assert fs.read("a.txt") == (sample_tree / "a.txt").read_bytes()
    assert report.files == 10
    out = tmp_path / "out"
    stagefs.unpack(dest, out, progress=False)
    shutil.rmtree(dest)
    # directory mtimes of the source changed when the pack was made in it; compare the rest
    assert snapshot_tree(out, mtimes=False) == snapshot_tree(sample_tree, mtimes=False)


def test_unpack_refuses_non_empty_destination(tmp_path: Path,
                                              sample_pack_session: tuple[Path, Path]) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "x").write_bytes(b"")
    with pytest.raises(DestinationExistsError, match=str(out)):
        stagefs.unpack(sample_pack_session[1], out, progress=False)


def test_sample_tree_round_trip(tmp_path: Path, sample_pack_session: tuple[Path, Path]) -> None:
    src, pack = sample_pack_session
    _roundtrip(src, pack, tmp_path / "out")
    s = snapshot_tree(tmp_path / "out")
    assert st.S_IMODE(s[b"exec.sh"].mode) == 0o755
    assert st.S_IMODE(s[b"emptydir"].mode) == 0o700


def test_destination_inside_source_through_a_symlink(tmp_path: Path, sample_tree: Path) -> None:
    """DEST inside SRC is left out even when one of them is named through a symlink, also
    when DEST already holds files (a re-run with --force, a resumed pack)."""
    os.symlink(sample_tree, tmp_path / "via")
    for src, dest in [(tmp_path / "via", sample_tree / "p"), (sample_tree, tmp_path / "via/p")]:
        for _ in range(2):  # the second run finds the first pack's files in SRC
            report = _pack(src, dest, overwrite=True)
            assert report.files == 10
            with stagefs.open(sample_tree / "p") as fs:
                assert "p" not in fs.listdir("")


@pytest.mark.parametrize("where", ["same", "parent", "same-via-link", "dot"])
def test_destination_containing_the_source_is_refused(tmp_path: Path, sample_tree: Path,
                                                      where: str) -> None:
    os.symlink(sample_tree, tmp_path / "via")
    dest = {"same": sample_tree, "parent": tmp_path, "same-via-link": tmp_path / "via",
            "dot": sample_tree / "."}[where]
    before = snapshot_tree(sample_tree)
    with pytest.raises(PackError, match="source") as info:
        _pack(sample_tree, dest, overwrite=True)  # --force must never delete the source
    assert str(os.path.abspath(dest)) in str(info.value)
    assert snapshot_tree(sample_tree) == before


# ------------------------------------------------------------------ crafted manifests


def _crafted_pack(pack: Path, entries: list[Any]) -> Path:
    from stagefs.format import KIND_FILE, ManifestBuilder
    from stagefs.format.manifest import ShardInfo
    from stagefs.format.spec import SHARD_HEADER

    pack.mkdir()
    b = ManifestBuilder()
    for e in entries:
        if e.kind == KIND_FILE:  # empty files, in an empty shard
            e.shard, e.offset = 0, SHARD_HEADER.size
        b.add(e)
    b.shards.append(ShardInfo("shard-000000.sfs", SHARD_HEADER.size))
    b.write(str(pack / MANIFEST_NAME))
    return pack / MANIFEST_NAME


def test_unpack_refuses_paths_that_leave_dest(tmp_path: Path) -> None:
    from stagefs.errors import CorruptManifestError
    from stagefs.format import KIND_DIR, KIND_FILE, KIND_SYMLINK
    from stagefs.format.manifest import Entry

    # a name ".." (the builder takes any name the caller gives)
    _crafted_pack(tmp_path / "p1", [Entry(b"", KIND_DIR, 0o40755, 0),
                                    Entry(b"..", KIND_DIR, 0o40755, 0),
                                    Entry(b"../evil", KIND_FILE, 0o100644, 0)])
    with pytest.raises(CorruptManifestError, match=r"'\.\.'"):
        stagefs.unpack(tmp_path / "p1", tmp_path / "a" / "out", progress=False)
    assert not (tmp_path / "a" / "evil").exists()
    # a file whose path goes through a symlink to a directory outside DEST
    outside = tmp_path / "outside"
    outside.mkdir()
    m = _crafted_pack(tmp_path / "p2", [
        Entry(b"", KIND_DIR, 0o40755, 0), Entry(b"D", KIND_DIR, 0o40755, 0),
        Entry(b"L", KIND_SYMLINK, 0o120777, 0, link_target=os.fsencode(outside)),
        Entry(b"D/evil", KIND_FILE, 0o100644, 0)])
    patch_manifest(m, b"D/evil", b"L/evil")
    with pytest.raises(CorruptManifestError, match="L/evil"):
        stagefs.unpack(tmp_path / "p2", tmp_path / "out2", progress=False)
    assert os.listdir(outside) == []
