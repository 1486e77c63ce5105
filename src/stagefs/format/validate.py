"""What a reader checks in a manifest before using it (docs/FORMAT.md, "What a reader checks").

A manifest is input from outside: whoever can write a pack directory can write any bytes
into it, and recompute the body checksum. Every array a lookup or a read indexes with is
checked here when the manifest is opened, so that afterwards every index is in range, every
walk up the tree reaches the root, every probe of the hash table meets an empty slot, and no
path or shard name taken from the manifest leaves the pack (or a tier) directory.

The checks are vectorised (numpy over whole arrays, no Python loop over entries): a
million-entry manifest is checked in tens of milliseconds. A failed check raises
``CorruptManifestError`` naming the manifest and what is wrong.
"""

from __future__ import annotations

import json
import os
import stat as st
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from stagefs.errors import CorruptManifestError
from stagefs.format.codecs import MAX_COMPRESSED, Codec
from stagefs.format.spec import (
    ALIGN,
    ENTRY_ARRAYS,
    KIND_DIR,
    KIND_FILE,
    KIND_SYMLINK,
    MANIFEST_HEADER,
    MAX_FILE_ALIGN,
    NO_INDEX,
    PIECE_ENTRY_ARRAY,
    PIECES_ARRAY,
    SHARD_HEADER,
)

__all__ = ["ARRAY_DTYPES", "NO_ALIGN", "FileAlign", "Layout", "check_align", "check_arrays", "check_pieces",
           "check_shard_name", "parse_meta"]

ARRAY_DTYPES: dict[str, str] = {
    "path_off": "<u8", **ENTRY_ARRAYS, "slots": "<u4", "strings": "u1"}
"""The dtype of every array this reader knows; an array it does not know is mapped as it is
(itemsize 1, 4 or 8) and not checked."""

ZSTD_MAX_RATIO = 1 << 15
"""zstd never expands more than this (a 3-byte block header and 1 RLE byte make at most a
128 KiB block): a zstd entry whose size is larger than this times its stored bytes is
corrupt, and decoding it would allocate that size."""

_TYPE_BITS = {KIND_FILE: st.S_IFREG, KIND_DIR: st.S_IFDIR, KIND_SYMLINK: st.S_IFLNK}
_KIND_NAMES = {KIND_FILE: "file", KIND_DIR: "directory", KIND_SYMLINK: "symlink"}
_RESERVED_SUFFIXES = (".partial", ".fill")  # a tier's copy in progress (tiers/fill.py)
_MAX_NAME = 255 - max(len(s) for s in _RESERVED_SUFFIXES)  # NAME_MAX, with room for them
_SLASH, _DOT = ord("/"), ord(".")


def corrupt(where: str, what: str) -> CorruptManifestError:
    return CorruptManifestError(
        f"{where}: corrupt manifest: {what}. It was damaged or crafted: re-pack the dataset, "
        "or copy the pack again from where it was written")


@dataclass(frozen=True, slots=True)
class Layout:
    """The metadata section, checked: what the arrays are and where they sit."""

    meta: dict[str, Any]
    n: int
    pack_id: bytes
    shards: list[tuple[str, int]]
    arrays: dict[str, tuple[np.dtype[Any], int, int]]  # name -> (dtype, offset, count)


def parse_meta(raw: bytes, where: str, arrays_end: int) -> Layout:
    """The JSON metadata, checked for types and ranges; arrays must lie in [64, arrays_end)."""
    try:
        meta = json.loads(raw)
    except (ValueError, RecursionError) as exc:  # RecursionError: nesting too deep
        raise corrupt(where, f"the metadata is not JSON ({type(exc).__name__})") from None
    if not isinstance(meta, dict):
        raise corrupt(where, "the metadata is not a JSON object")
    n = meta.get("entries")
    if type(n) is not int or not 1 <= n < NO_INDEX:
        raise corrupt(where, f"entries is {n!r}, not a count from 1 to {NO_INDEX - 1}")
    pack_id = meta.get("pack_id")
    if not (isinstance(pack_id, str) and len(pack_id) == 32
            and all(c in "0123456789abcdefABCDEF" for c in pack_id)):
        raise corrupt(where, f"pack_id is {pack_id!r}, not 32 hex digits")
    return Layout(meta, n, bytes.fromhex(pack_id), _shards(meta.get("shards"), where),
                  _arrays(meta.get("arrays"), n, where, arrays_end))


