"""Real MPI jobs on this machine: ``mpiexec -n 3`` and ``-n 4`` daemons, each rank its own
node directory and port on 127.0.0.1, readers on every rank, a daemon killed mid-read."""

from __future__ import annotations

import contextlib
import glob
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))
from cluster_helpers import (
    cluster_maps,
    make_pack,
    mpiexec,
    results,
    serve_args,
    start,
    status_json,
    stop,
    tail,
    wait_staged,
    write_expected,
)

MPIEXEC = mpiexec()
pytestmark = [
    pytest.mark.mpi,
    pytest.mark.integration,
    pytest.mark.skipif(MPIEXEC is None, reason="mpiexec or mpi4py not installed "
                       "(pip install 'stagefs[mpi]')"),
]
READER = str(Path(__file__).with_name("cluster_reader.py"))
_SEGMENTS = "/dev/shm/mpich_shm_*"


@pytest.fixture(autouse=True)
def _remove_leftover_mpich_segments() -> Iterator[None]:
    """Jobs whose ranks are killed leave MPICH's shared-memory segments in /dev/shm: remove
    the ones this test's jobs made (they have all ended when the test returns)."""
    before = set(glob.glob(_SEGMENTS))
    yield
    for path in set(glob.glob(_SEGMENTS)) - before:
        with contextlib.suppress(OSError):
            os.unlink(path)


def _readers(workdir: str, n: int, rounds: int) -> subprocess.Popen[bytes]:
    assert MPIEXEC is not None
    return start([MPIEXEC, "-n", str(n), sys.executable, READER, workdir, str(rounds)],
                 os.path.join(workdir, "readers.log"))


@pytest.mark.parametrize("n", [3, 4])
def test_every_rank_reads_every_file(tmp_path: Path, n: int) -> None:
    work = str(tmp_path)
    pack, content = make_pack(work, files=120)
    write_expected(work, content)
    from stagefs.format import MANIFEST_NAME, Manifest

    # the files' stored bytes: a copy writes each shard's header from the manifest and the
    # padding between aligned files as zeros, never reads them
    m = Manifest(os.path.join(pack, MANIFEST_NAME))
    dataset = sum(int(m.stored[e]) for e in m.files())
    m.close()
    log = os.path.join(work, "daemons.log")
    assert MPIEXEC is not None
    daemons = start([MPIEXEC, "-n", str(n), *serve_args(work, pack, "--bind", "127.0.0.1",
                                                          "--replicas", "2",
                                                          "--replicate-all", "val")], log)
    try:
        wait_staged(work, n, daemons, log=log)
        st = status_json(work, 1)
        nodes = st["nodes"]
        assert isinstance(nodes, list) and len(nodes) == n and all(nodes)
        assert len({(s["host"], s["port"]) for s in nodes}) == n  # its own port each
        assert all(s["state"] == "staged" for s in nodes)
        origin = sum(s["staging"]["origin_bytes"] for s in nodes)
        forwarded = sum(s["staging"]["forwarded_bytes"] for s in nodes)
        # each origin byte read once although every shard is on 2 nodes (val/ on all)
        assert origin == dataset, (origin, dataset)
        assert forwarded >= dataset
        # rendezvous placement: copies per node are a fair random draw, not equal to within
        # one (docs/decisions/0011; tests/unit/test_placement.py checks the spread)
        counts = [s["staging"]["shards_assigned"] for s in nodes]
        assert all(c > 0 for c in counts), counts
        # each rank's node directory holds its own shards in the agreed layout
        for r in range(n):
            d = os.path.join(work, f"node{r}", "mem")
            held = [f for sub in os.listdir(d) if not sub.startswith(".")  # (room folder)
                    for f in os.listdir(os.path.join(d, sub))]
            assert len(held) == nodes[r]["staging"]["shards_held"]
            assert not [f for f in held if f.endswith(".partial")]
            assert os.stat(os.path.join(work, f"rt{r}")).st_mode & 0o777 == 0o700
            assert os.stat(os.path.join(work, f"rt{r}", "token")).st_mode & 0o777 == 0o600

        readers = _readers(work, n, 2)
        assert readers.wait(240) == 0, tail(os.path.join(work, "readers.log"))
        for res in results(work, n):
            assert res["bad"] == 0
            assert res["workers_ok"] == 2  # forked and spawned workers read correctly
            assert res["origin_bytes"] == 0  # everything from this node or a peer
            assert res["local_hits"] > 0 and res["peer_bytes"] > 0
        st = status_json(work, 0)
        assert sum(s["server"]["bytes_served"] for s in st["nodes"]) > 0

        # a wrong token is refused by every daemon
        from stagefs.errors import AuthenticationError
        from stagefs.net.auth import new_token
        from stagefs.net.client import PeerClient

        for s in st["nodes"]:
            c = PeerClient(s["host"], s["port"], new_token())
            with pytest.raises(AuthenticationError):
                c.read([(0, 0, 8)])
            c.close()
        st = status_json(work, 0)
        assert all(s["server"]["auth_failures"] >= 1 for s in st["nodes"])
    finally:
        code = stop(daemons)
    assert code == 0, tail(log)  # SIGTERM: a clean stop of every rank
    assert not os.path.exists(os.path.join(work, "rt0", "cluster.json"))


def _pids(work: str, n: int) -> list[int]:
    """The daemons' process ids, from their runtime maps."""
    return [int(m["pid"]) for m in cluster_maps(work, n) if m is not None]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.parametrize("transport", ["tcp", "mpi"])
