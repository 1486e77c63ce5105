"""Who am I in the job: rank, size and host, from the launcher's environment or a hosts file.

Pure reading of the environment: no MPI import here (mpi4py is imported only by the daemon's
MPI bootstrap, never by training processes or DataLoader workers).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass

from stagefs import runtime as _runtime
from stagefs.errors import ConfigError
from stagefs.runtime import job_id

__all__ = ["ONE_PER_NODE", "SlurmStep", "World", "detect", "expand_hostlist", "job_id",
           "read_hosts", "runtime_default", "slurm_batch_nodes", "slurm_step",
           "under_mpi"]

# the srun options that start one task on each node of the job, whatever its #SBATCH
# --ntasks-per-node (srun inherits the job's SLURM_NTASKS, which overrides --ntasks-per-node)
ONE_PER_NODE = "srun --nodes=$SLURM_NNODES --ntasks=$SLURM_NNODES --ntasks-per-node=1"

# (rank variable, size variable, launcher), most specific first
_LAUNCHERS = (
    ("PMI_RANK", "PMI_SIZE", "mpi"),  # MPICH / Hydra, Intel MPI
    ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "mpi"),  # Open MPI
    ("PMIX_RANK", "PMIX_SIZE", "mpi"),
    ("SLURM_PROCID", "SLURM_NTASKS", "slurm"),
    ("RANK", "WORLD_SIZE", "torchrun"),
)

@dataclass(frozen=True, slots=True)
class World:
    rank: int
    size: int
    host: str
    source: str  # mpi, slurm, torchrun, static, single


def _int(env: Mapping[str, str], name: str) -> int | None:
    v = env.get(name, "")
    try:
        return int(v)
    except ValueError:
        return None


def detect(env: Mapping[str, str] | None = None) -> World:
    """Rank and size from MPI, Slurm or torchrun variables; else a world of one."""
    env = os.environ if env is None else env
    host = socket.gethostname()
    for rv, sv, source in _LAUNCHERS:
        rank, size = _int(env, rv), _int(env, sv)
        if rank is not None and size is not None and 0 <= rank < size:
            return World(rank, size, host, source)
    return World(0, 1, host, "single")


def under_mpi(env: Mapping[str, str] | None = None) -> bool:
    """Were we started by an MPI launcher (so MPI_Init will find its peers)?"""
    env = os.environ if env is None else env
    return any(k in env for k in ("PMI_RANK", "PMI_FD", "OMPI_COMM_WORLD_RANK", "PMIX_RANK",
                                  "HYDI_CONTROL_FD", "MPI_LOCALRANKID"))


_HOSTLIST_MAX = 1 << 20  # names one hostlist may expand to (a typo like n[1-9999999999])


def expand_hostlist(text: str, what: str = "hostlist") -> list[str]:
    """Slurm's hostlist syntax, expanded in its order: ``n[01-03,7],gpu[1-2]-ib`` gives
    n01 n02 n03 n07 gpu1-ib gpu2-ib. A range keeps the width of its first number
    (``[08-10]``: 08 09 10); several brackets in one name give every combination, the
    last varying fastest, as ``scontrol show hostnames`` does. Written here rather than
    taken from python-hostlist, whose GPL does not mix with our Apache-2.0."""

    def fail(why: str) -> ConfigError:
        return ConfigError(f"{what} {text!r}: {why} (expected e.g. 'node[01-04,7],gpu1')")

    def one(name: str) -> list[str]:
        out = [""]
        pos = 0
        while pos < len(name):
            lb = name.find("[", pos)
            if lb < 0:
                return [o + name[pos:] for o in out]
            rb = name.find("]", lb)
            if rb < 0 or "[" in name[lb + 1 : rb]:
                raise fail("a '[' without its ']'")
            values: list[str] = []
            for part in name[lb + 1 : rb].split(","):
                lo, dash, hi = part.strip().partition("-")
                if not lo.isdigit() or (dash and not hi.isdigit()):
                    raise fail(f"bad range {part!r}")
                a, b = int(lo), int(hi) if dash else int(lo)
                if b < a:
                    raise fail(f"range {part!r} runs backwards")
                if len(values) + b - a >= _HOSTLIST_MAX:
                    raise fail(f"more than {_HOSTLIST_MAX} names")
                values += [str(v).zfill(len(lo)) for v in range(a, b + 1)]
            prefix = name[pos:lb]
            out = [o + prefix + v for o in out for v in values]
            if len(out) > _HOSTLIST_MAX:
                raise fail(f"more than {_HOSTLIST_MAX} names")
            pos = rb + 1
        return out

    names: list[str] = []
    depth, start = 0, 0
    for i, c in enumerate(text + ","):
        if c == "[":
            depth += 1
        elif c == "]":
            depth -= 1
            if depth < 0:
                raise fail("a ']' without its '['")
        elif c == "," and depth == 0:
            item = text[start:i].strip()
            start = i + 1
            if item:
                names += one(item)
    if depth:
        raise fail("a '[' without its ']'")
    if not names:
        raise fail("names no host")
    return names


@dataclass(frozen=True, slots=True)
class SlurmStep:
    """This process's place in a Slurm job step launched with one task per node."""

    job: str
    node: int  # SLURM_NODEID: this node's index in the step
    hosts: list[str]  # the step's nodes, in Slurm's order