def _shards(shards: Any, where: str) -> list[tuple[str, int]]:
    if not isinstance(shards, list) or len(shards) >= NO_INDEX:
        raise corrupt(where, "shards is not a list of [name, size]")
    out: list[tuple[str, int]] = []
    for i, item in enumerate(shards):  # one per shard: a few thousand at most
        if not (isinstance(item, list) and len(item) == 2):
            raise corrupt(where, f"shard {i} is {item!r}, not [name, size]")
        name, size = item
        check_shard_name(name, where, i)
        if type(size) is not int or not SHARD_HEADER.size <= size < 2**63:
            raise corrupt(where, f"shard {i} ({name}) has size {size!r}")
        out.append((name, size))
    if len({name for name, _ in out}) != len(out):
        raise corrupt(where, "two shards have the same shard name")
    return out


def check_shard_name(name: Any, where: str, i: int) -> None:
    """A shard name is a plain file name: it names a file in the pack directory (and in a
    tier's directory), never one elsewhere."""
    why = None
    if not isinstance(name, str) or not name:
        why = "is not a file name"
    elif "/" in name or "\0" in name or name in (".", ".."):
        why = "is not a plain file name in the pack directory"
    elif name.endswith(_RESERVED_SUFFIXES):
        why = f"ends with one of {', '.join(_RESERVED_SUFFIXES)} (a tier's copy in progress)"
    else:
        try:
            if len(os.fsencode(name)) > _MAX_NAME:
                why = f"is longer than {_MAX_NAME} bytes"
        except UnicodeError:
            why = "cannot be encoded as a file name"
    if why is not None:
        raise corrupt(where, f"shard {i}: shard name {name!r} {why}")


def _arrays(table: Any, n: int, where: str, end: int
            ) -> dict[str, tuple[np.dtype[Any], int, int]]:
    if not isinstance(table, dict):
        raise corrupt(where, "arrays is not a table of arrays")
    out: dict[str, tuple[np.dtype[Any], int, int]] = {}
    for name, spec in table.items():
        if not (isinstance(spec, list) and len(spec) == 3 and isinstance(spec[0], str)
                and type(spec[1]) is int and type(spec[2]) is int):
            raise corrupt(where, f"array {name!r} is {spec!r}, not [dtype, offset, count]")
        dtype_s, off, count = spec
        want = ARRAY_DTYPES.get(name)
        try:
            dtype = np.dtype(dtype_s)
        except (TypeError, ValueError):
            raise corrupt(where, f"array {name!r} has dtype {dtype_s!r}") from None
        if (dtype.str != np.dtype(want).str if want is not None
                else dtype.kind not in "uib" or dtype.itemsize not in (1, 4, 8)
                or dtype.str[0] not in "<|"):
            raise corrupt(where, f"array {name!r} has dtype {dtype_s!r}"
                          + (f", not {want!r}" if want else ""))
        if off < MANIFEST_HEADER.size or off % ALIGN or count < 0 or (
                off + count * dtype.itemsize > end):
            raise corrupt(where, f"array {name!r} ({count} items at offset {off}) is not "
                          "inside the arrays section")
        out[name] = (dtype, off, count)
    for name in ARRAY_DTYPES:
        if name not in out:
            raise corrupt(where, f"array {name!r} is missing")
        want_n = {"path_off": n + 1, "slots": None, "strings": None}.get(name, n)
        if want_n is not None and out[name][2] != want_n:
            raise corrupt(where, f"array {name!r} has {out[name][2]} items, not {want_n} "
                          f"({n} entries)")
    return out


