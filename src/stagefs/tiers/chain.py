"""The tier chain: which holders a read asks (tiers fastest first, then the origin), and the
background placement of shards into the tiers. The only module that knows their order.

- ``holders(shard)``: the tiers holding the shard, then the origin. A held shard is answered
  from a dict (its fd is cached in the tier); a shard not held yet is re-checked on disk at
  most every ``RECHECK_S`` (one local ``open``, never an origin call), so a shard placed by
  another process is seen almost at once.
- Reads fill the tier as they pass (fill.py): every verified read from the origin also writes
  its bytes into the shard's shared partial copy, and any process then reads them from there.
  A shard whose files have all been read this way is complete without a copy.
- A miss also queues the shard for streaming (stream.py): the process's streams copy the
  shard's pieces in large sequential reads, several shards at once, in the order of the
  queue (a prefetch's order, else the order of first reads); a claim in the runtime dir
  makes the copy happen once per node. A read of a shard not whole yet asks the partial
  copies of every tier holding pieces of it (in tier order), then the stream: it waits for a
  file a stream has in flight and reads one nobody holds itself. So every origin byte is
  read once.
- Capacity, in pieces (fill.py): a piece goes into the first tier with room for it, and
  stays there; a tier that has no room for a piece takes no more (no eviction: the held set
  stays put, MONARCH's rule), so a tier of a piece or more holds its share and a shard may have
  pieces in several tiers. ENOSPC deletes that partial copy and stops the tier.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import functools
import logging
import multiprocessing.util as mp_util
import os
import resource
import shutil
import stat
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from stagefs._fsutil import file_lock, raise_fd_limit, remove_any
from stagefs.config import TierSpec, format_size
from stagefs.errors import ConfigError, CorruptShardError, DescriptorLimitError
from stagefs.format import KIND_FILE, Manifest
from stagefs.runtime import Runtime, alive, read_record
from stagefs.tiers import placer
from stagefs.tiers.base import (
    DESCRIPTORS,
    CopyLetGo,
    DamagedCopy,
    ShardSource,
    SourceUnavailable,
    pread_full,
    through,
)
from stagefs.tiers.claims import Claims
from stagefs.tiers.fill import (
    FILL_SUFFIX,
    PARTIAL_SUFFIX,
    Activity,
    Extents,
    ShardFill,
    copy_charge,
    create_fill,
    open_fill,
    placement_piece,
    remove_fill,
    runs_of,
    usual_piece,
    whole_charge,
)
from stagefs.tiers.placer import CopyAborted, Layout, OriginFailed, fill_gaps, finish_copy
from stagefs.tiers.status import RECORD_EVERY_S, new_record, write_record
from stagefs.tiers.stream import Stream
from stagefs.tiers.tier import (
    DirTier,
    check_fd_limit,
    dir_bytes,
    memory_limit_problem,
    over_capacity,
)

__all__ = ["RECHECK_S", "TIER_LOCK_WAIT_S", "NodePieces", "TierChain", "TiersBusy"]

log = logging.getLogger("stagefs.tiers")

RECHECK_S = 0.05  # how often a read re-checks whether a missing shard has landed
# how often a cluster reader looks again for its node's partial copies of a shard that it
# found none of (its daemon places them: at staging, in the overflow's rounds, for the dead)
PIECES_RECHECK_S = 1.0
# how often a read looks whether the whole copy of its shard is still in its tier (deleted
# from outside: ``rm``, a cleaner of /dev/shm, a tmp reaper): 2 stats a held shard
GONE_RECHECK_S = 1.0
IDLE_S = 0.01  # reads went to the origin less than this long ago: they are under way
CALM_S = 1.0  # reads stopped this long ago: the copy goes at full speed
GRACE_S = 0.25  # the copy leaves reads under way alone this long after it first has work
READERS_S = 0.05  # threads that read from the origin this recently count as reading now
PIECE_SIZE: int | None = None  # bytes per piece of placement; None: fill.placement_piece's
# the tiers' lock is held for microseconds (a millisecond for a piece's fallocate): waited
# this long, its holder is stopped (kill -STOP, Ctrl-Z, a debugger), not busy
TIER_LOCK_WAIT_S = 2.0


class TiersBusy(TimeoutError):
    """A tier's lock could not be had: another process (of this job or another using the
    tier) holds it and does not go on. What needed it is skipped (a reservation, a rename,
    a drop); reads go on."""

Record = Callable[[int, int], None]


Copy = tuple[ShardFill, DirTier]


class _FillSource:
    """The pieces in one tier's partial copies (fill.py), for shards not whole yet."""

    def __init__(self, chain: TierChain, tier: DirTier) -> None:
        self.tier = tier
        self.name = f"partial copy in {tier.name}"
        self.holder = tier.kind  # what the read counters call it
        self._chain = chain

    def pread(self, shard: int, offset: int, length: int) -> bytes:
        self._chain.in_shard(shard, offset, length)
        f = self._chain._copy_in(shard, self.tier)
        if f is None:
            raise SourceUnavailable("no partial copy")
        try:
            data = f.pread(offset, length)
        except DamagedCopy:
            self.drop(shard)  # cut short under us: placed anew
            raise
        self.tier.stats.hits += 1
        self.tier.stats.bytes += length
        return data

    def drop(self, shard: int) -> None:
        """A read found bad bytes in this partial copy: start it afresh."""
        self._chain._drop_fill(shard, self.tier)

    def close(self) -> None:
        pass


