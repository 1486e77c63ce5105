"""``stagefs.connect()``: the whole distributed dataset as a Store, in any training process.

It reads this node's runtime directory (``$STAGEFS_RUNTIME`` or the job's default), loads
the cluster map and the token, recomputes the placement (pure, the same as the daemons'),
and builds a plain Store whose holders for a shard (``ClusterHolders``) are: this node's
tier copy (read with the single-node tier reader, ``DirTier``: pread, no daemon hop), then
one holder per peer of the shard's ranking: its live holders, the less busy of two first,
then the nodes that take over from dead ones (``ClusterHolders._holders_of``; each peer a
``HedgedPeer``, net/hedge.py: a read a peer has not answered within the hedging delay goes
to another replica too), then the origin. The Store reads and verifies; ``read_many`` sends each peer the ranges it is asked
for in one batched request (the peer's ``pread_many``). No MPI here: it works in forked and
spawned DataLoader workers (a pickled store connects again in the child; a forked one opens
new connections there). A peer that is down, slow or wrong is skipped and counted; the
caller gets correct bytes or the Store's own errors, never a network exception.

The node fabric: when the node's daemon listens on its Unix socket (``fabric.sock`` in the
runtime directory), every read that is not a local tier hit goes to it instead (one holder,
``fabric``, between the tier copies and the origin), so the process opens no connection to
any peer: the daemon relays to its peers and verifies nothing; the Store verifies. While the
daemon does not answer (killed, restarting), the holders are the direct ones above again.
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, replace
from typing import Any

from stagefs.cluster.cmap import ClusterMap, load_runtime
from stagefs.cluster.fabric import FabricHolder
from stagefs.cluster.placement import SPARE, place
from stagefs.cluster.world import runtime_default
from stagefs.config import TierSpec, env, env_flag
from stagefs.errors import ClusterError
from stagefs.format import MANIFEST_NAME, Manifest
from stagefs.net.client import PeerClient, PeerSource
from stagefs.net.hedge import HedgedPeer, HedgePolicy, ReplyTimes
from stagefs.store import ReadStats, Store
from stagefs.tiers.base import ShardSource
from stagefs.tiers.origin import PackOrigin
from stagefs.tiers.tier import DirTier

__all__ = ["ClusterHolders", "connect"]


class ClusterHolders:
    """Who holds each shard in cluster mode, and the Store's cluster-wide answers
    (``held_shards``, ``status``, how a pickled copy opens again)."""

    def __init__(self, runtime: str, cmap: ClusterMap, token: bytes, manifest: Manifest,
                 origin: PackOrigin, *, verify: bool, timeout: float,
                 clients: dict[int, PeerClient] | None = None,
                 hedge: HedgePolicy | None = None) -> None:
        self.runtime = runtime
        self.cmap = cmap
        self.rank = cmap.rank
        self.origin = origin
        self.verify = verify
        self.read_stats = ReadStats()  # the Store's, once connect() made it
        self.placement = place(len(manifest.shards), cmap.size, cmap.replicas,
                               everywhere=cmap.everywhere, seed=cmap.seed)
        self.tiers = [DirTier(TierSpec(path, cap), manifest) for path, cap in cmap.tiers]
        self.clients = clients if clients is not None else {
            n: PeerClient(h, p, token, pack_id=manifest.pack_id, timeout=timeout,
                          connect_timeout=min(3.0, timeout), name=f"node {n}")
            for n, (h, p) in enumerate(cmap.nodes) if n != cmap.rank}
        # one holder per peer (Store.read_many sends each peer one batch), whose slow reads
        # go to another replica of the shard too (net/hedge.py)
        policy = hedge or HedgePolicy()
        self.reply_times = ReplyTimes(policy)
        # a batch takes longer than one read: until its replies are timed, wait the cap
        self.batch_times = ReplyTimes(replace(policy, initial=policy.cap))
        self.peers = {n: HedgedPeer(PeerSource(c, f"node {n}"), self._replicas,
                                    self.reply_times, self.batch_times)
                      for n, c in self.clients.items()}
        # each shard's ranking (placement.py): its K holders, then the SPARE nodes that
        # take over when holders die; as peers (this node left out), built once per ranking
        self.rng = random.Random()  # the power of two choices (a test seeds it)
        sets: dict[tuple[int, ...], tuple[HedgedPeer, ...]] = {}
        self._ranked: list[tuple[HedgedPeer, ...]] = []
        self._ranked_nodes: list[tuple[int, ...]] = []
        self._static_after: dict[tuple[int, ...], list[ShardSource]] = {}
        for shard in range(len(manifest.shards)):
            nodes = tuple(self.placement.live(shard, (), SPARE))
            got = sets.get(nodes)
            if got is None:
                got = sets[nodes] = tuple(self.peers[n] for n in nodes if n != self.rank)
                self._static_after[nodes] = [*got, origin]
            self._ranked.append(got)
            self._ranked_nodes.append(nodes)
        self._mine = set(self.placement.shards_of(self.rank))
        self.holders = self._holders_of
        self.fabric: FabricHolder | None = None  # the node daemon (cluster/fabric.py)
        name = cmap.extra.get("fabric")
        if clients is None and name and env_flag("FABRIC"):
            self.fabric = FabricHolder(PeerClient(
                "", 0, token, unix=os.path.join(runtime, str(name)), pack_id=manifest.pack_id,
                timeout=timeout, connect_timeout=min(1.0, timeout), pool_size=2,
                name=f"node {cmap.rank} daemon"), self._peers_of)
            self.holders = self._via_fabric

    def _via_fabric(self, shard: int) -> Sequence[ShardSource]:
        """This node's tier copies, then the node daemon, then the origin; the direct
        holders while the daemon does not answer."""
        hs = self._holders_of(shard)
        fabric = self.fabric
        if fabric is None or fabric.is_down():
            return hs
        local = 0
        while getattr(hs[local], "local", False):
            local += 1
        return [*hs[:local], fabric, self.origin]

    def _peers_of(self, shard: int) -> Sequence[ShardSource]:
        return [h for h in self._holders_of(shard)
                if h is not self.origin and not getattr(h, "local", False)]

    def _replicas(self, shard: int) -> Sequence[HedgedPeer]:
        """The peers of the shard's ranking, in order: where a hedge goes (HedgedPeer skips
        the suspect ones and the ones asked)."""
        return self._ranked[shard]

    def _holders_of(self, shard: int) -> Sequence[ShardSource]:
        """The shard's holders, in the order to ask them: this node's tier copy, the first K
        live nodes of the shard's ranking (the less busy of two first: the power of two
        choices on requests in flight), the nodes that take over after them (a node that
        has not copied the shard yet answers "not held" at once), the suspect peers last
        (never chosen first), then the origin. Store.read_many sends each range to the
        first of these that is not down (store.py ``_first_up``)."""
        nodes = self._ranked_nodes[shard]
        if shard in self._mine:
            # only a copy the tier holds now: read_many reads it in the calling thread
            here: list[ShardSource] = [t for t in self.tiers if t.holds(shard)]
            if here:
                return here + self._static_after[nodes]
        out: list[ShardSource] = [*self.remote(shard), self.origin]
        if self.rank in nodes and shard not in self._mine:
            # a copy this node made when a holder died (whatever this reader knows of the
            # dead: one open() when there is none)
            here = [t for t in self.tiers if t.holds(shard)]
            return here + out
        return out

    def remote(self, shard: int) -> list[HedgedPeer]:
        """The shard's holders on other nodes in the order to ask them (``_holders_of``
        without this node's copies and the origin): where the node daemon relays."""
        k = len(self.placement.holders[shard])  # K, or every node (--replicate-all)
        first: list[HedgedPeer] = []
        after: list[HedgedPeer] = []
        down: list[HedgedPeer] = []
        live = 0  # live nodes of the ranking seen so far, this node included
        for n in self._ranked_nodes[shard]:
            if n == self.rank:
                live += 1
                continue
            peer = self.peers[n]
            if peer.is_down():
                down.append(peer)
            elif live < k:
                first.append(peer)
                live += 1
            else:
                after.append(peer)
        if len(first) > 1:
            first = self._two_choices(first)
        return [*first, *after, *down]

    def _two_choices(self, first: list[HedgedPeer]) -> list[HedgedPeer]:
        """Two of the live holders drawn at random, the one with fewer requests in flight
        first, then the others in ranking order: reads of a shard spread over its holders,
        and away from a busy one."""
        i, j = self.rng.sample(range(len(first)), 2)
        a, b = first[i], first[j]
        if b.outstanding < a.outstanding:
            a, b = b, a
        return [a, b, *(p for p in first if p is not a and p is not b)]

    def held_shards(self) -> set[int]:
        """The shards placed on this node (its daemon stages them)."""
        return set(self._mine)

    def prefetch(self, shards: Iterable[int]) -> None:
        """Staging is the daemons' job in cluster mode: nothing to do here."""

    def status(self) -> dict[str, Any]:
        return {
            "mode": "cluster", "runtime": self.runtime, "rank": self.rank,
            "nodes": self.cmap.size, "pack": self.cmap.pack, "staged": self.cmap.staged,
            **asdict(self.read_stats),
            "local_hits": sum(t.stats.hits for t in self.tiers),
            "origin": self.origin.stats.as_dict(),
            "peers": {n: c.stats.as_dict() for n, c in self.clients.items()},
            "hedged": sum(p.hedged for p in self.peers.values()),
            "gave_up": sum(p.gave_up for p in self.peers.values()),
            "suspect_peers": sorted(n for n, c in self.clients.items() if c.is_suspect()),
            "fabric": None if self.fabric is None else {
                **self.fabric.client.stats.as_dict(),
                "suspect": self.fabric.client.is_suspect(),
                "patience": (self.fabric.client.patience or (None,))[0]},
        }

    def reopen(self) -> tuple[Callable[..., Store], tuple[Any, ...]]:
        # a copy in another process (a spawned DataLoader worker) connects again there
        return _reconnect, (self.runtime, self.verify)

    def close(self) -> None:
        if self.fabric is not None:
            self.fabric.close()
        for c in self.clients.values():
            c.close()
        for t in self.tiers:
            t.close()


def connect(runtime: str | os.PathLike[str] | None = None, *, verify: bool = True,
            timeout: float | None = None) -> Store:
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
    manifest = Manifest(os.path.join(cmap.pack, MANIFEST_NAME))
    if manifest.pack_id.hex() != cmap.pack_id:
        manifest.close()
        raise ClusterError(f"{cmap.pack}: the pack changed since the daemons started "
                           "(pack id differs); restart them")
    try:
        origin = PackOrigin(cmap.pack, manifest, check_headers=not verify)
        holders = ClusterHolders(path, cmap, token, manifest, origin, verify=verify,
                                 timeout=peer_timeout)
    except BaseException:
        manifest.close()
        raise
    stats = os.path.join(path, "stats")  # the daemon's runtime: reads counted by holder
    store = Store(cmap.pack, verify=verify, manifest=manifest, origin=origin, policy=holders,
                  counters=stats if os.path.isdir(stats) else None)
    holders.read_stats = store.stats
    return store


def _reconnect(runtime: str, verify: bool) -> Store:
    return connect(runtime, verify=verify, timeout=30.0)
