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
daemon does not answer (killed, restarting), the holders are the direct ones above again;
once it answers, the connections they opened to peers are closed (``PeerClient.shed``).
Daemons started again (``mpiexec`` again: a new job token, new ports) are found by the map
they write (looked at once a second as reads go): the process reads through them from then
on (``ClusterHolders._renew_if_restarted``).

This node's tier copies are its daemon's (their room, their placement): one a read finds
bad is not deleted here but reported to the daemon (CHECK), which checks it, deletes it and
places it again; this process does not read that copy meanwhile (``_dropped_here``).

A process that connects holds a lease on the runtime directory until its store closes, as
``stagefs.open``'s readers do (runtime.py): ``stagefs clean`` names it, and a daemon stopping
with ``--clean-on-exit`` keeps the tier data this process reads.

A process keeps a descriptor open for each shard of this node it reads (two for a memory
tier's, mapped by ``read_many``): ``connect`` raises its soft open-file limit to the hard
one, as the single-node tier chain does, and says so when even that cannot hold them.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import random
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, replace
from typing import Any

from stagefs._fsutil import raise_fd_limit
from stagefs.cluster.cmap import MAP_NAME, ClusterMap, check_runtime_access, load_runtime
from stagefs.cluster.fabric import FabricHolder
from stagefs.cluster.placement import SPARE, place
from stagefs.cluster.world import runtime_default
from stagefs.config import TierSpec, env_flag, env_number
from stagefs.errors import ClusterError, StagefsError
from stagefs.format import MANIFEST_NAME, Manifest
from stagefs.net.client import PeerClient, PeerSource
from stagefs.net.hedge import HedgedPeer, HedgePolicy, ReplyTimes
from stagefs.runtime import Runtime
from stagefs.store import ReadStats, Store
from stagefs.tiers.base import ShardSource, SourceUnavailable
from stagefs.tiers.chain import NodePieces
from stagefs.tiers.origin import PackOrigin
from stagefs.tiers.tier import DirTier, check_fd_limit

__all__ = ["ClusterHolders", "connect"]

log = logging.getLogger("stagefs.connect")
_Copy = tuple[int, int, int]  # a tier copy's (device, inode, ctime): which file it was
RENEW_EVERY = 1.0  # seconds between two looks at the runtime's map (a stat) as reads go


class ClusterHolders:
    """Who holds each shard in cluster mode, and the Store's cluster-wide answers
    (``held_shards``, ``status``, how a pickled copy opens again)."""

    # a daemon serves a range of a shard it holds in part (its partial copies) only where
    # it holds all of the range: the Store reads a large file by its pieces (store.py)
    holds_pieces = True

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
        self._token, self._timeout = token, timeout
        self._pack_id = manifest.pack_id
        self._daemons = _daemons_of(cmap, token)  # which daemons this process reads through
        self._map_seen = _map_seen(runtime)  # which map file they were read from
        self.clients = clients if clients is not None else self._peer_clients(cmap, token)
        # one holder per peer (Store.read_many sends each peer one batch), whose slow reads
        # go to another replica of the shard too (net/hedge.py)
        policy = hedge or HedgePolicy()
        self.reply_times = ReplyTimes(policy)
        # a batch takes longer than one read: until its replies are timed, wait the cap
        self.batch_times = ReplyTimes(replace(policy, initial=policy.cap))
        self.peers = self._hedged(self.clients)
        # each shard's ranking (placement.py): its K holders, then the SPARE nodes that
        # take over when holders die; as peers (this node left out), built once per ranking
        self.rng = random.Random()  # the power of two choices (a test seeds it)
        self._ranked_nodes: list[tuple[int, ...]] = [
            tuple(self.placement.live(shard, (), SPARE)) for shard in range(len(manifest.shards))]
        self._ranked, self._static_after = self._rank(self.peers)
        self._mine = set(self.placement.shards_of(self.rank))
        self.holders = self._holders_of
        self._direct = False  # read peers directly since the daemon last answered
        # this node's tier copies a read found bad: (tier, shard) -> which file it was;
        # not read again here until the daemon has replaced it (``_dropped_here``)
        self._bad: dict[tuple[int, int], _Copy] = {}
        self._daemon_tcp: PeerClient | None = None  # to report them without the fabric
        # the pieces of this node's partial copies, which the daemon serves: read here
        # when this process reads the peers directly (``_holders_of``)
        self.pieces: NodePieces | None = None
        if clients is None:  # a reader (a daemon's own holders read no tier)
            for i, t in enumerate(self.tiers):
                t.on_drop = functools.partial(self._dropped_here, i)
            self.pieces = NodePieces(manifest, self.tiers)
        self.fabric: FabricHolder | None = None  # the node daemon (cluster/fabric.py)
        if clients is None:
            self.fabric = self._fabric_of(cmap, token)
            if self.fabric is not None:
                self.holders = self._via_fabric
        # the daemons started again (a new job token, new ports: mpiexec again): the map
        # they write is looked at once a RENEW_EVERY as reads go (_renew_if_restarted)
        self._renewable = clients is None  # (a daemon's own holders: its peers are its own)
        self._looked_at = float("-inf")
        self._renewing = 0  # the pid of the process renewing now, if any
        self.clock: Callable[[], float] = time.monotonic

    def _peer_clients(self, cmap: ClusterMap, token: bytes) -> dict[int, PeerClient]:
        """A client for each peer of ``cmap`` (this node left out), proving ``token``."""
        timeout = self._timeout
        clients = {n: PeerClient(h, p, token, pack_id=self._pack_id, timeout=timeout,
                                 connect_timeout=min(3.0, timeout), name=f"node {n}")
                   for n, (h, p) in enumerate(cmap.nodes) if n != cmap.rank}
        for c in clients.values():
            c.explains_refusal = self._restarted
        return clients

    def _hedged(self, clients: dict[int, PeerClient]) -> dict[int, HedgedPeer]:
        return {n: HedgedPeer(PeerSource(c, f"node {n}"), self._replicas,
                              self.reply_times, self.batch_times)
                for n, c in clients.items()}

    def _rank(self, peers: dict[int, HedgedPeer]) -> tuple[
            list[tuple[HedgedPeer, ...]], dict[tuple[int, ...], list[ShardSource]]]:
        """Each shard's ranking as peers (this node left out; one tuple per ranking), and
        each ranking's holders after this node's copy (those peers, then the origin)."""
        sets: dict[tuple[int, ...], tuple[HedgedPeer, ...]] = {}
        after: dict[tuple[int, ...], list[ShardSource]] = {}
        ranked: list[tuple[HedgedPeer, ...]] = []
        for nodes in self._ranked_nodes:
            got = sets.get(nodes)
            if got is None:
                got = sets[nodes] = tuple(peers[n] for n in nodes if n != self.rank)
                after[nodes] = [*got, self.origin]
            ranked.append(got)
        return ranked, after

    def _fabric_of(self, cmap: ClusterMap, token: bytes) -> FabricHolder | None:
        """The node daemon of ``cmap`` as a holder, if it listens on a Unix socket (and
        STAGEFS_FABRIC is not 0)."""
        name = cmap.extra.get("fabric")
        if not name or not env_flag("FABRIC"):
            return None
        client = PeerClient(
            "", 0, token, unix=os.path.join(self.runtime, str(name)), pack_id=self._pack_id,
            timeout=self._timeout, connect_timeout=min(1.0, self._timeout), pool_size=2,
            name=f"node {cmap.rank} daemon")
        client.explains_refusal = self._restarted
        return FabricHolder(client, self._peers_of)

    def _via_fabric(self, shard: int) -> Sequence[ShardSource]:
        """This node's tier copies, then the node daemon, then the origin; the direct
        holders while the daemon does not answer. Back on the daemon, the connections the
        direct reads opened to peers are closed: the fabric's bound (connections grow
        with nodes, not readers) holds again."""
        fabric = self.fabric
        assert fabric is not None
        if fabric.is_down():
            self._direct = True
            if self._renew_if_restarted():
                return self._via_fabric(shard)  # the restarted daemon, as any read
            return self._holders_of(shard)
        if self._direct:
            self._leave_peers()
            self._renew_if_restarted(at_once=True)  # back: the same daemon, or another?
        here = self._here(shard) if self.rank in self._ranked_nodes[shard] else []
        return [*here, self.fabric or fabric, self.origin]  # (the new daemon's, if _here saw it)

    def _peers_of(self, shard: int) -> Sequence[ShardSource]:
        """The shard's peers, for a read the daemon did not answer (cluster/fabric.py)."""
        self._direct = True
        return [h for h in self._holders_of(shard)
                if h is not self.origin and not getattr(h, "local", False)]

    # -- the daemons restarted ----------------------------------------------------------------

    def _renew_if_restarted(self, *, at_once: bool = False) -> bool:
        """If this node's runtime directory now holds the map of other daemons (started
        again: another pid, job token or addresses, as ``mpiexec`` gives them each time),
        read through them from now on, and let go of the tier copies they deleted. Looked
        at (a stat of the map, read only when it changed) at most once a ``RENEW_EVERY``
        (``clock``) as reads go (``at_once``: now, this node's daemon answers again after it
        did not); the clients made again once per restart. True if they were. (A reader
        that outlived an MPI restart was refused by every daemon for its life, with the old
        token, and read what its node's tiers did not hold from the origin; one that
        outlived a restart on emptied tiers held their old copies open, deleted.)"""
        if not self._renewable:
            return False
        now = self.clock()
        if now - self._looked_at < RENEW_EVERY and not at_once:
            return False
        pid = os.getpid()  # (two threads at once: one reads the map; no lock to fork, and a
        if self._renewing == pid:  # worker forked while its parent renewed renews too)
            return False
        self._looked_at = now
        self._renewing = pid
        try:
            return self._renew()
        finally:
            self._renewing = 0

    def _restarted(self) -> bool:
        """Does this node's runtime directory name other daemons than those this process
        reads through (they were started again: a refusal of the old token is no
        misconfiguration; ``_renew_if_restarted`` takes the new ones)?"""
        try:
            cmap, token = load_runtime(self.runtime)
        except (StagefsError, OSError):
            return False
        return _daemons_of(cmap, token) != self._daemons

    def _renew(self) -> bool:
        seen = _map_seen(self.runtime)
        if seen is None or seen == self._map_seen:  # between two daemons, or as it was
            return False
        try:
            cmap, token = load_runtime(self.runtime)
        except (StagefsError, OSError):  # between two daemons: no map yet
            return False
        self._map_seen = seen
        daemons = _daemons_of(cmap, token)
        if daemons == self._daemons:
            return False
        self._daemons = daemons
        for t in self.tiers:  # copies the daemons deleted meanwhile (tiers emptied)
            t.forget_gone()
        if self.pieces is not None:
            self.pieces.forget_gone()
        old = self.cmap
        if (cmap.pack_id, cmap.rank, cmap.size, cmap.replicas, cmap.seed, cmap.everywhere,
                cmap.tiers) != (old.pack_id, old.rank, old.size, old.replicas, old.seed,
                                old.everywhere, old.tiers):
            log.warning(
                "the daemons of %s were started again on other terms (pack, nodes, "
                "replicas, seed, --replicate-all or tiers differ): this process goes on with "
                "the cluster it connected to, whose daemons are gone, and reads from the "
                "origin what this node's tiers do not hold; connect again (start the "
                "training again) to read through the new daemons", self.runtime)
            return False
        clients = self._peer_clients(cmap, token)
        for n, c in clients.items():  # (the counts of the process's reads go on)
            c.stats = self.clients[n].stats
        peers = self._hedged(clients)
        ranked, after = self._rank(peers)
        fabric = self._fabric_of(cmap, token) if self.fabric is not None else None
        if fabric is not None and self.fabric is not None:
            fabric.client.stats = self.fabric.client.stats
        gone: list[PeerClient] = [*self.clients.values()]
        gone += [x.client for x in (self.fabric,) if x is not None and fabric is not None]
        gone += [self._daemon_tcp] if self._daemon_tcp is not None else []
        # the peers before the rankings that name them (a read in another thread meanwhile
        # reads through the old ones or the new ones, never a mix it cannot use)
        self.clients, self.peers = clients, peers
        self._ranked, self._static_after = ranked, after
        if fabric is not None:
            self.fabric = fabric
        self._daemon_tcp = None
        self._token, self.cmap = token, cmap
        for c in gone:  # (what a read in flight on them has: the next holder answers it)
            c.interrupt()
            c.close()
        log.info("the daemons of %s were started again (this node's: pid %d, was %d): "
                 "this process reads through them", self.runtime, cmap.pid, old.pid)
        return True

    def _leave_peers(self) -> None:
        """The daemon answers again: close the connections to peers that reads opened
        while it did not (each in use now as it comes back). (Two threads may both shed:
        no harm, and no lock for a forked worker to inherit held.)"""
        self._direct = False
        for c in self.clients.values():
            c.shed()

    # -- this node's tier copies -----------------------------------------------------------

    def _here(self, shard: int) -> list[ShardSource]:
        """This node's tier copies of ``shard`` that this process may read (opened, and
        kept open, by ``DirTier.holds``)."""
        self._renew_if_restarted()  # (copies the daemons deleted are let go of)
        if not self._bad:
            return [t for t in self.tiers if t.holds(shard)]
        return [t for i, t in enumerate(self.tiers) if self._readable(i, shard)
                and t.holds(shard)]

    def _readable(self, tier: int, shard: int) -> bool:
        """Not the copy a read found bad (still there: the daemon has not replaced it)."""
        bad = self._bad.get((tier, shard))
        if bad is None:
            return True
        if _copy_of(self.tiers[tier].path(shard)) == bad:
            return False
        self._bad.pop((tier, shard), None)  # deleted, or replaced: read what is there
        return True

    def _dropped_here(self, tier: int, shard: int, ino: tuple[int, int] | None) -> None:
        """A read found bad bytes in this node's copy of ``shard`` in ``tier`` (the copy's
        inode ``ino``, when known). The copy is the daemon's: it is asked to check it
        (CHECK), which deletes it, frees its room and places it again (deleted here, it
        stayed missing: the daemon never knew); this process reads it no more."""
        copy = _copy_of(self.tiers[tier].path(shard))
        if copy is None or (ino is not None and copy[:2] != ino):
            return  # gone already, or replaced by another copy
        self._bad[(tier, shard)] = copy
        log.info("%s: shard %d: this node's copy is bad; its daemon is asked to check it "
                 "and place it again", self.tiers[tier].name, shard)
        if self.fabric is not None and not self.fabric.is_down():
            try:  # at once: the read goes on to the daemon, which must not serve this copy
                self.fabric.check(shard)
                return
            except SourceUnavailable:
                pass
        if self._daemon_tcp is None:  # no fabric (STAGEFS_FABRIC=0), or it does not answer
            host, port = self.cmap.nodes[self.rank]
            self._daemon_tcp = PeerClient(
                host, port, self._token, pack_id=bytes.fromhex(self.cmap.pack_id),
                timeout=self._timeout, connect_timeout=min(3.0, self._timeout),
                pool_size=1, name=f"node {self.rank} daemon (TCP)")
        self._daemon_tcp.report_bad(shard)  # (in a thread of its own)

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
            here = self._here(shard)
            if here:
                return here + self._static_after[nodes]
        out: list[ShardSource] = [*self.remote(shard), self.origin]
        if self.rank in nodes:
            # a copy this node made when a holder died (whatever this reader knows of the
            # dead: one open() when there is none), and the pieces of its partial copies:
            # of its own shards its tiers had room for in part, of the shards it is a spare
            # of that the overflow placed (the daemon serves them through the fabric; read
            # past it, they were read from the origin)
            here = self._here(shard) if shard not in self._mine else []
            if not here and self.pieces is not None:
                here = self.pieces.sources(shard)
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
        peers = self.peers
        for n in self._ranked_nodes[shard]:
            if n == self.rank:
                live += 1
                continue
            peer = peers[n]
            if peer.is_down():
                down.append(peer)
            elif live < k:
                first.append(peer)
                live += 1
            else:
                after.append(peer)
        if down and self._renew_if_restarted():
            return self.remote(shard)  # the restarted daemons, as any read
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
        """The shards this node's processes read from its own tiers: those placed on it
        (its daemon stages them), and the copies it made of a dead node's shards, which
        ``_holders_of`` reads here too. Without those, a Sampler with locality dealt a
        dead node's samples out at random after re-replication, and its local_fraction
        said less than the reads served here. Once the cluster has staged, only the
        copies its tiers hold: the shards placed on a node whose tiers had no room for
        them (a small tier, a tier of 0 bytes) are read from peers, and were counted as
        its own (its ranks were dealt them, and local_fraction said they read locally)."""
        held: set[int] = set()
        for t in self.tiers:
            held |= {s for s in t.held() if self.rank in self._ranked_nodes[s]}
        return held if self._staged() else held | self._mine

    def _staged(self) -> bool:
        """Has the cluster staged (the map says so)? Read again from the runtime directory
        until it does: a reader may connect before (a daemon without ``--wait``)."""
        if not self.cmap.staged:
            try:
                now = load_runtime(self.runtime)[0]
            except (StagefsError, OSError):  # restarting: as it was
                return False
            if now.staged:
                self.cmap = replace(self.cmap, staged=True)
        return self.cmap.staged

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
        # a copy in another process (a spawned DataLoader worker) connects again there;
        # with this process's map (not its token), which it reads by while the daemons are
        # between two starts
        return _reconnect, (self.runtime, self.verify, self.cmap.to_json())

    def close(self) -> None:
        if self.pieces is not None:
            self.pieces.close()
        if self.fabric is not None:
            self.fabric.close()
        if self._daemon_tcp is not None:
            self._daemon_tcp.close()
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
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, int | float)
                                or math.isnan(timeout) or timeout < 0):
        # (nan waited for ever: no clock is ever past it; a string failed deep inside)
        raise ValueError(f"connect(timeout=...) is the seconds to wait for the daemon's map, "
                         f"0 or more (None: $STAGEFS_CONNECT_TIMEOUT or 0), not {timeout!r}")
    path = os.path.abspath(os.fspath(runtime)) if runtime is not None else runtime_default()
    wait = timeout if timeout is not None else env_number("CONNECT_TIMEOUT", 0)
    deadline = time.monotonic() + wait
    check_runtime_access(path)  # another user's: no map to wait for
    while True:
        try:
            cmap, token = load_runtime(path)
            # the map of a daemon killed before the pack was made again, its daemon
            # restarted on the new pack and about to write its own: waited for too
            manifest = _manifest_of(cmap, path)
            break
        except ClusterError:
            if time.monotonic() >= deadline:
                raise
            time.sleep(0.2)
    return _leased(path, cmap, token, manifest, verify)


