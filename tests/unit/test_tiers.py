"""Node-local tiers: one suite run against every tier kind (memory, disk), the chain's
placement (claims, capacity, ENOSPC, corruption), the origins as ShardSources, bad input."""

from __future__ import annotations

import logging
import os
import random
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

import stagefs
from conftest import small_tmpfs
from stagefs.config import parse_tier
from stagefs.errors import ConfigError, OriginUnavailableError
from stagefs.format import MANIFEST_NAME, Manifest
from stagefs.format.spec import SHARD_HEADER
from stagefs.runtime import Runtime
from stagefs.tiers.base import ShardSource
from stagefs.tiers.claims import Claims
from stagefs.tiers.inplace import InPlaceOrigin
from stagefs.tiers.origin import PackOrigin
from tiers_helpers import make_tree

# ------------------------------------------------------------------------------ data


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, dict[str, bytes]]:
    base = tmp_path_factory.mktemp("tiers")
    files = make_tree(base / "raw")
    stagefs.pack(base / "raw", base / "pack", shard_size="64KiB", jobs=1, progress=False,
                 echo=lambda _m: None)
    return base / "raw", base / "pack", files


@pytest.fixture
def pack(dataset: tuple[Path, Path, dict[str, bytes]]) -> Path:
    return dataset[1]


@pytest.fixture
def files(dataset: tuple[Path, Path, dict[str, bytes]]) -> dict[str, bytes]:
    return dataset[2]


def shuffled(files: dict[str, bytes], seed: int = 0) -> list[str]:
    paths = sorted(files)
    random.Random(seed).shuffle(paths)
    return paths


def read_all(fs: stagefs.Store, files: dict[str, bytes], seed: int = 0) -> None:
    for p in shuffled(files, seed):
        assert fs.read(p) == files[p], p


# ------------------------------------------------------------- one suite, every tier kind


@pytest.fixture(params=["memory", "disk"])
def tier_dir(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Path]:
    if request.param == "memory":
        if not os.access("/dev/shm", os.W_OK):
            pytest.skip("no writable /dev/shm on this machine")
        d = Path("/dev/shm") / f"stagefs-test-{uuid.uuid4().hex[:8]}"
    else:
        d = tmp_path / "disk-tier"
    yield d
    shutil.rmtree(d, ignore_errors=True)


