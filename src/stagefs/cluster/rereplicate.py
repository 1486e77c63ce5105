"""Re-replication: after a node dies, copy its shards again from the surviving replicas.

Each daemon probes its peers (``Health``: a peer is *dead* once its probes have failed for
``dead_after`` seconds, by an injected clock; one answer makes it live again). When the set
of dead nodes changes, each daemon works out, with no message to anyone, which shards it
must now hold (``plan``): a shard's live holders are the first K live nodes of its ranking
(placement.py ``Placement.live``), so the node after the dead one in each ranking takes the
shard over. It copies each from a live node that holds it: a surviving holder of the
placement, or a node ranked before it that took the shard over earlier (never one ranked
after it: two takers never wait for each other). Only a shard with no surviving replica is
read from the origin. The copy is the cluster stager's (staging.py), through the single-node
tier layer (``TierChain.place(source=peer)``): claimed, verified file by file, renamed into
place. Readers follow the same ranking (cluster/connect.py), so a reader that asks a taker
before it has copied gets a quick "not held" and goes on.

A node that reaches fewer than half of the nodes (itself included) is the one cut off, most
likely: it re-replicates nothing (``isolated`` in its status), so a partitioned node does
not read the whole dataset from the origin. When the partition heals, its probes answer,
its dead set empties, and it serves what it held: whole copies of this pack (the handshake
and each shard header carry the pack id; every byte is verified by the reader).

A peer that refuses this node's job token (or serves another pack) fails its probes as a
silent one does, and is dead after ``dead_after`` the same way: it cannot serve this node a
byte, so its shards need their K copies elsewhere, and the staged barrier must not wait for it
forever. But it is a misconfiguration, not a crash, and said as one: ``refused_token`` (and
``other_pack``) in the status, and the line that names the dead nodes says which of them
refused. (A node whose token is the odd one out is refused by every other: isolated, it
copies nothing.)

When the daemon stops (``stop``), the monitor interrupts every call blocked on the daemon's
peer clients (``PeerClient.interrupt``): the staged barrier's, a copy's. A hung peer held a
stopping daemon for a reply deadline (30 s) per call, past a batch system's grace period.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from stagefs.cluster.placement import Placement
from stagefs.cluster.staging import Stager
from stagefs.format import Manifest
from stagefs.net.client import PACK, TOKEN, PeerClient
from stagefs.tiers.chain import TierChain

__all__ = ["Health", "Rereplicator", "plan"]

log = logging.getLogger("stagefs.rereplicate")


class Health:
    """Which peers are dead, from the outcomes of their probes (pure: the clock is given).

    A peer is dead once its probes have failed for at least ``dead_after`` seconds (two
    failures at least: one failure after a pause of this process, SIGSTOP, is not enough)
    and live again at its first answer. A peer never heard from is given ``grace`` seconds
    from the start before it can be judged: the daemons of a large job start over a minute
    or more, and one that has not started yet is not dead."""

    def __init__(self, peers: Iterable[int], dead_after: float,
                 clock: Callable[[], float] = time.monotonic,
                 grace: float | None = None) -> None:
        self.dead_after = dead_after
        self.clock = clock
        self.grace = 4 * dead_after if grace is None else grace
        self.started = clock()
        self._failing: dict[int, tuple[float, int]] = {}  # peer -> (first failure, count)
        self._seen: set[int] = set()
        self.peers = set(peers)

    def record(self, peer: int, ok: bool, at: float | None = None) -> None:
        """A probe's outcome; ``at``: when it was sent (a probe that fails by timing out
        says so only its timeout later, and the peer was silent from when it was asked)."""
        if ok:
            self._seen.add(peer)
            self._failing.pop(peer, None)
            return
        first, count = self._failing.get(peer, (self.clock() if at is None else at, 0))
        self._failing[peer] = (first, count + 1)

    def failing(self) -> list[int]:
        return sorted(self._failing)

    def dead(self) -> frozenset[int]:
        now = self.clock()
        young = now - self.started < self.grace
        return frozenset(n for n, (first, count) in self._failing.items()
                         if count >= 2 and now - first >= self.dead_after
                         and not (young and n not in self._seen))


def plan(placement: Placement, rank: int, dead: Iterable[int]) -> dict[int, list[int]]:
    """The shards ``rank`` must copy now that ``dead`` are dead -> the nodes to copy each
    from, best first (empty: no replica survives, read the origin)."""
    gone = frozenset(dead)
    out: dict[int, list[int]] = {}
    if not gone or rank in gone:
        return out
    for s, h in enumerate(placement.holders):
        if rank in h or gone.isdisjoint(h):
            continue
        live = placement.live(s, gone)
        if rank not in live:
            continue
        mine = live.index(rank)
        out[s] = [n for i, n in enumerate(live) if n != rank and (n in h or i < mine)]
    return out


class Rereplicator:
    """The daemon's re-replication: probes peers every ``every`` seconds, and when the dead
    set changes, copies the shards it must now hold (``plan``) with a Stager of their own.
    ``status()`` is what ``stagefs status`` shows."""

    def __init__(self, manifest: Manifest, placement: Placement, rank: int, chain: TierChain,
                 peers: dict[int, PeerClient], probes: Mapping[int, Callable[[], bool]],
                 stop: threading.Event, *, dead_after: float, every: float = 0.5,
                 clock: Callable[[], float] = time.monotonic,
                 forward_timeout: float = 600.0, probes_per_round: int = 8,
                 grace: float | None = None) -> None:
        self.manifest = manifest
        self.placement = placement
        self.rank = rank
        self.chain = chain
        self.peers = peers
        self.probes = probes  # each peer's: True if it answered (on the daemon's relay
        # connection: a probe never waits on a data copy)
        self.stop = stop
        self.every = every
        self.forward_timeout = forward_timeout
        self.health = Health(probes, dead_after, clock, grace)
        self.probes_per_round = probes_per_round
        self._next = rank  # where this node's turn starts: the nodes spread their probes
        self._changed_at: float | None = None  # when the dead set changed, not acted on yet
        self._held: tuple[frozenset[int], float] | None = None  # the set now, and since when
        self.dead: frozenset[int] = frozenset()
        self.generation = 0  # changes of the dead set seen by this node
        # the shards this node holds for the dead now (the last ``plan``): a daemon's STATUS
        # counts them on this line, not among its own or the overflow's
        self.taken: frozenset[int] = frozenset()
        self.isolated = False
        self._round: tuple[Stager, threading.Event, threading.Thread] | None = None
        self._past = {"forwarded_bytes": 0, "origin_bytes": 0, "forwarded_shards": 0,
                      "origin_shards": 0}
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max(1, min(probes_per_round, len(probes))),
                                        thread_name_prefix="stagefs-probe")

    # -- probing -------------------------------------------------------------------------

    def _probe(self, n: int) -> bool:
        data = self.peers.get(n)
        if data is not None and data.clock() - data.answered_at < self.every:
            return True  # it answered a data request this round: no probe needed
        return self.probes[n]()

    def step(self) -> None:
        """One round: probe the peers that are failing (to confirm a death or clear it) and
        the next few others in turn, at most ``probes_per_round`` (at once), then act on a
        changed dead set. A round costs the same at 8 nodes as at 4,096: probing every peer
        every round made each daemon answer N probes a round, and 64 emulated daemons on
        two cores, starved, took each other for dead."""
        peers = sorted(self.probes)
        if not peers:
            return
        ask = self.health.failing()[: self.probes_per_round]
        room = self.probes_per_round - len(ask)
        turn = [peers[(self._next + i) % len(peers)] for i in range(min(room, len(peers)))]
        self._next = (self._next + len(turn)) % len(peers)
        ask += [n for n in turn if n not in ask]
        sent = self.health.clock()
        for n, ok in zip(ask, self._pool.map(self._probe, ask), strict=True):
            self.health.record(n, ok, at=sent)
        self.settle(self.health.dead())

    def settle(self, dead: frozenset[int]) -> None:
        """``update`` to ``dead`` once it has held for two rounds with no other peer failing
        but not dead yet, or ``dead_after`` after the dead set first changed. The peers a
        partition cuts off stop answering within a round or two of each other (one that
        answered a relayed read just before is probed a round later), and answer again
        the same way when it heals: judged one by one, a dead set of some of them would
        have this node, cut off, not see that it is (isolated: it copies nothing), and
        copy their shards from the origin."""
        now = self.health.clock()
        if dead == self.dead:
            self._changed_at = self._held = None
            return
        if self._changed_at is None:
            self._changed_at = now
        if self._held is None or self._held[0] != dead:
            self._held = (dead, now)
        settled = (now - self._held[1] >= 2 * self.every
                   and not set(self.health.failing()) - dead)
        if settled or now - self._changed_at >= self.health.dead_after:
            self._changed_at = self._held = None
            self.update(dead)

    def refusing(self, kind: str = TOKEN) -> list[int]:
        """The peers that refuse this node's handshake now: another job token (``TOKEN``),
        or another pack (``PACK``)."""
        return sorted(n for n, c in self.peers.items() if getattr(c, "refused", None) == kind)

    def update(self, dead: frozenset[int]) -> None:
        if dead == self.dead:
            return
        self.generation += 1
        refused = [n for n in (*self.refusing(TOKEN), *self.refusing(PACK)) if n in dead]
        log.warning("node %d: dead nodes now %s (generation %d)%s", self.rank,
                    sorted(dead) or "none", self.generation,
                    f"; of which {sorted(refused)} refuse this node's handshake: alive, but "
                    "another job token or pack (said above), not crashed" if refused else "")
        self.dead = dead
        reachable = self.placement.nodes - len(dead)
        self.isolated = 2 * reachable < self.placement.nodes
        if self.isolated:
            log.warning("node %d reaches %d of %d nodes: cut off, most likely; it copies "
                        "nothing until they answer again", self.rank, reachable,
                        self.placement.nodes)
            self.taken = frozenset()
            self._end_round()
            return
        todo = plan(self.placement, self.rank, dead)
        self.taken = frozenset(todo)
        self._start_round(todo)

    def run(self) -> None:
        threading.Thread(target=self._interrupt_on_stop, name="stagefs-stop-peers",
                         daemon=True).start()
        while not self.stop.wait(self.every):
            try:
                self.step()
            except Exception:  # never let the monitor die silently: log and go on
                log.exception("node %d: re-replication round failed", self.rank)
        self._end_round()
        self._pool.shutdown(wait=False)

    def _interrupt_on_stop(self) -> None:
        """Once the daemon stops: end every call blocked on its peers (a thread of its own:
        the round being probed, or copied, may itself be blocked on one)."""
        self.stop.wait()
        for c in list(self.peers.values()):
            interrupt = getattr(c, "interrupt", None)  # (fakes in tests may have none)
            if interrupt is not None:
                interrupt()

    # -- copying -------------------------------------------------------------------------

    def _start_round(self, todo: dict[int, list[int]]) -> None:
        self._end_round()
        if not todo:
            return
        holders: list[tuple[int, ...]] = [()] * len(self.placement.holders)
        for s, sources in todo.items():
            holders[s] = (*sources, self.rank)  # no sources: this node reads the origin
        stop = threading.Event()
        stager = Stager(self.manifest, holders, self.rank, self.chain, self.peers, stop,
                        self.forward_timeout)
        t = threading.Thread(target=self._copy, args=(stager, stop),
                             name="stagefs-rereplicate", daemon=True)
        with self._lock:
            self._round = (stager, stop, t)
        log.warning("node %d: %d shards to copy again (%d with no surviving replica)",
                    self.rank, len(todo), sum(not v for v in todo.values()))
        t.start()

    def _copy(self, stager: Stager, stop: threading.Event) -> None:
        def watch() -> None:  # the daemon stopping ends the round too
            while not stop.wait(0.2):
                if self.stop.is_set() or stager.done.is_set():
                    stop.set()

        threading.Thread(target=watch, daemon=True).start()
        stager.run()

    def _end_round(self) -> None:
        with self._lock:
            got, self._round = self._round, None
        if got is None:
            return
        stager, stop, t = got
        stop.set()
        t.join(60)
        st = stager.stats
        self._past["forwarded_bytes"] += st.forwarded_bytes
        self._past["forwarded_shards"] += st.forwarded_shards
        self._past["origin_bytes"] += st.placed_from_origin_bytes
        self._past["origin_shards"] += st.placed_from_origin

    def idle(self) -> bool:
        got = self._round
        return got is None or got[0].done.is_set()

    def status(self) -> dict[str, Any]:
        got = self._round
        st = got[0].stats if got is not None else None
        return {
            "dead": sorted(self.dead), "generation": self.generation,
            "isolated": self.isolated, "done": self.idle(),
            "shards_to_copy": st.shards_assigned if st else 0,
            "shards_copied": (st.shards_held - st.shards_reused) if st else 0,
            "shards_held_already": st.shards_reused if st else 0,
            "bytes_to_copy": st.bytes_assigned if st else 0,
            "from_peers_bytes": self._past["forwarded_bytes"] + (
                st.forwarded_bytes if st else 0),
            "from_peers_shards": self._past["forwarded_shards"] + (
                st.forwarded_shards if st else 0),
            "from_origin_bytes": self._past["origin_bytes"] + (
                st.placed_from_origin_bytes if st else 0),
            "from_origin_shards": self._past["origin_shards"] + (
                st.placed_from_origin if st else 0),
            "no_room": st.no_room if st else 0,
            # alive, but misconfigured: dead to this node all the same (a crash looks alike
            # in "dead"; these say why)
            "refused_token": self.refusing(TOKEN), "other_pack": self.refusing(PACK),
        }
