"""In-place datasets: the scan of a raw directory, its cache, and files that change or cannot
be read after it (docs/decisions/0006-in-place-datasets.md)."""

from __future__ import annotations

import errno
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import stagefs
from conftest import as_nobody, world_dir
from stagefs.errors import ConfigError, SourceChangedError, UnreadableSourceError


def test_a_raw_dir_that_is_a_symlink_is_scanned_once(tmp_path: Path) -> None:
    """The root was lstat'ed: its entry had a symlink's mode and the manifest built from it
    was refused as corrupt (a CorruptManifestError traceback, every open)."""
    (tmp_path / "real" / "d").mkdir(parents=True)
    (tmp_path / "real" / "d" / "a").write_bytes(b"a" * 10)
    (tmp_path / "link").symlink_to(tmp_path / "real")
    rt = tmp_path / "rt"
    with stagefs.open(tmp_path / "link", runtime=rt) as fs:
        assert fs.read("d/a") == b"a" * 10
        pid = fs.manifest.pack_id
    with stagefs.open(tmp_path / "link", runtime=rt) as fs:
        assert fs.manifest.pack_id == pid  # the cache was reused
        assert fs.read("d/a") == b"a" * 10


def test_a_file_replaced_by_a_fifo_is_a_change_not_a_hang(tmp_path: Path) -> None:
    """The origin's open of a file that had become a FIFO waited for a writer for ever."""
    root = tmp_path / "raw"
    (root / "d").mkdir(parents=True)
    (root / "d" / "a").write_bytes(b"a" * 10)
    with stagefs.open(root, runtime=tmp_path / "rt") as fs:
        (root / "d" / "a").unlink()
        os.mkfifo(root / "d" / "a")
        got: list[BaseException | bytes] = []

        def read() -> None:
            try:
                got.append(fs.read("d/a"))
            except BaseException as exc:  # handed to the test's thread
                got.append(exc)

        t = threading.Thread(target=read, daemon=True)
        t.start()
        t.join(60)
        if t.is_alive():  # unblock the reader (it waits for a writer), then fail
            os.close(os.open(root / "d" / "a", os.O_WRONLY | os.O_NONBLOCK))
            t.join(10)
            pytest.fail("reading a file replaced by a FIFO hangs")
    assert len(got) == 1 and isinstance(got[0], SourceChangedError), got
    assert str(root / "d" / "a") in str(got[0]) and "regular file" in str(got[0])


def test_an_unreadable_file_says_so_and_keeps_the_scan() -> None:
    """A file the user may not read was called 'changed since the scan; reopen', and the
    cached scan marked stale: every open scanned again, and failed the same way."""
    if os.geteuid() != 0:
        pytest.skip("needs root to read as another user")
    with world_dir() as tmp:
        root = tmp / "raw"
        (root / "d").mkdir(parents=True)
        (root / "d" / "ok").write_bytes(b"ok")
        (root / "d" / "secret").write_bytes(b"secret")
        os.chmod(root / "d" / "secret", 0)
        rt = tmp / "rt"
        rt.mkdir(mode=0o700)
        os.chown(rt, 65534, 65534)  # the runtime of the user who reads

        def read() -> None:
            with stagefs.open(root, runtime=rt) as fs:
                assert fs.read("d/ok") == b"ok"
                try:
                    fs.read("d/secret")
                except UnreadableSourceError as exc:
                    assert exc.errno == errno.EACCES or isinstance(exc, PermissionError)
                    raise
            raise AssertionError("an unreadable file was read")

        code, msg = as_nobody(read)
        assert code == 1, msg
        assert msg.startswith(UnreadableSourceError.__name__), msg
        assert str(root / "d" / "secret") in msg and "chmod" in msg
        assert not list(rt.glob("inplace/*/stale"))  # scanning again would not help


def _dirs(root: Path) -> Iterator[Path]:
    yield root
    yield from (p for p in root.rglob("*") if p.is_dir() and not p.is_symlink())


