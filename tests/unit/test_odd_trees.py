"""Trees that real datasets and careless users produce, fed to the packer and to the in-place
scanner: each defect found by feeding them has a test here."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import stagefs
from conftest import as_nobody, world_dir
from stagefs.errors import UnreadableSourceError
from stagefs.inplace import scan_tree

quiet: Callable[[str], None] = lambda _m: None  # noqa: E731


def _pack(src: Path, dest: Path, **kw: Any) -> stagefs.PackReport:
    kw.setdefault("jobs", 1)
    return stagefs.pack(src, dest, progress=False, echo=kw.pop("echo", quiet), **kw)


# ------------------------------------------------------------------ in place: permissions


@pytest.mark.parametrize("where", ["top", "deep"])
def test_inplace_scan_of_a_listable_unsearchable_dir_names_it(where: str) -> None:
    """A directory with r but not x can be listed, its entries not stat'ed: the scan said
    nothing useful (a PermissionError traceback from a scan thread)."""
    with world_dir() as tmp:
        src = tmp / "src"
        bad = src / "rnox" if where == "top" else src / "sub" / "rnox"
        bad.mkdir(parents=True)
        (bad / "x").write_bytes(b"x")
        (src / "ok").write_bytes(b"ok")
        os.chmod(bad, 0o444)
        if os.geteuid() != 0 and os.access(bad / "x", os.F_OK):
            pytest.skip("this user can search a directory without x")
        code, msg = as_nobody(lambda: scan_tree(str(src), progress=False))
        assert code == 1, msg
        assert msg.startswith(UnreadableSourceError.__name__)
        assert str(bad) in msg and "chmod" in msg


def test_inplace_scan_of_an_unsearchable_root_names_it() -> None:
    with world_dir() as tmp:
        src = tmp / "src"
        src.mkdir()
        (src / "x").write_bytes(b"x")
        os.chmod(src, 0o444)
        if os.geteuid() != 0 and os.access(src / "x", os.F_OK):
            pytest.skip("this user can search a directory without x")
        code, msg = as_nobody(lambda: scan_tree(str(src), progress=False))
        assert code == 1, msg
        assert str(src) in msg and "search" in msg


# ------------------------------------------------------------------ a pack killed with SIGKILL

_KILLED_PACK = r"""
import importlib, os, sys, time
import stagefs
packmod = importlib.import_module("stagefs.pack")
verify = importlib.import_module("stagefs.verify")
src, dest, report, what = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]

def stuck(*args, **kwargs):  # a worker busy with a shard (or the verify of one) for long
    os.write(report, b"%d\n" % os.getpid())
    time.sleep(3600)

if what == "pack":
    packmod._write_shard = stuck
    stagefs.pack(src, dest, jobs=2, shard_size=4096, progress=False)
else:
    stagefs.pack(src, dest, jobs=1, shard_size=4096, progress=False)
    verify._verify_shard = stuck
    verify.verify_pack(dest, jobs=2, progress=False)
"""


@pytest.mark.skipif(not hasattr(os, "pidfd_open"), reason="needs pidfd_open (Linux)")
@pytest.mark.parametrize("what", ["pack", "verify"])
def test_workers_end_with_a_killed_command(tmp_path: Path, what: str) -> None:
    """`stagefs pack -j N` or `verify -j N` killed with SIGKILL (kill -9, the OOM killer,
    scancel): its workers lived on forever, and a pack's kept writing shards into DEST."""
    import select
    import signal
    import subprocess
    import sys

    src = tmp_path / "src"
    src.mkdir()
    for i in range(4):
        (src / f"f{i}").write_bytes(bytes([i]) * 4096)
    r, w = os.pipe()
    proc = subprocess.Popen([sys.executable, "-c", _KILLED_PACK, str(src), str(tmp_path / "p"),
                             str(w), what], pass_fds=(w,))
    os.close(w)
    workers: list[int] = []
    try:
        with os.fdopen(r, "rb") as reports:  # each worker says so once inside its task
            workers = [int(reports.readline()) for _ in range(2)]
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        for pid in workers:  # a pidfd turns readable when its process ends
            fd = os.pidfd_open(pid)
            try:
                ended, _, _ = select.select([fd], [], [], 30)
            finally:
                os.close(fd)
            assert ended, f"worker {pid} outlived the killed {what}"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for pid in workers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


# ------------------------------------------------------------------ symlink texts


