"""``held_shards()`` in cluster mode, on a node whose tiers had no room for its share (a small
tier, a tier of 0 bytes): once the cluster has staged it is what the tiers hold, not the
placement. It said every shard placed on the node, so a Sampler with locality dealt the
node's ranks samples that were all read from peers, and its local_fraction said they were
read locally."""

from __future__ import annotations

import os
import shutil
from dataclasses import replace
from pathlib import Path

import stagefs
from stagefs.cluster.cmap import ClusterMap, write_map
from stagefs.cluster.connect import ClusterHolders
from stagefs.format import Manifest
from stagefs.net import auth
from stagefs.tiers.origin import PackOrigin


def test_held_shards_is_what_the_tiers_hold_once_staged(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    for i in range(12):
        (src / f"f{i:02d}.bin").write_bytes(os.urandom(3000))
    pack = str(tmp_path / "pack")
    stagefs.pack(str(src), pack, jobs=1, shard_size="4KiB")
    m = Manifest(os.path.join(pack, "manifest.sfm"))
    token = auth.new_token()
    runtime = str(tmp_path / "rt")
    cmap = ClusterMap(pack=pack, pack_id=m.pack_id.hex(), rank=0,
                      nodes=[("127.0.0.1", 9), ("127.0.0.1", 10)], replicas=1, seed=0,
                      everywhere=[], replicate_all=[], tiers=[(str(tmp_path / "tier"), 0)])
    write_map(runtime, cmap, token)
    origin = PackOrigin(pack, m)
    holders = ClusterHolders(runtime, cmap, token, m, origin, verify=True, timeout=1)
    try:
        mine = set(holders.placement.shards_of(0))
        assert len(mine) >= 2
        # staging under way: what is placed here (its daemon is staging it)
        assert holders.held_shards() == mine
        # one copy made; then the cluster staged (the map written again): that copy alone
        tier = holders.tiers[0]
        os.makedirs(tier.dir, exist_ok=True)
        one = min(mine)
        shutil.copyfile(os.path.join(pack, m.shards[one].name), tier.path(one))
        assert holders.held_shards() == mine
        write_map(runtime, replace(cmap, staged=True), token)
        assert holders.held_shards() == {one}
        assert holders.status()["staged"] is True
    finally:
        for c in holders.clients.values():
            c.close()
        origin.close()
        m.close()
