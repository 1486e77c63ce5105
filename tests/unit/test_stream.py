"""The cold pipeline (tiers/stream.py): shards stream into the tiers in large reads, several
at once, in the order they will be needed; readers wait for what a stream holds and read
the rest themselves; across the processes of a node every origin byte is read once."""

from __future__ import annotations

import contextlib
import errno
import multiprocessing
import os
import random
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import stagefs
from stagefs.format import MANIFEST_NAME, Manifest, checksum
from stagefs.format.spec import SHARD_HEADER
from stagefs.tiers import stream as stream_mod
from stagefs.tiers.stream import Controller
from tiers_helpers import make_tree


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, bytes]]:
    base = tmp_path_factory.mktemp("stream")
    files = make_tree(base / "raw", n=240, seed=5)
    stagefs.pack(base / "raw", base / "pack", shard_size="48KiB", jobs=1, progress=False,
                 echo=lambda _m: None)
    return base / "pack", files


def stored_total(pack: Path) -> int:
    m = Manifest(str(pack / MANIFEST_NAME))
    try:
        return int(m.arrays["stored"].sum())
    finally:
        m.close()


# -- the controller ------------------------------------------------------------------------


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def run_windows(c: Controller, clock: FakeClock, rate_with: Any, windows: int,
                busy: bool = True) -> list[int]:
    """Feed ``windows`` measurement windows in which n streams read rate_with(n) bytes/s."""
    total, seen = 0, []
    c.update(total, busy)
    for _ in range(windows):
        n = c.target
        clock.now += c.window
        total += int(rate_with(n) * c.window)
        seen.append(c.update(total, busy))
    return seen


def test_the_controller_doubles_streams_while_throughput_rises() -> None:
    clock = FakeClock()
    c = Controller(clock, most=8, first=1)
    # a link that one stream reads at 380 MB/s, and more a little faster, up to 446 MB/s
    rates = {1: 380e6, 2: 410e6, 3: 430e6, 4: 440e6}
    seen = run_windows(c, clock, lambda n: rates.get(n, 446e6), 10)
    # doubling to eight did not pay (1.4%): six and five are tried, then back to four
    assert seen[:6] == [2, 4, 8, 6, 5, 4]
    assert c.target == 4 and c.settled
    # from four at first (the default), the same search in fewer windows
    c = Controller(clock, most=8)
    assert c.target == stream_mod.FIRST_STREAMS == 4
    seen = run_windows(c, clock, lambda n: rates.get(n, 446e6), 6)
    assert seen[:4] == [8, 6, 5, 4] and c.settled


def test_the_controller_searches_between_a_count_that_paid_and_one_that_did_not() -> None:
    """Throughput that rises up to twelve streams and falls after: sixteen pays no more than
    eight, so the search goes between them and settles on twelve."""
    clock = FakeClock()
    c = Controller(clock, most=32, first=1)
    seen = run_windows(c, clock, lambda n: 100e6 * n if n <= 12 else 100e6 * (24 - n), 12)
    assert seen[:8] == [2, 4, 8, 16, 12, 14, 13, 12]
    assert c.target == 12 and c.settled and seen[-1] == 12


def test_the_controller_stops_at_its_ceiling_and_ignores_idle_windows() -> None:
    clock = FakeClock()
    c = Controller(clock, most=3, first=1)
    run_windows(c, clock, lambda n: 100e6, 5, busy=False)  # nothing to stream: no judgement
    assert c.target == 1 and not c.settled
    run_windows(c, clock, lambda n: n * 100e6, 6)  # every stream pays
    assert c.target == 3 and c.settled


def test_the_controller_measures_bytes_not_calls() -> None:
    """A window is judged by the bytes read in it: updates inside one window change
    nothing, whatever their number."""
    clock = FakeClock()
    c = Controller(clock, window=0.5, first=1)
    c.update(0, True)
    for k in range(100):
        clock.now += 0.001
        assert c.update(k * 10**6, True) == 1
    clock.now += 0.5
    assert c.update(500 * 10**6, True) == 2


# -- reads and streams share one download ---------------------------------------------------


