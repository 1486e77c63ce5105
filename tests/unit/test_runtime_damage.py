"""A job's runtime directory and tier copies left damaged (a crash, a buggy program of the
user): records of the wrong shape, FIFOs, directories or devices under the names of files.
``stagefs status``, ``stagefs clean`` and the readers skip, repair or refuse clearly what is
damaged: never a traceback, a hang, a wrong byte, nor a directory removed that the runtime
did not make."""

from __future__ import annotations

import contextlib
import json
import os
import threading
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import pytest

import stagefs
from conftest import small_tmpfs
from stagefs.cluster.cmap import load_runtime
from stagefs.errors import ClusterError
from stagefs.net.auth import read_token, write_token
from stagefs.runtime import HOST, Runtime, clean
from stagefs.tiers.claims import Claims
from stagefs.tiers.status import job_status


def _within(fn: Callable[[], Any], fifos: Iterable[Path], timeout: float = 30) -> Any:
    """``fn()``'s result, which must come without waiting on the ``fifos`` for a writer: a
    call that blocks is released (a writer opens each FIFO) and the test fails."""
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["value"] = fn()
        except BaseException as exc:  # raised in the test's thread
            out["error"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout)
    blocked = t.is_alive()
    if blocked:
        for f in fifos:
            for _ in range(2):  # (the opener may read, then open the next one)
                with contextlib.suppress(OSError):
                    os.close(os.open(f, os.O_WRONLY | os.O_NONBLOCK))
        t.join(timeout)
    assert not blocked, "blocked on a FIFO left under a file's name"
    if "error" in out:
        raise out["error"]
    return out.get("value")


@pytest.fixture
def used(sample_pack_session: tuple[Path, Path], tmp_path: Path) -> Iterator[tuple[Path, Path]]:
    """(runtime, tier) after a process read the sample pack through a tier and ended."""
    _, pack = sample_pack_session
    rt, tier = tmp_path / "rt", tmp_path / "tier"
    with stagefs.open(pack, tiers=[f"{tier}:64MiB"], runtime=rt) as fs:
        for p in _files(sample_pack_session):
            fs.read(p)
        fs.prefetch(range(len(fs.manifest.shards)))
        assert fs.chain is not None and fs.chain.wait_idle(30)
    assert list(tier.rglob("*.sfs"))
    yield rt, tier


def _files(sample: tuple[Path, Path]) -> dict[str, bytes]:
    src, _ = sample
    return {str(p.relative_to(src)): p.read_bytes() for p in src.rglob("*") if p.is_file()}


def _read_and_place(pack: Path, tier: Path, rt: Path, files: dict[str, bytes]) -> None:
    """Read every file through the tier (each byte checked), then place every shard."""
    with stagefs.open(pack, tiers=[f"{tier}:64MiB"], runtime=rt) as fs:
        for p, data in files.items():
            assert fs.read(p) == data, p
        fs.prefetch(range(len(fs.manifest.shards)))
        assert fs.chain is not None and fs.chain.wait_idle(30)


