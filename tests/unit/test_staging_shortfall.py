"""A node whose tiers take only part of its share (their file system full at start, or a
capacity below the share) staged what fitted and said nothing: ``stagefs status`` showed
"14/39 shards" with no reason, and the reason (the tier's ``stopped``) only in --json."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, cast

from stagefs.cluster.daemon import staging_shortfall


def _tier(root: str, stopped: str | None) -> Any:
    return cast(Any, SimpleNamespace(root=root, stopped=stopped))


def test_a_node_that_staged_part_of_its_share_says_why() -> None:
    tiers = [_tier("/dev/shm/t0", "no space left on device"), _tier("/nvme/t1", "full")]
    said = staging_shortfall(14, 39, tiers)
    assert said is not None
    assert said.startswith("staged 14 of its 39 shards: tier /dev/shm/t0: no space left on "
                           "device; tier /nvme/t1: full;")
    assert "other holders or the origin" in said and "--tier DIR:SIZE" in said
    # staged them all: nothing to say
    assert staging_shortfall(39, 39, tiers) is None
    # short for another reason than room: no advice on room
    said = staging_shortfall(3, 5, [_tier("/t", None)])
    assert said is not None and "--tier" not in said and "status --json" in said


def _staged(n: int, assigned: int, held: int, no_room: int, capacity: int | None
            ) -> dict[str, Any]:
    """The STATUS of node ``n`` staged, as much as ``stagefs status`` reads."""
    return {"host": "10.0.0.1", "port": 7070 + n, "state": "staged", "staging_done": True,
            "staging": {"shards_held": held, "shards_assigned": assigned,
                        "bytes_assigned": assigned * 1024, "bytes_held": held * 1024,
                        "no_room": no_room},
            "tiers": [{"used": held * 1024, "capacity": capacity}],
            "server": {"bytes_served": 0}, "peers_unreachable": 0, "checksum_failures": 0,
            "reads": {}}


def test_status_says_the_copies_no_node_had_room_for(
        monkeypatch: Any, tmp_path: Any, capsys: Any) -> None:
    """Nodes of unlike tiers (1 MiB, 2 MiB, 0 bytes) with --replicas 1: each node's line
    said its own share, and nothing said that a part of the dataset was held by no node
    and read from the origin every epoch; a tier of 0 bytes was shown as 'free'."""
    from stagefs.cluster import status
    from stagefs.cluster.cmap import ClusterMap

    nodes: list[dict[str, Any] | None] = [
        _staged(0, 11, 3, 8, 2**20), _staged(1, 7, 7, 0, 2 * 2**20), _staged(2, 5, 0, 5, 0)]
    said = status.without_room(nodes, 1)
    assert said is not None
    assert said.startswith("13 shard copies (13.0 KiB) placed on nodes whose tiers had no "
                           "room for them: node 0 (8), node 2 (5);"), said
    assert "go to the origin, but for the pieces" in said
    # the pieces other nodes hold of them after staging (the overflow) are said too
    nodes[1]["staging"]["bytes_for_others"] = 3 * 1024  # type: ignore[index]
    said = status.without_room(nodes, 1) or ""
    assert "the shards' spares hold in the room they have left after staging (3.0 KiB so " \
        "far)" in said, said
    assert "other holders" in (status.without_room(nodes, 2) or "")
    # every node took its share, or is still staging: nothing to say
    assert status.without_room([_staged(1, 7, 7, 0, None)], 1) is None
    assert status.without_room([{**nodes[0], "staging_done": False}, None], 1) is None  # type: ignore[dict-item]

    cmap = ClusterMap(pack=str(tmp_path / "pack"), pack_id="00", rank=0,
                      nodes=[("10.0.0.1", 7070 + n) for n in range(3)], replicas=1, seed=0,
                      everywhere=[], replicate_all=[], tiers=[])
    monkeypatch.setattr(status, "cluster_status", lambda runtime: (cmap, nodes))
    status.print_cluster_status(str(tmp_path))
    out = capsys.readouterr().out
    assert said in out.splitlines()
    row2 = out.splitlines()[4]
    assert row2.startswith("2 ") and "0 B/0 B" in row2 and "free" not in row2, row2


def test_progress_counts_a_node_done_without_room_as_done() -> None:
    """Rank 0's progress while the others stage: a node whose tiers took part of its share
    and are done is done. Its share was counted to stage: the progress stopped short of 100%
    with no ETA, and the node was named a laggard at its share until the end."""
    from stagefs.cluster.daemon import staging_progress

    small = _staged(0, 11, 3, 8, 2**20)  # done: 3 of its 11 shards
    staging = {**_staged(1, 10, 4, 0, None), "staging_done": False, "state": "staging"}
    fast = {**_staged(2, 10, 9, 0, None), "staging_done": False, "state": "staging"}
    done, total, lag = staging_progress([small, staging, fast], ())
    assert done == (3 + 4 + 9) * 1024
    assert total == (3 + 10 + 10) * 1024  # node 0: what it holds is all that is to come
    assert lag == ["node 1 (40%)"], lag  # node 0 is no laggard
    done, total, lag = staging_progress([small, None, {**fast, "staging_done": True}], {1})
    assert done == total and lag == ["node 1 (dead)"]
