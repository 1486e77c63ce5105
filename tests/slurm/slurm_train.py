"""The training program of the Slurm recipe test, started by torchrun on every node.

Every process connects to its node's daemon (``stagefs.connect()``, STAGEFS_RUNTIME from the
job script), reads its share of the dataset (files ``rank::world`` in a seeded order; half
with ``read``, half with ``read_many``), says it is halfway (``half-<rank>``), waits for the
test to kill a daemon and say ``go``, reads the rest, and writes the xxh3 of every file it
read to ``result-<rank>.json``. ``--data stagefs`` is the recipe's argument.
"""

from __future__ import annotations

import json
import os
import random
import sys
import time

from xxhash import xxh3_64_hexdigest

import stagefs


def main() -> None:
    assert sys.argv[1:] == ["--data", "stagefs"], sys.argv
    work = os.environ["SLURM_TEST_DIR"]
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    with open(os.path.join(work, "expected.json")) as f:
        paths = sorted(json.load(f))
    random.Random(1).shuffle(paths)
    mine = paths[rank::world]
    half = len(mine) // 2
    fs = stagefs.connect()
    seen = {p: xxh3_64_hexdigest(fs.read(p)) for p in mine[:half]}
    open(os.path.join(work, f"half-{rank}"), "w").close()
    deadline = time.monotonic() + float(os.environ.get("SLURM_TEST_WAIT", "300"))
    while not os.path.exists(os.path.join(work, "go")):
        if time.monotonic() > deadline:
            raise SystemExit(f"rank {rank}: no 'go' from the test")
        time.sleep(0.1)
    rest = mine[half:]
    for i in range(0, len(rest), 16):
        batch = rest[i : i + 16]
        seen.update((p, xxh3_64_hexdigest(d)) for p, d in zip(batch, fs.read_many(batch),
                                                                strict=True))
    with open(os.path.join(work, f"result-{rank}.json"), "w") as f:
        json.dump({"host": os.uname().nodename, "files": seen}, f)


if __name__ == "__main__":
    main()
