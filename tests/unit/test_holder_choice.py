"""Holder choice in cluster mode: reads of a shard spread over its live holders (the power of
two choices on requests in flight, seeded), never to a suspect peer first, and read_many
sends each range where the holder order says. Three real shard servers on loopback serve
the pack's shard files; this node (rank 0) holds nothing in its tier."""

from __future__ import annotations

import os
import random
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import stagefs
from stagefs.cluster.cmap import ClusterMap
from stagefs.cluster.connect import ClusterHolders
from stagefs.format import Manifest
from stagefs.net import auth
from stagefs.net.hedge import HedgePolicy, ReplyTimes
from stagefs.net.server import ShardServer
from stagefs.store import Store, _first_up
from stagefs.tiers.base import Gathered
from stagefs.tiers.origin import PackOrigin

Cluster = tuple[Store, ClusterHolders, dict[int, ShardServer], dict[str, bytes]]


@pytest.fixture(scope="module")
def pack(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[str, bytes]]:
    root = tmp_path_factory.mktemp("choice")
    rnd = random.Random(1)
    content = {f"d/f{i:03d}.bin": rnd.randbytes(rnd.choice([1000, 9000, 30_000]))
               for i in range(80)}
    for rel, data in content.items():
        os.makedirs(root / "src" / "d", exist_ok=True)
        (root / "src" / rel).write_bytes(data)
    stagefs.pack(str(root / "src"), str(root / "pack"), shard_size="64KiB", jobs=1)
    return str(root / "pack"), content


def _cluster(tmp: Path, pack: str, replicas: int) -> Iterator[Cluster]:
    token = auth.new_token()
    m = Manifest(os.path.join(pack, "manifest.sfm"))
    servers = {n: ShardServer(m, token, lambda s: os.path.join(pack, m.shards[s].name),
                              "127.0.0.1").start() for n in (1, 2, 3)}
    os.makedirs(tmp / "tier", exist_ok=True)
    cmap = ClusterMap(pack=pack, pack_id=m.pack_id.hex(), rank=0,
                      nodes=[("127.0.0.1", 9), *(servers[n].address for n in (1, 2, 3))],
                      replicas=replicas, seed=0, everywhere=[], replicate_all=[],
                      tiers=[(str(tmp / "tier"), None)])
    origin = PackOrigin(pack, m)
    holders = ClusterHolders(str(tmp / "rt"), cmap, token, m, origin, verify=True, timeout=10)
    holders.rng = random.Random(42)
    slow = ReplyTimes(HedgePolicy(floor=30.0, cap=30.0, initial=30.0))
    for h in holders.peers.values():  # no hedging here: each read goes where it was sent
        h.times = h.batch_times = slow
    store = Store(pack, manifest=m, origin=origin, policy=holders)
    try:
        yield store, holders, servers, {}
    finally:
        store.close()
        for s in servers.values():
            s.close()


@pytest.fixture()
def three(tmp_path: Path, pack: tuple[str, dict[str, bytes]]) -> Iterator[Cluster]:
    """K = 3 of 4 nodes: every shard has two or three holders among the peers."""
    for c in _cluster(tmp_path, pack[0], 3):
        yield c[0], c[1], c[2], pack[1]


def _file_of(store: Store, holders: ClusterHolders, content: dict[str, bytes],
             peers: int) -> tuple[str, int]:
    """A file whose shard has ``peers`` holders among the peers."""
    for p in sorted(content):
        shard = int(store.manifest.shard[store.namespace.file_entry(p)])
        if sum(n != 0 for n in holders.placement.holders[shard]) == peers:
            return p, shard
    raise AssertionError(f"no shard with {peers} peer holders")


def test_reads_of_a_hot_shard_spread_over_its_holders(three: Cluster) -> None:
    store, holders, servers, content = three
    path, _ = _file_of(store, holders, content, 3)
    for _ in range(300):
        assert store.read(path) == content[path]
    served = [servers[n].stats.requests for n in (1, 2, 3)]
    assert sum(served) == 300 and store.origin.stats.reads == 0
    assert all(60 <= c <= 140 for c in served), served  # about 100 each, never one holder


