"""A node daemon that did not start, or was killed, and the job started again on the node.

What a batch job leaves on a node when its daemons fail at start (a typo in --tier, a bad
pack) or are killed (SIGKILL after Slurm's KillWait, the OOM killer), and what the next
start of the same job (requeued, its step run again) and the job's epilogue then meet.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from cluster_helpers import make_pack, start, stop, tail, wait_staged

from stagefs.format import MANIFEST_NAME

pytestmark = pytest.mark.integration


def _stagefs(*args: str, env: dict[str, str] | None = None, timeout: float = 60
             ) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "stagefs.cli", *args], capture_output=True,
                          text=True, timeout=timeout, env=env)


def _not_a_tier(tmp_path: Path) -> str:
    """A --tier whose parent is a file: the daemon refuses it."""
    (tmp_path / "a-file").write_bytes(b"")
    return str(tmp_path / "a-file" / "mem") + ":64MiB"


# an srun step of two tasks on one node (a job of --ntasks-per-node=2): refused before the
# daemon takes its runtime directory
_TWO_TASKS = {"SLURM_JOB_ID": "77", "SLURM_NODEID": "0", "SLURM_STEP_NODELIST": "n1",
              "SLURM_STEP_NUM_NODES": "1", "SLURM_STEP_NUM_TASKS": "2"}


def _bad_pack(tmp_path: Path) -> str:
    """A pack whose manifest is damaged: the daemon fails after it took its runtime."""
    pack, _ = make_pack(str(tmp_path / "bad"), files=10)
    with open(os.path.join(pack, MANIFEST_NAME), "r+b") as f:
        f.write(b"\0" * 64)
    return pack


@pytest.mark.parametrize("fails", ["slurm step", "tier", "manifest"])
def test_clean_removes_what_a_daemon_that_did_not_start_left(tmp_path: Path,
                                                             fails: str) -> None:
    """It leaves its runtime directory with the reason in it (for 'stagefs status
    --wait-staged'), on every node of the job: 'stagefs clean' refused it as "not a stagefs
    runtime directory of yours", so a job's epilogue could not remove it."""
    pack, _ = make_pack(str(tmp_path), files=10)
    tier = str(tmp_path / "t") + ":64MiB"
    env = dict(os.environ)
    if fails == "slurm step":
        env.update(_TWO_TASKS)
    elif fails == "tier":
        tier = _not_a_tier(tmp_path)
    else:
        pack = _bad_pack(tmp_path)
    rt = str(tmp_path / "rt")
    p = _stagefs("serve", pack, "--tier", tier, "--runtime", rt, "--progress", "0", env=env)
    assert p.returncode == 1, p.stderr
    assert os.path.exists(os.path.join(rt, "daemon.failed")), os.listdir(rt)
    c = _stagefs("clean", "--runtime", rt)
    assert c.returncode == 0, c.stderr
    assert not os.path.exists(rt)


def test_clean_still_refuses_a_directory_of_other_use_a_daemon_failed_in(
        tmp_path: Path) -> None:
    """--runtime naming a directory of the user's files: the failure is recorded there, but
    clean must not take it for a runtime (it removes a runtime whole)."""
    rt = tmp_path / "results"
    rt.mkdir()
    (rt / "model.pt").write_bytes(b"weights")
    pack, _ = make_pack(str(tmp_path), files=10)
    p = _stagefs("serve", pack, "--tier", str(tmp_path / "t") + ":64MiB", "--runtime",
                 str(rt), "--progress", "0", env=dict(os.environ, **_TWO_TASKS))
    assert p.returncode == 1, p.stderr
    c = _stagefs("clean", "--runtime", str(rt))
    assert c.returncode == 1 and "not a stagefs runtime directory" in c.stderr, c.stderr
    assert (rt / "model.pt").read_bytes() == b"weights"


def test_a_restart_after_a_killed_daemon_is_not_taken_for_it(tmp_path: Path) -> None:
    """A daemon killed with SIGKILL leaves its map and token in the runtime. The job's next
    start on the node found them: a daemon that then failed at start was not reported,
    'stagefs status --wait-staged' asked the dead daemon's address until its time was up
    (and readers connected to it, with --wait before the new one had staged). The new
    daemon removes them as it starts, so status says at once why it failed."""
    pack, _ = make_pack(str(tmp_path), files=20)
    rt, log = str(tmp_path / "rt0"), str(tmp_path / "daemon.log")
    (tmp_path / "node0").mkdir()
    first = start([sys.executable, "-m", "stagefs.cli", "serve", pack, "--tier",
                   str(tmp_path / "node0" / "mem") + ":64MiB", "--runtime", rt,
                   "--progress", "0"], log)
    try:
        wait_staged(str(tmp_path), 1, first, log=log)
    finally:
        stop(first, signal.SIGKILL)
    assert os.path.exists(os.path.join(rt, "cluster.json"))  # what the kill left
    p = _stagefs("serve", pack, "--tier", _not_a_tier(tmp_path), "--runtime", rt,
                 "--progress", "0")
    assert p.returncode == 1, p.stderr
    assert not os.path.exists(os.path.join(rt, "cluster.json"))
    s = _stagefs("status", "--runtime", rt, "--wait-staged", "20")
    assert s.returncode == 1, s.stdout + s.stderr
    assert "could not start" in s.stderr and "a-file" in s.stderr, \
        s.stdout + s.stderr + tail(log)


def test_a_second_daemon_on_a_live_runtime_leaves_its_map(tmp_path: Path) -> None:
    """The same command run twice: the second is refused and must not remove what the live
    daemon published (its readers would lose it)."""
    pack, _ = make_pack(str(tmp_path), files=20)
    rt, log = str(tmp_path / "rt0"), str(tmp_path / "daemon.log")
    (tmp_path / "node0").mkdir()
    args = ["serve", pack, "--tier", str(tmp_path / "node0" / "mem") + ":64MiB",
            "--runtime", rt, "--progress", "0"]
    first = start([sys.executable, "-m", "stagefs.cli", *args], log)
    try:
        wait_staged(str(tmp_path), 1, first, log=log)
        p = _stagefs(*args)
        assert p.returncode == 1 and "already serves" in p.stderr, p.stderr
        assert os.path.exists(os.path.join(rt, "cluster.json"))
        assert os.path.exists(os.path.join(rt, "token"))
    finally:
        assert stop(first) == 0, tail(log)


def test_clean_knows_every_file_a_daemon_writes_before_its_lease() -> None:
    from stagefs.cluster.cmap import DAEMON_PID, FAILED_NAME
    from stagefs.cluster.daemon import DAEMON_LOCK
    from stagefs.runtime import DAEMON_FILES

    assert {FAILED_NAME, DAEMON_PID, DAEMON_LOCK} == DAEMON_FILES