def _leased(path: str, cmap: ClusterMap, token: bytes, manifest: Manifest,
            verify: bool) -> Store:
    # a lease on the daemon's runtime, as stagefs.open's readers take: `stagefs clean` and
    # the daemon's --clean-on-exit keep the tier data while this process reads it
    try:
        rt = Runtime(path).open()
    except BaseException:
        manifest.close()
        raise
    try:
        return _connect(rt, cmap, token, manifest, verify)
    except BaseException:
        rt.unregister()
        raise


def _manifest_of(cmap: ClusterMap, runtime: str) -> Manifest:
    """The pack's manifest, if it is the pack the map's daemon serves; else ClusterError."""
    manifest = Manifest(os.path.join(cmap.pack, MANIFEST_NAME))
    if manifest.pack_id.hex() != cmap.pack_id:
        got = manifest.pack_id.hex()
        manifest.close()
        raise ClusterError(
            f"{cmap.pack}: the pack was made again since this node's daemon (pid "
            f"{cmap.pid}) started: its map ({os.path.join(runtime, MAP_NAME)}) names pack "
            f"{cmap.pack_id}, the pack is {got}; restart the daemons on it (a reader waits "
            "for their new map up to connect(timeout=...) or $STAGEFS_CONNECT_TIMEOUT "
            "seconds)")
    return manifest