# -- the arrays -------------------------------------------------------------------------------

Arr = npt.NDArray[Any]


def _first(mask: Arr, base: int = 0) -> int | None:
    """The first index where ``mask`` holds (plus ``base``), or None."""
    hit = np.flatnonzero(mask)
    return int(hit[0]) + base if len(hit) else None


def check_arrays(a: Mapping[str, Arr], n: int, shard_sizes: list[int], where: str) -> None:
    """Every check of docs/FORMAT.md "What a reader checks" on the entry arrays, the names
    and the hash table."""
    _check_kinds(a, where)
    _check_tree(a, n, where)
    _check_files(a, np.asarray(shard_sizes, dtype=np.uint64), where)
    _check_symlinks(a, n, where)
    _check_paths(a, n, where)
    _check_slots(a, n, where)


def _entry(a: Mapping[str, Arr], e: int) -> str:
    """"entry E 'PATH'" for a message, the path only where it can be read."""
    if e == 0:
        return "the root (entry 0)"
    po, strings = a["path_off"], a["strings"]
    lo, hi = int(po[e]), int(po[e + 1])
    if lo < hi <= len(strings) and hi - lo <= 4096:
        return f"entry {e} {os.fsdecode(strings[lo:hi].tobytes())!r}"
    return f"entry {e}"


def _check_kinds(a: Mapping[str, Arr], where: str) -> None:
    kind, mode = a["kind"], a["mode"]
    if kind[0] != KIND_DIR:
        raise corrupt(where, "the root (entry 0) is not a directory")
    e = _first(kind > KIND_SYMLINK)
    if e is not None:
        raise corrupt(where, f"{_entry(a, e)} has kind {kind[e]} (0 file, 1 directory, "
                      "2 symlink)")
    want = np.array([_TYPE_BITS[k] for k in range(3)], dtype=np.uint32).take(kind)
    e = _first((mode & 0o170000) != want)  # S_IFMT: the type bits
    if e is not None:
        raise corrupt(where, f"{_entry(a, e)} has mode 0o{mode[e]:o}, not the type of its "
                      f"kind ({_KIND_NAMES[kind[e]]})")


def _check_tree(a: Mapping[str, Arr], n: int, where: str) -> None:
    """Parents come before their children (so every walk up reaches the root), and each
    directory's children are exactly the entries [first, first + count) whose parent it is."""
    kind, parent = a["kind"], a["parent"].astype(np.int64)
    first, count = a["first"].astype(np.int64), a["count"].astype(np.int64)
    if parent[0] != 0:
        raise corrupt(where, "the root (entry 0) is not its own parent")
    idx = np.arange(n, dtype=np.int64)
    e = _first(parent[1:] >= idx[1:], 1)
    if e is not None:
        raise corrupt(where, f"{_entry(a, e)} has parent {parent[e]}: a parent comes "
                      "before its children (a cycle, or an index past the end)")
    e = _first(kind[parent[1:]] != KIND_DIR, 1)
    if e is not None:
        raise corrupt(where, f"{_entry(a, e)} has parent {parent[e]}, which is not a "
                      "directory")
    dirs = kind == KIND_DIR
    e = _first(~dirs & (count != 0))
    if e is not None:
        raise corrupt(where, f"{_entry(a, e)} is not a directory but has {count[e]} children")
    e = _first(dirs & (count > 0) & ((first < 1) | (first > n - count)))
    if e is not None:
        raise corrupt(where, f"{_entry(a, e)} has children {first[e]}..{first[e]}+"
                      f"{count[e]}, past the {n} entries")
    p = parent[1:]
    e = _first((idx[1:] < first[p]) | (idx[1:] >= first[p] + count[p]), 1)
    if e is not None:
        raise corrupt(where, f"{_entry(a, e)} is not among the children of its parent "
                      f"{_entry(a, int(parent[e]))}")
    if int(count[dirs].sum()) != n - 1:
        raise corrupt(where, "the directories' children overlap (their counts add up to "
                      f"{int(count[dirs].sum())}, not {n - 1})")


