"""Store: the client a user holds. Path → entry → (shard, range) → the first holder whose
bytes pass the checksum → bytes.

Every front end (the CLI, file objects, interception, FUSE, the PyTorch datasets) reads
through a Store. Where the bytes come from is behind ``ShardSource``s (tiers/); the Store
only decides the order to ask them in and verifies what they return.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import functools
import logging
import operator
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import asdict, dataclass
from typing import Any, Concatenate, ParamSpec, Protocol, TypeVar, cast

import numpy as np
import numpy.typing as npt

from stagefs._fsutil import InUse, in_parts, out_of_descriptors, unreachable
from stagefs._malloc import tune_malloc
from stagefs.config import TierSpec, absolute, env_number
from stagefs.errors import (
    ChecksumError,
    ConfigError,
    CorruptShardError,
    DescriptorLimitError,
    NotFoundError,
    OriginUnavailableError,
    ReadOnlyError,
)
from stagefs.format import KIND_FILE, KIND_SYMLINK, MANIFEST_NAME, Manifest, checksum
from stagefs.format.checksum import StreamSum, bad_piece, check, piece_error
from stagefs.format.codecs import decode
from stagefs.namespace import DirEntry, Namespace, PathArg, is_a_directory
from stagefs.runtime import Runtime
from stagefs.tiers.base import (
    GATHER_PART,
    Gathered,
    OriginStats,
    PreadMany,
    ShardSource,
    SourceUnavailable,
)
from stagefs.tiers.chain import TierChain
from stagefs.tiers.fill import reading_for
from stagefs.tiers.inplace import SumTable
from stagefs.tiers.origin import PackOrigin
from stagefs.tiers.status import (
    HOLDERS,
    RECORD_EVERY_S,
    ReadCounters,
    holder_summary,
    new_record,
    write_record,
)

__all__ = ["Holders", "ReadStats", "Store", "open"]

_COALESCE_LIMIT = 8 * 2**20  # read_many merges adjacent ranges up to this span
_DECODE_IN_PARTS = 256 * 1024  # raw bytes of a batch's compressed files decoded in parts
READ_THREADS = 8  # read_many's origin reads in flight at once ($STAGEFS_READ_THREADS)
# a read that took longer than this plus its bytes at COPY_RATE waited on a file system's
# latency, not on a copy from memory. Measured here: a 110 KB read from the page cache (a
# FUSE client's included) 21 us, 1 MB 142 us (5-7 GB/s); a random 110 KB read from the test
# PFS 0.76 ms alone, 0.35 ms each with 8 in flight (1,318 against 2,650 files/s)
SLOW_READ_S = 100e-6
COPY_RATE = 2e9  # bytes/s: a copy from memory is faster than this
_Unit = tuple[int, int, int, int, int]  # read_entries: order[i:j], shard, start, span
_STREAM = 8 * 2**20  # bytes per read while a file without piece checksums is verified whole
_V1_NOTICED: set[str] = set()  # manifests whose version 1 notice was logged (once each)

log = logging.getLogger("stagefs")


_STORES: weakref.WeakSet[Store] = weakref.WeakSet()


class _Tally(list[tuple[str, int, int, int]]):
    """A batch's samples (holder, samples, bytes, stored bytes), counted once the whole batch
    has been read (``read_entries``): a batch that raises delivered nothing to its caller,
    and ``stagefs status`` must not say its samples were read. Its reader threads append
    to it (one ``append`` each: atomic)."""

    def __bool__(self) -> bool:
        return True  # counting (``count``), however few samples it holds yet


def _after_fork_in_child() -> None:
    """A lock another thread held at the fork stays held in the child: make new ones. The
    origin of a store without tiers too (the tier chain resets its own): its lock, and its
    counts, which are the child's from now on (``status()["origin_stats"]``)."""
    for store in list(_STORES):
        store._lock = threading.Lock()
        has = store.__dict__
        if "_users" in has:
            store._users.reset_after_fork()
        reset = getattr(has.get("origin"), "reset_after_fork", None) \
            if has.get("chain") is None else None
        if reset is not None:
            reset()


os.register_at_fork(after_in_child=_after_fork_in_child)


def _close_at_exit() -> None:
    """The Stores still open at exit close as close() closes them: what they hold is let
    go of once the reads that daemon threads have under way are done. The tiers' own exit
    hook (registered before this one, so run after it) closed their copies under those
    reads: the readers died of an IndexError or read through a descriptor another file had
    taken."""
    for store in list(_STORES):
        with contextlib.suppress(Exception):
            store.close(wait=False)


atexit.register(_close_at_exit)


def _read_threads() -> int:
    return int(env_number("read_threads", READ_THREADS, whole=True, least=1))


class Holders(Protocol):
    """Who holds each shard, and the rest a Store hands to the same object: the node's
    tiers (tiers/chain.py) or a cluster (cluster/connect.py). A holder that offers
    ``pread_many`` (tiers/base.py ``PreadMany``: a peer) or ``gather_many`` (a node-local
    tier) gets the ranges of a ``read_many`` that go to it in one call."""

    def holders(self, shard: int) -> Sequence[ShardSource]: ...
    def prefetch(self, shards: Iterable[int]) -> None: ...
    def held_shards(self) -> set[int]: ...
    def status(self) -> dict[str, Any]: ...
    def close(self) -> None: ...


@dataclass
class ReadStats:
    """Reads served by this process's Store."""

    reads: int = 0
    bytes: int = 0
    checksum_failures: int = 0
    unavailable: int = 0


_WAYS_IN = ("_find", "stat", "lstat", "listdir", "exists", "isdir", "isfile", "islink",
            "getsize", "readlink", "scandir", "walk", "info", "read_entries", "read_ahead",
            "read_entry", "open", "prefetch")  # (held_shards and status still answer: a closing report)


def _closed_error(pack_dir: str, how: str) -> ValueError:
    return ValueError(f"I/O operation on a closed Store ({pack_dir}): open the dataset "
                      f"again with {how}")


def _closed_store(pack_dir: str, how: str, *args: Any, **kwargs: Any) -> Any:
    raise _closed_error(pack_dir, how)


_P = ParamSpec("_P")
_R = TypeVar("_R")


