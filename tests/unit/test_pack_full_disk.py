"""A full file system (or a used-up quota) under DEST: pack and unpack say which DEST and
what to do, in one line from the CLI; a pack that ran out of room resumes once there is."""

from __future__ import annotations

import errno
import importlib
import io
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import stagefs
from conftest import random_bytes, small_tmpfs, snapshot_tree
from stagefs.cli import main
from stagefs.errors import DestinationExistsError, DestinationFullError, PackError
from stagefs.format import ShardWriter

packmod = importlib.import_module("stagefs.pack")  # `stagefs.pack` is the function


def _pack(src: Path, dest: Path, **kw: Any) -> stagefs.PackReport:
    kw.setdefault("jobs", 1)
    return stagefs.pack(src, dest, progress=False, echo=kw.pop("echo", lambda _m: None),
                        **kw)


@pytest.fixture
def src(tmp_path: Path) -> Path:
    """1.8 MB in files of 3 KB (written through the shard file's buffer), packed first,
    then 0.6 MB in files of 300 KB."""
    root = tmp_path / "src"
    for d in ("small", "zbig"):
        (root / d).mkdir(parents=True)
    for i in range(600):
        (root / "small" / f"s{i:03d}").write_bytes(random_bytes(3000, i))
    for i in range(2):
        (root / "zbig" / f"b{i}").write_bytes(random_bytes(300_000, 1000 + i))
    return root


def _mount(where: Path, size: str, *more: str) -> subprocess.CompletedProcess[str]:
    opts = ",".join((*more, f"size={size}"))
    return subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(where)],
                          capture_output=True, text=True, timeout=30, check=False)


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    """A file system of 1 MiB (a tmpfs): skipped only where this process cannot mount one."""
    with small_tmpfs(tmp_path / "small_fs", "1M") as where:
        yield where


@pytest.mark.parametrize("jobs", [1, 2])
def test_pack_onto_a_full_file_system_names_dest_and_resumes(
        tmp_path: Path, src: Path, small_fs: Path, jobs: int) -> None:
    dest = small_fs / "p.pack"
    with pytest.raises(DestinationFullError) as err:
        _pack(src, dest, shard_size="256KiB", jobs=jobs)
    e = err.value
    assert isinstance(e, PackError) and isinstance(e, OSError)
    assert (e.errno, e.filename) == (errno.ENOSPC, str(dest))
    msg = str(e)
    assert msg.startswith(f"{dest}: No space left on device: ")
    assert "Free space there, or choose another DEST" in msg
    assert "running the same command again resumes the pack" in msg
    assert not list(dest.glob("*.partial"))  # no half shard keeps the room it took
    assert not (dest / "manifest.sfm").exists()
    # what the message promises: with room, the same command resumes
    assert _mount(small_fs, "16M", "remount").returncode == 0
    said: list[str] = []
    report = _pack(src, dest, shard_size="256KiB", jobs=jobs, echo=said.append)
    assert report.reused_shards >= 1 and any("resuming" in s for s in said), said
    stagefs.unpack(dest, tmp_path / "out", progress=False)
    assert snapshot_tree(tmp_path / "out") == snapshot_tree(src)


def test_unpack_onto_a_full_file_system_names_dest(tmp_path: Path, src: Path,
                                                   small_fs: Path) -> None:
    _pack(src, tmp_path / "p.pack", shard_size="256KiB")
    dest = small_fs / "out"
    with pytest.raises(DestinationFullError) as err:
        stagefs.unpack(tmp_path / "p.pack", dest, progress=False)
    assert err.value.errno == errno.ENOSPC
    msg = str(err.value)
    assert msg.startswith(f"{dest}: No space left on device: ")
    assert "choose another DEST" in msg and f"remove {dest}" in msg


# ------------------------------------------------- the same, injected (runs everywhere)


def _no_room_in_shards(monkeypatch: pytest.MonkeyPatch, code: int) -> None:
    def append(self: ShardWriter, data: bytes) -> int:
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(ShardWriter, "append", append)


def _no_room_in_files(monkeypatch: pytest.MonkeyPatch, code: int) -> None:
    """unpack's file writes fail (``os.fdopen(fd, "wb")``: the file it writes through)."""
    real = os.fdopen

    class NoRoom(io.FileIO):
        def write(self, _data: Any) -> int:
            raise OSError(code, os.strerror(code))

    def fdopen(fd: int, mode: str = "r", *a: Any, **k: Any) -> Any:
        return NoRoom(fd, "wb") if "w" in mode else real(fd, mode, *a, **k)

    monkeypatch.setattr(os, "fdopen", fdopen)


_SAID = {errno.ENOSPC: ("No space left on device: the file system that holds it is full. "
                        "Free space there, or choose another DEST."),
         errno.EDQUOT: ("Disk quota exceeded: the disk quota on the file system that holds it "
                        "is used up. Free space within the quota (or have it raised), or "
                        "choose another DEST.")}


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EDQUOT], ids=["ENOSPC", "EDQUOT"])
@pytest.mark.parametrize("command", ["pack", "unpack"])
def test_cli_says_which_dest_is_full_and_what_to_do(
        tmp_path: Path, src: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str], code: int, command: str) -> None:
    dest = tmp_path / "dest"
    if command == "pack":
        _no_room_in_shards(monkeypatch, code)
        argv = ["pack", "--jobs", "1", str(src), str(dest)]
        then = "Once there is room, running the same command again resumes the pack"
    else:
        _pack(src, tmp_path / "p.pack")
        _no_room_in_files(monkeypatch, code)
        argv = ["unpack", str(tmp_path / "p.pack"), str(dest)]
        then = f"Unpack writes into an empty directory only: remove {dest}"
    assert main(argv) == 1
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and "[Errno" not in err
    assert err.startswith(f"stagefs: error: {dest}: {_SAID[code]} {then}"), err


def test_pack_full_before_its_state_is_written_says_force(
        tmp_path: Path, src: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Out of room for the pack's own state file: a run without --force would refuse the
    DEST left behind (not empty, not an interrupted pack), so the message says --force."""
    dest = tmp_path / "p.pack"
    real = packmod._write_json

    def write_json(path: str, obj: Any) -> None:
        if path.endswith("state.json"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real(path, obj)

    monkeypatch.setattr(packmod, "_write_json", write_json)
    with pytest.raises(DestinationFullError, match="with --force"):
        _pack(src, dest)
    monkeypatch.undo()
    with pytest.raises(DestinationExistsError):
        _pack(src, dest)
    assert _pack(src, dest, overwrite=True).files == 602
