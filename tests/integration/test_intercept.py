"""Interception (``stagefs.intercept``, ``stagefs run``): the real directory is the oracle."""

from __future__ import annotations

import builtins
import errno
import io
import json
import os
import posixpath
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from frontend_probe import build_tree, probe

import stagefs

pytestmark = pytest.mark.integration
HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def tree(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Any]:
    """(real tree, pack of it, the probe's result on the real tree)."""
    base = tmp_path_factory.mktemp("icpt")
    src = build_tree(base / "src")
    np.save(src / "data" / "big.npy", np.arange(300_000, dtype=np.float64))  # > 2 MB
    stagefs.pack(src, base / "pack", shard_size="1MiB", jobs=1, progress=False,
                 echo=lambda _m: None)
    return src, base / "pack", probe(str(src))


@pytest.fixture
def store(tree: tuple[Path, Path, Any]) -> Iterator[stagefs.Store]:
    with stagefs.open(tree[1]) as s:
        yield s


def _diff(a: Any, b: Any, where: str = "") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for k in sorted(set(a) | set(b), key=str):
            out += _diff(a.get(k, "<missing>"), b.get(k, "<missing>"), f"{where}/{k}")
        return out
    return [] if a == b else [f"{where}: real {a!r} != served {b!r}"]


def test_probe_through_interception_equals_real_tree(tree: Any, store: stagefs.Store,
                                                     tmp_path: Path) -> None:
    at = tmp_path / "nowhere" / "dataset"  # does not exist: every answer is the store's
    with stagefs.intercept(store, at=at):
        served = probe(str(at))
    assert _diff(tree[2], served) == []


def test_interception_shadows_an_existing_directory(tree: Any, store: stagefs.Store,
                                                    tmp_path: Path) -> None:
    at = tmp_path / "shadow"
    at.mkdir()
    (at / "only-on-disk").write_bytes(b"x")
    with stagefs.intercept(store, at=at):
        assert not os.path.exists(at / "only-on-disk")
        assert "a.txt" in os.listdir(at)
    assert os.listdir(at) == ["only-on-disk"]


def test_exit_restores_every_original(store: stagefs.Store, tmp_path: Path) -> None:
    import glob
    import pathlib

    def snapshot() -> dict[str, Any]:
        names = [n for n in dir(os) if callable(getattr(os, n))]
        d = {f"os.{n}": getattr(os, n) for n in names}
        d |= {f"path.{n}": getattr(posixpath, n) for n in dir(posixpath)}
        d |= {"builtins.open": builtins.open, "io.open": io.open}
        d |= {f"glob.{n}": getattr(glob, n) for n in dir(glob)}
        d |= {f"pathlib.{n}": getattr(pathlib.Path, n) for n in dir(pathlib.Path)}
        return d

    env_before = dict(os.environ)
    before = snapshot()
    with stagefs.intercept(store, at=tmp_path / "d") as icpt:
        assert icpt.active
        assert builtins.open is not before["builtins.open"]
        assert os.stat is not before["os.stat"]
        assert os.environ["STAGEFS_INTERCEPT_AT"] == str(tmp_path / "d")
    after = snapshot()
    changed = [k for k in before if before[k] != after[k]]
    assert changed == []
    assert dict(os.environ) == env_before
    with pytest.raises(FileNotFoundError):
        os.stat(tmp_path / "d" / "a.txt")


def test_exit_restores_after_an_exception(store: stagefs.Store, tmp_path: Path) -> None:
    original = os.stat
    with pytest.raises(KeyError), stagefs.intercept(store, at=tmp_path / "d"):
        raise KeyError("boom")
    assert os.stat is original


def test_nested_interceptions_of_two_paths(tree: Any, store: stagefs.Store,
                                           tmp_path: Path) -> None:
    with stagefs.open(tree[1]) as other, stagefs.intercept(store, at=tmp_path / "one"), \
            stagefs.intercept(other, at=tmp_path / "two"):
        assert (tmp_path / "one" / "a.txt").read_bytes() == (tree[0] / "a.txt").read_bytes()
        assert os.path.isdir(tmp_path / "two" / "img")
    assert not os.path.exists(tmp_path / "one")


