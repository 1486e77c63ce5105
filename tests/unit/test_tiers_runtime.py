"""The runtime directory (per user and job, 0700; leases: test_runtime_leases.py), in-place datasets
(scan, cache, staleness, verification), and the stage/status/clean commands."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import stat as st
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from test_tiers import read_all

import stagefs
from stagefs.cli import main
from stagefs.config import format_size
from stagefs.errors import SourceChangedError
from stagefs.runtime import Runtime
from stagefs.tiers.claims import Claims
from tiers_helpers import make_tree


def _dead_pid() -> int:
    out = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                         capture_output=True, text=True, timeout=60).stdout
    return int(out)


@pytest.fixture
def job(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A fresh job id and the default runtime location (under /dev/shm)."""
    name = f"test-{uuid.uuid4().hex[:8]}"
    monkeypatch.delenv("STAGEFS_RUNTIME", raising=False)
    monkeypatch.delenv("STAGEFS_TIERS", raising=False)
    monkeypatch.setenv("STAGEFS_JOB", name)
    path = Runtime().path
    base = os.path.dirname(path)
    made_base = not os.path.exists(base)
    yield name
    shutil.rmtree(path, ignore_errors=True)
    if made_base:  # the per-user directory too, when the test made it and left it empty
        with contextlib.suppress(OSError):
            os.rmdir(base)


def test_default_runtime_is_per_user_and_job(job: str) -> None:
    rt = Runtime().open()
    base = "/dev/shm" if os.access("/dev/shm", os.W_OK) else "/tmp"
    assert rt.path == os.path.join(base, f"stagefs-{os.getuid()}", job)
    for p in (rt.path, os.path.dirname(rt.path)):
        s = os.stat(p)
        assert st.S_IMODE(s.st_mode) == 0o700 and s.st_uid == os.getuid()
    assert os.getpid() in rt.live_processes()


