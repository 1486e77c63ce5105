"""The per-node daemon (``stagefs serve``): bootstrap, stage this node's shards, serve peers.

One per node, launched by ``mpiexec -ppn 1`` / ``srun --ntasks-per-node=1`` (or with a
static hosts file). Order of events: bootstrap (rank, size, token, addresses), placement
(pure, the same on every node), the server starts (it serves while staging goes on),
staging starts in a thread, the runtime directory is written for training processes (at
once, or with ``--wait`` only when the whole cluster has staged), rank 0 reports progress,
the "staged" barrier, then serve until SIGTERM/SIGINT.

The daemon is its node's fabric: it listens on a Unix socket in the runtime directory too,
where the node's training processes and DataLoader workers send every read that is not a
local tier hit. Ranges of shards it holds it answers from its tiers; the others it relays to
their holders (``ClusterHolders``, the readers' own holder order), all peers of a batch at
once under one deadline, from the server's event loop on one connection of its own to each
peer (net/relay.py; the re-replication probes go on it too, and staging and status on one
``PeerClient`` connection: two per peer). It does not verify relayed bytes: the reader
does. Relayed bytes are received into kernel pipes and sent on from them (net/pipes.py: no
copy in this process; ``STAGEFS_RELAY_PIPES=0``: through memory). With ``--transport mpi``
the relay reads the peers' ranges through MPI instead (the MPI transport's peers, a channel
each: net/relay.py), as the staging copies are.

A copy reported bad (CHECK: by a reader of this node, or a peer) is not served until it is
checked; a bad one is deleted and placed again from a peer that holds it, else the origin.
Descriptors: each peer costs the daemon about ``PEER_DESCRIPTORS``, each shard it holds
``SHARD_DESCRIPTORS`` (one more if read from the origin); it says at start when its limit
cannot hold them, and out of them it serves on (net/server.py) and says so.
"""

from __future__ import annotations

import dataclasses
import errno
import fcntl
import logging
import os
import signal
import socket
import statistics
import struct
import sys
import threading
import time
from collections.abc import Collection, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from stagefs._fsutil import atomic_write, hold_lock, raise_fd_limit
from stagefs._malloc import tune_malloc
from stagefs.cluster.bootstrap import (
    Bootstrap,
    MpiBootstrap,
    SingleBootstrap,
    SlurmBootstrap,
    StagedNodes,
    StaticBootstrap,
)
from stagefs.cluster.cmap import (
    DAEMON_PID,
    ClusterMap,
    clear_failure,
    prepare_runtime,
    record_failure,
    remove_runtime,
    write_map,
)
from stagefs.cluster.connect import ClusterHolders
from stagefs.cluster.fabric import FABRIC_NAME
from stagefs.cluster.mpi_transport import MpiPeer, mpi_library
from stagefs.cluster.placement import place, shards_matching
from stagefs.cluster.rereplicate import Rereplicator
from stagefs.cluster.staging import Stager
from stagefs.cluster.status import said_unreadable, unreadable, without_room
from stagefs.cluster.transport import TRANSPORTS, open_transport, peer_sources
from stagefs.cluster.world import (
    ONE_PER_NODE,
    detect,
    read_hosts,
    runtime_default,
    slurm_batch_nodes,
    slurm_step,
    under_mpi,
)
from stagefs.config import env, env_flag, format_size, parse_tier
from stagefs.errors import ConfigError, RuntimeInUseError, StagefsError
from stagefs.format import MANIFEST_NAME, Manifest
from stagefs.format.spec import SHARD_HEADER
from stagefs.net.client import PeerClient
from stagefs.net.hedge import HedgePolicy
from stagefs.net.pipes import PipePool, pipe_descriptors, pool_pipes
from stagefs.net.relay import Relay, RelayPeer
from stagefs.net.server import ServerLimits, ShardServer, connection_room
from stagefs.net.sockio import host_port
from stagefs.runtime import Runtime, clean
from stagefs.tiers.audit import check_shard
from stagefs.tiers.base import SourceUnavailable
from stagefs.tiers.chain import TierChain
from stagefs.tiers.origin import PackOrigin
from stagefs.tiers.status import EndedCounts, ReadCounters, read_counts
from stagefs.tiers.tier import DirTier

__all__ = ["Daemon", "ServeOptions", "descriptor_shortfall", "descriptors_for",
           "interface_address", "peers_within", "serve", "shard_descriptors",
           "staging_shortfall"]

log = logging.getLogger("stagefs.daemon")
DEFAULT_PORT = 7070
CHECK_EVERY = 10.0  # seconds between two checks of one shard's copies asked by readers
PEER_CONNECTIONS = 1  # per peer for staging and status; the relay keeps one more (its
# readers' relayed ranges and the probes: net/relay.py)
# descriptors a daemon spends on each peer: its connections to the peer (data, relay) and
# the peer's to it
PEER_DESCRIPTORS = 2 * (PEER_CONNECTIONS + 1)
READER_ALLOWANCE = 64  # descriptors counted for the node's own readers (4 ranks x 16)
# descriptors a daemon keeps open for each shard it holds, until it ends: its tier copy
# (the tier chain's; its staging's are let go of once it is whole) and the server's (read
# by peers); and one more for each shard it read from the origin (its primaries: at most a
# quarter of its limit, PackOrigin)
SHARD_DESCRIPTORS = 2


