"""The bench's pure parts: the order-free epoch checksum, the origin counter, the summary."""

from __future__ import annotations

import json
import mmap
import os
import signal
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from stagefs.bench import fuse_serve, worker
from stagefs.bench.limit import origin_limit, read_files
from stagefs.bench.measure import OriginCounter, Proc, Tally
from stagefs.bench.report import limit_table, summarize, summary_table, write_report
from stagefs.cli import main


def _tally(items: list[tuple[str, bytes]]) -> tuple[str, int, int]:
    t = Tally()
    for k, v in items:
        t.add(k, v)
    digest, distinct = t.digest()
    return digest, distinct, t.samples


def test_checksum_ignores_order_and_sees_every_difference() -> None:
    items = [(f"train/{i}.jpg", bytes([i]) * (i + 1)) for i in range(50)]
    ref, distinct, n = _tally(items)
    assert (distinct, n) == (50, 50)
    assert _tally(list(reversed(items)))[0] == ref
    changed = [*items[:-1], (items[-1][0], items[-1][1][:-1] + b"\x00")]
    assert _tally(changed)[0] != ref  # one byte differs
    dup = [*items[:-1], items[0]]  # one sample twice, one missing
    d, distinct, n = _tally(dup)
    assert d != ref and distinct == 49 and n == 50
    assert _tally([(k, memoryview(v)) for k, v in items])[0] == ref  # memoryviews hash alike


def test_origin_counter_counts_only_under_its_roots(tmp_path: Path) -> None:
    origin, other = tmp_path / "origin", tmp_path / "other"
    origin.mkdir()
    other.mkdir()
    (origin / "a").write_bytes(b"x" * 10)
    (other / "b").write_bytes(b"y")
    real_open, real_stat = open, os.stat
    with OriginCounter([str(origin)], {str(origin / "a"): 10}) as c:
        with open(origin / "a", "rb") as f:
            f.read()
        os.close(os.open(origin / "a", os.O_RDONLY))
        os.stat(origin / "a")
        os.path.exists(origin / "a")
        os.listdir(origin)  # the root itself is not "under" it
        with open(other / "b", "rb"):
            pass
        os.stat(other / "b")
    assert (c.opens, c.stats, c.bytes_opened) == (2, 2, 20)
    assert open is real_open and os.stat is real_stat  # restored


def _results(epochs: list[dict[str, object]]) -> dict[str, object]:
    conv = {"seconds": 1.5, "bytes_on_disk": 2_000_000}
    return {"order": ["x"], "skipped": {}, "systems": {"x": {
        "title": "x", "settings": "", "conversion": conv, "epochs": epochs, "errors": [],
        "all_samples_once": True, "same_bytes": True}}}


def _epoch(epoch: int, rate: float, opens: int) -> dict[str, object]:
    return {"epoch": epoch, "samples_per_s": rate, "mb_per_s": rate / 10, "origin_opens": opens,
            "origin_stats": 1, "origin_bytes": 1000, "peak_rss": 2**20, "cpu_s_per_1k": 0.1,
            "shared_rss": epoch * 2**19}


def test_summary_takes_medians_of_cold_and_warm_epochs() -> None:
    eps = [_epoch(0, r, 9) for r in (100, 300, 200)] + [_epoch(1, r, 0) for r in (1000, 5000)]
    eps += [_epoch(2, r, 0) for r in (2000, 4000, 3000)]
    m = summarize(_results(eps))["x"]
    assert m["cold_samples_per_s"] == 200
    assert m["warm_samples_per_s"] == 3000
    assert m["per_epoch_samples_per_s"] == [200, 3000, 3000]
    assert (m["cold_origin_opens"], m["warm_origin_opens"]) == (9, 0)
    assert m["peak_shared_rss"] == 2**20  # the most of any epoch (the last: 2 x 512 KiB)
    text = summary_table(_results(eps))
    assert "| x " in text and "of which shared MiB" in text


def test_a_system_ctrl_c_stopped_before_its_turn_did_not_fail() -> None:
    results = _results([])
    results["interrupted"] = "stopped by Ctrl-C during run 1 of 1"
    assert summarize(results)["x"]["error"] == "not run: stopped by Ctrl-C before its turn"