class TestTier:
    """Every tier kind: layout, reads, capacity, corruption, partial files."""

    def test_kind(self, pack: Path, tier_dir: Path, runtime: Path) -> None:
        with stagefs.open(pack, tiers=[str(tier_dir)]) as fs:
            assert fs.chain is not None
            kind = fs.chain.tiers[0].kind
        assert kind == ("memory" if str(tier_dir).startswith("/dev/shm") else "disk")

    def test_staged_shards_are_the_pack_shards(self, pack: Path, tier_dir: Path,
                                                runtime: Path) -> None:
        with stagefs.open(pack, tiers=[str(tier_dir)]) as fs:
            assert fs.chain is not None
            counts = fs.chain.stage()
            pid = fs.manifest.pack_id.hex()
            assert counts == {"placed": len(fs.manifest.shards)}
            assert fs.held_shards() == set(range(len(fs.manifest.shards)))
            for s in fs.manifest.shards:
                assert (tier_dir / pid / s.name).read_bytes() == (pack / s.name).read_bytes()
            assert not list((tier_dir / pid).glob("*.partial"))

    def test_later_epochs_read_locally(self, pack: Path, files: dict[str, bytes],
                                       tier_dir: Path, runtime: Path) -> None:
        with stagefs.open(pack, tiers=[f"{tier_dir}:1GiB"]) as fs:
            assert fs.chain is not None
            read_all(fs, files, seed=1)  # epoch 1: misses, placed in the background
            assert fs.chain.wait_idle(30)
            before = fs.origin.stats.as_dict()
            read_all(fs, files, seed=2)
            after = fs.origin.stats.as_dict()
            st = fs.status()
        assert after == before  # not one origin operation in epoch 2
        assert st["tiers"][0]["shards_held"] == st["shards"]
        assert st["tiers"][0]["hits"] >= sum(1 for d in files.values() if d)
        # one open per shard in the whole run, no stat
        assert after["opens"] == st["shards"] and after["stats"] == 0

    def test_capacity_holds_what_fits_and_stays(self, pack: Path, files: dict[str, bytes],
                                                tier_dir: Path, runtime: Path) -> None:
        shard_sizes = sorted(os.path.getsize(p) for p in pack.glob("shard-*.sfs"))
        cap = sum(shard_sizes) // 2
        with stagefs.open(pack, tiers=[f"{tier_dir}:{cap}"]) as fs:
            assert fs.chain is not None
            read_all(fs, files, seed=1)
            fs.chain.wait_idle(30)
            held = fs.held_shards()
            used = fs.status()["tiers"][0]["bytes_used"]
            assert 0 < len(held) < len(shard_sizes) and used <= cap
            assert fs.chain.tiers[0].stopped == "full"
            m = fs.manifest
            t = fs.chain.tiers[0]
            hits0, misses0 = t.stats.hits, fs.chain.misses
            read_all(fs, files, seed=2)
            read_all(fs, files, seed=3)
            assert fs.held_shards() == held  # no eviction: the held set stays put
            hits, misses = t.stats.hits - hits0, fs.chain.misses - misses0
            nonempty = [p for p in files if files[p]]
            in_held = sum(1 for p in nonempty if m.shard[fs.namespace.file_entry(p)] in held)
            assert hits == 2 * in_held and hits + misses == 2 * len(nonempty)

    def test_corrupt_copy_is_dropped_and_counted(self, pack: Path, files: dict[str, bytes],
                                                 tier_dir: Path, runtime: Path) -> None:
        with stagefs.open(pack, tiers=[str(tier_dir)]) as fs:
            assert fs.chain is not None
            fs.chain.stage()
            path = next(p for p in sorted(files) if len(files[p]) > 100)
            e = fs.namespace.file_entry(path)
            shard = fs.manifest.shard[e]
            copy = fs.chain.tiers[0].path(shard)
            with open(copy, "r+b") as f:  # flip one byte of the file's stored bytes
                f.seek(fs.manifest.offset[e] + 5)
                b = f.read(1)
                f.seek(-1, 1)
                f.write(bytes([b[0] ^ 0xFF]))
            assert fs.read(path) == files[path]  # right bytes, from the origin
            assert fs.chain.tiers[0].stats.dropped == 1
            assert fs.stats.checksum_failures == 1
            assert not os.path.exists(copy) or fs.chain.wait_idle(30)
            fs.chain.wait_idle(30)
            # placed again from the origin, verified, and read locally
            assert shard in fs.held_shards()
            assert fs.read(path) == files[path]

    def test_partial_file_is_never_held(self, pack: Path, files: dict[str, bytes],
                                        tier_dir: Path, runtime: Path) -> None:
        m = Manifest(str(pack / MANIFEST_NAME))
        pid = m.pack_id.hex()
        name = m.shards[0].name
        m.close()
        (tier_dir / pid).mkdir(parents=True)
        (tier_dir / pid / (name + ".partial")).write_bytes((pack / name).read_bytes()[:100])
        with stagefs.open(pack, tiers=[str(tier_dir)]) as fs:
            assert fs.held_shards() == set()
            assert fs.chain is not None and not fs.chain.tiers[0].holds(0)
            read_all(fs, files)

    def test_truncated_copy_is_not_served(self, pack: Path, files: dict[str, bytes],
                                          tier_dir: Path, runtime: Path) -> None:
        with stagefs.open(pack, tiers=[str(tier_dir)]) as fs:
            assert fs.chain is not None
            fs.chain.stage()
            pid = fs.manifest.pack_id.hex()
        for s in (tier_dir / pid).glob("shard-*.sfs"):
            os.truncate(s, 200)
        with stagefs.open(pack, tiers=[str(tier_dir)]) as fs:
            read_all(fs, files)


