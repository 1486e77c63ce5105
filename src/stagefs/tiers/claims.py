"""Claims: one process per node places a given shard.

A claim is the file ``<runtime>/claims/<pack id>.<shard>``, created with O_CREAT|O_EXCL and
holding ``"<pid> <start time>"``. A claim whose process is dead (killed while placing) is
taken over: under a lock, the claim is re-read and, if still dead, atomically replaced by
one naming the new owner, so two processes never both take over the same claim.
"""

from __future__ import annotations

import contextlib
import os
import stat
import time
from collections.abc import Iterator

from stagefs._fsutil import atomic_write, file_lock, open_read, remove_any
from stagefs.runtime import alive, proc_start

__all__ = ["Claims"]

_UNWRITTEN_GRACE_S = 5.0  # an empty claim younger than this is being written, not dead


class Claims:
    def __init__(self, folder: str, pack_id: str) -> None:
        self.folder = folder
        self.pack_id = pack_id
        self.pid = os.getpid()
        self.me = f"{self.pid} {proc_start(self.pid)}"
        self.taken = 0  # claims this process won
        self.takeovers = 0  # of which taken over from a dead process

    def reset_after_fork(self) -> None:
        self.pid = os.getpid()
        self.me = f"{self.pid} {proc_start(self.pid)}"
        self.taken = self.takeovers = 0

    def path(self, shard: int) -> str:
        return os.path.join(self.folder, f"{self.pack_id}.{shard}")

    def acquire(self, shard: int) -> bool:
        """Claim ``shard`` for this process; False if a live process holds it."""
        path = self.path(shard)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        except FileExistsError:
            return self._take_over(path)
        try:
            os.write(fd, self.me.encode())
        finally:
            os.close(fd)
        self.taken += 1
        return True

    def owner(self, shard: int) -> tuple[int, int] | None:
        """(pid, start) of the claim on ``shard``, or None if unclaimed."""
        return _read(self.path(shard))

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
        raw = os.pread(fd, 64, 0) if stat.S_ISREG(info.st_mode) else b""
    except OSError:
        return None
    finally:
        os.close(fd)
    return _parse(raw.decode("ascii", "replace"))
