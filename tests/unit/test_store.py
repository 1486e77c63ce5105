"""The Store: read, read_many, open, read-only errors, corruption, pickling, public API."""

from __future__ import annotations

import errno
import io
import os
import pickle
import random
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

import stagefs
from conftest import flip_byte, random_bytes, text_bytes
from stagefs.errors import (
    ChecksumError,
    CorruptShardError,
    NotFoundError,
    OriginUnavailableError,
    ReadOnlyError,
    StagefsError,
)
from stagefs.format import shard_name

# --------------------------------------------------------------------------- a busy pack


def _busy_tree(root: Path) -> dict[str, bytes]:
    """~300 small files over a few dirs: empty, compressible, random; many per shard."""
    rng = random.Random(11)
    files: dict[str, bytes] = {}
    for i in range(300):
        d = f"d{i % 7}"
        kind = rng.choice(["empty", "text", "random", "random"])
        n = rng.randint(1, 6000)
        data = {"empty": b"", "text": text_bytes(n, i), "random": random_bytes(n, i)}[kind]
        files[f"{d}/f{i:03d}"] = data
    for rel, data in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)
    return files


@pytest.fixture(scope="module")
def busy(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, bytes]]:
    base = tmp_path_factory.mktemp("busy")
    files = _busy_tree(base / "src")
    report = stagefs.pack(base / "src", base / "pack", shard_size="40KiB", jobs=1,
                          progress=False, echo=lambda _m: None)
    assert report.shards > 5
    return base / "pack", files


@pytest.fixture
def busy_store(busy: tuple[Path, dict[str, bytes]]) -> Iterator[stagefs.Store]:
    with stagefs.open(busy[0]) as fs:
        yield fs


def test_read_equals_source(busy: tuple[Path, dict[str, bytes]],
                            busy_store: stagefs.Store) -> None:
    files = busy[1]
    for rel, data in files.items():
        assert busy_store.read(rel) == data, rel
    m = busy_store.manifest
    compressed = sum(1 for rel in files if m.codec[m.lookup(rel.encode())])
    assert 0 < compressed < len(files)


def test_read_many_equals_read(busy: tuple[Path, dict[str, bytes]],
                               busy_store: stagefs.Store) -> None:
    files = busy[1]
    names = sorted(files)
    m = busy_store.manifest
    by_offset = sorted(names, key=lambda p: (m.shard[m.lookup(p.encode())],
                                             m.offset[m.lookup(p.encode())]))
    rng = random.Random(3)
    batches: list[list[str]] = [[], names, by_offset, by_offset[::-1], [names[0]] * 5]
    for _ in range(150):
        k = rng.randint(1, 60)
        if rng.random() < 0.3:  # runs of neighbours in the shard (coalesced reads)
            start = rng.randrange(len(by_offset))
            batch = by_offset[start : start + k]
        else:
            batch = [rng.choice(names) for _ in range(k)]  # duplicates are likely
        if rng.random() < 0.3:
            batch = batch + batch[: rng.randint(0, len(batch))]
        batches.append(batch)
    for batch in batches:
        got = busy_store.read_many(batch)
        assert got == [files[p] for p in batch]
        assert got == [busy_store.read(p) for p in batch]
    # any iterable, any path form
    assert busy_store.read_many(iter(names[:3])) == [files[p] for p in names[:3]]
    assert busy_store.read_many([b"/" + names[0].encode(), Path(names[1])]) == [
        files[names[0]], files[names[1]]]
    # one path where a list is meant: said so, not "no such file" for its first character
    for one in (names[0], names[0].encode(), Path(names[0])):
        with pytest.raises(TypeError, match="list of paths"):
            busy_store.read_many(one)  # type: ignore[arg-type]


def test_read_many_empty_and_adjacent(busy: tuple[Path, dict[str, bytes]],
                                      busy_store: stagefs.Store) -> None:
    files = busy[1]
    empties = [p for p, d in files.items() if not d]
    assert len(empties) > 10
    assert busy_store.read_many(empties) == [b""] * len(empties)
    assert busy_store.read_many(empties + empties[:3]) == [b""] * (len(empties) + 3)