# ---------------------------------------------------------------- sources (tiers, origins)


def _sources(pack: Path, raw: Path, kind: str, tmp: Path) -> tuple[ShardSource, Manifest]:
    if kind == "pack-origin":
        m = Manifest(str(pack / MANIFEST_NAME))
        return PackOrigin(str(pack), m), m
    rt = Runtime(tmp / "rt").open()
    from stagefs.inplace import open_manifest

    m, _, _ = open_manifest(str(raw), rt, shard_size=50_000)
    return InPlaceOrigin(str(raw), m), m


@pytest.mark.parametrize("kind", ["pack-origin", "inplace-origin"])
def test_origin_sources_serve_shard_ranges(kind: str, dataset: tuple[Path, Path,
                                                                     dict[str, bytes]],
                                           tmp_path: Path) -> None:
    raw, pack, files = dataset
    src, m = _sources(pack, raw, kind, tmp_path)
    assert isinstance(src, ShardSource)
    try:
        rng = random.Random(5)
        for _ in range(50):
            shard = rng.randrange(len(m.shards))
            size = m.shards[shard].size
            off = rng.randrange(size)
            n = rng.randint(0, size - off)
            whole = src.pread(shard, 0, size)
            assert src.pread(shard, off, n) == whole[off : off + n]
        for e in m.files():
            if m.codec[e] == 0 and m.size[e]:
                data = src.pread(m.shard[e], m.offset[e], m.stored[e])
                assert data == files[os.fsdecode(m.path_of(e))]
    finally:
        src.close()
        m.close()


def test_inplace_origin_counts_a_read_per_file(dataset: tuple[Path, Path, dict[str, bytes]],
                                               tmp_path: Path) -> None:
    """A range of an in-place shard is one read (and one open) of each file it covers, as
    the origin's counters say (`stagefs status`): a stream's run of many files was counted
    one read (184 reads for the 2,019 a first epoch made)."""
    raw, pack, _files = dataset
    src, m = _sources(pack, raw, "inplace-origin", tmp_path)
    try:
        shard = max(range(len(m.shards)), key=lambda k: len(src._files(k)[0]))
        files = sum(1 for e in src._files(shard)[0] if m.stored[e])
        assert files > 1
        src.pread(shard, 0, m.shards[shard].size)
        assert (src.stats.reads, src.stats.opens) == (files, files)
    finally:
        src.close()
        m.close()


# -------------------------------------------------------------------- placement, faults


def test_enospc_stops_the_tier_and_reads_go_on(pack: Path, files: dict[str, bytes],
                                               runtime: Path, tmp_path: Path) -> None:
    with small_tmpfs(tmp_path / "tiny", "160k") as mnt, \
            stagefs.open(pack, tiers=[str(mnt / "t")]) as fs:  # no cap: the device fills
        assert fs.chain is not None
        read_all(fs, files, seed=1)
        fs.chain.wait_idle(30)
        t = fs.chain.tiers[0]
        assert t.stopped == "no space left on device"
        assert 0 < len(fs.held_shards()) < len(fs.manifest.shards)
        assert not list(Path(t.dir).glob("*.partial"))
        read_all(fs, files, seed=2)


def test_tiers_in_order_then_the_origin(pack: Path, files: dict[str, bytes], runtime: Path,
                                        tmp_path: Path) -> None:
    sizes = sorted(os.path.getsize(p) for p in pack.glob("shard-*.sfs"))
    fast = f"{tmp_path / 'fast'}:{sizes[-1] + 1}"  # room for one shard
    with stagefs.open(pack, tiers=[fast, str(tmp_path / "slow")]) as fs:
        assert fs.chain is not None
        fs.chain.stage()
        a, b = fs.chain.tiers
        assert len(a.held()) == 1 and len(b.held()) == len(sizes) - 1
        assert not a.held() & b.held()
        read_all(fs, files)
        assert a.stats.hits > 0 and b.stats.hits > 0 and fs.chain.misses == 0


