"""Tiers as users set them up when the dataset is larger than they are: a shard staged in
pieces over two tiers, one directory named by two paths, a tier the file system cannot give
its capacity, a tier filled by another (or an older) pack (docs/decisions/0015-pieces.md)."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

import stagefs
from conftest import pack_files, random_bytes
from stagefs.errors import ConfigError
from stagefs.tiers.tier import dir_bytes

MiB = 2**20


@pytest.fixture
def one_large(tmp_path: Path) -> Path:
    """One shard: one raw file of 6 MiB (6 pieces of 1 MiB)."""
    return pack_files(tmp_path, "large", {"big.bin": random_bytes(6 * MiB, 1)})


def test_staging_a_shard_split_over_two_tiers_counts_both_copies(
        one_large: Path, runtime: Path, tmp_path: Path) -> None:
    """``stagefs stage``'s progress (and its "copied" figure) sums the bytes copied into
    each tier's copy of a shard; the second copy's count started again from zero, so the
    total went backwards (2 MiB said for 6 MiB copied)."""
    tiers = [f"{tmp_path / 'a'}:{4 * MiB + 64 * 1024}", f"{tmp_path / 'b'}:{3 * MiB}"]
    seen: list[int] = []
    with stagefs.open(one_large, tiers=tiers) as fs:
        assert fs.chain is not None
        counts = fs.chain.stage(progress=seen.append)
    # held in two partial copies (a shard whole in one tier only is renamed into place)
    assert counts == {"full": 1}
    assert dir_bytes(str(tmp_path / "a")) >= 4 * MiB
    assert dir_bytes(str(tmp_path / "b")) >= 2 * MiB
    assert all(n >= 0 for n in seen), seen  # never backwards
    assert sum(seen) == 6 * MiB  # every byte of the file, once


def test_one_directory_named_by_two_paths_is_refused(one_large: Path, runtime: Path,
                                                     tmp_path: Path) -> None:
    """A tier and a symlink to it are one directory: two tiers there each counted their own
    room (the directory took both capacities) and could claim the same copy. Refused,
    naming both; the tier named once (by either path) works, and shares one room count."""
    real = tmp_path / "nvme"
    real.mkdir()
    alias = tmp_path / "scratch"
    alias.symlink_to(real)
    with pytest.raises(ConfigError, match="same directory") as err:
        stagefs.open(one_large, tiers=[f"{real}:3MiB", f"{alias}:3MiB"])
    assert str(real) in str(err.value) and str(alias) in str(err.value)
    with stagefs.open(one_large, tiers=[f"{real}:3MiB"]) as a, \
            stagefs.open(one_large, tiers=[f"{alias}:3MiB"]) as b:
        assert a.chain is not None and b.chain is not None
        ra, rb = a.chain.tiers[0].room, b.chain.tiers[0].room
        assert ra is not None and rb is not None and ra.path == rb.path


def test_a_tier_named_by_a_symlink_to_nothing_is_a_clear_error(
        one_large: Path, runtime: Path, tmp_path: Path) -> None:
    """A tier named through a symlink whose target is gone (a job's scratch directory
    removed since, ``rm -rf`` of the tiers between jobs): a FileNotFoundError traceback
    from inside the tier's setup. A ConfigError names the link and its target; nothing
    is made there."""
    gone = tmp_path / "nvme" / "job1"
    link = tmp_path / "tier"
    link.symlink_to(gone)
    with pytest.raises(ConfigError, match="symlink") as err:
        stagefs.open(one_large, tiers=[f"{link}:8MiB"])
    assert str(link) in str(err.value) and str(gone) in str(err.value)
    assert not gone.parent.exists()
    gone.mkdir(parents=True)
    with stagefs.open(one_large, tiers=[f"{link}:8MiB"]) as fs:
        assert fs.read("big.bin") == random_bytes(6 * MiB, 1)


def test_a_tier_whose_file_system_fills_before_its_capacity_says_so(
        one_large: Path, runtime: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """A tier given 5 MiB on a file system with 2 MiB free stops when the file system is
    full: a warning says so (it was only on the debug-level log, so a user saw a tier hold
    less than asked with no word why), and the reads go on, right."""
    import os

    small = tmp_path / "small"
    real_statvfs = os.statvfs

    def statvfs(path: str | os.PathLike[str] | int) -> os.statvfs_result:
        st = real_statvfs(path)
        if isinstance(path, int) or not str(path).startswith(str(small)):
            return st
        fields = list(st)
        free = max(0, 2 * MiB - dir_bytes(str(small)))  # 2 MiB free before the tier
        fields[4] = free // st.f_frsize  # f_bavail
        return os.statvfs_result(fields)

    monkeypatch.setattr(os, "statvfs", statvfs)
    data = (one_large.parent / "large" / "big.bin").read_bytes()
    with caplog.at_level(logging.INFO, logger="stagefs"), \
            stagefs.open(one_large, tiers=[f"{small}:5MiB"]) as fs:
        assert fs.read("big.bin") == data
        assert fs.chain is not None
        fs.chain.wait_idle(60)
        assert fs.read("big.bin") == data
        assert fs.chain.tiers[0].stopped == "no space left on device"
    said = [r for r in caplog.records if "file system is full" in r.getMessage()]
    assert said and said[0].levelno == logging.WARNING
    assert str(small) in said[0].getMessage() and "5.0 MiB" in said[0].getMessage()


def test_a_tier_full_of_an_older_pack_says_whose_copies_fill_it(
        tmp_path: Path, runtime: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The dataset packed again (a new pack id) finds its tier full of the old pack's
    copies, kept for a next job until ``stagefs clean``: it holds none of its share. A
    warning names the directory that fills it and what to do; a tier full of the dataset's
    own copies says nothing."""
    files = {f"f{i}.bin": random_bytes(200_000, i) for i in range(30)}
    pack = pack_files(tmp_path, "data", files)
    tier = f"{tmp_path / 'ram'}:3MiB"
    with stagefs.open(pack, tiers=[tier]) as fs:
        assert fs.chain is not None
        fs.chain.stage()
        old_dir = fs.chain.tiers[0].dir
    with caplog.at_level(logging.WARNING, logger="stagefs"), \
            stagefs.open(pack, tiers=[tier]) as fs:
        assert fs.chain is not None
        fs.chain.stage()
    assert not [r for r in caplog.records if "other datasets" in r.getMessage()]
    files = {f"f{i}.bin": random_bytes(200_000, 100 + i) for i in range(30)}
    pack = pack_files(tmp_path, "data", files)  # packed again: another pack id
    with caplog.at_level(logging.WARNING, logger="stagefs"), \
            stagefs.open(pack, tiers=[tier]) as fs:
        assert fs.chain is not None
        assert all(fs.read(p) == d for p, d in files.items())  # never the old bytes
        fs.chain.stage()
        assert fs.chain.tiers[0].dir != old_dir
    said = [r.getMessage() for r in caplog.records if "other datasets" in r.getMessage()]
    assert said and old_dir in said[0] and "stagefs clean" in said[0]


