"""Python-level interception: paths under one directory are served by a Store.

``with stagefs.intercept(store, at="/lustre/imagenet"): ...`` replaces, for its duration,
the functions Python code reads files with (``builtins.open``/``io.open``, ``os.stat``,
``os.lstat``, ``os.listdir``, ``os.scandir``, ``os.readlink``, ``os.access``, ``os.open``,
``os.listxattr``/``os.getxattr`` (none, as the preload library answers), ``os.path.exists``/``lexists``/``isfile``/``isdir``/``islink``/``getsize``/``getmtime``) by
wrappers that serve every path under ``at`` from the store and pass every other path to the
function they replaced, untouched. ``os.walk``, ``glob``, ``pathlib.Path`` (open, stat,
iterdir, glob, rglob, read_bytes, read_text, exists, is_file, is_dir), ``PIL.Image.open``
and ``numpy.load`` call these functions through their modules, so they follow.

Writes under ``at`` (opening for writing, mkdir, unlink, rename, chmod, ...) fail with EROFS.

What is not covered, and why (docs/frontends.md has the user's version):
- C code that calls libc directly (a C++ reader inside a framework, a subprocess that is not
  Python): ``stagefs run`` loads the preload library for those; in a process that only
  calls ``intercept()``, use ``stagefs mount``.
- File descriptors: under ``stagefs run`` the preload library (preload.c) is loaded, and
  ``os.open`` under ``at`` and ``fileno()`` on a stagefs file object give the library's
  read-only descriptor (``os.fstat`` reports the manifest; directories open too), and the
  file is read and counted once: a large file's is a real descriptor on the file that holds
  it (``mmap`` of it maps the tier's pages when the file is page aligned in its shard), and
  the object's reads go through it from then on; a small (or compressed) file, which the
  object read whole at open, hands those bytes to the library in a memfd that it seals
  read-only, rather than have the library read the file again. Without the library (the
  ``intercept()`` API in a process of its own) a file under ``at`` has no fd of its own:
  ``fileno()`` and ``os.open`` return an anonymous in-memory copy of the file (``memfd``),
  made on first use, so ``mmap``, ``numpy.load(..., mmap_mode="r")``, ``os.read`` and
  ``os.fstat`` work; ``os.fstat`` of it reports the memfd, not the manifest. ``os.open`` of
  a directory under ``at`` (the ``dir_fd=`` family, ``os.fwalk``) is refused with ENOTSUP.
- ``os.chdir`` into ``at`` and paths relative to a ``dir_fd`` (the preload library serves
  both, under ``stagefs run``).
- ``from os import stat`` done before interception starts keeps the original function.
"""

from __future__ import annotations

import builtins
import contextlib
import errno
import io
import os
import posixpath
import threading
from collections.abc import Callable, Iterator
from typing import Any

from stagefs.errors import ConfigError, FormatError, ReadOnlyError
from stagefs.fileobj import WHOLE_READ_LIMIT, LargeFile, SmallFile, _RangeRaw
from stagefs.format import KIND_FILE
from stagefs.namespace import DirEntry
from stagefs.posix.preload import active as preload_active
from stagefs.posix.preload import adopt as _adopt
from stagefs.posix.preload import memfd as _memfd

__all__ = ["BOOTSTRAP_DIR", "ENV_AT", "ENV_DATASET", "ENV_STORE", "Interceptor", "intercept",
           "program_kind"]

ENV_DATASET = "STAGEFS_INTERCEPT_DATASET"
ENV_AT = "STAGEFS_INTERCEPT_AT"
ENV_STORE = "STAGEFS_INTERCEPT_STORE"  # the Store, pickled and base64-encoded
BOOTSTRAP_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_bootstrap")

_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
_stack: list[Interceptor] = []
_stack_lock = threading.Lock()


class _FdMixin:
    """``fileno()`` gives a descriptor of the file (made once, closed with the file). Where
    the preload library serves this process (``stagefs run``), the library's: read-only,
    ``os.fstat`` of it reports the manifest, and the file is read and counted once however
    the program reads it (``_library_fd``). Else an in-memory copy."""

    _fd: int | None = None
    _content: Callable[[], bytes]
    _served: tuple[Callable[..., int], str] | None = None  # (the real os.open, abs path)
    name: Any

    def fileno(self) -> int:
        if self._fd is None:
            if self._served is not None and preload_active():
                self._fd = self._library_fd(*self._served)
            else:
                self._fd = _memfd(self._content(), str(self.name))
        return self._fd

    def _library_fd(self, real_open: Callable[..., int], path: str) -> int:
        raise NotImplementedError

    def _close_fd(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)


