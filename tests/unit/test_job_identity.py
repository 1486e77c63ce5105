"""Outside a batch system, a job is the login session that launched it
(docs/decisions/0010-job-identity.md): real processes, started as a terminal, an ssh command
or a cron job would start them (each in its own session)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

_SHOW = """
import multiprocessing as mp, subprocess, sys
from stagefs.runtime import Runtime

def show(tag):
    print(tag, Runtime().path, flush=True)

if __name__ == "__main__":
    show("self")
    subprocess.run([sys.executable, "-c",
                    "from stagefs.runtime import Runtime; print('child', Runtime().path)"],
                   check=True)
    p = mp.get_context("fork").Process(target=show, args=("worker",))
    p.start(); p.join()
    p = mp.get_context("spawn").Process(target=show, args=("spawned",))
    p.start(); p.join()
"""
_BATCH = ("SLURM_JOB_ID", "PBS_JOBID", "LSB_JOBID", "FLUX_JOB_ID", "COBALT_JOBID",
          "STAGEFS_JOB", "STAGEFS_RUNTIME")


def _launch(tmp_path, **extra: str) -> dict[str, str]:  # type: ignore[no-untyped-def]
    """One independent launch (a new session, no batch system): each process's runtime."""
    script = tmp_path / "show.py"
    script.write_text(_SHOW)
    env = {k: v for k, v in os.environ.items() if k not in _BATCH}
    src = os.path.join(os.path.dirname(__file__), "..", "..", "src")
    env["PYTHONPATH"] = os.pathsep.join([os.path.abspath(src), env.get("PYTHONPATH", "")])
    out = subprocess.run([sys.executable, str(script)], env={**env, **extra}, check=True,
                         capture_output=True, text=True, start_new_session=True,
                         cwd=tmp_path).stdout
    return dict(line.split(" ", 1) for line in out.splitlines())


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