def test_a_change_in_the_same_tick_as_the_scan_is_seen(tmp_path: Path) -> None:
    """On a file system whose mtimes are whole seconds (Lustre, MooseFS), a file added in
    the second of the scan left its directory's mtime as scanned: the cache was reused for
    the rest of the job, without the file."""
    root = tmp_path / "raw"
    (root / "d").mkdir(parents=True)
    (root / "d" / "a").write_bytes(b"a")
    rt = tmp_path / "rt"
    with stagefs.open(root, runtime=rt) as fs:
        assert fs.listdir("d") == ["a"]
    before = os.stat(root / "d").st_mtime_ns
    (root / "d" / "b").write_bytes(b"b")
    os.utime(root / "d", ns=(before, before))  # what a clock of whole seconds shows
    with stagefs.open(root, runtime=rt) as fs:
        assert fs.listdir("d") == ["a", "b"]
        assert fs.read("d/b") == b"b"
    # a tree left alone since well before its scan: its mtimes suffice, nothing is listed
    for d in _dirs(root):
        t = d.stat().st_mtime_ns - 3600 * 10**9
        os.utime(d, ns=(t, t))
    with stagefs.open(root, runtime=rt) as fs:  # changed: scanned again
        pid = fs.manifest.pack_id
    with stagefs.open(root, runtime=rt) as fs:
        assert fs.manifest.pack_id == pid and fs.origin.stats.opens == 0


def test_a_tree_under_one_directory_is_scanned_in_parallel(tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch
                                                           ) -> None:
    """One thread per top-level directory: a dataset under train/ (ImageNet's layout) was
    scanned by one thread, a metadata round trip at a time, behind a bar of '0/1 dir'."""
    root = tmp_path / "raw"
    classes = [root / "train" / f"c{i}" for i in range(4)]
    for c in classes:
        c.mkdir(parents=True)
        (c / "x").write_bytes(b"x")
    barrier = threading.Barrier(len(classes), timeout=30)
    real = os.scandir
    wanted = {os.fsencode(c) for c in classes}

    def scandir(path: Any = ".") -> Any:
        if os.fsencode(path) in wanted:
            barrier.wait()  # all the classes are listed at once, or this breaks
        return real(path)

    monkeypatch.setattr(os, "scandir", scandir)
    with stagefs.open(root, runtime=tmp_path / "rt") as fs:
        assert fs.listdir("train") == ["c0", "c1", "c2", "c3"]
        assert fs.read("train/c3/x") == b"x"


@pytest.mark.parametrize("inside", ["tier", "runtime"])
def test_a_tier_or_runtime_inside_the_raw_dir_is_refused(tmp_path: Path, inside: str) -> None:
    """A tier (or the runtime) under the raw directory it serves: its shards were scanned
    as files of the dataset, and every open scanned again (a new pack id: no tier copy
    ever reused)."""
    root = tmp_path / "raw"
    (root / "d").mkdir(parents=True)
    (root / "d" / "a").write_bytes(b"a")
    tier = root / ".cache" if inside == "tier" else tmp_path / "t"
    rt = root / ".rt" if inside == "runtime" else tmp_path / "rt"
    with pytest.raises(ConfigError) as err:
        stagefs.open(root, tiers=[f"{tier}:1MiB"], runtime=rt)
    named = tier if inside == "tier" else rt
    assert str(named) in str(err.value) and "outside" in str(err.value)
    # beside it, not inside: fine
    with stagefs.open(root, tiers=[f"{tmp_path / 'raw-tier'}:1MiB"],
                      runtime=tmp_path / "rt2") as fs:
        assert fs.read("d/a") == b"a"


