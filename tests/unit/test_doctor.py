"""``stagefs doctor``'s network check: the send buffer the node daemon asks for its readers'
connections against the kernel's cap, read from a file as /proc gives it; its tier check on a
tier that does not exist yet: said usable only where a store could make it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import small_tmpfs
from stagefs.doctor import check_network, check_tier
from stagefs.net.server import UNIX_SNDBUF


def test_a_cap_that_fits_a_reply_is_ok(tmp_path: Path) -> None:
    f = tmp_path / "wmem_max"
    f.write_text(f"{UNIX_SNDBUF}\n")
    [finding] = check_network(str(f))
    assert finding.status == "ok" and "4.0 MiB" in finding.meaning


def test_the_usual_cap_is_a_warning_that_says_what_to_set(tmp_path: Path) -> None:
    f = tmp_path / "wmem_max"
    f.write_text("212992\n")
    [finding] = check_network(str(f))
    assert finding.status == "warn"
    assert "208.0 KiB" in finding.meaning
    assert f"sysctl -w net.core.wmem_max={UNIX_SNDBUF}" in finding.meaning


def test_an_unreadable_cap_is_a_warning_not_an_error(tmp_path: Path) -> None:
    for content in (None, "junk"):
        f = tmp_path / "wmem_max"
        if content is None:
            f.unlink(missing_ok=True)
        else:
            f.write_text(content)
        [finding] = check_network(str(f))
        assert finding.status == "warn" and str(f) in finding.meaning


def test_a_tier_whose_parents_do_not_exist_yet_is_probed_and_left_as_it_was(
        tmp_path: Path) -> None:
    """A store makes the missing parents of a tier below a directory two levels deep; the
    doctor ended instead, its report unprinted, asking the free space of a parent that was
    not there."""
    [finding] = check_tier(f"{tmp_path / 'scratch' / 'me' / 't0'}:64MiB")
    assert finding.status == "ok", finding
    assert f"creates it in {tmp_path}" in finding.meaning and "write" in finding.meaning
    assert list(tmp_path.iterdir()) == []  # the probe's directories are gone again


def test_a_tier_that_cannot_be_made_is_an_error_not_ok() -> None:
    """Root may write in /proc by its permissions, but no directory can be made there: the
    doctor called such a tier ok (0 B free of 0 B) where 'stagefs stage' then failed."""
    [finding] = check_tier("/proc/stagefs-doctor-tier")
    assert finding.status == "error", finding
    assert "/proc/stagefs-doctor-tier" in finding.meaning


def test_a_memory_tier_over_the_job_s_memory_limit_is_a_warning_with_what_to_give(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A memory tier larger than what the job's memory limit (its control group's: Slurm's
    --mem) leaves was called ok: filling it got the job killed (out of memory), its pages
    being charged to the job and never given back. The doctor says so, with the room left
    and what to give; a tier that fits, or a node with no limit, stays ok."""
    from stagefs.tiers import tier as tier_mod

    room: list[int | None] = [8 << 20]
    monkeypatch.setattr(tier_mod, "fs_type", lambda _p: "tmpfs")
    monkeypatch.setattr(tier_mod, "memory_limit_room", lambda: room[0])
    [over] = check_tier(f"{tmp_path / 't0'}:64MiB")
    assert over.status == "warn", over
    assert "its capacity (64.0 MiB)" in over.meaning and "leaves (8.0 MiB)" in over.meaning
    assert "out of memory" in over.meaning and "--mem" in over.meaning
    [whole] = check_tier(f"{tmp_path / 't1'}")  # no capacity: all of its free space
    assert whole.status == "warn" and "free space of its file system" in whole.meaning
    [fits] = check_tier(f"{tmp_path / 't2'}:4MiB")
    assert fits.status == "ok", fits
    room[0] = None  # no limit applies
    [free] = check_tier(f"{tmp_path / 't3'}:64MiB")
    assert free.status == "ok", free


