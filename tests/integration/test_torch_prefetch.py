"""The read-ahead of stagefs.torch (Prefetcher): in order, within its byte budget, always."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch", reason="PyTorch is not installed (pip install torch)")

from stagefs.runtime import proc_start
from stagefs.torch import FileDataset, Prefetcher, Sampler

pytestmark = pytest.mark.integration


WAIT_S = 60  # a wait for the read-ahead that has not ended by then fails: it hung


class Reader:
    """Returns sample i as bytes of length sizes[i]; records what it was asked for, so a
    test can wait until the read-ahead has asked for a sample (no sleeps, no timing)."""

    def __init__(self, sizes: np.ndarray, fail: int | None = None) -> None:
        self.sizes, self.fail = sizes, fail
        self.calls: list[list[int]] = []
        self._asked: set[int] = set()
        self._cv = threading.Condition()

    def __call__(self, idx: Sequence[int]) -> list[bytes]:
        with self._cv:
            self.calls.append(list(idx))
            self._asked.update(idx)
            self._cv.notify_all()
        if self.fail is not None and self.fail in idx:
            raise OSError("disk on fire")
        return [bytes([i % 251]) * int(self.sizes[i]) for i in idx]

    def wait_asked(self, i: int) -> None:
        with self._cv:
            assert self._cv.wait_for(lambda: i in self._asked, WAIT_S), f"sample {i} never read"


def wait_until(cond: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not cond():
        assert time.monotonic() < deadline, f"the read-ahead never {what}"
        time.sleep(0.001)


def first_fill(sizes: np.ndarray, order: np.ndarray, budget: int) -> int:
    """The bytes the read-ahead holds, nothing taken yet, once it can claim no more: the
    samples in order that fit the budget (those larger than it are passed over)."""
    used = 0
    for i in order.tolist():
        if sizes[i] > budget:
            continue
        if used + sizes[i] > budget:
            break
        used += int(sizes[i])
    return used


@pytest.mark.parametrize(("budget", "threads"), [(1000, 1), (5000, 4), (300, 3)])
def test_never_exceeds_budget(budget: int, threads: int) -> None:
    rng = np.random.default_rng(budget)
    sizes = rng.integers(1, 400, 500).astype(np.int64)
    order = rng.permutation(500).astype(np.int64)
    reader = Reader(sizes)
    p = Prefetcher(reader, sizes, order, budget, chunk=8, threads=threads).start()
    peak = [0]
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], p.used)

    w = threading.Thread(target=watch)
    w.start()
    waited = 0
    try:
        full = first_fill(sizes, order, budget)
        wait_until(lambda: p.used == full, f"filled its budget ({full} bytes)")
        for k, i in enumerate(order.tolist()):
            if k % 7 == 0 and sizes[i] <= budget:
                reader.wait_asked(i)  # a slow step: the read-ahead reaches this sample
                waited += 1
            data = p.take(i)
            if data is not None:
                assert data == bytes([i % 251]) * int(sizes[i])
    finally:
        stop.set()
        w.join()
        p.close()
    assert peak[0] <= budget and p.stats.peak_bytes <= budget
    assert p.stats.peak_bytes >= full > budget // 3  # it read ahead, up to near its budget
    assert p.stats.hits >= waited  # it served every sample it reached first
    assert p.stats.hits + p.stats.misses == 500
    # a sample bigger than the budget is never read ahead
    assert not any(sizes[i] > budget for call in reader.calls for i in call)


def test_read_errors_fall_back_to_the_caller() -> None:
    sizes = np.full(50, 10, dtype=np.int64)
    order = np.arange(50, dtype=np.int64)
    reader = Reader(sizes, fail=20)
    p = Prefetcher(reader, sizes, order, 100, chunk=4, threads=2).start()
    got = []
    for i in range(50):
        reader.wait_asked(i)  # every chunk is read ahead of its take
        got.append(p.take(i))
    p.close()
    assert got[20] is None  # the caller reads it and sees the error itself
    assert all(got[i] == bytes([i]) * 10 for i in range(50) if i // 4 != 20 // 4)
    assert p.stats.errors >= 1 and p.used == 0


def test_prefetcher_refuses_a_zero_budget() -> None:
    with pytest.raises(ValueError, match="budget"):
        Prefetcher(Reader(np.ones(1, np.int64)), np.ones(1, np.int64), np.arange(1), 0)


def test_sampler_prefetch_in_process(tmp_path: Path) -> None:
    """num_workers=0: the dataset takes its bytes from the sampler's read-ahead."""
    import torch

    import stagefs
    from stagefs.bench.datasets import imagenet_like

    imagenet_like(str(tmp_path / "raw"), files=150, classes=3, mean_size=3000, progress=False)
    stagefs.pack(tmp_path / "raw", tmp_path / "pack", shard_size="32KiB", progress=False)
    ds = FileDataset(tmp_path / "pack", target=None)
    budget = 20_000
    s = Sampler(ds, seed=2, prefetch=budget, rank=0, world_size=1)
    loader = torch.utils.data.DataLoader(ds, batch_size=8, sampler=s,
                                         collate_fn=lambda b: b)
    plain = [ds.store.read(ds.path_of(i)) for i in s.order()]
    for epoch in range(2):
        s.set_epoch(epoch)
        got = [x for batch in loader for x in batch]
        assert got == [ds.store.read(ds.path_of(i)) for i in s.order()]
        p = s.prefetcher
        assert p is not None and p.stats.hits > 0
        assert p.stats.peak_bytes <= budget
    assert plain != got  # the epochs differ
    s.close()


