"""A node-local tier: a directory (on /dev/shm or a local disk) holding shards, whole or in
pieces.

Layout (shared with every other writer): ``<tier dir>/<pack id hex>/<shard file name>``,
byte-identical to the pack's shard file. A shard is held whole iff that file exists under
its final name; writers fill ``NAME.partial`` piece by piece (tiers/fill.py) and rename it
once every piece is there. A copy whose tier has no room for every piece stays partial.

The room a tier uses is counted in bytes of data (whole copies, reserved pieces) by a
counter kept in the tier (``Room``): every process of the user that places into it, of this
job or another, counts in it and changes it under the tier's lock beside it.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import logging
import mmap
import os
import resource
import shutil
import stat
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, fields
from typing import Any

from stagefs._fsutil import (
    login,
    movable_by_others,
    open_own_file,
    open_read,
    private_makedirs,
    user_name,
)
from stagefs._sysinfo import memory_limit_room
from stagefs.config import TierSpec, env_flag, format_size
from stagefs.errors import ConfigError, FormatError
from stagefs.format import Manifest, ShardHeader
from stagefs.format.spec import SHARD_HEADER
from stagefs.runtime import TIER_ROOM_DIR
from stagefs.tiers.base import (
    DESCRIPTORS,
    MAPPINGS_GUARDED,
    READER_DESCRIPTORS,
    DamagedCopy,
    Gathered,
    SourceUnavailable,
    gather,
    pread_full,
)

log = logging.getLogger("stagefs")
_told_limit: set[int] = set()  # the limits a process was told are too low (once each)

__all__ = ["DirTier", "Room", "TierStats", "fs_type", "memory_limit_problem", "over_capacity",
           "prepare_tier_dir", "share_capacity", "tier_dir_problem", "tier_kind"]


@dataclass
class TierStats:
    """What one tier did in this process."""

    hits: int = 0  # reads it served
    bytes: int = 0  # bytes it served
    placed: int = 0  # shards this process made whole in it
    pieces: int = 0  # pieces this process reserved in it
    placed_bytes: int = 0
    filled: int = 0  # extents (fill.Extents) written into partial copies by reads
    filled_bytes: int = 0
    dropped: int = 0  # copies deleted because a read found them corrupt

    def as_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def fs_type(path: str) -> str:
    """The file system type of the mount holding ``path`` (``tmpfs``, ``ext4``, ...)."""
    best, kind = "", "unknown"
    real = os.path.realpath(path)
    try:
        with open("/proc/self/mounts") as f:
            for line in f:
                parts = line.split()
                if len(parts) < 3:
                    continue
                mnt = parts[1].replace("\\040", " ")
                if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and len(mnt) > len(best):
                    best, kind = mnt, parts[2]
    except OSError:
        pass
    return kind


def tier_kind(path: str) -> str:
    """``memory`` for a tier on tmpfs or ramfs (its pages are the node's memory), else
    ``disk``."""
    return "memory" if fs_type(path) in ("tmpfs", "ramfs") else "disk"


def _nearest_existing(path: str) -> str:
    """``path`` itself or its nearest ancestor that exists."""
    while not os.path.lexists(path):
        path = os.path.dirname(path)
    return path


def tier_dir_problem(path: str) -> str | None:
    """Why the tier directory ``path`` cannot be used or created (None: it can).

    Missing directories are created below an existing one at least two levels deep
    (``/dev/shm/me/t0``, ``/local/nvme/me/t1``, a job's scratch directory). Below ``/`` or a
    directory right under it, a missing parent is most likely a typo (``/dev/shmm/t0``,
    ``/scrach/t1``): creating it would silently stage into a directory nobody meant,
    perhaps on the wrong file system, so it is an error naming it.

    A tier another user made first (a directory of theirs, in a directory of theirs, or a
    symlink of theirs: a predictable name on a shared ``/dev/shm``) is refused, naming them:
    they could move this user's copies away, or swap in a directory where copies are
    written into files of theirs.
    """
    path = os.path.abspath(path)
    with contextlib.suppress(OSError):
        link = os.lstat(path)
        if stat.S_ISLNK(link.st_mode) and link.st_uid not in (0, os.getuid()):
            return (f"tier {path} is a symlink (to {os.readlink(path)}) made by "
                    f"{user_name(link.st_uid)}: copies would go wherever its maker points "
                    "it; name a directory of your own")
        if stat.S_ISLNK(link.st_mode) and not os.path.exists(path):
            # (made, its copies would go wherever the link points: not made here)
            target = os.path.join(os.path.dirname(path), os.readlink(path))
            return (f"tier {path} is a symlink to {os.path.normpath(target)}, which does "
                    f"not exist (removed since?); create it (mkdir -p "
                    f"{os.path.normpath(target)}), or name an existing directory")
    why = movable_by_others(path if os.path.isdir(path) else os.path.dirname(path))
    if why:
        return (f"tier {path}: {why}: another user may move this user's copies there away "
                "or put theirs in their place; name a tier directory of your own, in a "
                "directory only you may change or a sticky one (/dev/shm)")
    try:  # one look: the job's other processes may create it meanwhile (a worker pool
        # opening its stores at once: "is a file" was said of a directory made between an
        # isdir() that found nothing and an exists() that found it)
        mode: int | None = os.stat(path).st_mode
    except OSError:
        mode = None
    if mode is not None and stat.S_ISDIR(mode):
        if _read_only(path):
            return (f"tier {path} is on a read-only file system; name a directory on a "
                    "writable one")
        if not os.access(path, os.W_OK | os.X_OK):
            return f"tier {path} is not writable by this user; name a writable directory"
        return None
    if mode is not None:
        return f"tier {path} is a file, not a directory; name a directory"
    parent = os.path.dirname(path)
    base = _nearest_existing(parent)
    if not os.path.isdir(base):
        return f"tier {path}: {base} is a file, not a directory; correct the path"
    missing = parent[len(base):].lstrip("/").split("/", 1)[0]
    if base != parent and base.count("/") <= 1:
        top = os.path.join(base, missing)
        return (f"tier {path}: {top} does not exist (a typo?); correct the path, or create "
                f"it first: mkdir -p {parent}")
    if _read_only(base):
        return (f"tier {path} does not exist and cannot be created: {base} is on a "
                "read-only file system; name a directory on a writable one")
    if not os.access(base, os.W_OK | os.X_OK):
        return (f"tier {path} does not exist and cannot be created: {base} is not "
                "writable by this user; create it, or name a writable directory")
    return None


def over_capacity(held: int, capacity: int | None) -> str | None:
    """What a tier holding ``held`` bytes, more than the ``capacity`` it is given, does and
    how its room is freed (a run given more room placed them, or other datasets did);
    None if it holds no more. Said by a store that opens it and by ``stagefs doctor``."""
    if capacity is None or held <= capacity:
        return None
    return (f"holds {format_size(held)}, more than the {format_size(capacity)} it is given: "
            "what it holds is kept and read, nothing more is placed there, and nothing is "
            "removed to bring it down; to free the room, 'stagefs clean' (of the job that "
            "placed the copies) or delete the directories no job reads any more")


def memory_limit_problem(path: str, capacity: int | None, held: int = 0,
                         room: int | None = None) -> str | None:
    """Why the memory tier ``path`` (tmpfs) may get the job killed: what it may still take
    (its ``capacity`` less the ``held`` bytes already there, else its file system's free
    space) is more than the job's memory limit leaves (``room``; default: its control
    group's, ``memory_limit_room``). A memory tier's pages count against that limit and are
    never given back: filling it past the limit killed the job (out of memory), with no word
    of why. None if it fits, or no limit applies."""
    room = memory_limit_room() if room is None else room
    if room is None:
        return None
    if capacity is None:  # all the free space of its file system
        try:
            st = os.statvfs(path)
        except OSError:
            return None
        more = st.f_bavail * st.f_frsize
        what = f"the free space of its file system ({format_size(more)}; no capacity given)"
    else:
        more = capacity - held
        what = (f"its capacity ({format_size(capacity)})" if not held else
                f"its capacity less what it holds ({format_size(more)})")
    if more <= room:
        return None
    return (f"memory tier {path}: {what} is more than this job's memory limit leaves "
            f"({format_size(room)}): a memory tier's pages count against that limit, and "
            "filling it would get the job killed (out of memory); give it a capacity well "
            f"under {format_size(held + room)} (the training needs memory too), or ask the "
            "batch system for more memory (Slurm: --mem)")


def _read_only(path: str) -> bool:
    """Is ``path`` on a file system mounted read-only? (Not a permission: no chmod or
    other user makes it writable.)"""
    try:
        return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except OSError:
        return False


def prepare_tier_dir(path: str) -> None:
    """Create a tier directory (and its missing parents, where tier_dir_problem allows),
    else raise a ConfigError naming it. Parents it had to create are said on the log."""
    problem = tier_dir_problem(path)
    if problem:
        raise ConfigError(problem)
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        log.warning("tier %s: created its parent directories (%s did not exist)", path,
                    parent)
    try:
        private_makedirs(parent)
        os.mkdir(path, mode=0o700)
    except FileExistsError:
        pass  # it was there, or another process of the job created it first
    except OSError as exc:
        raise ConfigError(f"tier {path} cannot be created ({exc.strerror}); create it or "
                          "name a writable directory") from None


class Room:
    """Bytes a tier holds (whole copies and reserved pieces, of every dataset), counted in
    one file in the tier itself: ``<tier>/.stagefs-<uid>/room``, 8 bytes (then 8 more: the
    bytes a process found no room for, ``full``), read and changed only under the tier's
    lock, the file ``lock`` beside it. Every process of the user that places into the tier
    counts there, whatever its job: with a counter per job, two jobs sharing a tier
    directory each filled it to its capacity (a 40 MiB tier held 56 MiB). Made, the first
    time the tier is used, from what the tier directory holds (whole files, and the
    allocated bytes of partial copies: a disk tier allocates each piece as it reserves it),
    and counted anew so by the first process of each job (``recount``): the counter stays
    in the tier when its copies are deleted (``stagefs clean``, ``rm -rf TIER/*``).

    The folder is private to the user (0700, refused if another user made it): in a tier
    root shared by users each has a counter of their own, as each has copies of their own.
    """

    def __init__(self, root: str) -> None:
        self.root = root
        # by its real path: processes that name the tier by a symlink share its count and
        # its lock, and take the locks of several tiers in one order (TierChain._tier_lock)
        real = os.path.realpath(root)
        self.folder = os.path.join(real, TIER_ROOM_DIR.format(uid=os.getuid()))
        self.path = os.path.join(self.folder, "room")
        self.lock_path = os.path.join(self.folder, "lock")
        self.key = hashlib.sha1(os.fsencode(real)).hexdigest()[:16]  # a job's markers

    def make(self) -> None:
        """Create the folder, or check the one there is this user's own directory."""
        self.remake()
        s = os.lstat(self.folder)
        if not stat.S_ISDIR(s.st_mode) or s.st_uid != os.getuid():
            what = "a symlink" if stat.S_ISLNK(s.st_mode) else (
                "not a directory" if not stat.S_ISDIR(s.st_mode) else "a directory")
            raise ConfigError(
                f"tier {self.root}: {self.folder}, where this user's room counter and lock "
                f"for the tier go, is {what} of {user_name(s.st_uid)}; remove it if it is "
                f"yours, or name a tier directory of your own, e.g. "
                f"{os.path.join(self.root, login(os.getuid()))}")

    def remake(self) -> None:
        """Make the folder again if it was removed (``rm -rf TIER/*`` takes dot files too;
        the tier itself gone is said as removed by its placement, ``DirTier.why_stopped``)."""
        with contextlib.suppress(FileExistsError):
            os.mkdir(self.folder, mode=0o700)

    def used(self) -> int:
        raw = self._read(0)  # none yet, or not a file: counted anew, and made one (_write)
        if len(raw) == 8 and (value := int.from_bytes(raw, "little", signed=True)) >= 0:
            return value
        total, unwritten = dir_usage(self.root)
        self._write(total - unwritten)
        return total - unwritten

    def add(self, n: int) -> None:
        self._write(max(0, self.used() + n))

    def recount(self, adjust: int = 0) -> int:
        """Count the room anew from what the tier directory holds (as when it was made),
        plus ``adjust`` (the caller's own copies as it charges them, less their allocated
        bytes): a copy deleted from outside (``rm``, a cleanup of the tier) is no longer
        counted. The caller holds the tiers' lock."""
        total, unwritten = dir_usage(self.root)
        value = max(0, total - unwritten + adjust)
        self._write(value)
        return value

    def full(self) -> int:
        """The bytes a process of the job found no room for in the tier (``set_full``;
        bytes 8-15 of the file), or 0. The caller holds the tiers' lock."""
        raw = self._read(8)
        return int.from_bytes(raw, "little") if len(raw) == 8 else 0

    def set_full(self, need: int) -> None:
        """Say, for every process of the job, that ``need`` bytes found no room in the tier
        (0: room was freed since); the caller holds the tiers' lock."""
        self._write(max(0, need), 8)

    def _read(self, at: int) -> bytes:
        """The 8 bytes at ``at`` of the file, or fewer (none yet, a symlink, not a file)."""
        try:  # without waiting: a FIFO left under its name would hold the tiers' lock
            fd, info = open_read(self.path, os.O_NOFOLLOW)
        except OSError:
            return b""
        try:
            return os.pread(fd, 8, at) if stat.S_ISREG(info.st_mode) else b""
        finally:
            os.close(fd)

    def _write(self, value: int, at: int = 0) -> None:
        try:
            fd = open_own_file(self.path, os.O_WRONLY)
        except FileNotFoundError:  # the folder removed
            self.remake()
            fd = open_own_file(self.path, os.O_WRONLY)
        try:
            os.pwrite(fd, value.to_bytes(8, "little", signed=True), at)
        finally:
            os.close(fd)


class DirTier:
    """One tier for one dataset: ``pread`` serves held shards through one cached fd each."""

    local = True  # node-local: Store.read_many reads it in the calling thread

    def __init__(self, spec: TierSpec, manifest: Manifest, *, counted: bool = False) -> None:
        """``counted``: a tier the caller places into, with a room counter (``Room``)."""
        self.spec = spec
        self.root = spec.path
        prepare_tier_dir(self.root)
        self.capacity = spec.capacity if spec.share is None else share_capacity(self.root,
                                                                                spec.share)
        self.pack_id = manifest.pack_id.hex()
        self.dir = os.path.join(self.root, self.pack_id)
        with contextlib.suppress(FileExistsError):  # (what is there is judged below)
            os.makedirs(self.dir, mode=0o700, exist_ok=True)
        s = os.lstat(self.dir)
        owner = s.st_uid
        if not stat.S_ISDIR(s.st_mode):  # made first by another user, in a shared tier
            what = (f"a symlink to {os.readlink(self.dir)}" if stat.S_ISLNK(s.st_mode)
                    else "not a directory")
            raise ConfigError(
                f"tier {self.root}: {self.dir}, where this dataset's copy goes, is {what}, "
                f"made by {user_name(owner)}: copies are never placed through it; remove it "
                f"if it is yours, or name a tier directory of your own, e.g. "
                f"{os.path.join(self.root, login(os.getuid()))}")
        if owner != os.getuid():  # a tier root shared by users, each copy private to one
            raise ConfigError(
                f"tier {self.root}: the copy of this dataset there, {self.dir}, belongs to "
                f"{user_name(owner)}, and this user ({user_name(os.getuid())}) may not use "
                f"it; name a tier directory of your own, e.g. "
                f"{os.path.join(self.root, login(os.getuid()))}")
        self.kind = tier_kind(self.root)
        # what its file system allocates at least: room is counted in these (fill.py)
        try:
            self.block = max(mmap.PAGESIZE, os.statvfs(self.root).f_frsize)
        except OSError:
            self.block = mmap.PAGESIZE
        self.holder = self.kind  # what the read counters call it (stagefs status)
        self.room = Room(self.root) if counted else None
        if self.room is not None:
            self.room.make()
        self.name = f"{self.kind} tier {self.root}"
        self._names = [s.name for s in manifest.shards]
        self._sizes = [s.size for s in manifest.shards]
        self._index = {n: i for i, n in enumerate(self._names)}
        self._fds: dict[int, int] = {}
        self._maps: dict[int, mmap.mmap] = {}  # memory tier: held copies mapped (gather_many)
        # (the pages a process touches through them count in its RSS, as shared memory:
        # STAGEFS_TIER_MAP=0 preads instead, for a scheduler that sums its tasks' RSS)
        # (and only where gather's C form guards the copies: base.MAPPINGS_GUARDED)
        self._mapped = self.kind == "memory" and env_flag("TIER_MAP") and MAPPINGS_GUARDED
        self._lock = threading.Lock()
        self._retired: list[int] = []  # descriptors let go of while in use (_retire)
        self.stats = TierStats()
        self.stopped: str | None = None  # why placement into this tier stopped, if it did
        # its room was counted anew from its directory since it was last found full (no_room)
        self.recounted = False
        # the chain deletes a corrupt copy (shard, its inode if known) and forgets it
        self.on_drop: Callable[[int, tuple[int, int] | None], None] | None = None
        # the chain's copies of this dataset as it charges them less their allocated bytes
        # (Room.recount): a room counted anew matches what their drops will free
        self.charges: Callable[[], int] | None = None

    def __repr__(self) -> str:
        cap = "free space" if self.capacity is None else format_size(self.capacity)
        return f"<DirTier {self.kind} {self.root} ({cap})>"

    def path(self, shard: int) -> str:
        return os.path.join(self.dir, self._names[shard])

    def index_of(self, name: str) -> int | None:
        """The shard whose copy's file name is ``name``, if any."""
        return self._index.get(name)

    # -- holding ---------------------------------------------------------------------------

    def holds(self, shard: int) -> bool:
        """Is the shard here? Opens (and keeps) its fd: one local syscall on a miss."""
        if shard in self._fds:
            return True
        if not 0 <= shard < len(self._names):
            return False
        if not DESCRIPTORS.take() and not (self._unmap_one() and DESCRIPTORS.take()):
            self._no_descriptors()
            return False
        try:
            # without waiting: a FIFO left under a copy's name would hold a plain open (and
            # the read behind it) for a writer forever; what is not a file is not a copy
            fd, info = open_read(self.path(shard))
        except OSError:
            DESCRIPTORS.give()
            return False
        if not stat.S_ISREG(info.st_mode) or info.st_size != self._sizes[shard]:
            os.close(fd)  # not ours to judge further: the reader's checksum decides
            DESCRIPTORS.give()
            return False
        with self._lock:
            if shard in self._fds:
                os.close(fd)
                DESCRIPTORS.give()
            else:
                self._fds[shard] = fd
        return True

    def _unmap_one(self) -> bool:
        """Let go of the oldest mapping (unmapped once no batch under way holds it), if
        any: a copy's descriptor comes before a mapping, which only makes a batch faster.
        With the tier copies' share of the limit taken by mappings, the copies past them
        were read from the origin (0.04 of a pack of 400 shards an epoch under 1,024)."""
        with self._lock:
            if not self._maps:
                return False
            del self._maps[next(iter(self._maps))]
        DESCRIPTORS.give()
        return True

    def _no_descriptors(self) -> None:
        """Say once a process that copies held here are read from the origin: the process's
        tier copies hold what its open-file limit leaves them (``Descriptors``)."""
        if _told_limit:
            return
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        _told_limit.add(soft)
        log.warning("%s: this process's tier copies hold %d descriptors, what its open-file "
                    "limit (%d) leaves them: the copies it has not opened yet are read from "
                    "the origin. Raise the limit before training starts (ulimit -n; above "
                    "the hard limit: ulimit -Hn, limits.conf nofile, or Slurm's "
                    "PropagateResourceLimits)", self.name, DESCRIPTORS.held, soft)

    def header_ok(self, shard: int, pack_id: bytes) -> bool:
        """Does the held copy's header name this pack and shard, with the right length?"""
        fd = self._fds.get(shard)
        if fd is None and not (self.holds(shard) and (fd := self._fds.get(shard)) is not None):
            return False
        try:
            raw = os.pread(fd, SHARD_HEADER.size, 0)
            ShardHeader.decode(raw, self.path(shard)).check(
                self.path(shard), index=shard, pack_id=pack_id, file_size=self._sizes[shard])
        except (OSError, FormatError):
            return False
        return True

    def held(self) -> set[int]:
        """Every shard of this dataset the tier holds now (one directory listing)."""
        try:
            names = os.listdir(self.dir)
        except FileNotFoundError:
            return set()
        return {self._index[n] for n in names if n in self._index}

    def used_bytes(self) -> int:
        """Bytes of data the tier holds (every dataset): its room counter if it has one,
        else the bytes allocated in its directory; none once this dataset's directory is
        gone (removed while the job ran: the counter still counts the copies it held)."""
        if not self.present():
            return 0
        if self.room is not None:
            with contextlib.suppress(OSError):
                return self.room.used()
        return dir_bytes(self.root)

    def present(self) -> bool:
        """Whether this dataset's directory in the tier is still there: not removed while
        the job ran, with the tier's (``rm -rf TIER``) or alone (``rm -rf TIER/*``, the
        tier's root left: its copies gone just the same)."""
        return os.path.isdir(self.dir)

    def why_stopped(self) -> str | None:
        """Why placement into the tier stopped (``stopped``), or None; its directory removed
        while the job ran, whatever stopped it before: a tier full, then removed, was said to
        be full (and hold 0 B) for the rest of the job."""
        if not self.present():
            return self.failure(FileNotFoundError(errno.ENOENT, "removed", self.dir))
        return self.stopped

    def failure(self, exc: OSError) -> str:
        """Why placement into the tier stopped, for ``exc`` met writing a copy: what a user
        can act on, not the errno of one of its files."""
        if exc.errno in NO_SPACE:
            return "no space left on device"
        if exc.errno == errno.ENOENT and not self.present():
            gone = self.dir if os.path.isdir(self.root) else self.root
            return (f"its directory {gone} was removed while the job ran; the reads "
                    "its copies would have served go to the origin")
        return str(exc)

    def no_room(self, size: int) -> str | None:
        """Why ``size`` more bytes do not fit (the caller holds the tiers' lock): ``"full"``
        (the tier's capacity), ``"no space left on device"`` (its file system), or None."""
        if self.capacity is not None:
            used = self.room.used() if self.room is not None else dir_bytes(self.root)
            if used + size > self.capacity and self.room is not None and not self.recounted:
                # full by the counter: once (until room is freed again), counted anew from
                # the directory, in case copies were deleted from outside since it was made
                # (they would stay counted for the rest of the job, and the tier never take
                # their shards again)
                self.recounted = True
                counted = used
                used = self.room.recount(self.charges() if self.charges else 0)
                if used < counted:
                    log.info("%s: %s counted that it no longer holds (deleted from outside?); "
                             "its room is free again", self.name,
                             format_size(counted - used))
            if used + size > self.capacity:
                return "full"
        try:
            st = os.statvfs(self.root)
        except OSError:
            return None
        if st.f_bavail * st.f_frsize < size:
            return "no space left on device"
        return None

    # -- ShardSource ----------------------------------------------------------------------

    def pread(self, shard: int, offset: int, length: int) -> bytes:
        fd = self._held_fd(shard)
        if fd is None:
            raise SourceUnavailable(f"{self.name}: shard {shard} not held")
        try:
            data = pread_full(fd, length, offset)
        except OSError as exc:
            raise SourceUnavailable(f"{self.path(shard)}: {exc.strerror}") from exc
        if len(data) != length:
            if offset < 0 or length < 0 or offset + length > self._sizes[shard]:
                raise SourceUnavailable(f"{self.path(shard)}: no range [{offset}, "
                                        f"{offset + length}) in the shard")
            self.drop(shard)  # cut short under us: dropped, placed anew
            raise DamagedCopy(f"{self.path(shard)}: short read (cut short?)")
        self.stats.hits += 1
        self.stats.bytes += length
        return data

    def _held_fd(self, shard: int) -> int | None:
        """The open fd of the held copy of ``shard`` (opened now if it is here), or None."""
        fd = self._fds.get(shard)
        if fd is None and self.holds(shard):
            fd = self._fds.get(shard)
        return fd

    def gather_many(self, ranges: Sequence[tuple[int, int, int]],
                    pool: Executor | None = None, parts: int = 1) -> Gathered:
        """The bytes of each (shard, offset, length) and their hashes (``gather``: in
        ``parts`` at once with a ``pool``), None where the shard is not held (or the range
        is not in it): a batch of reads in one call.

        A memory tier copies them out of a read-only mapping of each held copy: on tmpfs
        that is twice the speed of pread (docs/decisions/0016-batched-reads.md), unless
        ``STAGEFS_TIER_MAP=0``. A disk tier preads them: a cold page there is one read, not
        a fault per page.
        """
        sources: list[Any] = []
        of: dict[int, Any] = {}
        for shard, _, _ in ranges:
            src = of.get(shard, False)
            if src is False:
                src = self._source(shard)
                of[shard] = src
            sources.append(src)
        got = gather(sources, [r[1] for r in ranges], [r[2] for r in ranges], pool=pool,
                     parts=parts)
        hits = nbytes = 0
        for data in got.datas:
            if data is not None:
                hits += 1
                nbytes += len(data)
        self.stats.hits += hits
        self.stats.bytes += nbytes
        return got

    def _source(self, shard: int) -> Any:
        """What ``gather`` reads ``shard``'s held copy from: its mapping (a memory tier),
        else its descriptor; -1 if it is not held. A mapping is checked to be whole first
        (one fstat a shard a batch)."""
        if self._mapped:
            mm = self._maps.get(shard) or self._map(shard)
            if mm is not None:  # (cut short later, under the copy: gather's item is None)
                return mm if self._whole_still(shard, len(mm)) else -1
            # not mapped (the descriptors a mapping takes are the process's tier copies'
            # share, Descriptors: all taken): read through its descriptor, not the origin
        fd = self._held_fd(shard)
        return -1 if fd is None else fd

    def _whole_still(self, shard: int, size: int) -> bool:
        """Is the mapped copy still ``size`` bytes long (one fstat a shard a batch)? If not
        (cut short), it is dropped."""
        fd = self._fds.get(shard)
        try:
            if fd is None or os.fstat(fd).st_size >= size:
                return True
        except OSError:
            return True
        self.drop(shard)
        return False

    def _map(self, shard: int) -> mmap.mmap | None:
        """A read-only mapping of the held copy of ``shard`` (kept until it is dropped)."""
        fd = self._held_fd(shard)
        if fd is None:
            return None
        size = self._sizes[shard]
        if not DESCRIPTORS.take():  # (a mapping holds a descriptor of its own)
            return None
        try:
            # copies are replaced by rename and dropped by unlink, never cut short: a mapping
            # stays whole; the size is checked in case something else cut it
            if os.fstat(fd).st_size != size:
                DESCRIPTORS.give()
                return None
            mm = mmap.mmap(fd, size, prot=mmap.PROT_READ)
        except (OSError, ValueError):
            DESCRIPTORS.give()
            return None
        with self._lock:
            got = self._maps.setdefault(shard, mm)
        if got is not mm:
            DESCRIPTORS.give()  # (unmapped as it is dropped)
        return got

    def drop(self, shard: int) -> None:
        """A read found this copy corrupt: delete it (all processes stop using it). With a
        chain (``on_drop``), the chain deletes it under the tiers' lock, only if it is still
        the copy this process read (another process may have dropped it first, and placed
        the shard again), and frees its room once."""
        with self._lock:
            unmapped = self._maps.pop(shard, None)  # once no batch under way holds it
            fd = self._fds.pop(shard, None)
        if unmapped is not None:
            DESCRIPTORS.give()
        ino: tuple[int, int] | None = None
        if fd is not None:
            with contextlib.suppress(OSError):
                st = os.fstat(fd)
                ino = (st.st_dev, st.st_ino)
            self._retire(fd)
        self.stats.dropped += 1
        if self.on_drop is not None:
            self.on_drop(shard, ino)
            return
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path(shard))

    def adopt(self, shard: int, fd: int) -> bool:
        """Keep ``fd`` (opened on the file just renamed into place) as the shard's fd,
        unless a reader opened one already (then the caller keeps ``fd``)."""
        with self._lock:
            if shard in self._fds or not DESCRIPTORS.take():
                return False
            self._fds[shard] = fd
        return True

    def reset_after_fork(self) -> None:
        self._lock = threading.Lock()
        self.stats = TierStats()

    def forget(self, shard: int) -> None:
        with self._lock:
            unmapped = self._maps.pop(shard, None)
            fd = self._fds.pop(shard, None)
        if unmapped is not None:
            DESCRIPTORS.give()
        if fd is not None:
            self._retire(fd)

    def still_held(self, shard: int) -> bool:
        """Is the copy of ``shard`` this process holds open still the file at its path (two
        stats)? True if it holds none open (``holds`` opens what is there)."""
        fd = self._fds.get(shard)
        if fd is None:
            return True
        try:
            a, b = os.fstat(fd), os.stat(self.path(shard))
        except FileNotFoundError:
            return False
        except OSError:
            return True  # (not ours to judge: a read of it says what is wrong)
        return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)

    def forget_gone(self) -> int:
        """Let go of the descriptors of copies no longer at their path (deleted, or replaced
        by another file, by the process that places them: a cluster's daemon started again
        on emptied tiers), which pinned their blocks for this process's life; ``holds``
        opens what is there now. How many were let go of."""
        with self._lock:
            held = list(self._fds.items())
        gone = 0
        for shard, _ in held:
            if not self.still_held(shard):
                self.forget(shard)
                gone += 1
        return gone

    def _retire(self, fd: int) -> None:
        """Let go of a copy's descriptor that another thread may be using now (a read, a
        mapping being made): it is pointed at /dev/null, so that such a thread reads nothing
        (a short read: the next holder) and maps nothing, and its number is kept until the
        tier closes, so that no file opened meanwhile takes it. Closed at once instead, a
        thread mapping the copy mapped whatever file got the number next, and died of SIGBUS
        copying out of it. The copy's blocks are freed at once all the same (unless a
        mapping of it is in use). One descriptor for each copy dropped (damaged copies)."""
        try:
            null = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
            try:
                os.dup2(null, fd, inheritable=False)
            finally:
                os.close(null)
        except OSError:
            os.close(fd)
            DESCRIPTORS.give()
            return
        self._retired.append(fd)

    def close(self) -> None:
        with self._lock:
            for fd in [*self._fds.values(), *self._retired]:
                os.close(fd)
            DESCRIPTORS.give(len(self._fds) + len(self._retired) + len(self._maps))
            self._fds.clear()
            self._retired.clear()
            self._maps.clear()  # each unmapped once no batch under way holds it


def descriptors_to_read(shards: int, memory: bool) -> int:
    """The open files a reader may hold reading ``shards`` held in tiers (one a shard, two
    on a memory tier: ``read_many`` maps them), and its own (its origin's are at most a
    quarter of its limit: ``PackOrigin``)."""
    return shards * (2 if memory else 1) + READER_DESCRIPTORS


def check_fd_limit(shards: int, memory: bool, whose: str) -> None:
    """Say so (once a process) when the open-file limit, raised to the hard one, cannot hold
    a descriptor for each of ``whose`` (this node's, its tiers') ``shards`` and the origin's
    quarter: a copy past it is not opened (read from the origin; ``Descriptors``)."""
    need = descriptors_to_read(shards, memory)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft - soft // 4 >= need or soft in _told_limit:
        return
    _told_limit.add(soft)
    want = need + need // 3
    log.warning(
        "the open-file limit of this process (%d, its hard limit %s) is below what reading "
        "%s %d shards may take (%d descriptors: one a shard%s, a quarter of the limit for "
        "the origin's, and the process's own): the copies past it are read from the "
        "origin instead (a memory tier maps fewer first). Raise it before training starts: "
        "ulimit -n %d (above the hard limit: ulimit -Hn, limits.conf nofile, or Slurm's "
        "PropagateResourceLimits)", soft,
        "unlimited" if hard == resource.RLIM_INFINITY else hard, whose, shards, want,
        ", two on a memory tier" if memory else "", want)


def share_capacity(root: str, share: float) -> int:
    """The capacity of a tier given as ``share`` percent of its file system's free space: of
    the free space and what the tier directory holds already. Of the free space alone, a
    tier opened again with its data in it (a job restarted with its tiers kept, a rank that
    opens it later) got less room: 50% of a 64 MiB file system was 32 MiB, and 28 MiB once
    the job had staged 8 MiB there."""
    return int((shutil.disk_usage(root).free + dir_bytes(root)) * share / 100)


def dir_bytes(root: str) -> int:
    """Bytes allocated to the files one and two levels below ``root`` (a sparse partial
    copy counts what it holds, not its apparent size)."""
    total, unwritten = dir_usage(root)
    return total - unwritten


def dir_usage(root: str) -> tuple[int, int]:
    """Apparent bytes of the files one and two levels below ``root``, and how many of them
    are not allocated yet (sparse partial copies, to be written). A directory this user
    cannot read (another user's, in a tier on a shared ``/dev/shm`` or scratch directory)
    is not ours to count: its bytes are not this job's to hold, and failing on it stopped
    placement into the whole tier. Nor is one it can read, or a file of another user: in a
    tier shared by users, another user's readable directory of hard links to one file
    counted that file's size once per link, and a few MiB of theirs filled this job's tier
    of any capacity."""
    total = unwritten = 0
    me = os.getuid()

    def add(st: os.stat_result) -> None:
        nonlocal total, unwritten
        total += st.st_size
        unwritten += max(0, st.st_size - st.st_blocks * 512)

    try:
        with os.scandir(root) as it:
            top = list(it)
    except FileNotFoundError:
        return 0, 0
    for d in top:
        if d.name.startswith(".stagefs-"):
            continue  # a room counter and its lock (Room): not data
        try:
            s = d.stat(follow_symlinks=False)
            if s.st_uid != me:
                continue
            if stat.S_ISDIR(s.st_mode):
                with os.scandir(d.path) as it:
                    for f in it:
                        with contextlib.suppress(FileNotFoundError):
                            if f.is_file(follow_symlinks=False):
                                fs = f.stat(follow_symlinks=False)
                                if fs.st_uid == me:
                                    add(fs)
            elif stat.S_ISREG(s.st_mode):
                add(s)
        except (FileNotFoundError, PermissionError):
            continue
    return total, unwritten


NO_SPACE = (errno.ENOSPC, errno.EDQUOT)