def test_an_older_scans_table_never_touches_the_new_scans(tmp_path: Path) -> None:
    """One table of checksums per raw directory: a process that had opened the scan before
    another process scanned again, and made its table after, opened the new scan's table,
    resized it (a mapping cut short: SIGBUS) and recorded its sums under entry numbers that
    name other files in the new scan."""
    from stagefs.inplace import open_manifest
    from stagefs.runtime import Runtime
    from stagefs.tiers.inplace import SumTable

    root = tmp_path / "raw"
    (root / "d").mkdir(parents=True)
    for i in range(3):
        (root / "d" / f"f{i}").write_bytes(b"x" * i)
    rt = Runtime(str(tmp_path / "rt")).open()
    try:
        m1, c1, _ = open_manifest(str(root), rt, progress=False)
        (root / "d" / "f9").write_bytes(b"new")  # another process scans again
        t = os.stat(root / "d").st_mtime_ns + 10**9
        os.utime(root / "d", ns=(t, t))
        m2, c2, scanned = open_manifest(str(root), rt, progress=False)
        assert scanned and m2.pack_id != m1.pack_id
        new = SumTable(c2.sums_path, len(m2))
        old = SumTable(c1.sums_path, len(m1))  # made late, by the first process
        for e in range(len(m1)):
            old.record(e, 1234)
        assert os.path.getsize(c2.sums_path) == 9 * len(m2)  # not resized
        assert not any(new.known(e) or new.sums[e] for e in range(len(m2)))
        c1.mark_stale("a file of the old scan changed")  # the new scan is not condemned
        m3, _c3, scanned = open_manifest(str(root), rt, progress=False)
        assert not scanned and m3.pack_id == m2.pack_id
        for x in (old, new):
            x.close()
        for m in (m1, m2, m3):
            m.close()
    finally:
        rt.unregister()


def test_a_raw_dir_whose_name_is_not_utf8(tmp_path: Path) -> None:
    """The cache's key was the root encoded as UTF-8: a name of other bytes (as os.listdir
    gives it) was a UnicodeEncodeError."""
    root = os.path.join(os.fsencode(tmp_path), b"raw\xff")
    os.makedirs(os.path.join(root, b"d"))
    with open(os.path.join(root, b"d", b"a"), "wb") as f:
        f.write(b"a")
    with stagefs.open(os.fsdecode(root), runtime=tmp_path / "rt") as fs:
        assert fs.read("d/a") == b"a"


def test_reading_files_in_place_counts_an_open_each_and_no_stat(tmp_path: Path) -> None:
    """The fstat each read makes of the file it opened (still the file scanned?) is part of
    its open, as in Python's own open(); counted as a stat, the demo's first epoch showed
    half again the metadata operations of plain files, which it counts by path too."""
    root = tmp_path / "raw"
    files = {f"d{i % 3}/f{i}": bytes([i]) * (100 + i) for i in range(30)}
    for name, data in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
    with stagefs.open(root, runtime=tmp_path / "rt") as fs:
        before = fs.origin.stats.as_dict()
        assert before["stats"] >= len(files)  # the scan stats every path
        for name, data in files.items():
            assert fs.read(name) == data
        after = fs.origin.stats.as_dict()
    assert after["opens"] - before["opens"] == len(files)
    assert after["stats"] == before["stats"]


def test_symlinks_that_name_nothing_in_the_tree_are_warned_of_at_the_scan(
        tmp_path: Path, runtime: Path, caplog: pytest.LogCaptureFixture) -> None:
    """``stagefs pack`` refuses a symlink out of the tree; used in place, the tree took it
    without a word and each read of it failed as not found."""
    root = tmp_path / "raw"
    (root / "d").mkdir(parents=True)
    (root / "d" / "a.txt").write_bytes(b"a")
    (root / "d" / "in.txt").symlink_to("a.txt")
    (root / "d" / "out.txt").symlink_to("/etc/hostname")
    (root / "d" / "gone.txt").symlink_to("nowhere")
    with caplog.at_level("WARNING", logger="stagefs"), stagefs.open(root) as fs:
        assert fs.read("d/in.txt") == b"a"
        with pytest.raises(FileNotFoundError, match="outside its tree"):
            fs.read("d/out.txt")
    said = [r.getMessage() for r in caplog.records if "symlink" in r.getMessage()]
    assert len(said) == 1, said
    assert "2 symlink(s)" in said[0] and "d/gone.txt, d/out.txt" in said[0]
    caplog.clear()
    with caplog.at_level("WARNING", logger="stagefs"), stagefs.open(root):
        pass  # the cached scan: said once, when scanned
    assert not [r for r in caplog.records if "symlink" in r.getMessage()]
