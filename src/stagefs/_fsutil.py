"""Two file-system habits every layer shares: an atomic write and a lock file.

``atomic_write`` never leaves a half-written file under its final name: the bytes go to a
partial file with a name of its own in the same directory, are flushed to disk, and the
partial file is renamed over the final name; on any error the partial file is removed.
Readers see the old file or the new one, never a mix (the rename is atomic).

``file_lock`` serialises processes of one node on a lock file (``flock`` through the
``filelock`` package), for a "look, then act" step that must not interleave.

Shard copies into tiers are not written here: they are filled piece by piece by several
processes under a fill map and renamed by their own protocol (tiers/fill.py).

``user_name`` and ``unreachable`` say whose a path is and which directory keeps this user
out of it: on a node shared by several users, "no such file" for a dataset another user
keeps private (or a tier copy of theirs) sends the user looking for a typo.

``InUse`` counts the threads using descriptors that a close lets go of, so that they are
closed once the last of those threads is done, never under one of them; ``OpenFiles`` keeps
at most so many files open, the least recently used closed that way.

``worker_pool`` is a process pool whose workers end with the process that made it, so
that a command killed with SIGKILL (``kill -9``, the OOM killer, ``scancel``) leaves none of
them behind. ``in_parts`` splits one call's work over a thread pool and the calling thread.

This module imports nothing of stagefs, so that every layer may use it.
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import contextlib
import ctypes
import errno
import functools
import logging
import os
import pwd
import resource
import secrets
import shutil
import signal
import stat
import sys
import threading
from collections.abc import Callable, Iterator
from typing import BinaryIO, Generic, TypeVar

import filelock

__all__ = [
    "PARTIAL_SUFFIX",
    "InUse",
    "OpenFiles",
    "atomic_write",
    "file_lock",
    "login",
    "movable_by_others",
    "open_own_file",
    "open_read",
    "out_of_descriptors",
    "private_makedirs",
    "pwrite_all",
    "remove_any",
    "unreachable",
    "user_name",
    "worker_pool",
    "write_out",
]

PARTIAL_SUFFIX = ".partial"

Writer = Callable[[BinaryIO], None]


def partial_name(path: str) -> str:
    """A name for the partial file of ``path``, beside it, unique to this call."""
    return f"{path}.{os.getpid()}-{secrets.token_hex(4)}{PARTIAL_SUFFIX}"


def atomic_write(path: str | os.PathLike[str], data: bytes | str | Writer, *,
                 mode: int = 0o666, fsync: bool = True, replace: bool = True) -> bool:
    """Make ``path`` hold ``data`` (bytes, text as UTF-8, or what ``data(f)`` writes to a
    binary file), or leave it as it was. Returns True if this call wrote ``path``.

    ``mode`` is the new file's permission bits (less the umask), applied when it is created,
    so a private file (0o600) is never readable by others, even for an instant.
    ``fsync=False`` skips the flush to disk, for files that are cheap to lose on a crash
    (counters); the rename still keeps readers from seeing a torn file.
    ``replace=False`` never replaces an existing ``path`` (the partial file is linked to the
    name, which fails if it exists, also on NFS): the first of several writers racing to
    create it wins, the others return False and read the winner's file, never a torn one.
    """
    final = os.fspath(path)
    partial = partial_name(final)
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                 mode)
    try:
        with os.fdopen(fd, "wb") as f:
            if callable(data):
                data(f)
            else:
                f.write(data.encode() if isinstance(data, str) else data)
            f.flush()
            if fsync:
                os.fsync(f.fileno())
        if replace:
            os.replace(partial, final)
        else:
            try:
                os.link(partial, final)
            except FileExistsError:
                return False
            finally:
                os.unlink(partial)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(partial)
        raise
    return True


def pwrite_all(fd: int, data: bytes | bytearray | memoryview, pos: int) -> None:
    """Write all of ``data`` at ``pos`` (``os.pwrite`` may write less than asked)."""
    view = memoryview(data)
    while view:
        n = os.pwrite(fd, view, pos)
        view, pos = view[n:], pos + n


class InUse:
    """The threads using something that closing lets go of (descriptors, mappings):
    ``close(release)`` runs ``release`` at once if no thread is, else as the last of them
    leaves. A descriptor closed while another thread read or wrote through it got the number
    of the next file opened, and that thread read, or wrote, the wrong file: shard bytes
    written into whatever the program opened meanwhile.

    ``enter`` before each use (False once closing: the caller says it is closed), ``leave``
    after it, in a ``finally``."""

    __slots__ = ("_lock", "_n", "_release", "closed")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._n = 0
        self._release: Callable[[], object] | None = None
        self.closed = False

    def enter(self) -> bool:
        with self._lock:
            if self.closed:
                return False
            self._n += 1
        return True

    def busy(self) -> bool:
        """Is a thread using it now?"""
        return self._n > 0

    def leave(self) -> None:
        with self._lock:
            self._n -= 1
            if self._n or self._release is None:
                return
            release, self._release = self._release, None
        try:
            release()
        except Exception:  # the last user's own call succeeded: not its error
            logging.getLogger("stagefs").exception("letting go after the last reader failed")

    @contextlib.contextmanager
    def use(self, closed: Callable[[], BaseException]) -> Iterator[None]:
        """``enter`` and ``leave`` around a block; ``closed()`` is raised if closing."""
        if not self.enter():
            raise closed()
        try:
            yield
        finally:
            self.leave()

    def reset_after_fork(self) -> None:
        """In a forked child: the threads using it were the parent's (a lock one of them
        held stays held here). What they would have let go of stays held in the child."""
        self._lock = threading.Lock()
        self._n = 0
        self._release = None

    def close(self, release: Callable[[], object]) -> None:
        """Let go (``release``) now, or once the threads using it are done (once)."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
            if self._n:
                self._release = release
                return
        release()


