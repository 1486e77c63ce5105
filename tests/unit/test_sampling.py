"""The sampler's plan (stagefs._sampling): exactly-once coverage, padding, locality, resume.

Pure: no torch, no store. Ranks are simulated by computing every rank's order.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stagefs._sampling import (
    Plan,
    Segment,
    first_use,
    local_fraction,
    permutation,
    rank_world,
    split_interleaved,
    split_local,
    window_order,
)

SRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "src")
sizes = st.integers(0, 300)
worlds = st.integers(1, 9)
seeds = st.integers(-(2**40), 2**40)
epochs = st.integers(0, 50)


def check_epoch(orders: list[np.ndarray], n: int, world: int, drop_last: bool,
                pool: np.ndarray | None = None) -> None:
    """Every sample exactly once, with only the documented padding or dropping."""
    pool = np.arange(n) if pool is None else pool
    n = len(pool)
    per = n // world if drop_last else math.ceil(n / world)
    assert [len(o) for o in orders] == [per] * world
    counts = Counter(int(i) for o in orders for i in o)
    assert set(counts) <= {int(i) for i in pool}
    if drop_last:
        assert all(c == 1 for c in counts.values())
        assert len(counts) == per * world
    else:
        assert len(counts) == n  # none missing
        assert sum(c - 1 for c in counts.values()) == per * world - n  # only the padding
        assert per * world - n < world or n == 0 or n < world


@settings(max_examples=300, deadline=None)
@given(n=sizes, world=worlds, seed=seeds, epoch=epochs, drop_last=st.booleans(),
       shuffle=st.booleans())
def test_interleaved_exactly_once(n: int, world: int, seed: int, epoch: int, drop_last: bool,
                                  shuffle: bool) -> None:
    plan = Plan(n, seed, epoch, shuffle, drop_last, [Segment(world)])
    check_epoch(plan.orders(), n, world, drop_last)


def test_interleaved_matches_distributed_sampler_rules() -> None:
    pool = np.arange(10)
    assert [list(o) for o in split_interleaved(pool, 4, False)] == [
        [0, 4, 8], [1, 5, 9], [2, 6, 0], [3, 7, 1]]
    assert [list(o) for o in split_interleaved(pool, 4, True)] == [[0, 4], [1, 5], [2, 6],
                                                                    [3, 7]]


def test_permutation_depends_on_seed_and_epoch_only() -> None:
    a = permutation(1000, 7, 3)
    assert np.array_equal(a, permutation(1000, 7, 3))
    assert not np.array_equal(a, permutation(1000, 7, 4))
    assert not np.array_equal(a, permutation(1000, 8, 3))
    assert sorted(a) == list(range(1000))
    assert list(permutation(5, 7, 3, shuffle=False)) == [0, 1, 2, 3, 4]


@st.composite
def locality_case(draw: st.DrawFn) -> tuple[int, np.ndarray, list[set[int]]]:
    n = draw(st.integers(0, 300))
    shards = draw(st.integers(1, 12))
    world = draw(st.integers(1, 6))
    shard_of = np.sort(np.asarray(draw(st.lists(st.integers(0, shards - 1), min_size=n,
                                                max_size=n)), dtype=np.int64))
    holders = [draw(st.sets(st.integers(0, shards - 1), max_size=shards)) for _ in range(world)]
    return n, shard_of, holders


@settings(max_examples=300, deadline=None)
@given(case=locality_case(), seed=seeds, epoch=epochs, drop_last=st.booleans())
def test_locality_exactly_once(case: tuple[int, np.ndarray, list[set[int]]], seed: int,
                               epoch: int, drop_last: bool) -> None:
    n, shard_of, holders = case
    plan = Plan(n, seed, epoch, True, drop_last,
                [Segment(len(holders), 0, tuple(tuple(sorted(h)) for h in holders))],
                shard_of=shard_of)
    check_epoch(plan.orders(), n, len(holders), drop_last)


def test_locality_fraction_with_disjoint_holdings() -> None:
    """Each of 4 nodes holds a quarter of 40 equal shards: every sample is read locally."""
    shard_of = np.repeat(np.arange(40), 25)
    holders = [set(range(r, 40, 4)) for r in range(4)]
    orders = split_local(permutation(1000, 1, 0), shard_of, holders, False, 1, 0)
    assert local_fraction(orders, shard_of, holders) == [1.0] * 4
    check_epoch(orders, 1000, 4, False)
    # a plain interleaved split reads only about a quarter locally
    plain = split_interleaved(permutation(1000, 1, 0), 4, False)
    assert max(local_fraction(plain, shard_of, holders)) < 0.4


def test_locality_fraction_with_uneven_holdings() -> None:
    """Node 0 holds half the shards, the others a sixth each: the surplus spills."""
    shard_of = np.repeat(np.arange(12), 10)
    holders = [set(range(6)), {6, 7}, {8, 9}, {10, 11}]
    orders = split_local(permutation(120, 2, 0), shard_of, holders, True, 2, 0)
    frac = local_fraction(orders, shard_of, holders)
    assert frac[0] == 1.0
    # ranks 1-3 hold 20 samples each for a quota of 30: two thirds local
    assert frac[1:] == pytest.approx([2 / 3] * 3)
    check_epoch(orders, 120, 4, True)


def test_shard_held_by_several_ranks_is_shared() -> None:
    shard_of = np.repeat(np.arange(4), 50)
    holders = [set(range(4))] * 2  # two ranks on one node
    orders = split_local(permutation(200, 0, 0), shard_of, holders, False, 0, 0)
    assert local_fraction(orders, shard_of, holders) == [1.0, 1.0]
    assert [len(o) for o in orders] == [100, 100]


@settings(max_examples=100, deadline=None)
@given(seed=seeds, window=st.integers(1, 6))
def test_window_order_bound(seed: int, window: int) -> None:
    """The documented bound: consecutive samples come from at most 2 * window shards, and a
    window's samples are contiguous."""
    shard_of = np.repeat(np.arange(20), 7)
    samples = np.arange(140)
    order = window_order(samples, shard_of, np.random.default_rng(seed & 0xFFFF), window)
    assert sorted(order) == list(range(140))
    span = window * 7
    for start in range(0, 140 - span + 1, 7):
        assert len(set(shard_of[order[start : start + span]])) <= 2 * window
    # shards of one window occupy one contiguous run
    seen: list[int] = []
    for s in shard_of[order]:
        if not seen or seen[-1] != s:
            seen.append(int(s))
    assert len(seen) >= 20