def test_status_skips_records_of_the_wrong_shape(used: tuple[Path, Path]) -> None:
    """A tier, stats or stall record that is JSON but not of the shape stagefs writes
    (a list; a count that is a string; an object where a number is), and a lease naming a
    pid no process can have, ended ``stagefs status`` in a traceback (TypeError,
    AttributeError, OverflowError). Each is skipped, or counts what in it is a count."""
    rt, tier = used
    (rt / "tiers" / "list.json").write_text("[1, 2]")
    (rt / "tiers" / "noid.json").write_text(json.dumps({"pack_id": 5, "tiers": ["/tmp"]}))
    (rt / "tiers" / "strtiers.json").write_text(json.dumps({"pack_id": "ab", "tiers": 5}))
    (rt / "stats" / "1.x.0.json").write_text(json.dumps(
        {"origin_stats": [1], "misses": "x", "tiers": {str(tier): [1]}}))
    (rt / "stats" / "2.x.0.json").write_text(json.dumps(
        {"origin": ["x"], "tiers": {str(tier): {"hits": "many"}}, "misses": 1e400}))
    (rt / "stats" / "3.x.0.json").write_text("[1]")
    (rt / "stall-1.json").write_text("[1]")
    (rt / "stall-2.json").write_text(json.dumps({"rank": "a", "epochs": [{"epoch": 0}]}))
    (rt / "stall-3.json").write_text(json.dumps({"rank": 1, "epochs": [
        {"epoch": 0, "steps": 2, "wait_s": "x"}, 7, {"epoch": 1, "steps": 2, "wait_s": 0.5,
                                                   "step_s": 1.0}]}))
    (rt / "procs" / f"5@{HOST}").write_text(json.dumps({"pid": 10**30, "host": HOST}))
    (rt / "procs" / f"{10**30}@{HOST}").write_text("torn")
    st = job_status(Runtime(rt))
    assert st["live_processes"] == 0
    assert [r["path"] for r in st["tiers"]] == [str(tier)]
    assert st["tiers"][0]["shards_held"] > 0
    assert [(r["rank"], r["epoch"]) for r in st["stalls"]] == [(1, 1)]
    assert not list((rt / "procs").iterdir())  # dead leases, however written, are removed


def test_clean_never_follows_a_damaged_tier_record_out_of_its_tier(tmp_path: Path) -> None:
    """A tier record whose pack id is ``..`` (or whose tiers are a string, each character a
    relative path) made ``stagefs clean`` remove the tier's parent directory, with every
    file of the user in it. Such a record is not trusted: nothing outside is removed."""
    rt = tmp_path / "rt"
    (rt / "procs").mkdir(parents=True)
    (rt / "tiers").mkdir()
    keep = tmp_path / "keep"
    (keep / "tier").mkdir(parents=True)
    (keep / "precious").write_text("mine")
    (rt / "tiers" / "a.json").write_text(json.dumps({"pack_id": "..", "tiers": [str(keep / "tier")]}))
    (rt / "tiers" / "b.json").write_text(json.dumps({"pack_id": "k", "tiers": "keep"}))
    cwd = os.getcwd()
    os.chdir(tmp_path)  # where a relative "tier" k/e/e/p would be taken from
    try:
        (tmp_path / "k" / "k").mkdir(parents=True)
        clean([Runtime(rt)])
    finally:
        os.chdir(cwd)
    assert (keep / "precious").exists() and (tmp_path / "k" / "k").exists()
    assert not rt.exists()


def test_fifos_in_the_runtime_never_hang_status_or_readers(
        used: tuple[Path, Path], sample_pack_session: tuple[Path, Path]) -> None:
    """A FIFO under a lease's, a counters file's, a claim's, the tier room's or a tier
    copy's name held ``stagefs status`` or the next reader in open() forever. Each is
    opened without waiting: status skips it, a claim or room there is made anew, a copy
    there is not a copy (the reader goes to the origin and places the shard anew)."""
    rt, tier = used
    _, pack = sample_pack_session
    files = _files(sample_pack_session)
    copies = sorted((tier).rglob("*.sfs"))
    assert copies
    fifos = [rt / "procs" / f"{2**22}@{HOST}",  # (a pid no process has)
             rt / "stats" / "9-0.counters", copies[0],
             tier / f".stagefs-{os.getuid()}" / "room"]
    pack_id = copies[0].parent.name
    fifos += [rt / "claims" / f"{pack_id}.{i}" for i in range(len(copies) + 8)]
    for f in fifos:
        if f.exists():
            f.unlink()
        os.mkfifo(f, 0o600)
    st = _within(lambda: job_status(Runtime(rt)), fifos)
    assert st["live_processes"] == 0
    _within(lambda: _read_and_place(pack, tier, rt, files), fifos)
    assert copies[0].is_file()  # placed anew


