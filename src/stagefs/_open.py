"""Putting a Store together: the origin (a pack or a raw directory), the tier chain, the
runtime directory. ``stagefs.open`` and a Store's unpickling both come here."""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING

from stagefs.config import TierSpec, env, parse_tier
from stagefs.errors import ConfigError, StagefsError
from stagefs.format import MANIFEST_NAME, Manifest
from stagefs.runtime import Runtime
from stagefs.tiers.base import OriginStats
from stagefs.tiers.chain import TierChain
from stagefs.tiers.inplace import InPlaceOrigin, SumTable
from stagefs.tiers.origin import PackOrigin

if TYPE_CHECKING:
    from stagefs.store import Store

__all__ = ["build_store", "resolve_tiers"]

log = logging.getLogger("stagefs")

TiersArg = Sequence[str | TierSpec] | str | None


def resolve_tiers(tiers: TiersArg) -> list[TierSpec]:
    """Tier specs from the argument, else ``$STAGEFS_TIERS`` (comma-separated), else none."""
    if tiers is None:
        tiers = env("TIERS") or ""
    items = tiers.split(",") if isinstance(tiers, str) else list(tiers)
    specs: list[TierSpec] = []
    for t in items:
        if isinstance(t, TierSpec):
            specs.append(t)
        elif isinstance(t, str) and t.strip():
            specs.append(parse_tier(t.strip()))
        elif not isinstance(t, str):
            raise ConfigError(f"a tier is a string like '/dev/shm/x:16GiB', not {t!r}")
    paths = [s.path for s in specs]
    if len(set(paths)) != len(paths):
        raise ConfigError(f"the same tier directory is named twice: {paths}")
    return specs


def build_store(path: str, *, tiers: TiersArg = None, runtime: str | os.PathLike[str] | None
                = None, verify: bool = True, progress: bool | None = None) -> Store:
    from stagefs.store import Store

    specs = resolve_tiers(tiers)
    is_pack = os.path.exists(os.path.join(path, MANIFEST_NAME))
    rt = Runtime(runtime).open() if specs or not is_pack else _counting(runtime)
    sums: SumTable | None = None
    try:
        if is_pack:
            manifest = Manifest(os.path.join(path, MANIFEST_NAME))
            origin: PackOrigin | InPlaceOrigin = PackOrigin(path, manifest,
                                                               check_headers=not verify)
        else:
            from stagefs.inplace import open_manifest

            assert rt is not None
            scan_stats = OriginStats()
            manifest, cache, _ = open_manifest(path, rt, progress=progress, stats=scan_stats,
                                               tiers=[s.path for s in specs])
            origin = InPlaceOrigin(path, manifest)
            origin.on_changed = cache.mark_stale  # a file changed in place: scan at next open
            origin.stats = scan_stats  # the scan's operations on the origin count too
            sums = SumTable(cache.sums_path, len(manifest))
        chain = None
        if specs:
            assert rt is not None
            chain = TierChain(manifest, origin, specs, rt, origin_path=path,
                              record=sums.record if sums is not None else None)
    except BaseException:
        if rt is not None:
            rt.unregister()
        raise
    reopen = None
    if rt is not None:  # (a spawned worker's copy counts for the job too)
        reopen = {"path": path, "tiers": specs, "verify": verify,
                  "runtime": os.fspath(runtime) if runtime is not None else None}
    return Store(path, verify=verify, manifest=manifest, origin=origin, chain=chain, sums=sums,
                 reopen=reopen, runtime=rt)


def _counting(runtime: str | os.PathLike[str] | None) -> Runtime | None:
    """The job's runtime for a pack read without tiers, where its reads are counted for
    ``stagefs status``: the one named (``runtime``), or the job's if it has one already
    (another of its stores has tiers, a cluster daemon, a FUSE mount with tiers); else
    none, and nothing is made. Without it, a val set read beside a tiered train set (or a
    mount, a ``stagefs run`` without ``--tier``) was missing from the job's counts. A
    runtime that cannot be used is not an error for a read that needs none: uncounted."""
    try:
        rt = Runtime(runtime)
        return rt.open() if runtime is not None or rt.exists() else None
    except (StagefsError, OSError) as exc:
        log.debug("reads not counted for stagefs status: %s", exc)
        return None
