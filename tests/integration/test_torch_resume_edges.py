"""stagefs.torch used as a demanding user would: resuming through DataLoader workers and the
usual epoch loop, damaged sampler states, ImageFolder's listing with symlinks and a single
extension, a dataset whose store was closed; and Store.read_entry/read_entries with inputs
that are not entries."""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed (pip install torch)")

import stagefs  # noqa: E402
from stagefs.errors import ConfigError  # noqa: E402
from stagefs.torch import FileDataset, Sampler  # noqa: E402
from tiers_helpers import make_tree  # noqa: E402

pytestmark = pytest.mark.integration

BATCH = 8


@pytest.fixture(scope="module")
def pack(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.mktemp("resume")
    make_tree(base / "raw" / "train", n=157, seed=5)  # 157: no world size divides it
    stagefs.pack(base / "raw", base / "pack", shard_size="32KiB", jobs=1, progress=False,
                 echo=lambda _m: None)
    return base / "pack"


def _paths(batch: list[Any]) -> list[str]:
    return [p for _, p in batch]


def _loader(ds: FileDataset, sampler: Sampler, workers: int) -> Any:
    return torch.utils.data.DataLoader(ds, batch_size=BATCH, sampler=sampler,
                                       num_workers=workers, collate_fn=_paths)


# -- resume --------------------------------------------------------------------------------


@pytest.mark.parametrize("workers", [0, 2])
def test_checkpoint_near_the_end_of_a_resumed_epoch(pack: Path, workers: int) -> None:
    """With workers the sampler's iteration ends a few batches before the loop does: a
    checkpoint taken then, in an epoch that was itself resumed, keeps the first resume point
    (it started the epoch over from the resume point: samples read twice)."""
    ds = FileDataset(pack, target="path")
    s = Sampler(ds, seed=5)
    s.set_epoch(2)
    it = iter(_loader(ds, s, 0))
    seen = [p for _ in range(7) for p in next(it)]
    state = s.state_dict(consumed=7 * BATCH)

    s2 = Sampler(ds, seed=5)
    s2.load_state_dict(state)
    loader = _loader(ds, s2, workers)
    batches = len(loader)
    it = iter(loader)
    seen += [p for _ in range(batches - 1) for p in next(it)]
    state2 = s2.state_dict(consumed=(batches - 1) * BATCH)  # the sampler has ended by now
    last = [p for b in it for p in b]

    s3 = Sampler(ds, seed=5)
    s3.load_state_dict(state2)
    assert [p for b in _loader(ds, s3, 0) for p in b] == last
    assert sorted(seen + last) == sorted(ds.path_of(i) for i in range(len(ds)))


def test_state_after_an_epoch_ended_is_that_epoch_done(pack: Path) -> None:
    ds = FileDataset(pack, target=None)
    s = Sampler(ds, seed=1)
    assert len(list(s)) == len(ds)
    s2 = Sampler(ds, seed=1)
    s2.load_state_dict(s.state_dict())  # num_workers=0: what it yielded is exact
    assert list(s2) == []
    assert len(list(s)) == len(ds)  # iterating again without set_epoch: from the start


def test_set_epoch_of_the_resumed_epoch_keeps_the_resume_point(pack: Path) -> None:
    """docs: call set_epoch every epoch; the usual loop does so for the resumed one too."""
    ds = FileDataset(pack, target=None)
    s = Sampler(ds, seed=2, rank=1, world_size=3)
    s.set_epoch(4)
    it = iter(s)
    first = [next(it) for _ in range(20)]
    state = s.state_dict(consumed=20 * 3)
    s2 = Sampler(ds, seed=2, rank=1, world_size=3)
    s2.load_state_dict(state)
    s2.set_epoch(state["epoch"])
    rest = list(s2)
    whole = Sampler(ds, seed=2, rank=1, world_size=3)
    whole.set_epoch(4)
    assert first + rest == list(whole)
    s2.set_epoch(5)  # the next epoch starts from its beginning
    assert len(list(s2)) == len(whole)
    s2.set_epoch(5)
    s2.load_state_dict(state)
    s2.set_epoch(4)
    assert list(s2) == rest
    s2.set_epoch(4)  # once iterated, set_epoch starts the epoch over
    assert list(s2) == first + rest


def _good_state(ds: FileDataset) -> dict[str, Any]:
    s = Sampler(ds, seed=0, rank=0, world_size=2)
    return s.state_dict(consumed=10)


@pytest.mark.parametrize("damage", [
    "none", "list", "no segments", "no epoch", "segments str", "segment short",
    "world float", "world str", "consumed bool", "epoch str", "epoch float", "epoch none",
    "holders without locality", "seed bool",
])
def test_damaged_sampler_states_are_refused_by_name(pack: Path, damage: str) -> None:
    ds = FileDataset(pack, target=None)
    st = _good_state(ds)
    state: Any = {
        "none": None, "list": [st],
        "no segments": {k: v for k, v in st.items() if k != "segments"},
        "no epoch": {k: v for k, v in st.items() if k != "epoch"},
        "segments str": {**st, "segments": "2,5"},
        "segment short": {**st, "segments": [[2]]},
        "world float": {**st, "segments": [[2.5, 5, None]]},
        "world str": {**st, "segments": [["2", 5, None]]},
        "consumed bool": {**st, "segments": [[2, True, None]]},
        "epoch str": {**st, "epoch": "0"},
        "epoch float": {**st, "epoch": 1.5},
        "epoch none": {**st, "epoch": None},
        "holders without locality": {**st, "segments": [[2, 5, [[0], [1]]]]},
        "seed bool": {**st, "seed": False},
    }[damage]
    s = Sampler(ds, seed=0, rank=1, world_size=2)
    with pytest.raises(ConfigError, match=r"sampler state|state_dict"):
        s.load_state_dict(state)
    s.load_state_dict(st)  # a good one still loads
    assert len(list(s)) == len(Sampler(ds, seed=0, rank=1, world_size=2)) - 5


def test_consumed_must_be_a_whole_number(pack: Path) -> None:
    ds = FileDataset(pack, target=None)
    s = Sampler(ds, seed=0)
    for bad in (3.5, "3", None.__class__):
        with pytest.raises(TypeError, match="consumed"):
            s.state_dict(consumed=bad)  # type: ignore[arg-type]
    assert s.state_dict(consumed=np.int64(4))["segments"] == [[1, 4, None]]


def test_consumed_past_the_iteration_is_its_end(pack: Path) -> None:
    # batches_seen * batch_size * world_size overshoots by a last partial batch: the
    # iteration is done, and the state says so (not a count past its samples)
    ds = FileDataset(pack, target=None)
    s = Sampler(ds, seed=0, rank=0, world_size=2)
    n = len(s)
    assert s.state_dict(consumed=n * 2 + 6)["segments"] == [[2, n, None]]
    s.load_state_dict(s.state_dict(consumed=10))  # resumed: the iteration is what is left
    assert s.state_dict(consumed=n * 2 + 6)["segments"] == [[2, n, None]]
    assert len(s) == n - 5


# -- the listing ---------------------------------------------------------------------------


def _imagefolder(top: Path, extensions: str | tuple[str, ...] | None) -> list[tuple[str, int]]:
    """torchvision's ImageFolder listing (datasets/folder.py make_dataset)."""
    classes = sorted(e.name for e in os.scandir(top) if e.is_dir())
    out = []
    for label, c in enumerate(classes):
        for root, _, names in sorted(os.walk(top / c, followlinks=True)):
            for name in sorted(names):
                if extensions is None or name.lower().endswith(extensions):
                    p = os.path.join(root, name)
                    out.append((os.path.relpath(p, top.parent), label))
    return out


@pytest.fixture(scope="module")
def linked(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    base = tmp_path_factory.mktemp("linked")
    top = base / "raw" / "train"
    for rel in ("a/m.jpg", "a/z.png", "a/sub/k.jpg", "b/c.jpg", "b/y.JPG", "zz/q.jpg"):
        (top / rel).parent.mkdir(parents=True, exist_ok=True)
        (top / rel).write_bytes(rel.encode())
    os.symlink("../b/c.jpg", top / "a" / "b_link.jpg")  # a file link, sorted among files
    os.symlink("../zz", top / "a" / "l_dir")  # a folder link, walked under its own path
    os.symlink("zz", top / "c_class")  # a class folder that is a link
    os.symlink("../b/y.JPG", top / "a" / "zz_last.jpg")
    stagefs.pack(base / "raw", base / "pack", jobs=1, progress=False, echo=lambda _m: None)
    return top, base / "pack"


@pytest.mark.parametrize("extensions", [None, (".jpg",), ".jpg", ".png"])
def test_listing_with_symlinks_and_one_extension_is_imagefolders(
        linked: tuple[Path, Path], extensions: Any) -> None:
    top, pack = linked
    ds = FileDataset(pack, target="path", extensions=extensions)
    want = _imagefolder(top, extensions)
    assert ds.samples == want
    for i, (path, label) in enumerate(want):  # the bytes are the link target's
        data, p = ds[i]
        assert p == path and data == (top.parent / path).resolve().read_bytes()
        assert ds.targets[i] == label


def test_a_symlink_loop_is_listed_once_not_walked_forever(tmp_path: Path) -> None:
    top = tmp_path / "raw" / "train"
    (top / "a").mkdir(parents=True)
    (top / "a" / "f.jpg").write_bytes(b"x")
    os.symlink("..", top / "a" / "up")  # train/a/up/a/up/a/... for ever
    os.symlink(".", top / "a" / "self")
    stagefs.pack(tmp_path / "raw", tmp_path / "pack", jobs=1, progress=False,
                 echo=lambda _m: None)
    ds = FileDataset(tmp_path / "pack", target="path")
    assert Counter(p for p, _ in ds.samples) == Counter(
        ["train/a/f.jpg", "train/a/up/a/f.jpg"])
    assert all(ds[i][0] == b"x" for i in range(len(ds)))


def test_a_dataset_whose_store_was_closed_says_so(pack: Path) -> None:
    store = stagefs.open(pack)
    ds = FileDataset(store, target="path")
    store.close()
    for call in (lambda: Sampler(ds, prefetch="1MiB"), lambda: ds.path_of(0),
                 lambda: ds[0], lambda: ds.__getitems__([0, 1])):
        with pytest.raises(ValueError, match="closed Store"):
            call()


# -- Store.read_entry / read_entries -------------------------------------------------------


def test_entries_that_are_not_whole_numbers_are_named(pack: Path) -> None:
    with stagefs.open(pack) as fs:
        e = next(i for i in range(len(fs.manifest))
                 if fs.isfile(fs.manifest.path_of(i)) and fs.manifest.size[i] > 0)
        data = fs.read_entry(e)
        assert fs.read_entry(np.int64(e)) == fs.read_entry(np.uint32(e)) == data
        assert fs.read_entry(torch.tensor(e)) == data
        for bad in (np.float64(e), float(e), str(e), None, True):
            with pytest.raises(TypeError, match="whole number"):
                fs.read_entry(bad)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="flat"):
            fs.read_entries(np.array([[e, e], [e, e]]))
        with pytest.raises(ValueError, match="paths"):
            fs.read_entries([e, e, e], ["only one"])
        assert fs.read_entries(np.array([e, e], dtype=np.int32)) == [data, data]


def test_a_state_of_another_dataset_of_the_same_size_is_refused(pack: Path) -> None:
    """The state names the dataset's files (a digest of their path hashes), not only their
    count: a random_split without a seeded generator is another split each run, and its
    state resumed silently (samples of the resumed split read twice, others never)."""
    ds = FileDataset(pack, target=None)
    split = [0.75, 0.25]
    a = torch.utils.data.random_split(ds, split, generator=torch.Generator().manual_seed(1))[0]
    b = torch.utils.data.random_split(ds, split, generator=torch.Generator().manual_seed(2))[0]
    assert len(a) == len(b) and list(a.indices) != list(b.indices)
    state = Sampler(a, seed=0).state_dict(consumed=8)
    with pytest.raises(ConfigError, match=r"another dataset.*random_split"):
        Sampler(b, seed=0).load_state_dict(state)
    same = torch.utils.data.random_split(ds, split, generator=torch.Generator().manual_seed(1))
    s = Sampler(same[0], seed=0)
    s.load_state_dict(json.loads(json.dumps(state)))  # the same split, through JSON
    assert list(s) == list(Sampler(a, seed=0).order()[8:])
    # the whole dataset in another order of its files is another dataset too
    t = Sampler(torch.utils.data.Subset(ds, list(range(len(ds)))[::-1]), seed=0)
    with pytest.raises(ConfigError, match="another dataset"):
        t.load_state_dict(Sampler(ds, seed=0).state_dict(consumed=8))
    # a state saved before the digest was kept loads as before; a damaged one is refused
    old = {k: v for k, v in state.items() if k != "dataset"}
    Sampler(b, seed=0).load_state_dict(old)
    with pytest.raises(ConfigError, match="damaged"):
        Sampler(a, seed=0).load_state_dict({**state, "dataset": 7})
