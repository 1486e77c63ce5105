"""The runtime directory: node-local state of one job of one user (claims, stats, caches).

Default: ``/dev/shm/stagefs-<uid>/<job id>``; ``$STAGEFS_RUNTIME`` (or the ``runtime``
argument) names another directory. The job id comes from ``$STAGEFS_JOB``, else the batch
system (Slurm, PBS, LSF, Flux), else ``local``. Two jobs of one user therefore use two
directories and never see each other's claims. Both levels are mode 0700 and must belong to
the user. It must be node-local: claims hold process ids, which mean nothing elsewhere.

Layout::

    <runtime>/procs/<pid>                  one file per live process using the job
    <runtime>/claims/<pack id>.<shard>     a shard being placed, and by whom (pid, start time)
    <runtime>/stats/<pid>.<pack id>.<n>.json   the counters of one open store of a process
    <runtime>/tiers/<pack id>.json         the tier directories a dataset was placed into
    <runtime>/inplace/<key>/               cached manifests of in-place datasets

A directory of another job whose registered processes are all dead is stale: it is removed
(with the tier data it recorded) the next time a runtime is opened.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import stat as st
import tempfile
import time
from typing import Any

from stagefs._fsutil import atomic_write
from stagefs.config import env
from stagefs.errors import ConfigError

__all__ = ["Runtime", "alive", "job_id", "proc_start"]

_JOB_VARS = ("SLURM_JOB_ID", "PBS_JOBID", "LSB_JOBID", "FLUX_JOB_ID", "COBALT_JOBID")
_STALE_GRACE_S = 5.0  # a fresh directory whose creator has not registered yet is not stale
_USERS: dict[tuple[int, str], int] = {}  # (pid, runtime path) -> stores open in this process


def job_id() -> str:
    """The id of the job this process belongs to (``local`` outside a batch system)."""
    job = env("JOB")
    if job is None:
        job = next((os.environ[v] for v in _JOB_VARS if os.environ.get(v)), "local")
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in job) or "local"


def proc_start(pid: int) -> int:
    """The start time of process ``pid`` in clock ticks (0 if unknown): tells pid reuse apart."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
    except OSError:
        return 0
    return int(raw.rpartition(b")")[2].split()[19])


def alive(pid: int, start: int = 0) -> bool:
    """Is process ``pid`` (started at ``start``, if known) still running?"""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    if start and proc_start(pid) not in (0, start):
        return False  # the pid was reused by another process
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rpartition(b")")[2].split()[0] != b"Z"
    except OSError:
        return True


def _default_base() -> str:
    shm = "/dev/shm"
    root = shm if os.path.isdir(shm) and os.access(shm, os.W_OK | os.X_OK) else tempfile.gettempdir()
    return os.path.join(root, f"stagefs-{os.getuid()}")


def _private_dir(path: str) -> None:
    """Create ``path`` mode 0700, or check that the one there is ours and private."""
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
    except OSError as exc:
        raise ConfigError(
            f"runtime directory {path}: cannot create it ({exc.strerror}); set "
            "STAGEFS_RUNTIME to a writable node-local directory"
        ) from exc
    s = os.lstat(path)
    if not st.S_ISDIR(s.st_mode) or s.st_uid != os.getuid():
        raise ConfigError(
            f"runtime directory {path} is not a directory owned by you (uid {os.getuid()}); "
            "remove it or set STAGEFS_RUNTIME elsewhere"
        )
    if st.S_IMODE(s.st_mode) != 0o700:
        os.chmod(path, 0o700)


