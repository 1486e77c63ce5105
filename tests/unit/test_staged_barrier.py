"""The staged barrier's gossip (cluster/bootstrap.py: ``barrier_round``), pure logic: N
simulated nodes in rounds, each node's STATUS what a daemon answers (``staging_done`` and
``staged_nodes``). Every live node ends the barrier once all have staged, dead ones
excepted; no node is asked by every other each round (N nodes polling a laggard directly
made it answer N requests a round); the news of the last node's end spreads in a few
rounds, not N."""

from __future__ import annotations

import math
import random
from collections import Counter
from typing import Any, cast

import pytest

from stagefs.cluster.bootstrap import FAN, StagedNodes, barrier_round
from stagefs.net.client import PeerClient
from stagefs.tiers.base import SourceUnavailable


class _Node:
    def __init__(self, rank: int, size: int) -> None:
        self.rank = rank
        self.known = StagedNodes()
        self.staged = False
        self.dead = False
        self.passed = False
        self.rng = random.Random(rank)


class _Status:
    """A peer as ``barrier_round`` sees it: its ``status()`` answers from the simulation
    and counts the requests it is sent."""

    def __init__(self, node: _Node, asked: Counter[int]) -> None:
        self.node, self.asked = node, asked

    def status(self) -> dict[str, Any]:
        self.asked[self.node.rank] += 1
        if self.node.dead:
            raise SourceUnavailable(f"node {self.node.rank}: unreachable")
        return {"staging_done": self.node.staged, "staged_nodes": self.node.known.text()}


def _simulate(size: int, finish: dict[int, int], dead: frozenset[int] = frozenset(),
              rounds: int = 200) -> tuple[dict[int, int], list[Counter[int]]]:
    """Each node stages at round ``finish.get(rank, 0)`` and then runs the barrier a round
    at a time: the round each live node passed it, and who was asked how often each round."""
    nodes = [_Node(r, size) for r in range(size)]
    for r in dead:
        nodes[r].dead = True
    passed: dict[int, int] = {}
    per_round: list[Counter[int]] = []
    for t in range(rounds):
        asked: Counter[int] = Counter()
        peers = {r: cast(PeerClient, _Status(n, asked)) for r, n in enumerate(nodes)}
        for n in nodes:
            if n.dead or n.passed or t < finish.get(n.rank, 0):
                continue
            if not n.staged:
                n.staged = True
                n.known.add(n.rank)
            status = {r: p for r, p in peers.items() if r != n.rank}
            if barrier_round(status, n.known, size, dead, n.rng):
                n.passed = True
                passed[n.rank] = t
        per_round.append(asked)
        if len(passed) == size - len(dead):
            break
    return passed, per_round


@pytest.mark.parametrize("size", [2, 3, FAN + 1, 64, 1024])
def test_every_node_passes_once_all_have_staged_and_not_before(size: int) -> None:
    laggard, late = size - 1, 5
    passed, per_round = _simulate(size, {laggard: late})
    assert set(passed) == set(range(size))
    assert min(passed.values()) >= late  # none before the laggard staged
    # the news spreads: a few rounds after the laggard, not one a node
    assert max(passed.values()) - late <= 2 + 3 * math.ceil(math.log2(size)), passed
    # and the laggard is not asked by every other node each round while it stages
    if size > 64:
        waiting = per_round[1:late]
        assert max(c[laggard] for c in waiting) <= 4 * FAN, [c[laggard] for c in waiting]


def test_a_dead_node_is_not_waited_for() -> None:
    passed, _ = _simulate(64, {3: 4}, dead=frozenset({10, 11}))
    assert set(passed) == set(range(64)) - {10, 11}


def test_what_a_peer_says_it_knows_is_checked() -> None:
    known = StagedNodes()
    known.merge("zz", 8)  # not hexadecimal
    known.merge(None, 8)
    known.merge(7, 8)  # not text
    known.merge("f" * 100, 8)  # longer than a mask of 8 nodes
    assert known.nodes() == frozenset()
    known.merge("1ff", 8)  # node 8 does not exist
    assert known.nodes() == frozenset(range(8))
    assert known.text() == "ff"
