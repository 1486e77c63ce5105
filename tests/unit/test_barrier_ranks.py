"""The staged barrier asks each peer whether it has staged: a daemon that answers at peer
n's address as another rank (the nodes' hosts files differ, or list the nodes in another
order) was counted as node n staged, and the node passed its barrier with placement
computed from the wrong ranks. Now it is not counted, and the node says why."""

from __future__ import annotations

import logging
import random
from typing import Any, cast

import pytest

from stagefs.cluster.bootstrap import StagedNodes, barrier_round
from stagefs.net.client import PeerClient


class _Peer:
    def __init__(self, rank: int, staged: str = "") -> None:
        self.rank, self.staged = rank, staged

    def status(self) -> dict[str, Any]:
        return {"rank": self.rank, "staging_done": True, "staged_nodes": self.staged}


def test_a_peer_answering_as_another_rank_is_not_counted_staged(
        caplog: pytest.LogCaptureFixture) -> None:
    # node 2's hosts file lists nodes 0 and 1 the other way round
    peers = {0: cast(PeerClient, _Peer(1)), 1: cast(PeerClient, _Peer(0)),
             3: cast(PeerClient, _Peer(3, staged="f"))}  # node 3 knows 0..3 staged
    known = StagedNodes()
    known.add(2)
    with caplog.at_level(logging.WARNING, "stagefs.bootstrap"):
        for _ in range(3):
            assert not barrier_round(peers, known, 4, frozenset(), random.Random(2))
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 2, said  # once a peer
    assert "node 0's address says it is rank 1" in said[0] + said[1]
    assert "same hosts file" in said[0]
    # the nodes agree again (the daemons restarted with one hosts file): it passes
    peers[0], peers[1] = cast(PeerClient, _Peer(0)), cast(PeerClient, _Peer(1))
    assert barrier_round(peers, known, 4, frozenset(), random.Random(2))
    # a peer found dead is not waited for, whoever answered at its address before
    known2 = StagedNodes()
    known2.add(2)
    wrong = {0: cast(PeerClient, _Peer(1)), 1: cast(PeerClient, _Peer(1))}
    assert not barrier_round(wrong, known2, 3, frozenset(), random.Random(0))
    assert barrier_round(wrong, known2, 3, frozenset({0}), random.Random(0))


def test_a_peer_address_that_reaches_this_daemon_is_named_as_a_hosts_file_listing_it_twice(
        caplog: pytest.LogCaptureFixture) -> None:
    # node1 and 10.0.0.1 on two lines: node 0's peer 1 is node 0's own daemon
    peers = {1: cast(PeerClient, _Peer(0))}
    known = StagedNodes(0)
    known.add(0)
    with caplog.at_level(logging.WARNING, "stagefs.bootstrap"):
        assert not barrier_round(peers, known, 2, frozenset(), random.Random(0))
    said = " ".join(r.getMessage() for r in caplog.records)
    assert "node 1's address reaches this daemon (rank 0)" in said
    assert "names one daemon twice" in said


class _Placed(_Peer):
    def __init__(self, rank: int, placement: dict[str, Any]) -> None:
        super().__init__(rank)
        self.placement = placement

    def status(self) -> dict[str, Any]:
        return {**super().status(), "placement": self.placement}


def test_a_peer_that_places_the_shards_apart_is_not_counted_staged(
        caplog: pytest.LogCaptureFixture) -> None:
    # node 2 restarted with --replicas 1 in a job of --replicas 2: each node looked for
    # shards where the other did not put them, and all of them said staged
    from stagefs.cluster.placement import place
    from stagefs.cluster.status import placed_apart

    two = {**place(40, 3, 2).settings(), "replicate_all": []}
    one = {**place(40, 3, 1).settings(), "replicate_all": []}
    seeded = {**place(40, 3, 2, seed=7).settings(), "replicate_all": []}
    assert len({two["key"], one["key"], seeded["key"]}) == 3
    assert place(40, 3, 2).settings() == place(40, 3, 2).settings()
    peers = {1: cast(PeerClient, _Placed(1, two)), 2: cast(PeerClient, _Placed(2, one))}
    known = StagedNodes(0, two)
    known.add(0)
    with caplog.at_level(logging.WARNING, "stagefs.bootstrap"):
        for _ in range(3):
            assert not barrier_round(peers, known, 3, frozenset(), random.Random(0))
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1, said  # once
    assert "node 2 places the shards with --replicas 1" in said[0]
    assert "this node with --replicas 2" in said[0] and "same --replicas" in said[0]
    assert 2 not in known.nodes()
    # what a peer that agrees says of it is not taken either
    peers[1] = cast(PeerClient, _Peer(1, staged="7"))
    assert not barrier_round(peers, known, 3, frozenset(), random.Random(0))
    # `stagefs status` names the odd node and the fix
    lines = placed_apart([{"placement": two}, {"placement": two}, {"placement": one}])
    assert lines[0].startswith("node(s) 0, 1 place the shards with --replicas 2")
    assert lines[1].startswith("node(s) 2 place the shards with --replicas 1")
    assert "same --replicas, --seed and --replicate-all" in lines[2]
    assert placed_apart([{"placement": two}, None, {"placement": two}]) == []
    # restarted with the job's arguments: it agrees, and the barrier passes
    peers[1], peers[2] = cast(PeerClient, _Placed(1, two)), cast(PeerClient, _Placed(2, two))
    assert barrier_round(peers, known, 3, frozenset(), random.Random(0))
    # an older daemon says nothing of its placement: not held against it
    old = StagedNodes(0, two)
    old.add(0)
    assert barrier_round({1: cast(PeerClient, _Peer(1))}, old, 2, frozenset(),
                         random.Random(0))
