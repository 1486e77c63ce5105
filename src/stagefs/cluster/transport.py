"""Which transport a daemon reads its peers through: TCP (the default) or MPI.

Training processes and their DataLoader workers always read peers over TCP (net/client.py):
they are not MPI ranks. The daemons are, when launched by ``mpiexec``/``srun``, and with
``--transport mpi`` their own peer reads (staging copies between nodes, reads forwarded for
their readers) go through MPI (cluster/mpi_transport.py). ``peer_sources`` is the one place
that turns the choice into holders.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, cast

from stagefs.cluster.mpi_transport import MpiTransport
from stagefs.errors import ConfigError
from stagefs.format import Manifest
from stagefs.net.client import PeerClient, PeerSource
from stagefs.net.server import Pieces
from stagefs.tiers.chain import TierChain

__all__ = ["TRANSPORTS", "open_transport", "peer_sources"]

TRANSPORTS = ("tcp", "mpi")


def open_transport(name: str, comm: Any, manifest: Manifest, chain: TierChain, *,
                   pieces: Pieces | None = None) -> MpiTransport | None:
    """The MPI transport over ``comm`` serving ``chain``'s copies (started), and with
    ``pieces`` the ranges its partial copies hold (the daemon's), or None for TCP (the
    daemon's ShardServer serves peers). Every rank calls it at the same point."""
    if name not in TRANSPORTS:
        raise ConfigError(f"--transport {name!r}: use one of {', '.join(TRANSPORTS)}")
    if name == "tcp":
        return None
    if comm is None:
        raise ConfigError("--transport mpi needs the daemons launched as MPI ranks "
                          "(mpiexec -ppn 1 stagefs serve ..., srun --nodes=$SLURM_NNODES "
                          "--ntasks=$SLURM_NNODES --ntasks-per-node=1 ...), "
                          "not a hosts file; or use --transport tcp")
    return MpiTransport(comm, manifest, chain.locate, pieces=pieces).start()


def peer_sources(transport: MpiTransport | None,
                 clients: Mapping[int, PeerClient]) -> dict[int, PeerSource]:
    """The daemon's holder for each peer of ``clients``: through the MPI transport if there
    is one, else over those TCP clients. Each is a ``PeerSource`` (pread, pread_many,
    is_down, close); any failure is PeerUnavailable, so a reader falls back per item."""
    if transport is None:
        return {n: PeerSource(c, f"node {n}") for n, c in clients.items()}
    # PeerSource (and HedgedPeer over it) use only what MpiPeer has as PeerClient has it:
    # read, suspect, is_down, mark_suspect, stats.skipped, close, name
    return {n: PeerSource(cast(PeerClient, transport.peer(n, f"node {n}")),
                          f"node {n} (MPI)") for n in clients}