def collate_with_hits(batch: list[bytes]) -> tuple[list[bytes], int]:
    """Runs in the worker: the batch, and how many samples its read-ahead served so far."""
    import torch.utils.data

    info = torch.utils.data.get_worker_info()
    ahead = getattr(info.dataset, "_worker_ahead", None) if info is not None else None
    return batch, ahead.prefetcher.stats.hits if ahead is not None else -1


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_workers_read_their_own_batches_ahead(tmp_path: Path, method: str) -> None:
    """Each DataLoader worker reads ahead the batches the round robin will give it. A
    persistent worker keeps its copy of the dataset: it follows into the next epoch by
    working out that epoch's order, and steps aside when the batches are not the ones it
    expects (an epoch skipped)."""
    import torch

    import stagefs
    from stagefs.bench.datasets import imagenet_like

    imagenet_like(str(tmp_path / "raw"), files=200, classes=4, mean_size=2500, progress=False)
    stagefs.pack(tmp_path / "raw", tmp_path / "pack", shard_size="64KiB", progress=False)
    ds = FileDataset(tmp_path / "pack", target=None)
    s = Sampler(ds, seed=6, prefetch=100_000, rank=0, world_size=1)
    loader = torch.utils.data.DataLoader(ds, batch_size=10, sampler=s, num_workers=2,
                                         multiprocessing_context=method, timeout=120,
                                         persistent_workers=True, collate_fn=collate_with_hits)
    for epoch in (0, 1, 2, 7):
        s.set_epoch(epoch)
        got, hits = [], []
        for batch, h in loader:
            got += batch
            hits.append(h)
        assert got == ds.read_samples(s.order().tolist())
        if epoch <= 2:
            assert max(hits) > 0, epoch  # the workers' read-ahead served samples
        else:
            assert max(hits) == -1  # not the epoch after the last: turned off


def test_a_sample_looked_at_in_the_main_process_starts_no_read_ahead(tmp_path: Path) -> None:
    """With workers, the main process reads nothing ahead: a sample looked at there while
    they read the epoch (``ds[k]``, to log one) started the read-ahead of the whole epoch in
    the main process, up to the budget, counted as samples read though never delivered."""
    import torch

    import stagefs
    from stagefs.bench.datasets import imagenet_like

    imagenet_like(str(tmp_path / "raw"), files=120, classes=3, mean_size=2000, progress=False)
    stagefs.pack(tmp_path / "raw", tmp_path / "pack", shard_size="32KiB", progress=False)
    ds = FileDataset(tmp_path / "pack", target=None)
    s = Sampler(ds, seed=3, prefetch=100_000, rank=0, world_size=1)
    loader = torch.utils.data.DataLoader(ds, batch_size=10, sampler=s, num_workers=2,
                                         multiprocessing_context="fork", timeout=120,
                                         collate_fn=lambda b: b)
    it = iter(loader)
    got = next(it)  # the loop runs: the workers read the epoch
    p = s.prefetcher
    assert p is not None
    k = int(s.order()[-1])  # a sample, not the order's first
    want = ds.store.read(ds.path_of(k))
    assert ds[k] == want and ds.__getitems__([k, int(s.order()[-2])])[0] == want
    got += [x for batch in it for x in batch]
    assert got == ds.read_samples(s.order().tolist(), count=False)
    assert p.stats.read == 0 and not p.used  # nothing read ahead here
    assert ds.store.stats.reads == 4  # the samples asked for in this process, and no other
    s.close()
    ds.store.close()




