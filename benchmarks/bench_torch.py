"""Data stall of a training-like loop: plain files on the test PFS against stagefs without and
with clairvoyant prefetching.

The loop reads an ImageNet-like dataset through a DataLoader (batch 32) and sleeps a fixed
compute time per batch, standing in for the GPU step (as DLIO's computation_time). A
StallMeter measures, per epoch, the share of the time spent waiting for data (DS-Analyzer's
data stall). Configurations, on the same data with the same epoch orders, caches dropped
before each one:

- ``plain``: an ImageFolder-style dataset over the raw files on the PFS (open + read each);
- ``stagefs``: FileDataset over the pack on the PFS, tiers on /dev/shm (shards placed when
  first read), no prefetching;
- ``stagefs+prefetch``: the same with ``Sampler(prefetch=...)``: the tiers are handed every
  shard in order of first use (this epoch, then the next); from the moment the sampler is
  made until the loop starts, the epoch's first samples are read into the tiers; in the
  loop, without workers, the next samples' bytes are read ahead into memory within a byte
  budget (with workers, their batched reads do it);
- ``stagefs+prefetch+window``: the same with the locality-aware shuffle
  (``locality=True``): shards in a random order, samples shuffled within windows of
  ``--window`` shards, so the order of first use is spread over the epoch and staging the
  next window runs ahead of the reads;
- ``staged``: as ``stagefs+prefetch``, with every shard copied into the tier before the
  first epoch (``stagefs stage``): the least stall any prefetcher could reach, since the
  first epoch then reads nothing from the PFS;
- ``memory`` (only when asked for, ``--configs memory``): the same loop over as many empty
  in-memory items, no file read at all: the DataLoader's own cost per batch.

After dropping the page cache, each configuration first runs a DataLoader over a few
in-memory items (same workers): dropping the cache also evicts the pages of torch's own
libraries that this process has not run yet, and the first ``iter(loader)`` then read them
back from the local disk (64 ms in ``torch.empty().random_()``, against 1 ms warm). A job
has run torch long before its first batch.

``--setup S`` sleeps S seconds between making the loader and the first epoch, the same for
every configuration, standing for a model's set-up (0 by default: the loop starts at once).

Run as root (drop_caches) with the test PFS at /tmp/pfs::

    python3 benchmarks/bench_torch.py                       # the full run
    python3 benchmarks/bench_torch.py --files 500 --repeat 1   # a quick look
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.utils.data

import stagefs
from stagefs._table import table
from stagefs.bench.datasets import imagenet_like
from stagefs.bench.runner import drop_caches
from stagefs.torch import FileDataset, Sampler, StallMeter

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
CONFIGS = ["plain", "stagefs", "stagefs+prefetch", "stagefs+prefetch+window", "staged"]
EXTRA = ["memory"]


class PlainFolder(torch.utils.data.Dataset[tuple[bytes, int]]):
    """What ImageFolder does, minus decoding: list once with os.walk, open + read per item."""

    def __init__(self, root: str) -> None:
        self.classes = sorted(d.name for d in os.scandir(root) if d.is_dir())
        self.samples = [(os.path.join(dp, f), c) for c, name in enumerate(self.classes)
                        for dp, _, fs in sorted(os.walk(os.path.join(root, name)))
                        for f in sorted(fs)]

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> tuple[bytes, int]:
        path, target = self.samples[i]
        with open(path, "rb") as f:
            return f.read(), target


def collate(batch: list[Any]) -> int:
    return sum(len(x[0]) for x in batch)


class _Few(torch.utils.data.Dataset[tuple[bytes, int]]):
    def __init__(self, n: int = 64) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[bytes, int]:
        return b"", i


def warm_torch(workers: int) -> None:
    """Run a DataLoader like the measured one over a few in-memory items, so torch's code
    is in memory again after drop_caches (see the module's docstring)."""
    for _ in torch.utils.data.DataLoader(
            _Few(), batch_size=32, shuffle=True, num_workers=workers, collate_fn=collate,
            multiprocessing_context="fork" if workers else None):
        pass


def link_bytes() -> int:
    """Bytes the test PFS's link has carried to this host so far (0 if there is no such
    link): what every process on the node read from the PFS, metadata and read-ahead
    included."""
    try:
        with open("/sys/class/net/pfs-h/statistics/rx_bytes") as f:
            return int(f.read())
    except OSError:
        return 0


def pfs_cap() -> str:
    out = subprocess.run(["tc", "qdisc", "show", "dev", "pfs-h"], capture_output=True,
                         text=True, timeout=10, check=False).stdout
    return "none" if "tbf" not in out else out.split("rate")[1].split()[0]


def prepare(root: str, files: int) -> tuple[str, str]:
    raw, pack = os.path.join(root, "raw"), os.path.join(root, "pack")
    done = os.path.join(root, f"raw-{files}.done")
    if not os.path.exists(done):
        shutil.rmtree(root, ignore_errors=True)
        imagenet_like(raw, files=files)
        stagefs.pack(raw, pack, shard_size="16MiB", jobs=2, overwrite=True)
        with open(done, "w") as f:
            f.write(str(files))
    return raw, pack


def run(config: str, raw: str, pack: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Train ``args.epochs`` epochs with one configuration; each epoch's stall."""
    tier = f"/dev/shm/stagefs-bench-torch/{config}"
    shutil.rmtree(tier, ignore_errors=True)
    store = None
    if config == "staged":
        with stagefs.open(pack, tiers=[f"{tier}/t0:4GiB"], runtime=f"{tier}/rt") as s:
            assert s.chain is not None
            s.chain.stage()
    drop_caches()
    warm_torch(args.workers)
    if config in ("plain", "memory"):
        ds: Any = PlainFolder(os.path.join(raw, "train"))
        if config == "memory":
            ds = _Few(len(ds))
        sampler = Sampler(ds, seed=0, rank=0, world_size=1)
    else:
        store = stagefs.open(pack, tiers=[f"{tier}/t0:4GiB"], runtime=f"{tier}/rt")
        ds = FileDataset(store)
        sampler = Sampler(ds, seed=0, rank=0, world_size=1,
                          prefetch=args.budget if config != "stagefs" else None,
                          prefetch_threads=args.threads,
                          locality="window" in config, window=args.window)
    loader = StallMeter(torch.utils.data.DataLoader(
        ds, batch_size=args.batch, sampler=sampler, num_workers=args.workers,
        collate_fn=collate, persistent_workers=args.workers > 0,
        multiprocessing_context="fork" if args.workers else None), write=False)
    rows = []
    time.sleep(args.setup)  # the model's set-up: the sampler knows epoch 1's order already
    try:
        for epoch in range(args.epochs):
            sampler.set_epoch(epoch)
            held = len(store.held_shards()) / len(store.manifest.shards) if store else 0.0
            nbytes = 0
            wire = link_bytes()
            for nb in loader:
                nbytes += nb
                time.sleep(args.compute)
            e = loader.last
            assert e is not None
            rows.append({"epoch": epoch + 1, "stall": e.stall, "wait_s": e.wait_s,
                         "step_s": e.step_s, "steady_stall": e.steady_stall,
                         "held_before": held, "bytes": nbytes,
                         "link_bytes": link_bytes() - wire})
    finally:
        sampler.close()
        del loader
        if store is not None:
            store.close()
        shutil.rmtree(tier, ignore_errors=True)
        with contextlib.suppress(OSError):
            os.rmdir(os.path.dirname(tier))  # the parent too, once it is empty
    return rows


def median_rows(runs: Sequence[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    return [{k: statistics.median(r[i][k] for r in runs) for k in runs[0][i]}
            for i in range(len(runs[0]))]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--root", default="/tmp/pfs/torch-bench")
    ap.add_argument("--files", type=int, default=3000)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--compute", type=float, default=0.04, help="seconds per batch")
    ap.add_argument("--setup", type=float, default=0.0,
                    help="seconds between making the loader and the first epoch, standing for "
                         "the model's set-up (the same for every configuration)")
    ap.add_argument("--workers", type=int, nargs="+", default=[0, 2])
    ap.add_argument("--budget", default="256MiB", help="read-ahead budget (prefetch)")
    ap.add_argument("--window", type=int, default=4, help="shards per shuffle window")
    ap.add_argument("--threads", type=int, default=4,
                    help="read-ahead threads (Sampler prefetch_threads)")
    ap.add_argument("--configs", nargs="+", default=CONFIGS, choices=CONFIGS + EXTRA)
    ap.add_argument("--out", default=os.path.join(RESULTS, "torch.json"))
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--keep", action="store_true", help="keep the dataset on the PFS")
    args = ap.parse_args(argv)
    if not os.path.ismount("/tmp/pfs") and args.root.startswith("/tmp/pfs"):
        print("the test PFS is not mounted at /tmp/pfs", file=sys.stderr)
        return 2
    raw, pack = prepare(args.root, args.files)
    configs = args.configs
    caps = {pfs_cap()}
    results: dict[str, Any] = {}
    for workers in args.workers:
        runs: dict[str, list[list[dict[str, Any]]]] = {c: [] for c in configs}
        for rep in range(args.repeat):
            for c in configs:  # interleaved, so drift on the shared machine hits all alike
                a = argparse.Namespace(**{**vars(args), "workers": workers})
                runs[c].append(run(c, raw, pack, a))
                caps.add(pfs_cap())
                print(f"workers={workers} run {rep + 1} {c}: "
                      + ", ".join(f"{r['stall']:.1%}" for r in runs[c][-1]), flush=True)
        results[f"workers={workers}"] = {c: {"median": median_rows(runs[c]), "runs": runs[c]}
                                         for c in configs}
    rows = []
    for key, by_config in results.items():
        for c in configs:
            for r in by_config[c]["median"]:
                rows.append([key, c, r["epoch"], f"{r['stall']:.1%}", f"{r['steady_stall']:.1%}",
                             f"{r['wait_s']:.2f}", f"{r['step_s']:.2f}",
                             f"{r['held_before']:.0%}", f"{r['link_bytes'] / 1e6:.0f}"])
    print()
    print(table(["loader", "config", "epoch", "stall", "after 1st batch", "wait s", "step s",
                 "tier held before", "MB over the PFS link"], rows))
    for key, by_config in results.items():
        print(f"{key}: first-epoch stall, " + ", ".join(
            f"{c} {by_config[c]['median'][0]['stall']:.1%}" for c in configs))
    doc = {"command": "python3 benchmarks/bench_torch.py " + " ".join(argv or sys.argv[1:]),
           "files": args.files, "batch": args.batch, "compute_s": args.compute,
           "setup_s": args.setup,
           "threads": args.threads, "window": args.window,
           "epochs": args.epochs, "repeat": args.repeat, "budget": args.budget,
           "pfs_rate_cap_seen": sorted(caps), "torch": torch.__version__,
           "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "results": results}
    os.makedirs(RESULTS, exist_ok=True)
    out = args.out
    with open(out, "w") as f:
        json.dump(doc, f, indent=1)
    print(f"saved {out}")
    if not args.keep:
        shutil.rmtree(args.root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
