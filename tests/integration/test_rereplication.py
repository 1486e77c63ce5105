"""Re-replication with real daemons (static bootstrap, four nodes, two copies of each shard):
a daemon killed mid-read, its shards copied again from the survivors (status says so, no
byte from the origin), then a second node killed that held the other copy of some shards:
reads stay exact, from the copies made. And a daemon stopped (SIGSTOP) and continued: it
rejoins, serves again, and no reader sees a wrong byte. No timing asserts: bounded polls of
``stagefs status`` that fail with what they waited for."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from cluster_helpers import (
    cluster_maps,
    free_ports,
    make_pack,
    results,
    serve_args,
    start,
    status_json,
    stop,
    tail,
    wait_staged,
    write_expected,
)

from stagefs.cluster.placement import place
from stagefs.format import Manifest

pytestmark = pytest.mark.integration
READER = str(Path(__file__).resolve().parents[1] / "mpi" / "cluster_reader.py")
N = 4


class Cluster:
    def __init__(self, work: str) -> None:
        self.work = work
        self.pack, self.content = make_pack(work, files=160, shard_size="64KiB")
        write_expected(work, self.content)
        with open(os.path.join(work, "hosts"), "w") as f:
            f.write("".join(f"127.0.0.1:{p}\n" for p in free_ports(N)))
        subprocess.run([sys.executable, "-m", "stagefs.cli", "serve", "--new-token",
                        os.path.join(work, "token")], check=True, timeout=60)
        self.daemons = [self._daemon(r) for r in range(N)]
        self.readers: list[subprocess.Popen[bytes]] = []
        m = Manifest(os.path.join(self.pack, "manifest.sfm"))
        self.sizes = [sh.size for sh in m.shards]
        m.close()
        self.placement = place(len(self.sizes), N, 2)

    def _daemon(self, r: int) -> subprocess.Popen[bytes]:
        return start(serve_args(self.work, self.pack, "--hosts",
                                os.path.join(self.work, "hosts"), "--rank", str(r),
                                "--token-file", os.path.join(self.work, "token"),
                                "--replicas", "2", "--dead-after", "1"),
                     os.path.join(self.work, f"daemon{r}.log"))

    def logs(self) -> str:
        return "\n".join(f"-- daemon {r}\n" + tail(os.path.join(self.work, f"daemon{r}.log"))
                         for r in range(N))

    def read(self, ranks: list[int], rounds: int, then: Callable[[], None] | None = None
             ) -> list[dict[str, int]]:
        """Readers on ``ranks`` read every file ``rounds`` times; ``then`` runs once they
        all read. Their results, each checked: no wrong byte, none from the origin."""
        for r in ranks:
            with open(os.path.join(self.work, f"reading{r}"), "w"):
                pass
            os.unlink(os.path.join(self.work, f"reading{r}"))
        self.readers = [start([sys.executable, READER, self.work, str(rounds), str(r)],
                              os.path.join(self.work, f"reader{r}.log")) for r in ranks]
        if then is not None:
            deadline = time.monotonic() + 120
            while not all(os.path.exists(os.path.join(self.work, f"reading{r}"))
                          for r in ranks):
                assert time.monotonic() < deadline, "readers never started reading"
                time.sleep(0.05)
            then()
        for r, p in zip(ranks, self.readers, strict=True):
            assert p.wait(300) == 0, tail(os.path.join(self.work, f"reader{r}.log"))
        out = results(self.work, ranks)
        for res in out:
            assert res["bad"] == 0 and res["checksum_failures"] == 0, res
            assert res["origin_bytes"] == 0, (res, ranks)
        return out

    def wait_rereplicated(self, dead: list[int], via: int) -> list[dict[str, Any]]:
        """Poll the status until every live node sees ``dead`` and has copied what it must;
        the live nodes' re-replication records."""
        deadline = time.monotonic() + 120
        last: Any = None
        while time.monotonic() < deadline:
            st = status_json(self.work, via)
            nodes = st["nodes"]
            assert isinstance(nodes, list)
            live = [s for n, s in enumerate(nodes) if n not in dead]
            last = [s and s["rereplication"] for s in live]
            if all(r is not None and r["dead"] == dead and r["done"] for r in last):
                return last
            time.sleep(0.3)
        raise AssertionError(f"re-replication after the death of {dead} did not finish "
                             f"within 120 s; last status: {last}\n{self.logs()}")


@pytest.fixture()
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    c = Cluster(str(tmp_path))
    try:
        for r, d in enumerate(c.daemons):
            wait_staged(c.work, N, d, log=os.path.join(c.work, f"daemon{r}.log"))
        yield c
    finally:
        for p in c.readers:
            stop(p)
        for d in c.daemons:
            if d.poll() is None:
                d.send_signal(signal.SIGCONT)
            stop(d)


