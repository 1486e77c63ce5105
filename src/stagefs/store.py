"""Store: the client a user holds. Path → entry → (shard, range) → the first holder whose
bytes pass the checksum → bytes.

Every front end (the CLI, file objects, interception, FUSE, the PyTorch datasets) reads
through a Store. Where the bytes come from is behind ``ShardSource``s (tiers/); the Store
only decides the order to ask them in and verifies what they return.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from stagefs._malloc import tune_malloc
from stagefs.errors import (
    ChecksumError,
    ConfigError,
    CorruptShardError,
    IsADirectoryError_,
    ReadOnlyError,
)
from stagefs.format import KIND_FILE, MANIFEST_NAME, Manifest, checksum
from stagefs.format.codecs import decode
from stagefs.namespace import DirEntry, Namespace, PathArg, normalize
from stagefs.tiers.base import ShardSource, SourceUnavailable
from stagefs.tiers.origin import PackOrigin

__all__ = ["ReadStats", "Store", "open"]

_COALESCE_LIMIT = 8 * 2**20  # read_many merges adjacent ranges up to this span


@dataclass
class ReadStats:
    """Reads served by this process's Store."""

    reads: int = 0
    bytes: int = 0
    checksum_failures: int = 0
    unavailable: int = 0


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
    ) -> None:
        self.pack_dir = pack_dir
        self.verify = verify
        self.manifest = manifest or Manifest(os.path.join(pack_dir, MANIFEST_NAME))
        self.namespace = ns = Namespace(self.manifest)
        self.origin = PackOrigin(pack_dir, self.manifest)
        self._origin_only = (self.origin,)
        self._holders = sources or self._origin_holders
        m = self.manifest
        self._lookup, self._kind, self._size = m.lookup, m.kind, m.size
        self._shard, self._offset, self._stored = m.shard, m.offset, m.stored
        self._checksum = m.checksum
        tune_malloc()
        self.stats = ReadStats()
        self._closed = False
        self._lock = threading.Lock()
        # the namespace answers these directly: no extra call layer on the metadata path
        self.stat, self.lstat, self.listdir = ns.stat, ns.lstat, ns.listdir
        self.exists, self.isdir, self.isfile, self.islink = ns.exists, ns.isdir, ns.isfile, ns.islink
        self.getsize, self.readlink = ns.getsize, ns.readlink

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
        return self.namespace.scandir(path)

    def walk(
        self, top: PathArg = "", topdown: bool = True, followlinks: bool = False
    ) -> Iterator[tuple[str, list[str], list[str]]]:
        return self.namespace.walk(top, topdown, followlinks)

    def info(self) -> dict[str, Any]:
        return {"pack": self.pack_dir, **self.namespace.summary()}

    # -- data ------------------------------------------------------------------------------

    def read(self, path: PathArg) -> bytes:
        """The whole content of the file at ``path``, verified."""
        e = self._lookup(normalize(path))  # the namespace's resolution, inlined for speed
        if e < 0 or self._kind[e] != KIND_FILE:
            e = self.namespace.file_entry(path)
        return self.read_entry(e, path)

    def read_many(self, paths: Iterable[PathArg]) -> list[bytes]:
        """The contents of many files, in the order asked: the batched fast path.

        Ranges are read in the order of their bytes, and ranges that sit next to each other
        in a shard are read with one call.
        """
        lookup, kind, file_entry = self._lookup, self._kind, self.namespace.file_entry
        plist = paths if isinstance(paths, list) else list(paths)
        ents = []
        for p in plist:
            e = lookup(normalize(p))
            if e < 0 or kind[e] != KIND_FILE:
                e = file_entry(p)
            ents.append(e)
        shard, offset, stored = self._shard, self._offset, self._stored
        pos = [(shard[e], offset[e], stored[e]) for e in ents]
        order = sorted(range(len(ents)), key=pos.__getitem__)
        out: list[bytes] = [b""] * len(ents)
        n, i = len(order), 0
        while i < n:
            s0, start, length = pos[order[i]]
            end, j = start + length, i + 1
            while j < n:  # extend the run while the next range starts where this one ends
                s1, o1, l1 = pos[order[j]]
                if s1 != s0 or o1 != end or end + l1 - start > _COALESCE_LIMIT:
                    break
                end += l1
                j += 1
            if j == i + 1:
                k = order[i]
                out[k] = self.read_entry(ents[k], plist[k])
            else:
                self._read_run(order[i:j], ents, plist, out, s0, start, end - start)
            i = j
        return out

    def _read_run(self, run: list[int], ents: list[int], paths: Sequence[PathArg],
                  out: list[bytes], shard: int, start: int, span: int) -> None:
        """Read adjacent ranges with one call, then verify each file on its own."""
        m = self.manifest
        try:
            blob = memoryview(self._fetch(shard, start, span))
        except (SourceUnavailable, ChecksumError, CorruptShardError):
            blob = None
        for i in run:
            e = ents[i]
            data = None
            if blob is not None:
                rel = m.offset[e] - start
                try:
                    raw = decode(m.codec[e], bytes(blob[rel : rel + m.stored[e]]), m.size[e],
                                 self._where(e))
                except CorruptShardError:  # undecodable: as a checksum mismatch, below
                    raw = None
                if raw is not None and (not self.verify or checksum(raw) == m.checksum[e]):
                    data = raw
                    self.stats.reads += 1
                    self.stats.bytes += len(raw)
            # a bad or missing span falls back to the per-entry path, which tries every holder
            out[i] = data if data is not None else self.read_entry(e, paths[i])

    def read_entry(self, e: int, path: PathArg | None = None) -> bytes:
        """The verified content of entry ``e``: each holder in turn until one is right."""
        m = self.manifest
        if self._kind[e] != KIND_FILE:
            raise IsADirectoryError_(self._show(e, path))
        size = self._size[e]
        if size == 0:
            return b""
        shard, offset, stored, codec = self._shard[e], self._offset[e], self._stored[e], m.codec[e]
        tried: list[str] = []
        for src in self._holders(shard):
            try:
                data = src.pread(shard, offset, stored)
            except SourceUnavailable:
                self.stats.unavailable += 1
                tried.append(src.name + " (unavailable)")
                continue
            if codec:
                try:
                    data = decode(codec, data, size, self._where(e))
                except CorruptShardError:
                    data = b""
            if not self.verify or checksum(data) == self._checksum[e]:
                stats = self.stats
                stats.reads += 1
                stats.bytes += size
                return data
            self.stats.checksum_failures += 1
            tried.append(src.name)
            self._corrupt(src, shard)
        if not tried:
            raise ConfigError(f"no source can serve shard {shard}")
        raise ChecksumError(self._show(e, path), f"{self._where(e)} via {', '.join(tried)}")

    def _origin_holders(self, shard: int) -> Sequence[ShardSource]:
        return self._origin_only

    def _fetch(self, shard: int, offset: int, length: int) -> bytes:
        for src in self._holders(shard):
            try:
                return src.pread(shard, offset, length)
            except SourceUnavailable:
                continue
        raise SourceUnavailable(f"shard {shard}: no holder answered")

    def _corrupt(self, src: ShardSource, shard: int) -> None:
        """A holder returned bad bytes: tell it to drop its copy, if it keeps copies."""
        drop = getattr(src, "drop", None)
        if drop is not None:
            drop(shard)

    def _where(self, e: int) -> str:
        return f"shard {self.manifest.shards[self.manifest.shard[e]].name}"

    def _show(self, e: int, path: PathArg | None) -> str:
        if path is not None:
            return os.fsdecode(path) if not isinstance(path, str) else path
        return os.fsdecode(self.manifest.path_of(e))

    def open(self, path: PathArg, mode: str = "rb", buffering: int = -1) -> Any:
        """A read-only binary file object (read, readinto, seek, tell, readline, iteration)."""
        from stagefs.posix.fileobj import open_entry

        if any(c in mode for c in "wax+"):
            raise ReadOnlyError(self._show(0, path))
        if mode not in ("rb", "br", "r", "rt", "tr"):
            raise ValueError(f"invalid mode {mode!r} (stagefs files open as 'rb' or 'r')")
        e = self.namespace.file_entry(path)
        return open_entry(self, e, os.fsdecode(path) if not isinstance(path, str) else path,
                          mode, buffering)

    # -- lifecycle ---------------------------------------------------------------------------

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self.origin.close()
        self.manifest.close()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __getstate__(self) -> dict[str, Any]:
        return {"pack_dir": self.pack_dir, "verify": self.verify}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["pack_dir"], verify=state["verify"])  # type: ignore[misc]

    def __repr__(self) -> str:
        return f"<stagefs.Store {self.pack_dir!r} ({len(self.manifest)} entries)>"


def open(path: str | os.PathLike[str], *, verify: bool = True) -> Store:
    """Open the dataset at ``path`` (a pack directory) and return a Store."""
    p = os.path.abspath(os.fspath(path))
    if not os.path.exists(p):
        raise FileNotFoundError(2, "No such file or directory (no dataset here)", p)
    if not os.path.isdir(p):
        raise ConfigError(f"{p}: a pack is a directory with {MANIFEST_NAME} in it")
    if not os.path.exists(os.path.join(p, MANIFEST_NAME)):
        from stagefs.errors import CorruptManifestError

        raise CorruptManifestError(
            f"{p}: not a pack (no {MANIFEST_NAME}). Pack it with 'stagefs pack {p} DEST', or "
            "finish an interrupted pack by running the same 'stagefs pack' command again."
        )
    return Store(p, verify=verify)

