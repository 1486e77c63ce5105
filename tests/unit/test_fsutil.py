"""The atomic write and the file lock that every layer uses (stagefs._fsutil)."""

from __future__ import annotations

import concurrent.futures as cf
import fcntl
import os
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from typing import BinaryIO

import pytest

from stagefs._fsutil import atomic_write, file_lock, in_parts
from stagefs.errors import ConfigError

SRC = str(Path(__file__).resolve().parents[2] / "src")


def _python(code: str, **kw: object) -> subprocess.Popen[bytes]:
    env = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], env=env,
                            **kw)  # type: ignore[call-overload]


def test_atomic_write_replaces_and_leaves_nothing_beside(tmp_path: Path) -> None:
    target = tmp_path / "f.json"
    target.write_bytes(b"old")
    atomic_write(target, b"new bytes")
    assert target.read_bytes() == b"new bytes"
    atomic_write(target, "text é")
    assert target.read_text() == "text é"
    atomic_write(target, lambda f: f.write(b"from a writer"))
    assert target.read_bytes() == b"from a writer"
    assert os.listdir(tmp_path) == ["f.json"]


def test_atomic_write_mode_is_private_from_the_start(tmp_path: Path) -> None:
    atomic_write(tmp_path / "token", b"secret", mode=0o600)
    assert os.stat(tmp_path / "token").st_mode & 0o777 == 0o600


def test_an_error_mid_write_keeps_the_old_file_and_removes_the_partial(tmp_path: Path) -> None:
    target = tmp_path / "f"
    target.write_bytes(b"old")

    def half(f: BinaryIO) -> None:
        f.write(b"half of the new")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        atomic_write(target, half)
    assert target.read_bytes() == b"old"
    assert os.listdir(tmp_path) == ["f"]
    with pytest.raises(RuntimeError):
        atomic_write(tmp_path / "new", half)
    assert not (tmp_path / "new").exists() and os.listdir(tmp_path) == ["f"]


