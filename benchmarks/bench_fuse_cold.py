"""Where a cold epoch through the FUSE mount spends its time, against the API on the same pack.

Every configuration reads the whole pack once, cold (a new memory tier, a new runtime, the
page cache dropped), in one shuffled order, in a process of its own:

- ``api``: ``Store.read_entries`` in batches of 64, no plan (no ``prefetch``: the same
  knowledge of the order the mount has);
- ``fuse-N``: a program reading every file of the mount with ``open(path, "rb").read()``
  from N threads (the mount served by ``stagefs.bench.fuse_serve``, what ``stagefs mount``
  runs); ``fuse-1-nopush``: one thread, ``STAGEFS_FUSE_PUSH=0`` (no file a stream brings is
  pushed into the page cache).

Configurations alternate within each round; the table shows medians over ``--rounds``:
samples/s, the ratio to ``api``, and for the mount the reader's time in files that took
over 20 ms (waiting for the streams to bring them), the share of the epoch its first fifth
of files took, and the median file.

    python3 benchmarks/bench_fuse_cold.py --pack /tmp/pfs/bench-s42.bench/stagefs --rounds 3

Needs root (to drop the page cache) and FUSE.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from typing import Any

from stagefs._table import table
from stagefs.bench.runner import drop_caches
from stagefs.bench.systems import start_fuse_server, stop_fuse_server

_API = r"""
import json, sys, time
import numpy as np
import stagefs
pack, tier, rt = sys.argv[1:4]
with stagefs.open(pack, tiers=[tier], runtime=rt) as s:
    files = np.fromiter(s.manifest.files(), dtype=np.int64)
    order = files[np.random.default_rng(1).permutation(len(files))]
    t0 = time.perf_counter(); n = 0
    for i in range(0, len(order), 64):
        n += sum(map(len, s.read_entries(order[i : i + 64])))
    dt = time.perf_counter() - t0
print(json.dumps({"files": len(order), "bytes": n, "s": dt}))
"""

_READER = r"""
import json, os, random, sys, time
from concurrent.futures import ThreadPoolExecutor
root, threads = sys.argv[1], int(sys.argv[2])
t0 = time.perf_counter()
files = [os.path.join(d, f) for d, _, names in os.walk(root) for f in names]
random.Random(1).shuffle(files)
lat = [0.0] * len(files)
def read(k):
    a = time.perf_counter()
    with open(files[k], "rb") as f:
        n = len(f.read())
    lat[k] = time.perf_counter() - a
    return n
with ThreadPoolExecutor(threads) as ex:
    n = sum(ex.map(read, range(len(files)), chunksize=8))
dt = time.perf_counter() - t0
fifth = len(lat) // 5
print(json.dumps({"files": len(files), "bytes": n, "s": dt,
                  "slow_s": sum(x for x in lat if x > 0.02),
                  "first_fifth": sum(lat[:fifth]) / max(sum(lat), 1e-9),
                  "median_us": sorted(lat)[len(lat) // 2] * 1e6}))
"""


def _fresh(tier: str, rt: str) -> None:
    for d in (tier, rt):
        shutil.rmtree(d, ignore_errors=True)
    os.makedirs(tier)


def run_api(pack: str, tier: str, rt: str) -> dict[str, Any]:
    _fresh(tier, rt)
    drop_caches()
    out = subprocess.run([sys.executable, "-c", _API, pack, tier, rt], check=True,
                         capture_output=True, text=True).stdout
    return dict(json.loads(out.splitlines()[-1]))


def run_fuse(pack: str, tier: str, rt: str, mnt: str, threads: int, push: bool
             ) -> dict[str, Any]:
    _fresh(tier, rt)
    env = {**os.environ, "STAGEFS_FUSE_PUSH": "1" if push else "0"}
    server = start_fuse_server(pack, mnt, rt + "-stats.json", [rt, tier], env=env)
    try:
        drop_caches()
        out = subprocess.run([sys.executable, "-c", _READER, mnt, str(threads)], check=True,
                             capture_output=True, text=True).stdout
        return dict(json.loads(out.splitlines()[-1]))
    finally:
        stop_fuse_server(mnt, server)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pack", required=True, help="a pack on the PFS")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--no-nopush", action="store_true", help="skip fuse-1-nopush")
    ap.add_argument("--out", help="write every run here (JSON)")
    args = ap.parse_args(argv)
    if not drop_caches():
        print("cannot drop the page cache (needs root): the epochs would not be cold",
              file=sys.stderr)
        return 2
    work = tempfile.mkdtemp(prefix="stagefs-fuse-cold-")
    tier = os.path.join("/dev/shm", os.path.basename(work) + "-tier")
    mnt, rt = os.path.join(work, "mnt"), os.path.join(work, "rt")
    os.makedirs(mnt)
    configs: list[tuple[str, Any]] = [("api", lambda: run_api(args.pack, tier, rt))]
    for n in args.threads:
        configs.append((f"fuse-{n}", lambda n=n: run_fuse(args.pack, tier, rt, mnt, n, True)))
    if not args.no_nopush:
        configs.append(("fuse-1-nopush", lambda: run_fuse(args.pack, tier, rt, mnt, 1, False)))
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name, _ in configs}
    try:
        for r in range(args.rounds):
            for name, run in configs:
                res = run()
                res["rate"] = res["files"] / res["s"]
                runs[name].append(res)
                print(f"round {r + 1} {name}: {res['rate']:,.0f} samples/s", file=sys.stderr,
                      flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(tier, ignore_errors=True)
    api = statistics.median(x["rate"] for x in runs["api"])
    rows = []
    for name, rs in runs.items():
        rate = statistics.median(x["rate"] for x in rs)
        row = [name, f"{rate:,.0f}", f"{rate / api:.2f}"]
        if name == "api":
            row += ["-", "-", "-"]
        else:
            row += [f"{statistics.median(x['slow_s'] for x in rs):.2f}",
                    f"{100 * statistics.median(x['first_fifth'] for x in rs):.0f}%",
                    f"{statistics.median(x['median_us'] for x in rs):.0f}"]
        rows.append(row)
    print(table(["reader", "samples/s", "/ api", "waited s (files > 20 ms, all threads)",
                 "first fifth of files", "median file us"], rows))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(runs, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
