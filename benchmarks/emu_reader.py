"""One emulated node's training process (benchmarks/emucluster.py starts one per node).

Synchronous data-parallel training, as the data layer sees it: every epoch, the global
shuffle of the dataset (seed + epoch) is cut into one slice per node (``rank::nodes``); the
node reads its slice in batches through ``stagefs.connect()`` with ``--prefetch`` batches in
flight (``read_many`` in a thread pool), and "computes" for ``--compute-ms`` per batch (a
sleep: the accelerator, not this machine's CPU). Nodes start each epoch together (a file
barrier), as an all-reduce would hold them. Writes what it measured to ``--out``:
per epoch the wall time, the time it waited for data (stall) and the bytes, and the store's
counters (origin fallbacks, checksum failures). With ``--digests`` (path -> xxh3-64 of the
file's bytes, written by emucluster.py from the source files) every sample read is compared
with what the file holds: ``wrong`` counts the samples that differ, a wrong byte the
store's own checksums did not catch.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor

from xxhash import xxh3_64_hexdigest

import stagefs


def barrier(where: str, name: str, rank: int, nodes: int, timeout: float = 600) -> None:
    open(os.path.join(where, f"{name}.{rank}"), "w").close()
    deadline = time.monotonic() + timeout
    while not all(os.path.exists(os.path.join(where, f"{name}.{r}")) for r in range(nodes)):
        if time.monotonic() > deadline:
            raise SystemExit(f"rank {rank}: barrier {name} timed out")
        time.sleep(0.01)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runtime", required=True)
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--nodes", type=int, required=True)
    ap.add_argument("--paths", required=True, help="JSON list of the dataset's files")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--compute-ms", type=float, default=100.0)
    ap.add_argument("--prefetch", type=int, default=4)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--barrier", required=True)
    ap.add_argument("--half", default=None,
                    help="epoch:file - touch file when half of that epoch's batches are read")
    ap.add_argument("--digests", default=None, help="JSON path -> xxh3-64 hex of its bytes")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    with open(a.paths) as f:
        paths: list[str] = json.load(f)
    digests: dict[str, str] = {}
    if a.digests:
        with open(a.digests) as f:
            digests = json.load(f)
    half_epoch, half_file = (-1, "")
    if a.half:
        e, _, half_file = a.half.partition(":")
        half_epoch = int(e)
    fs = stagefs.connect(a.runtime, timeout=600)
    epochs = []
    errors = wrong = 0
    with ThreadPoolExecutor(a.prefetch) as pool:
        for e in range(a.epochs):
            order = paths[:]
            random.Random(a.seed + e).shuffle(order)
            mine = order[a.rank :: a.nodes]
            batches = [mine[i : i + a.batch] for i in range(0, len(mine), a.batch)]
            barrier(a.barrier, f"epoch{e}", a.rank, a.nodes)
            t0, stall, nbytes = time.monotonic(), 0.0, 0
            inflight: deque[Future[list[bytes]]] = deque()
            nxt = 0
            for step in range(len(batches)):
                while nxt < len(batches) and len(inflight) < a.prefetch:
                    inflight.append(pool.submit(fs.read_many, batches[nxt]))
                    nxt += 1
                w0 = time.monotonic()
                try:
                    got = inflight.popleft().result()
                    nbytes += sum(len(d) for d in got)
                    if digests:
                        wrong += sum(xxh3_64_hexdigest(d) != digests[p]
                                     for p, d in zip(batches[step], got, strict=True))
                except Exception as exc:  # counted: a reader error is a failed run
                    errors += 1
                    print(f"rank {a.rank}: read error: {exc!r}", flush=True)
                stall += time.monotonic() - w0
                if e == half_epoch and step == len(batches) // 2 and half_file:
                    open(half_file, "w").close()
                time.sleep(a.compute_ms / 1000)
            epochs.append({"start": t0, "seconds": time.monotonic() - t0, "stall": stall,
                           "samples": len(mine), "bytes": nbytes})
    st = fs.status()
    ru = resource.getrusage(resource.RUSAGE_SELF)
    out = {"rank": a.rank, "epochs": epochs, "errors": errors, "wrong": wrong,
           "origin_bytes": st["origin"]["bytes_read"],
           "hedged": st["hedged"], "suspect_peers": st["suspect_peers"],
           "fabric": st["fabric"],
           "checksum_failures": st["checksum_failures"],
           "local_hits": st["local_hits"],
           "cpu_s": ru.ru_utime + ru.ru_stime}
    with open(a.out, "w") as f:
        json.dump(out, f)
    fs.close()


if __name__ == "__main__":
    main()
