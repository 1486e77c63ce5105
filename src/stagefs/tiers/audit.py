"""Check every file of one shard file (a pack's, or a tier's whole copy of it) against its
checksum, with the readers' own check: ``stagefs verify`` (verify.py) over a pack, a node
daemon over a copy a reader found bad bytes in (cluster/daemon.py)."""

from __future__ import annotations

import os
from dataclasses import dataclass

from stagefs._fsutil import out_of_descriptors
from stagefs.errors import CorruptShardError, DescriptorLimitError, FormatError, StagefsError
from stagefs.format import KIND_FILE, Manifest
from stagefs.format.checksum import StreamSum, bad_piece, check
from stagefs.tiers.base import SourceUnavailable
from stagefs.tiers.origin import PackOrigin

__all__ = ["Corrupt", "check_shard"]


@dataclass(frozen=True, slots=True)
class Corrupt:
    path: str
    shard: str
    reason: str


_WINDOW = 64 * 2**20
"""Bytes read with one call: bounded memory, and well below Linux's 2 GiB cap on one read
(a shard larger than that, from ``--shard-size 4GiB`` or one huge file, is read in parts)."""


_CANNOT_READ = (StagefsError, OSError, SourceUnavailable)
"""What reading a shard raises when it cannot be read: missing, truncated, another pack's,
or not to be opened at all (permission denied: SourceUnavailable)."""


def _reason(exc: BaseException, path: str) -> str:
    """Why the shard at ``path`` could not be read (``exc``), said for each of its files.
    Out of descriptors (EMFILE, ENFILE, here or in the cause) is this process's condition,
    not the shard's: raised as a DescriptorLimitError, never a shard called corrupt."""
    if out_of_descriptors(exc):  # (or the OSError a SourceUnavailable wraps)
        raise DescriptorLimitError(f"{path}: cannot open the shard to check it") from exc
    if isinstance(exc, SourceUnavailable):
        return f"the shard cannot be read: {exc}"
    return str(exc)


def _check(raw: bytes, e: int, m: Manifest, name: str) -> Corrupt | None:
    """Decode and check one file (and its pieces) with the readers' own check."""
    try:
        data = check(m.codec[e], raw, m.size[e], m.checksum[e])
        sums = m.piece_sums(e)
        if sums is not None and (k := bad_piece(data, m.piece_size, sums, 0)) >= 0:
            raise CorruptShardError(f"piece {k} does not match its checksum")
    except FormatError as exc:
        return Corrupt(os.fsdecode(m.path_of(e)), name, str(exc))
    return None


def _check_streamed(origin: PackOrigin, shard: int, e: int, m: Manifest,
                    name: str) -> Corrupt | None:
    """A raw entry larger than the window, hashed part by part (and piece by piece)."""
    h = StreamSum(m.piece_size)
    off, left = int(m.offset[e]), int(m.stored[e])
    while left:
        n = min(left, _WINDOW)
        h.update(origin.pread(shard, off, n))
        off, left = off + n, left - n
    path = os.fsdecode(m.path_of(e))
    if m.stored[e] != m.size[e] or h.digest() != m.checksum[e]:
        return Corrupt(path, name, "checksum mismatch")
    sums = m.piece_sums(e)
    if sums is not None and list(sums) != h.pieces:
        return Corrupt(path, name, "piece checksums do not match the file")
    return None


def check_shard(directory: str, m: Manifest, shard: int, *, whole: bool = False
                ) -> tuple[int, int, list[Corrupt]]:
    """Check every file of shard file ``shard`` in ``directory`` (a pack, or a tier's
    copies: the same names) against the manifest ``m``: (files, bytes, the corrupt ones).
    ``whole``: a file of another size than the shard's is bad as a whole (a tier's copy
    written past its end: its files are right, but no server serves it)."""
    origin = PackOrigin(directory, m, check_headers=True)
    a = m.arrays
    files = [int(e) for e in (a["shard"] == shard).nonzero()[0] if a["kind"][e] == KIND_FILE]
    # an empty file is in no shard's bytes (the manifest answers it): never corrupt
    empty = sum(1 for e in files if m.stored[e] == 0)
    ents = sorted((e for e in files if m.stored[e] > 0), key=lambda e: int(m.offset[e]))
    name = m.shards[shard].name
    bad: list[Corrupt] = []
    nbytes = 0
    try:
        try:
            origin.open_check(shard)  # opens the shard and checks its header
            if whole:
                origin.diagnose(shard)  # and its size
        except _CANNOT_READ as exc:
            reason = _reason(exc, origin.path(shard))
            return len(files), 0, [Corrupt(os.fsdecode(m.path_of(e)), name, reason)
                                   for e in ents]
        i = 0
        while i < len(ents):
            e = ents[i]
            start, j = int(m.offset[e]), i + 1
            while j < len(ents) and m.offset[ents[j]] + m.stored[ents[j]] - start <= _WINDOW:
                j += 1  # a window of whole entries, read with one call
            try:
                if m.stored[e] > _WINDOW and m.codec[e] == 0:
                    found = [_check_streamed(origin, shard, e, m, name)]
                else:
                    last = ents[j - 1]
                    end = int(m.offset[last] + m.stored[last])
                    blob = origin.pread(shard, start, end - start)
                    found = [_check(blob[m.offset[x] - start : m.offset[x] - start + m.stored[x]],
                                    x, m, name) for x in ents[i:j]]
            except _CANNOT_READ as exc:
                reason = _reason(exc, origin.path(shard))
                found = [Corrupt(os.fsdecode(m.path_of(x)), name, reason) for x in ents[i:j]]
            bad += [c for c in found if c is not None]
            nbytes += sum(int(m.size[x]) for x in ents[i:j])
            i = j
        return len(ents) + empty, nbytes, bad
    finally:
        origin.close()
        del a