K = TypeVar("K")


def out_of_descriptors(exc: BaseException) -> bool:
    """Did ``exc``, or what caused it (a holder's SourceUnavailable, its OSError), fail for
    want of a descriptor (EMFILE, ENFILE)?"""
    seen: BaseException | None = exc
    for _ in range(4):
        if seen is None:
            return False
        if isinstance(seen, OSError) and seen.errno in (errno.EMFILE, errno.ENFILE):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


class OpenFiles(Generic[K]):
    """Descriptors of files opened as they are first read, at most ``limit`` open at once:
    past it, the least recently used is closed, once no thread reads through it (``using``
    holds one for a block: ``InUse``). Kept open for the life of the process, one each
    shard read, a pack of 200 shards read with no tier under an open-file limit of 120
    failed at its 115th shard; a hard limit of 4,096 is common on clusters."""

    def __init__(self, limit: int) -> None:
        self.limit = max(1, limit)
        self._lock = threading.Lock()
        self._open: collections.OrderedDict[K, tuple[int, InUse]] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._open)

    def opened(self) -> dict[K, int]:
        """What is open now: each key's descriptor."""
        with self._lock:
            return {k: fd for k, (fd, _) in self._open.items()}

    def take(self, key: K, opener: Callable[[], int]) -> tuple[int, InUse]:
        """``key``'s descriptor (``opener()`` opens it if it is not open: under the lock,
        once however many threads ask) and its use, entered: not closed until the caller
        calls ``leave()`` on it (in a ``finally``). ``using`` in a ``with``; this, on a read
        path where a generator's cost shows (a sample from the page cache: 6%)."""
        shed: list[tuple[int, InUse]] = []
        with self._lock:
            got = self._open.get(key)
            if got is None:
                got = self._open[key] = (self._opened(opener), InUse())
                while len(self._open) > self.limit:
                    shed.append(self._open.popitem(last=False)[1])
            else:
                self._open.move_to_end(key)
            # (one in the table is never closing: it leaves the table, under the lock,
            # before it is closed, so no thread takes it up then)
            got[1].enter()
        for fd, use in shed:
            use.close(functools.partial(os.close, fd))
        return got

    @contextlib.contextmanager
    def using(self, key: K, opener: Callable[[], int]) -> Iterator[int]:
        """``take`` for a block: the descriptor, not closed until the block is done."""
        fd, use = self.take(key, opener)
        try:
            yield fd
        finally:
            use.leave()

    def _opened(self, opener: Callable[[], int]) -> int:
        """``opener()``; out of descriptors (other files of the process took them: its tier
        copies), once more after closing the idle ones here. The caller holds the lock."""
        try:
            return opener()
        except Exception as exc:  # (the opener's own error, with the OSError as its cause)
            if not out_of_descriptors(exc) or not self._shed():
                raise
        return opener()

    def _shed(self) -> int:
        """Close every descriptor no thread reads through now (the caller holds the lock);
        how many."""
        idle = [k for k, (_, use) in self._open.items() if not use.busy()]
        for k in idle:
            fd, use = self._open.pop(k)
            use.close(functools.partial(os.close, fd))
        return len(idle)

    def reset_after_fork(self) -> None:
        """In a forked child: the descriptors stay valid; the threads using them were the
        parent's."""
        self._lock = threading.Lock()
        for _, use in self._open.values():
            use.reset_after_fork()

    def close(self) -> None:
        """Close every descriptor (each once no thread reads through it)."""
        with self._lock:
            every, self._open = list(self._open.values()), collections.OrderedDict()
        for fd, use in every:
            use.close(functools.partial(os.close, fd))


