"""Sizes, tier specs and ``STAGEFS_*`` environment variables: parsed in one place."""

from __future__ import annotations

import errno
import math
import os
import re
import shutil
from dataclasses import dataclass

from stagefs.errors import ConfigError

__all__ = [
    "ENV_VARS",
    "SIZE_SYNTAX",
    "EnvVar",
    "TierSpec",
    "absolute",
    "check_flags",
    "env",
    "env_number",
    "flag_errors",
    "format_size",
    "parse_size",
    "parse_tier",
    "show_path",
]

_UNITS = {
    "": 1, "b": 1,
    "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
    "t": 10**12, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
SIZE_SYNTAX = (
    "Sizes: a number of bytes with an optional unit, binary (KiB, MiB, GiB, TiB: powers of "
    "1024) or decimal (KB, MB, GB, TB, or K, M, G, T: powers of 1000), e.g. 2GiB, 500MB, "
    "1.5TB, 4096; for a tier, also a share of its file system's free space, e.g. 50%."
)
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str | int, *, of: str | None = None) -> int:
    """Parse ``"64MiB"``, ``"2.5GB"``, ``"4096"`` or, with ``of`` (a directory), ``"80%"``.

    A percentage is a share of the free space of the file system holding ``of``.
    """
    if isinstance(text, int):
        if text < 0:
            raise ConfigError(f"size must not be negative: {text}")
        return text
    stripped = text.strip()
    if stripped.endswith("%"):
        if of is None:
            raise ConfigError(f"a size in percent ({text!r}) needs a directory to take it of")
        try:
            share = float(stripped[:-1])
        except ValueError:
            raise ConfigError(f"not a percentage: {text!r}") from None
        if not 0 < share <= 100:
            raise ConfigError(f"percentage out of range (0-100]: {text!r}")
        return int(shutil.disk_usage(of).free * share / 100)
    match = _SIZE_RE.match(stripped)
    if not match or match.group(2).lower() not in _UNITS:
        raise ConfigError(
            f"not a size: {text!r} (use bytes or a unit: KiB, MiB, GiB, TiB, KB, MB, GB, TB)"
        )
    unit = _UNITS[match.group(2).lower()]
    if unit == 1 and "." in match.group(1):  # "1.5": meant in some unit, not 1 byte
        raise ConfigError(f"not a size: {text!r} is a fraction of a byte; give whole bytes "
                          f"or a unit ({match.group(1)}GiB, {match.group(1)}MB, ...)")
    return int(float(match.group(1)) * unit)


