"""How the daemons of one job find each other: MPI, a static hosts file, or a node alone.

Each bootstrap gives the daemon its rank and size, exchanges the server addresses (an
allgather), hands out the job token (rank 0 makes it), and waits until every node has staged
(a barrier, over the protocol for every bootstrap: a node that dies is not waited for). MPI
(mpi4py) is imported only by ``MpiBootstrap``, and used only for the rank, the token and
the addresses, so that the daemons outlive a rank that dies (under a launcher that lets
them: ``mpiexec -disable-auto-cleanup``). This module is used by the daemon alone, never by
training processes or their DataLoader workers.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import signal
import socket
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

from xxhash import xxh3_64_intdigest

from stagefs.cluster.world import ONE_PER_NODE, SlurmStep, World, detect
from stagefs.errors import ClusterError, StagefsError
from stagefs.net import auth
from stagefs.net.client import PeerClient
from stagefs.net.sockio import host_port
from stagefs.tiers.base import SourceUnavailable

__all__ = ["Bootstrap", "MpiBootstrap", "SingleBootstrap", "SlurmBootstrap", "StagedNodes",
           "StaticBootstrap", "barrier_round", "placed", "secret_path"]


class Bootstrap(Protocol):
    rank: int
    size: int
    source: str

    def token(self) -> bytes: ...

    def exchange(self, address: tuple[str, int]) -> list[tuple[str, int]]: ...

    def agree(self, failure: BaseException | None, runtime: str | None = None) -> None:
        """A step of the start done (``failure``: what went wrong here, if anything):
        raise if it failed here, or (MPI) on any rank, so that every daemon stops at the
        same point with an error naming the nodes that failed, instead of waiting forever
        in the next collective for one that left. ``runtime``: this daemon's runtime
        directory (two daemons of one MPI job sharing it on one node are refused)."""
        ...

    def barrier(self, stop: threading.Event, status: dict[int, PeerClient],
                gone: Callable[[], frozenset[int]] = frozenset,
                known: StagedNodes | None = None) -> bool:
        """Wait until every node has staged, but those ``gone()`` names (found dead: their
        shards are copied again by the others); False if stopped first. ``known``: where
        what this node learns is kept (its STATUS answers it to the others)."""
        ...

    def finished(self, lost: bool = False) -> bool:
        """True if the process may end normally; ``lost``: a peer is dead (under MPI,
        finalizing would wait for it forever)."""
        ...

    def finalize(self) -> None:
        """Let go of what the bootstrap holds (MPI: ``MPI_Finalize``, which waits for every
        rank)."""
        ...


log = logging.getLogger("stagefs.bootstrap")


def _raise(failure: BaseException | None) -> None:
    """``agree`` of the bootstraps without collectives: this node's failure is its own."""
    if failure is not None:
        raise failure

_NO_TOKEN_FILE = ("no such token file (--token-file): make one with 'stagefs serve "
                  "--new-token FILE' where every node can read it")


class SingleBootstrap:
    source = "single"

    def __init__(self, token_file: str | None = None) -> None:
        self.rank, self.size = 0, 1
        self._token = auth.read_token(token_file, _NO_TOKEN_FILE) if token_file else \
            auth.new_token()

    def token(self) -> bytes:
        return self._token

    def exchange(self, address: tuple[str, int]) -> list[tuple[str, int]]:
        return [address]

    def agree(self, failure: BaseException | None, runtime: str | None = None) -> None:
        _raise(failure)

    def barrier(self, stop: threading.Event, status: dict[int, PeerClient],
                gone: Callable[[], frozenset[int]] = frozenset,
                known: StagedNodes | None = None) -> bool:
        return not stop.is_set()

    def finished(self, lost: bool = False) -> bool:
        return True

    def finalize(self) -> None:
        pass