def test_runtime_env_overrides(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STAGEFS_RUNTIME", str(tmp_path / "rt"))
    rt = Runtime().open()
    assert rt.path == str(tmp_path / "rt")
    assert st.S_IMODE(os.stat(rt.path).st_mode) == 0o700


def test_two_jobs_do_not_collide(job: str, monkeypatch: pytest.MonkeyPatch) -> None:
    a = Runtime().open()
    monkeypatch.setenv("STAGEFS_JOB", job + "-other")
    b = Runtime().open()
    try:
        assert a.path != b.path
        assert Claims(a.claims, "p").acquire(0)
        assert Claims(b.claims, "p").acquire(0)  # the other job's claim is not seen
    finally:
        shutil.rmtree(b.path, ignore_errors=True)


def test_runtime_owned_by_another_user_is_refused(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to make a directory owned by another user")
    rt = tmp_path / "rt"
    rt.mkdir(mode=0o700)
    os.chown(rt, 65534, 65534)
    with pytest.raises(stagefs.ConfigError, match="not a directory owned by you"):
        Runtime(rt).open()


# ------------------------------------------------------------------------------ in place


@pytest.fixture
def raw(tmp_path: Path) -> tuple[Path, dict[str, bytes]]:
    files = make_tree(tmp_path / "raw", n=80, seed=9)
    return tmp_path / "raw", files


def _age(root: Path, seconds: int = 3600) -> None:
    """Set the mtime of every directory of ``root`` back by ``seconds``."""
    for d in [root, *(p for p in root.rglob("*") if p.is_dir() and not p.is_symlink())]:
        t = d.stat().st_mtime_ns - seconds * 10**9
        os.utime(d, ns=(t, t))


def test_in_place_reads_stages_and_reuses_its_cache(raw: tuple[Path, dict[str, bytes]],
                                                    tmp_path: Path) -> None:
    root, files = raw
    _age(root)  # written before the job: its mtimes prove it unchanged (see test_racy_...)
    rt = tmp_path / "rt"
    tiers = [str(tmp_path / "t")]
    with stagefs.open(root, tiers=tiers, runtime=rt) as fs:
        assert fs.chain is not None
        scan_stats = fs.origin.stats.stats
        assert scan_stats >= len(files)  # one lstat per entry
        read_all(fs, files, seed=1)
        fs.chain.wait_idle(30)
        pid = fs.manifest.pack_id
        assert fs.held_shards() == set(range(len(fs.manifest.shards)))
        before = fs.origin.stats.as_dict()
        read_all(fs, files, seed=2)
        assert fs.origin.stats.as_dict() == before  # epoch 2: nothing from the origin
        # the staged shard is a real shard: header, then the files' bytes at their offsets
        m = fs.manifest
        e = fs.namespace.file_entry(next(p for p in sorted(files) if files[p]))
        with open(fs.chain.tiers[0].path(m.shard[e]), "rb") as f:
            f.seek(m.offset[e])
            assert f.read(m.size[e]) == files[os.fsdecode(m.path_of(e))]
    with stagefs.open(root, tiers=tiers, runtime=rt) as fs:
        assert fs.manifest.pack_id == pid  # the cache was reused: same manifest
        assert fs.origin.stats.opens == 0  # no scan: only the directories were stat'ed
        assert fs.held_shards() == set(range(len(fs.manifest.shards)))
        read_all(fs, files, seed=3)
        assert fs.origin.stats.bytes_read == 0
    assert not any((root / ".stagefs").exists() for _ in [0])
    assert sorted(p.name for p in root.iterdir()) == sorted({p.split("/")[0] for p in files})


def test_in_place_detects_changes(raw: tuple[Path, dict[str, bytes]], tmp_path: Path) -> None:
    root, files = raw
    rt = tmp_path / "rt"
    with stagefs.open(root, runtime=rt) as fs:
        pid = fs.manifest.pack_id
        victim = next(p for p in sorted(files) if len(files[p]) > 10)
        # changed in place (same directory): caught when the origin opens it
        (root / victim).write_bytes(files[victim] + b"more")
        with pytest.raises(SourceChangedError, match=victim):
            fs.read(victim)
    # as the error says, a new open scans again (the directory's mtime did not change)
    with stagefs.open(root, runtime=rt) as fs:
        assert fs.manifest.pack_id != pid
        assert fs.read(victim) == files[victim] + b"more"
        pid = fs.manifest.pack_id
    with stagefs.open(root, runtime=rt) as fs:  # and only once: the scan is current now
        assert fs.manifest.pack_id == pid
    # a file added: the directory's mtime changed, so the next open rescans
    (root / "c0" / "new.bin").write_bytes(b"fresh")
    with stagefs.open(root, runtime=rt) as fs:
        assert fs.manifest.pack_id != pid
        assert fs.read("c0/new.bin") == b"fresh"
        assert fs.read(victim) == files[victim] + b"more"


def test_in_place_tier_copy_is_verified(raw: tuple[Path, dict[str, bytes]],
                                        tmp_path: Path) -> None:
    root, files = raw
    with stagefs.open(root, tiers=[str(tmp_path / "t")], runtime=tmp_path / "rt") as fs:
        assert fs.chain is not None
        fs.chain.stage()
        path = next(p for p in sorted(files) if len(files[p]) > 100)
        e = fs.namespace.file_entry(path)
        copy = fs.chain.tiers[0].path(fs.manifest.shard[e])
        with open(copy, "r+b") as f:
            f.seek(fs.manifest.offset[e])
            f.write(b"\x00" * 8 if files[path][:8] != b"\x00" * 8 else b"\x01" * 8)
        assert fs.read(path) == files[path]
        assert fs.chain.tiers[0].stats.dropped == 1


def test_in_place_sum_learnt_elsewhere_during_a_check(raw: tuple[Path, dict[str, bytes]],
                                                     tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Two stores of one job (as two processes) read a file of an in-place dataset from the
    origin at once, its sum not known yet: one checks the bytes it read against the sum
    table just as the other records the sum and marks it known. The origin's bytes are
    right and are returned; before, they were called corrupt (ChecksumError), having been
    checked against the sum not yet written and then judged as if it had been known."""
    from stagefs import store as store_mod

    root, files = raw
    rt = tmp_path / "rt"
    path = next(p for p in sorted(files) if files[p])
    with stagefs.open(root, runtime=rt) as a, stagefs.open(root, runtime=rt) as b:
        real = store_mod.check
        learnt: list[bool] = []

        def check(codec: int, stored: bytes, size: int, expected: int,
                  digest: int | None = None) -> bytes:
            if not learnt:  # b checks its bytes now: a learns the sum first
                learnt.append(True)
                assert a.read(path) == files[path]
            return real(codec, stored, size, expected, digest)

        monkeypatch.setattr(store_mod, "check", check)
        assert b.read(path) == files[path]
        assert learnt and b.stats.checksum_failures == 0


# ------------------------------------------------------------------------ the commands


def _shard_count(root: Path, rt: str) -> int:
    with stagefs.open(root, runtime=rt) as fs:
        return len(fs.manifest.shards)


def test_stage_status_clean(raw: tuple[Path, dict[str, bytes]], tmp_path: Path,
                            capsys: pytest.CaptureFixture[str]) -> None:
    root, files = raw
    rt, tier = str(tmp_path / "rt"), str(tmp_path / "tier")
    assert main(["stage", str(root), "--tier", tier, "--runtime", rt, "--no-progress"]) == 0
    out = capsys.readouterr().out
    n = _shard_count(root, rt)
    # each count before what it counts ("shards 11 not placed" read as shard number 11)
    assert f"of its shards, {n} placed whole; {n} of {n} shards held whole" in out, out
    # resumable: a second stage copies nothing
    assert main(["stage", str(root), "--tier", tier, "--runtime", rt, "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "0 B copied" in out and f"of its shards, {n} held already;" in out, out
    with stagefs.open(root, tiers=[tier], runtime=rt) as fs:
        read_all(fs, files)
        n_shards = len(fs.manifest.shards)
    assert main(["status", "--runtime", rt, "--json"]) == 0
    status = json.loads(capsys.readouterr().out)
    (t,) = status["tiers"]
    assert (t["path"], t["shards_held"], t["placed"]) == (tier, n_shards, n_shards), status
    assert t["hits"] >= sum(1 for d in files.values() if d)
    assert status["origins"][0]["origin"] == str(root)
    # a runtime given by path is not said to be this shell's job (it may be any job's)
    assert status["job"] is None
    assert main(["status", "--runtime", rt]) == 0
    out = capsys.readouterr().out
    assert "shards held" in out and out.startswith(f"runtime {rt}, "), out
    assert main(["clean", "--runtime", rt]) == 0
    assert not os.path.exists(rt) and not os.listdir(tier)
    capsys.readouterr()
    # none there now: said on stderr, so `status --json` never prints what is not JSON
    assert main(["status", "--runtime", rt, "--json"]) == 1
    got = capsys.readouterr()
    assert got.out == "" and f"no stagefs runtime at {rt}" in got.err


def test_status_after_staging_alone_says_what_it_read_of_the_origin(
        raw: tuple[Path, dict[str, bytes]], tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    """With no sample read yet (a job that has only staged, or whose streams ran before it
    was stopped), the table points at the origin's reads "above": they are said there."""
    root, _ = raw
    rt, tier = str(tmp_path / "rt"), str(tmp_path / "tier")
    assert main(["stage", str(root), "--tier", tier, "--runtime", rt, "--no-progress"]) == 0
    capsys.readouterr()
    assert main(["status", "--runtime", rt, "--json"]) == 0
    fetched = json.loads(capsys.readouterr().out)["fetched"]
    assert fetched["reads"] > 0, fetched
    assert main(["status", "--runtime", rt]) == 0
    out = capsys.readouterr().out
    said = (f"no samples read yet; read from the origin: {format_size(fetched['bytes'])} in "
            f"{fetched['reads']} reads")
    assert said in out, out
    assert out.index(said) < out.index("metadata operations on the origin (the reads are above)")


def test_status_names_a_dataset_read_without_tiers_and_counts_its_opens(
        raw: tuple[Path, dict[str, bytes]], tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    """A val set read without tiers beside a tiered train set: its row names its origin
    (not a pack id) and its opens are in the origins, as the train set's are."""
    root, files = raw
    train = tmp_path / "train"
    make_tree(train / "raw", n=30, seed=4)
    stagefs.pack(train / "raw", train / "pack", jobs=1, progress=False, echo=lambda _m: None)
    rt, tier = str(tmp_path / "rt"), str(tmp_path / "tier")
    with stagefs.open(train / "pack", tiers=[tier], runtime=rt) as tr, \
            stagefs.open(root, runtime=rt) as val:
        assert val.chain is None
        read_all(val, files)
        for d, _, fl in tr.walk(""):
            tr.read_many([f"{d}/{f}" if d else f for f in fl])
        opens = val.status()["origin_stats"]["opens"]
    assert opens > sum(1 for d in files.values() if d) // 2  # an open per file read
    assert main(["status", "--runtime", rt, "--json"]) == 0
    status = json.loads(capsys.readouterr().out)
    assert sorted(d["origin"] for d in status["datasets"]) == sorted(
        [str(root), str(train / "pack")]), status["datasets"]
    by_origin = {o["origin"]: o for o in status["origins"]}
    assert by_origin[str(root)]["opens"] == opens, status["origins"]
    assert by_origin[str(train / "pack")]["opens"] > 0
    assert main(["status", "--runtime", rt]) == 0
    out = capsys.readouterr().out
    assert f"| {root} " in out.split("reads by dataset")[1], out



def test_stage_again_into_a_tier_holding_a_shard_in_part_copies_nothing(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A tier smaller than a shard holds its pieces of it; staging again reads nothing from
    the origin, and said it copied the pieces held already (the bar's progress)."""
    src = tmp_path / "src"
    src.mkdir()
    for k in range(40):
        (src / f"f{k:02d}").write_bytes(os.urandom(60_000))
    stagefs.pack(str(src), str(tmp_path / "pack"), progress=False, echo=lambda _m: None)
    rt, tier = str(tmp_path / "rt"), f"{tmp_path / 'tier'}:1536KiB"
    args = ["stage", str(tmp_path / "pack"), "--tier", tier, "--runtime", rt, "--no-progress"]
    assert main(args) == 0
    # its share: pieces of 64 KiB windows (a small dataset's) up to its 1.5 MiB; with
    # pieces of 1 MiB it held one, two thirds of its capacity
    assert "(1.5 MiB copied" in capsys.readouterr().out
    assert main(args) == 0
    assert "(0 B copied" in capsys.readouterr().out

def test_stage_without_tiers_is_a_clear_error(raw: tuple[Path, dict[str, bytes]],
                                              tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.delenv("STAGEFS_TIERS", raising=False)
    assert main(["stage", str(raw[0]), "--runtime", str(tmp_path / "rt")]) == 1
    assert "--tier" in capsys.readouterr().err


def test_stats_are_flushed_while_open(raw: tuple[Path, dict[str, bytes]], tmp_path: Path
                                      ) -> None:
    root, files = raw
    with stagefs.open(root, tiers=[str(tmp_path / "t")], runtime=tmp_path / "rt") as fs:
        read_all(fs, files)
        fs.chain.wait_idle(30)  # type: ignore[union-attr]
        deadline = time.monotonic() + 20
        flushed = (tmp_path / "rt" / "stats").glob
        while time.monotonic() < deadline and not list(flushed(f"{os.getpid()}.*.json")):
            time.sleep(0.05)  # a partial file of the flush may be there first
        assert list(flushed(f"{os.getpid()}.*.json"))


def test_status_lists_an_in_place_scan_with_tiers_from_the_open(
        raw: tuple[Path, dict[str, bytes]], tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    """A store with tiers that has read nothing yet (a DataLoader's main process, whose
    workers read) is in the origins from its open, with what its scan cost the origin."""
    root, _ = raw
    rt = tmp_path / "rt"
    with stagefs.open(root, tiers=[str(tmp_path / "t")], runtime=rt) as fs:
        scan = fs.status()["origin_stats"]
        assert scan["stats"] > 0, scan
        assert main(["status", "--runtime", str(rt), "--json"]) == 0
        origins = json.loads(capsys.readouterr().out)["origins"]
    assert [(o["origin"], o["opens"], o["stats"]) for o in origins] == [
        (str(root), scan["opens"], scan["stats"])], origins


def test_a_tier_full_of_an_earlier_scans_copies_says_the_raw_directory_was_scanned_again(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A file of a raw directory changed: the next open scans again (a new pack id), and
    the tier, full of the first scan's copies, holds none of the new one's. The warning
    that names them said "a dataset packed again" of a directory never packed."""
    root = tmp_path / "raw"
    root.mkdir()
    for i in range(8):
        (root / f"f{i}").write_bytes(os.urandom(600_000))
    _age(root)
    rt, tier = tmp_path / "rt", f"{tmp_path / 'tier'}:3MiB"
    with stagefs.open(root, tiers=[tier], runtime=rt) as fs:
        for i in range(8):
            fs.read(f"f{i}")
        assert fs.chain is not None and fs.chain.wait_idle(30)
        first = fs.manifest.pack_id
    with (root / "f7").open("ab") as f:  # its directory's mtime does not move
        f.write(b"more")
    with stagefs.open(root, tiers=[tier], runtime=rt) as fs, \
            pytest.raises(SourceChangedError):
        fs.read("f7")
    with caplog.at_level("WARNING", logger="stagefs"), \
            stagefs.open(root, tiers=[tier], runtime=rt) as fs:
        assert fs.manifest.pack_id != first
        for i in range(8):
            fs.read(f"f{i}")
    said = [r.getMessage() for r in caplog.records if "other datasets' copies" in r.getMessage()]
    assert said and "raw directory scanned again" in said[0] and first.hex() in said[0], said


def _aged_raw(tmp_path: Path, n: int, size: int) -> tuple[Path, dict[str, bytes]]:
    """A raw directory of ``n`` random files of ``size`` bytes, written before the job."""
    root = tmp_path / "raw"
    root.mkdir()
    files = {f"f{i}": os.urandom(size) for i in range(n)}
    for name, data in files.items():
        (root / name).write_bytes(data)
    _age(root)
    return root, files


def test_a_new_job_on_an_unchanged_raw_directory_reads_the_copies_an_earlier_one_left(
        tmp_path: Path) -> None:
    """Each job scanned a raw directory anew, with a new pack id: a persistent tier kept
    the first job's copies, counted in its room, and the next job's reads all went to the
    origin. A scan that finds the same files as another job's (on this node, of this user)
    takes its id and its learnt checksums, and the copies serve; a file changed since (a
    new size or modification time) makes a scan of its own, whose reads give the new
    bytes, never the old copy's."""
    root, files = _aged_raw(tmp_path, 8, 600_000)
    jobs, tier = tmp_path / "jobs", f"{tmp_path / 'tier'}:3MiB"
    total = sum(map(len, files.values()))

    def job(name: str) -> tuple[bytes, int]:
        with stagefs.open(root, tiers=[tier], runtime=jobs / name) as fs:
            for _ in range(2):
                for f, data in files.items():
                    assert fs.read(f) == data
            assert fs.chain is not None and fs.chain.wait_idle(30)
            return fs.manifest.pack_id, int(fs.origin.stats.bytes_read)

    first, read1 = job("j1")
    assert read1 > total  # its second epoch read again what the tier could not hold
    second, read2 = job("j2")
    assert second == first
    assert read2 <= 2 * total - 2 * 2**20  # the tier's copies (2 MiB or more) served twice
    files["f3"] = os.urandom(600_000)  # the same size, other bytes, a later mtime
    (root / "f3").write_bytes(files["f3"])
    t = time.time_ns() + 10**9
    os.utime(root / "f3", ns=(t, t))
    third, _ = job("j3")  # (reads every file against its new bytes)
    assert third != first


def test_the_sums_one_job_learns_of_a_shared_scan_the_other_sees(tmp_path: Path) -> None:
    """Two jobs on one scan share its checksum table: the copies the second placed, of
    files the first never read, serve the first's next process, checked against sums the
    second learnt (a table of its own would know none of them: each copy refused as
    unverifiable, dropped and read again from the origin)."""
    root, files = _aged_raw(tmp_path, 8, 300_000)
    jobs, tier = tmp_path / "jobs", f"{tmp_path / 'tier'}:64MiB"
    names = sorted(files)

    def job(name: str, reads: list[str]) -> stagefs.Store:
        fs = stagefs.open(root, tiers=[tier], runtime=jobs / name)
        for f in reads:
            assert fs.read(f) == files[f]
        assert fs.chain is not None and fs.chain.wait_idle(30)
        return fs

    with job("j1", []) as fs:  # scanned; nothing read, no sum learnt
        first = fs.manifest.pack_id
    with job("j2", names) as fs:  # the same scan: every sum learnt, every file placed
        assert fs.manifest.pack_id == first
    with job("j1", names) as fs:
        assert fs.manifest.pack_id == first
        assert fs.stats.checksum_failures == 0
        assert fs.origin.stats.bytes_read == 0  # every file from the second job's copies


def _child_reads(fs: stagefs.Store, names: list[str], out: Any) -> None:
    """In a multiprocessing child (as a DataLoader worker): read, flush, read one more."""
    assert fs.chain is not None
    for n in names[:-1]:
        fs.read(n)
    assert fs.chain.wait_idle(30)
    fs.chain.flush_stats()
    before = fs.chain.counters()
    fs.read(names[-1])  # counted after the last flush
    out.send((before, fs.chain.counters()))


@pytest.mark.parametrize("how", ["fork", "spawn"])
def test_a_multiprocessing_child_flushes_its_counters_as_it_ends(
        raw: tuple[Path, dict[str, bytes]], tmp_path: Path, how: str) -> None:
    """A forked DataLoader worker ends with os._exit (no atexit): its counters since its
    last flush reached no ``stagefs status``; multiprocessing's exit finalizer flushes them
    now (a spawned one ends through sys.exit and atexit, as before)."""
    import multiprocessing

    root, files = raw
    names = sorted(files)[:12]
    ctx = multiprocessing.get_context(how)
    with stagefs.open(root, tiers=[str(tmp_path / "t")], runtime=tmp_path / "rt") as fs:
        recv, send = ctx.Pipe(duplex=False)
        p = ctx.Process(target=_child_reads, args=(fs, names, send))
        p.start()
        before, got = recv.recv()
        p.join(60)
        assert p.exitcode == 0
        assert got != before  # the last read was counted (a tier hit, or an origin read)
        flushed = [json.loads(f.read_text()) for f in (tmp_path / "rt" / "stats").glob(
            f"{p.pid}.*.json")]
        assert len(flushed) == 1
        # every count as the child had it last; ("open": whether its store was closed by
        # then: a spawned child's atexit closes it, a forked one's exit does not)
        flushed[0].pop("open")
        got.pop("open")
        assert flushed[0] == got
