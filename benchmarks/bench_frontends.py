"""Front-end benchmark: random-order reads and stats of an ImageNet-like dataset through
interception (``stagefs.intercept``), FUSE (``stagefs mount``), the native API
(``Store.read``), and as plain files on the local disk and on the test PFS.

Every system reads the same files in the same random order, in one run, systems
alternating within each pass; each figure is the median of --runs passes (all passes are in
the JSON), with the load average of the machine recorded before and after. "warm": after a first pass, page
caches full (for stagefs this is the state after staging). "cold": the page cache is
dropped before each pass (root only; on a VM the host may still cache).

    python benchmarks/bench_frontends.py --files 10000 --pfs /tmp/pfs/frontends \
        --out benchmarks/results

The FUSE mount is read two ways: ``open(path, "rb")``, whose ``isatty`` probe (Python <
3.14) the kernel sends to the FUSE server as an ioctl, a round trip per file, and
``open(path, "rb", buffering=0)``, with no probe (as Python 3.14's ``open`` for a regular
file). ``--same-cpu N`` runs this process and every thread of the mount's server on CPU N
alone: a round trip then needs no wake-up of another CPU (an inter-processor interrupt,
costly on a virtual machine).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import re
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import stagefs
from stagefs._table import table
from stagefs.bench.datasets import imagenet_like
from stagefs.bench.runner import drop_caches
from stagefs.posix.fuse import fuse_available, is_mounted


def read_all(paths: list[str]) -> int:
    n = 0
    for p in paths:
        with open(p, "rb") as f:
            n += len(f.read())
    return n


def read_all_unbuffered(paths: list[str]) -> int:
    """``open(path, "rb", buffering=0)``: no ``isatty`` probe (what Python 3.14 does)."""
    n = 0
    for p in paths:
        with open(p, "rb", buffering=0) as f:
            n += len(f.readall())
    return n


def pin(pid: int, cpu: int) -> None:
    """Every thread of ``pid`` on ``cpu`` alone."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        os.sched_setaffinity(int(tid), {cpu})


