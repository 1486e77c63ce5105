"""What this node has: its memory (``/proc/meminfo``) and the share of it this process's
control group may still use (a batch system such as Slurm confines a job to a memory limit
that ``/proc/meminfo`` does not show).

This module imports nothing of stagefs, so that every layer may use it.
"""

from __future__ import annotations

import contextlib
import os

__all__ = ["meminfo", "memory_available", "memory_limit_room"]


def meminfo(proc: str = "/proc") -> dict[str, int]:
    """``/proc/meminfo`` in bytes, by key (``MemTotal``, ``MemAvailable``, ...); empty where
    it cannot be read."""
    out: dict[str, int] = {}
    with contextlib.suppress(OSError), open(os.path.join(proc, "meminfo")) as f:
        for line in f:
            key, _, rest = line.partition(":")
            parts = rest.split()
            if parts and parts[0].isdigit():
                out[key] = int(parts[0]) * 1024
    return out


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # "max" (v2): no limit


def _cgroup_room(proc: str, root: str) -> int | None:
    """The least room left under a memory limit of this process's control group or any
    group above it (limit - usage), or None where no limit applies (or none can be read).
    cgroup v2 (``memory.max``, ``memory.current``) and v1 (``memory.limit_in_bytes``,
    ``memory.usage_in_bytes``, in the memory hierarchy)."""
    try:
        with open(os.path.join(proc, "self", "cgroup")) as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    room: int | None = None
    for line in lines:
        hier, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hier == "0" and controllers == "":  # v2, the unified hierarchy
            base, limit_f, usage_f = root, "memory.max", "memory.current"
        elif "memory" in controllers.split(","):  # v1
            base, limit_f, usage_f = (os.path.join(root, "memory"), "memory.limit_in_bytes",
                                      "memory.usage_in_bytes")
        else:
            continue
        parts = [p for p in path.split("/") if p and p != ".."]
        for k in range(len(parts), -1, -1):  # this group, then each above it
            d = os.path.join(base, *parts[:k])
            limit, usage = _read_int(os.path.join(d, limit_f)), _read_int(os.path.join(d, usage_f))
            if limit is None or usage is None or limit >= 1 << 60:  # v1's "no limit"
                continue
            left = max(0, limit - usage)
            room = left if room is None else min(room, left)
    return room


def memory_limit_room(proc: str = "/proc", cgroup_root: str = "/sys/fs/cgroup") -> int | None:
    """Bytes this process's control group (or one above it) may still use under its memory
    limit (a batch job's: Slurm's ``--mem``), or None where no limit applies. A memory
    tier's pages (tmpfs) count against it, and are not given back under pressure: the
    kernel kills a process of the group instead."""
    return _cgroup_room(proc, cgroup_root)


def memory_available(proc: str = "/proc", cgroup_root: str = "/sys/fs/cgroup") -> int:
    """Bytes this process may still use without pressing on others: the node's
    ``MemAvailable``, or less where its control group's limit leaves less (0 if unknown)."""
    avail = meminfo(proc).get("MemAvailable", 0)
    room = _cgroup_room(proc, cgroup_root)
    return avail if room is None else min(avail, room)
