"""Cluster mode with tiers smaller than each node's share: what epochs read from the origin.

``mpiexec -n N stagefs serve`` (N emulated nodes on this machine, each its own tier and
runtime directory) stages a pack on the test PFS into tiers whose capacities sum to a share
of the dataset (``--shares``: C = share x D, C / N on each node); then a reader on each node
(``stagefs.connect()``, ``read_many`` of 64 shuffled samples a call, every byte verified)
reads every file for ``--epochs`` epochs, the page cache dropped before each. Per share:
the origin bytes of each epoch (each node's readers', from its store's counters by
holder; the staging's from the daemons'), against D - C, the least a cluster whose tiers
hold C can read. The nodes' tiers lose about a piece and a copy's header each to rounding
(decision 0015). "spares hold": the pieces of shards whose holders had no room that their
spares placed after staging (cluster/staging.py, the overflow). Medians over ``--runs``.

    python3 benchmarks/bench_cluster_partial.py --runs 3 --out benchmarks/results/cluster-partial
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
from typing import Any

import stagefs
from stagefs._table import table
from stagefs.bench.runner import drop_caches
from stagefs.cluster.status import cluster_status
from stagefs.config import format_size

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_cluster import make_pack, stop, wait_staged  # one copy of each

BATCH = 64


def one_share(pack: str, share: float, d: int, nodes: int, epochs: int, work: str,
              seed: int) -> dict[str, Any]:
    """Stage with tiers summing to ``share`` of ``d``, read ``epochs`` epochs on each node."""
    local = os.path.join(work, f"share-{share}")
    shutil.rmtree(local, ignore_errors=True)
    os.makedirs(local)
    per_node = int(share * d / nodes)
    rts = [os.path.join(local, f"rt{r}") for r in range(nodes)]
    drop_caches()
    daemons = subprocess.Popen(
        ["mpiexec", "-n", str(nodes), sys.executable, "-m", "stagefs.cli", "serve", pack,
         "--tier", os.path.join(local, "node{rank}") + f":{per_node}", "--runtime",
         os.path.join(local, "rt{rank}"), "--bind", "127.0.0.1", "--progress", "0"],
        start_new_session=True, stderr=subprocess.DEVNULL)
    try:
        wait_staged(rts, daemons, 600)
        _, st = cluster_status(rts[0])
        nodes_st = [s for s in st if s]
        staged = sum(s["staging"]["origin_bytes"] for s in nodes_st)
        held = sum(s["staging"]["bytes_held"] + s["staging"].get("bytes_in_pieces", 0)
                   for s in nodes_st)
        per_epoch: list[list[int]] = []  # [epoch][node] origin bytes
        for e in range(epochs):
            drop_caches()
            row = []
            for r in range(nodes):
                with stagefs.connect(rts[r], timeout=60) as fs:
                    paths = [os.path.join(root, f) for root, _, files in fs.walk("/")
                             for f in files]
                    random.Random(seed * 1000 + e * 10 + r).shuffle(paths)
                    for i in range(0, len(paths), BATCH):
                        fs.read_many(paths[i:i + BATCH])
                    row.append(int(fs.status()["holders"]["origin"]["bytes"]))
            per_epoch.append(row)
        # the pieces of shards whose holders had no room, that their spares hold (placed
        # after staging, during the first epoch)
        _, st = cluster_status(rts[0])
        others = sum(s["staging"].get("bytes_for_others", 0) for s in st if s)
    finally:
        stop(daemons)
        shutil.rmtree(local, ignore_errors=True)
    return {"share": share, "capacity": per_node * nodes, "staged_origin": staged,
            "held": held, "held_for_others": others, "origin_per_epoch": per_epoch}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--files", type=int, default=1500)
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument("--shares", type=float, nargs="+", default=[1.0, 0.5, 0.25, 0.1])
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--pfs", default="/tmp/pfs/cluster-partial")
    ap.add_argument("--out", default=None, help="directory for runs.json")
    a = ap.parse_args(argv)
    if shutil.which("mpiexec") is None:
        raise SystemExit("mpiexec not found: pip install 'stagefs[mpi]'")
    pack, _ = make_pack(a.pfs, a.files, "16MiB")
    with stagefs.open(pack) as fs:
        d = sum(fs.stat(os.path.join(root, f)).st_size for root, _, files in fs.walk("/")
                for f in files)
    work = tempfile.mkdtemp(prefix="stagefs-bench-cpart-", dir="/dev/shm")
    runs: list[dict[str, Any]] = []
    try:
        for run in range(a.runs):
            for share in a.shares:  # alternated within each run
                runs.append(one_share(pack, share, d, a.nodes, a.epochs, work, run))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    rows = []
    for share in a.shares:
        mine = [r for r in runs if r["share"] == share]
        c = mine[0]["capacity"]
        least = max(0, d - c)
        cells = [f"{share:.0%}", format_size(c), format_size(least),
                 format_size(statistics.median(r["staged_origin"] for r in mine)),
                 format_size(statistics.median(r.get("held_for_others", 0) for r in mine))]
        for e in range(a.epochs):
            # each node's readers read every file: the median node of the median run
            got = statistics.median(statistics.median(r["origin_per_epoch"][e]) for r in mine)
            cells.append(f"{format_size(got)}" + (f" ({got / least:.2f})" if least else ""))
        rows.append(cells)
    print(f"{a.nodes} nodes, D = {format_size(d)} ({a.files} files, 16 MiB shards), medians "
          f"of {a.runs} runs; origin bytes a node's reader read each epoch (/ D - C):")
    print(table(["tiers C / D", "C", "D - C", "staging read", "spares hold",
                 *(f"epoch {e + 1}" for e in range(a.epochs))], rows))
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "runs.json"), "w") as f:
            json.dump({"command": " ".join(sys.argv), "dataset_bytes": d, "runs": runs}, f,
                      indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
