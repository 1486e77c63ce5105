"""Constants of the pack format, version 3. docs/FORMAT.md is the prose of this file."""

from __future__ import annotations

import struct

VERSION = 3
"""The format version this stagefs writes (manifest and shard headers)."""

SUPPORTED_VERSIONS = (1, 2, 3)
"""The versions this stagefs reads; a reader refuses any other, naming these."""

PIECE = 1 << 20
"""Bytes per checksummed piece of a large raw file (version 2). Written to the manifest's
metadata as ``piece_size``: a reader uses the pack's value, not this one."""

MANIFEST_NAME = "manifest.sfm"
PACK_STATE_DIR = ".stagefs-pack"  # an unfinished pack's state, in DEST (pack.py)
MANIFEST_MAGIC = b"STGFSMAN"
SHARD_MAGIC = b"STGFSSHD"

# Manifest header: magic, version, flags, meta offset, meta length, file length, body checksum.
MANIFEST_HEADER = struct.Struct("<8sIIQQQQ16x")
# Shard header: magic, version, shard index, pack id, data length (bytes after the header).
SHARD_HEADER = struct.Struct("<8sII16sQ24x")
ALIGN = 64
"""Arrays of a manifest start at a multiple of this (not to be confused with file alignment)."""

FILE_ALIGN = 4096
"""Default boundary a pack aligns raw files to in their shards (``stagefs pack --align``): a
page, so that a tier copy of a shard can be mapped file by file (mmap offsets are pages)."""

FILE_ALIGN_MIN = 64 * 1024
"""Raw files smaller than this are not aligned: padding costs up to ``FILE_ALIGN - 1`` bytes
per file, which on small files would grow a pack by far more than mapping them saves
(docs/FORMAT.md, "File alignment")."""

MAX_FILE_ALIGN = 1 << 30
"""The largest alignment a pack may declare (a reader refuses a larger one)."""

KIND_FILE = 0
KIND_DIR = 1
KIND_SYMLINK = 2

NO_INDEX = 0xFFFFFFFF
"""Entry or shard index meaning "none" (a directory's shard, a dangling symlink's target)."""

# The entry arrays of a manifest, in file order: name → numpy dtype (little-endian).
ENTRY_ARRAYS: dict[str, str] = {
    "hash": "<u8",  # xxh3_64 of the path bytes
    "parent": "<u4",  # index of the parent directory entry (root: itself)
    "kind": "u1",  # KIND_*
    "mode": "<u4",  # st_mode, type bits included
    "mtime_ns": "<i8",
    "size": "<u8",  # raw (uncompressed) bytes; a symlink: length of its target
    "shard": "<u4",  # shard index of a file's bytes; NO_INDEX otherwise
    "offset": "<u8",  # file: offset in the shard; symlink: offset of the target in strings
    "stored": "<u8",  # file: bytes stored in the shard; symlink: length of the target
    "codec": "u1",  # CODEC_*
    "checksum": "<u8",  # xxh3_64 of the raw content
    "first": "<u4",  # directory: first child; symlink: the entry it resolves to, or NO_INDEX
    "count": "<u4",  # directory: number of children
}

# Version 2 adds, per entry, the index of the file's first piece checksum in ``pieces``.
PIECE_ENTRY_ARRAY = ("piece", "<u4")  # NO_INDEX: the file has no piece checksums
PIECES_ARRAY = ("pieces", "<u8")  # xxh3_64 of each piece, the pieces of a file contiguous