def test_writes_under_the_path_fail_with_erofs(store: stagefs.Store, tmp_path: Path) -> None:
    at = tmp_path / "ro"
    attempts = {
        "open w": lambda: open(at / "new.txt", "w"),  # noqa: SIM115
        "open a": lambda: open(at / "a.txt", "ab"),  # noqa: SIM115
        "open r+": lambda: open(at / "a.txt", "r+b"),  # noqa: SIM115
        "open x": lambda: open(at / "x", "x"),  # noqa: SIM115
        "os.open": lambda: os.open(at / "a.txt", os.O_WRONLY),
        "os.open creat": lambda: os.open(at / "n", os.O_CREAT | os.O_WRONLY),
        "mkdir": lambda: os.mkdir(at / "d"),
        "makedirs": lambda: os.makedirs(at / "d" / "e"),
        "remove": lambda: os.remove(at / "a.txt"),
        "rmdir": lambda: os.rmdir(at / "emptydir"),
        "rename": lambda: os.rename(at / "a.txt", at / "b.txt"),
        "rename out": lambda: os.rename(at / "a.txt", tmp_path / "b.txt"),
        "chmod": lambda: os.chmod(at / "a.txt", 0o777),
        "utime": lambda: os.utime(at / "a.txt"),
        "symlink": lambda: os.symlink("a.txt", at / "l"),
        "write_text": lambda: (at / "w.txt").write_text("x"),
        "touch": lambda: (at / "t").touch(),
        "unlink": lambda: (at / "a.txt").unlink(),
    }
    with stagefs.intercept(store, at=at):
        for name, fn in attempts.items():
            with pytest.raises(OSError) as info:
                fn()
            assert info.value.errno == errno.EROFS, name
        assert (at / "a.txt").read_bytes()  # reading still works


def test_copytree_keeps_symlinks_and_links_may_point_in(tree: Any, store: stagefs.Store,
                                                        tmp_path: Path) -> None:
    """shutil asks os.supports_follow_symlinks before it passes follow_symlinks=False (a
    replacement missing from it made copystat of a symlink fail on None), and a symlink's
    target is text, not a path it writes to."""
    import shutil

    at = tmp_path / "data"
    with stagefs.intercept(store, at=at):
        shutil.copytree(at, tmp_path / "copy", symlinks=True)
        os.symlink(at / "a.txt", tmp_path / "to-a")
        assert os.readlink(tmp_path / "to-a") == str(at / "a.txt")
        with pytest.raises(OSError) as info:
            os.symlink(tmp_path / "x", at / "l")
        assert info.value.errno == errno.EROFS
    left = os.supports_dir_fd | os.supports_fd | os.supports_follow_symlinks
    assert not [f for f in left if f.__module__ == "stagefs.posix.intercept"]  # all undone
    assert os.readlink(tmp_path / "copy" / "link_dir") == "img"
    assert (tmp_path / "copy" / "a.txt").read_bytes() == (tree[0] / "a.txt").read_bytes()


def test_names_relative_to_a_dir_fd_are_not_judged_by_the_cwd(store: stagefs.Store,
                                                              tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch
                                                              ) -> None:
    """shutil.rmtree of a tree elsewhere, from a current directory inside the intercepted
    path, unlinks names relative to a directory descriptor: they are not under the path."""
    import shutil

    at = tmp_path / "data"
    at.mkdir()  # on disk, so that the current directory can be in it
    (tmp_path / "scratch" / "img").mkdir(parents=True)
    (tmp_path / "scratch" / "img" / "cat.jpg").write_bytes(b"x")
    (tmp_path / "scratch" / "a.txt").write_bytes(b"x")
    monkeypatch.chdir(at)
    with stagefs.intercept(store, at=at):
        shutil.rmtree(tmp_path / "scratch")
        with pytest.raises(OSError) as info:
            os.unlink("a.txt")
        assert info.value.errno == errno.EROFS
    assert not (tmp_path / "scratch").exists()


def test_paths_outside_are_untouched(store: stagefs.Store, tmp_path: Path) -> None:
    at = tmp_path / "data"
    near = tmp_path / "data2"  # shares a prefix with `at` but is another directory
    with stagefs.intercept(store, at=at):
        near.mkdir()
        (near / "f.txt").write_text("written while intercepting")
        assert os.listdir(near) == ["f.txt"]
        assert (near / "f.txt").read_text() == "written while intercepting"
        assert os.stat(near / "f.txt").st_size == 26
        fd = os.open(near / "f.txt", os.O_RDONLY)
        os.close(fd)
        os.remove(near / "f.txt")
        assert not os.path.exists(near / "f.txt")