def test_a_dead_nodes_shards_are_copied_again_from_peers(cluster: Cluster) -> None:
    c = cluster
    p = c.placement
    lost1 = p.shards_of(1)
    cluster.read([0, 1, 2, 3], 3, then=lambda: c.daemons[1].send_signal(signal.SIGKILL))
    recs = c.wait_rereplicated([1], 0)
    assert sum(r["shards_to_copy"] for r in recs) == len(lost1)
    assert sum(r["shards_copied"] for r in recs) == len(lost1)
    assert sum(r["from_peers_shards"] for r in recs) == len(lost1)  # every one from a peer
    # the files' bytes came over the network (each copy writes its shard header itself)
    assert 0 < sum(r["from_peers_bytes"] for r in recs) <= sum(c.sizes[s] for s in lost1)
    assert sum(r["from_origin_bytes"] for r in recs) == 0
    assert len([r for r in recs if r["shards_to_copy"]]) > 1  # spread, not one partner
    text = subprocess.run([sys.executable, "-m", "stagefs.cli", "status", "--runtime",
                           os.path.join(c.work, "rt0")], capture_output=True, text=True,
                          timeout=60).stdout
    assert "dead nodes [1]" in text and "re-replication done" in text, text

    # a second node that held the other copy of some of node 1's shards
    second = max((n for n in (0, 2, 3)),
                 key=lambda n: sum(n in p.holders[s] for s in lost1))
    both = [s for s in lost1 if second in p.holders[s]]
    assert both
    c.daemons[second].send_signal(signal.SIGKILL)
    readers = [n for n in range(N) if n not in (1, second)]
    c.read(readers, 2)  # exact, and none from the origin: from the copies made
    recs = c.wait_rereplicated(sorted([1, second]), readers[0])
    assert sum(r["from_origin_bytes"] for r in recs) == 0
    assert sum(r["from_peers_bytes"] for r in recs) > 0


def test_a_stopped_node_rejoins_and_serves_nothing_stale(cluster: Cluster) -> None:
    c = cluster
    c.daemons[3].send_signal(signal.SIGSTOP)
    recs = c.wait_rereplicated([3], 0)
    assert sum(r["from_origin_bytes"] for r in recs) == 0
    c.daemons[3].send_signal(signal.SIGCONT)
    deadline = time.monotonic() + 120
    while True:
        nodes = status_json(c.work, 0)["nodes"]
        assert isinstance(nodes, list)
        if all(s is not None and s["rereplication"]["dead"] == [] for s in nodes):
            break
        assert time.monotonic() < deadline, f"node 3 never rejoined: {nodes}\n{c.logs()}"
        time.sleep(0.3)
    back = nodes[3]["rereplication"]
    # stopped, it saw no one die: it copied nothing, from the origin least of all
    assert back["shards_to_copy"] == 0 and back["from_origin_bytes"] == 0, back
    served = nodes[3]["server"]["bytes_served"]
    c.read([0, 1, 2], 2)
    after = status_json(c.work, 0)["nodes"]
    assert isinstance(after, list)
    assert after[3]["server"]["bytes_served"] > served  # it serves again, and right bytes


def test_a_node_lost_before_the_cluster_staged_is_not_waited_for(tmp_path: Path) -> None:
    """A node killed before it staged: the others stage, find it dead, copy its shards
    again, and the cluster is staged without it (it waited for it forever: no reader could
    connect to daemons started with --wait, `status --wait-staged` never succeeded)."""
    c = Cluster(str(tmp_path))
    try:
        c.daemons[2].send_signal(signal.SIGKILL)
        live = [0, 1, 3]
        deadline = time.monotonic() + 120
        while not all((m or {}).get("staged") for m in
                      [cluster_maps(c.work, N)[r] for r in live]):
            assert time.monotonic() < deadline, f"not staged without node 2\n{c.logs()}"
            time.sleep(0.2)
        recs = c.wait_rereplicated([2], 0)
        assert sum(r["shards_copied"] for r in recs) == len(c.placement.shards_of(2))
        text = subprocess.run([sys.executable, "-m", "stagefs.cli", "status", "--runtime",
                               os.path.join(c.work, "rt0"), "--wait-staged", "30"],
                              capture_output=True, text=True, timeout=60)
        assert text.returncode == 0, text.stdout + text.stderr
        c.read(live, 1)  # exact, none from the origin
    finally:
        for d in c.daemons:
            stop(d)


