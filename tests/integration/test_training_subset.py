"""A training job that carves its validation set out of ``train`` with ``random_split``:
the Sampler's prefetching and locality work on a torch Subset of a FileDataset, and every
byte a loader returns is the file's."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed (pip install torch)")

import stagefs  # noqa: E402
from stagefs.bench.datasets import imagenet_like  # noqa: E402
from stagefs.errors import ConfigError  # noqa: E402
from stagefs.torch import FileDataset, Sampler  # noqa: E402

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def pack(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    base = tmp_path_factory.mktemp("subset")
    imagenet_like(str(base / "raw"), files=120, classes=4, mean_size=2000, seed=3,
                  progress=False)
    stagefs.pack(base / "raw", base / "pack", shard_size="32KiB", progress=False)
    return base / "raw", base / "pack"


def collate_list(batch: list[Any]) -> list[Any]:
    return batch


def split(pack: Path, **open_kw: Any) -> tuple[FileDataset, Any, Any]:
    ds = FileDataset(stagefs.open(pack, **open_kw), target="path")
    train, val = torch.utils.data.random_split(ds, [0.75, 0.25],
                                               generator=torch.Generator().manual_seed(0))
    # a Subset of a Subset: the maps compose
    return ds, torch.utils.data.Subset(train, list(range(len(train) - 1, -1, -1))), val


def epoch_items(sampler: Sampler, subset: Any, **kw: Any) -> list[tuple[bytes, str]]:
    loader = torch.utils.data.DataLoader(subset, batch_size=8, sampler=sampler,
                                         collate_fn=collate_list, **kw)
    return [item for batch in loader for item in batch]


@pytest.mark.parametrize("workers", [0, 2])
def test_prefetch_on_a_random_split(pack: tuple[Path, Path], workers: int) -> None:
    raw, packed = pack
    ds, train, _ = split(packed)
    sampler = Sampler(train, seed=4, prefetch="64KiB")
    for epoch in range(2):
        sampler.set_epoch(epoch)
        items = epoch_items(sampler, train, num_workers=workers,
                            persistent_workers=workers > 0)
        want = [ds.path_of(train.dataset.indices[train.indices[i]])
                for i in sampler.order().tolist()]
        assert [p for _, p in items] == want  # the Subset's samples, in the sampler's order
        for data, path in items:
            assert data == (raw / path).read_bytes()
    if workers == 0:  # read ahead, by the FileDataset's index, and taken by the loop
        assert sampler.prefetcher is not None and sampler.prefetcher.stats.hits > 0
    sampler.close()


def test_tier_read_ahead_and_locality_on_a_random_split(pack: tuple[Path, Path],
                                                        tmp_path: Path) -> None:
    raw, packed = pack
    _, _, val = split(packed, tiers=[f"{tmp_path / 't0'}:64MiB"])
    sampler = Sampler(val, seed=1, prefetch="64KiB", locality=True)
    ahead = sampler.tier_ahead
    assert ahead is not None  # reading the split's first samples into the tiers
    deadline = time.monotonic() + 60
    while ahead.stats.read + ahead.stats.errors == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert ahead.stats.read > 0 and ahead.stats.errors == 0
    items = epoch_items(sampler, val)
    assert sorted(p for _, p in items) == sorted(val.dataset.path_of(i) for i in val.indices)
    for data, path in items:
        assert data == (raw / path).read_bytes()
    assert 0.0 <= sampler.local_fraction <= 1.0
    sampler.close()


def test_resume_on_a_random_split(pack: tuple[Path, Path]) -> None:
    _, packed = pack
    _, train, _ = split(packed)
    whole = Sampler(train, seed=2, prefetch="64KiB")
    full = list(whole)
    first = Sampler(train, seed=2, prefetch="64KiB")
    it = iter(first)
    head = [next(it) for _ in range(20)]
    state = first.state_dict(consumed=20)
    again = Sampler(train, seed=2, prefetch="64KiB")
    again.load_state_dict(state)
    assert head + list(again) == full
    for s in (whole, first, again):
        s.close()


def test_other_datasets_are_refused_by_name() -> None:
    with pytest.raises(ConfigError, match=r"not list.*a torch Subset of one"):
        Sampler(list(range(10)), prefetch="1MiB")
    assert len(Sampler(np.arange(10))) == 10  # without prefetch or locality: any dataset
