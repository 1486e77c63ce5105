"""stat, listdir, scandir and walk over a manifest: pure lookups, no I/O beyond the mmap.

Paths are relative to the dataset root, "/"-separated, as ``str`` (or ``bytes``, or a
PathLike); a leading "/" is ignored, so "train/a.jpg" and "/train/a.jpg" are the same file.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import numpy as np

from stagefs.config import env_flag
from stagefs.errors import (
    IsADirectoryError_,
    NotADirectoryError_,
    NotFoundError,
    PathError,
    SymlinkLoopError,
)
from stagefs.format import KIND_DIR, KIND_FILE, KIND_SYMLINK, NO_INDEX, Manifest

__all__ = ["DirEntry", "Namespace", "PathArg", "accelerator", "is_a_directory", "normalize"]

log = logging.getLogger("stagefs")

_stat_result = os.stat_result

PathArg = str | bytes | os.PathLike[str] | os.PathLike[bytes]
_MAX_LINKS = 40  # as Linux's MAXSYMLINKS
_UTF8 = sys.getfilesystemencoding() == "utf-8" and sys.getfilesystemencodeerrors() == (
    "surrogateescape"
)


_R = TypeVar("_R")


def _says_closed(method: Callable[[Namespace, PathArg], _R]) -> Callable[[Namespace, PathArg], _R]:
    """``method`` (a question about one path), with the closed Store's error once the
    manifest was let go of (``Namespace.closed``), not what it met of the arrays released
    under it: another thread still asking as ``close()`` runs, or a bound method kept past
    it (``stat = fs.stat``). Checked only once something failed: the normal path pays one
    call of fixed arity (no argument packing), not a check."""

    def checked(self: Namespace, path: PathArg) -> _R:
        try:
            return method(self, path)
        except Exception as exc:
            self.raise_if_closed(exc)
            raise

    checked.__defaults__ = getattr(method, "__defaults__", None)  # listdir() is the root's
    return functools.update_wrapper(checked, method)


def plain_key(path: PathArg) -> bytes | None:
    """The manifest key of a path that needs no resolution (no trailing "/", no empty, "."
    or ".." component; one leading "/" is the root's: "/a/b" is "a/b"), or None: the fast
    path's gate."""
    if type(path) is str and _UTF8:  # the common case, without os.fsencode's dispatch
        if path[:1] == "/":
            path = path[1:]
        if path[:1] not in "/." and path[-1:] != "/" and "//" not in path and "/." not in path:
            return path.encode("utf-8", "surrogateescape")
        return None
    p = os.fsencode(path)
    if p[:1] == b"/":
        p = p[1:]
    if p[:1] not in (b"/", b".") and p[-1:] != b"/" and b"//" not in p and b"/." not in p:
        return p
    return None


def normalize(path: PathArg) -> bytes:
    """The key of ``path`` with "", "." and ".." components folded lexically.

    Lexical: "link/.." is the directory holding "link". ``Namespace.entry`` resolves ".."
    physically, as the kernel does (the parent of the directory "link" points to).
    """
    key = plain_key(path)
    if key is not None:
        return key
    parts: list[bytes] = []
    for comp in os.fsencode(path).split(b"/"):
        if comp in (b"", b"."):
            continue
        if comp == b"..":
            if parts:
                parts.pop()
        else:
            parts.append(comp)
    return b"/".join(parts)


class DirEntry:
    """What ``Namespace.scandir`` yields; the same methods as ``os.DirEntry``. One asked
    after its Store was closed (a listing kept past a ``with``) says so (``closed``), not
    what it met of the manifest let go of."""

    __slots__ = ("_e", "_ns", "name", "path")

    def __init__(self, ns: Namespace, e: int, name: Any, path: Any) -> None:
        self._ns, self._e, self.name, self.path = ns, e, name, path

    def inode(self) -> int:
        return self._e + 1

    def is_dir(self, *, follow_symlinks: bool = True) -> bool:
        try:
            return self._ns.kind_of(self._e, follow_symlinks) == KIND_DIR
        except Exception as exc:
            self._ns.raise_if_closed(exc)
            raise

    def is_file(self, *, follow_symlinks: bool = True) -> bool:
        try:
            return self._ns.kind_of(self._e, follow_symlinks) == KIND_FILE
        except Exception as exc:
            self._ns.raise_if_closed(exc)
            raise

    def is_symlink(self) -> bool:
        try:
            return bool(self._ns.manifest.kind[self._e] == KIND_SYMLINK)
        except Exception as exc:
            self._ns.raise_if_closed(exc)
            raise

    def is_junction(self) -> bool:
        return False

    def stat(self, *, follow_symlinks: bool = True) -> os.stat_result:
        try:
            e = self._ns.follow(self._e, self.path) if follow_symlinks else self._e
            return self._ns.stat_entry(e)
        except Exception as exc:
            self._ns.raise_if_closed(exc)
            raise

    def __fspath__(self) -> Any:
        return self.path

    def __repr__(self) -> str:
        return f"<stagefs.DirEntry {self.name!r}>"


class Namespace:
    """The read-only directory tree of one manifest."""

    def __init__(self, manifest: Manifest) -> None:
        self.manifest = manifest
        # the error of the Store that closed this manifest (set by its close())
        self.closed: Callable[[], BaseException] | None = None
        self._dev = int.from_bytes(manifest.pack_id[:4], "little") | 1
        self._uid, self._gid = os.getuid(), os.getgid()
        self._lookup, self._kind = manifest.lookup, manifest.kind
        self._mode, self._size, self._mtime = manifest.mode, manifest.size, manifest.mtime_ns
        # the hot path: in C when the accelerator is built, else the Python reference below
        self.stat: Callable[[PathArg], os.stat_result] = self._stat_py
        self.find: Callable[[PathArg], int] = self._find_py
        index = _accelerated(manifest, self._stat_py, self._dev, self._uid, self._gid)
        if index is not None:
            self.stat, self.find = index.stat, index.find
            self.accelerated = True
        else:
            self.accelerated = False

    def raise_if_closed(self, exc: BaseException) -> None:
        """If the manifest was let go of (``closed``), the error that says so, for ``exc``
        met on the way."""
        if self.closed is not None:
            raise self.closed() from exc

    # -- resolution ------------------------------------------------------------------------

    def entry(self, path: PathArg, *, follow: bool = True) -> int:
        """The entry index of ``path``, resolved as the kernel resolves a path: symlinks in
        the path are followed, ".." is the parent of the directory reached so far, and a
        trailing "/" requires a directory (and follows a final symlink)."""
        key = plain_key(path)
        if key is not None:
            e = self._lookup(key)
            if e < 0:
                e = self._walk_components(key.split(b"/"), path, follow)
            if follow and self._kind[e] == KIND_SYMLINK:
                e = self.follow(e, path)
            return e
        raw = os.fsencode(path)
        trailing = raw.endswith(b"/") and raw.strip(b"/") != b""
        e = self._walk_components(raw.split(b"/"), path, follow or trailing)
        if (follow or trailing) and self._kind[e] == KIND_SYMLINK:
            e = self.follow(e, path)
        if trailing and self._kind[e] != KIND_DIR:
            raise NotADirectoryError_(_show(path))
        return e

    def follow(self, e: int, path: PathArg) -> int:
        m = self.manifest
        for _ in range(_MAX_LINKS):
            if m.kind[e] != KIND_SYMLINK:
                return e
            target = m.first[e]
            if target == NO_INDEX:
                raise NotFoundError(_show(path), "No such file or directory (a symlink whose "
                                    "target is not in the dataset: missing, or outside its "
                                    "tree)")
            e = target
        raise SymlinkLoopError(_show(path))

    def _walk_components(self, comps: list[bytes], path: PathArg, follow: bool = True) -> int:
        """Resolve a path one component at a time (the slow path): symlinked directories,
        "..", missing names and files used as directories."""
        m = self.manifest
        cur, links = 0, 0
        for comp in comps:
            if comp in (b"", b"."):
                continue
            if m.kind[cur] == KIND_SYMLINK:  # as the kernel: at most 40 links in one path
                links += 1
                if links > _MAX_LINKS:
                    raise SymlinkLoopError(_show(path))
            cur = self.follow(cur, path)
            if m.kind[cur] != KIND_DIR:
                raise NotADirectoryError_(_show(path))
            if comp == b"..":
                cur = int(m.parent[cur])  # the root is its own parent, as "/" is
                continue
            prefix = m.path_of(cur)
            child = m.lookup(prefix + b"/" + comp if prefix else comp)
            if child < 0:
                raise NotFoundError(_show(path))
            cur = child
        if follow and links >= _MAX_LINKS and m.kind[cur] == KIND_SYMLINK:
            raise SymlinkLoopError(_show(path))  # following the last one makes 41
        return cur

    def kind_of(self, e: int, follow: bool = True) -> int:
        m = self.manifest
        if follow and m.kind[e] == KIND_SYMLINK:
            t = m.first[e]
            for _ in range(_MAX_LINKS):  # bounded: a symlink loop is neither dir nor file
                if t == NO_INDEX or m.kind[t] != KIND_SYMLINK:
                    break
                t = m.first[t]
            return -1 if t == NO_INDEX or m.kind[t] == KIND_SYMLINK else int(m.kind[t])
        return int(m.kind[e])

    def file_entry(self, path: PathArg) -> int:
        e = self.entry(path)
        if self.manifest.kind[e] == KIND_DIR:
            raise is_a_directory(_show(path))
        return e

    def dir_entry(self, path: PathArg) -> int:
        e = self.entry(path)
        if self.manifest.kind[e] != KIND_DIR:
            raise NotADirectoryError_(_show(path))
        return e

    # -- stat ------------------------------------------------------------------------------

    @_says_closed
    def _stat_py(self, path: PathArg) -> os.stat_result:
        key = plain_key(path)  # entry(), inlined for the common case
        e = -1 if key is None else self._lookup(key)
        if e < 0 or self._kind[e] == KIND_SYMLINK:
            e = self.entry(path)
        return self.stat_entry(e)

    def _find_py(self, path: PathArg) -> int:
        """The entry of a regular file at a plain ``path`` (no symlink in the way), or -1."""
        key = plain_key(path)
        e = -1 if key is None else self._lookup(key)
        return e if e >= 0 and self._kind[e] == KIND_FILE else -1

    @_says_closed
    def lstat(self, path: PathArg) -> os.stat_result:
        return self.stat_entry(self.entry(path, follow=False))

    def stat_entry(self, e: int) -> os.stat_result:
        size = self._size[e]
        ns = self._mtime[e]
        secs = ns // 1_000_000_000
        fsecs = secs + (ns - secs * 1_000_000_000) * 1e-9  # as os.stat computes it
        nlink = self._nlink(e) if self._kind[e] == KIND_DIR else 1
        return _stat_result(
            (self._mode[e], e + 1, self._dev, nlink, self._uid, self._gid, size, secs, secs,
             secs, fsecs, fsecs, fsecs, ns, ns, ns, self.blksize(size), (size + 511) >> 9, 0)
        )

    def blksize(self, size: int) -> int:
        """The preferred I/O size of a file of ``size`` bytes: one piece (the unit its bytes
        are verified in) for a file of several pieces: cat and cp read that much at a time,
        so each read is a whole piece, hashed in the reader's buffer with no copy of ours (as
        a parallel file system gives its stripe size); 64 KiB for another file (stdio and
        Python size their buffers by it). The preload library and the C index say the
        same."""
        piece = self.manifest.piece_size
        return piece if piece and size > piece else 65536

    def _nlink(self, e: int) -> int:
        r = self.manifest.children(e)
        kinds = self.manifest.arrays["kind"][r.start : r.stop]
        return 2 + int(np.count_nonzero(kinds == KIND_DIR))

    @_says_closed
    def exists(self, path: PathArg) -> bool:
        try:
            self.entry(path)
        except OSError:
            return False
        return True

    @_says_closed
    def isdir(self, path: PathArg) -> bool:
        try:
            return bool(self.manifest.kind[self.entry(path)] == KIND_DIR)
        except OSError:
            return False

    @_says_closed
    def isfile(self, path: PathArg) -> bool:
        try:
            return bool(self.manifest.kind[self.entry(path)] == KIND_FILE)
        except OSError:
            return False

    @_says_closed
    def islink(self, path: PathArg) -> bool:
        try:
            return bool(self.manifest.kind[self.entry(path, follow=False)] == KIND_SYMLINK)
        except OSError:
            return False

    @_says_closed
    def getsize(self, path: PathArg) -> int:
        return int(self.manifest.size[self.entry(path)])

    @_says_closed
    def readlink(self, path: PathArg) -> str:
        e = self.entry(path, follow=False)
        if self.manifest.kind[e] != KIND_SYMLINK:
            raise PathError(_show(path), "Invalid argument (not a symlink)")
        return os.fsdecode(self.manifest.link_target(e))

    # -- directories -----------------------------------------------------------------------

    @_says_closed
    def listdir(self, path: PathArg = "") -> list[Any]:
        """Names in a directory: ``str``, or ``bytes`` when ``path`` is bytes (as os does)."""
        return self._names(self.manifest.children(self.dir_entry(path)),
                           as_bytes=isinstance(path, bytes))

    def _names(self, children: range, *, as_bytes: bool = False) -> list[Any]:
        """The names of a directory's ``children``, cut from one copy of their paths (they
        are contiguous in the strings): a name at a time went through the manifest's
        memoryviews twice, and walking ImageNet's tree took ten times os.walk's time on a
        local disk."""
        if not children:
            return []
        m = self.manifest
        a, b = children.start, children.stop
        off = m.arrays["path_off"]
        base = int(off[a])
        block = m.strings[base : int(off[b])].tobytes()
        # each child's path is its parent's, "/", then its name: the name is after the
        # last "/" (checked at open: format/validate.py)
        prefix = len(m.path_of(int(m.parent[a])))
        skip = prefix + 1 if prefix else 0
        starts = (off[a:b] - base + skip).tolist()
        ends = (off[a + 1 : b + 1] - base).tolist()
        if as_bytes:
            return [block[i:j] for i, j in zip(starts, ends, strict=True)]
        if _UTF8 and block.isascii():  # byte offsets are character offsets: decode once
            text = block.decode("ascii")
            return [text[i:j] for i, j in zip(starts, ends, strict=True)]
        return [os.fsdecode(block[i:j]) for i, j in zip(starts, ends, strict=True)]

    def scandir(self, path: PathArg = "") -> Iterator[DirEntry]:
        """``DirEntry`` objects; their ``name`` and ``path`` are bytes when ``path`` is. A
        missing directory raises here, as ``os.scandir`` does, not at the first entry."""
        return self.dir_entries(self.dir_entry(path), path)

    def dir_entries(self, e: int, path: PathArg) -> Iterator[DirEntry]:
        """The ``DirEntry`` objects of directory entry ``e``, each ``path`` joined with its
        name (as ``os.scandir(path)`` gives them; also what ``stagefs run`` serves)."""
        base: Any = path if isinstance(path, str | bytes) else os.fspath(path)
        as_bytes = isinstance(base, bytes)
        children = self.manifest.children(e)
        names = self._names(children, as_bytes=as_bytes)
        sep: Any = b"/" if as_bytes else "/"
        prefix = base if not base or base.endswith(sep) else base + sep  # os.path.join's
        return (DirEntry(self, c, name, prefix + name)
                for c, name in zip(children, names, strict=True))

    def walk(
        self, top: PathArg = "", topdown: bool = True, followlinks: bool = False
    ) -> Iterator[tuple[Any, list[Any], list[Any]]]:
        """Like ``os.walk``: symlinks to directories are listed as directories and descended
        only with ``followlinks``; with ``topdown``, pruning ``dirs`` in place prunes the
        walk. A loop, not recursion: a tree of any depth is walked."""
        if isinstance(top, bytes):  # bytes in, bytes out, as os.walk
            for d, dirs_, files_ in self.walk(os.fsdecode(top), topdown, followlinks):
                yield (os.fsencode(d), [os.fsencode(x) for x in dirs_],
                       [os.fsencode(x) for x in files_])
            return
        top_s = os.fsdecode(top) if not isinstance(top, str) else top
        # a directory still to list, or (bottom-up) a listing to yield once its subtree is
        stack: list[tuple[str, tuple[list[str], list[str]] | None]] = [(top_s, None)]
        while stack:
            path, listed = stack.pop()
            if listed is not None:
                yield path, *listed
                continue
            try:
                children = self.manifest.children(self.dir_entry(path))
            except OSError:
                continue
            names = self._names(children)
            kinds = self.manifest.arrays["kind"][children.start : children.stop]
            is_dir = kinds == KIND_DIR
            links: set[str] = set()
            for k in np.flatnonzero(kinds == KIND_SYMLINK).tolist():  # as scandir's is_dir
                if self.kind_of(children.start + k) == KIND_DIR:
                    is_dir[k] = True
                    links.add(names[k])
            dirs: list[str] = [names[k] for k in np.flatnonzero(is_dir).tolist()]
            files: list[str] = [names[k] for k in np.flatnonzero(~is_dir).tolist()]
            if topdown:
                yield path, dirs, files
            else:
                stack.append((path, (dirs, files)))
            for name in reversed(dirs):  # popped in listing order
                if name not in links or followlinks:
                    stack.append((os.path.join(path, name) if path else name, None))

    def summary(self) -> dict[str, Any]:
        a = self.manifest.arrays
        kinds = a["kind"]
        files = kinds == KIND_FILE
        return {
            "files": int(np.count_nonzero(files)),
            "directories": int(np.count_nonzero(kinds == KIND_DIR)) - 1,
            "symlinks": int(np.count_nonzero(kinds == KIND_SYMLINK)),
            "raw_bytes": int(a["size"][files].sum()),
            "stored_bytes": int(a["stored"][files].sum()),
            "compressed_files": int(np.count_nonzero(a["codec"][files] != 0)),
            "shards": len(self.manifest.shards),
            "shard_bytes": sum(s.size for s in self.manifest.shards),
        }


NOT_BUILT = (
    "not built: path lookups and stat run in Python, about 6x slower. "
    "To build it, install a C compiler and Python's headers (Debian/Ubuntu: apt-get install "
    "gcc python3-dev), then reinstall stagefs from its source without pip's cache: pip "
    "install --force-reinstall --no-deps --no-cache-dir SOURCE (the checkout or sdist it came "
    "from). STAGEFS_SPEEDUPS=0 turns this notice off"
)
_noticed = False  # NOT_BUILT is logged once per process


def _index_type() -> tuple[Any, str]:
    """The C accelerator's Index class and "active", or None and why it is not used."""
    if not env_flag("SPEEDUPS"):
        return None, "off (STAGEFS_SPEEDUPS=0)"
    if os.stat_result.n_fields != 19:
        return None, "not used: this platform's os.stat_result has another layout"
    try:
        from stagefs._speedups import Index  # type: ignore[import-not-found]
    except ImportError:
        return None, NOT_BUILT
    return Index, "active"


def accelerator() -> str:
    """"active", or why the C accelerator is not used and what that costs."""
    return _index_type()[1]


def _accelerated(
    manifest: Manifest, fallback: Callable[[PathArg], os.stat_result], dev: int, uid: int,
    gid: int,
) -> Any:
    """The C index over this manifest, or None (not built, or STAGEFS_SPEEDUPS=0); the first
    time it is not built, a notice that says what that costs and how to build it."""
    global _noticed
    index_type, state = _index_type()
    if index_type is None:
        if state == NOT_BUILT and not _noticed:
            _noticed = True
            log.warning("the C accelerator is %s", NOT_BUILT)
        return None
    a = manifest.arrays
    index = index_type(a["slots"], a["hash"], a["path_off"], a["strings"], a["kind"],
                       a["mode"], a["size"], a["mtime_ns"], os.stat_result, fallback, dev,
                       uid, gid, manifest.piece_size)
    manifest.on_close(index.release)
    return index


def is_a_directory(shown: str) -> IsADirectoryError_:
    """The error of a read of a directory (``shown``: its path as the caller gave it)."""
    return IsADirectoryError_(shown, "Is a directory (a read reads a file: listdir, "
                              "scandir or walk list a directory)")


def _show(path: PathArg) -> str:
    return os.fsdecode(path) if not isinstance(path, str) else path