def test_shared_pages_a_process_maps_are_told_from_its_own(tmp_path: Path) -> None:
    """A memory tier's pages a reader maps count in its RSS as shared memory: the bench
    reports them apart (a tier file on tmpfs, mapped and touched here)."""
    if not os.access("/dev/shm", os.W_OK):
        pytest.skip("no writable /dev/shm on this machine")
    path = Path("/dev/shm") / f"stagefs-test-{os.getpid()}-shared"
    size = 8 * 2**20
    path.write_bytes(os.urandom(size))
    try:
        me = Proc()
        before = me.shared_rss()
        with open(path, "rb") as f, mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ) as mm:
            total = sum(mm[i] for i in range(0, size, 4096))  # touch every page
            assert me.shared_rss() - before >= size * 0.9, total
            assert me.peak_rss() >= me.shared_rss()
    finally:
        path.unlink()


def test_the_cold_epoch_is_held_against_the_origins_sequential_limit() -> None:
    results = _results([_epoch(0, r, 9) for r in (900, 1100, 1000)])
    results["origin_limit"] = [  # one and six streams, three runs each
        {"streams": n, "samples_per_s": v, "mb_per_s": v / 10, "run": k}
        for k, (one, six) in enumerate([(2000, 4000), (2100, 3900), (1900, 4100)])
        for n, v in ((1, one), (6, six))]
    text = limit_table(results)
    assert "1 stream 200 MB/s = 2,000 samples/s, 6 streams 400 MB/s = 4,000 samples/s" in text
    assert "| x      |          1,000 |       0.50 |        0.25 |   0.25 |" in text
    assert limit_table(_results([_epoch(0, 1, 1)])) == ""  # no limit measured: no table


def test_the_kept_pass_is_shown_beside_the_limit_and_not_taken_as_the_best() -> None:
    results = _results([_epoch(0, r, 9) for r in (900, 1100, 1000)])
    results["origin_limit"] = [
        {"streams": n, "kept": kept, "samples_per_s": v, "mb_per_s": v / 10, "run": 0}
        for n, kept, v in ((1, False, 2000), (6, False, 4000), (6, True, 1250))]
    text = limit_table(results)
    assert ("6 streams that also write what they read into node-local storage (the least a "
            "loader that keeps the data does): 125 MB/s = 1,250 samples/s") in text
    assert "| / 1 stream | / 6 streams | / 6 streams kept | / best |" in text
    assert "|          1,000 |       0.50 |        0.25 |             0.80 |   0.25 |" in text


def test_the_kept_pass_writes_every_byte_it_reads_and_leaves_nothing(tmp_path: Path) -> None:
    """The kept pass's copies hold the bytes read (written as read, at their offsets, by
    several streams), and origin_limit removes them after the pass."""
    import stagefs

    src = tmp_path / "src"
    src.mkdir()
    for k in range(40):
        (src / f"f{k}").write_bytes(os.urandom(k * 997 + (5 * 2**20 if k == 3 else 0)))
    pack = tmp_path / "pack"
    stagefs.pack(str(src), str(pack), shard_size=2**20, progress=False)
    shards = sorted(str(p) for p in pack.glob("*.sfs"))
    assert len(shards) > 2
    keep = tmp_path / "keep"
    keep.mkdir()
    _, nbytes = read_files(shards, 3, str(keep))
    assert nbytes == sum(os.path.getsize(p) for p in shards)
    for i, p in enumerate(shards):
        assert (keep / f"{i:06d}").read_bytes() == Path(p).read_bytes()
    local = tmp_path / "local"
    local.mkdir()
    passes = origin_limit(str(pack), 40, lambda: False, keep=str(local))
    assert [(p["streams"], p["kept"]) for p in passes] == [(1, False), (6, False), (6, True)]
    assert all(p["bytes"] == nbytes for p in passes)
    assert not list(local.iterdir())


def test_the_limit_reads_every_byte_with_any_number_of_streams(tmp_path: Path) -> None:
    sizes = [0, 1, 5 * 2**20 + 3, 70_000, 4 * 2**20]
    paths = []
    for k, n in enumerate(sizes):
        p = tmp_path / f"s{k}"
        p.write_bytes(os.urandom(n))
        paths.append(str(p))
    for streams in (1, 3, 8):
        seconds, nbytes = read_files(paths, streams)
        assert nbytes == sum(sizes) and seconds > 0


