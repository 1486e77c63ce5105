"""Jobs never destroy each other's data: leases (host, pid, start time) decide who uses a
runtime, staged data stays until `stagefs clean`, and clean refuses while a process uses it.

Every job here is a real process that opens a Store on a pack with a tier, stages it, says
so on a pipe and waits on another. The user's runtime base is a temporary directory (the
children get it through STAGEFS_RUNTIME), so no test sees another's jobs.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

import stagefs
from stagefs.cli import main
from stagefs.runtime import HOST, Lease, Runtime

# the children import the stagefs this test imported (a source tree or an installed package)
STAGEFS_ROOT = str(Path(stagefs.__file__).resolve().parents[1])
CHILD = textwrap.dedent("""
    import sys
    import stagefs
    pack, tier, marker = sys.argv[1:4]
    with stagefs.open(pack, tiers=[tier]) as fs:
        fs.chain.stage()
        print("staged", flush=True)
        sys.stdin.readline()
""")


class Job:
    """A process of job ``name`` that staged ``pack`` into ``tier`` and waits to be told."""

    def __init__(self, base: Path, name: str, pack: Path, tier: Path) -> None:
        self.runtime = base / name
        env = dict(os.environ, STAGEFS_RUNTIME=str(self.runtime), STAGEFS_JOB=name,
                   PYTHONPATH=STAGEFS_ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
        self.proc = subprocess.Popen([sys.executable, "-c", CHILD, str(pack), str(tier),
                                      f"lease-test-{name}"], env=env, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE)
        assert self.proc.stdout is not None
        assert self.proc.stdout.readline() == b"staged\n", "the job did not stage"

    def finish(self) -> int:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(b"done\n")
        self.proc.stdin.close()
        code = self.proc.wait(60)
        self.proc.stdout.close()
        return code

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(60)
        for f in (self.proc.stdin, self.proc.stdout):
            if f is not None:
                f.close()


@pytest.fixture
def base(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """This user's runtime base (normally /dev/shm/stagefs-<uid>), private to the test."""
    b = tmp_path / "base"
    monkeypatch.setattr("stagefs.runtime._default_base", lambda: str(b))
    monkeypatch.delenv("STAGEFS_RUNTIME", raising=False)
    monkeypatch.delenv("STAGEFS_TIERS", raising=False)
    monkeypatch.setenv("STAGEFS_JOB", "next")
    yield b


@pytest.fixture
def pack(sample_pack_session: tuple[Path, Path]) -> Path:
    return sample_pack_session[1]


def _staged(tier: Path, pack: Path) -> list[str]:
    with stagefs.open(pack) as fs:
        d = tier / fs.manifest.pack_id.hex()
    return sorted(os.listdir(d)) if d.is_dir() else []


@pytest.mark.parametrize("end", ["exit", "killed"])
def test_a_finished_jobs_data_is_kept_for_the_next_job(base: Path, pack: Path, tmp_path: Path,
                                                       end: str) -> None:
    tier = tmp_path / "tier"
    job = Job(base, "first", pack, tier)
    if end == "exit":
        assert job.finish() == 0
    else:
        job.kill()
    staged = _staged(tier, pack)
    assert staged
    # an hour later (the clock the old rule read: the mtime of the job's process records)
    old = os.stat(job.runtime / "procs").st_mtime_ns - 3600 * 10**9
    os.utime(job.runtime / "procs", ns=(old, old))
    with stagefs.open(pack, tiers=[str(tier)]) as fs:  # the next job, another job id
        assert fs.held_shards() == set(range(len(fs.manifest.shards)))
        for e in fs.manifest.files():
            fs.read_entry(int(e))
        assert fs.origin.stats.bytes_read == 0
    assert _staged(tier, pack) == staged
    assert job.runtime.is_dir()  # it still says where its data is, for `stagefs clean`


