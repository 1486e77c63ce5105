"""The server's open shard files (net/server.py, ``HeldFiles``): a copy deleted since it
was opened (a reader found it corrupt and dropped it) is not served any more."""

from __future__ import annotations

import os
from pathlib import Path

from stagefs.net.server import HeldFiles
from tiers_helpers import packed_tree


def test_a_copy_deleted_under_its_open_file_is_not_served(tmp_path: Path) -> None:
    from stagefs.format import MANIFEST_NAME, Manifest

    pack, _ = packed_tree(tmp_path, n=20)
    m = Manifest(str(pack / MANIFEST_NAME))
    names = [s.name for s in m.shards]
    now = [0.0]
    held = HeldFiles(m, lambda s: str(pack / names[s]), clock=lambda: now[0])
    try:
        fd = held.fd(0)
        assert fd is not None and held.fd(0) == fd
        os.unlink(pack / names[0])  # dropped: its open descriptor still reads it
        now[0] += HeldFiles.RECHECK / 2
        assert held.fd(0) == fd  # not looked at again yet
        now[0] += HeldFiles.RECHECK
        assert held.fd(0) is None  # served from it before, until the daemon ended
        assert held.fd(1) is not None
    finally:
        held.close()
        m.close()


def test_a_copy_of_the_wrong_size_is_not_served_and_is_reported(tmp_path: Path) -> None:
    """A copy cut short (or written past its end) is served as not held, and the daemon is
    told (``damaged``: its CHECK, which deletes the copy and places it again): untold, the
    node relayed the shard, or sent its readers to the origin, every epoch."""
    from stagefs.format import MANIFEST_NAME, Manifest

    pack, _ = packed_tree(tmp_path, n=20, shard_size="8KiB")
    m = Manifest(str(pack / MANIFEST_NAME))
    names = [s.name for s in m.shards]
    assert len(names) >= 3
    told: list[int] = []
    held = HeldFiles(m, lambda s: str(pack / names[s]), damaged=told.append)
    try:
        os.truncate(pack / names[0], m.shards[0].size - 1)
        with open(pack / names[1], "ab") as f:
            f.write(b"\0")
        assert held.fd(0) is None and held.fd(1) is None
        assert told == [0, 1]
        assert held.fd(2) is not None and told == [0, 1]  # a whole copy: served, not told
    finally:
        held.close()
        m.close()