def _connect(rt: Runtime, cmap: ClusterMap, token: bytes, manifest: Manifest,
             verify: bool) -> Store:
    peer_timeout = env_number("PEER_TIMEOUT", 10, above=True)
    try:
        origin = PackOrigin(cmap.pack, manifest, check_headers=not verify)
        holders = ClusterHolders(rt.path, cmap, token, manifest, origin, verify=verify,
                                 timeout=peer_timeout)
    except BaseException:
        manifest.close()
        raise
    raise_fd_limit()  # a descriptor per shard of this node read (as the tier chain does)
    check_fd_limit(len(holders.held_shards()), any(t.kind == "memory" for t in holders.tiers),
                   "this node's")
    # reads counted by holder in the runtime's stats; the store's close ends the lease
    store = Store(cmap.pack, verify=verify, manifest=manifest, origin=origin, policy=holders,
                  runtime=rt)
    holders.read_stats = store.stats
    return store


def _reconnect(runtime: str, verify: bool, sent_map: str | None = None) -> Store:
    """A store sent to another process (a spawned DataLoader worker), connected there. With
    no map in the runtime directory (the daemons between two starts: a restart under live
    readers), the sender's: it reads as the sender does (this node's tiers, the origin)
    until their map is there (``ClusterHolders._renew_if_restarted``). It waited 30 s for
    the map, then raised ClusterError: the training stopped."""
    if sent_map is not None and not os.path.exists(os.path.join(runtime, MAP_NAME)):
        check_runtime_access(runtime)
        cmap = ClusterMap.from_json(sent_map, "the cluster map of the process that sent "
                                    "this store")
        return _leased(runtime, cmap, b"", _manifest_of(cmap, runtime), verify)
    return connect(runtime, verify=verify, timeout=30.0)


def _daemons_of(cmap: ClusterMap, token: bytes) -> tuple[object, ...]:
    """Which daemons a map names: this node's pid, every node's address, the job token
    (one of them differs after a restart)."""
    return cmap.pid, tuple(cmap.nodes), token


def _map_seen(runtime: str) -> tuple[int, int, int] | None:
    """Which map file the runtime directory holds now (None: none): a daemon writes its
    own anew (renamed into place) as it starts, and when its node has staged."""
    try:
        st = os.stat(os.path.join(runtime, MAP_NAME))
    except OSError:
        return None
    return st.st_ino, st.st_mtime_ns, st.st_size


def _copy_of(path: str) -> _Copy | None:
    """Which file is at ``path`` now (None: none): a copy replaced by another (renamed into
    place) differs, even if its inode number was reused."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino, st.st_ctime_ns

