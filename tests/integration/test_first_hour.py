"""A new user's first hour, as the README and docs/ tell it: the mistakes they make (a
command pointed at the wrong directory, a busy mount, a tier spec with no directory) get
one clear error that says what to do, and the documented examples do what the text says."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from test_cli import cli_pack, one_line_error, run

from stagefs.posix.fuse import fuse_available, is_mounted

pytestmark = pytest.mark.integration

__all__ = ["cli_pack"]  # the fixture, shared with test_cli


@pytest.mark.skipif(fuse_available() is not None, reason=str(fuse_available()))
def test_umount_of_a_busy_mount_names_who_uses_it_and_offers_lazy(
        cli_pack: tuple[Path, Path], tmp_path: Path) -> None:
    mp = tmp_path / "mp"
    mp.mkdir()
    run("mount", cli_pack[1], mp)
    user = subprocess.Popen(["sleep", "600"], cwd=mp)  # its current directory is in the mount
    try:
        line = one_line_error(run("umount", mp, ok=False), str(mp), "busy",
                              f"pid {user.pid} (sleep)", f"stagefs umount --lazy {mp}")
        assert "fusermount" not in line and "umount -l" not in line
        assert is_mounted(str(mp))
        run("umount", "--lazy", mp)
        assert not is_mounted(str(mp))
        assert sorted(os.listdir(os.fspath(mp))) == []  # the directory is back, empty
    finally:
        user.kill()
        user.wait()
        if is_mounted(str(mp)):
            subprocess.run(["fusermount3", "-uz", str(mp)], check=False)


def test_pack_of_a_pack_is_refused_naming_it(cli_pack: tuple[Path, Path],
                                             tmp_path: Path) -> None:
    pack = cli_pack[1]
    for given in (str(pack), f"{pack}/"):
        one_line_error(run("pack", given, tmp_path / "again", ok=False), str(pack),
                       "is a pack already", f"stagefs info {pack}")
    assert not (tmp_path / "again").exists()


def test_verify_of_the_source_directory_says_it_is_not_a_pack(cli_pack: tuple[Path, Path],
                                                              tmp_path: Path) -> None:
    src = cli_pack[0]
    line = one_line_error(run("verify", src, ok=False), str(src), "not a pack",
                          f"stagefs pack {src} DEST")
    assert "interrupted" not in line
    (tmp_path / "e").mkdir()
    one_line_error(run("verify", tmp_path / "e", ok=False), "an empty directory")


def test_stat_in_a_raw_directory_names_the_file_not_a_shard(
        cli_pack: tuple[Path, Path]) -> None:
    src, pack = cli_pack
    out = run("stat", src, "a.txt").stdout.decode()
    assert f" Bytes: {src / 'a.txt'} (a raw directory" in out
    assert "Shard:" not in out and "xxh3" not in out
    assert " Shard: shard-" in run("stat", pack, "a.txt").stdout.decode()


def test_mount_and_unpack_with_the_arguments_swapped_say_the_order(
        cli_pack: tuple[Path, Path], tmp_path: Path) -> None:
    """'stagefs mount MOUNTPOINT PACK' was told to pass --force-nonempty (which then
    failed on the empty directory taken for the dataset); 'stagefs unpack DEST PACK' that
    the pack was not empty."""
    pack, mp = cli_pack[1], tmp_path / "mp"
    mp.mkdir()
    line = one_line_error(run("mount", mp, pack, ok=False), f"{pack} is a pack",
                          "stagefs mount DATASET MOUNTPOINT")
    assert "--force-nonempty" not in line
    line = one_line_error(run("unpack", tmp_path / "out", pack, ok=False),
                          f"{pack} is a pack", "stagefs unpack PACK DEST")
    assert not (tmp_path / "out").exists() and list(mp.iterdir()) == []
