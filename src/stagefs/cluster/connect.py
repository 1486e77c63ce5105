"""``stagefs.connect()``: the whole distributed dataset as a Store, in any training process.

It reads this node's runtime directory (``$STAGEFS_RUNTIME`` or the job's default), loads
the cluster map and the token, recomputes the placement (pure, the same as the daemons'),
and builds a Store whose holders for a shard are: this node's tier copy, then the peers
holding it (one hedged holder over its replicas, in placement order), then the origin. No MPI here: it works in forked and spawned
DataLoader workers (a pickled store re-connects in the child; a forked one opens new
connections there). A peer that is down, slow or wrong is skipped and counted; the caller
gets correct bytes or the Store's own errors, never a network exception.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterable, Sequence
from typing import Any

from stagefs.cluster.cmap import ClusterMap, load_runtime
from stagefs.cluster.placement import place
from stagefs.cluster.world import runtime_default
from stagefs.config import env
from stagefs.errors import ClusterError
from stagefs.format import KIND_FILE, MANIFEST_NAME, Manifest, checksum
from stagefs.format.codecs import decode
from stagefs.namespace import PathArg
from stagefs.net.client import PeerClient, PeerSource
from stagefs.net.hedge import HedgedPeers, ReplyTimes
from stagefs.store import Store
from stagefs.tiers.base import ShardSource, SourceUnavailable, pread_full

__all__ = ["ClusterStore", "LocalTierSource", "connect"]


class LocalTierSource:
    """This node's tier copies of the shards placed here, read with pread (no daemon hop)."""

    name = "local tier"
    local = True  # Store.read_many reads it in the calling thread

    def __init__(self, tiers: Sequence[str], pack_hex: str, manifest: Manifest) -> None:
        self.dirs = [os.path.join(t, pack_hex) for t in tiers]
        self.manifest = manifest
        self._fds: dict[int, int] = {}
        self._lock = threading.Lock()
        self.hits = 0

    def fd(self, shard: int) -> int | None:
        fd = self._fds.get(shard)
        if fd is not None:
            return fd
        name = self.manifest.shards[shard].name
        for d in self.dirs:
            try:
                fd = os.open(os.path.join(d, name), os.O_RDONLY | os.O_CLOEXEC)
            except OSError:
                continue
            with self._lock:
                old = self._fds.setdefault(shard, fd)
            if old != fd:
                os.close(fd)
            return old
        return None

    def pread(self, shard: int, offset: int, length: int) -> bytes:
        fd = self.fd(shard)
        if fd is None:
            raise SourceUnavailable(f"shard {shard} is not (yet) in this node's tiers")
        data = pread_full(fd, length, offset)
        if len(data) != length:
            raise SourceUnavailable(f"shard {shard}: short read from the tier copy")
        self.hits += 1
        return data

    def drop(self, shard: int) -> None:
        """A read found this copy corrupt: stop using it (the daemon re-stages on restart)."""
        with self._lock:
            fd = self._fds.pop(shard, None)
        if fd is not None:
            os.close(fd)

    def close(self) -> None:
        with self._lock:
            fds, self._fds = list(self._fds.values()), {}
        for fd in fds:
            os.close(fd)