def test_relative_bytes_and_unnormalised_paths(tree: Any, store: stagefs.Store,
                                               tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    at = tmp_path / "rel"
    real = (tree[0] / "img" / "cat.jpg").read_bytes()
    monkeypatch.chdir(tmp_path)
    with stagefs.intercept(store, at="rel"):
        for name in ("rel/img/cat.jpg", f"{tmp_path}//rel/./data/../img/cat.jpg",
                     os.fsencode(at / "img" / "cat.jpg")):
            with open(name, "rb") as f:
                assert f.read() == real
        assert sorted(os.listdir(os.fsencode(at / "img"))) == sorted(
            os.fsencode(n) for n in os.listdir(tree[0] / "img"))
        with open(at / "img" / "cat.jpg", "rb") as f:
            assert f.name == str(at / "img" / "cat.jpg")
        assert os.stat(at).st_mode == os.stat(at / ".").st_mode


def test_pil_and_numpy_including_mmap(tree: Any, store: stagefs.Store, tmp_path: Path) -> None:
    pil = pytest.importorskip("PIL.Image")
    src = tree[0]
    img = tmp_path / "img.png"
    pil.new("RGB", (31, 17), (10, 200, 30)).save(img)
    at = tmp_path / "served"
    with stagefs.intercept(store, at=at):
        small = np.load(at / "data" / "arr.npy")
        big = np.load(at / "data" / "big.npy")
        mm = np.load(at / "data" / "big.npy", mmap_mode="r")
        assert isinstance(mm, np.memmap)
        assert np.array_equal(mm, big)
        assert float(mm[123_456]) == 123_456.0
        del mm
        with pytest.raises(OSError) as info:
            np.load(at / "data" / "big.npy", mmap_mode="r+")
        assert info.value.errno == errno.EROFS
        with pil.open(img) as im:  # outside the path: untouched
            assert im.size == (31, 17)
    assert np.array_equal(small, np.load(src / "data" / "arr.npy"))
    assert np.array_equal(big, np.load(src / "data" / "big.npy"))


def test_pil_open_of_an_intercepted_image(tmp_path: Path) -> None:
    pil = pytest.importorskip("PIL.Image")
    src = tmp_path / "imgs"
    (src / "c").mkdir(parents=True)
    pil.new("RGB", (40, 30), (1, 2, 3)).save(src / "c" / "x.jpeg", quality=95)
    pil.new("L", (8, 9), 77).save(src / "c" / "y.png")
    pil.new("RGB", (5, 6), (9, 9, 9)).save(src / "c" / "z.bmp")  # PIL maps raw formats
    stagefs.pack(src, tmp_path / "p", jobs=1, progress=False, echo=lambda _m: None)
    at = tmp_path / "mnt"
    with stagefs.open(tmp_path / "p") as s, stagefs.intercept(s, at=at):
        for name in ("x.jpeg", "y.png", "z.bmp"):
            with pil.open(at / "c" / name) as im:
                got = (im.size, im.convert("RGB").tobytes())
            with pil.open(src / "c" / name) as im:
                assert got == (im.size, im.convert("RGB").tobytes())


def test_os_open_gives_a_readable_fd(tree: Any, store: stagefs.Store, tmp_path: Path) -> None:
    at = tmp_path / "fd"
    real = (tree[0] / "sizes" / "odd").read_bytes()
    with stagefs.intercept(store, at=at):
        fd = os.open(at / "sizes" / "odd", os.O_RDONLY)
        try:
            assert os.fstat(fd).st_size == len(real)
            assert os.pread(fd, 100, 1000) == real[1000:1100]
        finally:
            os.close(fd)
        with pytest.raises(OSError) as info:
            os.open(at / "img", os.O_RDONLY)
        assert info.value.errno == errno.ENOTSUP
        with pytest.raises(FileNotFoundError):
            os.open(at / "missing", os.O_RDONLY)
        with open(at / "sizes" / "odd", "rb") as f:
            assert os.pread(f.fileno(), 10, 5) == real[5:15]


def test_refuses_a_dataset_under_its_own_path(store: stagefs.Store) -> None:
    with pytest.raises(stagefs.ConfigError, match="under the intercepted path"):
        stagefs.intercept(store, at=os.path.dirname(store.pack_dir)).__enter__()
    with pytest.raises(stagefs.ConfigError, match="cannot intercept '/'"):
        stagefs.intercept(store, at="/").__enter__()


def _run(cmd: list[str], **kw: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False, **kw)


def test_stagefs_run_serves_a_python_program(tree: Any, tmp_path: Path) -> None:
    at = tmp_path / "lustre" / "imagenet"
    r = _run([sys.executable, "-m", "stagefs.cli", "run", "--dataset", str(tree[1]),
              "--at", str(at), "--", sys.executable, str(HERE / "frontend_probe.py"),
              str(at)])
    assert r.returncode == 0, r.stderr
    assert _diff(tree[2], json.loads(r.stdout)) == []


def test_stagefs_run_reaches_grandchildren_and_keeps_exit_codes(tree: Any,
                                                                tmp_path: Path) -> None:
    at = tmp_path / "x"
    inner = tmp_path / "inner.py"
    inner.write_text(f"import os, sys\nsys.exit(7 if os.path.isfile({str(at / 'a.txt')!r}) "
                     "else 1)\n")
    outer = tmp_path / "outer.py"
    outer.write_text("import subprocess, sys\n"
                     f"sys.exit(subprocess.run([sys.executable, {str(inner)!r}]).returncode)\n")
    r = _run([sys.executable, "-m", "stagefs.cli", "run", "--dataset", str(tree[1]),
              "--at", str(at), "--", "sh", "-c", f"{sys.executable} {outer}"])
    assert r.returncode == 7, r.stderr


def test_stagefs_run_errors_are_clear(tree: Any, tmp_path: Path) -> None:
    r = _run([sys.executable, "-m", "stagefs.cli", "run", "--dataset", str(tmp_path / "no"),
              "--at", str(tmp_path), "--", sys.executable, "-c", "pass"])
    assert r.returncode == 1 and "no dataset here" in r.stderr
    r = _run([sys.executable, "-m", "stagefs.cli", "run", "--dataset", str(tree[1]),
              "--at", str(tmp_path / "a"), "--", "no-such-command-x"])
    assert r.returncode == 127 and "no-such-command-x: command not found" in r.stderr


def test_subprocess_inside_the_api_block_is_intercepted(tree: Any, store: stagefs.Store,
                                                        tmp_path: Path) -> None:
    at = tmp_path / "api"
    with stagefs.intercept(store, at=at):
        r = _run([sys.executable, str(HERE / "frontend_probe.py"), str(at)])
    assert r.returncode == 0, r.stderr
    assert _diff(tree[2], json.loads(r.stdout)) == []
    r = _run([sys.executable, "-c", f"import os; print(os.path.exists({str(at)!r}))"])
    assert r.stdout.strip() == "False"  # after the block: not intercepted


_LOADER = """
import hashlib, os, sys
import torch
from torch.utils.data import DataLoader, Dataset

root = sys.argv[1]
files = sorted(os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs
               if os.path.isfile(os.path.join(d, f)))

class Files(Dataset):
    def __len__(self):
        return len(files)
    def __getitem__(self, i):
        with open(files[i], "rb") as f:
            return os.path.relpath(files[i], root), hashlib.sha1(f.read()).hexdigest()

def collate(batch):
    return batch

if __name__ == "__main__":
    dl = DataLoader(Files(), batch_size=4, num_workers=2, multiprocessing_context=sys.argv[2],
                    collate_fn=collate)
    print(sorted(x for batch in dl for x in batch))
"""


@pytest.mark.slow
@pytest.mark.parametrize("ctx", ["fork", "spawn"])
def test_dataloader_workers_are_intercepted(tree: Any, store: stagefs.Store, tmp_path: Path,
                                            ctx: str) -> None:
    pytest.importorskip("torch")
    script = tmp_path / "loader.py"
    script.write_text(_LOADER)
    real = _run([sys.executable, str(script), str(tree[0]), ctx])
    assert real.returncode == 0, real.stderr
    at = tmp_path / "served"
    served = _run([sys.executable, "-m", "stagefs.cli", "run", "--dataset", str(tree[1]),
                   "--at", str(at), "--", sys.executable, str(script), str(at), ctx])
    assert served.returncode == 0, served.stderr
    assert served.stdout == real.stdout
    assert len(eval(real.stdout)) > 20


def test_a_file_of_a_cut_shard_fails_with_eio_naming_it(tmp_path: Path) -> None:
    """A file whose bytes a shard cut short in the pack lost: a large file's range read, a
    whole read and os.open fail with an OSError (EIO) that names the file and the shard, as the
    preload library and a FUSE mount answer, not with a ValueError (the Store's
    CorruptShardError) that a program's ``except OSError`` does not catch; the files
    before the cut still read."""
    import shutil

    src = tmp_path / "src"
    src.mkdir()
    small, big = os.urandom(50_000), os.urandom(3 * 2**20 + 5)
    (src / "a.bin").write_bytes(small)
    (src / "z.bin").write_bytes(big)  # after a.bin in the shard
    stagefs.pack(src, tmp_path / "pack", compress="none", jobs=1, progress=False,
                 echo=lambda _m: None)
    pack = tmp_path / "cut"
    shutil.copytree(tmp_path / "pack", pack)
    with stagefs.open(pack) as s:
        m = s.manifest
        e = m.lookup(b"z.bin")
        shard = m.shards[int(m.shard[e])].name
        os.truncate(pack / shard, int(m.offset[e]) + 2**20 + 7)  # z.bin's second MiB on
    at = tmp_path / "nowhere"
    with stagefs.open(pack) as s, stagefs.intercept(s, at=at):
        assert (at / "a.bin").read_bytes() == small

        def ranged() -> None:
            with open(at / "z.bin", "rb") as f:
                f.seek(2 * 2**20)
                f.read(1000)

        for read in (ranged, lambda: (at / "z.bin").read_bytes(),
                     lambda: os.read(os.open(at / "z.bin", os.O_RDONLY), 10)):
            with pytest.raises(OSError) as err:
                read()
            assert err.value.errno == errno.EIO
            assert "z.bin" in str(err.value) and shard in str(err.value)
            assert "truncated" in str(err.value)