def test_persistent_workers_keep_reading_ahead_after_a_resumed_epoch(tmp_path: Path) -> None:
    """A run resumed from a checkpoint: the persistent workers start on the resumed
    epoch's rest, then follow into the next epochs from their start (a resume with
    another world size used to turn their read-ahead off for the rest of the run)."""
    import torch

    import stagefs
    from stagefs.bench.datasets import imagenet_like

    imagenet_like(str(tmp_path / "raw"), files=120, classes=3, mean_size=2500, progress=False)
    stagefs.pack(tmp_path / "raw", tmp_path / "pack", shard_size="64KiB", progress=False)
    ds = FileDataset(tmp_path / "pack", target=None)
    first = Sampler(ds, seed=3, rank=0, world_size=2)
    first.set_epoch(4)
    state = first.state_dict(consumed=2 * 25)
    s = Sampler(ds, seed=3, prefetch=100_000, rank=0, world_size=1)
    s.load_state_dict(state)  # resumed with another world size, too
    loader = torch.utils.data.DataLoader(ds, batch_size=10, sampler=s, num_workers=2,
                                         timeout=120, persistent_workers=True,
                                         collate_fn=collate_with_hits)
    for epoch in (4, 5, 6):
        s.set_epoch(epoch)
        want = s.order().tolist()
        got, hits = [], []
        for batch, h in loader:
            got += batch
            hits.append(h)
        assert got == ds.read_samples(want)
        assert max(hits) > 0, epoch  # the workers' read-ahead served samples

@pytest.mark.parametrize(("budget", "threads"), [(1000, 1), (5000, 4)])
def test_tier_read_ahead_stays_within_its_budget(budget: int, threads: int) -> None:
    """The read-ahead into the tiers (for DataLoader workers): in order, never more than the
    budget past the consumer; what the consumer passed first is skipped."""
    from stagefs.torch._prefetch import TierAhead

    rng = np.random.default_rng(budget)
    sizes = rng.integers(1, 400, 600).astype(np.int64)
    order = rng.permutation(600).astype(np.int64)
    cum = np.concatenate([[0], np.cumsum(sizes[order])])
    pos_of = {int(i): k for k, i in enumerate(order)}
    seen: list[int] = []
    over: list[int] = []
    consumer = [0]
    lock = threading.Lock()

    def read(idx: Sequence[int]) -> None:
        with lock:
            last = pos_of[int(idx[-1])]
            if cum[last + 1] - cum[consumer[0]] > budget:
                over.append(last)
            seen.extend(int(i) for i in idx)

    ta = TierAhead(read, sizes, order, budget, chunk=8, threads=threads).start()
    try:
        wait_until(lambda: ta.stats.read > 0, "read")
        for k in range(0, len(order) + 1, 10):
            with lock:
                consumer[0] = k
            ta.advance(k)
            if k < 300:  # a slow consumer: the read-ahead claims up to its budget
                left = int(cum[-1] - cum[k])
                wait_until(lambda k=k, left=left: ta.ahead_bytes() >= min(budget - 400, left),
                           f"read ahead of position {k}")
            # then the consumer outruns it
    finally:
        ta.close()
    assert not over
    assert len(seen) == len(set(seen))  # each sample read at most once
    positions = sorted(pos_of[i] for i in seen)
    assert positions == list(range(len(positions))) or ta.stats.skipped > 0
    assert ta.stats.read == len(seen) and ta.stats.read + ta.stats.skipped <= len(order)
    assert ta.stats.read > 0


