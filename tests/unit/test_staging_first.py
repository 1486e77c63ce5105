"""The shards asked on every node (``--replicate-all val``) are staged before the others.
A node whose tiers could not hold its whole share filled them with its train shards (its
own primaries, copied from the origin at once) while the validation set's shards waited to
come from their primaries on other nodes, and held none of the validation set."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest

import stagefs
from stagefs.cluster.staging import Stager
from stagefs.format import Manifest


class _Chain:
    """Tiers with room for ``room`` shards (what ``Stager`` asks of the tier chain)."""

    corrupt = 0
    origin = None

    def __init__(self, room: int, placed_all: set[int] | None = None) -> None:
        self.room = room
        self.placed: list[int] = []
        self.placed_all = placed_all  # set ``done`` once these are placed
        self.done = threading.Event()

    @property
    def full(self) -> bool:
        return len(self.placed) >= self.room

    def scan(self, shards: object) -> set[int]:
        return set()

    def charge(self, shard: int) -> int:
        return 1

    def room_left(self) -> float:
        return float(max(0, self.room - len(self.placed)))

    def place(self, shard: int, source: object = None) -> str:
        if self.full:
            return "full"
        self.placed.append(shard)
        if self.placed_all is not None and self.placed_all <= set(self.placed):
            self.done.set()
        return "placed"



class _Peer:
    """A live holder of every shard (``holds``: of none, and still staging)."""

    name = "node 1"

    def __init__(self, holds: bool = True) -> None:
        self.holds = holds

    def is_down(self) -> bool:
        return False

    def read(self, ranges: list[tuple[int, int, int]]) -> list[bytes | None]:
        return [b"\0" * n if self.holds else None for _, _, n in ranges]

    def status(self) -> dict[str, bool]:
        return {"staging_done": self.holds, "primary_done": self.holds}


@pytest.fixture()
def manifest(tmp_path: Path) -> Iterator[Manifest]:
    src = tmp_path / "src"
    src.mkdir()
    for i in range(6):
        (src / f"f{i}.bin").write_bytes(os.urandom(3000))
    stagefs.pack(str(src), str(tmp_path / "pack"), jobs=1, shard_size="4KiB")
    m = Manifest(str(tmp_path / "pack" / "manifest.sfm"))
    yield m
    m.close()


def test_the_shards_on_every_node_have_room_before_the_others(manifest: Manifest) -> None:
    m = manifest
    n = len(m.shards)
    assert n >= 5
    val = {n - 2, n - 1}  # on every node, node 1 their primary
    holders = [(1, 0) if s in val else (0,) for s in range(n)]
    chain = _Chain(room=3)
    stager = Stager(m, holders, 0, chain, {1: _Peer()},  # type: ignore[arg-type, dict-item]
                    threading.Event(), sources={1: SimpleNamespace(name="node 1")},  # type: ignore[dict-item]
                    first=val)
    stager.run()
    assert stager.error is None
    assert set(chain.placed[:2]) == val, chain.placed  # the validation set, first
    # the train shards took the room left, and the rest are counted without room
    assert len(chain.placed) == 3
    assert stager.stats.no_room == n - 3
    assert stager.stats.shards_held == 3 and stager.stats.forwarded_shards == 2


def test_the_others_are_staged_meanwhile_while_the_room_allows(manifest: Manifest) -> None:
    """A shard on every node whose primary has not staged it yet does not hold up this
    node's other shards when the tiers have room for all of them."""
    m = manifest
    n = len(m.shards)
    holders = [(1, 0) if s == n - 1 else (0,) for s in range(n)]
    chain = _Chain(room=n, placed_all=set(range(n - 1)))
    stop = threading.Event()
    stager = Stager(m, holders, 0, chain, {1: _Peer(holds=False)},  # type: ignore[arg-type, dict-item]
                    stop, sources={1: SimpleNamespace(name="node 1")},  # type: ignore[dict-item]
                    first={n - 1})
    t = threading.Thread(target=stager.run)
    t.start()
    try:
        assert chain.done.wait(60), chain.placed  # every other shard, while it waits
        assert n - 1 not in chain.placed and not stager.done.is_set()
    finally:
        stop.set()
        t.join(60)
