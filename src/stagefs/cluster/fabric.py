"""The node fabric, seen from a training process: its node's daemon as one holder.

The daemon listens on ``fabric.sock`` in the runtime directory (net/server.py) and relays
what it does not hold to its peers (cluster/daemon.py), so a process needs no connection to
any peer: connections grow with nodes, not with processes. ``FabricHolder`` is that daemon
as a holder for the Store (cluster/connect.py puts it after the node's tier copies and
before the origin). A range the daemon answers NOT_HELD (no peer gave it in time) is
unavailable: the Store's next holder, the origin, answers it. A daemon that does not answer
(killed, restarting, stopped) is not the reader's problem: a reply not begun within
``FABRIC_PATIENCE`` is waited for on only if the daemon answers a probe (a killed daemon
fails at once), else the daemon is suspect, a single read goes to
the direct holders (the peers themselves, then the Store's origin), and a batch gives None
for every range (the Store reads each again, and finds the daemon suspect: its holders are
the direct ones until a background probe finds the daemon answering). A stopped daemon once
cost each of its readers the peers' reply deadline (10 s).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from stagefs.net.client import PeerClient, PeerUnavailable
from stagefs.tiers.base import ShardSource, SourceUnavailable

__all__ = ["FABRIC_NAME", "FABRIC_PATIENCE", "FabricHolder"]

FABRIC_NAME = "fabric.sock"  # the node daemon's Unix socket, in the runtime directory
# A request the daemon has not begun to answer in this long: is it alive? It relays, and
# may take up to its relay deadline (4 s) when peers do not answer, but its event loop
# answers a probe at once on another connection while it does (the probe's deadline is the
# client's connect timeout, 1 s). A stopped or stuck daemon answers neither: its readers go
# around it after about 2 s, not a peer's 10 s reply deadline. Timed in the reader's own
# thread: a pool thread racing each request (as a peer's hedge does) cost 8% of the
# relayed throughput.
FABRIC_PATIENCE = 1.0


class FabricHolder:
    """This node's daemon as a holder; ``direct(shard)``: the shard's peer holders, asked
    when the daemon itself does not answer."""

    def __init__(self, client: PeerClient, direct: Callable[[int], Sequence[ShardSource]],
                 patience: float = FABRIC_PATIENCE) -> None:
        self.client = client
        self.name = "node daemon"
        self._direct = direct
        client.patience = (patience, client.probe)

    def is_down(self) -> bool:
        return self.client.is_down()

    def report_bad(self, shard: int) -> None:
        """Bytes of ``shard`` it gave (from its tiers, or relayed from a peer) failed their
        checksum: it checks its copy, or has the shard's holders check theirs; a bad one
        is deleted (it was served to every reader until the daemon ended)."""
        self.client.report_bad(shard)

    def check(self, shard: int) -> str:
        """Ask the daemon now to check its copy of ``shard`` (a read found this node's tier
        copy bad): it serves the copy no more until checked, so the read that goes on to
        it gets the bytes from a peer. What it says (``"queued"``, ...), or
        SourceUnavailable if it does not answer."""
        return self.client.check(shard)

    def pread(self, shard: int, offset: int, length: int) -> bytes:
        try:
            data = self.client.read([(shard, offset, length)])[0]
        except SourceUnavailable:
            return self._pread_direct(shard, offset, length)
        if data is None:
            raise PeerUnavailable(f"{self.name}: no holder of shard {shard} gave "
                                  f"[{offset}, {offset + length}) in time")
        return data

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
            return self.client.read(ranges)
        except SourceUnavailable:
            return [None] * len(ranges)

    def close(self) -> None:
        self.client.close()

    def __repr__(self) -> str:
        return f"<FabricHolder {self.client.name}>"
