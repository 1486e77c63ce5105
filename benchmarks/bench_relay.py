"""Relayed reads under load: several reader processes on node 0 reading, through their
node's daemon, samples the other nodes hold, with the daemon's relayed bytes in kernel
pipes (net/pipes.py, the default) and in memory (``STAGEFS_RELAY_PIPES=0``).

Two clusters of ``--nodes`` daemons on this host (loopback), one of each kind, up at once;
each pass runs the readers against one then the other (alternating, so both see the same
machine), every sample checked against the manifest's xxh3; the figure is bytes read by all
readers over the pass's wall time, the median over passes. Also the daemon's CPU seconds
per GB relayed (from /proc), the cost that pipes cut.

``--against SRC``: a third cluster whose daemons run another checkout's code (its ``src``
directory first on their PYTHONPATH), the readers the same: a change to the daemon measured
side by side with what it changed (e.g. ``git worktree add /tmp/base HEAD~1``, build its C
parts or copy them, then ``--against /tmp/base/src``).

    python benchmarks/bench_relay.py --files 2000 --readers 1 4 --runs 5 --out benchmarks/results

``--batch``: samples a request (64 by default, about 7 MB; 8 is a small DataLoader batch,
where what a relayed request costs the daemon, not its bytes, is the most of it).

Read its ratio against an A/A run (``--against`` this checkout's own ``src``): on this
machine the third cluster read 1.06-1.14x the first one's with the very same code (2026-11-26,
five and six runs, whether or not each run changed the clusters' order), so "this / against"
of 0.88-0.94 is no difference.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import random
import shutil
import statistics
import tempfile
import time
from typing import Any

from bench_cluster import make_pack, stop
from bench_fabric import BATCH, start_cluster
from xxhash import xxh3_64_intdigest

from stagefs._table import table
from stagefs.cluster.placement import place
from stagefs.format import Manifest
from stagefs.net.client import PeerClient


def _reader(sock: str, token: bytes, pack_id: bytes, batches: list[Any], secs: float,
            q: Any) -> None:
    c = PeerClient("", 0, token, unix=sock, pack_id=pack_id)
    n = k = 0
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < secs:
        ranges, sums = batches[k % len(batches)]
        k += 1
        for d, want in zip(c.read(ranges), sums, strict=True):
            if d is None or xxh3_64_intdigest(d) != want:
                raise RuntimeError("a relayed read returned wrong bytes")
            n += len(d)
    q.put((n, time.perf_counter() - t0))
    c.close()


def _cpu(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--files", type=int, default=2000)
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument("--readers", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--seconds", type=float, default=3.0, help="per pass")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--batch", type=int, default=BATCH,
                    help="samples in each request (a DataLoader batch: 8 to 64)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--against", default=None, metavar="SRC",
                    help="also daemons running the code under SRC (another checkout's src)")
    a = ap.parse_args()
    work = tempfile.mkdtemp(prefix="stagefs-bench-relay-", dir="/dev/shm")
    pack, _ = make_pack(os.path.join(work, "data"), a.files, "16MiB")
    kinds = {"pipes": {"STAGEFS_RELAY_PIPES": "1"}, "memory": {"STAGEFS_RELAY_PIPES": "0"}}
    if a.against:
        kinds["against"] = {"STAGEFS_RELAY_PIPES": "1",
                            "PYTHONPATH": os.path.abspath(a.against) + os.pathsep
                            + os.environ.get("PYTHONPATH", "")}
    clusters: dict[str, tuple[str, list[Any]]] = {}
    try:
        for kind, env in kinds.items():
            w = os.path.join(work, kind)
            os.makedirs(w)
            clusters[kind] = (w, start_cluster(w, pack, a.nodes, env))
        m = Manifest(os.path.join(pack, "manifest.sfm"))
        holder = [h[0] for h in place(len(m.shards), a.nodes, 1).holders]
        ents = [e for e in m.files() if holder[m.shard[e]] != 0]
        random.Random(1).shuffle(ents)
        ranges = [(int(m.shard[e]), int(m.offset[e]), int(m.stored[e])) for e in ents]
        sums = [int(m.checksum[e]) for e in ents]
        batches = [(ranges[i : i + a.batch], sums[i : i + a.batch])
                   for i in range(0, len(ranges), a.batch)]
        rows: list[dict[str, Any]] = []
        for nr in a.readers:
            res: dict[str, list[float]] = {k: [] for k in kinds}
            cpu: dict[str, list[float]] = {k: [] for k in kinds}
            for _ in range(a.runs):
                for kind, (w, daemons) in clusters.items():
                    with open(os.path.join(w, "token")) as f:
                        token = bytes.fromhex(f.read().strip())
                    sock = os.path.join(w, "rt0", "fabric.sock")
                    q: Any = mp.Queue()
                    c0 = _cpu(daemons[0].pid)
                    ps = [mp.Process(target=_reader, args=(sock, token, m.pack_id,
                                                           batches[i::nr], a.seconds, q))
                          for i in range(nr)]
                    for p in ps:
                        p.start()
                    got = [q.get(timeout=120) for _ in ps]
                    for p in ps:
                        p.join()
                        if p.exitcode:
                            raise RuntimeError(f"a reader failed ({kind})")
                    total = sum(g[0] for g in got)
                    res[kind].append(total / max(g[1] for g in got) / 1e9)
                    cpu[kind].append((_cpu(daemons[0].pid) - c0) / (total / 1e9))
            shares = {}
            for kind, (w, _) in clusters.items():
                with open(os.path.join(w, "token")) as f:
                    token = bytes.fromhex(f.read().strip())
                c = PeerClient("", 0, token, unix=os.path.join(w, "rt0", "fabric.sock"),
                               pack_id=m.pack_id)
                srv = c.status()["server"]
                c.close()
                shares[kind] = srv["relayed_piped"] / max(1, srv["relayed_ranges"])
            rows.append({"readers": nr, "piped_share": shares,
                         **{f"{k}_GBps": statistics.median(v) for k, v in res.items()},
                         **{f"{k}_cpu_s_per_GB": statistics.median(v) for k, v in cpu.items()},
                         "passes": res, "cpu_passes": cpu})
        m.close()
    finally:
        for _, daemons in clusters.values():
            for d in daemons:
                stop(d)
        shutil.rmtree(work, ignore_errors=True)
    print(table(["readers on node 0", "pipes GB/s", "memory GB/s", "pipes / memory",
                 "daemon CPU s/GB, pipes", "memory", "ranges piped (so far)"],
                [[r["readers"], f"{r['pipes_GBps']:.2f}", f"{r['memory_GBps']:.2f}",
                  f"{r['pipes_GBps'] / r['memory_GBps']:.2f}",
                  f"{r['pipes_cpu_s_per_GB']:.2f}", f"{r['memory_cpu_s_per_GB']:.2f}",
                  f"{r['piped_share']['pipes']:.0%}"]
                 for r in rows]))
    if a.against:
        print(f"\nagainst the daemons of {a.against}:")
        print(table(["readers on node 0", "this GB/s", "against GB/s", "this / against",
                     "daemon CPU s/GB, this", "against"],
                    [[r["readers"], f"{r['pipes_GBps']:.2f}", f"{r['against_GBps']:.2f}",
                      f"{r['pipes_GBps'] / r['against_GBps']:.2f}",
                      f"{r['pipes_cpu_s_per_GB']:.2f}", f"{r['against_cpu_s_per_GB']:.2f}"]
                     for r in rows]))
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        path = os.path.join(a.out, "relay.json" if a.batch == BATCH
                            else f"relay-batch{a.batch}.json")
        with open(path, "w") as f:
            json.dump({"files": a.files, "nodes": a.nodes, "batch": a.batch, "against": a.against,
                       "seconds": a.seconds, "runs": a.runs, "rows": rows,
                       "load_average": os.getloadavg()}, f, indent=1)
        print("saved", path)


if __name__ == "__main__":
    main()