def test_window_order_is_random_within_window() -> None:
    shard_of = np.repeat(np.arange(4), 50)
    a = window_order(np.arange(200), shard_of, np.random.default_rng(0), 4)
    b = window_order(np.arange(200), shard_of, np.random.default_rng(1), 4)
    assert not np.array_equal(a, b)
    # one window holds all shards: the first 50 samples mix several shards
    assert len(set(shard_of[a[:50]])) == 4


@settings(max_examples=200, deadline=None)
@given(n=st.integers(1, 300), world=worlds, world2=worlds, world3=worlds, seed=seeds,
       epoch=epochs, drop_last=st.booleans(), data=st.data())
def test_resume_reads_each_remaining_sample_once(n: int, world: int, world2: int, world3: int,
                                                 seed: int, epoch: int, drop_last: bool,
                                                 data: st.DataObject) -> None:
    """Interrupt at a random point, resume with another world size, interrupt again, resume
    with a third: the consumed parts and the rest together are one epoch."""
    plan = Plan(n, seed, epoch, True, drop_last, [Segment(world)])
    per = len(plan.orders()[0])
    k1 = data.draw(st.integers(0, per))
    consumed = [o[:k1] for o in plan.orders()]
    plan2 = Plan(n, seed, epoch, True, drop_last, [Segment(world, k1), Segment(world2)])
    per2 = len(plan2.orders()[0])
    k2 = data.draw(st.integers(0, per2))
    consumed += [o[:k2] for o in plan2.orders()]
    plan3 = Plan(n, seed, epoch, True, drop_last,
                 [Segment(world, k1), Segment(world2, k2), Segment(world3)])
    rest = [plan3.remaining(r) for r in range(world3)]
    seen = Counter(int(i) for part in consumed + rest for i in part)
    if not drop_last:
        assert set(seen) == set(range(n))  # nothing missing
    # no sample read twice except as padding: at most one pad per rank per segment
    assert sum(c - 1 for c in seen.values()) <= world + world2 + world3


