"""The scale model (benchmarks/scale_sim.py): pure logic checked against what it must do,
not against timings of this machine."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import pytest

pytest.importorskip("simpy", reason="the scale model needs SimPy (pip install '.[test]')")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import simpy
from scale_sim import Links, Params, Sim, main, simulate

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
    lost = simulate(8, replace(SMALL, kill_at=0.1, hedge_s=2.0, dead_after_s=0.2))
    assert lost.epochs_s[-1] > whole.epochs_s[-1]  # a hedge longer than prefetch hides
    assert lost.hedged_parts > 0
    assert lost.rereplicated_bytes > 0
    assert lost.origin_fallback_bytes == 0  # two replicas: the other one answers
    alone = simulate(8, replace(SMALL, replicas=1, kill_at=0.3))
    assert alone.origin_fallback_bytes > 0  # one copy, not yet copied again: the origin
    assert alone.rereplicated_origin_bytes == 0  # the epoch ends before --dead-after


def test_links_share_fairly_and_a_flow_speeds_up_when_another_ends() -> None:
    env = simpy.Environment()
    links = Links(env, 4, 100.0)  # bytes/s per link and direction
    ends: dict[str, float] = {}

    def flow(name: str, src: int, dst: int, nbytes: float, at: float = 0.0):  # type: ignore[no-untyped-def]
        yield env.timeout(at)
        yield links.send(src, dst, nbytes)
        ends[name] = env.now

    # a and b share node 0's out-link: 50 B/s each; c shares node 1's in-link with a
    env.process(flow("a", 0, 1, 100))
    env.process(flow("b", 0, 2, 50))
    env.process(flow("c", 3, 1, 25))
    env.run(until=0.1)
    assert [links.rate(0, 1), links.rate(0, 2), links.rate(3, 1)] == [50.0, 50.0, 50.0]
    env.run()
    # c: 25 B at 50 B/s -> 0.5 s; b: 50 B at 50 -> 1.0 s; a: 50 B by 1.0 s at 50 (25 by
    # c's end at 0.5, 25 more by b's end at 1.0), then the link alone: 50 B at 100 -> 1.5 s
    assert ends == pytest.approx({"c": 0.5, "b": 1.0, "a": 1.5})
    assert links.out == [{}] * 4 and links.inl == [{}] * 4


def test_a_late_flow_slows_the_running_one_from_its_start_only() -> None:
    env = simpy.Environment()
    links = Links(env, 2, 10.0)
    ends: list[float] = []

    def flow(nbytes: float, at: float):  # type: ignore[no-untyped-def]
        yield env.timeout(at)
        yield links.send(0, 1, nbytes)
        ends.append(env.now)

    env.process(flow(20, 0.0))  # alone for 1 s (10 B), then 5 B/s
    env.process(flow(5, 1.0))  # 5 B at 5 B/s: ends at 2.0; the first's last 5 B at 10
    env.run()
    assert ends == pytest.approx([2.0, 2.5])


@pytest.mark.parametrize("replicas", [1, 2])
def test_a_dead_nodes_shards_go_to_the_next_of_their_ranking_from_a_replica_or_origin(
        replicas: int) -> None:
    p = replace(SMALL, replicas=replicas, kill_at=0.2, dead_after_s=0.1)
    sim = Sim(8, p)
    o = sim.run()
    victim = 7
    lost = [s for s, h in enumerate(sim.placement.holders) if victim in h]
    assert lost
    for s in lost:  # the daemons' rule: the first K live nodes of the ranking hold it
        live = sim.placement.live(s, {victim})
        assert set(live) <= set(sim.holders[s]), (s, live, sim.holders[s])
    copied = len(lost) * p.shard_bytes
    if replicas == 1:  # no surviving copy: the taker reads the origin
        assert (o.rereplicated_bytes, o.rereplicated_origin_bytes) == (0, copied)
    else:
        assert (o.rereplicated_bytes, o.rereplicated_origin_bytes) == (copied, 0)


def test_the_model_is_deterministic() -> None:
    assert simulate(6, SMALL) == simulate(6, SMALL)


def test_reading_the_next_epoch_ahead_hides_the_wait_for_its_first_batches() -> None:
    far = replace(SMALL, latency_s=0.1)  # a round trip of a step: the first batch waits
    steps = SMALL.samples_per_node // SMALL.batch
    behind = simulate(8, replace(far, epoch_ahead=False))
    ahead = simulate(8, far)
    assert behind.epochs_s[1] > steps * SMALL.compute_s + 2 * far.latency_s
    assert ahead.epochs_s[1] == pytest.approx(steps * SMALL.compute_s, rel=0.02)
    # the first epoch has nothing before it to read ahead during
    assert ahead.epochs_s[0] == pytest.approx(behind.epochs_s[0])


def test_the_daemons_background_work_takes_the_emulation_hosts_cores() -> None:
    host = replace(SMALL, host_cores=1)
    quiet = simulate(8, host)
    busy = simulate(8, replace(host, daemon_bg_s=0.3))  # 8 daemons: 2.4 cores of 1
    assert busy.epochs_s[-1] > 1.5 * quiet.epochs_s[-1]
    # on their own cores (a real cluster) the same work costs no reader anything
    own = replace(SMALL, daemon_bg_s=0.3)
    assert simulate(8, own).epochs_s == simulate(8, SMALL).epochs_s


def test_each_reader_finds_the_lost_node_dead_by_a_request_of_its_own() -> None:
    # a short hedge: nodes that had not asked the lost node by then still do, and pay once
    sim = Sim(16, replace(SMALL, kill_at=0.2, hedge_s=0.01, dead_after_s=100.0))
    o = sim.run()
    assert sim.dead == 15 and sim.dead not in sim.knows
    assert len(sim.knows) >= 2  # several readers, each by its own failed request
    assert o.hedged_parts >= len(sim.knows)
    assert o.origin_fallback_bytes == 0  # the other replica answered each


@pytest.mark.parametrize("content, words", [
    (None, "No such file or directory"),
    ("{}", "no 'settings' and 'runs' in it"),
    ("not json", "not JSON"),
    ('{"settings": {}, "runs": []}', "its settings lack 'samples_per_node'"),
])
def test_a_calibration_that_is_not_an_emulated_run_is_named(
        tmp_path: Path, content: str | None, words: str) -> None:
    """A missing or foreign --calibration file: the flag, the file and what to give, not a
    traceback from open, json or a KeyError."""
    path = tmp_path / "emulated.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(SystemExit) as exc:
        main(["--calibration", str(path), "--nodes", "2"])
    msg = str(exc.value)
    assert msg.startswith(f"scale_sim: --calibration {path}: {words}"), msg
    assert "benchmarks/emucluster.py --out DIR" in msg