def test_symlink_text_leads_where_the_link_resolved(tmp_path: Path,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    """A link kept in the pack is read two ways: by the API through the entry resolved when
    packing, and by its text (readlink, unpack, a mount). An absolute link into the tree, a
    link that climbs out of the tree and back in, and a link back into the tree from an
    outside directory that --follow-symlinks brought in had texts that led out of the
    unpacked tree (to the source) or nowhere, while the API read the file."""
    root = tmp_path / "T"
    (root / "sub" / "deep").mkdir(parents=True)
    (tmp_path / "out" / "E").mkdir(parents=True)
    (root / "file").write_bytes(b"f")
    (root / "sub" / "deep" / "g").write_bytes(b"g")
    (tmp_path / "out" / "E" / "e").write_bytes(b"e")
    os.symlink(root / "file", root / "abs")
    os.symlink("../T/file", root / "climb")
    os.symlink("../T/sub", root / "climb_dir")
    os.symlink("../../out/E", root / "sub" / "ext")
    os.symlink("../../T/sub/deep/g", tmp_path / "out" / "E" / "back")
    # kept as they are: ordinary relative links, through other links of the tree too
    os.symlink("../file", root / "sub" / "plain")
    os.symlink("sub/deep", root / "latest")
    os.symlink("latest/g", root / "via_link")
    os.symlink("latest/../plain", root / "dotdot_after_link")  # the kernel: sub/plain
    os.symlink("missing", root / "dangling")
    os.symlink("loop_b", root / "loop_a")
    os.symlink("loop_a", root / "loop_b")
    _pack(root, tmp_path / "p", follow_symlinks=True)
    expect = {"abs": b"f", "climb": b"f", "climb_dir/deep/g": b"g", "sub/ext/back": b"g",
              "sub/plain": b"f", "via_link": b"g", "dotdot_after_link": b"f"}
    with stagefs.open(tmp_path / "p") as fs:
        assert {p: fs.read(p) for p in expect} == expect
        texts = {p: fs.readlink(p) for p in ("sub/plain", "latest", "via_link",
                                             "dotdot_after_link", "dangling", "loop_a")}
    assert texts == {"sub/plain": "../file", "latest": "sub/deep", "via_link": "latest/g",
                     "dotdot_after_link": "latest/../plain", "dangling": "missing",
                     "loop_a": "loop_b"}
    out = tmp_path / "u"
    stagefs.unpack(tmp_path / "p", out, progress=False)
    for p, data in expect.items():
        assert os.path.realpath(out / p).startswith(str(out) + "/"), (p, os.readlink(out / p))
        assert (out / p).read_bytes() == data, p
    assert os.readlink(out / "abs") == "file" and os.readlink(out / "climb") == "file"
    assert os.readlink(out / "sub" / "ext" / "back") == "../deep/g"
    assert "stored as -> file" in caplog.text  # said, not done silently


# ------------------------------------------------------------------ replaced after the scan


@pytest.mark.timeout(60)  # the failure was a hang
@pytest.mark.parametrize("by", ["fifo", "symlink"])
def test_file_replaced_after_the_scan_is_a_change(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch,
                                                  by: str) -> None:
    """A file replaced by a FIFO after the scan hung the pack for ever (a blocking open
    waits for a writer); replaced by a symlink to a file of its size and mtime, the pack
    stored what it led to (outside the tree) without a word."""
    import importlib

    packmod = importlib.import_module("stagefs.pack")
    src = tmp_path / "src"
    src.mkdir()
    (src / "a").write_bytes(b"a")
    (src / "b").write_bytes(b"b")
    (tmp_path / "elsewhere").write_bytes(b"X")  # outside, the size and mtime of b
    real = packmod._scan

    def scan(*args: Any, **kwargs: Any) -> Any:
        found = real(*args, **kwargs)
        stat = os.stat(src / "b")
        (src / "b").unlink()
        if by == "fifo":
            os.mkfifo(src / "b")
        else:
            os.symlink(tmp_path / "elsewhere", src / "b")
        os.utime(src / "b", ns=(stat.st_atime_ns, stat.st_mtime_ns), follow_symlinks=False)
        os.utime(tmp_path / "elsewhere", ns=(stat.st_atime_ns, stat.st_mtime_ns))
        return found

    monkeypatch.setattr(packmod, "_scan", scan)
    from stagefs.errors import SourceChangedError

    with pytest.raises(SourceChangedError, match="changed while they were packed: b"):
        _pack(src, tmp_path / "p")
