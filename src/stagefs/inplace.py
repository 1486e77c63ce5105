"""In-place datasets: a raw directory used without packing.

One parallel scan (threads over the top-level subdirectories, with a progress bar) builds a
manifest whose shards are virtual: the files, in path order, cut into groups of about
``shard_size`` bytes (tiers/inplace.py reads them). The manifest is cached in the runtime
directory, never in the origin, and a later open reuses it.

Staleness rule (docs/decisions/inplace-staleness.md): at open, every directory the scan saw
is stat'ed again; if any is gone or its mtime differs (a file was added, removed or renamed
in it), the cache is stale and the directory is scanned again, which gives the dataset a new
pack id, so no copy staged from the old scan is ever used. A file changed in place (same
directory mtime) is caught when the origin opens it: its size and mtime must match the scan,
or the read fails with a ``SourceChangedError`` naming it, and the cached scan is marked
stale (``InPlaceCache.mark_stale``), so that the next open scans again, as the error says.
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat as st
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from tqdm import tqdm
from xxhash import xxh3_64_hexdigest

from stagefs._fsutil import atomic_write, file_lock
from stagefs.errors import UnreadableSourceError
from stagefs.format import KIND_DIR, KIND_FILE, KIND_SYMLINK, Manifest, ManifestBuilder, shard_name
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


@dataclass
class _Found:
    entries: list[Entry] = field(default_factory=list)
    unreadable: list[str] = field(default_factory=list)
    dirs: int = 0
    files: int = 0


def _walk(root: bytes, rel_top: bytes) -> _Found:
    """Serial walk of one subtree (lstat only)."""
    out = _Found()
    stack = [rel_top]
    while stack:
        rel_dir = stack.pop()
        path = os.path.join(root, rel_dir) if rel_dir else root
        try:
            with os.scandir(path) as it:
                items = list(it)
        except OSError:
            out.unreadable.append(os.fsdecode(path))
            continue
        out.dirs += 1
        for d in items:
            rel = rel_dir + b"/" + d.name if rel_dir else d.name
            try:
                info = d.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue  # removed while we looked: the scan is of what is there
            except PermissionError:  # listable but not searchable (r without x)
                out.unreadable.append(os.fsdecode(path))
                break
            if st.S_ISDIR(info.st_mode):
                out.entries.append(Entry(rel, KIND_DIR, info.st_mode, info.st_mtime_ns))
                stack.append(rel)
            elif st.S_ISREG(info.st_mode):
                out.entries.append(Entry(rel, KIND_FILE, info.st_mode, info.st_mtime_ns,
                                         size=info.st_size))
                out.files += 1
            elif st.S_ISLNK(info.st_mode):
                target = os.readlink(os.path.join(path, d.name))
                out.entries.append(Entry(rel, KIND_SYMLINK, info.st_mode, info.st_mtime_ns,
                                         link_target=target,
                                         link_resolved=_resolve(rel, target)))
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
    """Every entry under ``root`` (the root itself first), scanned by ``jobs`` threads."""
    broot = os.fsencode(root)
    top = os.lstat(broot)
    entries = [Entry(b"", KIND_DIR, top.st_mode, top.st_mtime_ns)]
    first = _walk_one_level(broot)
    entries += first.entries
    subdirs = [e.path for e in first.entries if e.kind == KIND_DIR]
    unreadable = list(first.unreadable)
    bar = tqdm(total=len(subdirs), desc=f"scanning {root}", unit="dir",
               disable=None if progress is None else not progress)
    n_dirs, n_files = 1, first.files
    with bar, ThreadPoolExecutor(max(1, jobs), thread_name_prefix="stagefs-scan") as pool:
        for found in pool.map(lambda rel: _walk(broot, rel), subdirs):
            entries += found.entries
            unreadable += found.unreadable
            n_dirs += found.dirs
            n_files += found.files
            bar.update(1)
    if unreadable:
        raise UnreadableSourceError(
            f"cannot read {len(unreadable)} director(ies) of {root}: {', '.join(unreadable[:5])}"
            f"{', ...' if len(unreadable) > 5 else ''}. {_UNREADABLE_HINT}"
        )
    if stats is not None:  # one scandir per directory, one lstat per entry
        stats.opens += n_dirs
        stats.stats += len(entries)
    return entries


def _walk_one_level(root: bytes) -> _Found:
    out = _Found()
    try:
        with os.scandir(root) as it:
            items = list(it)
    except OSError as exc:
        raise UnreadableSourceError(f"{os.fsdecode(root)}: {exc.strerror}. "
                                    f"{_UNREADABLE_HINT}") from exc
    for d in items:
        try:
            info = d.stat(follow_symlinks=False)
        except FileNotFoundError:
            continue  # removed while we looked: the scan is of what is there
        except PermissionError as exc:  # listable but not searchable (r without x)
            raise UnreadableSourceError(
                f"{os.fsdecode(root)}: cannot reach its entries ({exc.strerror}: it can be "
                f"listed but not searched). {_UNREADABLE_HINT}") from exc
        if st.S_ISDIR(info.st_mode):
            out.entries.append(Entry(d.name, KIND_DIR, info.st_mode, info.st_mtime_ns))
        elif st.S_ISREG(info.st_mode):
            out.entries.append(Entry(d.name, KIND_FILE, info.st_mode, info.st_mtime_ns,
                                     size=info.st_size))
            out.files += 1
        elif st.S_ISLNK(info.st_mode):
            target = os.readlink(d.path)
            out.entries.append(Entry(d.name, KIND_SYMLINK, info.st_mode, info.st_mtime_ns,
                                     link_target=target, link_resolved=_resolve(d.name, target)))
    return out


def build_manifest(root: str, entries: list[Entry], path: str, shard_size: int) -> None:
    """Cut the files, in path order, into virtual shards and write the manifest."""
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
    b.meta["inplace"] = {"origin": root, "shard_size": shard_size, "scanned": time.time()}
    b.write(path)


class InPlaceCache:
    """Where one raw directory's manifest and checksum table are kept for this job."""

    def __init__(self, root: str, runtime: Runtime) -> None:
        self.root = root
        self.dir = os.path.join(runtime.inplace, xxh3_64_hexdigest(root.encode()))
        self.manifest_path = os.path.join(self.dir, MANIFEST)
        self.sums_path = os.path.join(self.dir, SUMS)
        self.stale_path = os.path.join(self.dir, "stale")

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