def write_out(fd: int, size: int) -> None:
    """Make the file ``size`` bytes long, its missing tail written (zeros), not left a
    hole: for a file mapped shared (a counter, a fill map). A page of a hole first touched
    through the mapping once the file system is full (a tmpfs other programs filled) is a
    SIGBUS that kills the process; here it is an ENOSPC the caller can say something of."""
    have = os.fstat(fd).st_size
    if have < size:
        pwrite_all(fd, bytes(size - have), have)


def open_read(path: str | bytes, flags: int = 0) -> tuple[int, os.stat_result]:
    """Open ``path`` read-only without waiting on it, and fstat it: a FIFO where a file was
    (a crafted pack, a tree changed since its scan) would hold a plain open for a writer
    forever. A regular file's descriptor is blocking again, as any other; what is not one
    is for the caller to refuse by the stat. ``flags``: more, e.g. ``O_NOFOLLOW``."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | flags)
    try:
        info = os.fstat(fd)
        if stat.S_ISREG(info.st_mode):
            os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd, info


def open_own_file(path: str, flags: int = os.O_RDWR) -> int:
    """A descriptor (``flags``: O_RDWR, O_WRONLY) on the regular file ``path`` of a runtime
    or a tier (a count, a shared map), made 0600 if missing. What a damaged runtime left
    under its name instead (a directory, a FIFO, a symlink) is removed and the file made
    anew, with a warning: before, a directory there stopped placement into a tier and a
    FIFO made every ``stagefs.open`` of the dataset fail with a bare EINVAL."""
    flags |= os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK
    fd = -1
    try:
        fd = os.open(path, flags, 0o600)
        if stat.S_ISREG(os.fstat(fd).st_mode):
            os.set_blocking(fd, True)
            return fd
    except OSError as exc:  # ELOOP: a symlink; ENXIO: a FIFO no one reads (O_WRONLY)
        if exc.errno not in (errno.EISDIR, errno.ELOOP, errno.ENXIO):
            raise
    if fd >= 0:
        os.close(fd)
    logging.getLogger("stagefs").warning(
        "%s: not a file (a damaged runtime directory); made anew", path)
    remove_any(path)
    fd = os.open(path, flags | os.O_EXCL, 0o600)
    os.set_blocking(fd, True)
    return fd


def remove_any(path: str) -> str | None:
    """Remove ``path`` whatever it is: a directory with its tree (as far as it can be), a
    file, a FIFO, a symlink (never what it points to); nothing if it is gone. Returns why
    part of a tree stayed, as the file system said it (a tier remounted read-only after a
    disk error was said to hold files of another user), or None."""
    if os.path.isdir(path) and not os.path.islink(path):
        errors: list[str] = []

        def failed(exc: BaseException) -> None:
            if isinstance(exc, OSError) and exc.strerror \
                    and not isinstance(exc, FileNotFoundError):  # (gone meanwhile: removed)
                errors.append(exc.strerror)

        if sys.version_info >= (3, 12):  # (onerror is deprecated there)
            shutil.rmtree(path, onexc=lambda _f, _p, exc: failed(exc))
        else:
            shutil.rmtree(path, onerror=lambda _f, _p, info: failed(info[1]))
        return errors[0] if errors else None
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    return None


def private_makedirs(path: str | os.PathLike[str]) -> None:
    """Create ``path`` and each of its missing parents mode 0700 (``os.makedirs`` gives the
    parents 0777 less the umask: under a umask of 000, a runtime's parent on a shared
    ``/dev/shm`` that any user could rename away). Existing directories are left as they
    are; OSError as ``os.mkdir`` raises it (a file on the way, no permission)."""
    missing = []
    here = os.path.abspath(os.fspath(path))
    while not os.path.isdir(here) and here != os.path.dirname(here):
        missing.append(here)
        here = os.path.dirname(here)
    for d in reversed(missing):
        try:
            os.mkdir(d, mode=0o700)
        except FileExistsError:
            if not os.path.isdir(d):  # a file in the way
                raise
            # another process of the job made it first


def movable_by_others(directory: str | os.PathLike[str]) -> str | None:
    """Why another user may rename or replace what is in ``directory`` or in a directory on
    its way (its missing part left out): the first such directory, with whose it is or that
    every user may write it without the sticky bit that ``/dev/shm`` and ``/tmp`` have;
    None if only this user and root may. Such a user can move a runtime directory or a
    tier's copies away while a job uses them, or put a directory (or a symlink) of theirs
    in their place, made first under a predictable name (``/dev/shm/stagefs-$USER``)."""
    here = os.path.abspath(os.fspath(directory))
    me = os.getuid()
    while True:
        try:
            s = os.stat(here)
        except OSError:
            s = None  # missing (to be made, ours) or closed to us (said where it is used)
        if s is not None and stat.S_ISDIR(s.st_mode):
            why = (f"belongs to {user_name(s.st_uid)}" if s.st_uid not in (0, me) else
                   "may be written by every user and has no sticky bit"
                   if s.st_mode & stat.S_IWOTH and not s.st_mode & stat.S_ISVTX else None)
            if why:
                return f"{here} {why} (mode {stat.S_IMODE(s.st_mode):04o})"
        if here == os.path.dirname(here):
            return None
        here = os.path.dirname(here)


def login(uid: int) -> str:
    """The login name of ``uid`` (its number where it has none on this node): from the
    user database, not ``$USER``, which ``su``, ``sudo`` or a container may leave set to
    another user's."""
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def user_name(uid: int) -> str:
    """``alice (uid 1002)``, or ``uid 1002`` for a uid with no name on this node."""
    name = login(uid)
    return f"uid {uid}" if name == str(uid) else f"{name} (uid {uid})"


