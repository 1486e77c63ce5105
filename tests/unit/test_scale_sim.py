"""The scale model (benchmarks/scale_sim.py): pure logic checked against what it must do,
not against timings of this machine."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import pytest

pytest.importorskip("simpy", reason="the scale model needs SimPy (pip install '.[test]')")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from scale_sim import Params, simulate

SMALL = Params(samples_per_node=32, epochs=2, shard_bytes=512 * 1024)  # 8 samples a shard


def test_one_node_is_compute_bound_and_reads_the_origin_once() -> None:
    o = simulate(1, SMALL)
    steps = SMALL.samples_per_node // SMALL.batch
    assert o.epochs_s[0] == pytest.approx(steps * SMALL.compute_s, rel=0.05)
    assert o.staging_origin_bytes == SMALL.shards(1) * SMALL.shard_bytes
    assert o.origin_fallback_bytes == 0


def test_staging_reads_each_shard_from_the_origin_once_at_any_size() -> None:
    for n in (4, 16):
        o = simulate(n, SMALL)
        assert o.staging_origin_bytes == SMALL.shards(n) * SMALL.shard_bytes


def test_slow_links_make_epochs_io_bound_and_prefetch_hides_latency() -> None:
    fast = simulate(8, SMALL)
    slow = simulate(8, replace(SMALL, link_Bps=SMALL.link_Bps / 50))
    assert slow.epochs_s[-1] > 1.5 * fast.epochs_s[-1]
    # a round trip longer than a step: one batch ahead stalls every step, two do not
    far = replace(SMALL, latency_s=0.15)
    shallow, deep = simulate(8, replace(far, prefetch=1)), simulate(8, replace(far, prefetch=2))
    steps = SMALL.samples_per_node // SMALL.batch
    assert shallow.epochs_s[-1] > steps * (SMALL.compute_s + 0.05)
    assert deep.epochs_s[-1] < 0.8 * shallow.epochs_s[-1]


def test_a_lost_node_costs_time_and_its_shards_are_copied_again() -> None:
    whole = simulate(8, SMALL)
    lost = simulate(8, replace(SMALL, kill_at=0.3, hedge_s=2.0))  # more than prefetch hides
    assert lost.epochs_s[-1] > whole.epochs_s[-1]
    assert lost.rereplicated_bytes > 0
    assert lost.origin_fallback_bytes == 0  # two replicas: the other one answers
    alone = simulate(8, replace(SMALL, replicas=1, kill_at=0.3))
    assert alone.origin_fallback_bytes > 0  # one copy: its readers go to the origin


def test_the_model_is_deterministic() -> None:
    assert simulate(6, SMALL) == simulate(6, SMALL)
