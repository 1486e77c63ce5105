"""Descriptors a reading process keeps open, and what it reads under an open-file limit
below what the pack's shards would take (a hard limit of 4,096 is common on clusters).

A pack of ``--shards`` small shards is read for three epochs in a child process whose soft
and hard limits are each of ``--limits`` (``0``: the limit this shell has), with no tier, a
memory tier (/dev/shm) and a memory plus a disk tier (both with room for the whole pack),
by ``read`` and by ``read_many``. Per run: whether every byte was right and no traceback
was printed, the most descriptors open, those on tier copies per shard the tiers hold, the
origin's opens, and the origin bytes of epochs 2 and 3 against the pack (the copies past
what the limit leaves them are read from the origin). ``--src DIR`` runs the children on
another source tree (the code before a change, for the same table).

    python3 benchmarks/bench_descriptors.py --shards 400 --limits 0 1024 512
    python3 benchmarks/bench_descriptors.py --shards 400 --limits 0 1024 --src /tmp/before/src
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from typing import Any

from stagefs._table import table

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")

_CHILD = r"""
import json, os, random, resource, sys, time
limit, pack, src, tiers, how = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5]
if limit:
    resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))
import stagefs
names = sorted(os.listdir(src))
want = {n: open(os.path.join(src, n), "rb").read() for n in names}
out = {"right": True, "epochs": [], "most": 0}
def open_on(prefixes):
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            t = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        n += any(t.startswith(p) for p in prefixes)
    return n
tier_list = [t for t in tiers.split(",") if t]
with stagefs.open(pack, tiers=tier_list or None) as fs:
    for epoch in range(3):
        random.Random(epoch).shuffle(names)
        o0, t0 = fs.origin.stats.bytes_read, time.perf_counter()
        if how == "many":
            for k in range(0, len(names), 64):
                got = fs.read_many(names[k : k + 64])
                out["right"] &= got == [want[n] for n in names[k : k + 64]]
        else:
            for n in names:
                out["right"] &= fs.read(n) == want[n]
        if fs.chain is not None:
            fs.chain.wait_idle(60)
        out["epochs"].append({"origin": fs.origin.stats.bytes_read - o0,
                              "s": time.perf_counter() - t0})
        out["most"] = max(out["most"], len(os.listdir("/proc/self/fd")))
    roots = [t.split(":")[0] for t in tier_list]
    out["tier_fds"] = open_on(roots) if roots else 0
    out["held"] = len(fs.held_shards()) if fs.chain is not None else 0
    out["opens"] = fs.origin.stats.opens
    out["shards"] = len(fs.manifest.shards)
    out["data"] = sum(s.size for s in fs.manifest.shards)
print(json.dumps(out))
"""


def make(base: str, shards: int) -> tuple[str, str]:
    import random

    import stagefs

    src, pack = os.path.join(base, "src"), os.path.join(base, "pack")
    os.makedirs(src)
    rng = random.Random(7)
    for i in range(shards * 4):  # four files of 12 KiB a shard of 48 KiB
        with open(os.path.join(src, f"f{i:06d}.bin"), "wb") as f:
            f.write(rng.randbytes(12 * 1024))
    stagefs.pack(src, pack, shard_size="48KiB", compress="none", progress=False,
                 echo=lambda _m: None)
    return src, pack


def run(pack: str, src: str, limit: int, tiers: str, how: str, code: str | None
        ) -> dict[str, Any]:
    env = dict(os.environ)
    if code:
        env["PYTHONPATH"] = code
    for t in tiers.split(","):
        if t:
            shutil.rmtree(t.split(":")[0], ignore_errors=True)
    with tempfile.TemporaryDirectory() as rt:
        env["STAGEFS_RUNTIME"] = rt
        proc = subprocess.run([sys.executable, "-c", _CHILD, str(limit), pack, src, tiers, how],
                              capture_output=True, text=True, env=env, timeout=1800,
                              check=False)
    traceback = "Traceback" in proc.stderr
    try:
        got: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        last = proc.stderr.strip().splitlines()[-1:] or ["?"]
        return {"failed": last[0][:120], "traceback": traceback}
    got["traceback"] = traceback
    return got


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shards", type=int, default=400)
    ap.add_argument("--limits", type=int, nargs="+", default=[0, 1024, 512])
    ap.add_argument("--src", help="run the children on this source tree (PYTHONPATH)")
    ap.add_argument("--work", default="/var/tmp/stagefs-bench-fds")
    ap.add_argument("--out", default=os.path.join(RESULTS, "descriptors.json"))
    args = ap.parse_args()
    shutil.rmtree(args.work, ignore_errors=True)
    src, pack = make(args.work, args.shards)
    mem, disk = "/dev/shm/stagefs-bench-fds", os.path.join(args.work, "disk")
    setups = {"none": "", "memory": f"{mem}:1GiB", "memory+disk": f"{mem}:4MiB,{disk}:1GiB"}
    rows, results = [], []
    for limit in args.limits:
        for name, tiers in setups.items():
            for how in ("read", "many"):
                r = run(pack, src, limit, tiers, how, args.src)
                r.update(limit=limit or "shell's", tiers=name, how=how)
                results.append(r)
                if "failed" in r:
                    rows.append([r["limit"], name, how, "FAILED", "", "", "", "", r["failed"]])
                    continue
                later = [e["origin"] for e in r["epochs"][1:]]
                rows.append([r["limit"], name, how,
                             "yes" if r["right"] and not r["traceback"] else "NO",
                             r["most"], f"{r['tier_fds'] / max(1, r['held']):.2f}",
                             f"{r['held']}/{r['shards']}", r["opens"],
                             " ".join(f"{x / r['data']:.2f}" for x in later)])
    print(table(["limit", "tiers", "reads", "bytes right", "most fds", "tier fds/held",
                 "held", "origin opens", "origin/D epochs 2, 3"], rows))
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"shards": args.shards, "src": args.src, "runs": results}, f, indent=1)
    shutil.rmtree(mem, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