@pytest.mark.skipif(os.geteuid() != 0, reason="makes a directory of another user (root)")
def test_a_full_tier_does_not_name_another_users_copies(
        tmp_path: Path, runtime: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A tier root shared by users: another user's copy there is not counted in this
    user's room, and is not theirs to delete; the full tier's warning named it (as 0 B)
    among the copies to delete."""
    files = {f"f{i}.bin": random_bytes(200_000, i) for i in range(30)}
    old = pack_files(tmp_path, "old", files)
    new = pack_files(tmp_path, "new", {f"g{i}.bin": random_bytes(200_000, 50 + i)
                                       for i in range(30)})
    root = tmp_path / "shared"
    root.mkdir(mode=0o1777)
    tier = f"{root}:3MiB"
    with stagefs.open(old, tiers=[tier]) as fs:  # this user's older copies: named
        assert fs.chain is not None
        fs.chain.stage()
        old_dir = fs.chain.tiers[0].dir
    theirs = root / ("ab" * 16)
    theirs.mkdir(mode=0o700)
    (theirs / "shard-000000.sfs").write_bytes(b"x" * 4096)
    for p in (theirs / "shard-000000.sfs", theirs):
        os.chown(p, 65534, 65534)
    with caplog.at_level(logging.WARNING, logger="stagefs"), \
            stagefs.open(new, tiers=[tier]) as fs:
        assert fs.chain is not None
        fs.chain.stage()
    said = [r.getMessage() for r in caplog.records if "other datasets" in r.getMessage()]
    assert said and old_dir in said[0], said
    assert str(theirs) not in said[0], said[0]


def test_a_tier_whose_path_is_not_utf8_holds_data(one_large: Path, runtime: Path,
                                                  tmp_path: Path) -> None:
    """A tier directory named with bytes that are not UTF-8 (os.fsdecode's surrogates):
    its room count is keyed by its path's bytes; it was a UnicodeEncodeError at open."""
    tier = os.fsdecode(os.path.join(os.fsencode(tmp_path), b"t\xff"))
    with stagefs.open(one_large, tiers=[f"{tier}:8MiB"]) as fs:
        assert fs.chain is not None
        assert fs.chain.stage() == {"placed": 1}
        assert fs.read("big.bin") == random_bytes(6 * MiB, 1)
        assert set(fs.held_shards()) == {0}
    assert dir_bytes(tier) >= 6 * MiB


def test_a_tier_opened_with_less_capacity_than_it_holds_says_so(
        tmp_path: Path, runtime: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A job restarted on its tiers with a smaller capacity (the disk wanted back for
    checkpoints) keeps every copy and reads them (nothing is evicted), but said nothing:
    a tier given 2 MiB held 6 MiB. A warning names the tier, what it holds and the
    capacity, once; a tier within its capacity says nothing."""
    files = {f"f{i}.bin": random_bytes(200_000, i) for i in range(30)}
    pack = pack_files(tmp_path, "data", files)
    tier = tmp_path / "disk"
    with stagefs.open(pack, tiers=[f"{tier}:8MiB"]) as fs:
        assert fs.chain is not None
        fs.chain.stage()
        held = fs.chain.tiers[0].used_bytes()
    assert held > 5 * MiB
    with caplog.at_level(logging.WARNING, logger="stagefs"), \
            stagefs.open(pack, tiers=[f"{tier}:8MiB"]) as fs:
        pass
    assert not [r for r in caplog.records if "more than the" in r.getMessage()]
    for _ in range(2):  # a second process of the job: not said again
        with caplog.at_level(logging.WARNING, logger="stagefs"), \
                stagefs.open(pack, tiers=[f"{tier}:2MiB"]) as fs:
            assert all(fs.read(p) == d for p, d in files.items())
            assert fs.chain is not None and fs.chain.tiers[0].used_bytes() == held
    said = [r.getMessage() for r in caplog.records if "more than the" in r.getMessage()]
    assert len(said) == 1
    assert str(tier) in said[0] and "2.0 MiB" in said[0] and "stagefs clean" in said[0]
