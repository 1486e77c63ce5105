"""stagefs.torch with real PyTorch: FileDataset, Sampler with DataLoader workers (fork and
spawn), real multi-process ranks, resume, locality on a real store, StallMeter."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import warnings
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed (pip install torch)")

import stagefs  # noqa: E402
from stagefs.bench.datasets import imagenet_like  # noqa: E402
from stagefs.errors import ConfigError, NotFoundError  # noqa: E402
from stagefs.torch import FileDataset, Sampler, StallMeter  # noqa: E402

pytestmark = pytest.mark.integration

FILES, CLASSES = 241, 6  # not a multiple of the world sizes: padding shows


@pytest.fixture(scope="module")
def tree(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A small ImageNet-like tree (class folders of JPEGs) and its pack, in several shards."""
    base = tmp_path_factory.mktemp("torchdata")
    imagenet_like(str(base / "raw"), files=FILES, classes=CLASSES, mean_size=2500, seed=1,
                  progress=False)
    stagefs.pack(base / "raw", base / "pack", shard_size="64KiB", progress=False)
    return base / "raw", base / "pack"


def raw_listing(raw: Path) -> tuple[list[str], list[tuple[str, int]]]:
    """What torchvision's ImageFolder lists: sorted class folders, a sorted walk of each."""
    classes = sorted(d.name for d in os.scandir(raw / "train") if d.is_dir())
    samples = []
    for idx, c in enumerate(classes):
        for root, _, names in sorted(os.walk(raw / "train" / c)):
            for name in sorted(names):
                samples.append((os.path.relpath(os.path.join(root, name), raw), idx))
    return classes, samples


def collate_list(batch: list[Any]) -> list[Any]:
    return batch


# -- import rules --------------------------------------------------------------------------

