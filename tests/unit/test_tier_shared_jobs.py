"""Two jobs of different ids sharing a tier directory (two jobs of a user on one node, each
given ``--tier /dev/shm/$USER/data:50%``): the tier's room is counted in the tier, by every
job that places into it, so together they hold no more than its capacity; a counter left
in the tier by copies deleted since is counted anew by the next job."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import stagefs
from conftest import pack_files, random_bytes, small_tmpfs
from stagefs.tiers.tier import dir_bytes

MiB = 2**20

# a job: open the dataset with the tier, wait until the other job has opened it too, then
# read every file in a shuffled order in batches and check each against its source
_JOB = textwrap.dedent("""
    import hashlib, os, random, sys, time
    import stagefs
    pack, src, tier, mine, other = sys.argv[1:6]
    fs = stagefs.open(pack, tiers=[tier])
    open(mine, "w").close()
    deadline = time.monotonic() + 60
    while not os.path.exists(other) and time.monotonic() < deadline:
        time.sleep(0.01)
    names = [os.path.join(r, f) for r, _, files in fs.walk("/") for f in files]
    random.Random(mine).shuffle(names)
    for i in range(0, len(names), 8):
        batch = names[i:i + 8]
        for name, data in zip(batch, fs.read_many(batch)):
            with open(os.path.join(src, name.lstrip("/")), "rb") as f:
                assert bytes(data) == f.read(), name
    fs.close()
    print("ok", len(names))
""")


@pytest.fixture
def three_shards(tmp_path: Path) -> tuple[Path, Path]:
    """48 MiB in 96 files of 512 KiB: six shards of 8 MiB."""
    files = {f"d{i % 4}/f{i:02d}.bin": random_bytes(MiB // 2, i) for i in range(96)}
    return pack_files(tmp_path, "data", files), tmp_path / "data"


def _as_job(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, name: str) -> None:
    """This process is now job ``name`` (its own id and runtime, rt-NAME), with no tiers
    from the caller's environment."""
    monkeypatch.delenv("STAGEFS_TIERS", raising=False)
    monkeypatch.setenv("STAGEFS_JOB", name)
    monkeypatch.setenv("STAGEFS_RUNTIME", str(tmp_path / f"rt-{name}"))


