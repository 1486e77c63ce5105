"""A cold FUSE mount reads through the same cold pipeline as the API (tiers/stream.py):
every file read once in a random order costs the origin each stored byte once."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest

import stagefs
from stagefs.format import MANIFEST_NAME, Manifest
from stagefs.posix.fuse import fuse_available, is_mounted
from tiers_helpers import make_tree

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(fuse_available() is not None, reason=str(fuse_available())),
]


def _stagefs(*args: str, runtime: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "stagefs.cli", *args], capture_output=True,
                          text=True, timeout=120, check=False,
                          env={**os.environ, "STAGEFS_RUNTIME": str(runtime)})


def test_a_cold_cat_of_every_file_reads_each_origin_byte_once(tmp_path: Path) -> None:
    files = make_tree(tmp_path / "raw", n=300, seed=7)
    pack = tmp_path / "pack"
    stagefs.pack(tmp_path / "raw", pack, shard_size="64KiB", jobs=1, progress=False,
                 echo=lambda _m: None)
    m = Manifest(str(pack / MANIFEST_NAME))
    stored, shards = int(m.arrays["stored"].sum()), len(m.shards)
    m.close()
    mp, runtime, tier = tmp_path / "mnt", tmp_path / "rt", tmp_path / "tier"
    mp.mkdir()
    r = _stagefs("mount", str(pack), str(mp), "--tier", str(tier), runtime=runtime)
    assert r.returncode == 0, r.stderr
    try:
        order = sorted(files)
        random.Random(3).shuffle(order)
        # cat in a random order, a few files per call, as a shell loop would
        for k in range(0, len(order), 25):
            batch = order[k : k + 25]
            got = subprocess.run(["cat", *batch], cwd=mp, capture_output=True, check=True,
                                 timeout=120).stdout
            assert got == b"".join(files[p] for p in batch)
    finally:
        r = _stagefs("umount", str(mp), runtime=runtime)
        assert r.returncode == 0, r.stderr
        assert not is_mounted(str(mp))
    # the server writes its counters when it closes the store, and then lets go of its lease
    deadline = time.monotonic() + 60
    while any((runtime / "procs").iterdir()):
        assert time.monotonic() < deadline, "the FUSE server did not end"
        time.sleep(0.02)
    # (the per-store JSON files; the *.counters beside them are the read counts by holder)
    counters = [json.loads(p.read_text()) for p in (runtime / "stats").glob("*.json")]
    assert sum(c["origin_stats"]["bytes_read"] for c in counters) == stored
    pid = next(p for p in os.listdir(tier) if not p.startswith("."))  # (not the room folder)
    held = [p for p in os.listdir(tier / pid) if not p.endswith((".partial", ".fill"))]
    assert len(held) == shards