def peers_within(fd_limit: int, fd_reserve: int | None = None) -> int:
    """How many peers a daemon can keep its connections with under ``fd_limit`` open
    descriptors, ``fd_reserve`` of them kept apart (default: what its relay's pipe pool may
    hold) and room left for the node's readers."""
    if fd_reserve is None:
        fd_reserve = pipe_descriptors(fd_limit)
    return max(0, (connection_room(fd_limit, fd_reserve) - READER_ALLOWANCE)
               // PEER_DESCRIPTORS)


def _left(fd_limit: int, peers: int, shard_fds: int = 0, fd_reserve: int | None = None
          ) -> int:
    """The descriptors left under ``fd_limit`` once a daemon has room for its ``peers``,
    its node's readers and the ``shard_fds`` it keeps for its shards (negative: short)."""
    if fd_reserve is None:
        fd_reserve = pipe_descriptors(fd_limit)
    return (connection_room(fd_limit - shard_fds, fd_reserve) - READER_ALLOWANCE
            - peers * PEER_DESCRIPTORS)


def descriptors_for(peers: int, shard_fds: int = 0) -> int:
    """The smallest open-file limit under which a daemon has room for ``peers`` peers and
    the ``shard_fds`` descriptors of its shards (``shard_descriptors``)."""
    limit = peers * PEER_DESCRIPTORS + READER_ALLOWANCE + shard_fds
    while (short := -_left(limit, peers, shard_fds)) > 0:
        limit += short
    while _left(limit - 1, peers, shard_fds) >= 0:  # the steps above may pass it by a few
        limit -= 1
    return limit


def shard_descriptors(shards: int, primaries: int) -> int:
    """The descriptors a daemon keeps open for the ``shards`` it holds, ``primaries`` of
    them read from the origin (``SHARD_DESCRIPTORS``)."""
    return SHARD_DESCRIPTORS * shards + primaries


def descriptor_shortfall(fd_limit: int, fd_reserve: int, peers: int,
                         shard_fds: int = 0) -> str | None:
    """What to tell the user when ``fd_limit`` descriptors cannot hold a daemon's
    connections with its ``peers`` and the ``shard_fds`` descriptors of the shards it holds
    (``shard_descriptors``); None when they can."""
    fit = peers_within(fd_limit, fd_reserve)
    if fit >= peers and _left(fd_limit, peers, shard_fds, fd_reserve) >= 0:
        return None
    want = descriptors_for(peers, shard_fds)
    advice = ("(ulimit -Hn; limits.conf nofile, or Slurm's PropagateResourceLimits): "
              "stagefs doctor checks it")
    if fit < peers:
        return (f"the open-file limit ({fd_limit}) leaves room for connections with about "
                f"{fit} peers, and this job has {peers}: the others' connections will be "
                f"refused and their reads go to the origin; raise the hard limit to {want} "
                f"or more {advice}")
    return (f"the open-file limit ({fd_limit}) cannot hold what this node keeps open: about "
            f"{shard_fds} descriptors for its shards ({SHARD_DESCRIPTORS} a shard held, one "
            f"more a shard read from the origin) and its connections"
            f"{f' with {peers} peer' + 's' * (peers > 1) if peers else ''}: "
            "past the limit, copies are opened again as they are read, or not kept open "
            f"(read from other nodes or the origin); raise the hard limit to {want} or "
            f"more (ulimit -n {want} where the daemons start), or hold fewer shards a node "
            f"(larger shards, more nodes) {advice}")


@dataclass(frozen=True)
class ServeOptions:
    origin: str
    tiers: Sequence[str]
    replicas: int = 1
    replicate_all: Sequence[str] = ()
    runtime: str | None = None
    wait: bool = False
    hosts: str | None = None
    rank: int | None = None
    token_file: str | None = None
    bind: str | None = None
    interface: str | None = None
    port: int | None = None
    seed: int = 0
    progress: float = 5.0
    mpi: bool | None = None  # None: use MPI if an MPI launcher started us
    clean_on_exit: bool = False  # remove this node's tier data when the daemon stops
    transport: str = "tcp"  # how this daemon reads its peers: "tcp" or "mpi" (MPI ranks)
    forward_timeout: float = 600.0
    dead_after: float = 30.0  # a peer whose probes fail this long is dead: re-replicate
    relay_timeout: float = 4.0  # one relayed batch of this node's readers, all its peers
    fabric: bool = True  # listen on the runtime's Unix socket for this node's readers
    limits: ServerLimits = field(default_factory=ServerLimits)  # what the server grants peers
    extra: dict[str, Any] = field(default_factory=dict)


def _bootstrap(o: ServeOptions) -> Bootstrap:
    if o.transport not in TRANSPORTS:
        raise ConfigError(f"--transport {o.transport!r}: use one of {', '.join(TRANSPORTS)}")
    if o.transport == "mpi":
        if o.hosts or o.mpi is False:
            raise ConfigError("--transport mpi reads peers through MPI: launch the daemons as "
                              "MPI ranks (mpiexec/srun), without --hosts or --no-mpi; or use "
                              "--transport tcp")
        mpi_library("--transport mpi was given")  # MPI_THREAD_MULTIPLE, before bootstrap
        return MpiBootstrap(asked=True)
    if o.rank is not None and not o.hosts:
        raise ConfigError("--rank is the static bootstrap's: give --hosts FILE too (under "
                          "mpiexec or srun the launcher gives each daemon its rank)")
    if o.hosts:
        rank = o.rank if o.rank is not None else detect().rank
        return StaticBootstrap(read_hosts(o.hosts), rank, o.token_file,
                               o.port if o.port is not None else DEFAULT_PORT)
    if o.mpi or (o.mpi is None and under_mpi()):
        return MpiBootstrap(asked=bool(o.mpi))
    step = slurm_step() if o.mpi is None else None
    if step is not None:
        return SlurmBootstrap(step, o.token_file, o.port)
    nodes = slurm_batch_nodes() if o.mpi is None else None
    if nodes is not None and nodes > 1:
        # (the batch script's own line, without srun: the other nodes get no daemon, and
        # their readers wait for one until their connect timeout)
        log.warning("this daemon runs in a Slurm job of %d nodes but outside an srun step "
                    "(in the batch script itself): it serves this node alone, a cluster of "
                    "one, and the job's other nodes get no daemon. Start one on every node: "
                    "%s stagefs serve ... (docs/cluster.md, Slurm batch script)", nodes,
                    ONE_PER_NODE)
    return SingleBootstrap(o.token_file)


def interface_address(name: str) -> str:
    """The IPv4 address of network interface ``name``."""
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))
    except OSError as exc:
        raise ConfigError(f"interface {name!r}: no IPv4 address ({exc.strerror}); see "
                          "'ip -4 addr' for the cluster interface's name") from None
    finally:
        s.close()
    return socket.inet_ntoa(packed[20:24])


def _bind_address(o: ServeOptions, boot: Bootstrap) -> tuple[str, int]:
    if isinstance(boot, StaticBootstrap):
        host, port = boot.hosts[boot.rank]
        return (o.bind or host), port
    port = o.port if o.port is not None else 0
    if o.bind:
        return o.bind, port
    iface = o.interface or env("INTERFACE")
    if iface:
        return interface_address(iface), port
    if boot.size == 1:
        return "127.0.0.1", port
    try:
        return socket.gethostbyname(socket.gethostname()), port
    except OSError as exc:
        raise ConfigError("cannot tell this node's cluster address from its host name; give "
                          "--bind ADDR or --interface NAME") from exc


