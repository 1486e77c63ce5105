"""The node fabric, seen from a training process: its node's daemon as one holder.

The daemon listens on ``fabric.sock`` in the runtime directory (net/server.py) and relays
what it does not hold to its peers (cluster/daemon.py), so a process needs no connection to
any peer: connections grow with nodes, not with processes. ``FabricHolder`` is that daemon
as a holder for the Store (cluster/connect.py puts it after the node's tier copies and
before the origin). A range the daemon answers NOT_HELD (no peer gave it in time) is
unavailable: the Store's next holder, the origin, answers it. A daemon that does not answer
(killed, restarting, stopped) is not the reader's problem: a request it has not answered
within the fabric's hedging delay (the 99th percentile of its recent replies, between
``FABRIC_HEDGE.floor`` and ``.cap``; a killed daemon fails at once) makes it suspect, and a
single read goes to the direct holders (the peers themselves, then the Store's origin), a
batch gives None for every range (the Store reads each again, and finds the daemon
suspect: its holders are the direct ones until a background probe finds the daemon
answering). A stopped daemon once cost each of its readers the whole reply deadline
(10 s).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import wait
from time import perf_counter
from typing import Any

from stagefs.net.client import PeerClient, PeerUnavailable
from stagefs.net.hedge import HedgePolicy, ReplyTimes, executor
from stagefs.tiers.base import ShardSource, SourceUnavailable

__all__ = ["FABRIC_HEDGE", "FABRIC_NAME", "FabricHolder"]

FABRIC_NAME = "fabric.sock"  # the node daemon's Unix socket, in the runtime directory
# The daemon relays, and hedges its own peers within their delays (at most 0.5 s each):
# its replies are given longer than a peer's before its readers go around it, and more
# than a p99 (1% of batches would send their readers to the peers directly, each with a
# connection of its own: what the fabric is for is to avoid that). A stopped daemon costs
# its readers 1-2 s (10 s, the reply deadline, before).
FABRIC_HEDGE = HedgePolicy(floor=1.0, cap=2.0, initial=2.0, to_origin=2.0)


class FabricHolder:
    """This node's daemon as a holder; ``direct(shard)``: the shard's peer holders, asked
    when the daemon itself does not answer."""

    def __init__(self, client: PeerClient, direct: Callable[[int], Sequence[ShardSource]],
                 policy: HedgePolicy = FABRIC_HEDGE) -> None:
        self.client = client
        self.name = "node daemon"
        self._direct = direct
        self.times = ReplyTimes(policy)  # of single reads
        self.batch_times = ReplyTimes(policy)  # of batches
        self.hedged = 0  # requests the daemon did not answer within the delay

    def is_down(self) -> bool:
        return self.client.is_down()

    def _timed(self, times: ReplyTimes, ranges: Sequence[tuple[int, int, int]]) -> list[Any]:
        t0 = perf_counter()
        out = self.client.read(ranges)
        times.add(perf_counter() - t0)
        return out

    def _ask(self, times: ReplyTimes, ranges: Sequence[tuple[int, int, int]]
             ) -> list[bytes | None] | None:
        """The daemon's answer; None if it gave none within the hedging delay (it is
        suspect now; the request runs on to its deadline, and a late answer clears that).
        SourceUnavailable if it failed or is suspect."""
        if self.client.suspect():
            self.client.stats.skipped += 1
            raise PeerUnavailable(f"{self.name}: suspect after a recent failure; skipped")
        f = executor().submit(self._timed, times, ranges)
        delay = times.delay()
        if not wait([f], delay).done:
            self.hedged += 1
            self.client.mark_suspect(f"no answer within {delay:.3f} s; its readers read "
                                     "from the peers directly")
            return None
        return f.result()

    def pread(self, shard: int, offset: int, length: int) -> bytes:
        try:
            got = self._ask(self.times, [(shard, offset, length)])
        except SourceUnavailable:
            got = None
        if got is None:
            return self._pread_direct(shard, offset, length)
        if got[0] is None:
            raise PeerUnavailable(f"{self.name}: no holder of shard {shard} gave "
                                  f"[{offset}, {offset + length}) in time")
        return got[0]

    def _pread_direct(self, shard: int, offset: int, length: int) -> bytes:
        for h in self._direct(shard):
            try:
                return h.pread(shard, offset, length)
            except SourceUnavailable:
                continue
        raise PeerUnavailable(f"{self.name} does not answer, nor does any peer holding "
                              f"shard {shard}")

    def pread_many(self, ranges: Sequence[tuple[int, int, int]]) -> list[bytes | None]:
        try:
            got = self._ask(self.batch_times, ranges)
        except SourceUnavailable:
            got = None
        return got if got is not None else [None] * len(ranges)

    def close(self) -> None:
        self.client.close()

    def __repr__(self) -> str:
        return f"<FabricHolder {self.client.name}>"
