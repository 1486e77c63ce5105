"""net/fanout.py: a batch split per holder, all parts in flight at once, one deadline,
per-range fallback. Holders are fakes (pure logic); no assertion on elapsed time."""

from __future__ import annotations

import threading
from collections.abc import Sequence

import pytest

from stagefs.net.fanout import Fanout, send_all
from stagefs.tiers.base import SourceUnavailable

Ranges = Sequence[tuple[int, int, int]]


class Fake:
    """Gives ``b"<name>:<shard>:<offset>"`` for the shards it has, None for the others;
    with ``gate``, waits for it before answering."""

    def __init__(self, name: str, has: set[int], gate: threading.Barrier | threading.Event |
                 None = None, down: bool = False) -> None:
        self.name, self.has, self.gate, self.down = name, has, gate, down
        self.calls: list[list[tuple[int, int, int]]] = []

    def is_down(self) -> bool:
        return self.down

    def pread_many(self, ranges: Ranges) -> list[bytes | None]:
        self.calls.append(list(ranges))
        if isinstance(self.gate, threading.Barrier):
            self.gate.wait(30)  # broken (an error) unless every part is in flight at once
        elif isinstance(self.gate, threading.Event):
            self.gate.wait(30)
        return [f"{self.name}:{s}:{o}".encode() if s in self.has else None
                for s, o, _ in ranges]


def test_a_batch_over_every_holder_has_all_its_parts_in_flight_at_once() -> None:
    n = 12
    gate = threading.Barrier(n)
    peers = [Fake(f"p{i}", {i}, gate) for i in range(n)]
    f = Fanout(threads=64)
    ranges = [(s, o, 1) for s in range(n) for o in (0, 7)]
    got = f.read(ranges, lambda s: [peers[s]], timeout=60)
    assert got == [f"p{s}:{s}:{o}".encode() for s, o, _ in ranges]
    assert all(len(p.calls) == 1 and len(p.calls[0]) == 2 for p in peers)  # one part each
    assert f.stats.peak_parts == n and f.stats.parts == n and f.stats.missing == 0
    f.close()


def test_a_range_one_holder_did_not_give_goes_to_the_next() -> None:
    a = Fake("a", {0})  # holds shard 0 only, though listed first for 1 too
    b = Fake("b", {0, 1})
    c = Fake("c", set(), down=True)  # down: never asked
    f = Fanout()
    got = f.read([(0, 0, 1), (1, 0, 1), (2, 0, 1)],
                 lambda s: [c, a, b] if s < 2 else [c, a], timeout=60)
    assert got == [b"a:0:0", b"b:1:0", None]  # shard 2: no holder has it
    assert c.calls == [] and b.calls == [[(1, 0, 1)]]
    assert f.stats.rounds == 1 and f.stats.missing == 1
    f.close()


def test_ranges_whose_holders_are_all_down_are_left_at_once_and_counted() -> None:
    down = Fake("down", {0, 1}, down=True)
    up = Fake("up", {2})
    f = Fanout()
    got = f.read([(0, 0, 1), (1, 0, 1), (2, 0, 1)], lambda s: [down] if s < 2 else [up],
                 timeout=60)
    assert got == [None, None, b"up:2:0"] and down.calls == []
    assert f.stats.skipped == 2 and f.stats.missing == 2 and f.stats.parts == 1
    f.close()


def test_a_holder_that_does_not_answer_by_the_deadline_leaves_its_ranges_none() -> None:
    hung = threading.Event()
    slow, fast = Fake("slow", {0}, hung), Fake("fast", {1})
    f = Fanout()
    try:
        got = f.read([(0, 0, 1), (1, 0, 1)], lambda s: [slow, fast][s : s + 1], timeout=0.05)
        assert got == [None, b"fast:1:0"]
        assert f.stats.late == 1 and f.stats.missing == 1
    finally:
        hung.set()
        f.close()


def test_send_all_passes_unavailable_as_no_answer_and_raises_other_errors() -> None:
    from concurrent.futures import ThreadPoolExecutor

    def call(h: str, items: list[int]) -> list[int]:
        if h == "gone":
            raise SourceUnavailable("gone")
        if h == "bug":
            raise ZeroDivisionError
        return [i * 2 for i in items]

    with ThreadPoolExecutor(4) as pool:
        assert send_all([("ok", [1, 2]), ("gone", [3])], call, pool, None) == [
            (True, [2, 4]), (False, None)]
        with pytest.raises(ZeroDivisionError):
            send_all([("ok", [1]), ("bug", [2])], call, pool, None)
