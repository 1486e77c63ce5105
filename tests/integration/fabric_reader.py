"""A training process of the fabric tests, with DataLoader-like forked workers.

``fabric_reader.py WORKDIR NODE ID WORKERS ROUNDS [UNTIL]``: connects to node NODE's runtime
(``<workdir>/rt<NODE>``), forks WORKERS workers (as a DataLoader does, the store inherited),
and every process reads every file ROUNDS times (read_many in batches of 32, then read
one by one), checking each against ``expected.json``. It touches ``reading<NODE>-<ID>``
after its first round; with UNTIL (a file name in WORKDIR), every process goes on reading
until that file exists, then reads ROUNDS more. It writes what every process saw to
``fabric<NODE>-<ID>.json``: bytes that differed, origin bytes, direct peer connections,
the node daemon's requests and failures.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import random
import sys
import time
from typing import Any

from xxhash import xxh3_64_hexdigest

import stagefs


def one_round(fs: Any, expected: dict[str, str], seed: int) -> int:
    paths = sorted(expected)
    random.Random(seed).shuffle(paths)
    bad = 0
    for i in range(0, len(paths), 32):
        batch = paths[i : i + 32]
        bad += sum(xxh3_64_hexdigest(d) != expected[p]
                   for p, d in zip(batch, fs.read_many(batch), strict=True))
    bad += sum(xxh3_64_hexdigest(fs.read(p)) != expected[p] for p in paths[::3])
    return bad


def run(fs: Any, expected: dict[str, str], seed: int, rounds: int, mark: str | None,
        until: str | None) -> dict[str, Any]:
    bad = one_round(fs, expected, seed)
    if mark is not None:
        open(mark, "w").close()
    n = 1
    if until is not None:
        deadline = time.monotonic() + 120
        while not os.path.exists(until) and time.monotonic() < deadline:
            bad += one_round(fs, expected, seed + n)
            n += 1
    for r in range(rounds):
        bad += one_round(fs, expected, seed + n + r)
    st = fs.status()
    fab = st.get("fabric") or {}
    return {"bad": bad, "pid": os.getpid(), "origin_bytes": st["origin"]["bytes_read"],
            "peer_connects": sum(v["connects"] for v in st["peers"].values()),
            "fabric_requests": fab.get("requests", 0), "fabric_failures": fab.get("failures", 0),
            "fabric_connects": fab.get("connects", 0),
            "fabric_patience": fab.get("patience"), "checksum_failures":
                st["checksum_failures"], "unavailable": st["unavailable"]}


def worker(fs: Any, expected: dict[str, str], seed: int, rounds: int, until: str | None,
           q: Any) -> None:
    try:
        q.put(run(fs, expected, seed, rounds, None, until))
    except BaseException as exc:
        q.put({"error": repr(exc)})
        raise


def main() -> None:
    workdir, node, ident, workers, rounds = sys.argv[1], int(sys.argv[2]), sys.argv[3], \
        int(sys.argv[4]), int(sys.argv[5])
    until = os.path.join(workdir, sys.argv[6]) if len(sys.argv) > 6 else None
    with open(os.path.join(workdir, "expected.json")) as f:
        expected: dict[str, str] = json.load(f)
    fs = stagefs.connect(os.path.join(workdir, f"rt{node}"), timeout=60)
    fs.read_many(sorted(expected)[:4])  # connected before the fork: workers inherit it
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(fs, expected, 100 + w, rounds, until, q))
             for w in range(workers)]
    for p in procs:
        p.start()
    out = [run(fs, expected, 0, rounds,
               os.path.join(workdir, f"reading{node}-{ident}"), until)]
    out += [q.get(timeout=300) for _ in procs]
    for p in procs:
        p.join(60)
    with open(os.path.join(workdir, f"fabric{node}-{ident}.json"), "w") as f:
        json.dump({"node": node, "procs": out,
                   "exits": [p.exitcode for p in procs]}, f)
    fs.close()


if __name__ == "__main__":
    main()
