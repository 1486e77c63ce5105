"""Checksums of stored files: xxh3_64 of the raw (uncompressed) content, of the whole file
and (format version 2) of each piece of a large raw file.

``check`` and ``bad_piece`` are the one place where stored bytes are decoded and compared
with their checksums: every reader (the Store, ``stagefs verify``) calls them.
"""

from __future__ import annotations

from collections.abc import Sequence

from xxhash import xxh3_64, xxh3_64_intdigest

from stagefs.errors import CorruptShardError
from stagefs.format.codecs import decode

checksum = xxh3_64_intdigest
"""``checksum(data) -> int``: the 64-bit checksum recorded for every file."""

__all__ = ["StreamSum", "bad_piece", "check", "checksum", "piece_count", "piece_error",
           "piece_sums"]


def check(codec: int, stored: bytes, size: int, expected: int, digest: int | None = None
          ) -> bytes:
    """The raw bytes of one stored file, decoded and matching ``expected``; else raise
    ``CorruptShardError`` saying what is wrong (the caller adds which file and where).
    ``digest``: the checksum of ``stored``, taken as it was read (tiers/base.py ``gather``),
    used for a file stored raw instead of hashing it again."""
    data = decode(codec, stored, size, "") if codec else stored
    if len(data) != size:
        raise CorruptShardError(f"{len(data)} bytes where the manifest says {size}")
    if (xxh3_64_intdigest(data) if digest is None or codec else digest) != expected:
        raise CorruptShardError("checksum mismatch")
    return data


def piece_count(size: int, piece: int) -> int:
    """Pieces of a file of ``size`` raw bytes: piece k covers [k*piece, min((k+1)*piece, size))."""
    return -(-size // piece)


def piece_sums(data: bytes | memoryview, piece: int) -> list[int]:
    """The checksum of each piece of ``data`` (a whole raw file)."""
    view = memoryview(data)
    return [xxh3_64_intdigest(view[k : k + piece]) for k in range(0, len(view), piece)]


def bad_piece(data: bytes | memoryview, piece: int, sums: Sequence[int], first: int) -> int:
    """Check ``data``, the raw bytes of pieces ``first``, ``first + 1``, ... of a file (the
    last one possibly short), against ``sums``; return the first bad piece, or -1."""
    view = memoryview(data)
    k = first
    for pos in range(0, len(view), piece):
        if xxh3_64_intdigest(view[pos : pos + piece]) != sums[k]:
            return k
        k += 1
    return -1


def piece_error(k: int, piece: int, size: int) -> CorruptShardError:
    """Piece ``k`` of a file of ``size`` raw bytes failed its checksum: the error names it and
    its bytes, so that a reader knows which ranges of the file cannot be read."""
    return CorruptShardError(f"piece {k}, bytes {k * piece}-{min(size, (k + 1) * piece) - 1} "
                             "of the file, does not match its checksum")


class StreamSum:
    """The checksum of a raw file fed in order, part by part (bounded memory), and of each
    of its pieces on the way."""

    def __init__(self, piece: int) -> None:
        self.piece = piece
        self._whole = xxh3_64()
        self._part = xxh3_64()
        self._in_part = 0
        self.pieces: list[int] = []

    def update(self, data: bytes | memoryview) -> None:
        self._whole.update(data)
        view = memoryview(data)
        while view:
            n = min(len(view), self.piece - self._in_part)
            self._part.update(view[:n])
            self._in_part += n
            view = view[n:]
            if self._in_part == self.piece:
                self.pieces.append(self._part.intdigest())
                self._part.reset()
                self._in_part = 0

    def digest(self) -> int:
        """The whole file's checksum; ``pieces`` then holds every piece's (call once)."""
        if self._in_part:
            self.pieces.append(self._part.intdigest())
            self._in_part = 0
        return int(self._whole.intdigest())
