"""verify_pack: every checksum, read in bounded windows; each corrupt file is named."""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path
from typing import Any

import pytest

import stagefs
import stagefs.tiers.audit as verify_mod
from conftest import random_bytes, text_bytes
from stagefs.cli import main
from stagefs.errors import DescriptorLimitError
from stagefs.format import shard_name
from stagefs.verify import verify_pack


@pytest.fixture(scope="module")
def verify_pack_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.mktemp("verify")
    src = base / "src"
    src.mkdir()
    for i in range(40):
        blob = random_bytes(i * 97, i) if i % 3 else text_bytes(i * 131, i)
        (src / f"f{i:02d}").write_bytes(blob)
    (src / "big").write_bytes(random_bytes(50_000, 99))
    stagefs.pack(src, base / "pack", shard_size="16KiB", jobs=1, progress=False,
                 echo=lambda _m: None)
    return base / "pack"


def _copy(pack: Path, tmp_path: Path) -> Path:
    shutil.copytree(pack, tmp_path / "pack")
    return tmp_path / "pack"


def _flip(pack: Path, rel: str, where: int) -> str:
    with stagefs.open(pack) as fs:
        m = fs.manifest
        e = m.lookup(rel.encode())
        shard, off = m.shards[m.shard[e]].name, int(m.offset[e]) + where
    with open(pack / shard, "r+b") as f:
        f.seek(off)
        b = f.read(1)
        f.seek(off)
        f.write(bytes([b[0] ^ 0x80]))
    return shard


@pytest.mark.parametrize("window", [verify_mod._WINDOW, 1000, 1])
@pytest.mark.parametrize("jobs", [1, 2])
def test_verify_ok(verify_pack_dir: Path, monkeypatch: pytest.MonkeyPatch, window: int,
                   jobs: int) -> None:
    monkeypatch.setattr(verify_mod, "_WINDOW", window)
    lengths: list[int] = []
    real = verify_mod.PackOrigin.pread

    def pread(self: verify_mod.PackOrigin, shard: int, offset: int, length: int) -> bytes:
        lengths.append(length)
        return real(self, shard, offset, length)

    if jobs == 1:  # no read is larger than the window (Linux caps one read at 2 GiB)
        monkeypatch.setattr(verify_mod.PackOrigin, "pread", pread)
    report = verify_pack(str(verify_pack_dir), jobs=jobs, progress=False)
    assert report.ok and report.files == 41 and report.corrupt == []
    if jobs == 1:
        with stagefs.open(verify_pack_dir) as fs:
            a = fs.manifest.arrays
            zstd_max = int(a["stored"][a["codec"] == 1].max())  # read whole, at most 64 MiB
        assert lengths and max(lengths) <= max(window, zstd_max)
    assert report.bytes == sum(i * 97 if i % 3 else i * 131 for i in range(40)) + 50_000


@pytest.mark.parametrize("window", [64 * 2**20, 1000])
@pytest.mark.parametrize("victim", ["f05", "f27", "big", "f39"])
def test_verify_names_the_corrupt_file(verify_pack_dir: Path, tmp_path: Path,
                                       monkeypatch: pytest.MonkeyPatch, window: int,
                                       victim: str) -> None:
    monkeypatch.setattr(verify_mod, "_WINDOW", window)
    pack = _copy(verify_pack_dir, tmp_path)
    shard = _flip(pack, victim, 3)
    report = verify_pack(str(pack), jobs=1, progress=False)
    assert not report.ok
    assert [(c.path, c.shard) for c in report.corrupt] == [(victim, shard)]
    assert report.files == 41


def test_verify_truncated_and_missing_shards(verify_pack_dir: Path, tmp_path: Path) -> None:
    pack = _copy(verify_pack_dir, tmp_path)
    with stagefs.open(pack) as fs:
        m = fs.manifest
        # an empty file (f00) is in no shard's bytes: it reads fine whatever its shard
        in0 = sorted(os.fsdecode(m.path_of(e)) for e in range(len(m))
                     if m.kind[e] == 0 and m.shard[e] == 0 and m.size[e])
        in1 = sorted(os.fsdecode(m.path_of(e)) for e in range(len(m))
                     if m.kind[e] == 0 and m.shard[e] == 1 and m.size[e])
        assert m.shard[fs.namespace.file_entry("f00")] in (0, 1)
    os.truncate(pack / shard_name(0), 100)
    os.unlink(pack / shard_name(1))
    report = verify_pack(str(pack), jobs=2, progress=False)
    assert sorted(c.path for c in report.corrupt) == sorted(in0 + in1)
    assert report.files == 41
    with stagefs.open(pack) as fs:
        assert fs.read("f00") == b""
    reasons = {c.shard: c.reason for c in report.corrupt}
    assert "truncated" in reasons[shard_name(0)] and shard_name(0) in reasons[shard_name(0)]
    assert shard_name(1) in reasons[shard_name(1)]


