"""Shard files: a 64-byte header, then the stored bytes of files back to back, with zero
bytes before a file the pack aligns (docs/FORMAT.md, "File alignment").

A shard is written to ``NAME.partial`` and renamed into place when complete, so a shard
with its final name is always whole (docs/FORMAT.md, "Shards").
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import BinaryIO

from stagefs.errors import CorruptShardError, UnsupportedVersionError
from stagefs.format.spec import SHARD_HEADER, SHARD_MAGIC, SUPPORTED_VERSIONS, VERSION
from stagefs.format.validate import NO_ALIGN, FileAlign

__all__ = ["ShardHeader", "ShardWriter", "shard_name"]


def shard_name(index: int) -> str:
    return f"shard-{index:06d}.sfs"


@dataclass(frozen=True, slots=True)
class ShardHeader:
    index: int
    pack_id: bytes
    data_length: int

    def encode(self) -> bytes:
        return SHARD_HEADER.pack(SHARD_MAGIC, VERSION, self.index, self.pack_id, self.data_length)

    @classmethod
    def decode(cls, raw: bytes, where: str) -> ShardHeader:
        if len(raw) < SHARD_HEADER.size:
            raise CorruptShardError(f"{where}: truncated shard header ({len(raw)} bytes); copy the pack again or re-pack")
        magic, version, index, pack_id, length = SHARD_HEADER.unpack_from(raw)
        if magic != SHARD_MAGIC:
            raise CorruptShardError(f"{where}: not a stagefs shard (bad magic {magic!r})")
        if version not in SUPPORTED_VERSIONS:
            raise UnsupportedVersionError(
                f"{where}: shard format version {version}; this stagefs reads versions "
                f"{', '.join(map(str, SUPPORTED_VERSIONS))}. A newer stagefs wrote it: use "
                "that stagefs (or upgrade this one), or re-pack the dataset with this one."
            )
        return cls(index, pack_id, length)

    def check(self, where: str, *, index: int, pack_id: bytes, file_size: int) -> None:
        """Raise if this header does not belong at ``index`` of pack ``pack_id``."""
        if self.pack_id != pack_id:
            raise CorruptShardError(f"{where}: shard belongs to another pack (pack id differs)")
        if self.index != index:
            raise CorruptShardError(f"{where}: header says shard {self.index}, expected {index}")
        if file_size != SHARD_HEADER.size + self.data_length:
            raise CorruptShardError(
                f"{where}: shard is {file_size} bytes, its header says "
                f"{SHARD_HEADER.size + self.data_length}: truncated or overwritten; copy the pack again or re-pack"
            )


class ShardWriter:
    """Append stored files to a new shard; ``close()`` makes it appear under its final name.
    ``align``: the pack's file alignment, which ``align_for`` keeps."""

    def __init__(self, path: str, index: int, pack_id: bytes,
                 align: FileAlign = NO_ALIGN) -> None:
        self.path = path
        self.align = align
        self.index = index
        self.pack_id = pack_id
        self._partial = path + ".partial"
        self._f: BinaryIO = open(self._partial, "wb")  # noqa: SIM115 - closed in close()/abort()
        self._f.write(ShardHeader(index, pack_id, 0).encode())
        self.position = SHARD_HEADER.size

    def append(self, data: bytes) -> int:
        """Write one file's stored bytes; return the offset they start at."""
        offset = self.position
        self._f.write(data)
        self.position += len(data)
        return offset

    def align_for(self, codec: int, size: int) -> None:
        """Before a file stored with ``codec`` of ``size`` raw bytes: if the pack aligns
        such a file, write zero bytes up to the next multiple of the alignment."""
        if not self.align.applies(codec, size):
            return
        gap = -self.position & (self.align.to - 1)
        if gap:
            self._f.write(bytes(gap))
            self.position += gap

    def close(self) -> None:
        header = ShardHeader(self.index, self.pack_id, self.position - SHARD_HEADER.size)
        self._f.seek(0)
        self._f.write(header.encode())
        self._f.flush()
        os.fsync(self._f.fileno())
        self._f.close()
        os.replace(self._partial, self.path)

    def abort(self) -> None:
        # the bytes still buffered are dropped: on a full disk (the usual cause of an
        # abort) their flush fails again, and the partial file must go all the same
        with contextlib.suppress(OSError):
            self._f.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._partial)
