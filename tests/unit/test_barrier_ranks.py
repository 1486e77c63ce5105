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
