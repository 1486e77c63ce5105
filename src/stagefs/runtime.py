"""The runtime directory: node-local state of one job of one user (claims, stats, caches).

Default: ``/dev/shm/stagefs-<uid>/<job id>``; ``$STAGEFS_RUNTIME`` (or the ``runtime``
argument) names another directory. The job id comes from ``$STAGEFS_JOB`` (``--job``), else
the batch system (Slurm, PBS, LSF, Flux), else the login session of the launching shell
(``session-<sid>``, see job_id). Two jobs of one user therefore use two directories and never
see each other's claims. Both levels are mode 0700 and must belong to
the user. It must be node-local: claims hold process ids, which mean nothing elsewhere.

Layout::

    <runtime>/procs/<pid>@<host>           a lease: one live process using the job
    <runtime>/claims/<pack id>.<shard>     a shard being placed, and by whom (pid, start time),
                                           and how far its stream has come
    <runtime>/stats/<pid>.<pack id>.<n>.json   the counters of one open store of a process
    <runtime>/tiers/<pack id>.json         the tier directories a dataset was placed into
    <runtime>/inplace/<key>/               cached manifests of in-place datasets

A lease names its process by host, pid and start time (a reused pid is another process),
and the command line, so that ``stagefs clean`` can say who uses the job. It is judged
directly: on this host the process is alive or not; a lease of another host is taken as
alive (it cannot be checked from here). Nothing decides by age. Tier data is removed only by
``stagefs clean`` (docs/decisions/0008-runtime-leases.md): data a finished job staged stays
for the next job of the same dataset, and data that a live process of another job records
is never removed.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import shutil
import socket
import stat as st
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from stagefs._fsutil import (
    atomic_write,
    file_lock,
    login,
    movable_by_others,
    open_read,
    private_makedirs,
    remove_any,
    user_name,
)
from stagefs.config import absolute, env
from stagefs.errors import ConfigError, RuntimeInUseError

__all__ = ["Lease", "Runtime", "alive", "clean", "job_id", "private_dir", "proc_start",
           "read_record"]

_JOB_VARS = ("STAGEFS_JOB", "SLURM_JOB_ID", "PBS_JOBID", "LSB_JOBID", "FLUX_JOB_ID", "COBALT_JOBID")
HOST = socket.gethostname()
PID_MAX = 2**22  # the kernel's largest pid_max: a larger "pid" names no process
RECORD_MAX = 2**20
"""The largest record file (lease, tier or stats record) read: the small JSON files stagefs
writes are far below it; a larger one is damage, skipped rather than read into memory."""
DAEMON_FILES = frozenset({"daemon.failed", "daemon.lock", "daemon.pid"})
# in a tier's root, the user's room counter and lock for it (tiers/tier.py, Room)
TIER_ROOM_DIR = ".stagefs-{uid}"
"""What a node daemon (cluster/daemon.py, cluster/cmap.py) may write in its runtime directory
before it takes its lease (``procs/``): a directory holding only these is the runtime of a
daemon that did not start (each node of a job whose daemons failed keeps one, saying why),
and ``stagefs clean`` in the job's epilogue must remove it."""
log = logging.getLogger("stagefs")
_USERS: dict[tuple[int, str], int] = {}  # (pid, runtime path) -> stores open in this process


def job_id(environ: Mapping[str, str] | None = None) -> str:
    """The id of the job this process belongs to: ``$STAGEFS_JOB``, else the batch system's
    job id (Slurm, PBS, LSF, Flux, Cobalt), else ``session-<sid>``: the login session of the
    launching shell, which the processes a job starts (DataLoader workers, torchrun and
    mpiexec ranks, ``stagefs`` commands typed in that shell) share and another terminal, ssh
    command, cron job or ``setsid`` launch does not (docs/decisions/0010-job-identity.md)."""
    environ = os.environ if environ is None else environ
    job = next((environ[v] for v in _JOB_VARS if environ.get(v)), None)
    if job is None:
        sid = _launch_session()
        job = f"session-{sid}" if sid > 0 else "local"
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in job) or "local"


# a rank a launcher started; mpiexec (Hydra) and torchrun start each in a session of its own
_RANK_MARKS = (b"PMI_RANK=", b"OMPI_COMM_WORLD_RANK=", b"PMIX_RANK=", b"TORCHELASTIC_RUN_ID=")


