"""``stagefs stage`` and ``stagefs status``: staging ahead of time with a progress bar, and
the job's counters as a table."""

from __future__ import annotations

import json
import sys
import time
from typing import TYPE_CHECKING

from tqdm import tqdm

from stagefs._table import table
from stagefs.config import format_size
from stagefs.errors import ConfigError
from stagefs.runtime import Runtime
from stagefs.tiers.status import job_status, read_lines, stall_lines

if TYPE_CHECKING:
    from stagefs.store import Store

__all__ = ["print_status", "stage_with_progress"]


def stage_with_progress(fs: Store, *, progress: bool | None = None
                        ) -> tuple[dict[str, int], float, int]:
    """Place every shard of ``fs`` not held yet; shards already held are skipped (so an
    interrupted stage resumes). Returns (outcome counts, seconds, bytes copied: read from
    the origin, not the pieces a partial copy held already, which the bar counts as done)."""
    chain = fs.chain
    if chain is None:
        raise ConfigError("no tiers to stage into: pass --tier DIR[:SIZE] or set STAGEFS_TIERS")
    sizes = [s.size for s in fs.manifest.shards]
    held = fs.held_shards()
    todo = [i for i in range(len(sizes)) if i not in held]
    read_before = fs.origin.stats.bytes_read
    t0 = time.perf_counter()
    with tqdm(total=sum(sizes), initial=sum(sizes[i] for i in held), unit="B",
              unit_scale=True, unit_divisor=1024, desc="staging", smoothing=0.1,
              disable=None if progress is None else not progress) as bar:
        counts = chain.stage(todo, progress=bar.update)
    if held:
        counts["held"] = counts.get("held", 0) + len(held)
    return counts, time.perf_counter() - t0, fs.origin.stats.bytes_read - read_before


def print_status(runtime: str | None, *, as_json: bool = False) -> int:
    rt = Runtime(runtime)
    if not rt.exists():
        if runtime is not None:
            print(f"no stagefs runtime at {rt.path} (--runtime): no process of a job with "
                  "tiers or a cluster daemon has used it", file=sys.stderr)
            return 1
        print(f"no stagefs runtime for job {rt.job} at {rt.path}: a job's read counters are "
              "kept where its processes use node-local tiers (--tier, tiers=[...], "
              "$STAGEFS_TIERS) or a cluster; is $STAGEFS_JOB (or --job) the job's, or did "
              "its daemon get another --runtime (then give it: --runtime DIR, or "
              "$STAGEFS_RUNTIME)?", file=sys.stderr)
        return 1
    st = job_status(rt)
    if as_json:
        print(json.dumps(st, indent=2))
        return 0
    print(("" if st["job"] is None else f"job {st['job']}: ")
          + f"runtime {st['runtime']}, {st['live_processes']} live processes")
    # what each tier served is in the reads by holder below, counted by every process (a
    # forked DataLoader worker writes no record of its own)
    rows = [[t["path"], format_size(t["bytes_used"]), t["shards_held"], t["shards_filling"],
             t["placed"], format_size(t["filled_bytes"]), t["dropped"]] for t in st["tiers"]]
    if rows:
        # a partial copy is a shard held in part (a tier without room for all its pieces
        # keeps it so), or one a fill has not finished: "filling" was said of both
        # "filled": what the streams and the reads wrote into partial copies (a stream's
        # bytes were said to be the reads', "filled by reads", with no sample read)
        print(table(["tier", "used", "shards held", "held in part", "placed",
                     "filled (streams, reads, staging)", "dropped"], rows))
    for line in read_lines(st, "every process of the job"):
        print(line)
    rows = [[o["origin"], o["opens"], o["stats"]] for o in st["origins"]]
    if rows:
        print("metadata operations on the origin (the reads are above):")
        print(table(["origin", "opens", "stats"], rows))
    for line in stall_lines(st["stalls"]):
        print(line)
    return 0
