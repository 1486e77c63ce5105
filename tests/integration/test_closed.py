"""MLPerf Storage CLOSED rules (``STAGEFS_CLOSED=1`` / ``Sampler(closed=True)``): nothing the
storage does is informed by the shuffle seed."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch", reason="PyTorch is not installed (pip install torch)")

import torch.utils.data

import stagefs
from stagefs.errors import ConfigError
from stagefs.torch import FileDataset, Sampler
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