@settings(max_examples=100, deadline=None)
@given(n=st.integers(1, 300), world=worlds, seed=seeds, drop_last=st.booleans(),
       data=st.data())
def test_resume_same_world_continues_the_same_sequence(n: int, world: int, seed: int,
                                                       drop_last: bool,
                                                       data: st.DataObject) -> None:
    full = Plan(n, seed, 0, True, drop_last, [Segment(world)]).orders()
    k = data.draw(st.integers(0, len(full[0])))
    resumed = Plan(n, seed, 0, True, drop_last, [Segment(world, k)])
    for r in range(world):
        assert np.array_equal(resumed.remaining(r), full[r][k:])


@settings(max_examples=100, deadline=None)
@given(case=locality_case(), seed=seeds, world2=worlds, drop_last=st.booleans(),
       data=st.data())
def test_locality_resume_with_other_world(case: tuple[int, np.ndarray, list[set[int]]],
                                          seed: int, world2: int, drop_last: bool,
                                          data: st.DataObject) -> None:
    n, shard_of, holders = case
    h1 = tuple(tuple(sorted(h)) for h in holders)
    plan = Plan(n, seed, 0, True, drop_last, [Segment(len(holders), 0, h1)],
                shard_of=shard_of)
    k = data.draw(st.integers(0, len(plan.orders()[0])))
    h2 = tuple(tuple(range(r, 12, world2)) for r in range(world2))
    plan2 = Plan(n, seed, 0, True, drop_last,
                 [Segment(len(holders), k, h1), Segment(world2, 0, h2)], shard_of=shard_of)
    parts = [o[:k] for o in plan.orders()] + [plan2.remaining(r) for r in range(world2)]
    seen = Counter(int(i) for p in parts for i in p)
    if not drop_last:
        assert set(seen) == set(range(n))
    assert sum(c - 1 for c in seen.values()) <= len(holders) + world2


def test_first_use() -> None:
    shard_of = np.array([0, 0, 1, 1, 2, 2])
    assert list(first_use(np.array([5, 0, 4, 1, 2]), shard_of)) == [2, 0, 1]


@pytest.mark.parametrize(("env", "want"), [
    ({}, None),
    ({"RANK": "2", "WORLD_SIZE": "4"}, (2, 4)),
    ({"SLURM_PROCID": "1", "SLURM_NTASKS": "3"}, (1, 3)),
    ({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2"}, (0, 2)),
    ({"RANK": "", "WORLD_SIZE": "4", "SLURM_PROCID": "5", "SLURM_NTASKS": "8"}, (5, 8)),
])
def test_rank_world(env: dict[str, str], want: tuple[int, int] | None) -> None:
    assert rank_world(env) == want


@pytest.mark.parametrize("env", [{"RANK": "4", "WORLD_SIZE": "4"},
                                 {"RANK": "x", "WORLD_SIZE": "4"}])
def test_rank_world_refuses_bad_values(env: dict[str, str]) -> None:
    with pytest.raises(ValueError, match="RANK"):
        rank_world(env)


def test_no_numpy_import_is_left_for_an_orders_first_call() -> None:
    """np.unique and np.isin import numpy.ma at their first call: done with the module, not
    in the thread that makes an epoch's order while the main thread forks workers."""
    code = ("import sys; import stagefs._sampling, stagefs.format.manifest; "
            "before = set(sys.modules); import numpy as np; "
            ""
            "np.unique(np.arange(5)); np.isin(np.arange(5), [1]); "
            "print(sorted(set(sys.modules) - before))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, env=dict(os.environ, PYTHONPATH=SRC))
    assert out.stdout.strip() == "[]"