def stat_all(paths: list[str]) -> int:
    n = 0
    for p in paths:
        n += os.stat(p).st_size
    return n


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--files", type=int, default=10000)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--work", default="/tmp/stagefs-bench-frontends")
    ap.add_argument("--pfs", default="/tmp/pfs/frontends", help="a directory on the test PFS")
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--no-cold", action="store_true", help="skip the cold passes")
    ap.add_argument("--keep", action="store_true", help="keep the generated data")
    ap.add_argument("--same-cpu", type=int, default=None, metavar="N",
                    help="run this process and the mount's server on CPU N alone")
    a = ap.parse_args()

    raw, pack, mnt = (os.path.join(a.work, d) for d in ("raw", "pack", "mnt"))
    at = os.path.join(a.work, "intercepted")  # a path that does not exist on disk
    if not os.path.exists(os.path.join(raw, ".complete")):
        shutil.rmtree(raw, ignore_errors=True)
        imagenet_like(raw, files=a.files, classes=max(1, a.files // 500))
        open(os.path.join(raw, ".complete"), "w").close()
    if not os.path.exists(os.path.join(pack, "manifest.sfm")):
        stagefs.pack(raw, pack, jobs=2, overwrite=True)
    pfs = None
    if os.path.isdir(os.path.dirname(a.pfs.rstrip("/"))) and subprocess.run(
            ["mountpoint", "-q", os.path.dirname(a.pfs.rstrip("/"))], check=False).returncode == 0:
        pfs = a.pfs
        if not os.path.exists(os.path.join(pfs, ".complete")):
            shutil.rmtree(pfs, ignore_errors=True)
            shutil.copytree(raw, pfs)
    rels = sorted(os.path.relpath(os.path.join(d, f), raw) for d, _, fs in os.walk(raw)
                  for f in fs if not f.startswith("."))
    random.Random(0).shuffle(rels)
    n = len(rels)

    store = stagefs.open(pack)
    fuse_reason = fuse_available()
    os.makedirs(mnt, exist_ok=True)
    if fuse_reason is None and not is_mounted(mnt):
        said = subprocess.run([sys.executable, "-m", "stagefs.cli", "mount", pack, mnt],
                              check=True, capture_output=True, text=True).stdout
        server = re.search(r"server pid (\d+)", said)
        if a.same_cpu is not None and server:
            pin(int(server.group(1)), a.same_cpu)
    if a.same_cpu is not None:
        os.sched_setaffinity(0, {a.same_cpu})

    def native() -> int:
        return sum(len(store.read(p)) for p in rels)

    def native_stat() -> int:
        return sum(store.stat(p).st_size for p in rels)

    def intercepted(fn: Callable[[list[str]], int]) -> Callable[[], int]:
        paths = [os.path.join(at, p) for p in rels]

        def run() -> int:
            with stagefs.intercept(store, at=at, children=False):
                return fn(paths)
        return run

    def plain(root: str, fn: Callable[[list[str]], int]) -> Callable[[], int]:
        paths = [os.path.join(root, p) for p in rels]
        return lambda: fn(paths)

    systems: dict[str, tuple[Callable[[], int], Callable[[], int]]] = {
        "native API (Store.read)": (native, native_stat),
        "interception (open/os.stat)": (intercepted(read_all), intercepted(stat_all)),
    }
    if fuse_reason is None:
        systems["FUSE mount (open/os.stat)"] = (plain(mnt, read_all), plain(mnt, stat_all))
        systems["FUSE mount, open(buffering=0)"] = (plain(mnt, read_all_unbuffered),
                                                    plain(mnt, stat_all))
    systems["plain files, local disk"] = (plain(raw, read_all), plain(raw, stat_all))
    if pfs:
        systems["plain files, test PFS"] = (plain(pfs, read_all), plain(pfs, stat_all))

    load0 = os.getloadavg()
    results: dict[str, dict[str, Any]] = {name: {} for name in systems}
    samples: dict[str, dict[str, list[float]]] = {name: {} for name in systems}

    def measure(name: str, kind: str, fn: Callable[[], int]) -> None:
        t0 = time.perf_counter()
        results[name]["bytes" if kind == "warm_samples_per_s" else "_"] = fn()
        samples[name].setdefault(kind, []).append(n / (time.perf_counter() - t0))

    try:
        for reader, _st in systems.values():  # warm-up pass: fills every cache
            reader()
        # systems alternate within each pass, so a busy moment of this shared machine falls
        # on all of them alike
        for _ in range(a.runs):
            for name, (reader, statter) in systems.items():
                # each timed pass right after a pass that fills the caches: other jobs on this
                # machine drop the page cache now and then
                reader()
                measure(name, "warm_samples_per_s", reader)
                measure(name, "stat_per_s", statter)
        if not a.no_cold and drop_caches():
            for _ in range(a.runs):
                for name, (reader, _st) in systems.items():
                    drop_caches()
                    measure(name, "cold_samples_per_s", reader)
        for name in systems:
            results[name].pop("_", None)
            for kind, rates in samples[name].items():
                results[name][kind] = statistics.median(rates)
                results[name][kind.replace("_per_s", "_runs")] = rates
    finally:
        if is_mounted(mnt):
            subprocess.run([sys.executable, "-m", "stagefs.cli", "umount", mnt], check=False)
        store.close()

    base = results["native API (Store.read)"]
    pfs_r = results.get("plain files, test PFS")
    rows = []
    for name, r in results.items():
        rows.append([
            name, f"{r['warm_samples_per_s']:,.0f}",
            f"{r['warm_samples_per_s'] / base['warm_samples_per_s']:.2f}x",
            f"{r['warm_samples_per_s'] / pfs_r['warm_samples_per_s']:.1f}x" if pfs_r else "-",
            f"{r.get('cold_samples_per_s', float('nan')):,.0f}",
            f"{r['stat_per_s']:,.0f}",
            f"{r['stat_per_s'] / pfs_r['stat_per_s']:.1f}x" if pfs_r else "-",
        ])
    mb = base["bytes"] / n / 1e3
    print(f"\n{n} ImageNet-like files ({mb:.0f} KB mean), random order, median of {a.runs}\n")
    print(table(["system", "warm samples/s", "vs native", "vs PFS files", "cold samples/s",
                 "stat/s", "stat vs PFS"], rows))
    os.makedirs(a.out, exist_ok=True)
    out = os.path.join(a.out, "frontends.json")
    with open(out, "w") as f:
        json.dump({"benchmark": "frontends", "files": n, "loadavg": [load0, os.getloadavg()], "mean_bytes": base["bytes"] / n,
                   "runs": a.runs, "same_cpu": a.same_cpu, "machine": platform.node(), "cpus": os.cpu_count(),
                   "command": " ".join(sys.argv), "results": results}, f, indent=2)
    print(f"\nsaved {out}")
    if not a.keep:
        shutil.rmtree(a.work, ignore_errors=True)
        if pfs:
            shutil.rmtree(pfs, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
