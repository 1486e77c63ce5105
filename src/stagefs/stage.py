"""``stagefs stage`` and ``stagefs status``: staging ahead of time with a progress bar, and
the job's counters as a table."""

from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING

from tqdm import tqdm

from stagefs._table import table
from stagefs.config import format_size
from stagefs.errors import ConfigError
from stagefs.runtime import Runtime
from stagefs.tiers.status import job_status

if TYPE_CHECKING:
    from stagefs.store import Store

__all__ = ["print_status", "stage_with_progress"]


def stage_with_progress(fs: Store, *, progress: bool | None = None
                        ) -> tuple[dict[str, int], float, int]:
    """Place every shard of ``fs`` not held yet; shards already held are skipped (so an
    interrupted stage resumes). Returns (outcome counts, seconds, bytes copied)."""
    chain = fs.chain
    if chain is None:
        raise ConfigError("no tiers to stage into: pass --tier DIR[:SIZE] or set STAGEFS_TIERS")
    sizes = [s.size for s in fs.manifest.shards]
    held = fs.held_shards()
    todo = [i for i in range(len(sizes)) if i not in held]
    copied = [0]
    t0 = time.perf_counter()
    with tqdm(total=sum(sizes), initial=sum(sizes[i] for i in held), unit="B",
              unit_scale=True, unit_divisor=1024, desc="staging", smoothing=0.1,
              disable=None if progress is None else not progress) as bar:
        def advance(n: int) -> None:
            copied[0] += n
            bar.update(n)

        counts = chain.stage(todo, progress=advance)
    if held:
        counts["held"] = counts.get("held", 0) + len(held)
    return counts, time.perf_counter() - t0, copied[0]


def print_status(runtime: str | None, *, as_json: bool = False) -> int:
    rt = Runtime(runtime)
    if not rt.exists():
        print(f"no stagefs runtime for job {rt.job} at {rt.path}")
        return 1
    st = job_status(rt)
    if as_json:
        print(json.dumps(st, indent=2))
        return 0
    print(f"job {st['job']}: runtime {st['runtime']}, {st['live_processes']} live processes")
    rows = [[t["path"], format_size(t["bytes_used"]), t["shards_held"], t["shards_filling"],
             t["hits"], format_size(t["bytes"]), t["placed"], format_size(t["filled_bytes"]),
             t["dropped"]] for t in st["tiers"]]
    if rows:
        print(table(["tier", "used", "shards held", "filling", "hits", "served", "placed",
                     "filled by reads", "dropped"], rows))
    if st["reads"]:
        rows = [[h, v["reads"], format_size(v["bytes"]),
                 f"{100 * v['bytes'] / st['bytes']:.1f}%" if st["bytes"] else "-"]
                for h, v in st["holders"].items()]
        print(f"reads by holder (every process of the job): {st['reads']} samples, "
              f"{format_size(st['bytes'])}, hit rate {100 * st['hit_rate']:.1f}% "
              "(bytes not read from the origin)")
        print(table(["holder", "samples", "bytes", "share"], rows))
        pushed = st.get("pushed", {})
        if pushed.get("reads"):
            print(f"of these, pushed by a FUSE mount into the kernel's page cache as streamed: "
                  f"{pushed['reads']} samples, {format_size(pushed['bytes'])} (counted when "
                  "pushed: the kernel serves their reads)")
    rows = [[o["origin"], o["misses"], o["opens"], o["stats"], o["reads"],
             format_size(o["bytes_read"])] for o in st["origins"]]
    if rows:
        print(table(["origin", "misses", "opens", "stats", "reads", "bytes read"], rows))
    rows = [[r.get("rank"), r.get("pid"), r.get("epoch"), r.get("steps"),
             f"{r.get('wait_s', 0):.1f}", f"{r.get('step_s', 0):.1f}",
             f"{100 * r.get('stall', 0):.1f}%", f"{100 * r.get('steady_stall', 0):.1f}%"]
            for r in st["stalls"]]
    if rows:
        print("data stall (time each step waited for data), per training process and epoch:")
        print(table(["rank", "pid", "epoch", "steps", "waited s", "step s", "stall",
                     "stall after 1st batch"], rows))
    return 0