class _SmallFile(_FdMixin, SmallFile):
    def _content(self) -> bytes:
        return self.getvalue()

    def _library_fd(self, real_open: Callable[..., int], path: str) -> int:
        # the bytes read (verified, counted) at open, handed to the library: an open through
        # it would read and count the file again (the helper's Store, or a tier's copy)
        return _adopt(self.getvalue(), path)

    def close(self) -> None:
        self._close_fd()
        SmallFile.close(self)


class _ServedRaw(_RangeRaw):
    """A large file's range reads: through the Store, and once the file object has the
    library's descriptor, through it (the library reads, verifies and counts them), so that
    reads and a mapping of the descriptor do not read the file twice."""

    fd: int | None = None

    def serve_by(self, fd: int) -> None:
        self.fd = fd
        if self._sample:  # the library counted the open as the sample
            self._sample = 0

    def readinto(self, buf: Any) -> int:
        if self.fd is None:
            with _io_error(self.name):
                return super().readinto(buf)
        n = os.preadv(self.fd, [buf], self._pos) if self._pos < self._size else 0
        self._pos += n
        return n

    def readall(self) -> bytes:
        if self.fd is None:
            with _io_error(self.name):
                return super().readall()
        parts = []
        while self._pos < self._size:
            got = os.pread(self.fd, self._size - self._pos, self._pos)
            if not got:
                break
            parts.append(got)
            self._pos += len(got)
        return b"".join(parts)


class _LargeFile(_FdMixin, LargeFile):
    _store: Any
    _entry: int
    raw: _ServedRaw

    def _content(self) -> bytes:
        with _io_error(self.name):
            return bytes(self._store.read_entry(self._entry, str(self.name)))

    def _library_fd(self, real_open: Callable[..., int], path: str) -> int:
        # a real descriptor on the file that holds it (mmap maps a tier's pages): no copy
        fd = real_open(path, os.O_RDONLY | os.O_CLOEXEC)
        self.raw.serve_by(fd)
        return fd

    def close(self) -> None:
        self._close_fd()
        LargeFile.close(self)


class _ScandirIterator:
    """What ``os.scandir`` returns: an iterator that is also a context manager."""

    __slots__ = ("_it",)

    def __init__(self, it: Iterator[DirEntry]) -> None:
        self._it = it

    def __iter__(self) -> _ScandirIterator:
        return self

    def __next__(self) -> DirEntry:
        return next(self._it)

    def close(self) -> None:
        self._it = iter(())

    def __enter__(self) -> _ScandirIterator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _rofs(path: Any) -> ReadOnlyError:
    return ReadOnlyError(os.fsdecode(path) if isinstance(path, (str, bytes)) else str(path))


@contextlib.contextmanager
def _io_error(path: Any) -> Iterator[None]:
    """A read of a file whose shard is damaged in the pack (cut short, another pack's: a
    ``FormatError``, a ValueError) fails as an I/O error, EIO with the reason, as the
    preload library and a FUSE mount answer it: a program's ``except OSError`` around its
    reads catches it (a ChecksumError is an OSError already)."""
    try:
        yield
    except FormatError as exc:
        raise OSError(errno.EIO, str(exc), path) from exc


def intercept_root(at: str | os.PathLike[str], dataset: str | os.PathLike[str]) -> str:
    """The directory ``at`` names, to be served from ``dataset`` (a pack or a raw tree);
    ConfigError if it cannot be: ``/``, or a directory the dataset lies under (stagefs
    reads it with the functions it intercepts). Checked before the dataset is opened too
    (``stagefs run``: a raw tree's scan would come first)."""
    root = os.path.normpath(os.path.abspath(os.fspath(at)))
    if root == "/":
        raise ConfigError("cannot intercept '/': name the directory the data is read from")
    pack_dir = os.path.normpath(os.path.abspath(os.fspath(dataset)))
    if pack_dir == root or pack_dir.startswith(root + "/"):
        raise ConfigError(
            f"the dataset {pack_dir} lies under the intercepted path {root}: stagefs reads "
            "it with the functions it intercepts; intercept another path"
        )
    return root


