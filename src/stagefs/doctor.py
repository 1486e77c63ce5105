"""``stagefs doctor``: check this node for what stagefs uses, and say what each finding means.

Every check returns findings (check, status, what it means for the user); nothing is changed
on the node except a probe file written in each tier and removed again (a tier directory that
does not exist yet is made for it, as a store would make it, and removed too). Statuses: ``ok``,
``warn`` (works, at a cost the message names), ``missing`` (an optional part is absent: what
needs it does not work), ``error`` (a tier that was named cannot be used).
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
import resource
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from stagefs._native import preload_library
from stagefs._sysinfo import meminfo, memory_limit_room
from stagefs._table import table
from stagefs.config import env, flag_errors, format_size, parse_tier
from stagefs.errors import ConfigError
from stagefs.format.spec import PIECE
from stagefs.tiers.tier import (
    dir_bytes,
    memory_limit_problem,
    over_capacity,
    share_capacity,
    tier_dir_problem,
    tier_kind,
)

__all__ = ["Finding", "check_node", "check_tier", "render"]

PROBE_BYTES = 32 << 20  # written and read back in each tier: a quick estimate, not a benchmark
SHM = "/dev/shm"


@dataclass(frozen=True, slots=True)
class Finding:
    check: str
    status: str  # ok | warn | missing | error
    meaning: str


def check_fuse() -> list[Finding]:
    """stagefs mount needs fusermount3, a usable /dev/fuse and the mfusepy binding."""
    out = []
    helper = shutil.which("fusermount3")
    out.append(Finding("FUSE: fusermount3", "ok", f"{helper}: mounts can be made and undone")
               if helper else Finding("FUSE: fusermount3", "missing",
                                      "not on PATH: 'stagefs mount' cannot mount "
                                      "(apt-get install fuse3); 'stagefs run' still works"))
    try:
        fd = os.open("/dev/fuse", os.O_RDWR | os.O_CLOEXEC)
        os.close(fd)
        out.append(Finding("FUSE: /dev/fuse", "ok", "usable by this user"))
    except OSError as exc:
        out.append(Finding("FUSE: /dev/fuse", "missing",
                           f"cannot be opened ({exc.strerror}): 'stagefs mount' cannot work on "
                           "this node (in a container: --device /dev/fuse); use 'stagefs run' "
                           "or the Python API"))
    try:
        importlib.import_module("mfusepy")
        out.append(Finding("FUSE: mfusepy", "ok", "the Python binding loads libfuse"))
    except (ImportError, OSError) as exc:
        out.append(Finding("FUSE: mfusepy", "missing",
                           f"cannot be imported ({exc}): pip install 'stagefs[fuse]' "
                           "for 'stagefs mount'"))
    return out


def _space(path: str) -> tuple[int, int]:
    s = os.statvfs(path)
    return s.f_blocks * s.f_frsize, s.f_bavail * s.f_frsize


def check_shm() -> list[Finding]:
    """/dev/shm is the fastest tier and holds the runtime directory."""
    if not os.path.isdir(SHM):
        return [Finding("/dev/shm", "missing", "no /dev/shm: the runtime dir goes to the "
                                               "temporary directory ($TMPDIR, else /tmp), "
                                               "and there is no memory tier by default")]
    total, free = _space(SHM)
    mem = meminfo().get("MemTotal", 0)
    what = f"{format_size(total)}, {format_size(free)} free"
    if free < PIECE and env("RUNTIME") is None:
        return [Finding("/dev/shm", "warn", f"{what}: full, so the runtime directory stagefs "
                        "keeps there (leases, claims, counters) cannot be written and opening a "
                        "dataset with tiers fails; free space there (what other jobs left), or "
                        "set STAGEFS_RUNTIME to a node-local directory with room")]
    if mem and total < mem // 4:
        return [Finding("/dev/shm", "warn", f"{what}: under a quarter of the memory "
                        f"({format_size(mem)}); a memory tier there holds little of a dataset")]
    return [Finding("/dev/shm", "ok", f"{what}: a memory tier can hold up to this much "
                    "(it counts against the job's memory)")]


def _speed(nbytes: int, seconds: float) -> str:
    return f"{nbytes / max(seconds, 1e-9) / 2**20:,.0f} MiB/s"


def _probe(path: str, clock: Callable[[], float], nbytes: int = PROBE_BYTES
           ) -> tuple[float, float]:
    """Seconds to write ``nbytes`` (whole MiB, fsync'd) in ``path``, then to read them
    back."""
    name = os.path.join(path, f".stagefs-doctor-{os.getpid()}")
    block = os.urandom(1 << 20)
    try:
        fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            t0 = clock()
            for _ in range(nbytes // len(block)):
                os.write(fd, block)
            os.fsync(fd)
            wrote = clock() - t0
            with contextlib.suppress(OSError):  # read from the device, not the page cache
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
        fd = os.open(name, os.O_RDONLY | os.O_CLOEXEC)
        try:
            t0 = clock()
            while os.read(fd, 1 << 20):
                pass
            read = clock() - t0
        finally:
            os.close(fd)
    finally:
        with contextlib.suppress(OSError):
            os.unlink(name)
    return wrote, read


def check_tier(spec: str, clock: Callable[[], float] = time.perf_counter) -> list[Finding]:
    """A tier named by the user: its directory, free space and speed; ``error`` if unusable."""
    label = f"tier {spec}"
    try:
        tier = parse_tier(spec)
    except ConfigError as exc:
        return [Finding(label, "error", str(exc))]
    path = tier.path
    problem = tier_dir_problem(path)
    if problem:
        return [Finding(label, "error", problem)]
    least = PIECE + 2 * 4096  # a piece, and a copy's header and fill map (a page each)
    # a share (50%) as a store takes it: of the free space and what the tier holds (of the
    # free space alone, a tier filled by a job was said to have less than a piece)
    capacity = share_capacity(path, tier.share) if tier.share is not None and \
        os.path.isdir(path) else tier.capacity
    if capacity is not None and capacity < least:
        return [Finding(label, "warn", f"capacity {format_size(capacity)} is less than "
                        f"one piece of placement ({format_size(PIECE)} as packed by "
                        f"default, for a dataset of 512 MiB or more; a smaller one's are "
                        f"smaller) and its copy's header: it holds little or nothing of a "
                        f"large dataset; give it {format_size(2 * PIECE)} or more, or leave "
                        f"it out")]
    # A tier that does not exist yet is made for the probe, as a store would make it, and
    # removed again: what the directory's permissions promise (root may "write" in /proc)
    # is not what the file system takes, and its parents may not exist either.
    made = _missing_dirs(path)
    try:
        if made:
            try:
                os.makedirs(path, mode=0o700)
            except OSError as exc:
                return [Finding(label, "error", f"{path} cannot be created in "
                                f"{os.path.dirname(made[-1])} ({exc.strerror}): stagefs cannot "
                                "stage there; name a writable directory with free space")]
        total, free = _space(path)
        # the probe takes at most half of what the tier may use: on a file system with a
        # few MiB free, a tier a store fills piece by piece was called unusable when the
        # 32 MiB probe met ENOSPC
        room = free if capacity is None else min(free, capacity)
        held = dir_bytes(path)
        if room < least:
            keeps = f"it keeps the {format_size(held)} it holds and places nothing more" \
                if held else "it holds little or nothing"
            return [Finding(label, "warn", f"{path}'s file system has {format_size(free)} "
                            f"free: less than one piece of placement ({format_size(PIECE)} "
                            f"as packed by default) and its copy's header: {keeps}; free "
                            "some space there, or name another directory")]
        probe = max(1 << 20, min(PROBE_BYTES, room // 2) >> 20 << 20)
        wrote, read = _probe(path, clock, probe)
        over = memory_limit_problem(path, capacity, held) \
            if tier_kind(path) == "memory" else None
        if over is None and (why := over_capacity(held, capacity)):
            over = f"{path} {why}"
    except OSError as exc:
        return [Finding(label, "error", f"cannot write in {path} ({exc.strerror}): stagefs "
                        "cannot stage there; name a writable directory with free space")]
    finally:
        for d in made:
            with contextlib.suppress(OSError):
                os.rmdir(d)
    new = f"{path} does not exist yet (stagefs creates it in {os.path.dirname(made[-1])}); " \
        if made else ""
    if over:
        return [Finding(label, "warn", f"{new}{over}")]
    return [Finding(label, "ok", f"{new}{format_size(free)} free of {format_size(total)}; "
                    f"write {_speed(probe, wrote)}, read {_speed(probe, read)} "
                    f"({format_size(probe)} probe)")]


def _missing_dirs(path: str) -> list[str]:
    """``path`` and those of its parents that do not exist, deepest first (the order to
    remove them in)."""
    out = []
    while not os.path.lexists(path):
        out.append(path)
        path = os.path.dirname(path)
    return out


def check_accelerator() -> list[Finding]:
    try:
        importlib.import_module("stagefs._speedups")
    except ImportError as exc:
        return [Finding("C accelerator", "warn",
                        f"not built ({exc}): stat and open run in pure Python, several "
                        "times slower per file; reinstall with a C compiler present")]
    return [Finding("C accelerator", "ok", "stagefs._speedups loaded: the fast metadata path")]


def check_preload() -> list[Finding]:
    lib = preload_library()
    if lib is None:
        return [Finding("preload library", "warn",
                        "not built: 'stagefs run' serves Python programs only (cat, tar, "
                        "h5py, TensorFlow read the disk); reinstall with a C compiler present")]
    return [Finding("preload library", "ok", f"{lib}: 'stagefs run' serves any dynamically "
                    "linked program")]


def check_switches() -> list[Finding]:
    """Each switch set in the environment (``STAGEFS_CLOSED=1`` ...) that is not one: every
    other command refuses to start with it."""
    return [Finding(name, "error", str(exc)) for name, exc in flag_errors()]


def check_mpi() -> list[Finding]:
    # find_spec, not import: importing mpi4py.MPI initialises MPI
    has_mpi4py = importlib.util.find_spec("mpi4py") is not None
    mpiexec = shutil.which("mpiexec")
    out = [Finding("MPI: mpi4py", "ok", "installed: 'stagefs serve' can bootstrap over MPI")
           if has_mpi4py else Finding("MPI: mpi4py", "missing",
                                      "'stagefs serve --mpi' cannot work: pip install "
                                      "'stagefs[mpi]', or use --hosts (static bootstrap)")]
    out.append(Finding("MPI: mpiexec", "ok", f"{mpiexec}: launches one daemon per node")
               if mpiexec else Finding("MPI: mpiexec", "missing",
                                       "not on PATH: launch 'stagefs serve' with srun or "
                                       "--hosts instead"))
    return out


def check_slurm() -> list[Finding]:
    job, srun = os.environ.get("SLURM_JOB_ID"), shutil.which("srun")
    out = [Finding("Slurm: job", "ok", f"SLURM_JOB_ID={job}: the runtime dir is per job")
           if job else Finding("Slurm: job", "missing",
                               "not inside a Slurm job: the job id comes from $STAGEFS_JOB "
                               "or the launching process")]
    out.append(Finding("Slurm: srun", "ok", f"{srun}: launches one daemon per node")
               if srun else Finding("Slurm: srun", "missing", "not on PATH: no Slurm launcher "
                                    "(mpiexec or --hosts work instead)"))
    return out


def check_memory() -> list[Finding]:
    page = os.sysconf("SC_PAGE_SIZE")
    out = [Finding("page size", "ok" if page == 4096 else "warn",
                   f"{page:,} bytes" + ("" if page == 4096 else
                                        ": small files each take a whole page in a "
                                        "memory tier and in the page cache"))]
    mem = meminfo()
    if "MemTotal" in mem:
        room = memory_limit_room()
        limit = "" if room is None else (f"; this job's memory limit (its control group's) "
                                         f"leaves {format_size(room)}")
        out.append(Finding("memory", "ok", f"{format_size(mem['MemTotal'])} in all, "
                           f"{format_size(mem.get('MemAvailable', 0))} available{limit}: a "
                           "memory tier and the training job share it"))
    return out


WMEM_MAX = "/proc/sys/net/core/wmem_max"
BIG_JOB = 4096  # nodes: the job size stagefs is built for


def check_network(wmem_max: str = WMEM_MAX) -> list[Finding]:
    """The largest socket send buffer a process may ask for: the node daemon asks
    ``UNIX_SNDBUF`` for each reader's connection, so that a relayed reply goes out in a few
    rounds, not one per 208 KiB (the kernel's usual cap)."""
    from stagefs.net.server import UNIX_SNDBUF

    label = "network: socket send buffer"
    try:
        with open(wmem_max) as f:
            cap = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return [Finding(label, "warn", f"{wmem_max} cannot be read: the node daemon's "
                        "replies to its readers go out at the kernel's buffer size")]
    if cap >= UNIX_SNDBUF:
        return [Finding(label, "ok", f"up to {format_size(cap)} (net.core.wmem_max): the "
                        "node daemon sends a relayed reply to its reader in few rounds")]
    return [Finding(label, "warn", f"at most {format_size(cap)} (net.core.wmem_max): the "
                    "node daemon sends its readers relayed bytes that much at a time and "
                    "waits between; 'sysctl -w net.core.wmem_max="
                    f"{UNIX_SNDBUF}' (root, or ask the admins) lets it send a whole reply "
                    "(about 1.2x the relayed throughput, measured)")]


def check_descriptors(limits: tuple[int, int] | None = None) -> list[Finding]:
    """Open descriptors: every connection of a node daemon is one, four for each peer (its
    connections to the peer and the peer's to it), and the daemon raises its limit to the
    hard one. ``limits``: (soft, hard), default this process's."""
    from stagefs.cluster.daemon import descriptors_for, peers_within

    soft, hard = limits or resource.getrlimit(resource.RLIMIT_NOFILE)
    cap = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    fit = peers_within(cap)
    label = "open files"
    what = (f"hard limit {cap:,}: a node daemon can keep its connections with about "
            f"{fit:,} peers")
    if fit >= BIG_JOB - 1:
        return [Finding(label, "ok", what)]
    return [Finding(label, "warn", f"{what}; a job on more nodes has the others refused "
                    f"(their reads go to the origin): ask for a higher hard limit "
                    f"(limits.conf nofile; Slurm: PropagateResourceLimits): "
                    f"{descriptors_for(BIG_JOB - 1):,} for {BIG_JOB:,} nodes")]


def tier_specs(tiers: Sequence[str] | None) -> list[str]:
    """The tiers named with --tier, else those of $STAGEFS_TIERS (comma-separated)."""
    if tiers:
        return list(tiers)
    return [t.strip() for t in (env("TIERS") or "").split(",") if t.strip()]


def check_node(tiers: Sequence[str] | None = None) -> list[Finding]:
    findings = check_fuse() + check_shm()
    for spec in tier_specs(tiers):
        findings += check_tier(spec)
    return (findings + check_accelerator() + check_preload() + check_mpi() + check_slurm()
            + check_memory() + check_network() + check_descriptors() + check_switches())


def render(findings: Sequence[Finding]) -> str:
    return table(("check", "status", "what it means"),
                 [(f.check, f.status, f.meaning) for f in findings])
