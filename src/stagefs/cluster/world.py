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

__all__ = ["World", "detect", "job_id", "read_hosts", "runtime_default", "under_mpi"]

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
            host, _, rest = line[1:].partition("]")
            if rest.startswith(":"):
                port = _port(rest[1:], path, no)
        elif line.count(":") == 1:
            host, p = line.split(":")
            port = _port(p, path, no)
        if not host:
            raise ConfigError(f"{path}:{no}: no address on this line")
        out.append((host, port))
    if not out:
        raise ConfigError(f"hosts file {path} names no host (one ADDR[:PORT] per line)")
    return out


def _port(text: str, path: str, no: int) -> int:
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 0 <= port < 65536:
        raise ConfigError(f"{path}:{no}: bad port {text!r}")
    return port


def runtime_default(env: Mapping[str, str] | None = None) -> str:
    """``$STAGEFS_RUNTIME``, else ``/dev/shm/stagefs-<uid>/<job id>`` (node-local, per user
    and job; the same rule as the single-node runtime)."""
    env = os.environ if env is None else env
    if env.get("STAGEFS_RUNTIME"):
        return os.path.abspath(env["STAGEFS_RUNTIME"])
    return os.path.join(_runtime._default_base(), job_id(env))
