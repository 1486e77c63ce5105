"""Store.read_many / read_entries from the tiers: one call per tier for a batch, every file
checked as a read alone checks it, a bad copy read again per file along the same holders as
``read``, errors as ``read`` raises them, the order asked kept."""

from __future__ import annotations

import os
import random
import re
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import stagefs
from conftest import flip_byte, text_bytes
from stagefs.errors import ChecksumError, IsADirectoryError_, NotFoundError
from stagefs.tiers.tier import DirTier
from tiers_helpers import make_tree, packed_tree

# (the package's ``checksum`` function hides the module of that name)
checksum_module = sys.modules["stagefs.format.checksum"]


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, bytes]]:
    return packed_tree(tmp_path_factory.mktemp("batch"), n=160)


class Spy:
    """Counts the calls to one method of one real object and the items they carried."""

    def __init__(self, obj: Any, name: str) -> None:
        self.calls: list[int] = []
        real: Callable[..., Any] = getattr(obj, name)

        def spy(*args: Any, **kwargs: Any) -> Any:
            self.calls.append(len(args[0]) if name.endswith("_many") else 1)
            return real(*args, **kwargs)

        setattr(obj, name, spy)


def _tiers(fs: stagefs.Store) -> list[DirTier]:
    assert fs.chain is not None
    return fs.chain.tiers


def _shard_of(fs: stagefs.Store, path: str) -> int:
    return int(fs.manifest.shard[fs.namespace.file_entry(path)])


def _holders(fs: stagefs.Store) -> dict[str, int]:
    return {h: v["reads"] for h, v in fs.status()["holders"].items()}


def test_a_batch_from_two_tiers_is_one_call_to_each(dataset: tuple[Path, dict[str, bytes]],
                                                    memory_dir: Path, tmp_path: Path) -> None:
    pack, files = dataset
    with stagefs.open(pack, tiers=[f"{memory_dir}:160KiB", str(tmp_path / "disk")]) as fs:
        assert fs.chain is not None
        fs.chain.stage()
        memory, disk = _tiers(fs)
        assert (memory.kind, disk.kind) == ("memory", "disk")
        in_memory, on_disk = memory.held(), disk.held()
        assert in_memory and on_disk and len(in_memory | on_disk) == len(fs.manifest.shards)
        names = sorted(files)
        batch = random.Random(5).sample(names, 60)
        batch += batch[:7] + [batch[3]] * 3  # duplicates, also next to each other
        want = [files[p] for p in batch]
        staged = fs.origin.stats.reads  # the copies' reads
        spies = {t.kind: Spy(t, "gather_many") for t in (memory, disk)}
        mapped, alone = Spy(memory, "pread"), Spy(fs, "read_entry")
        got = fs.read_many(batch)
        assert got == want  # in the order asked
        nonempty = [p for p in batch if files[p]]
        shards = {_shard_of(fs, p) for p in nonempty}
        assert shards & in_memory and shards & on_disk  # several shards, in both tiers
        distinct = set(nonempty)  # a repeat is read once (its bytes handed to each ask)
        for kind, held in (("memory", in_memory), ("disk", on_disk)):
            assert spies[kind].calls == [sum(_shard_of(fs, p) in held for p in distinct)]
        assert alone.calls == [] and mapped.calls == []  # no file read alone; memory: mapped
        assert _holders(fs) == {  # an empty file or a repeat: a sample from memory
            "memory": sum(_shard_of(fs, p) in in_memory for p in distinct)
            + len(batch) - len(distinct),
            "disk": sum(_shard_of(fs, p) in on_disk for p in distinct), "peer": 0, "origin": 0}
        # the same through read_entries (entries known: no path looked up), and read
        ents = np.array([fs.namespace.file_entry(p) for p in batch])
        assert fs.read_entries(ents) == want
        assert [fs.read(p) for p in batch] == want
        assert fs.stats.checksum_failures == 0 and fs.origin.stats.reads == staged


