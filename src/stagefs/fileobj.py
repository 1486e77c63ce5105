"""Read-only file objects over stagefs entries.

A small file (or any compressed one) is read whole and verified when opened, and served as
an in-memory buffer. A large raw file is read by range on demand through a buffered reader:
each read asks the Store for the pieces that cover it, verified against their checksums
(docs/decisions/0002-large-file-reads.md), and never returns a byte that was not verified.
"""

from __future__ import annotations

import io
from typing import TYPE_CHECKING, Any

from stagefs.errors import ReadOnlyError

if TYPE_CHECKING:
    from stagefs.store import Store

__all__ = ["WHOLE_READ_LIMIT", "open_entry"]

WHOLE_READ_LIMIT = 4 * 2**20


class _Base:
    name: str
    mode: str

    def fileno(self) -> int:
        raise io.UnsupportedOperation("stagefs files have no file descriptor")

    def isatty(self) -> bool:
        return False


class SmallFile(_Base, io.BytesIO):
    """A verified in-memory copy of one file, with the file's name and mode."""

    def __init__(self, data: bytes, name: str) -> None:
        io.BytesIO.__init__(self, data)
        self.name, self.mode = name, "rb"

    def writable(self) -> bool:
        return False

    def peek(self, size: int = 0) -> bytes:
        """What the next read returns, without moving: as a large file (a BufferedReader)
        and a builtin binary file have it, so that code that peeks (a format sniffer,
        pickle) takes any stagefs file."""
        if self.closed:
            raise ValueError("peek of closed file")
        pos = self.tell()
        with self.getbuffer() as view:  # released at once: a held export blocks close()
            return view[pos : pos + max(size, io.DEFAULT_BUFFER_SIZE)].tobytes()

    def write(self, data: Any) -> int:
        raise ReadOnlyError(self.name)

    def writelines(self, lines: Any) -> None:
        raise ReadOnlyError(self.name)

    def truncate(self, size: int | None = None) -> int:
        raise ReadOnlyError(self.name)

    def __repr__(self) -> str:
        return f"<stagefs file {self.name!r} mode='rb'>"


class _RangeRaw(io.RawIOBase):
    """Raw reads of one large uncompressed file by range. Each read asks the Store for
    whole pieces (verified), from the one its position is in, as many as its buffer holds:
    a read that does not start on a piece boundary ends on one (short, as raw reads may be;
    the buffered reader above asks again for the rest). So a buffer fill (1 MiB, the piece
    size) reads the one piece that holds what was asked, not the two it straddles, and a
    large read no more pieces than it covers. The piece that holds the read's end is kept
    (``_span``), so a sequential reader reads and verifies each piece once; never more
    than a piece of it, so a large read is not held in memory twice until the file
    closes."""

    def __init__(self, store: Store, e: int, name: str, per_open: bool = True) -> None:
        m = store.manifest
        self._store, self._e, self.name, self.mode = store, e, name, "rb"
        # one sample for the file object's reads (a FUSE server's reader, kept for many
        # opens it cannot see: a sample per read from the start of the file)
        self._sample: int | None = 1 if per_open else None
        self._size, self._piece = m.size[e], m.piece_size
        self._pos = 0
        self._span_at, self._span = 0, b""  # the last verified span read, and where it starts

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        self._checkClosed()  # type: ignore[attr-defined]  # as a closed BytesIO: ValueError
        return self._pos

    def seek(self, pos: int, whence: int = 0) -> int:
        # as io.BytesIO (the small files' class), so both kinds of file behave the same
        self._checkClosed()  # type: ignore[attr-defined]
        if whence not in (0, 1, 2):
            raise ValueError(f"invalid whence ({whence}, should be 0, 1 or 2)")
        if whence == 0 and pos < 0:
            raise ValueError(f"negative seek value {pos}")
        self._pos = max(0, (0, self._pos, self._size)[whence] + pos)
        return self._pos

    def readinto(self, buf: Any) -> int:
        n = max(0, min(len(buf), self._size - self._pos))
        if n == 0:
            return 0
        pos, p = self._pos, self._piece
        rel = pos - self._span_at
        if not 0 <= rel < len(self._span):
            lo = pos - pos % p
            hi = min(self._size, lo + -(-n // p) * p)  # whole pieces, as many as buf holds
            self._span = self._store.read_entry(self._e, self.name, lo, hi - lo,
                                                sample=self._next_sample())
            self._span_at, rel = lo, pos - lo
        span = self._span
        n = min(n, len(span) - rel)  # the rest comes with the next call
        memoryview(buf)[:n] = memoryview(span)[rel : rel + n]
        self._pos = end = pos + n
        if len(span) > p:  # keep the piece the next read starts in, not the whole read
            keep = max(end - end % p, self._span_at)
            self._span = span[keep - self._span_at :]
            self._span_at = keep
        return n

    def readall(self) -> bytes:
        data = self._store.read_entry(self._e, self.name, self._pos, -1,
                                      sample=self._next_sample())
        self._pos += len(data)
        return data

    def _next_sample(self) -> int | None:
        """The samples the next read counts: 1 for a file object's first, then 0."""
        n = self._sample
        if n:
            self._sample = 0
        return n


class LargeFile(_Base, io.BufferedReader):
    """Buffered range reads; ``name`` and ``mode`` come from the raw reader."""

    def __init__(self, raw: _RangeRaw, buffering: int) -> None:
        io.BufferedReader.__init__(self, raw, buffering if buffering > 1 else 1 << 20)

    def read(self, size: int | None = -1) -> bytes:
        # as io.BytesIO (unlike io.BufferedReader): any negative size reads to the end
        return io.BufferedReader.read(self, -1 if size is None or size < 0 else size)

    def readlines(self, hint: int | None = -1) -> list[bytes]:
        # as io.BytesIO: stop once the lines reach ``hint`` bytes (io.IOBase waits to pass it)
        lines, total = [], 0
        for line in self:
            lines.append(line)
            total += len(line)
            if hint is not None and 0 < hint <= total:
                break
        return lines

    def __repr__(self) -> str:
        return f"<stagefs file {self.name!r} mode='rb'>"


def open_entry(store: Store, e: int, name: str, mode: str, buffering: int, *,
               per_open: bool = True, encoding: str | None = None, errors: str | None = None,
               newline: str | None = None) -> Any:
    """A file object of entry ``e``: one sample whatever it reads (``per_open``), or, for
    a reader kept across opens it cannot see (a FUSE server's), one for each read from the
    start of the file. In text mode, ``encoding`` (UTF-8 by default: a dataset's text does
    not change with the reader's locale), ``errors`` and ``newline`` as ``open`` takes them."""
    m = store.manifest
    if m.codec[e] or m.size[e] <= WHOLE_READ_LIMIT:
        f: Any = SmallFile(store.read_entry(e, name), name)
    else:
        f = LargeFile(_RangeRaw(store, e, name, per_open), buffering)
    if "b" not in mode:
        t = io.TextIOWrapper(f, encoding or "utf-8", errors, newline)
        t.mode = "r"  # type: ignore[misc]  # as the builtin open's text files say
        return t
    return f
