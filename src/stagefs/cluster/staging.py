"""Staging: fill this node's tiers with its shards, each origin byte read once per job.

A shard's *primary* (placement.py) copies it from the origin; its other holders copy it from
a holder that has it, over the peer protocol, so a shard with K replicas costs the origin one
read, not K. A holder whose sources are down, gave bad bytes, finished staging without the
shard or are too slow reads the origin instead, and says so in its counters.

The copy is the single-node tier layer's (tiers/chain.py ``TierChain.place``): the same
tiers and room rule, a claim per shard (so a live process's partial copy is never touched),
``NAME.partial`` renamed into place, and every file checked against its checksum as it is
copied, from the origin or from a peer. A file that fails is counted, logged (shard and
file) and fetched from the next holder; the files already checked stay in the partial copy.
A restarted daemon adopts the whole copies its tiers hold (``TierChain.scan``).

A holder that refuses this node's handshake (another job token, another pack: a
misconfiguration its client logs, naming the fix) is no source: it is counted apart
(``peers_refused``, not ``peers_unreachable``), and its shards are not waited for as those of
a holder still starting would be. A stager that is stopped reads nothing more from the
origin: the daemon's stop interrupts its peer calls (``PeerClient.interrupt``), and it ends.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

from stagefs.errors import AuthenticationError
from stagefs.format import Manifest
from stagefs.format.spec import SHARD_HEADER
from stagefs.net.client import PeerAuthenticationError, PeerClient, PeerSource
from stagefs.tiers.base import ShardSource, SourceUnavailable
from stagefs.tiers.chain import TierChain

__all__ = ["Stager", "StagingStats"]

log = logging.getLogger("stagefs.stage")

_FORWARD_TIMEOUT = 600.0  # give up waiting for a primary after this long: read the origin


@dataclass
class StagingStats:
    shards_assigned: int = 0
    bytes_assigned: int = 0
    shards_held: int = 0
    bytes_held: int = 0
    shards_reused: int = 0  # found in the tiers at start (restart)
    origin_reads: int = 0
    origin_bytes: int = 0
    origin_opens: int = 0  # metadata operations on the origin (the shared FS's server)
    origin_stats: int = 0
    forwarded_shards: int = 0  # pulled from a peer instead of the origin
    forwarded_bytes: int = 0
    forward_fallbacks: int = 0  # no peer could give it: read the origin instead
    placed_from_origin: int = 0  # shards this stager copied from the origin
    placed_from_origin_bytes: int = 0
    no_room: int = 0  # shards that did not fit in the tiers
    peers_unreachable: int = 0
    peers_refused: int = 0  # asked a holder that refused this node's job token (or pack)
    checksum_failures: int = 0  # files that failed their checksum while copied
    started: float = 0.0
    finished: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


class _Counted:
    """A peer as a source to copy from, counting the bytes it gave."""

    def __init__(self, src: ShardSource, count: Callable[[int], None]) -> None:
        self.src = src
        self.name = src.name
        self._count = count

    def pread(self, shard: int, offset: int, length: int) -> bytes:
        data = self.src.pread(shard, offset, length)
        self._count(len(data))
        return data

    def close(self) -> None:
        pass


class Stager:
    """Stage ``mine`` (the shards placed on ``rank``) into ``chain``'s tiers; run() in a
    thread."""

    def __init__(self, manifest: Manifest, holders: Sequence[Sequence[int]], rank: int,
                 chain: TierChain, peers: dict[int, PeerClient], stop: threading.Event,
                 forward_timeout: float = _FORWARD_TIMEOUT,
                 sources: Mapping[int, ShardSource] | None = None,
                 unreachable_after: float = 30.0, first: Collection[int] = ()) -> None:
        """``sources``: what to copy each peer's shards from (default: over its client;
        cluster/transport.py ``peer_sources`` gives the transport's). ``unreachable_after``:
        how long a shard's other holders may all be unreachable (still starting, a blip)
        before this node takes them for dead and reads the origin itself. ``first``: the
        shards staged before any other (``--replicate-all``'s, placed on every node)."""
        self.manifest = manifest
        self.holders = holders
        self.rank = rank
        self.chain = chain
        self.peers = peers
        self.stop = stop
        self.forward_timeout = forward_timeout
        self.unreachable_after = unreachable_after
        if sources is None:
            sources = {n: PeerSource(c, f"node {n}") for n, c in peers.items()}
        self.sources = {n: _Counted(src, self._forwarded) for n, src in sources.items()}
        self.mine = [s for s, h in enumerate(holders) if rank in h]
        self.first = frozenset(first)
        self._first_left: set[int] = set()  # of ``first``, those not staged (nor refused) yet
        self._reserved = 0  # the room they are counted in the tiers: kept for them
        self.stats = StagingStats(shards_assigned=len(self.mine),
                                  bytes_assigned=sum(manifest.shards[s].size for s in self.mine))
        self.done = threading.Event()
        # every shard this node is the primary of has had its copy made or refused (no room,
        # a bad origin): one it does not hold then never comes from it (_gone)
        self.primary_done = False
        self._primaries = {s for s in self.mine if holders[s][0] == rank}
        self.error: BaseException | None = None
        self._lock = threading.Lock()

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
        held = self.chain.scan(self.mine)
        self.stats.shards_reused = len(held)
        self.stats.shards_held = len(held)
        self.stats.bytes_held = sum(self.manifest.shards[s].size for s in held)
        # the shards this node is primary for first: the other holders wait for them
        pending = sorted((s for s in self.mine if s not in held),
                         key=lambda s: self.holders[s][0] != self.rank)
        self._primaries -= held
        self.primary_done = not self._primaries
        # the shards asked on every node (the validation set) first, and their room kept for
        # them until they are staged: staged with the rest, the train set's shards, copied
        # from the origin while the validation set's came from peers, filled a small node's
        # tiers and left it none of them. The others are staged meanwhile while the room
        # allows (a holder that is late does not hold them up).
        first = [s for s in pending if s in self.first]
        self._first_left = set(first)
        self._reserved = sum(self.chain.charge(s) for s in first)
        self._stage([*first, *(s for s in pending if s not in self.first)])

    def _stage(self, pending: list[int]) -> None:
        """Round-robin over the pending shards, so that one slow primary (or a shard another
        live process is placing) does not hold up the rest."""
        first_try = {s: time.monotonic() for s in pending}
        pause = 0.05
        while pending and not self.stop.is_set():
            # peer -> (finished staging, its primary shards, its tiers full): once a round
            asked: dict[int, tuple[bool, bool, bool]] = {}
            progress = False
            for s in list(pending):
                if self.stop.is_set():
                    return
                if self._stage_one(s, first_try[s], asked):
                    pending.remove(s)
                    progress = True
                    if s in self._first_left:
                        self._first_left.discard(s)
                        self._reserved -= self.chain.charge(s)
                    self._primaries.discard(s)
                    self.primary_done = not self._primaries
            if progress:
                pause = 0.05
            else:
                self.stop.wait(pause)
                pause = min(pause * 1.5, 1.0)

    def _stage_one(self, shard: int, since: float,
                   asked: dict[int, tuple[bool, bool, bool]]) -> bool:
        """One attempt at ``shard``; True when there is nothing more to do for it."""
        if self.chain.full:  # the tiers take no more: waiting on the peers for it is vain
            self.stats.no_room += 1
            return True
        if self._reserved > 0 and shard not in self._first_left and \
                self.chain.room_left() - self.chain.charge(shard) < self._reserved:
            return False  # the room left is kept for the first shards until they are staged
        if self.holders[shard][0] == self.rank:
            return self._place(shard, None) != "elsewhere"
        # a holder that refuses this node's handshake will not give it the shard however
        # long it is waited for (a misconfiguration, said by its client): left out, and not
        # waited for as a holder still starting is
        usable = [n for n in self._sources(shard) if not self._refused(n)]
        live = [n for n in usable if not self.peers[n].is_down()]
        bad = False
        for n in live:
            if not self._peer_holds(n, shard):
                continue
            outcome = self._place(shard, n)
            if outcome in ("corrupt", "unavailable"):
                bad = True  # the next holder, else the origin
                continue
            return outcome != "elsewhere"
        waited = time.monotonic() - since
        if not live and usable and not bad and \
                waited < min(self.unreachable_after, self.forward_timeout):
            return False  # no holder answers yet: daemons start at different times
        late = waited > self.forward_timeout
        if not (bad or late) and not self._gone(shard, live, asked):
            return False  # its holders are still staging: wait for them
        if self.stop.is_set():
            return False  # stopping: not a whole shard from the origin now
        self.stats.forward_fallbacks += 1
        return self._place(shard, None) != "elsewhere"

    def _gone(self, shard: int, live: list[int], asked: dict[int, tuple[bool, bool, bool]]
              ) -> bool:
        """Will no peer ever give ``shard``? Each is down, or finished staging without it;
        or its primary finished its own shards without it (no room for it there) and so did
        the holders listed between it and this node. One more look, in case it came just
        now. Without the primary's rule, nodes whose tiers could not hold their shards each
        waited on the others' copies until the forward timeout (10 minutes). The holders
        after the primary take the shard over in their order, each from the origin only
        once those before it will not give it: all at once, every node of a
        ``--replicate-all`` shard whose primary had no room read it from the origin (a
        validation set read 3 times on 4 nodes, N - 1 times on N)."""
        primary = self.holders[shard][0]
        for n in live:
            done, primary_done, _ = self._asked(n, asked)
            if n == primary and primary_done:
                if self._peer_holds(n, shard):
                    return False
                order = self.holders[shard]
                for m in order[1 : order.index(self.rank)]:  # in turn, each once
                    if m not in live:
                        continue
                    if self._peer_holds(m, shard):
                        return False
                    m_done, _, m_full = self._asked(m, asked)
                    if not (m_done or m_full):
                        return False  # it reads it (from the origin) first: then from it
                return True
            if not done:
                return False
        return not any(self._peer_holds(n, shard) for n in live)

    def _asked(self, n: int, asked: dict[int, tuple[bool, bool, bool]]
               ) -> tuple[bool, bool, bool]:
        """Has node ``n`` finished staging, finished its primary shards, found its tiers
        full? (Its STATUS, asked once a round.)"""
        if n not in asked:
            try:
                st = self.peers[n].status()
                asked[n] = (bool(st.get("staging_done")), bool(st.get("primary_done")),
                            bool((st.get("staging") or {}).get("no_room")))
            except (SourceUnavailable, AuthenticationError) as exc:
                self._unavailable(exc)
                asked[n] = (False, False, False)
        return asked[n]

    def _place(self, shard: int, peer: int | None) -> str:
        """Copy ``shard`` from ``peer`` (None: the origin) through the tier chain."""
        before = self.chain.corrupt
        outcome = self.chain.place(shard, source=None if peer is None else self.sources[peer])
        self.stats.checksum_failures += self.chain.corrupt - before
        origin = getattr(self.chain.origin, "stats", None)
        if origin is not None:
            self.stats.origin_reads, self.stats.origin_bytes = origin.reads, origin.bytes_read
            self.stats.origin_opens, self.stats.origin_stats = origin.opens, origin.stats
        if outcome in ("placed", "held"):
            self.stats.shards_held += 1
            self.stats.bytes_held += self.manifest.shards[shard].size
            if outcome == "placed" and peer is not None:
                self.stats.forwarded_shards += 1
            elif outcome == "placed":
                self.stats.placed_from_origin += 1
                self.stats.placed_from_origin_bytes += self.manifest.shards[shard].size
        elif outcome == "full":
            self.stats.no_room += 1  # reads of it go to a peer or the origin
        return outcome

    def _forwarded(self, n: int) -> None:
        with self._lock:
            self.stats.forwarded_bytes += n

    def _sources(self, shard: int) -> list[int]:
        return [n for n in self.holders[shard] if n != self.rank and n in self.peers]

    def _peer_holds(self, n: int, shard: int) -> bool:
        """Does node ``n`` hold ``shard`` now? (Asks for its header: one small read.)"""
        try:
            got = self.peers[n].read([(shard, 0, SHARD_HEADER.size)])[0]
        except (SourceUnavailable, AuthenticationError) as exc:
            self._unavailable(exc)
            return False
        return got is not None

    def _refused(self, n: int) -> bool:
        """Does node ``n`` refuse this node's handshake now (PeerClient.refused)?"""
        return getattr(self.peers[n], "refused", None) is not None

    def _unavailable(self, exc: BaseException) -> None:
        """Count a peer call that failed: refused (a misconfiguration), or unreachable."""
        if isinstance(exc, PeerAuthenticationError):
            self.stats.peers_refused += 1
        else:
            self.stats.peers_unreachable += 1
