"""The Python side of the preload library (preload.c) that ``stagefs run`` loads into programs.

``launch`` prepares a run before the program is exec'd: a private run directory holding the
sidecar the library reads (where the manifest's arrays are, the tiers, the origin), an empty
directory that backs staged directory descriptors, and the helper: a process that stays
alive while the program runs and answers, on a Unix socket, what the library does not do
alone. It reads a file through the Store (the one verified read path: tiers, peers, the
origin) into a memfd and passes the descriptor back (compressed files, datasets without
shards of their own, copies that failed their checksum), and places shards into the tiers
as the library reads them from the origin.

docs/decisions/0014-preload.md says why this design, and docs/frontends.md what it serves.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import os
import selectors
import shutil
import signal
import socket
import struct
import sys
import tempfile
import threading
from collections.abc import Callable
from typing import Any

from stagefs._native import preload_library
from stagefs.errors import StagefsError

__all__ = ["ENV_INDEX", "active", "adopt", "launch", "notes", "static_binary", "write_sidecar"]

log = logging.getLogger("stagefs")

ENV_INDEX = "STAGEFS_PRELOAD_INDEX"
SIDECAR = "preload.idx"
_MAGIC = b"STGFSPLD"
_VERSION = 2
_FLAG_DIRECT = 1  # raw files may be read straight from the tiers and the origin's shards
# the manifest arrays the library uses, in the order of the sidecar's table (preload.c A_*)
_ARRAYS = ("path_off", "hash", "parent", "kind", "mode", "mtime_ns", "size", "shard", "offset",
           "stored", "codec", "checksum", "first", "count", "piece", "slots", "strings",
           "pieces")
_HEAD = struct.Struct("<8sIIQQQQQII")


_active: bool | None = None


def active() -> bool:
    """Whether the preload library serves the staged path in this process (loaded at its
    start, so asked once)."""
    global _active
    if _active is None:
        try:
            fn = ctypes.CDLL(None).stagefs_preload_active
        except (AttributeError, OSError):
            _active = False
        else:
            _active = bool(fn())
    return _active


def static_binary(path: str) -> bool:
    """Whether ``path`` is an ELF executable with no program interpreter (statically linked:
    LD_PRELOAD does nothing to it). Scripts and unreadable files are not."""
    try:
        with open(path, "rb") as f:
            head = f.read(64)
            if head[:4] != b"\x7fELF" or head[4] != 2:  # 64-bit ELF only
                return False
            order = "<" if head[5] == 1 else ">"
            phoff, = struct.unpack_from(order + "Q", head, 32)
            phentsize, phnum = struct.unpack_from(order + "HH", head, 54)
            f.seek(phoff)
            table = f.read(phentsize * phnum)
    except (OSError, struct.error, IndexError):
        return False
    types = [struct.unpack_from(order + "I", table, i * phentsize)[0] for i in range(phnum)
             if (i + 1) * phentsize <= len(table)]
    return 3 not in types  # PT_INTERP


def notes(exe: str | None, root: str) -> list[str]:
    """What the user should know before the program runs (each said on stderr)."""
    out = []
    if preload_library() is None:
        out.append("the preload library is not built (stagefs was installed without a C "
                   f"compiler): only Python's file calls see {root} served; other programs "
                   "see it as it is on disk. Reinstall stagefs with a C compiler present, or "
                   "use 'stagefs mount'")
    elif exe is not None and static_binary(exe):
        out.append(f"{exe} is statically linked: the preload library cannot enter it, so it "
                   f"sees {root} as it is on disk (programs it starts that are dynamically "
                   "linked are served). Use 'stagefs mount' to serve it")
    if os.path.lexists(root):
        out.append(f"{root} exists on disk: the staged view hides it while the program "
                   "runs (it reads the dataset there, not those files)")
    return out


def _header_sums(manifest_path: str) -> tuple[int, int]:
    with open(manifest_path, "rb") as f:
        head = f.read(64)
    return struct.unpack_from("<QQ", head, 32)


def write_sidecar(store: Any, root: str, run_dir: str, socket_path: str,
                  empty_dir: str) -> str:
    """Write the library's index of ``store`` served at ``root`` into ``run_dir``."""
    m = store.manifest
    arrays = m.meta["arrays"]
    table = b"".join(struct.pack("<QQ", *(arrays[a][1:3] if a in arrays else (0, 0)))
                     for a in _ARRAYS)
    length, body = _header_sums(m.path)
    chain = getattr(store, "chain", None)
    from stagefs.tiers.origin import PackOrigin

    # raw bytes straight from the shard files: a pack read on this node (not in place,
    # whose checksums are learnt as it is read, and not a cluster, whose shards are remote)
    direct = isinstance(store.origin, PackOrigin) and getattr(store, "_sums", None) is None \
        and getattr(store, "_policy", None) is chain
    tiers = [t.dir for t in chain.tiers] if chain is not None and direct else []
    origin = store.pack_dir if direct else ""
    names = [s.name for s in m.shards]
    head = _HEAD.pack(_MAGIC, _VERSION, _FLAG_DIRECT if direct else 0, m.n, m.piece_size,
                      store.namespace._dev, length, body, len(names), len(tiers))
    counts = getattr(store, "_counts", None)  # the job's stats dir: stagefs status sums it
    stats = counts.folder if counts is not None else ""
    kinds = "".join("m" if t.kind == "memory" else "d" for t in chain.tiers) \
        if chain is not None and direct else ""
    strings = [root, os.path.abspath(m.path), socket_path, empty_dir, origin, stats, kinds,
               *tiers, *names]
    blob = head + table + b"".join(os.fsencode(s) + b"\0" for s in strings)
    path = os.path.join(run_dir, SIDECAR)
    with open(path, "wb") as f:
        f.write(blob)
    return path