def _launch_session() -> int:
    """The session of the launching shell: this process's session, or, when its leader is a
    rank that a launcher put in a session of its own, the launcher's session (0 when the
    leader is outside our pid namespace)."""
    try:
        sid = os.getsid(0)
    except OSError:
        return 0
    if sid <= 0:
        return 0
    try:
        with open(f"/proc/{sid}/environ", "rb") as f:
            leader_env = f.read()
        with open(f"/proc/{sid}/stat", "rb") as f:
            ppid = int(f.read().rpartition(b")")[2].split()[1])
        if ppid > 1 and any(b"\0" + m in b"\0" + leader_env for m in _RANK_MARKS):
            return os.getsid(ppid)
    except (OSError, ValueError, IndexError):
        pass  # the leader is gone or not ours: its session is still the job's
    return sid


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
    if not 0 < pid <= PID_MAX:
        return False  # no process has it (a lease written wrong, or crafted)
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


def _command(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            raw = f.read()
    except OSError:
        return ""
    args = [" ".join(a.decode(errors="replace").split()) for a in raw.split(b"\0") if a]
    return " ".join(a if len(a) <= 60 else a[:57] + "..." for a in args)[:300]


@dataclass(frozen=True, slots=True)
class Lease:
    """A process using a job's runtime: who it is (host, pid, start time) and its command."""

    pid: int
    host: str
    start: int = 0
    cmd: str = ""

    @classmethod
    def mine(cls, pid: int | None = None) -> Lease:
        pid = os.getpid() if pid is None else pid
        return cls(pid, HOST, proc_start(pid), _command(pid))

    @property
    def name(self) -> str:
        return f"{self.pid}@{self.host}"

    def alive(self) -> bool:
        """On this host, whether the process runs; a lease of another host cannot be
        checked from here and counts as alive."""
        return self.host != HOST or alive(self.pid, self.start)

    def __str__(self) -> str:
        return f"pid {self.pid} on {self.host}" + (f" ({self.cmd})" if self.cmd else "")


def _read_lease(path: str) -> Lease | None:
    """The lease in ``path`` (None if it is gone); an unreadable one names only the process
    in its file name, so that it is still judged."""
    name = os.path.basename(path)
    pid_s, _, host = name.partition("@")
    if not os.path.lexists(path):
        return None
    doc = read_record(path)
    try:
        if doc is None:
            raise ValueError(path)
        return Lease(int(doc["pid"]), str(doc["host"]), int(doc.get("start", 0)),
                     str(doc.get("cmd", "")))
    except (ValueError, KeyError, TypeError, OverflowError):
        return Lease(int(pid_s), host or HOST) if pid_s.isdigit() else None


def _default_base() -> str:
    shm = "/dev/shm"
    root = shm if os.path.isdir(shm) and os.access(shm, os.W_OK | os.X_OK) else tempfile.gettempdir()
    return os.path.join(root, f"stagefs-{os.getuid()}")


def _cannot(path: str, doing: str, exc: OSError) -> ConfigError:
    """The error for a runtime directory ``path`` this process cannot ``doing`` (create
    it, write in it): a full file system (a shared /dev/shm that other jobs filled) is
    said to be one."""
    full = exc.errno in (errno.ENOSPC, errno.EDQUOT)
    return ConfigError(
        f"runtime directory {path}: cannot {doing} ({exc.strerror}); "
        + (f"its file system is full: free space there (df {os.path.dirname(path)}), or "
           if full else "")
        + "set STAGEFS_RUNTIME to a writable node-local directory"
        + (" with room" if full else ""))


def _owner(path: str) -> int | None:
    try:
        return os.lstat(path).st_uid
    except OSError:
        return None


def private_dir(path: str) -> None:
    """Create ``path`` mode 0700, or check that the one there is ours and private; refused
    (ConfigError) in a directory another user may rename it in: that user could move it
    away (a daemon's readers then wait for its map forever) or put one of theirs in its
    place, as a predictable name on a shared ``/dev/shm`` (``stagefs-$USER``) invites."""
    why = movable_by_others(os.path.dirname(os.path.abspath(path)))
    if why:
        raise ConfigError(
            f"runtime directory {path}: {why}: another user may move the runtime directory "
            "away or put theirs in its place. Set STAGEFS_RUNTIME (or --runtime) to a "
            "directory in one of your own, such as one made by 'mktemp -d "
            "/dev/shm/stagefs-XXXXXX', or unset it for the default")
    try:
        private_makedirs(path)
    except OSError as exc:
        # a file or FIFO another user made under its name: said below, with its owner
        if not (isinstance(exc, FileExistsError) and exc.filename == os.path.abspath(path)
                and _owner(path) not in (None, os.getuid())):
            raise _cannot(path, "create it", exc) from exc
    s = os.lstat(path)
    if not st.S_ISDIR(s.st_mode) or s.st_uid != os.getuid():
        # on a shared /dev/shm (sticky) only its owner or root can remove another user's
        uid = os.getuid()
        where = os.environ.get("XDG_RUNTIME_DIR") or "/dev/shm"
        raise ConfigError(
            f"runtime directory {path} is not a directory owned by you ({user_name(uid)}): "
            f"{user_name(s.st_uid)} owns it. Set STAGEFS_RUNTIME to a node-local directory "
            f"of yours (e.g. {where}/stagefs-{login(uid)}), and have {path} removed by its "
            "owner or the node's administrator"
        )
    if st.S_IMODE(s.st_mode) != 0o700:
        try:
            os.chmod(path, 0o700)
        except OSError as exc:  # a read-only file system: a bare OSError naming nothing to do
            raise _cannot(path, "make it private (mode 0700)", exc) from exc


class Runtime:
    """One job's runtime directory on this node. Cheap to create; ``open()`` makes it."""

    def __init__(self, path: str | os.PathLike[str] | None = None) -> None:
        given = os.fspath(path) if path is not None else env("RUNTIME")
        if given is not None and given and not given.strip():  # a directory named " "
            raise ConfigError(f"the runtime directory {given!r} (--runtime, or "
                              "$STAGEFS_RUNTIME) is blank: name a node-local directory, or "
                              "unset STAGEFS_RUNTIME for the default")
        self.job = job_id()
        self.explicit = given is not None
        self.base = _default_base() if given is None else None
        self.path = absolute(given) if given else os.path.join(_default_base(), self.job)
        self.claims = os.path.join(self.path, "claims")
        self.stats = os.path.join(self.path, "stats")
        self.tiers = os.path.join(self.path, "tiers")
        self.inplace = os.path.join(self.path, "inplace")
        self.procs = os.path.join(self.path, "procs")

    def __repr__(self) -> str:
        return f"Runtime({self.path!r}, job={self.job!r})"

    def open(self) -> Runtime:
        """Create the directory (0700) and take a lease for this process. Nothing of another
        job is touched: only ``clean`` removes data."""
        if self.base is not None:
            private_dir(self.base)
        private_dir(self.path)
        try:
            for sub in (self.claims, self.stats, self.tiers, self.inplace, self.procs):
                try:
                    os.makedirs(sub, mode=0o700, exist_ok=True)
                except FileExistsError:  # a file (or symlink) there: made anew as a directory
                    log.warning("%s: not a directory (damaged runtime directory); made anew",
                                sub)
                    os.unlink(sub)
                    os.makedirs(sub, mode=0o700, exist_ok=True)
            self.register()
        except OSError as exc:  # ENOSPC: a full /dev/shm was a bare OSError naming nothing
            raise _cannot(self.path, "write in it", exc) from exc
        # the leases of processes that ended without closing (killed, os._exit) go: in a
        # cluster job no `stagefs status` or `clean` of this runtime judges them, and a
        # long run left one for each reader killed, without end
        self.leases()
        return self

    def exists(self) -> bool:
        return os.path.isdir(self.path)

    # -- processes ------------------------------------------------------------------------

    def register(self, pid: int | None = None) -> None:
        """Take (or renew) this process's lease on the job (once per open store; see
        unregister)."""
        lease = Lease.mine(pid)
        atomic_write(os.path.join(self.procs, lease.name),
                     json.dumps({"pid": lease.pid, "host": lease.host, "start": lease.start,
                                 "cmd": lease.cmd}), mode=0o600, fsync=False)
        key = (lease.pid, self.path)
        _USERS[key] = _USERS.get(key, 0) + 1

    def unregister(self) -> None:
        """A store closed; the lease goes when the process's last store of the job does."""
        key = (os.getpid(), self.path)
        left = _USERS.get(key, 1) - 1
        if left > 0:
            _USERS[key] = left
            return
        _USERS.pop(key, None)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(self.procs, f"{os.getpid()}@{HOST}"))

    def leases(self) -> list[Lease]:
        """The live processes using the job; the leases of dead ones are removed."""
        out: list[Lease] = []
        try:
            names = sorted(os.listdir(self.procs))
        except OSError:  # gone, or not a directory (damaged): no lease to judge
            return out
        for name in names:
            if name.endswith(".partial"):
                continue
            lease = _read_lease(os.path.join(self.procs, name))
            if lease is None:
                continue
            if lease.alive():
                out.append(lease)
            else:  # (what cannot be unlinked, a directory made there, stays: judged again)
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(self.procs, name))
        return out

    def live_processes(self) -> list[int]:
        return [lease.pid for lease in self.leases()]

    def jobs(self) -> list[Runtime]:
        """Every job runtime of this user on this node (the directories beside this one
        under the default base); only this one when the path was given explicitly."""
        if self.base is None:
            return [self]
        try:
            names = sorted(os.listdir(self.base))
        except FileNotFoundError:
            return [self]
        found: list[Runtime] = []
        for name in names:
            if os.path.isdir(os.path.join(self.base, name)):
                job = self if name == self.job else Runtime(os.path.join(self.base, name))
                job.job, job.explicit = name, False  # the default runtime of job `name`
                found.append(job)
        return found if self in found else [*found, self]

    def neighbours(self) -> list[Runtime]:
        """The job runtimes of this user that may share tier directories with this one:
        the directories beside it (as ``--runtime /dev/shm/stagefs-$USER/$SLURM_JOB_ID``
        gives each job one) and those under the default base; itself left out. A runtime
        in an unrelated directory is not found."""
        found: dict[str, Runtime] = {}
        for parent in dict.fromkeys((os.path.dirname(self.path), _default_base())):
            try:
                with os.scandir(parent) as entries:
                    for e in entries:
                        if e.path != self.path and e.path not in found and _is_runtime(e):
                            found[e.path] = Runtime(e.path)
            except OSError:
                continue  # no such directory, or not ours to read
        return list(found.values())

    # -- records --------------------------------------------------------------------------

    def record_tiers(self, pack_id: str, tier_dirs: list[str]) -> None:
        """Remember where a dataset's shards go: ``tiers``, the last process's tiers (what
        ``stagefs status`` shows), and ``placed``, every tier this job's processes have
        named for it (what ``clean`` removes: a job staged with one set of tiers, then read
        with another, left the first set's data behind)."""
        path = os.path.join(self.tiers, pack_id + ".json")
        placed = list(tier_dirs)
        old = _tier_record(read_record(path))
        for t in [*old["placed"], *old["tiers"]] if old is not None else []:
            if t not in placed:
                placed.append(t)
        record = {"pack_id": pack_id, "tiers": tier_dirs, "placed": placed}
        try:
            _write_json(path, record)
        except IsADirectoryError:  # a directory made under its name: the record replaces it
            log.warning("%s: a directory (damaged runtime directory); made a record anew", path)
            remove_any(path)
            _write_json(path, record)

    def tier_records(self) -> list[dict[str, Any]]:
        """The tier records, checked: ``clean`` removes the directories they name, so a
        damaged one (a pack id that is not a name, a tier that is not an absolute path) is
        skipped rather than trusted."""
        return [r for r in map(_tier_record, _read_jsons(self.tiers)) if r is not None]

    def tier_dirs(self) -> list[str]:
        """The tier directories (``<tier>/<pack id>``) this job's data was placed into."""
        return _tier_dirs(self.tier_records())

    def stat_records(self) -> list[dict[str, Any]]:
        return _read_jsons(self.stats)

    # -- removal --------------------------------------------------------------------------

    def remove(self, *, tier_data: bool = True,
               keep: frozenset[tuple[int, int]] = frozenset()) -> list[str]:
        """Delete this job's runtime directory and (by default) the tier data it recorded,
        except the tier directories in ``keep`` (in use by a live job; ``_dir_ids``)."""
        removed: list[str] = []
        if tier_data:
            removed += remove_tier_data(self.tier_records(), keep)
        if os.path.isdir(self.path):
            # procs/ last: a clean cut short (killed, Ctrl-C) leaves what is still the
            # job's runtime by its mark (_not_runtime), which the next clean then removes
            with contextlib.suppress(OSError), os.scandir(self.path) as it:
                for e in list(it):
                    if e.name != "procs":
                        remove_any(e.path)
            shutil.rmtree(self.path, ignore_errors=True)
            removed.append(self.path)
        return removed


