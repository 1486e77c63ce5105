"""Tier faults a job meets between epochs: copies deleted or damaged from outside, the tier
dir changed under the job. Each test names the fault; the repro scripts that found them
ran several processes at once (the tests here are their one-process core)."""

from __future__ import annotations

import errno
import os
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import stagefs
from conftest import held_deleted
from stagefs.tiers.fill import copy_charge, whole_charge
from tiers_helpers import packed_tree


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, bytes]]:
    return packed_tree(tmp_path_factory.mktemp("faults"), n=160, shard_size="48KiB")


def epoch(fs: stagefs.Store, files: dict[str, bytes], seed: int) -> None:
    paths = sorted(files)
    random.Random(seed).shuffle(paths)
    for p in paths:
        assert fs.read(p) == files[p], p


def fill(fs: stagefs.Store, files: dict[str, bytes], seed: int) -> None:
    """An epoch, then every shard placed where the tiers have room."""
    epoch(fs, files, seed)
    fs.prefetch(range(len(fs.manifest.shards)))
    assert fs.chain is not None and fs.chain.wait_idle(30)


def _fill_in_order(fs: stagefs.Store) -> None:
    """Every shard placed by one stream, in shard order, before any read."""
    assert fs.chain is not None
    ctl = fs.chain.stream.controller
    ctl.most = ctl.target = 1
    fs.prefetch(range(len(fs.manifest.shards)))
    assert fs.chain.wait_idle(30)


def _extents(pack: Path, tier: Path) -> tuple[list[Any], int]:
    """The pieces of each shard, and the block a tier in ``tier`` counts in."""
    with stagefs.open(pack, tiers=[str(tier)]) as probe:
        assert probe.chain is not None
        return ([probe.chain._extents_of(s) for s in range(len(probe.manifest.shards))],
                probe.chain.tiers[0].block)


def allocated(d: Path) -> int:
    return sum(min(p.stat().st_size, p.stat().st_blocks * 512) for p in d.rglob("*")
               if p.is_file())


def test_a_copy_deleted_from_outside_frees_its_room(
        dataset: tuple[Path, dict[str, bytes]], tmp_path: Path, runtime: Path) -> None:
    """A whole copy deleted from a full tier between runs of the job (``rm``, a cleanup)
    was counted in the tier's room for the rest of the job: the tier said it held bytes it
    did not, and never took the shard again (it went to the next tier, or to the origin).
    A tier found full counts its room anew from its directory once: the shard is placed
    there again, and the counter is what the tier holds."""
    pack, files = dataset
    fast, slow = tmp_path / "fast", tmp_path / "slow"
    # room for the first four shards whole, and not a piece more: placed by one stream in
    # shard order, the fast tier holds those four, whole, every run (with several streams
    # and the reads' own reservations, which shards it held, and whether the room left
    # took a piece, was their race)
    exts, block = _extents(pack, tmp_path / "measure")
    tiers = [f"{fast}:{sum(whole_charge(x, block) for x in exts[:4])}", f"{slow}:64MiB"]
    with stagefs.open(pack, tiers=tiers) as fs:
        _fill_in_order(fs)
        epoch(fs, files, 1)
        before = fs.status()["tiers"][0]["bytes_used"]
    copies = sorted(p for p in fast.rglob("*.sfs"))
    assert [p.name for p in copies] == [f"shard-{s:06d}.sfs" for s in range(4)]
    assert not list(fast.rglob("*.partial"))
    victim = copies[0]
    victim.unlink()
    with stagefs.open(pack, tiers=tiers) as fs:
        _fill_in_order(fs)
        epoch(fs, files, 3)
        st = fs.status()
    assert victim.exists(), "the shard was not placed again in the tier it was deleted from"
    assert sorted(fast.rglob("*.sfs")) == copies
    assert not (slow / victim.parent.name / victim.name).exists()
    # counted as it was before the delete: what the tier holds, by the rule of its charges
    assert st["tiers"][0]["bytes_used"] == before
    assert st["reads"]["checksum_failures"] == 0