def check_pieces(a: Mapping[str, Arr], n: int, piece_size: int, where: str) -> None:
    """Version 2's piece checksums: ``piece`` has one item per entry, and a file that has
    pieces is a raw file larger than one piece whose pieces all lie inside ``pieces``."""
    for name, dtype in (PIECE_ENTRY_ARRAY, PIECES_ARRAY):
        if name not in a:
            raise corrupt(where, f"a version 2 or later manifest without the array {name!r}")
        if a[name].dtype.str != np.dtype(dtype).str:
            raise corrupt(where, f"array {name!r} has dtype {a[name].dtype.str!r}, not {dtype!r}")
    piece, total = a[PIECE_ENTRY_ARRAY[0]], len(a[PIECES_ARRAY[0]])
    if len(piece) != n:
        raise corrupt(where, f"array 'piece' has {len(piece)} items, not {n} ({n} entries)")
    has = piece != NO_INDEX
    size = a["size"]
    need = (size + np.uint64(piece_size - 1)) // np.uint64(piece_size)  # pieces of each file
    first = piece.astype(np.uint64)
    bad = has & ((a["kind"] != KIND_FILE) | (a["codec"] != Codec.NONE)
                 | (size <= np.uint64(piece_size))
                 | (first > np.uint64(total)) | (need > np.uint64(total) - np.minimum(
                     first, np.uint64(total))))
    e = _first(bad)
    if e is not None:
        raise corrupt(where, f"{_entry(a, e)} has piece checksums {piece[e]}+{need[e]} of "
                      f"{total}, and only a raw file larger than one piece ({piece_size} "
                      "bytes) has them, all stored")