def test_origin_disappears_mid_epoch(dataset: tuple[Path, Path, dict[str, bytes]],
                                     runtime: Path, tmp_path: Path) -> None:
    files = dataset[2]
    pack = tmp_path / "pack"
    shutil.copytree(dataset[1], pack)
    with stagefs.open(pack, tiers=[str(tmp_path / "t")]) as fs:
        assert fs.chain is not None
        n = len(fs.manifest.shards)
        fs.chain.stage(range(n // 2))
        held = fs.held_shards()
        shutil.rmtree(pack)
        gone = 0
        for p in shuffled(files):
            e = fs.namespace.file_entry(p)
            if not files[p]:
                continue
            if fs.manifest.shard[e] in held:
                assert fs.read(p) == files[p]
            else:
                with pytest.raises(OriginUnavailableError, match=str(pack)):
                    fs.read(p)
                gone += 1
        assert gone > 0


def test_claims_one_owner_and_dead_owner_taken_over(tmp_path: Path) -> None:
    a, b = Claims(str(tmp_path), "p"), Claims(str(tmp_path), "p")
    assert a.acquire(3)
    b.pid = os.getpid()  # the same live process: a live claim is never taken
    assert not b.acquire(3)
    a.release(3)
    assert b.acquire(3)
    # a claim left by a dead process is taken over
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, timeout=60).stdout.strip()
    Path(a.path(7)).write_text(f"{dead} 1")
    assert a.acquire(7) and a.takeovers == 1
    assert a.owner(7) == (os.getpid(), int(a.me.split()[1]))


def test_tier_errors(pack: Path, runtime: Path, tmp_path: Path,
                     caplog: pytest.LogCaptureFixture) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(ConfigError, match=str(blocker / "tier")):
        stagefs.open(pack, tiers=[str(blocker / "tier")])
    with pytest.raises(ConfigError, match="larger than its device"):
        stagefs.open(pack, tiers=[f"{tmp_path}/t:1000TiB"])
    with pytest.raises(ConfigError, match="twice"):
        stagefs.open(pack, tiers=[str(tmp_path / "t"), str(tmp_path / "t")])
    # a missing directory right under / is most likely a typo: an error naming it, and
    # nothing is created
    typo = f"/stagefs-no-such-dir-{os.getpid()}"
    with pytest.raises(ConfigError, match=f"{typo} does not exist.*mkdir -p {typo}/new"):
        stagefs.open(pack, tiers=[f"{typo}/new/deeper"])
    assert not os.path.exists(typo)
    # deeper down, missing parents are created, and the log says so
    with caplog.at_level(logging.WARNING, logger="stagefs"), \
            stagefs.open(pack, tiers=[str(tmp_path / "new" / "deeper")]) as fs:
        assert fs.chain is not None
    assert (tmp_path / "new" / "deeper").is_dir()
    assert any("created its parent directories" in r.getMessage() and
               str(tmp_path / "new") in r.getMessage() for r in caplog.records)


def test_tier_not_writable(pack: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to switch to another user")
    import tempfile

    base = Path(tempfile.mkdtemp(prefix="stagefs-ro-", dir="/tmp"))
    try:
        os.chmod(base, 0o755)
        shutil.copytree(pack, base / "pack")
        ro = base / "ro"
        ro.mkdir(mode=0o755)
        code = (
            "import os, stagefs\n"
            "os.setgid(65534); os.setuid(65534)\n"
            "try:\n"
            f"    stagefs.open({str(base / 'pack')!r}, tiers=[{str(ro)!r}],"
            " runtime='/tmp/stagefs-ro-rt-' + str(os.getpid()))\n"
            "except stagefs.ConfigError as e:\n"
            "    print('ConfigError', e)\n"
        )
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           timeout=60)
        assert "ConfigError" in r.stdout and str(ro) in r.stdout, r.stdout + r.stderr
        assert "not writable" in r.stdout, r.stdout
    finally:
        shutil.rmtree(base, ignore_errors=True)
        for d in Path("/tmp").glob("stagefs-ro-rt-*"):
            shutil.rmtree(d, ignore_errors=True)


def test_tiers_from_the_environment(pack: Path, files: dict[str, bytes], runtime: Path,
                                    tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STAGEFS_TIERS", f"{tmp_path / 'a'}:1MiB,{tmp_path / 'b'}")
    with stagefs.open(pack) as fs:
        assert fs.chain is not None
        assert [t.root for t in fs.chain.tiers] == [str(tmp_path / "a"), str(tmp_path / "b")]
        assert fs.chain.tiers[0].capacity == 2**20
    monkeypatch.delenv("STAGEFS_TIERS")
    with stagefs.open(pack) as fs:
        assert fs.chain is None and fs.held_shards() == set()
        fs.prefetch([0, 1])  # a no-op without tiers
        assert fs.status()["tiers"] == []


def test_prefetch_places_in_order(pack: Path, runtime: Path, tmp_path: Path) -> None:
    with stagefs.open(pack, tiers=[str(tmp_path / "t")]) as fs:
        assert fs.chain is not None
        fs.prefetch([2, 0])
        assert fs.chain.wait_idle(30)
        assert fs.held_shards() == {0, 2}
        # each stored byte once; the headers follow from the manifest and are not read
        assert fs.chain.origin.stats.bytes_read == sum(
            fs.manifest.shards[i].size - SHARD_HEADER.size for i in (0, 2))


def test_pickled_store_reopens_with_its_tiers(pack: Path, files: dict[str, bytes],
                                              runtime: Path, tmp_path: Path) -> None:
    import pickle

    with stagefs.open(pack, tiers=[f"{tmp_path / 't'}:1GiB"], runtime=runtime) as fs:
        fs2 = pickle.loads(pickle.dumps(fs))
        try:
            assert fs2.chain is not None
            assert [t.root for t in fs2.chain.tiers] == [str(tmp_path / "t")]
            read_all(fs2, files)
        finally:
            fs2.close()


def test_parse_tier_capacity() -> None:
    assert parse_tier("/tmp/x:1MiB").capacity == 2**20
    assert parse_tier("/tmp/x").capacity is None
    assert parse_tier("/tmp/a:b/c").path == "/tmp/a:b/c"
    assert parse_tier("/tmp/x:v2:1MiB").path == "/tmp/x:v2"  # a colon in a name is kept


@pytest.mark.parametrize("spec, says", [
    ("/tmp/x:", "no capacity after ':'"),  # DIR:$SIZE with SIZE unset
    ("/tmp/x: ", "no capacity after ':'"),
    ("/tmp/x:1MiB:2", "two capacities"),
    ("/tmp/x:50%:1GiB", "two capacities"),
])
def test_a_tier_spec_with_an_empty_or_second_capacity_is_refused(spec: str, says: str) -> None:
    """A tier named "/tmp/x:" (no limit) or "/tmp/x:1MiB" of 2 bytes was made silently."""
    with pytest.raises(ConfigError, match=says):
        parse_tier(spec)


def test_a_tier_smaller_than_a_piece_is_warned_of(pack: Path, runtime: Path, tmp_path: Path,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    """A tier below one piece of placement holds nothing: said when the store opens, and
    by the doctor (which knows no dataset: a piece of 1 MiB, a large dataset's), instead of
    an INFO line once it is found full. The piece is the dataset's (a small one's is
    smaller: ``placement_piece``)."""
    from stagefs.doctor import check_tier
    from stagefs.tiers.fill import placement_piece

    with stagefs.open(pack) as probe:
        piece = placement_piece(probe.manifest)
    with caplog.at_level(logging.WARNING, logger="stagefs"), \
            stagefs.open(pack, tiers=[f"{tmp_path / 'small'}:{piece // 2}",
                                      f"{tmp_path / 'big'}:64MiB"]) as fs:
        assert fs.chain is not None
    said = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("small" in m and "less than one piece" in m for m in said), said
    assert not any("big" in m for m in said), said
    (finding,) = check_tier(f"{tmp_path / 'small'}:512KiB")
    assert finding.status == "warn" and "less than one piece" in finding.meaning
    assert check_tier(f"{tmp_path / 'big'}:64MiB")[0].status == "ok"
    # one piece exactly holds nothing either: a copy's header takes blocks of its own
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="stagefs"), \
            stagefs.open(pack, tiers=[f"{tmp_path / 'onepiece'}:{piece}"]):
        pass
    assert any("onepiece" in r.getMessage() and "less than one piece" in r.getMessage()
               for r in caplog.records), caplog.records
    assert check_tier(f"{tmp_path / 'onepiece'}:1MiB")[0].status == "warn"


def test_a_tier_given_as_a_share_keeps_its_capacity_when_opened_again(
        pack: Path, files: dict[str, bytes], runtime: Path, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A tier of 50% of its file system's free space: what it holds is no longer free, so a
    store opened again with the tier kept (a job restarted, a rank that opens it later) took
    50% of what was left, and held less than asked. The share is of the free space and what
    the tier holds already."""
    from stagefs.tiers.tier import dir_bytes

    tier = tmp_path / "t"
    size = 64 * 2**20
    real = shutil.disk_usage

    def usage(path: str) -> shutil._ntuple_diskusage:  # 64 MiB, holding the tier alone
        used = dir_bytes(str(tier))
        return real(path)._replace(total=size, used=used, free=size - used)

    monkeypatch.setattr(shutil, "disk_usage", usage)
    with stagefs.open(pack, tiers=[f"{tier}:50%"]) as fs:
        assert fs.chain is not None
        first = fs.chain.tiers[0].capacity
        read_all(fs, files)
        fs.chain.wait_idle(60)
    assert first == size // 2
    assert dir_bytes(str(tier)) > 0
    with stagefs.open(pack, tiers=[f"{tier}:50%"]) as fs:
        assert fs.chain is not None
        assert fs.chain.tiers[0].capacity == first


@pytest.mark.parametrize("chunk", [777, 4096])
def test_placement_verifies_files_across_read_chunks(chunk: int, pack: Path,
                                                     files: dict[str, bytes], runtime: Path,
                                                     tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Files (raw and zstd) that straddle the copy's read chunks are checked all the same."""
    import stagefs.tiers.placer as placer

    monkeypatch.setattr(placer, "CHUNK", chunk)
    with stagefs.open(pack, tiers=[str(tmp_path / "t")]) as fs:
        assert fs.chain is not None
        assert fs.chain.stage() == {"placed": len(fs.manifest.shards)}
        read_all(fs, files)
    # a byte flipped at the origin is caught while copying: that shard is not placed
    bad = tmp_path / "bad"
    shutil.copytree(pack, bad)
    victim = sorted(bad.glob("shard-*.sfs"))[1]
    raw = bytearray(victim.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    victim.write_bytes(bytes(raw))
    with stagefs.open(bad, tiers=[str(tmp_path / "t2")]) as fs:
        assert fs.chain is not None
        counts = fs.chain.stage()
        assert counts == {"placed": len(fs.manifest.shards) - 1, "failed": 1}
        assert 1 not in fs.held_shards()
        assert not list((tmp_path / "t2").glob("*/*.partial"))
