"""Outside a batch system, a job is the login session that launched it
(docs/decisions/0010-job-identity.md): real processes, started as a terminal, an ssh command
or a cron job would start them (each in its own session)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

# each process writes its runtime to a file of its own in $SHOW_OUT (the ranks' stdout
# lines, forwarded by a launcher, can run into each other)
_SHOW_FN = """
import os
from stagefs.runtime import Runtime

def show(tag):
    with open(os.path.join(os.environ["SHOW_OUT"], tag), "w") as f:
        f.write(Runtime().path)
"""
_SHOW = _SHOW_FN + """
import multiprocessing as mp, subprocess, sys

if __name__ == "__main__":
    show("self")
    subprocess.run([sys.executable, "-c", "import os; from stagefs.runtime import Runtime; "
                    "open(os.path.join(os.environ['SHOW_OUT'], 'child'), 'w')"
                    ".write(Runtime().path)"], check=True)
    p = mp.get_context("fork").Process(target=show, args=("worker",))
    p.start(); p.join()
    p = mp.get_context("spawn").Process(target=show, args=("spawned",))
    p.start(); p.join()
"""
_RANK = _SHOW_FN + """
import multiprocessing as mp

if __name__ == "__main__":
    import os
    show(f"rank{os.getpid()}")
    p = mp.get_context("fork").Process(target=show, args=(f"worker{os.getpid()}",))
    p.start(); p.join()
"""
# what mpiexec (Hydra) and torchrun do: each rank in a session of its own, marked as a rank
_LAUNCHER = """
import os, subprocess, sys
procs = [subprocess.Popen([sys.executable, sys.argv[1]], start_new_session=True,
                          env=dict(os.environ, PMI_RANK=str(r), PMI_SIZE="2"))
         for r in range(2)]
sys.exit(max(p.wait() for p in procs))
"""
_BATCH = ("SLURM_JOB_ID", "PBS_JOBID", "LSB_JOBID", "FLUX_JOB_ID", "COBALT_JOBID",
          "STAGEFS_JOB", "STAGEFS_RUNTIME")


def _launch(tmp_path, *cmd: str, **extra: str) -> dict[str, str]:  # type: ignore[no-untyped-def]
    """One independent launch (a new session, no batch system) of ``cmd`` (by default a
    script that starts a subprocess and workers): each process's runtime."""
    (tmp_path / "show.py").write_text(_SHOW)
    (tmp_path / "rank.py").write_text(_RANK)
    (tmp_path / "launcher.py").write_text(_LAUNCHER)
    env = {k: v for k, v in os.environ.items() if k not in _BATCH}
    env["TMPDIR"] = str(tmp_path)  # torchrun's log dir (torchelastic_*, never removed)
    src = Path(__file__).resolve().parents[2] / "src"
    env["PYTHONPATH"] = os.pathsep.join([str(src), env.get("PYTHONPATH", "")])
    out = Path(tempfile.mkdtemp(dir=tmp_path))
    subprocess.run(list(cmd) or [sys.executable, "show.py"],
                   env={**env, **extra, "SHOW_OUT": str(out)}, check=True, capture_output=True,
                   start_new_session=True, cwd=tmp_path, timeout=300)
    return {f.name: f.read_text() for f in out.iterdir()}


def test_a_job_and_its_children_share_one_runtime(tmp_path) -> None:  # type: ignore[no-untyped-def]
    seen = _launch(tmp_path)
    assert set(seen) == {"self", "child", "worker", "spawned"}
    assert len(set(seen.values())) == 1, seen
    assert os.path.basename(seen["self"]).startswith("session-")


def test_two_independent_launches_get_two_runtimes(tmp_path) -> None:  # type: ignore[no-untyped-def]
    a, b = _launch(tmp_path), _launch(tmp_path)
    assert a["self"] != b["self"]
    assert os.path.dirname(a["self"]) == os.path.dirname(b["self"])  # the user's base


@pytest.mark.parametrize("var", ["STAGEFS_JOB", "SLURM_JOB_ID"])
def test_a_named_job_is_shared_across_launches(tmp_path, var: str) -> None:  # type: ignore[no-untyped-def]
    a, b = _launch(tmp_path, **{var: "train-7"}), _launch(tmp_path, **{var: "train-7"})
    assert a["self"] == b["self"] == a["worker"]
    assert os.path.basename(a["self"]) == "train-7"


def _one_job_per_launch(tmp_path, *cmd: str) -> None:  # type: ignore[no-untyped-def]
    a, b = _launch(tmp_path, *cmd), _launch(tmp_path, *cmd)
    assert len(a) == len(b) == 4, (a, b)  # two ranks, each with a worker
    assert len(set(a.values())) == 1 and len(set(b.values())) == 1, (a, b)
    assert set(a.values()) != set(b.values())


def test_ranks_a_launcher_puts_in_sessions_of_their_own_share_one_runtime(
        tmp_path) -> None:  # type: ignore[no-untyped-def]
    _one_job_per_launch(tmp_path, sys.executable, "launcher.py", "rank.py")


@pytest.mark.skipif(shutil.which("mpiexec") is None, reason="mpiexec is not installed")
def test_mpiexec_ranks_share_one_runtime(tmp_path) -> None:  # type: ignore[no-untyped-def]
    _one_job_per_launch(tmp_path, "mpiexec", "-n", "2", sys.executable, "rank.py")


def test_torchrun_ranks_share_one_runtime(tmp_path) -> None:  # type: ignore[no-untyped-def]
    pytest.importorskip("torch.distributed.run")
    _one_job_per_launch(tmp_path, sys.executable, "-m", "torch.distributed.run",
                        "--standalone", "--nproc-per-node", "2", "rank.py")