@pytest.fixture
def corruptible(tmp_path: Path) -> tuple[Path, dict[str, bytes]]:
    files = _busy_tree(tmp_path / "src")
    stagefs.pack(tmp_path / "src", tmp_path / "pack", shard_size="40KiB", jobs=1,
                 progress=False, echo=lambda _m: None)
    return tmp_path / "pack", files


@pytest.mark.parametrize("where", [0, 1, 2])
@pytest.mark.parametrize("codec", [0, 1], ids=["raw", "zstd"])
def test_corrupt_byte_gives_checksum_error(corruptible: tuple[Path, dict[str, bytes]],
                                           codec: int, where: int) -> None:
    pack, files = corruptible
    with stagefs.open(pack) as fs:
        m = fs.manifest
        victims = [p for p, d in files.items()
                   if len(d) > 100 and m.codec[m.lookup(p.encode())] == codec]
        victim = victims[len(victims) // 2]
        e = m.lookup(victim.encode())
        shard = m.shards[m.shard[e]].name
        # the first byte (a zstd frame's magic: it cannot be decoded), the middle, the last
        off = int(m.offset[e]) + (int(m.stored[e]) - 1) * where // 2
        order = sorted(files, key=lambda p: (m.shard[m.lookup(p.encode())],
                                             m.offset[m.lookup(p.encode())]))
        k = order.index(victim)
        neighbours = order[max(0, k - 3) : k + 4]
    flip_byte(pack / shard, off, 0x01)
    with stagefs.open(pack) as fs:
        for read in (fs.read, lambda p: fs.read_many([p])[0],
                     lambda p: fs.read_many(neighbours)[neighbours.index(p)],
                     lambda p: fs.open(p).read()):
            with pytest.raises(ChecksumError) as info:
                read(victim)
            msg = str(info.value)
            assert victim in msg and shard in msg
            assert info.value.errno == errno.EIO and isinstance(info.value, StagefsError)
        # the neighbours are still served, and right
        for p in neighbours:
            if p != victim:
                assert fs.read(p) == files[p]
        assert fs.stats.checksum_failures >= 4


def test_read_entries_refuses_entries_not_in_the_manifest(busy_store: stagefs.Store) -> None:
    """-1 once read the manifest's last entry (numpy's indexing from the end)."""
    n = len(busy_store.manifest)
    e = busy_store.namespace.file_entry("d0/f000")
    for bad in ([-1], [-1, e], [e, n], [n + 5]):
        with pytest.raises(IndexError, match="not in this pack's manifest"):
            busy_store.read_entries(bad)
    assert busy_store.read_entries([e, e]) == [busy_store.read("d0/f000")] * 2
    # one entry alone, as read_entry: -1 read the last file, n numpy's IndexError
    for bad_one in (-1, n, 2**70):
        with pytest.raises(IndexError, match="not in this pack's manifest"):
            busy_store.read_entry(bad_one)
    with pytest.raises(IndexError, match="not in this pack's manifest"):
        busy_store.read_entries([2**70])  # was numpy's OverflowError
    # a float was taken as the entry it rounds down to
    for not_whole in ([float(e)], np.array([e + 0.5]), ["1"], [True]):
        with pytest.raises(TypeError, match="whole number"):
            busy_store.read_entries(not_whole)
    with pytest.raises(TypeError, match="whole number"):
        busy_store.read_entry(float(e))  # type: ignore[arg-type]


def test_read_entries_takes_whole_numbers_of_any_kind(busy_store: stagefs.Store) -> None:
    """numpy makes floats of numpy's uint64 next to an int: such entries were refused as
    floats, and a list holding None was refused naming its first, good, entry."""
    es = [e for e in range(len(busy_store.manifest)) if busy_store.namespace.isfile(
        busy_store.manifest.path_of(e))][:3]
    want = [busy_store.read_entry(e) for e in es]
    assert busy_store.read_entries([np.uint64(es[0]), es[1], np.int8(es[2])]) == want
    assert busy_store.read_entries(e for e in es) == want  # as read_many takes paths
    with pytest.raises(IndexError, match="not in this pack's manifest"):
        busy_store.read_entries([np.uint64(es[0]), 2**63])
    for bad, shown in ((None, "None"), (float(es[1]), repr(float(es[1]))), ("d0", "'d0'")):
        with pytest.raises(TypeError, match="whole number") as info:
            busy_store.read_entries([np.uint64(es[0]), bad])
        assert shown in str(info.value)
    with pytest.raises(TypeError, match="read_entry"):
        busy_store.read_entries(np.int64(es[0]))  # type: ignore[arg-type]


def test_one_entry_or_path_as_a_0d_array_is_refused_by_name(busy_store: stagefs.Store) -> None:
    """A 0-d array (``entries[k]`` of an array kept 0-d, ``np.asarray(e)``) raised numpy's
    "len() of unsized object", and one path as a 0-d array "iteration over a 0-d array"."""
    e = busy_store.namespace.file_entry("d0/f000")
    with pytest.raises(TypeError, match=r"takes a list of entries.*read_entry\(\) reads one"):
        busy_store.read_entries(np.array(e))
    with pytest.raises(TypeError, match=r"takes a list of paths.*read\(\) reads one"):
        busy_store.read_many(np.array("d0/f000"))  # type: ignore[arg-type]
    assert busy_store.read_entries(np.array([e])) == [busy_store.read("d0/f000")]


def test_a_closed_store_says_so(busy: tuple[Path, dict[str, bytes]]) -> None:
    """After close, a read raised "operation forbidden on released memoryview object"."""
    fs = stagefs.open(busy[0])
    e = fs.namespace.file_entry("d0/f000")
    fs.close()
    for way_in in (lambda: fs.read("d0/f000"), lambda: fs.read_many(["d0/f000"]),
                   lambda: fs.read_entries([e, e]), lambda: fs.stat("d0/f000"),
                   lambda: fs.listdir(""), lambda: fs.open("d0/f000"), lambda: list(fs.walk())):
        with pytest.raises(ValueError, match="closed Store"):
            way_in()
    fs.close()  # twice is fine


def test_a_packs_shards_without_their_manifest_are_not_a_raw_dataset(
        busy: tuple[Path, dict[str, bytes]], tmp_path: Path) -> None:
    """Served as a raw directory of shard files before: every dataset path was missing."""
    import shutil

    from stagefs.errors import CorruptManifestError

    copy = tmp_path / "copy"
    shutil.copytree(busy[0], copy)
    (copy / "manifest.sfm").unlink()
    with pytest.raises(CorruptManifestError, match=r"without its manifest\.sfm"):
        stagefs.open(copy)


def test_switches_take_1_or_0_and_refuse_the_rest(monkeypatch: pytest.MonkeyPatch) -> None:
    from stagefs.config import env_flag
    from stagefs.errors import ConfigError

    for value, want in (("0", False), ("off", False), ("No", False), ("1", True),
                        ("true", True), ("", True)):
        monkeypatch.setenv("STAGEFS_TIER_MAP", value)
        assert env_flag("TIER_MAP") is want
    monkeypatch.setenv("STAGEFS_TIER_MAP", "2")
    with pytest.raises(ConfigError, match="STAGEFS_TIER_MAP='2'"):
        env_flag("TIER_MAP")


def test_read_many_of_a_truncated_shard_says_what_read_says(tmp_path: Path) -> None:
    """The batch reads a shard's files at once (``gather``): those the cut took away are
    read again alone and raise what ``read`` raises, naming the file and the shard; a batch of
    the files before the cut is read whole, and right."""
    files = _busy_tree(tmp_path / "src")
    stagefs.pack(tmp_path / "src", tmp_path / "pack", shard_size="40KiB", jobs=1,
                 progress=False, echo=lambda _m: None)
    with stagefs.open(tmp_path / "pack") as fs:
        m = fs.manifest
        shard = int(m.shard[m.lookup(b"d0/f007")])
        mine = sorted((p for p, d in files.items() if d and m.shard[m.lookup(p.encode())] == shard),
                      key=lambda p: int(m.offset[m.lookup(p.encode())]))
        cut = int(m.offset[m.lookup(mine[len(mine) // 2].encode())]) + 1
        name = m.shards[shard].name
    assert len(mine) >= 4
    os.truncate(tmp_path / "pack" / name, cut)
    with stagefs.open(tmp_path / "pack") as fs:
        whole = mine[: len(mine) // 2]
        assert fs.read_many(whole) == [files[p] for p in whole]
        for read in (fs.read, lambda p: fs.read_many(mine)[mine.index(p)]):
            with pytest.raises(CorruptShardError, match="truncated") as info:
                read(mine[-1])
            assert name in str(info.value)
            # the file read (in the batch, the first of those cut), then why
            assert str(info.value).split(": ")[0] in mine[len(mine) // 2 :]


@pytest.mark.parametrize("err", [
    ChecksumError("c0/f1.bin", "shard shard-000001.sfs via origin"),
    OriginUnavailableError("/pfs/ds", "shard shard-000002.sfs", "origin (unavailable)"),
    NotFoundError("a/missing"), ReadOnlyError("a/file"), CorruptShardError("bad header")],
    ids=lambda e: type(e).__name__)
def test_errors_cross_processes_as_they_are(err: StagefsError) -> None:
    """An error raised in a worker process reaches its parent pickled: it must come back the
    same (class, message, errno, path). Errors whose __init__ takes other arguments than
    OSError's could not be unpickled, and a multiprocessing pool's result thread died on one,
    leaving the caller waiting for its result until its timeout."""
    got = pickle.loads(pickle.dumps(err))
    assert type(got) is type(err)
    assert str(got) == str(err) and got.args == err.args and vars(got) == vars(err)
    if isinstance(err, OSError):
        assert isinstance(got, OSError)
        assert (got.errno, got.strerror, got.filename) == (err.errno, err.strerror,
                                                           err.filename)


def test_corrupt_large_file_through_range_reads(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    import stagefs.fileobj as fileobj

    src = tmp_path / "src"
    src.mkdir()
    data = random_bytes(300_000, 8)
    (src / "big").write_bytes(data)
    stagefs.pack(src, tmp_path / "pack", jobs=1, progress=False, echo=lambda _m: None)
    flip_byte(tmp_path / "pack" / shard_name(0), 64 + 250_000, 0x01)
    monkeypatch.setattr(fileobj, "WHOLE_READ_LIMIT", 1000)
    with stagefs.open(tmp_path / "pack") as fs:
        with fs.open("big", buffering=4096) as f:
            assert isinstance(f, fileobj.LargeFile)
            with pytest.raises(ChecksumError, match="big"):
                f.read()
        with fs.open("big") as f, pytest.raises(ChecksumError, match=shard_name(0)):
            while f.read(10_000):
                pass


@pytest.mark.parametrize("mode", ["w", "wb", "a", "ab", "x", "xb", "r+", "rb+", "w+b", "r+b"])
def test_open_for_writing_is_erofs(sample_store: stagefs.Store, mode: str) -> None:
    for path in ("a.txt", "new-file"):
        with pytest.raises(OSError) as info:
            sample_store.open(path, mode)
        assert info.value.errno == errno.EROFS
        assert isinstance(info.value, ReadOnlyError) and isinstance(info.value, StagefsError)
        assert path in str(info.value)


def test_file_object_is_read_only(sample_store: stagefs.Store) -> None:
    with sample_store.open("a.txt") as f:
        assert f.readable() and f.seekable() and not f.writable()
        assert f.name == "a.txt" and f.mode == "rb"
        with pytest.raises(OSError) as info:
            f.write(b"x")
        assert info.value.errno == errno.EROFS
        with pytest.raises(io.UnsupportedOperation):
            f.fileno()
    assert f.closed


def test_open_text_mode(sample_pack_session: tuple[Path, Path],
                        sample_store: stagefs.Store) -> None:
    real = (sample_pack_session[0] / "a.txt").read_text()
    with sample_store.open("a.txt", "r") as f:
        assert f.read() == real
    with sample_store.open("a.txt", "rt") as f:
        assert f.readlines() == real.splitlines(keepends=True)
    with pytest.raises(ValueError, match="mode"):
        sample_store.open("a.txt", "rz")


def test_pickled_store_works(sample_pack_session: tuple[Path, Path]) -> None:
    src = sample_pack_session[0]
    with stagefs.open(sample_pack_session[1]) as fs:
        blob = pickle.dumps(fs)
        fs.read("a.txt")
    copy = pickle.loads(blob)  # the original is closed by now
    with copy:
        assert isinstance(copy, stagefs.Store)
        assert copy.read("a.txt") == (src / "a.txt").read_bytes()
        assert copy.read_many(["img/cat.jpg", "empty.bin"]) == [
            (src / "img/cat.jpg").read_bytes(), b""]
        assert sorted(copy.listdir("")) == sorted(os.listdir(src))
        assert copy.verify
    unverified = pickle.loads(pickle.dumps(stagefs.open(sample_pack_session[1], verify=False)))
    with unverified:
        assert unverified.verify is False


def test_context_manager_and_repr(sample_pack_session: tuple[Path, Path]) -> None:
    with stagefs.open(sample_pack_session[1]) as fs:
        assert str(sample_pack_session[1]) in repr(fs)
        info = fs.info()
    assert info["files"] == 10 and info["directories"] == 5 and info["symlinks"] == 5
    fs.close()  # closing twice is fine


def test_open_refuses_what_is_not_a_pack(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="nowhere") as info:
        stagefs.open(tmp_path / "nowhere")
    assert isinstance(info.value, StagefsError)
    (tmp_path / "f").write_bytes(b"")
    with pytest.raises(StagefsError, match="f"):
        stagefs.open(tmp_path / "f")


def test_public_api() -> None:
    assert stagefs.__all__ == sorted(stagefs.__all__)
    assert len(set(stagefs.__all__)) == len(stagefs.__all__)
    for name in stagefs.__all__:
        assert hasattr(stagefs, name), name
    for name in ("open", "pack", "unpack", "Store", "StagefsError", "__version__"):
        assert name in stagefs.__all__
    assert isinstance(stagefs.__version__, str) and stagefs.__version__
    for name in stagefs.__all__:
        obj = getattr(stagefs, name)
        if isinstance(obj, type) and issubclass(obj, BaseException):
            assert issubclass(obj, stagefs.StagefsError), name


def test_read_many_through_symlinks(sample_pack_session: tuple[Path, Path],
                                    sample_store: stagefs.Store) -> None:
    src = sample_pack_session[0]
    paths = ["link_file", "link_dir/cat.jpg", "img/up", "link_chain", "a.txt", "link_dir/up",
             "/img/../a.txt", "empty.bin"]
    assert sample_store.read_many(paths) == [(src / p.lstrip("/")).read_bytes() for p in paths]
    with pytest.raises(FileNotFoundError, match="link_dangling"):
        sample_store.read_many(["a.txt", "link_dangling"])


# --------------------------------------------------------------------------- batched origin reads


class _Recording:
    """An origin that waits on every read (as a remote file system does) and records how many
    reads were under way at once."""

    def __init__(self, inner: object, delay: float) -> None:
        import threading

        self.inner, self.delay, self.name = inner, delay, "origin"
        self.now = self.most = self.calls = 0
        self.by: list[int] = []  # the thread of each read, in the order they began
        self._lock = threading.Lock()

    def pread(self, shard: int, offset: int, length: int) -> bytes:
        import threading
        import time

        with self._lock:
            self.now += 1
            self.calls += 1
            self.most = max(self.most, self.now)
            self.by.append(threading.get_ident())
        try:
            if self.delay:  # a sleep of 0 still takes 70 us here: more than a cached read
                time.sleep(self.delay)
            return self.inner.pread(shard, offset, length)  # type: ignore[attr-defined]
        finally:
            with self._lock:
                self.now -= 1

    def close(self) -> None:
        self.inner.close()  # type: ignore[attr-defined]


def _scattered(fs: stagefs.Store, files: dict[str, bytes], k: int) -> list[str]:
    """k non-empty files no two of which sit next to each other (one origin read each)."""
    m = fs.manifest
    order = sorted((p for p, d in files.items() if d),
                   key=lambda p: (m.shard[m.lookup(p.encode())], m.offset[m.lookup(p.encode())]))
    picked = order[::3][:k]
    random.Random(5).shuffle(picked)
    return picked


def _recording_store(pack: Path, delay: float) -> tuple[stagefs.Store, _Recording]:
    from stagefs.store import Store
    from stagefs.tiers.origin import PackOrigin

    manifest = stagefs.format.Manifest(str(pack / stagefs.format.MANIFEST_NAME))
    rec = _Recording(PackOrigin(str(pack), manifest), delay)
    return Store(str(pack), manifest=manifest, origin=rec), rec  # type: ignore[arg-type]


def test_read_many_reads_the_origin_from_several_threads(
        busy: tuple[Path, dict[str, bytes]], monkeypatch: pytest.MonkeyPatch) -> None:
    pack, files = busy
    fs, rec = _recording_store(pack, 0.02)
    with fs:
        batch = _scattered(fs, files, 24)
        assert fs.read_many(batch) == [files[p] for p in batch]
        assert rec.calls == len(batch)
        assert 2 <= rec.most <= fs.read_threads == 8
    monkeypatch.setenv("STAGEFS_READ_THREADS", "1")
    fs, rec = _recording_store(pack, 0.002)
    with fs:
        assert fs.read_threads == 1
        batch = _scattered(fs, files, 24)
        assert fs.read_many(batch) == [files[p] for p in batch]
        assert rec.most == 1  # one at a time, in the calling thread


def test_reads_below_a_millisecond_that_wait_on_the_file_system_go_to_threads(
        busy: tuple[Path, dict[str, bytes]]) -> None:
    """The test PFS answers a random 110 KB read in about 0.76 ms: under the 1 ms the rule
    once asked, so a partial-capacity epoch read its origin files one at a time, at half
    the rate of 8 in flight."""
    pack, files = busy
    fs, rec = _recording_store(pack, 0.0006)
    with fs:
        batch = _scattered(fs, files, 24)
        assert fs.read_many(batch) == [files[p] for p in batch]
        assert rec.most >= 2


def test_a_batch_after_one_that_waited_goes_to_the_threads_at_its_first_wait(
        busy: tuple[Path, dict[str, bytes]]) -> None:
    """Judging each batch afresh made its first reads one after the other, each a shared
    file system's latency: about a tenth of the later epochs with partial capacity. After
    a batch that went to the threads, the next one goes at its first read that waits; a
    first read that does not wait (the page cache now) keeps the batch in this thread."""
    import threading

    pack, files = busy
    fs, rec = _recording_store(pack, 0.002)
    me = threading.get_ident()
    with fs:
        batches = [_scattered(fs, files, 24)[i::4] for i in range(4)]

        def here(batch: list[str]) -> int:  # reads made in this thread for the batch
            rec.by.clear()
            assert fs.read_many(batch) == [files[p] for p in batch]
            assert len(rec.by) == len(batch)
            return rec.by.count(me)

        assert here(batches[0]) == 3  # two waited, then one more here, the rest in threads
        assert here(batches[1]) == 2  # the first waited: one more here, the rest in threads
        assert rec.most >= 2
        rec.delay = 0.0  # the file system answers at once now (its page cache)
        assert here(batches[2]) == len(batches[2])
        assert here(batches[3]) == len(batches[3])


@pytest.mark.parametrize(("elapsed", "nbytes", "slow"), [
    (21e-6, 110_000, False),      # the page cache (a FUSE client's too): 5 GB/s
    (576e-6, 4_000_000, False),   # a large file from the page cache, 7 GB/s
    (60e-6, 110_000, False),      # a busy node's page cache
    (0.76e-3, 110_000, True),     # the test PFS, a random read alone
    (0.3e-3, 110_000, True),      # a local disk not cached
    (12e-3, 4_000_000, True),     # a large file from the test PFS
])
def test_what_waited_on_a_file_system(elapsed: float, nbytes: int, slow: bool) -> None:
    from stagefs.store import waited

    assert waited(elapsed, nbytes) is slow


def test_fast_origin_reads_stay_in_the_calling_thread(
        busy: tuple[Path, dict[str, bytes]]) -> None:
    """Reads that come back at once (the page cache, a local disk) are not worth a thread:
    only a slow one sends the rest of the batch to the reader threads."""
    pack, files = busy
    fs, rec = _recording_store(pack, 0.0)
    with fs:
        batch = _scattered(fs, files, 24)
        assert fs.read_many(batch) == [files[p] for p in batch]
        assert rec.most == 1 and fs._pool is None


@pytest.mark.parametrize("value", ["0", "many", "-2"])
def test_read_threads_must_be_a_positive_number(busy: tuple[Path, dict[str, bytes]],
                                                monkeypatch: pytest.MonkeyPatch,
                                                value: str) -> None:
    from stagefs.errors import ConfigError

    monkeypatch.setenv("STAGEFS_READ_THREADS", value)
    with pytest.raises(ConfigError, match="STAGEFS_READ_THREADS"):
        stagefs.open(busy[0])


def test_a_bad_file_read_by_a_helper_thread_is_reported(
        corruptible: tuple[Path, dict[str, bytes]]) -> None:
    """The corrupt file is not the first of the batch, so a reader thread finds it: the
    caller gets the same ChecksumError as a read alone, and the good files stay right."""
    pack, files = corruptible
    with stagefs.open(pack) as fs:
        batch = _scattered(fs, files, 20)
        victim = batch[-1]
        m = fs.manifest
        e = m.lookup(victim.encode())
        shard = m.shards[m.shard[e]].name
        off = int(m.offset[e]) + int(m.stored[e]) // 2
    flip_byte(pack / shard, off, 0x01)
    with stagefs.open(pack) as fs:
        with pytest.raises(ChecksumError, match=victim):
            fs.read_many(batch)
        assert fs.read_many(batch[:-1]) == [files[p] for p in batch[:-1]]


def test_read_many_in_a_forked_child(busy: tuple[Path, dict[str, bytes]]) -> None:
    """The reader threads are not copied by fork: a child that inherits the Store (as a
    DataLoader worker does) makes its own, and reads right."""
    import multiprocessing

    pack, files = busy
    fs, _rec = _recording_store(pack, 0.002)  # a remote file system's latency: threads
    with fs:
        batch = _scattered(fs, files, 16)
        want = [files[p] for p in batch]
        assert fs.read_many(batch) == want  # the parent's threads exist now
        assert fs._pool is not None

        def child() -> None:
            os._exit(0 if fs.read_many(batch) == want and fs._pool[1] is not parent else 1)

        parent = fs._pool[1]
        proc = multiprocessing.get_context("fork").Process(target=child)
        proc.start()
        proc.join(60)
        if proc.exitcode is None:
            proc.kill()
        assert proc.exitcode == 0


def test_origin_shards_are_read_without_read_ahead(busy: tuple[Path, dict[str, bytes]],
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Samples are read in a random order: the origin tells the kernel so for every shard
    it opens (the read-ahead of a small read fetches its neighbours ahead of need)."""
    advised: list[tuple[int, int, int, int]] = []
    real = os.posix_fadvise

    def record(fd: int, offset: int, length: int, advice: int) -> None:
        advised.append((fd, offset, length, advice))
        real(fd, offset, length, advice)

    monkeypatch.setattr(os, "posix_fadvise", record)
    pack, files = busy
    with stagefs.open(pack) as fs:
        batch = _scattered(fs, files, 30)
        assert fs.read_many(batch) == [files[p] for p in batch]
        opened = fs.origin.descriptors()
        assert len(opened) >= 2 and fs.origin.stats.opens == len(opened)
        assert sorted(a[0] for a in advised) == sorted(opened.values())
        assert {a[1:] for a in advised} == {(0, 0, os.POSIX_FADV_RANDOM)}


def test_the_kernel_read_ahead_can_be_kept(busy: tuple[Path, dict[str, bytes]],
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """STAGEFS_ORIGIN_READAHEAD=kernel leaves the kernel's read-ahead on (an idle, fast
    link); a value it does not know fails the open, naming the variable."""
    from stagefs.errors import ConfigError

    advised: list[int] = []
    monkeypatch.setattr(os, "posix_fadvise", lambda fd, o, n, a: advised.append(fd))
    pack, files = busy
    monkeypatch.setenv("STAGEFS_ORIGIN_READAHEAD", "kernel")
    with stagefs.open(pack) as fs:
        batch = _scattered(fs, files, 10)
        assert fs.read_many(batch) == [files[p] for p in batch]
        assert fs.origin.stats.opens >= 2 and advised == []
    monkeypatch.setenv("STAGEFS_ORIGIN_READAHEAD", "sometimes")
    with pytest.raises(ConfigError, match="STAGEFS_ORIGIN_READAHEAD"):
        stagefs.open(pack)


def test_an_unreadable_shard_says_why(busy: tuple[Path, dict[str, bytes]], tmp_path: Path
                                      ) -> None:
    """A shard file the origin cannot read (here a directory in its place; a permission, a
    file system gone) fails with OriginUnavailableError carrying the system's reason, from
    read and from read_many alike."""
    import shutil

    pack = tmp_path / "pack"
    shutil.copytree(busy[0], pack)
    with stagefs.open(pack) as fs:
        m = fs.manifest
        victim = next(p for p, d in sorted(busy[1].items()) if d)
        name = m.shards[int(m.shard[m.lookup(victim.encode())])].name
    (pack / name).unlink()
    (pack / name).mkdir()
    with stagefs.open(pack) as fs:
        for read in (fs.read, lambda p: fs.read_many([p, p])[0]):
            with pytest.raises(OriginUnavailableError) as info:
                read(victim)
            assert name in str(info.value) and "Is a directory" in str(info.value)


def test_a_reader_at_its_open_file_limit_is_told_so(busy: tuple[Path, dict[str, bytes]]) -> None:
    """Out of descriptors, a read said "the origin cannot be read ... Is the shared file
    system mounted?": now the limit, and what to raise it with."""
    import subprocess
    import sys

    script = (
        "import os, resource, sys, stagefs\n"
        "from stagefs.errors import DescriptorLimitError\n"
        "fs = stagefs.open(sys.argv[1])\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (64, resource.getrlimit("
        "resource.RLIMIT_NOFILE)[1]))\n"
        "held = []\n"
        "try:\n"
        "    while True: held.append(os.open(os.devnull, os.O_RDONLY))\n"
        "except OSError: pass\n"
        "try:\n"
        "    fs.read(sys.argv[2]); print('read')\n"
        "except DescriptorLimitError as exc:\n"
        "    print('limit', exc.errno, exc)\n"
        "for fd in held: os.close(fd)\n"
        "print('after', fs.read(sys.argv[2]) == open(sys.argv[3], 'rb').read())\n")
    src = busy[0].parent / "src" / "d0" / "f000"
    run = subprocess.run([sys.executable, "-c", script, str(busy[0]), "d0/f000", str(src)],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    first, after = run.stdout.splitlines()[-2:]
    assert first.startswith(f"limit {errno.EMFILE} ") and "open-file limit (64;" in first
    assert "ulimit -n" in first and "shared file system" not in first
    assert after == "after True"
