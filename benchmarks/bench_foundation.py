"""Foundation benchmark: stat rate, epoch reads (warm and cold), pack speed, manifest scale.

Every figure is measured side by side in one run on the same data, systems alternating, and
reported as the median of --runs. The physical limit of a verified local read is a raw
os.pread loop over the same shard bytes plus xxh3 of them (DESIGN.md, "What fast means").

    python benchmarks/bench_foundation.py --files 20000 --pfs /tmp/pfs --out benchmarks/results

Cold runs drop the page cache first (root only); on a VM the host may still cache.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

from xxhash import xxh3_64_intdigest

import stagefs
from stagefs._table import table
from stagefs.bench.datasets import imagenet_like
from stagefs.bench.runner import drop_caches


def median_time(fn: Callable[[], object], runs: int, before: Callable[[], object] | None = None
                ) -> float:
    times = []
    for _ in range(runs):
        if before:
            before()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def dataset(root: str, files: int) -> str:
    marker = os.path.join(root, ".complete")
    if not os.path.exists(marker):
        shutil.rmtree(root, ignore_errors=True)
        imagenet_like(root, files=files, classes=max(1, files // 200))
        open(marker, "w").close()
    return root


def packed(raw: str, dest: str) -> str:
    if not os.path.exists(os.path.join(dest, "manifest.sfm")):
        stagefs.pack(raw, dest, jobs=2, overwrite=True)
    return dest


def readers(raw: str, pack_dir: str, order: list[str]) -> dict[str, Callable[[], int]]:
    fs = stagefs.open(pack_dir)
    m = fs.manifest
    ents = [fs.namespace.file_entry(p) for p in order]
    spans = [(m.shard[e], m.offset[e], m.stored[e]) for e in ents]
    fds = [os.open(os.path.join(pack_dir, s.name), os.O_RDONLY) for s in m.shards]
    full = [os.path.join(raw, p) for p in order]

    def plain() -> int:
        n = 0
        for p in full:
            with open(p, "rb") as f:
                n += len(f.read())
        return n

    def pread_limit() -> int:
        return sum(len(os.pread(fds[s], n, o)) for s, o, n in spans)

    def pread_xxh3_limit() -> int:
        n = 0
        for s, o, k in spans:
            b = os.pread(fds[s], k, o)
            xxh3_64_intdigest(b)
            n += len(b)
        return n

    def read() -> int:
        return sum(len(fs.read(p)) for p in order)

    def read_many() -> int:
        return sum(len(b) for i in range(0, len(order), 64) for b in fs.read_many(order[i:i + 64]))

    return {"plain files": plain, "raw pread loop": pread_limit,
            "raw pread + xxh3 (limit)": pread_xxh3_limit, "stagefs read": read,
            "stagefs read_many(64)": read_many}


def bench_epochs(where: str, raw: str, pack_dir: str, runs: int, cold: bool) -> list[dict[str, Any]]:
    with stagefs.open(pack_dir) as fs:
        order = [os.path.join(d, f) for d, _, fl in fs.walk("train") for f in fl]
        total = sum(fs.getsize(p) for p in order)
    random.Random(1).shuffle(order)
    fns = readers(raw, pack_dir, order)
    if not cold:
        for fn in fns.values():
            fn()
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(runs):  # alternate systems within each round
        for name, fn in fns.items():
            if cold:
                drop_caches()
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    out = []
    limit = statistics.median(times["raw pread + xxh3 (limit)"])
    plain = statistics.median(times["plain files"])
    for name, ts in times.items():
        t = statistics.median(ts)
        out.append({"where": where, "cache": "cold" if cold else "warm", "reader": name,
                    "samples_per_s": len(order) / t, "MB_per_s": total / t / 1e6,
                    "vs_plain": plain / t, "vs_limit": limit / t, "runs": ts})
    return out


def bench_stat(raw_dirs: dict[str, str], pack_dir: str, runs: int) -> list[dict[str, Any]]:
    with stagefs.open(pack_dir) as fs:
        order = [os.path.join(d, f) for d, _, fl in fs.walk("train") for f in fl]
        random.Random(2).shuffle(order)
        st = fs.stat
        res = []
        t_api = median_time(lambda: [st(p) for p in order], runs)
        res.append({"system": "stagefs API (fs.stat)", "stats_per_s": len(order) / t_api})
        for where, raw in raw_dirs.items():
            full = [os.path.join(raw, p) for p in order]
            for p in full:
                os.stat(p)
            t = median_time(lambda full=full: [os.stat(p) for p in full], runs)
            res.append({"system": f"os.stat, {where}", "stats_per_s": len(order) / t})
    return res


def bench_pack(raw: str, scratch: str, runs: int) -> list[dict[str, Any]]:
    size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fl in os.walk(raw) for f in fl)
    out = []
    tar_dest = os.path.join(scratch, "t.tar")
    pack_dest = os.path.join(scratch, "p")

    def tar() -> None:
        subprocess.run(["tar", "cf", tar_dest, "-C", raw, "."], check=True)

    def pk(jobs: int) -> None:
        stagefs.pack(raw, pack_dest, jobs=jobs, overwrite=True, progress=False)

    systems = [("tar cf", tar), ("stagefs pack --jobs 1", lambda: pk(1)),
               ("stagefs pack --jobs 2", lambda: pk(2))]
    times: dict[str, list[float]] = {n: [] for n, _ in systems}
    for _ in range(runs):
        for name, fn in systems:
            t0 = time.perf_counter()
            fn()
            os.sync()
            times[name].append(time.perf_counter() - t0)
            shutil.rmtree(pack_dest, ignore_errors=True)
            if os.path.exists(tar_dest):
                os.unlink(tar_dest)
    tar_t = statistics.median(times["tar cf"])
    for name, ts in times.items():
        t = statistics.median(ts)
        out.append({"system": name, "seconds": t, "MB_per_s": size / t / 1e6,
                    "vs_tar": tar_t / t, "runs": ts})
    return out


_MANIFEST_CHILD = r"""
import os, sys, time, json
def private_kb():
    # anonymous memory: what this process allocated for itself. The manifest's mmap'd pages
    # are page cache, shared by every process that maps the file.
    with open('/proc/self/smaps_rollup') as f:
        d = {l.split(':')[0]: int(l.split()[1]) for l in f if l.split()[0].endswith(':') and len(l.split()) >= 2}
    return d.get('Anonymous', 0)