class MpiBootstrap:
    """Ranks, allgather of addresses and broadcast of the token through MPI; the barrier
    over the protocol."""

    source = "mpi"

    def __init__(self, asked: bool = False) -> None:
        """``asked``: --mpi was given (else an MPI launcher's variables were seen)."""
        try:
            import mpi4py

            mpi4py.rc.thread_level = "funneled"  # only the main thread calls MPI
            from mpi4py import MPI
        except (ImportError, RuntimeError, OSError) as exc:  # no mpi4py, or no libmpi
            why = "--mpi was given" if asked else "an MPI launcher started this process"
            raise ClusterError(
                f"{why} but MPI cannot be used: mpi4py or the MPI library it loads "
                f"(MPICH) is missing ({exc}). Install both with: pip install "
                "'stagefs[mpi]'; or bootstrap without MPI: --hosts FILE --rank N "
                "--token-file FILE (static; under Slurm, the hosts from 'scontrol show "
                "hostnames' and the rank from $SLURM_NODEID, see docs/cluster.md)"
            ) from None
        self._mpi: Any = MPI
        self.comm: Any = MPI.COMM_WORLD
        self.rank, self.size = int(self.comm.Get_rank()), int(self.comm.Get_size())
        launched = detect()  # what the launcher says of this process: its variables
        if self.size == 1 and launched.size > 1:
            # each process initialised MPI alone (a singleton): every node would be a
            # cluster of one, staging the whole dataset from the origin, sharing nothing
            raise ClusterError(_alone(launched, MPI))

    def token(self) -> bytes:
        tok = auth.new_token() if self.rank == 0 else None
        got = self.comm.bcast(tok, root=0)
        if not isinstance(got, bytes):
            raise ClusterError("the job token broadcast from rank 0 failed")
        return got

    def exchange(self, address: tuple[str, int]) -> list[tuple[str, int]]:
        return [(str(h), int(p)) for h, p in self.comm.allgather(address)]

    def agree(self, failure: BaseException | None, runtime: str | None = None) -> None:
        # Every collective of the start (the token's broadcast, the addresses' allgather,
        # the transport's communicator) waits for every rank: a rank that failed before it
        # and left (in MPI_Finalize at exit, itself waiting for the others) held the whole
        # job forever, each rank spinning a core, its error naming no node. So each step of
        # the start ends with this allgather of what failed where, and every rank stops.
        host = socket.gethostname()
        said: list[tuple[str, str | None, str | None]] = self.comm.allgather(
            (host, runtime, None if failure is None else _why(failure)))
        failed = [(r, h, why) for r, (h, _, why) in enumerate(said) if why is not None]
        twice = _sharing(said)  # (the second one's failure says only that the first holds it)
        if twice is not None:
            (a, b), (h, rt) = twice
            raise ClusterError(
                f"nodes {a} and {b} are two daemons on one host ({h}) with one runtime "
                f"directory ({rt}): launch one daemon per node (mpiexec -ppn 1, "
                f"{ONE_PER_NODE}); for a test cluster on one machine give each its own: "
                "--runtime 'DIR{rank}' and --tier 'DIR{rank}'")
        if failure is not None and not isinstance(failure, (StagefsError, OSError)):
            raise failure  # a bug: its traceback (the others stop, naming this node)
        if failure is not None:
            raise ClusterError(f"node {self.rank} ({host}): {_why(failure)}") from None
        if failed:
            shown = "; ".join(f"node {r} ({h}): {why}" for r, h, why in failed[:_SHOWN])
            more = f"; and {len(failed) - _SHOWN} more" if len(failed) > _SHOWN else ""
            raise ClusterError(
                f"{len(failed)} of the {self.size} daemons could not start, and this one "
                f"(node {self.rank}, {host}) stops with them (the daemons of an MPI job start "
                f"together): {shown}{more}")

    def barrier(self, stop: threading.Event, status: dict[int, PeerClient],
                gone: Callable[[], frozenset[int]] = frozenset,
                known: StagedNodes | None = None) -> bool:
        # over the protocol, not MPI: an MPI barrier would wait forever for a rank that
        # died (and, in MPICH without fault tolerance, end the ranks that wait), while a
        # node that dies must cost the others nothing; after the token and the addresses
        # this process calls MPI no more (unless --transport mpi)
        return ask_until_staged(stop, status, gone, known, self.rank)

    def finished(self, lost: bool = False) -> bool:
        # MPI_Finalize waits for every rank: with one lost it would wait forever
        return bool(self._mpi.Is_finalized()) or not lost

    def finalize(self) -> None:
        if self._mpi.Is_finalized():
            return
        self._mpi.Finalize()
        # MPICH's launcher tells the ranks of a rank's death with SIGUSR1, news for an MPI
        # this process no longer uses: ignored, whatever handler the library left
        with contextlib.suppress(ValueError):  # (not the main thread: left as it is)
            signal.signal(signal.SIGUSR1, signal.SIG_IGN)