def _while_open(method: Callable[Concatenate[Store, _P], _R]
                ) -> Callable[Concatenate[Store, _P], _R]:
    """A read that was under way in another thread when the Store was closed raises the
    closed Store's error, not whatever it met of what close() let go of (a released
    manifest view, a KeyError of its arrays, a reader pool shut down). What close() lets go
    of waits for the reads under way (``InUse``): a descriptor closed under one was the next
    file's, and the read read that file, or the tiers' stream wrote shard bytes into it."""

    @functools.wraps(method)
    def call(self: Store, /, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        users = self._users
        if not users.enter():
            _closed_store(self.pack_dir, self._opened_with())
        try:
            out = method(self, *args, **kwargs)
        except Exception as exc:
            self._raise_if_closed(exc)
            raise
        finally:
            users.leave()
        if self._closed:  # closed under it: as a read that met what close() let go of
            _closed_store(self.pack_dir, self._opened_with())
        return out

    return call


class Store:
    """A read-only view of one dataset. Use ``stagefs.open`` to get one.

    Thread-safe for reads. Picklable: a copy sent to a DataLoader worker (fork or spawn)
    reopens the same dataset there instead of carrying file descriptors across.
    """

    def __init__(
        self,
        pack_dir: str,
        *,
        verify: bool = True,
        manifest: Manifest | None = None,
        sources: Callable[[int], Sequence[ShardSource]] | None = None,
        origin: ShardSource | None = None,
        chain: TierChain | None = None,
        policy: Holders | None = None,
        sums: SumTable | None = None,
        reopen: dict[str, Any] | None = None,
        runtime: Runtime | None = None,
        counters: str | None = None,
        borrowed: bool = False,
    ) -> None:
        self.pack_dir = pack_dir
        # what it was given is the caller's to close, not this store's when it is dropped
        self._owned = not borrowed
        self.verify = verify
        self.manifest = manifest or Manifest(os.path.join(pack_dir, MANIFEST_NAME))
        self.namespace = ns = Namespace(self.manifest)
        self.origin: Any = origin if origin is not None else PackOrigin(
            pack_dir, self.manifest, check_headers=not verify)
        self._origin_only = (self.origin,)
        # the origin's batch of reads (a pack's files: tiers/origin.py), if it has one
        self._gather: Callable[..., Gathered] | None = getattr(self.origin, "gather_many", None)
        self.chain = chain  # node-local tiers (tiers/chain.py), or None: origin only
        # who holds each shard: the tiers, a cluster (policy), or the origin alone
        self._policy: Holders | None = policy if policy is not None else chain
        self._holders = sources or (self._policy.holders if self._policy is not None
                                    else self._origin_holders)
        # the same, told the file read: the tiers' plan made with no prefetch covers the
        # directory the reads share (TierChain._plan_rest)
        self._holders_of: Callable[[int, int], Sequence[ShardSource]] = (
            chain.holders if chain is not None and sources is None and self._policy is chain
            else functools.partial(_untold, self._holders))
        # holders that give a range only where one holds all of it, which hold a large
        # file's pieces in part (a cluster's: ClusterHolders): a large file read by pieces
        self._by_piece = bool(getattr(self._policy, "holds_pieces", False))
        # the tiers fill as origin reads pass (tiers/fill.py)
        self._from_origin = chain.from_origin if chain is not None else None
        self._sums = sums  # in place: checksums learnt as shards are placed
        self._reopen = reopen  # how a pickled copy reopens this store
        self._runtime = runtime  # the job's runtime dir, if this store uses one
        # reads per holder, summed by `stagefs status` (tiers/status.py): in the runtime's
        # stats dir, or ``counters`` (a cluster client's)
        folder = counters or (runtime.stats if runtime is not None else None)
        self._counts = ReadCounters(folder, self.manifest.pack_id.hex()) \
            if folder is not None else None
        stats = getattr(self.origin, "stats", None)
        if self._counts is not None and isinstance(stats, OriginStats):
            stats.sink = self._counts.fetched  # the job counts every read of the origin
        # a store without tiers that counts for a job writes the record a TierChain writes
        # (its origin, what it cost the origin: ``stagefs status``'s origins and datasets),
        # from time to time as it reads the origin and when it closes: a val set read
        # beside a tiered train set was a pack id in the table, its opens counted nowhere
        self._record: str | None = None
        self._record_at = 0.0
        self._record_lock = threading.Lock()
        if self._policy is None and self._counts is not None and runtime is not None \
                and counters is None and isinstance(stats, OriginStats):
            self._record_pid = os.getpid()
            self._record = new_record(runtime.stats, self.manifest.pack_id.hex())
            stats.sink = self._fetched
        m = self.manifest
        self._find, self._kind, self._size = ns.find, m.kind, m.size
        self._shard, self._offset, self._stored = m.shard, m.offset, m.stored
        self._codec = m.codec
        self._entries = len(m)
        self._checksum = m.checksum if sums is None else sums.sums
        self._derived: dict[int, Sequence[int]] = {}  # piece sums learnt by _derive
        tune_malloc()
        self.stats = ReadStats()
        self._closed = False
        self._users = InUse()  # the reads under way: close() lets go after the last
        self._lock = threading.Lock()
        self.read_threads = _read_threads()
        # the parts a batch from the page cache or a memory tier is read in at once (gather)
        self._parts = min(self.read_threads, len(os.sched_getaffinity(0)))
        self._pool: tuple[int, ThreadPoolExecutor] | None = None  # (pid, pool)
        self._remote_waits = False  # whether the last batch's remote reads went to threads
        _STORES.add(self)
        if chain is not None:
            chain.closed_by_store = True  # (after the reads under way, at exit too)
        # the namespace answers these directly: no extra call layer on the metadata path
        self.stat, self.lstat, self.listdir = ns.stat, ns.lstat, ns.listdir
        self.exists, self.isdir, self.isfile, self.islink = ns.exists, ns.isdir, ns.isfile, ns.islink
        self.getsize, self.readlink = ns.getsize, ns.readlink
        self._write_record(wait=True)  # its origin listed from the start (a scan's cost)

    # -- namespace (bound in __init__; declared here for readers and type checkers) ---------

    stat: Callable[[PathArg], os.stat_result]
    lstat: Callable[[PathArg], os.stat_result]
    listdir: Callable[..., list[str]]
    exists: Callable[[PathArg], bool]
    isdir: Callable[[PathArg], bool]
    isfile: Callable[[PathArg], bool]
    islink: Callable[[PathArg], bool]
    getsize: Callable[[PathArg], int]
    readlink: Callable[[PathArg], str]

    def scandir(self, path: PathArg = "") -> Iterator[DirEntry]:
        return self._while_open_iter(self.namespace.scandir(path))

    def walk(
        self, top: PathArg = "", topdown: bool = True, followlinks: bool = False
    ) -> Iterator[tuple[str, list[str], list[str]]]:
        return self._while_open_iter(self.namespace.walk(top, topdown, followlinks))

    def _while_open_iter(self, it: Iterator[Any]) -> Iterator[Any]:
        """``it`` (a walk, a listing: read as the caller goes), with the closed Store's
        error if the Store is closed before the caller is done (_while_open)."""
        try:
            yield from it
        except Exception as exc:
            self._raise_if_closed(exc)
            raise

    def _raise_if_closed(self, exc: BaseException) -> None:
        """If this Store was closed, the error that says so, for ``exc`` met on the way."""
        if self._closed:
            raise _closed_error(self.pack_dir, self._opened_with()) from exc

    def info(self) -> dict[str, Any]:
        return {"pack": self.pack_dir, **self.namespace.summary()}

    # -- data ------------------------------------------------------------------------------

    def read(self, path: PathArg) -> bytes:
        """The whole content of the file at ``path``, verified."""
        e = self._find(path)  # a plain path to a regular file; else the full resolution
        if e < 0:
            e = self.namespace.file_entry(path)
        return self.read_entry(e, path)

    @_while_open
    def read_many(self, paths: Iterable[PathArg]) -> list[bytes]:
        """The contents of many files, in the order asked: the batched fast path.

        The paths are looked up first (a missing one raises the error ``read`` raises, before
        anything is read), then read as ``read_entries`` reads entries.
        """
        if isinstance(paths, (str, bytes, os.PathLike)) or getattr(paths, "ndim", None) == 0:
            raise TypeError(f"read_many takes a list of paths, not one path ({paths!r}): "
                            "read() reads one file")
        if not hasattr(paths, "__iter__") and not hasattr(paths, "__getitem__"):
            # None, a number: Python's "'NoneType' object is not iterable" named neither
            raise TypeError(f"read_many takes a list of paths, not {type(paths).__name__} "
                            f"({paths!r})")
        plist = paths if isinstance(paths, list) else list(paths)
        find = self._find
        try:
            ents = [find(p) for p in plist]
            if -1 in ents:  # not a plain path to a regular file: the full resolution, its errors
                file_entry = self.namespace.file_entry
                ents = [e if e >= 0 else file_entry(p) for e, p in zip(ents, plist, strict=True)]
        except TypeError:
            for i, p in enumerate(plist):  # the first that is not a path, named
                if not isinstance(p, (str, bytes, os.PathLike)):
                    raise TypeError(f"read_many: paths[{i}] is {p!r} ({type(p).__name__}), "
                                    "not a path (str, bytes or os.PathLike)") from None
            raise
        return self.read_entries(ents, plist)

    @_while_open
    def read_entries(self, entries: Iterable[int] | npt.NDArray[np.integer[Any]],
                     paths: Sequence[PathArg | None] | None = None, *,
                     count: bool | _Tally = True) -> list[bytes]:
        """The verified bytes of many entries (``paths``: their names in errors), in the
        order asked: what ``read_entry`` gives each, at a lower cost per sample.

        The batch is sorted by shard and offset with the manifest's arrays. The files of a
        shard held in a local tier are read with one call to the tier (``gather_many``),
        then checked one after the other. Elsewhere, files next to each other in a shard
        are read with one call; what has to come from a remote source (the origin, a
        partial copy that may not hold it yet) is read by up to ``read_threads`` threads
        at once once a read shows the source is slow: a batch of small random reads waits
        on the file system's latency, not its bandwidth (on the test PFS, 32 samples of
        107 KB took 24-61 ms one after the other, 14-30 ms with 8 threads); a peer that
        takes many ranges in one request (``pread_many``) gets all of its ranges at once.
        Whatever a holder cannot give, or gives wrong, is read again by ``read_entry``: every
        holder in turn, counted and logged as a read alone would be. ``count=False``: the
        samples are not counted as read (a read-ahead into the tiers, whose samples the
        workers read and count); the origin's reads are counted all the same. The samples
        are counted once the batch has returned: a batch that raises (a file no holder has
        good bytes for) delivered nothing, and counts no sample (its reads of the origin,
        its checksum failures, are counted).
        """
        if count is not True:
            return self._read_entries(entries, paths, count)
        got, counted = self._read_ahead(entries, paths)
        counted()  # the samples counted once every one of them was read
        return got

    @_while_open
    def read_ahead(self, entries: Iterable[int] | npt.NDArray[np.integer[Any]],
                   paths: Sequence[PathArg | None] | None = None
                   ) -> tuple[list[bytes], Callable[[], None]]:
        """``read_entries`` now, its samples counted later: the bytes, and a function that
        counts them as ``read_entries`` would have (by holder; once, however often it is
        called), for a read-ahead that counts the samples it hands out, not those it read
        and dropped (a loop left early: the samples read into its memory budget were said
        to be read)."""
        return self._read_ahead(entries, paths)

    def _read_ahead(self, entries: Iterable[int] | npt.NDArray[np.integer[Any]],
                    paths: Sequence[PathArg | None] | None
                    ) -> tuple[list[bytes], Callable[[], None]]:
        tally = _Tally()
        got = self._read_entries(entries, paths, tally)

        def counted() -> None:
            for holder, reads, nbytes, stored in tally:
                self._add(holder, reads, nbytes, stored)
            tally.clear()  # once

        return got, counted

    def _read_entries(self, entries: Iterable[int] | npt.NDArray[np.integer[Any]],
                      paths: Sequence[PathArg | None] | None, count: bool | _Tally
                      ) -> list[bytes]:
        """``read_entries``, its samples counted in ``count`` (a batch's tally) or not."""
        if isinstance(entries, (int, np.integer)) or getattr(entries, "ndim", None) == 0:
            # one number, or a 0-d array or tensor of one (numpy's, torch's): no len()
            raise TypeError(f"read_entries takes a list of entries, not one entry ({entries!r}):"
                            " read_entry() reads one")
        if not hasattr(entries, "__len__"):  # a generator
            entries = list(entries)
        entries = cast("Sequence[int] | npt.NDArray[np.integer[Any]]", entries)
        n = len(entries)
        if paths is not None and len(paths) != n:
            raise ValueError(f"read_entries: {len(paths)} paths for {n} entries (paths name "
                             "the entries in errors: one each, or none)")
        names: Sequence[PathArg | None] = paths if paths is not None else [None] * n
        ents = self._entry_array(entries)
        if n < 2:
            return [self.read_entry(int(e), names[0], count=count) for e in entries]
        el: list[int] = ents.tolist()
        a = self.manifest.arrays
        out: list[bytes] = [b""] * n
        file = a["kind"][ents] == KIND_FILE
        for k in np.flatnonzero(~file).tolist():
            # a symlink read as its target is; a directory raises as a read (a symlink's
            # size is its target's length: read as a file of the batch, an in-place
            # symlink's shard was -1, an IndexError)
            out[k] = self.read_entry(el[k], names[k], count=count)
        # empty files are read from no holder (b"")
        sized = file & (a["size"][ents] > 0)
        pick = np.flatnonzero(sized)
        if count and np.any(file & ~sized):
            # empty files: samples of no bytes the manifest answers (count_kept)
            self.count_kept(0, int(np.count_nonzero(file & ~sized)), into=count)
        if self._by_piece:
            # a cluster's holders give a range only where one holds all of it: a large raw
            # file by its pieces, each from its holder, as ``read_entry`` reads it (in a
            # batch, it was read whole from the origin, the pieces its holders hold too)
            big = (a["size"][ents[pick]] > self.manifest.piece_size) & \
                (a["codec"][ents[pick]] == 0)
            alone = [(i, k) for i, k in zip(np.flatnonzero(big).tolist(), pick[big].tolist(),
                                            strict=True)
                     if self.manifest.piece_sums(el[k]) is not None]
            if alone:
                for _, k in alone:
                    out[k] = self.read_entry(el[k], names[k], count=count)
                # (a mask, not np.setdiff1d: whose first call in a process imports numpy.ma,
                # and a DataLoader worker forked meanwhile from another thread waited on
                # that import's lock for ever)
                keep = np.ones(len(pick), bool)
                keep[[i for i, _ in alone]] = False
                pick = pick[keep]
        if not len(pick):
            return out
        sh, off = a["shard"][ents[pick]], a["offset"][ents[pick]]
        by = np.lexsort((off, sh))
        pick, sh, off = pick[by], sh[by], off[by]
        # a file asked for again in the batch (sampling with replacement, a padded epoch) is
        # read once, each repeat handed the same bytes: the origin read it 64 times in a
        # batch of 64 repeats (the repeats of an entry are next to each other now)
        again, pick, sh, off = _repeats(ents, pick, sh, off)
        order: list[int] = pick.tolist()  # positions in out, in the order of their bytes
        shards: list[int] = sh.tolist()
        offs: list[int] = off.tolist()
        lens: list[int] = a["stored"][ents[pick]].tolist()
        cuts = [0, *(np.flatnonzero(sh[1:] != sh[:-1]) + 1).tolist(), len(order)]
        # the shards held in a local tier that takes a batch: (tier, its call, positions)
        local: dict[int, tuple[ShardSource, Callable[..., Gathered], list[int]]] = {}
        # elsewhere, runs of adjacent files (order[i:j], shard, span): for a holder that
        # takes many ranges in one request (a peer), by holder; for the others (the
        # origin, partial copies), in one list
        batches: dict[int, tuple[ShardSource, PreadMany, list[_Unit]]] = {}
        remote: list[_Unit] = []
        direct: list[_Unit] = []  # the origin's, read with gather_many while they do not wait
        origin = self.origin
        holders = self._holders_of
        for g in range(len(cuts) - 1):
            i, end = cuts[g], cuts[g + 1]
            hs = holders(shards[i], el[order[i]])
            gather_many = getattr(hs[0], "gather_many", None)
            if gather_many is not None and getattr(hs[0], "local", False):
                local.setdefault(id(hs[0]), (hs[0], gather_many, []))[2].extend(range(i, end))
                continue
            src = _first_up(hs)
            many: PreadMany | None = getattr(src, "pread_many", None)
            units = batches.setdefault(id(src), (src, many, []))[2] if many else (
                direct if src is origin and self._gather is not None else remote)
            while i < end:  # a run grows while the next file starts where it ends
                start, j = offs[i], i + 1
                stop = start + lens[i]
                while j < end and offs[j] == stop and stop + lens[j] - start <= _COALESCE_LIMIT:
                    stop += lens[j]
                    j += 1
                units.append((i, j, shards[i], start, stop - start))
                i = j

        def read_local() -> None:
            pool = self._read_pool() if self._parts > 1 else None
            for src, gather_many, idx in local.values():  # hashed as they are read
                got = gather_many([(shards[i], offs[i], lens[i]) for i in idx], pool,
                                  self._parts)
                self._take(src, [order[i] for i in idx], el, names, got.datas, out, count,
                           got.sums)

        if batches or remote or direct:
            self._read_remote(batches, remote, order, el, names, out,
                              read_local if local else None, count, direct,
                              (shards, offs, lens))
        else:
            read_local()
        if again:
            self._repeat(again, ents, out, count)
        return out

    def _repeat(self, again: list[tuple[int, int]], ents: npt.NDArray[np.int64],
                out: list[bytes], count: bool | _Tally) -> None:
        """Hand each repeat ``k`` of ``again`` (k, j) the bytes read for ``out[j]``: samples
        the batch served again from its own memory, counted as such (``count_kept``)."""
        for k, j in again:
            out[k] = out[j]
        if count:
            rep = ents[[k for k, _ in again]]
            a = self.manifest.arrays
            self.count_kept(int(a["size"][rep].sum()), len(again), int(a["stored"][rep].sum()),
                            into=count)

    def _read_remote(self, batches: dict[int, tuple[ShardSource, PreadMany, list[_Unit]]],
                     remote: list[_Unit], order: list[int], el: list[int],
                     names: Sequence[PathArg | None], out: list[bytes],
                     read_local: Callable[[], None] | None, count: bool | _Tally = True,
                     direct: list[_Unit] | None = None,
                     where: tuple[list[int], list[int], list[int]] | None = None) -> None:
        """Read the runs of files that no local tier holds (read_entries): each peer's in
        one request, the others one after the other while they come back at once, from
        several threads once they are slow; then ``read_local`` (the batch's files in the
        local tiers, if any) while the threads wait on the remote ones."""
        clock = time.perf_counter

        def read_unit(u: _Unit) -> bool:
            """Read and check run ``u``; whether its read waited (``waited``)."""
            t0 = clock()
            src, parts = self._fetch_run(u, order, el)
            slow = waited(clock() - t0, u[4])
            self._take(src, order[u[0] : u[1]], el, names, parts, out, count)
            return slow

        def read_batch(src: ShardSource, pread_many: PreadMany, us: list[_Unit]) -> None:
            """One call to ``src`` for all its units, each then verified like any read;
            what it could not give goes to the per-entry path (every holder in turn)."""
            run: list[int] = []
            parts: list[bytes | None] = []
            got = pread_many([(s0, start, span) for _, _, s0, start, span in us])
            for u, data in zip(us, got, strict=True):
                if data is None:
                    self._unavailable(src)
                run += order[u[0] : u[1]]
                parts += self._fetch_run(u, order, el, (src, data))[1]
            self._take(src, run, el, names, parts, out, count)

        direct = direct or []
        every = direct + remote + [u for _, _, us in batches.values() for u in us]
        if len(every) == 1:  # one range: from the first holder that answers
            read_unit(every[0])
            if read_local is not None:
                read_local()
            return
        caller = threading.get_ident()

        def for_caller(read: Callable[..., object], *args: Any) -> None:
            with reading_for(caller):  # one reader for the tiers' pace, however many threads
                read(*args)

        threads = self.read_threads > 1
        futures: list[Future[None]] = []
        ended = False
        try:
            # each remote holder's batch at once, in the reader threads (the last one in
            # this thread if it has nothing else to read)
            alone = not remote and read_local is None
            for b, (src, many, us) in enumerate(batches.values(), 1):
                if threads and not (alone and b == len(batches)):
                    futures.append(self._read_pool().submit(for_caller, read_batch, src, many,
                                                            us))
                else:
                    read_batch(src, many, us)
            # remote reads that come back at once (the page cache) go on here, one after
            # the other, each checked as it is read: threads would only cost (a warm epoch
            # from the PFS client's page cache: 17.6 k samples/s with them, 29.5 k
            # without); once most of them, two at least, waited (a file system's latency:
            # ``waited``), the rest go to the reader threads. Most, not one: a read of the
            # page cache that waited for the CPU (a busy node) or opened its shard file
            # must not send a whole batch to threads. Where the last batch went to the
            # threads (``_remote_waits``), the first read that waits is enough: judging
            # each batch afresh cost a shared file system's latency for each of its first
            # reads (the later epochs at half capacity on the test PFS: 4-7% of their time).
            # Reads are judged in this thread only: in the threads, a read of the page
            # cache waits for the interpreter lock (a warm epoch: half of them "waited")
            k, slow, ahead = 0, 0, threads and self._remote_waits
            went = False
            # the origin's runs: many at once (gather_many), until one waits
            while direct:
                got, direct = self._gather_units(direct, where, threads, order, el, names,
                                                 out, count)
                k += got[0]
                slow += got[1]
                if threads and len(direct) + len(remote) > 1 and (
                        (slow > 1 and 2 * slow > k) or (ahead and slow == k == 1)):
                    remote = direct + remote
                    direct = []
                    pool = self._read_pool()
                    for u in remote[1:]:  # each kept as it is submitted (_settle)
                        futures.append(pool.submit(for_caller, read_unit, u))
                    read_unit(remote[0])
                    went = True
            r = 0
            while r < len(remote) and not went:
                slow += read_unit(remote[r])
                k, r = k + 1, r + 1
                if threads and len(remote) - r > 1 and (
                        (slow > 1 and 2 * slow > k) or (ahead and slow == k == 1)):
                    pool = self._read_pool()
                    for u in remote[r + 1 :]:
                        futures.append(pool.submit(for_caller, read_unit, u))
                    read_unit(remote[r])
                    went = True
            if k or went:
                self._remote_waits = went
            if read_local is not None:
                read_local()
            ended = True
        finally:  # every read begun has ended before out is returned or dropped
            _settle(futures, drop=not ended)
        for f in futures:
            f.result()  # the first error, as the caller would have seen it reading alone

    def _gather_units(self, units: list[_Unit], where: Any, threads: bool, order: list[int],
                      el: list[int], names: Sequence[PathArg | None], out: list[bytes],
                      count: bool | _Tally) -> tuple[tuple[int, int], list[_Unit]]:
        """Read the origin's runs ``units`` (read_entries) with one call (``gather_many``),
        in this thread, each file checked and counted as ``_take`` does; with ``threads``,
        the reads stop after the first that waited (a file system's latency, not the page
        cache). ((runs read whole, whether the last read waited), the runs not read yet)."""
        shards, offs, lens = where
        flat = [i for u in units for i in range(u[0], u[1])]
        ranges = [(shards[i], offs[i], lens[i]) for i in flat]
        many = self._gather
        assert many is not None
        if not threads:
            got = many(ranges)
        else:  # the first few one after the other: if none waits, the rest at once
            got = many(ranges[:GATHER_PART], SLOW_READ_S, COPY_RATE)
            if got.done == GATHER_PART < len(ranges) and not got.waited:
                more = many(ranges[GATHER_PART:], pool=self._read_pool(), parts=self._parts)
                got = Gathered(got.datas + more.datas, got.sums + more.sums, len(ranges))
        n = got.done
        self._take(self.origin, [order[i] for i in flat[:n]], el, names, got.datas[:n], out,
                   count, got.sums[:n])
        if n == len(flat):
            return (len(units), int(got.waited)), []
        b, whole, rest = flat[n], 0, []
        for u in units:  # in order: those before b were read, b's run from b on is not
            if u[1] <= b:
                whole += 1
            elif u[0] >= b:
                rest.append(u)
            else:
                rest.append((b, u[1], u[2], offs[b], u[3] + u[4] - offs[b]))
        return (whole, int(got.waited)), rest

    def _read_pool(self) -> ThreadPoolExecutor:
        """This process's reader threads (a forked child makes its own)."""
        got = self._pool
        pid = os.getpid()
        if got is None or got[0] != pid:
            with self._lock:
                got = self._pool
                if got is None or got[0] != pid:
                    got = (pid, ThreadPoolExecutor(self.read_threads - 1,
                                                   thread_name_prefix="stagefs-read"))
                    self._pool = got
        return got[1]

    def _fetch_run(self, u: _Unit, order: list[int], el: list[int],
                   fetched: tuple[ShardSource, bytes | None] | None = None
                   ) -> tuple[ShardSource | None, list[bytes | None]]:
        """The stored bytes of each file of run ``u``: read with one call from the first
        holder that answers (or ``fetched``: a holder and the bytes it gave for the run,
        None if it gave none), not checked yet; None for each if no holder gave them."""
        i, j, shard, start, span = u
        src: ShardSource | None = None
        try:
            src, got = fetched or self._fetch_from(shard, start, span)
        except (SourceUnavailable, ChecksumError, CorruptShardError):
            got = None
        if got is None:
            return src, [None] * (j - i)
        if j == i + 1:
            return src, [got]  # the whole span is the file
        blob, offset, stored = memoryview(got), self._offset, self._stored
        return src, [bytes(blob[offset[e] - start : offset[e] - start + stored[e]])
                     for e in (el[k] for k in order[i:j])]

    def _take(self, src: ShardSource | None, run: Sequence[int], el: list[int],
              names: Sequence[PathArg | None], got: Sequence[bytes | None],
              out: list[bytes], count: bool | _Tally = True,
              sums: Sequence[int] | None = None
              ) -> None:
        """``got[i]`` is what ``src`` gave for the file at ``out[run[i]]`` (None: nothing;
        ``sums[i]``: its checksum taken as it was read, if it was: ``gather``):
        each is checked as ``read_entry`` checks a whole file (``check``) and counted; a file
        not given or given wrong is read by ``read_entry``, which tries every holder in turn,
        counts and logs, and lets a holder with bad bytes drop its copy."""
        whole, trust = self._whole, self._trust
        fill = self._from_origin if src is self.origin else None
        again: list[int] = []
        nbytes = stored = 0
        decoded = self._decoded(src, run, el, got)
        for i, (k, raw) in enumerate(zip(run, got, strict=True)):
            e = el[k]
            if raw is None:
                again.append(k)
                continue
            try:
                done = decoded[i] if decoded is not None else None
                data = done if done is not None else \
                    whole(e, raw, trust(src, e),  # type: ignore[arg-type]
                          None if sums is None else sums[i])
            except CorruptShardError:
                again.append(k)  # read_entry, below, tries every holder, counts and logs it
                continue
            out[k] = data
            nbytes += len(data)
            stored += len(raw)  # type: ignore[arg-type]
            if fill is not None:
                fill(self._shard[e], self._offset[e], raw, self.verify)
        if count and len(again) < len(run):
            counted = (lambda: [(int(self._offset[el[k]]), int(self._stored[el[k]]))
                                for k in run if k not in again]) if len(run) > 1 else None
            self._count(src, len(run) - len(again), nbytes, stored, counted, count)
        for k in again:
            out[k] = self.read_entry(el[k], names[k], count=count)

    def _decoded(self, src: ShardSource | None, run: Sequence[int], el: list[int],
                 got: Sequence[bytes | None]) -> list[bytes | None] | None:
        """The compressed files of a batch (``_take``'s ``got``) decoded and checked
        (``_whole``) by this thread and reader threads at once, each taking the next file
        as it is free (not a fixed half each: a reader thread wakes some 40 us late, and
        halves left this thread waiting on it; 54 k documents/s against 50 k): zstd
        decodes without the interpreter lock, and decoding is most of the cost of a
        compressed file read from memory (12-15 us of an 18 KB document, about half of what
        a ``read`` of it costs). None at the files stored raw and at any whose check failed
        (the caller's ``_whole`` says why); None for a batch too small to gain."""
        if self._parts < 2 or len(run) < 2 * GATHER_PART:
            return None
        codec, size, trust = self._codec, self._size, self._trust
        todo = [i for i, k in enumerate(run) if codec[el[k]] and got[i] is not None
                and not trust(src, el[k])]  # type: ignore[arg-type]
        if len(todo) < 2 * GATHER_PART or \
                sum(int(size[el[run[i]]]) for i in todo) < _DECODE_IN_PARTS:
            return None
        out: list[bytes | None] = [None] * len(run)
        whole = self._whole
        left = iter(todo)  # shared (a list iterator's next is atomic under the GIL)

        def part(_a: int, _b: int) -> None:
            for i in left:
                try:
                    out[i] = whole(el[run[i]], got[i], False)  # type: ignore[arg-type]
                except CorruptShardError:  # (not suppress(): a context a file costs)
                    continue

        in_parts(self._read_pool(), self._parts, self._parts, part)
        return out

    def _entry_array(self, entries: Sequence[int] | npt.NDArray[np.integer[Any]]
                     ) -> npt.NDArray[np.int64]:
        """``entries`` as an array of entries of this manifest; else IndexError (an entry
        outside it) or TypeError (not whole numbers)."""
        raw = np.asarray(entries)
        if raw.ndim > 1:
            raise TypeError(f"entries are a flat list of manifest indices, not an array of "
                            f"shape {raw.shape}: flatten it first")
        if raw.size == 0:
            return np.zeros(0, np.int64)
        if raw.dtype.kind not in "iu" and not isinstance(entries, np.ndarray):
            # whole numbers of mixed kinds (numpy's uint64 with an int) that numpy made
            # floats of, or something else: each taken as read_entry takes it, the first
            # that is not a whole number named
            ints = [_entry_number(x) for x in entries]
            try:
                raw = np.asarray(ints, np.int64)
            except OverflowError:  # beyond any manifest: named below
                raw = np.asarray(ints, object)
        if raw.dtype.kind not in "iu" and (
                raw.dtype.kind != "O" or not all(isinstance(x, int) for x in raw.flat)):
            raise TypeError(f"entries are whole numbers (manifest indices), not "
                            f"{raw.dtype} ({raw.flat[0]!r}): look entries up with the Store")
        n = len(self.manifest)
        bad = [int(x) for x in raw.flat if not 0 <= x < n][:1] if raw.dtype.kind == "O" else \
            raw[(raw < 0) | (raw >= n)][:1].tolist()
        if bad:
            self._no_entry(bad[0])
        return raw.astype(np.int64)

    def _no_entry(self, e: object) -> None:
        raise IndexError(f"entry {e} is not in this pack's manifest (entries 0 to "
                         f"{len(self.manifest) - 1}): look entries up with the Store")

    @_while_open
    def read_entry(self, e: int, path: PathArg | None = None, start: int = 0,
                   length: int = -1, *, count: bool | _Tally = True,
                   sample: int | None = None
                   ) -> bytes:
        """The verified bytes of entry ``e``: the whole file, or ``length`` bytes from
        ``start`` (to the end if ``length`` is negative). ``count=False``: not counted in
        the read counters (a sample a front end counted already, ``count_delivered``).
        ``sample``: the samples it counts (a file object counts one for all its reads);
        by default one for a read from the start of the file. (``count``: a batch's
        ``_Tally``, to be counted once the batch has returned: ``read_entries``.)

        The one read path: each holder of the shard in turn (the tiers, then the origin)
        until one returns bytes that pass the checksum: the file's for a whole file, the
        pieces' for a range of a large raw file (only the pieces covering the range are
        read); in place, the origin's bytes of a file whose sum is not learnt yet (it
        checked the file against the scan). A holder with bad bytes is counted, logged,
        and told to drop its copy.
        """
        if e.__class__ is not int:
            e = _entry_number(e)
        if not 0 <= e < self._entries:
            self._no_entry(e)
        if self._kind[e] != KIND_FILE:
            e = self._file_of(e, path)
        size = self._size[e]
        shard, offset, stored, codec = self._shard[e], self._offset[e], self._stored[e], \
            self._codec[e]
        sums: Sequence[int] | None = None  # a range's piece checksums
        derive = False
        if start or 0 <= length < size:  # a range
            if start < 0:
                raise ValueError(f"{self._show(e, path)}: a range starts at an offset of 0 "
                                 f"or more, not {start}")
            end = size if length < 0 else min(size, start + length)
            if start >= end:
                return b""
            piece = self.manifest.piece_size
            if codec or size <= piece:  # one piece: the whole file
                return self.read_entry(e, path, count=count,
                                       sample=1 if sample is None else sample)[start:end]
            if self.verify:
                sums = self.manifest.piece_sums(e) or self._derived.get(e)
                derive = sums is None
                lo, first = start - start % piece, start // piece
                hi = min(size, end + (-end) % piece)
            else:
                lo, hi, first = start, end, 0
            offset, stored = offset + lo, hi - lo
        elif self._by_piece and not codec and size > self.manifest.piece_size \
                and self.manifest.piece_sums(e) is not None:
            # a cluster's holders give a range only where one holds all of it (a daemon's
            # partial copy holds some of a file's pieces): by pieces, each from its holder
            # (whole, it went to the origin for every piece, those held too)
            piece = self.manifest.piece_size
            return b"".join(self.read_entry(e, path, k, piece, count=count,
                                            sample=sample if k == 0 else 0)
                            for k in range(0, size, piece))
        elif size == 0:
            if count:  # a sample of no bytes the manifest answers
                self.count_kept(0, 1 if sample is None else sample, into=count)
            return b""
        tried: list[str] = []
        no_fds: SourceUnavailable | None = None  # a holder failed for want of a descriptor
        denied = False  # the origin refused by a file's mode (its reason says what to do)
        holders = self._holders_of(shard, e)
        for src in holders:
            # before the check reads the sum: in place, another process may learn it meanwhile
            trust = self._trust(src, e)
            try:
                if derive:
                    # in place, the origin checked the file against the scan: its range is
                    # believed as it is (no sum is learnt from a range). Derived first, the
                    # whole file was read to serve a range, then the range again, by each
                    # READ at once (a FUSE mount's): 70 MiB read as 210 from the origin
                    sums = None if trust else self._derive(src, e, path)
                raw = src.pread(shard, offset, stored)
            except SourceUnavailable as exc:
                self._unavailable(src)
                if out_of_descriptors(exc):
                    no_fds = exc
                denied |= src is self.origin and isinstance(exc.__cause__, PermissionError)
                # the origin's reason in the error (a permission, a missing mount); a tier's
                # or a stream's is that it does not hold the shard (yet)
                tried.append(f"{src.name} (unavailable: {exc})" if src is self.origin
                             else f"{src.name} (unavailable)")
                log.debug("%s: %s unavailable (%s)", self._where(e), src.name, exc)
                continue
            except CorruptShardError as exc:  # from _derive: the whole file is wrong here
                self._bad(src, e, path, exc, tried, src is holders[-1])
                continue
            try:
                if sums is not None:
                    k = bad_piece(raw, piece, sums, first)
                    if k >= 0:
                        raise piece_error(k, piece, size)
                    data = raw if start == lo and end == hi else raw[start - lo : end - lo]
                elif derive:  # a range of the origin, believed (above)
                    data = raw if start == lo and end == hi else raw[start - lo : end - lo]
                else:
                    data = self._whole(e, raw, trust)
            except CorruptShardError as exc:
                psums = self.manifest.piece_sums(e) if sums is None and not codec else None
                if psums is not None and len(raw) == size:  # a whole file: name its bad piece
                    k = bad_piece(raw, self.manifest.piece_size, psums, 0)
                    exc = piece_error(k, self.manifest.piece_size, size) if k >= 0 else exc
                self._bad(src, e, path, exc, tried, src is holders[-1])
                continue
            if count:  # a sample per file read: a range counts one if it starts the file
                self._count(src, int(start == 0) if sample is None else sample, len(data),
                            len(raw), into=count)
            if src is self.origin and self._from_origin is not None and (
                    sums is not None or stored == self._stored[e]):
                # the whole file, or the checked pieces of a range: into the tiers
                self._from_origin(shard, offset, raw, self.verify)
            return data
        if not tried:
            raise ConfigError(f"no source can serve shard {shard}")
        if all("(unavailable" in t for t in tried):
            if no_fds is not None:  # not the shared file system's fault: say what is
                raise DescriptorLimitError(self._where(e)) from no_fds
            raise OriginUnavailableError(self._origin_name(), self._where(e), ", ".join(tried),
                                         denied=denied)
        raise ChecksumError(self._show(e, path), f"{self._where(e)} via {', '.join(tried)}")

    def _whole(self, e: int, raw: bytes, trust: bool, digest: int | None = None) -> bytes:
        """The content of whole file ``e`` from the stored bytes a holder gave: decoded and
        checked against the file's checksum (``check``), or only decoded by a Store that
        does not verify; else CorruptShardError. Every read of a whole file comes here
        (``read_entry``, ``read_entries``).

        ``trust`` (``_trust``, asked before the sum was read): in place, the origin checked
        the file against the scan; its sum is learnt from this read, and what it wrote into
        a tier is checked against that sum. ``digest``: the checksum of ``raw`` taken as it
        was read (``gather``)."""
        codec = self._codec[e]
        if not self.verify:
            return decode(codec, raw, self._size[e], "") if codec else raw
        try:
            return check(codec, raw, self._size[e], self._checksum[e], digest)
        except CorruptShardError:
            if not trust:
                raise
        if digest is None or codec:
            digest = checksum(raw)
        self._sums.record(e, digest)  # type: ignore[union-attr]
        return raw

    def _derive(self, src: ShardSource, e: int, path: PathArg | None) -> Sequence[int]:
        """Piece checksums for a file that has none in its manifest (a version 1 pack, an
        in-place dataset): read the whole file from ``src`` once, in parts, and keep the
        checksum of each piece if the whole file matches its checksum."""
        m = self.manifest
        shard, offset, size = m.shard[e], m.offset[e], m.size[e]
        trust = self._trust(src, e)  # before the sum is read (see _trust)
        h = StreamSum(m.piece_size)
        for pos in range(0, size, _STREAM):
            h.update(src.pread(shard, offset + pos, min(_STREAM, size - pos)))
        digest = h.digest()
        if digest != self._checksum[e]:
            if not trust:
                raise CorruptShardError("checksum mismatch")
            self._sums.record(e, digest)  # type: ignore[union-attr]
        if m.piece is None and m.path not in _V1_NOTICED:
            _V1_NOTICED.add(m.path)
            log.warning("%s: a version 1 pack has no piece checksums: the first range read "
                        "of a large file reads and verifies the whole file. Re-pack the "
                        "dataset with this stagefs to verify ranges by piece.", m.path)
        self._derived[e] = h.pieces
        return h.pieces

    def _bad(self, src: ShardSource, e: int, path: PathArg | None, exc: Exception,
             tried: list[str], last: bool) -> None:
        """``src`` returned bad bytes for entry ``e``: count it, say so (the error raised
        says so when it was the last holder), let it drop them."""
        self.stats.checksum_failures += 1
        if self._counts is not None:
            self._counts.count("checksum_failures")
        last_from = getattr(src, "last_from", None)  # the stream: which copies it read
        who = last_from() if last_from is not None else src.name
        # what was wrong, unless the error says it: which piece, a size, a frame
        tried.append(who if str(exc) == "checksum mismatch" else f"{who} ({exc})")
        log.log(logging.DEBUG if last else logging.WARNING,
                "%s, %s: bad bytes from %s (%s); trying the next holder",
                self._where(e), self._show(e, path), who, exc)
        try:
            self._corrupt(src, self._shard[e])
        except CorruptShardError as why:  # the origin's shard file is the cause: the file too
            raise CorruptShardError(f"{self._show(e, path)}: {why}") from why

    def _count(self, src: ShardSource | None, reads: int, nbytes: int, stored: int,
               files: Callable[[], Sequence[tuple[int, int]]] | None = None,
               into: bool | _Tally = True) -> None:
        """``reads`` samples (``nbytes`` bytes; ``stored`` as stored) came from ``src``:
        this process's counts, and the job's by holder (memory or disk tier, peer, origin).
        ``files``: where in the shard each sample's stored bytes are, when ``reads`` files
        of one run were read at once (asked only if they came from several holders: each
        sample to the holder of most of its bytes). ``into``: a batch's ``_Tally``, which
        keeps them until the batch has returned (``_add``)."""
        if self._counts is None:
            self._add("origin", reads, nbytes, stored, into)  # (this process's stats only)
            return
        served_by = getattr(src, "served_by", None)  # the stream: the holders of its read
        split = served_by() if served_by is not None else None
        if not split:  # one holder (the common case, without the loop below)
            holder = "origin" if src is self.origin else getattr(src, "holder", "peer")
            self._add(holder if holder in HOLDERS else "peer", reads, nbytes, stored, into)
            return
        # from several holders (a large file's pieces in two tiers and the origin, or a
        # run's files in a tier and not): the bytes to each; the samples to the one that
        # gave most of each (one file: the first, which gave the most)
        samples = _samples_by_holder(src, files()) if len(split) > 1 and files else None
        left_n, left_s = nbytes, stored
        for k, (holder, part) in enumerate(split):
            last = k == len(split) - 1
            n = left_n if last else nbytes * part // max(stored, 1)
            m = left_s if last else part
            got = (reads if k == 0 else 0) if samples is None else samples.get(holder, 0)
            self._add(holder if holder in HOLDERS else "peer", got, n, m, into)
            left_n, left_s = left_n - n, left_s - m

    def _add(self, holder: str, reads: int, nbytes: int, stored: int,
             into: bool | _Tally = True) -> None:
        """Count ``reads`` samples of ``nbytes`` (``stored`` as stored) served by ``holder``:
        in this process's stats and the job's counters, or in ``into``, a batch's tally
        (``read_entries`` adds it here once the batch has returned)."""
        if isinstance(into, _Tally):
            into.append((holder, reads, nbytes, stored))
            return
        self.stats.reads += reads
        self.stats.bytes += nbytes
        if self._counts is not None:
            self._counts.add(holder, reads, nbytes, stored)

    def count_kept(self, nbytes: int, reads: int = 1, stored: int | None = None, *,
                   into: bool | _Tally = True) -> None:
        """``reads`` samples of ``nbytes`` in all (``stored`` as stored) that a front end
        served again from its own memory (the FUSE server's last files, a batch's repeats of
        a file), or that need no holder (empty files: the manifest, in memory, answers
        them): ``memory``'s. ``into``: as ``_count``'s."""
        self._add("memory", reads, nbytes, nbytes if stored is None else stored, into)

    def count_delivered(self, nbytes: int) -> None:
        """One sample of ``nbytes`` that a front end delivered without a read through this
        Store (the FUSE mount pushing a streamed file into the kernel's page cache, which
        then serves the program's read): counted as the origin's, as a stream's bytes are
        in the first epoch, and as pushed (``stagefs status``: "pushed")."""
        self._count(self.origin, 1, nbytes, nbytes)  # a pushed file is stored raw
        if self._counts is not None:
            self._counts.count("pushed_reads")
            self._counts.count("pushed_bytes", nbytes)

    def _unavailable(self, src: ShardSource) -> None:
        """``src`` could not serve a read (the next holder is asked): counted for a peer or
        the origin, not for this node's tier copies and stream, which route reads of what
        they do not hold (yet) on to the next holder as a matter of course."""
        if src is not self.origin and getattr(src, "holder", None) in HOLDERS:
            return
        self.stats.unavailable += 1
        if self._counts is not None:
            self._counts.count("unavailable")

    def _origin_holders(self, shard: int) -> Sequence[ShardSource]:
        return self._origin_only

    def _trust(self, src: ShardSource, e: int) -> bool:
        """In place, before a file's shard is placed its checksum is unknown: only the
        origin (which checked the file's size and mtime against the scan) is believed.

        Asked before the bytes are checked against the sum: another process may learn the
        sum in between (it writes the sum, then marks it known), and origin bytes checked
        against the sum not yet written must still be believed, not called corrupt."""
        return self._sums is not None and src is self.origin and not self._sums.known(e)

    def _origin_name(self) -> str:
        return str(getattr(self.origin, "root", None) or self.pack_dir)

    def _fetched(self, nbytes: int, reads: int) -> None:
        """A read of the origin by a store without tiers: counted for the job, and its
        record written if it was last written a second ago or more."""
        assert self._counts is not None
        self._counts.fetched(nbytes, reads)
        if time.monotonic() - self._record_at >= RECORD_EVERY_S:
            self._write_record(wait=False)

    def _write_record(self, *, wait: bool) -> None:
        """This store's stats record (``self._record``), as a TierChain's (``counters``);
        not by a forked child, whose counts are not the parent's (its reads are counted in
        its own counters file); ``wait=False``: not if another thread writes it now."""
        if self._record is None or os.getpid() != self._record_pid \
                or not self._record_lock.acquire(blocking=wait):
            return
        try:
            self._record_at = time.monotonic()
            write_record(self._record, {
                "pid": os.getpid(), "pack_id": self.manifest.pack_id.hex(),
                "origin": self._origin_name(), "open": not self._closed,
                "misses": self.stats.reads, "origin_stats": self.origin.stats.as_dict(),
                "tiers": {}})
        finally:
            self._record_lock.release()

    def _fetch_from(self, shard: int, offset: int, length: int) -> tuple[ShardSource, bytes]:
        """The first holder that answers, and its bytes (not verified here)."""
        for src in self._holders(shard):
            try:
                return src, src.pread(shard, offset, length)
            except SourceUnavailable:
                continue
        raise SourceUnavailable(f"shard {shard}: no holder answered")

    def _corrupt(self, src: ShardSource, shard: int) -> None:
        """A holder returned bad bytes: tell it to drop its copy, if it keeps copies (a peer
        to check its copy); the origin says what is wrong with its shard file, if that is
        the cause. Not once the Store is closed: a read under way then may have read a
        descriptor close() let go of, and a good copy must not be dropped for it."""
        if self._closed:
            return
        drop = getattr(src, "drop", None)
        if drop is not None:
            drop(shard)
        report = getattr(src, "report_bad", None)  # a peer: it checks its copy (CHECK)
        if report is not None:
            report(shard)
        diagnose = getattr(src, "diagnose", None)
        if diagnose is not None:
            diagnose(shard)

    def _file_of(self, e: int, path: PathArg | None) -> int:
        """The regular file that entry ``e`` (not one itself) is read as: a symlink's
        target, followed as ``read`` follows a path's (NotFoundError if it is not in the
        dataset, SymlinkLoopError); else IsADirectoryError_ (the root named "/")."""
        shown = self._show(e, path)
        if self._kind[e] == KIND_SYMLINK:
            t = self.namespace.follow(e, shown)
            if self._kind[t] == KIND_FILE:
                return t
        raise is_a_directory(shown)

    def _where(self, e: int) -> str:
        return f"shard {self.manifest.shards[self.manifest.shard[e]].name}"

    def _show(self, e: int, path: PathArg | None) -> str:
        if path is not None:
            return os.fsdecode(path) if not isinstance(path, str) else path
        return os.fsdecode(self.manifest.path_of(e)) or "/"  # (the root's is "")

    @_while_open
    def open(self, path: PathArg, mode: str = "rb", buffering: int = -1,
             encoding: str | None = None, errors: str | None = None,
             newline: str | None = None) -> Any:
        """A read-only file object (read, readinto, seek, tell, readline, iteration): binary
        ('rb'), or text ('r') with ``encoding`` (default UTF-8), ``errors`` and ``newline``
        as the builtin ``open`` takes them."""
        from stagefs.fileobj import open_entry

        if any(c in mode for c in "wax+"):
            raise ReadOnlyError(self._show(0, path))
        if mode not in ("rb", "br", "r", "rt", "tr"):
            raise ValueError(f"invalid mode {mode!r} (stagefs files open as 'rb' or 'r')")
        if "b" in mode and (encoding, errors, newline) != (None, None, None):
            raise ValueError(f"mode {mode!r} is binary: it takes no encoding, errors or "
                             "newline (open with 'r' to read text)")
        e = self.namespace.file_entry(path)
        return open_entry(self, e, os.fsdecode(path) if not isinstance(path, str) else path,
                          mode, buffering, encoding=encoding, errors=errors, newline=newline)

    # -- tiers -------------------------------------------------------------------------------

    def prefetch(self, shards: Iterable[int]) -> None:
        """Place these shards into the tiers in this order, soonest first (background).
        A number that is no shard of the pack is refused here, naming it: the background
        copy failed on it with a traceback in the log, and the caller never knew."""
        if self._policy is not None:
            order = list(shards)
            n = len(self.manifest.shards)
            bad = [s for s in order if not isinstance(s, (int, np.integer)) or not 0 <= s < n]
            if bad:
                raise IndexError(f"{bad[0]!r} is not a shard of this pack (shards 0 to "
                                 f"{n - 1}): prefetch takes shard numbers ('stagefs stat "
                                 "PACK PATH' names a file's)")
            self._policy.prefetch(order)

    def held_shards(self) -> set[int]:
        """The shards this node holds in its tiers."""
        return self._policy.held_shards() if self._policy is not None else set()

    def status(self) -> dict[str, Any]:
        """Counters of this process: per tier (bytes used, shards held, hits, placed,
        dropped), misses, every origin operation (``origin_stats``), the samples and bytes
        read from each holder (``holders``) and the hit rate: the bytes read that did not
        come from the origin, over all the bytes read."""
        if self._policy is not None:
            out = self._policy.status()
        else:
            out = {"pid": os.getpid(), "tiers": [], "misses": self.stats.reads, "hits": 0,
                   "origin": self._origin_name(), "shards": len(self.manifest.shards)}
        out["origin_stats"] = self.origin.stats.as_dict()
        out["reads"] = asdict(self.stats)
        if self._counts is not None:
            mine = holder_summary(self._counts.snapshot())
            out.update(holders=mine["holders"], hit_rate=mine["hit_rate"])
        else:
            out["hit_rate"] = 0.0  # every byte from the origin
        return out

    # -- lifecycle ---------------------------------------------------------------------------

    def close(self, *, wait: bool = True) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            pool, self._pool = self._pool, None
            # every way in says so (the manifest's arrays are let go of below)
            closed = functools.partial(_closed_store, self.pack_dir, self._opened_with())
            for name in _WAYS_IN:
                setattr(self, name, closed)
            # and the directory entries of its listings (namespace.DirEntry)
            self.namespace.closed = functools.partial(_closed_error, self.pack_dir,
                                                      self._opened_with())
        if pool is not None and pool[0] == os.getpid():
            pool[1].shutdown(wait=wait)
        self._users.close(self._release)

    def _release(self) -> None:
        """What close() lets go of, once no read is under way."""
        if self._policy is not None:
            self._policy.close()
        self._write_record(wait=True)  # (before the manifest it names is let go of)
        if self._runtime is not None:
            self._runtime.unregister()
        self.origin.close()
        if self._sums is not None:
            self._sums.close()
        if self._counts is not None:
            self._counts.close()
        self.manifest.close()

    def __del__(self) -> None:
        """A Store let go of without close() (``stagefs.open(p).read(name)`` in a loop, a
        notebook cell run again) gives back what it holds, as a file object does: each kept
        the shard's and the manifest's descriptors, a tier's, its counters and its lease,
        and the process ran out of descriptors after a few hundred. Quietly: the garbage
        collector may run this in any thread, even at exit, so nothing is waited for."""
        try:  # no module-level name here: at exit, modules may be torn down already
            if not self.__dict__.get("_closed", True) and self.__dict__.get("_owned", False):
                self.close(wait=False)
        except Exception:  # nothing to tell, and no one to tell it to
            pass

    def _opened_with(self) -> str:
        """The call that opens this dataset again (for the errors of a closed store): a
        cluster's store is stagefs.connect's."""
        if getattr(self._policy, "reopen", None) is not None:
            return "stagefs.connect()"
        return "stagefs.open"

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __getstate__(self) -> dict[str, Any]:
        if self._closed:  # as a closed file: a spawned worker's copy would read on, reopened
            _closed_store(self.pack_dir, self._opened_with())
        reopen = getattr(self._policy, "reopen", None)
        if reopen is not None:  # (function, args) that open it again (a cluster: connect)
            return {"policy_reopen": reopen()}
        if self._reopen is not None:
            return {"reopen": self._reopen}
        return {"pack_dir": self.pack_dir, "verify": self.verify}

    def __setstate__(self, state: dict[str, Any]) -> None:
        if "policy_reopen" in state:
            fn, args = state["policy_reopen"]
            self._adopt(fn(*args))
            return
        if "reopen" in state:  # tiers or in place: reopen the same way (_open.py)
            from stagefs._open import build_store

            self._adopt(build_store(**state["reopen"]))
            return
        self.__init__(state["pack_dir"], verify=state["verify"])  # type: ignore[misc]

    def _adopt(self, other: Store) -> None:
        """Become ``other``, a Store just opened: what it holds is this one's now, so its
        own going away (``__del__``) must not close it."""
        self.__dict__.update(other.__dict__)
        other._owned = False
        _STORES.add(self)

    def __repr__(self) -> str:
        return f"<stagefs.Store {self.pack_dir!r} ({len(self.manifest)} entries)>"


def _entry_number(e: object) -> int:
    """An entry given as another kind of whole number (numpy's, torch's) as an int; a
    float, a string or None is a TypeError naming it, not an error from deep inside."""
    if isinstance(e, (bool, np.bool_)):
        raise TypeError(f"an entry is a whole number (a manifest index), not {e!r}")
    try:
        return operator.index(e)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(f"an entry is a whole number (a manifest index), not "
                        f"{type(e).__name__} ({e!r}): look entries up with the Store"
                        ) from None


def _repeats(ents: npt.NDArray[np.int64], pick: npt.NDArray[np.intp],
             sh: npt.NDArray[Any], off: npt.NDArray[Any]
             ) -> tuple[list[tuple[int, int]], npt.NDArray[np.intp], npt.NDArray[Any],
                        npt.NDArray[Any]]:
    """The positions ``pick`` of a batch (read_entries), sorted by shard and offset, with
    their shards ``sh`` and offsets ``off``: the repeats of the entry just before, as
    (position, position of its first ask), and the rest."""
    e = ents[pick]
    rep = e[1:] == e[:-1]
    if not rep.any():
        return [], pick, sh, off
    first = np.concatenate(([True], ~rep))
    src = np.maximum.accumulate(np.where(first, np.arange(len(pick)), 0))
    again = list(zip(pick[~first].tolist(), pick[src[~first]].tolist(), strict=True))
    return again, pick[first], sh[first], off[first]


def _settle(futures: Sequence[Future[Any]], *, drop: bool) -> None:
    """Wait until every read of ``futures`` that has begun has ended. ``drop`` (the batch
    failed or was interrupted in the caller's thread, even while it handed its runs to the
    threads: each future is kept as it is submitted), or a Ctrl-C while waiting: the
    reads not begun yet are not made. The reader threads read the rest of a dropped batch
    before: 64 files from a slow origin, 8 s after a Ctrl-C (and the Store's close, at the
    end of a ``with``, waited for them too)."""
    if drop:
        for f in futures:
            f.cancel()
    try:
        wait_futures(futures)
    except BaseException:
        for f in futures:
            f.cancel()
        wait_futures(futures)  # the reads begun: each ends within one read of its holder
        raise


def waited(elapsed: float, nbytes: int) -> bool:
    """Whether a read of ``nbytes`` that took ``elapsed`` seconds waited on a file system's
    latency (a shared file system, a disk: reads in flight at once go faster) rather than
    copying from memory (the page cache: threads would only cost). The rule before, 1 ms a
    read, took the test PFS's 0.76 ms random reads for the page cache: a partial-capacity
    epoch read its origin files one after the other, at half the rate of 8 at once."""
    return elapsed > SLOW_READ_S + nbytes / COPY_RATE


def _untold(holders: Callable[[int], Sequence[ShardSource]], shard: int,
            _entry: int) -> Sequence[ShardSource]:
    """``holders(shard)``, for holders not told which file is read (a cluster, the origin)."""
    return holders(shard)


def _first_up(hs: Sequence[ShardSource]) -> ShardSource:
    """The first holder not known to be down (a peer after a failure), else the first."""
    for h in hs:
        down = getattr(h, "is_down", None)
        if down is None or not down():
            return h
    return hs[0]


def open(
    path: PathArg,
    *,
    tiers: Sequence[str | TierSpec] | str | None = None,
    runtime: str | os.PathLike[str] | None = None,
    verify: bool = True,
) -> Store:
    """Open the dataset at ``path`` and return a Store.

    ``path`` is a pack directory, or a raw directory used in place (its manifest is built by
    one parallel scan and cached in the runtime directory). ``tiers`` are node-local
    directories with a capacity (``"/dev/shm/x:16GiB"``, ``"/nvme/x:80%"``), fastest first;
    without them ``$STAGEFS_TIERS`` (comma-separated) is used, and without that the origin
    is read directly. ``runtime`` (or ``$STAGEFS_RUNTIME``) is the job's runtime directory.
    """
    from stagefs._open import build_store

    p = absolute(path)
    if not os.path.exists(p):
        closed = unreachable(p)  # another user's private directory is not "no such file"
        if closed:
            raise PermissionError(errno.EACCES, f"Permission denied: {closed}; ask its owner "
                                  "for read access, or use a copy of your own", p)
        raise NotFoundError(p, "No such file or directory (no dataset here)")
    if not os.path.isdir(p):
        raise ConfigError(f"{p}: a dataset is a directory (a pack, or raw files to use in "
                          f"place), not a file; name the directory that holds {MANIFEST_NAME}")
    if not os.path.exists(os.path.join(p, MANIFEST_NAME)) and os.path.isdir(
            os.path.join(p, ".stagefs-pack")):
        from stagefs.errors import CorruptManifestError

        raise CorruptManifestError(
            f"{p}: not a pack yet (no {MANIFEST_NAME}): finish the interrupted pack by running "
            "the same 'stagefs pack' command again."
        )
    if not os.path.exists(os.path.join(p, MANIFEST_NAME)):
        from stagefs.errors import CorruptManifestError

        names = os.listdir(p)
        if not names:
            raise CorruptManifestError(
                f"{p}: not a pack (no {MANIFEST_NAME}) and no files to use in place: an empty "
                f"directory. Pack a tree with 'stagefs pack SRC {p}', or open a directory of "
                "files."
            )
        if "cluster.json" in names:  # (cluster/cmap.py MAP_NAME) a node daemon's runtime
            raise ConfigError(
                f"{p} is a cluster job's runtime directory, not a dataset: read the job's "
                f"dataset through its node daemon with stagefs.connect(runtime={p!r}) (or "
                "set STAGEFS_RUNTIME to it and call stagefs.connect())")
        if {"claims", "stats", "procs"} <= set(names):  # runtime.py's layout
            raise ConfigError(
                f"{p} is a stagefs runtime directory (claims, counters, leases), not a "
                "dataset: open the pack or the directory of files the job reads")
        if any(n.startswith("shard-") and n.endswith(".sfs") for n in names):
            raise CorruptManifestError(
                f"{p}: a pack's shards without its {MANIFEST_NAME} (deleted, or not copied "
                "with them): copy the whole pack again, or pack the source tree again with "
                f"'stagefs pack SRC {p} --force'"
            )
    return build_store(p, tiers=tiers, runtime=runtime, verify=verify)


def _samples_by_holder(src: ShardSource | None, files: Sequence[tuple[int, int]]
                       ) -> dict[str, int] | None:
    """How many of ``files`` (shard offset, stored length) each holder of ``src``'s last
    read gave most of; None if the read does not say (``served_spans``)."""
    spans_of = getattr(src, "served_spans", None)
    spans = spans_of() if spans_of is not None else None
    if not spans:
        return None
    out: dict[str, int] = {}
    for off, n in files:
        most: dict[str, int] = {}
        for a, b, holder in spans:
            part = min(off + n, b) - max(off, a)
            if part > 0:
                most[holder] = most.get(holder, 0) + part
        best = max(most, key=most.__getitem__) if most else spans[0][2]
        out[best] = out.get(best, 0) + 1
    return out