def test_clean_refuses_while_a_process_uses_the_runtime_then_force(
        base: Path, pack: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tier = tmp_path / "tier"
    job = Job(base, "busy", pack, tier)
    try:
        assert main(["clean", "--runtime", str(job.runtime)]) == 1
        err = capsys.readouterr().err
        assert f"pid {job.proc.pid} on {HOST}" in err and "lease-test-busy" in err, err
        assert "--force" in err and "Traceback" not in err
        assert _staged(tier, pack) and job.runtime.is_dir()
        assert main(["clean", "--runtime", str(job.runtime), "--force"]) == 0
        assert not _staged(tier, pack) and not job.runtime.exists()
    finally:
        assert job.finish() == 0  # its runtime went under it: it still closes cleanly


def test_clean_after_the_job_ended_removes_its_data(base: Path, pack: Path, tmp_path: Path
                                                    ) -> None:
    tier = tmp_path / "tier"
    job = Job(base, "done", pack, tier)
    job.kill()  # its lease stays behind, dead
    assert main(["clean", "--runtime", str(job.runtime)]) == 0
    assert not _staged(tier, pack) and not job.runtime.exists()


def test_clean_removes_every_tier_set_the_job_placed_into(base: Path, pack: Path,
                                                          tmp_path: Path) -> None:
    # staged with one set of tiers, read with another: clean removed the last set's only
    one, two = tmp_path / "one", tmp_path / "two"
    first = Job(base, "sets", pack, one)
    assert first.finish() == 0
    second = Job(base, "sets", pack, two)
    assert second.finish() == 0
    assert _staged(one, pack) and _staged(two, pack)
    assert main(["clean", "--runtime", str(second.runtime)]) == 0
    assert not _staged(one, pack) and not _staged(two, pack)


def test_clean_never_removes_what_a_live_job_uses(base: Path, pack: Path, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    tier = tmp_path / "tier"
    first = Job(base, "first", pack, tier)
    assert first.finish() == 0
    second = Job(base, "second", pack, tier)  # same dataset, same tier: shares the data
    try:
        monkeypatch.setenv("STAGEFS_JOB", "first")
        assert main(["clean"]) == 0  # the first job's runtime goes, the shared data stays
        assert not first.runtime.exists() and _staged(tier, pack)
        capsys.readouterr()
        assert main(["clean", "--all"]) == 1  # every job of the user: one is live
        err = capsys.readouterr().err
        assert f"pid {second.proc.pid}" in err and "(job second)" in err, err
        assert _staged(tier, pack) and second.runtime.is_dir()
    finally:
        assert second.finish() == 0
    assert main(["clean", "--all"]) == 0
    assert not _staged(tier, pack) and os.listdir(base) == []


def test_clean_keeps_what_a_live_job_uses_through_a_symlink(
        base: Path, pack: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A live job named the tier through a symlink, another job the directory itself: a
    clean of the other job compared the paths as written and removed the copies the live
    job was reading, and its room folder with them."""
    tier = tmp_path / "tier"
    tier.mkdir()
    link = tmp_path / "tier-link"
    link.symlink_to(tier)
    first = Job(base, "first", pack, tier)
    assert first.finish() == 0
    live = Job(base, "live", pack, link)  # the same copies, by the link
    try:
        staged = _staged(tier, pack)
        assert staged
        monkeypatch.setenv("STAGEFS_JOB", "first")
        assert main(["clean"]) == 0
        assert not first.runtime.exists()
        assert _staged(tier, pack) == staged and any(tier.glob(".stagefs-*"))
    finally:
        assert live.finish() == 0


def test_a_lease_is_judged_by_host_pid_and_start_time(tmp_path: Path) -> None:
    rt = Runtime(tmp_path / "rt").open()
    me = Lease.mine()
    assert me.alive() and me.host == HOST and me.start > 0 and "python" in me.cmd
    assert not Lease(me.pid, HOST, me.start + 1).alive()  # the pid now names another process
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, timeout=60, check=True)
    dead_pid = int(dead.stdout)
    assert not Lease(dead_pid, HOST).alive()
    assert Lease(dead_pid, "another-node").alive()  # cannot be checked from here: kept
    procs = Path(rt.procs)
    (procs / f"{dead_pid}@{HOST}").write_text(json.dumps({"pid": dead_pid, "host": HOST}))
    (procs / f"{dead_pid}@another-node").write_text(json.dumps({"pid": dead_pid,
                                                                "host": "another-node"}))
    (procs / f"{os.getpid() + 10**7}@{HOST}").write_text("torn")  # judged by its name
    assert sorted((lease.pid, lease.host) for lease in rt.leases()) == sorted(
        [(os.getpid(), HOST), (dead_pid, "another-node")])
    assert sorted(os.listdir(procs)) == sorted([me.name, f"{dead_pid}@another-node"])
    rt.unregister()
    assert os.listdir(procs) == [f"{dead_pid}@another-node"]


def test_a_clean_cut_short_leaves_a_runtime_the_next_clean_removes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`stagefs clean` killed while it removed the runtime directory could leave it without
    procs/ (its mark as a runtime): the next clean refused it as "not a stagefs runtime
    directory of yours". procs/ goes last."""
    from stagefs import runtime as rt_mod

    rt = tmp_path / "rt"
    Runtime(str(rt)).open().unregister()  # a job's runtime, its process ended
    for sub in ("stats", "claims", "tiers"):
        (rt / sub / "x").write_text("x")
    real = rt_mod.remove_any
    calls: list[str] = []

    def cut_short(path: str) -> None:
        calls.append(os.path.basename(path))
        if len(calls) == 2:
            raise KeyboardInterrupt  # the clean is killed here
        real(path)

    monkeypatch.setattr(rt_mod, "remove_any", cut_short)
    with pytest.raises(KeyboardInterrupt):
        rt_mod.clean([Runtime(str(rt))])
    assert "procs" not in calls and (rt / "procs").is_dir()
    monkeypatch.setattr(rt_mod, "remove_any", real)
    rt_mod.clean([Runtime(str(rt))])
    assert not rt.exists()