_SHOWN = 5  # failed nodes named in the others' error


def _alone(launched: World, mpi: Any) -> str:
    """Why MPI sees a job of one rank where the launcher started ``launched.size``
    processes, and what to do."""
    try:
        library = " ".join(str(mpi.Get_library_version()).strip().splitlines()[0].split())
    except Exception:  # (only to name it)
        library = "the MPI library mpi4py loads"
    who = "srun" if launched.source == "slurm" else "the launcher"
    head = (f"{who} started {launched.size} processes (this is number {launched.rank}) but "
            "MPI sees each as a job of its own, of one rank: every node would stage the "
            "whole dataset alone, a cluster of one")
    if launched.source == "slurm":
        return (f"{head}. srun started the tasks without MPI (no PMI): give srun --mpi=pmi2 "
                "(or pmix; 'srun --mpi=list' shows what this Slurm has) for --mpi or "
                "--transport mpi; or use the Slurm bootstrap over TCP: no --mpi, "
                "--transport tcp (docs/cluster.md, Slurm batch script)")
    return (f"{head}. The launcher is another MPI's than the library mpi4py loads "
            f"({library}): start the daemons with that library's mpiexec (pip install "
            "'stagefs[mpi]' gives MPICH's), or install mpi4py built for your MPI "
            "(pip install --no-binary mpi4py mpi4py with its mpicc on PATH)")


def _why(failure: BaseException) -> str:
    """What went wrong, for the other ranks: the message, else the exception's type."""
    return str(failure) or type(failure).__name__


def _sharing(said: Sequence[tuple[str, str | None, str | None]]
             ) -> tuple[tuple[int, int], tuple[str, str]] | None:
    """The first two ranks of ``said`` (host, runtime, failure) on one host with one
    runtime directory, with that host and directory; None if there are none."""
    first: dict[tuple[str, str], int] = {}
    for r, (host, rt, _) in enumerate(said):
        if rt is None:
            continue
        if (host, rt) in first:
            return (first[host, rt], r), (host, rt)
        first[host, rt] = r
    return None


