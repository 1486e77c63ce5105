"""The cluster map: what a daemon writes into its node's runtime directory for readers.

``<runtime>/cluster.json`` (the map) and ``<runtime>/token`` (the job token, mode 0600),
in a directory of mode 0700. Everything a training process needs to reach the whole
dataset: the pack, every node's address, the placement parameters, this node's tiers.
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
from dataclasses import asdict, dataclass, field
from typing import Any

from stagefs._fsutil import atomic_write, open_read, unreachable
from stagefs.errors import ClusterError, StagefsError
from stagefs.net.auth import read_token, write_token
from stagefs.runtime import private_dir

__all__ = ["MAP_NAME", "TOKEN_NAME", "ClusterMap", "check_runtime_access", "load_runtime",
           "prepare_runtime", "remove_runtime", "write_map"]

MAP_NAME = "cluster.json"
TOKEN_NAME = "token"
DAEMON_PID = "daemon.pid"  # the runtime directory's daemon, once it holds the directory
FAILED_NAME = "daemon.failed"  # why the daemon of this runtime could not start
MAP_VERSION = 1
_MAP_MAX = 64 * 2**20  # far above any map (a line per node): what is longer is damage


@dataclass(frozen=True)
class ClusterMap:
    pack: str  # the pack directory (the origin), as every node sees it
    pack_id: str  # hex
    rank: int  # the node this runtime belongs to
    nodes: list[tuple[str, int]]  # rank -> (address, port)
    replicas: int
    seed: int
    everywhere: list[int]  # shards placed on every node (--replicate-all)
    replicate_all: list[str]
    tiers: list[tuple[str, int | None]]  # this node's tiers: directory, capacity
    staged: bool = False
    pid: int = 0
    version: int = MAP_VERSION
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def size(self) -> int:
        return len(self.nodes)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str, where: str) -> ClusterMap:
        try:
            d = json.loads(text)
            if not isinstance(d, dict):
                raise TypeError("not a JSON object")
            if d.get("version") != MAP_VERSION:
                raise ClusterError(f"{where}: cluster map version {d.get('version')}; this "
                                   f"stagefs reads {MAP_VERSION}: use the daemon's stagefs")
            bytes.fromhex(d["pack_id"])  # (a ValueError if it is not hex)
            d["nodes"] = [(str(h), int(p)) for h, p in d["nodes"]]
            d["tiers"] = [(str(p), None if c is None else int(c)) for p, c in d["tiers"]]
            return cls(**d)
        except (ValueError, TypeError, KeyError) as exc:
            raise ClusterError(f"{where}: malformed cluster map ({exc}): restart this node's "
                               "daemon, which writes it anew") from None


def prepare_runtime(path: str) -> None:
    """Create the runtime directory (0700, ours) or refuse (ConfigError) one another user
    could enter, or move away (``runtime.private_dir``)."""
    private_dir(path)


def write_map(path: str, cmap: ClusterMap, token: bytes | None = None) -> None:
    prepare_runtime(path)
    if token is not None:
        write_token(os.path.join(path, TOKEN_NAME), token)
    target = os.path.join(path, MAP_NAME)
    atomic_write(target, cmap.to_json())


def check_runtime_access(path: str) -> None:
    """Refuse, naming its owner, a runtime directory this user cannot enter (another user's
    job: it is 0700): the reader or ``stagefs status`` got a bare "Permission denied" on a
    file inside it (or, waiting for its map, waited out its timeout for nothing)."""
    closed = unreachable(path)  # None if it is missing (not started yet: the map says so)
    if closed:
        raise ClusterError(
            f"runtime directory {path}: this user cannot read it: {closed}. A job's runtime "
            "directory is its user's own; point STAGEFS_RUNTIME (or --runtime) at the one "
            "given to your daemons, or run as its owner")


def load_runtime(path: str) -> tuple[ClusterMap, bytes]:
    check_runtime_access(path)
    target = os.path.join(path, MAP_NAME)
    try:  # without waiting on a FIFO, and bounded: a damaged runtime, never a hang
        fd, info = open_read(target)
        try:
            if not stat.S_ISREG(info.st_mode):
                raise ClusterError(f"{target}: not a file (a damaged runtime directory): "
                                   "remove it and restart this node's daemon, which writes it")
            text = os.read(fd, _MAP_MAX).decode("utf-8", "replace")
        finally:
            os.close(fd)
    except PermissionError as exc:  # the map itself closed to this user
        raise ClusterError(f"{target}: this user cannot read it: "
                           f"{unreachable(target) or exc.strerror}; run as its owner") from None
    except FileNotFoundError:
        raise ClusterError(
            f"no stagefs cluster at {path} (no {MAP_NAME}): start the daemons with "
            "'stagefs serve' (docs/cluster.md), or point STAGEFS_RUNTIME at the runtime "
            "directory given to --runtime"
        ) from None
    return ClusterMap.from_json(text, target), read_token(os.path.join(path, TOKEN_NAME))


def remove_runtime(path: str) -> None:
    for name in (MAP_NAME, TOKEN_NAME):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(path, name))


def record_failure(path: str, message: str) -> None:
    """Say in the runtime directory why its daemon could not start (``stagefs status
    --wait-staged`` ends with it rather than wait out its timeout); best effort."""
    with contextlib.suppress(OSError, StagefsError):
        prepare_runtime(path)
        atomic_write(os.path.join(path, FAILED_NAME), message.encode())


def clear_failure(path: str) -> None:
    """A daemon starts on ``path``: what an earlier one said of its failure no longer holds."""
    with contextlib.suppress(OSError):
        os.unlink(os.path.join(path, FAILED_NAME))


def daemon_ended(path: str) -> str | None:
    """Why the daemon of runtime ``path`` will not write its map: it failed at start (its
    message), or its process is gone; None while it has written it or still may."""
    if os.path.exists(os.path.join(path, MAP_NAME)):
        return None
    try:
        with open(os.path.join(path, FAILED_NAME), errors="replace") as f:
            return f"the daemon of {path} could not start: {f.read().strip()}"
    except OSError:
        pass
    try:
        with open(os.path.join(path, DAEMON_PID)) as f:
            pid = int(f.read().strip())
        os.kill(pid, 0)
    except ProcessLookupError:
        return (f"the daemon of {path} (pid {pid}) has ended without writing its map: its "
                "output (the job's log) says why")
    except (OSError, ValueError):
        pass
    return None


def map_left(path: str, cmap: ClusterMap) -> str | None:
    """Why the daemon that wrote ``cmap`` into runtime ``path`` will not answer: its process
    is gone, its map left behind (killed: it removes the map when it stops); None while it
    runs, or if the map does not say which process wrote it. Ask it only of a daemon that
    did not answer: a live one answers, whoever has its pid now."""
    if cmap.pid <= 0:
        return None
    try:
        os.kill(cmap.pid, 0)
    except ProcessLookupError:
        return (f"this node's daemon (node {cmap.rank}, pid {cmap.pid}) has ended without "
                f"removing its map from {path}: it was killed (SIGKILL: the OOM killer, "
                "Slurm after KillWait, or mpiexec ending every rank when one of them died; "
                "its output, the job's log, says which). This node's readers read the "
                "peers directly, else the origin, until it runs again: restart the daemons "
                "with the same arguments (each adopts what its tiers hold)")
    except OSError:  # (another user's process: alive)
        pass
    return None
