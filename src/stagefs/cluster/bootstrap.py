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

import os
import threading
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from xxhash import xxh3_64_intdigest

from stagefs.cluster.world import SlurmStep
from stagefs.errors import ClusterError
from stagefs.net import auth
from stagefs.net.client import PeerClient
from stagefs.tiers.base import SourceUnavailable

__all__ = ["Bootstrap", "MpiBootstrap", "SingleBootstrap", "SlurmBootstrap", "StaticBootstrap",
           "secret_path"]


class Bootstrap(Protocol):
    rank: int
    size: int
    source: str

    def token(self) -> bytes: ...

    def exchange(self, address: tuple[str, int]) -> list[tuple[str, int]]: ...

    def barrier(self, stop: threading.Event, status: dict[int, PeerClient],
                gone: Callable[[], frozenset[int]] = frozenset) -> bool:
        """Wait until every node has staged, but those ``gone()`` names (found dead: their
        shards are copied again by the others); False if stopped first."""
        ...

    def finished(self, lost: bool = False) -> bool:
        """True if the process may end normally; ``lost``: a peer is dead or not answering
        (under MPI, finalizing would wait for it forever)."""
        ...


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

    def barrier(self, stop: threading.Event, status: dict[int, PeerClient],
                gone: Callable[[], frozenset[int]] = frozenset) -> bool:
        return not stop.is_set()

    def finished(self, lost: bool = False) -> bool:
        return True


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
        self.comm: Any = MPI.COMM_WORLD
        self.rank, self.size = int(self.comm.Get_rank()), int(self.comm.Get_size())

    def token(self) -> bytes:
        tok = auth.new_token() if self.rank == 0 else None
        got = self.comm.bcast(tok, root=0)
        if not isinstance(got, bytes):
            raise ClusterError("the job token broadcast from rank 0 failed")
        return got

    def exchange(self, address: tuple[str, int]) -> list[tuple[str, int]]:
        return [(str(h), int(p)) for h, p in self.comm.allgather(address)]

    def barrier(self, stop: threading.Event, status: dict[int, PeerClient],
                gone: Callable[[], frozenset[int]] = frozenset) -> bool:
        # over the protocol, not MPI: an MPI barrier would wait forever for a rank that
        # died (and, in MPICH without fault tolerance, end the ranks that wait), while a
        # node that dies must cost the others nothing; after the token and the addresses
        # this process calls MPI no more (unless --transport mpi)
        return ask_until_staged(stop, status, gone)

    def finished(self, lost: bool = False) -> bool:
        # MPI_Finalize waits for every rank: with one lost it would wait forever
        return not lost


class StaticBootstrap:
    """A hosts file (rank i on line i) and a shared token file; no MPI.

    The barrier asks every peer over the protocol until each says it has staged.
    """

    source = "static"

    def __init__(self, hosts: list[tuple[str, int | None]], rank: int, token_file: str | None,
                 default_port: int) -> None:
        if not 0 <= rank < len(hosts):
            raise ClusterError(f"--rank {rank} is not a line of the hosts file "
                               f"({len(hosts)} hosts: ranks 0..{len(hosts) - 1})")
        self.rank, self.size = rank, len(hosts)
        self.hosts = [(h, p if p is not None else default_port) for h, p in hosts]
        if not token_file:
            raise ClusterError(
                "the static bootstrap needs the job token in a file every node can read: "
                "--token-file FILE (make one with 'stagefs serve --new-token FILE')"
            )
        self._token = auth.read_token(token_file, _NO_TOKEN_FILE)

    def token(self) -> bytes:
        return self._token

    def exchange(self, address: tuple[str, int]) -> list[tuple[str, int]]:
        return list(self.hosts)

    def barrier(self, stop: threading.Event, status: dict[int, PeerClient],
                gone: Callable[[], frozenset[int]] = frozenset) -> bool:
        return ask_until_staged(stop, status, gone)

    def finished(self, lost: bool = False) -> bool:
        return True


def ask_until_staged(stop: threading.Event, status: dict[int, PeerClient],
                     gone: Callable[[], frozenset[int]] = frozenset) -> bool:
    """The barrier of every bootstrap with peers: ask each peer over the protocol until it
    says it has staged, those ``gone()`` names excepted; False if ``stop`` is set first."""
    waiting = set(status)
    pause = 0.2  # growing to 2 s: N nodes asking N peers must not fill their links
    while waiting and not stop.is_set():
        # a node that died before it staged is not waited for (it would be forever):
        # the live ones copy its shards again (rereplicate.py) and say so when done
        waiting -= gone()
        for n in list(waiting):
            try:
                if status[n].status().get("staging_done"):
                    waiting.discard(n)
            except SourceUnavailable:
                pass
        if waiting:
            stop.wait(pause)
            pause = min(pause * 1.5, 2.0)
    return not stop.is_set()


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