class Daemon:
    def __init__(self, o: ServeOptions) -> None:
        self.o = o
        self.stop = threading.Event()
        self.state = "starting"
        self.boot = _bootstrap(o)
        self.rank, self.size = self.boot.rank, self.boot.size
        try:
            self._start(o)
        except BaseException:
            self._abandon()
            raise

    def _start(self, o: ServeOptions) -> None:
        """Everything of the start after the bootstrap. Under MPI the daemons start
        together: each step that may fail on one node ends with ``boot.agree``, before the
        next collective (the token's broadcast, the addresses' allgather, the transport),
        so that every rank stops there with the nodes that failed named, rather than the
        others waiting for a rank that left."""
        failure: Exception | None = None
        runtime: str | None = None
        try:
            self.pack = os.path.abspath(o.origin)
            raw_rt = o.runtime or runtime_default()
            self.runtime = runtime = os.path.abspath(raw_rt.replace("{rank}", str(self.rank)))
            if not os.path.exists(os.path.join(self.pack, MANIFEST_NAME)):
                raise ConfigError(f"{self.pack}: not a pack (no {MANIFEST_NAME}); cluster "
                                  f"mode serves packs: run 'stagefs pack SRC {self.pack}' "
                                  "first")
            if not o.tiers:
                raise ConfigError("give at least one --tier DIR[:SIZE] (node-local memory or "
                                  "disk); on a node with no room for data, DIR:0 (it holds "
                                  "nothing, and its readers read the other nodes)")
            self.tier_specs = [parse_tier(t, rank=self.rank) for t in o.tiers]
            self._one = _only_daemon(self.runtime)
            self.manifest = Manifest(os.path.join(self.pack, MANIFEST_NAME))
        except Exception as exc:
            failure = exc
        self.boot.agree(failure, runtime)
        self.token = self.boot.token()
        try:
            self._start_server(o)
        except Exception as exc:
            failure = exc
        self.boot.agree(failure)
        try:
            self._start_peers(o)
        except Exception as exc:
            failure = exc
        self.boot.agree(failure)
        self._start_transport(o)

    def _start_server(self, o: ServeOptions) -> None:
        """This node's tiers and its server (listening: the port is exchanged next)."""
        # a lease (clean refuses while we run) and where our data goes (clean removes it);
        # the same runtime holds the tier layer's claims, tier locks and counters
        self.lease = _tier_runtime(self.runtime)
        self.lease.record_tiers(self.manifest.pack_id.hex(), [s.path for s in self.tier_specs])
        # the single-node tier layer: tiers, room, claims and copies (tiers/chain.py)
        self.origin = PackOrigin(self.pack, self.manifest)
        # staging's reads of the origin count for the node's hit rate (stagefs status)
        self.counts = ReadCounters(self.lease.stats)
        self.origin.stats.sink = self.counts.fetched
        self.chain = TierChain(self.manifest, self.origin,
                               self.tier_specs, self.lease, origin_path=self.pack)
        host, port = _bind_address(o, self.boot)
        old, new = raise_fd_limit()  # each connection is a descriptor
        if new != old:
            log.info("open file limit raised from %d to %d", old, new)
        self.fd_limit = new
        self.holders: ClusterHolders | None = None  # the relay's, once the nodes are known
        self.pipes = (PipePool(most=pool_pipes(new)) if env_flag("RELAY_PIPES")
                      else None)
        self._relay_mpi: dict[int, MpiPeer] = {}  # id(relay peer) -> its MPI reader
        self.relay = Relay(self._relay_peers_of, o.relay_timeout, self.pipes,
                           channel=lambda peer: self._relay_mpi.get(id(peer)))
        self.fabric_path = os.path.join(self.runtime, FABRIC_NAME) if o.fabric else None
        self._status_cache: tuple[float, dict[str, Any]] | None = None
        self._missing: set[int] = set()  # its copies deleted as bad, not placed again yet
        self._used: dict[str, int] = {}  # each tier's bytes used, as last read
        self._reads_at, self._reads_bad = float("-inf"), 0
        self._reads_ended = EndedCounts()  # ended readers' counts: read once
        # the relay's pipes are descriptors too: kept out of the connections' share
        self._limits = limits = dataclasses.replace(
            o.limits, fd_reserve=self.pipes.max_fds if self.pipes is not None else 0)
        self._checking: set[int] = set()  # shards whose copies are checked now: not served
        try:
            self.server = ShardServer(self.manifest, self.token, self._locate, host, port,
                                      limits=limits, status=self.status,
                                      unix_path=self.fabric_path, relay=self.relay,
                                      check=self._check_shard, pieces=self._pieces)
        except ConfigError as exc:
            boot = self.boot if isinstance(self.boot, StaticBootstrap) else None
            cause = exc.__cause__
            taken = isinstance(cause, OSError) and cause.errno == errno.EADDRINUSE
            others = boot.reaching(self.rank) if boot is not None and taken else []
            if boot is None or not others:
                raise
            # (not another job's: the hosts file names this node twice, under two names
            # that are not looked up at start, and the other line's daemon listens here)
            named = ", ".join(f"rank {i}'s {host_port(*boot.hosts[i])}" for i in others)
            raise ConfigError(
                f"{exc}. Here the hosts file names one address twice: {named} reaches it, "
                f"as this daemon's {host_port(*boot.hosts[self.rank])} (rank {self.rank}) "
                "does, and that daemon listens there: list each node once, by one name "
                "(two daemons on one host: different ports, ADDR:PORT)") from None
        # CHECKs of copies readers found bad bytes in: one at a time, at most one a shard
        # every CHECK_EVERY seconds
        self._checker = ThreadPoolExecutor(1, thread_name_prefix="stagefs-check")
        self._checked: dict[int, float] = {}
        self.checks = {"asked": 0, "checked": 0, "dropped": 0, "placed": 0, "forwarded": 0}

    def _start_peers(self, o: ServeOptions) -> None:
        """The nodes' addresses (a collective), placement and the clients of the peers."""
        self.nodes = self.boot.exchange(self.server.address)
        self.everywhere = sorted(shards_matching(
            ((self.manifest.path_of(e).decode("utf-8", "surrogateescape"),
              int(self.manifest.shard[e])) for e in self.manifest.files()),
            list(o.replicate_all)))
        if o.replicas > self.size and self.rank == 0:
            _say(self.rank, f"--replicas {o.replicas} on {self.size} nodes: each shard has "
                 f"{self.size} copies (a node holds one copy at most)")
        self.placement = place(len(self.manifest.shards), self.size, o.replicas,
                               everywhere=self.everywhere, seed=o.seed)
        short = descriptor_shortfall(
            self.fd_limit, self._limits.fd_reserve, len(self.nodes) - 1,
            shard_descriptors(len(self.placement.shards_of(self.rank)),
                              len(self.placement.primary_shards(self.rank))))
        if short is not None:
            log.warning("%s", short)
            _say(self.rank, short)
        self.peers = {n: PeerClient(h, p, self.token, pack_id=self.manifest.pack_id,
                                    name=f"node {n}", timeout=30.0,
                                    pool_size=PEER_CONNECTIONS)
                      for n, (h, p) in enumerate(self.nodes) if n != self.rank}

    def _start_transport(self, o: ServeOptions) -> None:
        """The peers' transport (MPI: a collective), staging and re-replication."""
        # the peers' bytes come over TCP or MPI (--transport); status and the barrier over TCP
        self.transport = open_transport(o.transport, getattr(self.boot, "comm", None),
                                        self.manifest, self.chain, pieces=self._pieces)
        if self.transport is not None:
            # every rank is past MPI_Init (the transport's communicator is a collective):
            # the node's ranks have attached MPI's shared-memory segment, and its name in
            # /dev/shm is needed no more. Removed now: a daemon that does not finalize (a
            # peer lost; under srun --mpi=pmi2 at the job's end, MPI_Finalize waits on the
            # srun that the end stops too, until Slurm kills it) left it on every node
            _unlink_mpi_segments()
        if self.transport is None:
            # MPI served the start (rank, token, addresses) and nothing after it uses MPI:
            # let go of it now, while every rank is alive. MPI_Finalize waits for every
            # rank, so at the end a rank lost (or stopped sooner) would hold it forever,
            # and a rank that left without it kept its segments in /dev/shm
            self.boot.finalize()
        # the readers' holders, on this daemon's clients: who to relay each shard to; a
        # sole replica is given half the batch's deadline before its ranges are left to
        # the reader's origin (a reader on its own gives it 0.5 s)
        self.holders = ClusterHolders(self.runtime, self.cmap(False), self.token,
                                      self.manifest, self.origin, verify=False,
                                      timeout=30.0, clients=self.peers,
                                      hedge=HedgePolicy(to_origin=o.relay_timeout / 2))
        self.stager = Stager(self.manifest, self.placement.holders, self.rank, self.chain,
                             self.peers, self.stop, o.forward_timeout,
                             sources=peer_sources(self.transport, self.peers),
                             unreachable_after=o.dead_after, first=self.everywhere,
                             spares=self.placement.spares())
        self._mine = frozenset(self.stager.mine)  # (staging counts what it placed)
        # after a peer dies, its shards are copied again from survivors (rereplicate.py)
        # probes go on the relay's connection to each peer (STATUS): two fit in
        # dead_after, so a death is declared within about dead_after of the silence
        wait = min(5.0, o.dead_after / 2)
        relay, ps = self.relay, self.holders.peers
        if self.transport is not None:  # the readers' relayed ranges through MPI too
            self._relay_mpi = {id(ps[n]): self.transport.peer(n, f"node {n}")
                               for n in self.peers}
        probes = {n: (lambda p=ps[n]: relay.probe(p, wait)) for n in self.peers}
        # the staged barrier's knowledge, and what this node placed the shards with
        self.staged_nodes = StagedNodes(self.rank, self.placement_settings())
        self.rereplicator = Rereplicator(self.manifest, self.placement, self.rank, self.chain,
                                         self.peers, probes, self.stop,
                                         dead_after=o.dead_after,
                                         every=min(1.0, o.dead_after / 4),
                                         forward_timeout=o.forward_timeout)
        self.monitor: threading.Thread | None = None
        self.progress_unreachable = 0
        self._unreadable: dict[int, str] = {}  # peers whose STATUS could not be read, why
        self.staged_at = 0.0

    def _abandon(self) -> None:
        """The start failed: let go of what it took (the server's port and fabric socket,
        the lease), so that a daemon that does not start leaves nothing that looks live."""
        server: ShardServer | None = getattr(self, "server", None)
        if server is not None:
            server.close()
        chain: TierChain | None = getattr(self, "chain", None)
        if chain is not None:
            chain.close()
        lease: Runtime | None = getattr(self, "lease", None)
        if lease is not None:
            lease.unregister()
            if self.o.clean_on_exit:
                self._clean(tries=1)

    # -- copies a reader found bad bytes in (CHECK) ------------------------------------

    def _check_shard(self, shard: int) -> str:
        """A reader (or a peer's daemon) found bad bytes of ``shard`` from here: check this
        node's copy in the background, or, if it holds none (it relayed them), have the
        shard's holders check theirs. Called in the server's event loop: returns at once."""
        if not 0 <= shard < len(self.manifest.shards):
            return "no such shard"
        now = time.monotonic()
        if now - self._checked.get(shard, float("-inf")) < CHECK_EVERY:
            return "checked recently"
        self._checked[shard] = now
        self.checks["asked"] += 1
        # not served until checked: a reader that found this node's copy bad reads on
        # through this daemon, which then relays the shard from a peer
        self._checking.add(shard)
        self.server.forget(shard)
        try:
            self._checker.submit(self._check_copy, shard)
        except RuntimeError:  # shut down: the daemon is stopping
            self._checking.discard(shard)
            return "stopping"
        return "queued"

    def _locate(self, shard: int) -> str | None:
        """The shard's copy to serve (the server's ``locate``): none while it is checked."""
        return None if shard in self._checking else self.chain.locate(shard)

    def _pieces(self, shard: int, offset: int, length: int) -> bytes | None:
        """The bytes of a range of ``shard`` from this node's partial copies (the server's
        ``pieces``): a tier too small for the node's share holds some of its shards in
        part, and those pieces serve its readers and its peers (the readers check them);
        None where no copy has all of it, or while the shard is checked. Never the header:
        a peer asks for it to learn whether this node holds the shard whole, to copy it
        from here (staging.py ``_peer_holds``): a copy under way would send it to the origin
        for the pieces not in yet."""
        if shard in self._checking or offset < SHARD_HEADER.size:
            return None
        for f in self.chain.partial_copies(shard):
            if f.covered(offset, offset + length):
                try:
                    return f.pread(offset, length)
                except SourceUnavailable:  # let go of meanwhile (made whole), cut short
                    continue
        return None

    def _bytes_in_pieces(self, shards: Iterable[int], whole: Collection[int] = ()) -> int:
        """The stored bytes of the files this node's partial copies of ``shards`` hold, and
        its whole copies of those of them in ``whole``."""
        total = 0
        for shard in shards:
            if shard in whole and self.chain.locate(shard) is not None:
                total += self.chain.file_bytes(shard)
                continue
            for f in self.chain.partial_copies(shard):
                bits = f.bits
                if len(bits) == len(f.ext):  # (none once let go of: made whole meanwhile)
                    total += int((f.ext.ends - f.ext.offs)[bits.astype(bool)].sum())
        return total

    def _check_copy(self, shard: int) -> None:
        """Check every file of each whole copy of ``shard`` this node holds (tiers/audit.py,
        the readers' check); a bad copy is deleted (the tiers' own drop: the server stops
        serving it) and placed again, from a peer if one gives it. None held: the shard's
        holders are asked."""
        try:
            self._check_held(shard)
        finally:
            self._checking.discard(shard)  # served again (placed again, if it was bad)

    def _check_held(self, shard: int) -> None:
        held = [t for t in self.chain.tiers if shard in t.held()]
        for t in held:
            if not _can_open(t.path(shard)):
                # out of descriptors: the audit would take the copy for a corrupt one
                log.warning("%s: shard %d not checked: out of descriptors (the open-file "
                            "limit, %d)", t.name, shard, self.fd_limit)
                self._checked.pop(shard, None)  # the next report asks again
                continue
            # (says what it cannot read; a copy of the wrong size is bad: it is not served)
            _, _, bad = check_shard(t.dir, self.manifest, shard, whole=True)
            self.checks["checked"] += 1
            if bad:
                self.checks["dropped"] += 1
                log.warning("%s: shard %d: %s: %s; the copy is deleted and placed again",
                            t.name, shard, bad[0].path, bad[0].reason)
                self._drop(t, shard)
                self._place_again(shard)
        if held:
            return
        for n in self.placement.holders[shard]:
            if n != self.rank and n in self.peers:
                self.checks["forwarded"] += 1
                try:
                    self.peers[n].check(shard)
                except SourceUnavailable:
                    continue

    def _drop(self, tier: DirTier, shard: int) -> None:
        """Delete the tier's bad copy of ``shard`` (the tier chain's drop: its room freed),
        under the shard's claim: the drop queues the shard for the chain's own streams,
        which read the origin, and a stream that finds it claimed leaves it (to
        ``_place_again``, which reads a peer)."""
        claimed = self.chain.claims.acquire(shard)
        try:
            self._missing.add(shard)
            tier.drop(shard)
            deadline = time.monotonic() + 1.0
            while claimed and shard in self.chain.stream.queued() and \
                    time.monotonic() < deadline:
                time.sleep(0.005)  # until a stream has taken it off its queue, and left it
        finally:
            if claimed:
                self.chain.claims.release(shard)

    def _place_again(self, shard: int) -> None:
        """Place ``shard`` again, its bad copy deleted: from a live peer that holds it, else
        from the origin. (Should a stream of the tier chain have claimed it first, it
        places it from the origin, and this finds it placed.)"""
        outcome = "unavailable"
        for n in self.placement.live(shard, self.rereplicator.dead):
            if n == self.rank or n not in self.peers or self.peers[n].is_down():
                continue
            outcome = self.chain.place(shard, source=self.stager.sources[n])
            if outcome not in ("corrupt", "unavailable"):
                break
        else:
            outcome = self.chain.place(shard)
        if outcome == "placed":
            self.checks["placed"] += 1
        log.info("shard %d placed again: %s", shard, outcome)

    # -- the fabric: relayed reads of this node's readers -------------------------------

    def _relay_peers_of(self, shard: int) -> Sequence[RelayPeer]:
        """Where the relay reads ranges of ``shard``: its holders on other nodes, in the
        readers' order (none until the nodes are known)."""
        holders = self.holders
        return () if holders is None else holders.remote(shard)

    # -- what STATUS answers ---------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        """What STATUS answers; computed at most every 0.2 s (every peer's probes ask it, a
        few times a second in all, and it walks the tiers)."""
        now = time.monotonic()
        cached = self._status_cache
        if cached is not None and now - cached[0] < 0.2:
            return cached[1]
        try:
            out = self._status()
        except OSError as exc:  # out of descriptors: what it said last
            if cached is None or exc.errno not in (errno.EMFILE, errno.ENFILE):
                raise
            return cached[1]
        self._status_cache = (now, out)
        return out

    def placement_settings(self) -> dict[str, Any]:
        """What this node placed the shards with (STATUS ``placement``): a peer whose key
        differs is not counted staged (bootstrap.StagedNodes.disagrees)."""
        return {**self.placement.settings(), "replicate_all": list(self.o.replicate_all)}

    def _status(self) -> dict[str, Any]:
        st = self.stager.stats.as_dict()
        # what the tiers hold now, not what staging placed: a copy deleted since (found
        # bad) is missing until it is placed again
        gone = self._still_missing() & self._mine
        st["shards_held"] -= len(gone)
        st["bytes_held"] -= sum(self.manifest.shards[s].size for s in gone)
        # and the files of its shards its partial copies hold (a tier too small for the
        # whole share): they are served too (``_pieces``); the share said 0% of them
        st["bytes_in_pieces"] = self._bytes_in_pieces(self._mine)
        # and of other nodes' shards, which their holders had no room for (the overflow):
        # whole copies too, where their holders held none of them, but for those it holds
        # for dead nodes now (counted on its re-replication line)
        others = self.stager.held_for_others - self._mine
        taken = self.rereplicator.taken
        st["bytes_for_others"] = self._bytes_in_pieces(
            others, whole={s for s in others if s not in taken})
        return {
            "rank": self.rank, "size": self.size, "host": self.server.address[0],
            "port": self.server.address[1], "pid": os.getpid(), "state": self.state,
            "staging": st,
            # with re-replication idle: a node copying from this one waits for it until then
            "staging_done": self.stager.done.is_set() and self.rereplicator.idle(),
            "primary_done": self.stager.primary_done,
            # rounds of the overflow done: the spares after this node wait on them
            "overflow_rounds": self.stager.overflow,
            "overflow_done": self.stager.overflow_done.is_set(),
            "staged_nodes": self.staged_nodes.text(),  # what its barrier knows (gossip)
            "placement": self.staged_nodes.placement,
            "rereplication": self.rereplicator.status(),
            "staging_error": None if self.stager.error is None else str(self.stager.error),
            "tiers": self._tier_usage(), "pack": self.pack,
            # files that failed their checksum: copied in staging, and read by this
            # node's processes (its readers, and the daemon)
            "reads": {"checksum_failures": self._reads_failed()},
            "peers_unreachable": st["peers_unreachable"] + self.progress_unreachable + sum(
                c.stats.failures for c in self.peers.values()),
            "checksum_failures": st["checksum_failures"],
            "bootstrap": self.boot.source,
            "transport": self.o.transport,
            **({} if self.transport is None else {"mpi": self.transport.status()}),
            "checks": dict(self.checks),
            "fabric": {"socket": self.fabric_path, "fd_limit": self.fd_limit,
                       "relay": self.relay.stats.as_dict(),
                       **({} if self.pipes is None else {"pipes": self.pipes.status()}),
                       **self._relay_peers()},
        }

    def _relay_peers(self) -> dict[str, Any]:
        """The relay's peers: batches hedged to another replica, requests given up on after
        the hedging delays, and the peers suspect now (skipped until they answer again)."""
        peers = [] if self.holders is None else list(self.holders.peers.values())
        return {"hedged": sum(p.hedged for p in peers),
                "gave_up": sum(p.gave_up for p in peers),
                "suspect_peers": sorted(n for n, c in self.peers.items() if c.is_suspect())}

    def _still_missing(self) -> set[int]:
        """The shards whose copies were deleted as bad and are not placed again yet (a
        stream of the tier chain may have placed one: looked up, one open at most)."""
        for shard in list(self._missing):
            if self.chain.locate(shard) is not None:
                self._missing.discard(shard)
        return set(self._missing)

    def _tier_usage(self) -> list[dict[str, Any]]:
        # used: what the tier's room counts (whole and partial copies, in its blocks), as
        # its capacity is checked against; a partial copy was shown as nothing
        return [{"path": t.root, "capacity": t.capacity, "stopped": t.stopped,
                 "used": self._used_bytes(t)} for t in self.chain.tiers]

    def _used_bytes(self, tier: DirTier) -> int:
        """The tier's ``used_bytes``; what it was last if it cannot be read now (out of
        descriptors: STATUS is answered all the same)."""
        try:
            self._used[tier.root] = tier.used_bytes()
        except OSError as exc:
            log.debug("%s: use not read: %s", tier.name, exc)
        return self._used.get(tier.root, 0)

    def _reads_failed(self) -> int:
        """Checksum failures of the reads of this node's processes (their counters in the
        runtime directory), summed at most once a second."""
        now = time.monotonic()
        if now - self._reads_at >= 1.0:
            self._reads_at = now
            # (they only grow: a listing that failed, out of descriptors, counts none)
            self._reads_bad = max(self._reads_bad, read_counts(
                self.lease.stats, self._reads_ended)["checksum_failures"])
        return self._reads_bad

    def cmap(self, staged: bool) -> ClusterMap:
        return ClusterMap(
            pack=self.pack, pack_id=self.manifest.pack_id.hex(), rank=self.rank,
            nodes=list(self.nodes), replicas=self.placement.replicas, seed=self.o.seed,
            everywhere=self.everywhere, replicate_all=list(self.o.replicate_all),
            tiers=[(t.path, t.capacity) for t in self.tier_specs], staged=staged,
            pid=os.getpid(), extra={"fabric": FABRIC_NAME} if self.fabric_path else {})

    # -- running -------------------------------------------------------------------------

    def run(self) -> int:
        self.server.start()
        self.state = "staging"
        stager = threading.Thread(target=self.stager.run, name="stagefs-stager", daemon=True)
        stager.start()
        if not self.o.wait:
            self._publish(False)
        reporter = None
        if self.rank == 0 and self.o.progress > 0:
            reporter = threading.Thread(target=self._report, name="stagefs-progress",
                                        daemon=True)
            reporter.start()
        _say(self.rank, f"node {self.rank}/{self.size} serving {self.pack} on "
             f"{self.server.address[0]}:{self.server.address[1]}, "
             f"{self.stager.stats.shards_assigned} shards "
             f"({format_size(self.stager.stats.bytes_assigned)}) to stage")
        while not self.stager.done.wait(0.2):
            if self.stop.is_set():
                break
        err = self.stager.error
        short = (isinstance(err, OSError) and err.errno in (errno.EMFILE, errno.ENFILE)) or \
            _free_descriptors() < _HEADROOM
        limit = ""
        if short:
            limit = (f" (this daemon's open-file limit, {self.fd_limit}, is reached: raise "
                     "it with ulimit -n before starting the daemons)")
            # room to serve what it holds: the origin's descriptors (one a shard it staged;
            # opened again when read) and the server's shard files go
            self.origin.close()
            self.server.make_room()
        if err is not None:
            _say(self.rank, f"staging failed: {err}{limit}; reads of the shards not staged "
                 "go to other nodes or the origin")
        elif short:
            st = self.stager.stats
            _say(self.rank, f"staged {st.shards_held} of its {st.shards_assigned} shards"
                 f"{limit}; reads of the others go to other nodes or the origin")
        elif not self.stop.is_set():
            told = staging_shortfall(self.stager.stats.shards_held,
                                     self.stager.stats.shards_assigned, self.chain.tiers)
            if told is not None:
                _say(self.rank, told)
        # deaths are watched for once this node has staged: while a large job starts, its
        # links and cores are busy with staging, and the stager itself waits for holders
        # that do not answer yet (staging.py), so a probe then proves little
        self.monitor = threading.Thread(target=self.rereplicator.run, name="stagefs-monitor",
                                        daemon=True)
        self.monitor.start()
        staged = self.boot.barrier(self.stop, self.peers, lambda: self.rereplicator.dead,
                                   self.staged_nodes)
        if staged:
            self.staged_at = time.time()
            self.state = "staged"
            self._publish(True)
            if reporter is not None:
                reporter.join(timeout=10)
            if self.rank == 0:
                self._final_report()
        while not self.stop.wait(0.5):
            pass
        self.state = "stopping"
        self.close()
        return 0

    def lost_peers(self) -> bool:
        """A peer is dead (its probes failed for --dead-after)."""
        return bool(self.rereplicator.dead)

    def _publish(self, staged: bool) -> None:
        """Write the runtime map for this node's readers. Out of descriptors, the server
        closes the shard files it can (opened again when read) and it is tried again
        every second, until it is written or the daemon stops."""
        told = False
        while True:
            try:
                write_map(self.runtime, self.cmap(staged), self.token)
                return
            except OSError as exc:
                if exc.errno not in (errno.EMFILE, errno.ENFILE):
                    raise
                if not told:
                    told = True
                    log.warning("the runtime map is not written: out of descriptors (the "
                                "open-file limit, %d); tried again every second",
                                self.fd_limit)
                self.server.make_room()
            if self.stop.wait(1.0):
                return

    def close(self) -> None:
        self.stop.set()
        self._interrupt_peers()  # (the monitor did it already if it ran: Rereplicator.run)
        self.server.close()  # and its relay
        self._checker.shutdown(wait=True, cancel_futures=True)  # a check under way ends
        if self.pipes is not None:
            self.pipes.close()
        if self.state != "starting":  # the stager ran: let it end the shard it copies
            self.stager.done.wait(30)
        if self.monitor is not None:  # and re-replication, the shard it copies
            self.monitor.join(60)
        if self.transport is not None:
            self.transport.close()
        self.chain.close()
        self.counts.close()
        for c in self.peers.values():
            c.close()
        remove_runtime(self.runtime)
        self.lease.unregister()
        if self.o.clean_on_exit:
            self._clean()

    def _interrupt_peers(self) -> None:
        """End every call blocked on a peer (a hung one held the stager, and the close
        that waits for it, for a reply deadline: 30 s, Slurm's whole KillWait), and fail
        the next ones at once: nothing waits on a peer once the daemon stops."""
        for c in self.peers.values():
            c.interrupt()

    def _clean(self, tries: int = 20) -> None:
        """What this job staged on this node goes with it: once the job's other processes
        on the node (its readers, being stopped with us by scancel or the job's end) are
        gone; while one still reads, kept, and said so. Data another live job uses stays."""
        for k in range(tries):
            try:
                for path in clean([self.lease], others=self.lease.jobs()):
                    log.info("removed %s", path)
                return
            except RuntimeInUseError:
                if k < tries - 1:
                    time.sleep(0.25)
                    continue
                # readers (stagefs.connect) still read them: one line, what and who
                log.warning("kept %s and %s: still used by %s; 'stagefs clean --runtime %s' "
                            "removes them once they end",
                            ", ".join(self.lease.tier_dirs()) or "no tier data", self.runtime,
                            "; ".join(map(str, self.lease.leases())) or "?", self.runtime)
                return

    def _gather(self) -> list[dict[str, Any] | None]:
        out: list[dict[str, Any] | None] = []
        for n in range(self.size):
            if n == self.rank:
                out.append(self.status())
                continue
            try:
                info = self.peers[n].status()
            except SourceUnavailable:
                self.progress_unreachable += 1
                out.append(None)
                continue
            why = unreadable(info)
            if why is not None and self._unreadable.get(n) != why:
                self._unreadable[n] = why
                said_unreadable(n, why)  # once a node (and kind)
            out.append(None if why is not None else info)
        return out

    def _report(self) -> None:
        t0 = time.monotonic()
        last_bytes, last_t = 0, t0
        while not self.stop.wait(self.o.progress):
            nodes = self._gather()
            dead = self.rereplicator.dead  # not waited for: the others copy their shards
            if all((s and s["staging_done"]) or n in dead for n, s in enumerate(nodes)):
                return  # the final report says it, with the time staging took: a rate over
                # this interval would count the time since staging ended
            done, total, lag = staging_progress(nodes, dead)
            now = time.monotonic()
            rate = (done - last_bytes) / (now - last_t) if now > last_t else 0.0
            last_bytes, last_t = done, now
            eta = (total - done) / rate if rate > 0 else float("inf")
            eta_s = f"{eta:.0f} s" if eta != float("inf") else "?"
            _say(0, f"staging: {format_size(done)} of {format_size(total)} "
                 f"({done / max(total, 1):.0%}), {format_size(rate)}/s, ETA {eta_s}"
                 + (f"; laggards: {', '.join(lag)}" if lag else ""))

    def _final_report(self) -> None:
        nodes = self._gather()
        if self.stop.is_set():
            # stopped meanwhile (the reporter's wait ends up to --progress after staging):
            # the peers stopping too answer no more, and a report of the few that did
            # ("staged ... on 1 nodes, 0.25x the dataset") would misstate the staging
            return
        ok = [s for s in nodes if s]
        origin = sum(s["staging"]["origin_bytes"] for s in ok)
        fwd = sum(s["staging"]["forwarded_bytes"] for s in ok)
        held = sum(s["staging"]["bytes_held"] for s in ok)
        pieces = sum(s["staging"].get("bytes_in_pieces", 0) for s in ok)
        dataset = sum(sh.size for sh in self.manifest.shards)
        took = max((s["staging"]["finished"] - s["staging"]["started"] for s in ok),
                   default=0.0)
        held_in = format_size(held) + (f" + {format_size(pieces)} in pieces" if pieces else "")
        _say(0, f"staged: {held_in} on {len(ok)} nodes in {took:.1f} s; origin "
             f"read {format_size(origin)} ({origin / max(dataset, 1):.2f}x the dataset), "
             f"{format_size(fwd)} forwarded between nodes")
        roomless = without_room(nodes, self.placement.replicas)
        if roomless:
            _say(0, roomless)


def staging_progress(nodes: Sequence[dict[str, Any] | None], dead: Collection[int]
                     ) -> tuple[int, int, list[str]]:
    """Bytes staged, bytes to stage, and the laggards (nodes below 75% of the mean progress
    of those still staging, then those that do not answer), for rank 0's progress lines. A
    node done staging is done: what its tiers had no room for is not to come (it was
    counted to stage, so the progress stopped short of 100% with no ETA while the others
    staged, and the node was named a laggard at its share, 21%, until the end)."""
    done = total = 0
    fracs: dict[int, float] = {}
    for i, s in enumerate(nodes):
        if not s:
            continue
        st = s["staging"]
        done += st["bytes_held"]
        if s.get("staging_done"):
            total += st["bytes_held"]
            continue
        total += max(st["bytes_assigned"], st["bytes_held"])
        fracs[i] = st["bytes_held"] / max(1, st["bytes_assigned"])
    mean = statistics.fmean(fracs.values()) if fracs else 0.0
    lag = [f"node {i} ({f:.0%})" for i, f in sorted(fracs.items(), key=lambda x: x[1])
           if f < 0.75 * mean][:5]
    lag += [f"node {i} ({'dead' if i in dead else 'unreachable'})"
            for i, s in enumerate(nodes) if s is None][:5]
    return done, total, lag


def staging_shortfall(held: int, assigned: int, tiers: Sequence[DirTier]) -> str | None:
    """What to tell the user when this node's tiers took only part of its share (full, or
    their file system out of space, at start or on the way): it said nothing, and only
    ``stagefs status --json`` named the tiers' ``stopped``. None when it staged all."""
    if held >= assigned:
        return None
    why = "; ".join(f"tier {t.root}: {t.stopped}" for t in tiers if t.stopped)
    head = (f"staged {held} of its {assigned} shards{': ' + why if why else ''}; reads of "
            "the others go to their other holders or the origin")
    if not why:
        return f"{head} ('stagefs status --json' counts them: staging)"
    return (f"{head}. Give the tiers more room (a larger --tier DIR:SIZE, free space on "
            "their file systems: df), another --tier, or more nodes")


DAEMON_LOCK = "daemon.lock"  # held by the runtime directory's daemon while it lives


def _only_daemon(runtime: str) -> Any:
    """Take the runtime directory's daemon lock, or refuse: a second daemon on it (the
    same command run twice) took the first one's place, its map, token and socket, and
    deleted them when it stopped, leaving the first serving no reader."""
    prepare_runtime(runtime)
    lock = hold_lock(os.path.join(runtime, DAEMON_LOCK))
    pid_file = os.path.join(runtime, DAEMON_PID)
    if lock is None:
        try:
            with open(pid_file) as f:
                who = f"pid {int(f.read().strip())}"
        except (OSError, ValueError):
            who = "another process"
        raise ConfigError(f"a stagefs daemon ({who}) already serves {runtime}: stop it "
                          "first ('stagefs status' shows its cluster), or give this one "
                          "another --runtime")
    atomic_write(pid_file, f"{os.getpid()}\n".encode())
    return lock


def _forget_dead_daemon(runtime: str) -> None:
    """A daemon starts on ``runtime``: what an earlier one left there no longer holds: the
    failure it recorded, and, if it was killed (SIGKILL after Slurm's KillWait, the OOM
    killer) and the job restarted on this node (requeued, its step run again), its map and
    token. Readers took them for this daemon's (with ``--wait``, before it had staged), and
    ``stagefs status --wait-staged`` asked the dead daemon's address until its time was up,
    instead of saying why this one could not start. A live daemon's are left: this one is
    refused (``_only_daemon``). A directory that is not this user's own is refused first,
    touching nothing in it (``prepare_runtime``)."""
    prepare_runtime(runtime)
    clear_failure(runtime)
    if not os.path.isdir(runtime):
        return
    lock = hold_lock(os.path.join(runtime, DAEMON_LOCK))
    if lock is None:
        return
    try:
        remove_runtime(runtime)
    finally:
        lock.release()


_HEADROOM = 32  # descriptors free after staging, at least: else it is short of them


def _free_descriptors(most: int = _HEADROOM) -> int:
    """How many more descriptors this process can open now (up to ``most``)."""
    fds: list[int] = []
    try:
        while len(fds) < most:
            fds.append(os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC))
    except OSError:
        pass
    finally:
        for fd in fds:
            os.close(fd)
    return len(fds)