class StaticBootstrap:
    """A hosts file (rank i on line i) and a shared token file; no MPI.

    The barrier asks every peer over the protocol until each says it has staged.
    """

    source = "static"

    def __init__(self, hosts: list[tuple[str, int | None]], rank: int, token_file: str | None,
                 default_port: int,
                 resolve: Callable[[str, int], frozenset[tuple[str, int]]] | None = None
                 ) -> None:
        """``resolve``: a host's addresses (the default asks the resolver; tests give
        theirs)."""
        if not 0 <= rank < len(hosts):
            raise ClusterError(f"--rank {rank} is not a line of the hosts file "
                               f"({len(hosts)} hosts: ranks 0..{len(hosts) - 1})")
        self.rank, self.size = rank, len(hosts)
        self.hosts = [(h, p if p is not None else default_port) for h, p in hosts]
        if any(p == 0 for _, p in self.hosts):
            raise ClusterError("--port 0 with a hosts file: the daemons would listen where "
                               "no peer looks; give each line its ADDR:PORT, or --port N")
        first: dict[tuple[str, int], int] = {}
        for i, addr in enumerate(self.hosts):
            if addr in first:  # one daemon would be two nodes (and count itself staged)
                raise ClusterError(
                    f"the hosts file names {host_port(*addr)} twice (for ranks "
                    f"{first[addr]} and {i}): each node's daemon needs an address of its "
                    "own; give two daemons on one host different ports (ADDR:PORT)")
            first[addr] = i
        # the same daemon under two names (a host name and its IP, localhost and 127.0.0.1):
        # as above, one daemon would be two nodes
        _same_daemon_twice(self.hosts, resolve)
        if not token_file:
            raise ClusterError(
                "the static bootstrap needs the job token in a file every node can read: "
                "--token-file FILE (make one with 'stagefs serve --new-token FILE')"
            )
        self._token = auth.read_token(token_file, _NO_TOKEN_FILE)

    def token(self) -> bytes:
        return self._token

    def reaching(self, rank: int,
                 look: Callable[[str, int], frozenset[tuple[str, int]]] | None = None
                 ) -> list[int]:
        """The other ranks whose lines reach ``rank``'s address (IP and port), their names
        looked up now (``look``: the name service, unless given): asked by a daemon that
        cannot listen at its address, which another line's daemon may hold (one node named
        twice: a host name and its IP). One node asks, after a failure: not the flood of
        every node asking at start."""
        look = look or look_up
        mine = look(*self.hosts[rank])
        return [i for i, addr in enumerate(self.hosts)
                if i != rank and addr[1] == self.hosts[rank][1] and look(*addr) & mine]

    def exchange(self, address: tuple[str, int]) -> list[tuple[str, int]]:
        return list(self.hosts)

    def agree(self, failure: BaseException | None, runtime: str | None = None) -> None:
        # no collective to stop the others in: a node that does not start is waited for
        # 4 x --dead-after, then found dead (its shards copied by the others)
        _raise(failure)

    def barrier(self, stop: threading.Event, status: dict[int, PeerClient],
                gone: Callable[[], frozenset[int]] = frozenset,
                known: StagedNodes | None = None) -> bool:
        return ask_until_staged(stop, status, gone, known, self.rank)

    def finished(self, lost: bool = False) -> bool:
        return True

    def finalize(self) -> None:
        pass


