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
