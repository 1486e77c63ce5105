"""Placement: balanced, replicas distinct, deterministic, replicate-all honoured."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stagefs.cluster.placement import place, shards_matching
from stagefs.errors import ConfigError

cases = st.tuples(
    st.integers(0, 300),  # shards
    st.integers(1, 40),  # nodes
    st.integers(1, 6),  # replicas
    st.integers(0, 2**32),  # seed
).flatmap(lambda t: st.tuples(st.just(t), st.sets(st.integers(0, max(0, t[0] - 1)), max_size=10)))


@settings(max_examples=300, deadline=None)
@given(cases)
def test_balanced_distinct_deterministic(case: tuple[tuple[int, int, int, int], set[int]]) -> None:
    (shards, nodes, k, seed), every = case
    every = {s for s in every if s < shards}
    p = place(shards, nodes, k, everywhere=every, seed=seed)
    assert len(p.holders) == shards
    kk = min(k, nodes)
    for s, h in enumerate(p.holders):
        assert len(set(h)) == len(h), "a node holds two copies"
        assert all(0 <= n < nodes for n in h)
        assert len(h) == (nodes if s in every else kk)
    counts = p.counts()
    assert max(counts) - min(counts) <= 1
    assert sum(counts) == (shards - len(every)) * kk + len(every) * nodes
    # the same inputs give the same answer (computed again, as another node would)
    assert place(shards, nodes, k, everywhere=sorted(every), seed=seed) == p
    # primaries are balanced too: origin reads spread over nodes
    prim = [0] * nodes
    for h in p.holders:
        if h:
            prim[h[0]] += 1
    assert sum(prim) == shards


@given(st.integers(1, 200), st.integers(1, 30))
def test_primaries_spread(shards: int, nodes: int) -> None:
    p = place(shards, nodes, 2)
    prim = [0] * nodes
    for h in p.holders:
        prim[h[0]] += 1
    assert max(prim) - min(prim) <= 1


def test_seed_changes_layout_and_shards_of() -> None:
    a, b = place(64, 4, 1, seed=1), place(64, 4, 1, seed=2)
    assert a != b
    assert sorted(s for n in range(4) for s in a.shards_of(n)) == list(range(64))
    assert all(len(a.shards_of(n)) == 16 for n in range(4))


def test_bad_arguments() -> None:
    with pytest.raises(ConfigError, match="at least one node"):
        place(3, 0)
    with pytest.raises(ConfigError, match="replicas"):
        place(3, 2, 0)


def test_shards_matching() -> None:
    files = [("train/a/1.jpg", 0), ("train/b/2.jpg", 1), ("val/x/3.jpg", 2), ("val/4.jpg", 3),
             ("meta/labels.json", 1), ("train/c/5.jpg", 4)]
    assert shards_matching(files, ["val"]) == {2, 3}
    assert shards_matching(files, ["val/"]) == {2, 3}
    assert shards_matching(files, ["*.json"]) == {1}
    assert shards_matching(files, ["train/a/*"]) == {0}
    assert shards_matching(files, []) == set()
    assert shards_matching(files, ["nothing"]) == set()
