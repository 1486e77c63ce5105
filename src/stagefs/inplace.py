"""In-place datasets: a raw directory used without packing.

One parallel scan (a pool of threads taking directories from a queue, with a progress bar)
builds a manifest whose shards are virtual: the files, in path order, cut into groups of about
``shard_size`` bytes (tiers/inplace.py reads them). The manifest is cached in the runtime
directory, never in the origin, and a later open reuses it.

Staleness rule (docs/decisions/0006-in-place-datasets.md): at open, every directory the scan
saw is stat'ed again (and listed again if its mtime is too close to the scan to tell); if any
is gone or changed (a file was added, removed or renamed in it), the cache is stale and the
directory is scanned again, which gives the dataset a new pack id, so no copy staged from the
old scan is ever used. A scan that finds the same tree as another job's kept scan takes that
scan, its pack id and its learnt sums (``InPlaceCache.adopt``): a new job reads the copies an
earlier job left in a persistent tier. A file changed in place (same directory mtime) is
caught when the origin opens it: its size and mtime must match the scan, or the read fails
with a ``SourceChangedError`` naming it, and the cached scan is marked stale
(``InPlaceCache.mark_stale``), so that the next open scans again, as the error says.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import stat as st
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
from tqdm import tqdm
from xxhash import xxh3_64_hexdigest

from stagefs._fsutil import atomic_write, file_lock
from stagefs.errors import ConfigError, StagefsError, UnreadableSourceError
from stagefs.format import (
    KIND_DIR,
    KIND_FILE,
    KIND_SYMLINK,
    NO_INDEX,
    Manifest,
    ManifestBuilder,
    shard_name,
)
from stagefs.format.manifest import Entry, ShardInfo
from stagefs.format.spec import SHARD_HEADER
from stagefs.runtime import Runtime
from stagefs.tiers.base import OriginStats

__all__ = ["DEFAULT_SHARD_SIZE", "InPlaceCache", "open_manifest", "scan_tree"]

log = logging.getLogger("stagefs.inplace")

DEFAULT_SHARD_SIZE = 64 * 2**20
_UNREADABLE_HINT = ("Give this user read and search permission on them (chmod u+rx, or a+rx "
                    "for a shared dataset), or open the dataset as a user who has it")
MANIFEST = "manifest.sfm"
SUMS = "sums"
# a directory changed this close to the scan's start may not show it by its mtime: the
# granularity of file systems' clocks (whole seconds on Lustre, MooseFS, ext3) plus skew
RACY_NS = 3 * 10**9


@dataclass
class _Found:
    entries: list[Entry] = field(default_factory=list)
    unreadable: list[str] = field(default_factory=list)
    files: int = 0


def _list(root: bytes, rel_dir: bytes) -> _Found:
    """The entries of one directory (``lstat`` only): a subdirectory that cannot be listed
    or searched is noted in ``unreadable``; the root raises (nothing can be scanned)."""
    out = _Found()
    path = os.path.join(root, rel_dir) if rel_dir else root
    try:
        with os.scandir(path) as it:
            items = list(it)
    except FileNotFoundError:
        if not rel_dir:
            raise
        return out  # removed while we looked (its parent's mtime tells the next open)
    except OSError as exc:
        if not rel_dir:
            raise UnreadableSourceError(f"{os.fsdecode(root)}: {exc.strerror}. "
                                        f"{_UNREADABLE_HINT}") from exc
        out.unreadable.append(os.fsdecode(path))
        return out
    for d in items:
        rel = rel_dir + b"/" + d.name if rel_dir else d.name
        try:
            info = d.stat(follow_symlinks=False)
            if st.S_ISDIR(info.st_mode):
                out.entries.append(Entry(rel, KIND_DIR, info.st_mode, info.st_mtime_ns))
            elif st.S_ISREG(info.st_mode):
                out.entries.append(Entry(rel, KIND_FILE, info.st_mode, info.st_mtime_ns,
                                         size=info.st_size))
                out.files += 1
            elif st.S_ISLNK(info.st_mode):
                target = os.readlink(d.path)
                out.entries.append(Entry(rel, KIND_SYMLINK, info.st_mode, info.st_mtime_ns,
                                         link_target=target,
                                         link_resolved=_resolve(rel, target)))
        except FileNotFoundError:
            continue  # removed while we looked: the scan is of what is there
        except PermissionError as exc:  # listable but not searchable (r without x)
            if not rel_dir:
                raise UnreadableSourceError(
                    f"{os.fsdecode(root)}: cannot reach its entries ({exc.strerror}: it can be "
                    f"listed but not searched). {_UNREADABLE_HINT}") from exc
            out.unreadable.append(os.fsdecode(path))
            return _Found(unreadable=out.unreadable)
    return out


def _resolve(rel: bytes, target: bytes) -> bytes | None:
    if target.startswith(b"/"):
        return None
    parts: list[bytes] = []
    for p in (rel.rpartition(b"/")[0] + b"/" + target).split(b"/"):
        if p in (b"", b"."):
            continue
        if p == b"..":
            if not parts:
                return None
            parts.pop()
        else:
            parts.append(p)
    return b"/".join(parts)


def scan_tree(root: str, *, jobs: int = 16, progress: bool | None = None,
              stats: OriginStats | None = None) -> list[Entry]:
    """Every entry under ``root`` (the root itself first), scanned by ``jobs`` threads.

    Each directory is a task of its own, whose subdirectories are queued as it is listed:
    the threads stay busy however the tree is shaped (a dataset under one ``train/``
    directory too, which one thread per top-level directory would scan alone)."""
    broot = os.fsencode(root)
    top = os.stat(broot)  # a root that is a symlink: the directory it names is the dataset
    entries = [Entry(b"", KIND_DIR, top.st_mode, top.st_mtime_ns)]
    unreadable: list[str] = []
    n_dirs, n_files = 0, 0
    done: queue.SimpleQueue[Future[_Found]] = queue.SimpleQueue()
    bar = tqdm(desc=f"scanning {root}", unit="dir",
               disable=None if progress is None else not progress)
    with bar, ThreadPoolExecutor(max(1, jobs), thread_name_prefix="stagefs-scan") as pool:
        def submit(rel: bytes) -> None:
            pool.submit(_list, broot, rel).add_done_callback(done.put)

        submit(b"")
        outstanding = 1
        try:
            while outstanding:
                found = done.get().result()
                outstanding -= 1
                entries += found.entries
                unreadable += found.unreadable
                n_dirs += 1
                n_files += found.files
                for e in found.entries:
                    if e.kind == KIND_DIR:
                        submit(e.path)
                        outstanding += 1
                bar.update(1)
                bar.set_postfix_str(f"{n_files} files", refresh=False)
        except BaseException:  # Ctrl-C, an error: the directories queued are not listed
            pool.shutdown(wait=True, cancel_futures=True)
            raise
    if unreadable:
        raise UnreadableSourceError(
            f"cannot read {len(unreadable)} director(ies) of {root}: {', '.join(unreadable[:5])}"
            f"{', ...' if len(unreadable) > 5 else ''}. {_UNREADABLE_HINT}"
        )
    if stats is not None:  # one scandir per directory, one lstat per entry
        stats.opens += n_dirs
        stats.stats += len(entries)
    return entries


def _say_links_out(root: str, m: Manifest) -> None:
    """Warn of the symlinks of a raw tree that name nothing in it (out of the tree, or at
    nothing): ``stagefs pack`` refuses them, a tree used in place took them without a word
    and each read of one failed as not found."""
    bad = np.flatnonzero((m.arrays["kind"] == KIND_SYMLINK) & (m.arrays["first"] == NO_INDEX))
    if len(bad):
        names = ", ".join(os.fsdecode(m.path_of(int(e))) for e in bad[:3])
        log.warning("%s: %d symlink(s) name nothing in the dataset (a target out of the "
                    "directory, or none): %s%s; a read of one fails as not found. Copy their "
                    "targets into the directory to read them", root, len(bad), names,
                    ", ..." if len(bad) > 3 else "")


def build_manifest(root: str, entries: list[Entry], path: str, shard_size: int,
                   started_ns: int = 0) -> None:
    """Cut the files, in path order, into virtual shards and write the manifest.
    ``started_ns``: when the scan began (the clock of ``time.time_ns``), for ``is_stale``."""
    b = ManifestBuilder()
    files = sorted((e for e in entries if e.kind == KIND_FILE), key=lambda e: e.path)
    shard, pos = 0, SHARD_HEADER.size
    for e in files:
        if pos > SHARD_HEADER.size and pos - SHARD_HEADER.size + e.size > shard_size:
            b.shards.append(ShardInfo(shard_name(shard), pos))
            shard, pos = shard + 1, SHARD_HEADER.size
        e.shard, e.offset, e.stored = shard, pos, e.size
        pos += e.size
    if files:
        b.shards.append(ShardInfo(shard_name(shard), pos))
    for e in entries:
        b.add(e)
    b.meta["inplace"] = {"origin": root, "shard_size": shard_size, "scanned": time.time(),
                         "started_ns": started_ns}
    b.write(path)


def _outside(root: str, dirs: list[tuple[str, str]]) -> None:
    """Refuse a tier or runtime directory inside the raw directory: the files stagefs writes
    there would be scanned as the dataset's, and would change it under every later open
    (a scan again each time, a new pack id, no tier copy ever reused)."""
    real = os.path.realpath(root)
    for d, what in dirs:
        got = os.path.realpath(d)
        if os.path.commonpath([real, got]) == real:
            raise ConfigError(
                f"{d}: the {what} is inside {root}, the raw directory it serves: its files "
                f"would become part of the dataset. Put it outside {root} (node-local "
                "storage: a directory of /dev/shm or of a local disk)")


class InPlaceCache:
    """Where one raw directory's manifest and checksum table are kept for this job."""

    def __init__(self, root: str, runtime: Runtime) -> None:
        self.root = root
        self.dir = os.path.join(runtime.inplace, self.key(root))
        self.manifest_path = os.path.join(self.dir, MANIFEST)
        self.sums_path = self.stale_path = ""  # of one scan: ``use``

    @staticmethod
    def key(root: str) -> str:
        """The name of a raw directory's folder in every runtime."""
        return xxh3_64_hexdigest(os.fsencode(root))

    def use(self, m: Manifest) -> Manifest:
        """Keep the checksums and the stale mark of ``m``'s scan (its pack id) in files of
        their own: a process that opened an older scan and makes its table, or marks it
        stale, after another process scanned again must not size, fill or condemn the new
        scan's (its entries are numbered otherwise)."""
        scan = m.pack_id.hex()
        self.sums_path = os.path.join(self.dir, f"{SUMS}-{scan}")
        self.stale_path = os.path.join(self.dir, f"stale-{scan}")
        return m

    def adopt(self, m: Manifest, runtime: Runtime) -> Manifest:
        """``m``, the scan just made here, or the scan of the same tree another job of this
        user on this node kept (``Runtime.neighbours``; the newest): the same files, sizes
        and modification times, cut into the same shards (all the scan sees: a scan would
        tell no more). Its pack id, and so the copies its tiers hold under that id, then
        serve this job too: each job had its own id, and a persistent tier kept the old
        copies, counted in its room, until ``stagefs clean``, while the new job's reads all
        went to the origin. Its manifest and checksum table are hard links to the other
        job's: the sums either job learns, the other sees (a tier copy is checked against
        them). ``m`` where none matches, or no link can be made (another file system)."""
        found: list[tuple[int, Runtime]] = []
        for rt in runtime.neighbours():
            with contextlib.suppress(OSError):
                found.append((os.stat(InPlaceCache(self.root, rt).manifest_path).st_mtime_ns, rt))
        for _, rt in sorted(found, key=lambda f: f[0], reverse=True):
            theirs = InPlaceCache(self.root, rt)
            try:
                old = theirs.use(Manifest(theirs.manifest_path))
            except (OSError, StagefsError):
                continue  # removed meanwhile (its job cleaned), or not a manifest now
            try:
                if not _same_scan(old, m) or os.path.exists(theirs.stale_path) \
                        or not self._link(theirs):
                    continue
            finally:
                old.close()
            log.info("%s: the scan of another job (%s) found the same files: its pack id, "
                     "and the copies its tiers hold, serve this job too", self.root, rt.path)
            m.close()
            return self.use(Manifest(self.manifest_path))
        return m

    def _link(self, theirs: InPlaceCache) -> bool:
        """Make ``theirs``'s scan (``use`` called with it) this cache's: its checksum table
        first, then its manifest in place of this one's (which names the scan this cache
        serves). Whether it could (a hard link: not across file systems)."""
        sums = os.path.join(self.dir, os.path.basename(theirs.sums_path))
        new = self.manifest_path + ".adopted"
        made = False
        try:
            try:
                os.link(theirs.sums_path, sums)
                made = True
            except FileExistsError:  # this runtime took this scan before
                if not os.path.samefile(theirs.sums_path, sums):
                    return False
            with contextlib.suppress(FileNotFoundError):
                os.unlink(new)
            os.link(theirs.manifest_path, new)
            os.replace(new, self.manifest_path)
        except OSError:
            for leftover in [new, sums] if made else [new]:
                with contextlib.suppress(OSError):
                    os.unlink(leftover)
            return False
        return True

    def drop_others(self) -> None:
        """Remove the checksums and marks of earlier scans (processes still using them keep
        their mappings)."""
        keep = {os.path.basename(self.sums_path), os.path.basename(self.stale_path)}
        with contextlib.suppress(OSError), os.scandir(self.dir) as it:
            for d in it:
                if d.name.startswith((SUMS, "stale")) and d.name not in keep:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(d.path)

    def mark_stale(self, why: str) -> None:
        """A file changed in place since the scan (its directory did not: ``is_stale``
        cannot see it): the next open scans again."""
        with contextlib.suppress(OSError):
            atomic_write(self.stale_path, why, fsync=False)

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """One process scans; the others wait and then reuse what it wrote."""
        os.makedirs(self.dir, mode=0o700, exist_ok=True)
        with file_lock(os.path.join(self.dir, ".lock")):
            yield


