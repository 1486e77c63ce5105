"""What a job's tiers hold and what its processes did: the counters every process writes to
the runtime directory, summed (``stagefs status``).

Reads are counted per sample and per byte, by holder, in a small mapped file per process
(``ReadCounters``; the format is in docs/status.md, for any other front end, such as the
preload library, to write the same): every count is a store into shared memory, so a
process that ends with ``os._exit`` (a DataLoader worker) or is killed loses none.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import mmap
import os
import stat
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

from stagefs._fsutil import atomic_write, open_read, write_out
from stagefs._table import table
from stagefs.config import format_size
from stagefs.runtime import Runtime, alive, read_record
from stagefs.tiers.tier import dir_bytes

__all__ = ["COUNTER_SLOTS", "HOLDERS", "RECORD_EVERY_S", "EndedCounts", "ReadCounters", "holder_summary",
           "job_status", "new_record", "read_counts", "read_lines", "write_record"]

MAGIC = b"SFSCNT1\n"
HOLDERS = ("memory", "disk", "peer", "origin")
"""Where a read's bytes came from: a memory tier, a disk tier, another node, the origin."""
COUNTER_SLOTS = (*(f"{h}_{k}" for h in HOLDERS for k in ("reads", "bytes")),
                 "checksum_failures", "unavailable", "pushed_reads", "pushed_bytes",
                 "fetched_reads", "fetched_bytes", "stored_bytes")
"""The u64 counters after the 16-byte header, in this order (docs/status.md)."""
_FILE_SLOTS = 30  # room for counters added later: a reader sums the slots it knows
_SIZE = 16 + 8 * _FILE_SLOTS
SUFFIX = ".counters"
_SLOT = {name: i for i, name in enumerate(COUNTER_SLOTS)}
_FETCHED = _SLOT["fetched_reads"]
_STORED = _SLOT["stored_bytes"]
_HOLDER_SLOT = {h: 2 * i for i, h in enumerate(HOLDERS)}
_LIVE: weakref.WeakSet[ReadCounters] = weakref.WeakSet()
_SEQ = itertools.count()
_RECORDS = itertools.count()
RECORD_EVERY_S = 1.0  # a store writes its stats record at most this often while it reads


def new_record(stats: str, pack_id: str) -> str:
    """A new path for a store's stats record in the job's ``stats`` dir,
    ``<pid>.<pack id>.<n>.json`` (its origin and what it cost the origin: ``stagefs
    status``'s origins): one file per open store, so several stores of one process each
    keep theirs, and never the file of an ended process of the same pid (pids are reused):
    its counts stay."""
    while True:
        path = os.path.join(stats, f"{os.getpid()}.{pack_id}.{next(_RECORDS)}.json")
        if not os.path.lexists(path):
            return path


def write_record(path: str, record: dict[str, Any]) -> None:
    """Write a store's stats record (``new_record``) whole: best effort, as the counters
    are (the runtime dir may have been cleaned under the store)."""
    with contextlib.suppress(OSError):
        atomic_write(path, json.dumps(record), fsync=False)