def test_daemon_killed_during_reads(tmp_path: Path, transport: str) -> None:
    """A rank killed while every rank reads: no reader error, no wrong byte; the other
    daemons live on (one launcher proxy per node, as on a cluster: here the fork
    launcher and a host name for each rank; ``-disable-auto-cleanup`` keeps mpiexec from
    ending them), copy the dead node's shards again from each other, say so in status,
    and stop cleanly. With ``--transport mpi`` too: the dead rank's reads through MPI
    fail by their deadline, as a hung rank's (MPICH here, through shared memory, does not
    end the survivors; docs/decisions/0012)."""
    n = 3
    work = str(tmp_path)
    pack, content = make_pack(work, files=120)
    write_expected(work, content)
    log = os.path.join(work, "daemons.log")
    assert MPIEXEC is not None
    segments_before = set(glob.glob(_SEGMENTS))
    daemons = start([MPIEXEC, "-disable-auto-cleanup", "-launcher", "fork",
                     "-hosts", ",".join(f"node{r}" for r in range(n)), "-ppn", "1",
                     "-n", str(n), *serve_args(work, pack, "--bind", "127.0.0.1",
                                               "--replicas", "2", "--dead-after", "4",
                                               "--transport", transport)], log)
    readers = None
    try:
        wait_staged(work, n, daemons, log=log)
        pids = _pids(work, n)
        readers = _readers(work, n, 6)
        deadline = time.monotonic() + 60
        while not all(os.path.exists(os.path.join(work, f"reading{r}")) for r in range(n)):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        os.kill(pids[1], signal.SIGKILL)
        assert readers.wait(300) == 0, tail(os.path.join(work, "readers.log"))
        for res in results(work, n):
            assert res["bad"] == 0, res  # exactly the origin's bytes, whatever died
            assert res["checksum_failures"] == 0
        # the survivors copy the dead node's shards from each other (K=2: every shard it
        # held has a copy on one of them), never from the origin
        deadline = time.monotonic() + 120
        last: object = None
        while time.monotonic() < deadline:
            nodes = status_json(work, 0)["nodes"]
            assert isinstance(nodes, list)
            last = [nodes[r] and nodes[r]["rereplication"] for r in (0, 2)]
            if all(x and x["dead"] == [1] and x["done"] for x in last):
                break
            time.sleep(0.3)
        else:
            raise AssertionError(f"no re-replication within 120 s: {last}\n{tail(log)}")
        assert sum(x["from_peers_shards"] for x in last) > 0, last  # type: ignore[union-attr]
        assert all(x["from_origin_bytes"] == 0 for x in last), last  # type: ignore[union-attr]
        assert _alive(pids[0]) and _alive(pids[2]), tail(log)
        # SIGTERM to each (as Slurm ends a job's tasks: mpiexec, its proxy on the dead
        # node gone, cannot pass a signal on): the survivors stop as on any day, without
        # waiting in MPI_Finalize for the dead rank, and mpiexec ends with them
        for r in (0, 2):
            os.kill(pids[r], signal.SIGTERM)
        daemons.wait(60)
    finally:
        if readers is not None:
            stop(readers)
        stop(daemons)
    assert not _alive(pids[0]) and not _alive(pids[2])
    for r in (0, 2):
        assert not os.path.exists(os.path.join(work, f"rt{r}", "cluster.json")), tail(log)
    # MPI was let go of once the daemons had started: no rank, not even the killed one,
    # left its shared-memory segments behind (the survivors, which could not finalize
    # with a rank lost, left theirs in /dev/shm)
    assert set(glob.glob(_SEGMENTS)) <= segments_before


def test_a_rank_stopped_long_before_the_others_does_not_hold_them(tmp_path: Path) -> None:
    """SIGTERM to one daemon, and to the others only once they have found it dead: every
    rank ends (the first stopped waited in MPI_Finalize for the others, which had left
    without it, and mpiexec never ended)."""
    n = 3
    work = str(tmp_path)
    pack, _ = make_pack(work, files=60)
    log = os.path.join(work, "daemons.log")
    assert MPIEXEC is not None
    daemons = start([MPIEXEC, "-disable-auto-cleanup", "-launcher", "fork",
                     "-hosts", ",".join(f"node{r}" for r in range(n)), "-ppn", "1",
                     "-n", str(n), *serve_args(work, pack, "--bind", "127.0.0.1",
                                               "--dead-after", "2")], log)
    try:
        wait_staged(work, n, daemons, log=log)
        pids = _pids(work, n)
        os.kill(pids[0], signal.SIGTERM)
        deadline = time.monotonic() + 120
        while True:  # the others find it dead
            nodes = status_json(work, 1)["nodes"]
            assert isinstance(nodes, list)
            if all(nodes[r] and nodes[r]["rereplication"]["dead"] == [0] for r in (1, 2)):
                break
            assert time.monotonic() < deadline, tail(log)
            time.sleep(0.3)
        for r in (1, 2):
            os.kill(pids[r], signal.SIGTERM)
        # ended, not waiting for a rank that will never finalize (the bound is far above
        # the second or two a stop takes, and far below the forever it was)
        daemons.wait(90)
    finally:
        stop(daemons)
    assert not any(_alive(p) for p in pids), tail(log)
    for r in range(n):
        assert not os.path.exists(os.path.join(work, f"rt{r}", "cluster.json")), tail(log)