_SCAN_ARRAYS = ("kind", "size", "mtime_ns", "mode", "parent", "first", "count", "shard",
                "offset", "stored", "path_off", "strings")


def _same_scan(a: Manifest, b: Manifest) -> bool:
    """Whether two scans of one directory found the same tree, cut the same way: the same
    entries (names, kinds, sizes, modes, modification times) in the same shards."""
    ma, mb = a.meta.get("inplace", {}), b.meta.get("inplace", {})
    return (ma.get("origin") == mb.get("origin") and "started_ns" in ma
            and ma.get("shard_size") == mb.get("shard_size")
            and [(s.name, s.size) for s in a.shards] == [(s.name, s.size) for s in b.shards]
            and all(k in a.arrays and k in b.arrays and np.array_equal(a.arrays[k], b.arrays[k])
                    for k in _SCAN_ARRAYS))


def is_stale(root: str, m: Manifest, stats: OriginStats | None = None) -> str | None:
    """Why the cached manifest no longer matches ``root`` (None: it still does).

    A directory whose mtime is within ``RACY_NS`` of the scan's start may have changed in
    the same tick of its file system's clock after the scan listed it (Lustre and MooseFS
    keep whole seconds): its mtime cannot tell, so its names are listed again and compared
    (one more ``scandir`` for each such directory, none for a tree left alone before the
    scan)."""
    kinds, mtimes = m.arrays["kind"], m.arrays["mtime_ns"]
    started = m.meta.get("inplace", {}).get("started_ns")
    racy_from = int(started) - RACY_NS if started is not None else 2**63
    broot = os.fsencode(root)
    for e in (int(i) for i in (kinds == KIND_DIR).nonzero()[0]):
        rel = m.path_of(e)
        path = os.path.join(broot, rel) if rel else broot
        if stats is not None:
            stats.stats += 1
        try:
            s = os.stat(path)
        except OSError:
            return f"{os.fsdecode(path)} is gone"
        if s.st_mtime_ns != int(mtimes[e]):
            return f"{os.fsdecode(path)} changed (its mtime differs)"
        if s.st_mtime_ns >= racy_from and _listing(path, stats) != {
                (m.name_of(c), int(m.kind[c])) for c in m.children(e)}:
            return (f"{os.fsdecode(path)} changed (its names differ; its mtime, kept in "
                    "whole ticks, does not show it)")
    return None