def memfd(data: bytes, name: str) -> int:
    """An anonymous file holding ``data`` (its offset at 0): the descriptor a caller gets
    for a file that has none of its own (the library's helper, ``adopt``, and the
    Python-level interception's ``fileno()`` outside ``stagefs run``). It may be sealed:
    the library seals the helper's and ``adopt``'s before a program gets them (preload.c's
    read_only)."""
    fd = os.memfd_create("stagefs:" + os.path.basename(name)[:200],
                         os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.lseek(fd, 0, os.SEEK_SET)
    except BaseException:
        os.close(fd)
        raise
    return fd


_adopt: Any = None  # preload.c's stagefs_preload_adopt, looked up on first use


def adopt(data: bytes, path: str) -> int:
    """The descriptor of the staged file at ``path`` (absolute) for a caller that read its
    bytes, ``data``, through its Store already (verified and counted there): a ``memfd`` of
    them that the library seals and reopens read-only, as the helper's, and knows as the
    file (``os.fstat`` reports the manifest), so that the file is not read and counted a
    second time, as an open through the library would. Only where ``active()``."""
    global _adopt
    if _adopt is None:
        fn = ctypes.CDLL(None, use_errno=True).stagefs_preload_adopt
        fn.argtypes, fn.restype = [ctypes.c_int, ctypes.c_char_p], ctypes.c_int
        _adopt = fn
    fd = _adopt(memfd(data, path), os.fsencode(path))  # closes the memfd when it fails
    if fd < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), path)
    return int(fd)


class Helper:
    """Answers the library's requests for one store, one thread per connection."""

    def __init__(self, store: Any, listener: socket.socket) -> None:
        self.store = store
        self.listener = listener

    def handle(self, conn: socket.socket) -> None:
        with conn:
            line = b""
            while not line.endswith(b"\n") and len(line) < 64:
                got = conn.recv(64)
                if not got:
                    return
                line += got
            word, *args = line.decode("ascii", "replace").split()
            if not args or not all(a.isdigit() for a in args):
                return
            if word == "place":
                with contextlib.suppress(Exception):
                    self.store.prefetch([int(args[0])])
                return
            if word == "open":
                self._send_file(conn, int(args[0]))
            elif word == "piece" and len(args) == 2:  # a large file's checksum piece
                self._send_file(conn, int(args[0]), int(args[1]))
            elif word == "held":  # where a large file's pieces are held, for a mapping
                self._send_holders(conn, int(args[0]))

    def _send_holders(self, conn: socket.socket, e: int) -> None:
        """Send a memfd of one byte per checksum piece of entry ``e``: the index + 1 of
        the first tier whose copy holds the piece, 0 for none (``TierChain.piece_holders``):
        the library maps a large file from the tier copies that hold its pieces and the
        origin's shard for the rest."""
        chain = self.store.chain
        if chain is None:
            conn.sendall(bytes([errno.ENOENT]))
            return
        self._send(conn, e, lambda: chain.piece_holders(e).tobytes(), "held")

    def _send_file(self, conn: socket.socket, e: int, piece: int | None = None) -> None:
        """Send a memfd of entry ``e``'s verified bytes: the whole file, or its checksum
        piece number ``piece`` (a large file the library reads by pieces)."""
        m = self.store.manifest

        def data() -> bytes:
            got: bytes
            if piece is None:
                got = self.store.read_entry(e)
            else:  # a sample for the first piece: a read from the start of the file
                got = self.store.read_entry(e, None, piece * m.piece_size, m.piece_size)
            return got

        self._send(conn, e, data)

    def _send(self, conn: socket.socket, e: int, make: Callable[[], bytes],
              name: str | None = None) -> None:
        """Send a memfd of ``make()``'s bytes for entry ``e`` (named ``name``, else the
        file's path), or one byte, the errno of why not (ENOENT: no such entry)."""
        m = self.store.manifest
        if not 0 <= e < len(m):
            conn.sendall(bytes([errno.ENOENT]))
            return
        fd = -1
        try:
            fd = memfd(make(), name if name is not None else os.fsdecode(m.path_of(e)))
            socket.send_fds(conn, [b"\0"], [fd])
        except OSError as exc:  # includes the Store's errors (ChecksumError is EIO)
            log.warning("stagefs run: %s", exc)
            code = exc.errno if isinstance(exc.errno, int) and 0 < exc.errno < 256 else errno.EIO
            with contextlib.suppress(OSError):
                conn.sendall(bytes([code]))
        except (StagefsError, ValueError) as exc:
            log.warning("stagefs run: %s", exc)
            with contextlib.suppress(OSError):
                conn.sendall(bytes([errno.EIO]))
        finally:
            if fd >= 0:
                os.close(fd)

    def serve_until(self, pidfd: int) -> None:
        """Serve until the process ``pidfd`` refers to has ended."""
        sel = selectors.DefaultSelector()
        sel.register(self.listener, selectors.EVENT_READ)
        sel.register(pidfd, selectors.EVENT_READ)
        while True:
            for key, _ in sel.select():
                if key.fileobj is not self.listener:
                    return
                with contextlib.suppress(OSError):
                    conn, _ = self.listener.accept()
                    threading.Thread(target=self.handle, args=(conn,), daemon=True).start()