class Interceptor:
    """Serves paths under ``at`` from ``store``; ``start()`` patches, ``stop()`` restores."""

    def __init__(self, store: Any, at: str | os.PathLike[str]) -> None:
        root = intercept_root(at, getattr(store, "pack_dir", ""))
        self.store = store
        self.root = root
        self._cut = len(root) + 1
        self._saved: list[tuple[Any, str, Any]] = []
        self._supports: list[tuple[set[Any], Any]] = []
        self._active = False

    # -- which paths are ours ---------------------------------------------------------------

    def rel(self, path: Any) -> str | None:
        """The path inside the store for ``path``, or None when ``path`` is not ours."""
        if type(path) is str:
            s = path
        elif isinstance(path, int) or path is None:
            return None
        else:
            try:
                p = os.fspath(path)
            except TypeError:
                return None
            s = os.fsdecode(p) if isinstance(p, bytes) else p
        if s[:1] != "/":
            try:
                s = posixpath.join(os.getcwd(), s)
            except OSError:  # the current directory is gone: not a path of ours
                return None
        if "/." in s or "//" in s:
            s = posixpath.normpath(s)
        if not s.startswith(self.root):
            return None
        if len(s) == len(self.root):
            return ""
        if s[len(self.root)] != "/":
            return None
        return s[self._cut :]

    # -- the replacements -------------------------------------------------------------------

    def _build(self, o: dict[str, Any]) -> dict[str, Any]:
        store, rel = self.store, self.rel
        ns = store.namespace

        def _fix(exc: OSError, path: Any) -> OSError:
            with contextlib.suppress(Exception):
                exc.filename = path if isinstance(path, (str, bytes)) else os.fspath(path)
            return exc

        def open_(file: Any, mode: str = "r", buffering: int = -1, encoding: str | None = None,
                  errors: str | None = None, newline: str | None = None, closefd: bool = True,
                  opener: Any = None) -> Any:
            r = rel(file)
            if r is None:
                return o["open"](file, mode, buffering, encoding, errors, newline, closefd,
                                 opener)
            if any(c in mode for c in "wax+"):
                raise _rofs(file)
            name: Any = file if isinstance(file, (str, bytes)) else os.fspath(file)
            try:
                e = ns.file_entry(r)
            except OSError as exc:
                raise _fix(exc, file) from None
            m = store.manifest
            if m.codec[e] or m.size[e] <= WHOLE_READ_LIMIT:
                with _io_error(name):
                    f: Any = _SmallFile(store.read_entry(e, r), name)
            else:
                f = _LargeFile(_ServedRaw(store, e, name), buffering)
                f._store, f._entry = store, e
            f._served = (o["os_open"], posixpath.join(self.root, r) if r else self.root)
            if "b" in mode:
                return f
            t = io.TextIOWrapper(f, io.text_encoding(encoding), errors, newline,
                                 line_buffering=buffering == 1)
            t.mode = mode  # type: ignore[misc]
            return t

        def stat(path: Any, *, dir_fd: int | None = None, follow_symlinks: bool = True) -> Any:
            r = None if dir_fd is not None else rel(path)
            if r is None:
                return o["stat"](path, dir_fd=dir_fd, follow_symlinks=follow_symlinks)
            try:
                return ns.stat(r) if follow_symlinks else ns.lstat(r)
            except OSError as exc:
                raise _fix(exc, path) from None

        def lstat(path: Any, *, dir_fd: int | None = None) -> Any:
            r = None if dir_fd is not None else rel(path)
            if r is None:
                return o["lstat"](path, dir_fd=dir_fd)
            try:
                return ns.lstat(r)
            except OSError as exc:
                raise _fix(exc, path) from None

        def listdir(path: Any = None) -> Any:
            r = rel("." if path is None else path)
            if r is None:
                return o["listdir"]() if path is None else o["listdir"](path)
            try:
                names = ns.listdir(r)
            except OSError as exc:
                raise _fix(exc, path) from None
            if isinstance(path, bytes):
                return [os.fsencode(n) for n in names]
            return names

        def scandir(path: Any = None) -> Any:
            r = rel("." if path is None else path)
            if r is None:
                return o["scandir"]() if path is None else o["scandir"](path)
            try:
                e = ns.dir_entry(r)
            except OSError as exc:
                raise _fix(exc, path) from None
            return _ScandirIterator(ns.dir_entries(e, "." if path is None else path))

        def readlink(path: Any, *, dir_fd: int | None = None) -> Any:
            r = None if dir_fd is not None else rel(path)
            if r is None:
                return o["readlink"](path, dir_fd=dir_fd)
            try:
                target = ns.readlink(r)
            except OSError as exc:
                raise _fix(exc, path) from None
            return os.fsencode(target) if isinstance(path, bytes) else target

        def access(path: Any, mode: int, *, dir_fd: int | None = None,
                   effective_ids: bool = False, follow_symlinks: bool = True) -> bool:
            r = None if dir_fd is not None else rel(path)
            if r is None:
                return bool(o["access"](path, mode, dir_fd=dir_fd, effective_ids=effective_ids,
                                        follow_symlinks=follow_symlinks))
            try:
                s = ns.stat(r) if follow_symlinks else ns.lstat(r)
            except OSError:
                return False
            if mode & os.W_OK:
                return False
            return not (mode & os.X_OK and not s.st_mode & 0o111)

        def open_fd(path: Any, flags: int, mode: int = 0o777, *,
                    dir_fd: int | None = None) -> int:
            r = None if dir_fd is not None else rel(path)
            if r is None or (not flags & _WRITE_FLAGS and preload_active()):
                # the preload library, when loaded, gives a real descriptor of any entry
                return int(o["os_open"](path, flags, mode, dir_fd=dir_fd))
            if flags & _WRITE_FLAGS:
                raise _rofs(path)
            try:
                e = ns.entry(r)
            except OSError as exc:
                raise _fix(exc, path) from None
            if ns.kind_of(e) != KIND_FILE or flags & os.O_DIRECTORY:
                raise OSError(errno.ENOTSUP, "stagefs: os.open of a directory under an "
                              "intercepted path is not supported (use os.scandir)", path)
            with _io_error(path):
                return _memfd(store.read_entry(e, r), r)

        def listxattr(path: Any = None, *, follow_symlinks: bool = True) -> Any:
            r = None if path is None else rel(path)
            if r is None:
                return o["listxattr"](path, follow_symlinks=follow_symlinks)
            try:  # a file system without extended attributes, as the library's
                ns.stat(r) if follow_symlinks else ns.lstat(r)
            except OSError as exc:
                raise _fix(exc, path) from None
            return []

        def getxattr(path: Any, attribute: Any, *, follow_symlinks: bool = True) -> Any:
            if rel(path) is None:
                return o["getxattr"](path, attribute, follow_symlinks=follow_symlinks)
            listxattr(path, follow_symlinks=follow_symlinks)
            raise OSError(errno.ENOTSUP, os.strerror(errno.ENOTSUP), path)

        def exists(path: Any) -> bool:
            r = rel(path)
            return bool(o["exists"](path)) if r is None else bool(ns.exists(r))

        def lexists(path: Any) -> bool:
            r = rel(path)
            if r is None:
                return bool(o["lexists"](path))
            try:
                ns.entry(r, follow=False)
            except OSError:
                return False
            return True

        def isfile(path: Any) -> bool:
            r = rel(path)
            return bool(o["isfile"](path)) if r is None else bool(ns.isfile(r))

        def isdir(path: Any) -> bool:
            r = rel(path)
            return bool(o["isdir"](path)) if r is None else bool(ns.isdir(r))

        def islink(path: Any) -> bool:
            r = rel(path)
            return bool(o["islink"](path)) if r is None else bool(ns.islink(r))

        def getsize(path: Any) -> int:
            r = rel(path)
            if r is None:
                return int(o["getsize"](path))
            try:
                return int(ns.getsize(r))
            except OSError as exc:
                raise _fix(exc, path) from None

        def getmtime(path: Any) -> float:
            r = rel(path)
            if r is None:
                return float(o["getmtime"](path))
            return float(stat(path).st_mtime)

        def refuse(key: str, *paths: tuple[int, str]) -> Callable[..., Any]:
            """``paths``: (position, its ``dir_fd`` keyword) of each path argument. A
            relative path with a ``dir_fd`` is not relative to the current directory (the
            library, when loaded, judges it; ``shutil.rmtree`` of a tree elsewhere, run from
            inside ``at``, unlinks such names)."""
            orig = o[key]

            def wrapper(*args: Any, **kw: Any) -> Any:
                for i, fd_kw in paths:
                    if i >= len(args):
                        continue
                    a = args[i]
                    if kw.get(fd_kw) is not None and isinstance(a, (str, bytes, os.PathLike)) \
                            and os.fspath(a)[:1] not in ("/", b"/"):
                        continue
                    if rel(a) is not None:
                        raise _rofs(a)
                return orig(*args, **kw)

            wrapper.__name__ = getattr(orig, "__name__", key)
            wrapper.__doc__ = getattr(orig, "__doc__", None)
            return wrapper

        new: dict[str, Any] = {
            "open": open_, "stat": stat, "lstat": lstat, "listdir": listdir,
            "scandir": scandir, "readlink": readlink, "access": access, "os_open": open_fd,
            "exists": exists, "lexists": lexists, "isfile": isfile, "isdir": isdir,
            "islink": islink, "getsize": getsize, "getmtime": getmtime,
            "listxattr": listxattr, "getxattr": getxattr,
        }
        for key in ("mkdir", "rmdir", "unlink", "remove", "chmod", "chown", "utime",
                    "truncate", "mkfifo", "mknod", "setxattr", "removexattr"):
            new[key] = refuse(key, (0, "dir_fd"))
        for key in ("rename", "replace", "link"):
            new[key] = refuse(key, (0, "src_dir_fd"), (1, "dst_dir_fd"))
        # a symlink's target is text stored in the link, not a path it touches
        new["symlink"] = refuse("symlink", (1, "dir_fd"))
        for key, fn in new.items():
            with contextlib.suppress(AttributeError, TypeError):
                fn.__name__ = getattr(o[key], "__name__", key)
                fn.__doc__ = getattr(o[key], "__doc__", None)
        return new

    # -- patching ---------------------------------------------------------------------------

    def _targets(self) -> list[tuple[Any, str, str]]:
        """(module, attribute, key): every place a replaced function is looked up."""
        t: list[tuple[Any, str, str]] = [(builtins, "open", "open"), (io, "open", "open")]
        t += [(os, a, a) for a in ("stat", "lstat", "listdir", "scandir", "readlink", "access",
                                   "mkdir", "rmdir", "unlink", "remove", "chmod", "chown",
                                   "utime", "truncate", "mkfifo", "mknod", "rename", "replace",
                                   "link", "symlink", "listxattr", "getxattr", "setxattr",
                                   "removexattr")]
        t.append((os, "open", "os_open"))
        t += [(posixpath, a, a) for a in ("exists", "lexists", "isfile", "isdir", "islink",
                                          "getsize", "getmtime")]
        return t

    def start(self) -> None:
        with _stack_lock:
            if self._active:
                raise RuntimeError("this interception is already active")
            targets = self._targets()
            originals = {key: getattr(mod, attr) for mod, attr, key in targets}
            new = self._build(originals)
            self._saved = [(mod, attr, getattr(mod, attr)) for mod, attr, _ in targets]
            for mod, attr, key in targets:
                setattr(mod, attr, new[key])
            self._supports = _declare_support(originals, new)
            self._active = True
            _stack.append(self)

    def stop(self) -> None:
        with _stack_lock:
            if not self._active:
                return
            if _stack[-1] is not self:
                raise RuntimeError("interceptions must be stopped in the reverse order of "
                                   "their start")
            for mod, attr, fn in reversed(self._saved):
                setattr(mod, attr, fn)
            for group, fn in self._supports:
                group.discard(fn)
            self._saved, self._supports = [], []
            self._active = False
            _stack.pop()

    @property
    def active(self) -> bool:
        return self._active

    def __repr__(self) -> str:
        state = "active" if self._active else "inactive"
        return f"<stagefs.Interceptor {self.root!r} → {self.store!r} ({state})>"


