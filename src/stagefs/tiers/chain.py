"""The tier chain: which holders a read asks (tiers fastest first, then the origin), and the
background placement of shards into the tiers. The only module that knows their order.

- ``holders(shard)``: the tiers holding the shard, then the origin. A held shard is answered
  from a dict (its fd is cached in the tier); a shard not held yet is re-checked on disk at
  most every ``RECHECK_S`` (one local ``open``, never an origin call), so a shard placed by
  another process is seen almost at once.
- A miss schedules the whole shard's placement in one background thread per process; a claim
  in the runtime dir makes the copy happen once per node. While this process copies a shard,
  reads of ranges already copied are served from the partial file (checksum-verified like
  every read), so the first epoch does not read those bytes from the origin twice.
- Capacity: a shard goes into the first tier with room; a full tier takes no more (no
  eviction: the held set stays put); ENOSPC deletes the partial file and stops that tier.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import itertools
import json
import logging
import os
import resource
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

from xxhash import xxh3_64_hexdigest

from stagefs.config import TierSpec
from stagefs.errors import CorruptShardError
from stagefs.format import Manifest
from stagefs.runtime import Runtime
from stagefs.tiers.base import ShardSource, SourceUnavailable, pread_full
from stagefs.tiers.claims import Claims
from stagefs.tiers.placer import (
    CopyAborted,
    Layout,
    OriginFailed,
    copy_shard,
    open_partial,
)
from stagefs.tiers.tier import NO_SPACE, DirTier

__all__ = ["RECHECK_S", "TierChain"]

log = logging.getLogger("stagefs.tiers")

RECHECK_S = 0.05  # how often a read re-checks whether a missing shard has landed
_STATS_EVERY_S = 1.0

Record = Callable[[int, int], None]


class _PartialSource:
    """Ranges of shards this process is copying now, already written to the partial file."""

    name = "partial copy"

    def __init__(self) -> None:
        self.inflight: dict[int, list[int]] = {}  # shard -> [read fd, bytes copied]

    def pread(self, shard: int, offset: int, length: int) -> bytes:
        info = self.inflight.get(shard)
        if info is None or offset + length > info[1]:
            raise SourceUnavailable("not copied yet")
        data = pread_full(info[0], length, offset)
        if len(data) != length:
            raise SourceUnavailable("short read")
        return data

    def close(self) -> None:
        pass


class TierChain:
    """Tiers in order for one dataset, and the placement of its shards into them."""

    def __init__(self, manifest: Manifest, origin: ShardSource, specs: Sequence[TierSpec],
                 runtime: Runtime, *, origin_path: str, record: Record | None = None) -> None:
        self.manifest = manifest
        self.origin = origin
        self.runtime = runtime
        self.origin_path = origin_path
        self.pack_id = manifest.pack_id.hex()
        self.tiers = [DirTier(s, manifest) for s in specs]
        for t in self.tiers:
            t.on_drop = self._dropped
        runtime.record_tiers(self.pack_id, [t.root for t in self.tiers])
        self.claims = Claims(runtime.claims, self.pack_id)
        self._record = record
        self._sizes = [s.size for s in manifest.shards]
        self._layout: Layout | None = None
        self._origin_only: tuple[ShardSource, ...] = (origin,)
        self._partial = _PartialSource()
        self._with_partial: tuple[ShardSource, ...] = (self._partial, origin)
        self._route: dict[int, tuple[ShardSource, ...]] = {}
        self._next_check: dict[int, float] = {}
        self._queue: deque[int] = deque()
        self._queued: set[int] = set()
        self._failed: set[int] = set()
        self._graveyard: list[int] = []  # read fds of aborted partial copies, closed at close
        self.misses = 0
        self.full = not self.tiers
        self._closing = False
        self._init_threading()
        _raise_fd_limit()
        _CHAINS.add(self)

    def _init_threading(self) -> None:
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._busy = False
        # one file per open store: several stores of one process each keep their counters
        name = f"{os.getpid()}.{self.pack_id}.{next(_OPENED)}.json"
        self._stats_path = os.path.join(self.runtime.stats, name)
        self._stats_at = 0.0

    # -- the read path ----------------------------------------------------------------------

    def holders(self, shard: int) -> tuple[ShardSource, ...]:
        route = self._route.get(shard)
        if route is not None:
            return route
        return self._miss(shard)

    def _miss(self, shard: int) -> tuple[ShardSource, ...]:
        now = time.monotonic()
        if now >= self._next_check.get(shard, 0.0):
            for t in self.tiers:
                if t.holds(shard):
                    route = (t, self.origin)
                    self._route[shard] = route
                    return route
            self._next_check[shard] = now + RECHECK_S
        self.misses += 1
        if shard not in self._queued and not self.full:
            self._enqueue([shard], urgent=True)
        if shard in self._partial.inflight:
            return self._with_partial
        return self._origin_only

    def _dropped(self, shard: int) -> None:
        """A tier dropped a corrupt copy: read elsewhere, and place the shard again."""
        self._route.pop(shard, None)
        self._next_check.pop(shard, None)
        with self._cond:
            self._queued.discard(shard)
        self._enqueue([shard], urgent=True)

    # -- placement --------------------------------------------------------------------------

    def prefetch(self, shards: Iterable[int]) -> None:
        """Place these shards, in this order, after any shard a read is waiting for."""
        self._enqueue([int(s) for s in shards], urgent=False)

    def _enqueue(self, shards: list[int], *, urgent: bool) -> None:
        if self.full or self._closing:
            return
        with self._cond:
            new = [s for s in shards if s not in self._queued and s not in self._route
                   and s not in self._failed]
            if not new:
                return
            self._queued.update(new)
            if urgent:
                self._queue.extendleft(reversed(new))
            else:
                self._queue.extend(new)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="stagefs-placer",
                                                daemon=True)
                self._thread.start()
            self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closing:
                    self._cond.wait(_STATS_EVERY_S)
                    self._maybe_flush()
                if self._closing:
                    return
                shard = self._queue.popleft()
                self._busy = True
            try:
                self.place(shard)
            except Exception:  # never let the placer die silently: log and go on
                log.exception("placing shard %d failed", shard)
                self._failed.add(shard)
            finally:
                self._busy = False
            self._maybe_flush()

    def place(self, shard: int, progress: Callable[[int], None] | None = None) -> str:
        """Place one shard now, in this thread. Returns what happened: ``held`` (already
        there), ``placed``, ``elsewhere`` (another live process is placing it), ``full``
        (no tier has room) or ``failed`` (the origin could not be read or was wrong)."""
        if self._find(shard):
            return "held"
        if not self.claims.acquire(shard):
            return "elsewhere"
        try:
            if self._find(shard):  # finished by someone else just before we claimed it
                return "held"
            for t in self.tiers:
                if t.stopped is None:
                    outcome = self._place_in(t, shard, progress)
                    if outcome != "next":
                        return outcome
            self.full = True
            with self._cond:
                self._queue.clear()
            return "full"
        finally:
            self.claims.release(shard)

    def _find(self, shard: int) -> bool:
        if shard in self._route:
            return True
        for t in self.tiers:
            if t.holds(shard):
                self._route[shard] = (t, self.origin)
                return True
        return False

    def _place_in(self, t: DirTier, shard: int, progress: Callable[[int], None] | None) -> str:
        size = self._sizes[shard]
        final = t.path(shard)
        try:
            with self._tier_lock(t):
                if t.capacity is not None and t.used_bytes() + size > t.capacity:
                    t.stopped = "full"
                    log.info("%s is full: it takes no more shards", t.name)
                    return "next"
                fd = open_partial(final, size)
        except OSError as exc:
            return self._tier_failed(t, exc)
        rfd = os.open(final + ".partial", os.O_RDONLY | os.O_CLOEXEC)
        info = [rfd, 0]
        self._partial.inflight[shard] = info

        def advanced(n: int) -> None:
            info[1] = n
            if progress is not None:
                progress(n)

        if self._layout is None:
            self._layout = Layout(self.manifest)
        try:
            copy_shard(fd, final, read=lambda off, n: self.origin.pread(shard, off, n),
                       size=size, index=shard, pack_id=self.manifest.pack_id, m=self.manifest,
                       entries=self._layout.entries(shard), check=self._check,
                       progress=advanced, stop=lambda: self._closing)
        except CopyAborted:
            self._abandon(shard)
            return "aborted"
        except (OriginFailed, CorruptShardError) as exc:
            self._abandon(shard)
            self._failed.add(shard)
            log.warning("shard %d not placed: %s", shard, exc)
            return "failed"
        except OSError as exc:
            self._abandon(shard)
            return self._tier_failed(t, exc)
        # the read fd now names the placed file: it becomes the tier's cached fd
        del self._partial.inflight[shard]
        if not t.adopt(shard, rfd):
            self._graveyard.append(rfd)
        t.stats.placed += 1
        t.stats.placed_bytes += size
        self._route[shard] = (t, self.origin)
        return "placed"

    def _abandon(self, shard: int) -> None:
        info = self._partial.inflight.pop(shard, None)
        if info is not None:
            self._graveyard.append(info[0])  # a reader may still hold it for a moment

    def _tier_failed(self, t: DirTier, exc: OSError) -> str:
        reason = "no space left on device" if exc.errno in NO_SPACE else str(exc)
        t.stopped = reason
        log.warning("%s: placement stopped (%s); reads go on", t.name, reason)
        return "next"

    def _check(self, e: int, digest: int) -> None:
        if self._record is not None:
            self._record(e, digest)
        elif digest != self.manifest.checksum[e]:
            raise CorruptShardError(
                f"{self.origin_path}: {os.fsdecode(self.manifest.path_of(e))} does not match "
                "its checksum at the origin; the shard is not placed"
            )

    @contextlib.contextmanager
    def _tier_lock(self, t: DirTier) -> Iterator[None]:
        """Serialise 'is there room? reserve it' for one tier across the node's processes."""
        name = f".tier-{xxh3_64_hexdigest(t.root.encode())}.lock"
        fd = os.open(os.path.join(self.runtime.claims, name), os.O_RDWR | os.O_CREAT
                     | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    # -- whole-dataset operations ---------------------------------------------------------

    def held_shards(self) -> set[int]:
        held: set[int] = set()
        for t in self.tiers:
            held |= t.held()
        for s in held - self._route.keys():
            self._next_check.pop(s, None)  # seen landed: the next read looks at once
        return held

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
        """Wait until the background placer has nothing queued (tests, the benchmark)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._cond:
                idle = not self._queue and not self._busy
            if idle:
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
            "misses": self.misses,
            "origin_stats": origin_stats.as_dict() if origin_stats is not None else {},
            "claims": self.claims.taken,
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
                          "stopped": t.stopped, **t.stats.as_dict()})
        hits = sum(t.stats.hits for t in self.tiers)
        total = hits + self.misses
        c.update(tiers=tiers, shards=len(self._sizes), hits=hits,
                 hit_rate=hits / total if total else 0.0)
        return c

    def _maybe_flush(self) -> None:
        now = time.monotonic()
        if now - self._stats_at >= _STATS_EVERY_S:
            self.flush_stats()

    def flush_stats(self) -> None:
        """Write this process's counters where ``stagefs status`` sums them."""
        self._stats_at = time.monotonic()
        tmp = self._stats_path + ".tmp"
        try:
            with open(tmp, "w") as f:
                json.dump(self.counters(), f)
            os.replace(tmp, self._stats_path)
        except OSError:
            pass  # the runtime dir was cleaned under us: counters are best effort

    # -- lifecycle --------------------------------------------------------------------------

    def close(self) -> None:
        with self._cond:
            if self._closing:
                return
            self._closing = True
            self._queue.clear()
            self._cond.notify_all()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=60)
        self.flush_stats()
        for fd in self._graveyard:
            os.close(fd)
        self._graveyard.clear()
        for t in self.tiers:
            t.close()
        _CHAINS.discard(self)

    def _after_fork(self) -> None:
        """In a forked child: no placer thread was copied; start counting afresh."""
        self._partial.inflight.clear()
        self._queue.clear()
        self._queued.clear()
        self._init_threading()
        self.misses = 0
        self.claims.reset_after_fork()
        for t in self.tiers:
            t.reset_after_fork()
        reset = getattr(self.origin, "reset_after_fork", None)
        if reset is not None:
            reset()
        with contextlib.suppress(OSError):
            self.runtime.register()


_CHAINS: weakref.WeakSet[TierChain] = weakref.WeakSet()
_OPENED = itertools.count()


def _after_fork_in_child() -> None:
    for chain in list(_CHAINS):
        chain._after_fork()


def _close_all() -> None:
    for chain in list(_CHAINS):
        with contextlib.suppress(Exception):
            chain.close()


os.register_at_fork(after_in_child=_after_fork_in_child)
atexit.register(_close_all)


def _raise_fd_limit() -> None:
    """One fd per held shard (tiers) and per opened shard (origin): lift the soft limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = hard if hard != resource.RLIM_INFINITY else 1 << 20
    if soft != resource.RLIM_INFINITY and soft < want:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (min(want, 1 << 20), hard))
