"""The node fabric, seen from a training process: its node's daemon as one holder.

The daemon listens on ``fabric.sock`` in the runtime directory (net/server.py) and relays
what it does not hold to its peers (cluster/daemon.py), so a process needs no connection to
any peer: connections grow with nodes, not with processes. ``FabricHolder`` is that daemon
as a holder for the Store (cluster/connect.py puts it after the node's tier copies and
before the origin). A range the daemon answers NOT_HELD (no peer gave it in time) is
unavailable: the Store's next holder, the origin, answers it. A daemon that does not answer
(killed, restarting) is not the reader's problem: a single read goes to the direct holders
(the peers themselves, then the Store's origin), a batch gives None for every range (the
Store reads each again, and finds the daemon suspect: its holders are the direct ones
until a background probe finds the daemon answering).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from stagefs.net.client import PeerClient, PeerUnavailable
from stagefs.tiers.base import ShardSource, SourceUnavailable

__all__ = ["FABRIC_NAME", "FabricHolder"]

FABRIC_NAME = "fabric.sock"  # the node daemon's Unix socket, in the runtime directory


class FabricHolder:
    """This node's daemon as a holder; ``direct(shard)``: the shard's peer holders, asked
    when the daemon itself does not answer."""

    def __init__(self, client: PeerClient, direct: Callable[[int], Sequence[ShardSource]]
                 ) -> None:
        self.client = client
        self.name = "node daemon"
        self._direct = direct

    def is_down(self) -> bool:
        return self.client.is_down()

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
