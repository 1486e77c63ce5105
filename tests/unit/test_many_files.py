"""The namespace over a dataset of many files: listing and walking cost O(directories) in
Python, not O(files), and give what os gives on the unpacked tree."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import stagefs
from stagefs.format import Manifest

DIRS, PER_DIR = 10, 1000  # 10,000 files


@pytest.fixture(scope="module")
def many(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("many")
    src = root / "src"
    for d in range(DIRS):
        sub = src / "train" / f"n{d:04d}"
        sub.mkdir(parents=True)
        for i in range(PER_DIR):
            (sub / f"img_{i:05d}.JPEG").write_bytes(b"%d" % i)
    odd = src / "odd"
    odd.mkdir()
    for name in (b"caf\xc3\xa9.txt", b"raw\xff\xfe.bin", b"-dash", b"sp ace"):
        (odd / os.fsdecode(name)).write_bytes(name)
    (odd / "sub").mkdir()
    (odd / "sub" / "x").write_bytes(b"x")
    os.symlink("sub", odd / "link-to-dir")
    os.symlink("sub/x", odd / "link-to-file")
    os.symlink("nowhere", odd / "dangling")
    stagefs.pack(src, root / "pack", jobs=1, progress=False)
    return src, root / "pack"


def _os_walk(top: str | bytes, followlinks: bool = False) -> list[tuple[object, object, object]]:
    out = []
    for d, dirs, files in os.walk(top, followlinks=followlinks):
        dirs.sort()
        out.append((d, dirs, sorted(files)))
    return out


@pytest.mark.parametrize("followlinks", [False, True])
@pytest.mark.parametrize("as_bytes", [False, True])
def test_walk_and_listdir_as_os(many: tuple[Path, Path], followlinks: bool,
                                as_bytes: bool) -> None:
    src, pack = many
    with stagefs.open(pack) as fs:
        top: str | bytes = os.fsencode(src) if as_bytes else str(src)
        want = [(os.path.relpath(d, top) if d != top else d[:0], dirs, files)
                for d, dirs, files in _os_walk(top, followlinks)]
        got = sorted(fs.walk(b"" if as_bytes else "", followlinks=followlinks),
                     key=lambda t: os.fsencode(t[0]))
        want.sort(key=lambda t: os.fsencode(t[0]))  # type: ignore[arg-type]
        assert got == want
        for d in ("odd", "odd/link-to-dir", "train/n0003", ""):
            arg: str | bytes = os.fsencode(d) if as_bytes else d
            assert fs.listdir(arg) == sorted(os.listdir(os.path.join(top, arg)))


def test_listing_costs_no_lookup_per_file(many: tuple[Path, Path],
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Walking or listing takes a directory's names from one slice of the manifest's
    strings: looking each name up through the manifest made a walk of ImageNet's tree take
    7 s, ten times os.walk's on a local disk."""
    _, pack = many
    with stagefs.open(pack) as fs:
        calls = _count_lookups(monkeypatch)
        files = sum(len(f) for _, _, f in fs.walk("train"))
        assert files == DIRS * PER_DIR
        assert len(fs.listdir("train/n0001")) == PER_DIR
        assert calls[0] <= 4 * (DIRS + 2), calls  # a few per directory, none per file


def _count_lookups(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """From now on, how many times a path is looked up in the manifest (one count)."""
    calls = [0]
    real = Manifest.path_of

    def counted(self: Manifest, e: int) -> bytes:
        calls[0] += 1
        return real(self, e)

    monkeypatch.setattr(Manifest, "path_of", counted)
    return calls


@pytest.mark.parametrize("as_bytes", [False, True])
def test_scandir_as_os(many: tuple[Path, Path], as_bytes: bool) -> None:
    """Names, paths (joined as os.path.join joins them) and kinds as os.scandir's."""
    src, pack = many
    with stagefs.open(pack) as fs:
        for d in ("odd", "odd/", "train/n0002", "odd/link-to-dir"):
            arg: str | bytes = os.fsencode(d) if as_bytes else d
            real = os.path.join(os.fsencode(src) if as_bytes else str(src), arg)
            want = sorted((os.path.relpath(e.path, real), e.name, e.is_dir(), e.is_file(),
                           e.is_symlink()) for e in os.scandir(real))
            got = sorted((os.path.relpath(e.path, arg), e.name, e.is_dir(), e.is_file(),
                          e.is_symlink()) for e in fs.scandir(arg))
            assert got == want
            assert all(os.path.dirname(e.path) == os.path.normpath(arg) for e in fs.scandir(arg))
        with pytest.raises(FileNotFoundError):
            fs.scandir("no/such/dir")  # at the call, as os.scandir


def test_intercepted_walk_costs_no_lookup_per_file(many: tuple[Path, Path], tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """os.walk under stagefs.intercept (what ``stagefs run`` serves to Python) lists through
    the namespace's listing, not a name lookup per file (7.1 s for ImageNet's tree)."""
    src, pack = many
    at = tmp_path / "at"
    with stagefs.open(pack) as fs, stagefs.intercept(fs, at=at):
        calls = _count_lookups(monkeypatch)
        got = sorted((os.path.relpath(d, at), sorted(ds), sorted(fs_))
                     for d, ds, fs_ in os.walk(at / "train"))
        monkeypatch.undo()  # (before the intercept ends)
    assert calls[0] <= 4 * (DIRS + 2), calls
    want = sorted((os.path.relpath(d, src), sorted(ds), sorted(fs_))
                  for d, ds, fs_ in os.walk(src / "train"))
    assert got == want
