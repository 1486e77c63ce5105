"""``stagefs umount`` of a mount that another mount sits inside: busy, though no program
uses it; the error names the mount inside (it said "in use" and told the user to end
programs that do not exist)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import stagefs
from stagefs.posix.fuse import fuse_available, is_mounted

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(fuse_available() is not None, reason=str(fuse_available())),
]


def _stagefs(*args: str, tmp: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "stagefs.cli", *args], capture_output=True,
                          text=True, timeout=120, check=False,
                          env={**os.environ, "TMPDIR": str(tmp)})


def test_umount_of_a_mount_with_a_mount_inside_names_it(tmp_path: Path) -> None:
    src = tmp_path / "src"
    (src / "empty").mkdir(parents=True)
    (src / "a.txt").write_bytes(b"a" * 100)
    stagefs.pack(src, tmp_path / "pack", jobs=1, progress=False, echo=lambda _m: None)
    outer, inner = tmp_path / "mnt", tmp_path / "mnt" / "empty"
    outer.mkdir()
    logs = tmp_path / "logs"
    logs.mkdir()
    try:
        assert _stagefs("mount", str(tmp_path / "pack"), str(outer), tmp=logs).returncode == 0
        assert _stagefs("mount", str(tmp_path / "pack"), str(inner), tmp=logs).returncode == 0
        r = _stagefs("umount", str(outer), tmp=logs)
        assert r.returncode == 1
        assert f"mounted inside it ({inner})" in r.stderr, r.stderr
        assert f"stagefs umount {inner}" in r.stderr
        assert is_mounted(str(outer))
        assert _stagefs("umount", str(inner), tmp=logs).returncode == 0
        r = _stagefs("umount", str(outer), tmp=logs)
        assert r.returncode == 0, r.stderr
    finally:
        for mp in (inner, outer):
            if is_mounted(str(mp)):
                subprocess.run(["fusermount3", "-u", "-z", str(mp)], check=False, timeout=60)
    assert not is_mounted(str(outer))


def _one_file_pack(tmp_path: Path) -> tuple[Path, Path]:
    """tmp_path/pack of one file (a.txt, 100 bytes of "a"); an empty mount point and an
    empty directory for the servers' logs, made."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.txt").write_bytes(b"a" * 100)
    stagefs.pack(src, tmp_path / "pack", jobs=1, progress=False, echo=lambda _m: None)
    mnt, logs = tmp_path / "mnt", tmp_path / "logs"
    mnt.mkdir()
    logs.mkdir()
    return mnt, logs


def test_umount_of_a_killed_servers_mount_removes_its_empty_log(tmp_path: Path) -> None:
    """A detached server killed by SIGKILL (the OOM killer) left its empty log in the temp
    directory at every kill: /proc no longer showed it for ``stagefs umount`` to find."""
    import signal

    mnt, logs = _one_file_pack(tmp_path)
    other = logs / "stagefs-mount-other.log"  # a log this mount's umount has no business with
    other.write_text("")
    try:
        r = _stagefs("mount", str(tmp_path / "pack"), str(mnt), tmp=logs)
        assert r.returncode == 0, r.stderr
        pid = int(r.stdout.split("server pid ")[1].split(";")[0])
        assert len(list(logs.glob("stagefs-mount-*.log"))) == 2
        os.kill(pid, signal.SIGKILL)
        r = _stagefs("umount", str(mnt), tmp=logs)
        assert r.returncode == 0, r.stderr
    finally:
        if is_mounted(str(mnt)):
            subprocess.run(["fusermount3", "-u", "-z", str(mnt)], check=False, timeout=60)
    assert not is_mounted(str(mnt))
    assert sorted(logs.iterdir()) == [other]


def test_umount_of_a_killed_servers_busy_mount_says_the_server_is_gone(tmp_path: Path) -> None:
    """A program keeps a file of the mount open when its server is killed: the mount is
    busy, and the error says that nobody serves it (every access fails with ENOTCONN). It
    said the server would end when the programs let go, as of a live one."""
    import signal

    mnt, logs = _one_file_pack(tmp_path)
    holder = None
    try:
        r = _stagefs("mount", str(tmp_path / "pack"), str(mnt), tmp=logs)
        assert r.returncode == 0, r.stderr
        pid = int(r.stdout.split("server pid ")[1].split(";")[0])
        holder = subprocess.Popen(
            [sys.executable, "-c", "import sys; f = open(sys.argv[1], 'rb'); print(f.read(1)"
             ".decode(), flush=True); sys.stdin.read()", str(mnt / "a.txt")],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert holder.stdout is not None and holder.stdout.readline() == "a\n"
        os.kill(pid, signal.SIGKILL)
        r = _stagefs("umount", str(mnt), tmp=logs)
        assert r.returncode == 1
        assert f"in use by pid {holder.pid} (python" in r.stderr, r.stderr
        assert "its server is gone" in r.stderr and "Transport endpoint" in r.stderr
        assert "ends when" not in r.stderr
        assert is_mounted(str(mnt))
        r = _stagefs("umount", "--lazy", str(mnt), tmp=logs)
        assert r.returncode == 0, r.stderr
    finally:
        if holder is not None:
            holder.kill()
            holder.communicate()  # (and its pipes closed)
        if is_mounted(str(mnt)):
            subprocess.run(["fusermount3", "-u", "-z", str(mnt)], check=False, timeout=60)
    assert not is_mounted(str(mnt))


@pytest.mark.parametrize("sig", ["SIGKILL", "SIGSTOP"])
def test_mount_over_a_mount_whose_server_is_gone_or_stopped_says_so(
        tmp_path: Path, sig: str) -> None:
    """``stagefs mount`` again over a mount whose server was killed (or is stopped) said "is
    already a mount point", as of a live mount: now it says the server is gone (every
    access fails with ENOTCONN) or does not answer, and how to remove the mount."""
    import signal

    mnt, logs = _one_file_pack(tmp_path)
    pid = 0
    try:
        r = _stagefs("mount", str(tmp_path / "pack"), str(mnt), tmp=logs)
        assert r.returncode == 0, r.stderr
        pid = int(r.stdout.split("server pid ")[1].split(";")[0])
        r = _stagefs("mount", str(tmp_path / "pack"), str(mnt), tmp=logs)  # a live server
        assert r.returncode != 0 and "already a mount point" in r.stderr, r.stderr
        os.kill(pid, getattr(signal, sig))
        r = _stagefs("mount", str(tmp_path / "pack"), str(mnt), tmp=logs)
        assert r.returncode != 0
        said = "is gone" if sig == "SIGKILL" else "does not answer"
        assert f"server {said}" in r.stderr and f"stagefs umount {mnt}" in r.stderr, r.stderr
        assert "Traceback" not in r.stderr
    finally:
        if pid and sig == "SIGSTOP":
            os.kill(pid, signal.SIGCONT)
        if is_mounted(str(mnt)):
            subprocess.run(["fusermount3", "-u", "-z", str(mnt)], check=False, timeout=60)
    assert not is_mounted(str(mnt))