def test_a_copy_a_reader_finds_bad_is_checked_and_deleted_where_it_is(cluster: Cluster
                                                                        ) -> None:
    """A byte flipped in one node's copy of a shard that node 0 does not hold: a reader on
    node 0 gets the right bytes (the check catches it), and its report has the copy
    checked where it is: deleted there and placed again, so the next reads come from the
    other replica, not the origin (it was served to every reader until the daemon ended,
    each of them reading the origin instead)."""
    import stagefs
    from conftest import flip_byte

    c = cluster
    m = Manifest(os.path.join(c.pack, "manifest.sfm"))
    try:
        shard = next(s for s in range(len(c.sizes)) if 0 not in c.placement.holders[s]
                     and any(int(m.shard[e]) == s for e in m.files()))
        first = c.placement.holders[shard][0]
        ents = [e for e in m.files() if int(m.shard[e]) == shard and m.size[e]]
        victim = os.fsdecode(m.path_of(ents[0]))
        copy = os.path.join(c.work, f"node{first}", "mem", m.pack_id.hex(),
                            m.shards[shard].name)
        ino = os.stat(copy).st_ino
        flip_byte(copy, int(m.offset[ents[0]]) + 5)
    finally:
        m.close()
    with stagefs.connect(os.path.join(c.work, "rt0")) as fs:
        # the bad copy's bytes never come out; reads are spread over the replicas: read
        # until one meets the bad copy
        for _ in range(200):
            assert fs.read(victim) == c.content[victim]
            if fs.stats.checksum_failures:
                break
        assert fs.stats.checksum_failures == 1
        deadline = time.monotonic() + 60
        while os.path.exists(copy) and os.stat(copy).st_ino == ino:
            assert time.monotonic() < deadline, f"the bad copy was not deleted\n{c.logs()}"
            time.sleep(0.1)
        nodes = status_json(c.work, first)["nodes"]
        assert isinstance(nodes, list) and nodes[first]["checks"]["dropped"] == 1
        assert nodes[0]["checks"]["forwarded"] >= 1
        time.sleep(0.2)  # past the server's look at whether a copy it opened was deleted
        before = fs.status()["origin"]["bytes_read"]
        assert fs.read(victim) == c.content[victim]
        assert fs.status()["origin"]["bytes_read"] == before  # from the other replica


def test_a_bad_copy_a_reader_finds_on_its_own_node_is_placed_again(cluster: Cluster
                                                                    ) -> None:
    """A byte flipped in node 0's own copy of a shard: a reader on node 0 reads it from its
    tier, finds it bad, and gets the right bytes from the other replica (through its
    daemon, not the origin); the daemon checks the copy, deletes it and places it again,
    and its status counts the failure. The reader deleted the copy itself, and nothing
    placed it again: the node kept K-1 copies while its status said it held them all."""
    import stagefs
    from conftest import flip_byte

    c = cluster
    m = Manifest(os.path.join(c.pack, "manifest.sfm"))
    try:
        shard = next(s for s in range(len(c.sizes)) if 0 in c.placement.holders[s]
                     and any(int(m.shard[e]) == s and m.size[e] for e in m.files()))
        ents = [e for e in m.files() if int(m.shard[e]) == shard and m.size[e]]
        victim = os.fsdecode(m.path_of(ents[0]))
        copy = os.path.join(c.work, "node0", "mem", m.pack_id.hex(), m.shards[shard].name)
        ino = os.stat(copy).st_ino
        flip_byte(copy, int(m.offset[ents[0]]) + 5)
    finally:
        m.close()
    with stagefs.connect(os.path.join(c.work, "rt0")) as fs:
        assert fs.read(victim) == c.content[victim]
        st = fs.status()
        assert st["checksum_failures"] == 1 and st["origin"]["bytes_read"] == 0, st
        deadline = time.monotonic() + 60
        node: dict[str, Any] = {}
        while True:
            nodes = status_json(c.work, 0)["nodes"]
            assert isinstance(nodes, list)
            node = nodes[0]
            if node["checks"]["placed"] == 1 and os.path.exists(copy) and \
                    node["reads"]["checksum_failures"] == 1:  # (summed once a second)
                break
            assert time.monotonic() < deadline, f"not placed again: {node}\n{c.logs()}"
            time.sleep(0.2)
        assert os.stat(copy).st_ino != ino and node["checks"]["dropped"] == 1
        staging = node["staging"]
        assert staging["shards_held"] == staging["shards_assigned"], staging
        assert fs.read(victim) == c.content[victim]  # from the new copy, checked
        assert fs.status()["local_hits"] > 0 and fs.status()["checksum_failures"] == 1
    text = subprocess.run([sys.executable, "-m", "stagefs.cli", "status", "--runtime",
                           os.path.join(c.work, "rt0")], capture_output=True, text=True,
                          timeout=60).stdout
    row = next(line for line in text.splitlines() if line.split()[:1] == ["0"])
    assert row.split()[-1] == "1", text  # its checksum failures, as --json counts them