def test_ctrl_c_stops_the_limits_readers(tmp_path: Path) -> None:
    """Ctrl-C while the origin's limit is measured: the readers stop at their next read and
    are gone when read_files returns, where they read the whole pack first (minutes on a
    slow link) or failed once the run removed it. A FIFO fed byte by byte is the slow
    origin; SIGINT comes once the reader has read from it; the feeder sees the reader go
    (a write with no reader left fails)."""
    fifo = tmp_path / "shard"
    os.mkfifo(fifo)
    fed, gone, done = threading.Event(), threading.Event(), threading.Event()

    def feed() -> None:
        with open(fifo, "wb", buffering=0) as f:
            while not done.wait(0.005):
                try:
                    f.write(b"x")
                except BrokenPipeError:  # the reader closed it: stopped
                    gone.set()
                    return
                fed.set()

    def interrupt() -> None:
        if fed.wait(30):
            signal.pthread_kill(threading.main_thread().ident or 0, signal.SIGINT)

    feeder, ctrl_c = threading.Thread(target=feed), threading.Thread(target=interrupt)
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    feeder.start()
    ctrl_c.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            read_files([str(fifo)], 1)
        assert gone.wait(10), "the reader kept reading after Ctrl-C"
    finally:
        signal.signal(signal.SIGINT, old)
        done.set()
        ctrl_c.join()
        feeder.join()


@pytest.mark.parametrize("args, words", [
    (["--systems", "nosuch"], "unknown system"),
    (["--epochs", "0"], "at least 1"),
])
def test_bad_options_are_named(args: list[str], words: str, tmp_path: Path,
                               capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["bench", "--origin", str(tmp_path / "o"), "--out", str(tmp_path / "out"),
               *args])
    assert rc == 1
    assert words in capsys.readouterr().err
    assert not (tmp_path / "o").exists()  # refused before generating anything


def test_one_epoch_a_run_reports_no_warm_figures(tmp_path: Path) -> None:
    """With --epochs 1 the warm columns say "-": never the cold epoch again under a warm
    heading (they showed the cold samples/s and origin opens as warm ones)."""
    results = _results([_epoch(0, r, 9) for r in (100, 300, 200)])
    m = summarize(results)["x"]
    assert m["cold_samples_per_s"] == 200
    assert m["warm_samples_per_s"] is None and m["warm_origin_opens"] is None
    row = next(line for line in summary_table(results).splitlines() if line.startswith("| x "))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[3:6] == ["200", "-", "-"]  # cold samples/s, warm samples/s, warm MB/s
    assert cells[9] == "-"  # origin opens (warm)
    results.update(epochs=1, runs=3, cold="page cache dropped",
                   dataset={"kind": "imagenet-like", "root": "/o", "files": 3, "bytes": 30})
    written = write_report(results, str(tmp_path))  # the plots too, where matplotlib is
    assert "no warm figures" in (tmp_path / "table.md").read_text()
    assert all(os.path.getsize(p) > 0 for p in written)


def test_the_fuse_servers_counters_are_the_ones_taken_after_the_epoch(tmp_path: Path) -> None:
    """The server's thread publishes its origin counters every 50 ms; on a loaded machine it
    runs late, and the counters read a fixed 0.2 s after the epoch were the ones of before
    its end: the cold epoch's bytes went to the next one's. The reader now waits for the
    first ones taken after the end (the server's thread, real, held back here)."""
    stats = tmp_path / "stats.json"
    spec = {"server_stats": str(stats)}

    store = SimpleNamespace(origin=SimpleNamespace(stats=SimpleNamespace(
        as_dict=lambda: {"bytes_read": 1000})))
    stats.write_text(json.dumps({"bytes_read": 10, "at": 0.0}))  # before the epoch's end
    stop, go = threading.Event(), threading.Event()
    ended = time.monotonic()

    def late() -> None:
        go.wait(30)  # the server descheduled past the epoch's end
        fuse_serve._publish(store, str(stats), stop)

    t, wake = threading.Thread(target=late), threading.Timer(0.3, go.set)
    t.start()
    wake.start()
    try:
        got = worker._server_stats(spec, after=ended)
    finally:
        wake.cancel()
        go.set()
        stop.set()
        t.join()
        wake.join()
    assert got["bytes_read"] == 1000 and got["at"] >= ended