def clean(jobs: Sequence[Runtime], *, force: bool = False, others: Sequence[Runtime] = ()
          ) -> list[str]:
    """Remove the runtime directories of ``jobs`` and the tier data they recorded.

    Refused (ConfigError) for a directory that is not a runtime of this user (_not_runtime).
    Refused (RuntimeInUseError, naming each process) while a live process holds a lease on
    one of them, unless ``force``. Tier directories that a live process of another job also
    recorded are kept, even with ``force``: of one of ``others`` (the user's other jobs), or
    of a runtime beside one of ``jobs`` (``Runtime.neighbours``: found whatever paths the
    jobs were given, when they share a parent directory).
    """
    for rt in jobs:
        why = _not_runtime(rt.path) if os.path.lexists(rt.path) else None
        if why:
            raise ConfigError(
                f"{rt.path} is not a stagefs runtime directory of yours ({why}): nothing "
                "removed. Name the job's runtime directory (--runtime, $STAGEFS_RUNTIME), "
                "or unset STAGEFS_RUNTIME to clean this job's default one")
    users = [(rt, lease) for rt in jobs if rt.exists() for lease in rt.leases()]
    if users and not force:
        who = "; ".join(f"{lease} using {rt.path}" + ("" if rt.explicit else f" (job {rt.job})")
                        for rt, lease in users)
        raise RuntimeInUseError(
            f"{len(users)} live process(es) use the stagefs runtime: {who}. Stop them and "
            "run 'stagefs clean' again, or pass --force to remove their data anyway."
        )
    targets = {rt.path for rt in jobs}
    near = {rt.path: rt for rt in [*others, *(n for job in jobs for n in job.neighbours())]}
    keep = _dir_ids(d for rt in near.values() if rt.path not in targets and rt.leases()
                    for d in rt.tier_dirs())
    removed: list[str] = []
    for rt in jobs:
        if rt.exists():
            removed += rt.remove(keep=keep)
    return removed


