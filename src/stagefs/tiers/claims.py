"""Claims: one process per node places a given shard.

A claim is the file ``<runtime>/claims/<pack id>.<shard>``, created with O_CREAT|O_EXCL and
holding ``"<pid> <start time>"``. A claim whose process is dead (killed while placing) is
taken over: under a lock, the claim is re-read and, if still dead, atomically replaced by
one naming the new owner, so two processes never both take over the same claim.

A process that found a shard claimed by another remembers it (``elsewhere``): once that
claim is let go (its owner ended, killed or not, mid-shard) ``let_go`` says so, and the
process's reads of the shard queue it to stream again, taking the rest of the shard over.
Else the shard's stream ended with its owner, and the rest of it was read by the readers'
small per-sample reads of the origin for the rest of the first epoch.

The owner that streams the shard publishes in its claim how far its stream has come and
how fast (``publish``: 24 bytes at ``PROGRESS_AT``), after each run it reads: the readers
of the other processes wait for the bytes it brings soon (``progress``) rather than read
them themselves in small reads, as the readers of its own process do.
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat
import struct
import time
from collections.abc import Callable, Iterator

from stagefs._fsutil import atomic_write, file_lock, open_read, remove_any
from stagefs.runtime import alive, proc_start

log = logging.getLogger("stagefs.tiers")

__all__ = ["Claims"]

_UNWRITTEN_GRACE_S = 5.0  # an empty claim younger than this is being written, not dead
PROGRESS_AT = 64  # where a claim holds its stream's progress, after the owner's text
_PROGRESS = struct.Struct("<qdd")  # offset reached, bytes/s, when (time.monotonic: the node's)


class Claims:
    def __init__(self, folder: str, pack_id: str) -> None:
        self.folder = folder
        self.pack_id = pack_id
        self.pid = os.getpid()
        self.me = f"{self.pid} {proc_start(self.pid)}"
        self.taken = 0  # claims this process won
        self.takeovers = 0  # of which taken over from a dead process
        self.elsewhere: set[int] = set()  # shards a live process held when this one asked
        self._unclaimed = False  # a claim could not be written (said once)
        # when progress is published and judged: the node's monotonic clock (tests set theirs)
        self.clock: Callable[[], float] = time.monotonic

    def reset_after_fork(self) -> None:
        self.pid = os.getpid()
        self.me = f"{self.pid} {proc_start(self.pid)}"
        self.taken = self.takeovers = 0
        self.elsewhere = set()

    def path(self, shard: int) -> str:
        return os.path.join(self.folder, f"{self.pack_id}.{shard}")

    def acquire(self, shard: int) -> bool:
        """Claim ``shard`` for this process; False if a live process holds it. Where no
        claim can be written (the runtime directory's file system full, or the directory
        gone), True: the shard streams unclaimed (said once), as a process alone on its
        node would; the fill maps' locks still keep two processes from reading one file."""
        try:
            return self._acquire(shard)
        except OSError as exc:
            if not self._unclaimed:
                self._unclaimed = True
                log.warning("%s: claims cannot be written there (%s): this process streams "
                            "shards without claiming them, and another process of the node "
                            "may stream the same ones (free space where the runtime "
                            "directory is, or point STAGEFS_RUNTIME elsewhere)", self.folder,
                            exc.strerror or exc)
            self.elsewhere.discard(shard)
            return True

    def _acquire(self, shard: int) -> bool:
        path = self.path(shard)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        except FileExistsError:
            if self._take_over(path):
                self.elsewhere.discard(shard)
                return True
            self.elsewhere.add(shard)
            return False
        try:
            os.write(fd, self.me.encode())
        except OSError:  # (ENOSPC) an empty claim would hold the shard a grace period
            with contextlib.suppress(OSError):
                os.unlink(path)
            raise
        finally:
            os.close(fd)
        self.elsewhere.discard(shard)
        self.taken += 1
        return True

    def let_go(self, shard: int) -> bool:
        """Whether the claim on ``shard`` that another process held when this one asked
        (``acquire`` returned False) may be free now: released, its owner dead, or no claim
        (damaged, or being written: ``acquire`` judges it). Said once: the shard is then
        this process's to ask for again."""
        if shard not in self.elsewhere:
            return False
        owner = _read(self.path(shard))
        if owner is not None and alive(*owner):
            return False
        self.elsewhere.discard(shard)
        return True

    def owner(self, shard: int) -> tuple[int, int] | None:
        """(pid, start) of the claim on ``shard``, or None if unclaimed."""
        return _read(self.path(shard))

    def publish(self, shard: int, at: int, rate: float) -> None:
        """Say in this process's claim on ``shard`` that its stream has reached offset
        ``at``, reading ``rate`` bytes/s."""
        try:
            fd = os.open(self.path(shard),
                         os.O_WRONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            return
        try:
            os.pwrite(fd, _PROGRESS.pack(at, rate, self.clock()), PROGRESS_AT)
        except OSError:
            pass
        finally:
            os.close(fd)

    def progress(self, shard: int, within: float) -> tuple[int, float] | None:
        """(offset reached, bytes/s) of the stream another process runs on ``shard``, as
        published in the last ``within`` seconds; None if there is none (no claim, or a
        stream that stopped publishing: ended, stopped, or stalled on the origin)."""
        try:
            fd, info = open_read(self.path(shard), os.O_NOFOLLOW)
        except OSError:
            return None
        try:
            raw = os.pread(fd, _PROGRESS.size, PROGRESS_AT) if stat.S_ISREG(info.st_mode) \
                else b""
        except OSError:
            return None
        finally:
            os.close(fd)
        if len(raw) != _PROGRESS.size:
            return None
        at, rate, when = _PROGRESS.unpack(raw)
        if not 0 <= self.clock() - when <= within:
            return None
        return at, rate

    def release(self, shard: int) -> None:
        path = self.path(shard)
        if _read(path) == _parse(self.me):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)

    def _take_over(self, path: str) -> bool:
        with self._locked():
            try:
                owner = _read(path)
                age = time.time() - os.stat(path).st_mtime
            except FileNotFoundError:
                owner, age = None, 0.0
            if owner is None and os.path.exists(path) and age < _UNWRITTEN_GRACE_S:
                return False  # its creator is writing it right now
            if owner is not None and alive(*owner):
                return False
            if os.path.isdir(path):  # damage: no rename onto a directory
                remove_any(path)
            atomic_write(path, self.me, mode=0o600)
        self.taken += 1
        self.takeovers += 1
        return True

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        with file_lock(os.path.join(self.folder, ".lock")):
            yield


def _parse(text: str) -> tuple[int, int] | None:
    parts = text.split()
    try:
        return int(parts[0]), int(parts[1]) if len(parts) > 1 else 0
    except (IndexError, ValueError):
        return None


def _read(path: str) -> tuple[int, int] | None:
    """The owner in the claim at ``path``; None if there is none, or if what is there is no
    claim (damaged: garbage, a FIFO, a directory), which is then taken over as a dead one's.
    Opened without waiting: a FIFO under a claim's name would hold a plain open forever."""
    try:
        fd, info = open_read(path, os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        raw = os.pread(fd, PROGRESS_AT, 0) if stat.S_ISREG(info.st_mode) else b""
    except OSError:
        return None
    finally:
        os.close(fd)
    # the text, then zeros up to the progress the owner's stream publishes
    return _parse(raw.partition(b"\0")[0].decode("ascii", "replace"))
