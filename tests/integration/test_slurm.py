"""The Slurm recipe of docs/cluster.md, run as it stands with sbatch on a real Slurm.

scripts/slurm-testbed.sh starts Debian's slurm-wlm: a slurmctld and one slurmd per emulated
node (its own network namespace, host name, /dev/shm and /mnt/nvme). The test takes the job
script from the docs verbatim, submits it with sbatch, and checks what a user would: every
training process on every node reads exact bytes, also after one node's daemon is killed
mid-epoch (the job goes on: --kill-on-bad-exit=0); scancel leaves no daemon and no data on
any node. Needs root and slurm-wlm (.ci/run installs it).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from cluster_helpers import make_pack, write_expected

from stagefs.cluster.world import expand_hostlist
from stagefs.format import MANIFEST_NAME, Manifest

pytestmark = [pytest.mark.integration, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]
TESTBED = ROOT / "scripts" / "slurm-testbed.sh"
TRAIN = ROOT / "tests" / "slurm" / "slurm_train.py"
NODES = 3


def _run(cmd: list[str], env: dict[str, str], timeout: float = 60) -> str:
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    if p.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({p.returncode}): {p.stderr}{p.stdout}")
    return p.stdout


@pytest.fixture(scope="module")
def slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    if os.geteuid() != 0:
        pytest.skip("needs root: the Slurm testbed makes network and mount namespaces")
    if not (shutil.which("slurmctld") and shutil.which("slurmd") and shutil.which("munged")):
        pytest.skip("needs slurm-wlm and munge (apt-get install slurm-wlm; .ci/run does)")
    state = str(tmp_path_factory.mktemp("slurm-state"))
    env = dict(os.environ, SLURM_TESTBED=state, SLURM_CONF=os.path.join(state, "slurm.conf"))
    env.pop("STAGEFS_JOB", None)  # the suite's (conftest.py): each Slurm job is its own
    p = subprocess.run([str(TESTBED), "start", str(NODES)], env=env, capture_output=True,
                       text=True, timeout=180)
    if p.returncode != 0:
        subprocess.run([str(TESTBED), "stop"], env=env, capture_output=True, timeout=120)
        raise AssertionError(f"the Slurm testbed did not start: {p.stdout}{p.stderr}")
    try:
        yield env
    finally:
        subprocess.run([str(TESTBED), "stop"], env=env, capture_output=True, timeout=120)


def recipe() -> str:
    """The job script of docs/cluster.md, as a user copies it."""
    text = (ROOT / "docs" / "cluster.md").read_text()
    m = re.search(r"<!-- slurm-recipe -->\n```bash\n(.*?)```", text, re.S)
    assert m, "docs/cluster.md lost its Slurm recipe (the <!-- slurm-recipe --> block)"
    return m.group(1)


def _job_state(env: dict[str, str], job: str) -> dict[str, str]:
    out = _run(["scontrol", "show", "job", "--oneliner", job], env)
    return dict(kv.split("=", 1) for kv in out.split() if "=" in kv)


def _ended(env: dict[str, str], job: str) -> bool:
    return _job_state(env, job).get("JobState") not in ("PENDING", "RUNNING", "COMPLETING")


def _wait(what: str, cond: object, timeout: float, log: Path | None = None) -> None:
    deadline = time.monotonic() + timeout
    while not cond():  # type: ignore[operator]
        if time.monotonic() > deadline:
            out = log.read_text() if log and log.exists() else ""
            raise AssertionError(f"timed out waiting for {what}; job output:\n{out[-4000:]}")
        time.sleep(0.2)


def _submit(env: dict[str, str], work: Path, pack: str, *sbatch: str) -> tuple[str, Path]:
    script = work / "job.sh"
    script.write_text(recipe())
    log = work / "job.out"
    job_env = dict(env, PACK=pack, TRAIN=str(TRAIN), NPROC="2", SHM="64MiB",
                   NVME="/mnt/nvme", SLURM_TEST_DIR=str(work),
                   STAGEFS_SECRET=str(work / "secret"),
                   TMPDIR=str(work))  # torchrun's log dirs (torchelastic_*, never removed)
    job = _run(["sbatch", "--parsable", f"--nodes={NODES}", "--time=10", f"--output={log}",
                *sbatch, str(script)], job_env).strip().split(";")[0]
    return job, log


def _daemon_pids(node: int) -> list[int]:
    out = subprocess.run(["ip", "netns", "pids", f"sfs-n{node}"], capture_output=True,
                         text=True, timeout=30).stdout.split()
    pids = []
    for pid in out:
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"serve" in cmd and any(c.endswith(b"stagefs") or c == b"stagefs.cli" for c in cmd):
            pids.append(int(pid))
    return pids


def _node_leftovers(env: dict[str, str], pack: str, job: str) -> str:
    """What a job left on the nodes: daemons, and files of its runtime or of its pack's tier
    copies under /dev/shm and /mnt/nvme (the directories named on the command line stay)."""
    pack_id = Manifest(os.path.join(pack, MANIFEST_NAME)).pack_id.hex()
    left = [f"n{k}: daemon pid {p}" for k in range(1, NODES + 1) for p in _daemon_pids(k)]
    out = _run(["srun", f"--nodes={NODES}", "--ntasks-per-node=1", "--time=2", "bash", "-c",
                f"find /dev/shm /mnt/nvme \\( -path '*/{pack_id}/*' -o -path '*/{job}/*' \\) "
                "-type f -printf \"$(hostname): %p\\n\""], env)
    return "\n".join(left) + out


def test_hostlist_matches_scontrol(slurm: dict[str, str]) -> None:
    for text in ["n[01-03,7],r[1-2]-n[1-2]", "a,b[2-3],c", "gpu[8-10],10.0.0.[1-2]", "c[1-2]-[01-02]"]:
        assert expand_hostlist(text) == _run(["scontrol", "show", "hostnames", text],
                                             slurm).split()


def test_recipe_reads_exact_bytes_with_a_node_lost(slurm: dict[str, str],
                                                   tmp_path: Path) -> None:
    pack, content = make_pack(str(tmp_path), files=240, shard_size="64KiB")
    write_expected(str(tmp_path), content)
    job, log = _submit(slurm, tmp_path, pack)
    ranks = NODES * 2
    _wait("every training process halfway",
          lambda: all((tmp_path / f"half-{r}").exists() for r in range(ranks))
          or _job_state(slurm, job).get("JobState") not in ("PENDING", "RUNNING"),
          240, log)
    assert _job_state(slurm, job)["JobState"] == "RUNNING", log.read_text()
    victims = _daemon_pids(NODES)
    assert victims, f"no stagefs daemon on n{NODES}:\n{log.read_text()}"
    for pid in victims:
        os.kill(pid, signal.SIGKILL)
    (tmp_path / "go").touch()
    _wait("the job to end", lambda: _ended(slurm, job), 240, log)
    state = _job_state(slurm, job)
    assert state["JobState"] == "COMPLETED" and state["ExitCode"] == "0:0", log.read_text()
    expected = json.loads((tmp_path / "expected.json").read_text())
    seen: dict[str, str] = {}
    hosts = set()
    for r in range(ranks):
        res = json.loads((tmp_path / f"result-{r}.json").read_text())
        hosts.add(res["host"])
        assert not set(res["files"]) & set(seen), "two ranks read one file"
        seen.update(res["files"])
    assert hosts == {f"n{k}" for k in range(1, NODES + 1)}  # torchrun once per node
    assert seen == expected  # every file, exact bytes, on every node
    # the daemons that lived cleaned their nodes; the killed one could not
    left = _node_leftovers(slurm, pack, job)
    assert f"n{NODES}:" in left and "n1:" not in left and "n2:" not in left, left


def test_scancel_stops_and_cleans_every_node(slurm: dict[str, str], tmp_path: Path) -> None:
    """Submitted as a job of two tasks a node (one per GPU, as users write it): srun then
    takes the job's task count and ignored the recipe's --ntasks-per-node=1, and every
    daemon was refused; the recipe gives --ntasks too."""
    pack, content = make_pack(str(tmp_path), files=60, shard_size="64KiB")
    write_expected(str(tmp_path), content)
    # its trainers wait for a 'go' never given
    job, log = _submit(slurm, tmp_path, pack, "--ntasks-per-node=2")
    _wait("every training process halfway",
          lambda: all((tmp_path / f"half-{r}").exists() for r in range(NODES * 2)), 240, log)
    _run(["scancel", job], slurm)
    _wait("the job to end", lambda: _ended(slurm, job), 120, log)
    _wait("the daemons to stop",
          lambda: not any(_daemon_pids(k) for k in range(1, NODES + 1)), 60, log)
    assert _node_leftovers(slurm, pack, job) == "", log.read_text()


def _run_job(env: dict[str, str], work: Path, pack: str, serve_srun: str) -> tuple[str, str]:
    """A job whose daemons are started by ``serve_srun`` (the srun options before
    'stagefs serve') with --transport mpi, waited for until staged, then ended by the
    script's end; its job id and output."""
    script = work / "mpi-job.sh"
    script.write_text(
        "#!/bin/bash\nset -euo pipefail\n"
        "export STAGEFS_RUNTIME=/dev/shm/stagefs-$(id -u)/$SLURM_JOB_ID\n"
        f"{serve_srun} --nodes=\"$SLURM_NNODES\" --ntasks-per-node=1 --kill-on-bad-exit=0 "
        "--overlap stagefs serve \"$PACK\" --tier /dev/shm/stagefs-mpi:64MiB "
        "--runtime \"$STAGEFS_RUNTIME\" --clean-on-exit --transport mpi --replicas 2 "
        "--progress 0 &\n"
        "srun --nodes=1 --ntasks=1 --overlap stagefs status --wait-staged 120\n"
        "srun --nodes=1 --ntasks=1 --overlap stagefs status --json > \"$WORK/status.json\"\n")
    log = work / "mpi-job.out"
    job = _run(["sbatch", "--parsable", f"--nodes={NODES}", "--time=5", f"--output={log}",
                str(script)], dict(env, PACK=pack, WORK=str(work))).strip().split(";")[0]
    _wait("the job to end", lambda: _ended(env, job), 240, log)
    return job, log.read_text()