def look_up(host: str, port: int) -> frozenset[tuple[str, int]]:
    """The addresses (IP, port) the name service gives ``host``; none if it gives none."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        return frozenset()
    return frozenset((str(a[4][0]).split("%", 1)[0], int(a[4][1])) for a in infos)


_LOCAL_NAMES = frozenset({"localhost", "localhost.localdomain", "ip6-localhost",
                          "ip6-loopback"})


def resolve_host(host: str, port: int) -> frozenset[tuple[str, int]]:
    """The addresses (IP, port) ``host`` stands for, found with no name service: an IP
    address, or a loopback name. Other names are not looked up here (none: every node of a
    job of thousands asking the name service for every other's name at once would flood
    it); a node listed twice under such names is found when its daemon answers as another
    rank (``StagedNodes.misplaced``)."""
    flags = 0 if host.lower() in _LOCAL_NAMES else socket.AI_NUMERICHOST
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=flags)
    except (OSError, UnicodeError):
        return frozenset()
    return frozenset((str(ai[4][0]).split("%", 1)[0], int(ai[4][1])) for ai in infos)


def _same_daemon_twice(hosts: Sequence[tuple[str, int]],
                       resolve: Callable[[str, int], frozenset[tuple[str, int]]] | None
                       ) -> None:
    """Refuse a hosts file whose two lines reach one address: the same node by two names
    (a host name and its IP; localhost and 127.0.0.1). Its daemon would be two nodes: it
    asked itself whether the other had staged, said yes, and no daemon staged that node's
    shards (a second daemon started for the other line cannot listen there)."""
    look = resolve or resolve_host
    names = sorted(set(hosts))
    if len(names) > 1:
        with ThreadPoolExecutor(min(16, len(names)), thread_name_prefix="stagefs-resolve"
                                ) as ex:
            addrs = dict(zip(names, ex.map(lambda a: look(*a), names), strict=True))
    else:
        addrs = {a: frozenset() for a in names}
    seen: dict[tuple[str, int], int] = {}
    for i, addr in enumerate(hosts):
        for ip in addrs[addr]:
            j = seen.setdefault(ip, i)
            if j != i and hosts[j] != addr:
                raise ClusterError(
                    f"the hosts file names one daemon's address twice: "
                    f"{host_port(*hosts[j])} (rank {j}) and {host_port(*addr)} (rank {i}) "
                    f"both reach {host_port(*ip)}: list each node once, by one name; give two "
                    "daemons on one host different ports (ADDR:PORT)")


FAN = 4  # peers a node asks each round of the staged barrier


class StagedNodes:
    """The nodes this node knows have staged: what its barrier learned, answered in its
    STATUS (``staged_nodes``, a hexadecimal bit mask) so that the others learn it too."""

    def __init__(self, rank: int | None = None,
                 placement: Mapping[str, Any] | None = None) -> None:
        self.rank = rank  # this node's (a peer's address answered by this daemon: said so)
        self.placement = dict(placement or {})  # what this node placed the shards with
        self._mask = 0
        self._lock = threading.Lock()
        self.elsewhere: dict[int, int] = {}  # node -> the rank the daemon there says it is
        self.placed_apart: dict[int, str] = {}  # node -> the key of its other placement

    def disagrees(self, node: int, theirs: object) -> bool:
        """Does the daemon at ``node`` place the shards apart from this one (another
        ``--replicas``, ``--seed`` or ``--replicate-all``: one restarted with other
        arguments)? Said once for each placement it has; such a node is not counted staged
        until it agrees: each of the two would look for shards where the other did not put
        them, and hold fewer copies than the job was asked for, while both said staged."""
        mine = self.placement.get("key")
        other: Mapping[str, Any] = theirs if isinstance(theirs, Mapping) else {}
        key = other.get("key")
        if mine is None or key is None or key == mine:  # (None: an older daemon's STATUS)
            self.placed_apart.pop(node, None)
            return False
        if self.placed_apart.get(node) != key:
            self.placed_apart[node] = str(key)
            log.warning("node %d places the shards with %s, this node with %s: every daemon "
                        "of a job must be given the same --replicas, --seed and "
                        "--replicate-all (restart it with the others' arguments); node %d "
                        "is not counted staged until it agrees", node, placed(other),
                        placed(self.placement), node)
        return True

    def misplaced(self, node: int, says: object) -> None:
        """The daemon at ``node``'s address answers as another rank: the nodes' hosts files
        (or launchers) disagree on who is who. It is not counted staged, and said once:
        placement is computed from the ranks, so each node would look for shards where
        another placed them."""
        if self.elsewhere.get(node) == says:
            return
        self.elsewhere[node] = says if isinstance(says, int) else -1
        if says == self.rank:
            log.warning("node %d's address reaches this daemon (rank %s): the hosts file "
                        "names one daemon twice (a host name and its IP?): list each node "
                        "once, by one name; node %d is not counted staged", node, says, node)
            return
        log.warning("the daemon at node %d's address says it is rank %s: the nodes do not "
                    "agree on who is who (a hosts file that differs between nodes, or lines "
                    "in another order): give every daemon the same hosts file, rank i on "
                    "line i; node %d is not counted staged until it agrees", node, says, node)

    def add(self, node: int) -> None:
        with self._lock:
            self._mask |= 1 << node

    def merge(self, text: object, size: int) -> None:
        """What a peer says it knows (ignored unless a mask of nodes below ``size``)."""
        if not isinstance(text, str) or len(text) > size // 4 + 1:
            return
        try:
            mask = int(text, 16)
        except ValueError:
            return
        with self._lock:
            self._mask |= mask & ((1 << size) - 1)

    def nodes(self) -> frozenset[int]:
        mask = self._mask
        return frozenset(n for n in range(mask.bit_length()) if mask >> n & 1)

    def text(self) -> str:
        return format(self._mask, "x")


def placed(p: Mapping[str, Any]) -> str:
    """A placement's settings as the options that give them."""
    every = p.get("replicate_all") or ()
    return (f"--replicas {p.get('replicas')} --seed {p.get('seed')} --replicate-all "
            f"{' '.join(map(str, every)) if every else '(none)'} on {p.get('nodes')} nodes")


