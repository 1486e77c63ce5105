"""Slurm without MPI: hostlist expansion, the step a daemon is a task of, the job token."""

from __future__ import annotations

import os
import stat
import threading
from pathlib import Path

import pytest

from stagefs.cluster.bootstrap import SlurmBootstrap, slurm_port
from stagefs.cluster.world import expand_hostlist, slurm_step
from stagefs.errors import ClusterError, ConfigError
from stagefs.net import auth


@pytest.mark.parametrize("text, names", [
    ("node1", ["node1"]),
    ("n[1-3]", ["n1", "n2", "n3"]),
    ("n[01-03,7]", ["n01", "n02", "n03", "n7"]),  # each range its own width
    ("n[08-10]", ["n08", "n09", "n10"]),
    ("n[8-10]", ["n8", "n9", "n10"]),
    ("a,b[2-3],c", ["a", "b2", "b3", "c"]),
    ("r[1-2]-n[1-2]", ["r1-n1", "r1-n2", "r2-n1", "r2-n2"]),
    ("gpu[1-2]-ib", ["gpu1-ib", "gpu2-ib"]),
    ("10.0.0.[1-2]", ["10.0.0.1", "10.0.0.2"]),
    (" n1 , n2 ", ["n1", "n2"]),
])
def test_hostlist_expands_as_slurm_does(text: str, names: list[str]) -> None:
    assert expand_hostlist(text) == names


@pytest.mark.parametrize("text, why", [
    ("n[1-3", "without its"), ("n1-3]", "without its"), ("n[3-1]", "backwards"),
    ("n[a-b]", "bad range"), ("n[]", "bad range"), ("", "names no host"),
    ("n[1-99999999999]", "more than"), ("n[1-2[3]]", "without its"),
])
def test_hostlist_refuses_malformed_text_clearly(text: str, why: str) -> None:
    with pytest.raises(ConfigError, match=why) as err:
        expand_hostlist(text, "SLURM_STEP_NODELIST")
    assert "SLURM_STEP_NODELIST" in str(err.value)


def _env(**kw: str) -> dict[str, str]:
    base = {"SLURM_JOB_ID": "4242", "SLURM_STEP_NODELIST": "c[1-4]", "SLURM_NODEID": "2",
            "SLURM_STEP_NUM_NODES": "4", "SLURM_STEP_NUM_TASKS": "4"}
    base.update(kw)
    return {k: v for k, v in base.items() if v}


def test_slurm_step_reads_the_step_not_the_batch_script() -> None:
    step = slurm_step(_env())
    assert step is not None
    assert (step.job, step.node, step.hosts) == ("4242", 2, ["c1", "c2", "c3", "c4"])
    # a batch script (or salloc's shell) is not a step: no SLURM_STEP_NODELIST
    assert slurm_step(_env(SLURM_STEP_NODELIST="")) is None
    assert slurm_step({}) is None


def test_slurm_step_refuses_several_tasks_per_node() -> None:
    with pytest.raises(ConfigError, match="ntasks-per-node=1"):
        slurm_step(_env(SLURM_STEP_NUM_TASKS="16"))
    with pytest.raises(ConfigError, match="SLURM_NODEID 9"):
        slurm_step(_env(SLURM_NODEID="9"))
    with pytest.raises(ConfigError, match="SLURM_STEP_NUM_NODES is 3"):
        slurm_step(_env(SLURM_STEP_NUM_NODES="3"))


def test_several_tasks_per_node_names_the_srun_options_that_give_one() -> None:
    """A job of several tasks a node (#SBATCH --ntasks-per-node=2): srun inherits its task
    count, and ignores --ntasks-per-node=1 with a warning. The advice was that very option;
    a user who followed it met the same error. It must name --ntasks too."""
    with pytest.raises(ConfigError) as err:
        slurm_step(_env(SLURM_STEP_NUM_TASKS="8", SLURM_NTASKS_PER_NODE="2"))
    assert "--ntasks=$SLURM_NNODES --ntasks-per-node=1" in str(err.value)