def format_size(n: float) -> str:
    """``1536`` → ``"1.5 KiB"``: the binary units people read in ``df -h``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def absolute(path: str | bytes | os.PathLike[str] | os.PathLike[bytes]) -> str:
    """``os.path.abspath(path)``, as str (a bytes path, as ``os.fsencode`` gives a name that
    is not UTF-8, decoded as the file system's names are); a relative path in a current
    directory that was removed (``cd d; rmdir ../d``, a job's scratch directory cleaned
    under its shell) is a FileNotFoundError naming the path and what to do, not the bare
    one ``os.getcwd`` raises, which names nothing."""
    try:
        return os.path.abspath(os.fsdecode(path))
    except FileNotFoundError:
        raise FileNotFoundError(
            errno.ENOENT, "the current directory no longer exists (removed after it was "
            "entered?), so a relative path names nothing; cd to an existing directory, or "
            "give an absolute path", os.fsdecode(path)) from None


def show_path(path: str | bytes) -> str:
    """A path for a message or a listing of one path a line: as it is, or quoted as a Python
    string when it holds what would not print as itself (a newline, a tab, a byte that is
    not UTF-8), so each path stays on its line and can be told apart."""
    text = os.fsdecode(path)
    return text if text.isprintable() else repr(text)


@dataclass(frozen=True, slots=True)
class TierSpec:
    """One node-local tier: a directory and how many bytes of it stagefs may use."""

    path: str
    capacity: int | None  # None: as much as the file system has free
    # given as a share of the free space (50%): the percent; the tier takes it of its file
    # system's free space and what it holds already (tiers/tier.py), so that its own data
    # does not shrink the share when the tier is opened again (a restart, a later rank)
    share: float | None = None

    def __repr__(self) -> str:
        cap = "free space" if self.capacity is None else format_size(self.capacity)
        return f"TierSpec({self.path!r}, {cap})"


def parse_tier(spec: str, *, rank: int | None = None) -> TierSpec:
    """Parse ``"/dev/shm/x:16GiB"`` (or ``"/nvme/x:80%"``, or just a path).

    ``{rank}`` in the path is replaced by ``rank`` so one machine can host a test cluster.
    The capacity is checked against the device: asking for more than it has is an error.
    Spaces around the directory and the capacity are not part of them (``" /dir : 1GiB"``,
    a list written ``"A:1GiB, B:2GiB"``): a tier directory named with a space at its end
    was made, or a relative one under the current directory.
    """
    path, sep, size = spec.rpartition(":")
    path = path.strip() if sep else path
    if sep and not size.strip():
        raise ConfigError(
            f"tier {spec!r}: no capacity after ':' (a variable left empty?); give DIR:SIZE "
            "(e.g. /dev/shm/me:16GiB or /nvme/me:80%), or DIR alone for all its free space"
        )
    if not sep or "/" in size:
        path, size = spec.strip(), ""
    elif _is_size(path.rpartition(":")[2]):
        raise ConfigError(
            f"tier {spec!r} has two capacities; give DIR:SIZE with one (a directory whose "
            "name ends in ':SIZE' cannot be a tier)"
        )
    if not path.strip():  # ":16GiB": abspath("") would make the current directory a tier
        raise ConfigError(
            f"tier {spec!r} names no directory (a variable left empty?); give DIR:SIZE "
            "(e.g. /dev/shm/me:16GiB or /nvme/me:80%), or DIR alone for all its free space"
        )
    if rank is not None:
        path = path.replace("{rank}", str(rank))
    elif "{rank}" in path:
        raise ConfigError(f"tier {spec!r} names {{rank}} but no rank is known here")
    path = absolute(os.path.expanduser(path))
    probe = _existing_parent(path)
    try:
        capacity = parse_size(size, of=probe) if size else None
    except ConfigError as exc:  # which tier, of several (--tier, $STAGEFS_TIERS)
        raise ConfigError(f"tier {spec!r}: {exc}") from None
    if capacity is not None and not size.strip().endswith("%"):
        usage = shutil.disk_usage(probe)
        if capacity > usage.total:
            raise ConfigError(
                f"tier {path}: capacity {format_size(capacity)} is larger than its device "
                f"({format_size(usage.total)} in all); give a smaller size or a percentage"
            )
    share = float(size.strip()[:-1]) if size.strip().endswith("%") else None
    return TierSpec(path, capacity, share)


def _is_size(text: str) -> bool:
    stripped = text.strip()
    if stripped.endswith("%"):
        stripped = stripped[:-1]
        return bool(stripped) and stripped.replace(".", "", 1).isdigit()
    match = _SIZE_RE.match(stripped)
    return match is not None and match.group(2).lower() in _UNITS


def _existing_parent(path: str) -> str:
    while not os.path.exists(path):
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    return path


@dataclass(frozen=True, slots=True)
class EnvVar:
    """One ``STAGEFS_*`` environment variable: what it does and its default."""

    name: str
    default: str
    doc: str
    internal: bool = False  # set by stagefs for its own child processes, not by users
    flag: bool = False  # a switch: 1/0, true/false, yes/no, on/off (env_flag)


ENV_VARS: dict[str, EnvVar] = {v.name: v for v in (
    EnvVar("STAGEFS_TIERS", "none: read from the origin",
           "node-local tiers, fastest first, comma-separated DIR[:SIZE] "
           "(e.g. /dev/shm/me/data:16GiB,/nvme/me/data:80%), used when no --tier is given"),
    EnvVar("STAGEFS_RUNTIME", "/dev/shm/stagefs-<uid>/<job id>",
           "the job's node-local runtime directory (claims, leases, stats, the cluster map)"),
    EnvVar("STAGEFS_JOB", "the batch job id, else session-<sid> of the launching shell",
           "names the job, and so the default runtime directory; processes with the same "
           "name share it (--job sets it)"),
    EnvVar("STAGEFS_SECRET", "~/.config/stagefs/secret",
           "your secret (0600, made on first use) from which daemons started by plain srun "
           "derive the job token; must be the same file on every node"),
    EnvVar("STAGEFS_READ_THREADS", "8", "origin reads in flight at once in read_many"),
    EnvVar("STAGEFS_CLOSED", "0",
           "1: MLPerf Storage CLOSED rules: nothing is informed by the shuffle seed (the "
           "Sampler's clairvoyant prefetch, staging order and locality are off; the tiers "
           "stream shards as reads first ask for them, then the rest of the directory read "
           "in shard order); a Sampler given "
           "closed=False runs open mode, and warns", flag=True),
    EnvVar("STAGEFS_ORIGIN_READAHEAD", "off",
           "'kernel' leaves the kernel's readahead on for shards read from the origin"),
    EnvVar("STAGEFS_ORIGIN_DIRECT", "1",
           "0: the streams' large reads of the origin go through the page cache (by default "
           "they bypass it with O_DIRECT where the file system allows: the tier holds them)",
           flag=True),
    EnvVar("STAGEFS_SPEEDUPS", "1", "0 turns the C accelerator off (for comparison)", flag=True),
    EnvVar("STAGEFS_MALLOC_TUNE", "1", "0 leaves glibc's malloc thresholds as they are",
           flag=True),
    EnvVar("STAGEFS_TIER_MAP", "1",
           "0: read_many reads a memory tier with pread, not through a mapping (slower; the "
           "tier's pages then do not count in the process's RSS)", flag=True),
    EnvVar("STAGEFS_CONNECT_TIMEOUT", "0",
           "seconds to wait for this node's daemon to publish the cluster (--connect)"),
    EnvVar("STAGEFS_PEER_TIMEOUT", "10",
           "seconds a peer may take to answer before a read goes elsewhere"),
    EnvVar("STAGEFS_FABRIC", "1",
           "0: training processes read other nodes directly, not through their node's daemon",
           flag=True),
    EnvVar("STAGEFS_RELAY_PIPES", "1",
           "0: 'stagefs serve' relays its readers' ranges from peers through memory, not "
           "kernel pipes (splice)", flag=True),
    EnvVar("STAGEFS_FUSE_PUSH", "1",
           "0: a FUSE mount with tiers does not put the files its streams bring into the "
           "kernel's page cache ahead of the reads (read-ahead across files)", flag=True),
    EnvVar("STAGEFS_INTERFACE", "none: --bind, else the host name's address",
           "the network interface 'stagefs serve' listens on (like --interface)"),
    EnvVar("STAGEFS_BENCH_PEER_PYTHON", "this Python",
           "the Python that has the compared systems installed, for 'stagefs bench'"),
    EnvVar("STAGEFS_REQUIRE_SPEEDUPS", "0",
           "read when installing (setup.py): 1 makes a failed build of the C accelerator or "
           "the preload library an error instead of a warning", flag=True),
    EnvVar("STAGEFS_INTERCEPT_AT", "", "set by 'stagefs run': the path served", True),
    EnvVar("STAGEFS_INTERCEPT_DATASET", "", "set by 'stagefs run': the dataset", True),
    EnvVar("STAGEFS_INTERCEPT_STORE", "", "set by 'stagefs run': the store, pickled", True),
    EnvVar("STAGEFS_MOUNT_LOG", "", "set by 'stagefs mount': the detached server's log", True),
    EnvVar("STAGEFS_PRELOAD_INDEX", "", "set by 'stagefs run': the preload library's index",
           True),
    EnvVar("STAGEFS_PRELOAD_FDS", "", "set by the preload library for an exec'd program: "
           "the staged descriptors it inherits", True),
    EnvVar("STAGEFS_PRELOAD_CWD", "", "set by the preload library for an exec'd program: "
           "its current directory in the staged tree", True),
)}


def env(name: str, default: str | None = None) -> str | None:
    """Read ``STAGEFS_<NAME>``; the one place environment variables are looked at. Each is
    listed in ENV_VARS (shown by ``--help`` and docs/cli.md)."""
    key = f"STAGEFS_{name.upper()}"
    if key not in ENV_VARS:
        raise KeyError(f"{key} is not in stagefs.config.ENV_VARS: add it there")
    value = os.environ.get(key)
    return default if value in (None, "") else value


def env_number(name: str, default: float, *, whole: bool = False, least: float = 0,
               above: bool = False) -> float:
    """A number ``STAGEFS_<NAME>`` (seconds, a count: ``whole``), at least ``least`` (more
    than it: ``above``); unset, ``default``; anything else is a ConfigError that names the
    variable and what it takes (``float()`` raised its own ValueError, with a traceback and
    no name: STAGEFS_CONNECT_TIMEOUT=abc)."""
    key = f"STAGEFS_{name.upper()}"
    value = env(name)
    if value is None:
        return default
    kind = "a whole number" if whole else "a number"
    try:
        number: float = int(value) if whole else float(value)
    except ValueError:
        number = math.nan
    if math.isnan(number) or math.isinf(number):
        raise ConfigError(f"{key} must be {kind}, not {value!r}; unset it for the default "
                          f"({default:g})")
    if number < least or (above and number == least):
        raise ConfigError(f"{key} must be {'more than' if above else 'at least'} {least:g}, "
                          f"not {value!r}")
    return number


_FLAGS = {"1": True, "true": True, "yes": True, "on": True,
          "0": False, "false": False, "no": False, "off": False}


def env_flag(name: str, default: bool = True) -> bool:
    """A switch ``STAGEFS_<NAME>``: 1/0 (or true/false, yes/no, on/off); unset, ``default``;
    anything else is a ConfigError that names it (not silently taken as on)."""
    value = env(name)
    if value is None:
        return default
    flag = _FLAGS.get(value.strip().lower())
    if flag is None:
        raise ConfigError(f"STAGEFS_{name.upper()}={value!r} is not a switch: use 1 or 0 "
                          "(or true/false, yes/no, on/off), or unset it for the default")
    return flag


def flag_errors() -> list[tuple[str, ConfigError]]:
    """Each switch set in the environment (``EnvVar.flag``) that is not one: its name and
    the error ``env_flag`` raises for it."""
    bad = []
    for var in ENV_VARS.values():
        if var.flag:
            try:
                env_flag(var.name.removeprefix("STAGEFS_"))
            except ConfigError as exc:
                bad.append((var.name, exc))
    return bad


def check_flags() -> None:
    """Refuse a switch set in the environment that is not one (ConfigError, naming it)
    before a command starts, not when (and where) it is first read: ``stagefs bench`` ran
    some systems and failed others."""
    bad = flag_errors()
    if bad:
        raise bad[0][1]
