"""Check every file of a pack against its checksum, shard by shard, over processes."""

from __future__ import annotations

import concurrent.futures as cf
import os
from dataclasses import dataclass, field

from tqdm import tqdm

from stagefs.errors import ConfigError, CorruptShardError, FormatError, StagefsError
from stagefs.format import KIND_FILE, MANIFEST_NAME, Manifest
from stagefs.format.checksum import StreamSum, bad_piece, check
from stagefs.tiers.origin import PackOrigin

__all__ = ["Corrupt", "VerifyReport", "verify_pack"]


@dataclass(frozen=True, slots=True)
class Corrupt:
    path: str
    shard: str
    reason: str


@dataclass
class VerifyReport:
    files: int = 0
    bytes: int = 0
    corrupt: list[Corrupt] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.corrupt


_WINDOW = 64 * 2**20
"""Bytes read with one call: bounded memory, and well below Linux's 2 GiB cap on one read
(a shard larger than that, from ``--shard-size 4GiB`` or one huge file, is read in parts)."""


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


def _verify_shard(pack_dir: str, shard: int) -> tuple[int, int, list[Corrupt]]:
    m = Manifest(os.path.join(pack_dir, MANIFEST_NAME), verify=False)
    origin = PackOrigin(pack_dir, m, check_headers=True)
    a = m.arrays
    ents = [int(e) for e in (a["shard"] == shard).nonzero()[0] if a["kind"][e] == KIND_FILE]
    ents.sort(key=lambda e: int(m.offset[e]))
    name = m.shards[shard].name
    bad: list[Corrupt] = []
    nbytes = 0
    try:
        try:
            origin.fileno(shard)  # opens the shard and checks its header
        except (StagefsError, OSError) as exc:
            reason = str(exc)
            return len(ents), 0, [Corrupt(os.fsdecode(m.path_of(e)), name, reason) for e in ents]
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
            except (StagefsError, OSError) as exc:
                found = [Corrupt(os.fsdecode(m.path_of(x)), name, str(exc)) for x in ents[i:j]]
            bad += [c for c in found if c is not None]
            nbytes += sum(int(m.size[x]) for x in ents[i:j])
            i = j
        return len(ents), nbytes, bad
    finally:
        origin.close()
        del a
        m.close()


def verify_pack(pack_dir: str, *, jobs: int | None = None,
                progress: bool | None = None) -> VerifyReport:
    """Verify every file; the manifest's own checksum is checked first, on open."""
    pack_dir = os.path.abspath(pack_dir)
    m = Manifest(os.path.join(pack_dir, MANIFEST_NAME))
    shards = list(range(len(m.shards)))
    total = sum(s.size for s in m.shards)
    sizes = [s.size for s in m.shards]
    m.close()
    report = VerifyReport()
    if jobs is not None and jobs < 0:
        raise ConfigError(f"--jobs must be a number of processes (1 or more), not {jobs}")
    jobs = jobs or min(os.cpu_count() or 1, 8)
    with tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc="verifying",
              disable=None if progress is None else not progress) as bar:
        if jobs == 1 or len(shards) <= 1:
            results = ((i, _verify_shard(pack_dir, i)) for i in shards)
            for i, (n, b, bad) in results:
                report.files += n
                report.bytes += b
                report.corrupt += bad
                bar.update(sizes[i])
        else:
            with cf.ProcessPoolExecutor(max_workers=jobs) as pool:
                futs = {pool.submit(_verify_shard, pack_dir, i): i for i in shards}
                for fut in cf.as_completed(futs):
                    n, b, bad = fut.result()
                    report.files += n
                    report.bytes += b
                    report.corrupt += bad
                    bar.update(sizes[futs[fut]])
    report.corrupt.sort(key=lambda c: c.path)
    return report
