"""``stagefs mount``: a read-only FUSE file system over a Store (libfuse 3 through mfusepy).

Multithreaded; the kernel keeps file data (``kernel_cache``) and attributes, names and
missing names (``attr_timeout``, ``entry_timeout``, ``negative_timeout``) cached for as
long as the mount lives, since a dataset never changes under a job. Mounted read-only
(``-o ro``), so the kernel answers every write, create, rename and delete with EROFS itself.

A file handle is a stagefs file object (the same reader as ``Store.open``: small files are
read whole and verified at open, large ones by range); reads on one handle are serialised by
its lock, reads on different handles run in parallel.
"""

from __future__ import annotations

import errno
import logging
import os
import stat as st
import subprocess
import threading
import time
from collections.abc import Iterator
from typing import Any

from stagefs.errors import ConfigError

__all__ = ["CACHE_TIMEOUT", "fuse_available", "is_mounted", "mount", "unmount"]

log = logging.getLogger("stagefs.fuse")

CACHE_TIMEOUT = 86400.0  # seconds: the dataset is immutable for the life of the mount
# fuse_main's return codes (libfuse 3, lib/helper.c)
_FUSE_MAIN_ERRORS = {
    1: "invalid options", 2: "no mount point given", 3: "fuse_new failed",
    4: "the kernel refused the mount (is /dev/fuse usable? are you allowed to mount?)",
    5: "could not daemonise", 6: "could not set signal handlers", 7: "bad loop configuration",
}
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND


def _binding() -> Any:
    try:
        import mfusepy
    except ImportError as exc:
        raise ConfigError(
            "stagefs mount needs the FUSE extra: pip install 'stagefs[fuse]' "
            f"(and libfuse 3: apt-get install fuse3) ({exc})"
        ) from None
    except OSError as exc:  # the binding loads libfuse at import
        raise ConfigError(f"libfuse could not be loaded ({exc}): apt-get install fuse3") from None
    return mfusepy


def fuse_available() -> str | None:
    """None if a mount can work here, else the reason it cannot."""
    if not os.path.exists("/dev/fuse"):
        return "/dev/fuse is missing (FUSE is not available on this machine)"
    try:
        _binding()
    except ConfigError as exc:
        return str(exc)
    return None


def is_mounted(mountpoint: str) -> bool:
    """Whether a file system is mounted exactly at ``mountpoint`` (per /proc/self/mountinfo)."""
    target = os.path.realpath(mountpoint)
    try:
        with open("/proc/self/mountinfo", "rb") as f:
            for line in f:
                field = line.split(b" ")[4].decode("unicode_escape")
                if field == target:
                    return True
    except OSError:
        return os.path.ismount(target)
    return False


def _operations(store: Any) -> Any:
    fusepy = _binding()
    from stagefs.posix.fileobj import open_entry

    ns = store.namespace
    m = store.manifest

    class Operations(fusepy.Operations):  # type: ignore[misc,name-defined]
        use_ns = True

        def __init__(self) -> None:
            self._files: dict[int, tuple[Any, threading.Lock]] = {}
            self._next = 1
            self._lock = threading.Lock()

        def init_with_config(self, conn: Any, config: Any) -> None:
            if config is not None:
                config.kernel_cache = 1
                config.entry_timeout = CACHE_TIMEOUT
                config.attr_timeout = CACHE_TIMEOUT
                config.negative_timeout = CACHE_TIMEOUT
                config.use_ino = 1
                config.readdir_ino = 1

        def getattr(self, path: str, fh: int | None = None) -> dict[str, Any]:
            s = ns.lstat(path)
            return {
                "st_mode": s.st_mode, "st_ino": s.st_ino, "st_nlink": s.st_nlink,
                "st_uid": s.st_uid, "st_gid": s.st_gid, "st_size": s.st_size,
                "st_atime": s.st_atime_ns, "st_mtime": s.st_mtime_ns,
                "st_ctime": s.st_ctime_ns, "st_blocks": s.st_blocks, "st_blksize": 65536,
            }

        def readlink(self, path: str) -> str:
            return str(ns.readlink(path))

        def readdir(self, path: str, fh: int) -> Iterator[Any]:
            e = ns.dir_entry(path)
            yield ".", st.S_IFDIR, 0
            yield "..", st.S_IFDIR, 0
            for c in m.children(e):
                yield os.fsdecode(m.name_of(c)), {"st_mode": int(m.mode[c]), "st_ino": c + 1}, 0

        def open(self, path: str, flags: int) -> int:
            if flags & _WRITE_FLAGS:
                raise fusepy.FuseOSError(errno.EROFS)
            e = ns.file_entry(path)
            f = open_entry(store, e, path, "rb", -1)
            with self._lock:
                fh = self._next
                self._next += 1
                self._files[fh] = (f, threading.Lock())
            return fh

        def read(self, path: str, size: int, offset: int, fh: int) -> bytes:
            f, lock = self._files[fh]
            with lock:
                f.seek(offset)
                return bytes(f.read(size))

        def release(self, path: str, fh: int) -> int:
            with self._lock:
                f, _ = self._files.pop(fh, (None, None))
            if f is not None:
                f.close()
            return 0

        def access(self, path: str, amode: int) -> int:
            s = ns.stat(path)
            if amode & os.W_OK:
                raise fusepy.FuseOSError(errno.EROFS)
            if amode & os.X_OK and not s.st_mode & 0o111:
                raise fusepy.FuseOSError(errno.EACCES)
            return 0

        def statfs(self, path: str) -> dict[str, int]:
            info = ns.summary()
            blocks = (info["raw_bytes"] + 4095) // 4096
            return {"f_bsize": 4096, "f_frsize": 4096, "f_blocks": blocks, "f_bfree": 0,
                    "f_bavail": 0, "f_files": len(m), "f_ffree": 0, "f_namemax": 255}

    return Operations()


