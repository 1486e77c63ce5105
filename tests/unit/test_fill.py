"""Reads fill the tiers (tiers/fill.py): every verified origin read also lands in the shard's
shared partial copy, the placer copies only what no read brought in, and every origin byte
is read once."""

from __future__ import annotations

import multiprocessing
import os
import random
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

import stagefs
from stagefs.format import MANIFEST_NAME, Manifest
from stagefs.runtime import Runtime, proc_start
from stagefs.tiers.fill import Extents
from stagefs.tiers.status import job_status
from tiers_helpers import packed_tree


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, bytes]]:
    return packed_tree(tmp_path_factory.mktemp("fill"), n=160)


@pytest.fixture
def pack(dataset: tuple[Path, dict[str, bytes]]) -> Path:
    return dataset[0]


@pytest.fixture
def files(dataset: tuple[Path, dict[str, bytes]]) -> dict[str, bytes]:
    return dataset[1]


@pytest.fixture
def placer_elsewhere(pack: Path, runtime: Path) -> Iterator[None]:
    """Every shard's claim held by another live process (the parent of this one), as when
    another process of the node is placing them: this process's placer copies nothing,
    so only the reads fill the tier."""
    m = Manifest(str(pack / MANIFEST_NAME))
    hold_claims(runtime, m.pack_id.hex(), len(m.shards))
    m.close()
    yield


def hold_claims(runtime: Path, pack_id: str, shards: int) -> list[Path]:
    """Claim every shard for another live process (this one's parent); the claim files."""
    claims = runtime / "claims"
    claims.mkdir(parents=True, exist_ok=True)
    owner = f"{os.getppid()} {proc_start(os.getppid())}"
    held = [claims / f"{pack_id}.{s}" for s in range(shards)]
    for c in held:
        c.write_text(owner)
    return held


def stored_bytes(fs: stagefs.Store, paths: list[str]) -> int:
    m = fs.manifest
    return sum(int(m.stored[fs.namespace.file_entry(p)]) for p in paths)


def shuffled(files: dict[str, bytes], seed: int = 0) -> list[str]:
    paths = sorted(files)
    random.Random(seed).shuffle(paths)
    return paths


def leftovers(tier: Path) -> list[Path]:
    return sorted(p for p in tier.rglob("*") if p.suffix in (".partial", ".fill"))


def test_extents_tile_every_packed_shard(pack: Path) -> None:
    m = Manifest(str(pack / MANIFEST_NAME))
    try:
        from stagefs.tiers.placer import Layout

        lay = Layout(m)
        for s, info in enumerate(m.shards):
            ext = Extents.of(m, lay.idx[lay.bounds[s] : lay.bounds[s + 1]], info.size)
            assert ext.tiles, s
            assert int(ext.ends[-1]) == info.size
    finally:
        m.close()


def test_a_piece_added_is_charged_what_the_whole_count_grows_by() -> None:
    """``Extents.added`` (one piece's charge, counted alone at each reservation) equals what
    ``charged`` of the whole copy grows by, whatever the pieces held beside it, their ends
    against the blocks, and the block size."""
    import numpy as np

    rng = random.Random(3)
    for _ in range(3000):
        n = rng.randint(1, 12)
        sizes = [rng.choice([rng.randint(1, 20000), 4096 * rng.randint(1, 4)]) for _ in range(n)]
        offs = np.cumsum([64, *sizes[:-1]]).astype(np.int64)
        ends = offs + np.array(sizes, np.int64)
        ext = Extents(offs, ends, np.arange(n, dtype=np.int64), -np.ones(n, np.int64), True,
                      np.arange(n, dtype=np.int64), np.arange(n + 1, dtype=np.int64))
        block = rng.choice([512, 4096, 8192])
        held = np.array([rng.random() < 0.5 for _ in range(n)], bool)
        p = rng.randrange(n)
        grown = held.copy()
        grown[p] = True
        want = ext.charged(grown, block) - ext.charged(held, block)
        assert ext.added(held.astype(np.uint8), p, block) == want, (sizes, held, p, block)
        if not held.any():
            assert ext.added(None, p, block) == want