def _run_base() -> str:
    shm = "/dev/shm"
    return shm if os.access(shm, os.W_OK | os.X_OK) else tempfile.gettempdir()


_RUN_PREFIX = "stagefs-run-"
_SOCKET = "helper.sock"


def sweep_runs(base: str) -> list[str]:
    """Remove the run directories in ``base`` that runs killed with their helper left (a
    SIGKILL to the whole job: the OOM killer, a control group's kill; the helper removes
    its own otherwise): this user's, whose helper socket refuses a connection (nobody
    listens on it). A run alive, or still being set up (no sidecar yet: the helper writes
    it once it listens), is kept. The directories removed."""
    try:
        names = [n for n in os.listdir(base) if n.startswith(_RUN_PREFIX)]
    except OSError:
        return []
    gone = []
    for name in names:
        run_dir = os.path.join(base, name)
        try:
            if os.lstat(run_dir).st_uid != os.getuid() or \
                    not os.path.isfile(os.path.join(run_dir, SIDECAR)):
                continue
        except OSError:
            continue
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.setblocking(False)  # a live helper with a full backlog: EAGAIN, kept
            try:
                s.connect(os.path.join(run_dir, _SOCKET))
            except ConnectionRefusedError:
                shutil.rmtree(run_dir, ignore_errors=True)
                gone.append(run_dir)
            except OSError:
                pass
    return gone


def launch(open_store: Callable[[], Any], root: str) -> dict[str, str]:
    """Start the helper for a program about to be exec'd in this process, and return the
    variables that load the library into it. The helper ends when this process (the
    program, once exec'd) ends, and removes the run directory."""
    lib = preload_library()
    if lib is None:
        return {}
    base = _run_base()
    for gone in sweep_runs(base):
        log.info("removed %s, left by a run killed with its helper", gone)
    run_dir = tempfile.mkdtemp(prefix=_RUN_PREFIX, dir=base)
    empty = os.path.join(run_dir, "empty")
    os.mkdir(empty, 0o500)
    sock_path = os.path.join(run_dir, _SOCKET)
    parent = os.getpid()
    pidfd = os.pidfd_open(parent)
    r, w = os.pipe()
    # forked twice: the helper is not a child of the program this process becomes (a
    # program that waits for all its children, as strace -f does, would wait for the helper
    # while the helper waits for it to end)
    pid = os.fork()
    if pid == 0:
        try:
            if os.fork() == 0:  # the helper
                os.close(r)
                _helper_main(open_store, root, run_dir, sock_path, empty, pidfd, w)
        finally:
            os._exit(0)
    os.waitpid(pid, 0)
    os.close(w)
    os.close(pidfd)
    with os.fdopen(r, "rb") as f:
        said = f.read().decode("utf-8", "replace")
    if said != "ok":
        shutil.rmtree(run_dir, ignore_errors=True)
        raise StagefsError(said or "the stagefs run helper ended before it was ready")
    preload = os.environ.get("LD_PRELOAD", "")
    return {"LD_PRELOAD": f"{lib} {preload}".strip(),
            ENV_INDEX: os.path.join(run_dir, SIDECAR)}


def _exit_on_signal(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


def _helper_main(open_store: Callable[[], Any], root: str, run_dir: str, sock_path: str,
                 empty: str, pidfd: int, ready: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for the program; it ends us
    signal.signal(signal.SIGTERM, _exit_on_signal)  # killed with its job: remove the run dir
    os.environ.pop("LD_PRELOAD", None)
    try:
        try:
            store = open_store()
            listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            listener.bind(sock_path)
            os.chmod(sock_path, 0o600)
            listener.listen(64)
            write_sidecar(store, root, run_dir, sock_path, empty)
        except BaseException as exc:  # the parent says it and exits
            os.write(ready, f"stagefs run: cannot start the preload helper: {exc}".encode())
            os.close(ready)
            return
        os.write(ready, b"ok")
        os.close(ready)
        with contextlib.suppress(BaseException):
            devnull = os.open(os.devnull, os.O_RDWR)
            os.dup2(devnull, 0)
            os.close(devnull)
        try:
            Helper(store, listener).serve_until(pidfd)
        finally:
            listener.close()
            with contextlib.suppress(Exception):
                store.close()
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
        sys.stderr.flush()
