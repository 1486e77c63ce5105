"""Raw tree → pack (parallel over processes, resumable, with progress); pack → raw tree.

Packing runs in three steps: one scan of the source (lstat only, in bytes so that any name
survives), a plan that cuts the files, in path order, into shards of about ``shard_size``
bytes, and the shard writes, one task per shard over a process pool. Each finished shard
leaves a small record beside it in ``DEST/.stagefs-pack/``; the manifest is written last and
atomically, and only then is that folder removed. An interrupted pack therefore never looks
complete, and running the same pack again reuses every shard whose files have not changed.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import errno
import fcntl
import json
import logging
import os
import shutil
import stat as st
import sys
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from tqdm import tqdm

from stagefs._fsutil import PARTIAL_SUFFIX, atomic_write, open_read, worker_pool
from stagefs.config import absolute, format_size, parse_size, show_path
from stagefs.errors import (
    CorruptManifestError,
    DestinationExistsError,
    DestinationFullError,
    PackError,
    SourceChangedError,
    StagefsError,
    UnreadableSourceError,
    UnsafeSymlinkError,
)
from stagefs.format import (
    KIND_DIR,
    KIND_FILE,
    KIND_SYMLINK,
    MANIFEST_NAME,
    PACK_STATE_DIR,
    VERSION,
    ManifestBuilder,
    ShardWriter,
    checksum,
    shard_name,
)
from stagefs.format.checksum import StreamSum, piece_sums
from stagefs.format.codecs import MAX_COMPRESSED, Codec, compress_auto
from stagefs.format.manifest import Entry, ShardInfo
from stagefs.format.spec import FILE_ALIGN, FILE_ALIGN_MIN, MAX_FILE_ALIGN, PIECE, SHARD_HEADER
from stagefs.format.validate import NO_ALIGN, FileAlign
from stagefs.namespace import PathArg

__all__ = ["PackReport", "pack", "unpack"]

log = logging.getLogger("stagefs.pack")

DEFAULT_SHARD_SIZE = "64MiB"
STATE_DIR = PACK_STATE_DIR
_STREAM_ABOVE = MAX_COMPRESSED  # files larger than this are copied in chunks and stored raw
_CHUNK = 8 * 2**20
COMPRESS_MODES = ("auto", "zstd", "none")


@dataclass(slots=True)
class _Source:
    """A file found by the scan: what lstat said, and where to read it: at its path in the
    tree (``abspath`` None: SRC/rel, kept as one string for all, not one a file: 90 bytes
    each of a pack's memory, which holds every file's record until the manifest is
    written), or at ``abspath`` (a file reached through a symlink --follow-symlinks
    followed out of the tree)."""

    rel: bytes
    abspath: bytes | None
    size: int
    mtime_ns: int
    mode: int

    def path(self, root: bytes) -> bytes:
        """Where to read the file, for the tree at ``root``."""
        return self.abspath if self.abspath is not None else root + b"/" + self.rel


@dataclass
class PackReport:
    dest: str
    files: int = 0
    directories: int = 0
    symlinks: int = 0
    raw_bytes: int = 0
    stored_bytes: int = 0
    padding_bytes: int = 0  # zeros before aligned files (docs/FORMAT.md, "File alignment")
    raw_over_max: int = 0  # files over MAX_COMPRESSED, stored raw under --compress zstd
    shards: int = 0
    reused_shards: int = 0
    skipped: list[str] = field(default_factory=list)  # sockets, FIFOs, devices


# ---------------------------------------------------------------------------------- scan


@dataclass
class _Scan:
    entries: list[Entry] = field(default_factory=list)
    files: list[_Source] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    unsafe: list[str] = field(default_factory=list)
    unreadable: list[str] = field(default_factory=list)
    relinked: list[str] = field(default_factory=list)  # symlinks stored with a new target


def _within(path: bytes, root: bytes) -> bool:
    return path == root or path.startswith(root.rstrip(b"/") + b"/")


def _scan(src: bytes, *, follow_symlinks: bool, exclude: bytes | None,
          progress: bool | None = None) -> _Scan:
    """Every entry of the tree at ``src``. A count of the entries seen so far is shown as it
    goes (``progress``, as ``pack``'s): on a shared file system the scan of a million files
    takes minutes, and a pack that printed nothing for that long looked hung."""
    real_root = os.path.realpath(src)
    out = _Scan()
    top = os.stat(src)  # the root itself may be reached through a symlink
    out.entries.append(Entry(b"", KIND_DIR, top.st_mode, top.st_mtime_ns))
    seen_dirs = {(top.st_dev, top.st_ino)}
    stack: list[tuple[bytes, bytes]] = [(src, b"")]
    with tqdm(desc=f"scanning {os.fsdecode(src)}", unit=" entries", leave=False,
              disable=None if progress is None else not progress) as bar:
        while stack:
            dirpath, rel_dir = stack.pop()
            # a directory of the tree, or one a followed symlink brought in
            own = dirpath == (os.path.join(src, rel_dir) if rel_dir else src)
            try:
                with os.scandir(dirpath) as it:
                    items = sorted(it, key=lambda d: d.name)
            except PermissionError:
                out.unreadable.append(show_path(dirpath))
                continue
            bar.update(len(items))
            for d in items:
                rel = rel_dir + b"/" + d.name if rel_dir else d.name
                apath = os.path.join(dirpath, d.name)
                if exclude is not None and rel == exclude:  # DEST inside SRC
                    continue
                try:
                    info = d.stat(follow_symlinks=False)
                except PermissionError:  # listable but not searchable (r without x)
                    out.unreadable.append(show_path(dirpath))
                    break
                except FileNotFoundError:  # removed since it was listed: not in the tree
                    continue
                if st.S_ISLNK(info.st_mode):
                    # where the link is in the pack is where it is in the source, unless it
                    # lies in an outside directory that --follow-symlinks brought in
                    in_tree = apath == os.path.join(src, rel)
                    _scan_link(out, rel, apath, real_root, follow_symlinks, stack, seen_dirs,
                               in_tree)
                elif st.S_ISDIR(info.st_mode):
                    out.entries.append(Entry(rel, KIND_DIR, info.st_mode, info.st_mtime_ns))
                    stack.append((apath, rel))
                elif st.S_ISREG(info.st_mode):
                    out.files.append(_Source(rel, None if own else apath, info.st_size,
                                             info.st_mtime_ns, info.st_mode))
                else:
                    out.skipped.append(os.fsdecode(rel))
    return out


def _scan_link(
    out: _Scan,
    rel: bytes,
    apath: bytes,
    real_root: bytes,
    follow: bool,
    stack: list[tuple[bytes, bytes]],
    seen_dirs: set[tuple[int, int]],
    in_tree: bool,
) -> None:
    target = os.readlink(apath)
    resolved = os.path.realpath(apath)
    info = os.lstat(apath)
    if _within(resolved, real_root):
        inside = os.path.relpath(resolved, real_root)
        link_resolved = b"" if inside == b"." else inside
        rel_dir = rel.rpartition(b"/")[0]
        if os.path.exists(resolved) and (  # a dangling link or a loop keeps its text
                not in_tree or _beneath(real_root, rel_dir, target) != link_resolved):
            # its text, read from its place in the pack (readlink, unpack, a mount), would
            # not lead where the file system led: the path inside the pack that does
            new = os.path.relpath(b"/" + link_resolved, b"/" + rel_dir)
            out.relinked.append(f"{show_path(rel)} -> {show_path(target)} "
                                f"(stored as -> {show_path(new)})")
            target = new
        out.entries.append(
            Entry(rel, KIND_SYMLINK, info.st_mode, info.st_mtime_ns, link_target=target,
                  link_resolved=link_resolved)
        )
        return
    if not follow or not os.path.exists(resolved):
        if follow:
            log.warning("symlink %s points to missing %s: kept as a symlink",
                        show_path(rel), show_path(target))
            out.entries.append(
                Entry(rel, KIND_SYMLINK, info.st_mode, info.st_mtime_ns, link_target=target)
            )
        else:
            out.unsafe.append(f"{show_path(rel)} -> {show_path(target)}")
        return
    tinfo = os.stat(resolved)
    if st.S_ISDIR(tinfo.st_mode):
        if (tinfo.st_dev, tinfo.st_ino) in seen_dirs:
            out.unsafe.append(f"{show_path(rel)} -> {show_path(target)} (a loop)")
            return
        seen_dirs.add((tinfo.st_dev, tinfo.st_ino))
        out.entries.append(Entry(rel, KIND_DIR, tinfo.st_mode, tinfo.st_mtime_ns))
        stack.append((resolved, rel))
    elif st.S_ISREG(tinfo.st_mode):
        out.files.append(_Source(rel, resolved, tinfo.st_size, tinfo.st_mtime_ns, tinfo.st_mode))
    else:
        out.skipped.append(os.fsdecode(rel))


def _beneath(real_root: bytes, rel_dir: bytes, target: bytes) -> bytes | None:
    """Where the symlink text ``target``, followed from the directory ``rel_dir`` of the tree
    at ``real_root`` as the kernel follows it (component by component, through the links of
    the tree), leads: a path inside the tree, or None if it leaves the tree on the way (an
    absolute target, a ``..`` above the root) or loops. A missing name is taken as it is
    (as ``realpath`` does). A link kept with its own text must lead, from its place in the
    pack, where the file system led from its place in the source."""
    if target.startswith(b"/"):
        return None
    parts = [p for p in rel_dir.split(b"/") if p]
    todo = target.split(b"/")[::-1]  # a stack: the next component last
    links = 0
    while todo:
        name = todo.pop()
        if name in (b"", b"."):
            continue
        if name == b"..":
            if not parts:
                return None
            parts.pop()
            continue
        parts.append(name)
        path = os.path.join(real_root, *parts)
        try:
            info = os.lstat(path)
        except OSError:
            continue
        if st.S_ISLNK(info.st_mode):
            links += 1
            text = os.readlink(path)
            if links > 40 or text.startswith(b"/"):
                return None
            parts.pop()
            todo += text.split(b"/")[::-1]
    return b"/".join(parts)


# ---------------------------------------------------------------------------------- plan


def _plan(files: list[_Source], shard_size: int) -> list[list[_Source]]:
    """Cut the files, in path order, into shards of about ``shard_size`` bytes.

    A file larger than a shard gets one of its own; so does every file that would push a
    non-empty shard past the size.
    """
    files = sorted(files, key=lambda f: f.rel.rpartition(b"/"))
    shards: list[list[_Source]] = []
    current: list[_Source] = []
    filled = 0
    for f in files:
        if current and filled + f.size > shard_size:
            shards.append(current)
            current, filled = [], 0
        current.append(f)
        filled += f.size
    if current:
        shards.append(current)
    return shards


def _signature(files: list[_Source]) -> list[list[Any]]:
    return [[f.rel.hex(), f.size, f.mtime_ns] for f in files]


# ---------------------------------------------------------------------------------- write


_Record = tuple[int, int, int, int, Sequence[int]]
"""One file as written: offset, stored length, codec, checksum, piece checksums."""


@dataclass
class _ShardResult:
    index: int
    records: list[_Record]
    size: int = 0
    changed: list[str] = field(default_factory=list)
    unreadable: list[str] = field(default_factory=list)


def _read_whole(fd: int, size: int) -> bytes:
    chunks = []
    while True:
        chunk = os.read(fd, max(size + 1, 1 << 16))
        if not chunk:
            break
        chunks.append(chunk)
    return b"".join(chunks)


def _write_one(writer: ShardWriter, f: _Source, path: bytes, compress: str) -> _Record | str:
    """Append one file; return its record, or ``"changed"`` if it changed under us. A raw
    file larger than one piece gets the checksum of each piece too, and a raw file that the
    writer's alignment names starts at a multiple of it (docs/FORMAT.md).

    The scan found a regular file: if something else is there now (a FIFO, which a plain
    open would wait on for a writer forever; a device; a symlink), it changed."""
    try:
        fd, before = open_read(path, os.O_NOFOLLOW)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENXIO):  # a symlink now; a FIFO or socket now
            return "changed"
        raise
    try:
        if (not st.S_ISREG(before.st_mode) or before.st_size != f.size
                or before.st_mtime_ns != f.mtime_ns):
            return "changed"
        if f.size > _STREAM_ABOVE:
            writer.align_for(Codec.NONE, f.size)
            offset, total, h = writer.position, 0, StreamSum(PIECE)
            while chunk := os.read(fd, _CHUNK):
                writer.append(chunk)
                h.update(chunk)
                total += len(chunk)
            digest = h.digest()
            record = (offset, total, int(Codec.NONE), digest, h.pieces if total > PIECE else ())
        else:
            data = _read_whole(fd, f.size)
            total = len(data)
            codec, stored = compress_auto(data, compress)
            pieces = piece_sums(data, PIECE) if codec == Codec.NONE and total > PIECE else ()
            writer.align_for(codec, total)
            record = (writer.append(stored), len(stored), int(codec), checksum(data), pieces)
        after = os.fstat(fd)
    finally:
        os.close(fd)
    if total != f.size or after.st_size != f.size or after.st_mtime_ns != f.mtime_ns:
        return "changed"
    return record


def _write_shard(
    dest: str, index: int, pack_id: bytes, root: bytes, files: list[_Source], compress: str,
    align: FileAlign, on_file: Callable[[int], object] | None = None,
) -> _ShardResult:
    """Worker: write shard ``index`` of the files of the tree at ``root``; its record file
    makes it reusable by a later run. ``on_file(size)``: after each file (the progress bar,
    when written in this process)."""
    result = _ShardResult(index, [])
    writer = ShardWriter(os.path.join(dest, shard_name(index)), index, pack_id, align)
    try:
        for f in files:
            if on_file is not None:
                on_file(f.size)
            path = f.path(root)
            try:
                rec = _write_one(writer, f, path, compress)
            except PermissionError:
                result.unreadable.append(show_path(path))
                continue
            except FileNotFoundError:
                result.changed.append(show_path(f.rel) + " (deleted)")
                continue
            if isinstance(rec, str):
                result.changed.append(show_path(f.rel))
            else:
                result.records.append(rec)
        if result.changed or result.unreadable:
            writer.abort()
            return result
        writer.close()
    except BaseException:
        writer.abort()
        raise
    result.size = writer.position
    record_path = os.path.join(dest, STATE_DIR, f"{index}.json")
    _write_json(record_path, {"files": _signature(files), "records": result.records,
                              "size": result.size, "version": VERSION})
    return result


def _written(dest: str, index: int, most: int) -> int:
    """The bytes shard ``index`` holds so far while a worker writes it (its ``.partial``
    file), up to ``most`` (its files' size: padding and headers are not progress). A shard
    renamed into place is whole: its worker still writes its record and sends its result
    (a second, for a shard of 50,000 files), and counting it 0 then moved the bar back by
    the whole shard (18% to 1% and up again, at each shard's end). A pack resumed removes
    the shards it writes again before it writes (``_clear_stale``): one in place is this
    run's."""
    path = os.path.join(dest, shard_name(index))
    try:
        return min(most, os.stat(path + ".partial").st_size)
    except OSError:
        return most if os.path.exists(path) else 0  # renamed into place, or not begun


def _write_json(path: str, obj: Any) -> None:
    atomic_write(path, json.dumps(obj))


_NO_ROOM = (errno.ENOSPC, errno.EDQUOT)


@contextlib.contextmanager
def _room_in(dest: str, then: Callable[[], str]) -> Iterator[None]:
    """Writes to ``dest`` (a pack's or an unpack's DEST) inside: a file system that is full,
    or a quota used up (ENOSPC, EDQUOT), is raised as a DestinationFullError that names
    ``dest`` and says what to do; ``then()`` says what running the command again does."""
    try:
        yield
    except OSError as exc:
        if exc.errno not in _NO_ROOM or isinstance(exc, StagefsError):
            raise
        why = ("the file system that holds it is full. Free space there" if exc.errno ==
               errno.ENOSPC else "the disk quota on the file system that holds it is used "
               "up. Free space within the quota (or have it raised)")
        raise DestinationFullError(f"{dest}: {exc.strerror}: {why}, or choose another DEST. "
                                   f"{then()}", exc.errno, dest) from exc


def _after_full(dest: str) -> str:
    """What running a pack that ran out of room again does (``_room_in``'s ``then``)."""
    if os.path.exists(os.path.join(dest, STATE_DIR, "state.json")):
        return ("Once there is room, running the same command again resumes the pack: the "
                "shards already written are reused.")
    # its state was not written: a run without --force finds a DEST that is not empty and
    # not an interrupted pack
    return ("Nothing of the pack was kept: once there is room, run the same command again "
            "with --force.")


def _reusable(dest: str, index: int, files: list[_Source]) -> _ShardResult | None:
    try:
        with open(os.path.join(dest, STATE_DIR, f"{index}.json")) as f:
            saved = json.load(f)
        size = os.stat(os.path.join(dest, shard_name(index))).st_size
    except (OSError, ValueError):
        return None
    if (saved.get("files") != _signature(files) or saved.get("size") != size
            or saved.get("version") != VERSION):  # written by another format: write it again
        return None
    try:
        records: list[_Record] = [(int(o), int(n), int(c), int(h), [int(p) for p in ps] or ())
                                  for o, n, c, h, ps in saved["records"]]
    except (KeyError, TypeError, ValueError):
        return None
    return _ShardResult(index, records, size)


# ---------------------------------------------------------------------------------- pack


@contextlib.contextmanager
def _only_writer(dest: str) -> Iterator[None]:
    """Be the only ``stagefs pack`` writing ``dest`` while inside, or raise a PackError.

    Two packs into one DEST (a command run again in another terminal, two tasks of a job
    array) would each take the other's shards for stale and delete them, or start with
    pack ids of their own and leave a pack whose shards belong to two packs. The lock is an
    ``flock`` on the DEST directory itself (made here if missing): it goes with the process,
    however it ends, and leaves no file behind. A file system without ``flock`` (some
    Lustre and NFS mounts) packs as before, unlocked."""
    if os.path.exists(dest) and not os.path.isdir(dest):
        raise PackError(f"{dest} is a file, not a directory: a pack is a directory; choose "
                        "a missing or empty directory as DEST")
    os.makedirs(dest, exist_ok=True)
    fd = os.open(dest, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise PackError(f"{dest}: another 'stagefs pack' is writing this pack now; wait "
                            "for it to end (if it was stopped, run the same command again "
                            "then: it resumes), or choose another DEST") from None
        except OSError as exc:  # no flock here: nothing to serialise with
            log.debug("%s: not locked (%s)", dest, exc.strerror)
        yield
    finally:
        os.close(fd)


def _empty_dir(path: str) -> None:
    """Remove what ``path`` holds, keeping the directory (and so its lock: _only_writer)."""
    for name in os.listdir(path):
        p = os.path.join(path, name)
        if os.path.isdir(p) and not os.path.islink(p):
            shutil.rmtree(p)
        else:
            os.unlink(p)


def _prepare_dest(dest: str, options: dict[str, Any], overwrite: bool) -> tuple[bytes, bool]:
    """Make ``dest`` ready; return the pack id to use and whether a run is being resumed."""
    state_file = os.path.join(dest, STATE_DIR, "state.json")
    if os.path.exists(os.path.join(dest, MANIFEST_NAME)):
        if not overwrite:
            raise DestinationExistsError(
                f"{dest} already holds a complete pack; pass --force to replace it"
            )
        _empty_dir(dest)
    if os.path.isdir(dest) and os.listdir(dest):
        try:
            with open(state_file) as f:
                state = json.load(f)
        except (OSError, ValueError):
            state = None
        if state is None:
            if not overwrite:
                raise DestinationExistsError(
                    f"{dest} is not empty and is not an interrupted pack; choose an empty "
                    "directory or pass --force to replace its contents"
                )
            _empty_dir(dest)
        elif state.get("options") == options:
            return bytes.fromhex(state["pack_id"]), True
        else:
            log.warning("%s: an interrupted pack with other options is here; starting clean", dest)
            _empty_dir(dest)
    os.makedirs(os.path.join(dest, STATE_DIR), exist_ok=True)
    pack_id = uuid.uuid4().bytes
    _write_json(state_file, {"pack_id": pack_id.hex(), "options": options})
    return pack_id, False


def pack(
    src: PathArg,
    dest: PathArg,
    *,
    shard_size: int | str = DEFAULT_SHARD_SIZE,
    compress: str = "auto",
    align: int = FILE_ALIGN,
    align_min: int = FILE_ALIGN_MIN,
    jobs: int | None = None,
    follow_symlinks: bool = False,
    overwrite: bool = False,
    progress: bool | None = None,
    echo: Callable[[str], None] | None = None,
) -> PackReport:
    """Pack the tree at ``src`` into a pack at ``dest``; see the module docstring.

    Every raw (uncompressed) file of at least ``align_min`` bytes starts at a multiple of
    ``align`` in its shard (0 or 1: none is aligned). ``progress=None`` shows a progress bar
    only when stderr is a terminal.
    """
    say = echo or (lambda msg: print(msg, file=sys.stderr))
    src_s, dest_s = absolute(src), absolute(dest)
    if compress not in COMPRESS_MODES:
        raise PackError(f"unknown --compress {compress!r}: use one of {', '.join(COMPRESS_MODES)}")
    if not os.path.isdir(src_s):
        if os.path.exists(src_s):
            raise PackError(f"{src_s} is a file, not a directory: pack takes the directory "
                            "that holds the dataset's files (stagefs pack SRC_DIR DEST)")
        raise PackError(f"{src_s}: no such directory to pack")
    if os.path.isfile(os.path.join(src_s, MANIFEST_NAME)):  # packing it would store 2 files
        raise PackError(f"{src_s} is a pack already (it holds {MANIFEST_NAME}): read it as it "
                        f"is (stagefs info {src_s}); to pack its files again, give the "
                        "directory they came from, or 'stagefs unpack' it first")
    real_dest, real_src = os.fsencode(os.path.realpath(dest_s)), os.fsencode(os.path.realpath(src_s))
    if _within(real_src, real_dest):  # --force would delete the source with the old DEST
        raise PackError(f"{dest_s}: the pack cannot be written to the source directory or to "
                        f"a directory that contains it ({src_s}); choose another DEST")
    # DEST inside SRC is left out of the scan, found by its path inside SRC (not by the path
    # given, which may go through a symlink)
    dest_in_src = os.path.relpath(real_dest, real_src) if _within(real_dest, real_src) else None
    size = parse_size(shard_size)
    if size <= 0:
        raise PackError(f"--shard-size must be positive, not {shard_size!r}")
    if jobs is not None and jobs < 0:
        raise PackError(f"--jobs must be a number of processes (1 or more; 0: the default, one "
                        f"per core, at most 8), not {jobs}")
    jobs = jobs or min(os.cpu_count() or 1, 8)
    file_align = _file_align(align, align_min)

    scan = _scan(os.fsencode(src_s), follow_symlinks=follow_symlinks, exclude=dest_in_src,
                 progress=progress)
    if scan.unsafe:
        raise UnsafeSymlinkError(
            f"{len(scan.unsafe)} symlink(s) in {src_s} point outside it: "
            + "; ".join(scan.unsafe[:10])
            + ("; ..." if len(scan.unsafe) > 10 else "")
            + ". Pass --follow-symlinks to pack what they point to, or remove them."
        )
    if scan.unreadable:
        raise UnreadableSourceError(
            f"cannot read {len(scan.unreadable)} director(ies): "
            f"{', '.join(scan.unreadable[:10])}{', ...' if len(scan.unreadable) > 10 else ''}."
            " Give this user read and search permission on them (chmod u+rx), or pack as a "
            "user who has it; nothing was written.")
    if scan.relinked:
        log.warning("%d symlink(s) lead into %s by a way that leaves it (an absolute target, "
                    "a '..' above it, or a link in an outside directory --follow-symlinks "
                    "brought in): each is stored with the target that leads to the same entry "
                    "inside the pack: %s%s", len(scan.relinked), src_s,
                    "; ".join(scan.relinked[:10]), "; ..." if len(scan.relinked) > 10 else "")
    if scan.skipped:
        log.warning("skipped %d special files (sockets, FIFOs, devices): %s%s",
                    len(scan.skipped), ", ".join(map(show_path, scan.skipped[:10])),
                    ", ..." if len(scan.skipped) > 10 else "")

    options = {"shard_size": size, "compress": compress, "source": src_s,
               "align": [file_align.to, file_align.min_size]}
    with _room_in(dest_s, lambda: _after_full(dest_s)), _only_writer(dest_s):  # every write
        pack_id, resuming = _prepare_dest(dest_s, options, overwrite)
        plan = _plan(scan.files, size)
        results: dict[int, _ShardResult] = {}
        if resuming:
            for i, files in enumerate(plan):
                if (r := _reusable(dest_s, i, files)) is not None:
                    results[i] = r
            say(f"resuming an interrupted pack in {dest_s}: "
                f"{len(results)} of {len(plan)} shards already written")
        todo = [i for i in range(len(plan)) if i not in results]
        _clear_stale(dest_s, len(plan), keep=set(results))
        _run_writers(dest_s, pack_id, os.fsencode(src_s), plan, todo, compress, file_align,
                     jobs, progress, results)

        failures = [r for r in results.values() if r.changed or r.unreadable]
        unreadable = [p for r in failures for p in r.unreadable]
        changed = [p for r in failures for p in r.changed]
        if unreadable:
            raise UnreadableSourceError(
                f"cannot read {len(unreadable)} file(s): {', '.join(unreadable[:10])}. No pack "
                "was completed; fix the permissions and run the same command again (finished "
                "shards are reused)."
            )
        if changed:
            raise SourceChangedError(
                f"{len(changed)} file(s) changed while they were packed: {', '.join(changed[:10])}."
                " No pack was completed; run the same command again once the source is still."
            )
        # seconds for a million files, after the bar has ended: said, not silent
        with tqdm(desc=f"writing the manifest ({len(scan.entries) + len(scan.files):,} "
                  "entries)", bar_format="{desc}", leave=False,
                  disable=None if progress is None else not progress):
            report = _write_manifest(dest_s, pack_id, scan, plan, results, options,
                                     file_align)
        report.reused_shards = len(plan) - len(todo)
        report.skipped = scan.skipped
        if report.raw_over_max:
            log.warning("--compress zstd: %d file(s) over %s stored raw: a compressed file is "
                        "decoded whole, in memory, so none larger is compressed",
                        report.raw_over_max, format_size(MAX_COMPRESSED))
        shutil.rmtree(os.path.join(dest_s, STATE_DIR), ignore_errors=True)
        return report


def _file_align(align: int, align_min: int) -> FileAlign:
    if align in (0, 1):
        return NO_ALIGN
    if not 2 <= align <= MAX_FILE_ALIGN or align & (align - 1):
        raise PackError(f"--align {align}: give a power of two from 2 to {MAX_FILE_ALIGN} "
                        f"bytes (4096, a page, is the default), or 1 to align no file")
    if align_min < 0:
        raise PackError(f"align_min {align_min}: give a size in bytes (0: align every raw file)")
    return FileAlign(align, align_min)


def _clear_stale(dest: str, n_shards: int, keep: set[int]) -> None:
    """Before a resumed run writes: remove what an interrupted run left and this one does
    not reuse: shards and their records (a record left beside the shard written again would
    describe the old bytes to a later run, if the run writing it dies before its own
    record), shards in progress, and a manifest a killed run was writing (it would stay in
    the finished pack, as large as the manifest, for good)."""
    for name in os.listdir(dest):
        if name.startswith(MANIFEST_NAME + ".") and name.endswith(PARTIAL_SUFFIX):
            os.unlink(os.path.join(dest, name))
        elif name.startswith("shard-") and (name.endswith(".sfs") or name.endswith(".partial")):
            try:
                idx = int(name[6:12])
            except ValueError:
                continue
            if idx not in keep or name.endswith(".partial") or idx >= n_shards:
                os.unlink(os.path.join(dest, name))
    for name in os.listdir(os.path.join(dest, STATE_DIR)):
        index, dot, _ = name.partition(".")
        if dot and index.isdigit() and int(index) not in keep:  # N.json and its partials
            os.unlink(os.path.join(dest, STATE_DIR, name))


def _run_writers(
    dest: str,
    pack_id: bytes,
    root: bytes,
    plan: list[list[_Source]],
    todo: list[int],
    compress: str,
    align: FileAlign,
    jobs: int,
    progress: bool | None,
    results: dict[int, _ShardResult],
) -> None:
    total_bytes = sum(f.size for i in todo for f in plan[i])
    total_files = sum(len(plan[i]) for i in todo)
    bar = tqdm(total=total_bytes, unit="B", unit_scale=True, unit_divisor=1024,
               desc="packing", disable=None if progress is None else not progress,
               dynamic_ncols=True)
    done_files = done_bytes = 0
    # The bar moves as files are written, not only as whole shards end: a pack of many tiny
    # files makes few shards (ImageNet's 1.28 M files at 16-200 bytes: 3), and the bar sat
    # at 0% for 2 of the 3 minutes. Here, file by file; from the worker processes, by the
    # bytes their shards (.partial) hold so far, looked at twice a second.
    sizes = {i: sum(f.size for f in plan[i]) for i in todo}
    try:
        if jobs == 1 or len(todo) <= 1:
            for i in todo:
                results[i] = _write_shard(dest, i, pack_id, root, plan[i], compress, align,
                                          on_file=bar.update)
                done_files += len(plan[i])
                bar.set_postfix_str(f"{done_files}/{total_files} files")
            return
        with worker_pool(jobs) as pool:  # no worker outlives a killed pack
            futures = {pool.submit(_write_shard, dest, i, pack_id, root, plan[i], compress,
                                   align): i for i in todo}
            try:
                waiting = set(futures)
                while waiting:
                    ended, waiting = cf.wait(waiting, timeout=0.5,
                                             return_when=cf.FIRST_COMPLETED)
                    for fut in ended:
                        i = futures[fut]
                        results[i] = fut.result()
                        done_files += len(plan[i])
                        done_bytes += sizes[i]
                    if not bar.disable:
                        bar.n = done_bytes + sum(_written(dest, futures[f], sizes[futures[f]])
                                                 for f in waiting if not f.cancelled()
                                                 and (f.running() or f.done()))
                        bar.set_postfix_str(f"{done_files}/{total_files} files")
            except BaseException:
                for fut in futures:
                    fut.cancel()
                raise
    finally:
        bar.close()


def _write_manifest(
    dest: str,
    pack_id: bytes,
    scan: _Scan,
    plan: list[list[_Source]],
    results: dict[int, _ShardResult],
    options: dict[str, Any],
    align: FileAlign,
) -> PackReport:
    builder = ManifestBuilder(pack_id)
    report = PackReport(dest)
    for e in scan.entries:
        builder.add(e)
        report.directories += e.kind == KIND_DIR
        report.symlinks += e.kind == KIND_SYMLINK
    for i, files in enumerate(plan):
        res = results[i]
        builder.shards.append(ShardInfo(shard_name(i), res.size))
        report.padding_bytes += res.size - SHARD_HEADER.size - sum(r[1] for r in res.records)
        for f, (offset, stored, codec, digest, pieces) in zip(files, res.records, strict=True):
            builder.add(Entry(f.rel, KIND_FILE, f.mode, f.mtime_ns, f.size, i, offset, stored,
                              codec, digest, pieces=pieces))
            report.files += 1
            report.raw_bytes += f.size
            report.stored_bytes += stored
            report.raw_over_max += f.size > _STREAM_ABOVE and options["compress"] == "zstd"
    builder.meta["options"] = {k: v for k, v in options.items() if k != "source"}
    builder.meta["source"] = options["source"]
    if align.to > 1:
        builder.meta["align"] = {"to": align.to, "min_size": align.min_size}
    builder.write(os.path.join(dest, MANIFEST_NAME))
    report.directories -= 1  # the root
    report.shards = len(plan)
    return report


# ---------------------------------------------------------------------------------- unpack
#
# A pack is input from outside: a crafted manifest must not make unpack write, chmod or link
# anything outside DEST. So every name is checked (no "/", "..", ".", NUL or empty part, a
# path that is its directory's path plus one name), every directory is one this unpack made,
# and everything is created relative to the file descriptor of its directory, opened one
# name at a time with O_NOFOLLOW: no symlink is ever followed, whoever wrote it. Creation is
# exclusive (O_EXCL, mkdir, symlink), so a repeated path fails instead of reusing what is
# there. Set-user-id, set-group-id and sticky bits are never restored.

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


def unpack(
    pack_dir: PathArg, dest: PathArg, *, progress: bool | None = None
) -> int:
    """Restore the tree of a pack at ``dest`` byte for byte, with modes and mtimes.

    ``dest`` must be missing or an empty directory. Every file is verified against its
    checksum. A pack whose manifest names a path that would leave ``dest`` is refused with a
    CorruptManifestError naming the entry; what was written before stays inside ``dest``.
    Returns the number of files written.
    """
    from stagefs.store import open as open_store

    dest_s = absolute(dest)
    if os.path.lexists(dest_s) and not os.path.isdir(dest_s):
        raise DestinationExistsError(f"{dest_s} is not a directory; unpack into a new directory")
    if os.path.exists(os.path.join(dest_s, MANIFEST_NAME)):  # the arguments swapped
        raise DestinationExistsError(f"{dest_s} is a pack (it holds {MANIFEST_NAME}): the "
                                     "pack comes first, then DEST: stagefs unpack PACK DEST")
    if os.path.isdir(dest_s) and os.listdir(dest_s):
        raise DestinationExistsError(f"{dest_s} is not empty; unpack into a new directory")
    then = (f"Unpack writes into an empty directory only: remove {dest_s} (it holds part "
            "of the tree) before running the command again.")
    with open_store(pack_dir) as store, _room_in(dest_s, lambda: then):
        # (a pack that cannot be opened leaves no DEST behind)
        os.makedirs(dest_s, exist_ok=True)
        m = store.manifest
        total = int(m.arrays["size"][m.arrays["kind"] == KIND_FILE].sum())
        bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc="unpacking",
                   disable=None if progress is None else not progress)
        root = os.open(dest_s, _DIR_FLAGS & ~os.O_NOFOLLOW)  # DEST itself is the caller's
        try:
            with bar:
                return _Unpacker(store, root, dest_s, bar.update).run()
        finally:
            os.close(root)


class _Unpacker:
    def __init__(self, store: Any, root: int, dest: str, done: Callable[[int], object]) -> None:
        self.store, self.m, self.root, self.dest, self.done = store, store.manifest, root, dest, done
        self.dirs: dict[int, list[bytes]] = {0: []}  # directories made: entry -> path parts
        self._open: tuple[int, int] | None = None  # (directory entry, its fd), the last used

    def run(self) -> int:
        m, n = self.m, 0
        if len(m) == 0 or m.kind[0] != KIND_DIR or m.path_of(0) != b"":
            raise CorruptManifestError(f"{m.path}: entry 0 is not the root directory; the "
                                       "pack is corrupt, refusing to unpack it")
        try:
            for e in range(1, len(m)):
                n += self._entry(e)
            for e in reversed(self.dirs):  # children first: they change their directory's mtime
                fd = self._walk(self.dirs[e]) if e else os.dup(self.root)
                try:
                    self._finish(e, fd)
                finally:
                    os.close(fd)
        finally:
            if self._open is not None:
                os.close(self._open[1])
        return n

    def _entry(self, e: int) -> int:
        m = self.m
        parts = self._check(e)
        fd, name = self._parent_fd(e), parts[-1]
        try:
            kind = m.kind[e]
            if kind == KIND_DIR:
                os.mkdir(name, 0o700, dir_fd=fd)
                self.dirs[e] = parts
            elif kind == KIND_SYMLINK:
                os.symlink(m.link_target(e), name, dir_fd=fd)
                ns = m.mtime_ns[e]
                os.utime(name, ns=(ns, ns), dir_fd=fd, follow_symlinks=False)
            elif kind == KIND_FILE:
                self._file(e, fd, name)
                return 1
            else:
                raise self._unsafe(e, f"has an unknown kind {kind}")
        except FileExistsError:
            raise self._unsafe(e, "repeats a path already unpacked") from None
        except ValueError as exc:  # a NUL in a symlink's target
            raise self._unsafe(e, f"cannot be created ({exc})") from None
        return 0

    def _check(self, e: int) -> list[bytes]:
        """The path of ``e`` as parts, checked to be its directory's path plus one name."""
        m = self.m
        path: bytes = m.path_of(e)
        if path.startswith(b"/"):
            raise self._unsafe(e, "is an absolute path")
        if b"\0" in path:
            raise self._unsafe(e, "holds a NUL byte")
        parts = path.split(b"/")
        if any(p in (b"", b".", b"..") for p in parts):
            raise self._unsafe(e, "has an empty, '.' or '..' part")
        parent = int(m.parent[e])
        if self.dirs.get(parent) != parts[:-1]:
            raise self._unsafe(e, "is not inside a directory unpacked before it (its "
                               "directory is missing, is not a directory, or is a symlink)")
        return parts

    def _parent_fd(self, e: int) -> int:
        parent = int(self.m.parent[e])
        if parent == 0:
            return self.root
        if self._open is not None and self._open[0] == parent:
            return self._open[1]
        fd = self._walk(self.dirs[parent])
        if self._open is not None:
            os.close(self._open[1])
        self._open = (parent, fd)
        return fd

    def _walk(self, parts: list[bytes]) -> int:
        """Open the directory DEST/parts one name at a time, never through a symlink."""
        fd = os.dup(self.root)
        for name in parts:
            try:
                nfd = os.open(name, _DIR_FLAGS, dir_fd=fd)
            except OSError as exc:  # ELOOP/ENOTDIR: replaced by a symlink under our feet
                os.close(fd)
                raise CorruptManifestError(
                    f"{os.path.join(self.dest, os.fsdecode(b'/'.join(parts)))}: cannot open "
                    f"the directory unpack made ({exc.strerror}); something changed DEST "
                    "during the unpack. Unpack into a directory no other process writes to."
                ) from exc
            os.close(fd)
            fd = nfd
        return fd

    def _file(self, e: int, dir_fd: int, name: bytes) -> None:
        data = self.store.read_entry(e)
        fd = os.open(name, _FILE_FLAGS, 0o600, dir_fd=dir_fd)
        try:
            with os.fdopen(os.dup(fd), "wb") as out:
                out.write(data)
            self._finish(e, fd)
        finally:
            os.close(fd)
        self.done(len(data))

    def _finish(self, e: int, fd: int) -> None:
        """Mode (less set-id and sticky bits) and mtime of entry ``e``, through its fd."""
        os.fchmod(fd, st.S_IMODE(self.m.mode[e]) & 0o777)
        ns = self.m.mtime_ns[e]
        os.utime(fd, ns=(ns, ns))

    def _unsafe(self, e: int, why: str) -> CorruptManifestError:
        path = os.fsdecode(self.m.path_of(e))
        return CorruptManifestError(
            f"{self.m.path}: entry {path!r} {why}: the pack is corrupt or crafted to write "
            f"outside {self.dest}; refusing to unpack it. Nothing was written outside "
            f"{self.dest}; remove what was unpacked there."
        )


def describe(report: PackReport) -> str:
    ratio = report.raw_bytes / report.stored_bytes if report.stored_bytes else 1.0
    return (
        f"packed {report.files} files, {report.directories} directories, {report.symlinks} "
        f"symlinks: {format_size(report.raw_bytes)} raw, {format_size(report.stored_bytes)} "
        f"stored (x{ratio:.2f}) in {report.shards} shards"
        + (f", {format_size(report.padding_bytes)} of alignment padding"
           if report.padding_bytes else "")
        + (f" ({report.reused_shards} reused)" if report.reused_shards else "")
    )