def _check_files(a: Mapping[str, Arr], shard_sizes: Arr, where: str) -> None:
    kind, shard = a["kind"], a["shard"]
    files = kind == KIND_FILE
    count = len(shard_sizes)
    e = _first(np.where(files, shard >= count, shard != NO_INDEX))
    if e is not None:
        raise corrupt(where, f"{_entry(a, e)} is in shard {shard[e]}, and there are {count} "
                      "shards" if files[e] else f"{_entry(a, e)} is not a file but has shard "
                      f"{shard[e]}")
    # over whole arrays, masked, not gathered: the files are most of the entries
    off, stored, size, codec = a["offset"], a["stored"], a["size"], a["codec"]
    end = np.append(shard_sizes, SHARD_HEADER.size).take(
        np.where(files, shard.astype(np.intp), count))
    # offset + stored may wrap around 2**64: compare stored with what is left instead
    bad = (off < SHARD_HEADER.size) | (off > end) | (stored > end - np.minimum(off, end))
    e = _first(files & bad)
    if e is not None:
        raise corrupt(where, f"{_entry(a, e)} (bytes {off[e]}+{stored[e]}) is past the end "
                      f"of shard {shard[e]} ({shard_sizes[shard[e]]} bytes)")
    e = _first(files & (codec > int(max(Codec))))
    if e is not None:
        raise corrupt(where, f"{_entry(a, e)} has codec {codec[e]} (0 raw, 1 zstd)")
    # a compressed file is decoded whole, into memory: never allocate what a crafted size says
    e = _first(files & (codec == Codec.ZSTD) & (size > np.uint64(MAX_COMPRESSED)))
    if e is not None:
        raise corrupt(where, f"{_entry(a, e)} is a zstd file of {size[e]} bytes, and no pack "
                      f"stores a file of more than {MAX_COMPRESSED} bytes compressed")
    raw_bad = (codec == Codec.NONE) & (stored != size)
    zstd_bad = (codec == Codec.ZSTD) & (size // np.uint64(ZSTD_MAX_RATIO) > stored)
    e = _first(files & (raw_bad | zstd_bad))
    if e is not None:
        raise corrupt(where, f"{_entry(a, e)} has size {size[e]} for {stored[e]} stored bytes, "
                      f"which codec {codec[e]} cannot give (raw: the same; zstd: at most "
                      f"{ZSTD_MAX_RATIO} times more)")


@dataclass(frozen=True, slots=True)
class FileAlign:
    """The pack's promise: every raw file of at least ``min_size`` bytes (and not empty)
    starts at a multiple of ``to`` in its shard. ``to`` 1: no promise."""

    to: int = 1
    min_size: int = 0

    def applies(self, codec: int, size: int) -> bool:
        return self.to > 1 and codec == Codec.NONE and size >= max(self.min_size, 1)


NO_ALIGN = FileAlign()
"""No file is aligned (a pack before version 3, or packed with ``--align 1``)."""


def check_align(meta: Mapping[str, Any], a: Mapping[str, Arr], version: int,
                where: str) -> FileAlign:
    """Version 3's ``align`` (absent: no promise), checked, and kept by every file it names,
    so a reader that maps a file because the pack says it is aligned can rely on it. Before
    version 3 files are back to back and the key means nothing."""
    spec = meta.get("align")
    if spec is None or version < 3:
        return NO_ALIGN
    if not (isinstance(spec, dict) and type(spec.get("to")) is int
            and type(spec.get("min_size")) is int):
        raise corrupt(where, f"align is {spec!r}, not {{\"to\": bytes, \"min_size\": bytes}}")
    to, min_size = spec["to"], spec["min_size"]
    if not 1 <= to <= MAX_FILE_ALIGN or to & (to - 1):
        raise corrupt(where, f"align.to is {to}, not a power of two from 1 to {MAX_FILE_ALIGN}")
    if not 0 <= min_size < 2**63:
        raise corrupt(where, f"align.min_size is {min_size}, not a size in bytes")
    got = FileAlign(to, min_size)
    if to == 1:
        return got
    size = a["size"]
    held = ((a["kind"] == KIND_FILE) & (a["codec"] == Codec.NONE)
            & (size >= np.uint64(max(min_size, 1))))
    e = _first(held & ((a["offset"] & np.uint64(to - 1)) != 0))
    if e is not None:
        raise corrupt(where, f"{_entry(a, e)} (raw, {size[e]} bytes at offset {a['offset'][e]} "
                      f"of shard {a['shard'][e]}) does not start at a multiple of {to}, as "
                      f"align promises for every raw file of at least {min_size} bytes")
    return got


def _check_symlinks(a: Mapping[str, Arr], n: int, where: str) -> None:
    links = np.flatnonzero(a["kind"] == KIND_SYMLINK)
    blob = np.uint64(len(a["strings"]))
    off, length = a["offset"][links], a["stored"][links]
    bad = (off > blob) | (length > blob - np.minimum(off, blob)) | (length == 0)
    bad |= a["size"][links] != length
    e = _first(bad)
    if e is not None:
        e = int(links[e])
        raise corrupt(where, f"{_entry(a, e)} has its target at {a['offset'][e]}+"
                      f"{a['stored'][e]}, not inside the {int(blob)} bytes of strings")
    target = a["first"][links]
    e = _first((target >= n) & (target != NO_INDEX))
    if e is not None:
        e = int(links[e])
        raise corrupt(where, f"{_entry(a, e)} resolves to entry {a['first'][e]}, past the "
                      f"{n} entries")


def _check_paths(a: Mapping[str, Arr], n: int, where: str) -> None:
    """Each path is inside ``strings``, and is its parent's path, "/", then a name that is
    not empty, ".", ".." and holds no NUL (a name cannot hold "/": it ends at the last one).
    Whether a path starts with its parent's path byte for byte is not compared (the cost of
    comparing every prefix): docs/FORMAT.md says what that leaves."""
    strings, po = a["strings"], a["path_off"]
    if (po > len(strings)).any():
        raise corrupt(where, "the paths are not inside strings")
    off = po.astype(np.int64)
    lens = np.diff(off)
    e = _first(lens[1:] <= 0, 1)
    if e is not None or lens[0] != 0:
        raise corrupt(where, f"the path of entry {e or 0} is out of order or empty "
                      "(path_off is not increasing, or the root's path is not empty)")
    if len(strings) and strings.min() == 0:  # a reduction: no temporary array
        raise corrupt(where, "strings holds a NUL byte (no path or symlink target can)")
    if n == 1:
        return
    region = strings[off[0] : off[-1]]
    size = len(region)
    it = np.int32 if size < 2**31 else np.int64  # searches in int32 take half the time
    starts, ends = (off[1:-1] - off[0]).astype(it), (off[2:] - off[0]).astype(it)
    slashes = np.flatnonzero(region == _SLASH).astype(it)
    if ((region.take(starts) == _SLASH).any() or (region.take(ends - 1) == _SLASH).any()
            or (np.diff(slashes) == 1).any()):
        raise corrupt(where, "a path has an empty name (it starts or ends with '/', or "
                      "holds '//')")
    _check_dot_names(region, starts, slashes, where)
    # path(i) = path(parent) + "/" + name: its last "/" is where its parent's path ends
    last = np.searchsorted(slashes, ends, side="left") - 1
    last_at = np.append(slashes, -1).take(last)  # -1: no "/" at all
    has = last_at >= starts
    parent = a["parent"][1:].astype(np.intp)  # take() with uint32 indices is 20x slower
    want = np.where(parent == 0, 0, lens.take(parent))  # the parent's path length
    got = np.where(has, last_at - starts, 0)
    e = _first((has != (parent != 0)) | (got != want), 1)
    if e is not None:
        raise corrupt(where, f"the path of entry {e} is not a name inside its parent "
                      f"{parent[e - 1]}'s path")


def _check_dot_names(region: Arr, starts: Arr, slashes: Arr, where: str) -> None:
    """No name is "." or "..": no dot that begins a name (at a path's start, or after a
    "/") is followed by the name's end, or by one more dot and then the end."""
    size = len(region)
    after = slashes[slashes < size - 1] + 1
    begin = np.concatenate([starts[region.take(starts) == _DOT], after[region.take(after) == _DOT]])
    if not len(begin):  # the usual case: no name starts with a dot
        return

    def is_start(i: Arr) -> Arr:  # a path starts at i (or the last one ends there)
        at = np.searchsorted(starts, i)
        found: Arr = (i >= size) | (starts.take(np.minimum(at, len(starts) - 1)) == i)
        return found

    def ends_at(i: Arr) -> Arr:  # the name ends just before position i
        found: Arr = is_start(i) | (region.take(np.minimum(i, size - 1)) == _SLASH)
        return found

    if ends_at(begin + 1).any():
        raise corrupt(where, "a path holds a name '.'")
    second = np.minimum(begin + 1, size - 1)
    two = (region.take(second) == _DOT) & ~is_start(begin + 1)
    if (two & ends_at(begin + 2)).any():
        raise corrupt(where, "a path holds a name '..'")


def _check_slots(a: Mapping[str, Arr], n: int, where: str) -> None:
    """Every entry sits in exactly one slot, and one slot at least is empty: every probe
    sequence meets it, so a lookup of a missing path ends."""
    slots = a["slots"]
    size = len(slots)
    if size == 0 or size & (size - 1):
        raise corrupt(where, f"the hash table has {size} slots, not a power of two")
    if size <= n or not (slots == 0).any():
        raise corrupt(where, "the hash table has no empty slot (a lookup would never end)")
    if int(slots.max()) > n:
        raise corrupt(where, f"a hash table slot holds {int(slots.max())}, past the {n} "
                      "entries")
    taken = slots[slots != 0]
    seen = np.zeros(n + 1, dtype=bool)
    seen[taken] = True
    e = _first(~seen[1:])
    if e is not None or len(taken) != n:  # n slots, each entry in one: each in exactly one
        raise corrupt(where, f"{_entry(a, e)} is in no hash table slot" if e is not None else
                      "an entry is in two hash table slots")