def _job(tmp_path: Path, name: str, pack: Path, src: Path, tier: str,
         other: str) -> subprocess.Popen[str]:
    env = {**os.environ, "STAGEFS_JOB": name, "STAGEFS_RUNTIME": str(tmp_path / f"rt-{name}")}
    env.pop("STAGEFS_TIERS", None)
    return subprocess.Popen(
        [sys.executable, "-c", _JOB, str(pack), str(src), tier, str(tmp_path / name),
         str(tmp_path / other)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True)


def test_two_jobs_sharing_a_tier_hold_no_more_than_its_capacity(
        three_shards: tuple[Path, Path], tmp_path: Path) -> None:
    """Each job counted the tier's room in a counter of its own: both began at 0 and each
    filled the tier to its capacity (a 40 MiB tier held 56 MiB)."""
    pack, src = three_shards
    tier = tmp_path / "tier"
    capacity = 16 * MiB
    jobs = [_job(tmp_path, "a", pack, src, f"{tier}:{capacity}", "b"),
            _job(tmp_path, "b", pack, src, f"{tier}:{capacity}", "a")]
    for p in jobs:
        out, err = p.communicate(timeout=240)
        assert p.returncode == 0 and out.startswith("ok 96"), err
    held = dir_bytes(str(tier))
    # each job alone fills the tier to within a piece of its capacity; together no more
    assert capacity - 2 * MiB <= held <= capacity, held
    # and the one counter in the tier says what it holds
    (room,) = tier.glob(".stagefs-*/room")
    counted = int.from_bytes(room.read_bytes()[:8], "little")
    assert abs(counted - held) <= MiB // 4, (counted, held)


def test_a_counter_left_in_the_tier_is_counted_anew_by_the_next_job(
        three_shards: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """``rm -rf TIER/*`` leaves the hidden room folder: its counter still counted the copies
    deleted. The next job counts the tier anew: no warning that the tier is over its
    capacity, its room all free, and the dataset placed again."""
    pack, src = three_shards
    tier = tmp_path / "tier"
    _as_job(monkeypatch, tmp_path, "first")
    with stagefs.open(pack, tiers=[f"{tier}:64MiB"]) as fs:
        assert fs.chain is not None and fs.chain.stage()
    assert dir_bytes(str(tier)) >= 48 * MiB
    for d in tier.iterdir():  # what `rm -rf TIER/*` removes: not the dot folder
        if not d.name.startswith("."):
            shutil.rmtree(d)
    _as_job(monkeypatch, tmp_path, "second")
    with caplog.at_level(logging.WARNING), \
            stagefs.open(pack, tiers=[f"{tier}:12MiB"]) as fs:
        assert fs.chain is not None
        t = fs.chain.tiers[0]
        assert t.used_bytes() < MiB
        assert "capacity" not in caplog.text, caplog.text
        fs.chain.stage()
        assert 10 * MiB <= dir_bytes(str(tier)) <= 12 * MiB
        for rel in ("d0/f00.bin", "d3/f95.bin"):
            assert fs.read(rel) == (src / rel).read_bytes()


def test_the_same_job_run_again_after_the_tier_was_emptied_counts_it_anew(
        three_shards: tuple[Path, Path], tmp_path: Path, runtime: Path,
        caplog: pytest.LogCaptureFixture) -> None:
    """``stagefs stage`` twice in one shell (one job id), ``rm -rf TIER/*`` between, the
    second with a smaller capacity: the job had counted the tier once, so its counter
    still held the deleted copies, and the empty tier was said to hold more than it was
    given ("0 B of it this dataset's")."""
    pack, src = three_shards
    tier = tmp_path / "tier"
    with stagefs.open(pack, tiers=[f"{tier}:64MiB"]) as fs:
        assert fs.chain is not None and fs.chain.stage()
    for d in tier.iterdir():  # what `rm -rf TIER/*` removes: not the dot folder
        if not d.name.startswith("."):
            shutil.rmtree(d)
    with caplog.at_level(logging.WARNING), \
            stagefs.open(pack, tiers=[f"{tier}:12MiB"]) as fs:
        assert fs.chain is not None
        assert fs.chain.tiers[0].used_bytes() < MiB
        assert "more than" not in caplog.text, caplog.text
        fs.chain.stage()
        assert 10 * MiB <= dir_bytes(str(tier)) <= 12 * MiB
        assert fs.read("d1/f01.bin") == (src / "d1/f01.bin").read_bytes()


def test_clean_leaves_the_tier_as_it_found_it(three_shards: tuple[Path, Path],
                                              tmp_path: Path, runtime: Path) -> None:
    """The room folder goes with the user's last copy in the tier (``stagefs clean``)."""
    from stagefs.cli import main
    pack, _ = three_shards
    tier = tmp_path / "tier"
    with stagefs.open(pack, tiers=[f"{tier}:64MiB"]) as fs:
        assert fs.chain is not None and fs.chain.stage()
    assert any(tier.glob(".stagefs-*"))
    assert main(["clean", "--runtime", str(runtime)]) == 0
    assert os.listdir(tier) == []


def test_clean_of_a_tier_gone_read_only_says_why_it_stays(
        three_shards: tuple[Path, Path], tmp_path: Path, runtime: Path,
        caplog: pytest.LogCaptureFixture) -> None:
    """A tier's file system remounted read-only (a local disk after an error): ``stagefs
    clean`` cannot remove the copies, and said the directory held files of another user.
    It says what the file system said."""
    from stagefs.cli import main
    pack, _ = three_shards
    with small_tmpfs(tmp_path / "fs", "16M") as where:
        with stagefs.open(pack, tiers=[f"{where / 'tier'}:4MiB"]) as fs:
            assert fs.chain is not None
            fs.chain.stage()
        r = subprocess.run(["mount", "-o", "remount,ro", str(where)], capture_output=True,
                           text=True, timeout=30, check=False)
        if r.returncode != 0:
            pytest.skip(f"cannot remount a tmpfs read-only here: {r.stderr.strip()}")
        with caplog.at_level(logging.WARNING):
            assert main(["clean", "--runtime", str(runtime)]) == 0
        said = [m for m in caplog.messages if "could not be removed" in m]
        assert said and "Read-only file system" in said[0], caplog.messages
        assert "another user" not in said[0]


def test_clean_of_one_dataset_frees_its_room_for_a_live_job_of_another_id(
        three_shards: tuple[Path, Path], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Job b staged a second dataset into the tier job a (live) reads, then cleaned: its
    copies went, but the room counter in the tier still counted them, and job a saw the
    tier as used by them (its room left, its prefetch budget) until it found it full."""
    from stagefs.runtime import Runtime, clean
    pack, _ = three_shards
    other = pack_files(tmp_path, "other", {f"o{i}.bin": random_bytes(MiB, 100 + i)
                                           for i in range(6)})
    tier = tmp_path / "tier"
    _as_job(monkeypatch, tmp_path, "a")
    with stagefs.open(pack, tiers=[f"{tier}:256MiB"]) as fs:
        assert fs.chain is not None and fs.chain.stage()
        mine = dir_bytes(str(tier))
        _as_job(monkeypatch, tmp_path, "b")
        with stagefs.open(other, tiers=[f"{tier}:256MiB"]) as b:
            assert b.chain is not None and b.chain.stage()
        t = fs.chain.tiers[0]
        assert t.used_bytes() >= mine + 6 * MiB
        removed = clean([Runtime(tmp_path / "rt-b")])
        assert any(r.endswith(b.manifest.pack_id.hex()) for r in removed), removed
        assert dir_bytes(str(tier)) == mine  # job a's copies kept
        assert abs(t.used_bytes() - mine) <= MiB // 4, (t.used_bytes(), mine)
        assert fs.read("d0/f00.bin")  # and job a reads on