def _declare_support(originals: dict[str, Any], new: dict[str, Any]) -> list[tuple[set[Any],
                                                                                 Any]]:
    """Put each replacement in the ``os.supports_*`` sets its original is in (it takes the
    same ``dir_fd``, ``follow_symlinks``, descriptor and ``effective_ids`` arguments): the
    standard library asks them before it passes one (``shutil.copystat`` of a symlink got
    ``None`` for ``os.stat`` and failed ``copytree(symlinks=True)``). Returns what to undo."""
    added = []
    for group in (os.supports_dir_fd, os.supports_fd, os.supports_follow_symlinks,
                  os.supports_effective_ids):
        for key, fn in new.items():
            if originals[key] in group and fn not in group:
                group.add(fn)
                added.append((group, fn))
    return added


# programs that are not Python but commonly start it: their Python children are served
_LAUNCHERS = frozenset({
    "sh", "bash", "dash", "zsh", "ksh", "env", "time", "nice", "nohup", "stdbuf", "numactl",
    "taskset", "srun", "mpirun", "mpiexec", "mpiexec.hydra", "orterun", "prterun", "jsrun",
    "flux", "apptainer", "singularity", "uv", "conda", "pixi", "timeout",
})


def _is_python_name(word: str) -> bool:
    name = os.path.basename(word)
    return (name.startswith(("python", "pypy")) and name.rstrip("0123456789.").endswith(
        ("python", "pypy"))) or name.endswith(".py")


