"""Node-local tiers against plain files on the test PFS: three epochs in random order each.

Configurations (the same data, the same epoch orders, caches dropped before each one):

- plain files on the PFS (open + read of every file);
- stagefs on a pack on the PFS, tiers on /dev/shm and local disk;
- stagefs in place on the raw tree on the PFS, same tiers;
- both again with the tiers capped at half the dataset.

Per epoch: time and its ratio against plain files, origin metadata operations (opens +
stats), origin bytes, tier hit rate (and the fraction of shards held when the epoch began).
Epoch 1 of a stagefs configuration is timed until its reads are done and, separately, until
the background placement has finished. A reference epoch reads the same shards from a copy
of the pack on local disk (page cache warm), right after each of epochs 2 and 3 in the same
order: the local limit for those epochs, measured under the same machine load.

Run as root on a machine with the test PFS mounted at /tmp/pfs (needs the cap and
drop_caches)::

    python3 benchmarks/bench_tiers.py            # the full run (about 10 minutes)
    python3 benchmarks/bench_tiers.py --files 2000 --no-cap --root /tmp/x   # a quick look
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import stagefs
from stagefs._table import table
from stagefs.bench.datasets import imagenet_like
from stagefs.bench.runner import drop_caches
from stagefs.config import format_size

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
CAP = "800mbit"


def sh(cmd: str, check: bool = True) -> None:
    subprocess.run(cmd, shell=True, check=check, timeout=120, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL)


@contextlib.contextmanager
def rate_cap(rate: str | None) -> Iterator[None]:
    """The PFS link capped at ``rate`` for the duration (both directions), then uncapped."""
    if rate is None:
        yield
        return
    spec = f"root tbf rate {rate} burst 256kbit latency 200ms"
    sh(f"tc qdisc replace dev pfs-h {spec}")
    sh(f"ip netns exec stagefs-pfs tc qdisc replace dev pfs-p {spec}")
    try:
        yield
    finally:
        sh("tc qdisc del dev pfs-h root", check=False)
        sh("ip netns exec stagefs-pfs tc qdisc del dev pfs-p root", check=False)


def prepare(root: str, files: int) -> tuple[str, str]:
    raw, pack = os.path.join(root, "raw"), os.path.join(root, "pack")
    done = os.path.join(root, "raw.done")
    if not os.path.exists(done):
        shutil.rmtree(raw, ignore_errors=True)
        imagenet_like(raw, files=files)
        with open(done, "w") as f:
            f.write(str(files))
    if not os.path.exists(os.path.join(pack, "manifest.sfm")):
        stagefs.pack(raw, pack, jobs=2, overwrite=True)
    return raw, pack


class Tiers:
    """Tier directories for one configuration: /dev/shm then local disk, cleaned after."""

    def __init__(self, name: str, total: int, fraction: float | None, disk_base: str) -> None:
        self.mem = f"/dev/shm/stagefs-bench-tiers/{name}"
        self.disk = os.path.join(disk_base, name)
        self.runtime = f"/dev/shm/stagefs-bench-rt/{name}"
        if fraction is None:  # fits: half in memory, the rest on disk
            self.specs = [f"{self.mem}:{total // 2}", self.disk]
        else:
            share = int(total * fraction / 2)
            self.specs = [f"{self.mem}:{share}", f"{self.disk}:{share}"]
        self.clean()
        for d in (self.mem, self.disk):  # a tier's parent must exist; the tier is created
            os.makedirs(os.path.dirname(d), exist_ok=True)

    def clean(self) -> None:
        for d in (self.mem, self.disk, self.runtime):
            shutil.rmtree(d, ignore_errors=True)
            with contextlib.suppress(OSError):
                os.rmdir(os.path.dirname(d))  # the parent too, once it is empty


def epoch_orders(paths: list[str], epochs: int) -> list[list[str]]:
    out = []
    for i in range(epochs):
        p = list(paths)
        random.Random(1000 + i).shuffle(p)
        out.append(p)
    return out


def run_plain(raw: str, orders: list[list[str]]) -> list[dict[str, Any]]:
    drop_caches()
    rows = []
    for order in orders:
        t0 = time.perf_counter()
        n = 0
        for p in order:
            with open(os.path.join(raw, p), "rb") as f:  # an open, an fstat, reads, a close
                n += len(f.read())
        dt = time.perf_counter() - t0
        rows.append({"time": dt, "read_time": dt, "meta_ops": 2 * len(order), "origin_bytes": n,
                     "hit_rate": 0.0, "held_before": 0.0})
    return rows


def run_stagefs(origin: str, tiers: Tiers, orders: list[list[str]],
                local: stagefs.Store | None = None) -> list[dict[str, Any]]:
    drop_caches()
    rows = []
    t_open = time.perf_counter()
    fs = stagefs.open(origin, tiers=tiers.specs, runtime=tiers.runtime)
    open_s = time.perf_counter() - t_open
    try:
        chain = fs.chain
        assert chain is not None
        nshards = len(fs.manifest.shards)
        sizes = [s.size for s in fs.manifest.shards]

        def held() -> float:  # the share of the dataset's bytes held in the tiers
            return sum(sizes[s] for s in fs.held_shards()) / sum(sizes)

        read = fs.read
        for i, order in enumerate(orders):
            held_before = held()
            o0 = fs.origin.stats.as_dict()
            h0 = sum(t.stats.hits for t in chain.tiers)
            m0 = chain.misses
            t0 = time.perf_counter()
            for p in order:
                read(p)
            read_s = time.perf_counter() - t0 + (open_s if i == 0 else 0.0)
            chain.wait_idle(timeout=600)  # the epoch is done when its placement is
            total_s = time.perf_counter() - t0 + (open_s if i == 0 else 0.0)
            o1 = fs.origin.stats.as_dict()
            hits = sum(t.stats.hits for t in chain.tiers) - h0
            misses = chain.misses - m0
            meta = (o1["opens"] - o0["opens"]) + (o1["stats"] - o0["stats"])
            if i == 0 and not os.path.exists(os.path.join(origin, "manifest.sfm")):
                pass  # in place: the scan's operations are in the origin's counters already
            elif i == 0:
                meta += 2  # the manifest: one open, one fstat (not in the origin's counters)
            local_s = None
            if local is not None and i > 0:  # the same order from local-disk shards, now
                for p in order:  # warm (caches were dropped before this configuration)
                    local.read(p)
                t1 = time.perf_counter()
                for p in order:
                    local.read(p)
                local_s = time.perf_counter() - t1
            rows.append({"time": total_s, "read_time": read_s, "meta_ops": meta,
                         "local_time": local_s,
                         "origin_bytes": o1["bytes_read"] - o0["bytes_read"],
                         "hit_rate": hits / (hits + misses) if hits + misses else 0.0,
                         "held_before": held_before, "shards": nshards,
                         "held_after": held()})
    finally:
        fs.close()
        tiers.clean()
    return rows


def open_local(pack: str, local: str, orders: list[list[str]]) -> stagefs.Store:
    """The same shards on local disk, read once so that the page cache is warm."""
    if not os.path.exists(os.path.join(local, "manifest.sfm")):
        shutil.copytree(pack, local)
    fs = stagefs.open(local)
    for p in orders[0]:
        fs.read(p)
    return fs


def median_rows(runs: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    out = []
    for i in range(len(runs[0])):
        cells = [r[i] for r in runs]
        out.append({k: (None if cells[0][k] is None else statistics.median(c[k] for c in cells))
                    for k in cells[0]})
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--root", default="/tmp/pfs/tiers-bench", help="where the dataset lives")
    ap.add_argument("--files", type=int, default=20000)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--repeat", type=int, default=1, help="runs per configuration (median)")
    ap.add_argument("--no-cap", action="store_true", help="do not apply the PFS rate cap")
    ap.add_argument("--disk", default="/var/tmp/stagefs-bench-tiers", help="local disk tiers")
    ap.add_argument("--out", default=os.path.join(RESULTS, "tiers.json"))
    args = ap.parse_args(argv)
    if os.geteuid() != 0 and not args.no_cap:
        print("needs root (rate cap, drop_caches); or pass --no-cap", file=sys.stderr)
        return 2

    raw, pack = prepare(args.root, args.files)
    with stagefs.open(pack) as fs:
        paths = sorted(os.path.join(d, f) for d, _, names in fs.walk() for f in names)
        total = fs.info()["shard_bytes"]
        nshards = len(fs.manifest.shards)
    orders = epoch_orders(paths, args.epochs)
    local = open_local(pack, os.path.join(args.disk, "local-pack"), orders)
    load0 = os.getloadavg()
    print(f"{len(paths):,} files, {format_size(total)} in {nshards} shards; load {load0}")

    configs: list[tuple[str, Callable[[], list[dict[str, Any]]]]] = [
        ("plain files", lambda: run_plain(raw, orders)),
        ("stagefs pack", lambda: run_stagefs(pack, Tiers("pack", total, None, args.disk),
                                             orders, local)),
        ("stagefs in place", lambda: run_stagefs(raw, Tiers("inplace", total, None, args.disk),
                                                 orders, local)),
        ("stagefs pack, tiers = 1/2", lambda: run_stagefs(
            pack, Tiers("pack-half", total, 0.5, args.disk), orders)),
        ("stagefs in place, tiers = 1/2", lambda: run_stagefs(
            raw, Tiers("inplace-half", total, 0.5, args.disk), orders)),
    ]
    results: dict[str, list[dict[str, Any]]] = {}
    t_start = time.time()
    with rate_cap(None if args.no_cap else CAP):
        for name, fn in configs:
            runs = []
            for _ in range(args.repeat):
                runs.append(fn())
                print(f"  {name}: " + ", ".join(f"{r['time']:.1f}s" for r in runs[-1]),
                      flush=True)
            results[name] = median_rows(runs)
    load1 = os.getloadavg()

    plain = results["plain files"]
    rows = []
    for name, eps in results.items():
        for i, r in enumerate(eps):
            ratio = plain[i]["time"] / r["time"]
            rows.append([name, i + 1, f"{r['time']:.1f}", f"{r['read_time']:.1f}",
                         f"x{ratio:.2f}", f"{round(r['meta_ops']):,}", format_size(r["origin_bytes"]),
                         f"{100 * r['hit_rate']:.0f}%", f"{100 * r['held_before']:.0f}%"])
    print()
    print(table(["configuration", "epoch", "s (placed)", "s (reads)", "vs plain",
                 "origin meta ops", "origin bytes", "hit rate", "held at start"], rows))
    local.close()
    targets = check_targets(results, nshards)
    lt = [r["local_time"] for n in ("stagefs pack", "stagefs in place") for r in results[n][1:]]
    print(f"\nlocal-disk shards, warm epochs right after each: {', '.join(f'{t:.2f}' for t in lt)} s")
    for k, v in targets.items():
        print(f"  {'MET ' if v['met'] else 'NOT MET'}  {k}: {v['detail']}")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"command": "python3 benchmarks/bench_tiers.py " + " ".join(argv or
                                                                              sys.argv[1:]),
                   "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t_start)),
                   "files": len(paths), "bytes": total, "shards": nshards,
                   "cap": None if args.no_cap else CAP, "repeat": args.repeat,
                   "load_before": load0, "load_after": load1,
                   "results": results, "targets": targets}, f, indent=1)
    print(f"saved {args.out}")
    return 0


def check_targets(results: dict[str, list[dict[str, Any]]], nshards: int
                  ) -> dict[str, dict[str, Any]]:
    plain = results["plain files"]
    out: dict[str, dict[str, Any]] = {}
    for name in ("stagefs pack", "stagefs in place"):
        eps = results[name]
        e1 = eps[0]
        out[f"{name}: epoch 1 no slower than plain"] = {
            "met": e1["time"] <= plain[0]["time"],
            "detail": f"{e1['time']:.1f} s (reads done {e1['read_time']:.1f} s) vs "
                      f"{plain[0]['time']:.1f} s"}
        later = eps[1:]
        speed = min(plain[i + 1]["time"] / r["time"] for i, r in enumerate(later))
        speed1 = min(plain[0]["time"] / r["time"] for r in later)
        out[f"{name}: epochs 2+ at least 10x plain"] = {
            "met": speed >= 10,
            "detail": f"x{speed:.1f} vs plain's same epoch, x{speed1:.1f} vs plain's epoch 1"}
        local = min(r["local_time"] / r["time"] for r in later)
        out[f"{name}: epochs 2+ within 80% of local disk"] = {
            "met": local >= 0.8, "detail": f"{100 * local:.0f}% of the local-disk speed"}
        meta = sum(r["meta_ops"] for r in eps)
        out[f"{name}: origin metadata ops <= shards + a few"] = {
            "met": meta <= nshards + 10, "detail": f"{round(meta):,} ops, {nshards} shards"}
        late = sum(r["origin_bytes"] for r in later)
        out[f"{name}: zero origin bytes after epoch 1"] = {
            "met": late == 0, "detail": f"{round(late):,} bytes"}
        half = results[f"{name}, tiers = 1/2"]
        gaps = [abs(r["hit_rate"] - r["held_before"]) for r in half[1:]]
        out[f"{name}, tiers = 1/2: hit rate within 5 points of held fraction"] = {
            "met": max(gaps) <= 0.05,
            "detail": ", ".join(f"{100 * r['hit_rate']:.0f}% hits / {100 * r['held_before']:.0f}%"
                                " held" for r in half[1:])}
    return out


if __name__ == "__main__":
    sys.exit(main())
