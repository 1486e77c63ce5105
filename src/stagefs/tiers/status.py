"""What a job's tiers hold and what its processes did: the counters every process writes to
the runtime directory, summed (``stagefs status``)."""

from __future__ import annotations

import json
import os
from typing import Any

from stagefs.runtime import Runtime
from stagefs.tiers.tier import dir_bytes

__all__ = ["job_status"]

_TIER_COUNTERS = ("hits", "bytes", "placed", "placed_bytes", "filled", "filled_bytes",
                  "dropped")
_ORIGIN_COUNTERS = ("opens", "stats", "reads", "bytes_read")


def _held(tier: str, pack_id: str) -> tuple[int, int]:
    """Shards held whole, and shards with a partial copy being filled."""
    try:
        names = os.listdir(os.path.join(tier, pack_id))
    except FileNotFoundError:
        return 0, 0
    return (sum(1 for n in names if n.endswith(".sfs")),
            sum(1 for n in names if n.endswith(".sfs.fill")))


def job_status(rt: Runtime) -> dict[str, Any]:
    """Per tier: bytes used, shards held and being filled, hits, bytes served, shards
    placed, bytes filled by reads, copies dropped;
    per origin: misses, opens, stats, reads and bytes read; summed over the job's processes."""
    tiers: dict[str, dict[str, Any]] = {}
    for rec in rt.tier_records():
        for t in rec.get("tiers", []):
            row = tiers.setdefault(t, {"path": t, "shards_held": 0, "shards_filling": 0,
                                       **dict.fromkeys(_TIER_COUNTERS, 0)})
            n_held, n_filling = _held(t, rec["pack_id"])
            row["shards_held"] += n_held
            row["shards_filling"] += n_filling
    for row in tiers.values():
        row["bytes_used"] = dir_bytes(row["path"])
    origins: dict[str, dict[str, Any]] = {}
    for rec in rt.stat_records():
        for path, counters in rec.get("tiers", {}).items():
            held = tiers.get(path)
            if held is not None:
                for k in _TIER_COUNTERS:
                    held[k] += int(counters.get(k, 0))
        o = origins.setdefault(rec.get("origin", "?"), {"origin": rec.get("origin", "?"),
                                                       "misses": 0, "processes": 0,
                                                       **dict.fromkeys(_ORIGIN_COUNTERS, 0)})
        o["misses"] += int(rec.get("misses", 0))
        o["processes"] += 1
        for k in _ORIGIN_COUNTERS:
            o[k] += int(rec.get("origin_stats", {}).get(k, 0))
    return {"runtime": rt.path, "job": rt.job, "live_processes": len(rt.live_processes()),
            "tiers": list(tiers.values()), "origins": list(origins.values()),
            "stalls": stall_records(rt.path)}


def stall_records(runtime: str) -> list[dict[str, Any]]:
    """The data-stall records training processes wrote (``stall-<pid>.json``, written by
    ``stagefs.torch.StallMeter``): one row per process and epoch, by rank then epoch."""
    rows: list[dict[str, Any]] = []
    try:
        names = sorted(n for n in os.listdir(runtime)
                       if n.startswith("stall-") and n.endswith(".json"))
    except OSError:
        return rows
    for name in names:
        try:
            with open(os.path.join(runtime, name)) as f:
                rec = json.load(f)
            for ep in rec.get("epochs", []):
                rows.append({"pid": rec.get("pid"), "rank": rec.get("rank"), **ep})
        except (OSError, ValueError, TypeError):
            continue  # a record being rewritten or not ours: skip it, status is best effort
    rows.sort(key=lambda r: (r.get("rank") or 0, r.get("pid") or 0, r.get("epoch") or 0))
    return rows
