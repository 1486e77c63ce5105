"""Jobs one after the other on one raw directory used in place, with a tier kept across
them: the origin bytes each job reads.

Each job is a process of its own with a runtime directory of its own (as two Slurm jobs
get), opens the raw directory with one memory tier smaller than the dataset, and reads it
in ``--epochs`` shuffled epochs of ``read_many``. With the dataset D and the tier C, a job
that finds the copies an earlier job left reads about D - C an epoch; one that does not
reads D an epoch (its tier full of copies it cannot use).

    python benchmarks/bench_inplace_jobs.py [--src OTHER/src] [--jobs 3] [--touch-before 3]

``--touch-before K``: a file's modification time is moved before job K (a change the scan
sees): that job scans a tree of its own and reads everything from the origin.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time

_CHILD = r"""
import json, os, random, sys
import stagefs
root, tier, runtime, epochs = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
with stagefs.open(root, tiers=[tier], runtime=runtime) as fs:
    names = sorted(os.path.join(d, f) for d, _, fl in fs.walk('') for f in fl)
    for ep in range(epochs):
        random.Random(ep).shuffle(names)
        for i in range(0, len(names), 64):
            fs.read_many(names[i:i + 64])
    assert fs.chain is not None and fs.chain.wait_idle(60)
    print(json.dumps({"pack_id": fs.manifest.pack_id.hex(),
                      "origin_bytes": int(fs.origin.stats.bytes_read)}))
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--src", default=os.path.join(os.path.dirname(__file__), "..", "src"),
                    help="the src/ directory of the stagefs to run")
    ap.add_argument("--files", type=int, default=200)
    ap.add_argument("--file-kb", type=int, default=50)
    ap.add_argument("--tier-share", type=float, default=0.8, help="tier capacity / dataset")
    ap.add_argument("--jobs", type=int, default=3)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--touch-before", type=int, default=0, help="job number (1-based)")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    work = tempfile.mkdtemp(prefix="stagefs-inplace-jobs-")
    tier_dir = tempfile.mkdtemp(prefix="stagefs-inplace-tier-", dir="/dev/shm")
    try:
        root = os.path.join(work, "raw")
        rnd = random.Random(1)
        for i in range(args.files):
            d = os.path.join(root, f"c{i % 4}")
            os.makedirs(d, exist_ok=True)
            with open(os.path.join(d, f"f{i}.bin"), "wb") as f:
                f.write(rnd.randbytes(args.file_kb * 1000))
        old = time.time() - 3600  # written before the jobs (a scan's racy window)
        for d, _, fl in os.walk(root):
            for name in [*fl, "."]:
                os.utime(os.path.join(d, name), (old, old))
        size = args.files * args.file_kb * 1000
        tier = f"{tier_dir}:{int(size * args.tier_share)}"
        env = dict(os.environ, PYTHONPATH=os.path.abspath(args.src))
        rows = []
        for k in range(1, args.jobs + 1):
            if k == args.touch_before:
                t = time.time()
                os.utime(os.path.join(root, "c1", "f5.bin"), (t, t))
            out = subprocess.run([sys.executable, "-c", _CHILD, root, tier,
                                  os.path.join(work, f"job{k}"), str(args.epochs)],
                                 env=env, check=True, capture_output=True, text=True).stdout
            got = json.loads(out.strip().splitlines()[-1])
            rows.append({"job": k, **got})
            print(f"job {k}: pack id {got['pack_id'][:8]}, origin "
                  f"{got['origin_bytes'] / 1e6:.2f} MB in {args.epochs} epochs (D "
                  f"{size / 1e6:.2f} MB, C {size * args.tier_share / 1e6:.2f} MB)")
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"args": vars(args), "dataset_bytes": size, "jobs": rows}, f, indent=1)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(tier_dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
