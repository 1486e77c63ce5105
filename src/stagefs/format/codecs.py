"""Per-file codecs. ``auto`` keeps a file compressed only where that saves space."""

from __future__ import annotations

import enum
import threading

import zstandard

from stagefs.errors import CorruptShardError

__all__ = ["CODEC_NONE", "CODEC_ZSTD", "MAX_COMPRESSED", "Codec", "compress_auto", "decode"]


class Codec(enum.IntEnum):
    NONE = 0
    ZSTD = 1


CODEC_NONE = Codec.NONE
CODEC_ZSTD = Codec.ZSTD

ZSTD_LEVEL = 3
MAX_COMPRESSED = 64 * 2**20
"""The largest file a pack stores compressed: a larger one is copied in chunks and stored
raw. A reader decodes a compressed file whole, into memory, so a manifest that says a zstd
file is larger is refused (format/validate.py): a tiny crafted frame would otherwise make
every reader allocate what the manifest says, up to 32768 times its stored bytes."""
MIN_SAVING = 0.05
"""``auto`` keeps zstd only if it saves at least this share: below it, raw reads are cheaper."""
_SAMPLE = 16 * 1024
# Formats that are already compressed: a trial compression is skipped for them.
_COMPRESSED_MAGIC = (
    b"\xff\xd8\xff",  # JPEG
    b"\x89PNG",
    b"GIF8",
    b"RIFF",  # WebP, AVI, WAV (WAV is rare in training sets and would stay raw)
    b"\x1f\x8b",  # gzip
    b"\x28\xb5\x2f\xfd",  # zstd
    b"BZh",
    b"\xfd7zXZ",
    b"\x00\x00\x00\x1cftyp",  # MP4
    b"\x00\x00\x00\x20ftyp",
)

_local = threading.local()


def _compressor() -> zstandard.ZstdCompressor:
    c = getattr(_local, "c", None)
    if c is None:
        c = _local.c = zstandard.ZstdCompressor(level=ZSTD_LEVEL)
    return c


def _decompressor() -> zstandard.ZstdDecompressor:
    d = getattr(_local, "d", None)
    if d is None:
        d = _local.d = zstandard.ZstdDecompressor()
    return d


def compress_auto(data: bytes, mode: str) -> tuple[Codec, bytes]:
    """Choose a codec for one file under ``mode`` (auto, zstd or none) and encode it."""
    if mode == "none" or not data:
        return Codec.NONE, data
    if mode == "auto":
        if data.startswith(_COMPRESSED_MAGIC):
            return Codec.NONE, data
        if len(data) > 4 * _SAMPLE:  # a cheap trial on a sample before the whole file
            sample = data[:_SAMPLE]
            if len(_compressor().compress(sample)) > len(sample) * (1 - MIN_SAVING):
                return Codec.NONE, data
    packed = _compressor().compress(data)
    if mode == "auto" and len(packed) > len(data) * (1 - MIN_SAVING):
        return Codec.NONE, data
    return Codec.ZSTD, packed


def decode(codec: int, stored: bytes, size: int, where: str) -> bytes:
    """Return the raw bytes of one file; a stored form that cannot be decoded is corrupt.
    ``where`` (a shard and file; may be empty) begins the error's message."""
    at = f"{where}: " if where else ""
    if codec == Codec.NONE:
        return stored
    if codec == Codec.ZSTD:
        try:
            # a corrupt frame header may declare any size: never allocate by it
            declared = zstandard.frame_content_size(stored)
            if declared not in (-1, size):
                raise CorruptShardError(
                    f"{at}zstd frame says {declared} bytes, the manifest says {size}")
            return _decompressor().decompress(stored, max_output_size=size)
        except zstandard.ZstdError as exc:
            raise CorruptShardError(f"{at}zstd data cannot be decoded ({exc})") from exc
    raise CorruptShardError(f"{at}unknown codec {codec}")
