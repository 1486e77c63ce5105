"""The FUSE server's operations (posix/fuse.py), called as libfuse calls them, without a
mount: the errno each error is answered with, what is logged, and how a file the kernel
reads in several requests at once is read and counted."""

from __future__ import annotations

import errno
import logging
import os
import random
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import stagefs
from stagefs import errors
from stagefs.errors import ConfigError
from stagefs.format import MANIFEST_NAME, Manifest

MiB = 2**20


def _ops(store: Any, mp: str = "/mnt/ds") -> Any:
    from stagefs.posix import fuse

    try:
        fuse._binding()
    except ConfigError as exc:
        pytest.skip(str(exc))
    return fuse._operations(store, mp)


@pytest.fixture(scope="module")
def pack(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, bytes]]:
    """Three shards of 1 MiB: a.bin, b.bin (small, shard 0), big.bin (5 MiB, read by range,
    shard 1), mid.bin (2 MiB, read whole, shard 2), c.bin (shard 3)."""
    base = tmp_path_factory.mktemp("ops")
    rng = random.Random(1)
    files = {"d/a.bin": rng.randbytes(300_000), "d/b.bin": rng.randbytes(200_000),
             "d/big.bin": rng.randbytes(5 * MiB + 7), "d/mid.bin": rng.randbytes(2 * MiB - 1),
             "e/c.bin": rng.randbytes(100_000)}
    for rel, data in files.items():
        (base / "raw" / rel).parent.mkdir(parents=True, exist_ok=True)
        (base / "raw" / rel).write_bytes(data)
    stagefs.pack(base / "raw", base / "pack", shard_size="1MiB", jobs=1, progress=False,
                 echo=lambda _m: None)
    return base / "pack", files


def _shard_of(pack: Path, rel: str) -> Path:
    m = Manifest(str(pack / MANIFEST_NAME))
    try:
        return pack / m.shards[int(m.shard[m.lookup(rel.encode())])].name
    finally:
        m.close()


def _read(ops: Any, rel: str, size: int) -> bytes:
    out = b""
    while len(out) < size:
        got = ops.read("/" + rel, MiB, len(out), 0)
        if not got:
            break
        out += got
    return out


# -- errors ---------------------------------------------------------------------------------


