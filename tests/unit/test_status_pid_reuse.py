"""A process of a job whose pid an ended process of the same job had (pids are reused, in
a long job or a login session's runtime) adds its counts to `stagefs status`; it used to
make its files under the same names and take the ended process's counts away."""

from __future__ import annotations

import itertools
import os
from pathlib import Path

import pytest

import stagefs
from stagefs.runtime import Runtime
from stagefs.tiers import status as status_mod
from stagefs.tiers.status import COUNTER_SLOTS, ReadCounters, job_status, read_counts
from tiers_helpers import packed_tree


def _ended_process_counters(folder: Path, name: str, memory_reads: int) -> None:
    """The counter file an ended process of this pid left (docs/status.md's format)."""
    slots = [0] * 30
    slots[COUNTER_SLOTS.index("memory_reads")] = memory_reads
    slots[COUNTER_SLOTS.index("memory_bytes")] = 1000 * memory_reads
    (folder / name).write_bytes(b"SFSCNT1\n" + os.getpid().to_bytes(8, "little")
                                + b"".join(s.to_bytes(8, "little") for s in slots))


def test_a_new_process_of_a_reused_pid_keeps_the_ended_ones_counts(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = tmp_path / "stats"
    folder.mkdir()
    _ended_process_counters(folder, f"{os.getpid()}-0.counters", 7)
    monkeypatch.setattr(status_mod, "_SEQ", itertools.count())  # as in a new process
    c = ReadCounters(str(folder))
    try:
        c.add("disk", 3, 300, 300)
        total = read_counts(str(folder))
    finally:
        c.close()
    assert (total["memory_reads"], total["memory_bytes"]) == (7, 7000)
    assert (total["disk_reads"], total["disk_bytes"]) == (3, 300)
    assert c.snapshot()["memory_reads"] == 0  # this process's own counts stay its own
    assert len(list(folder.iterdir())) == 2


def test_a_new_store_of_a_reused_pid_keeps_the_ended_ones_tier_record(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The per-process record of tier and origin counters (the tier table, the origin's
    opens) is a file of its own too: an ended process's of the same pid stays."""
    pack, files = packed_tree(tmp_path)
    rt = tmp_path / "rt"
    with stagefs.open(pack, tiers=[str(tmp_path / "tier")], runtime=str(rt)) as fs:
        fs.read_many(sorted(files))
    first = job_status(Runtime(str(rt)))
    assert first["origins"][0]["processes"] == 1 and first["origins"][0]["opens"] > 0
    # a new process of the same pid numbers its stores and counter files from 0 again
    monkeypatch.setattr(status_mod, "_RECORDS", itertools.count())
    monkeypatch.setattr(status_mod, "_SEQ", itertools.count())
    with stagefs.open(pack, tiers=[str(tmp_path / "tier")], runtime=str(rt)) as fs:
        fs.read_many(sorted(files))
    again = job_status(Runtime(str(rt)))
    assert again["origins"][0]["processes"] == 2
    assert again["origins"][0]["opens"] >= first["origins"][0]["opens"]
    assert (again["reads"], again["bytes"]) == (2 * first["reads"], 2 * first["bytes"])
    assert sum(t["hits"] for t in again["tiers"]) >= first["reads"] - first[
        "holders"]["memory"]["reads"]  # the second store's reads came from the tier