def _files_of(pack: Path, shard: int) -> list[str]:
    with stagefs.open(pack) as fs:
        m = fs.manifest
        return sorted(os.fsdecode(m.path_of(e)) for e in range(len(m))
                      if m.kind[e] == 0 and m.shard[e] == shard and m.size[e])


@pytest.mark.parametrize("jobs", [1, 2])
def test_verify_lists_the_files_of_a_shard_that_cannot_be_opened(
        verify_pack_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
        jobs: int) -> None:
    """A shard that cannot be opened (a symlink to itself: ELOOP, for root too) is no
    traceback: its files are corrupt, with the reason; the CLI exits 1."""
    pack = _copy(verify_pack_dir, tmp_path)
    (pack / shard_name(1)).unlink()
    (pack / shard_name(1)).symlink_to(shard_name(1))
    report = verify_pack(str(pack), jobs=jobs, progress=False)
    assert sorted(c.path for c in report.corrupt) == _files_of(pack, 1)
    assert report.files == 41
    for c in report.corrupt:
        assert c.shard == shard_name(1)
        assert str(pack / shard_name(1)) in c.reason and "symbolic links" in c.reason
    assert main(["verify", "--jobs", str(jobs), str(pack)]) == 1
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err and err == ""
    lines = out.splitlines()
    assert [ln.split()[1] for ln in lines[:-1]] == [c.path for c in report.corrupt]
    assert all(ln.startswith("CORRUPT ") for ln in lines[:-1])
    assert lines[-1].endswith(f": {len(report.corrupt)} CORRUPT")


def test_verify_names_a_shard_it_may_not_read(verify_pack_dir: Path, tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Permission denied: the files of the shard are corrupt, with the reason. (Root reads
    a file of mode 000: then the open is refused as it would be for another user.)"""
    pack = _copy(verify_pack_dir, tmp_path)
    victim = str(pack / shard_name(2))
    os.chmod(victim, 0)
    if os.geteuid() == 0:
        _refuse_open(monkeypatch, victim, errno.EACCES)
    report = verify_pack(str(pack), jobs=1, progress=False)
    assert sorted(c.path for c in report.corrupt) == _files_of(pack, 2)
    assert all(c.reason.startswith(f"the shard cannot be read: {victim}: Permission denied")
               and f"chmod -R a+rX {pack}" in c.reason for c in report.corrupt), report.corrupt


def _refuse_open(monkeypatch: pytest.MonkeyPatch, path: str, code: int) -> None:
    real = os.open

    def fake_open(p: Any, flags: int, *a: Any, **k: Any) -> int:
        if os.fspath(p) == path:
            raise OSError(code, os.strerror(code), path)
        return real(p, flags, *a, **k)

    monkeypatch.setattr(os, "open", fake_open)


@pytest.mark.parametrize("code", [errno.EMFILE, errno.ENFILE])
def test_verify_out_of_descriptors_calls_no_shard_corrupt(
        verify_pack_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str], code: int) -> None:
    """No descriptor left to open a shard with is this process's condition: an error naming
    the open-file limit, not the shard's files listed as corrupt."""
    pack = _copy(verify_pack_dir, tmp_path)
    victim = str(pack / shard_name(1))
    _refuse_open(monkeypatch, victim, code)
    with pytest.raises(DescriptorLimitError, match="open-file limit") as err:
        verify_pack(str(pack), jobs=1, progress=False)
    assert victim in str(err.value) and "ulimit -n" in str(err.value)
    assert main(["verify", "--jobs", "1", str(pack)]) == 1
    out, err_text = capsys.readouterr()
    assert "CORRUPT" not in out and "Traceback" not in err_text
    assert err_text.startswith(f"stagefs: error: {victim}: ") and "ulimit -n" in err_text


def test_a_copy_written_past_its_end_is_bad_as_a_whole_copy(verify_pack_dir: Path,
                                                            tmp_path: Path) -> None:
    """A tier's copy longer than its shard: its files are right, but no server serves it,
    so the daemon's check (``whole``) calls it bad, and the daemon places it again; a
    pack's shard is checked by its files as before (``stagefs verify``)."""
    from stagefs.format import MANIFEST_NAME, Manifest

    pack = _copy(verify_pack_dir, tmp_path)
    with open(pack / shard_name(0), "ab") as f:
        f.write(b"\0" * 10)
    m = Manifest(str(pack / MANIFEST_NAME))
    try:
        n, _, bad = verify_mod.check_shard(str(pack), m, 0, whole=True)
        assert n and len(bad) == len(_files_of(pack, 0)) > 0
        assert all("manifest says" in c.reason and shard_name(0) in c.reason for c in bad)
        assert verify_mod.check_shard(str(pack), m, 0)[2] == []
        assert verify_mod.check_shard(str(pack), m, 1, whole=True)[2] == []
    finally:
        m.close()
