"""Cluster mode with tiers smaller than each node's share: the pieces a node's staging put in
its partial copies serve its readers and its peers' (through its daemon's server).

They served nobody: the server and the readers read whole copies only, so a node whose tier
was smaller than one shard held pieces it had read from the origin, and every reader of
every node read the whole dataset from the origin, every epoch (4 nodes, 16 MiB shards,
tiers at 25% of each node's share: 105 MB a node an epoch, against D - C = 79 MB), and
`stagefs status` gave such a node's share as 0 B (0%)."""

from __future__ import annotations

import contextlib
import os
import random
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from cluster_helpers import (
    free_ports,
    held_in_pieces,
    hosts_daemons,
    piece_pack,
    start,
    status_json,
    stop,
    tail,
    wait_staged,
)

import stagefs
from stagefs.cluster.placement import place
from stagefs.format import Manifest

pytestmark = pytest.mark.integration


def test_partial_copies_serve_the_node_and_its_peers(tmp_path: Path) -> None:
    n, work = 2, str(tmp_path)
    rnd = random.Random(3)
    pack, content = piece_pack(work)
    # a tier smaller than one shard: it holds a few pieces of its share, no whole shard
    with _small_tiers(work, pack, n):
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


def test_a_reader_past_its_daemon_reads_its_node_s_pieces(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A reader that reads the peers directly (``STAGEFS_FABRIC=0``; the same while its
    daemon does not answer) reads the pieces its own node's partial copies hold from them:
    it read them from the origin, every epoch (only its daemon read them, and served them
    through the fabric)."""
    n, work = 2, str(tmp_path)
    rnd = random.Random(5)
    pack, content = piece_pack(work)
    with _small_tiers(work, pack, n):
        held = held_in_pieces(work, n, pack)
        mine = [held_in_pieces(work, n, pack, node=r) for r in range(n)]
        assert all(mine), "a node holds no piece: the test proves nothing"
        total = sum(len(d) for d in content.values())
        paths = sorted(content)
        monkeypatch.setenv("STAGEFS_FABRIC", "0")
        for r in range(n):
            with stagefs.connect(os.path.join(work, f"rt{r}")) as fs:
                assert fs._policy.fabric is None  # type: ignore[union-attr]
                for _ in range(2):
                    rnd.shuffle(paths)
                    for i in range(0, len(paths), 32):
                        batch = paths[i : i + 32]
                        assert fs.read_many(batch) == [content[p] for p in batch]
                for p in paths[:40]:  # and file by file
                    assert fs.read(p) == content[p]
                st = fs.status()["holders"]
            ones = sum(len(content[p]) for p in paths[:40])
            read_held = 2 * sum(held.values()) + sum(held[p] for p in paths[:40] if p in held)
            from_here = 2 * sum(mine[r].values()) + sum(
                mine[r][p] for p in paths[:40] if p in mine[r])
            # only what no node holds came from the origin; this node's pieces from its
            # own tier, the other's through its daemon
            assert st["origin"]["bytes"] == 2 * total + ones - read_held, st
            assert st["disk"]["bytes"] == from_here, st
            assert st["peer"]["bytes"] == read_held - from_here, st


def test_a_batch_imports_nothing_a_forked_worker_could_wait_on(tmp_path: Path) -> None:
    """A cluster batch imported ``numpy.ma`` at its first call in a process (np.setdiff1d),
    and a DataLoader worker forked while another thread (the Sampler's prefetch) made that
    import waited on the import's lock for ever: four children of a process whose thread
    read batches, all four hung. The first batches of a fresh process import nothing."""
    n, work = 2, str(tmp_path)
    pack, content = piece_pack(work)
    with _small_tiers(work, pack, n):
        code = (
            "import sys, stagefs\n"
            f"paths = {sorted(content)[:64]!r}\n"
            f"with stagefs.connect({os.path.join(work, 'rt0')!r}) as fs:\n"
            "    before = set(sys.modules)\n"
            "    for i in range(0, 64, 16):\n"
            "        fs.read_many(paths[i : i + 16])\n"
            "    print(sorted(m for m in set(sys.modules) - before if m.startswith('numpy')))\n")
        got = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             timeout=120)
        assert got.returncode == 0, got.stderr
        assert got.stdout.strip() == "[]", got.stdout


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


def test_a_spare_that_holds_a_whole_shard_of_another_says_so(tmp_path: Path) -> None:
    """A shard whose holder had room for none of it is placed whole on its spare by the
    overflow: its status said nothing of it (``bytes_for_others`` counted partial copies
    only), and the line on the copies no node had room for said "0 B so far" while every
    read of them came from the spare."""
    n, work = 2, str(tmp_path)
    pack, content = piece_pack(work, 120, (20_000, 110_000), "2MiB", seed=7)
    # node 0's tier holds nothing, node 1's the whole dataset: node 1 is the spare of every
    # shard of node 0
    daemons = _daemons(work, pack, ["0", "1GiB"], "--replicas", "1")
    try:
        for r, d in enumerate(daemons):
            wait_staged(work, n, d, timeout=120, log=os.path.join(work, f"daemon{r}.log"))
        for _ in range(600):
            nodes = status_json(work, 0)["nodes"]
            if all(s["overflow_done"] for s in nodes):
                break
            time.sleep(0.1)
        assert all(s["overflow_done"] for s in nodes), nodes
        m = Manifest(os.path.join(pack, "manifest.sfm"))
        theirs = place(len(m.shards), n).shards_of(0)
        files = sum(int(m.stored[e]) for e in m.files() if int(m.shard[e]) in theirs)
        whole = all(os.path.exists(os.path.join(work, "node1", "disk", m.pack_id.hex(),
                                                m.shards[s].name)) for s in theirs)
        m.close()
        assert theirs and whole, "node 1 holds no whole shard of node 0: the test proves nothing"
        # node 1's whole copies of node 0's shards are its bytes for others
        assert nodes[1]["staging"]["bytes_for_others"] == files
        assert nodes[1]["staging"]["overflow_shards"] == len(theirs)
        with stagefs.connect(os.path.join(work, "rt0")) as fs:
            paths = sorted(content)
            assert fs.read_many(paths) == [content[p] for p in paths]
            assert fs.status()["holders"]["origin"]["bytes"] == 0
    finally:
        codes = [stop(d) for d in daemons]
    assert codes == [0] * n, [tail(os.path.join(work, f"daemon{r}.log")) for r in range(n)]


def test_a_batch_reads_a_large_file_from_the_pieces_held(tmp_path: Path) -> None:
    """``read_many`` of a batch read a file larger than a piece whole through the node's
    daemon, which no holder served whole: from the origin, the pieces this node's partial
    copy holds too (a reader on each node of a cluster read its own node's pieces of such
    files from the origin every epoch; ``read`` and a batch of one read them by pieces)."""
    n, work = 2, str(tmp_path)
    rnd = random.Random(9)
    src = os.path.join(work, "src")
    os.makedirs(src)
    content = {"big.bin": rnd.randbytes(5_000_000), "small.bin": rnd.randbytes(30_000)}
    for name, data in content.items():
        with open(os.path.join(src, name), "wb") as f:
            f.write(data)
    pack = os.path.join(work, "pack")
    stagefs.pack(src, pack, shard_size="2MiB", jobs=1)
    # both nodes hold every shard; node 0 has no room, node 1 room for some pieces of the
    # large file's shard
    daemons = _daemons(work, pack, ["0", "3MiB"], "--replicas", "2")
    try:
        for r, d in enumerate(daemons):
            wait_staged(work, n, d, timeout=120, log=os.path.join(work, f"daemon{r}.log"))
        assert status_json(work, 1)["nodes"][1]["staging"]["bytes_in_pieces"] > 0
        with stagefs.connect(os.path.join(work, "rt1")) as fs:
            def origin_bytes() -> int:
                return int(fs.status()["holders"]["origin"]["bytes"])

            alone = 0  # each read alone: a large file by its pieces
            for name, data in content.items():
                before = origin_bytes()
                assert fs.read(name) == data
                alone += origin_bytes() - before
            assert alone < len(content["big.bin"]), "no piece held: the test proves nothing"
            names = sorted(content)
            before = origin_bytes()
            assert fs.read_many(names) == [content[p] for p in names]
            assert origin_bytes() - before == alone
    finally:
        codes = [stop(d) for d in daemons]
    assert codes == [0] * n, [tail(os.path.join(work, f"daemon{r}.log")) for r in range(n)]


def _daemons(work: str, pack: str, tiers: list[str], *extra: str
             ) -> list[subprocess.Popen[bytes]]:
    """A cluster of ``len(tiers)`` daemons named by a hosts file, rank r's tier of
    ``tiers[r]`` (as ``hosts_daemons``, whose tiers are all of one size)."""
    with open(os.path.join(work, "hosts"), "w") as f:
        f.write("".join(f"127.0.0.1:{p}\n" for p in free_ports(len(tiers))))
    token = os.path.join(work, "token")
    subprocess.run([sys.executable, "-m", "stagefs.cli", "serve", "--new-token", token],
                   check=True, timeout=60)
    return [start([sys.executable, "-m", "stagefs.cli", "serve", pack, "--tier",
                   os.path.join(work, f"node{r}", "disk") + f":{size}", "--runtime",
                   os.path.join(work, f"rt{r}"), "--hosts", os.path.join(work, "hosts"),
                   "--rank", str(r), "--token-file", token, "--progress", "0", *extra],
                  os.path.join(work, f"daemon{r}.log")) for r, size in enumerate(tiers)]


@contextlib.contextmanager
def _small_tiers(work: str, pack: str, n: int) -> Iterator[None]:
    """``n`` daemons on a hosts file, each with a 2 MiB tier (smaller than one shard: a few
    pieces of its share) and ``--replicas 1``, staged; stopped at the end, each to exit 0."""
    daemons = hosts_daemons(work, pack, n, "2MiB", "--replicas", "1", "--progress", "0")
    try:
        for r, d in enumerate(daemons):
            wait_staged(work, n, d, timeout=120, log=os.path.join(work, f"daemon{r}.log"))
        yield
    finally:
        codes = [stop(d) for d in daemons]
    assert codes == [0] * n, [tail(os.path.join(work, f"daemon{r}.log")) for r in range(n)]