def _damaged(pack: Path, tmp_path: Path, how: str) -> Path:
    """A copy of ``pack`` whose shard holding big.bin (and so only it) is damaged."""
    copy = tmp_path / "copy"
    shutil.copytree(pack, copy)
    shard = _shard_of(copy, "d/big.bin")
    other = _shard_of(copy, "d/a.bin")
    if how == "truncated":
        os.truncate(shard, os.path.getsize(shard) // 2)
    elif how == "another shard":
        shutil.copyfile(other, shard)
    else:
        shard.unlink()
    return copy


@pytest.mark.parametrize("how", ["truncated", "another shard", "missing"])
def test_a_damaged_shard_fails_reads_with_eio_told_once_without_a_traceback(
        pack: tuple[Path, dict[str, bytes]], tmp_path: Path, how: str,
        caplog: pytest.LogCaptureFixture) -> None:
    """EIO, as `stagefs run` answers: not the binding's EINVAL for a FormatError, not
    ENOENT for a missing shard file (the file is in the dataset). The reason is the
    error's own message, logged once for the shard, on one line."""
    copy = _damaged(pack[0], tmp_path, how)
    shard = _shard_of(copy, "d/big.bin").name
    caplog.set_level(logging.DEBUG, logger="stagefs.fuse")
    with stagefs.open(copy) as store:
        ops = _ops(store)
        for offset in (4 * MiB, 3 * MiB, 4 * MiB):  # past a half of the file
            with pytest.raises(OSError) as err:
                ops.read("/d/big.bin", MiB, offset, 0)
            assert err.value.errno == errno.EIO
        assert _read(ops, "d/a.bin", 300_000) == pack[1]["d/a.bin"]  # other shards read
    told = [r for r in caplog.records if r.name == "stagefs.fuse"
            and r.levelno >= logging.WARNING]
    assert len(told) == 1, [r.getMessage() for r in told]
    msg = told[0].getMessage()
    assert f"reads from {shard} fail with EIO" in msg and "/mnt/ds/d/big.bin" in msg
    assert str(copy / shard) in msg and "\n" not in msg and told[0].exc_info is None
    assert "[Errno" not in msg
    if how == "truncated":
        assert "truncated or overwritten; copy the pack again or re-pack" in msg
    elif how == "missing":
        assert "missing from the pack; re-pack" in msg


def _instance(cls: type[BaseException]) -> BaseException:
    args: dict[type[BaseException], tuple[str, ...]] = {
        errors.ChecksumError: ("d/mid.bin", "shard x"),
        errors.OriginUnavailableError: ("/origin", "shard x", "gone"),
    }
    if issubclass(cls, errors.PathError):
        return cls("/pack/shard-000002.sfs")
    return cls(*args.get(cls, ("something is wrong",)))


_ERRORS = [getattr(errors, n) for n in errors.__all__]


@pytest.mark.parametrize("cls", _ERRORS, ids=[c.__name__ for c in _ERRORS])
def test_every_stagefs_error_from_a_read_is_eio(
        pack: tuple[Path, dict[str, bytes]], cls: type[BaseException],
        monkeypatch: pytest.MonkeyPatch) -> None:
    with stagefs.open(pack[0]) as store:
        ops = _ops(store)

        def fail(*_a: Any, **_k: Any) -> bytes:
            raise _instance(cls)

        monkeypatch.setattr(store, "read_entry", fail)
        for rel in ("d/mid.bin", "d/big.bin"):  # read whole, and by range
            with pytest.raises(OSError) as err:
                ops.read("/" + rel, MiB, 0, 0)
            assert err.value.errno == errno.EIO, rel


def test_names_get_their_own_errno_and_other_errors_eio(
        pack: tuple[Path, dict[str, bytes]], monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """A name not in the dataset is ENOENT, silently (ordinary traffic); an error that is
    not a name's (a bug here: a ValueError) is EIO, with one line saying where it was
    raised, in a listing as it is read too."""
    with stagefs.open(pack[0]) as store:
        ops = _ops(store)
        for call in (lambda: ops.getattr("/d/nope"), lambda: ops.read("/d/nope", 10, 0, 0),
                     lambda: ops.access("/nope", os.R_OK), lambda: list(ops.readdir("/x", 0))):
            with pytest.raises(OSError) as err:
                call()
            assert err.value.errno == errno.ENOENT
        with pytest.raises(OSError) as err:
            list(ops.readdir("/d/a.bin", 0))
        assert err.value.errno == errno.ENOTDIR
        assert not caplog.records

        def broken(*_a: Any) -> Any:
            raise ValueError("boom")

        monkeypatch.setattr(store.namespace, "lstat", broken)
        monkeypatch.setattr(store.namespace, "stat_entry", broken)
        for _ in range(2):
            with pytest.raises(OSError) as err:
                ops.getattr("/d/a.bin")
            assert err.value.errno == errno.EIO
        items: Iterator[Any] = ops.readdir_plus("/d", 0)
        with pytest.raises(OSError) as err:
            list(items)
        assert err.value.errno == errno.EIO
    told = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert [r.levelno for r in told] == [logging.ERROR, logging.ERROR]  # once per operation
    msg = told[0].getMessage()
    assert "getattr of /mnt/ds/d/a.bin failed with EIO: ValueError: boom at " in msg
    assert "a bug in stagefs" in msg and told[0].exc_info is None


# -- a file read whole, asked for in several READs ------------------------------------------


class _Gated:
    """``store.read_entry`` that waits until let go, counting its calls."""

    def __init__(self, store: Any) -> None:
        self.read_entry, self.calls = store.read_entry, 0
        self.started, self.go = threading.Event(), threading.Event()

    def __call__(self, *a: Any, **k: Any) -> bytes:
        self.calls += 1
        self.started.set()
        assert self.go.wait(10)
        return self.read_entry(*a, **k)  # type: ignore[no-any-return]


def test_concurrent_reads_of_a_file_read_whole_read_and_count_it_once(
        pack: tuple[Path, dict[str, bytes]], monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel asks for a 2 MiB file's second MiB before the first is answered (its
    read-ahead): one read of the file, one sample of its size (it was two, and twice its
    bytes), whichever READ came first."""
    data = pack[1]["d/mid.bin"]
    for first, second in ((0, MiB), (MiB, 0)):
        with stagefs.open(pack[0]) as store:
            ops = _ops(store)
            gated = _Gated(store)
            monkeypatch.setattr(store, "read_entry", gated)
            got: dict[int, bytes] = {}

            def read(offset: int, ops: Any = ops, got: dict[int, bytes] = got) -> None:
                got[offset] = ops.read("/d/mid.bin", MiB, offset, 0)

            threads = [threading.Thread(target=read, args=(first,))]
            threads[0].start()
            assert gated.started.wait(10)
            threads.append(threading.Thread(target=read, args=(second,)))
            threads[1].start()
            time.sleep(0.2)  # the second READ waits for the first's read
            gated.go.set()
            for t in threads:
                t.join(10)
            assert got[0] + got[MiB] == data
            assert gated.calls == 1
            assert (store.stats.reads, store.stats.bytes) == (1, len(data))


def test_a_read_from_the_start_after_the_file_was_read_is_the_same_read(
        pack: tuple[Path, dict[str, bytes]]) -> None:
    """A READ further on read the file, and the READ from its start comes after (the
    kernel's requests are served in any order): one sample. A later READ from the start
    of the file still kept is a new one (the program's next epoch), from memory."""
    data = pack[1]["d/mid.bin"]
    with stagefs.open(pack[0]) as store:
        ops = _ops(store)
        assert ops.read("/d/mid.bin", MiB, MiB, 0) == data[MiB:]
        assert ops.read("/d/mid.bin", MiB, 0, 0) == data[:MiB]
        assert (store.stats.reads, store.stats.bytes) == (1, len(data))
        assert _read(ops, "d/mid.bin", len(data)) == data
        assert (store.stats.reads, store.stats.bytes) == (2, 2 * len(data))


def test_a_failed_read_fails_every_waiting_read_and_the_next_one_tries_again(
        pack: tuple[Path, dict[str, bytes]], monkeypatch: pytest.MonkeyPatch) -> None:
    data = pack[1]["d/mid.bin"]
    with stagefs.open(pack[0]) as store:
        ops = _ops(store)
        real = store.read_entry
        gate = threading.Event()

        def failing(*_a: Any, **_k: Any) -> bytes:
            assert gate.wait(10)
            raise errors.CorruptShardError("bad")

        monkeypatch.setattr(store, "read_entry", failing)
        codes: list[int | None] = []

        def read(offset: int) -> None:
            try:
                ops.read("/d/mid.bin", MiB, offset, 0)
            except OSError as exc:
                codes.append(exc.errno)

        threads = [threading.Thread(target=read, args=(o,)) for o in (0, MiB)]
        for t in threads:
            t.start()
        time.sleep(0.2)
        gate.set()
        for t in threads:
            t.join(10)
        assert codes == [errno.EIO, errno.EIO]
        monkeypatch.setattr(store, "read_entry", real)
        assert _read(ops, "d/mid.bin", len(data)) == data
