"""One emulated node's training process (benchmarks/emucluster.py starts one per node).

Synchronous data-parallel training, as the data layer sees it: every epoch, the global
shuffle of the dataset (seed + epoch) is cut into one slice per node (``rank::nodes``); the
node reads its slice in batches through ``stagefs.connect()`` with ``--prefetch`` batches in
flight (``read_many`` in a thread pool), and "computes" for ``--compute-ms`` per batch (a
sleep: the accelerator, not this machine's CPU). Nodes start each epoch together (a file
barrier), as an all-reduce would hold them. The read-ahead does not stop at the end of an
epoch: the next epoch's order is known (seed + epoch), so its first batches are asked for
while the last ones of this epoch compute, and before the barrier, as stagefs's own
clairvoyant prefetch does for the torch path (``--no-epoch-ahead``: each epoch's read-ahead
starts at its barrier). Writes what it measured to ``--out``: per epoch the wall time, the
time it waited for data (stall), the bytes and the process's CPU, and the store's counters
(origin fallbacks, checksum failures). With ``--digests`` (path -> xxh3-64 of the
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
    """Wait until every rank has reached ``name``. One stat a poll, of the first rank not
    seen yet (a rank seen stays there): polling all N files, 64 waiting readers took a core
    of the emulation host from the nodes still computing."""
    open(os.path.join(where, f"{name}.{rank}"), "w").close()
    deadline = time.monotonic() + timeout
    r = 0
    while r < nodes:
        if os.path.exists(os.path.join(where, f"{name}.{r}")):
            r += 1
            continue
        if time.monotonic() > deadline:
            raise SystemExit(f"rank {rank}: barrier {name} timed out")
        time.sleep(0.01)


def cpu_now() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


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
    ap.add_argument("--no-epoch-ahead", dest="epoch_ahead", action="store_false",
                    help="start each epoch's read-ahead at its barrier, not before")
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
    plan: list[list[list[str]]] = []  # every epoch's batches, known in advance
    for e in range(a.epochs):
        order = paths[:]
        random.Random(a.seed + e).shuffle(order)
        mine = order[a.rank :: a.nodes]
        plan.append([mine[i : i + a.batch] for i in range(0, len(mine), a.batch)])
    queue = [(e, i) for e in range(a.epochs) for i in range(len(plan[e]))]
    epochs = []
    errors = wrong = 0
    with ThreadPoolExecutor(a.prefetch) as pool:
        inflight: deque[Future[list[bytes]]] = deque()
        nxt = 0  # the next batch of ``queue`` to ask for

        def fill(epoch: int) -> None:
            """Keep ``prefetch`` batches in flight, of this epoch and, with the epoch ahead,
            of the next ones."""
            nonlocal nxt
            while (nxt < len(queue) and len(inflight) < a.prefetch
                   and (a.epoch_ahead or queue[nxt][0] == epoch)):
                e, i = queue[nxt]
                inflight.append(pool.submit(fs.read_many, plan[e][i]))
                nxt += 1

        for e, batches in enumerate(plan):
            if a.epoch_ahead:  # the first batches go out before the barrier
                fill(e)
            barrier(a.barrier, f"epoch{e}", a.rank, a.nodes)
            t0, c0, stall, nbytes = time.monotonic(), cpu_now(), 0.0, 0
            for step in range(len(batches)):
                fill(e)
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
                           "samples": sum(map(len, batches)),
                           "batches": len(batches), "bytes": nbytes,
                           "cpu_s": cpu_now() - c0})
    st = fs.status()
    ru = resource.getrusage(resource.RUSAGE_SELF)
    out = {"rank": a.rank, "epochs": epochs, "errors": errors, "wrong": wrong,
           "origin_bytes": st["origin"]["bytes_read"],
           "hedged": st["hedged"], "suspect_peers": st["suspect_peers"],
           "fabric": st["fabric"],
           # the direct connections to peers: a reader opens them only while its node's
           # daemon does not answer (killed), each a connect and a token exchange
           "peer_connects": sum(c.get("connects", 0) for c in st["peers"].values()),
           "peer_requests": sum(c.get("requests", 0) for c in st["peers"].values()),
           "checksum_failures": st["checksum_failures"],
           "local_hits": st["local_hits"],
           "cpu_s": ru.ru_utime + ru.ru_stime}
    with open(a.out, "w") as f:
        json.dump(out, f)
    fs.close()


if __name__ == "__main__":
    main()