def test_reads_alone_fill_the_tier(pack: Path, files: dict[str, bytes], runtime: Path,
                                   tmp_path: Path, placer_elsewhere: None) -> None:
    tier = tmp_path / "t"
    paths = shuffled(files)
    with stagefs.open(pack, tiers=[str(tier)]) as fs:
        assert fs.chain is not None
        for p in paths:
            assert fs.read(p) == files[p], p
        origin = fs.chain.origin.stats
        # every stored byte read once from the origin, headers never
        assert origin.bytes_read == stored_bytes(fs, paths)
        assert fs.held_shards() == set(range(len(fs.manifest.shards)))
        t = fs.chain.tiers[0].stats
        assert t.placed == len(fs.manifest.shards)
        assert t.filled == sum(1 for p in paths if files[p])
        assert leftovers(tier) == []
        # the copies are the pack's shards, byte for byte
        pid = fs.manifest.pack_id.hex()
        for s in fs.manifest.shards:
            assert (tier / pid / s.name).read_bytes() == (pack / s.name).read_bytes()
        before = origin.bytes_read
        for p in shuffled(files, 1):
            assert fs.read(p) == files[p], p
        assert origin.bytes_read == before


def test_batched_reads_fill_too(pack: Path, files: dict[str, bytes], runtime: Path,
                                tmp_path: Path, placer_elsewhere: None) -> None:
    paths = sorted(files)  # in pack order: read_many coalesces adjacent files into one read
    with stagefs.open(pack, tiers=[str(tmp_path / "t")]) as fs:
        assert fs.chain is not None
        for k in range(0, len(paths), 16):
            batch = paths[k : k + 16]
            assert fs.read_many(batch) == [files[p] for p in batch]
        assert fs.held_shards() == set(range(len(fs.manifest.shards)))
        assert fs.chain.origin.stats.bytes_read == stored_bytes(fs, paths)


def _read_some(pack: str, tier: str, runtime: str, paths: list[str]) -> None:
    os.environ["STAGEFS_RUNTIME"] = runtime
    with stagefs.open(pack, tiers=[tier]) as fs:
        for p in paths:
            fs.read(p)


def read_in_another_process(pack: Path, tier: Path, runtime: Path, paths: list[str]) -> None:
    """Another process of the job (spawned) opens the store with the tier and reads these."""
    child = multiprocessing.get_context("spawn").Process(
        target=_read_some, args=(str(pack), str(tier), str(runtime), paths))
    child.start()
    child.join(60)
    assert child.exitcode == 0