def is_stale(root: str, m: Manifest, stats: OriginStats | None = None) -> str | None:
    """Why the cached manifest no longer matches ``root`` (None: it still does)."""
    kinds, mtimes = m.arrays["kind"], m.arrays["mtime_ns"]
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
    return None


def open_manifest(root: str, runtime: Runtime, *, shard_size: int = DEFAULT_SHARD_SIZE,
                  progress: bool | None = None, stats: OriginStats | None = None
                  ) -> tuple[Manifest, InPlaceCache, bool]:
    """The manifest of the raw directory ``root``: cached, or scanned now.

    Returns (manifest, cache, scanned): ``scanned`` is False when the cache was reused.
    """
    cache = InPlaceCache(root, runtime)
    with cache.locked():
        if os.path.exists(cache.manifest_path):
            m = Manifest(cache.manifest_path)
            meta = m.meta.get("inplace", {})
            why = "made for another directory" if meta.get("origin") != root else None
            with contextlib.suppress(OSError), open(cache.stale_path) as f:
                why = why or f.read()
            why = why or is_stale(root, m, stats)
            if why is None:
                return m, cache, False
            log.info("rescanning %s: %s", root, why)
            m.close()
        t0 = time.perf_counter()
        entries = scan_tree(root, progress=progress, stats=stats)
        build_manifest(root, entries, cache.manifest_path, shard_size)
        for old in (cache.sums_path, cache.stale_path):  # the sums belong to the old scan
            with contextlib.suppress(FileNotFoundError):
                os.unlink(old)
        log.info("scanned %s: %d entries in %.1f s", root, len(entries),
                 time.perf_counter() - t0)
        return Manifest(cache.manifest_path), cache, True