def test_job_token_is_the_same_on_every_node_and_differs_per_job(tmp_path: Path) -> None:
    secret = str(tmp_path / "home" / ".config" / "stagefs" / "secret")
    got: list[bytes] = []
    # nodes racing to make the secret: the first wins and all derive the same token
    threads = [threading.Thread(target=lambda: got.append(auth.job_token("77", secret)))
               for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(got) == 8 and len(set(got)) == 1 and len(got[0]) == 32
    assert stat.S_IMODE(os.stat(secret).st_mode) == 0o600
    assert [p for p in os.listdir(os.path.dirname(secret))] == ["secret"]  # no partials
    assert auth.job_token("78", secret) != got[0]
    assert auth.job_token("77", secret) == got[0]
    os.chmod(secret, 0o644)
    with pytest.raises(ClusterError, match="chmod 600"):
        auth.job_token("77", secret)


def test_slurm_bootstrap_hosts_port_and_token(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STAGEFS_SECRET", str(tmp_path / "secret"))
    step = slurm_step(_env())
    assert step is not None
    a = SlurmBootstrap(step, None, None)
    b = SlurmBootstrap(slurm_step(_env(SLURM_NODEID="0")) or step, None, None)
    assert (a.rank, a.size, b.rank) == (2, 4, 0)
    port = slurm_port("4242")
    assert a.exchange(("ignored", 1)) == [(f"c{i}", port) for i in range(1, 5)]
    assert a.token() == b.token() == auth.job_token("4242", str(tmp_path / "secret"))
    assert SlurmBootstrap(step, None, 7001).hosts[0] == ("c1", 7001)
    assert slurm_port("4243") != port  # two jobs on one node: other ports
    tok = tmp_path / "tok"
    auth.write_token(str(tok), b"t" * 32)
    assert SlurmBootstrap(step, str(tok), None).token() == b"t" * 32


_BATCH = {"SLURM_JOB_ID": "4242", "SLURM_JOB_NUM_NODES": "4", "SLURM_NNODES": "4",
          "SLURM_NODEID": "0", "SLURM_PROCID": "0", "SLURM_NTASKS": "4"}


@pytest.mark.parametrize("nodes, warned", [("4", True), ("1", False)])
def test_a_daemon_in_the_batch_script_without_srun_is_told_it_serves_one_node(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
        nodes: str, warned: bool) -> None:
    # 'stagefs serve ... &' in a job script of several nodes, srun forgotten: a cluster of
    # one on the batch node, said nowhere, while the other nodes' readers waited for a
    # daemon until their connect timeout
    from stagefs.cluster.bootstrap import SingleBootstrap
    from stagefs.cluster.daemon import ServeOptions, _bootstrap

    for k in list(os.environ):
        if k.startswith(("SLURM_", "PMI_", "PMIX_", "OMPI_", "HYDI_", "MPI_")):
            monkeypatch.delenv(k)
    for k, v in {**_BATCH, "SLURM_JOB_NUM_NODES": nodes, "SLURM_NNODES": nodes}.items():
        monkeypatch.setenv(k, v)
    with caplog.at_level("WARNING", logger="stagefs.daemon"):
        boot = _bootstrap(ServeOptions(origin=str(tmp_path), tiers=[str(tmp_path / "t")]))
    assert isinstance(boot, SingleBootstrap)
    said = [r.getMessage() for r in caplog.records if "outside an srun step" in r.getMessage()]
    assert bool(said) == warned
    if warned:
        assert "Slurm job of 4 nodes" in said[0] and "srun --nodes=$SLURM_NNODES" in said[0]


def test_slurm_batch_nodes_only_outside_a_step() -> None:
    from stagefs.cluster.world import slurm_batch_nodes

    assert slurm_batch_nodes(_BATCH) == 4
    assert slurm_batch_nodes({**_BATCH, "SLURM_STEP_NODELIST": "c[1-4]"}) is None
    assert slurm_batch_nodes({"SLURM_NNODES": "4"}) is None  # no job