def test_a_copy_deleted_from_outside_while_the_job_reads(
        dataset: tuple[Path, dict[str, bytes]], tmp_path: Path, runtime: Path,
        memory_dir: Path) -> None:
    """A whole copy deleted while the process reads (``rm``, a cleaner of /dev/shm): the
    process served its reads from the deleted file for the rest of its life, through the
    descriptor and mapping it kept (the memory never came back), never placed the shard
    again, and its tier's room still counted it. Now the reads let go of it within
    ``GONE_RECHECK_S`` (the chain's clock), the shard is placed again, the room counts
    what the tier holds."""
    from stagefs.tiers.chain import GONE_RECHECK_S

    pack, files = dataset
    names = sorted(files)
    with stagefs.open(pack, tiers=[f"{memory_dir}:64MiB"]) as fs:
        chain = fs.chain
        assert chain is not None
        now = [0.0]
        chain.clock = lambda: now[0]
        chain.stage()
        assert fs.read_many(names) == [files[p] for p in names]  # mapped, held open
        before = fs.status()["tiers"][0]["bytes_used"]
        victim = Path(chain.tiers[0].path(2))
        assert victim.exists()
        victim.unlink()
        gone = f"{victim} (deleted)"  # (not the fill map of a copy placed again meanwhile)
        assert gone in held_deleted(victim), "the copy was not held open: the test tests nothing"
        assert fs.read_many(names) == [files[p] for p in names]  # within the second
        now[0] += GONE_RECHECK_S
        assert fs.read_many(names) == [files[p] for p in names]
        assert gone not in held_deleted(victim)  # let go of: its memory freed
        chain.stage()
        assert victim.exists(), "the shard deleted was not placed again"
        assert fs.read_many(names) == [files[p] for p in names]
        assert fs.status()["tiers"][0]["bytes_used"] == before
        assert fs.stats.checksum_failures == 0


