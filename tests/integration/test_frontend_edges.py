"""The POSIX front ends (``stagefs mount``/``umount``, ``stagefs run``) given what users give
them: a mount point named in another script than ASCII, ``stagefs umount`` of a file system
stagefs did not mount, ``tar -C`` the parent of ``--at``, ``ls -la`` of ``--at``."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tarfile
from collections.abc import Iterator
from pathlib import Path

import pytest

import stagefs
from conftest import build_sample_tree
from stagefs._native import preload_library
from stagefs.errors import ConfigError
from stagefs.posix import fuse

pytestmark = pytest.mark.integration

SRC = Path(__file__).resolve().parents[2] / "src"
ROOT = pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")
FUSE = pytest.mark.skipif(fuse.fuse_available() is not None, reason=str(fuse.fuse_available()))
PRELOAD = pytest.mark.skipif(preload_library() is None,
                             reason="the preload library is not built (no C compiler)")


def _env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(SRC), os.environ.get(
        "PYTHONPATH", "")]).rstrip(os.pathsep), STAGEFS_TIERS="")


def _stagefs(*args: str | Path) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run([sys.executable, "-m", "stagefs.cli", *map(str, args)],
                          capture_output=True, timeout=120, env=_env(), check=False)


@pytest.fixture(scope="module")
def packed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    base = tmp_path_factory.mktemp("edges")
    src = build_sample_tree(base / "src")
    pack = base / "pack"
    stagefs.pack(str(src), str(pack), jobs=1, progress=False, echo=lambda _m: None)
    return src, pack


@contextlib.contextmanager
def _tmpfs(mp: Path) -> Iterator[Path]:
    mp.mkdir(parents=True)
    subprocess.run(["mount", "-t", "tmpfs", "edges", str(mp)], check=True, timeout=30)
    try:
        yield mp
    finally:
        subprocess.run(["umount", str(mp)], check=False, timeout=30)


@ROOT
@pytest.mark.parametrize("name", ["données é", "a\nb", "back\\slash", "tab\there"])
def test_a_mount_point_named_in_any_script_is_seen_mounted(tmp_path: Path, name: str) -> None:
    """/proc/self/mountinfo escapes a mount point's space, tab, newline and backslash and
    leaves UTF-8 as bytes: all must be read back (a non-ASCII name was never seen mounted, so
    ``stagefs mount`` waited 60 s, then killed the server it had started)."""
    with _tmpfs(tmp_path / name) as mp:
        assert fuse.is_mounted(str(mp))
    assert not fuse.is_mounted(str(tmp_path / name))


@ROOT
@FUSE
def test_mount_comes_up_at_a_non_ascii_mount_point(packed: tuple[Path, Path],
                                                   tmp_path: Path) -> None:
    src, pack = packed
    mp = tmp_path / "données"
    mp.mkdir()
    try:
        r = _stagefs("mount", pack, mp)
        assert r.returncode == 0, r.stderr.decode()
        assert (mp / "a.txt").read_bytes() == (src / "a.txt").read_bytes()
        fuse.unmount(str(mp))
        assert not fuse.is_mounted(str(mp))
    finally:  # whatever is_mounted says
        subprocess.run(["fusermount3", "-u", str(mp)], capture_output=True, check=False,
                       timeout=30)


@ROOT
def test_umount_refuses_a_mount_that_is_not_stagefs(tmp_path: Path) -> None:
    """``stagefs umount`` of a tmpfs (a bind mount, /proc) names what is there and leaves
    it: it ran fusermount3, then umount, which unmounted it and lost its files."""
    with _tmpfs(tmp_path / "scratch") as mp:
        (mp / "keep").write_bytes(b"precious\n")
        with pytest.raises(ConfigError, match=r"not a stagefs mount .*tmpfs"):
            fuse.unmount(str(mp))
        r = _stagefs("umount", mp)
        assert r.returncode != 0
        assert b"not a stagefs mount" in r.stderr
        assert fuse.is_mounted(str(mp))
        assert (mp / "keep").read_bytes() == b"precious\n"


@PRELOAD
def test_run_tar_from_the_parent_of_at(packed: tuple[Path, Path], tmp_path: Path) -> None:
    """docs/cli.md's example, ``tar cf - -C /data imagenet`` with ``--at /data/imagenet``:
    tar asks ``fstatat(fd of /data, "imagenet")``, a real directory's descriptor and a
    relative path into the tree (it said "imagenet: Cannot stat: No such file")."""
    src, pack = packed
    (tmp_path / "data").mkdir()
    at = tmp_path / "data" / "imagenet"
    out = tmp_path / "out.tar"
    r = _stagefs("run", "--dataset", pack, "--at", at, "--",
                 "tar", "cf", out, "-C", tmp_path / "data", "imagenet")
    assert r.returncode == 0, r.stderr.decode()
    with tarfile.open(out) as t:
        got = {m.name: t.extractfile(m).read()  # type: ignore[union-attr]
               for m in t.getmembers() if m.isfile()}
    want = {f"imagenet/{p.relative_to(src)}": p.read_bytes()
            for p in src.rglob("*") if p.is_file() and not p.is_symlink()}
    assert got == want
    # and through ".." from a sibling's descriptor, and "./" first
    r = _stagefs("run", "--dataset", pack, "--at", at, "--", "sh", "-c",
                 f"tar cf - -C '{tmp_path}/data' ./imagenet/a.txt | tar xOf - && "
                 f"mkdir -p '{tmp_path}/data/side' && "
                 f"tar cf - -C '{tmp_path}/data/side' ../imagenet/a.txt | tar xOf -")
    assert r.returncode == 0, r.stderr.decode()
    assert r.stdout == (src / "a.txt").read_bytes() * 2


@PRELOAD
def test_run_ls_la_of_at_says_nothing_wrong(packed: tuple[Path, Path], tmp_path: Path) -> None:
    """``ls -la AT`` asks ``lgetxattr("AT/..")``: the real parent, not a path the kernel
    cannot find (AT is not on disk): "ls: AT/..: No such file or directory" and exit 1."""
    _src, pack = packed
    at = tmp_path / "at"
    r = _stagefs("run", "--dataset", pack, "--at", at, "--", "ls", "-la", at)
    assert r.returncode == 0 and r.stderr == b"", r.stderr.decode()
    names = [line.split()[-1] for line in r.stdout.decode().splitlines()[1:]]
    assert ".." in names and "a.txt" in names