def test_workers_find_the_samples_in_the_tiers(tmp_path: Path) -> None:
    """With tiers, the Sampler reads an epoch's first samples into them from the moment it
    knows the order until the loop starts (within the budget), then leaves the reading to
    the DataLoader workers; the epoch leaves every shard whole in the tier. The placer is
    another process's here (it holds every claim), so what is in the tier is what the reads
    put there, however the threads are scheduled."""
    import torch

    import stagefs
    from stagefs.bench.datasets import imagenet_like

    imagenet_like(str(tmp_path / "raw"), files=300, classes=4, mean_size=3000, progress=False)
    stagefs.pack(tmp_path / "raw", tmp_path / "pack", shard_size="64KiB", progress=False)
    store = stagefs.open(tmp_path / "pack", tiers=[str(tmp_path / "tier")],
                         runtime=tmp_path / "rt")
    owner = f"{os.getppid()} {proc_start(os.getppid())}"  # a live process, not this one
    for k in range(len(store.manifest.shards)):
        (tmp_path / "rt" / "claims" / f"{store.manifest.pack_id.hex()}.{k}").write_text(owner)
    ds = FileDataset(store, target=None)
    budget = 200_000
    s = Sampler(ds, seed=3, prefetch=budget, rank=0, world_size=1)
    ta = s.tier_ahead
    assert ta is not None  # under way as soon as the order is known
    sizes = ds.sizes()[s.order()]
    first = int(np.searchsorted(np.cumsum(sizes), budget, "right"))  # samples in the budget
    deadline = time.monotonic() + 60
    while ta.stats.read + ta.stats.skipped < first and time.monotonic() < deadline:
        time.sleep(0.01)
    assert ta.stats.read == first and 0 < ta.stats.bytes_read <= budget
    tier = store.status()["tiers"][0]
    assert tier["filled_bytes"] >= ta.stats.bytes_read  # in the tier, for any process
    loader = torch.utils.data.DataLoader(ds, batch_size=10, sampler=s, num_workers=2,
                                         multiprocessing_context="fork", timeout=120,
                                         collate_fn=lambda b: b)
    try:
        got = [x for batch in loader for x in batch]
        # each sample counted once, when a worker read it: the read-ahead's are not samples
        assert _job_reads(tmp_path / "rt") == len(got) > ta.stats.read
        assert got == ds.read_samples(s.order().tolist())
        assert s.tier_ahead is None and ta.stats.read == first  # stopped when the loop began
        assert ds._upcoming is None  # the workers do not read ahead on their own
        assert store.held_shards() == set(range(len(store.manifest.shards)))
    finally:
        s.close()
        store.close()


def test_the_read_ahead_into_full_tiers_stops_and_the_first_epoch_reads_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A tier of a tenth of the dataset, a read-ahead budget of half of it: what the tier
    cannot take is not read ahead (the workers would read it again from the origin), so the
    first epoch reads the dataset from the origin once, and the second D - C (within 5%;
    pieces of 64 KiB, as a dataset a hundred times larger has at 1 MiB)."""
    import torch

    import stagefs
    from stagefs.bench.datasets import imagenet_like
    from stagefs.tiers import chain as chain_mod

    monkeypatch.setattr(chain_mod, "PIECE_SIZE", 64 * 1024)  # the forked workers' too

    imagenet_like(str(tmp_path / "raw"), files=400, classes=4, mean_size=20_000,
                  progress=False)
    stagefs.pack(tmp_path / "raw", tmp_path / "pack", shard_size="1MiB", progress=False)
    with stagefs.open(tmp_path / "pack") as probe:
        d = int(probe.manifest.arrays["stored"].sum())
    cap = d // 10
    store = stagefs.open(tmp_path / "pack", tiers=[f"{tmp_path / 'tier'}:{cap}"],
                         runtime=tmp_path / "rt")
    ds = FileDataset(store, target=None)
    s = Sampler(ds, seed=2, prefetch=d // 2, rank=0, world_size=1)
    loader = torch.utils.data.DataLoader(ds, batch_size=16, sampler=s, num_workers=2,
                                         multiprocessing_context="fork", timeout=120,
                                         collate_fn=lambda b: b)
    plain = stagefs.open(tmp_path / "pack")  # no runtime: its reads are not the job's
    try:
        fetched = []
        for epoch in range(2):
            s.set_epoch(epoch)
            got = [x for batch in loader for x in batch]
            assert store.chain is not None
            store.chain.wait_idle(60)
            fetched.append(_job_fetched(tmp_path / "rt"))
            assert got == FileDataset(plain, target=None).read_samples(s.order().tolist())
        first, second = fetched[0], fetched[1] - fetched[0]
        assert d <= first <= 1.02 * d, (first, d)
        assert abs(second - (d - cap)) <= 0.05 * (d - cap), (second, d - cap)
    finally:
        s.close()
        store.close()
        plain.close()


def _job_reads(rt: Path) -> int:
    """The samples the job's processes counted as read."""
    from stagefs.tiers.status import holder_summary, read_counts

    return int(holder_summary(read_counts(str(rt / "stats")))["reads"])


