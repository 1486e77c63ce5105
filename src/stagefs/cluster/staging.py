"""Staging: fill this node's tiers with its shards, each origin byte read once per job.

A shard's *primary* (placement.py) reads it from the origin with large sequential reads; its
other holders pull it from the primary over the peer protocol (one batched READ of the whole
shard), so a shard with K replicas costs the origin one read, not K. A holder whose primary
is down or too slow falls back to the origin, and says so in its counters.

Shard files go where every other writer puts them (COMMON layout):
``<tier dir>/<pack id hex>/<shard file name>``, written as ``NAME.partial`` and renamed, so a
shard is held iff its final name exists. A restarted daemon finds what it had staged.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from typing import Any

from stagefs.config import TierSpec
from stagefs.errors import CorruptShardError, FormatError
from stagefs.format import Manifest, ShardHeader
from stagefs.format.spec import SHARD_HEADER
from stagefs.net.client import PeerClient
from stagefs.tiers.base import SourceUnavailable

__all__ = ["NodeTiers", "Stager", "StagingStats"]

log = logging.getLogger("stagefs.stage")

_CHUNK = 8 * 2**20
_FORWARD_TIMEOUT = 600.0  # give up waiting for a primary after this long: read the origin


class NodeTiers:
    """This node's tiers for one pack: where each held shard is, and room left in each."""

    def __init__(self, tiers: Sequence[TierSpec], manifest: Manifest) -> None:
        self.specs = list(tiers)
        self.manifest = manifest
        self.pack_hex = manifest.pack_id.hex()
        self.used = [0] * len(self.specs)
        self.where: dict[int, int] = {}  # shard -> tier index
        self._lock = threading.Lock()
        for spec in self.specs:
            os.makedirs(self.dir(spec), mode=0o700, exist_ok=True)

    def dir(self, spec: TierSpec) -> str:
        return os.path.join(spec.path, self.pack_hex)

    def path(self, tier: int, shard: int) -> str:
        return os.path.join(self.dir(self.specs[tier]), self.manifest.shards[shard].name)

    def locate(self, shard: int) -> str | None:
        t = self.where.get(shard)
        return None if t is None else self.path(t, shard)

    def scan(self, shards: Sequence[int]) -> int:
        """Adopt shards already in the tiers (a restart); drop partial leftovers. Returns
        the number adopted."""
        for spec in self.specs:
            d = self.dir(spec)
            for name in os.listdir(d):
                if name.endswith(".partial"):
                    with contextlib.suppress(OSError):
                        os.unlink(os.path.join(d, name))
        found = 0
        for s in shards:
            for t in range(len(self.specs)):
                if self._valid(self.path(t, s), s):
                    self._adopt(t, s)
                    found += 1
                    break
        return found

    def _valid(self, path: str, shard: int) -> bool:
        try:
            with open(path, "rb") as f:
                raw = f.read(SHARD_HEADER.size)
                size = os.fstat(f.fileno()).st_size
            ShardHeader.decode(raw, path).check(path, index=shard,
                                                pack_id=self.manifest.pack_id, file_size=size)
        except (OSError, FormatError):
            return False
        return size == self.manifest.shards[shard].size

    def _adopt(self, tier: int, shard: int) -> None:
        with self._lock:
            if shard not in self.where:
                self.where[shard] = tier
                self.used[tier] += self.manifest.shards[shard].size

    def choose(self, shard: int) -> int | None:
        """The first tier with room for ``shard`` (reserving it), or None."""
        size = self.manifest.shards[shard].size
        with self._lock:
            for t, spec in enumerate(self.specs):
                room = (spec.capacity - self.used[t] if spec.capacity is not None
                        else shutil.disk_usage(spec.path).free - 64 * 2**20)
                if size <= room:
                    self.used[t] += size
                    return t
        return None

    def release(self, tier: int, shard: int) -> None:
        with self._lock:
            self.used[tier] -= self.manifest.shards[shard].size

    def commit(self, tier: int, shard: int, write: Callable[[int], None]) -> None:
        """Write a shard through ``write(fd)`` as NAME.partial, check it, rename into place."""
        final = self.path(tier, shard)
        partial = final + ".partial"
        fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            write(fd)
        except BaseException:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(partial)
            raise
        os.close(fd)
        if not self._valid(partial, shard):
            os.unlink(partial)
            raise CorruptShardError(f"shard {shard}: the staged copy has a bad header or size")
        os.replace(partial, final)
        with self._lock:
            self.where[shard] = tier

    def usage(self) -> list[dict[str, Any]]:
        return [{"path": s.path, "capacity": s.capacity, "used": u}
                for s, u in zip(self.specs, self.used, strict=True)]


@dataclass
class StagingStats:
    shards_assigned: int = 0
    bytes_assigned: int = 0
    shards_held: int = 0
    bytes_held: int = 0
    shards_reused: int = 0  # found in the tiers at start (restart)
    origin_reads: int = 0
    origin_bytes: int = 0
    forwarded_shards: int = 0  # pulled from a peer instead of the origin
    forwarded_bytes: int = 0
    forward_fallbacks: int = 0  # a peer could not give it: read the origin instead
    no_room: int = 0  # shards that did not fit in the tiers
    peers_unreachable: int = 0
    checksum_failures: int = 0
    started: float = 0.0
    finished: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