def test_import_stagefs_does_not_import_torch() -> None:
    out = subprocess.run([sys.executable, "-c",
                          "import sys, stagefs; print('torch' in sys.modules)"],
                         capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "False"


def test_missing_torch_names_the_extra() -> None:
    code = ("import sys; sys.modules['torch'] = None\n"
            "try:\n import stagefs.torch\nexcept ImportError as e:\n print(e)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, check=True)
    assert "pip install 'stagefs[torch]'" in out.stdout


# -- FileDataset ---------------------------------------------------------------------------

def test_dataset_is_imagefolder_compatible(tree: tuple[Path, Path]) -> None:
    raw, pack = tree
    ds = FileDataset(pack)
    classes, samples = raw_listing(raw)
    assert ds.classes == classes
    assert ds.class_to_idx == {c: i for i, c in enumerate(classes)}
    assert list(ds.targets) == [t for _, t in samples]
    assert ds.samples == samples
    assert len(ds) == FILES
    for i in (0, 17, FILES - 1, -1):
        data, target = ds[i]
        assert data == (raw / samples[i][0]).read_bytes()
        assert target == samples[i][1]
    with pytest.raises(IndexError, match="out of range"):
        ds[FILES]
    # numpy's and torch's whole numbers are indices; a float or a string is not (a list,
    # and ImageFolder, refuse them: truncated, 1.5 read sample 1)
    assert ds[np.int64(17)] == ds[torch.tensor(17)] == ds[17]
    for bad in (1.5, np.float32(1.99), "3", torch.tensor(1.0)):
        with pytest.raises(TypeError, match="whole numbers"):
            ds[bad]
        with pytest.raises(TypeError, match="whole numbers"):
            ds.__getitems__([0, bad])


def test_dataset_orders_names_that_are_not_utf8_as_imagefolder(tmp_path: Path) -> None:
    """ImageFolder sorts names as str, where a byte that is not UTF-8 is a surrogate that
    sorts after most characters; the manifest sorts them as bytes. A Shift-JIS class beside
    a UTF-8 one, a Latin-1 file beside a UTF-8 one: the same classes, targets and samples."""
    raw = os.fsencode(tmp_path / "raw")
    for c in (b"\x83e\x83X\x83g", "テスト".encode(), b"plain"):
        for sub in (b"", b"\xc0sub/", "été/".encode()):
            for f in (b"\xc0pple.jpg", "été.jpg".encode(), b"z.jpg"):
                p = os.path.join(raw, b"train", c, sub + f)
                os.makedirs(os.path.dirname(p), exist_ok=True)
                Path(os.fsdecode(p)).write_bytes(p)
    stagefs.pack(tmp_path / "raw", tmp_path / "pack", progress=False)
    ds = FileDataset(tmp_path / "pack")
    classes, samples = raw_listing(tmp_path / "raw")
    assert ds.classes == classes
    assert ds.samples == samples
    assert [ds[i][0] for i in range(len(ds))] == [
        (tmp_path / "raw" / p).read_bytes() for p, _ in samples]


def test_dataset_targets_and_transforms(tree: tuple[Path, Path]) -> None:
    raw, pack = tree
    _, samples = raw_listing(raw)
    ds = FileDataset(pack, transform=len, target="path", target_transform=str.upper)
    assert ds[3] == ((raw / samples[3][0]).stat().st_size, samples[3][0].upper())
    alone = FileDataset(stagefs.open(pack), target=None)
    assert alone[5] == (raw / samples[5][0]).read_bytes()
    assert len(FileDataset(pack, extensions=[".jpeg"])) == FILES
    with pytest.raises(NotFoundError, match="No files"):
        FileDataset(pack, extensions=[".png"])
    with pytest.raises(FileNotFoundError, match="FileDataset"):
        FileDataset(pack, root="nope")
    with pytest.raises(ConfigError, match="target"):
        FileDataset(pack, target="label")  # type: ignore[arg-type]


def test_getitems_is_one_batched_read(tree: tuple[Path, Path]) -> None:
    pack = tree[1]
    ds = FileDataset(pack)
    idx = [5, 200, 7, 5, 99]
    want = [ds[i] for i in idx]
    store = ds.store
    calls: list[int] = []
    real = store.read_entries

    def read_entries(entries: Any, paths: Any = None, **kw: Any) -> list[bytes]:
        calls.append(len(entries))
        return real(entries, paths, **kw)

    def no_lookup(path: Any) -> int:
        raise AssertionError(f"{path!r} looked up again: the dataset knows its entries")

    store.read_entries = read_entries  # type: ignore[method-assign]
    store._find = store.namespace.file_entry = no_lookup  # type: ignore[method-assign]
    assert ds.__getitems__(idx) == want
    assert calls == [len(idx)]  # one batched read, the Store's fast route


def test_worker_state_is_small(tree: tuple[Path, Path]) -> None:
    ds = FileDataset(pack := tree[1])
    assert ds.entries.dtype.kind == "i" and ds.targets.dtype.kind == "i"
    blob = pickle.dumps(ds)
    assert len(blob) < 2000  # the store's path and arguments, not the listing
    assert str(pack).encode() in blob
    copy = pickle.loads(blob)
    assert np.array_equal(copy.entries, ds.entries) and copy[9] == ds[9]


# -- DataLoader ----------------------------------------------------------------------------

def loader_bytes(ds: FileDataset, sampler: Sampler, **kw: Any) -> list[bytes]:
    loader = torch.utils.data.DataLoader(ds, batch_size=16, sampler=sampler,
                                         collate_fn=collate_list, **kw)
    return [data for batch in loader for data, _ in batch]


@pytest.mark.parametrize(("workers", "method"), [(0, None), (2, "fork"), (2, "spawn")])
def test_dataloader_returns_the_file_bytes(tree: tuple[Path, Path], workers: int,
                                           method: str | None) -> None:
    raw, pack = tree
    _, samples = raw_listing(raw)
    ds = FileDataset(pack)
    sampler = Sampler(ds, seed=3, rank=0, world_size=1)
    got = loader_bytes(ds, sampler, num_workers=workers, multiprocessing_context=method,
                       timeout=120 if workers else 0)
    want = [(raw / samples[i][0]).read_bytes() for i in sampler.order()]
    assert got == want


def test_persistent_workers_follow_set_epoch(tree: tuple[Path, Path]) -> None:
    ds = FileDataset(tree[1], transform=len, target=None)
    sampler = Sampler(ds, seed=1, rank=0, world_size=1)
    loader = torch.utils.data.DataLoader(ds, batch_size=32, sampler=sampler, num_workers=2,
                                         persistent_workers=True, multiprocessing_context="fork",
                                         timeout=120)
    sizes = ds.sizes()
    for epoch in range(2):
        sampler.set_epoch(epoch)
        got = torch.cat(list(loader)).tolist()
        assert got == sizes[sampler.order()].tolist()


def test_pin_memory_on_cpu_only_torch(tree: tuple[Path, Path]) -> None:
    """pin_memory=True works; without an accelerator torch warns that it pins nothing."""
    ds = FileDataset(tree[1], transform=lambda b: torch.tensor(len(b)), target="folder")
    sampler = Sampler(ds, rank=0, world_size=1)
    loader = torch.utils.data.DataLoader(ds, batch_size=64, sampler=sampler, pin_memory=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        batches = list(loader)
    if not torch.accelerator.is_available():
        assert any("pin_memory" in str(w.message) for w in caught)
    assert sum(len(b[0]) for b in batches) == FILES


# -- ranks ---------------------------------------------------------------------------------

RANK_SCRIPT = """
import json, sys
from stagefs.torch import FileDataset, Sampler
ds = FileDataset(sys.argv[1])
out = []
for drop_last, epoch in ((False, 0), (True, 5)):
    s = Sampler(ds, seed=11, drop_last=drop_last)
    s.set_epoch(epoch)
    out.append([s.rank, s.world_size, list(s)])
print(json.dumps(out))
"""


def test_real_ranks_cover_the_dataset_once(tree: tuple[Path, Path]) -> None:
    """Three processes, rank and world size from RANK/WORLD_SIZE, each iterating its
    Sampler: together they read the dataset once (padding / dropping as documented)."""
    world = 3
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    procs = [subprocess.Popen([sys.executable, "-c", RANK_SCRIPT, str(tree[1])],
                              env={**env, "RANK": str(r), "WORLD_SIZE": str(world)},
                              stdout=subprocess.PIPE, text=True) for r in range(world)]
    results = [json.loads(p.communicate(timeout=180)[0]) for p in procs]
    for variant, drop_last in ((0, False), (1, True)):
        outs = [res[variant] for res in results]
        assert sorted(o[0] for o in outs) == list(range(world))
        assert {o[1] for o in outs} == {world}
        counts = Counter(i for o in outs for i in o[2])
        per = FILES // world if drop_last else -(-FILES // world)
        assert all(len(o[2]) == per for o in outs)
        if drop_last:
            assert max(counts.values()) == 1 and len(counts) == per * world
        else:
            assert set(counts) == set(range(FILES))
            assert sum(counts.values()) - FILES == per * world - FILES


def test_rank_from_torch_distributed(tree: tuple[Path, Path]) -> None:
    """With torch.distributed initialised (gloo over loopback), rank and world come from it
    and locality gathers every rank's holdings."""
    script = """
import json, os, sys
import torch.distributed as dist
from stagefs.torch import FileDataset, Sampler
dist.init_process_group("gloo", rank=int(sys.argv[2]), world_size=2,
                        init_method="tcp://127.0.0.1:" + sys.argv[3])
ds = FileDataset(sys.argv[1])
held = set(range(dist.get_rank(), len(ds.store.manifest.shards), 2))
ds.store.held_shards = lambda: held
s = Sampler(ds, seed=2, locality=True)
print(json.dumps([s.rank, s.world_size, list(s), s.local_fraction]))
dist.destroy_process_group()
"""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    procs = [subprocess.Popen([sys.executable, "-c", script, str(tree[1]), str(r), str(port)],
                              env=env, stdout=subprocess.PIPE, text=True) for r in range(2)]
    outs = [json.loads(p.communicate(timeout=120)[0]) for p in procs]
    assert [o[:2] for o in outs] == [[0, 2], [1, 2]]
    counts = Counter(i for o in outs for i in o[2])
    assert set(counts) == set(range(FILES)) and sum(counts.values()) == FILES + 1  # 1 pad
    assert all(o[3] > 0.8 for o in outs)  # shards alternate; sizes differ a little


# -- resume --------------------------------------------------------------------------------

def ranks(ds: FileDataset, world: int, **kw: Any) -> list[Sampler]:
    return [Sampler(ds, rank=r, world_size=world, **kw) for r in range(world)]


@pytest.mark.parametrize(("world", "world2", "locality"),
                         [(2, 2, False), (4, 3, False), (3, 1, False), (2, 3, True)])
def test_resume_mid_epoch(tree: tuple[Path, Path], world: int, world2: int,
                          locality: bool) -> None:
    ds = FileDataset(tree[1])
    shards = len(ds.store.manifest.shards)
    held = [list(range(r, shards, world)) for r in range(world)] if locality else None
    held2 = [list(range(r, shards, world2)) for r in range(world2)] if locality else None
    rng = np.random.default_rng(world * 10 + world2)
    for epoch in (0, 3):
        full = ranks(ds, world, seed=5, locality=locality, held_by=held)
        for s in full:
            s.set_epoch(epoch)
        whole = [list(s) for s in full]
        batch = 4
        steps = int(rng.integers(0, len(whole[0]) // batch + 1))
        its = [iter(s) for s in full]
        seen = [[next(it) for _ in range(steps * batch)] for it in its]
        assert [w[: steps * batch] for w in whole] == seen
        state = full[0].state_dict(consumed=steps * batch * world)
        state = json.loads(json.dumps(state))  # a state survives a checkpoint as JSON
        again = ranks(ds, world2, seed=5, locality=locality, held_by=held2)
        for s in again:
            s.load_state_dict(state)
        rest = [list(s) for s in again]
        if world2 == world:  # the same sequence as the uninterrupted run
            assert rest == [w[steps * batch :] for w in whole]
        counts = Counter(i for part in seen + rest for i in part)
        assert set(counts) == set(range(FILES))
        assert sum(counts.values()) - FILES < world + world2
        # after the resumed epoch, the sampler starts the next one from its beginning
        again[0].set_epoch(epoch + 1)
        assert len(again[0]) == -(-FILES // world2)


def test_state_dict_without_consumed_counts_yielded(tree: tuple[Path, Path]) -> None:
    ds = FileDataset(tree[1])
    s = Sampler(ds, rank=0, world_size=1, seed=9)
    it = iter(s)
    first = [next(it) for _ in range(50)]
    t = Sampler(ds, rank=0, world_size=1, seed=9)
    t.load_state_dict(s.state_dict())
    assert first + list(t) == list(Sampler(ds, rank=0, world_size=1, seed=9))
    with pytest.raises(ConfigError, match="seed"):
        Sampler(ds, rank=0, world_size=1, seed=10).load_state_dict(s.state_dict())
    # a negative count, or a state edited by hand, is refused (the resumed epoch held
    # 5 samples of hundreds)
    with pytest.raises(ValueError, match="negative"):
        s.state_dict(consumed=-5)
    bad = s.state_dict()
    bad["segments"][-1][1] = -5
    with pytest.raises(ConfigError, match="damaged"):
        t.load_state_dict(bad)


def test_resume_with_other_worker_count(tree: tuple[Path, Path]) -> None:
    """Interrupted under 2 spawn workers, resumed under 0: every remaining sample once."""
    ds = FileDataset(tree[1], transform=len, target=None)
    s = Sampler(ds, seed=4, rank=0, world_size=1)
    loader = torch.utils.data.DataLoader(ds, batch_size=10, sampler=s, num_workers=2,
                                         multiprocessing_context="spawn", timeout=120)
    got: list[int] = []
    for b, batch in enumerate(loader):
        got += batch.tolist()
        if b == 6:
            state = s.state_dict(consumed=(b + 1) * 10)
            break
    s2 = Sampler(ds, seed=4, rank=0, world_size=1)
    s2.load_state_dict(state)
    rest = [x for batch in torch.utils.data.DataLoader(ds, batch_size=10, sampler=s2)
            for x in batch.tolist()]
    assert got + rest == ds.sizes()[Sampler(ds, seed=4, rank=0, world_size=1).order()].tolist()


# -- locality on a real store ----------------------------------------------------------------

def test_locality_on_a_real_store(tree: tuple[Path, Path]) -> None:
    ds = FileDataset(tree[1])
    shards = len(ds.store.manifest.shards)
    assert shards >= 4
    held = [list(range(r, shards, 2)) for r in range(2)]
    samplers = ranks(ds, 2, seed=1, locality=True, held_by=held)
    assert min(samplers[0].local_fractions) > 0.8
    plain = ranks(ds, 2, seed=1)
    shard_of = ds.shard_of()
    plain_local = np.isin(shard_of[list(plain[0])], held[0]).mean()
    assert plain_local < 0.7
    counts = Counter(i for s in samplers for i in s)
    assert set(counts) == set(range(FILES)) and sum(counts.values()) == FILES + 1  # 1 pad
    with pytest.raises(ConfigError, match=r"torch\.distributed"):
        list(Sampler(ds, rank=0, world_size=2, locality=True))
    with pytest.raises(ConfigError, match="only with locality"):
        _ = plain[0].local_fraction


def test_locality_and_prefetch_with_real_tiers(tree: tuple[Path, Path], tmp_path: Path) -> None:
    """A store with a real tier: locality follows held_shards(); prefetching stages the
    shards through Store.prefetch and the reads still return the file bytes."""
    raw, pack = tree
    store = stagefs.open(pack, tiers=[f"{tmp_path}/tier:64MiB"], runtime=tmp_path / "rt")
    if store.chain is None:
        pytest.skip("this Store has no tiers")
    shards = len(store.manifest.shards)
    store.chain.stage(range(0, shards, 2))
    held = store.held_shards()
    assert held == set(range(0, shards, 2))
    ds = FileDataset(store)
    s = Sampler(ds, seed=1, locality=True)
    assert s.local_fraction == pytest.approx(np.isin(ds.shard_of(), list(held)).mean())
    # prefetching: the sampler hands the tiers every shard in order of first use, as soon
    # as it knows the order (here: when it is made)
    asked: list[list[int]] = []
    real_prefetch = store.prefetch
    store.prefetch = lambda shards: (asked.append(list(shards)), real_prefetch(asked[-1]))[1]
    p = Sampler(ds, seed=1, prefetch="1MiB", rank=0, world_size=1)
    assert p.tier_ahead is not None  # reading ahead before the loop asks
    p.set_epoch(0)  # the same epoch start: the read-ahead goes on
    _, samples = raw_listing(raw)
    got = loader_bytes(ds, p, num_workers=0)
    assert got == [(raw / samples[i][0]).read_bytes() for i in p.order()]
    assert store.chain.wait_idle(60)
    assert store.held_shards() == set(range(shards))
    shard_of = ds.shard_of()
    want = list(dict.fromkeys(shard_of[np.r_[p.order(), p.next_order()]].tolist()))
    assert asked == [want]  # once per epoch, in order of first use
    assert p.prefetcher is not None and p.prefetcher.stats.peak_bytes <= 2**20
    p.close()
    store.close()


# -- data stall ------------------------------------------------------------------------------

class Clock:
    """Seconds that pass only when the test says so."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def batches_after(clock: Clock, n: int, wait: float) -> Iterator[int]:
    """``n`` batches, each ``wait`` seconds after it is asked for."""
    for i in range(n):
        clock.now += wait
        yield i


def test_stall_meter(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STAGEFS_RUNTIME", str(tmp_path))
    clock = Clock()
    meter = StallMeter(batches_after(clock, 5, 0.0), clock=clock)
    for _ in meter:
        clock.now += 0.02  # a step
    fast = meter.last
    assert fast is not None and fast.steps == 5 and fast.stall == 0.0
    assert fast.step_s == pytest.approx(0.1)
    meter.loader = batches_after(clock, 5, 0.03)
    for _ in meter:
        clock.now += 0.01
    slow = meter.last
    assert slow is not None and slow.epoch == 1
    assert slow.stall == pytest.approx(0.75)  # waits 0.03 s for every 0.01 s step
    assert slow.first_wait_s == pytest.approx(0.03)
    assert slow.steady_stall == pytest.approx(0.12 / 0.17)
    doc = json.loads((tmp_path / f"stall-{os.getpid()}.json").read_text())
    assert [e["steps"] for e in doc["epochs"]] == [5, 5]
    assert doc["epochs"][1]["stall"] == pytest.approx(slow.stall)
    assert f"{slow.stall:.1%}" in meter.report()


def test_stall_meter_records_the_samplers_epoch_of_a_resumed_run(
        tree: tuple[Path, Path]) -> None:
    """A run resumed from a checkpoint records its epochs by the sampler's number, not the
    meter's passes (a job resumed in epoch 4 said epoch 0 in ``stagefs status``); a resumed
    epoch that had ended is a pass without a batch, and stalls nothing (it said 100%)."""
    ds = FileDataset(tree[1], target=None)
    s = Sampler(ds, seed=0)
    s.set_epoch(4)
    list(s)
    state = s.state_dict()  # epoch 4 done
    clock = Clock()
    resumed = Sampler(ds, seed=0)
    resumed.load_state_dict(state)
    loader = torch.utils.data.DataLoader(ds, batch_size=50, sampler=resumed,
                                         collate_fn=lambda b: b)
    meter = StallMeter(loader, write=False, clock=clock)
    for epoch in range(state["epoch"], 6):
        resumed.set_epoch(epoch)
        clock.now += 0.5  # set-up between epochs
        for _ in meter:
            clock.now += 0.01
    assert [(e.epoch, e.steps > 0) for e in meter.epochs] == [(4, False), (5, True)]
    assert meter.epochs[0].stall == 0.0 and meter.epochs[0].steady_stall == 0.0
    # a loader without a sampler's epoch: the passes are counted
    plain = StallMeter([1, 2], write=False, clock=clock)
    for _ in range(2):
        for _ in plain:
            clock.now += 0.01
    assert [e.epoch for e in plain.epochs] == [0, 1]


def test_stall_meter_left_early_still_records() -> None:
    meter = StallMeter(range(100), write=False)
    for i in meter:
        if i == 3:
            break
    assert meter.last is not None and meter.last.steps == 4