class Runtime:
    """One job's runtime directory on this node. Cheap to create; ``open()`` makes it."""

    def __init__(self, path: str | os.PathLike[str] | None = None) -> None:
        given = os.fspath(path) if path is not None else env("RUNTIME")
        self.job = job_id()
        self.explicit = given is not None
        self.base = _default_base() if given is None else None
        self.path = os.path.abspath(given) if given else os.path.join(_default_base(), self.job)
        self.claims = os.path.join(self.path, "claims")
        self.stats = os.path.join(self.path, "stats")
        self.tiers = os.path.join(self.path, "tiers")
        self.inplace = os.path.join(self.path, "inplace")
        self.procs = os.path.join(self.path, "procs")

    def __repr__(self) -> str:
        return f"Runtime({self.path!r}, job={self.job!r})"

    def open(self) -> Runtime:
        """Create the directory (0700), register this process, and clear stale job dirs."""
        if self.base is not None:
            _private_dir(self.base)
            self.cleanup_stale()
        _private_dir(self.path)
        for sub in (self.claims, self.stats, self.tiers, self.inplace, self.procs):
            os.makedirs(sub, mode=0o700, exist_ok=True)
        self.register()
        return self

    def exists(self) -> bool:
        return os.path.isdir(self.path)

    # -- processes ------------------------------------------------------------------------

    def register(self, pid: int | None = None) -> None:
        """Record that this process uses the job (once per open store; see unregister)."""
        pid = os.getpid() if pid is None else pid
        key = (pid, self.path)
        _USERS[key] = _USERS.get(key, 0) + 1
        with open(os.path.join(self.procs, str(pid)), "w") as f:
            f.write(str(proc_start(pid)))

    def unregister(self) -> None:
        """A store closed; the record goes when the process's last store of the job does."""
        key = (os.getpid(), self.path)
        left = _USERS.get(key, 1) - 1
        if left > 0:
            _USERS[key] = left
            return
        _USERS.pop(key, None)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(self.procs, str(os.getpid())))

    def live_processes(self) -> list[int]:
        return _live(self.procs)

    # -- records --------------------------------------------------------------------------

    def record_tiers(self, pack_id: str, tier_dirs: list[str]) -> None:
        """Remember where a dataset's shards go, for ``stagefs status`` and ``clean``."""
        path = os.path.join(self.tiers, pack_id + ".json")
        _write_json(path, {"pack_id": pack_id, "tiers": tier_dirs})

    def tier_records(self) -> list[dict[str, Any]]:
        return _read_jsons(self.tiers)

    def stat_records(self) -> list[dict[str, Any]]:
        return _read_jsons(self.stats)

    # -- removal --------------------------------------------------------------------------

    def remove(self, *, tier_data: bool = True, keep: frozenset[str] = frozenset()) -> list[str]:
        """Delete this job's runtime directory and (by default) the tier data it recorded,
        except the tier directories in ``keep`` (in use by a live job)."""
        removed: list[str] = []
        if tier_data:
            removed += remove_tier_data(self.tier_records(), keep)
        if os.path.isdir(self.path):
            shutil.rmtree(self.path, ignore_errors=True)
            removed.append(self.path)
        return removed

    def cleanup_stale(self) -> list[str]:
        """Remove the runtime dirs (and recorded tier data) of this user's dead jobs."""
        removed: list[str] = []
        if self.base is None or not os.path.isdir(self.base):
            return removed
        stale: list[Runtime] = []
        keep: set[str] = set()
        for name in sorted(os.listdir(self.base)):
            path = os.path.join(self.base, name)
            if not os.path.isdir(path):
                continue
            job = Runtime(path)
            if name != self.job and _is_stale(path):
                stale.append(job)
            else:  # a live job may share a tier directory with a dead one: keep its data
                keep.update(_tier_dirs(job.tier_records()))
        for job in stale:
            removed += job.remove(keep=frozenset(keep))
        return removed


def _is_stale(path: str) -> bool:
    """A job dir is stale when it records its processes and none is alive. A dir without a
    process record (a cluster daemon's map alone, anything else) is not ours to judge."""
    procs = os.path.join(path, "procs")
    if not os.path.isdir(procs) or os.path.exists(os.path.join(path, "cluster.json")):
        return False
    try:
        age = time.time() - os.stat(procs).st_mtime
        registered = bool(os.listdir(procs))
    except FileNotFoundError:
        return False
    if _live(procs):
        return False
    return registered or age > _STALE_GRACE_S


def _live(procs: str) -> list[int]:
    out: list[int] = []
    try:
        names = os.listdir(procs)
    except FileNotFoundError:
        return out
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(os.path.join(procs, name)) as f:
                start = int(f.read().strip() or 0)
        except (OSError, ValueError):
            start = 0
        if alive(int(name), start):
            out.append(int(name))
        else:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(procs, name))
    return out


def _tier_dirs(records: list[dict[str, Any]]) -> list[str]:
    return [os.path.join(t, rec["pack_id"]) for rec in records for t in rec.get("tiers", [])]


def remove_tier_data(records: list[dict[str, Any]], keep: frozenset[str] = frozenset()
                     ) -> list[str]:
    removed: list[str] = []
    for d in _tier_dirs(records):
        if d not in keep and os.path.isdir(d):
            shutil.rmtree(d, ignore_errors=True)
            removed.append(d)
    return removed


def _write_json(path: str, obj: Any) -> None:
    atomic_write(path, json.dumps(obj))


def _read_jsons(folder: str) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    try:
        names = sorted(os.listdir(folder))
    except FileNotFoundError:
        return out
    for name in names:
        if not name.endswith(".json"):
            continue
        try:
            with open(os.path.join(folder, name)) as f:
                out.append(json.load(f))
        except (OSError, ValueError):
            continue  # being replaced right now, or torn by a crash: skip it
    return out