def test_the_busy_holder_is_not_chosen_first(three: Cluster) -> None:
    store, holders, servers, content = three
    path, shard = _file_of(store, holders, content, 3)
    busy = holders.placement.holders[shard][0]
    holders.peers[busy].outstanding = 5  # five requests in flight there
    for _ in range(100):
        assert store.read(path) == content[path]
    assert servers[busy].stats.requests == 0
    assert sum(servers[n].stats.requests for n in (1, 2, 3)) == 100


def test_a_suspect_peer_is_never_chosen_first(three: Cluster) -> None:
    store, holders, servers, content = three
    path, shard = _file_of(store, holders, content, 2)
    bad = next(n for n in holders.placement.holders[shard] if n != 0)
    holders.clients[bad].mark_suspect("test")
    for _ in range(50):
        order = holders.holders(shard)
        assert order[0] is not holders.peers[bad]
        assert order[-1] is store.origin
        assert store.read(path) == content[path]
    assert servers[bad].stats.requests == 0
    assert store.origin.stats.reads == 0  # the other holder served every read


def test_read_many_sends_each_range_to_the_first_holder_of_the_order(three: Cluster) -> None:
    store, holders, servers, content = three
    paths = sorted(content)
    # the order read_many follows is the one ClusterHolders gives (store._first_up)
    for shard in range(len(store.manifest.shards)):
        order = holders.holders(shard)
        assert _first_up(order) is order[0]
    got = store.read_many(paths)
    assert got == [content[p] for p in paths]
    served = {n: servers[n].stats.ranges for n in (1, 2, 3)}
    assert store.origin.stats.reads == 0
    assert all(c > 0 for c in served.values()), served  # spread, not all to one peer
    # the same seed gives the same spread
    holders.rng = random.Random(42)
    before = {n: servers[n].stats.ranges for n in (1, 2, 3)}
    assert store.read_many(paths) == got
    holders.rng = random.Random(42)
    after1 = {n: servers[n].stats.ranges - before[n] for n in (1, 2, 3)}
    before = {n: servers[n].stats.ranges for n in (1, 2, 3)}
    assert store.read_many(paths) == got
    assert after1 == {n: servers[n].stats.ranges - before[n] for n in (1, 2, 3)}


def test_the_holder_order_follows_the_ranking_when_a_holder_is_down(
        tmp_path: Path, pack: tuple[str, dict[str, bytes]]) -> None:
    """K = 2: with a holder suspect, the first K live nodes of the ranking come first (the
    survivor, then the node that takes over), then the rest, the suspect one, the origin."""
    for store, holders, _servers, _ in _cluster(tmp_path, pack[0], 2):
        p = holders.placement
        shard = next(s for s, h in enumerate(p.holders) if 0 not in h
                     and 0 not in p.ranking(s)[:3])
        a, b = p.holders[shard]
        holders.clients[a].mark_suspect("test")
        order = holders.holders(shard)
        nxt = p.ranking(shard)[2]
        assert order[:2] == [holders.peers[b], holders.peers[nxt]]
        assert order[-2:] == [holders.peers[a], store.origin]


def test_read_many_reads_this_nodes_tier_in_one_call(three: Cluster) -> None:
    """The shards this node holds in its tier are read with one call to the tier for the
    whole batch (no peer, no origin), the others from the peers, in the order asked."""
    store, holders, servers, content = three
    m = store.manifest
    (tier,) = holders.tiers
    mine = sorted(holders.held_shards())
    assert mine and len(mine) < len(m.shards)
    os.makedirs(os.path.join(tier.root, m.pack_id.hex()), exist_ok=True)
    for s in mine:  # as the node's daemon staged them
        shutil.copyfile(os.path.join(store.pack_dir, m.shards[s].name), tier.path(s))
    paths = sorted(content)
    random.Random(7).shuffle(paths)
    calls: list[int] = []
    real = tier.gather_many

    def gather_many(ranges: list[tuple[int, int, int]], *args: Any) -> Gathered:
        calls.append(len(ranges))
        return real(ranges, *args)

    tier.gather_many = gather_many  # type: ignore[method-assign]
    here = [p for p in paths if int(m.shard[store.namespace.file_entry(p)]) in mine]
    assert store.read_many(paths) == [content[p] for p in paths]
    assert calls == [len(here)]
    assert sum(s.stats.bytes_served for s in servers.values()) == sum(
        len(content[p]) for p in paths if p not in here)
    assert store.origin.stats.reads == 0 and store.stats.reads == len(paths)