class ClusterStore(Store):
    """A Store over the cluster. Same API as ``stagefs.open``'s; read_many batches the
    ranges held by each peer into one request to it."""

    def __init__(self, runtime: str, cmap: ClusterMap, token: bytes, *, verify: bool = True,
                 timeout: float = 10.0) -> None:
        manifest = Manifest(os.path.join(cmap.pack, MANIFEST_NAME))
        if manifest.pack_id.hex() != cmap.pack_id:
            manifest.close()
            raise ClusterError(f"{cmap.pack}: the pack changed since the daemons started "
                               "(pack id differs); restart them")
        self.runtime = runtime
        self.cmap = cmap
        self.rank = cmap.rank
        self.placement = place(len(manifest.shards), cmap.size, cmap.replicas,
                               everywhere=cmap.everywhere, seed=cmap.seed)
        self.local = LocalTierSource([t for t, _ in cmap.tiers], cmap.pack_id, manifest)
        self.clients = {n: PeerClient(h, p, token, pack_id=manifest.pack_id, timeout=timeout,
                                      connect_timeout=min(3.0, timeout), name=f"node {n}")
                        for n, (h, p) in enumerate(cmap.nodes) if n != cmap.rank}
        self.peer_sources = {n: PeerSource(c, f"node {n}") for n, c in self.clients.items()}
        self.reply_times = ReplyTimes()  # of every peer: the hedging delay
        self._hedged: dict[tuple[int, ...], HedgedPeers] = {}
        self._verify_arg = verify
        self._timeout = timeout
        super().__init__(cmap.pack, verify=verify, manifest=manifest, sources=self._holders_of)
        self._holder_lists = [self._holder_list(s) for s in range(len(manifest.shards))]

    def _holders_of(self, shard: int) -> list[ShardSource]:
        return self._holder_lists[shard]

    def _holder_list(self, shard: int) -> list[ShardSource]:
        out: list[ShardSource] = []
        placed = self.placement.holders[shard]
        if self.rank in placed:
            out.append(self.local)
        peers = tuple(n for n in placed if n != self.rank)
        if peers:
            if peers not in self._hedged:
                self._hedged[peers] = HedgedPeers([self.peer_sources[n] for n in peers],
                                                  self.reply_times)
            out.append(self._hedged[peers])
        out.append(self.origin)
        return out

    # -- batched reads -----------------------------------------------------------------------

    def read_many(self, paths: Iterable[PathArg]) -> list[bytes]:
        plist = list(paths)
        m, ns = self.manifest, self.namespace
        ents = [ns.file_entry(p) for p in plist]
        out: list[bytes | None] = [None] * len(ents)
        by_peer: dict[int, list[int]] = {}
        rest: list[int] = []
        for i, e in enumerate(ents):
            shard = m.shard[e]
            if m.kind[e] != KIND_FILE or m.size[e] == 0 or (
                    self.rank in self.placement.holders[shard]
                    and self.local.fd(shard) is not None):
                rest.append(i)
                continue
            peer = next((n for n in self.placement.holders[shard]
                         if n != self.rank and not self.clients[n].is_down()), None)
            (rest if peer is None else by_peer.setdefault(peer, [])).append(i)
        for peer, idx in by_peer.items():
            self._read_peer(peer, idx, ents, out)
        rest += [i for idxs in by_peer.values() for i in idxs if out[i] is None]
        if rest:
            for i, data in zip(rest, super().read_many([plist[i] for i in rest]), strict=True):
                out[i] = data
        return [b"" if d is None else d for d in out]

    def _read_peer(self, peer: int, idx: list[int], ents: list[int],
                   out: list[bytes | None]) -> None:
        m = self.manifest
        ranges = [(m.shard[ents[i]], m.offset[ents[i]], m.stored[ents[i]]) for i in idx]
        try:
            got = self.clients[peer].read(ranges)
        except SourceUnavailable:
            self.stats.unavailable += 1
            return
        for i, data in zip(idx, got, strict=True):
            if data is None:
                continue
            e = ents[i]
            if m.codec[e]:
                try:
                    data = decode(m.codec[e], data, m.size[e], self._where(e))
                except ValueError:
                    self.stats.checksum_failures += 1
                    continue
            if self.verify and checksum(data) != m.checksum[e]:
                self.stats.checksum_failures += 1
                continue
            out[i] = data
            self.stats.reads += 1
            self.stats.bytes += m.size[e]

    # -- the agreed Store extensions --------------------------------------------------------

    def held_shards(self) -> set[int]:
        """The shards placed on this node (its daemon stages them)."""
        return set(self.placement.shards_of(self.rank))

    def prefetch(self, shards: Iterable[int]) -> None:
        """Staging is the daemons' job in cluster mode: nothing to do here."""

    def status(self) -> dict[str, Any]:
        return {
            "mode": "cluster", "runtime": self.runtime, "rank": self.rank,
            "nodes": self.cmap.size, "pack": self.pack_dir, "staged": self.cmap.staged,
            "reads": self.stats.reads, "bytes": self.stats.bytes,
            "checksum_failures": self.stats.checksum_failures,
            "unavailable": self.stats.unavailable, "local_hits": self.local.hits,
            "origin": self.origin.stats.as_dict(),
            "peers": {n: c.stats.as_dict() for n, c in self.clients.items()},
        }

    def close(self) -> None:
        for c in self.clients.values():
            c.close()
        self.local.close()
        super().close()

    def __reduce__(self) -> tuple[Any, ...]:
        # a copy in another process (a spawned DataLoader worker) connects again there
        return (_reconnect, (self.runtime, self._verify_arg))

    def __repr__(self) -> str:
        return (f"<stagefs.ClusterStore {self.pack_dir!r} node {self.rank} of "
                f"{self.cmap.size}>")


def connect(runtime: str | os.PathLike[str] | None = None, *, verify: bool = True,
            timeout: float | None = None) -> ClusterStore:
    """The dataset served by this node's stagefs daemon and its peers, as a Store.

    ``runtime`` defaults to ``$STAGEFS_RUNTIME``, else the job's default runtime directory.
    If the daemon has not written it yet, wait up to ``timeout`` seconds (default
    ``$STAGEFS_CONNECT_TIMEOUT`` or 0) for it, then raise ClusterError saying what to do.
    """
    path = os.path.abspath(os.fspath(runtime)) if runtime is not None else runtime_default()
    wait = timeout if timeout is not None else float(env("CONNECT_TIMEOUT", "0") or 0)
    deadline = time.monotonic() + wait
    while True:
        try:
            cmap, token = load_runtime(path)
            break
        except ClusterError:
            if time.monotonic() >= deadline:
                raise
            time.sleep(0.2)
    peer_timeout = float(env("PEER_TIMEOUT", "10") or 10)
    return ClusterStore(path, cmap, token, verify=verify, timeout=peer_timeout)


def _reconnect(runtime: str, verify: bool) -> ClusterStore:
    return connect(runtime, verify=verify, timeout=30.0)
