"""Re-replication decisions, pure: when a peer is dead (an injected clock), and which shards
a node copies again from whom."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from stagefs.cluster.placement import place
from stagefs.cluster.rereplicate import Health, plan


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_peer_is_dead_after_failing_for_dead_after_seconds() -> None:
    clock = Clock()
    h = Health([1, 2], dead_after=10.0, clock=clock)
    h.record(1, True)  # seen alive once: no start-up grace for it
    h.record(1, False)
    assert h.dead() == frozenset()
    clock.now += 9.9
    h.record(1, False)
    assert h.dead() == frozenset()  # not long enough yet
    clock.now += 0.1
    assert h.dead() == frozenset({1})
    h.record(1, True)  # one answer: live again
    assert h.dead() == frozenset()


def test_one_failure_after_a_long_pause_is_not_death() -> None:
    """This process stopped (SIGSTOP) for longer than dead_after: the first probe after it
    fails, but one failure is not enough; the next answer clears it."""
    clock = Clock()
    h = Health([1], dead_after=1.0, clock=clock)
    h.record(1, True)
    clock.now += 3600
    h.record(1, False)
    clock.now += 5
    assert h.dead() == frozenset()
    h.record(1, True)
    assert h.dead() == frozenset()


def test_a_peer_that_never_answered_is_given_the_start_up_grace() -> None:
    """The daemons of a big job start over a minute: one not up yet is not dead, until the
    grace (4 x dead_after) has passed since this node started watching."""
    clock = Clock()
    h = Health([1, 2], dead_after=10.0, clock=clock)
    h.record(1, False)
    clock.now += 20
    h.record(1, False)
    assert h.dead() == frozenset()  # never heard from, still within the grace
    clock.now += 20
    h.record(1, False)
    assert h.dead() == frozenset({1})  # 40 s: the grace is over, and it failed for 40 s
    h2 = Health([1], dead_after=10.0, clock=clock, grace=0)
    h2.record(1, False)
    clock.now += 10
    h2.record(1, False)
    assert h2.dead() == frozenset({1})


def test_a_round_probes_a_bounded_number_of_peers() -> None:
    """Probing every peer every round costs each daemon N probes a round: a round asks the
    failing peers and the next few in turn, at most probes_per_round, and over N / that many
    rounds every peer is asked."""
    import threading

    from stagefs.cluster.rereplicate import Rereplicator

    asked: list[int] = []

    def probe(n: int) -> Callable[[], bool]:
        def ask() -> bool:
            asked.append(n)
            return True
        return ask

    nodes = 40
    p = place(100, nodes, 2)
    r = Rereplicator(None, p, 0, None, {}, {n: probe(n) for n in range(1, nodes)},  # type: ignore[arg-type]
                     threading.Event(), dead_after=1.0, probes_per_round=8)
    for _ in range(5):
        before = len(asked)
        r.step()
        assert len(asked) - before <= 8
    assert set(asked) == set(range(1, nodes))  # 39 peers within 5 rounds of 8


def test_the_next_node_of_each_ranking_copies_from_the_survivor() -> None:
    nodes, k = 8, 2
    p = place(500, nodes, k, seed=4)
    dead = 3
    todo = {r: plan(p, r, {dead}) for r in range(nodes)}
    assert todo[dead] == {}
    lost = p.shards_of(dead)
    copied = sorted(s for r in todo for s in todo[r])
    assert copied == lost  # each lost shard copied once, by one node
    for r, shards in todo.items():
        for s, sources in shards.items():
            assert r == p.ranking(s)[k]  # the next node of the ranking
            assert sources == [n for n in p.holders[s] if n != dead]  # from the survivor
    assert len([r for r in todo if todo[r]]) == nodes - 1  # spread over every other node


def test_a_second_death_copies_from_the_first_taker_not_the_origin() -> None:
    nodes, k = 6, 2
    p = place(300, nodes, k, seed=1)
    s = 0
    a, b = p.holders[s]
    r = p.ranking(s)
    # a died, r[2] copied the shard from b; then b dies: r[3] copies it from r[2]
    assert plan(p, r[2], {a})[s] == [b]
    assert plan(p, r[3], {a, b})[s] == [r[2]]
    # both holders died at once: r[2] reads the origin (no replica survives), r[3] waits
    # for r[2], ranked before it (never the other way round: no two takers wait on each
    # other)
    assert plan(p, r[2], {a, b})[s] == []
    assert s not in plan(p, r[4], {a, b})


def test_a_silence_counts_from_when_the_probe_was_sent() -> None:
    """A probe that times out fails its timeout after it was sent: the peer has been silent
    since it was asked, so a death is declared dead_after from then, not one timeout later
    (a cut of twice the timeout ended before anyone was declared dead, and the deaths landed
    at the heal)."""
    clock = Clock()
    h = Health([1], dead_after=5.0, clock=clock)
    h.record(1, True)
    sent = clock.now
    clock.now += 2.5  # the probe's timeout
    h.record(1, False, at=sent)
    clock.now += 0.5
    sent = clock.now
    clock.now += 2.0  # the second probe fails: 5 s after the first was sent
    h.record(1, False, at=sent)
    assert h.dead() == frozenset({1})


def _judging(answers: dict[int, bool]) -> tuple[Any, Clock, list[frozenset[int]]]:
    """A Rereplicator of node 0 of 4 whose probes answer as ``answers`` says (changed by
    the test), on an injected clock; the dead sets it acts on are listed, not acted on."""
    import threading

    from stagefs.cluster.rereplicate import Rereplicator

    clock = Clock()
    r = Rereplicator(None, place(100, 4, 2), 0, None, {},  # type: ignore[arg-type]
                     {n: (lambda n=n: answers[n]) for n in answers}, threading.Event(),
                     dead_after=2.0, clock=clock, grace=0.0)
    acted: list[frozenset[int]] = []

    def update(dead: frozenset[int]) -> None:  # what the round would act on
        acted.append(dead)
        r.dead = dead

    r.update = update
    return r, clock, acted


def _rounds(r: Any, clock: Clock, n: int, every: float) -> None:
    for _ in range(n):
        r.step()
        clock.now += every


def test_a_partition_s_peers_are_judged_together() -> None:
    """Node 0 of 4 is cut off. Peer 1 stops answering a round before peers 2 and 3 (they
    answered a relayed read just before): the dead set is acted on only once all three
    are dead (reachable 1 of 4: isolated, nothing copied), never as {1} alone, which would
    have this node copy peer 1's shards from the origin."""
    answers = {1: False, 2: True, 3: True}
    r, clock, acted = _judging(answers)
    _rounds(r, clock, 1, 1.0)
    answers[2] = answers[3] = False
    _rounds(r, clock, 6, 1.0)
    assert acted == [frozenset({1, 2, 3})]


