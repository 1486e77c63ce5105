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

Then the room left holds what the holders had none for (``_overflow``): placement deals
whole shards, so at a total tier capacity near the dataset's some nodes got more than their
tiers hold and others room to spare (4 nodes, tiers at a quarter of the dataset each: 14%
of it read from the origin every epoch). A shard's spares (placement.py ``spares``: the
nodes after its holders in its ranking, which readers and relays ask after the holders)
each hold, in their turn, the pieces of it that neither its holders nor the spares before
them hold, read from the origin once. Turns are rounds, so no node waits on one that waits
on it: the first spares once the holders finished staging, the second once the first
finished their first round.

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
from typing import Any, NamedTuple

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
    overflow_shards: int = 0  # other nodes' shards it placed pieces of (their holders full)
    overflow_pieces: int = 0
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


class _Peer(NamedTuple):
    """What a peer's STATUS says of its staging."""

    done: bool  # finished staging
    primary_done: bool  # finished the shards it is primary of
    full: bool  # found its tiers full
    overflow: int  # overflow rounds finished


class Stager:
    """Stage ``mine`` (the shards placed on ``rank``) into ``chain``'s tiers; run() in a
    thread."""

    def __init__(self, manifest: Manifest, holders: Sequence[Sequence[int]], rank: int,
                 chain: TierChain, peers: dict[int, PeerClient], stop: threading.Event,
                 forward_timeout: float = _FORWARD_TIMEOUT,
                 sources: Mapping[int, ShardSource] | None = None,
                 unreachable_after: float = 30.0, first: Collection[int] = (),
                 spares: Sequence[Sequence[int]] = ()) -> None:
        """``sources``: what to copy each peer's shards from (default: over its client;
        cluster/transport.py ``peer_sources`` gives the transport's). ``unreachable_after``:
        how long a shard's other holders may all be unreachable (still starting, a blip)
        before this node takes them for dead and reads the origin itself. ``first``: the
        shards staged before any other (``--replicate-all``'s, placed on every node).
        ``spares``: each shard's spare nodes (placement.py), for the overflow after
        staging (none: no overflow)."""
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
        self.spares = spares
        self.rounds = max((len(sp) for sp in spares), default=0)
        self.overflow = 0  # overflow rounds finished (STATUS: spares after it wait on them)
        self.overflow_done = threading.Event()
        self.held_for_others: set[int] = set()  # shards it placed pieces of in the overflow
        self._gone_nodes: set[int] = set()  # taken for dead in the overflow: not waited for

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
        try:
            if self.error is None:
                self._overflow()
        except Exception as exc:  # its pieces are read from the origin, as before
            log.warning("holding pieces of other nodes' shards stopped: %s", exc)
        finally:
            self.overflow = self.rounds
            self.overflow_done.set()

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
            asked: dict[int, _Peer] = {}  # each peer's STATUS: once a round
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

    def _stage_one(self, shard: int, since: float, asked: dict[int, _Peer]) -> bool:
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

    def _gone(self, shard: int, live: list[int], asked: dict[int, _Peer]) -> bool:
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
            st = self._asked(n, asked)
            done, primary_done = st.done, st.primary_done
            if n == primary and primary_done:
                if self._peer_holds(n, shard):
                    return False
                order = self.holders[shard]
                for m in order[1 : order.index(self.rank)]:  # in turn, each once
                    if m not in live:
                        continue
                    if self._peer_holds(m, shard):
                        return False
                    later = self._asked(m, asked)
                    if not (later.done or later.full):
                        return False  # it reads it (from the origin) first: then from it
                return True
            if not done:
                return False
        return not any(self._peer_holds(n, shard) for n in live)

    def _asked(self, n: int, asked: dict[int, _Peer]) -> _Peer:
        """Has node ``n`` finished staging, finished its primary shards, found its tiers
        full, finished overflow rounds? (Its STATUS, asked once a round.)"""
        if n not in asked:
            try:
                st = self.peers[n].status()
                asked[n] = _Peer(bool(st.get("staging_done")), bool(st.get("primary_done")),
                                 bool((st.get("staging") or {}).get("no_room")),
                                 int(st.get("overflow_rounds") or 0))
            except (SourceUnavailable, AuthenticationError) as exc:
                self._unavailable(exc)
                asked[n] = _Peer(False, False, False, 0)
        return asked[n]

    # -- the overflow: pieces of shards whose holders had no room -------------------------

    def _overflow(self) -> None:
        """Round by round, the shards this node is the round's spare of: once the nodes
        before it in the shard's ranking are done (its holders staged, the spares before it
        finished their rounds, or found down, or no answer by the forward timeout), the
        pieces none of them holds are placed here from the origin, as the room allows."""
        for j in range(self.rounds):
            todo = [s for s, sp in enumerate(self.spares)
                    if len(sp) > j and sp[j] == self.rank and s not in self.mine]
            since, pause = time.monotonic(), 0.05
            while todo and not self.stop.is_set() and not self.chain.full:
                asked: dict[int, _Peer] = {}
                progress = False
                for s in list(todo):
                    if self.stop.is_set() or self.chain.full:
                        return
                    before = self._before(s, j, asked, time.monotonic() - since)
                    if before is None:
                        continue  # they are not done: wait
                    todo.remove(s)
                    progress = True
                    self._hold_rest(s, before)
                if progress:
                    pause = 0.05
                else:
                    self.stop.wait(pause)
                    pause = min(pause * 1.5, 1.0)
            if self.stop.is_set() or self.chain.full:
                return
            self.overflow = j + 1

    def _before(self, shard: int, j: int, asked: dict[int, _Peer], waited: float
                ) -> list[int] | None:
        """The nodes before this one in ``shard``'s ranking (for its ``j``-th spare
        round), once each is done with it; None while one is not. A node that does not
        answer is waited for as staging waits for a holder (daemons start at different
        times, and one found slow is skipped for a while): one left out holds pieces this
        node would hold again. Past ``unreachable_after`` it is taken for dead (left out,
        in the later rounds too: each waited for it anew); past the forward timeout, one not
        done is asked what it holds now."""
        k = len(self.holders[shard])
        out: list[int] = []
        for i, n in enumerate((*self.holders[shard], *self.spares[shard][:j])):
            if n not in self.peers or self._refused(n) or n in self._gone_nodes:
                continue
            st = self._asked(n, asked)
            if st.done if i < k else (st.overflow > i - k or st.full):
                out.append(n)
            elif self.peers[n].is_down():
                if waited < min(self.unreachable_after, self.forward_timeout):
                    return None
                self._gone_nodes.add(n)
            elif waited < self.forward_timeout:
                return None
            else:
                out.append(n)
        return out

    def _hold_rest(self, shard: int, before: Sequence[int]) -> None:
        """Place here the pieces of ``shard`` no node of ``before`` holds: each asked for the
        first and last byte of every piece (one READ; a node serves a range only where its
        copy has all of it). A node that does not answer: nothing is placed (its pieces
        would be held twice)."""
        spans = self.chain.piece_spans(shard)
        if not spans:
            return
        k = len(spans)
        ranges = [(shard, a, 1) for a, _ in spans] + [(shard, b - 1, 1) for _, b in spans]
        held = [False] * k
        for n in before:
            try:
                got = self.peers[n].read(ranges)
            except (SourceUnavailable, AuthenticationError) as exc:
                self._unavailable(exc)
                return
            held = [h or (got[p] is not None and got[k + p] is not None)
                    for p, h in enumerate(held)]
        missing = [p for p, h in enumerate(held) if not h]
        if not missing:
            return
        outcome = self.chain.place(shard, pieces=missing)
        self._count_origin()
        # whole now (its holders held none of it, or this node the rest): every piece, and
        # no partial copy of it left to count them in
        here = set(range(k)) if outcome in ("placed", "held") else {
            int(p) for f in self.chain.partial_copies(shard) for p in f.held_pieces()}
        if here:
            self.held_for_others.add(shard)
            self.stats.overflow_shards = len(self.held_for_others)
            self.stats.overflow_pieces += len(here)
        log.info("shard %d: %d of its %d pieces held by no node before this one, %d of them "
                 "placed here (%s)", shard, len(missing), k, len(here), outcome)

    def _place(self, shard: int, peer: int | None) -> str:
        """Copy ``shard`` from ``peer`` (None: the origin) through the tier chain."""
        before = self.chain.corrupt
        outcome = self.chain.place(shard, source=None if peer is None else self.sources[peer])
        self.stats.checksum_failures += self.chain.corrupt - before
        self._count_origin()
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

    def _count_origin(self) -> None:
        origin = getattr(self.chain.origin, "stats", None)
        if origin is not None:
            self.stats.origin_reads, self.stats.origin_bytes = origin.reads, origin.bytes_read
            self.stats.origin_opens, self.stats.origin_stats = origin.opens, origin.stats

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
