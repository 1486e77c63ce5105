"""Cluster mode with tiers smaller than each node's share: the pieces a node's staging put in
its partial copies serve its readers and its peers' (through its daemon's server).

They served nobody: the server and the readers read whole copies only, so a node whose tier
was smaller than one shard held pieces it had read from the origin, and every reader of
every node read the whole dataset from the origin, every epoch (4 nodes, 16 MiB shards,
tiers at 25% of each node's share: 105 MB a node an epoch, against D - C = 79 MB), and
`stagefs status` gave such a node's share as 0 B (0%)."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cluster_helpers import (
    held_in_pieces,
    hosts_daemons,
    piece_pack,
    status_json,
    stop,
    tail,
    wait_staged,
)

import stagefs
from stagefs.format import Manifest

pytestmark = pytest.mark.integration


def test_partial_copies_serve_the_node_and_its_peers(tmp_path: Path) -> None:
    n, work = 2, str(tmp_path)
    rnd = random.Random(3)
    pack, content = piece_pack(work)
    # a tier smaller than one shard: it holds a few pieces of its share, no whole shard
    daemons = hosts_daemons(work, pack, n, "2MiB", "--replicas", "1", "--progress", "0")
    try:
        for r, d in enumerate(daemons):
            wait_staged(work, n, d, timeout=120, log=os.path.join(work, f"daemon{r}.log"))
        held = held_in_pieces(work, n, pack)
        assert held, "the tiers hold no piece: the test proves nothing"
        total = sum(len(d) for d in content.values())
        paths = sorted(content)
        for r in range(n):
            with stagefs.connect(os.path.join(work, f"rt{r}")) as fs:
                for _ in range(2):  # two epochs, shuffled, in batches
                    rnd.shuffle(paths)
                    for i in range(0, len(paths), 32):
                        batch = paths[i : i + 32]
                        assert fs.read_many(batch) == [content[p] for p in batch]
                st = fs.status()
            # every file a partial copy holds came from it (through this node's daemon,
            # from its own tier or its peer's); only the rest from the origin
            assert st["holders"]["origin"]["bytes"] == 2 * (total - sum(held.values())), st
            assert st["holders"]["peer"]["bytes"] == 2 * sum(held.values()), st
        nodes = status_json(work, 0)["nodes"]
        assert sum(s["server"]["bytes_served_partial"] for s in nodes) == \
            2 * n * sum(held.values())
        # the node's share says what its pieces hold (it said 0 B, 0%)
        assert sum(s["staging"]["bytes_in_pieces"] for s in nodes) == sum(held.values())
        text = subprocess.run([sys.executable, "-m", "stagefs.cli", "status", "--runtime",
                               os.path.join(work, "rt0")], capture_output=True, text=True,
                              timeout=60).stdout
        assert "in pieces" in text, text
    finally:
        codes = [stop(d) for d in daemons]
    assert codes == [0, 0], [tail(os.path.join(work, f"daemon{r}.log")) for r in range(n)]


def test_a_file_larger_than_a_piece_is_read_from_the_pieces_held(tmp_path: Path) -> None:
    """A whole file of several pieces, a partial copy holding some of them: ``read`` and
    ``read_many`` (and the helper of ``stagefs run --connect``, which reads with
    ``read_entry``) read from the origin only the pieces no copy holds, as a file object's
    reads by pieces (and the FUSE mount) do. They asked the daemon for the whole file, which
    it serves only where it holds all of it, and read the whole file from the origin every
    epoch."""
    work = str(tmp_path)
    rnd = random.Random(5)
    src = os.path.join(work, "src")
    os.makedirs(src)
    # a partial copy holds some pieces of a file only when the file is too large to be
    # held whole or not at all (over 64 MiB: tiers/stream.py FILE_LIMIT)
    content = {"big.bin": rnd.randbytes(66 * 2**20 + 1), "small.bin": rnd.randbytes(30_000)}
    for name, data in content.items():
        with open(os.path.join(src, name), "wb") as f:
            f.write(data)
    pack = os.path.join(work, "pack")
    stagefs.pack(src, pack, shard_size="16MiB", jobs=1)
    # a tier smaller than the share: it holds some of the files' pieces, in partial copies
    daemons = hosts_daemons(work, pack, 1, "24MiB", "--replicas", "1", "--progress", "0")
    try:
        wait_staged(work, 1, daemons[0], timeout=120, log=os.path.join(work, "daemon0.log"))
        with stagefs.connect(os.path.join(work, "rt0")) as fs:
            def origin_bytes() -> int:
                return int(fs.status()["holders"]["origin"]["bytes"])

            before = origin_bytes()
            for name, data in content.items():  # by pieces: the path that used the pieces
                with fs.open(name, "rb") as f:
                    assert b"".join(iter(lambda: f.read(2**20), b"")) == data
            by_pieces = origin_bytes() - before
            total = sum(len(d) for d in content.values())
            assert 0 < by_pieces < total, "the tier holds no piece: the test proves nothing"
            for read in (lambda n: fs.read(n), lambda n: fs.read_many([n])[0]):
                before = origin_bytes()
                for name, data in content.items():
                    assert read(name) == data
                assert origin_bytes() - before == by_pieces
            before = origin_bytes()
            names = sorted(content)
            assert fs.read_many(names) == [content[n] for n in names]
            assert origin_bytes() - before == by_pieces
    finally:
        codes = [stop(d) for d in daemons]
    assert codes == [0], tail(os.path.join(work, "daemon0.log"))


def test_nodes_with_room_hold_the_pieces_full_holders_could_not(tmp_path: Path) -> None:
    """Placement deals whole shards, so with tiers of about a quarter of the dataset on each
    of 4 nodes, a node dealt more than its tier holds left pieces unheld while the others
    kept room unused: 8.3% of this dataset read from the origin every epoch, tiers of 1.11x
    the dataset in all. Now each shard's spares (the nodes readers ask after its holders)
    hold, in turn, the pieces its holders could not."""
    n, work = 4, str(tmp_path)
    pack, content = piece_pack(work, 600, (20_000, 110_000), "4MiB", seed=5)
    total = sum(len(d) for d in content.values())
    tier = total // n + 2**20
    daemons = hosts_daemons(work, pack, n, str(tier), "--replicas", "1", "--progress", "0")
    try:
        for r, d in enumerate(daemons):
            wait_staged(work, n, d, timeout=120, log=os.path.join(work, f"daemon{r}.log"))
        for _ in range(600):  # the overflow runs after staging
            nodes = status_json(work, 0)["nodes"]
            if all(s["overflow_done"] for s in nodes):
                break
            time.sleep(0.1)
        assert all(s["overflow_done"] for s in nodes), nodes
        others = sum(s["staging"]["bytes_for_others"] for s in nodes)
        assert others > 0, "no node held another's pieces: the test proves nothing"
        # each piece is held once: no node's tiers over their capacity, and what the nodes
        # hold is whole copies, their own pieces and the others' pieces, apart
        held = held_in_pieces(work, n, pack)
        pieces = sum(s["staging"]["bytes_in_pieces"] for s in nodes)
        assert sum(held.values()) == pieces + others
        m = Manifest(os.path.join(pack, "manifest.sfm"))
        whole = {m.shards[s].name for s in range(len(m.shards)) for r in range(n)
                 if os.path.exists(os.path.join(work, f"node{r}", "disk", m.pack_id.hex(),
                                                m.shards[s].name))}
        held.update((m.path_of(e).decode(), int(m.stored[e])) for e in m.files()
                    if m.shards[int(m.shard[e])].name in whole)
        m.close()
        paths = sorted(content)
        with stagefs.connect(os.path.join(work, "rt0")) as fs:
            random.Random(5).shuffle(paths)
            for i in range(0, len(paths), 32):
                batch = paths[i : i + 32]
                assert fs.read_many(batch) == [content[p] for p in batch]
            origin = fs.status()["holders"]["origin"]["bytes"]
        # what no node holds comes from the origin, and only that (the manifest's sizes
        # are the stored ones: these files are not compressible)
        assert origin == total - sum(held.values())
        assert origin < 0.05 * total, (origin, total)
    finally:
        codes = [stop(d) for d in daemons]
    assert codes == [0] * n, [tail(os.path.join(work, f"daemon{r}.log")) for r in range(n)]