def _can_open(path: str) -> bool:
    """Can this process open ``path`` (for reading) now? False only for want of descriptors
    (EMFILE, ENFILE): whatever else is wrong with the file is for its check to say."""
    try:
        os.close(os.open(path, os.O_RDONLY | os.O_CLOEXEC))
    except OSError as exc:
        return exc.errno not in (errno.EMFILE, errno.ENFILE)
    return True


def _tier_runtime(path: str) -> Runtime:
    """The daemon's runtime directory (refused if another user could enter it), with a lease
    for the daemon: ``stagefs clean`` refuses while it runs and removes its tier data after."""
    prepare_runtime(path)
    return Runtime(path).open()


def _say(rank: int, msg: str) -> None:
    print(f"stagefs[{rank}]: {msg}", file=sys.stderr, flush=True)


def serve(o: ServeOptions) -> int:
    """Run the daemon until SIGTERM/SIGINT; return the exit code."""
    if o.replicas < 1:
        raise ConfigError(f"--replicas must be at least 1 (got {o.replicas})")
    tune_malloc()  # the server and the stager move sample- and shard-sized buffers
    given = o.runtime or runtime_default()
    where = None if "{rank}" in given else os.path.abspath(given)  # (its rank not known yet)
    if where is not None:
        _forget_dead_daemon(where)
    try:
        d = Daemon(o)
    except (StagefsError, OSError) as exc:
        if where is not None:  # for 'stagefs status --wait-staged', which would wait on
            record_failure(where, str(exc))
        raise

    def _stop(signum: int, frame: object) -> None:
        d.stop.set()

    old = {s: signal.signal(s, _stop) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        code = d.run()
    finally:
        d.stop.set()
        for s, h in old.items():
            signal.signal(s, h)
    if not d.boot.finished(lost=d.lost_peers()):
        # --transport mpi with a peer dead: finalizing would wait for it forever
        _leave(code)
    # MPI_Finalize (--transport mpi, which used MPI to the end) waits for every rank, and
    # holds the interpreter while it does: one that died since its last probe would hold
    # it forever, so the kernel ends this process after FINALIZE_WAIT (SIGALRM's default
    # action; a thread of ours could not run)
    old_alarm = signal.signal(signal.SIGALRM, signal.SIG_DFL)
    signal.alarm(FINALIZE_WAIT)
    try:
        d.boot.finalize()
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old_alarm)
    return code


FINALIZE_WAIT = 30  # seconds
# the files in /dev/shm that MPI libraries map for their shared memory (MPICH; Open MPI)
MPI_SEGMENTS = ("mpich_shm_", "vader_segment.", "sm_segment.")


def _unlink_mpi_segments(maps: str = "/proc/self/maps") -> list[str]:
    """Remove the names of the MPI shared-memory segments this process maps in /dev/shm
    (call it once every rank is past MPI_Init: the node's ranks attached them there, and
    their mappings stay valid), so that an MPI_Finalize that never returns, or a kill,
    leaves none behind; the paths removed."""
    try:
        with open(maps) as f:
            fields = [line.split(None, 5) for line in f]
    except OSError:
        return []
    mapped = {f[5].strip() for f in fields if len(f) == 6}
    removed = []
    for path in sorted(mapped):
        if os.path.dirname(path) == "/dev/shm" and \
                os.path.basename(path).startswith(MPI_SEGMENTS):
            try:
                os.unlink(path)
            except OSError:
                continue
            removed.append(path)
    return removed


def _leave(code: int) -> None:
    """End this process at once (from any thread), its output flushed."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)

