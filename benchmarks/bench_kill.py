"""A daemon SIGKILLed while many reader processes read, on its node and on the others.

``--nodes`` daemons on this machine (static bootstrap, 2 replicas, staged), on each node
``--readers`` training processes that each fork ``--workers`` DataLoader-like workers
(tests/integration/fabric_reader.py: every process reads every file with read_many in
batches of 32 and one by one, each checked against its digest, over and over until told the
kill happened, then 3 more rounds). Once every training process has read a round, daemon 1
gets SIGKILL. Reported: reader processes, the ones that exited non-zero, samples that
differed, bytes read from the origin (all processes together and the most by one), how
often a reader's daemon failed it (node 1's readers lost theirs) and how many connections
readers opened to peers themselves. The default is 4 x 4 x (1 + 7) = 128 reader processes.

    python benchmarks/bench_kill.py --out benchmarks/results

The cluster and readers are the fabric tests' (tests/integration/test_fabric.py's Cluster),
so the benchmark and the test exercise one harness.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "tests" / "integration"), str(ROOT / "tests")]

from test_fabric import Cluster  # noqa: E402

from stagefs._table import table  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument("--readers", type=int, default=4, help="training processes per node")
    ap.add_argument("--workers", type=int, default=7, help="forked workers per process")
    ap.add_argument("--files", type=int, default=400)
    ap.add_argument("--out", default=None, help="directory for kill.json")
    a = ap.parse_args()
    if a.nodes < 2:
        raise SystemExit("bench_kill: needs 2 nodes at least (daemon 1 is killed)")
    work = tempfile.mkdtemp(prefix="stagefs-bench-kill-")
    t0 = time.monotonic()
    c = Cluster(work, a.nodes, files=a.files)
    try:
        readers = c.readers(per_node=a.readers, workers=a.workers, rounds=3, until="killed")
        marks = [os.path.join(work, f"reading{n}-{i}") for n in range(a.nodes)
                 for i in range(a.readers)]
        deadline = time.monotonic() + 600
        while not all(os.path.exists(m) for m in marks):
            if time.monotonic() > deadline:
                raise SystemExit("bench_kill: the readers did not start within 600 s")
            time.sleep(0.05)
        killed_at = time.monotonic() - t0
        c.daemons[1].send_signal(signal.SIGKILL)
        c.daemons[1].wait(30)
        Path(work, "killed").touch()
        c.wait_readers(readers)
        res = c.results()
    finally:
        c.close()
    procs = [p for r in res for p in r["procs"]]
    exits = [e for r in res for e in r["exits"]]
    dataset = sum(os.path.getsize(os.path.join(c.pack, f)) for f in os.listdir(c.pack)
                  if f.endswith(".sfs"))
    shutil.rmtree(work, ignore_errors=True)
    out = {"nodes": a.nodes, "reader_processes": len(procs),
           "nonzero_exits": sum(1 for e in exits if e), "bad_samples": sum(p.get("bad", 0) for p in procs),
           "errors": sum(1 for p in procs if "error" in p),
           "origin_bytes": sum(p.get("origin_bytes", 0) for p in procs),
           "origin_bytes_most_by_one": max(p.get("origin_bytes", 0) for p in procs),
           "dataset_bytes": dataset,
           "node1_fabric_failures": sum(p.get("fabric_failures", 0) for r in res
                                        if r["node"] == 1 for p in r["procs"]),
           "fabric_failures_elsewhere": sum(p.get("fabric_failures", 0) for r in res
                                            if r["node"] != 1 for p in r["procs"]),
           "peer_connects": sum(p.get("peer_connects", 0) for p in procs),
           "killed_after_s": killed_at, "seconds": time.monotonic() - t0,
           "load_average": os.getloadavg()}
    print(table(["figure", "value"], [[k, f"{v:,}" if isinstance(v, int) else str(v)]
                                      for k, v in out.items()]))
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "kill.json"), "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