def mount(store: Any, mountpoint: str, *, allow_other: bool = False,
          debug: bool = False) -> None:
    """Serve ``store`` at ``mountpoint`` until it is unmounted or a signal (SIGINT,
    SIGTERM, SIGHUP) ends it; then the mount is gone. Runs in the foreground."""
    fusepy = _binding()
    mp = os.path.abspath(mountpoint)
    if not os.path.isdir(mp):
        raise ConfigError(f"mount point {mp} is not a directory: create it first (mkdir -p)")
    if is_mounted(mp):
        raise ConfigError(f"{mp} is already a mount point: 'stagefs umount {mp}' first")
    opts: dict[str, Any] = {"ro": True, "fsname": f"stagefs:{store.pack_dir}",
                            "subtype": "stagefs", "default_permissions": True}
    if allow_other:
        opts["allow_other"] = True
    logging.getLogger("fuse").setLevel(logging.ERROR)  # ENOENT lookups are normal traffic
    try:
        fusepy.FUSE(_operations(store), mp, foreground=True, nothreads=False, debug=debug,
                    **opts)
    except RuntimeError as exc:
        code = exc.args[0] if exc.args else None
        if code == 8:  # libfuse: the loop ended on a signal (SIGINT/SIGTERM/SIGHUP); unmounted
            log.info("stopped by a signal; %s unmounted", mp)
            return
        why = _FUSE_MAIN_ERRORS.get(code, f"libfuse error {code}") if isinstance(code, int) \
            else str(exc)
        raise ConfigError(f"could not mount at {mp}: {why}") from None


def unmount(mountpoint: str, *, timeout: float = 10.0) -> None:
    """Unmount a stagefs mount; the serving process then exits by itself."""
    mp = os.path.abspath(mountpoint)
    if not is_mounted(mp):
        raise ConfigError(f"{mp} is not mounted")
    errors = []
    for cmd in (["fusermount3", "-u", mp], ["fusermount", "-u", mp], ["umount", mp]):
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                               check=False)
        except (FileNotFoundError, subprocess.TimeoutExpired) as exc:
            errors.append(f"{cmd[0]}: {exc}")
            continue
        if r.returncode == 0:
            break
        errors.append(f"{cmd[0]}: {r.stderr.strip()}")
    deadline = time.monotonic() + timeout
    while is_mounted(mp) and time.monotonic() < deadline:
        time.sleep(0.05)
    if is_mounted(mp):
        raise ConfigError(f"could not unmount {mp}: {'; '.join(errors)} (is it busy? "
                          "close the programs using it, or: umount -l)")


def mount_background(dataset: str, mountpoint: str, tiers: list[str] | None, *,
                     allow_other: bool = False, timeout: float = 60.0) -> int:
    """Start ``stagefs mount --foreground`` as a detached process; return once mounted.

    The child runs in its own session (a closed terminal does not end it), writes its log
    next to nothing the user owns (a file in the temp dir, named in any error), and ends
    with ``stagefs umount``, SIGTERM or SIGINT.
    """
    import sys
    import tempfile

    reason = fuse_available()
    if reason:
        raise ConfigError(reason)
    mp = os.path.abspath(mountpoint)
    if not os.path.isdir(mp):
        raise ConfigError(f"mount point {mp} is not a directory: create it first (mkdir -p)")
    if is_mounted(mp):
        raise ConfigError(f"{mp} is already a mount point: 'stagefs umount {mp}' first")
    cmd = [sys.executable, "-m", "stagefs.cli", "mount", os.path.abspath(dataset), mp,
           "--foreground"]
    for t in tiers or ():
        cmd += ["--tier", t]
    if allow_other:
        cmd.append("--allow-other")
    with tempfile.NamedTemporaryFile(prefix="stagefs-mount-", suffix=".log",
                                     delete=False) as logf:
        child = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=logf, stderr=logf,
                                 start_new_session=True, close_fds=True)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if is_mounted(mp):
            print(f"mounted {dataset} at {mp} (server pid {child.pid}; "
                  f"'stagefs umount {mp}' to end it)")
            return 0
        if child.poll() is not None:
            break
        time.sleep(0.05)
    else:
        child.terminate()
    with open(logf.name, errors="replace") as f:
        text = f.read().strip()
    raise ConfigError(f"the mount did not come up (log {logf.name}): {text[-2000:] or '-'}")
