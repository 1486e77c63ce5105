"""The MPI transport (cluster/mpi_transport.py) in real MPI jobs on this machine: every rank
reads the other ranks' shards through it, bad ranges are refused, a hung peer is
PeerUnavailable and comes back; and ``stagefs serve --transport mpi`` stages through it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from stagefs.format import MANIFEST_NAME

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))
from cluster_helpers import (
    held_in_pieces,
    make_pack,
    mpiexec,
    piece_pack,
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
RANKS = str(Path(__file__).with_name("mpi_transport_ranks.py"))
READER = str(Path(__file__).with_name("cluster_reader.py"))
SRC = str(Path(__file__).resolve().parents[2] / "src")


def _ranks(work: Path, n: int, *mode: str) -> list[dict[str, object]]:
    _, content = make_pack(str(work), files=120)
    write_expected(str(work), content)
    assert MPIEXEC is not None
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}
    run = subprocess.run([MPIEXEC, "-n", str(n), sys.executable, RANKS, str(work), *mode],
                         capture_output=True, timeout=300, env=env)
    assert run.returncode == 0, run.stderr.decode()[-4000:]
    out = []
    for r in range(n):
        path = work / f"mpi{r}.json"
        if path.exists():
            out.append(json.loads(path.read_text()))
    return out


@pytest.mark.parametrize("n", [2, 4])
def test_every_rank_reads_the_other_ranks_shards_through_mpi(tmp_path: Path, n: int) -> None:
    got = _ranks(tmp_path, n)
    assert len(got) == n
    for res in got:
        assert res["threads"]  # MPI_THREAD_MULTIPLE
        assert res["files"] > 0 and res["bad"] == 0  # every file, exactly its bytes
        assert res["store_checksum_failures"] == 0 and res["store_unavailable"] == 0
        peers = res["peers"]
        assert isinstance(peers, dict) and sorted(peers) == sorted(
            str(r) for r in range(n) if r != res["rank"])
        assert all(p["bytes"] > 0 and p["failures"] == 0 for p in peers.values())
        # 8 bad ranges, unknown shards and a shard the peer does not hold: all refused,
        # in a batch too, and a refusal does not make the peer suspect
        assert res["refused"] == 8 and res["many_ok"] and not res["suspect_after_refusals"]
        served = res["served"]
        assert isinstance(served, dict) and served["ranges_invalid"] > 0
        assert served["ranges_not_held"] > 0 and served["bytes_served"] > 0
    # the holder conformance suite, with rank 1 as the holder through MPI
    assert got[0]["conformance"] == ["check_ranges", "check_out_of_bounds",
                                     "check_missing_shard", "check_corrupt_copy",
                                     "check_concurrent_readers"]


def test_a_hung_peer_is_unavailable_and_comes_back(tmp_path: Path) -> None:
    res = _ranks(tmp_path, 3, "hung")[0]
    assert "no reply within" in str(res["first"]) and res["suspect"]
    assert res["bad_while_hung"] == 0 and int(str(res["origin_bytes"])) > 0  # from the origin
    assert res["probe"] and not res["suspect_after"]
    assert res["bad_after"] == 0 and int(str(res["mpi_bytes_after"])) > 0  # through MPI again


def test_replies_given_up_on_are_let_go_once_the_peer_answers(tmp_path: Path) -> None:
    """A reader gives up on a stopped rank's replies (a read of 1.3 MB, a ping); the rank
    goes on and answers late. MPICH cannot cancel a send: the serving rank's send of the
    large reply waited for ever and its buffer was held for ever, and the reader's rank kept
    the late messages in MPI's queue. Now the reader's rank takes and drops them, the
    serving rank's sends complete, and neither holds anything for them; every byte read
    after is right."""
    r0, r1 = _ranks(tmp_path, 2, "late")
    assert "no reply within" in str(r0["first"]) and r0["ping_while_stopped"] is False
    assert int(str(r0["reply_bytes"])) > 2**20  # a rendezvous-sized reply, not an eager one
    # [abandoned, sending, a message in MPI's queue] on each rank: nothing left
    assert r0["held"] == [[0, 0, False], [0, 0, False]]
    st0, st1 = r0["status"], r1["status"]
    assert isinstance(st0, dict) and isinstance(st1, dict)
    assert st0["abandoned_held"] == st0["abandoned_held_bytes"] == 0
    assert st1["abandoned_held"] == st1["abandoned_held_bytes"] == 0
    assert st0["server"]["late_replies"] >= 2  # the read's reply and the ping's
    assert st1["server"]["requests"] >= 2
    for r in (r0, r1):
        assert int(str(r["files_after"])) > 0 and r["bad_after"] == 0


def _mpi_daemons(work: str, n: int) -> tuple[str, subprocess.Popen[bytes]]:
    """``n`` daemons with ``--transport mpi`` and 2 copies of each shard, in one MPI job, of
    a pack of 120 files (its expected hashes written): (their log, the job)."""
    pack, content = make_pack(work, files=120)
    write_expected(work, content)
    log = os.path.join(work, "daemons.log")
    assert MPIEXEC is not None
    return log, start([MPIEXEC, "-n", str(n), *serve_args(
        work, pack, "--bind", "127.0.0.1", "--replicas", "2", "--transport", "mpi")], log)


def test_daemons_stage_through_mpi(tmp_path: Path) -> None:
    n = 4
    work = str(tmp_path)
    log, daemons = _mpi_daemons(work, n)
    try:
        wait_staged(work, n, daemons, log=log)
        nodes = status_json(work, 0)["nodes"]
        assert isinstance(nodes, list) and len(nodes) == n and all(nodes)
        assert all(s["transport"] == "mpi" for s in nodes)
        forwarded = sum(s["staging"]["forwarded_bytes"] for s in nodes)
        through_mpi = sum(p["bytes"] for s in nodes for p in s["mpi"]["peers"].values())
        served = sum(s["mpi"]["server"]["bytes_served"] for s in nodes)
        # each replica copied from its primary through MPI, the bytes the copies counted
        assert forwarded > 0 and through_mpi == forwarded == served
        assert all(s["staging"]["checksum_failures"] == 0 for s in nodes)
        # training processes send their reads to their node's daemon (the fabric), which
        # reads the ranges other nodes hold through MPI too; every byte right
        assert MPIEXEC is not None
        readers = start([MPIEXEC, "-n", str(n), sys.executable, READER, work, "1"],
                        os.path.join(work, "readers.log"))
        assert readers.wait(240) == 0, tail(os.path.join(work, "readers.log"))
        res = results(work, n)
        for r in res:
            assert r["bad"] == 0 and r["origin_bytes"] == 0
        after = status_json(work, 0)["nodes"]
        assert isinstance(after, list)
        relayed = sum(s["fabric"]["relay"]["parts"] for s in after)
        assert relayed > 0 and sum(s["fabric"]["relay"]["missing"] for s in after) == 0
        mpi_after = sum(p["bytes"] for s in after for p in s["mpi"]["peers"].values())
        served_after = sum(s["mpi"]["server"]["bytes_served"] for s in after)
        # the relayed bytes came through MPI: every one a peer served, none over TCP
        assert mpi_after - through_mpi >= sum(r["peer_bytes"] for r in res) > 0
        assert served_after - served == mpi_after - through_mpi
        assert sum(s["fabric"]["relay"]["upstream_failures"] for s in after) == 0
    finally:
        code = stop(daemons)
    assert code == 0, tail(log)


def test_a_hung_rank_under_relayed_mpi_reads_costs_no_byte(tmp_path: Path) -> None:
    """``--transport mpi``, 4 daemons, 2 copies of each shard; one daemon stopped
    (SIGSTOP) while readers on the 3 other nodes read through their daemons, which read
    other nodes' ranges through MPI: the parts sent to the stopped rank are hedged to the
    other replica or given up on before the batch's deadline, and every byte is right."""
    import signal

    n = 4
    work = str(tmp_path)
    log, daemons = _mpi_daemons(work, n)
    hung: int | None = None
    try:
        wait_staged(work, n, daemons, log=log)
        nodes = status_json(work, 0)["nodes"]
        assert isinstance(nodes, list)
        hung = int(nodes[3]["pid"])
        os.kill(hung, signal.SIGSTOP)
        readers = start([MPIEXEC, "-n", "3", sys.executable, READER, work, "1"],
                        os.path.join(work, "readers.log"))
        assert readers.wait(300) == 0, tail(os.path.join(work, "readers.log"))
        res = results(work, 3)
        assert len(res) == 3 and all(r["bad"] == 0 for r in res), res
        after = status_json(work, 0)["nodes"]
        assert isinstance(after, list)
        live = [s for s in after[:3] if s]
        assert len(live) == 3
        # the stopped rank was met (hedged away from, or given up on), and the relay went on
        assert sum(s["fabric"]["hedged"] + s["fabric"]["gave_up"] for s in live) > 0
        assert sum(s["fabric"]["relay"]["parts"] for s in live) > 0
        assert sum(p["bytes"] for s in live for k, p in s["mpi"]["peers"].items()
                   if str(k) != "3") > 0
        # through MPI: the parts sent to the stopped rank fail there by their batch's
        # deadline (4 s; a read of the transport's own waits 30 s)
        deadline = time.monotonic() + 60  # (each status waits for the stopped node)
        while True:
            now = status_json(work, 0)["nodes"]
            assert isinstance(now, list)
            to_hung = [s["mpi"]["peers"].get("3") for s in now[:3] if s]
            if sum(p["failures"] for p in to_hung if p) > 0:
                break
            assert time.monotonic() < deadline, to_hung
            time.sleep(0.5)
        os.kill(hung, signal.SIGCONT)
        hung = None
    finally:
        if hung is not None:
            os.kill(hung, signal.SIGCONT)
        code = stop(daemons)
    assert code == 0, tail(log)