def _epoch_part(pack: str, tier: str, runtime: str, paths: list[str], batched: bool,
                want: dict[str, int], out: Any) -> None:
    os.environ["STAGEFS_RUNTIME"] = runtime
    bad = []
    with stagefs.open(pack, tiers=[tier]) as fs:
        if batched:
            for k in range(0, len(paths), 16):
                batch = paths[k : k + 16]
                for p, data in zip(batch, fs.read_many(batch), strict=True):
                    if checksum(data) != want[p]:
                        bad.append(p)
        else:
            for p in paths:
                if checksum(fs.read(p)) != want[p]:
                    bad.append(p)
        fs.chain.wait_idle(60)
        origin = fs.origin.stats.bytes_read
    out.put((origin, bad))


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_one_epoch_reads_each_origin_byte_once_across_processes(
        dataset: tuple[Path, dict[str, bytes]], runtime: Path, tmp_path: Path,
        method: str) -> None:
    """Three processes of one node (DataLoader workers, say) read one epoch in a random
    order between them, one with read_many; their streams and reads share one download."""
    pack, files = dataset
    want = {p: checksum(d) for p, d in files.items()}
    order = sorted(files)
    random.Random(11).shuffle(order)
    parts = [order[k::3] for k in range(3)]
    ctx = multiprocessing.get_context(method)
    out = ctx.Queue()
    procs = [ctx.Process(target=_epoch_part,
                         args=(str(pack), str(tmp_path / "tier"), str(runtime), part, k == 0,
                               want, out))
             for k, part in enumerate(parts)]
    for p in procs:
        p.start()
    got = [out.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    assert [bad for _, bad in got] == [[], [], []]
    assert sum(origin for origin, _ in got) == stored_total(pack)
    # and the tier holds the whole pack, byte for byte
    with stagefs.open(pack, tiers=[str(tmp_path / "tier")], runtime=runtime) as fs:
        assert fs.held_shards() == set(range(len(fs.manifest.shards)))
        for p in order[:40]:
            assert fs.read(p) == files[p]
        assert fs.origin.stats.bytes_read == 0


def test_the_stream_follows_the_prefetch_order(dataset: tuple[Path, dict[str, bytes]],
                                               runtime: Path, tmp_path: Path) -> None:
    pack, files = dataset
    with stagefs.open(pack, tiers=[str(tmp_path / "tier")], runtime=runtime) as fs:
        assert fs.chain is not None
        ctl = fs.chain.stream.controller
        ctl.most = ctl.target = 1  # one stream: the order is the queue's
        n = len(fs.manifest.shards)
        order = list(range(n))
        random.Random(2).shuffle(order)
        fs.prefetch(order)
        assert fs.chain.wait_idle(60)
        assert fs.chain.stream.started == order
        assert fs.held_shards() == set(range(n))
        assert fs.origin.stats.bytes_read == stored_total(pack)
        for p in sorted(files):
            assert fs.read(p) == files[p]
        assert fs.origin.stats.bytes_read == stored_total(pack)


@pytest.fixture
def quiet_streams(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """No stream threads: reads alone."""
    monkeypatch.setattr(stream_mod.Stream, "_grow", lambda self: None)
    yield


def _stalled_streams(monkeypatch: pytest.MonkeyPatch, fs: Any, readers: list[str] | None = None
                     ) -> tuple[threading.Event, threading.Event]:
    """The origin's reads in stream threads stall until ``release`` is set (``entered``: one
    has begun); the names of the other threads that read it go to ``readers``."""
    entered, release = threading.Event(), threading.Event()
    origin_type = type(fs.chain.origin)
    real_pread = origin_type.pread

    def pread(self: Any, shard: int, offset: int, length: int, **_kw: Any) -> bytes:
        name = threading.current_thread().name
        if name.startswith("stagefs-stream"):
            entered.set()
            assert release.wait(60)  # the stalled read
        elif readers is not None:
            readers.append(name)
        return bytes(real_pread(self, shard, offset, length))

    monkeypatch.setattr(origin_type, "pread", pread)
    monkeypatch.setattr(origin_type, "pread_through", pread)  # the streams' reads
    return entered, release


def _last_of_shard0(fs: Any, files: dict[str, bytes]) -> str:
    """The non-empty file of shard 0 stored last in it."""
    m = fs.manifest
    entry = {p: fs.namespace.file_entry(p) for p in files if files[p]}
    return max(entry, key=lambda p: (int(m.shard[entry[p]]) == 0, int(m.offset[entry[p]])))


def test_a_read_waits_for_the_stream_on_its_shard_rather_than_reading_itself(
        dataset: tuple[Path, dict[str, bytes]], runtime: Path, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A read of a file the stream on its shard is about to reach waits for it: the origin
    sees only the stream's large reads, none of the reader's own."""
    pack, files = dataset
    readers: list[str] = []
    with stagefs.open(pack, tiers=[str(tmp_path / "tier")], runtime=runtime) as fs:
        chain = fs.chain
        assert chain is not None
        entered, release = _stalled_streams(monkeypatch, fs, readers)
        last = _last_of_shard0(fs, files)
        fs.prefetch([0])  # the stream takes shard 0 and blocks in its first read
        assert entered.wait(60)
        waiting = threading.Event()
        real_coming = getattr(stream_mod.Stream, "coming", None)
        if real_coming is not None:
            def coming(self: Any, shard: int, offset: int) -> bool:
                got = bool(real_coming(self, shard, offset))
                if got:
                    waiting.set()
                return got

            monkeypatch.setattr(stream_mod.Stream, "coming", coming)
        result: list[bytes] = []
        reader = threading.Thread(target=lambda: result.append(fs.read(last)))
        reader.start()
        try:
            while not (waiting.is_set() or readers or not reader.is_alive()):
                waiting.wait(0.01)  # until it waits for the stream, or reads by itself
            assert readers == [] and reader.is_alive()
        finally:
            release.set()
        reader.join(60)
        assert result == [files[last]]
        assert readers == []  # every origin byte came through the stream
        assert chain.misses == 0


def test_a_read_far_ahead_of_the_stream_reads_itself(
        dataset: tuple[Path, dict[str, bytes]], runtime: Path, tmp_path: Path) -> None:
    """The wait is bounded: a stream that reaches the bytes within STREAM_WAIT_S at the
    rate its reads run is waited for, one further off is not, nor a shard no stream is on."""
    pack, _ = dataset
    with stagefs.open(pack, tiers=[str(tmp_path / "tier")], runtime=runtime) as fs:
        assert fs.chain is not None
        st = fs.chain.stream
        assert not st.coming(0, 10)  # no stream on shard 0
        st._at[0] = 1000
        assert st.coming(0, 500)  # behind it: held by a reader the stream waits for
        assert st.coming(0, 10**9)  # no rate measured yet: wait
        st._measure(0, 2000, stream_mod.CHUNK, 0.1)  # 4 MiB in 0.1 s: 42 MB/s
        rate = stream_mod.CHUNK / 0.1
        near = 2000 + int(rate * stream_mod.STREAM_WAIT_S * 0.9)
        far = 2000 + int(rate * stream_mod.STREAM_WAIT_S * 1.1)
        assert st.coming(0, near) and not st.coming(0, far)
        st._at.clear()


def _hold_then_fill(pack: str, tier: str, runtime: str, path: str, held: Any, go: Any,
                    out: Any) -> None:
    """Reserve one file as a stream would, say so, wait for the word, then read it from the
    origin into the partial copy and let go."""
    os.environ["STAGEFS_RUNTIME"] = runtime
    with stagefs.open(pack, tiers=[tier]) as fs:
        chain = fs.chain
        assert chain is not None
        e = fs.namespace.file_entry(path)
        shard, off = int(fs.manifest.shard[e]), int(fs.manifest.offset[e])
        ext = chain._extents_of(shard)
        lo, hi = ext.touching(off, off + int(fs.manifest.stored[e]))
        p = int(ext.piece[lo])
        fill, t = chain._reserve(shard, [p])[p]
        h = chain.stream.res.held(shard, fill)
        assert h is not None
        assert chain.stream.res.take(h, lo, hi) == [(lo, hi)]
        held.set()
        go.wait(60)
        chain.stream._copy(shard, fill, t, h, lo, hi, bulk=True)
        chain.stream.res.release(h, lo, hi)
        out.put(fs.origin.stats.bytes_read)


def test_a_reader_waits_for_a_file_another_process_holds(
        dataset: tuple[Path, dict[str, bytes]], runtime: Path, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch, quiet_streams: None) -> None:
    pack, files = dataset
    path = next(p for p in sorted(files) if len(files[p]) > 1000)
    ctx = multiprocessing.get_context("spawn")
    held, go, out = ctx.Event(), ctx.Event(), ctx.Queue()
    child = ctx.Process(target=_hold_then_fill,
                        args=(str(pack), str(tmp_path / "tier"), str(runtime), path, held, go,
                              out))
    child.start()
    assert held.wait(60)
    refused = threading.Event()  # the reader found the file held by the other process
    real_take = stream_mod.Reservations.take

    def take(self: Any, h: Any, lo: int, hi: int) -> Any:
        got = real_take(self, h, lo, hi)
        if got is None:
            refused.set()
        return got

    monkeypatch.setattr(stream_mod.Reservations, "take", take)
    with stagefs.open(pack, tiers=[str(tmp_path / "tier")], runtime=runtime) as fs:
        fs.chain.stream.clear()  # type: ignore[union-attr]
        result: list[bytes] = []
        reader = threading.Thread(target=lambda: result.append(fs.read(path)))
        reader.start()
        assert refused.wait(60)
        go.set()
        reader.join(60)
        assert result == [files[path]]
        child_origin = out.get(timeout=60)
        child.join(60)
        assert child.exitcode == 0
        # the bytes came over once, read by the process that held them
        e = fs.namespace.file_entry(path)
        assert child_origin == int(fs.manifest.stored[e])
        mine = fs.origin.stats.bytes_read
    assert mine + child_origin <= stored_total(pack)
    assert fs.chain.tiers[0].stats.hits >= 1  # type: ignore[union-attr]


def test_reads_alone_read_each_file_once_from_many_threads(
        dataset: tuple[Path, dict[str, bytes]], runtime: Path, tmp_path: Path,
        quiet_streams: None) -> None:
    """Eight threads read every file twice over in a random order, with no stream: each
    file comes from the origin once, read by whichever thread reserved it first."""
    pack, files = dataset
    order = sorted(files) * 2
    random.Random(4).shuffle(order)
    errors: list[str] = []
    with stagefs.open(pack, tiers=[str(tmp_path / "tier")], runtime=runtime) as fs:

        def work(k: int) -> None:
            for p in order[k::8]:
                if fs.read(p) != files[p]:
                    errors.append(p)

        threads = [threading.Thread(target=work, args=(k,)) for k in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert errors == []
        assert fs.origin.stats.bytes_read == stored_total(pack)
        assert fs.held_shards() == set(range(len(fs.manifest.shards)))


def test_a_look_does_not_drop_the_copy_another_thread_makes_meanwhile(
        dataset: tuple[Path, dict[str, bytes]], runtime: Path, tmp_path: Path,
        quiet_streams: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """A stream looks for a shard's partial copies (none yet) while a reader makes one and
    reserves a piece in it: the reader must find its piece's copy afterwards (else it reads
    the file from the origin and the stream reads it again)."""
    from stagefs.tiers import chain as chain_mod

    pack, _ = dataset
    with stagefs.open(pack, tiers=[str(tmp_path / "tier")], runtime=runtime) as fs:
        chain = fs._policy
        assert isinstance(chain, chain_mod.TierChain)
        looking, go_on = threading.Event(), threading.Event()
        real_open = chain_mod.open_fill

        def slow_open(*args: Any) -> Any:
            got = real_open(*args)  # nothing there yet: the look will find no copy
            if threading.current_thread().name == "look":
                looking.set()
                go_on.wait(30)
            return got

        monkeypatch.setattr(chain_mod, "open_fill", slow_open)
        look = threading.Thread(target=chain._look, args=(0,), name="look")
        look.start()
        assert looking.wait(30)
        reserve = threading.Thread(target=chain._reserve, args=(0, [0]))
        reserve.start()
        reserve.join(0.5)  # a reserve that does not wait for the look ends here (the bug)
        go_on.set()
        look.join(30)
        reserve.join(30)
        assert chain._owner(0, 0) is not None


def test_a_file_filled_between_the_look_and_the_reservation_is_a_tier_hit(
        dataset: tuple[Path, dict[str, bytes]], runtime: Path, tmp_path: Path,
        quiet_streams: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """A reader finds its file not in the partial copy yet, and by the time it reserves it
    another process has filled it: it reads the copy (a tier hit), not counted as a miss."""
    from stagefs.tiers import fill as fill_mod

    pack, files = dataset
    path = sorted(files)[3]
    with stagefs.open(pack, tiers=[str(tmp_path / "tier")], runtime=runtime) as fs:
        chain = fs.chain
        assert chain is not None
        assert fs.read(path) == files[path]  # read from the origin into the partial copy
        misses, hits = chain.misses, chain.tiers[0].stats.hits
        real = fill_mod.ShardFill.covered
        looks = iter([False])  # the first look sees it missing (filled right after)
        monkeypatch.setattr(fill_mod.ShardFill, "covered",
                            lambda self, a, b: next(looks, None) is not False and real(self, a, b))
        monkeypatch.setattr(fs, "_holders", lambda shard: (chain.stream.source, chain.origin))
        assert fs.read(path) == files[path]
        assert chain.misses == misses
        assert chain.tiers[0].stats.hits == hits + 1


@pytest.fixture
def large(tmp_path: Path) -> tuple[Path, bytes]:
    """A pack whose one file is larger than a file object reads whole (5 pieces and a bit),
    among small ones."""
    from stagefs.fileobj import WHOLE_READ_LIMIT
    from stagefs.format import PIECE

    raw = tmp_path / "raw"
    (raw / "d").mkdir(parents=True)
    rng = random.Random(7)
    big = rng.randbytes(max(5 * PIECE, WHOLE_READ_LIMIT + PIECE) + 12_345)
    (raw / "d" / "big.bin").write_bytes(big)
    for k in range(5):
        (raw / "d" / f"s{k}.bin").write_bytes(rng.randbytes(3_000 + k))
    stagefs.pack(raw, tmp_path / "pack", compress="none", jobs=1, progress=False,
                 echo=lambda _m: None)
    return tmp_path / "pack", big


def test_a_range_of_a_large_file_reads_its_pieces_once_into_its_copy(
        large: tuple[Path, bytes], runtime: Path, tmp_path: Path, quiet_streams: None) -> None:
    """A range of a large raw file (a FUSE mount's 1 MiB requests) nobody streams is read by the reader as the checksum pieces that cover it,
    which fill its copy: the same ranges again, the rest of the file, and the shard's
    stream later never read them again."""
    from stagefs.format import PIECE

    pack, big = large
    with stagefs.open(pack, tiers=[str(tmp_path / "tier")], runtime=runtime) as fs:
        e = fs.namespace.file_entry("d/big.bin")
        assert fs.read_entry(e, start=PIECE + 5, length=1000) == big[PIECE + 5 : PIECE + 1005]
        assert fs.read_entry(e, start=3 * PIECE, length=PIECE) == big[3 * PIECE : 4 * PIECE]
        assert fs.origin.stats.bytes_read == 2 * PIECE  # pieces 1 and 3
        assert fs.read_entry(e, start=PIECE, length=10) == big[PIECE : PIECE + 10]
        assert fs.read_entry(e, start=3 * PIECE + 7, length=PIECE - 7) == \
            big[3 * PIECE + 7 : 4 * PIECE]
        assert fs.origin.stats.bytes_read == 2 * PIECE  # from the copy now
        assert fs.read("d/big.bin") == big
        assert fs.origin.stats.bytes_read == len(big)  # the rest of it, once


def test_a_whole_file_over_the_run_limit_is_not_read_again_by_the_stream(
        large: tuple[Path, bytes], runtime: Path, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A file larger than a reader's run of files (DIRECT_LIMIT), read whole while its
    shard streams, is reserved and read by its reader or waited for, never both: the epoch
    reads each origin byte once (the reader read it unreserved, and the stream again)."""
    pack, big = large
    monkeypatch.setattr(stream_mod, "DIRECT_LIMIT", len(big) // 4)
    with stagefs.open(pack, tiers=[str(tmp_path / "tier")], runtime=runtime) as fs:
        assert fs.read("d/big.bin") == big
        assert fs.chain is not None
        for _ in range(6000):  # the stream it started ends (well within a minute)
            if fs.chain.stream.idle() and fs.held_shards():
                break
            threading.Event().wait(0.01)
        assert fs.held_shards() == {0}
        assert fs.origin.stats.bytes_read == stored_total(pack)


def test_a_range_of_a_file_over_the_file_limit_reads_only_its_pieces(
        large: tuple[Path, bytes], runtime: Path, tmp_path: Path, quiet_streams: None,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Past FILE_LIMIT a reader does not read a whole file for a range of it, nor the
    file's other pieces: the piece the range lies in, once, into its copy."""
    from stagefs.format import PIECE

    pack, big = large
    monkeypatch.setattr(stream_mod, "FILE_LIMIT", len(big) - 1)
    monkeypatch.setattr(stream_mod, "DIRECT_LIMIT", PIECE)
    with stagefs.open(pack, tiers=[str(tmp_path / "tier")], runtime=runtime) as fs:
        e = fs.namespace.file_entry("d/big.bin")
        for _ in range(2):
            assert fs.read_entry(e, start=2 * PIECE + 1, length=10) == big[2 * PIECE + 1 :
                                                                           2 * PIECE + 11]
            assert fs.origin.stats.bytes_read == PIECE  # the piece that holds the range


def test_a_tier_one_process_found_full_is_full_for_every_process(
        runtime: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two processes of a node (two stores here), a tier of 1.5 MiB: the first reserves a
    large file's first piece and finds no room for another whole piece: full. The second,
    asked for a small shard's piece that would still fit, takes the tier as full too. It
    reserved it: the first process, full, read that shard's files from the origin
    unreserved while the second's copy streamed them (a 3 MiB tier, 46 MB read by three
    processes: one run in four read some bytes twice in the first epoch). Pieces of 1 MiB
    windows (a large dataset's): the small shard's piece fits in what the large file's
    left."""
    from stagefs.tiers import chain as chain_mod

    monkeypatch.setattr(chain_mod, "PIECE_SIZE", 2**20)
    raw = tmp_path / "raw"
    raw.mkdir()
    (raw / "big.bin").write_bytes(random.Random(1).randbytes(3 * 2**20))
    for k in range(5):
        (raw / f"s{k}.bin").write_bytes(random.Random(2 + k).randbytes(20_000))
    stagefs.pack(raw, tmp_path / "pack", shard_size="1MiB", compress="none", jobs=1,
                 progress=False, echo=lambda _m: None)
    tiers = [f"{tmp_path / 'tier'}:{3 * 2**19}"]
    with stagefs.open(tmp_path / "pack", tiers=tiers) as a, \
            stagefs.open(tmp_path / "pack", tiers=tiers) as b:
        assert a.chain is not None and b.chain is not None
        m = a.manifest
        big, small = (int(m.shard[a.namespace.entry(p)]) for p in ("big.bin", "s0.bin"))
        assert big != small
        a.chain._reserve(big, range(a.chain._extents_of(big).pieces))
        assert a.chain.full
        assert b.chain._reserve(small, [0]) == {}
        assert b.chain.full


def _packed(tmp_path: Path, files: dict[str, bytes], **kw: Any) -> Path:
    """``files`` written under tmp_path/raw and packed into tmp_path/pack (16 MiB shards)."""
    raw = tmp_path / "raw"
    raw.mkdir()
    for name, data in files.items():
        (raw / name).write_bytes(data)
    stagefs.pack(raw, tmp_path / "pack", shard_size="16MiB", jobs=1, progress=False,
                 echo=lambda _m: None, **kw)
    return tmp_path / "pack"


def _streamed_by_one(fs: Any) -> Any:
    """Shard 0 of ``fs`` streamed by one stream until the streams are idle; the chain."""
    chain = fs.chain
    assert chain is not None
    ctl = chain.stream.controller
    ctl.most = ctl.target = 1
    fs.prefetch([0])
    assert chain.wait_idle(60)
    return chain


def test_a_slow_origin_is_streamed_in_short_runs(runtime: Path, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A sample reaches its reader when the stream's run it is in has been read: at a slow
    origin the runs shrink to about RUN_S of the stream's measured rate (4 MiB at 2 MB/s
    kept a sample 2 s), and each origin byte is still read once."""
    rng = random.Random(3)
    files = {f"f{i:03d}": rng.randbytes(64 * 2**10) for i in range(160)}  # 10 MiB
    _packed(tmp_path, files)
    clock = FakeClock()
    rate = 2e6  # bytes/s of the origin, on the injected clock
    sizes: list[int] = []
    with stagefs.open(tmp_path / "pack", tiers=[str(tmp_path / "tier")],
                      runtime=runtime) as fs:
        chain = fs.chain
        assert chain is not None
        stream = chain.stream
        ctl = stream.controller
        ctl.most = ctl.target = 1
        monkeypatch.setattr(stream, "_clock", clock)
        origin_type = type(chain.origin)
        real_pread = origin_type.pread

        def pread(self: Any, shard: int, offset: int, length: int, **_kw: Any) -> bytes:
            if threading.current_thread().name.startswith("stagefs-stream"):
                sizes.append(length)
                clock.now += length / rate
            return bytes(real_pread(self, shard, offset, length))

        monkeypatch.setattr(origin_type, "pread", pread)
        monkeypatch.setattr(origin_type, "pread_through", pread)  # the streams' reads
        assert stream.run_bytes() == stream_mod.CHUNK  # no rate measured yet
        fs.prefetch([0])
        assert chain.wait_idle(60)
        assert sizes[0] >= stream_mod.CHUNK - 64 * 2**10  # the first run: a CHUNK
        later = sizes[1:]
        run = max(stream_mod.MIN_RUN, int(rate * stream_mod.RUN_S))
        assert run < stream_mod.CHUNK // 4
        assert later and max(later) <= run  # then runs of RUN_S at 2 MB/s
        assert stream.run_bytes() == run
        assert fs.origin.stats.bytes_read == stored_total(tmp_path / "pack")
        for name, data in files.items():
            assert fs.read(name) == data
        assert fs.origin.stats.bytes_read == stored_total(tmp_path / "pack")


def test_the_stream_hands_its_listener_every_file_it_brought_whole(
        runtime: Path, tmp_path: Path) -> None:
    """A stream's listener (a FUSE mount's pusher into the page cache) gets every file the
    stream brought whole, with its bytes: the files of one extent, and the files of 1-4
    MiB cut in 1 MiB checksum pieces, which a run does not end inside. Before, only files
    of one extent were handed over: a mount pushed no file over 1 MiB, and its programs
    read each of those through the server."""
    rng = random.Random(9)
    files = {f"f{i:03d}": rng.randbytes(rng.randint(1000, 300_000)) for i in range(30)}
    files.update({f"m{i:03d}": rng.randbytes(rng.randint(2**20 + 1, 3 * 2**20))
                  for i in range(4)})  # 12 MiB in all: one shard
    pack = _packed(tmp_path, files, compress="none")
    got: dict[int, bytes] = {}

    def listener(entries: Any, runs: list[tuple[int, bytes]]) -> None:
        for e in entries.tolist():
            off, size = int(m.offset[e]), int(m.stored[e])
            got[e] = b"".join(memoryview(d)[max(0, off - at) : max(0, off + size - at)]
                              for at, d in runs if at < off + size and off < at + len(d))

    with stagefs.open(pack, tiers=[str(tmp_path / "tier")], runtime=runtime) as fs:
        m = fs.manifest
        assert fs.chain is not None
        fs.chain.stream.arrived = listener
        _streamed_by_one(fs)
        shard = pack / m.shards[0].name
        assert len(m.shards) == 1
        # each byte once (and some of the padding before the aligned files)
        assert stored_total(pack) <= fs.origin.stats.bytes_read \
            <= shard.stat().st_size - SHARD_HEADER.size
        want = {fs.namespace.file_entry(n): data for n, data in files.items()}
        assert sorted(got) == sorted(want)
        assert all(got[e] == data for e, data in want.items())


def test_a_shard_made_whole_is_in_the_job_s_status_before_the_next_flush(
        runtime: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The tier table's counters (a process's JSON under stats/) are written at most every
    second, and a process killed (SIGKILL, the OOM killer: a FUSE server) never writes
    them again; a shard it made whole is written at once. Before, a mount's server killed
    0.6 s into a cold epoch had made 7 shards whole, and `stagefs status` said 0 placed
    for the rest of the job."""
    import json

    from stagefs.tiers import chain as chain_mod

    rng = random.Random(6)
    files = {f"f{i:03d}": rng.randbytes(rng.randint(1000, 30000)) for i in range(60)}
    pack = _packed(tmp_path, files, compress="none")
    with stagefs.open(pack, tiers=[str(tmp_path / "tier")], runtime=runtime) as fs:
        chain = fs.chain
        assert chain is not None
        chain.flush_stats()  # (the first, as a store that has just begun makes it)
        monkeypatch.setattr(chain_mod, "RECORD_EVERY_S", 1e9)  # no other before the kill
        _streamed_by_one(fs)
        assert fs.held_shards() == {0}
        written = json.loads(Path(chain._stats_path).read_text())
        (tier,) = written["tiers"].values()
        assert tier["placed"] == 1
        assert tier["placed_bytes"] == (pack / fs.manifest.shards[0].name).stat().st_size
        assert tier["filled_bytes"] == stored_total(pack)
        assert tier["filled"] == len(files)


def test_a_file_wrong_at_the_origin_costs_the_stream_only_that_file(
        runtime: Path, tmp_path: Path) -> None:
    """A byte flipped in one file at the origin: that file is a ChecksumError, never placed;
    the good files read in the same run are checked and placed, and the stream goes on with
    the rest of the shard. Before, the stream stopped at the bad file and threw the run
    away: its readers read the rest of the shard again, one small read each."""
    rng = random.Random(4)
    files = {f"f{i:03d}": rng.randbytes(rng.randint(1000, 30000)) for i in range(120)}
    pack = _packed(tmp_path, files, compress="none")
    with stagefs.open(pack) as fs:
        m = fs.manifest
        by_offset = sorted((int(m.offset[fs.namespace.file_entry(n)]), n) for n in files)
        shard = pack / m.shards[0].name
    bad_at, bad = by_offset[len(by_offset) // 3]
    with open(shard, "r+b") as f:  # one byte of a file a third into the shard
        f.seek(bad_at + 7)
        b = f.read(1)
        f.seek(bad_at + 7)
        f.write(bytes([b[0] ^ 0xFF]))
    with stagefs.open(pack, tiers=[str(tmp_path / "tier")], runtime=runtime) as fs:
        chain = _streamed_by_one(fs)
        assert fs.origin.stats.bytes_read == stored_total(pack)  # the stream read it all
        assert chain.corrupt == 1
        for name, data in files.items():
            if name != bad:
                assert fs.read(name) == data
        assert fs.origin.stats.bytes_read == stored_total(pack)  # every good file placed
        with pytest.raises(stagefs.ChecksumError, match=bad):
            fs.read(bad)
        assert 0 not in fs.held_shards()  # a shard with a bad file is never whole


def test_a_wait_on_this_process_s_own_stalled_read_blames_the_origin_not_a_stopped_process(
        dataset: tuple[Path, dict[str, bytes]], runtime: Path, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """The origin stalls under this process's own stream (a shared file system in recovery):
    a read waiting for the stream gives up after HOLDER_WAIT_S and reads the origin itself,
    and the log says the origin is slow. Before, with no other process in the job, it said
    a reader held the bytes and asked to `kill -CONT` a stopped process of the job."""
    pack, files = dataset
    monkeypatch.setattr(stream_mod, "HOLDER_WAIT_S", 0.0)  # the wait runs out at once
    with stagefs.open(pack, tiers=[str(tmp_path / "tier")], runtime=runtime) as fs:
        entered, release = _stalled_streams(monkeypatch, fs)
        last = _last_of_shard0(fs, files)
        fs.prefetch([0])
        assert entered.wait(60)
        try:
            with caplog.at_level("WARNING", logger="stagefs.tiers"):
                assert fs.read(last) == files[last]  # from the origin, by the reader
        finally:
            release.set()
        said = " ".join(r.getMessage() for r in caplog.records)
        assert "this process's own read of the origin" in said and str(pack) in said
        assert "kill -CONT" not in said


def test_a_shard_cut_short_at_the_origin_keeps_the_files_before_the_cut(
        runtime: Path, tmp_path: Path) -> None:
    """A shard truncated at the origin (copied again under a running job): the stream's
    read comes up short; the whole files it did get are checked and placed, and only the
    files from the cut on are errors naming the shard. Before, the read's bytes were let go
    and the first file of the read was marked bad: the files before the cut were read again
    from the origin, one small read each."""
    rng = random.Random(6)
    files = {f"f{i:03d}": rng.randbytes(rng.randint(1000, 30000)) for i in range(120)}
    pack = _packed(tmp_path, files, compress="none")
    with stagefs.open(pack) as fs:
        m = fs.manifest
        ends = {n: int(m.offset[fs.namespace.file_entry(n)]) + len(files[n]) for n in files}
        shard = pack / m.shards[0].name
    cut = sorted(ends.values())[len(ends) * 2 // 3] - 5  # inside a file two thirds in
    os.truncate(shard, cut)
    before = {n for n, end in ends.items() if end <= cut}
    assert 40 < len(before) < len(files)
    with stagefs.open(pack, tiers=[str(tmp_path / "tier")], runtime=runtime) as fs:
        _streamed_by_one(fs)
        streamed = fs.origin.stats.bytes_read
        assert 0 < streamed <= cut
        for name in sorted(before):
            assert fs.read(name) == files[name]
        assert fs.origin.stats.bytes_read == streamed  # each came in the stream's read
        for name in sorted(set(files) - before):
            with pytest.raises(stagefs.errors.CorruptShardError, match="truncated"):
                fs.read(name)


def test_a_stream_read_that_fails_once_is_read_again_not_left_to_the_readers(
        runtime: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A shared file system's read fails now and then (EIO while a server fails over): the
    stream reads that run once more and the shard is placed whole, each byte read once; a
    single failed read stopped the shard's stream for the rest of the job, its files left to
    the readers' small reads. A read that fails twice in a row still stops it."""
    rng = random.Random(5)
    files = {f"f{i:03d}": rng.randbytes(64 * 2**10) for i in range(160)}  # 10 MiB
    _packed(tmp_path, files)
    monkeypatch.setattr(stream_mod, "RETRY_S", 0.01, raising=False)
    for fails in (1, 2):
        with stagefs.open(tmp_path / "pack", tiers=[str(tmp_path / f"tier{fails}")],
                          runtime=runtime / str(fails)) as fs:
            chain = fs.chain
            assert chain is not None
            chain.stream.controller.most = chain.stream.controller.target = 1
            origin_type = type(chain.origin)
            real_pread = origin_type.pread
            calls = [0]

            def pread(self: Any, shard: int, offset: int, length: int, fails: int = fails,
                      calls: list[int] = calls, real_pread: Any = real_pread,
                      **_kw: Any) -> bytes:
                if threading.current_thread().name.startswith("stagefs-stream"):
                    calls[0] += 1
                    if 2 <= calls[0] < 2 + fails:  # the second run's read, fails times
                        raise OSError(errno.EIO, "Input/output error")
                return bytes(real_pread(self, shard, offset, length))

            monkeypatch.setattr(origin_type, "pread", pread)
            monkeypatch.setattr(origin_type, "pread_through", pread)  # the streams' reads
            fs.prefetch([0])
            assert chain.wait_idle(60)
            monkeypatch.undo()
            monkeypatch.setattr(stream_mod, "RETRY_S", 0.01, raising=False)
            if fails == 1:
                assert chain._find(0) and 0 not in chain._failed  # placed whole
                assert fs.origin.stats.bytes_read == stored_total(tmp_path / "pack")
            else:
                assert 0 in chain._failed and not chain._find(0)
            for name, data in files.items():
                assert fs.read(name) == data


@contextlib.contextmanager
def _queue_only(pack: Path, tmp_path: Path, runtime: Path) -> Iterator[tuple[Any, Any]]:
    """A store with a tier whose streams take nothing from their queue: it is looked at."""
    with stagefs.open(pack, tiers=[str(tmp_path / "tier")], runtime=runtime) as fs:
        chain = fs.chain
        assert chain is not None
        ctl = chain.stream.controller
        ctl.most = ctl.target = 0
        yield fs, chain


def test_a_later_prefetch_orders_the_queue_and_a_waiting_read_stays_first(
        dataset: tuple[Path, dict[str, bytes]], runtime: Path, tmp_path: Path) -> None:
    """A prefetch is the latest plan: a second Sampler in the process (a new seed, or the
    closed mode after an open one) streamed in the first one's order until that queue
    drained, its shards already queued being skipped. Shards a read waits for stay first;
    those an earlier plan queued and this one does not name go after it."""
    pack, _files = dataset
    with _queue_only(pack, tmp_path, runtime) as (fs, chain):
        n = len(fs.manifest.shards)
        assert n >= 4
        fs.prefetch(range(1, n))
        assert chain.stream.queued() == list(range(1, n))
        chain._enqueue([0], urgent=True)  # a read waits for shard 0, queued by no plan
        assert chain.stream.queued() == list(range(n))
        fs.prefetch([3, 1, 0])
        assert chain.stream.queued() == [0, 3, 1, 2, *range(4, n)]
        fs.prefetch(reversed(range(n)))
        assert chain.stream.queued() == [0, *reversed(range(1, n))]


def _a_file_of(fs: Any, files: dict[str, bytes], shard: int, k: int = 0) -> str:
    """The ``k``-th non-empty file stored in ``shard``."""
    m = fs.manifest
    mine = sorted(p for p in files if files[p]
                  and int(m.shard[fs.namespace.file_entry(p)]) == shard)
    return mine[k]


def test_reads_that_miss_in_a_second_shard_queue_every_shard(
        dataset: tuple[Path, dict[str, bytes]], runtime: Path, tmp_path: Path) -> None:
    """With no plan (no prefetch: a FUSE mount's reader, the preload library's), reads in one
    shard queue that shard alone; a read that misses in a second one (here in another
    directory at the top: the whole dataset) queues every other shard after the two, in
    shard order from it: each stream has a shard from the start, not only once a read
    first reaches it."""
    pack, files = dataset
    with _queue_only(pack, tmp_path, runtime) as (fs, chain):
        n = len(fs.manifest.shards)
        assert n >= 5
        for k in range(2):
            p = _a_file_of(fs, files, 1, k)
            assert fs.read(p) == files[p]
        assert chain.stream.queued() == [1]
        p = _a_file_of(fs, files, 3)
        assert fs.read(p) == files[p]
        assert chain.stream.queued() == [3, 1, 4, *range(5, n), 0, 2]


def test_reads_of_one_directory_queue_its_shards_and_a_read_outside_widens_the_plan(
        runtime: Path, tmp_path: Path) -> None:
    """With no plan, reads that miss in a second shard queue the shards of the directory
    their files share, not the whole dataset: a job that reads only its validation
    directory (through a mount, or ``fs.read``) streamed every training shard too. A miss
    outside the directory widens the plan to the one holding both, and queues the shards
    that adds, after those queued already."""
    rng = random.Random(7)
    files = {f"{top}/c{i % 3}/f{i:03d}": rng.randbytes(rng.randint(1000, 6000))
             for top, count in (("train", 90), ("val", 30)) for i in range(count)}
    for name in files:
        (tmp_path / "raw" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "raw" / name).write_bytes(files[name])
    stagefs.pack(tmp_path / "raw", tmp_path / "pack", shard_size="24KiB", jobs=1,
                 progress=False, echo=lambda _m: None)
    with _queue_only(tmp_path / "pack", tmp_path, runtime) as (fs, chain):
        m = fs.manifest

        def shards_of(top: str) -> list[int]:
            return sorted({int(m.shard[fs.namespace.file_entry(p)]) for p in files
                           if p.startswith(top)})

        val, train = shards_of("val/"), shards_of("train/")
        assert len(val) >= 3 and len(set(train) - set(val)) >= 3
        first, second = (next(p for p in files if p.startswith("val/")
                              and int(m.shard[fs.namespace.file_entry(p)]) == s)
                         for s in (val[-1], val[0]))
        for p in (first, second):
            assert fs.read(p) == files[p]
        assert sorted(chain.stream.queued()) == val
        assert sorted(chain.stream.queued()[:2]) == [val[0], val[-1]]  # the reads' first
        p = next(p for p in files if p.startswith("train/")
                 and int(m.shard[fs.namespace.file_entry(p)]) not in val)
        assert fs.read(p) == files[p]
        queued = chain.stream.queued()
        assert sorted(queued) == list(range(len(m.shards)))
        assert queued[0] == int(m.shard[fs.namespace.file_entry(p)])  # a read waits for it
        assert sorted(queued[1:1 + len(val)]) == val  # then the directory's, as before


def test_a_plan_given_queues_no_other_shard(
        dataset: tuple[Path, dict[str, bytes]], runtime: Path, tmp_path: Path) -> None:
    """A prefetch is the plan (the sampler's order, or a training subset's shards): reads
    in other shards then queue those shards, and nothing more."""
    pack, files = dataset
    with _queue_only(pack, tmp_path, runtime) as (fs, chain):
        fs.prefetch([2])
        for shard in (0, 3):
            p = _a_file_of(fs, files, shard)
            assert fs.read(p) == files[p]
        assert sorted(chain.stream.queued()) == [0, 2, 3]


def _first_piece_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pieces of 8 KiB (the 48 KiB shards hold several), a stream's first reservation the
    first piece alone."""
    from stagefs.tiers import chain as chain_mod

    monkeypatch.setattr(chain_mod, "PIECE_SIZE", 8 * 1024)
    monkeypatch.setattr(stream_mod, "RESERVE_FIRST", 1)


def test_a_stream_reserves_its_first_pieces_reads_then_reserves_the_rest(
        dataset: tuple[Path, dict[str, bytes]], runtime: Path, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A stream begins reading once the pieces of its shard's first ``RESERVE_FIRST`` bytes
    are reserved, and reserves the rest after its first read; the shard ends whole in the
    tier, each origin byte read once."""
    pack, files = dataset
    _first_piece_alone(monkeypatch)
    with stagefs.open(pack, tiers=[str(tmp_path / "tier")], runtime=runtime) as fs:
        chain = fs.chain
        assert chain is not None
        pieces = chain._extents_of(0).pieces
        assert pieces >= 3
        entered, release = _stalled_streams(monkeypatch, fs)
        fs.prefetch([0])
        assert entered.wait(60)  # the stream's first read, stalled
        try:
            [(fill, _tier)] = chain._fills[0]
            assert int(fill.res.sum()) == 1
        finally:
            release.set()
        assert chain.wait_idle(60)
        assert fs.held_shards() == {0}
        assert fs.origin.stats.bytes_read == fs.manifest.shards[0].size - \
            chain._extents_of(0).offs[0]
        for p in files:
            if files[p] and int(fs.manifest.shard[fs.namespace.file_entry(p)]) == 0:
                assert fs.read(p) == files[p]


def test_the_shard_streamed_first_is_held_whole_when_later_streams_find_no_room(
        dataset: tuple[Path, dict[str, bytes]], runtime: Path, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Reads missed in one shard first (its stream alone: it reserves its first pieces, and
    reads), then the plan queued the others, whose streams found no room in the tiers for
    every shard streaming and reserved theirs whole before reading: they took the room the
    first shard's rest needed, and the shard that came first was held in part (its first
    pieces), the later ones whole. Now a stream that reserves its shard whole first lets
    the streams under way reserve the rest of theirs: the first shard is held whole."""
    pack, files = dataset
    from stagefs.tiers.fill import whole_charge

    _first_piece_alone(monkeypatch)
    with stagefs.open(pack, tiers=[str(tmp_path / "probe")], runtime=runtime) as fs:
        chain = fs.chain
        assert chain is not None
        block = chain.tiers[0].block
        room = sum(whole_charge(chain._extents_of(s), block) for s in (0, 1)) + block
        n = len(fs.manifest.shards)
        assert n >= 4
        origin_type = type(fs.origin)
    stalled: set[str] = set()
    release = threading.Event()
    real_pread = origin_type.pread

    def pread(self: Any, shard: int, offset: int, length: int, **_kw: Any) -> bytes:
        name = threading.current_thread().name
        if name.startswith("stagefs-stream"):
            stalled.add(name)
            assert release.wait(60)  # every stream's reads wait here
        return bytes(real_pread(self, shard, offset, length))

    monkeypatch.setattr(origin_type, "pread", pread)
    monkeypatch.setattr(origin_type, "pread_through", pread)
    with stagefs.open(pack, tiers=[f"{tmp_path / 'tier'}:{room}"], runtime=runtime) as fs:
        chain = fs.chain
        assert chain is not None
        stream = chain.stream
        try:
            fs.prefetch([0])  # the first shard's stream, alone: it reserves its first piece
            while not stalled:
                with stream._cond:
                    stream._cond.wait(0.01)
            [(fill, _tier)] = chain._fills[0]
            assert int(fill.res.sum()) == 1
            fs.prefetch(range(n))  # then the others, several streams at once
            while stream.queued() or len(stalled) < stream._running:
                with stream._cond:
                    stream._cond.wait(0.01)
        finally:
            release.set()
        assert chain.wait_idle(60)
        assert stream.started[0] == 0
        assert 0 in fs.held_shards()
        for p in files:
            if files[p] and int(fs.manifest.shard[fs.namespace.file_entry(p)]) == 0:
                assert fs.read(p) == files[p]


def test_reservations_on_a_copy_replaced_under_a_reader_close_after_its_release(
        dataset: tuple[Path, dict[str, bytes]], runtime: Path, tmp_path: Path) -> None:
    """A partial copy dropped and made anew under the same name while a reader held a run
    of the old one: the old copy's lock descriptor stayed open for the life of the process
    (one for each such copy), or was closed under a thread that then locked through the
    number another file took. It closes as the reader releases its run, and nothing locks
    through it after."""
    from stagefs.tiers.fill import create_fill, remove_fill
    from stagefs.tiers.stream import Reservations

    pack, _files = dataset
    with _queue_only(pack, tmp_path, runtime) as (fs, chain):
        ext, size = chain._extents_of(0), chain._sizes[0]
        final = str(tmp_path / "copy.sfs")
        old = create_fill(final, size, ext, 0, fs.manifest.pack_id)
        res = Reservations()
        h1 = res.held(0, old)
        assert h1 is not None
        [run] = res.take(h1, 0, 1) or [None]
        assert run == (0, 1)
        remove_fill(final)
        new = create_fill(final, size, ext, 0, fs.manifest.pack_id)
        h2 = res.held(0, new)
        assert h2 is not None and h2 is not h1
        assert not h1.closed  # its run is being read: open until released
        res.release(h1, *run)
        assert h1.closed
        assert res.take(h1, 0, 1) is None and res.take_next(h1, 0, 1 << 20) is None
        assert not res.someone_holds(h1, 0, 1)
        assert res.take(h2, 0, 1) == [(0, 1)]
        res.close()
        assert h2.closed
        old.close()
        new.close()


def test_a_copy_let_go_of_under_a_stream_is_neither_read_nor_written_and_frees_its_descriptors(
        dataset: tuple[Path, dict[str, bytes]], runtime: Path, tmp_path: Path) -> None:
    """A partial copy's handle let go of (finished or dropped by another thread) while a
    stream still held it and its reservations: kept open until the store closed, each
    filled shard held four descriptors; closed with its state emptied, a stream indexing
    its files died (IndexError) and reads of the node waited 30 s a file. Now it keeps a
    copy of its state of the copy's length, raises CopyLetGo (a SourceUnavailable, and
    the ValueError of a closed file) on a read or write, and its reservations are
    forgotten with their descriptor; a newer copy of the same inode number gets its own."""
    from stagefs.tiers.base import CopyLetGo, SourceUnavailable
    from stagefs.tiers.fill import create_fill, remove_fill
    from stagefs.tiers.stream import Reservations

    pack, _files = dataset
    with _queue_only(pack, tmp_path, runtime) as (fs, chain):
        ext, size = chain._extents_of(0), chain._sizes[0]
        final = str(tmp_path / "copy.sfs")
        old = create_fill(final, size, ext, 0, fs.manifest.pack_id)
        old.reserve(0, ext.pieces)
        old.mark(0, 1)
        res = Reservations()
        h1 = res.held(0, old)
        assert h1 is not None
        state = old.bits.copy()
        old.close()
        assert old.closed and (old.bits == state).all() and len(old.res) == ext.pieces
        assert old.covered(int(ext.offs[0]), int(ext.ends[0]))  # as it was
        with pytest.raises(CopyLetGo) as info:
            old.pread(int(ext.offs[0]), 1)
        assert isinstance(info.value, SourceUnavailable) and isinstance(info.value, ValueError)
        with pytest.raises(CopyLetGo):
            old.put(int(ext.offs[0]), b"x")
        with pytest.raises(CopyLetGo):
            old.reserve(0)
        res.forget(0, old)
        assert h1.closed  # no run was being read: its lock descriptor closed at once
        remove_fill(final)
        new = create_fill(final, size, ext, 0, fs.manifest.pack_id)
        new.ino = old.ino  # the inode number a deleted copy had, taken by the new one
        h3 = res.held(0, old)  # a stale look with the old handle: not the old state
        assert h3 is not None and h3 is not h1 and h3.fill is old
        h2 = res.held(0, new)
        assert h2 is not None and h2 is not h3 and h2.fill is new  # never the closed one's
        assert res.take(h2, 0, 1) == [(0, 1)]
        res.close()
        new.close()


def test_close_waits_for_stuck_streams_once_not_once_each(
        dataset: tuple[Path, dict[str, bytes]], tmp_path: Path, runtime: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Streams stuck on a stalled origin (each thread's join times out): close() waited 60 s
    for each in turn, 8 minutes with eight; now CLOSE_WAIT_S for them all."""
    pack, _files = dataset
    clock = FakeClock()
    waits: list[float] = []

    class Stuck:
        def join(self, timeout: float | None = None) -> None:  # never ends in time
            assert timeout is not None
            waits.append(timeout)
            clock.now += timeout

    fs = stagefs.open(pack, tiers=[str(tmp_path / "tier")], runtime=runtime)
    chain = fs.chain
    assert chain is not None
    monkeypatch.setattr(chain.stream, "_clock", clock)
    chain.stream._threads.extend([Stuck(), Stuck(), Stuck()])  # type: ignore[list-item]
    fs.close()
    assert waits[0] == stream_mod.CLOSE_WAIT_S
    assert waits[1:] == [0.0, 0.0]


def test_a_read_after_its_shard_was_made_whole_reads_the_copy_not_the_origin(
        dataset: tuple[Path, dict[str, bytes]], runtime: Path, tmp_path: Path) -> None:
    """The tiers full, a read whose holders were looked up while its shard was partial met
    the shard made whole by its stream meanwhile (routed, its partial copy let go of): it
    found no copy holding its piece, said "no tier has room for its piece", and the Store
    read the origin for bytes the stream had just brought (an origin byte twice in epoch 1,
    about one run in twenty of test_pieces.py::test_later_epochs_read_what_does_not_fit
    with the tiers' descriptors in a table). It reads the whole copy now."""
    pack, _files = dataset
    with stagefs.open(pack, tiers=[str(tmp_path / "tier")], runtime=runtime) as fs:
        chain = fs.chain
        assert chain is not None
        chain.prefetch([0])
        assert chain.wait_idle(60) and chain._find(0)
        assert 0 not in chain._fills  # whole: its partial copy let go of
        chain.full = True  # (the tiers full since)
        shard = (pack / fs.manifest.shards[0].name).read_bytes()
        before = fs.origin.stats.bytes_read
        assert chain.stream.read(0, 100, 1000) == shard[100:1100]
        assert fs.origin.stats.bytes_read == before