class ReadCounters:
    """This process's read counters for one store, in ``<stats dir>/<pid>-<n>.counters``
    (``<pid>-<dataset>-<n>.counters`` given the dataset's pack id: ``stagefs status`` shows
    each dataset of a job apart, a train set's hit rate not mixed with a val set's), made at
    the first count (a forked child makes its own: the parent's stay its own)."""

    def __init__(self, folder: str, dataset: str = "") -> None:
        self.folder = folder
        self._tag = f"{dataset}-" if dataset else ""
        self._pid = -1
        self._slots: memoryview | None = None
        self._mm: mmap.mmap | None = None
        self._last: list[int] | None = None  # the counts as closed (snapshot's, after)
        self._lock = threading.Lock()
        _LIVE.add(self)

    def add(self, holder: str, reads: int, nbytes: int, stored: int) -> None:
        """``reads`` samples of ``nbytes`` bytes in all came from ``holder``; ``stored``:
        their bytes as stored (compressed), what the origin's reads are weighed against."""
        i = _HOLDER_SLOT[holder]
        self._add((i, reads), (i + 1, nbytes), (_STORED, stored))

    def count(self, name: str, n: int = 1) -> None:
        self._add((_SLOT[name], n))

    def fetched(self, nbytes: int, reads: int = 1) -> None:
        """``reads`` reads of ``nbytes`` in all from the origin by this process (a
        reader's, a stream's, staging's): what the hit rate is counted against."""
        self._add((_FETCHED, reads), (_FETCHED + 1, nbytes))

    def _add(self, *counts: tuple[int, int]) -> None:
        """Add each (slot, n) to this process's file (made at its first count)."""
        with self._lock:
            slots = self._slots if self._pid == os.getpid() else self._open()
            if slots is not None:
                for i, n in counts:
                    slots[i] += n

    def snapshot(self) -> dict[str, int]:
        """This process's counts, by counter name (as they were closed, once closed: a
        closed Store's status() is the run's report)."""
        with self._lock:
            mine = self._pid == os.getpid()
            slots: Any = (self._slots if self._slots is not None else self._last) \
                if mine else None
            return {k: int(slots[i]) if slots is not None else 0
                    for i, k in enumerate(COUNTER_SLOTS)}

    def _open(self) -> memoryview | None:
        """Make this process's file (None if the runtime dir is gone: counting is best
        effort, never an error for a read).

        A new file, never an old one: a process that ended may have left a file of the same
        pid (pids are reused, within a long job or a login session's runtime), whose counts
        are the job's; truncating it took them from ``stagefs status`` (its totals went
        backwards)."""
        self._pid = os.getpid()
        self._slots = None
        while True:
            path = os.path.join(self.folder, f"{self._pid}-{self._tag}{next(_SEQ)}{SUFFIX}")
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
                break
            except FileExistsError:
                continue  # an ended process's, of this pid: its counts stay
            except OSError:
                return None
        try:
            write_out(fd, _SIZE)  # (a hole in it: a SIGBUS at a count on a full /dev/shm)
            os.pwrite(fd, MAGIC + self._pid.to_bytes(8, "little"), 0)
            self._mm = mmap.mmap(fd, _SIZE, mmap.MAP_SHARED)
        except OSError:
            return None
        finally:
            os.close(fd)
        self._slots = memoryview(self._mm)[16:].cast("Q")
        return self._slots

    def close(self) -> None:
        with self._lock:
            if self._slots is not None:
                self._last = self._slots.tolist()
                self._slots.release()
                self._slots = None
            if self._mm is not None:
                with contextlib.suppress(BufferError):
                    self._mm.close()
                self._mm = None


def _after_fork_in_child() -> None:
    for c in list(_LIVE):
        c._lock = threading.Lock()  # another thread may have held it at the fork
        c._slots, c._mm, c._pid = None, None, -1  # the parent's mapping stays the parent's


os.register_at_fork(after_in_child=_after_fork_in_child)


