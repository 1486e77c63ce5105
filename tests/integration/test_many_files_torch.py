"""stagefs.torch over a dataset of many files: what a DataLoader worker is sent, and what it
works out for itself, does not grow with the dataset."""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch", reason="PyTorch is not installed (pip install torch)")

import torch.utils.data

import stagefs
from stagefs.torch import FileDataset, Sampler

pytestmark = pytest.mark.integration

CLASSES, PER_CLASS = 20, 500  # 10,000 files


@pytest.fixture(scope="module")
def many_pack(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("many")
    src, dest = root / "src", root / "pack"
    for c in range(CLASSES):
        d = src / "train" / f"c{c:03d}"
        d.mkdir(parents=True)
        for i in range(PER_CLASS):
            (d / f"{i:05d}.JPEG").write_bytes(bytes([c, i % 256]) * (8 + i % 40))
    stagefs.pack(src, dest, jobs=1, shard_size="64KiB", progress=False)
    return dest


def test_pickled_dataset_does_not_carry_the_order(many_pack: Path) -> None:
    """A spawned worker is sent the plan of the epoch, not its order: 8 bytes a sample made
    the pickle 10 MB at ImageNet's size, more than a pipe holds, and the workers started one
    after the other (each waited for the one before to import torch)."""
    with stagefs.open(many_pack) as fs:
        ds = FileDataset(fs, root="train")
        small = len(pickle.dumps(ds))
        sampler = Sampler(ds, seed=3, prefetch="1MiB")
        try:
            sent = len(pickle.dumps(ds))
            assert sent < small + 4096, (small, sent)  # was small + 8 bytes x 10,000
        finally:
            sampler.close()


@pytest.mark.parametrize("case", ["start", "locality", "resumed"])
def test_worker_works_out_the_samplers_order(many_pack: Path, case: str) -> None:
    """What the worker reads ahead is the order the sampler yields, worked out from the
    plan in the unpickled copy: from an epoch's start, with locality (holders), and in an
    epoch resumed with another world size; and, for a Subset, by the FileDataset's
    indices."""
    with stagefs.open(many_pack) as fs:
        ds = FileDataset(fs, root="train")
        n_shards = len(fs.manifest.shards)
        held = [list(range(0, n_shards, 2)), list(range(1, n_shards, 2))]
        sub = torch.utils.data.Subset(ds, list(range(len(ds) - 1, -1, -3)))
        for data in (ds, sub):
            kw: dict[str, object] = {"seed": 7, "prefetch": "1MiB", "rank": 1, "world_size": 2}
            if case == "locality":
                kw.update(locality=True, held_by=held)
            sampler = Sampler(data, **kw)  # type: ignore[arg-type]
            try:
                if case == "resumed":
                    sampler.set_epoch(2)
                    state = sampler.state_dict(consumed=1234)
                    sampler.close()
                    sampler = Sampler(data, seed=7, prefetch="1MiB", rank=2, world_size=3)
                    sampler.load_state_dict(state)
                    sampler.set_epoch(2)
                want = np.asarray(list(iter(sampler)))
                if data is sub:
                    want = np.asarray(sub.indices)[want]
                copy = pickle.loads(pickle.dumps(ds))
                got = copy._upcoming.order(copy.shard_of)
                assert np.array_equal(got, want)
            finally:
                sampler.close()