def _is_runtime(entry: os.DirEntry[str]) -> bool:
    """Is ``entry`` a job runtime directory of this user (one with leases)?"""
    return _not_runtime(entry.path) is None


def _not_runtime(path: str) -> str | None:
    """Why ``path`` is not a job runtime directory of this user (a real directory of its
    own with the ``procs`` folder that ``Runtime.open`` makes, or one holding nothing but
    ``DAEMON_FILES``), or None.

    ``stagefs clean`` removes a runtime directory whole: a ``--runtime`` or
    ``$STAGEFS_RUNTIME`` naming a directory of another use ($TMPDIR, a scratch or results
    directory) would lose every file of the user in it, and say it removed a directory
    that other users' files kept there."""
    try:
        s = os.lstat(path)
        if not st.S_ISDIR(s.st_mode):
            return "not a directory"
        if s.st_uid != os.getuid():
            return f"owned by {user_name(s.st_uid)}"
        if os.path.isdir(os.path.join(path, "procs")) or set(os.listdir(path)) <= DAEMON_FILES:
            return None
    except OSError as exc:
        return exc.strerror or str(exc)
    return "it has no procs/ folder: no stagefs process ever used it as its runtime"


def _tier_record(rec: dict[str, Any] | None) -> dict[str, Any] | None:
    """A tier record (``record_tiers``) with its fields checked, or None: the pack id a
    plain name, ``tiers`` and ``placed`` lists of absolute paths (a wrong entry dropped)."""
    if rec is None:
        return None
    pack_id = rec.get("pack_id")
    if not isinstance(pack_id, str) or pack_id in ("", ".", "..") or "/" in pack_id \
            or "\0" in pack_id:
        return None

    def paths(key: str) -> list[str]:
        value = rec.get(key)
        return [t for t in value if isinstance(t, str) and os.path.isabs(t) and "\0" not in t] \
            if isinstance(value, list) else []

    tiers = paths("tiers")
    return {**rec, "pack_id": pack_id, "tiers": tiers,
            "placed": paths("placed") if "placed" in rec else tiers}