def test_a_lone_death_is_acted_on_at_once() -> None:
    r, clock, acted = _judging({1: False, 2: True, 3: True})
    _rounds(r, clock, 4, 1.0)
    assert acted == [frozenset({1})]


def test_a_healed_partition_s_peers_come_back_together() -> None:
    """Node 0, cut off, found peers 1-3 dead (isolated). The partition heals; peer 3
    answers a round before 1 and 2: the dead set {1, 2}, which would have this node copy
    their shards from the origin, is never acted on."""
    answers = {1: False, 2: False, 3: False}
    r, clock, acted = _judging(answers)
    _rounds(r, clock, 10, 0.5)
    assert acted == [frozenset({1, 2, 3})]
    answers[3] = True
    _rounds(r, clock, 1, 0.5)
    answers[1] = answers[2] = True
    _rounds(r, clock, 4, 0.5)
    assert acted == [frozenset({1, 2, 3}), frozenset()]


def test_status_says_when_fewer_nodes_live_than_the_copies_asked() -> None:
    from stagefs.cluster.status import rereplication_lines

    def node(dead: list[int]) -> dict[str, object]:
        return {"rereplication": {
            "dead": dead, "generation": 1, "isolated": False, "done": True,
            "shards_to_copy": 0, "shards_copied": 0, "shards_held_already": 0,
            "from_peers_bytes": 5 * 2**20, "from_origin_bytes": 0, "no_room": 0}}

    # 4 nodes, K = 3: one dead leaves 3 (K copies kept), a second dead leaves 2
    assert not any("copies, not" in line for line in
                   rereplication_lines([node([3]), node([3]), node([3]), None], 3))
    lines = rereplication_lines([node([2, 3]), node([2, 3]), None, None], 3)
    assert lines[0] == "2 of 4 nodes live: each shard has at most 2 copies, not the 3 asked " \
                       "(--replicas)"
    assert "since the job began 5.0 MiB copied from peers" in lines[1]


def test_status_tells_peers_unreachable_now_from_failed_contacts_so_far() -> None:
    """A healthy cluster's daemons failed to reach peers still starting: that count is not
    shown as peers unreachable, the peers skipped now are."""
    from stagefs.cluster.status import _unreachable

    assert _unreachable({"fabric": {"suspect_peers": []}, "peers_unreachable": 6}) == \
        "0 (6 failed contacts)"
    assert _unreachable({"fabric": {"suspect_peers": [2, 3]}, "peers_unreachable": 9}) == \
        "2 (9 failed contacts)"


def test_status_says_when_copies_of_the_dead_nodes_found_no_room() -> None:
    """Takers whose tiers are full copy less than they were to: each said "N without room"
    on its line, and status then read "re-replication done" with no word that the job has
    fewer copies than asked of those shards."""
    from stagefs.cluster.status import rereplication_lines

    def node(no_room: int) -> dict[str, object]:
        return {"rereplication": {
            "dead": [1], "generation": 1, "isolated": False, "done": True,
            "shards_to_copy": 6, "shards_copied": 6 - no_room, "shards_held_already": 0,
            "from_peers_bytes": 0, "from_origin_bytes": 0, "no_room": no_room}}

    lines = rereplication_lines([node(5), None, node(10), node(2)], 2)
    assert lines[-1].startswith("17 shard copies of the dead nodes were not made again"), lines
    assert "fewer than the 2 copies asked" in lines[-1]
    assert not any("not made again" in x for x in rereplication_lines([node(0), None], 2))