class EndedCounts:
    """The counts of the counters files whose writer has ended, which no one adds to any
    more, kept by a caller that sums a folder again and again (a node's daemon, every
    second): ``read_counts`` reads each such file once, then only lists the folder. A long
    job leaves a file for every process that read, each DataLoader worker of each epoch:
    without it the daemon read them all every second in its event loop, thousands after a
    few hours, and every reader of the node waited while it did. Their pids are judged
    again every ``every`` seconds: a file whose pid lives again (reused, the preload
    library adds to a file of its pid's name) is read again from then on."""

    def __init__(self, every: float = 60.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.every, self.clock = every, clock
        self.files: dict[str, tuple[int, list[int]]] = {}  # name -> (pid, its counts)
        self.total = [0] * len(COUNTER_SLOTS)
        self._judged = clock()

    def add(self, name: str, pid: int, values: list[int]) -> None:
        self.files[name] = (pid, values)
        self._count(values, 1)

    def drop(self, name: str) -> None:
        self._count(self.files.pop(name)[1], -1)

    def _count(self, values: list[int], sign: int) -> None:
        for i, v in enumerate(values):
            self.total[i] += sign * v

    def refresh(self, names: set[str]) -> None:
        """Forget the files no longer in the folder (removed: counted no more) and, when
        due, those whose pid is alive again."""
        for gone in self.files.keys() - names:
            self.drop(gone)
        if self.clock() - self._judged >= self.every:
            self._judged = self.clock()
            for name in [n for n, (pid, _) in self.files.items() if alive(pid)]:
                self.drop(name)


def read_counts(folder: str, ended: EndedCounts | None = None,
                by_dataset: dict[str, dict[str, int]] | None = None) -> dict[str, int]:
    """Every ``*.counters`` file in ``folder`` summed, by counter name; ``ended``: the
    counts of ended writers' files read before, not read again (``EndedCounts``);
    ``by_dataset``: also filled, in the same pass, with the sums of the files that name
    their dataset (``<pid>-<pack id>-<n>.counters``), by pack id (files of no dataset, the
    preload library's or a node daemon's, are in the total only)."""
    assert ended is None or by_dataset is None  # (ended files are not read again)
    total = dict.fromkeys(COUNTER_SLOTS, 0)
    try:
        names = {n for n in os.listdir(folder) if n.endswith(SUFFIX)}
    except OSError:
        return total
    if ended is not None:
        ended.refresh(names)
        for key, v in zip(COUNTER_SLOTS, ended.total, strict=True):
            total[key] += v
        names -= ended.files.keys()
    for name in names:
        counts = _read_counter_file(os.path.join(folder, name), ended is not None)
        if counts is None:
            continue
        pid, values, final = counts
        sums = [total]
        parts = name.removesuffix(SUFFIX).split("-")
        if by_dataset is not None and len(parts) == 3 and parts[1]:
            sums.append(by_dataset.setdefault(parts[1], dict.fromkeys(COUNTER_SLOTS, 0)))
        for into in sums:
            for key, v in zip(COUNTER_SLOTS, values, strict=False):
                into[key] += v
        if final and ended is not None:
            ended.add(name, pid, values)
    return total


def _read_counter_file(path: str, judge: bool) -> tuple[int, list[int], bool] | None:
    """A counters file's writer pid and counts (None: not a counters file, or gone), and
    with ``judge``, whether they are final: the writer had ended before they were read
    (read again once it is found dead, so no count it made before it ended is missed)."""
    try:  # without waiting: a FIFO under a counters name would hold status forever
        fd, info = open_read(path, os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        raw = os.pread(fd, _SIZE, 0) if stat.S_ISREG(info.st_mode) else b""
        if raw[:8] != MAGIC or len(raw) < 16:
            return None  # not a counters file (or one being made): skip it
        pid = int.from_bytes(raw[8:16], "little")
        final = judge and not alive(pid)
        if final:
            raw = os.pread(fd, _SIZE, 0)
    except OSError:
        return None
    finally:
        os.close(fd)
    body = raw[16:]
    values = [int.from_bytes(body[8 * i : 8 * i + 8], "little")
              for i in range(len(COUNTER_SLOTS)) if 8 * i + 8 <= len(body)]
    nbytes = sum(values[_SLOT[f"{h}_bytes"]] for h in HOLDERS) if len(values) > _STORED else 0
    if nbytes and not values[_STORED] and not values[_SLOT["fetched_bytes"]]:
        # an older stagefs's file (same magic, no fetched_* or stored_bytes yet): its
        # samples from the origin are the origin reads it is known to have made, or
        # every one of them would count as a hit
        values[_FETCHED] = values[_SLOT["origin_reads"]]
        values[_SLOT["fetched_bytes"]] = values[_SLOT["origin_bytes"]]
        values[_STORED] = nbytes
    return pid, values, final


def _count(value: Any) -> int:
    """A count from a process's stats record, 0 if it is not one (a damaged record)."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0


def _obj(value: Any) -> dict[str, Any]:
    """A JSON object of a stats record, empty if the record has something else there."""
    return value if isinstance(value, dict) else {}


def holder_summary(counts: dict[str, int]) -> dict[str, Any]:
    """Reads and bytes per holder (where each sample was served from), their totals, the
    origin's own reads (``fetched``: every read any process made of the origin, the streams'
    and staging's included), and the hit rate: the bytes read that did not have to be read
    from the origin, 1 - fetched / read (0 in a cold first epoch, whatever served it: a
    stream's bytes reach their reader through its tier copy), the bytes read counted as
    stored (``stored_bytes``: a compressed file's stored bytes, as the origin gives them)."""
    holders = {h: {"reads": counts[f"{h}_reads"], "bytes": counts[f"{h}_bytes"]}
               for h in HOLDERS}
    reads = sum(v["reads"] for v in holders.values())
    nbytes = sum(v["bytes"] for v in holders.values())
    fetched = counts["fetched_bytes"]
    stored = counts["stored_bytes"] or nbytes  # like with like: a compressed file's bytes
    hit = max(0.0, 1 - fetched / stored) if stored else 0.0
    return {"holders": holders, "reads": reads, "bytes": nbytes, "stored_bytes": stored,
            "hit_rate": hit,
            "fetched": {"reads": counts["fetched_reads"], "bytes": fetched},
            "checksum_failures": counts["checksum_failures"],
            "unavailable": counts["unavailable"],
            # of the reads: files a FUSE mount pushed into the kernel's page cache
            "pushed": {"reads": counts["pushed_reads"], "bytes": counts["pushed_bytes"]}}

def read_lines(summary: dict[str, Any], who: str) -> list[str]:
    """``stagefs status``'s lines for a ``holder_summary`` of ``who``'s reads: the totals,
    the origin's own reads and the hit rate, a table by holder, the FUSE pushes; with no
    sample read, only what was read of the origin (staging, streams: the lines after point
    here for it); none if nothing was read."""
    nbytes, fetched = summary["bytes"], summary["fetched"]
    if not summary["reads"]:
        if not fetched["reads"]:
            return []
        return [f"reads by holder ({who}): no samples read yet; read from the origin: "
                f"{format_size(fetched['bytes'])} in {fetched['reads']} reads (streams, "
                "staging)"]
    rows = [[h, v["reads"], format_size(v["bytes"]),
             f"{100 * v['bytes'] / nbytes:.1f}%" if nbytes else "-"]
            for h, v in summary["holders"].items()]
    # a compressed pack's samples are larger than what the origin gives for them: the hit
    # rate is of their stored bytes, which the line then shows beside the raw ones
    stored = summary.get("stored_bytes", nbytes)
    kind = "stored " if stored != nbytes else ""
    also = f" ({format_size(stored)} as stored, compressed)" if kind else ""
    out = [f"reads by holder ({who}): {summary['reads']} samples, {format_size(nbytes)}"
           f"{also}; read from the origin: {format_size(fetched['bytes'])} in "
           f"{fetched['reads']} reads (samples, streams, staging); hit rate "
           f"{100 * summary['hit_rate']:.1f}% (the {kind}bytes read that were not read from "
           "the origin)",
           table(["holder", "samples", "bytes", "share"], rows)]
    rows = [[d["origin"], d["reads"], format_size(d["bytes"]),
             format_size(d["fetched"]["bytes"]), f"{100 * d['hit_rate']:.1f}%"]
            for d in summary.get("datasets", []) if d["reads"]]
    if len(rows) > 1:  # a job reading several datasets (train, val): each apart
        out += ["reads by dataset (the stores of the API, torch, a FUSE mount):",
                table(["dataset", "samples", "bytes", "from the origin", "hit rate"], rows)]
    pushed = summary["pushed"]
    if pushed["reads"]:
        out.append(f"of these, pushed by a FUSE mount into the kernel's page cache as "
                   f"streamed: {pushed['reads']} samples, {format_size(pushed['bytes'])} "
                   "(counted when pushed: the kernel serves their reads)")
    return out


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
    made whole, bytes the streams and the reads wrote into partial copies, copies dropped;
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
    names: dict[str, str] = {}  # pack id -> its origin, for the reads by dataset
    # (a record a process left damaged counts what in it is a count, and no more)
    for rec in rt.stat_records():
        for path, counters in _obj(rec.get("tiers")).items():
            held = tiers.get(path)
            if held is not None:
                for k in _TIER_COUNTERS:
                    held[k] += _count(_obj(counters).get(k))
        name = rec.get("origin")
        name = name if isinstance(name, str) else "?"
        if isinstance(rec.get("pack_id"), str):
            names[rec["pack_id"]] = name
        o = origins.setdefault(name, {"origin": name, "misses": 0, "processes": 0,
                                      **dict.fromkeys(_ORIGIN_COUNTERS, 0)})
        o["misses"] += _count(rec.get("misses"))
        o["processes"] += 1
        for k in _ORIGIN_COUNTERS:
            o[k] += _count(_obj(rec.get("origin_stats")).get(k))
    by_dataset: dict[str, dict[str, int]] = {}
    total = read_counts(rt.stats, by_dataset=by_dataset)  # one pass: the job's, each dataset's
    datasets = [{"pack_id": pack_id,
                 "origin": names.get(pack_id, pack_id), **holder_summary(counts)}
                for pack_id, counts in sorted(by_dataset.items())]
    # a runtime given by path (--runtime, $STAGEFS_RUNTIME) may be any job's: not this shell's
    return {"runtime": rt.path, "job": None if rt.explicit else rt.job,
            "live_processes": len(rt.live_processes()),
            "tiers": list(tiers.values()), "origins": list(origins.values()),
            **holder_summary(total), "datasets": datasets,
            "stalls": stall_records(rt.path)}


def stall_lines(stalls: list[dict[str, Any]]) -> list[str]:
    """The data-stall table of ``stall_records`` for ``stagefs status`` (none: no lines)."""
    # rank: the launcher's or torch.distributed's; - for a process not told one (not "None")
    rows = [["-" if r.get("rank") is None else r["rank"], r.get("pid"), r.get("epoch"), r.get("mode") or "-", r.get("steps"),
             f"{r.get('wait_s', 0):.1f}", f"{r.get('step_s', 0):.1f}",
             f"{100 * r.get('stall', 0):.1f}%", f"{100 * r.get('steady_stall', 0):.1f}%"]
            for r in stalls]
    if not rows:
        return []
    # mode: the stagefs Sampler's, closed (MLPerf Storage CLOSED rules) or open; - for another
    return ["data stall (time each step waited for data), per training process and epoch:",
            table(["rank", "pid", "epoch", "mode", "steps", "waited s", "step s", "stall",
                   "stall after 1st batch"], rows)]


_STALL_IDS = ("pid", "rank", "epoch")
_STALL_FIGURES = ("steps", "wait_s", "step_s", "stall", "steady_stall")


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
        # a record being rewritten, torn or damaged is skipped: status is best effort
        rec = read_record(os.path.join(runtime, name)) or {}
        epochs = rec.get("epochs")
        for ep in epochs if isinstance(epochs, list) else []:
            if not isinstance(ep, dict):
                continue
            row = {"pid": rec.get("pid"), "rank": rec.get("rank"), **ep}
            if all(isinstance(row.get(k), int) or row.get(k) is None for k in _STALL_IDS) and \
                    all(isinstance(row.get(k, 0), int | float) for k in _STALL_FIGURES) and \
                    row.get("mode") in (None, "open", "closed"):
                rows.append(row)
    rows.sort(key=lambda r: (r.get("rank") or 0, r.get("pid") or 0, r.get("epoch") or 0))
    return rows