def test_a_process_killed_mid_write_leaves_no_final_file(tmp_path: Path) -> None:
    target = tmp_path / "f"
    child = _python(f"""
        import sys
        from stagefs._fsutil import atomic_write
        def writer(f):
            f.write(b"x" * 4096)
            f.flush()
            sys.stdout.write("writing\\n"); sys.stdout.flush()
            sys.stdin.read()  # killed here
        atomic_write({str(target)!r}, writer)
    """, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert child.stdout is not None and child.stdin is not None
    try:
        assert child.stdout.readline() == b"writing\n"
        (partial,) = os.listdir(tmp_path)  # the bytes are there, under another name
        assert partial.startswith("f.") and partial.endswith(".partial")
        child.send_signal(signal.SIGKILL)
        assert child.wait(60) == -signal.SIGKILL
    finally:
        child.kill()
        child.stdin.close()
        child.stdout.close()
    assert not target.exists()


def test_the_lock_excludes_another_process_until_it_is_released(tmp_path: Path) -> None:
    lock = tmp_path / "x.lock"
    child = _python(f"""
        import sys
        from stagefs._fsutil import file_lock
        with file_lock({str(lock)!r}):
            sys.stdout.write("locked\\n"); sys.stdout.flush()
            sys.stdin.readline()
        sys.stdout.write("released\\n"); sys.stdout.flush()
        sys.stdin.readline()
    """, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert child.stdout is not None and child.stdin is not None

    def try_lock() -> bool:
        fd = os.open(lock, os.O_RDWR)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        finally:
            os.close(fd)
        return True

    try:
        assert child.stdout.readline() == b"locked\n"
        assert not try_lock()
        child.stdin.write(b"go\n")
        child.stdin.flush()
        assert child.stdout.readline() == b"released\n"
        assert try_lock()
        child.stdin.write(b"go\n")
        child.stdin.flush()
        assert child.wait(60) == 0
    finally:
        child.kill()
        child.stdin.close()
        child.stdout.close()


def test_two_processes_contending_never_interleave(tmp_path: Path) -> None:
    """Each process adds 1 to a counter file 200 times by read, then write: a lost update
    (both read the same value) would show as a total below 400."""
    counter, lock = tmp_path / "n", tmp_path / "n.lock"
    counter.write_text("0")
    code = f"""
        from stagefs._fsutil import file_lock
        for _ in range(200):
            with file_lock({str(lock)!r}):
                with open({str(counter)!r}) as f:
                    n = int(f.read())
                with open({str(counter)!r}, "w") as f:
                    f.write(str(n + 1))
    """
    procs = [_python(code) for _ in range(2)]
    assert [p.wait(120) for p in procs] == [0, 0]
    assert counter.read_text() == "400"


def test_the_lock_is_freed_when_its_holder_is_killed(tmp_path: Path) -> None:
    lock = tmp_path / "x.lock"
    child = _python(f"""
        import sys
        from stagefs._fsutil import file_lock
        with file_lock({str(lock)!r}):
            sys.stdout.write("locked\\n"); sys.stdout.flush()
            sys.stdin.read()
    """, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert child.stdout is not None and child.stdin is not None
    try:
        assert child.stdout.readline() == b"locked\n"
        child.send_signal(signal.SIGKILL)
        child.wait(60)
    finally:
        child.kill()
        child.stdin.close()
        child.stdout.close()
    with file_lock(lock):  # would block forever if the dead holder kept it
        pass


def test_a_runtime_and_a_tier_make_their_missing_parents_private_whatever_the_umask(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A runtime named below directories that do not exist yet (the docs' mpirun recipe,
    STAGEFS_RUNTIME=/dev/shm/stagefs-$USER/job42): under a umask of 000 its parents were
    0777, and on a shared /dev/shm any user could rename the job's runtime away."""
    from stagefs.runtime import Runtime
    from stagefs.tiers.tier import prepare_tier_dir

    old = os.umask(0)
    try:
        rt = Runtime(str(tmp_path / "shm" / "stagefs-me" / "job42")).open()
        rt.unregister()
        prepare_tier_dir(str(tmp_path / "nvme" / "me" / "tier"))
    finally:
        os.umask(old)
    for d in ("shm", "shm/stagefs-me", "shm/stagefs-me/job42", "nvme", "nvme/me",
              "nvme/me/tier"):
        assert (tmp_path / d).stat().st_mode & 0o777 == 0o700, d
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match="cannot create"):
        Runtime(str(tmp_path / "file" / "job")).open()


def test_in_parts_covers_every_item_once_in_order() -> None:
    seen: list[tuple[int, int]] = []
    with cf.ThreadPoolExecutor(3) as pool:
        for n, parts in [(1, 4), (2, 2), (7, 3), (10, 4), (10, 20), (100, 1)]:
            seen.clear()
            got = in_parts(pool, n, parts,
                           lambda a, b: (seen.append((a, b)), list(range(a, b)))[1])
            assert [i for part in got for i in part] == list(range(n))
            assert len(got) == len(seen) == min(parts, n)  # each part once, none empty
            assert all(a < b for a, b in seen)


def test_in_parts_from_a_thread_of_its_own_full_pool() -> None:
    """A call from the only thread of its pool runs the parts it cannot hand out itself:
    waiting on them would wait for ever (the pool's one thread is the one waiting)."""
    threads: list[str] = []

    def part(a: int, b: int) -> int:
        threads.append(threading.current_thread().name)
        return b - a

    with cf.ThreadPoolExecutor(1, thread_name_prefix="own") as pool:
        got = pool.submit(in_parts, pool, 9, 3, part).result(timeout=60)
    assert got == [3, 3, 3]
    assert len(threads) == 3 and set(threads) == {threads[0]}


def test_in_parts_raises_once_every_begun_part_has_ended() -> None:
    begun = threading.Event()
    release = threading.Event()
    ended: list[int] = []

    def part(a: int, b: int) -> int:
        if a == 0:
            begun.wait(60)  # the other part is under way in the pool
            release.set()
            raise ValueError("part 0")
        begun.set()
        release.wait(60)
        ended.append(a)
        return a

    with cf.ThreadPoolExecutor(2) as pool, pytest.raises(ValueError, match="part 0"):
        in_parts(pool, 4, 2, part)
    assert ended == [2]