def _tier_dirs(records: list[dict[str, Any]]) -> list[str]:
    return [os.path.join(t, rec["pack_id"]) for rec in records for t in rec["placed"]]


def _dir_ids(paths: Iterable[str]) -> frozenset[tuple[int, int]]:
    """The directories at ``paths`` that exist, by device and inode: a live job that names a
    tier through a symlink (or a bind mount) uses the copies of one that names the
    directory itself, and compared by path a clean of the one removed them under the
    other."""
    ids = set()
    for d in paths:
        with contextlib.suppress(OSError):
            s = os.stat(d)
            ids.add((s.st_dev, s.st_ino))
    return frozenset(ids)


def remove_tier_data(records: list[dict[str, Any]],
                     keep: frozenset[tuple[int, int]] = frozenset()) -> list[str]:
    """Remove the recorded tier directories but those in ``keep`` (by device and inode,
    ``_dir_ids``); returns those removed.

    Only a directory of this user is touched: a tier shared by users (``/dev/shm``, a
    scratch directory) may hold another user's copy of the same dataset under the same
    name, which a record of a refused attempt names; and a directory that could not be
    removed whole is not said to be."""
    removed: list[str] = []
    for d in _tier_dirs(records):
        try:
            s = os.lstat(d)
        except OSError:
            continue
        if (s.st_dev, s.st_ino) in keep or not st.S_ISDIR(s.st_mode) \
                or s.st_uid != os.getuid():
            continue
        why = remove_any(d)
        if not os.path.lexists(d):
            removed.append(d)
            _forget_room(os.path.dirname(d))
        else:
            log.warning("stagefs clean: %s could not be removed whole (%s); remove what is "
                        "left by hand", d, why or "files of another user in it?")
    return removed


