"""stagefs.torch over the cluster client (``FileDataset(stagefs.connect())``): two daemons
on loopback, a training process per "node" with torch.distributed (gloo), the dataset's
bytes checked against the origin's. Assertions are on bytes, samples and counters."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
from cluster_helpers import (
    free_ports,
    make_pack,
    serve_args,
    start,
    status_json,
    stop,
    tail,
    wait_staged,
)

pytest.importorskip("torch", reason="PyTorch is not installed (pip install torch)")

pytestmark = pytest.mark.integration
NODES = 2

# One training process on node RANK: FileDataset over stagefs.connect(), Sampler with
# locality (holdings gathered through torch.distributed), a DataLoader. Rank 0 alone logs
# len(loader), local_fraction and a state_dict before each epoch, as training scripts do.
TRAIN = r"""
import datetime, json, sys
import torch.distributed as dist
from torch.utils.data import DataLoader
from xxhash import xxh3_64_hexdigest
import stagefs
from stagefs.torch import FileDataset, Sampler

def collate(batch):
    return batch

def main():
    work, rank, world, port, workers = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], int(sys.argv[5])
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            init_method="tcp://127.0.0.1:" + port,
                            timeout=datetime.timedelta(seconds=60))
    expected = json.load(open(f"{work}/expected.json"))
    ds = FileDataset(stagefs.connect(f"{work}/rt{rank}"), root="train", target="path")
    sampler = Sampler(ds, seed=3, locality=True)
    loader = DataLoader(ds, batch_size=4, sampler=sampler, collate_fn=collate,
                        num_workers=workers, persistent_workers=workers > 0)
    epochs, logged = [], []
    for epoch in range(2):
        if rank == 0:  # this rank alone: no collective call may hide in these
            logged.append([len(loader), sampler.local_fraction,
                           sampler.state_dict()["epoch"]])
        sampler.set_epoch(epoch)
        paths, bad, nbytes = [], 0, 0
        for batch in loader:
            for data, path in batch:
                paths.append(path)
                nbytes += len(data)
                bad += xxh3_64_hexdigest(data) != expected[path]
        epochs.append({"paths": paths, "bad": bad, "bytes": nbytes})
    json.dump({"epochs": epochs, "logged": logged}, open(f"{work}/train{rank}.json", "w"))
    dist.destroy_process_group()

if __name__ == "__main__":
    main()
"""




@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, dict[str, bytes]]]:
    """Two daemons (static bootstrap, two replicas), staged; yields (work dir, content)."""
    from xxhash import xxh3_64_hexdigest

    work = str(tmp_path_factory.mktemp("torchcluster"))
    pack, content = make_pack(work, files=80, shard_size="64KiB")
    with open(os.path.join(work, "expected.json"), "w") as f:
        json.dump({p: xxh3_64_hexdigest(d) for p, d in content.items()}, f)
    with open(os.path.join(work, "hosts"), "w") as f:
        f.write("".join(f"127.0.0.1:{p}\n" for p in free_ports(NODES)))
    subprocess.run([sys.executable, "-m", "stagefs.cli", "serve", "--new-token",
                    os.path.join(work, "token")], check=True, timeout=60, capture_output=True)
    daemons = [start(serve_args(work, pack, "--hosts", os.path.join(work, "hosts"), "--rank",
                                str(r), "--token-file", os.path.join(work, "token"),
                                "--replicas", "1", "--wait"),
                     os.path.join(work, f"daemon{r}.log")) for r in range(NODES)]
    try:
        for r, d in enumerate(daemons):
            wait_staged(work, NODES, d, log=os.path.join(work, f"daemon{r}.log"))
        yield work, content
    finally:
        for d in daemons:
            stop(d)


def _train(work: str, workers: int) -> list[dict[str, Any]]:
    port = free_ports(1)[0]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    procs = [subprocess.Popen([sys.executable, "-c", TRAIN, work, str(r), str(NODES), str(port),
                               str(workers)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for r in range(NODES)]
    outs = [p.communicate(timeout=180)[0] for p in procs]
    for r, (p, out) in enumerate(zip(procs, outs, strict=True)):
        assert p.returncode == 0, f"rank {r}:\n{out[-3000:]}\n{tail(work + '/daemon0.log')}"
    results = []
    for r in range(NODES):
        with open(os.path.join(work, f"train{r}.json")) as f:
            results.append(json.load(f))
    return results


@pytest.mark.parametrize("workers", [0, 2])
def test_locality_sampler_over_the_cluster_client(
        cluster: tuple[str, dict[str, bytes]], workers: int) -> None:
    """Every rank finishes both epochs with the right bytes, every sample read once an
    epoch across the ranks, though rank 0 alone asked len(), local_fraction and state_dict
    (each used to gather the holdings through torch.distributed: a collective call the
    other ranks never made, so rank 0 was left waiting); the node's counters saw what the
    ranks read."""
    work, content = cluster
    train = sorted(p for p in content if p.startswith("train/"))
    before = [status_json(work, r)["reads"] for r in range(NODES)]
    results = _train(work, workers)
    for epoch in range(2):
        counts = Counter(p for res in results for p in res["epochs"][epoch]["paths"])
        assert sorted(counts) == train and set(counts.values()) == {1}, counts
        assert all(res["epochs"][epoch]["bad"] == 0 for res in results)
    logged = results[0]["logged"]
    assert [entry[0] for entry in logged] == [len(train) // NODES // 4] * 2  # batches of 4
    assert all(0 < entry[1] <= 1 for entry in logged)
    for r in range(NODES):  # `stagefs status` on node r: what its training process read
        after = status_json(work, r)["reads"]
        epochs = results[r]["epochs"]
        assert after["reads"] - before[r]["reads"] == sum(len(e["paths"]) for e in epochs)
        assert after["bytes"] - before[r]["bytes"] == sum(e["bytes"] for e in epochs)
        assert after["holders"]["origin"]["reads"] == before[r]["holders"]["origin"]["reads"]


def test_a_closed_cluster_dataset_says_to_connect_again(
        cluster: tuple[str, dict[str, bytes]]) -> None:
    """A FileDataset whose cluster store was closed says to open it with stagefs.connect()
    (it said stagefs.open, the single-node call, which does not open a cluster's dataset)."""
    import stagefs
    from stagefs.torch import FileDataset

    work, _ = cluster
    fs = stagefs.connect(os.path.join(work, "rt0"))
    ds = FileDataset(fs)
    fs.close()
    for read in (lambda: ds[0], lambda: ds.__getitems__([0, 1]), ds.sizes):
        with pytest.raises(ValueError, match=r"closed Store .*stagefs\.connect\(\)"):
            read()


def test_cluster_status_shows_the_training_processes_stalls(
        cluster: tuple[str, dict[str, bytes]]) -> None:
    """StallMeter writes its records "for stagefs status" (docs/torch.md): on a cluster's
    runtime, status showed none of them."""
    from stagefs.torch import StallMeter

    work, _ = cluster
    rt = os.path.join(work, "rt0")
    ticks = iter(range(100))
    meter = StallMeter([1, 2, 3], runtime=rt, rank=0, clock=lambda: float(next(ticks)))
    assert list(meter) == [1, 2, 3]
    (rec,) = [r for r in status_json(work, 0)["stalls"] if r.get("pid") == os.getpid()]
    assert rec["rank"] == 0 and rec["steps"] == 3
    text = subprocess.run([sys.executable, "-m", "stagefs.cli", "status", "--runtime", rt],
                          capture_output=True, text=True, timeout=60).stdout
    assert "data stall" in text
    os.unlink(os.path.join(rt, f"stall-{os.getpid()}.json"))