def program_kind(cmd: list[str]) -> str:
    """How much of ``cmd`` the interception can serve (it reaches Python processes only):

    ``python`` (a Python interpreter, or a script run by one: ``torchrun``, ``train.py``),
    ``launcher`` (a shell or launcher, or a program whose arguments name Python: its Python
    children are served, nothing else), ``native`` (a program that reads with libc, like
    ``ls``: it sees the directory as it is on disk), or ``missing`` (not found).
    """
    import shutil

    exe = shutil.which(cmd[0])
    if exe is None:
        return "missing"
    if _is_python_name(os.path.realpath(exe)) or _is_python_name(exe):
        return "python"
    try:
        with open(exe, "rb") as f:
            head = f.read(256).split(b"\n", 1)[0]
    except OSError:
        head = b""
    if head.startswith(b"#!") and b"python" in head:
        return "python"
    words = [w for arg in cmd[1:] for w in arg.split()]
    if (head.startswith(b"#!") or os.path.basename(exe) in _LAUNCHERS
            or any(_is_python_name(w) for w in words)):
        return "launcher"
    return "native"


def _env_for(store: Any, root: str) -> dict[str, str]:
    """The variables that carry an interception into spawned and child Python processes."""
    import base64
    import pickle

    path = os.environ.get("PYTHONPATH", "")
    parts = [p for p in path.split(os.pathsep) if p and p != BOOTSTRAP_DIR]
    return {
        ENV_DATASET: str(getattr(store, "pack_dir", "")),
        ENV_AT: root,
        ENV_STORE: base64.b64encode(pickle.dumps(store)).decode("ascii"),
        "PYTHONPATH": os.pathsep.join([BOOTSTRAP_DIR, *parts]),
    }