def _forget_room(tier: str) -> None:
    """Copies of the user's were just removed from ``tier``: its room counter (Room, in the
    tier) must not count them. Once the tier holds no copy of the user's, the folder goes
    (the tier left as it was before its first job); else the counter alone, under the
    tier's lock, and the next process to place there counts the room anew from what the
    tier holds: a live job of another id saw the removed copies as used until it found the
    tier full."""
    folder = os.path.join(tier, TIER_ROOM_DIR.format(uid=os.getuid()))
    try:
        with os.scandir(tier) as it:
            theirs = [e.name for e in it if e.path != folder
                      and e.stat(follow_symlinks=False).st_uid == os.getuid()]
    except OSError:
        return
    if not theirs:
        shutil.rmtree(folder, ignore_errors=True)
        return
    # (a lock not had in 2 s, a folder gone: the counter is counted anew when found full)
    with contextlib.suppress(OSError), file_lock(os.path.join(folder, "lock"), 2.0):
        os.unlink(os.path.join(folder, "room"))


def _write_json(path: str, obj: Any) -> None:
    atomic_write(path, json.dumps(obj))


def read_record(path: str) -> dict[str, Any] | None:
    """The JSON object in the record file ``path``, or None if there is none to read: gone,
    being replaced, torn by a crash, or damaged (not a JSON object, not a regular file,
    larger than ``RECORD_MAX``). Opened without following a symlink or waiting on a FIFO,
    and read within a bound: a runtime directory left damaged (by a crash, a buggy
    program) makes ``stagefs status`` and ``clean`` skip the record, never hang, fill the
    memory or fail."""
    try:
        fd, info = open_read(path, os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        if not st.S_ISREG(info.st_mode) or info.st_size > RECORD_MAX:
            return None
        with os.fdopen(os.dup(fd), "rb") as f:
            raw = f.read(RECORD_MAX + 1)
        doc = json.loads(raw) if len(raw) <= RECORD_MAX else None
    except (OSError, ValueError, RecursionError):
        return None
    finally:
        os.close(fd)
    return doc if isinstance(doc, dict) else None


def _read_jsons(folder: str) -> list[dict[str, Any]]:
    try:
        names = sorted(os.listdir(folder))
    except OSError:  # gone, or not a directory (damaged): no records
        return []
    records = (read_record(os.path.join(folder, n)) for n in names if n.endswith(".json"))
    return [r for r in records if r is not None]
