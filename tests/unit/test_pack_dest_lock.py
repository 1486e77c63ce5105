"""One pack at a time into a DEST, and a pack that says what it does while it scans."""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

import pytest

import stagefs
from conftest import random_bytes
from stagefs.errors import PackError
from stagefs.verify import verify_pack

packmod = importlib.import_module("stagefs.pack")  # `stagefs.pack` is the function


def _tree(root: Path, files: int = 6) -> Path:
    root.mkdir()
    for i in range(files):
        (root / f"f{i}").write_bytes(random_bytes(3000, seed=i))
    return root


def _pack(src: Path, dest: Path, **kw: Any) -> stagefs.PackReport:
    return stagefs.pack(src, dest, jobs=1, shard_size="4KiB", progress=False,
                        echo=lambda _m: None, **kw)


def test_a_second_pack_into_a_dest_being_written_is_refused(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The second run used to adopt the first one's state, delete its shards in progress,
    and remove its state folder under it (or, both fresh, leave shards of two pack ids)."""
    src, dest = _tree(tmp_path / "src"), tmp_path / "out"
    second: list[BaseException | None] = []
    plan = packmod._plan

    def plan_then_race(*a: Any, **kw: Any) -> Any:
        if not second:  # the first pack holds DEST here: a second one starts
            try:
                _pack(src, dest)
                second.append(None)
            except PackError as exc:
                second.append(exc)
        return plan(*a, **kw)

    monkeypatch.setattr(packmod, "_plan", plan_then_race)
    report = _pack(src, dest)
    assert isinstance(second[0], PackError), "the second pack ran into the first one's DEST"
    assert "another 'stagefs pack' is writing" in str(second[0]) and str(dest) in str(second[0])
    assert report.files == 6
    monkeypatch.setattr(packmod, "_plan", plan)
    assert verify_pack(dest, jobs=1, progress=False).ok
    with stagefs.open(dest) as fs:
        assert fs.read("f3") == random_bytes(3000, seed=3)
    # the lock went with the pack: packing again (--force) is allowed
    assert _pack(src, dest, overwrite=True).files == 6


def test_force_replaces_the_contents_and_keeps_the_dest_directory(tmp_path: Path) -> None:
    src, dest = _tree(tmp_path / "src"), tmp_path / "out"
    _pack(src, dest)
    ino = dest.stat().st_ino
    (dest / "stray").write_bytes(b"x")
    (dest / "sub").mkdir()
    _pack(src, dest, overwrite=True)
    assert dest.stat().st_ino == ino  # emptied, not removed: the lock is on this directory
    assert not (dest / "stray").exists() and not (dest / "sub").exists()
    assert verify_pack(dest, jobs=1, progress=False).ok


def test_a_dest_that_is_a_file_is_named(tmp_path: Path) -> None:
    src, dest = _tree(tmp_path / "src"), tmp_path / "out"
    dest.write_bytes(b"not a directory")
    with pytest.raises(PackError, match="is a file, not a directory") as ei:
        _pack(src, dest)
    assert str(dest) in str(ei.value)
    assert dest.read_bytes() == b"not a directory"


def test_the_scan_shows_its_progress(tmp_path: Path, capsys: pytest.CaptureFixture[str]
                                     ) -> None:
    """Before, nothing was printed until the whole tree was scanned (minutes for a million
    files on a shared file system): the pack looked hung."""
    src = _tree(tmp_path / "src", files=30)
    stagefs.pack(src, tmp_path / "out", jobs=1, progress=True, echo=lambda _m: None)
    err = capsys.readouterr().err
    assert f"scanning {src}" in err and "entries" in err, err