def _job_fetched(rt: Path) -> int:
    """Every read the job's processes (this one, its workers) made of the origin."""
    from stagefs.tiers.status import holder_summary, read_counts

    return int(holder_summary(read_counts(str(rt / "stats")))["fetched"]["bytes"])


def test_a_dropped_sampler_stops_its_read_ahead(tmp_path: Path) -> None:
    """The read-ahead into the tiers starts when the sampler is made: a sampler dropped
    without close() (never iterated) is still collected, and its threads end."""
    import gc

    import stagefs
    from stagefs.bench.datasets import imagenet_like

    imagenet_like(str(tmp_path / "raw"), files=120, classes=2, mean_size=2000, progress=False)
    stagefs.pack(tmp_path / "raw", tmp_path / "pack", shard_size="64KiB", progress=False)
    with stagefs.open(tmp_path / "pack", tiers=[str(tmp_path / "tier")],
                      runtime=tmp_path / "rt") as store:
        ds = FileDataset(store, target=None)
        s = Sampler(ds, seed=1, prefetch=20_000, rank=0, world_size=1)
        ta = s.tier_ahead
        assert ta is not None
        threads = list(ta._threads)
        deadline = time.monotonic() + 30
        while ta.stats.read == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert 0 < ta.stats.bytes_read <= 20_000  # then it waits at its budget
        del s
        gc.collect()
        for t in threads:
            t.join(10)
        assert ta._closed and not any(t.is_alive() for t in threads)


def test_a_loop_left_early_counts_the_samples_it_was_handed(tmp_path: Path) -> None:
    """num_workers=0 and a loop left after two batches: the read-ahead had read up to its
    budget, and every sample it read was counted as read (status said 200 samples for the
    16 handed out). Now a chunk of read-ahead counts once its first sample is handed out."""
    import torch

    import stagefs
    from stagefs.bench.datasets import imagenet_like

    imagenet_like(str(tmp_path / "raw"), files=300, classes=3, mean_size=3000, progress=False)
    stagefs.pack(tmp_path / "raw", tmp_path / "pack", shard_size="64KiB", progress=False)
    with stagefs.open(tmp_path / "pack", runtime=str(tmp_path / "rt")) as fs:
        ds = FileDataset(fs, target=None)
        s = Sampler(ds, seed=1, prefetch=2**20, rank=0, world_size=1, prefetch_threads=1)
        loader = torch.utils.data.DataLoader(ds, batch_size=8, sampler=s,
                                             collate_fn=lambda b: b)
        handed = []
        for k, batch in enumerate(loader):
            handed += batch
            if k == 1:
                break
        p = s.prefetcher
        assert p is not None
        wait_until(lambda: p.stats.read >= 200, "read 200 samples ahead")
        order = s.order()
        assert handed == [fs.read(ds.path_of(i)) for i in order[:16]]
        reads = fs.status()["holders"]
        counted = sum(h["reads"] for h in reads.values())
        # the 16 handed out, the 16 just read again above, and at most the rest of the
        # chunk (16 samples) the second batch was in
        assert 32 <= counted <= 48, reads
        s.close()
        assert sum(h["reads"] for h in fs.status()["holders"].values()) == counted