def slurm_step(env: Mapping[str, str] | None = None) -> SlurmStep | None:
    """The Slurm step this process is a task of (``srun`` sets SLURM_STEP_NODELIST), or None
    outside ``srun`` (a batch script itself, ``salloc``'s shell, no Slurm at all). Refuses a
    step with several tasks on a node: the daemons need exactly one per node."""
    env = os.environ if env is None else env
    nodelist, job = env.get("SLURM_STEP_NODELIST"), env.get("SLURM_JOB_ID")
    node = _int(env, "SLURM_NODEID")
    if not nodelist or not job or node is None:
        return None
    hosts = expand_hostlist(nodelist, "SLURM_STEP_NODELIST")
    nnodes = _int(env, "SLURM_STEP_NUM_NODES")
    if nnodes is not None and nnodes != len(hosts):
        raise ConfigError(f"SLURM_STEP_NODELIST {nodelist!r} names {len(hosts)} nodes but "
                          f"SLURM_STEP_NUM_NODES is {nnodes}")
    if not 0 <= node < len(hosts):
        raise ConfigError(f"SLURM_NODEID {node} is not a node of the step ({len(hosts)} "
                          "nodes)")
    ntasks = _int(env, "SLURM_STEP_NUM_TASKS")
    if ntasks is not None and ntasks != len(hosts):
        raise ConfigError(
            f"this srun step runs {ntasks} tasks on {len(hosts)} nodes; stagefs serve needs "
            f"one per node: {ONE_PER_NODE} stagefs serve ... (--ntasks too: in a job of "
            "several tasks a node, srun takes the job's task count and ignores "
            "--ntasks-per-node=1, with only a warning)")
    return SlurmStep(job, node, hosts)


def slurm_batch_nodes(env: Mapping[str, str] | None = None) -> int | None:
    """The node count of the Slurm job this process runs in outside any ``srun`` step (the
    batch script itself, ``salloc``'s shell), or None: no Slurm job, or a step of it. A
    daemon started there, not by ``srun``, serves its own node alone."""
    env = os.environ if env is None else env
    if not env.get("SLURM_JOB_ID") or env.get("SLURM_STEP_NODELIST"):
        return None
    for name in ("SLURM_JOB_NUM_NODES", "SLURM_NNODES"):
        n = _int(env, name)
        if n is not None:
            return n
    return None


def read_hosts(path: str) -> list[tuple[str, int | None]]:
    """A static hosts file: one ``ADDR`` or ``ADDR:PORT`` per line, rank 0 first; ``#``
    starts a comment. IPv6 addresses go in brackets: ``[fe80::1]:7070``."""
    try:
        with open(path) as f:
            lines = f.read().splitlines()
    except OSError as exc:
        raise ConfigError(f"hosts file {path}: {exc.strerror}") from None
    out: list[tuple[str, int | None]] = []
    for no, raw in enumerate(lines, 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        host, port = line, None
        if line.startswith("["):
            host, close, rest = line[1:].partition("]")
            if not close or (rest and not rest.startswith(":")):
                raise ConfigError(f"{path}:{no}: {line!r}: an IPv6 address goes in brackets, "
                                  "the port after them: [ADDR] or [ADDR]:PORT")
            if rest:
                port = _port(rest[1:], path, no)
        elif line.count(":") == 1:
            host, p = line.split(":")
            port = _port(p, path, no)
        if not host:
            raise ConfigError(f"{path}:{no}: no address on this line")
        if any(c.isspace() for c in line):
            raise ConfigError(f"{path}:{no}: {line!r}: one ADDR[:PORT] a line (a space "
                              "in it; a comment starts with #)")
        out.append((host, port))
    if not out:
        raise ConfigError(f"hosts file {path} names no host (one ADDR[:PORT] per line)")
    return out


def _port(text: str, path: str, no: int) -> int:
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 0 < port < 65536:  # (port 0: the daemon would listen where no peer looks)
        raise ConfigError(f"{path}:{no}: bad port {text!r} (a port is 1 to 65535)")
    return port


def runtime_default(env: Mapping[str, str] | None = None) -> str:
    """``$STAGEFS_RUNTIME``, else ``/dev/shm/stagefs-<uid>/<job id>`` (node-local, per user
    and job; the same rule as the single-node runtime)."""
    env = os.environ if env is None else env
    if env.get("STAGEFS_RUNTIME"):
        if not env["STAGEFS_RUNTIME"].strip():
            raise ConfigError("$STAGEFS_RUNTIME is blank: name a node-local directory, or "
                              "unset it for the default")
        return os.path.abspath(env["STAGEFS_RUNTIME"])
    return os.path.join(_runtime._default_base(), job_id(env))
