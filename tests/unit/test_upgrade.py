"""Runtime state left by an older stagefs in the job's runtime directory, used by this one
(docs/FORMAT.md "Versioning", "Read counters"; docs/decisions/0006-in-place-datasets.md)."""

from __future__ import annotations

import os
from pathlib import Path

import stagefs
from conftest import patch_manifest, set_mtime
from stagefs.tiers.status import COUNTER_SLOTS, MAGIC, holder_summary, read_counts


def test_an_inplace_scan_cached_by_an_older_stagefs_is_scanned_again(tmp_path: Path) -> None:
    """A cache from before the racy check has no ``started_ns``: it was reused as if no
    directory changed in the tick of the scan, so a file added then stayed unseen all job."""
    root, rt = tmp_path / "raw", tmp_path / "rt"
    (root / "d").mkdir(parents=True)
    (root / "d" / "a").write_bytes(b"a" * 10)
    with stagefs.open(root, runtime=rt):
        pass
    [cached] = rt.glob("**/manifest.sfm")
    assert b'"started_ns"' in cached.read_bytes()
    patch_manifest(cached, b'"started_ns"', b'"started_xx"')  # as an older stagefs wrote it
    mtime = (root / "d").stat().st_mtime_ns
    (root / "d" / "b").write_bytes(b"b" * 5)  # in the same tick as the scan's listing
    set_mtime(root / "d", mtime)
    with stagefs.open(root, runtime=rt) as fs:
        assert fs.read("d/b") == b"b" * 5
        assert fs.read("d/a") == b"a" * 10


def _counters_file(folder: Path, name: str, values: dict[str, int]) -> None:
    body = bytearray(8 * 30)
    for i, key in enumerate(COUNTER_SLOTS):
        body[8 * i : 8 * i + 8] = values.get(key, 0).to_bytes(8, "little")
    (folder / name).write_bytes(MAGIC + (2**31).to_bytes(8, "little") + bytes(body))


def test_counters_of_an_older_stagefs_do_not_make_origin_reads_hits(tmp_path: Path) -> None:
    """An older writer's counters file has the same magic but no ``fetched_*`` or
    ``stored_bytes`` (zero): its origin reads counted as no origin read, and ``stagefs
    status`` said 100% hits for a job that read nearly everything from the origin."""
    _counters_file(tmp_path, "1-0.counters", {"memory_reads": 1, "memory_bytes": 100,
                                              "origin_reads": 3, "origin_bytes": 900})
    summary = holder_summary(read_counts(str(tmp_path)))
    assert summary["fetched"] == {"reads": 3, "bytes": 900}
    assert abs(summary["hit_rate"] - 0.1) < 1e-9
    # with a current writer beside it: each file counted by its own kind
    _counters_file(tmp_path, "2-0.counters", {"disk_reads": 1, "disk_bytes": 1000,
                                              "fetched_reads": 0, "stored_bytes": 1000})
    summary = holder_summary(read_counts(str(tmp_path)))
    assert summary["fetched"]["bytes"] == 900
    assert abs(summary["hit_rate"] - (1 - 900 / 2000)) < 1e-9
    assert os.path.exists(tmp_path / "1-0.counters")
