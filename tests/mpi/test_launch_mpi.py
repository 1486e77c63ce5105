"""What HPC users get wrong when they launch the daemons under ``mpiexec``: one rank that
cannot start, two daemons on one node, an MPI library without thread support. Each must
end the whole job at once with an error naming the node and what to do, leaving nothing
behind; a job that never ends burns its allocation."""

from __future__ import annotations

import contextlib
import glob
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))
from cluster_helpers import make_pack, mpiexec, serve_args

MPIEXEC = mpiexec()
pytestmark = [
    pytest.mark.mpi,
    pytest.mark.integration,
    pytest.mark.skipif(MPIEXEC is None, reason="mpiexec or mpi4py not installed "
                       "(pip install 'stagefs[mpi]')"),
]
SRC = str(Path(__file__).resolve().parents[2] / "src")
_SEGMENTS = "/dev/shm/mpich_shm_*"
# a job that does not end by then has hung (the daemons refuse in about a second): the
# guard that ends it, not a measure
HUNG = 120


@pytest.fixture(autouse=True)
def _remove_leftover_mpich_segments() -> Iterator[None]:
    """The MPICH shared-memory segments a test's jobs left in /dev/shm: removed at the end
    (a job whose ranks all ended normally leaves none)."""
    before = set(glob.glob(_SEGMENTS))
    yield
    for path in set(glob.glob(_SEGMENTS)) - before:
        with contextlib.suppress(OSError):
            os.unlink(path)


def _job(cmd: list[str]) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          env=env, start_new_session=True) as proc:
        try:
            out, err = proc.communicate(timeout=HUNG)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # mpiexec, its proxies and the ranks
            out, err = proc.communicate()
            raise AssertionError(f"the job hung: {err[-3000:]}") from None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def test_a_rank_that_cannot_start_ends_the_job_naming_it(tmp_path: Path) -> None:
    """Rank 1's tier is under a file: it cannot start. The others stopped too (they were
    waiting for it in the token's broadcast, forever, each spinning a core; it waited for
    them in MPI_Finalize), each saying which node failed and why."""
    work = str(tmp_path)
    pack, _ = make_pack(work, files=20)
    for r in (0, 2):
        os.makedirs(os.path.join(work, f"node{r}"))
    Path(work, "node1").write_text("a file where rank 1's tier should go\n")
    assert MPIEXEC is not None
    before = set(glob.glob(_SEGMENTS))
    run = _job([MPIEXEC, "-n", "3", *serve_args(work, pack, "--bind", "127.0.0.1")])
    assert run.returncode != 0
    err = run.stderr
    assert "node 1 (" in err and "is a file" in err, err
    # the two others say why they stop, naming it
    assert err.count("1 of the 3 daemons could not start") == 2, err
    assert set(glob.glob(_SEGMENTS)) == before  # every rank finalized MPI
    for r in range(3):  # nothing a reader would take for a live daemon
        rt = os.path.join(work, f"rt{r}")
        for name in ("cluster.json", "token", "fabric.sock"):
            assert not os.path.exists(os.path.join(rt, name)), (rt, name)
        procs = os.path.join(rt, "procs")
        assert not os.path.isdir(procs) or not os.listdir(procs)  # no lease left


def test_two_daemons_on_one_node_are_told_to_launch_one_per_node(tmp_path: Path) -> None:
    """-ppn 2 by mistake: the two daemons of a node share its runtime directory (the job's
    default). The second was refused ('already serves') and the job hung; now every rank
    stops at once, saying so."""
    work = str(tmp_path)
    pack, _ = make_pack(work, files=20)
    assert MPIEXEC is not None
    args = serve_args(work, pack, "--bind", "127.0.0.1")
    args[args.index("--runtime") + 1] = os.path.join(work, "rt")  # one per node: no {rank}
    run = _job([MPIEXEC, "-launcher", "fork", "-hosts", "n0,n1", "-ppn", "2", "-n", "4",
                *args])
    assert run.returncode != 0
    assert "two daemons on one host" in run.stderr, run.stderr
    assert "launch one daemon per node (mpiexec -ppn 1" in run.stderr


def test_transport_mpi_without_thread_multiple_is_refused_before_it_takes_anything(
        tmp_path: Path) -> None:
    """MPI initialised with MPI_THREAD_FUNNELED (as a library without thread support gives):
    --transport mpi is refused before the bootstrap, naming the level; it was refused only
    after the daemon had taken its runtime directory, its tiers and its port."""
    pack, _ = make_pack(str(tmp_path), files=10)
    rt, tier = tmp_path / "rt", tmp_path / "tier"
    code = (
        "import mpi4py; mpi4py.rc.thread_level = 'funneled'; from mpi4py import MPI\n"
        "from stagefs.cluster.daemon import ServeOptions, serve\n"
        "from stagefs.errors import ClusterError\n"
        "try:\n"
        f"    serve(ServeOptions({pack!r}, [{str(tier) + ':64MiB'!r}], runtime={str(rt)!r},"
        " transport='mpi', mpi=True, progress=0))\n"
        "except ClusterError as exc:\n"
        "    print(exc)\n"
    )
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=HUNG, env=env)
    assert run.returncode == 0, run.stderr
    assert "needs MPI_THREAD_MULTIPLE" in run.stdout, run.stdout + run.stderr
    assert "gave MPI_THREAD_FUNNELED" in run.stdout
    assert not tier.exists()
    assert not (rt / "fabric.sock").exists() and not (rt / "daemon.pid").exists()


@pytest.mark.parametrize("launcher", ["srun", "another mpirun"])
def test_a_launch_where_mpi_sees_each_daemon_alone_is_refused(tmp_path: Path,
                                                              launcher: str) -> None:
    """srun without an MPI plugin (no PMI), or another MPI's mpirun: each daemon initialised
    MPI as a job of one rank, and every node was a cluster of one, staging the whole
    dataset from the origin, silently. Refused, saying what to launch with."""
    pack, _ = make_pack(str(tmp_path), files=10)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PMI_", "PMIX_", "OMPI_", "SLURM_", "HYDI_", "MPI_"))}
    env["PYTHONPATH"] = SRC + os.pathsep + os.environ.get("PYTHONPATH", "")
    if launcher == "srun":  # task 1 of a step of 3, as srun --mpi=none sets them
        env.update(SLURM_PROCID="1", SLURM_NTASKS="3")
        want = "srun --mpi=pmi2"
    else:  # Open MPI's mpirun, mpi4py on MPICH
        env.update(OMPI_COMM_WORLD_RANK="1", OMPI_COMM_WORLD_SIZE="4")
        want = "that library's mpiexec"
    rt = tmp_path / "rt"
    run = subprocess.run([sys.executable, "-m", "stagefs.cli", "serve", pack, "--tier",
                          f"{tmp_path / 'tier'}:64MiB", "--runtime", str(rt),
                          "--transport", "mpi"], capture_output=True, text=True,
                         timeout=HUNG, env=env)
    assert run.returncode != 0
    assert "MPI sees each as a job of its own" in run.stderr, run.stderr
    assert want in run.stderr, run.stderr
    assert not (rt / "cluster.json").exists() and not (tmp_path / "tier").exists()