def _listing(path: bytes, stats: OriginStats | None) -> set[tuple[bytes, int]] | None:
    """The (name, kind) of each entry of directory ``path`` the scan would keep; None if
    it cannot be listed now."""
    if stats is not None:
        stats.opens += 1
    out: set[tuple[bytes, int]] = set()
    try:
        with os.scandir(path) as it:
            for d in it:
                if d.is_symlink():
                    out.add((d.name, KIND_SYMLINK))
                elif d.is_dir(follow_symlinks=False):
                    out.add((d.name, KIND_DIR))
                elif d.is_file(follow_symlinks=False):
                    out.add((d.name, KIND_FILE))
    except OSError:
        return None
    return out


def open_manifest(root: str, runtime: Runtime, *, shard_size: int = DEFAULT_SHARD_SIZE,
                  progress: bool | None = None, stats: OriginStats | None = None,
                  tiers: Sequence[str] = ()) -> tuple[Manifest, InPlaceCache, bool]:
    """The manifest of the raw directory ``root``: cached, or scanned now.

    Returns (manifest, cache, scanned): ``scanned`` is False when the cache was reused.
    ``tiers``: the directories this job stages into, refused inside ``root``.
    """
    _outside(root, [(t, "tier") for t in tiers] + [(runtime.path, "runtime directory")])
    cache = InPlaceCache(root, runtime)
    with cache.locked():
        if os.path.exists(cache.manifest_path):
            m = cache.use(Manifest(cache.manifest_path))
            meta = m.meta.get("inplace", {})
            why = "made for another directory" if meta.get("origin") != root else None
            if "started_ns" not in meta:  # scanned by a stagefs from before the racy check
                why = why or ("scanned by an older stagefs, which did not keep when its scan "
                              "began: a change made during that scan could go unseen")
            with contextlib.suppress(OSError), open(cache.stale_path) as f:
                why = why or f.read()
            why = why or is_stale(root, m, stats)
            if why is None:
                return m, cache, False
            log.info("rescanning %s: %s", root, why)
            m.close()
        t0, started_ns = time.perf_counter(), time.time_ns()
        entries = scan_tree(root, progress=progress, stats=stats)
        build_manifest(root, entries, cache.manifest_path, shard_size, started_ns)
        m = cache.use(Manifest(cache.manifest_path))
        m = cache.adopt(m, runtime)
        cache.drop_others()  # the sums of the old scan: its entries are not these
        log.info("scanned %s: %d entries in %.1f s", root, len(entries),
                 time.perf_counter() - t0)
        _say_links_out(root, m)
        return m, cache, True
