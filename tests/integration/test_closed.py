"""MLPerf Storage CLOSED rules (``STAGEFS_CLOSED=1`` / ``Sampler(closed=True)``): nothing the
storage does is informed by the shuffle seed."""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch", reason="PyTorch is not installed (pip install torch)")

import torch.utils.data

import stagefs
from stagefs.errors import ConfigError
from stagefs.torch import FileDataset, Sampler
from stagefs.torch._prefetch import TierAhead
from tiers_helpers import make_tree

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def pack(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.mktemp("closed")
    make_tree(base / "raw" / "train", n=200, seed=9)
    stagefs.pack(base / "raw", base / "pack", shard_size="32KiB", jobs=1, progress=False,
                 echo=lambda _m: None)
    return base / "pack"


def _identity(batch: Any) -> Any:
    return batch


def storage_side(pack: Path, tmp: Path, runtime: Path, seed: int, closed: bool | None
                 ) -> tuple[list[list[int]], list[int], bool]:
    """What the storage was told or did ahead of the reads when a Sampler with ``seed`` was
    made and its loop started: the shard orders handed to Store.prefetch, the queue of the
    tiers' streams then, and whether any read-ahead ran."""
    with stagefs.open(pack, tiers=[str(tmp / f"tier{seed}")], runtime=runtime / str(seed)) as fs:
        told: list[list[int]] = []
        real = fs.prefetch

        def prefetch(shards: Iterable[int]) -> None:
            order = [int(s) for s in shards]
            told.append(order)
            real(order)

        fs.prefetch = prefetch  # type: ignore[method-assign]
        fs.chain.stream.clear()  # type: ignore[union-attr]
        ds = FileDataset(fs, root="train", target=None)
        s = Sampler(ds, seed=seed, prefetch="1MiB", closed=closed)
        queued = fs.chain.stream.queued()  # type: ignore[union-attr]
        it = iter(torch.utils.data.DataLoader(ds, batch_size=8, sampler=s, num_workers=0,
                                              collate_fn=_identity))
        next(it)
        ahead = s.tier_ahead is not None or s.prefetcher is not None
        s.close()
        return told, queued, ahead


def test_closed_mode_uses_nothing_from_the_seed(pack: Path, tmp_path: Path, runtime: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    # without it, the seed decides what the storage is told ahead of the reads ...
    a = storage_side(pack, tmp_path, runtime, 1, closed=False)
    b = storage_side(pack, tmp_path, runtime, 2, closed=False)
    assert a[0] and b[0] and a[0] != b[0]
    assert a[2] and b[2]
    # ... with it (the switch or the argument), nothing: no order, no read-ahead
    monkeypatch.setenv("STAGEFS_CLOSED", "1")
    for seed in (1, 2, 3):
        assert storage_side(pack, tmp_path, runtime, 10 + seed, closed=None) == ([], [], False)
    assert storage_side(pack, tmp_path, runtime, 20, closed=True) == ([], [], False)


def test_closed_mode_refuses_locality_and_bad_values(pack: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    with stagefs.open(pack) as fs:
        ds = FileDataset(fs, root="train", target=None)
        with pytest.raises(ConfigError, match="CLOSED"):
            Sampler(ds, locality=True, closed=True)
        monkeypatch.setenv("STAGEFS_CLOSED", "maybe")
        with pytest.raises(ConfigError, match="STAGEFS_CLOSED"):
            Sampler(ds)
        monkeypatch.setenv("STAGEFS_CLOSED", "0")
        assert not Sampler(ds).closed
        for on in ("on", "1", "Yes"):  # as every other switch ("on" was refused)
            monkeypatch.setenv("STAGEFS_CLOSED", on)
            assert Sampler(ds).closed
        monkeypatch.setenv("STAGEFS_CLOSED", "off")
        assert not Sampler(ds).closed


def _ahead_in_worker(batch: list[Any]) -> tuple[int, int]:
    """(samples in the batch, samples this DataLoader worker read ahead so far)."""
    info = torch.utils.data.get_worker_info()
    st = getattr(info.dataset, "_worker_ahead", None) if info is not None else None
    return len(batch), 0 if st is None else st.prefetcher.stats.read


def test_closed_mode_takes_no_read_ahead_an_earlier_sampler_left(pack: Path,
                                                                 runtime: Path) -> None:
    """An open-mode Sampler made first on the same dataset (a comparison of the two modes in
    one script, with one seed) left its read-ahead there: the closed-mode loop read ahead
    in the seed's order through it."""
    with stagefs.open(pack) as fs:  # no tiers: DataLoader workers read their batches ahead
        ds = FileDataset(fs, root="train", target=None)
        earlier = Sampler(ds, seed=3, prefetch="1MiB")
        s = Sampler(ds, seed=3, prefetch="1MiB", closed=True)
        loader = torch.utils.data.DataLoader(ds, batch_size=8, sampler=s, num_workers=2,
                                             multiprocessing_context="fork",
                                             collate_fn=_ahead_in_worker)
        got = list(loader)
        assert sum(n for n, _ in got) == len(ds)
        assert [a for _, a in got] == [0] * len(got)
        # in this process (num_workers=0): a loop of the earlier sampler left early
        loader = torch.utils.data.DataLoader(ds, batch_size=8, sampler=earlier,
                                             collate_fn=_identity)
        next(iter(loader))
        assert earlier.prefetcher is not None
        served = earlier.prefetcher.stats.hits + earlier.prefetcher.stats.misses
        list(torch.utils.data.DataLoader(ds, batch_size=8, sampler=s, collate_fn=_identity))
        # none of the closed loop's samples was asked of the earlier read-ahead
        assert earlier.prefetcher.stats.hits + earlier.prefetcher.stats.misses == served
        earlier.close()


def test_closed_mode_stops_the_read_into_the_tiers_an_earlier_sampler_started(
        pack: Path, tmp_path: Path, runtime: Path) -> None:
    """An open-mode Sampler made first on the same dataset, with tiers, reads the epoch's
    first samples into them in the seed's order until its loop starts: a closed-mode
    Sampler made then left that read running under the closed run."""
    with stagefs.open(pack, tiers=[str(tmp_path / "tier")], runtime=runtime / "t") as fs:
        ds = FileDataset(fs, root="train", target=None)
        gate, reads = threading.Event(), list[int]()
        real = ds.read_samples

        def read_samples(indices: Sequence[int], *, count: bool = True) -> list[bytes]:
            if not count:  # the read into the tiers
                reads.append(len(indices))
                gate.wait(10)
            return real(indices, count=count)

        ds.read_samples = read_samples  # type: ignore[method-assign]
        earlier = Sampler(ds, seed=3, prefetch="64MiB")
        assert earlier.tier_ahead is not None
        Sampler(ds, seed=3, closed=True)
        gate.set()
        for t in threading.enumerate():
            if t.name.startswith(TierAhead.thread_name):
                t.join(10)
        assert len(reads) <= 1  # the read under way as the closed Sampler was made
        earlier.close()


def test_closed_mode_is_said_and_overriding_the_switch_is_warned(
        pack: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """An auditor's STAGEFS_CLOSED=1 overridden by a script's closed=False ran open mode
    without a word; a closed Sampler said nothing a log could show."""
    monkeypatch.setenv("STAGEFS_CLOSED", "yes")
    with stagefs.open(pack) as fs, caplog.at_level("INFO", logger="stagefs"):
        ds = FileDataset(fs, root="train", target=None)
        opened = Sampler(ds, seed=1, prefetch="1MiB", closed=False)
        assert not opened.closed
        warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
        assert any("STAGEFS_CLOSED=yes" in m and "closed=False" in m and "open mode" in m
                   for m in warned), warned
        for closed, how in ((None, "STAGEFS_CLOSED=yes"), (True, "closed=True")):
            caplog.clear()
            s = Sampler(ds, seed=1, prefetch="1MiB", closed=closed)
            said = [r.getMessage() for r in caplog.records if r.levelname == "INFO"]
            assert s.closed and any("closed mode" in m and how in m and "prefetch='1MiB' is "
                                    "ignored" in m for m in said), said
        monkeypatch.setenv("STAGEFS_CLOSED", "0")
        caplog.clear()
        Sampler(ds, seed=1, closed=False)
        assert not [r for r in caplog.records if r.levelname == "WARNING"]


def test_closed_mode_checks_the_prefetch_it_ignores(pack: Path) -> None:
    """A prefetch typo that open mode refuses was taken silently in closed mode: the script
    failed only once the switch was off."""
    with stagefs.open(pack) as fs:
        ds = FileDataset(fs, root="train", target=None)
        for bad in ("lots", -5, 1.5):
            with pytest.raises(ConfigError, match="prefetch"):
                Sampler(ds, prefetch=bad, closed=True)
        assert Sampler(ds, prefetch="1MiB", closed=True).budget == 0
