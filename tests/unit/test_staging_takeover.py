"""A shard whose primary finished its own shards without it (no room in its tiers): its
other holders take it over in their order, each from the origin only once the holders
before it will not give it. All of them read it from the origin at once: a
``--replicate-all`` shard (the validation set) on 4 nodes whose primary's tier was too
small was read from the origin 3 times, N - 1 times on N nodes."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import stagefs
from stagefs.cluster.staging import Stager
from stagefs.format import Manifest


class _Peer:
    """A live node: whether it holds the shard whole, and what its STATUS says."""

    def __init__(self, holds: bool, staging_done: bool, primary_done: bool,
                 no_room: int) -> None:
        self.holds = holds
        self.st = {"staging_done": staging_done, "primary_done": primary_done,
                   "staging": {"no_room": no_room}}

    def is_down(self) -> bool:
        return False

    def read(self, ranges: list[tuple[int, int, int]]) -> list[bytes | None]:
        return [b"\0" * n if self.holds else None for _, _, n in ranges]

    def status(self) -> dict[str, Any]:
        return self.st


@pytest.fixture()
def manifest(tmp_path: Path) -> Iterator[Manifest]:
    src = tmp_path / "src"
    src.mkdir()
    (src / "f.bin").write_bytes(os.urandom(3000))
    stagefs.pack(str(src), str(tmp_path / "pack"), jobs=1)
    m = Manifest(str(tmp_path / "pack" / "manifest.sfm"))
    yield m
    m.close()


def _gone(m: Manifest, rank: int, peers: dict[int, _Peer]) -> bool:
    holders = [(0, 1, 2, 3)]  # node 0 the primary, then 1, 2 and 3 in turn
    stager = Stager(m, holders, rank, None, peers,  # type: ignore[arg-type]
                    threading.Event(), sources={})
    return stager._gone(0, sorted(peers), {})


def test_the_holders_after_a_primary_without_room_take_it_in_turn(
        manifest: Manifest) -> None:
    primary = _Peer(holds=False, staging_done=False, primary_done=True, no_room=1)
    busy = _Peer(holds=False, staging_done=False, primary_done=False, no_room=0)
    # the next holder reads it from the origin
    assert _gone(manifest, 1, {0: primary, 2: busy, 3: busy})
    # a later one waits for it: it will copy the shard from there
    assert not _gone(manifest, 2, {0: primary, 1: busy, 3: busy})
    assert not _gone(manifest, 3, {0: primary, 1: busy, 2: busy})
    # it holds the shard: copied from it, not from the origin
    held = _Peer(holds=True, staging_done=False, primary_done=False, no_room=0)
    assert not _gone(manifest, 3, {0: primary, 1: held, 2: busy})
    # it will not give it (its tiers full, or its staging over without it): the next one
    full = _Peer(holds=False, staging_done=False, primary_done=False, no_room=2)
    done = _Peer(holds=False, staging_done=True, primary_done=True, no_room=0)
    assert _gone(manifest, 2, {0: primary, 1: full, 3: busy})
    assert not _gone(manifest, 3, {0: primary, 1: full, 2: busy})
    assert _gone(manifest, 3, {0: primary, 1: full, 2: done})
    # a holder that is down is not waited for
    assert _gone(manifest, 2, {0: primary, 3: busy})


class _Down(_Peer):
    """A node that does not answer (killed, or its link cut)."""

    def __init__(self) -> None:
        super().__init__(False, False, False, 0)

    def is_down(self) -> bool:
        return True

    def status(self) -> dict[str, Any]:
        from stagefs.net.client import PeerUnavailable
        raise PeerUnavailable("node: does not answer")


def test_the_overflow_waits_for_the_nodes_before_it_in_turn(manifest: Manifest) -> None:
    """A shard's second spare places what the holders and the first spare do not hold only
    once they are done (the holder staged, the first spare's first round over); a node that
    does not answer is waited for up to ``unreachable_after``, then left out, in every later
    round too (each round waited for it anew: twice --dead-after before the second spares
    went on)."""
    holder, first = _Peer(False, True, True, 0), _Peer(False, True, True, 0)
    first.st["overflow_rounds"] = 0
    peers: dict[int, _Peer] = {0: holder, 1: first}
    stager = Stager(manifest, [(0,)], 2, None, peers,  # type: ignore[arg-type]
                    threading.Event(), sources={}, unreachable_after=30.0,
                    spares=[(1, 2)])
    assert stager._before(0, 0, {}, 0.0) == [0]  # the first spare's round: the holder only
    assert stager._before(0, 1, {}, 0.0) is None  # the first spare is not done yet
    first.st["overflow_rounds"] = 1
    assert stager._before(0, 1, {}, 0.0) == [0, 1]
    holder.st["staging_done"] = False
    assert stager._before(0, 1, {}, 0.0) is None  # nor is the holder
    peers[0] = _Down()
    assert stager._before(0, 1, {}, 10.0) is None  # down: waited for a while
    assert stager._before(0, 1, {}, 31.0) == [1]  # then taken for dead
    assert stager._before(0, 1, {}, 0.0) == [1]  # and not waited for again
