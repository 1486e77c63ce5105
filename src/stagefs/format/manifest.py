"""The manifest: the whole namespace of a pack as flat arrays plus one string blob.

It is opened with mmap, so every process on a node shares one copy of its pages and opening
a million-entry manifest parses nothing but a small JSON section. A path is found through an
open-addressing hash table stored in the file (xxh3_64 of the path), never through a Python
dict of all paths. docs/FORMAT.md specifies the layout byte by byte.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import json
import mmap
import operator
import os
import stat
import struct
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, BinaryIO

import numpy as np
import numpy.ma  # np.unique imports it at its first call: not in a thread (_sampling.py)
import numpy.typing as npt
from xxhash import xxh3_64_intdigest

from stagefs._fsutil import atomic_write, open_read
from stagefs.errors import CorruptManifestError, UnsupportedVersionError
from stagefs.format.checksum import piece_count
from stagefs.format.spec import (
    ALIGN,
    ENTRY_ARRAYS,
    KIND_DIR,
    KIND_FILE,
    KIND_SYMLINK,
    MANIFEST_HEADER,
    MANIFEST_MAGIC,
    NO_INDEX,
    PIECE,
    PIECE_ENTRY_ARRAY,
    PIECES_ARRAY,
    SUPPORTED_VERSIONS,
    VERSION,
)
from stagefs.format.validate import (
    FileAlign,
    check_align,
    check_arrays,
    check_pieces,
    corrupt,
    parse_meta,
)

__all__ = ["Entry", "Manifest", "ManifestBuilder", "ShardInfo", "pack_id_at"]


@dataclass(frozen=True, slots=True)
class ShardInfo:
    name: str
    size: int  # whole file, header included


@dataclass(slots=True)
class Entry:
    """One path as the packer hands it to the builder (pack-time only, never at read time)."""

    path: bytes  # relative, "/"-separated, no leading slash; the root is b""
    kind: int
    mode: int
    mtime_ns: int
    size: int = 0
    shard: int = NO_INDEX
    offset: int = 0
    stored: int = 0
    codec: int = 0
    checksum: int = 0
    link_target: bytes = b""  # a symlink's target, verbatim
    link_resolved: bytes | None = None  # the in-tree path it resolves to (None: dangling)
    pieces: Sequence[int] = ()  # a large raw file: the checksum of each piece (version 2)


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _hash_table(hashes: npt.NDArray[np.uint64]) -> npt.NDArray[np.uint32]:
    """Linear-probing table of entry index + 1 (0 = empty), filled in vectorised rounds.

    In round r every unplaced entry tries slot ``home + r``; the first claimant of a free slot
    takes it. An entry placed in round r passed only occupied slots, so a lookup probing from
    its home finds it before any empty slot.
    """
    n = len(hashes)
    size = 1 << max(4, int(2 * n - 1).bit_length())
    mask = np.uint64(size - 1)
    table = np.zeros(size, dtype="<u4")
    pending = np.arange(n, dtype=np.int64)
    homes = (hashes & mask).astype(np.int64)
    r = 0
    while len(pending):
        slots = (homes[pending] + r) & (size - 1)
        free = table[slots] == 0
        cand, cslots = pending[free], slots[free]
        _, first = np.unique(cslots, return_index=True)
        table[cslots[first]] = (cand[first] + 1).astype("<u4")
        placed = np.zeros(n, dtype=bool)
        placed[cand[first]] = True
        pending = pending[~placed[pending]]
        r += 1
    return table


class ManifestBuilder:
    """Collect entries, then ``write()`` the manifest atomically (``.partial``, rename)."""

    def __init__(self, pack_id: bytes | None = None, *, version: int = VERSION,
                 piece_size: int = PIECE) -> None:
        if version not in SUPPORTED_VERSIONS:
            raise ValueError(f"cannot write manifest version {version}")
        self.pack_id = pack_id or uuid.uuid4().bytes
        self.version = version  # 1 only to make test packs of the old layout
        self.piece_size = piece_size
        self.entries: list[Entry] = []
        self.shards: list[ShardInfo] = []
        self.meta: dict[str, Any] = {}

    def add(self, entry: Entry) -> None:
        self.entries.append(entry)

    def write(self, path: str) -> None:
        buf = self._encode()

        def put(f: BinaryIO) -> None:  # the buffer itself: no copy of 100s of MB
            f.write(buf)

        atomic_write(path, put)

    def encode(self) -> bytes:
        return bytes(self._encode())

    def _encode(self) -> bytearray:
        """The manifest's bytes. Each column is made in one pass over the entries (numpy's
        fromiter), not set item by item: a pack of ImageNet's 1.28 M files spent 20 s here
        with nothing on screen, and held three copies of the result at once."""
        entries = self._ordered()
        n = len(entries)
        paths = [e.path for e in entries]
        index = {p: i for i, p in enumerate(paths)}

        def col(name: str, values: Iterable[int]) -> npt.NDArray[Any]:
            return np.fromiter(values, dtype=ENTRY_ARRAYS[name], count=n)

        def attr(name: str) -> npt.NDArray[Any]:  # the Entry attribute of the same name
            return col(name, map(operator.attrgetter(name), entries))

        parent_of = [p.rpartition(b"/")[0] for p in paths]  # the root's: b"", itself
        kind = attr("kind")
        parent = np.fromiter((index.get(p, -1) for p in parent_of), dtype=np.int64, count=n)
        bad = np.flatnonzero((parent < 0) | (kind[np.maximum(parent, 0)] != KIND_DIR))
        if len(bad):
            raise ValueError(f"entry {paths[bad[0]]!r} has no parent directory entry")
        lengths = np.fromiter((len(p) for p in paths), dtype="<u8", count=n)
        path_off = np.zeros(n + 1, dtype="<u8")
        np.cumsum(lengths, out=path_off[1:])
        links = np.flatnonzero(kind == KIND_SYMLINK).tolist()
        targets = [entries[i].link_target for i in links]
        strings = b"".join([*paths, *targets])
        cols: dict[str, npt.NDArray[Any]] = {
            "hash": col("hash", map(xxh3_64_intdigest, paths)),
            "parent": parent.astype(ENTRY_ARRAYS["parent"]),
            "kind": kind,
            "mode": attr("mode"),
            "mtime_ns": attr("mtime_ns"),
            "size": attr("size"),
            "shard": attr("shard"),
            "offset": attr("offset"),
            "stored": attr("stored"),
            "codec": attr("codec"),
            "checksum": attr("checksum"),
            "first": np.full(n, NO_INDEX, dtype=ENTRY_ARRAYS["first"]),
            "count": np.zeros(n, dtype=ENTRY_ARRAYS["count"]),
        }
        if links:  # a symlink: its target in strings, after every path; the entry it reaches
            tlen = np.fromiter((len(t) for t in targets), dtype="<u8", count=len(links))
            cols["offset"][links] = path_off[n] + np.cumsum(tlen) - tlen
            cols["stored"][links] = cols["size"][links] = tlen
            for i in links:
                resolved = entries[i].link_resolved
                if resolved is not None and resolved in index:
                    cols["first"][i] = index[resolved]
        # children of one directory are contiguous (see _ordered): the first, and how many
        kids = parent[1:]
        cols["count"][:] = np.bincount(kids, minlength=n)
        has, first = np.unique(kids, return_index=True)
        cols["first"][has] = first + 1
        arrays: list[tuple[str, npt.NDArray[Any]]] = [("path_off", path_off)]
        arrays += list(cols.items())
        if self.version >= 2:
            arrays += self._pieces(entries)
        arrays += [("slots", _hash_table(cols["hash"]))]
        arrays += [("strings", np.frombuffer(strings, dtype="u1"))]
        return self._layout(arrays, n)

    def _pieces(self, entries: list[Entry]) -> list[tuple[str, npt.NDArray[Any]]]:
        """The ``piece`` entry array and the flat ``pieces`` array of checksums."""
        first = np.full(len(entries), NO_INDEX, dtype=PIECE_ENTRY_ARRAY[1])
        sums: list[int] = []
        for i, e in enumerate(entries):
            if not e.pieces:
                continue
            want = piece_count(e.size, self.piece_size)
            if e.codec or e.kind != KIND_FILE or want < 2 or len(e.pieces) != want:
                raise ValueError(f"entry {e.path!r}: {len(e.pieces)} piece checksums for "
                                 f"{e.size} bytes (codec {e.codec}) at {self.piece_size}")
            if len(sums) + len(e.pieces) >= NO_INDEX:
                raise ValueError("more piece checksums than a manifest can index")
            first[i] = len(sums)
            sums += e.pieces
        return [(PIECE_ENTRY_ARRAY[0], first),
                (PIECES_ARRAY[0], np.array(sums, dtype=PIECES_ARRAY[1]))]

    def _ordered(self) -> list[Entry]:
        roots = [e for e in self.entries if e.path == b""]
        if len(roots) != 1 or roots[0].kind != KIND_DIR:
            raise ValueError("a manifest needs exactly one root directory entry (path b'')")
        # by (parent path, name), as one bytes key a path: parent, NUL, name (no path holds
        # a NUL, which sorts before every other byte); a tuple a path took 3 times the memory
        rest = sorted((e for e in self.entries if e.path != b""),
                      key=lambda e: b"\0".join(e.path.rpartition(b"/")[::2]))
        for a, b in itertools.pairwise(rest):
            if a.path == b.path:
                raise ValueError(f"duplicate path {a.path!r}")
        return roots + rest

    def _layout(self, arrays: Sequence[tuple[str, npt.NDArray[Any]]], n: int) -> bytearray:
        pos = MANIFEST_HEADER.size
        table: dict[str, list[Any]] = {}
        for name, arr in arrays:
            pos = _align(pos)
            table[name] = [arr.dtype.str, pos, len(arr)]
            pos += arr.nbytes
        meta = dict(self.meta)
        if self.version >= 2:
            meta["piece_size"] = self.piece_size
        meta.update(
            pack_id=self.pack_id.hex(),
            entries=n,
            arrays=table,
            shards=[[s.name, s.size] for s in self.shards],
        )
        meta_bytes = json.dumps(meta, sort_keys=True).encode()
        meta_off = _align(pos)
        total = meta_off + len(meta_bytes)
        buf = bytearray(total)
        out = np.frombuffer(buf, dtype="u1")
        for name, arr in arrays:  # each array straight into place, no copy in between
            off = table[name][1]
            out[off : off + arr.nbytes] = arr.view("u1")
        buf[meta_off:] = meta_bytes
        body_sum = xxh3_64_intdigest(memoryview(buf)[MANIFEST_HEADER.size :])
        header = MANIFEST_HEADER.pack(
            MANIFEST_MAGIC, self.version, 0, meta_off, len(meta_bytes), total, body_sum
        )
        buf[: MANIFEST_HEADER.size] = header
        del out  # a view of buf's memory
        return buf


def _map(fd: int, size: int, path: str) -> mmap.mmap | bytes:
    """The manifest's bytes, mapped. A file system that refuses a shared mapping (ENODEV: a
    FUSE mount with ``direct_io``) may still map it privately, read-only (the same pages,
    never written); one that maps nothing has it read into this process's memory (each
    process then holds a copy of its own)."""
    shared, private = {"access": mmap.ACCESS_READ}, {"flags": mmap.MAP_PRIVATE,
                                                      "prot": mmap.PROT_READ}
    for how in (shared, private):
        try:
            return mmap.mmap(fd, 0, **how)
        except OSError as exc:
            if exc.errno not in (errno.ENODEV, errno.EINVAL, errno.EACCES):
                raise
    chunks, got = [], 0
    while got < size:
        chunk = os.pread(fd, size - got, got)
        if not chunk:
            break
        chunks.append(chunk)
        got += len(chunk)
    if got != size:
        raise CorruptManifestError(f"{path}: {got} bytes read of the manifest's {size} (the "
                                   "file shrank while it was read?); copy the pack again")
    return b"".join(chunks)


class Manifest:
    """A read-only, memory-mapped manifest. Scalar access goes through memoryviews (fast for
    one entry), vector access through numpy views (``.arrays``) of the same pages.

    Opening checks the body checksum (unless ``verify=False``: a caller that has just
    checked it) and then, always, every array and name (format/validate.py): after a
    successful open every index in the manifest is in range and every lookup ends."""

    def __init__(self, path: str, *, verify: bool = True) -> None:
        self.path = path
        try:
            fd, info = open_read(path)  # a FIFO in a crafted pack: refused below, not waited on
        except FileNotFoundError:
            raise CorruptManifestError(
                f"{path}: no manifest here; is this a pack made by 'stagefs pack'? "
                "(an interrupted pack has no manifest: run 'stagefs pack' again)"
            ) from None
        except NotADirectoryError:
            pack, name = os.path.split(path)
            raise CorruptManifestError(f"{pack}: a file, not a pack (a pack is a directory "
                                       f"that holds {name}); name the pack's directory") from None
        try:
            if not stat.S_ISREG(info.st_mode):
                raise CorruptManifestError(f"{path}: not a file, so this is not a pack; "
                                           "copy the pack again or re-pack it")
            size = info.st_size
            if size < MANIFEST_HEADER.size:
                raise CorruptManifestError(f"{path}: truncated manifest ({size} bytes); "
                                           "copy the pack again or re-pack it")
            self._mm: mmap.mmap | bytes = _map(fd, size, path)
        finally:
            os.close(fd)
        self._buf = memoryview(self._mm)
        self._views: dict[str, memoryview] = {}
        self._on_close: list[Callable[[], object]] = []
        self.arrays: dict[str, npt.NDArray[Any]] = {}
        try:
            self._parse(size, verify)
        except BaseException:
            self.close()
            raise

    def _parse(self, size: int, verify: bool) -> None:
        magic, version, _flags, meta_off, meta_len, total, body_sum = MANIFEST_HEADER.unpack_from(
            self._buf
        )
        where = self.path
        if magic != MANIFEST_MAGIC:
            raise CorruptManifestError(f"{where}: not a stagefs manifest (bad magic {magic!r}); "
                                       "copy the pack again or re-pack it")
        if version not in SUPPORTED_VERSIONS:
            raise UnsupportedVersionError(
                f"{where}: manifest format version {version}; this stagefs reads versions "
                f"{', '.join(map(str, SUPPORTED_VERSIONS))}. A newer stagefs wrote it: use "
                "that stagefs (or upgrade this one), or re-pack the dataset with this one."
            )
        self.version = version
        if total != size:
            raise CorruptManifestError(
                f"{where}: manifest is {size} bytes but its header says {total}: "
                "truncated or overwritten; re-pack the dataset"
            )
        if verify and xxh3_64_intdigest(self._buf[MANIFEST_HEADER.size :]) != body_sum:
            raise CorruptManifestError(f"{where}: manifest checksum mismatch: corrupt; re-pack")
        if not MANIFEST_HEADER.size <= meta_off <= size - meta_len:
            raise corrupt(where, f"the metadata ({meta_len} bytes at {meta_off}) is not inside "
                          f"the file ({size} bytes)")
        layout = parse_meta(bytes(self._buf[meta_off : meta_off + meta_len]), where, meta_off)
        self.meta, self.n, self.pack_id = layout.meta, layout.n, layout.pack_id
        self.shards = [ShardInfo(name, length) for name, length in layout.shards]
        for name, (dtype, off, count) in layout.arrays.items():
            self.arrays[name] = np.frombuffer(self._mm, dtype=dtype, count=count, offset=off)
            code = {1: "B", 4: "I", 8: "Q"}[dtype.itemsize]
            view = self._buf[off : off + count * dtype.itemsize]
            code = code.lower() if dtype.kind == "i" else code
            self._views[name] = view.cast(code)  # type: ignore[call-overload]
        check_arrays(self.arrays, self.n, [s.size for s in self.shards], where)
        self.align: FileAlign = check_align(self.meta, self.arrays, version, where)
        a = self._views
        self.path_off, self.strings, self.slots = a["path_off"], a["strings"], a["slots"]
        self.hash, self.kind, self.mode = a["hash"], a["kind"], a["mode"]
        self.mtime_ns, self.size, self.shard = a["mtime_ns"], a["size"], a["shard"]
        self.offset, self.stored, self.codec = a["offset"], a["stored"], a["codec"]
        self.checksum, self.first, self.count = a["checksum"], a["first"], a["count"]
        self.parent = a["parent"]
        self._mask = len(self.slots) - 1
        self._probes = range(len(self.slots))
        self._parse_pieces(version)

    def _parse_pieces(self, version: int) -> None:
        """Version 2's piece checksums; a version 1 manifest has none (``piece`` is None)."""
        self.piece: memoryview | None = None
        self.pieces: memoryview = memoryview(b"").cast("Q")
        self.piece_size = PIECE  # v1: the unit a reader derives piece sums in
        if version < 2:
            return
        size = self.meta.get("piece_size")
        if type(size) is not int or not 4096 <= size <= 1 << 30:
            raise CorruptManifestError(f"{self.path}: piece_size {size!r} is not a whole number "
                                       "of bytes from 4 KiB to 1 GiB; re-pack the dataset")
        check_pieces(self.arrays, self.n, size, self.path)
        self.piece_size = size
        self.piece, self.pieces = self._views[PIECE_ENTRY_ARRAY[0]], self._views[PIECES_ARRAY[0]]

    def piece_sums(self, e: int) -> memoryview | None:
        """The checksums of entry ``e``'s pieces, or None if it has none (a small or
        compressed file, a version 1 manifest)."""
        if self.piece is None:
            return None
        k = self.piece[e]
        if k == NO_INDEX:
            return None
        n = piece_count(self.size[e], self.piece_size)
        if k + n > len(self.pieces):
            raise CorruptManifestError(
                f"{self.path}: entry {e} ({self.path_of(e)!r}) has piece checksums "
                f"{k}..{k + n - 1}, beyond the {len(self.pieces)} stored; re-pack the dataset")
        return self.pieces[k : k + n]

    def on_close(self, release: Callable[[], object]) -> None:
        """Call ``release`` before unmapping (for holders of buffers into the map)."""
        self._on_close.append(release)

    def close(self) -> None:
        for release in getattr(self, "_on_close", ()):
            release()
        for view in self._views.values():
            view.release()
        self._views.clear()
        self.arrays.clear()
        if hasattr(self, "_buf"):
            self._buf.release()
        # numpy views made elsewhere may still pin the map; it is unmapped when they go
        if isinstance(self._mm, mmap.mmap):
            with contextlib.suppress(BufferError):
                self._mm.close()

    def __len__(self) -> int:
        return self.n

    def lookup(self, path: bytes) -> int:
        """Index of the entry at ``path`` (normalised, no leading slash), or -1."""
        h = xxh3_64_intdigest(path)
        slots, hashes, off, strings = self.slots, self.hash, self.path_off, self.strings
        i = h & self._mask
        for _ in self._probes:  # bounded: the table was checked to hold an empty slot
            e = slots[i]
            if e == 0:
                return -1
            e -= 1
            if hashes[e] == h and strings[off[e] : off[e + 1]] == path:
                return e
            i = (i + 1) & self._mask
        return -1

    def path_of(self, e: int) -> bytes:
        return bytes(self.strings[self.path_off[e] : self.path_off[e + 1]])

    def name_of(self, e: int) -> bytes:
        return self.path_of(e).rpartition(b"/")[2]

    def link_target(self, e: int) -> bytes:
        off = self.offset[e]
        return bytes(self.strings[off : off + self.stored[e]])

    def children(self, e: int) -> range:
        if self.kind[e] != KIND_DIR or self.count[e] == 0:
            return range(0)
        first = self.first[e]
        return range(first, first + self.count[e])

    def shard_path(self, pack_dir: str, index: int) -> str:
        return os.path.join(pack_dir, self.shards[index].name)

    def files(self) -> Iterable[int]:
        """Indices of every regular file, in (shard, offset) order: the order of the bytes."""
        kinds = self.arrays["kind"]
        idx = np.flatnonzero(kinds == 0)
        order = np.lexsort((self.arrays["offset"][idx], self.arrays["shard"][idx]))
        return (int(i) for i in idx[order])


def pack_id_at(path: str) -> bytes | None:
    """The pack id of the manifest at ``path`` as it is now, or None if there is none that
    reads as one (no manifest: a pack being written again; a torn or foreign file). Only
    the header and the metadata are read: for a reader that finds a shard of another pack
    where its manifest names one, to tell a pack packed again under it (``tiers/origin.py``)
    from a damaged one."""
    try:
        fd, info = open_read(path)  # a FIFO there is not waited on
    except OSError:
        return None
    try:
        if not stat.S_ISREG(info.st_mode):
            return None
        magic, _version, _flags, meta_off, meta_len, _total, _sum = MANIFEST_HEADER.unpack(
            os.pread(fd, MANIFEST_HEADER.size, 0))
        if magic != MANIFEST_MAGIC or meta_len > info.st_size:
            return None
        return parse_meta(os.pread(fd, meta_len, meta_off), path, meta_off).pack_id
    except (OSError, ValueError, struct.error):  # a FormatError is a ValueError
        return None
    finally:
        os.close(fd)