def test_transport_mpi_under_srun_without_pmi_is_refused(slurm: dict[str, str],
                                                         tmp_path: Path) -> None:
    """srun without --mpi (this Slurm's default plugin is none: no PMI): each daemon
    initialised MPI alone and every node was a cluster of one, staging the whole dataset
    from the origin. Refused, naming srun --mpi=pmi2."""
    pack, _ = make_pack(str(tmp_path), files=30, shard_size="64KiB")
    job, out = _run_job(slurm, tmp_path, pack, "srun")
    assert _job_state(slurm, job)["JobState"] == "FAILED", out
    assert "srun --mpi=pmi2" in out, out
    assert not (tmp_path / "status.json").exists()


def test_transport_mpi_under_srun_pmi2_leaves_nothing_on_the_nodes(slurm: dict[str, str],
                                                                   tmp_path: Path) -> None:
    """srun --mpi=pmi2 ... --transport mpi: every node staged through MPI; at the job's end
    the daemons' MPI_Finalize waits on the srun the end stops too, until Slurm kills them:
    MPICH's shared-memory segment stayed in /dev/shm on every node."""
    pack, _ = make_pack(str(tmp_path), files=30, shard_size="64KiB")
    job, out = _run_job(slurm, tmp_path, pack, "srun --mpi=pmi2")
    assert _job_state(slurm, job)["JobState"] == "COMPLETED", out
    nodes = json.loads((tmp_path / "status.json").read_text())["nodes"]
    assert len(nodes) == NODES and all(n["transport"] == "mpi" for n in nodes), nodes
    _wait("the daemons to stop",
          lambda: not any(_daemon_pids(k) for k in range(1, NODES + 1)), 60)
    left = _run(["srun", f"--nodes={NODES}", "--ntasks-per-node=1", "--time=2", "bash", "-c",
                 f"find /dev/shm \\( -name 'mpich_shm_*' -o -path '*/{job}/*' \\) "
                 "-printf \"$(hostname): %p\\n\""], slurm)
    assert left == "", left