def test_refused_without_thread_multiple(tmp_path: Path) -> None:
    """MPI initialised with less than MPI_THREAD_MULTIPLE (by the program, before stagefs
    asked): the transport refuses, naming the level it got and what to do."""
    pack, _ = make_pack(str(tmp_path), files=10)
    code = (
        "import mpi4py; mpi4py.rc.thread_level = 'funneled'; from mpi4py import MPI\n"
        "from stagefs.cluster.mpi_transport import MpiTransport\n"
        "from stagefs.errors import ClusterError\n"
        "from stagefs.format import Manifest\n"
        f"m = Manifest({os.path.join(pack, MANIFEST_NAME)!r})\n"
        "try:\n"
        "    MpiTransport(MPI.COMM_WORLD, m, lambda s: None)\n"
        "except ClusterError as exc:\n"
        "    print(exc)\n"
    )
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, env=env)
    assert run.returncode == 0, run.stderr
    assert "needs MPI_THREAD_MULTIPLE" in run.stdout
    assert "gave MPI_THREAD_FUNNELED" in run.stdout


def test_partial_copies_serve_peers_through_mpi(tmp_path: Path) -> None:
    """With ``--transport mpi``, a daemon read its peers' ranges through MPI, whose server
    gave whole copies only: the pieces a peer's tier held of a shard (a tier smaller than
    its share) were NOT_HELD, and the readers read them from the origin every epoch."""
    import random

    import stagefs

    n, work = 2, str(tmp_path)
    pack, content = piece_pack(work)
    log = os.path.join(work, "daemons.log")
    assert MPIEXEC is not None
    daemons = start([MPIEXEC, "-n", str(n), sys.executable, "-m", "stagefs.cli", "serve",
                     pack, "--tier", os.path.join(work, "node{rank}", "disk") + ":2MiB",
                     "--runtime", os.path.join(work, "rt{rank}"), "--bind", "127.0.0.1",
                     "--replicas", "1", "--progress", "0", "--transport", "mpi"], log)
    try:
        wait_staged(work, n, daemons, log=log)
        held = sum(held_in_pieces(work, n, pack).values())
        assert held, "the tiers hold no piece: the test proves nothing"
        total = sum(len(d) for d in content.values())
        paths = sorted(content)
        rnd = random.Random(5)
        for r in range(n):
            with stagefs.connect(os.path.join(work, f"rt{r}")) as fs:
                rnd.shuffle(paths)
                for i in range(0, len(paths), 32):
                    batch = paths[i : i + 32]
                    assert fs.read_many(batch) == [content[p] for p in batch]
                st = fs.status()
            assert st["holders"]["origin"]["bytes"] == total - held, st
        nodes = status_json(work, 0)["nodes"]
        assert isinstance(nodes, list) and all(s["transport"] == "mpi" for s in nodes)
        # a node's own pieces from its server (the fabric), its peer's through MPI
        by_mpi = sum(s["mpi"]["server"]["bytes_served_partial"] for s in nodes)
        by_fabric = sum(s["server"]["bytes_served_partial"] for s in nodes)
        assert by_mpi > 0 and by_mpi + by_fabric == n * held, (by_mpi, by_fabric, held)
    finally:
        code = stop(daemons)
    assert code == 0, tail(log)