def test_a_tier_holding_more_than_it_is_given_is_a_warning(tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch
                                                            ) -> None:
    """A tier filled by a run given more room, then named with less (to free the disk for
    checkpoints): it keeps every copy and reads them, places nothing more. The doctor called
    it ok; it now says what it holds against what it is given, and how to free the room."""
    import os

    import stagefs

    monkeypatch.setenv("STAGEFS_RUNTIME", str(tmp_path / "rt"))
    src = tmp_path / "src"
    src.mkdir()
    for k in range(80):
        (src / f"f{k}").write_bytes(os.urandom(50_000))
    stagefs.pack(str(src), str(tmp_path / "pack"), shard_size=2**20, progress=False)
    tier = tmp_path / "tier"
    with stagefs.open(str(tmp_path / "pack"), tiers=[f"{tier}:64MiB"]) as fs:
        fs.read_many([f"f{k}" for k in range(80)])
        fs.status()  # the reads placed their shards (the stream ends with the epoch)
    [fits] = check_tier(f"{tier}:64MiB")
    assert fits.status == "ok", fits
    [over] = check_tier(f"{tier}:2MiB")
    assert over.status == "warn", over
    assert "more than the 2.0 MiB it is given" in over.meaning
    assert "stagefs clean" in over.meaning


def test_a_tier_given_a_share_is_judged_by_the_capacity_a_store_gives_it(
        tmp_path: Path) -> None:
    """``DIR:20%`` of a file system the tier fills: a store takes the share of the free
    space and what the tier holds; the doctor took it of the free space alone, and called a
    tier of 2.4 MiB one of less than a piece that "holds little or nothing" (and a tier
    over its share ok)."""
    from stagefs.config import format_size
    from stagefs.tiers.tier import share_capacity

    with small_tmpfs(tmp_path / "small_fs", "12M") as where:
        copies = where / "t" / ("ab" * 16)
        copies.mkdir(parents=True)
        (copies / "shard-000000.sfs").write_bytes(bytes(9 << 20))
        capacity = share_capacity(str(where / "t"), 20)
        assert 2 << 20 < capacity < 3 << 20
        [finding] = check_tier(f"{where / 't'}:20%")
        assert finding.status == "warn", finding
        assert f"more than the {format_size(capacity)} it is given" in finding.meaning, finding
        [finding] = check_tier(f"{where / 't'}:90%")
        assert finding.status == "ok", finding


@pytest.fixture
def nearly_full_fs(tmp_path: Path) -> Iterator[Path]:
    """A file system of 12 MiB (a tmpfs) with 6 MiB of it taken: skipped only where this
    process cannot mount one."""
    with small_tmpfs(tmp_path / "small_fs", "12M") as where:
        (where / "filler").write_bytes(bytes(6 << 20))
        yield where


def test_a_tier_on_a_nearly_full_file_system_is_probed_within_its_room(
        nearly_full_fs: Path) -> None:
    """A tier on a file system with a few MiB free holds pieces (a store places them one
    by one): the doctor's 32 MiB probe met ENOSPC and called it unusable (an error, exit
    1). The probe now takes at most half of the tier's room; a file system with less than
    a piece free is a warning that says what the tier will hold, never an error."""
    for spec, probe in ((f"{nearly_full_fs / 't'}:4MiB", "2.0 MiB probe"),
                        (f"{nearly_full_fs / 'u'}", "3.0 MiB probe")):
        [finding] = check_tier(spec)
        assert finding.status == "ok", finding
        assert "6.0 MiB free" in finding.meaning and probe in finding.meaning
    with open(nearly_full_fs / "filler", "ab") as f:
        f.write(bytes((6 << 20) - (512 << 10)))  # 512 KiB left: less than a piece
    [finding] = check_tier(f"{nearly_full_fs / 'v'}")
    assert finding.status == "warn", finding
    assert "512.0 KiB free" in finding.meaning and "holds little or nothing" in finding.meaning
    assert sorted(p.name for p in nearly_full_fs.iterdir()) == ["filler"]  # left as it was