def barrier_round(status: Mapping[int, PeerClient], known: StagedNodes, size: int,
                  gone: frozenset[int], rng: random.Random, fan: int = FAN) -> bool:
    """One round of the staged barrier: True if every peer but those ``gone`` is known to
    have staged, else ask ``fan`` live peers at random (all of them, if no more) whether
    they have, and what they know. A node learns of a laggard's end from it directly
    (each asks it with odds fan/N: about ``fan`` askers a round, not N) or from a peer that
    did, so the news spreads in O(log N) rounds and no node is asked by every other."""
    live = [n for n in status if n not in gone]
    done = known.nodes()
    apart = known.elsewhere.keys() | known.placed_apart.keys()
    if all(n in done for n in live) and not apart - gone:
        return True
    for n in live if len(live) <= fan else rng.sample(live, fan):
        try:
            info = status[n].status()
        except SourceUnavailable:
            continue
        says = info.get("rank", n)
        if says != n:  # another node's daemon is at its address: not this one's peer n
            known.misplaced(n, says)
            continue
        known.elsewhere.pop(n, None)
        if known.disagrees(n, info.get("placement")):
            continue  # its view of who holds what is not this node's
        if info.get("staging_done"):
            known.add(n)
        known.merge(info.get("staged_nodes"), size)
    done = known.nodes()
    # (a peer answering as another rank, or placing the shards apart: what the others say
    # of it is not this node's)
    apart = known.elsewhere.keys() | known.placed_apart.keys()
    return all(n in done for n in live) and not apart - gone


def ask_until_staged(stop: threading.Event, status: Mapping[int, PeerClient],
                     gone: Callable[[], frozenset[int]] = frozenset,
                     known: StagedNodes | None = None, rank: int = 0) -> bool:
    """The barrier of every bootstrap with peers, over the protocol: rounds of
    ``barrier_round`` until every node has staged, those ``gone()`` names excepted (a node
    that died before it staged would be waited for forever: the live ones copy its shards
    again, rereplicate.py, and say so when done); False if ``stop`` is set first."""
    known = StagedNodes(rank) if known is None else known
    known.add(rank)  # called once this node has staged
    size = max([rank, *status]) + 1
    rng = random.Random(rank)
    pause = 0.2  # growing to 2 s
    while not stop.is_set():
        if barrier_round(status, known, size, gone(), rng):
            return True
        stop.wait(pause)
        pause = min(pause * 1.5, 2.0)
    return False


def secret_path(env: Mapping[str, str] | None = None) -> str:
    """Where the user's secret lives: ``$STAGEFS_SECRET``, else
    ``~/.config/stagefs/secret`` (the home directory is shared by a cluster's nodes)."""
    env = os.environ if env is None else env
    return env.get("STAGEFS_SECRET") or os.path.join(
        env.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config"),
        "stagefs", "secret")


class SlurmBootstrap(StaticBootstrap):
    """Slurm alone, neither MPI nor PMI: the daemons are the tasks of one ``srun`` step with
    one task per node. The hosts are the step's nodes (SLURM_STEP_NODELIST, expanded), the
    rank is SLURM_NODEID, the port is the same on every node (``--port``, else one derived
    from the job id, so two jobs sharing a node do not collide), and the token is derived
    from the job id and the user's secret (or read from ``--token-file``). The barrier is
    the static one: ask every peer until each says it has staged."""

    source = "slurm"

    def __init__(self, step: SlurmStep, token_file: str | None, port: int | None) -> None:
        port = port if port is not None else slurm_port(step.job)
        path = token_file or secret_path()
        self.rank, self.size = step.node, len(step.hosts)
        self.hosts = [(h, port) for h in step.hosts]
        self._token = auth.read_token(path, _NO_TOKEN_FILE) if token_file else \
            auth.job_token(step.job, path)


def slurm_port(job: str, base: int = 20000, span: int = 20000) -> int:
    """The daemons' port for a job when none is given: the same on every node, and
    different for most pairs of jobs (two jobs sharing a node would otherwise collide)."""
    return base + xxh3_64_intdigest(job.encode()) % span


def new_token_file(path: str) -> None:
    """Write a fresh job token for the static bootstrap (mode 0600)."""
    if os.path.exists(path):
        raise ClusterError(f"{path} exists; remove it or name another file")
    auth.write_token(path, auth.new_token())