def test_runtime_subdirectories_replaced_by_files_are_made_anew(
        used: tuple[Path, Path], sample_pack_session: tuple[Path, Path]) -> None:
    """A file where the runtime's procs/, stats/, claims/ folder or a tier record was
    ended every later open of the dataset with a bare FileExistsError (IsADirectoryError):
    the runtime is the job's own, and what is damaged in it is made anew."""
    rt, tier = used
    _, pack = sample_pack_session
    for sub in ("procs", "stats", "claims"):
        for p in sorted((rt / sub).iterdir()):
            p.unlink()
        (rt / sub).rmdir()
        (rt / sub).write_text("x")
    (record,) = (rt / "tiers").glob("*.json")
    record.unlink()
    record.mkdir()
    files = _files(sample_pack_session)
    with stagefs.open(pack, tiers=[f"{tier}:64MiB"], runtime=rt) as fs:
        for p, data in files.items():
            assert fs.read(p) == data, p
    assert all((rt / sub).is_dir() for sub in ("procs", "stats", "claims"))
    assert json.loads(record.read_text())["tiers"] == [str(tier)]


def test_a_damaged_claim_is_taken_over(tmp_path: Path) -> None:
    """A claim that is garbage, a directory or a FIFO names no live owner: it is taken over
    (a FIFO held the claimer in open(); garbage ended it in a UnicodeDecodeError)."""
    c = Claims(str(tmp_path), "p")
    Path(c.path(0)).write_bytes(b"\xff\xfe garbage")
    os.utime(c.path(0), (0, 0))  # not one being written now
    Path(c.path(1)).mkdir()
    os.utime(c.path(1), (0, 0))
    os.mkfifo(c.path(2))
    os.utime(c.path(2), (0, 0))
    got = _within(lambda: [c.acquire(s) for s in range(3)], [Path(c.path(2))])
    assert got == [True, True, True]
    assert all(c.owner(s) == (os.getpid(), c.owner(s)[1]) for s in range(3))  # type: ignore[index]


def test_a_damaged_cluster_map_or_token_is_refused_clearly(tmp_path: Path) -> None:
    """A cluster.json of the wrong shape, a FIFO in its place, a FIFO where the token was:
    a ClusterError naming the file and saying what to do, not an AttributeError,
    UnicodeDecodeError or a hang."""
    rt = tmp_path / "rt"
    rt.mkdir(mode=0o700)
    write_token(str(rt / "token"), os.urandom(32))
    for text in (b"[1]", b"\xff\xfe{", json.dumps({"version": 1, "pack_id": "zz"}).encode()):
        (rt / "cluster.json").write_bytes(text)
        with pytest.raises(ClusterError, match=r"cluster\.json: malformed cluster map.*restart"):
            load_runtime(str(rt))
    (rt / "cluster.json").unlink()
    os.mkfifo(rt / "cluster.json", 0o600)
    with pytest.raises(ClusterError, match=r"cluster\.json: not a file"):
        _within(lambda: load_runtime(str(rt)), [rt / "cluster.json"])
    (rt / "token").unlink()
    os.mkfifo(rt / "token", 0o600)
    with pytest.raises(ClusterError, match="token: cannot read the job token"):
        _within(lambda: read_token(str(rt / "token")), [rt / "token"])


def test_directories_and_fifos_where_a_tier_copy_a_lock_or_the_activity_map_go(
        used: tuple[Path, Path], sample_pack_session: tuple[Path, Path]) -> None:
    """A directory where a shard's tier copy goes stopped placement into the whole tier
    (IsADirectoryError at every re-check), one where the tiers' lock file goes too, and a
    FIFO or a directory in place of the job's activity map made every ``stagefs.open`` of
    the dataset fail (a bare EINVAL, IsADirectoryError). Each is removed and made anew."""
    rt, tier = used
    _, pack = sample_pack_session
    copies = sorted(tier.rglob("*.sfs"))
    for c in copies:
        c.unlink()
    copies[0].mkdir()
    (copies[0] / "inside").write_text("x")
    lock = tier / f".stagefs-{os.getuid()}" / "lock"
    lock.unlink(missing_ok=True)
    lock.mkdir()
    (activity,) = (rt / "claims").glob("*.activity")
    activity.unlink()
    files = _files(sample_pack_session)
    for damage in (os.mkfifo, os.mkdir):
        if activity.is_dir():
            activity.rmdir()
        elif activity.exists():
            activity.unlink()
        damage(activity)
        _within(lambda: _read_and_place(pack, tier, rt, files), [activity])
        assert activity.is_file() and lock.is_file()
        assert all(c.is_file() for c in copies)  # every shard placed again, the first too


