"""A training process of the cluster tests: one per rank (under mpiexec or alone).

Connects to its node (``<workdir>/rt<rank>``), reads every file of the dataset ``rounds``
times (read and read_many, random order), once more in a forked and a spawned worker (the
store is pickled there), and writes what it saw to ``<workdir>/result<rank>.json``. It never
imports mpi4py: the rank comes from the launcher's environment.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import random
import sys
from typing import Any

from xxhash import xxh3_64_hexdigest

import stagefs
from stagefs.cluster.world import detect


def check(fs: Any, expected: dict[str, str], seed: int) -> int:
    paths = sorted(expected)
    random.Random(seed).shuffle(paths)
    bad = sum(xxh3_64_hexdigest(fs.read(p)) != expected[p] for p in paths[::2])
    for i in range(0, len(paths), 32):
        batch = paths[i : i + 32]
        bad += sum(xxh3_64_hexdigest(d) != expected[p]
                   for p, d in zip(batch, fs.read_many(batch), strict=True))
    return bad


def worker(fs: Any, expected: dict[str, str], q: Any) -> None:
    q.put(check(fs, expected, 7))


def main() -> None:
    workdir, rounds = sys.argv[1], int(sys.argv[2])
    rank = int(sys.argv[3]) if len(sys.argv) > 3 else detect().rank
    with open(os.path.join(workdir, "expected.json")) as f:
        expected: dict[str, str] = json.load(f)
    fs = stagefs.connect(os.path.join(workdir, f"rt{rank}"), timeout=60)
    open(os.path.join(workdir, f"reading{rank}"), "w").close()
    bad = 0
    for r in range(rounds):
        bad += check(fs, expected, r)
    workers = 0
    for method in ("fork", "spawn"):
        ctx = mp.get_context(method)
        q = ctx.Queue()
        p = ctx.Process(target=worker, args=(fs, expected, q))
        p.start()
        bad += q.get(timeout=120)
        p.join(60)
        workers += p.exitcode == 0
    st = fs.status()
    out = {"rank": rank, "bad": bad, "files": len(expected), "rounds": rounds,
           "workers_ok": workers, "origin_bytes": st["origin"]["bytes_read"],
           "local_hits": st["local_hits"], "unavailable": st["unavailable"],
           "checksum_failures": st["checksum_failures"],
           # from other nodes: directly, or relayed by this node's daemon (the fabric)
           "peer_bytes": sum(v["bytes"] for v in st["peers"].values())
           + (st["fabric"] or {}).get("bytes", 0),
           "peer_requests": sum(v["requests"] for v in st["peers"].values())
           + (st["fabric"] or {}).get("requests", 0)}
    with open(os.path.join(workdir, f"result{rank}.json"), "w") as f:
        json.dump(out, f)
    fs.close()


if __name__ == "__main__":
    main()
