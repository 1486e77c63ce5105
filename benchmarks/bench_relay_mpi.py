"""Relayed reads through the node daemon, its peer reads over TCP against MPI, side by side.

Two clusters of ``--nodes`` daemons run at once on this machine, each an MPI job (``mpiexec
-n N stagefs serve``, replicas 1, a memory tier each): one with ``--transport tcp``, one with
``--transport mpi``. From node 0 of each, this process reads every sample that the other
nodes hold through node 0's fabric socket, ``--batch`` samples a request, each sample
checked against its xxh3 (as the Store does): node 0's daemon relays the ranges to their
holders over TCP in the first cluster and through MPI (point-to-point, MPICH's shared memory
here; a fabric's RDMA on a cluster) in the second. The passes alternate, ``--runs`` of
each; medians. The MPI cluster's counters say how many bytes its peers served through MPI.

    python benchmarks/bench_relay_mpi.py --files 2000 --runs 7 --out benchmarks/results

Saved to relay-mpi.json.
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
import time
from typing import Any

from bench_cluster import make_pack, stop, wait_staged
from xxhash import xxh3_64_intdigest

from stagefs._table import table
from stagefs.cluster.placement import place
from stagefs.cluster.status import cluster_status
from stagefs.format import Manifest
from stagefs.net.client import PeerClient


def start(work: str, pack: str, nodes: int, transport: str) -> subprocess.Popen[bytes]:
    mpiexec = shutil.which("mpiexec")
    if mpiexec is None:
        raise SystemExit("needs mpiexec and mpi4py: pip install 'stagefs[mpi]'")
    cmd = [mpiexec, "-n", str(nodes), sys.executable, "-m", "stagefs.cli", "serve", pack,
           "--tier", os.path.join(work, "node{rank}") + ":4GiB",
           "--runtime", os.path.join(work, "rt{rank}"), "--bind", "127.0.0.1",
           "--replicas", "1", "--transport", transport, "--wait", "--progress", "0"]
    proc = subprocess.Popen(cmd, start_new_session=True, stdout=subprocess.DEVNULL,
                            stderr=open(os.path.join(work, "daemons.log"), "wb"))  # noqa: SIM115
    wait_staged([os.path.join(work, f"rt{r}") for r in range(nodes)], proc, 600)
    return proc


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--files", type=int, default=2000)
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    base = tempfile.mkdtemp(prefix="stagefs-bench-relay-mpi-", dir="/dev/shm")
    procs: dict[str, subprocess.Popen[bytes]] = {}
    clients: dict[str, PeerClient] = {}
    try:
        pack, _ = make_pack(os.path.join(base, "data"), a.files, "16MiB")
        m = Manifest(os.path.join(pack, "manifest.sfm"))
        holder = [h[0] for h in place(len(m.shards), a.nodes, 1).holders]
        ents = [e for e in m.files() if holder[m.shard[e]] != 0]
        ranges = [(int(m.shard[e]), int(m.offset[e]), int(m.stored[e])) for e in ents]
        sums = [int(m.checksum[e]) for e in ents]
        nbytes = sum(r[2] for r in ranges)
        works = {t: os.path.join(base, t) for t in ("tcp", "mpi")}
        for t, w in works.items():
            os.makedirs(w)
            procs[t] = start(w, pack, a.nodes, t)
            with open(os.path.join(w, "rt0", "token")) as f:
                token = bytes.fromhex(f.read().strip())
            clients[t] = PeerClient("", 0, token, unix=os.path.join(w, "rt0", "fabric.sock"),
                                    pack_id=m.pack_id)

        def epoch(c: PeerClient) -> None:
            for i in range(0, len(ranges), a.batch):
                out = c.read(ranges[i : i + a.batch])
                for k, d in enumerate(out):
                    if d is None or xxh3_64_intdigest(d) != sums[i + k]:
                        raise RuntimeError("a relayed read returned wrong bytes")

        times: dict[str, list[float]] = {t: [] for t in works}
        for t in works:
            epoch(clients[t])  # warm: connections made, pages mapped
        for _ in range(a.runs):
            for t in works:
                t0 = time.perf_counter()
                epoch(clients[t])
                times[t].append(time.perf_counter() - t0)
        _, status = cluster_status(os.path.join(works["mpi"], "rt0"))
        through_mpi = sum(p["bytes"] for s in status if s for p in s["mpi"]["peers"].values())
        m.close()
    finally:
        for c in clients.values():
            c.close()
        for p in procs.values():
            stop(p)
        shutil.rmtree(base, ignore_errors=True)
    med = {t: statistics.median(v) for t, v in times.items()}
    gbps = {t: nbytes / v / 1e9 for t, v in med.items()}
    res: dict[str, Any] = {
        "command": " ".join(sys.argv), "samples": len(ranges), "bytes": nbytes,
        "batch": a.batch, "nodes": a.nodes, "runs": a.runs, "seconds": times,
        "GBps": gbps, "mpi_vs_tcp": med["tcp"] / med["mpi"],
        "mpi_bytes_counted": through_mpi, "load_average": os.getloadavg()}
    print(table([f"relayed reads from node 0 ({a.batch}/request, verified, medians of "
                 f"{a.runs})", "GB/s", "x TCP"],
                [["node daemon's peer reads over TCP", f"{gbps['tcp']:.2f}", "1.00"],
                 ["node daemon's peer reads through MPI", f"{gbps['mpi']:.2f}",
                  f"{res['mpi_vs_tcp']:.2f}"]]))
    print(f"bytes the MPI cluster's peers read through MPI (staging included): {through_mpi:,}")
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "relay-mpi.json"), "w") as f:
            json.dump(res, f, indent=1, sort_keys=True)
        print(f"saved {os.path.join(a.out, 'relay-mpi.json')}")


if __name__ == "__main__":
    main()
