"""Check every file of a pack against its checksum, shard by shard, over processes."""

from __future__ import annotations

import concurrent.futures as cf
import os
from dataclasses import dataclass, field

from tqdm import tqdm

from stagefs.errors import FormatError, StagefsError
from stagefs.format import KIND_FILE, MANIFEST_NAME, Manifest, checksum
from stagefs.format.codecs import decode
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


def _verify_shard(pack_dir: str, shard: int) -> tuple[int, int, list[Corrupt]]:
    m = Manifest(os.path.join(pack_dir, MANIFEST_NAME), verify=False)
    origin = PackOrigin(pack_dir, m)
    a = m.arrays
    ents = [int(e) for e in (a["shard"] == shard).nonzero()[0] if a["kind"][e] == KIND_FILE]
    name = m.shards[shard].name
    bad: list[Corrupt] = []
    nbytes = 0
    try:
        try:
            blob = origin.pread(shard, 0, m.shards[shard].size)
        except (StagefsError, OSError) as exc:
            reason = str(exc)
            return len(ents), 0, [Corrupt(os.fsdecode(m.path_of(e)), name, reason) for e in ents]
        for e in ents:
            off, n, size = m.offset[e], m.stored[e], m.size[e]
            path = os.fsdecode(m.path_of(e))
            try:
                raw = decode(m.codec[e], blob[off : off + n], size, name)
            except FormatError as exc:
                bad.append(Corrupt(path, name, str(exc)))
                continue
            if len(raw) != size or checksum(raw) != m.checksum[e]:
                bad.append(Corrupt(path, name, "checksum mismatch"))
            nbytes += size
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