@pytest.mark.timeout(120)  # the failure was a hang
def test_copies_deleted_from_outside_are_placed_again_by_the_next_epoch_s_reads(
        dataset: tuple[Path, dict[str, bytes]], tmp_path: Path, runtime: Path,
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """Every copy of a tier the first epoch filled deleted while the job reads (``rm``, a
    tmp reaper), epoch after epoch: the process read the deleted copies through the
    descriptors it kept (their memory never came back), never placed them again, and its
    tier's room counted them. A new copy given the inode number of a deleted one (ext4
    reuses them) must not meet the stream state of the old copy's closed handle: a stream
    failed (IndexError), its readers waited 30 s a file. The next epoch's reads and
    streams place them again, as the first epoch's did: the epoch after reads nothing
    from the origin, the room is what it was, no descriptor is left on a deleted copy, no
    stream fails. The copies are looked at every ``GONE_RECHECK_S`` at most (the chain's
    clock, moved by hand)."""
    from stagefs.tiers import stream as stream_mod
    from stagefs.tiers.chain import GONE_RECHECK_S

    monkeypatch.setattr(stream_mod, "HOLDER_WAIT_S", 1.0)  # (a stream failed: its readers')
    pack, files = dataset
    tier = tmp_path / "tier"
    with caplog.at_level("WARNING", logger="stagefs"), \
            stagefs.open(pack, tiers=[f"{tier}:64MiB"]) as fs:
        chain = fs.chain
        assert chain is not None
        now = [0.0]
        chain.clock = lambda: now[0]

        def from_origin(seed: int) -> int:
            """The origin bytes one epoch read, its streams done."""
            before = fs.origin.stats.bytes_read
            epoch(fs, files, seed)
            assert chain.wait_idle(30)
            return fs.origin.stats.bytes_read - before

        assert from_origin(1) > 0
        assert from_origin(2) == 0  # warm
        copies = sorted(tier.rglob("*.sfs"))
        assert len(copies) == sum(1 for s in fs.manifest.shards if s.size > 64)
        used = fs.status()["tiers"][0]["bytes_used"]
        for cycle in range(8):  # (a new copy takes a deleted one's inode number)
            for p in copies:
                p.unlink()
            assert f"{copies[0]} (deleted)" in held_deleted(copies[0]), \
                "the copy was not held open: the test tests nothing"
            now[0] += GONE_RECHECK_S
            assert from_origin(10 + 2 * cycle) > 0  # as a first epoch
            assert sorted(tier.rglob("*.sfs")) == copies, cycle  # placed again
            now[0] += GONE_RECHECK_S
            assert from_origin(11 + 2 * cycle) == 0, cycle  # warm again
            assert not [p for p in copies if f"{p} (deleted)" in held_deleted(p)]
            assert fs.status()["tiers"][0]["bytes_used"] == used
        assert fs.stats.checksum_failures == 0
    said = [r.getMessage() for r in caplog.records]
    assert not said, said[:3]


def test_a_partial_copy_deleted_from_outside_frees_its_room(
        dataset: tuple[Path, dict[str, bytes]], tmp_path: Path, runtime: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A partial copy (a shard the tier had room for in part) deleted from outside while the
    job reads (``rm``, a cleaner of /dev/shm) stayed counted in its full tier's room: the
    tier never took a piece again. Now the read that finds it gone counts the tier anew:
    its room is what it holds, and the shard's piece is placed there again."""
    from stagefs.tiers import chain as chain_mod
    from stagefs.tiers.fill import FILL_SUFFIX

    monkeypatch.setattr(chain_mod, "PIECE_SIZE", 16 * 1024)  # partial copies of 48 KiB shards
    pack, files = dataset
    exts, block = _extents(pack, tmp_path / "measure")
    # shard 0 whole, and room for the first piece of shard 1 alone
    cap = whole_charge(exts[0], block) + copy_charge(exts[1], block) + \
        exts[1].added(None, 0, block)
    tier = tmp_path / "tier"
    with stagefs.open(pack, tiers=[f"{tier}:{cap}"]) as fs:
        chain = fs.chain
        assert chain is not None
        _fill_in_order(fs)
        (partial,) = tier.rglob("*.partial")
        assert partial.name == "shard-000001.sfs.partial"
        used = fs.status()["tiers"][0]["bytes_used"]
        assert chain.full and used > whole_charge(exts[0], block)
        partial.unlink()
        Path(str(partial)[: -len(".partial")] + FILL_SUFFIX).unlink()
        chain._look(1)  # what a read of shard 1 does once RECHECK_S has passed
        assert fs.status()["tiers"][0]["bytes_used"] == whole_charge(exts[0], block)
        assert not chain.full
        _fill_in_order(fs)
        assert partial.exists(), "the piece deleted was not placed again"
        assert fs.status()["tiers"][0]["bytes_used"] == used
        epoch(fs, files, 5)
        assert fs.stats.checksum_failures == 0


def test_a_recount_with_nothing_deleted_changes_nothing(
        dataset: tuple[Path, dict[str, bytes]], tmp_path: Path, runtime: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Counted anew from the directory, a tier's room is what its reservations counted
    (whole copies and partial ones alike): a full tier takes no more pieces after it, so
    the held set stays put epoch after epoch (no creep past the capacity)."""
    from stagefs.tiers import chain as chain_mod

    monkeypatch.setattr(chain_mod, "PIECE_SIZE", 16 * 1024)  # partial copies of 48 KiB shards
    pack, files = dataset
    tier = tmp_path / "t"
    # room for the first three shards whole and the first piece of the next one with two
    # pieces or more: read in shard order with no stream (each read reserves its own
    # pieces), the tier holds those and is then full, every run (with streams, which
    # shards ended whole, and whether the room left took a piece, was the streams' race)
    exts, block = _extents(pack, tmp_path / "measure")
    with stagefs.open(pack) as probe:
        m = probe.manifest
        at = {p: (int(m.shard[e]), int(m.offset[e]))
              for p in files for e in [probe.namespace.file_entry(p)]}
    cut = next(s for s in range(3, len(exts)) if exts[s].pieces >= 2)
    first = np.zeros(exts[cut].pieces, bool)
    first[0] = True
    cap = sum(whole_charge(x, block) for x in exts[:3]) + copy_charge(exts[cut], block) + \
        exts[cut].charged(first, block)
    paths = sorted(files, key=at.__getitem__)
    held: dict[str, set[tuple[int, int]]] = {}
    for run in range(2):
        with stagefs.open(pack, tiers=[f"{tier}:{cap}"]) as fs:
            chain = fs.chain
            assert chain is not None
            ctl = chain.stream.controller
            ctl.most = ctl.target = 0
            for p in paths:
                assert fs.read(p) == files[p], p
            t = chain.tiers[0]
            assert t.room is not None and t.charges is not None
            if not run:
                assert [p.name for p in tier.rglob("*.partial")] == \
                    [f"shard-{cut:06d}.sfs.partial"]
                with chain._tier_lock():
                    used = t.room.used()
                    assert t.room.recount(t.charges()) == used
                held = chain.held_pieces()
            else:
                assert chain.held_pieces() == held
                assert fs.status()["tiers"][0]["bytes_used"] == used
    assert allocated(tier) <= used


def test_a_tier_on_a_read_only_mount_is_named_as_such(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A tier on a file system mounted read-only was refused as "not writable by this
    user": a permission the user would chase with chmod. The error names the read-only
    file system (the tier itself, or the directory it would be created in)."""
    from stagefs.tiers import tier as tier_mod

    real = os.statvfs
    ro = tmp_path / "ro"
    ro.mkdir()

    def statvfs(path: str | os.PathLike[str]) -> os.statvfs_result:
        st = real(path)
        if not os.fspath(path).startswith(str(ro)):
            return st
        fields = list(st)
        fields[8] |= os.ST_RDONLY
        return os.statvfs_result(fields)

    monkeypatch.setattr(os, "statvfs", statvfs)
    monkeypatch.setattr(os, "access", lambda *_a, **_k: False)  # as a read-only mount answers
    for path, named in ((ro, ro), (ro / "sub" / "t0", ro)):
        problem = tier_mod.tier_dir_problem(str(path))
        assert problem is not None
        assert f"{named} is on a read-only file system" in problem, problem
        assert "by this user" not in problem
    # a directory merely not writable by this user is still said to be that
    monkeypatch.setattr(os, "statvfs", real)
    problem = tier_mod.tier_dir_problem(str(ro))
    assert problem is not None and "not writable by this user" in problem


def test_a_copy_grown_from_outside_is_not_called_cut_short(
        dataset: tuple[Path, dict[str, bytes]], tmp_path: Path, runtime: Path,
        caplog: pytest.LogCaptureFixture) -> None:
    """A whole copy longer than its shard (bytes appended, another file copied over it) is
    deleted and placed anew; the log said it was "shorter than" the shard. It says the
    sizes, and that it is not this shard's copy."""
    pack, files = dataset
    tier = tmp_path / "t"
    with stagefs.open(pack, tiers=[f"{tier}:64MiB"]) as fs:
        fill(fs, files, 1)
    victim = sorted(tier.rglob("*.sfs"))[0]
    size = victim.stat().st_size
    with victim.open("ab") as f:
        f.write(b"x" * 100)
    with caplog.at_level("WARNING", logger="stagefs"), \
            stagefs.open(pack, tiers=[f"{tier}:64MiB"]) as fs:
        fill(fs, files, 2)
    assert victim.stat().st_size == size
    said = [r.getMessage() for r in caplog.records if str(victim) in r.getMessage()]
    assert said and all("shorter" not in m for m in said), said
    assert any(f"{size + 100} bytes" in m and "not this shard's copy" in m for m in said), said


def test_a_tier_copy_that_cannot_be_opened_for_want_of_descriptors_stops_placement_only(
        dataset: tuple[Path, dict[str, bytes]], tmp_path: Path, runtime: Path,
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """Under a low open-file limit (``ulimit -n 64``, several tiers), opening a shard's
    partial copy failed with EMFILE inside the chain's look for it, and the read died with
    a bare ``OSError: Too many open files`` though the origin could serve it. The tier's
    placement stops, saying the limit and how to raise it; the reads go on, right."""
    from stagefs.tiers import chain as chain_mod

    pack, files = dataset

    def no_descriptor(final: str, *_a: object, **_k: object) -> None:
        raise OSError(errno.EMFILE, "Too many open files", final + ".partial")

    monkeypatch.setattr(chain_mod, "open_fill", no_descriptor)
    with caplog.at_level("WARNING", logger="stagefs"), \
            stagefs.open(pack, tiers=[f"{tmp_path / 't0'}:64MiB"]) as fs:
        epoch(fs, files, 4)
        [tier] = fs.status()["tiers"]
    assert tier["stopped"] == "open-file limit reached"
    said = [r.getMessage() for r in caplog.records if "placement into it stopped" in r.message]
    assert said and "open-file limit" in said[0] and "ulimit -n" in said[0]


def test_a_memory_tier_over_the_job_s_memory_limit_is_warned_of_when_the_store_opens(
        dataset: tuple[Path, dict[str, bytes]], tmp_path: Path, runtime: Path,
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """A memory tier larger than the job's memory limit leaves (Slurm's --mem; /dev/shm
    itself is larger) filled until the kernel killed the job, with no word of why: its
    pages are charged to the job's control group and never given back. Opening the store
    says so, naming the tier, the room left and what to do; the reads are right."""
    from stagefs.tiers import tier as tier_mod

    pack, files = dataset
    monkeypatch.setattr(tier_mod, "fs_type", lambda _p: "tmpfs")
    monkeypatch.setattr(tier_mod, "memory_limit_room", lambda: 1 << 20)
    for capacity, warned in (("64MiB", True), ("512KiB", False)):
        caplog.clear()
        tier = tmp_path / f"t-{capacity}"
        with caplog.at_level("WARNING", logger="stagefs"), \
                stagefs.open(pack, tiers=[f"{tier}:{capacity}"]) as fs:
            assert fs.status()["tiers"][0]["kind"] == "memory"
            epoch(fs, files, 5)
        said = [r.getMessage() for r in caplog.records if "memory limit" in r.message]
        assert bool(said) == warned, said
        if warned:
            assert f"memory tier {tier}" in said[0] and "leaves (1.0 MiB)" in said[0]
            assert "--mem" in said[0]


def test_a_tier_directory_removed_mid_epoch(
        dataset: tuple[Path, dict[str, bytes]], tmp_path: Path, runtime: Path,
        caplog: pytest.LogCaptureFixture) -> None:
    """``rm -rf`` of the tier directory while the job reads: the reads go on, right; the
    tier's used bytes were its room counter's, the copies it held before (what the node
    daemon's ``stagefs status`` shows too), and its stop reason and warning the raw errno
    of one partial copy's path. Now it holds nothing, and one warning says the directory
    was removed."""
    import shutil

    pack, files = dataset
    tier = tmp_path / "t0"
    names = sorted(files)
    with caplog.at_level("WARNING", logger="stagefs"), \
            stagefs.open(pack, tiers=[f"{tier}:64MiB"]) as fs:
        for p in names[: len(names) // 3]:
            assert fs.read(p) == files[p]
        assert fs.status()["tiers"][0]["bytes_used"] > 0
        while tier.exists():  # as rm -rf: the streams make and rename copies meanwhile
            shutil.rmtree(tier, ignore_errors=True)
        epoch(fs, files, 5)
        assert fs.read_many(names) == [files[p] for p in names]
        [t] = fs.status()["tiers"]
    assert t["bytes_used"] == 0
    assert t["stopped"] is not None and "removed" in t["stopped"] and str(tier) in t["stopped"]
    said = [r.getMessage() for r in caplog.records if "placement stopped" in r.getMessage()]
    assert len(said) == 1 and "Errno" not in said[0], said


def test_a_tier_removed_while_its_lock_is_taken_says_it_was_removed(
        dataset: tuple[Path, dict[str, bytes]], tmp_path: Path, runtime: Path,
        caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    """A removal under way (``rm -rf``) can take the lock's folder away again just after
    the lock made it anew, and the lock says EEXIST: placement stopped with the raw errno
    (CI, under load) instead of saying the tier was removed."""
    import contextlib
    import shutil

    import stagefs.tiers.chain as chain_module

    pack, files = dataset
    tier = tmp_path / "t0"
    names = sorted(files)
    real = chain_module.file_lock
    raced: list[str] = []
    calls = [0]

    @contextlib.contextmanager
    def racing(path: str, timeout: float = -1) -> Any:
        calls[0] += 1
        if calls[0] == 3:  # a copy or two made, more to come
            raced.append(path)
            shutil.rmtree(tier)  # the removal, with the lock's folder just made and gone
            raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST),
                                  os.path.dirname(path))
        with real(path, timeout):
            yield

    monkeypatch.setattr(chain_module, "file_lock", racing)
    with caplog.at_level("WARNING", logger="stagefs"), \
            stagefs.open(pack, tiers=[f"{tier}:64MiB"]) as fs:
        assert fs.read_many(names) == [files[p] for p in names]
        epoch(fs, files, 6)
        [t] = fs.status()["tiers"]
    assert raced
    assert t["stopped"] is not None and "removed" in t["stopped"], t
    said = [r.getMessage() for r in caplog.records if "placement stopped" in r.getMessage()]
    assert len(said) == 1 and "Errno" not in said[0], said


def test_a_full_tier_removed_mid_epoch_says_it_was_removed(
        dataset: tuple[Path, dict[str, bytes]], tmp_path: Path, runtime: Path) -> None:
    """A tier that had stopped (full) and was then removed (``rm -rf``): its status went on
    saying "full", holding 0 B, for the rest of the job; nothing tried to place into it
    again to find out. Now it says the directory was removed."""
    import shutil

    pack, files = dataset
    tier = tmp_path / "t0"
    names = sorted(files)
    with stagefs.open(pack, tiers=[f"{tier}:160KiB"]) as fs:  # about half the dataset
        assert fs.read_many(names) == [files[p] for p in names]
        assert fs.chain is not None and fs.chain.stage() is not None
        [t] = fs.status()["tiers"]
        assert t["stopped"] == "full", t
        shutil.rmtree(tier)
        assert fs.read_many(names) == [files[p] for p in names]
        [t] = fs.status()["tiers"]
    assert t["bytes_used"] == 0
    assert t["stopped"] is not None and "removed" in t["stopped"] and str(tier) in t["stopped"]


def test_a_tier_s_contents_removed_mid_epoch(
        dataset: tuple[Path, dict[str, bytes]], tmp_path: Path, runtime: Path,
        caplog: pytest.LogCaptureFixture) -> None:
    """``rm -rf TIER/*`` while the job reads (a cleanup of /dev/shm that leaves the tier's
    root): the reads go on, right; the tier's stop reason and warning were the raw errno of
    one partial copy's path and it went on counting the copies that were gone as used (its
    room counter's). Now it holds nothing, and one warning names the directory removed."""
    import shutil

    pack, files = dataset
    tier = tmp_path / "t0"
    names = sorted(files)
    with caplog.at_level("WARNING", logger="stagefs"), \
            stagefs.open(pack, tiers=[f"{tier}:64MiB"]) as fs:
        sub = tier / fs.manifest.pack_id.hex()  # this dataset's copies
        for p in names[: len(names) // 3]:
            assert fs.read(p) == files[p]
        assert fs.status()["tiers"][0]["bytes_used"] > 0
        while any(tier.iterdir()):  # the streams make and rename copies meanwhile
            for d in tier.iterdir():
                shutil.rmtree(d, ignore_errors=True)
        epoch(fs, files, 5)
        assert fs.read_many(names) == [files[p] for p in names]
        [t] = fs.status()["tiers"]
    assert tier.is_dir()
    assert t["bytes_used"] == 0
    assert t["stopped"] is not None and "removed" in t["stopped"]
    assert str(sub) in t["stopped"]
    said = [r.getMessage() for r in caplog.records if "placement stopped" in r.getMessage()]
    assert len(said) == 1 and "Errno" not in said[0], said


def test_a_tier_another_process_creates_meanwhile_is_not_called_a_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Three forked workers opening the same new tier at once: one looked (no directory
    yet), another created it, and the first, looking again, said "is a file, not a
    directory" and failed (a CI run of ``test_processes_share_tiers``). The tier is looked
    at once: made meanwhile, it is a directory to use."""
    from stagefs.tiers import tier as tier_mod

    path = tmp_path / "mem"
    real_stat = os.stat
    looked = []

    def stat_then_made(p: Any, *a: Any, **kw: Any) -> os.stat_result:
        if os.fspath(p) == str(path):
            looked.append(p)
            if len(looked) == 2:  # nothing there at the look that decides ...
                os.mkdir(path)  # ... and another process of the job makes it right after
                raise FileNotFoundError(errno.ENOENT, "No such file or directory", str(p))
        return real_stat(p, *a, **kw)

    monkeypatch.setattr(os, "stat", stat_then_made)
    # (the first look is movable_by_others', whether the tier or its parent is to be asked)
    assert tier_mod.tier_dir_problem(str(path)) is None
    tier_mod.prepare_tier_dir(str(path))
    assert path.is_dir()
