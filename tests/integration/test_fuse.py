"""``stagefs mount``: a real FUSE mount, the real directory as the oracle."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from frontend_probe import build_tree, probe

import stagefs
from stagefs.posix.fuse import fuse_available, is_mounted

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(fuse_available() is not None, reason=str(fuse_available())),
]


def _run(cmd: list[str], **kw: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False, **kw)


def _stagefs(*args: str) -> subprocess.CompletedProcess[str]:
    return _run([sys.executable, "-m", "stagefs.cli", *args])


@contextlib.contextmanager
def mounted(pack: Path, mp: Path) -> Iterator[Path]:
    """``pack`` mounted at ``mp`` by `stagefs mount` while inside; unmounted after. The
    server's log goes beside ``mp``, not into the system's temp dir: one that logged
    anything (a test's corrupt file) is kept."""
    logs = mp.parent / f"{mp.name}.logs"
    logs.mkdir(exist_ok=True)
    r = _run([sys.executable, "-m", "stagefs.cli", "mount", str(pack), str(mp)],
             env={**os.environ, "TMPDIR": str(logs)})
    assert r.returncode == 0, r.stderr
    assert is_mounted(str(mp))
    try:
        yield mp
    finally:
        r = _stagefs("umount", str(mp))
        assert r.returncode == 0, r.stderr
        assert not is_mounted(str(mp))


@pytest.fixture(scope="module")
def tree(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Any]:
    base = tmp_path_factory.mktemp("fuse")
    src = build_tree(base / "src")
    np.save(src / "data" / "big.npy", np.arange(300_000, dtype=np.float64))
    stagefs.pack(src, base / "pack", shard_size="1MiB", jobs=1, progress=False,
                 echo=lambda _m: None)
    return src, base / "pack", probe(str(src))


@pytest.fixture(scope="module")
def mnt(tree: tuple[Path, Path, Any], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    with mounted(tree[1], tmp_path_factory.mktemp("mnt")) as mp:
        yield mp


def _diff(a: Any, b: Any, where: str = "") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for k in sorted(set(a) | set(b), key=str):
            out += _diff(a.get(k, "<missing>"), b.get(k, "<missing>"), f"{where}/{k}")
        return out
    return [] if a == b else [f"{where}: real {a!r} != mounted {b!r}"]


def test_probe_through_the_mount_equals_real_tree(tree: Any, mnt: Path) -> None:
    assert _diff(tree[2], probe(str(mnt))) == []


def test_ordinary_programs(tree: Any, mnt: Path) -> None:
    src = tree[0]
    for cmd in (["find", ".", "-printf", "%y %m %T@ %p %l\n"],
                ["find", ".", "-type", "f", "-printf", "%s %p\n"],
                ["md5sum", "a.txt", "sizes/five_mb.bin", "names/link_big", "empty.bin"],
                ["cat", "we ird name.txt", "deep/a/b/c/d/e/f.txt"],
                ["ls", "-1A", "img", "."],
                ["stat", "-c", "%n %s %Y %a %F", "a.txt", "img/cat.jpg", "link_dir"]):
        real, served = _run(cmd, cwd=src), _run(cmd, cwd=mnt)
        assert served.returncode == real.returncode == 0, (cmd, served.stderr)
        key = sorted if cmd[0] == "find" else list
        assert key(served.stdout.splitlines()) == key(real.stdout.splitlines()), cmd
    tar = ["tar", "-cf", "-", "--sort=name", "--mtime=@0", "--owner=0", "--group=0",
           "--numeric-owner", "."]
    served_tar = subprocess.run(tar, cwd=mnt, capture_output=True, timeout=120, check=True)
    real_tar = subprocess.run(tar, cwd=src, capture_output=True, timeout=120, check=True)
    assert hashlib.sha1(served_tar.stdout).digest() == hashlib.sha1(real_tar.stdout).digest()


_C = r"""
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>
int main(int argc, char **argv) {
    struct stat s;
    if (stat(argv[1], &s) != 0) { perror("stat"); return 2; }
    int fd = open(argv[1], O_RDONLY);
    if (fd < 0) { perror("open"); return 3; }
    unsigned long h = 5381, m = 5381;
    char buf[7777]; ssize_t n;
    while ((n = read(fd, buf, sizeof buf)) > 0)
        for (ssize_t i = 0; i < n; i++) h = h * 33 + (unsigned char)buf[i];
    unsigned char *p = mmap(NULL, s.st_size, PROT_READ, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) { perror("mmap"); return 4; }
    for (off_t i = 0; i < s.st_size; i++) m = m * 33 + p[i];
    int w = open(argv[1], O_WRONLY);
    printf("%lld %lu %lu %d\n", (long long)s.st_size, h, m, w < 0 ? errno : 0);
    return 0;
}
"""


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler (cc) on this machine")
def test_a_c_program_reads_and_mmaps(tree: Any, mnt: Path, tmp_path: Path) -> None:
    c = tmp_path / "reader.c"
    c.write_text(_C)
    exe = tmp_path / "reader"
    r = _run(["cc", "-O1", "-o", str(exe), str(c)])
    assert r.returncode == 0, r.stderr
    for rel in ("sizes/five_mb.bin", "a.txt", "img/cat.jpg", "sizes/odd"):
        real = _run([str(exe), str(tree[0] / rel)])
        served = _run([str(exe), str(mnt / rel)])
        assert served.returncode == 0, served.stderr
        size, h, m, werr = served.stdout.split()
        assert [size, h, m] == real.stdout.split()[:3]
        assert h == m
        assert int(werr) == errno.EROFS


def test_numpy_mmap_on_the_mount(tree: Any, mnt: Path) -> None:
    mm = np.load(mnt / "data" / "big.npy", mmap_mode="r")
    assert np.array_equal(mm, np.load(tree[0] / "data" / "big.npy"))
    del mm


def test_writes_fail_with_erofs(mnt: Path) -> None:
    attempts = {
        "create": lambda: os.open(mnt / "new", os.O_CREAT | os.O_WRONLY),
        "write": lambda: os.open(mnt / "a.txt", os.O_WRONLY),
        "mkdir": lambda: os.mkdir(mnt / "d"),
        "unlink": lambda: os.unlink(mnt / "a.txt"),
        "rmdir": lambda: os.rmdir(mnt / "emptydir"),
        "rename": lambda: os.rename(mnt / "a.txt", mnt / "b"),
        "chmod": lambda: os.chmod(mnt / "a.txt", 0o777),
        "symlink": lambda: os.symlink("a.txt", mnt / "l"),
    }
    for name, fn in attempts.items():
        with pytest.raises(OSError) as info:
            fn()
        assert info.value.errno == errno.EROFS, name
    assert not os.access(mnt / "a.txt", os.W_OK)
    assert os.access(mnt / "exec.sh", os.X_OK) and not os.access(mnt / "a.txt", os.X_OK)


def test_parallel_reads_from_threads(tree: Any, mnt: Path) -> None:
    rels = [str(p.relative_to(tree[0])) for p in tree[0].rglob("*")
            if p.is_file() and not p.is_symlink()] * 4

    def read(rel: str) -> bool:
        return (mnt / rel).read_bytes() == (tree[0] / rel).read_bytes()

    with ThreadPoolExecutor(8) as pool:
        assert all(pool.map(read, rels))


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_foreground_mount_ends_cleanly_on_a_signal(tree: Any, tmp_path: Path,
                                                   sig: signal.Signals) -> None:
    mp = tmp_path / "m"
    mp.mkdir()
    p = subprocess.Popen([sys.executable, "-m", "stagefs.cli", "mount", "--foreground",
                          str(tree[1]), str(mp)], stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 30
        while not is_mounted(str(mp)) and time.monotonic() < deadline and p.poll() is None:
            time.sleep(0.05)
        assert is_mounted(str(mp))
        assert (mp / "a.txt").read_bytes() == (tree[0] / "a.txt").read_bytes()
        p.send_signal(sig)
        _, err = p.communicate(timeout=30)
        assert not is_mounted(str(mp))
        assert p.returncode == 0, err
        # nothing said that is not a problem (libfuse 3.14 printed "Ignoring invalid max
        # threads value 4294967295 > max (100000)." at every mount)
        assert err == ""
    finally:
        if p.poll() is None:
            p.kill()
        p.communicate()
        if is_mounted(str(mp)):
            _run(["fusermount3", "-u", "-z", str(mp)])


def test_mount_errors_are_clear(tree: Any, tmp_path: Path, mnt: Path) -> None:
    r = _stagefs("mount", str(tree[1]), str(tmp_path / "missing"))
    assert r.returncode == 1 and "does not exist: create it first" in r.stderr
    r = _stagefs("mount", str(tree[1]), str(mnt))
    assert r.returncode == 1 and "already a mount point" in r.stderr
    r = _stagefs("umount", str(tmp_path))
    assert r.returncode == 1 and "is not mounted" in r.stderr
    r = _stagefs("mount", str(tmp_path / "nopack"), str(tmp_path))
    assert r.returncode == 1 and "no dataset here" in r.stderr
    (tmp_path / "files").mkdir()
    (tmp_path / "files" / "a-file").write_bytes(b"x")  # was told to create it (mkdir -p)
    r = _stagefs("mount", str(tree[1]), str(tmp_path / "files" / "a-file"))
    assert r.returncode == 1 and "is a file, not a directory" in r.stderr


def test_detached_server_leaves_no_log_after_a_clean_unmount(
    tree: Any, tmp_path: Path
) -> None:
    logs = tmp_path / "tmp"
    logs.mkdir()
    mp = tmp_path / "m"
    mp.mkdir()
    env = {**os.environ, "TMPDIR": str(logs)}
    r = subprocess.run([sys.executable, "-m", "stagefs.cli", "mount", str(tree[1]), str(mp)],
                       capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stderr
    assert next(p.name for p in logs.iterdir()).startswith("stagefs-mount-")  # while it runs
    assert _stagefs("umount", str(mp)).returncode == 0
    deadline = time.monotonic() + 20
    while any(logs.iterdir()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(logs.iterdir())


def _shard_file(pack: Path, rel: str) -> Path:
    from stagefs.format import MANIFEST_NAME, Manifest

    m = Manifest(str(pack / MANIFEST_NAME))
    try:
        return pack / m.shards[int(m.shard[m.lookup(rel.encode())])].name
    finally:
        m.close()


def test_reads_of_a_damaged_pack_fail_with_eio_and_umount_names_the_kept_log(
    tree: Any, tmp_path: Path
) -> None:
    """Shards truncated, from another pack, or missing after packing: each listed file of
    theirs fails to read with EIO (not EINVAL, not ENOENT), as under `stagefs run`; the
    others read. The reason, each shard's once, on one line, is in the detached server's
    log, which `stagefs umount` names and shows and which outlives the server."""
    src, orig = tree[0], tree[1]
    pack = tmp_path / "pack"
    shutil.copytree(orig, pack)
    other = tmp_path / "other"  # another pack (whose shards hold other bytes)
    stagefs.pack(src, other, shard_size="256KiB", jobs=1, progress=False,
                 echo=lambda _m: None)
    truncated, replaced, missing = "sizes/three_mb.bin", "sizes/five_mb.bin", "sizes/odd"
    shards = {rel: _shard_file(pack, rel) for rel in (truncated, replaced, missing)}
    assert len(set(shards.values())) == 3
    os.truncate(shards[truncated], 3000)
    shutil.copyfile(_shard_file(other, "a.txt"), shards[replaced])
    shards[missing].unlink()
    logs, mp = tmp_path / "tmp", tmp_path / "m"
    logs.mkdir()
    mp.mkdir()
    env = {**os.environ, "TMPDIR": str(logs)}
    r = _run([sys.executable, "-m", "stagefs.cli", "mount", str(pack), str(mp)], env=env)
    assert r.returncode == 0, r.stderr
    server = int(r.stdout.split("server pid ")[1].split(";")[0])
    try:
        for rel in [truncated, replaced, missing] * 2:
            assert (mp / rel).is_file()
            with pytest.raises(OSError) as err:
                (mp / rel).read_bytes()
            assert err.value.errno == errno.EIO, rel
        assert (mp / "a.txt").read_bytes() == (src / "a.txt").read_bytes()
    finally:
        r = _stagefs("umount", str(mp))
    assert r.returncode == 0, r.stderr
    (log,) = logs.iterdir()
    assert f"kept in {log}" in r.stderr
    deadline = time.monotonic() + 30
    while os.path.exists(f"/proc/{server}") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not os.path.exists(f"/proc/{server}")
    lines = log.read_text().splitlines()  # kept after the server ended
    assert "Traceback" not in log.read_text() and "EINVAL" not in log.read_text()
    told = [line for line in lines if "fail with EIO" in line]
    assert len(told) == 3, lines
    for rel, why in ((truncated, "truncated"), (replaced, "another pack"),
                     (missing, "missing from the pack")):
        (line,) = [t for t in told if f"reads from {shards[rel].name} " in t]
        assert str(mp / rel) in line and why in line and str(shards[rel]) in line
        assert line in r.stderr