class Stager:
    """Stage ``mine`` (shards placed on ``rank``) into ``tiers``; run() in a thread."""

    def __init__(self, manifest: Manifest, pack_dir: str, holders: Sequence[Sequence[int]],
                 rank: int, tiers: NodeTiers, peers: dict[int, PeerClient],
                 stop: threading.Event, forward_timeout: float = _FORWARD_TIMEOUT) -> None:
        self.manifest = manifest
        self.pack_dir = pack_dir
        self.holders = holders
        self.rank = rank
        self.tiers = tiers
        self.peers = peers
        self.stop = stop
        self.forward_timeout = forward_timeout
        self.mine = [s for s, h in enumerate(holders) if rank in h]
        self.stats = StagingStats(shards_assigned=len(self.mine),
                                  bytes_assigned=sum(manifest.shards[s].size for s in self.mine))
        self.done = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        self.stats.started = time.time()
        try:
            self._run()
        except BaseException as exc:  # reported by the daemon; reads still fall through
            self.error = exc
            log.error("staging stopped: %s", exc)
        finally:
            self.stats.finished = time.time()
            self.done.set()

    def _run(self) -> None:
        reused = self.tiers.scan(self.mine)
        self.stats.shards_reused = reused
        self._count_held()
        todo = [s for s in self.mine if self.tiers.locate(s) is None]
        primary = [s for s in todo if self.holders[s][0] == self.rank]
        forward = [s for s in todo if self.holders[s][0] != self.rank]
        for s in primary:
            if self.stop.is_set():
                return
            self._place(s, self._from_origin)
        self._pull_all(forward)

    def _count_held(self) -> None:
        held = [s for s in self.mine if self.tiers.locate(s) is not None]
        self.stats.shards_held = len(held)
        self.stats.bytes_held = sum(self.manifest.shards[s].size for s in held)

    def _place(self, shard: int, fill: Callable[[int, int], None]) -> bool:
        tier = self.tiers.choose(shard)
        if tier is None:
            self.stats.no_room += 1
            return True  # nothing more to do for it: reads go to a peer or the origin
        try:
            self.tiers.commit(tier, shard, lambda fd: fill(shard, fd))
        except BaseException:
            self.tiers.release(tier, shard)
            raise
        self.stats.shards_held += 1
        self.stats.bytes_held += self.manifest.shards[shard].size
        return True

    def _from_origin(self, shard: int, fd: int) -> None:
        path = os.path.join(self.pack_dir, self.manifest.shards[shard].name)
        size = self.manifest.shards[shard].size
        with open(path, "rb", buffering=0) as src:
            pos = 0
            while pos < size:
                chunk = src.read(min(_CHUNK, size - pos))
                if not chunk:
                    raise CorruptShardError(f"{path}: shorter than the manifest says; re-pack")
                self.stats.origin_reads += 1
                self.stats.origin_bytes += len(chunk)
                _write_all(fd, chunk)
                pos += len(chunk)

    def _pull_all(self, shards: list[int]) -> None:
        """Pull each shard from a holder that has it; round-robin over the pending ones so
        one slow primary does not hold up the rest."""
        pending = list(shards)
        first_try = {s: time.monotonic() for s in pending}
        pause = 0.05
        while pending and not self.stop.is_set():
            progress = False
            for s in list(pending):
                if self.stop.is_set():
                    return
                data = self._from_peers(s)
                late = time.monotonic() - first_try[s] > self.forward_timeout
                if data is None and not (late or self._no_live_source(s)):
                    continue
                if data is None:
                    self.stats.forward_fallbacks += 1
                    self._place(s, self._from_origin)
                else:
                    self._place(s, _writer(data))
                    self.stats.forwarded_shards += 1
                    self.stats.forwarded_bytes += len(data)
                pending.remove(s)
                progress = True
            if not progress:
                self.stop.wait(pause)
                pause = min(pause * 1.5, 1.0)
            else:
                pause = 0.05

    def _sources(self, shard: int) -> list[int]:
        return [n for n in self.holders[shard] if n != self.rank and n in self.peers]

    def _no_live_source(self, shard: int) -> bool:
        return all(self.peers[n].is_down() for n in self._sources(shard))

    def _from_peers(self, shard: int) -> bytes | None:
        size = self.manifest.shards[shard].size
        for n in self._sources(shard):
            client = self.peers[n]
            if client.is_down():
                continue
            try:
                data = client.read([(shard, 0, size)])[0]
            except SourceUnavailable:
                self.stats.peers_unreachable += 1
                continue
            if data is None:
                continue
            if not _header_ok(data, shard, self.manifest):
                self.stats.checksum_failures += 1
                continue
            return data
        return None


def _header_ok(data: bytes, shard: int, m: Manifest) -> bool:
    try:
        ShardHeader.decode(data[: SHARD_HEADER.size], "peer").check(
            "peer", index=shard, pack_id=m.pack_id, file_size=len(data))
    except FormatError:
        return False
    return len(data) == m.shards[shard].size


def _writer(data: bytes) -> Callable[[int, int], None]:
    def fill(shard: int, fd: int) -> None:
        _write_all(fd, data)

    return fill


def _write_all(fd: int, data: bytes | memoryview) -> None:
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]