def unreachable(path: str | os.PathLike[str]) -> str | None:
    """Why this user cannot reach ``path`` for reading: the first directory on its way (or
    ``path`` itself) that it may not search or read, with its owner and mode; None if
    nothing in the way is closed to it (or what is missing is simply not there)."""
    full = os.path.abspath(os.fspath(path))
    parts = full.strip("/").split("/")
    here = "/"
    for i, name in enumerate(["", *parts]):
        here = os.path.join(here, name) if name else here
        last = i == len(parts)
        try:
            s = os.stat(here)
        except FileNotFoundError:
            return None
        except PermissionError:
            continue  # its parent is the one closed: reported there
        need = (os.R_OK | os.X_OK) if stat.S_ISDIR(s.st_mode) else os.R_OK
        if not os.access(here, need if last else os.X_OK):
            what = "read" if last else "enter"
            return (f"{here} (owned by {user_name(s.st_uid)}, mode "
                    f"{stat.S_IMODE(s.st_mode):04o}) is closed to this user, "
                    f"{user_name(os.getuid())}: it may not {what} it")
    return None


_POLL_S = 0.001


@contextlib.contextmanager
def file_lock(path: str | os.PathLike[str], timeout: float = -1) -> Iterator[None]:
    """Hold an exclusive lock on the file ``path`` (created 0600 if missing) while inside.

    Blocks until the lock is free, or for at most ``timeout`` seconds (then a
    ``TimeoutError``). The lock belongs to the open file: it goes when this block ends or
    the process dies, so a killed holder never leaves it taken; a stopped one does (kill
    -STOP, a debugger), hence the timeout.
    """
    # filelock polls a non-blocking flock; its default of 50 ms between tries made a
    # contended tier lock cost at least 50 ms, where the holder keeps it for microseconds
    lock = filelock.FileLock(os.fspath(path), mode=0o600)
    try:
        lock.acquire(timeout=timeout, poll_interval=_POLL_S)
    except IsADirectoryError:  # a directory a damaged runtime left: it stopped placement
        logging.getLogger("stagefs").warning(
            "%s: a directory where a lock file goes (a damaged runtime directory); made "
            "anew", path)
        shutil.rmtree(path, ignore_errors=True)
        lock.acquire(timeout=timeout, poll_interval=_POLL_S)
    try:
        yield
    finally:
        lock.release()