def test_another_process_reads_what_one_filled(pack: Path, files: dict[str, bytes],
                                               runtime: Path, tmp_path: Path,
                                               placer_elsewhere: None) -> None:
    tier = tmp_path / "t"
    paths = shuffled(files, 2)
    half = paths[: len(paths) // 2]
    read_in_another_process(pack, tier, runtime, half)
    assert leftovers(tier)  # partial copies, shared through the tier
    (row,) = job_status(Runtime(str(runtime)))["tiers"]  # what `stagefs status` shows
    assert row["shards_filling"] > 0 and row["filled"] == sum(1 for p in half if files[p])
    with stagefs.open(pack, tiers=[str(tier)]) as fs:
        assert fs.chain is not None
        for p in paths:
            assert fs.read(p) == files[p], p
        # what the other process read came from the partial copies, not the origin
        assert fs.chain.origin.stats.bytes_read == stored_bytes(fs, paths[len(half):])
        assert fs.held_shards() == set(range(len(fs.manifest.shards)))
    assert leftovers(tier) == []


def test_the_placer_copies_only_the_gaps(pack: Path, files: dict[str, bytes], runtime: Path,
                                         tmp_path: Path) -> None:
    tier = tmp_path / "t"
    paths = shuffled(files, 3)
    half = paths[: len(paths) // 3]
    # a process whose placer is kept off by live claims reads a third of the files ...
    m = Manifest(str(pack / MANIFEST_NAME))
    held = hold_claims(runtime, m.pack_id.hex(), len(m.shards))
    m.close()
    read_in_another_process(pack, tier, runtime, half)
    for c in held:
        c.unlink()
    # ... then staging copies only the rest
    with stagefs.open(pack, tiers=[str(tier)]) as fs:
        assert fs.chain is not None
        assert fs.chain.stage() == {"placed": len(fs.manifest.shards)}
        assert fs.chain.origin.stats.bytes_read == stored_bytes(fs, paths[len(half):])
        pid = fs.manifest.pack_id.hex()
        for s in fs.manifest.shards:
            assert (tier / pid / s.name).read_bytes() == (pack / s.name).read_bytes()
    assert leftovers(tier) == []


def test_a_corrupt_partial_copy_is_never_served(pack: Path, files: dict[str, bytes],
                                                runtime: Path, tmp_path: Path,
                                                placer_elsewhere: None) -> None:
    tier = tmp_path / "t"
    paths = [p for p in sorted(files) if len(files[p]) > 100]
    with stagefs.open(pack, tiers=[str(tier)]) as fs:
        assert fs.chain is not None
        first = paths[0]
        assert fs.read(first) == files[first]
        e = fs.namespace.file_entry(first)
        shard, off = int(fs.manifest.shard[e]), int(fs.manifest.offset[e])
        partial = tier / fs.manifest.pack_id.hex() / (fs.manifest.shards[shard].name + ".partial")
        assert partial.exists()
        with open(partial, "r+b") as f:  # a bit flips in the tier's copy
            f.seek(off + 10)
            b = f.read(1)
            f.seek(off + 10)
            f.write(bytes([b[0] ^ 0x01]))
        fs.chain._next_check.clear()
        assert fs.read(first) == files[first]  # from the origin, and the copy is dropped
        assert fs.chain.tiers[0].stats.dropped == 1
        assert fs.stats.checksum_failures == 1
        for p in shuffled(files):
            assert fs.read(p) == files[p], p
        assert fs.held_shards() == set(range(len(fs.manifest.shards)))
        pid = fs.manifest.pack_id.hex()
        for s in fs.manifest.shards:
            assert (tier / pid / s.name).read_bytes() == (pack / s.name).read_bytes()


def test_a_small_tier_fills_up_and_reads_go_on(pack: Path, files: dict[str, bytes],
                                               runtime: Path, tmp_path: Path,
                                               placer_elsewhere: None) -> None:
    tier = tmp_path / "t"
    m = Manifest(str(pack / MANIFEST_NAME))
    cap = sum(s.size for s in m.shards) // 2
    m.close()
    with stagefs.open(pack, tiers=[f"{tier}:{cap}"]) as fs:
        assert fs.chain is not None
        for p in shuffled(files, 4):
            assert fs.read(p) == files[p], p
        held = fs.held_shards()
        assert 0 < len(held) < len(fs.manifest.shards)
        assert fs.chain.tiers[0].used_bytes() <= cap
        assert fs.chain.tiers[0].stopped == "full"
        assert leftovers(tier) == []  # every shard it took was read whole: all complete


def test_leftover_partial_copies(pack: Path, files: dict[str, bytes], runtime: Path,
                                 tmp_path: Path, placer_elsewhere: None) -> None:
    """A partial copy left by a job that died is taken up (its filled files were checked
    before they were marked); a partial file without its fill map is made afresh."""
    tier = tmp_path / "t"
    paths = shuffled(files, 5)
    half = paths[: len(paths) // 2]
    read_in_another_process(pack, tier, runtime, half)
    partials = [p for p in leftovers(tier) if p.suffix == ".partial"]
    assert len(partials) >= 2
    orphan = partials[0]
    orphan.with_suffix(".fill").unlink()  # shard-N.sfs.partial -> shard-N.sfs.fill
    with stagefs.open(pack, tiers=[str(tier)]) as fs:
        for p in paths:
            assert fs.read(p) == files[p], p
        assert fs.held_shards() == set(range(len(fs.manifest.shards)))
    assert leftovers(tier) == []


def test_a_store_that_does_not_verify_still_fills_only_checked_files(
        pack: Path, files: dict[str, bytes], runtime: Path, tmp_path: Path,
        placer_elsewhere: None) -> None:
    """verify=False spares the Store's check of what it returns, not the stream's check of
    what it writes into a tier: a file whose bytes are wrong at the origin never lands."""
    work = tmp_path / "pack"
    shutil.copytree(pack, work)
    tier = tmp_path / "t"
    with stagefs.open(work, tiers=[str(tier)], verify=False) as fs:
        m = fs.manifest
        victim = next(p for p in sorted(files) if len(files[p]) > 100)
        e = fs.namespace.file_entry(victim)
        shard = int(m.shard[e])
        with open(work / m.shards[shard].name, "r+b") as f:  # flip a byte at the origin
            f.seek(int(m.offset[e]) + 10)
            b = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([b[0] ^ 0xFF]))
        for p in shuffled(files):
            got = fs.read(p)
            assert got == files[p] or p == victim
        assert fs.held_shards() == set(range(len(m.shards))) - {shard}
        assert fs.chain.corrupt >= 1
    assert [p.name for p in leftovers(tier)] == [m.shards[shard].name + ".fill",
                                                 m.shards[shard].name + ".partial"]


def _pieces(parts: list[tuple[int, int]]) -> Callable[[int], tuple[int, int] | None]:
    """A ``next_piece`` for the copy's reader over fixed [start, end) spans."""
    todo = list(parts)

    def next_piece(chunk: int) -> tuple[int, int] | None:
        if not todo:
            return None
        a, b = todo.pop(0)
        n = min(chunk, b - a)
        if a + n < b:
            todo.insert(0, (a + n, b))
        return a, n

    return next_piece


def test_the_copy_reads_as_its_pace_allows() -> None:
    """The copy's reads: none while the pace says wait, then the pieces and depth it says."""
    import itertools
    import threading

    from stagefs.tiers import placer

    calls: list[tuple[int, int]] = []
    in_flight, most = [0], [0]
    lock = threading.Lock()
    two_at_once = threading.Event()  # set once a second read is under way beside the first
    wait_for_two = [False]

    def read(off: int, n: int) -> bytes:
        with lock:
            calls.append((off, n))
            in_flight[0] += 1
            most[0] = max(most[0], in_flight[0])
            if in_flight[0] >= 2:
                two_at_once.set()
        if wait_for_two[0]:  # the copy sent a second read without waiting for this one?
            two_at_once.wait(30)
        with lock:
            in_flight[0] -= 1
        return bytes(n)

    spans = [(0, 20000), (30000, 30500)]
    polls = itertools.count()
    out = list(placer._read_ahead(read, _pieces(spans), pace=lambda: None,
                                  stop=lambda: next(polls) >= 3))
    assert out == [] and calls == []  # waited, then stopped
    got = list(placer._read_ahead(read, _pieces(spans), pace=lambda: (1, 1024)))
    assert max(n for _, n in calls) == 1024 and most[0] == 1
    assert b"".join(d for _, d in got) == bytes(20500)
    assert [p for p, _ in got] == sorted(p for p, _ in got)
    calls.clear()
    most[0] = 0
    wait_for_two[0] = True
    got = list(placer._read_ahead(read, _pieces(spans), pace=lambda: (4, 4096)))
    assert max(n for _, n in calls) == 4096 and most[0] > 1 and two_at_once.is_set()
    assert sum(len(d) for _, d in got) == 20500


def test_the_copy_gives_way_to_reads(pack: Path, runtime: Path, tmp_path: Path) -> None:
    """The chain's pace: full speed once reads stopped; while several threads read, nothing;
    while one reads, nothing for the first GRACE_S, then one small piece at a time. The
    pace's clock is moved by hand."""
    import threading

    from stagefs.config import TierSpec
    from stagefs.tiers import chain as chainmod
    from stagefs.tiers import placer
    from stagefs.tiers.origin import PackOrigin

    now = [10**15]  # ns

    def seconds(s: float) -> int:
        return int(s * 1e9)

    m = Manifest(str(pack / MANIFEST_NAME))
    origin = PackOrigin(str(pack), m)
    rt = Runtime(runtime).open()
    c = chainmod.TierChain(m, origin, [TierSpec(str(tmp_path / "t"), None)], rt,
                           origin_path=str(pack), clock_ns=lambda: now[0])
    try:
        assert c._pace() == (placer.IN_FLIGHT, placer.CHUNK)  # no read ever
        c.activity.touch()  # one reader, just now
        now[0] += seconds(chainmod.IDLE_S / 2)
        assert c.activity.readers(chainmod.READERS_S) == 1
        assert c._pace() is None  # the grace period begins
        now[0] += seconds(chainmod.GRACE_S)  # ... and ends
        c.activity.touch()
        assert c._pace() == (1, placer.BUSY_CHUNK)
        other = threading.Thread(target=c.activity.touch)  # a second reader
        other.start()
        other.join()
        c.activity.touch()
        assert c.activity.readers(chainmod.READERS_S) == 2
        assert c._pace() is None  # readers after the bandwidth: the copy waits
        now[0] += seconds(0.5 * chainmod.CALM_S)  # a pause
        assert c._pace() == (1, placer.BUSY_CHUNK)
        now[0] += seconds(chainmod.CALM_S)  # reads stopped
        assert c._pace() == (placer.IN_FLIGHT, placer.CHUNK)
    finally:
        c.close()
        origin.close()
        rt.unregister()
        m.close()


def test_reads_fill_the_tiers_in_place_too(dataset: tuple[Path, dict[str, bytes]],
                                           tmp_path: Path, runtime: Path) -> None:
    """A raw directory used in place: a read's file is checked against the scan (size,
    mtime), its sum learnt from the read, and its bytes fill the tier; reading every file
    once leaves every shard whole, with each origin byte read once."""
    import shutil

    raw = tmp_path / "raw"
    src = dataset[0].parent / "raw"
    shutil.copytree(src, raw)
    files = {str(p.relative_to(raw)): p.read_bytes() for p in raw.rglob("*") if p.is_file()}
    stagefs.open(raw, runtime=runtime).close()  # the scan, as a job's first open
    tier = tmp_path / "t"
    with stagefs.open(raw, tiers=[str(tier)]) as fs:
        assert fs.chain is not None
        # keep this process's placer off
        hold_claims(runtime, fs.manifest.pack_id.hex(), len(fs.manifest.shards))
        paths = shuffled(files, 6)
        for p in paths:
            assert fs.read(p) == files[p], p
        assert fs.held_shards() == set(range(len(fs.manifest.shards)))
        assert fs.chain.origin.stats.bytes_read == sum(len(d) for d in files.values())
        assert fs.chain.tiers[0].stats.filled == sum(1 for d in files.values() if d)
        before = fs.chain.origin.stats.bytes_read
        for p in shuffled(files, 7):
            assert fs.read(p) == files[p], p
        assert fs.chain.origin.stats.bytes_read == before
    assert leftovers(tier) == []


def test_a_fork_never_inherits_a_held_tier_lock(pack: Path, runtime: Path,
                                                tmp_path: Path) -> None:
    """A thread holds a tier's lock file while the main thread forks (a DataLoader starting
    its workers while the placer or a read-ahead reserves room): the fork waits for it, so
    the child does not keep the lock locked for as long as it lives."""
    import fcntl
    import threading
    import time

    with stagefs.open(pack, tiers=[str(tmp_path / "t")]) as fs:
        chain = fs.chain
        assert chain is not None
        inside, leave = threading.Event(), threading.Event()

        letting_go = threading.Event()  # set just before the lock is let go

        def hold() -> None:
            with chain._tier_lock():
                inside.set()
                leave.wait(10)
                letting_go.set()

        t = threading.Thread(target=hold)
        t.start()
        assert inside.wait(10)
        threading.Timer(0.3, leave.set).start()
        pid = os.fork()
        if pid == 0:  # the child: once the parent's thread is done, the lock is free
            code = 1
            try:
                with chain._tier_lock():
                    code = 0
            finally:
                os._exit(code)
        waited = letting_go.is_set()  # the fork returned only once the lock was let go
        t.join(10)
        deadline = time.monotonic() + 30
        while True:
            got, status = os.waitpid(pid, os.WNOHANG)
            if got or time.monotonic() > deadline:
                break
            time.sleep(0.01)
        if not got:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
        assert got and os.waitstatus_to_exitcode(status) == 0
        assert waited  # the fork waited for the lock to be let go
        # and this process can take it again
        fd = os.open(chain.tiers[0].room.lock_path, os.O_RDWR)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        finally:
            os.close(fd)


def test_a_partial_copy_started_elsewhere_is_used_at_once(
        pack: Path, files: dict[str, bytes], runtime: Path, tmp_path: Path,
        placer_elsewhere: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """A process that looked for a shard's copy a moment ago, before another process (a
    read-ahead) started its partial copy, reads what that copy holds instead of going to
    the origin again until its next look at the tier (RECHECK_S)."""
    from stagefs.tiers import chain as chain_mod

    monkeypatch.setattr(chain_mod, "RECHECK_S", 3600.0)
    tier = str(tmp_path / "t")
    with stagefs.open(pack, tiers=[tier]) as a, stagefs.open(pack, tiers=[tier]) as b:
        assert a.chain is not None and b.chain is not None
        m = a.manifest
        path = next(p for p in shuffled(files) if files[p])
        shard = int(m.shard[m.lookup(path.encode())])
        b.chain.holders(shard)  # b looks: nothing in the tier yet
        assert a.read(path) == files[path]  # a reads it from the origin and fills the tier
        before = b.chain.origin.stats.bytes_read
        assert b.read(path) == files[path]
        assert b.chain.origin.stats.bytes_read == before  # from a's partial copy


def test_a_complete_copy_left_unfinished_is_made_whole_by_the_next_read(
        pack: Path, files: dict[str, bytes], runtime: Path, tmp_path: Path,
        placer_elsewhere: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """A process filled the last files of a shard's partial copy and ended before renaming
    it (a DataLoader worker leaves with os._exit, its placer thread mid-copy): the next
    process to read from it makes it the shard's copy, instead of serving a partial copy
    for the rest of the job."""
    tier = tmp_path / "t"
    with stagefs.open(pack, tiers=[str(tier)]) as a, stagefs.open(pack, tiers=[str(tier)]) as b:
        assert a.chain is not None and b.chain is not None
        m = a.manifest
        shard = 0
        in_shard = [p for p in sorted(files) if files[p]
                    and int(m.shard[m.lookup(p.encode())]) == shard]
        monkeypatch.setattr(a.chain, "_finish", lambda *_: False)  # ends before the rename
        for p in in_shard:
            assert a.read(p) == files[p], p
        assert shard not in a.held_shards() and leftovers(tier)  # complete, still partial
        before = b.chain.origin.stats.bytes_read
        assert b.read(in_shard[0]) == files[in_shard[0]]
        assert b.chain.origin.stats.bytes_read == before  # from the tier
        assert shard in b.held_shards()
        pid = m.pack_id.hex()
        name = m.shards[shard].name
        assert (tier / pid / name).read_bytes() == (pack / name).read_bytes()
        assert not [p for p in leftovers(tier) if p.name.startswith(name)]


def test_a_piece_is_never_reserved_in_two_tiers(pack: Path, files: dict[str, bytes],
                                                runtime: Path, tmp_path: Path,
                                                placer_elsewhere: None) -> None:
    """Two processes place the same piece; one (b) counts the first tier full, having found
    no room there earlier. The other (a) reserved the piece in the first tier meanwhile: b
    takes a's copy rather than reserve the piece again in the next tier (it would be filled
    and placed twice, and the room of one copy lost)."""
    mem, disk = tmp_path / "mem", tmp_path / "disk"
    with stagefs.open(pack, tiers=[str(mem), str(disk)]) as a, \
            stagefs.open(pack, tiers=[str(mem), str(disk)]) as b:
        assert a.chain is not None and b.chain is not None
        shard = 0
        b.chain.tiers[0].stopped = "full"
        got_a = a.chain._reserve(shard, [0])[0]
        assert got_a[1] is a.chain.tiers[0]  # in mem
        got_b = b.chain._reserve(shard, [0])[0]
        assert got_b[1] is b.chain.tiers[0]  # a's copy, in mem too
        assert got_b[0].ino == got_a[0].ino
        assert leftovers(disk) == []  # no second copy


def test_the_activity_map_is_written_when_it_is_made(tmp_path: Path) -> None:
    """The readers' activity map (a small mapped file in the runtime dir) has its blocks when
    it is made: sparse, the first stamp through the mapping once /dev/shm was full (filled
    by another program after the store opened) was a SIGBUS that killed the reader. A map
    another process made (and stamped) keeps its stamps."""
    from stagefs.tiers.fill import Activity

    path = str(tmp_path / "x.activity")
    a = Activity(path, clock=lambda: 7)
    size = 8 * Activity.SLOTS
    st = os.stat(path)
    assert st.st_size == size and st.st_blocks * 512 >= size
    a.touch()
    a.close()
    b = Activity(path, clock=lambda: 9)
    assert b.readers(5e-9) == 1  # the stamp of the first, 2 ns before
    assert os.stat(path).st_size == size
    b.close()


def test_the_node_s_shared_tables_are_written_when_made(tmp_path: Path) -> None:
    """The other files the node's processes map shared (the sums an in-place dataset learns,
    a process's read counters) have their blocks when made, as the activity map does: a
    hole in one was a SIGBUS at the first sum or count once /dev/shm was full. A table made
    before keeps what it holds."""
    from stagefs.tiers.inplace import SumTable
    from stagefs.tiers.status import ReadCounters

    path = str(tmp_path / "sums")
    sums = SumTable(path, 5_000)  # 45,000 bytes: pages a hole would leave unbacked
    st = os.stat(path)
    assert st.st_size == 45_000 and st.st_blocks * 512 >= 45_000
    sums.record(3, 0xABC)
    sums.close()
    again = SumTable(path, 5_000)
    assert again.get(3) == 0xABC
    again.close()
    counters = ReadCounters(str(tmp_path))
    counters.count("pushed_reads")
    [made] = [p for p in tmp_path.iterdir() if p.name.endswith(".counters")]
    st = made.stat()
    assert st.st_blocks * 512 >= st.st_size > 0
    counters.close()
