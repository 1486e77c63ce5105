"""A Store without tiers (a pack, or a raw directory in place) in a forked child: its
origin is the child's own from the fork on, as a Store with tiers has it (the tier chain
resets its origin): a lock another thread of the parent held at the fork does not hang the
child's reads, and the child's origin counts are its own, not the parent's."""

from __future__ import annotations

import ast
import os
import threading
from pathlib import Path

import pytest

import stagefs
from conftest import pack_files, random_bytes
from stagefs.tiers.origin import PackOrigin

FILES = {f"c{i % 3}/f{i:03d}.bin": random_bytes(2000 + i, seed=i) for i in range(60)}


@pytest.fixture(scope="module")
def pack(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return pack_files(tmp_path_factory.mktemp("fork"), "src", FILES)


def _lock_of(origin: object) -> threading.Lock:
    """The origin's lock: a pack's, its open files' (``OpenFiles``)."""
    return (origin._files if isinstance(origin, PackOrigin) else origin)._lock  # type: ignore[attr-defined,no-any-return]


def _in_child(fs: stagefs.Store) -> tuple[int, str]:
    """Fork while the origin's lock is held (by another thread, as far as the child can
    tell); the child reads every file and reports its origin counts before and after.
    (exit code, what the child wrote)."""
    held = _lock_of(fs.origin)
    held.acquire()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover (the child)
        code = 1
        try:
            mine = _lock_of(fs.origin)
            if mine.acquire(timeout=5):  # the child's own lock: free
                mine.release()
                before = fs.status()["origin_stats"]
                ok = fs.read_many(sorted(FILES)) == [FILES[p] for p in sorted(FILES)]
                after = fs.status()["origin_stats"]
                os.write(w, repr((before, ok, after)).encode())
                code = 0
            else:
                code = 3
        finally:
            os._exit(code)
    held.release()
    os.close(w)
    _, status = os.waitpid(pid, 0)
    with os.fdopen(r, "rb") as f:
        return os.waitstatus_to_exitcode(status), f.read().decode()


@pytest.mark.parametrize("where", ["pack", "in place"])
def test_a_forked_child_has_its_own_origin(pack: Path, runtime: Path, where: str) -> None:
    path = pack if where == "pack" else pack.parent / "src"
    with stagefs.open(path) as fs:
        assert fs.read_many(sorted(FILES)) == [FILES[p] for p in sorted(FILES)]
        parent = fs.status()["origin_stats"]
        assert parent["reads"] > 0
        code, said = _in_child(fs)
        assert code == 0, "the child waited on the origin's lock the parent's thread held"
        before, ok, after = ast.literal_eval(said)
        assert before == {k: 0 for k in parent}
        assert ok
        assert after["bytes_read"] == sum(len(d) for d in FILES.values())  # the child's read
        assert fs.status()["origin_stats"] == parent  # the parent's stay the parent's
