"""Checksums of stored files: xxh3_64 of the raw (uncompressed) content."""

from __future__ import annotations

from xxhash import xxh3_64_intdigest

checksum = xxh3_64_intdigest
"""``checksum(data) -> int``: the 64-bit checksum recorded for every file."""

__all__ = ["checksum"]