def hold_lock(path: str | os.PathLike[str]) -> filelock.BaseFileLock | None:
    """Take the lock on the file ``path`` (as ``file_lock``) for as long as the caller
    keeps it (``release()``, or the process ends), without waiting: None if another
    process holds it."""
    lock = filelock.FileLock(os.fspath(path), mode=0o600)
    try:
        lock.acquire(timeout=0)
    except filelock.Timeout:
        return None
    return lock


def raise_fd_limit() -> tuple[int, int]:
    """Raise this process's soft limit of open descriptors to its hard limit (at most 2**20
    where the hard one is unlimited): a held or opened shard and a connection are one each.
    Returns (old soft limit, new soft limit)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return soft, soft
    new = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    if new > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
        except (ValueError, OSError):
            return soft, soft
    return soft, max(new, soft)


_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def die_with_parent(parent: int) -> None:
    """Make this process end (SIGKILL) when its parent does, and end it now if ``parent``
    (the pid of the process that asked for it) is already gone.

    A pool worker's queue from its parent is held open by the worker itself (a forked
    worker inherits both ends of the pipe), so a worker whose parent was killed never sees
    the end of it: it waits for work forever, keeps the command's output open (a pipeline
    after it never ends), and may go on writing into what the next run writes. Linux only
    (``prctl``); elsewhere this only checks ``parent``."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL),
                                                    0, 0, 0)
    try:
        os.kill(parent, 0)
    except ProcessLookupError:  # died before the line above took effect
        os._exit(1)
    except PermissionError:  # the pid is another user's process now: ours is gone
        os._exit(1)


R = TypeVar("R")


def in_parts(pool: cf.Executor | None, n: int, parts: int,
             part: Callable[[int, int], R]) -> list[R]:
    """``part(a, b)`` for up to ``parts`` slices ``[a, b)`` that cover ``range(n)`` in order,
    at once: the first in this thread, the others in ``pool``'s threads; their results in
    order. A part no thread of the pool has begun when this thread is done with its own is
    taken back and run here, so a call from one of the pool's own threads never waits on
    threads that all wait (and a busy pool costs no more than one thread's pace). Every part
    begun has ended before this returns or raises (the first error, once they have)."""
    if pool is None or parts < 2 or n < 2:
        return [part(0, n)]
    size = -(-n // min(parts, n))
    futures = [(a, pool.submit(part, a, min(a + size, n))) for a in range(size, n, size)]
    out: list[R] = []
    error: BaseException | None = None
    try:
        out.append(part(0, size))
    except BaseException as exc:
        error = exc
    for a, fut in futures:
        if fut.cancel():  # not begun: here, or not at all after an error
            if error is None:
                try:
                    out.append(part(a, min(a + size, n)))
                except BaseException as exc:
                    error = exc
            continue
        try:
            got = fut.result()
        except BaseException as exc:
            error = error or exc
        else:
            out.append(got)
    if error is not None:
        raise error
    return out


def worker_pool(jobs: int) -> cf.ProcessPoolExecutor:
    """A pool of ``jobs`` processes that end when this process ends, however it ends
    (``die_with_parent``)."""
    return cf.ProcessPoolExecutor(max_workers=jobs, initializer=die_with_parent,
                                  initargs=(os.getpid(),))