class NodePieces:
    """The pieces of this node's partial copies (fill.py), for a process that reads them
    but does not place them: a reader in cluster mode, whose node daemon places its tiers'
    copies and serves them (the pieces of a shard its tiers had room for in part, and those
    the overflow placed for the nodes before it), when it reads the peers directly
    (``STAGEFS_FABRIC=0``, or while its daemon does not answer). ``sources(shard)``: one
    holder per tier with a partial copy of ``shard``, which gives a range only where the
    copy holds all of it (its fill map says so), else raises SourceUnavailable: the next
    holder answers. A copy is opened once and kept; a shard with none is looked for again
    ``RECHECK_S`` later (``clock``); a copy found bad, or deleted, is let go of."""

    def __init__(self, manifest: Manifest, tiers: Sequence[DirTier],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.manifest = manifest
        self.tiers = list(tiers)
        self.clock = clock
        self._sizes = [s.size for s in manifest.shards]
        self._piece = PIECE_SIZE or placement_piece(manifest)
        self._layout: Layout | None = None
        self._fills: dict[tuple[int, int], ShardFill] = {}  # (tier, shard) ->
        self._next: dict[int, float] = {}  # shard -> when to look for its copies again
        self._bad: set[tuple[int, int]] = set()  # the (device, inode) of copies found bad
        self._lock = threading.Lock()  # (held for dict updates only)
        self._sources = [_PiecesIn(self, i, t) for i, t in enumerate(self.tiers)]
        _PIECES.add(self)

    def sources(self, shard: int) -> list[ShardSource]:
        """The holders of ``shard``'s pieces in this node's tiers, in tier order."""
        now = self.clock()
        if now >= self._next.get(shard, 0.0):
            self._next[shard] = now + PIECES_RECHECK_S
            self._look(shard)
        return [self._sources[i] for i in range(len(self.tiers)) if (i, shard) in self._fills]

    def fill(self, tier: int, shard: int) -> ShardFill | None:
        return self._fills.get((tier, shard))

    def _look(self, shard: int) -> None:
        if self._layout is None:
            self._layout = Layout(self.manifest)
        ext = None
        for i, t in enumerate(self.tiers):
            f = self._fills.get((i, shard))
            if f is not None and f.linked():
                continue
            if f is not None:  # finished (a whole copy now: the tier serves it) or deleted
                self.let_go(i, shard)
            if ext is None:
                ext = self._layout.extents(shard, self._sizes[shard], self._piece)
            try:
                new = open_fill(t.path(shard), self._sizes[shard], ext)
            except OSError:  # not ours to read (another user's tier), or gone meanwhile
                new = None
            if new is None:
                continue
            if new.ino in self._bad:
                new.close()
                continue
            with self._lock:
                old, self._fills[(i, shard)] = self._fills.get((i, shard)), new
            if old is not None:
                old.close()

    def let_go(self, tier: int, shard: int, *, bad: bool = False) -> None:
        """Read this copy no more (``bad``: not this file again, whoever reopens it)."""
        with self._lock:
            f = self._fills.pop((tier, shard), None)
        if f is not None:
            if bad:
                self._bad.add(f.ino)
            f.close()
        self._next.pop(shard, None)

    def forget_gone(self) -> None:
        """Let go of the copies no longer at their path (the daemons started again on
        emptied tiers, or made them whole): looked for again at the next read."""
        for (i, shard), f in list(self._fills.items()):
            if not f.linked():
                self.let_go(i, shard)

    def close(self) -> None:
        with self._lock:
            fills, self._fills = list(self._fills.values()), {}
        for f in fills:
            f.close()
        _PIECES.discard(self)

    def _after_fork(self) -> None:
        """In a forked child (a DataLoader worker): no thread of the parent reads here."""
        self._lock = threading.Lock()
        for f in self._fills.values():
            f.reset_after_fork()


class _PiecesIn:
    """The pieces of one tier's partial copies, as a holder (``NodePieces``)."""

    def __init__(self, pieces: NodePieces, index: int, tier: DirTier) -> None:
        self.name = f"partial copy in {tier.name}"
        self.holder = tier.kind  # what the read counters call it
        self._pieces = pieces
        self._index = index
        self._tier = tier

    def pread(self, shard: int, offset: int, length: int) -> bytes:
        f = self._pieces.fill(self._index, shard)
        if f is None:
            raise SourceUnavailable("no partial copy")
        try:
            data = f.pread(offset, length)
        except DamagedCopy:
            self.drop(shard)  # cut short: the daemon places it anew
            raise
        self._tier.stats.hits += 1
        self._tier.stats.bytes += length
        return data

    def drop(self, shard: int) -> None:
        """A read found bad bytes here: this process reads this copy no more (the daemon,
        whose own reads check what they serve, replaces it)."""
        self._pieces.let_go(self._index, shard, bad=True)

    def close(self) -> None:
        pass


def _one_directory_each(tiers: Sequence[DirTier]) -> None:
    """Refuse two tiers that are one directory by two paths (a symlink, a bind mount): each
    would count its own room in it and claim a piece the other holds, so the directory
    took both capacities. Told apart by device and inode, as the paths are not."""
    seen: dict[tuple[int, int], str] = {}
    for t in tiers:
        try:
            st = os.stat(t.root)
        except OSError:
            continue  # gone already: its first placement says so
        first = seen.setdefault((st.st_dev, st.st_ino), t.root)
        if first != t.root:
            raise ConfigError(f"tiers {first} and {t.root} are the same directory (a symlink "
                              "or a mount names it twice); name it once, with the capacity "
                              "it should have")


def _live_datasets(runtime: Runtime) -> dict[str, str]:
    """The datasets (pack id -> origin) a live process of this job, or of another job of
    the user on the node (``Runtime.neighbours``: they share tiers), has open: this
    process's stores, and the stats record of each store another process opened
    (``<pid>.<pack id>.<n>.json``, its pid alive, not written by its ``close``). Another
    job's dataset was said to be old copies, its directory to be deleted."""
    live = {c.pack_id: c.origin_path for c in list(_CHAINS) if not c._closing}
    for rt in [runtime, *runtime.neighbours()]:
        try:
            names = os.listdir(rt.stats)
        except OSError:
            continue
        for name in names:
            pid, _, rest = name.partition(".")
            pack_id = rest.partition(".")[0]
            if not name.endswith(".json") or not pid.isdigit() or pack_id in live \
                    or int(pid) == os.getpid() or not alive(int(pid)):
                continue
            rec = read_record(os.path.join(rt.stats, name)) or {}
            if rec.get("open") is False:  # closed by a process that goes on
                continue
            origin = rec.get("origin")
            live[pack_id] = origin if isinstance(origin, str) else pack_id
    return live


def _say_who_fills(t: DirTier, runtime: Runtime, origin: str) -> None:
    """``t`` is full: if other datasets' copies take most of it, say which. A dataset packed
    again has a new pack id, and the old one's copies stay (for the next job of it) until
    ``stagefs clean``: the tier was found full of them, and the new pack held none of its
    share, with no word why. So has a raw directory scanned again (a file changed in it;
    a new job's scan that finds the same files takes the old scan's id: inplace.py
    ``InPlaceCache.adopt``): the warning said only "packed again" of a dataset never
    packed. A dataset the job reads now (a train set that took the room before the val set
    came) is named apart, by its origin: the warning once told to delete its directory, the
    copies the job was reading."""
    others: list[tuple[int, str]] = []
    try:
        with os.scandir(t.root) as it:
            for e in it:
                # (another user's, in a tier root shared by users: not counted in this
                # user's room, nor theirs to delete; it was named, as 0 B, to be deleted)
                if e.name != t.pack_id and not e.name.startswith(".stagefs-") \
                        and e.is_dir(follow_symlinks=False) \
                        and e.stat(follow_symlinks=False).st_uid == os.getuid():
                    others.append((dir_bytes(e.path), e.name))
    except OSError:
        return
    theirs = sum(n for n, _ in others)
    if theirs <= dir_bytes(t.dir):
        return
    if t.room is not None and not _first_of_job(runtime, t, f"full-{t.pack_id}"):
        return  # said once for the job: not again by each DataLoader worker of each epoch
    live = _live_datasets(runtime)
    read = sorted((n, live[name]) for n, name in others if name in live)
    old = sorted((n, os.path.join(t.root, name)) for n, name in others if name not in live)
    if read:
        log.warning("%s is full, %s of it with the copies of other datasets read now (by "
                    "this job or another of yours): %s. A tier's room goes to the datasets "
                    "placed in it first come, and what they hold stays; to keep a share for "
                    "%s, give each dataset a tier directory of its own with the capacity it "
                    "should have",
                    t.name, format_size(sum(n for n, _ in read)), _sizes_named(read),
                    origin)
    if old:
        log.warning("%s is full, %s of it with other datasets' copies: %s. A dataset packed "
                    "again, or a raw directory scanned again (a file of it changed since its "
                    "scan), has a new id and its old copies stay until 'stagefs clean' (of "
                    "the job that staged them); delete a directory no job reads any more to "
                    "give this dataset its share",
                    t.name, format_size(sum(n for n, _ in old)), _sizes_named(old))


def _say_over_capacity(t: DirTier, runtime: Runtime) -> None:
    """``t`` holds more than its capacity (kept from a run given more room, or other
    datasets' copies): say so, once for the job and capacity. Nothing is evicted, so a job
    restarted with a smaller capacity (to free the disk for checkpoints) kept every copy
    and went on reading them, with no word that the tier was over what it was given."""
    why = over_capacity(t.used_bytes(), t.capacity)
    if why is None:
        return
    if t.room is not None and not _first_of_job(runtime, t, f"over-{t.capacity}"):
        return  # said once for the job: not again by each DataLoader worker
    log.warning("%s %s (%s of it this dataset's, in %s)", t.name, why,
                format_size(dir_bytes(t.dir)), t.dir)


def _first_of_job(runtime: Runtime, t: DirTier, what: str) -> bool:
    """Is this the job's first process to do ``what`` about tier ``t`` (say a warning,
    count its room anew)? A marker file is made once, in the runtime's claims."""
    assert t.room is not None
    marker = os.path.join(runtime.claims, f"room-{t.room.key}.{what}")
    try:
        os.close(os.open(marker, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600))
    except FileExistsError:
        return False
    except OSError:
        pass  # the runtime dir gone or damaged: say it anyway
    return True


def _sizes_named(items: list[tuple[int, str]]) -> str:
    """The three largest of (bytes, name), named with their sizes, and how many more."""
    items = sorted(items, reverse=True)
    named = ", ".join(f"{name} ({format_size(n)})" for n, name in items[:3])
    return named + (f" and {len(items) - 3} more" if len(items) > 3 else "")


class TierChain:
    """Tiers in order for one dataset, and the placement of its shards into them."""

    def __init__(self, manifest: Manifest, origin: ShardSource, specs: Sequence[TierSpec],
                 runtime: Runtime, *, origin_path: str, record: Record | None = None,
                 clock_ns: Callable[[], int] = time.monotonic_ns) -> None:
        self.manifest = manifest
        self.origin = origin
        self.runtime = runtime
        self.origin_path = origin_path
        self.pack_id = manifest.pack_id.hex()
        self.tiers = [DirTier(s, manifest, counted=True) for s in specs]
        _one_directory_each(self.tiers)
        self._piece = piece = PIECE_SIZE or placement_piece(manifest)
        self._usual_piece = usual_piece(manifest, piece)
        for t in self.tiers:
            t.on_drop = functools.partial(self._dropped, t)
            t.charges = functools.partial(self._charges, t)
            least = piece + 2 * t.block  # a piece, and a copy's header and fill map blocks
            if t.capacity is not None and t.capacity < least:
                log.warning("%s: its capacity (%s) is less than one piece of placement "
                            "(%s) and its copy's header (%s): it will hold little or "
                            "nothing; give it %s or more, or leave it out", t.name,
                            format_size(t.capacity), format_size(piece),
                            format_size(2 * t.block), format_size(2 * piece))
            if t.kind == "memory" and (why := memory_limit_problem(
                    t.root, t.capacity, t.used_bytes())):
                log.warning("%s", why)
        runtime.record_tiers(self.pack_id, [t.root for t in self.tiers])
        self.claims = Claims(runtime.claims, self.pack_id)
        # the pace's clock (monotonic, shared by the node's processes); tests pass another
        self._clock_ns = clock_ns
        self.activity = Activity(os.path.join(runtime.claims, f"{self.pack_id}.activity"),
                                 clock_ns)
        self._record = record
        self._sizes = [s.size for s in manifest.shards]
        self._layout: Layout | None = None
        self._origin_only: tuple[ShardSource, ...] = (origin,)
        self._fill_src = {id(t): _FillSource(self, t) for t in self.tiers}
        self._order = {id(t): i for i, t in enumerate(self.tiers)}
        self._fills: dict[int, list[Copy]] = {}  # shard -> its partial copies, in tier order
        self.stream = Stream(self)  # the cold pipeline (stream.py)
        self._extents: dict[int, Extents] = {}
        self._no_fill: set[int] = set()  # shards whose files do not tile them (never seen)
        self._route: dict[int, tuple[ShardSource, ...]] = {}
        self._next_check: dict[int, float] = {}
        self.clock: Callable[[], float] = time.monotonic  # (tests set another)
        self._still_at: dict[int, float] = {}  # shard -> when its copy is next looked at
        self._queued: set[int] = set()
        # the first shard a read missed and its file's directory, until a plan (prefetch, or
        # _plan_rest's) is made; then the directory _plan_rest's plan covers (0: the root)
        self._first_miss: tuple[int, int] | None = None
        self._scope: int | None = None
        self._planned = False
        self._failed: set[int] = set()
        self._unusable: set[str] = set()  # partial copies _look found cut short or without a map
        self.misses = 0
        self.corrupt = 0  # files that failed their checksum while copied into a tier
        self.full = not self.tiers
        self._closing = False
        # a Store reads through it and closes it (at exit too: store.py) once the reads
        # under way are done; the exit hook below closes only the others (a node daemon's)
        self.closed_by_store = False
        self._init_threading()
        self._count_rooms()
        raise_fd_limit()  # one fd per held shard (two mapped), the origin's a quarter
        self._share_descriptors()
        check_fd_limit(self._may_hold(), any(t.kind == "memory" for t in self.tiers),
                       "its tiers'")
        _CHAINS.add(self)
        _flush_at_exit()
        # its origin listed from the start, with what opening it cost (an in-place scan):
        # written otherwise only once it streams or places, a DataLoader's main process
        # (its workers read) was missing from `stagefs status` until it closed
        self.flush_stats()

    def _count_rooms(self) -> None:
        """The job's first process to use a tier counts its room anew from what it holds
        (Room): the counter, kept in the tier across jobs, still counted copies deleted since
        (``stagefs clean``, ``rm -rf TIER/*``) and said the tier over its capacity. So does
        the job's first process to find the counter over a capacity: the job run again (the
        same id: ``stagefs stage`` twice in one shell) after ``rm -rf TIER/*`` was told that
        the empty tier held more than it was given. Then said if it is (once for the job)."""
        for t in self.tiers:
            if _first_of_job(self.runtime, t, "counted") or (
                    over_capacity(t.used_bytes(), t.capacity)
                    and _first_of_job(self.runtime, t, f"counted-{t.capacity}")):
                with contextlib.suppress(OSError, TiersBusy), self._tier_lock():
                    assert t.room is not None
                    t.room.recount(self._charges(t))
            _say_over_capacity(t, self.runtime)

    def _init_threading(self) -> None:
        self._cond = threading.Condition()
        # held while this process's list of a shard's partial copies changes: a look (which
        # rebuilds it from the tiers) must not drop a copy another thread has just made
        self._fills_lock = threading.RLock()
        self._grace_until: float | None = None
        self._lock_stuck = False  # the tiers' lock was not had in TIER_LOCK_WAIT_S
        self._stats_path = new_record(self.runtime.stats, self.pack_id)
        self._stats_at = 0.0
        # one writer of them at a time: a count taken before another thread's, renamed
        # after it, would put older counts back
        self._stats_lock = threading.Lock()

    # -- the read path ----------------------------------------------------------------------

    def holders(self, shard: int, entry: int = -1) -> tuple[ShardSource, ...]:
        """``entry``: the file read, if told (its directory scopes ``_plan_rest``'s plan).
        The whole copy a held shard is read from is looked at, at most every
        ``GONE_RECHECK_S``, to be still in its tier (``DirTier.still_held``); deleted from
        outside, the shard is read and placed again as in a first epoch (``_gone``)."""
        route = self._route.get(shard)
        if route is not None:
            now = self.clock()
            if now < self._still_at.get(shard, 0.0):
                return route
            self._still_at[shard] = now + GONE_RECHECK_S
            t = route[0]
            if not isinstance(t, DirTier) or t.still_held(shard):
                return route
            self._gone(shard, t)
        return self._miss(shard, entry)

    def _gone(self, shard: int, t: DirTier) -> None:
        """The whole copy of ``shard`` this process read in ``t`` is no longer there
        (deleted from outside: ``rm``, a cleaner of /dev/shm; or replaced): its descriptor
        and mapping are let go of, its shard placed again as reads miss it, and the room of
        ``t`` counted anew (under the tiers' lock: ``Room.recount`` is the same whichever
        of the node's processes notices first). Held open, a deleted copy's pages stayed
        allocated for the process's life, its reads were served from it, its shard was
        never placed again and the room went on counting it."""
        t.forget(shard)
        self._route.pop(shard, None)
        self._next_check.pop(shard, None)
        self._still_at.pop(shard, None)
        with self._cond:
            self._queued.discard(shard)
        log.info("%s: the copy of shard %d was deleted from outside; read from the origin "
                 "and placed again", t.name, shard)
        self._recount(t)

    def _recount(self, t: DirTier) -> None:
        """Count the room of ``t`` anew from its directory, a copy having gone from it that
        no process of the job let go of (deleted from outside): under the tiers' lock
        (``Room.recount`` is the same whichever of the node's processes notices first); a
        tier that was full takes pieces again if room was freed."""
        if t.room is None or not t.present():
            return  # (its directory removed: placement into it stops, status says why)
        with contextlib.suppress(OSError, TiersBusy), self._tier_lock():
            before = t.room.used()
            if t.room.recount(self._charges(t)) < before:
                self._freed(t)

    def _miss(self, shard: int, entry: int) -> tuple[ShardSource, ...]:
        self.activity.touch()  # a read may go to the origin now: place() gives way
        now = time.monotonic()
        if now >= self._next_check.get(shard, 0.0):
            if self._find(shard):
                return self._route[shard]
            self._next_check[shard] = now + RECHECK_S
            if self._look(shard) and self._find(shard):
                # made whole (by another process) since _find looked: with no copy and no
                # route the read would go to the origin for bytes a tier holds
                return self._route[shard]
            for f, t in list(self._fills.get(shard, ())):
                if f.complete() and self._finish(shard, f, t):
                    # complete but never made whole: the process that filled it last ended
                    # first (a DataLoader worker leaves with os._exit, its stream mid-copy)
                    return self._route[shard]
            if self.claims.let_go(shard) and shard not in self._failed:
                # the process that streamed it ended mid-shard (killed, or closed): its
                # pieces not in yet stream from here (tiers full or not: they are
                # reserved), not in the readers' small reads for the rest of the epoch
                with self._cond:
                    self._queued.add(shard)
                self.stream.enqueue([shard], urgent=True)
        elif shard not in self._fills:
            # a partial copy another process started: looked for on every miss (a failed
            # open() per tier when there is none, against a read from the origin; a process
            # forked while a read-ahead filled the first batches read them again otherwise)
            self._look(shard)
        if self._unusable:
            self._clear_unusable(shard)
        if shard not in self._queued and not self.full:
            self._enqueue([shard], urgent=True)
            self._plan_rest(shard, entry)
        copies = self._fills.get(shard)
        if not copies and shard in self._route:
            # made whole meanwhile by a stream thread (_finish routes it, then lets the
            # partial copy go): the tier, not the origin, holds its bytes
            return self._route[shard]
        if shard in self._no_fill or (self.full and not copies):
            return self._origin_only
        # the pieces each tier holds, then the stream (it waits for or reads what a copy
        # has reserved, or reserves it), then the origin: the stream can always refuse
        return (*(self._fill_src[id(t)] for _, t in copies or ()), self.stream.source,
                self.origin)

    # -- filling the tiers as reads pass ---------------------------------------------------

    def from_origin(self, shard: int, offset: int, data: bytes | memoryview,
                    verified: bool) -> None:
        """The Store read ``data`` from the origin at ``offset`` of the shard: one stored file,
        or checksum pieces of a large raw one. If it was verified, each extent wholly in it
        goes into the partial copy holding its piece, the piece reserved now in the first
        tier with room if no copy holds it yet."""
        self.misses += 1
        self.activity.touch()
        if not verified or self._closing or shard in self._route or shard in self._no_fill:
            return
        ext = self._extents_of(shard)
        if not ext.tiles:
            self._no_fill.add(shard)
            return
        end = offset + len(data)
        lo, hi = ext.inside(offset, end)
        if hi <= lo or ext.offs[lo] != offset:
            return
        view = memoryview(data)
        pieces = range(int(ext.piece[lo]), int(ext.piece[hi - 1]) + 1)
        missing = [p for p in pieces if self._owner(shard, p) is None]
        if missing and not self.full and self.may_copy(shard):
            self._reserve(shard, missing)
        for p in pieces:
            got = self._owner(shard, p)
            if got is None:
                continue
            f, t = got
            i, j = max(lo, int(ext.pstart[p])), min(hi, int(ext.pstart[p + 1]))
            a, b = int(ext.offs[i]), int(ext.ends[j - 1])
            try:
                new = f.write(a, view[a - offset : b - offset])
            except OSError as exc:
                self._drop_fill(shard, t, again=False)
                self._tier_failed(t, exc)
                return
            except ValueError:  # closed under us (the store is closing)
                return
            if new:
                t.stats.filled += new
                t.stats.filled_bytes += b - a
                if f.complete():
                    self._finish(shard, f, t)
                    return

    def _extents_of(self, shard: int) -> Extents:
        ext = self._extents.get(shard)
        if ext is None:
            if self._layout is None:
                self._layout = Layout(self.manifest)
            ext = self._extents[shard] = self._layout.extents(shard, self._sizes[shard],
                                                              self._piece)
        return ext

    def _copy_in(self, shard: int, tier: DirTier) -> ShardFill | None:
        for f, t in self._fills.get(shard, ()):
            if t is tier:
                return f
        return None

    def piece_spans(self, shard: int) -> list[tuple[int, int]]:
        """The byte range [start, end) in the shard of each of its pieces (none if its files
        do not tile it: it is not placed)."""
        ext = self._extents_of(shard)
        if not ext.tiles:
            return []
        return [ext.span(p) for p in range(ext.pieces)]

    def file_bytes(self, shard: int) -> int:
        """The stored bytes of the shard's files: what a whole copy holds of them."""
        ext = self._extents_of(shard)
        return int((ext.ends - ext.offs).sum())

    def partial_copies(self, shard: int) -> list[ShardFill]:
        """This process's handles on the shard's partial copies, in tier order (none once
        it is whole): a server of what the tiers hold (the cluster daemon, whose staging
        made them) reads the pieces they have (``ShardFill.covered``, ``pread``)."""
        return [f for f, _ in self._fills.get(shard, ())]

    def may_copy(self, shard: int) -> bool:
        """May a read reserve pieces of the shard now? Not where that makes a new partial
        copy with the descriptors the process's tier copies may hold (``Descriptors``) all
        taken: the read is served by the origin, and the shard placed by its stream, or a
        later read, once copies are made whole."""
        return shard in self._fills or DESCRIPTORS.room() > DESCRIPTORS.COPY

    def _owner(self, shard: int, p: int) -> Copy | None:
        """The partial copy (known to this process) where piece ``p`` is reserved."""
        for f, t in self._fills.get(shard, ()):
            if f.res[p]:
                return f, t
        return None

    def _copies_to_fill(self, shard: int, first: int | None = None,
                        pieces: Iterable[int] | None = None) -> list[Copy] | None:
        """Every piece of the shard reserved (where room allows, in piece order), or its
        ``first`` pieces (a stream reserves the rest as it goes), or those of ``pieces``,
        and the partial copies holding them, in tier order: what a stream or ``place``
        copies into. None if its files do not tile it (it is not placed); [] if it is whole
        or no tier has room for any piece of it. The caller holds the shard's claim."""
        ext = self._extents_of(shard)
        if not ext.tiles:
            self._no_fill.add(shard)
            self._failed.add(shard)
            log.warning("shard %d not placed: its files do not tile it", shard)
            return None
        self._look(shard)
        last = ext.pieces if first is None else min(first, ext.pieces)
        want = range(last) if pieces is None else sorted(p for p in set(pieces) if 0 <= p < last)
        todo = [p for p in want if self._owner(shard, p) is None]
        if (todo or shard not in self._fills) and not self.full:
            self._reserve(shard, todo)
        if self._find(shard):
            return []
        return list(self._fills.get(shard, ()))

    def _look(self, shard: int) -> bool:
        """The shard's partial copies as the tiers name them now: a handle whose copy
        another process (or thread) finished or dropped is let go, the copies others made
        are opened. True if a handle was let go: the shard may be whole now."""
        gone = False
        lost: list[DirTier] = []  # tiers a copy went from unfinished and not dropped here
        with self._fills_lock:
            ext = self._extents_of(shard)
            if not ext.tiles:
                self._no_fill.add(shard)
                return False
            keep: list[Copy] = []
            dead: list[ShardFill] = []  # let go of once out of the list readers look at
            for f, t in self._fills.get(shard, ()):
                if f.linked():
                    keep.append((f, t))
                else:
                    gone = True
                    dead.append(f)
                    if not os.path.exists(f.final) and not any(t is u for u in lost):
                        lost.append(t)
            for t in self.tiers:
                if not any(t is u for _, u in keep):
                    try:
                        opened = open_fill(t.path(shard), self._sizes[shard], ext,
                                           self._unusable)
                    except OSError as exc:  # out of descriptors (ulimit -n), an I/O error
                        # the copy there is not this process's to use, nor to make anew (a
                        # new one replaces it): placement into the tier stops, reads go on
                        if t.stopped is None:
                            self._tier_failed(t, exc)
                        continue
                    if opened is not None:
                        keep.append((opened, t))
            if keep:
                keep.sort(key=lambda c: self._order[id(c[1])])
                self._fills[shard] = keep
            else:
                self._fills.pop(shard, None)
            for f in dead:
                self._let_go(shard, f)
        # not finished: dropped by another process (which freed its room), or deleted from
        # outside (``rm``, a cleaner of /dev/shm), which nothing counted: its room stayed
        # counted, a full tier never took a piece again (its directory, counted anew, is
        # right either way; the lock is not taken under the fills' lock)
        for t in lost:
            self._recount(t)
        return gone

    def room_for(self, nbytes: int) -> bool:
        """Have the tiers room for ``nbytes`` more, as their counters and file systems say
        now? (No lock: a hint for how a stream reserves, not a reservation.)"""
        free = 0
        for t in self.tiers:
            if t.stopped is not None:
                continue
            with contextlib.suppress(OSError):
                st = os.statvfs(t.root)
                left = st.f_bavail * st.f_frsize
                if t.capacity is not None:
                    left = min(left, t.capacity - t.used_bytes())
                free += max(0, left)
        return free >= nbytes

    def _reserve(self, shard: int, pieces: Sequence[int]) -> dict[int, Copy]:
        """The copy holding each of these pieces: where one holds it already, else reserved
        now in the first tier with room, in this order, until no tier has room (a piece of
        one file larger than a piece that fits nowhere is passed over: the tiers keep room
        for the smaller ones after it). None of them if the shard is whole somewhere."""
        out: dict[int, Copy] = {}
        try:
            with self._tier_lock(), self._fills_lock:
                # looked for again under the lock, in every tier: another process may have
                # reserved a piece (or finished the shard) since, in a tier this one counts
                # as full; a piece reserved twice would be placed twice
                if any(self._whole_in(t, shard) for t in self.tiers):
                    return out  # whole already: the next look finds it
                self._look(shard)
                for t in self.tiers:  # the partial copies the look found unusable
                    if t.path(shard) in self._unusable and self._copy_in(shard, t) is None:
                        self._unusable.discard(t.path(shard))
                        self._leftover(t, shard)
                if not self._extents_of(shard).pieces and shard not in self._fills:
                    self._reserve_one(shard, None)  # no file with bytes: the header alone
                pieces = self._reserve_all(shard, pieces, out)
                for p in pieces:
                    got = self._owner(shard, p) or self._reserve_one(shard, p)
                    if got is None:
                        if self.full:
                            break
                        continue  # a large piece no tier has room for: the next may fit
                    out[p] = got
        except TiersBusy:
            pass  # nothing reserved: the reads go to the origin until the lock is free
        except OSError as exc:  # the lock file cannot be had (the runtime dir was removed)
            for t in self.tiers:
                if t.stopped is None:
                    self._tier_failed(t, exc)
            self._set_full()
        return out

    def _reserve_all(self, shard: int, pieces: Sequence[int], out: dict[int, Copy]
                     ) -> Sequence[int]:
        """Reserve the pieces no copy holds in the first tier taking pieces, in one count of
        its room and one allocation for each run of consecutive pieces, if they all fit
        there (as ``_reserve_one`` would one after the other: it counts the room and makes
        an allocation for each, 0.5 ms a piece, a quarter of the CPU a cold epoch's streams
        used); those held go into ``out``. Returns the pieces left to reserve one by one
        (all of them where they do not all fit: ``_reserve_one`` says why, and goes on in
        the next tier). The caller holds both locks."""
        todo = []
        for p in pieces:
            got = self._owner(shard, p)
            if got is None:
                todo.append(p)
            else:
                out[p] = got
        t = next((t for t in self.tiers if t.stopped is None), None)
        if len(todo) < 2 or t is None:
            return todo
        ext = self._extents_of(shard)
        f = self._copy_in(shard, t)
        held = np.zeros(ext.pieces, bool) if f is None else f.res.astype(bool)
        before = ext.charged(held, t.block)
        held[todo] = True
        size = ext.charged(held, t.block) - before
        header = copy_charge(ext, t.block) if f is None else 0
        if t.no_room(size + header) is not None or (t.room is not None and t.room.full()):
            return todo  # one by one: the pieces that still fit, and why the rest do not
        runs = runs_of(np.sort(np.asarray(todo, np.int64)))
        done: list[int] = []
        made = f is None
        try:
            if f is None:
                f = self._make_copy(shard, t, header)
            for p, q in runs:
                f.reserve(p, q)
                done.extend(range(p, q))
        except OSError:  # (ENOSPC under the count: _reserve_one meets it again, and says so)
            if made and f is not None and not done:
                self._unmake_copy(shard, t, header)
        if done:
            assert f is not None
            if len(done) < len(todo):
                size = ext.charged(f.res.astype(bool), t.block) - before
            self._room(t, size)
            t.stats.pieces += len(done)
            for p in done:
                out[p] = (f, t)
        return [p for p in todo if p not in out]

    def _whole_in(self, t: DirTier, shard: int) -> bool:
        """Is the shard whole in ``t``? A file under its name whose size is wrong (cut
        short: nothing renames a wrong one into place) is deleted and its room freed. The
        caller holds the tiers' lock."""
        path = t.path(shard)
        try:
            info = os.stat(path)
            if stat.S_ISDIR(info.st_mode):  # damage (no copy is one): it stopped placement
                log.warning("%s: a directory where shard %d's copy goes (a damaged tier); "
                            "removed, the shard to be placed anew", path, shard)
                remove_any(path)  # (a symlink to one: the link)
                return False
            size = info.st_size
            if size == self._sizes[shard]:
                return True
            os.unlink(path)
        except FileNotFoundError:
            return False
        log.warning("%s: %d bytes, shard %d has %d (%s); deleted, to be placed anew", path,
                    size, shard, self._sizes[shard],
                    "cut short" if size < self._sizes[shard] else "not this shard's copy")
        self._room(t, -whole_charge(self._extents_of(shard), t.block))
        t.forget(shard)
        t.stats.dropped += 1
        return False

    def in_shard(self, shard: int, offset: int, length: int) -> None:
        """Refuse a range that is not inside the shard (every holder of the chain)."""
        if not 0 <= shard < len(self._sizes) or offset < 0 or length < 0 or \
                offset + length > self._sizes[shard]:
            raise SourceUnavailable(f"no range [{offset}, {offset + length}) in shard {shard}")

    def _clear_unusable(self, shard: int) -> None:
        """Delete the partial copies of the shard ``_look`` found unusable (a read meets
        them; the tiers may be full, so no reservation would), then place it anew."""
        finals = {t.path(shard) for t in self.tiers} & self._unusable
        if not finals:
            return
        self._unusable -= finals
        done = False
        with contextlib.suppress(OSError), self._tier_lock():
            for t in self.tiers:
                if t.path(shard) in finals and self._copy_in(shard, t) is None:
                    done |= self._leftover(t, shard)
        if done:
            with self._cond:
                self._queued.discard(shard)

    def _leftover(self, t: DirTier, shard: int) -> bool:
        """A partial copy no process can use (cut short, its fill map gone or of an earlier
        version) is deleted, and the bytes it holds freed (the caller holds the tiers' lock;
        ``_look`` found no usable copy in ``t``). True if one was."""
        partial = t.path(shard) + PARTIAL_SUFFIX
        usable = open_fill(t.path(shard), self._sizes[shard], self._extents_of(shard))
        if usable is not None:  # made meanwhile by another process (under the lock)
            usable.close()
            return False
        try:
            held = os.stat(partial).st_blocks * 512
        except FileNotFoundError:
            return False
        log.warning("%s: a partial copy that cannot be used; deleted", partial)
        remove_fill(t.path(shard))
        self._room(t, -held)
        t.stats.dropped += 1
        return True

    def _reserve_one(self, shard: int, p: int | None) -> Copy | None:
        """Reserve piece ``p`` in the first tier with room (the caller holds both locks);
        None: only make a copy of the shard there."""
        ext = self._extents_of(shard)
        for t in self.tiers:
            if t.stopped is not None:
                continue
            f = self._copy_in(shard, t)
            made = f is None
            # in whole blocks of the tier's file system (Extents.charged)
            size = 0
            if p is not None:
                size = ext.added(None if f is None else f.res, p, t.block)
            header = copy_charge(ext, t.block) if made else 0
            small = self._usual_piece
            try:
                need = size + header
                why = t.no_room(need)
                found = t.room.full() if why is None and t.room is not None else 0
                if found:
                    # another process of the node found no room there for ``found`` bytes:
                    # full here too while they do not fit (no_room counts anew: copies
                    # deleted from outside free it). A process that took it as full reads
                    # the pieces no copy holds from the origin, unreserved; one that went on
                    # reserving the smaller pieces still fitting streamed some of those
                    # bytes again (a 3 MiB tier, 46 MB read by three processes)
                    why = t.no_room(max(need, found))
                    if why is None and t.room is not None:
                        t.room.set_full(0)
                if why is not None:
                    # a piece ends with the file its window ends in (up to a piece and a
                    # file; a large file's piece by piece): one larger than a piece is
                    # passed over while a piece still fits, and the tier takes the smaller
                    # ones after it, to within a piece of its capacity
                    if size > small and t.no_room(small + header) is None:
                        continue
                    t.stopped = why
                    if why == "full" and t.room is not None:
                        # for every process of the node (above)
                        t.room.set_full(max(found, min(need, small + header)))
                    if why == "full" or t.capacity is None:  # what it was given: as asked
                        log.info("%s: %s; it takes no more pieces", t.name, why)
                        if why == "full":
                            _say_who_fills(t, self.runtime, self.origin_path)
                    else:  # short of its capacity: the user asked for room it does not have
                        log.warning("%s: its file system is full with %s of the %s asked "
                                    "of it; it takes no more pieces, reads go on (free "
                                    "space there, or give it a capacity it can hold)",
                                    t.name, format_size(t.used_bytes()),
                                    format_size(t.capacity))
                    continue
                if f is None:
                    f = self._make_copy(shard, t, header)
                if p is not None:
                    f.reserve(p)
            except OSError as exc:
                if made and f is not None:
                    self._unmake_copy(shard, t, header)
                self._tier_failed(t, exc)
                continue
            self._room(t, size)
            t.stats.pieces += p is not None
            return f, t
        if all(t.stopped is not None for t in self.tiers):
            self._set_full()
        return None

    def _make_copy(self, shard: int, t: DirTier, header: int) -> ShardFill:
        """Create the shard's partial copy in ``t``, no piece reserved, and count its
        ``header`` (copy_charge); the caller holds both locks."""
        f = create_fill(t.path(shard), self._sizes[shard], self._extents_of(shard), shard,
                        self.manifest.pack_id)
        # a new list, set whole: sorted in place, the list a reader looks at (``_owner``,
        # without the lock) is empty while the sort runs (CPython's list.sort), and a read
        # then found no copy of the shard and read the origin for bytes a stream brought
        self._fills[shard] = sorted([*self._fills.get(shard, ()), (f, t)],
                                    key=lambda c: self._order[id(c[1])])
        self._room(t, header)
        return f

    def _unmake_copy(self, shard: int, t: DirTier, header: int) -> None:
        """Delete the copy ``_make_copy`` made when none of its pieces could be reserved
        (ENOSPC, EDQUOT): a copy with no piece is not left behind (``stagefs status`` would
        count the shard held in part there), nor its header counted."""
        remove_fill(t.path(shard))
        self._room(t, -header)
        self._forget_fill(shard, t)

    def _room(self, t: DirTier, n: int) -> None:
        """Count ``n`` more bytes held in ``t`` (the caller holds the tiers' lock). Bytes
        freed (a corrupt copy dropped) open a tier that was full again: the shard dropped
        is placed anew there."""
        if t.room is not None:
            t.room.add(n)
        if n < 0:
            self._freed(t)

    def _freed(self, t: DirTier) -> None:
        """Room was freed in ``t`` (the caller holds the tiers' lock): a tier found full
        takes copies again."""
        if t.room is not None and t.room.full():
            t.room.set_full(0)
        t.recounted = False  # full again later: counted anew once more (no_room)
        if t.stopped == "full":
            t.stopped = None
            if self.full and self.tiers:
                self.full = False

    def _charges(self, t: DirTier) -> int:
        """This dataset's copies in ``t`` as reservations charge them (whole_charge, and
        _charged for a partial copy in use), less the bytes they are allocated: what
        ``Room.recount`` adds to the allocated bytes of the tier directory so that a room
        counted anew frees what a drop of them frees (the caller holds the tiers' lock)."""
        adjust = 0
        try:
            with os.scandir(t.dir) as it:
                names = {e.name: e for e in it}
        except OSError:
            return 0
        for name, e in names.items():
            shard = t.index_of(name)
            with contextlib.suppress(OSError):
                if shard is not None:  # a whole copy (one of the wrong size: as allocated)
                    if e.stat().st_size == self._sizes[shard]:
                        adjust += whole_charge(self._extents_of(shard), t.block) - _allocated(e)
                    continue
                shard = t.index_of(name.removesuffix(PARTIAL_SUFFIX))
                fmap = names.get(name.removesuffix(PARTIAL_SUFFIX) + FILL_SUFFIX)
                if not name.endswith(PARTIAL_SUFFIX) or shard is None or fmap is None:
                    continue
                f = open_fill(t.path(shard), self._sizes[shard], self._extents_of(shard))
                if f is not None:  # one that cannot be used: as allocated
                    try:
                        adjust += self._charged(f, t) - _allocated(e) - _allocated(fmap)
                    finally:
                        f.close()
        return adjust

    def _charged(self, f: ShardFill, t: DirTier) -> int:
        """What partial copy ``f`` in ``t`` is counted in its room: its pieces and itself."""
        return f.reserved_bytes(t.block) + copy_charge(f.ext, t.block)

    def _set_full(self) -> None:
        self.full = True
        self.stream.clear()

    def _finish(self, shard: int, f: ShardFill, t: DirTier) -> bool:
        """A complete partial copy becomes the shard's copy (once, under the tiers' lock).
        With the lock stuck it stays complete, and the next read that re-checks the shard
        renames it (_miss)."""
        try:
            with self._tier_lock():
                if not f.linked() or not f.complete():
                    return False
                try:
                    finish_copy(f, shard, self.manifest.pack_id, self._sizes[shard])
                except CopyLetGo:  # (another thread's doing: it has the copy in hand)
                    return False
                except (CorruptShardError, OSError) as exc:
                    log.warning("shard %d: partial copy not kept: %s", shard, exc)
                    remove_fill(f.final)
                    self._room(t, -self._charged(f, t))
                    self._forget_fill(shard, t)
                    return False
                # counted as it was (every piece and the copy: whole_charge, what its drop
                # frees)
        except TiersBusy:
            return False
        try:
            with f.descriptor() as held:
                fd = os.dup(held)
        except (OSError, ValueError):  # closing: the tier opens the copy when it reads it
            fd = -1
        if fd >= 0 and not t.adopt(shard, fd):
            os.close(fd)
        # routed before the partial copy is let go: a read between the two would find
        # neither, and (the tiers full) go to the origin for bytes a tier holds
        self._route[shard] = (t, self.origin)
        self._still_at[shard] = self.clock() + GONE_RECHECK_S
        self._forget_fill(shard)
        t.stats.placed += 1
        t.stats.placed_bytes += self._sizes[shard]
        # written now, not within the second: a process killed (SIGKILL, the OOM killer: a
        # FUSE server) never writes them again, and `stagefs status` said 0 placed for the
        # shards it made whole for the rest of the job
        self.flush_stats()
        return True

    def _forget_fill(self, shard: int, tier: DirTier | None = None) -> None:
        """Let go of the shard's partial copy in ``tier`` (every tier: None). The list a
        reader looks at (``_owner``, without the lock) is replaced whole, never emptied
        first: popped, then set again, a read between the two found no copy of the shard
        (the tiers full: "no tier has room for its piece") and read from the origin bytes
        a stream was bringing into the other tier's copy; and the handles are closed once
        out of it."""
        with self._fills_lock:
            copies = self._fills.get(shard, [])
            keep = [c for c in copies if tier is not None and c[1] is not tier]
            if keep:
                self._fills[shard] = keep
            else:
                self._fills.pop(shard, None)
            for f, t in copies:
                if tier is None or t is tier:
                    self._let_go(shard, f)

    def _share_descriptors(self) -> None:
        """Share the open-file limit (raised): a quarter for the origin's shards (a Store
        without tiers gives them three), the rest for the tiers' copies (``Descriptors``)
        and the process's own."""
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        limit_open = getattr(self.origin, "limit_open", None)
        if soft != resource.RLIM_INFINITY and limit_open is not None and self.tiers:
            limit_open(max(16, soft // 4))

    def _may_hold(self) -> int:
        """How many shards the tiers may come to hold, by their capacities (or free space)
        and the shards' mean size."""
        sizes, n = self._sizes, len(self._sizes)
        mean = max(1, sum(sizes) // max(1, n))
        room = 0
        for t in self.tiers:
            cap = t.capacity
            if cap is None:
                try:
                    cap = shutil.disk_usage(t.root).free + t.used_bytes()
                except OSError:
                    cap = 0
            room += cap
        return min(n, -(-room // mean))

    def _let_go(self, shard: int, f: ShardFill) -> None:
        """Let go of a partial copy's handle the chain no longer uses (finished, dropped,
        or let go by another process): closed once no thread reads or writes through it
        (``ShardFill.close``), with the stream's reservations on it. Kept until the store
        closed, as they were, each shard a process filled held three descriptors more than
        one it found whole: 200 shards filled into a memory tier, 1,008 against 408."""
        f.close()
        self.stream.res.forget(shard, f)

    def _drop_fill(self, shard: int, tier: DirTier, *, again: bool = True) -> None:
        """Delete the shard's partial copy in ``tier`` (it served bad bytes, or a write
        into it failed) and free its room; ``again``: place the shard anew."""
        f = self._copy_in(shard, tier)
        if f is not None:
            with contextlib.suppress(OSError), self._tier_lock():
                if f.linked():
                    remove_fill(f.final)
                    self._room(tier, -self._charged(f, tier))
            tier.stats.dropped += again
            self._forget_fill(shard, tier)
        if again:
            self._next_check.pop(shard, None)
            with self._cond:
                self._queued.discard(shard)
            self._enqueue([shard], urgent=True)

    def _intact(self, shard: int, tier: DirTier, a: int, b: int) -> bool:
        """Do the extents of bytes [a, b) in the shard's partial copy in ``tier`` still
        pass their checks? (A read from several copies failed its check: which was bad?)"""
        f = self._copy_in(shard, tier)
        if f is None:
            return True
        lo, hi = f.ext.touching(a, b)
        if hi <= lo:
            return True
        start, end = int(f.ext.offs[lo]), int(f.ext.ends[hi - 1])
        try:
            with f.descriptor() as fd:
                data = pread_full(fd, end - start, start)
        except CopyLetGo:  # finished or dropped since: not the copy read now
            return True
        except OSError:
            return False
        src = self._fill_src[id(tier)]
        return len(data) == end - start and placer.extents_ok(
            self.manifest, f.ext, lo, hi, data, self._checker(src), src.name)

    def _dropped(self, tier: DirTier, shard: int, ino: tuple[int, int] | None) -> None:
        """A tier found its whole copy of the shard corrupt: delete it and free its room
        (once: only if it is still the copy that was read, inode ``ino``, when known; two
        processes that read it both drop it), read elsewhere, and place the shard again."""
        path = tier.path(shard)
        with contextlib.suppress(OSError), self._tier_lock():
            st = os.stat(path)
            if ino is None or (st.st_dev, st.st_ino) == ino:
                os.unlink(path)
                self._room(tier, -whole_charge(self._extents_of(shard), tier.block))
        self._route.pop(shard, None)
        self._next_check.pop(shard, None)
        with self._cond:
            self._queued.discard(shard)
        self._enqueue([shard], urgent=True)

    # -- placement --------------------------------------------------------------------------

    def prefetch(self, shards: Iterable[int]) -> None:
        """Place these shards, in this order, after any shard a read is waiting for.

        A prefetch announces reads (an epoch starts): the copy gives them the first turn."""
        self.activity.touch()
        self._planned = True
        self._enqueue([int(s) for s in shards], urgent=False)

    def _plan_rest(self, shard: int, entry: int) -> None:
        """With no plan given (``prefetch``), reads that miss in a second shard mean a pass
        over the directory their files share: every other shard holding files under it
        queues too, after those reads wait for, in shard order from this one (wrapping
        round), so each stream has a shard from the start, not only once a read first
        reaches it. A program that reads one file at a time, in an order it tells nobody (a
        FUSE mount's, the preload library's), waited on one shard's stream while the others
        had no shard yet: the fourth stream started after a third of a cold epoch, and the
        last shards streamed alone at its end. Reads within one shard (one file, or a
        shard's files in order) queue no other. A later miss in a shard the plan left out
        widens it to the directory holding both, and queues the shards that adds: a job
        that reads only its validation directory no longer streams the training shards it
        never reads (3 of 15 shards read, the origin read for all 15: 6x the bytes). A read
        that does not name its file (``entry`` -1) stands for the whole dataset."""
        if self._planned:
            return
        parent = self.manifest.parent
        d = int(parent[entry]) if 0 <= entry < len(parent) else 0
        if self._scope is None:
            if self._first_miss is None or self._first_miss[0] == shard:
                self._first_miss = (shard, d)
                return
            d = self._common_dir(self._first_miss[1], d)
        else:
            d = self._common_dir(self._scope, d)
            if d == self._scope:
                return
        under = self._shards_under(d)
        # widened: the plan's shards still queued stay ahead of those it adds
        before = self._shards_under(self._scope) if self._scope is not None else under & False
        self._scope = d
        self._planned = d == 0  # the whole dataset: nothing left to widen to
        n = len(self._sizes)
        order = [(shard + k) % n for k in range(1, n)]
        self._enqueue([s for s in order if before[s]]
                      + [s for s in order if under[s] and not before[s]], urgent=False)

    def _common_dir(self, a: int, b: int) -> int:
        """The deepest directory holding directories ``a`` and ``b`` (entries)."""
        parent = self.manifest.parent
        up = {a}
        while a:  # a manifest's parents come before their children: the walk ends at 0
            a = int(parent[a])
            up.add(a)
        while b not in up:
            b = int(parent[b])
        return b

    def _shards_under(self, d: int) -> np.ndarray:
        """By shard: whether it holds a file under directory ``d`` (an entry)."""
        a = self.manifest.arrays
        under = np.zeros(len(self._sizes), dtype=bool)
        files = np.flatnonzero((a["kind"] == KIND_FILE) & (a["stored"] > 0))
        if d:
            up = a["parent"][files].astype(np.int64)
            inside = up == d
            live = up > d  # an ancestor comes before its descendants: below d, never d
            while live.any():
                up[live] = a["parent"][up[live]]
                inside |= up == d
                live &= up > d
            files = files[inside]
        under[a["shard"][files]] = True
        return under

    def _enqueue(self, shards: list[int], *, urgent: bool) -> None:
        if self.full or self._closing:
            return
        with self._cond:
            new = [s for s in shards if s not in self._queued and s not in self._route
                   and s not in self._failed]
            self._queued.update(new)
            # a prefetch is the latest plan: what it names still waiting in the stream's
            # queue moves to its place in it (Stream.enqueue)
            plan = new if urgent else [s for s in shards if s in self._queued]
            if not plan:
                return
        self.stream.enqueue(plan, urgent=urgent)

    def place(self, shard: int, progress: Callable[[int], None] | None = None,
              source: ShardSource | None = None, pieces: Iterable[int] | None = None) -> str:
        """Place one shard now, in this thread, copying it from ``source`` (default: the
        origin). Returns what happened: ``held`` (already there), ``placed``, ``elsewhere``
        (another live process is placing it), ``full`` (no tier has room) or ``failed``
        (the origin could not be read or was wrong); ``full`` also when the tiers took some
        of its pieces, not all (they stay). From another source (a peer), what it
        could not give is for the caller to fetch elsewhere, and the files it gave right stay
        in the partial copy: ``corrupt`` (a file failed its checksum) or ``unavailable``.
        ``pieces``: only these of its pieces (the rest held elsewhere: cluster/staging.py's
        overflow), ``full`` once they are in."""
        if self._find(shard):
            return "held"
        if not self.claims.acquire(shard):
            return "elsewhere"
        try:
            if self._find(shard):  # finished by someone else just before we claimed it
                return "held"
            copies = self._copies_to_fill(shard, pieces=pieces)
            if copies is None:
                return "failed"
            if self._find(shard):
                return "held"
            outcome = "full"
            # fill_gaps counts each copy's bytes from 0: progress gets them summed over the
            # shard's copies (one per tier), or a shard split over two tiers went backwards
            # (stagefs stage said 2 MiB copied of 6)
            before, last = 0, [0]

            def each(n: int) -> None:
                last[0] = n
                if progress is not None:
                    progress(before + n)

            for f, t in copies:
                last[0] = 0
                outcome = self._copy_rest(shard, f, t, each, source or self.origin)
                before += last[0]
                if outcome not in ("placed", "held", "full"):
                    break
            return outcome
        finally:
            self.claims.release(shard)

    def scan(self, shards: Iterable[int]) -> set[int]:
        """Adopt the whole copies already in the tiers (a restarted process): a copy of the
        right size whose header names this pack and shard is held; another file under a
        shard's final name is deleted (nothing writes a final name but the rename of a
        checked copy). Partial copies are left alone: the claim decides who may go on
        filling them (``place``), never a scan."""
        held: set[int] = set()
        for shard in shards:
            if not self._find(shard):
                continue
            t = self._route[shard][0]
            assert isinstance(t, DirTier)
            if t.header_ok(shard, self.manifest.pack_id):
                held.add(shard)
            else:
                log.warning("%s: not a copy of shard %d of this pack; deleted", t.path(shard),
                            shard)
                self._route.pop(shard, None)
                t.forget(shard)
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(t.path(shard))
        return held

    def locate(self, shard: int) -> str | None:
        """The path of the shard's whole copy in a tier, or None (never schedules a copy)."""
        if not self._find(shard):
            return None
        t = self._route[shard][0]
        return t.path(shard) if isinstance(t, DirTier) else None

    def _find(self, shard: int) -> bool:
        if shard in self._route:
            return True
        for t in self.tiers:
            if t.holds(shard):
                self._route[shard] = (t, self.origin)
                self._still_at[shard] = self.clock() + GONE_RECHECK_S  # (opened just now)
                self._forget_fill(shard)
                return True
        return False

    def _pace(self) -> tuple[int, int] | None:
        """How the copy may read now; it gives way to reads that go to the origin (the job's
        processes on the node stamp a shared clock, fill.Activity):

        - no read for CALM_S: full speed;
        - several threads reading (DataLoader workers, a read-ahead): they are after the
          link's bandwidth, and what they read fills the tiers anyway: the copy waits;
        - one thread reading: it waits on each read's latency and leaves the link mostly
          idle, so after a grace period (the first batches of an epoch) the copy reads one
          BUSY_CHUNK piece at a time alongside it.
        """
        act = self.activity
        q = act.quiet_for()
        if q >= CALM_S:
            return placer.IN_FLIGHT, placer.CHUNK
        if q < IDLE_S and act.readers(READERS_S) > 1:
            return None
        now = self._clock_ns() / 1e9
        if self._grace_until is None:
            self._grace_until = now + GRACE_S
        if q < IDLE_S and now < self._grace_until:
            return None
        return 1, min(placer.BUSY_CHUNK, placer.CHUNK)

    def _copy_rest(self, shard: int, f: ShardFill, t: DirTier,
                   progress: Callable[[int], None] | None, src: ShardSource) -> str:
        """Copy what the reads have not filled of the pieces reserved in ``f`` from ``src``,
        then make the copy whole if every piece is in it."""
        origin = src is self.origin
        name = self.manifest.shards[shard].name
        had = f.bits.astype(bool)
        try:
            read = through(src)
            fill_gaps(f, read=lambda off, n: read(shard, off, n), m=self.manifest,
                      check=self._checker(src), where=f"shard {shard} from {src.name}",
                      progress=progress, stop=lambda: self._closing, pace=self._pace)
        except (CopyAborted, CopyLetGo):
            # what was copied stays in the partial copy, for the next one (let go of: the
            # copy was finished, or dropped, by another thread, which has it in hand)
            return "aborted"
        except CorruptShardError as exc:
            self.corrupt += 1
            if not origin:  # the files checked so far stay; the caller asks another holder
                log.warning("shard %d (%s): %s; asking the next holder", shard, name, exc)
                return "corrupt"
            self._failed.add(shard)
            self._drop_fill(shard, t, again=False)  # it cannot be completed: free its room
            log.warning("shard %d (%s) not placed: %s", shard, name, exc)
            return "failed"
        except OriginFailed as exc:
            if not origin:
                log.info("shard %d (%s): %s did not answer (%s)", shard, name, src.name, exc)
                return "unavailable"
            self._failed.add(shard)
            self._drop_fill(shard, t, again=False)
            log.warning("shard %d (%s) not placed: %s", shard, name, exc)
            return "failed"
        except OSError as exc:
            self._drop_fill(shard, t, again=False)
            self._tier_failed(t, exc)
            return "failed"
        if f.complete() and self._finish(shard, f, t):
            return "placed"
        # the files copied into a copy that stays partial (a tier with room for part of the
        # shard): counted as filled, as a stream's are (a whole copy is counted as placed);
        # `stagefs status` said 0 placed and 0 filled after `stagefs stage` into small tiers
        new = f.bits.astype(bool) & ~had if len(had) else had
        if new.any():
            t.stats.filled += int(new.sum())
            t.stats.filled_bytes += int((f.ext.ends - f.ext.offs)[new].sum())
            self.flush_stats()
        if self._find(shard):
            return "held"
        return "full" if not f.res.all() else "failed"

    def _tier_failed(self, t: DirTier, exc: OSError) -> str:
        if exc.errno in (errno.EMFILE, errno.ENFILE):  # this process's, not the tier's
            t.stopped = "open-file limit reached"
            log.warning("%s; placement into it stopped, reads go on",
                        DescriptorLimitError(t.name))
            return "next"
        reason = t.failure(exc)
        if t.stopped != reason:  # said once, not at every copy of the tier that fails
            log.warning("%s: placement stopped (%s); reads go on", t.name, reason)
        t.stopped = reason
        return "next"

    def _checker(self, src: ShardSource) -> placer.Check:
        """Check each file (or checksum piece of a large file: fill.Extents) copied from
        ``src`` against the manifest (in place: the origin's checksums are learnt as it is
        copied)."""
        origin = src is self.origin
        where = self.origin_path if origin else src.name
        m = self.manifest

        def check(e: int, part: int, digest: int) -> None:
            if part >= 0:
                sums = m.piece_sums(e)
                if sums is not None and digest == sums[part]:
                    return
                what = f"piece {part} of {os.fsdecode(m.path_of(e))}"
            elif origin and self._record is not None:
                self._record(e, digest)
                return
            elif digest == m.checksum[e]:
                return
            else:
                what = os.fsdecode(m.path_of(e))
            raise CorruptShardError(
                f"{where}: {what} does not match its checksum"
                + (" at the origin; the shard is not placed" if origin else ""))

        return check

    @contextlib.contextmanager
    def _tier_lock(self) -> Iterator[None]:
        """Serialise, across the node's processes, every change of which copy of a shard the
        tiers hold: 'is there a copy of it in any tier? is there room? make one', making a
        copy whole, dropping one. Each tier's lock (``Room.lock_path``, in the tier: every
        job that places into it takes it), all the chain's tiers' at once, in one order (by
        path: two jobs naming two tiers in either order do not each wait on the other), so
        that looking in every tier and making the copy are one step: a shard never gets
        copies in two tiers (both would be placed), nor a tier more than its room.

        A fork waits until no thread of this process is inside (_FORK_GUARD): a child would
        inherit the locked file and hold the lock for as long as it lives.

        A process stopped while it holds the lock (kill -STOP, Ctrl-Z, a debugger) held up
        every reader of the node for as long as it stayed stopped. The lock is waited for
        TIER_LOCK_WAIT_S at most (then TiersBusy: callers skip what needed it), and, once
        that happened, only tried until it is had again, so reads do not wait on each try.
        """
        rooms = sorted((t.room for t in self.tiers if t.room is not None),
                       key=lambda r: r.lock_path)
        paths = [r.lock_path for r in rooms]
        with _FORK_GUARD, contextlib.ExitStack() as held:
            until = time.monotonic() + (0 if self._lock_stuck else TIER_LOCK_WAIT_S)
            for room in rooms:
                try:
                    try:
                        held.enter_context(file_lock(room.lock_path,
                                                     max(0.0, until - time.monotonic())))
                    except (FileNotFoundError, FileExistsError):
                        # the tier removed while the job ran (rm -rf TIER): nothing goes into
                        # it any more (its placement says why), and the other tiers go on;
                        # its room folder alone removed: made again. (EEXIST: the lock's
                        # folder, made by the lock as it found it gone, was removed again
                        # before the lock saw it made: a removal under way. It stopped
                        # placement with the raw errno, not as a tier removed.)
                        if not os.path.isdir(room.root):
                            continue
                        room.remake()
                        try:
                            held.enter_context(file_lock(room.lock_path,
                                                         max(0.0, until - time.monotonic())))
                        except (FileNotFoundError, FileExistsError):
                            if os.path.isdir(room.root):
                                raise
                            continue  # removed meanwhile
                except TimeoutError:
                    if not self._lock_stuck:
                        self._lock_stuck = True
                        log.warning("another process has held the tier's lock %s for over "
                                    "%g s: stopped (kill -STOP, Ctrl-Z, a debugger)? This "
                                    "process places nothing into the tiers and reads from "
                                    "the origin until it is free: resume that process (kill "
                                    "-CONT) or end it", room.lock_path, TIER_LOCK_WAIT_S)
                    raise TiersBusy(f"the tier's lock {room.lock_path} is held by a process "
                                    "that does not go on") from None
                except OSError as exc:
                    if exc.errno not in (errno.EMFILE, errno.ENFILE):
                        raise
                    # out of descriptors for the lock file: this process's condition for
                    # now (the reads under way hold them), not the tier's; said by the
                    # origin's read if it lasts
                    raise TiersBusy(f"{room.lock_path}: {exc.strerror}") from exc
            if self._lock_stuck:
                self._lock_stuck = False
                log.warning("the tiers' locks (%s) are free again: placing into the tiers "
                            "goes on", ", ".join(paths))
            yield

    # -- whole-dataset operations ---------------------------------------------------------

    def held_shards(self) -> set[int]:
        held: set[int] = set()
        for t in self.tiers:
            held |= t.held()
        for s in held - self._route.keys():
            self._next_check.pop(s, None)  # seen landed: the next read looks at once
        return held

    def charge(self, shard: int) -> int:
        """What a whole copy of ``shard`` is counted in a tier's room (its pieces and its
        copy, in the largest block of the tiers)."""
        block = max((t.block for t in self.tiers), default=1)
        return whole_charge(self._extents_of(shard), block)

    def room_left(self) -> float:
        """Bytes the tiers can still take (inf if one of them has no capacity set)."""
        if self.full:
            return 0.0
        left = 0.0
        for t in self.tiers:
            if t.stopped is not None:
                continue
            if t.capacity is None:
                return float("inf")
            left += max(0, t.capacity - t.used_bytes())
        return left

    def held_pieces(self) -> dict[str, set[tuple[int, int]]]:
        """Per tier (by path): the (shard, piece) pairs it holds, whole copies included
        (every piece of them), read from the tier directories."""
        out: dict[str, set[tuple[int, int]]] = {}
        for t in self.tiers:
            got = out[t.root] = set()
            for shard in sorted(t.held()):
                got.update((shard, p) for p in range(self._extents_of(shard).pieces))
            for shard in self._partial_shards(t):
                ext = self._extents_of(shard)
                f = open_fill(t.path(shard), self._sizes[shard], ext)
                if f is not None:
                    got.update((shard, int(p)) for p in f.held_pieces())
                    f.close()
        return out

    def piece_holders(self, e: int) -> npt.NDArray[np.uint8]:
        """Per checksum piece of file ``e`` (a raw file with piece checksums): the first
        tier whose copy of its shard holds the piece, written and checked (its index + 1:
        a whole copy, or a partial copy's filled piece), 0 where none does. The preload
        library maps those pieces from the tier copies and the rest from the origin's
        shard (``stagefs run``'s mmap of a large file whose shard is held in part)."""
        m = self.manifest
        sums = m.piece_sums(e)
        out = np.zeros(0 if sums is None else len(sums), np.uint8)
        shard = int(m.shard[e])
        ext = self._extents_of(shard)
        mine = np.flatnonzero(ext.entries == e)
        parts = ext.part[mine]
        ok = (parts >= 0) & (parts < len(out))
        mine, parts = mine[ok], parts[ok]
        for i, t in enumerate(self.tiers):
            if not len(mine) or out.all():
                break
            if t.holds(shard):
                out[out == 0] = i + 1
                break
            f = open_fill(t.path(shard), self._sizes[shard], ext)
            if f is None:
                continue
            try:
                got = parts[f.bits[mine].astype(bool)]
                out[got[out[got] == 0]] = i + 1
            finally:
                f.close()
        return out

    def _partial_shards(self, t: DirTier) -> list[int]:
        try:
            names = os.listdir(t.dir)
        except FileNotFoundError:
            return []
        index = {s.name + ".fill": i for i, s in enumerate(self.manifest.shards)}
        return sorted(index[n] for n in names if n in index)

    def stage(self, shards: Iterable[int] | None = None,
              progress: Callable[[int], None] | None = None) -> dict[str, int]:
        """Place shards now, in this thread (``stagefs stage``); counts of each outcome.

        ``progress(n)`` is called with the number of new bytes copied (or skipped as held).
        """
        counts: dict[str, int] = {}
        todo = range(len(self._sizes)) if shards is None else shards
        for shard in todo:
            done = [0]

            def step(n: int, done: list[int] = done) -> None:
                if progress is not None:
                    progress(n - done[0])
                done[0] = n

            outcome = self.place(shard, step) if not self.full else "full"
            if outcome in ("held", "placed") and progress is not None:
                progress(self._sizes[shard] - done[0])
            counts[outcome] = counts.get(outcome, 0) + 1
        self.flush_stats()
        return counts

    def wait_idle(self, timeout: float = 60.0) -> bool:
        """Wait until the streams have nothing queued (tests, the benchmark)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.stream.idle():
                return True
            time.sleep(0.01)
        return False

    # -- counters ---------------------------------------------------------------------------

    def counters(self) -> dict[str, Any]:
        origin_stats = getattr(self.origin, "stats", None)
        return {
            "pid": os.getpid(),
            "pack_id": self.pack_id,
            "origin": self.origin_path,
            "open": not self._closing,  # a closed store's dataset is no longer read
            "misses": self.misses,
            "origin_stats": origin_stats.as_dict() if origin_stats is not None else {},
            "claims": self.claims.taken,
            "corrupt": self.corrupt,
            "takeovers": self.claims.takeovers,
            "tiers": {t.root: t.stats.as_dict() for t in self.tiers},
        }

    def status(self) -> dict[str, Any]:
        """This process's counters, with what each tier holds now."""
        c = self.counters()
        tiers = []
        for t in self.tiers:
            tiers.append({"path": t.root, "kind": t.kind, "capacity": t.capacity,
                          "bytes_used": t.used_bytes(), "shards_held": len(t.held()),
                          "stopped": t.why_stopped(), **t.stats.as_dict()})
        c.update(tiers=tiers, shards=len(self._sizes), hits=sum(t.stats.hits for t in self.tiers))
        return c

    def _maybe_flush(self) -> None:
        now = time.monotonic()
        if now - self._stats_at >= RECORD_EVERY_S:
            self.flush_stats()

    def flush_stats(self) -> None:
        """Write this process's counters where ``stagefs status`` sums them."""
        self._stats_at = time.monotonic()
        with self._stats_lock:
            write_record(self._stats_path, self.counters())

    # -- lifecycle --------------------------------------------------------------------------

    def close(self) -> None:
        with self._cond:
            if self._closing:
                return
            self._closing = True
        self.stream.close()
        self.flush_stats()
        for copies in list(self._fills.values()):
            for f, _ in copies:
                f.close()
        self._fills.clear()
        self.activity.close()
        for t in self.tiers:
            t.close()
        _CHAINS.discard(self)

    def _after_fork(self) -> None:
        """In a forked child: no stream thread was copied; start counting afresh."""
        self._queued.clear()
        self._init_threading()
        self.stream.after_fork()
        self.misses = self.corrupt = 0
        self.claims.reset_after_fork()
        for copies in self._fills.values():
            for f, _ in copies:
                f.reset_after_fork()
        for t in self.tiers:
            t.reset_after_fork()
        reset = getattr(self.origin, "reset_after_fork", None)
        if reset is not None:
            reset()
        with contextlib.suppress(OSError):
            self.runtime.register()


_CHAINS: weakref.WeakSet[TierChain] = weakref.WeakSet()
_PIECES: weakref.WeakSet[NodePieces] = weakref.WeakSet()


_FORK_GUARD = threading.Lock()  # held while the tiers' lock file is locked (_tier_lock)


def _allocated(e: os.DirEntry[str]) -> int:
    """A file's bytes as ``tier.dir_usage`` counts them (its size, less what is unwritten)."""
    st = e.stat(follow_symlinks=False)
    return min(st.st_size, st.st_blocks * 512)


def _after_fork_in_child() -> None:
    global _FORK_GUARD
    _FORK_GUARD = threading.Lock()
    for chain in list(_CHAINS):
        chain._after_fork()
    for pieces in list(_PIECES):
        pieces._after_fork()


def _close_all() -> None:
    """At exit. A chain a Store reads through is its Store's to close: closed here, its
    copies and descriptors were let go of under the reads a daemon thread still had under
    way (store.py closes the Stores first); its counters are written all the same."""
    for chain in list(_CHAINS):
        with contextlib.suppress(Exception):
            if not chain.closed_by_store:
                chain.close()
            elif not chain._closing:
                chain.flush_stats()


def _flush_all() -> None:
    for chain in list(_CHAINS):
        with contextlib.suppress(Exception):
            chain.flush_stats()


_EXIT_FLUSH = [0]  # the process that registered _flush_all with multiprocessing


def _flush_at_exit(_: object = None) -> None:
    """A forked multiprocessing child (a DataLoader worker) ends with os._exit: no atexit
    handler runs, and the counters it gathered since its last flush (once a
    second, from the stream threads) were lost to ``stagefs status``. multiprocessing runs
    its own exit finalizers there: flush the counters in one (once per process)."""
    if _EXIT_FLUSH[0] != os.getpid():
        _EXIT_FLUSH[0] = os.getpid()
        mp_util.Finalize(None, _flush_all, exitpriority=0)


_FLUSH_TOKEN = type("_FlushToken", (), {})()  # multiprocessing's after-fork hooks need one
mp_util.register_after_fork(_FLUSH_TOKEN, _flush_at_exit)


os.register_at_fork(before=lambda: _FORK_GUARD.acquire(),
                    after_in_parent=lambda: _FORK_GUARD.release(),
                    after_in_child=_after_fork_in_child)
atexit.register(_close_all)

