"""How many peers a node daemon can keep its connections with under an open-file limit, the
relay's pipe pool sized to that limit, and what the daemon and doctor say when the limit is
short. Pure arithmetic over the real constants; the daemon under a real limit is in
tests/integration/test_fabric.py."""

from __future__ import annotations

import pytest

from stagefs.cluster.daemon import (
    PEER_DESCRIPTORS,
    descriptor_shortfall,
    descriptors_for,
    peers_within,
    shard_descriptors,
)
from stagefs.doctor import BIG_JOB, check_descriptors
from stagefs.net.pipes import PIPE_BYTES, PipePool, budget, pipe_descriptors, pool_pipes


def test_the_pipe_pool_takes_a_small_share_of_a_small_limit() -> None:
    assert pool_pipes(1 << 20) == budget() // PIPE_BYTES  # a large limit: the pipe budget
    for limit in (256, 1024, 4096):
        fds = PipePool(most=pool_pipes(limit)).max_fds
        assert fds <= limit // 5, (limit, fds)


def test_a_limit_of_1024_leaves_room_for_a_hundred_peers() -> None:
    assert peers_within(1024) >= 100  # (with the pool at its full size: none)


@pytest.mark.parametrize("peers", [1, 3, 128, 1000, BIG_JOB - 1])
def test_descriptors_for_is_the_least_limit_that_holds_the_peers(peers: int) -> None:
    need = descriptors_for(peers)
    assert peers_within(need) >= peers > peers_within(need - 1)


def test_more_descriptors_never_hold_fewer_peers() -> None:
    fits = [peers_within(limit) for limit in range(200, 20_000, 37)]
    assert fits == sorted(fits) and fits[-1] > fits[0]


def test_each_peer_costs_its_connections_both_ways() -> None:
    base = peers_within(1 << 16, 0)
    assert peers_within((1 << 16) + 10 * PEER_DESCRIPTORS, 0) == base + 10


def test_a_short_limit_is_told_with_what_to_raise_it_to() -> None:
    assert descriptor_shortfall(1 << 16, 768, 3) is None
    msg = descriptor_shortfall(1024, 192, 199)
    assert msg is not None
    assert f"({1024})" in msg and f"about {peers_within(1024, 192)} peers" in msg
    assert "this job has 199" in msg and f"to {descriptors_for(199)} or more" in msg
    assert "ulimit -Hn" in msg


def test_a_node_of_many_shards_is_told_what_they_take() -> None:
    """2,600 shards on a node of two under a limit of 4,096: its tier copies alone take
    more (the limit held "about 750 peers", and staging stopped at Too many open files)."""
    shard_fds = shard_descriptors(2600, 1300)
    assert shard_fds > 4096
    assert descriptor_shortfall(1 << 16, 768, 1, shard_fds) is None
    msg = descriptor_shortfall(4096, pipe_descriptors(4096), 1, shard_fds)
    assert msg is not None and "(4096)" in msg and f"about {shard_fds} descriptors" in msg
    need = descriptors_for(1, shard_fds)
    assert f"ulimit -n {need}" in msg and "opened again as they are read" in msg
    assert descriptor_shortfall(need, pipe_descriptors(need), 1, shard_fds) is None
    assert descriptor_shortfall(need - 1, pipe_descriptors(need - 1), 1, shard_fds)
    # one node of a thousand shards: no peer, and still short
    assert descriptor_shortfall(1024, pipe_descriptors(1024), 0, shard_descriptors(1000, 1000))


def test_doctor_warns_below_what_the_largest_job_needs() -> None:
    need = descriptors_for(BIG_JOB - 1)
    [low] = check_descriptors((1024, 4096))
    assert low.status == "warn" and "hard limit 4,096" in low.meaning
    assert f"{need:,} for {BIG_JOB:,} nodes" in low.meaning
    [enough] = check_descriptors((1024, need))
    assert enough.status == "ok" and f"about {BIG_JOB - 1:,} peers" in enough.meaning