@pytest.mark.parametrize("mapped", [True, False])
def test_a_memory_tier_read_through_a_mapping_or_not(dataset: tuple[Path, dict[str, bytes]],
                                                     memory_dir: Path,
                                                     monkeypatch: pytest.MonkeyPatch,
                                                     mapped: bool) -> None:
    """``STAGEFS_TIER_MAP=0``: the same bytes, read with pread from the copies' descriptors
    (``gather``), and no mapping kept (the tier's pages then stay out of the process's
    RSS); either way in one call, no file read alone."""
    if not mapped:
        monkeypatch.setenv("STAGEFS_TIER_MAP", "0")
    pack, files = dataset
    with stagefs.open(pack, tiers=[str(memory_dir)]) as fs:
        assert fs.chain is not None
        fs.chain.stage()
        (memory,) = _tiers(fs)
        names = sorted(files)
        preads = Spy(memory, "pread")
        assert fs.read_many(names) == [files[p] for p in names]
        assert bool(memory._maps) is mapped
        assert preads.calls == []
        assert _holders(fs)["memory"] == len(names)  # the empty files too (the manifest's)


def test_a_corrupt_tier_copy_of_one_file(dataset: tuple[Path, dict[str, bytes]],
                                         memory_dir: Path) -> None:
    """The bad file comes from the origin, as a read alone would get it; the others of the
    batch, its shard's included, from the tier; the counters say so."""
    pack, files = dataset
    with stagefs.open(pack, tiers=[str(memory_dir)]) as fs:
        assert fs.chain is not None
        fs.chain.stage()
        m = fs.manifest
        raw = [p for p in sorted(files) if len(files[p]) > 100
               and int(m.codec[fs.namespace.file_entry(p)]) == 0]
        victim = raw[len(raw) // 2]
        e = fs.namespace.file_entry(victim)
        shard = int(m.shard[e])
        neighbours = [p for p in sorted(files) if files[p] and _shard_of(fs, p) == shard
                      and p != victim]
        others = [p for p in sorted(files) if files[p] and _shard_of(fs, p) != shard][:20]
        assert neighbours and others
        copy = Path(_tiers(fs)[0].path(shard))
        with open(copy, "r+b") as f:
            at = int(m.offset[e]) + 50
            f.seek(at)
            b = f.read(1)
            f.seek(at)
            f.write(bytes([b[0] ^ 0xFF]))
        batch = [*others[:10], victim, *neighbours, *others[10:]]
        assert fs.read_many(batch) == [files[p] for p in batch]
        assert fs.stats.checksum_failures == 1
        assert _holders(fs) == {"memory": len(batch) - 1, "disk": 0, "peer": 0, "origin": 1}
        assert _tiers(fs)[0].stats.dropped == 1  # the bad copy, as a read alone drops it
        assert fs.read(victim) == files[victim]


@pytest.mark.parametrize("how", ["drop", "forget"])
def test_a_dropped_copys_descriptor_is_never_another_files(
        dataset: tuple[Path, dict[str, bytes]], memory_dir: Path, how: str) -> None:
    """Another thread may hold a copy's descriptor number when the copy is dropped (a read
    of it, a mapping being made): closed at once, the number went to the next file opened,
    which that thread then mapped as the copy and died of SIGBUS copying out of it. Now the
    number reads nothing until the tier closes, and the copy's blocks are freed."""
    pack, _ = dataset
    with stagefs.open(pack, tiers=[str(memory_dir)]) as fs:
        assert fs.chain is not None
        fs.chain.stage()
        tier = _tiers(fs)[0]
        shard = min(tier.held())
        fd = tier._held_fd(shard)
        assert fd is not None and os.fstat(fd).st_size > 0
        gone = os.fstat(fd)
        getattr(tier, how)(shard)
        other = os.open(os.devnull, os.O_RDONLY)  # the next file opened
        try:
            assert other != fd
        finally:
            os.close(other)
        st = os.fstat(fd)
        assert (st.st_dev, st.st_ino) != (gone.st_dev, gone.st_ino)
        assert os.pread(fd, 10, 0) == b""  # a short read: the next holder
        if how == "drop":  # deleted (forget leaves the file to its caller): what a read
            # finds now is the copy the chain places again, if it is there yet, never the
            # dropped one (asserting none failed once a run: placed again that quickly)
            again = tier._held_fd(shard)
            assert again != fd
            if again is not None:
                assert os.fstat(again).st_ino != gone.st_ino
    with pytest.raises(OSError):  # closed with the tier
        os.fstat(fd)


def test_a_missing_path_fails_the_batch_as_read_fails(
        dataset: tuple[Path, dict[str, bytes]], memory_dir: Path) -> None:
    pack, files = dataset
    with stagefs.open(pack, tiers=[str(memory_dir)]) as fs:
        assert fs.chain is not None
        fs.chain.stage()
        good = sorted(p for p in files if files[p])[:5]
        with pytest.raises(NotFoundError) as alone:
            fs.read("c1/nope.bin")
        with pytest.raises(NotFoundError) as batched:
            fs.read_many([*good, "c1/nope.bin", good[0]])
        assert str(batched.value) == str(alone.value) and "c1/nope.bin" in str(batched.value)
        assert isinstance(batched.value, FileNotFoundError)
        assert _holders(fs)["memory"] == 0  # looked up first: nothing was read
        with pytest.raises(IsADirectoryError_, match="c1"):
            fs.read_many([good[0], "c1"])
        with pytest.raises(IsADirectoryError_):
            fs.read_entries([fs.namespace.file_entry(good[0]), fs.namespace.entry("c1")])


def test_entries_that_are_no_regular_file(tmp_path: Path, runtime: Path) -> None:
    """By number, as by path: a symlink's entry reads its target (read_entries of the
    entries ``walk``/``scandir`` give), a dangling one is not found, a directory (the root
    too, named "/") is one; a path list with something that is no path says which."""
    raw = tmp_path / "raw"
    (raw / "d").mkdir(parents=True)
    (raw / "d" / "a.txt").write_bytes(b"hello\n")
    (raw / "d" / "l.txt").symlink_to("a.txt")
    (raw / "d" / "up").symlink_to("../d/a.txt")
    (raw / "d" / "dangling").symlink_to("nowhere")
    (raw / "d" / "tod").symlink_to(".")
    stagefs.pack(raw, tmp_path / "pack", jobs=1, progress=False, echo=lambda _m: None)
    with stagefs.open(tmp_path / "pack") as fs:
        lookup = fs.manifest.lookup
        a, link, up = (lookup(p) for p in (b"d/a.txt", b"d/l.txt", b"d/up"))
        assert fs.read_entries([a, link, up, link]) == [b"hello\n"] * 4
        assert fs.read_entry(link) == fs.read("d/l.txt") == b"hello\n"
        with pytest.raises(NotFoundError, match="d/dangling"):
            fs.read_entries([a, lookup(b"d/dangling")])
        for e, name in [(0, "/"), (lookup(b"d"), "d"), (lookup(b"d/tod"), "d/tod")]:
            for read in (lambda e: fs.read_entries([a, e]), fs.read_entry):
                with pytest.raises(IsADirectoryError_) as info:
                    read(e)
                assert info.value.filename == name and "listdir" in str(info.value)
        with pytest.raises(IsADirectoryError_, match="listdir"):
            fs.read("d")
        for bad, i in [([None], 0), (["d/a.txt", 3], 1), (["d/a.txt", b"d/l.txt", 2.5], 2)]:
            with pytest.raises(TypeError, match=rf"paths\[{i}\] is {bad[i]!r}"):
                fs.read_many(bad)


@pytest.mark.parametrize("how", ["pack", "in place"])
def test_a_batch_with_symlinks_reads_and_counts_their_targets(
        tmp_path: Path, runtime: Path, how: str) -> None:
    """A symlink's entry in a batch of several: its target's bytes, one sample. Read as a
    file of the batch besides (a symlink's size is its target's length), it was counted
    twice in a pack and raised IndexError in place (its shard is none)."""
    raw = tmp_path / "raw"
    (raw / "d").mkdir(parents=True)
    (raw / "d" / "a.txt").write_bytes(b"hello\n")
    (raw / "d" / "b.txt").write_bytes(b"world\n" * 50)
    (raw / "d" / "l.txt").symlink_to("a.txt")
    (raw / "d" / "up").symlink_to("../d/b.txt")
    origin = raw
    if how == "pack":
        stagefs.pack(raw, tmp_path / "pack", jobs=1, progress=False, echo=lambda _m: None)
        origin = tmp_path / "pack"
    with stagefs.open(origin) as fs:
        lookup = fs.manifest.lookup
        a, b, link, up = (lookup(p) for p in (b"d/a.txt", b"d/b.txt", b"d/l.txt", b"d/up"))
        batch = [link, a, up, link, b, up]
        want = [b"hello\n", b"hello\n", b"world\n" * 50, b"hello\n", b"world\n" * 50,
                b"world\n" * 50]
        assert fs.read_entries(batch) == want
        assert fs.stats.reads == len(batch) and fs.stats.bytes == sum(map(len, want))


def test_no_list_of_paths_and_the_root_s_stat_are_named(
        tmp_path: Path, runtime: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A read_many of None or of a number says what it takes, not Python's "'NoneType'
    object is not iterable"; ``stagefs stat PACK ''`` (the root, as listdir takes it) said
    "File: " with no name."""
    from stagefs.cli import main

    raw = tmp_path / "raw"
    raw.mkdir()
    (raw / "a.txt").write_bytes(b"hello\n")
    stagefs.pack(raw, tmp_path / "pack", jobs=1, progress=False, echo=lambda _m: None)
    with stagefs.open(tmp_path / "pack") as fs:
        for bad, named in [(None, "NoneType (None)"), (5, "int (5)")]:
            with pytest.raises(TypeError, match=rf"read_many takes a list of paths, not "
                               rf"{re.escape(named)}"):
                fs.read_many(bad)  # type: ignore[arg-type]
        assert fs.read_many(iter(["a.txt"])) == [b"hello\n"]
    assert main(["stat", str(tmp_path / "pack"), ""]) == 0
    assert capsys.readouterr().out.splitlines()[0] == "  File: /"


def test_empty_and_small_batches(dataset: tuple[Path, dict[str, bytes]],
                                 memory_dir: Path) -> None:
    pack, files = dataset
    empties = [p for p in sorted(files) if not files[p]]
    some = [p for p in sorted(files) if files[p]][:3]
    assert empties
    with stagefs.open(pack, tiers=[str(memory_dir)]) as fs:
        assert fs.chain is not None
        fs.chain.stage()
        assert fs.read_many([]) == [] and fs.read_entries([]) == []
        assert fs.read_many(empties) == [b""] * len(empties)
        assert fs.read_many(some[:1]) == [files[some[0]]]
        mixed = [empties[0], *some, empties[-1], some[0]]
        assert fs.read_many(mixed) == [files[p] for p in mixed]
        assert fs.read_many(iter(mixed)) == [files[p] for p in mixed]


def test_unverified_batches_decode(dataset: tuple[Path, dict[str, bytes]],
                                   memory_dir: Path) -> None:
    """verify=False: compressed files are still decoded, from the tier and the origin."""
    pack, files = dataset
    names = sorted(files)
    with stagefs.open(pack, verify=False) as fs:
        assert fs.read_many(names) == [files[p] for p in names]
    with stagefs.open(pack, tiers=[str(memory_dir)], verify=False) as fs:
        assert fs.chain is not None
        fs.chain.stage()
        assert any(int(fs.manifest.codec[fs.namespace.file_entry(p)]) for p in names)
        assert fs.read_many(names) == [files[p] for p in names]
        assert _holders(fs)["memory"] == len(names)  # the empty files too (the manifest's)


def test_in_place_batches_read_each_origin_byte_once(tmp_path: Path, runtime: Path) -> None:
    """In place, a file's checksum is learnt from its first read from the origin: a run of
    neighbours read with one call is taken as read alone takes it, not read again."""
    files = make_tree(tmp_path / "raw", n=60)
    names = sorted(files)
    with stagefs.open(tmp_path / "raw") as fs:
        got = fs.read_many(names)
        assert got == [files[p] for p in names]
        assert fs.origin.stats.bytes_read == sum(len(d) for d in files.values())
        assert fs.stats.checksum_failures == 0
        assert fs.read_many(names[::-1]) == [files[p] for p in names[::-1]]  # sums now known


def test_a_batch_from_a_tier_and_the_origin(dataset: tuple[Path, dict[str, bytes]],
                                            memory_dir: Path) -> None:
    """A tier that holds some of the shards: their files come from it in one call, the
    others from the origin, every file in the order asked."""
    pack, files = dataset
    with stagefs.open(pack, tiers=[f"{memory_dir}:160KiB"]) as fs:
        assert fs.chain is not None
        fs.chain.stage()
        (memory,) = _tiers(fs)
        held = memory.held()
        assert 0 < len(held) < len(fs.manifest.shards)
        batch = sorted(files)
        random.Random(9).shuffle(batch)
        many = Spy(memory, "gather_many")
        assert fs.read_many(batch) == [files[p] for p in batch]
        here = [p for p in batch if files[p] and _shard_of(fs, p) in held]
        assert many.calls == [len(here)]
        got = _holders(fs)
        assert got["memory"] == len(here) + sum(1 for p in batch if not files[p])
        assert got["origin"] == sum(1 for p in batch if files[p]) - len(here)


def test_a_file_repeated_in_a_batch_is_read_once(dataset: tuple[Path, dict[str, bytes]],
                                                 runtime: Path) -> None:
    """Sampling with replacement names a file several times in a batch: it is read from the
    origin once, each repeat gets its bytes, and every sample is counted (a repeat as
    served from memory, as it is)."""
    pack, files = dataset
    names = [p for p in sorted(files) if files[p]]
    rng = random.Random(4)
    few = rng.sample(names, 3)
    batch = [few[0]] * 64 + [rng.choice(few) for _ in range(30)]
    with stagefs.open(pack) as fs:
        for p in few:
            fs.read(p)
        alone = fs.origin.stats.as_dict()
    with stagefs.open(pack) as fs:
        got = fs.read_many(batch)
        assert got == [files[p] for p in batch]
        once = fs.origin.stats.as_dict()
        assert (once["reads"], once["bytes_read"]) <= (alone["reads"], alone["bytes_read"])
        assert fs.stats.reads == len(batch)
        assert fs.stats.bytes == sum(len(files[p]) for p in batch)
        ents = [fs.namespace.file_entry(p) for p in batch]
        assert fs.read_entries(np.array(ents, np.int32)) == [files[p] for p in batch]


def test_a_batch_that_raises_counts_no_sample(tmp_path: Path, runtime: Path) -> None:
    """One file no holder has good bytes for fails the whole batch: its caller got nothing,
    so no sample of it is counted as read (its good files, its empty file, its repeats);
    the origin's reads it made and the checksum failure are counted. The same batch
    without the bad file then counts every sample."""
    from stagefs.tiers.status import read_counts

    pack, files = packed_tree(tmp_path, n=60)
    names = [p for p in sorted(files) if files[p]]
    empty = [p for p in sorted(files) if not files[p]]
    with stagefs.open(pack, runtime=runtime) as fs:
        m = fs.manifest
        victim = next(p for p in names[len(names) // 2 :] if len(files[p]) > 100
                      and int(m.codec[fs.namespace.file_entry(p)]) == 0)
        e = fs.namespace.file_entry(victim)
        with open(pack / m.shards[int(m.shard[e])].name, "r+b") as f:
            f.seek(int(m.offset[e]) + 50)
            b = f.read(1)
            f.seek(int(m.offset[e]) + 50)
            f.write(bytes([b[0] ^ 0xFF]))
        good = [p for p in names if p != victim]
        batch = [*empty[:1], *good, good[0], victim]
        for read in (lambda: fs.read_many(batch),
                     lambda: fs.read_entries([fs.namespace.file_entry(p) for p in batch])):
            with pytest.raises(stagefs.ChecksumError, match=victim):
                read()
            assert fs.stats.reads == fs.stats.bytes == 0
        counts = read_counts(str(runtime / "stats"))
        assert sum(counts[f"{h}_reads"] for h in ("memory", "disk", "peer", "origin")) == 0
        assert counts["fetched_bytes"] > 0  # what was read of the origin still counts
        assert counts["checksum_failures"] == 2
        ok = [*empty[:1], *good, good[0]]
        assert fs.read_many(ok) == [files[p] for p in ok]
        assert fs.stats.reads == len(ok)
        assert fs.stats.bytes == sum(len(files[p]) for p in ok)
        counts = read_counts(str(runtime / "stats"))
        assert counts["origin_reads"] + counts["memory_reads"] == len(ok)


def test_an_interrupted_batch_reads_no_more_of_the_origin(
        tmp_path: Path, runtime: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C during a read_many whose runs went to the reader threads (a slow origin):
    the KeyboardInterrupt comes out, and the runs not begun yet are never read. The
    threads read the rest of the batch before (64 files from a slow origin: 8 s after a
    Ctrl-C, and the Store's close at the end of a ``with`` waited for them too)."""
    import signal
    import threading

    from xxhash import xxh3_64_intdigest

    from stagefs.tiers import origin as origin_mod
    from stagefs.tiers.base import Gathered

    pack, files = packed_tree(tmp_path, n=120, shard_size="8KiB")
    names = [p for p in sorted(files) if files[p]]
    real = origin_mod.PackOrigin.pread
    interrupted = threading.Event()
    begun_after: list[int] = []
    main = threading.main_thread()

    def pread(self: Any, shard: int, offset: int, length: int) -> bytes:
        if threading.current_thread() is main:  # the caller's own run, once the threads
            pread.calls += 1  # type: ignore[attr-defined]  # have the batch's other runs
            if pread.calls == 1:  # type: ignore[attr-defined]
                signal.pthread_kill(main.ident or 0, signal.SIGINT)  # Ctrl-C
        else:
            if interrupted.is_set():
                begun_after.append(shard)
            interrupted.wait(60)  # the threads' reads under way end after it (60: no hang)
        return real(self, shard, offset, length)

    pread.calls = 0  # type: ignore[attr-defined]

    def gather_many(self: Any, ranges: Any, *args: Any, **kwargs: Any) -> Gathered:
        """As from a slow shared file system: each first read waits, and the batch's runs
        go to the reader threads."""
        data = real(self, *ranges[0])
        return Gathered([data], [xxh3_64_intdigest(data)], 1, True)

    def on_sigint(_signum: int, _frame: Any) -> None:
        interrupted.set()
        raise KeyboardInterrupt

    monkeypatch.setattr(origin_mod.PackOrigin, "pread", pread)
    monkeypatch.setattr(origin_mod.PackOrigin, "gather_many", gather_many)
    old = signal.signal(signal.SIGINT, on_sigint)
    try:
        with stagefs.open(pack, runtime=runtime) as fs:
            runs = len({int(fs.manifest.shard[fs.namespace.file_entry(p)]) for p in names})
            assert runs > 4 * fs.read_threads  # more runs than the threads read at once
            with pytest.raises(KeyboardInterrupt):
                fs.read_many(names)
            threads = fs.read_threads - 1
            assert fs.read_many(names[:3]) == [files[p] for p in names[:3]]
    finally:
        signal.signal(signal.SIGINT, old)
    # at most one run each thread had taken before the interrupt reached the caller
    assert len(begun_after) <= threads, begun_after


@pytest.mark.parametrize("where", ["origin", "memory tier"])
def test_a_batch_of_compressed_files_is_decoded_in_parts(
        tmp_path: Path, memory_dir: Path, monkeypatch: pytest.MonkeyPatch, where: str) -> None:
    """A batch's compressed files are decoded in the reader threads and this one at once
    (zstd lets go of the interpreter lock), each checked as a read alone checks it: right
    bytes, and a corrupt one read again from the next holder, counted once."""
    files = {f"t/f{i:03d}.txt": text_bytes(20_000 + 97 * i, i) for i in range(48)}
    for rel, data in files.items():
        (tmp_path / "raw" / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "raw" / rel).write_bytes(data)
    stagefs.pack(tmp_path / "raw", tmp_path / "pack", compress="zstd", jobs=1, progress=False,
                 echo=lambda _m: None)
    threads: list[str] = []
    real = checksum_module.decode

    def decode(*args: Any) -> bytes:
        threads.append(threading.current_thread().name)
        return real(*args)

    monkeypatch.setattr(checksum_module, "decode", decode)
    names = sorted(files)
    random.Random(5).shuffle(names)
    tiers = [str(memory_dir)] if where == "memory tier" else None
    with stagefs.open(tmp_path / "pack", tiers=tiers) as fs:
        if fs._parts < 2:
            pytest.skip("one CPU for this process: a batch is decoded in this thread")
        m = fs.manifest
        assert all(int(m.codec[fs.namespace.file_entry(p)]) for p in names)
        if tiers:
            assert fs.chain is not None
            fs.chain.stage()
        assert fs.read_many(names) == [files[p] for p in names]
        assert len(threads) == len(names)
        assert threading.current_thread().name in threads
        assert any(t.startswith("stagefs-read") for t in threads)
        # a corrupt stored file: the tier's copy (read again from the origin) or the
        # origin's own shard (no holder has it right: the batch fails as a read fails)
        victim = names[20]
        e = fs.namespace.file_entry(victim)
        target = _tiers(fs)[0].path(int(m.shard[e])) if tiers else \
            tmp_path / "pack" / m.shards[int(m.shard[e])].name
        flip_byte(target, int(m.offset[e]) + int(m.stored[e]) // 2)
        if tiers:
            assert fs.read_many(names) == [files[p] for p in names]
            assert fs.stats.checksum_failures == 1
            assert _holders(fs)["origin"] == 1
        else:
            with pytest.raises(ChecksumError, match=victim):
                fs.read_many(names)


def test_a_read_ahead_counts_its_samples_when_told(dataset: tuple[Path, dict[str, bytes]],
                                                   memory_dir: Path) -> None:
    """``read_ahead``: the bytes now, the samples counted (by holder, once) when its count
    is called: a read-ahead counts what it hands out."""
    pack, files = dataset
    names = sorted(p for p in files if files[p])[:30]
    with stagefs.open(pack, tiers=[str(memory_dir)]) as fs:
        assert fs.chain is not None
        fs.chain.stage()
        ents = [fs.namespace.file_entry(p) for p in names]
        got, count = fs.read_ahead(ents)
        assert got == [files[p] for p in names]
        assert sum(_holders(fs).values()) == 0
        count()
        count()
        assert _holders(fs) == {"memory": len(names), "disk": 0, "peer": 0, "origin": 0}
        assert fs.read_entries(ents) == got
        assert _holders(fs)["memory"] == 2 * len(names)