def test_a_full_runtime_file_system_is_named_with_what_to_do(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A shared /dev/shm that other jobs filled: every ``stagefs.open`` with tiers (and
    ``stagefs stage``) failed with a bare ``OSError: [Errno 28] No space left on device``
    from writing the process's lease, naming nothing. It names the runtime directory, says
    its file system is full and what to do; nothing of the failed open stays counted."""
    import errno

    from stagefs import runtime as runtime_mod
    from stagefs.doctor import check_shm
    from stagefs.errors import ConfigError

    def full(path: str, *_a: object, **_k: object) -> bool:
        raise OSError(errno.ENOSPC, "No space left on device", path)

    monkeypatch.setattr(runtime_mod, "atomic_write", full)
    rt = Runtime(tmp_path / "rt")
    with pytest.raises(ConfigError) as got:
        rt.open()
    said = str(got.value)
    assert f"runtime directory {rt.path}: cannot write in it (No space left" in said
    assert "file system is full" in said and "STAGEFS_RUNTIME" in said
    assert not any(path == rt.path for _, path in runtime_mod._USERS)
    # the doctor says the same of a full /dev/shm where the runtime goes by default
    monkeypatch.delenv("STAGEFS_RUNTIME", raising=False)
    monkeypatch.setattr("stagefs.doctor._space", lambda _p: (2 << 20, 4096))
    monkeypatch.setattr("stagefs.doctor.os.path.isdir", lambda _p: True)
    [shm] = check_shm()
    assert shm.status == "warn" and "runtime directory" in shm.meaning
    assert "STAGEFS_RUNTIME" in shm.meaning


def test_a_runtime_directory_on_a_read_only_file_system_is_named_with_what_to_do(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A runtime directory that exists, not private yet, on a file system mounted read-only
    (STAGEFS_RUNTIME pointed at a shared directory): ``stagefs.open`` with tiers and every
    command that opens the runtime failed with a bare ``OSError: [Errno 30] Read-only file
    system`` from making it private. It names the directory and what to do."""
    import errno

    from stagefs import runtime as runtime_mod
    from stagefs.errors import ConfigError

    def read_only(path: str, *_a: object, **_k: object) -> None:
        raise OSError(errno.EROFS, "Read-only file system", path)

    rt = Runtime(tmp_path / "rt")
    os.makedirs(rt.path, mode=0o755)
    os.chmod(rt.path, 0o755)
    monkeypatch.setattr(runtime_mod.os, "chmod", read_only)
    with pytest.raises(ConfigError) as got:
        rt.open()
    said = str(got.value)
    assert f"runtime directory {rt.path}: cannot make it private" in said
    assert "Read-only file system" in said and "STAGEFS_RUNTIME" in said


def test_claims_on_a_full_file_system_stream_unclaimed_with_one_warning(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The runtime directory's file system full (/dev/shm filled by another program): a
    claim's file was made but its owner could not be written; the stream died with a
    traceback in the log, once for each shard, and the empty claim held the shard from the
    node's other processes for its grace period. The shard streams unclaimed, said once,
    and no claim is left behind."""
    with small_tmpfs(tmp_path / "full", "64k") as mnt:
        with open(mnt / "filler", "wb", buffering=0) as f, contextlib.suppress(OSError):
            while True:
                f.write(b"\0" * 4096)
        c = Claims(str(mnt), "p")
        with caplog.at_level("WARNING", logger="stagefs.tiers"):
            assert [c.acquire(s) for s in range(3)] == [True, True, True]
        said = [r for r in caplog.records if "claims cannot be written" in r.getMessage()]
        assert len(said) == 1 and "No space left" in said[0].getMessage()
        assert not said[0].exc_info
        assert sorted(p.name for p in mnt.iterdir()) == ["filler"]
        c.release(0)  # (nothing of it to let go of)