import stagefs, numpy, xxhash
from stagefs.format import Manifest
path = sys.argv[1]
before = private_kb()
t0 = time.perf_counter()
m = Manifest(path)
t_open = time.perf_counter() - t0
from stagefs.namespace import Namespace
ns = Namespace(m)
ns.stat('train/n00000017/img_0000017.JPEG')
after = private_kb()
print(json.dumps({'open_s': t_open, 'private_bytes_per_entry': (after - before) * 1024 / len(m), 'entries': len(m)}))
"""


def bench_manifest(scratch: str, n: int, runs: int) -> dict[str, Any]:
    from stagefs.format import KIND_DIR, KIND_FILE, ManifestBuilder
    from stagefs.format.manifest import Entry, ShardInfo

    path = os.path.join(scratch, "big.sfm")
    t0 = time.perf_counter()
    b = ManifestBuilder()
    b.add(Entry(b"", KIND_DIR, 0o40755, 0))
    b.add(Entry(b"train", KIND_DIR, 0o40755, 0))
    classes = 1000
    for c in range(classes):
        b.add(Entry(b"train/n%08d" % c, KIND_DIR, 0o40755, 0))
    per = n // classes
    for i in range(n):
        c = i % classes
        b.add(Entry(b"train/n%08d/img_%07d.JPEG" % (c, i), KIND_FILE, 0o100644, 0, 110_000,
                    i // 600, 64 + (i % 600) * 110_000, 110_000, 0, i))
    b.shards = [ShardInfo(f"shard-{s:06d}.sfs", 64 + 600 * 110_000) for s in range(n // 600 + 1)]
    b.write(path)
    build = time.perf_counter() - t0
    del per
    results = []
    for _ in range(runs):
        drop_caches()
        out = subprocess.run([sys.executable, "-c", _MANIFEST_CHILD, path], check=True,
                             capture_output=True, text=True)
        results.append(json.loads(out.stdout))
    return {"entries": results[0]["entries"], "build_s": build,
            "file_bytes": os.path.getsize(path),
            "open_s_cold_median": statistics.median(r["open_s"] for r in results),
            "private_bytes_per_entry_median":
                statistics.median(r["private_bytes_per_entry"] for r in results)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--files", type=int, default=20000)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--pfs", default="/tmp/pfs", help="the test PFS mount ('' to skip)")
    ap.add_argument("--scratch", default="/tmp/stagefs-bench-foundation")
    ap.add_argument("--manifest-entries", type=int, default=1_281_167)
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--skip", nargs="*", default=[], choices=["stat", "epoch", "pack", "manifest"])
    args = ap.parse_args()

    os.makedirs(args.scratch, exist_ok=True)
    raw = dataset(os.path.join(args.scratch, "raw"), args.files)
    pack_local = packed(raw, os.path.join(args.scratch, "pack"))
    result: dict[str, Any] = {"files": args.files, "runs": args.runs,
                              "load": os.getloadavg(), "cpus": os.cpu_count()}
    pfs_ok = bool(args.pfs) and os.path.ismount(args.pfs)
    if pfs_ok:
        base = os.path.join(args.pfs, "bench-foundation")
        raw_pfs = os.path.join(base, "raw")
        if not os.path.exists(os.path.join(raw_pfs, ".complete")):
            shutil.rmtree(raw_pfs, ignore_errors=True)
            shutil.copytree(raw, raw_pfs)
        pack_pfs = os.path.join(base, "pack")
        if not os.path.exists(os.path.join(pack_pfs, "manifest.sfm")):
            shutil.rmtree(pack_pfs, ignore_errors=True)
            shutil.copytree(pack_local, pack_pfs)
    if "stat" not in args.skip:
        dirs = {"local disk": raw}
        if pfs_ok:
            dirs["test PFS"] = raw_pfs
        result["stat"] = bench_stat(dirs, pack_local, args.runs)
        print(table(["system", "stats/s"],
                    [[r["system"], f"{r['stats_per_s']:,.0f}"] for r in result["stat"]]), "\n")
    if "epoch" not in args.skip:
        rows = bench_epochs("local disk", raw, pack_local, args.runs, cold=False)
        rows += bench_epochs("local disk", raw, pack_local, args.runs, cold=True)
        if pfs_ok:
            rows += bench_epochs("test PFS", raw_pfs, pack_pfs, args.runs, cold=True)
        result["epoch"] = rows
        print(table(["where", "cache", "reader", "samples/s", "MB/s", "vs plain", "vs limit"],
                    [[r["where"], r["cache"], r["reader"], f"{r['samples_per_s']:,.0f}",
                      f"{r['MB_per_s']:,.0f}", f"x{r['vs_plain']:.2f}",
                      f"{100 * r['vs_limit']:.0f}%"] for r in rows]), "\n")
    if "pack" not in args.skip:
        with tempfile.TemporaryDirectory(dir=args.scratch) as tmp:
            result["pack"] = bench_pack(raw, tmp, args.runs)
        print(table(["system", "seconds", "MB/s", "vs tar"],
                    [[r["system"], f"{r['seconds']:.2f}", f"{r['MB_per_s']:,.0f}",
                      f"x{r['vs_tar']:.2f}"] for r in result["pack"]]), "\n")
    if "manifest" not in args.skip:
        with tempfile.TemporaryDirectory(dir=args.scratch) as tmp:
            result["manifest"] = mf = bench_manifest(tmp, args.manifest_entries, args.runs)
        print(table(["entries", "file MB", "open (cold, s)", "private bytes/entry"],
                    [[f"{mf['entries']:,}", f"{mf['file_bytes'] / 1e6:.0f}",
                      f"{mf['open_s_cold_median']:.3f}",
                      f"{mf['private_bytes_per_entry_median']:.1f}"]]), "\n")
    os.makedirs(args.out, exist_ok=True)
    out = os.path.join(args.out, "foundation.json")
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"saved {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
