"""Locality-aware shuffling over a cluster that lost a node: three daemons (static
bootstrap, one copy of each shard), one killed, its shards copied again onto the two
survivors. The survivors' training ranks must be dealt the samples of those copies (they
read them from their own tiers), every sample once, and ``local_fraction`` must say what
the reads then served from this node. Counted, never timed: bounded polls of
``stagefs status``."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from cluster_helpers import (
    free_ports,
    make_pack,
    serve_args,
    start,
    status_json,
    stop,
    tail,
    wait_staged,
)

pytest.importorskip("torch", reason="PyTorch is not installed (pip install torch)")

pytestmark = pytest.mark.integration
N = 3
DEAD = 2


def _wait_rereplicated(work: str) -> None:
    deadline = time.monotonic() + 120
    last: Any = None
    while time.monotonic() < deadline:
        nodes = status_json(work, 0)["nodes"]
        assert isinstance(nodes, list)
        last = [s and s["rereplication"] for n, s in enumerate(nodes) if n != DEAD]
        if all(r is not None and r["dead"] == [DEAD] and r["done"] for r in last):
            return
        time.sleep(0.3)
    logs = "\n".join(tail(os.path.join(work, f"daemon{r}.log")) for r in range(N))
    raise AssertionError(f"node {DEAD}'s shards were not copied again within 120 s; "
                         f"last status: {last}\n{logs}")


@pytest.fixture()
def survivors(tmp_path: Path) -> Iterator[str]:
    """Three staged daemons, node DEAD killed and its shards copied again; the work dir."""
    work = str(tmp_path)
    pack, _ = make_pack(work, files=120, shard_size="64KiB")
    with open(os.path.join(work, "hosts"), "w") as f:
        f.write("".join(f"127.0.0.1:{p}\n" for p in free_ports(N)))
    subprocess.run([sys.executable, "-m", "stagefs.cli", "serve", "--new-token",
                    os.path.join(work, "token")], check=True, timeout=60, capture_output=True)
    daemons = [start(serve_args(work, pack, "--hosts", os.path.join(work, "hosts"), "--rank",
                                str(r), "--token-file", os.path.join(work, "token"),
                                "--replicas", "1", "--dead-after", "1"),
                     os.path.join(work, f"daemon{r}.log")) for r in range(N)]
    try:
        for r, d in enumerate(daemons):
            wait_staged(work, N, d, log=os.path.join(work, f"daemon{r}.log"))
        stop(daemons[DEAD], signal.SIGKILL)
        _wait_rereplicated(work)
        yield work
    finally:
        for d in daemons:
            stop(d)


def test_locality_follows_the_copies_made_for_a_dead_node(survivors: str) -> None:
    import stagefs
    from stagefs.cluster.placement import place
    from stagefs.torch import FileDataset, Sampler

    stores = [stagefs.connect(os.path.join(survivors, f"rt{r}"))
              for r in range(N) if r != DEAD]
    try:
        shards = len(stores[0].manifest.shards)
        lost = set(place(shards, N, 1).shards_of(DEAD))
        assert lost
        held = [s.held_shards() for s in stores]
        # the dead node's shards are held again, by the survivors that copied them
        # (held_shards said the placement only: nobody held them)
        assert set().union(*held) == set(range(shards))
        assert all(h & lost for h in held), held
        dss = [FileDataset(s, root="train", target="path") for s in stores]
        samplers = [Sampler(d, seed=1, locality=True, rank=k, world_size=len(stores),
                            held_by=[sorted(h) for h in held]) for k, d in enumerate(dss)]
        counts = Counter(i for sm in samplers for i in sm.order().tolist())
        assert sorted(counts) == list(range(len(dss[0]))), counts
        for k, (s, d, sm) in enumerate(zip(stores, dss, samplers, strict=True)):
            order = sm.order()
            before = s.status()["local_hits"]
            for i in order.tolist():
                d[i]
            # every sample the plan counts as this node's was read here (an empty file is
            # read from no holder)
            mine = np.isin(d.shard_of()[order], sorted(held[k])) & (d.sizes()[order] > 0)
            assert s.status()["local_hits"] - before == int(mine.sum())
            assert sm.local_fraction == pytest.approx(
                float(np.isin(d.shard_of()[order], sorted(held[k])).mean()))
    finally:
        for s in stores:
            s.close()
