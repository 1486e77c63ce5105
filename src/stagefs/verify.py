"""Check every file of a pack against its checksum, shard by shard, over processes."""

from __future__ import annotations

import concurrent.futures as cf
import os
from dataclasses import dataclass, field

from tqdm import tqdm

from stagefs._fsutil import worker_pool
from stagefs.config import absolute
from stagefs.errors import ConfigError
from stagefs.format import MANIFEST_NAME, PACK_STATE_DIR, Manifest
from stagefs.tiers.audit import Corrupt, check_shard

__all__ = ["Corrupt", "VerifyReport", "verify_pack"]


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
    try:
        return check_shard(pack_dir, m, shard)
    finally:
        m.close()


def verify_pack(pack_dir: str, *, jobs: int | None = None,
                progress: bool | None = None) -> VerifyReport:
    """Verify every file; the manifest's own checksum is checked first, on open."""
    pack_dir = absolute(pack_dir)
    if os.path.isdir(pack_dir) and not os.path.exists(os.path.join(pack_dir, MANIFEST_NAME)) \
            and not os.path.isdir(os.path.join(pack_dir, PACK_STATE_DIR)):
        if not os.listdir(pack_dir):
            raise ConfigError(f"{pack_dir} is an empty directory, not a pack: name the "
                              f"directory that holds {MANIFEST_NAME} (stagefs pack writes it)")
        raise ConfigError(f"{pack_dir} is a directory of files, not a pack (no {MANIFEST_NAME}):"
                          " it holds no checksums to verify against; pack it (stagefs pack "
                          f"{pack_dir} DEST) and verify the pack")
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
            with worker_pool(jobs) as pool:  # no worker outlives a killed verify
                futs = {pool.submit(_verify_shard, pack_dir, i): i for i in shards}
                for fut in cf.as_completed(futs):
                    n, b, bad = fut.result()
                    report.files += n
                    report.bytes += b
                    report.corrupt += bad
                    bar.update(sizes[futs[fut]])
    report.corrupt.sort(key=lambda c: c.path)
    return report
