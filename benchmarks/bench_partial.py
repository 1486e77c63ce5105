"""Partial caching on the test PFS: epochs 2 and 3 with tiers holding 100%, 50% and 25% of
the dataset read D - C from the origin, and the held set stays put.

The dataset (D: the bytes of its stored files) is a pack on the PFS; the tiers are a RAM tier
smaller than one shard (/dev/shm) and a disk tier (/var/tmp) holding the rest of the
capacity C. Every configuration reads three epochs, each in its own random order, with
``Store.read_many`` (64 samples a call), the page cache dropped before each epoch (the RAM
tier is tmpfs: it stays; the disk tier is read from the disk). Per epoch:
time, origin bytes against D - C, the bytes each tier holds, and whether the pieces held
after epoch 2 are the ones held after epoch 3 (no thrash). Configurations alternate within a
run; medians over ``--runs``. With ``--rate-mbit`` the PFS link is capped for the run
(tc on the testbed's veth, as bench_tiers.py does).

    python3 benchmarks/bench_partial.py --pack /tmp/pfs/s21pack --runs 3
    python3 benchmarks/bench_partial.py --pack /tmp/pfs/s21pack --runs 3 --rate-mbit 800

``--mixed DIR`` makes and uses another dataset instead (docs/benchmarks.md, "Other data"):
3,000 files of 1-20 KB and 12 of 3-9 MiB (the large files more than two thirds of D), packed
in shards of 24 MiB under DIR, where large files decide how full a tier gets:

    python3 benchmarks/bench_partial.py --mixed /tmp/pfs/mixed --shares 0.25 0.5 0.8 0.9
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import statistics
import sys
import time
from typing import Any

import stagefs
from stagefs._table import table
from stagefs.bench.runner import drop_caches
from stagefs.config import format_size

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_tiers import rate_cap  # the testbed's tc cap, one copy

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
BATCH = 64
RAM_SHARE = 0.05  # of the dataset, in the RAM tier (below one shard of this pack)


def data_bytes(fs: stagefs.Store) -> int:
    m = fs.manifest
    return int(sum(int(m.stored[e]) for e in range(len(m)) if m.kind[e] == 0 and m.stored[e]))


def one_config(pack: str, paths: list[str], share: float, d: int, base: str,
               epochs: int, run: int, afresh: bool = False) -> list[dict[str, Any]]:
    ram_dir, disk_dir = f"/dev/shm/stagefs-bench-partial/{base}", f"/var/tmp/stagefs-bench-partial/{base}"
    runtime = f"/dev/shm/stagefs-bench-partial/rt-{base}"
    for p in (ram_dir, disk_dir, runtime):
        shutil.rmtree(p, ignore_errors=True)
        os.makedirs(os.path.dirname(p), exist_ok=True)
    cap = int(d * share)
    ram = int(d * RAM_SHARE)
    tiers = [f"{ram_dir}:{ram}", f"{disk_dir}:{cap - ram}"]
    drop_caches()
    rows = []
    held_before: dict[str, set[tuple[int, int]]] | None = None
    try:
        with stagefs.open(pack, tiers=tiers, runtime=runtime) as fs:
            chain = fs.chain
            assert chain is not None
            for e in range(epochs):
                order = list(paths)
                random.Random(run * 100 + e).shuffle(order)
                drop_caches()  # the origin's bytes from the PFS, not from this page cache
                o0 = fs.origin.stats.bytes_read
                t0 = time.perf_counter()
                for i in range(0, len(order), BATCH):
                    if afresh:  # as before the store carried "the last batch waited" over
                        fs._remote_waits = False
                    fs.read_many(order[i:i + BATCH])
                read_s = time.perf_counter() - t0
                chain.wait_idle(600)
                held = chain.held_pieces()
                rows.append({
                    "epoch": e + 1, "time": read_s,
                    "origin_bytes": int(fs.origin.stats.bytes_read - o0),
                    "d_minus_c": d - cap if share < 1 else 0,
                    "ram_used": chain.tiers[0].used_bytes(),
                    "disk_used": chain.tiers[1].used_bytes(),
                    "same_held": None if held_before is None or e < 2 else held == held_before,
                })
                held_before = held
    finally:
        for p in (ram_dir, disk_dir, runtime):
            shutil.rmtree(p, ignore_errors=True)
        for p in (ram_dir, disk_dir):
            with contextlib.suppress(OSError):  # the parent too, once empty
                os.rmdir(os.path.dirname(p))
    return rows


def make_mixed(root: str) -> str:
    """The mixed dataset under ``root`` (made once; the same bytes every time): its pack."""
    pack = os.path.join(root, "pack")
    if os.path.exists(os.path.join(pack, "manifest.sfm")):
        return pack
    rng = random.Random(18)
    raw = os.path.join(root, "raw")
    for i in range(3000):
        d = os.path.join(raw, f"small/{i % 5}")
        os.makedirs(d, exist_ok=True)
        with open(os.path.join(d, f"s{i:05d}.bin"), "wb") as f:
            f.write(rng.randbytes(rng.randint(1024, 20 * 1024)))
    for i in range(12):
        d = os.path.join(raw, f"big/g{i % 3}")
        os.makedirs(d, exist_ok=True)
        with open(os.path.join(d, f"big{i}.npy"), "wb") as f:
            f.write(rng.randbytes(rng.randint(3 * 2**20, 9 * 2**20)))
    stagefs.pack(raw, pack, shard_size="24MiB", progress=False, echo=lambda _m: None)
    return pack


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pack", default="/tmp/pfs/s21pack")
    ap.add_argument("--shares", type=float, nargs="+", default=[1.0, 0.5, 0.25])
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--rate-mbit", type=int, default=None)
    ap.add_argument("--out", default=os.path.join(RESULTS, "partial.json"))
    ap.add_argument("--mixed", metavar="DIR",
                    help="make (once) and use the dataset of small and large files under DIR")
    ap.add_argument("--afresh", action="store_true",
                    help="judge every read_many batch afresh, as the store did before it "
                         "carried over whether the last batch's origin reads waited")
    a = ap.parse_args(argv)
    if a.mixed:
        a.pack = make_mixed(a.mixed)
    with stagefs.open(a.pack) as fs:
        paths = sorted(os.path.join(dp, f) for dp, _, names in fs.walk() for f in names)
        d = data_bytes(fs)
        shard = max(s.size for s in fs.manifest.shards)
    print(f"{len(paths):,} files, D = {format_size(d)}, largest shard {format_size(shard)}, "
          f"RAM tier {format_size(int(d * RAM_SHARE))}; load {os.getloadavg()}", flush=True)
    per: dict[float, list[list[dict[str, Any]]]] = {s: [] for s in a.shares}
    cap_ctx = rate_cap(f"{a.rate_mbit}mbit") if a.rate_mbit else contextlib.nullcontext()
    with cap_ctx:
        for run in range(a.runs):
            for share in a.shares:
                rows = one_config(a.pack, paths, share, d, f"s{int(share * 100)}", a.epochs, run,
                                  a.afresh)
                per[share].append(rows)
                print(f"  run {run + 1}, C = {share:.0%}: " + ", ".join(
                    f"{r['time']:.2f}s {format_size(r['origin_bytes'])}" for r in rows),
                    flush=True)
    full = {e: statistics.median(r[e]["time"] for r in per[1.0]) for e in range(a.epochs)} \
        if 1.0 in per else {}
    out_rows, summary = [], []
    for share, runs in per.items():
        for e in range(a.epochs):
            t = statistics.median(r[e]["time"] for r in runs)
            ob = statistics.median(r[e]["origin_bytes"] for r in runs)
            target = runs[0][e]["d_minus_c"]
            ratio = ob / target if target and e else None
            same = [r[e]["same_held"] for r in runs if r[e]["same_held"] is not None]
            row = {"share": share, "epoch": e + 1, "time": t, "origin_bytes": ob,
                   "d_minus_c": target, "origin_over_d_minus_c": ratio,
                   "time_over_full": t / full[e] if full else None,
                   "samples_per_s": len(paths) / t,
                   "ram_used": statistics.median(r[e]["ram_used"] for r in runs),
                   "disk_used": statistics.median(r[e]["disk_used"] for r in runs),
                   "same_held": all(same) if same else None}
            summary.append(row)
            out_rows.append([f"{share:.0%}", e + 1, f"{t:.2f}", f"{len(paths) / t:,.0f}",
                             format_size(int(ob)), format_size(target) if e else "-",
                             f"{ratio:.3f}" if ratio is not None else "-",
                             f"{t / full[e]:.2f}" if full else "-",
                             format_size(int(row["ram_used"])),
                             "-" if row["same_held"] is None else
                             ("yes" if row["same_held"] else "no")])
    print(table(["C / D", "epoch", "s", "samples/s", "origin bytes", "D - C",
                 "origin / (D - C)", "time / full C", "RAM tier holds", "held set kept"],
                out_rows))
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump({"command": "python3 benchmarks/bench_partial.py " + " ".join(
            argv if argv is not None else sys.argv[1:]),
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "files": len(paths),
            "d": d, "rate_mbit": a.rate_mbit, "runs": a.runs, "afresh": a.afresh,
            "load": os.getloadavg(),
            "summary": summary, "all": {str(k): v for k, v in per.items()}}, f, indent=1)
    print(f"saved {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