@contextlib.contextmanager
def intercept(store: Any, at: str | os.PathLike[str], *,
              children: bool = True) -> Iterator[Interceptor]:
    """Serve every Python-level access under ``at`` from ``store`` inside the block.

    With ``children`` (the default), Python processes started inside the block (spawned
    DataLoader workers, ``subprocess`` running Python) are intercepted too, through
    environment variables that a start-up hook reads. Forked processes inherit the patch.
    Everything is restored on exit.
    """
    icpt = Interceptor(store, at)
    saved_env: dict[str, str | None] = {}
    if children:
        env = _env_for(store, icpt.root)
        saved_env = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
    icpt.start()
    try:
        yield icpt
    finally:
        icpt.stop()
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def from_environment() -> Interceptor | None:
    """Start the interception the environment asks for (the start-up hook calls this)."""
    at = os.environ.get(ENV_AT)
    if not at:
        return None
    blob = os.environ.get(ENV_STORE)
    if blob:
        import base64
        import pickle

        store = pickle.loads(base64.b64decode(blob))
    else:
        from stagefs.store import open as open_store

        dataset = os.environ.get(ENV_DATASET)
        if not dataset:
            raise ConfigError(f"{ENV_AT} is set but neither {ENV_STORE} nor {ENV_DATASET} is")
        store = open_store(dataset)
    icpt = Interceptor(store, at)
    icpt.start()
    return icpt

