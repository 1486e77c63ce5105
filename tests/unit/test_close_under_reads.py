"""A Store closed while another thread is in the middle of reading it: the reader gets the
closed Store's error (open the dataset again), not a KeyError, a released memoryview or a
reader pool shut down, whatever close() let go of first."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

import stagefs
from conftest import pack_files, random_bytes

FILES = {f"d{i % 3}/f{i:03d}.bin": random_bytes(3000 + 97 * i, seed=i) for i in range(40)}


@pytest.fixture(scope="module")
def pack(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return pack_files(tmp_path_factory.mktemp("close"), "src", FILES)


def _closing_origin(fs: stagefs.Store) -> None:
    """The origin's next read closes the store first (another thread's close, landing in the
    middle of this read), then returns the right bytes."""
    real = fs.origin.pread

    def pread(shard: int, offset: int, length: int) -> Any:
        fs.close()
        return real(shard, offset, length)

    fs.origin.pread = pread


def test_a_read_under_way_when_the_store_closes_says_it_is_closed(pack: Path) -> None:
    fs = stagefs.open(pack)
    _closing_origin(fs)
    with pytest.raises(ValueError, match=r"closed Store .* open the dataset again"):
        fs.read("d1/f001.bin")


def test_a_walk_under_way_when_the_store_closes_says_it_is_closed(pack: Path) -> None:
    fs = stagefs.open(pack)
    walk = fs.walk("")
    next(walk)
    fs.close()
    with pytest.raises(ValueError, match=r"closed Store .* open the dataset again"):
        list(walk)


def test_errors_of_an_open_store_are_its_own(pack: Path) -> None:
    with stagefs.open(pack) as fs:
        with pytest.raises(FileNotFoundError):
            fs.read("d1/nothing.bin")
        assert fs.read_many(["d0/f000.bin", "d2/f002.bin"]) == [FILES["d0/f000.bin"],
                                                                FILES["d2/f002.bin"]]
        assert [d for d, _, _ in fs.walk("")] == ["", "d0", "d1", "d2"]


class _Closing:
    """A holder whose read lands as another thread closes the store, and whose bytes are then
    wrong (what a read of a descriptor close() let go of, and the system gave to another
    file, returns): it must not be told to drop its copy, which was good."""

    name = "memory tier"
    holder = "memory"

    def __init__(self, store: list[stagefs.Store]) -> None:
        self.store, self.dropped = store, 0

    def pread(self, shard: int, offset: int, length: int) -> bytes:
        self.store[0].close()
        return b"\0" * length

    def drop(self, shard: int) -> None:
        self.dropped += 1


def test_bad_bytes_of_a_read_cut_by_close_drop_no_copy(pack: Path) -> None:
    box: list[stagefs.Store] = []
    tier = _Closing(box)
    fs = stagefs.Store(str(pack), sources=lambda shard: [tier])
    box.append(fs)
    with pytest.raises(ValueError, match="closed Store"):
        fs.read("d1/f001.bin")
    assert tier.dropped == 0


def test_a_closed_store_is_not_pickled_to_be_reopened(pack: Path) -> None:
    """A spawned DataLoader worker gets the dataset pickled: a closed Store's copy reopened
    the pack there and read on, where a forked worker, and the Store itself, said it was
    closed. It says so when pickled, as a closed file does."""
    fs = stagefs.open(pack)
    assert pickle.loads(pickle.dumps(fs)).read("d0/f000.bin") == FILES["d0/f000.bin"]
    fs.close()
    with pytest.raises(ValueError, match=r"closed Store .* open the dataset again"):
        pickle.dumps(fs)


def test_a_read_under_way_keeps_the_tier_copy_open_until_it_is_done(
        pack: Path, tmp_path: Path) -> None:
    """A reader reading a piece of the origin itself into the tier's partial copy when
    another thread closes the Store: close() let go of the copy's descriptor at once, the
    program opened files meanwhile, one took its number, and the read wrote the shard's
    bytes into that file. The copy is let go of once the read is done; the files opened
    meanwhile get nothing."""
    fs = stagefs.open(pack, tiers=[str(tmp_path / "tier")], runtime=str(tmp_path / "rt"))
    assert fs.chain is not None
    ctl = fs.chain.stream.controller
    ctl.most = ctl.target = 0  # no stream: the reader reads its pieces itself
    entered, go = threading.Event(), threading.Event()
    origin = fs.chain.origin
    for name in ("pread", "pread_through"):
        real = getattr(origin, name)

        def held(shard: int, offset: int, length: int, real: Any = real, **kw: Any) -> Any:
            if threading.current_thread().name == "reader":
                entered.set()
                go.wait(30)
            return real(shard, offset, length, **kw)

        setattr(origin, name, held)
    errors: list[BaseException] = []

    def read() -> None:
        try:
            fs.read("d1/f007.bin")
        except BaseException as exc:
            errors.append(exc)

    reader = threading.Thread(target=read, name="reader")
    reader.start()
    assert entered.wait(30)
    fs.close()
    opened = [os.open(tmp_path / f"other{i}", os.O_RDWR | os.O_CREAT, 0o600) for i in range(40)]
    try:
        go.set()
        reader.join(30)
        assert not reader.is_alive()
        assert [os.fstat(fd).st_size for fd in opened] == [0] * 40
    finally:
        for fd in opened:
            os.close(fd)
    assert len(errors) == 1 and "closed Store" in str(errors[0])
    # let go of once the read was done: no descriptor of the tier is left open
    assert not [fd for fd in os.listdir("/proc/self/fd")
                if str(tmp_path / "tier") in _target(fd)]


def _target(fd: str) -> str:
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return ""


def test_a_partial_copy_closed_under_a_writer_is_let_go_of_after_it(
        pack: Path, tmp_path: Path) -> None:
    """A stream thread still writing a partial copy when the tiers close (its join timed
    out): the copy's descriptor stays that copy's until the write is done; a write after
    the close is refused, not made through a number another file took."""
    with stagefs.open(pack, tiers=[str(tmp_path / "tier")],
                      runtime=str(tmp_path / "rt")) as fs:
        assert fs.chain is not None
        ctl = fs.chain.stream.controller
        ctl.most = ctl.target = 0
        assert fs.read("d1/f007.bin") == FILES["d1/f007.bin"]  # read into a partial copy
        [(fill, _)] = next(iter(fs.chain._fills.values()))
        with fill.descriptor() as fd:
            inode = os.fstat(fd).st_ino
            fill.close()
            other = os.open(tmp_path / "other", os.O_RDWR | os.O_CREAT, 0o600)
            assert other != fd and os.fstat(fd).st_ino == inode
        with pytest.raises(OSError):
            os.fstat(fd)  # let go of as the writer left
        with pytest.raises(ValueError, match="closed"):
            fill.put(4096, b"x" * 10)
        assert os.fstat(other).st_size == 0
        os.close(other)


@pytest.mark.parametrize("ask", ["is_file", "is_dir", "is_symlink", "stat"])
def test_a_listing_kept_past_the_close_says_the_store_is_closed(pack: Path, ask: str) -> None:
    """Entries of a scandir kept past the ``with`` (listed first, looked at after): each
    said "operation forbidden on released memoryview object", not that the Store was
    closed."""
    with stagefs.open(pack) as fs:
        entries = list(fs.scandir("d1"))
    with pytest.raises(ValueError, match=r"closed Store .* open the dataset again"):
        getattr(entries[0], ask)()
    assert entries[0].name == "f001.bin"  # what the entry itself holds still answers



_ASKS = [("stat", "d1/f001.bin"), ("stat", "d1"), ("lstat", "d1/f001.bin"),
         ("exists", "d1/f001.bin"), ("isdir", "d1"), ("isfile", "d1/f001.bin"),
         ("islink", "d1/f001.bin"), ("getsize", "d1/f001.bin"), ("listdir", "d1")]


@pytest.mark.parametrize("speedups", ["1", "0"])
@pytest.mark.parametrize(("ask", "path"), _ASKS)
def test_a_question_asked_through_a_method_kept_past_the_close_says_the_store_is_closed(
    pack: Path, ask: str, path: str, speedups: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``stat = fs.stat`` taken before the close (as a thread still asking while close()
    runs has it): each said "operation forbidden on released memoryview object" or raised
    KeyError('path_off'), not that the Store was closed; the C index's and the Python
    paths alike."""
    monkeypatch.setenv("STAGEFS_SPEEDUPS", speedups)
    fs = stagefs.open(pack)
    method = getattr(fs, ask)
    method(path)  # answers while open
    fs.close()
    with pytest.raises(ValueError, match=r"closed Store .* open the dataset again"):
        method(path)


def test_the_checked_questions_keep_their_signatures(pack: Path) -> None:
    with stagefs.open(pack) as fs:
        assert sorted(fs.listdir()) == ["d0", "d1", "d2"]
        with pytest.raises(TypeError):
            fs.isfile()  # type: ignore[call-arg]

_AT_EXIT = r'''
import atexit, os, sys, threading
pack, tier, runtime, name, expected = sys.argv[1:6]
go, entered, result = threading.Event(), threading.Event(), []


def after() -> None:  # registered before stagefs is imported: runs after its exit hooks
    go.set()
    reader.join(30)
    left = [fd for fd in os.listdir("/proc/self/fd")
            if os.path.realpath(f"/proc/self/fd/{fd}").startswith(tier)]
    print("RESULT", result[0] if result else "none", "LEFT", len(left), flush=True)


atexit.register(after)
import stagefs
fs = stagefs.open(pack, tiers=[tier], runtime=runtime)
ctl = fs.chain.stream.controller
ctl.most = ctl.target = 0  # no stream: the reader reads its pieces itself
origin = fs.chain.origin
for way in ("pread", "pread_through"):
    def held(shard, offset, length, real=getattr(origin, way), **kw):
        if threading.current_thread().name == "reader":
            entered.set()
            go.wait(30)
        return real(shard, offset, length, **kw)
    setattr(origin, way, held)


def read() -> None:
    try:
        with open(expected, "rb") as f:
            result.append("bytes" if fs.read(name) == f.read() else "wrong bytes")
    except BaseException as exc:
        result.append(f"{type(exc).__name__}: {exc}")


reader = threading.Thread(target=read, name="reader", daemon=True)
reader.start()
entered.wait(30)
'''


def test_a_read_under_way_at_exit_keeps_the_tiers_until_it_is_done(
        pack: Path, tmp_path: Path) -> None:
    """A daemon thread inside a read as the program exits: the tiers' exit hook closed the
    chain under it, and the read failed on its partial copy let go of (a ValueError naming
    the copy, an IndexError of its arrays) or read through a descriptor another file had
    taken. The Store closes at exit as close() does: the read ends (its bytes, or the
    closed Store's error), then the tiers are let go of."""
    (tmp_path / "expected").write_bytes(FILES["d1/f007.bin"])
    tier = str(tmp_path / "tier")
    out = subprocess.run(
        [sys.executable, "-c", _AT_EXIT, str(pack), tier, str(tmp_path / "rt"), "d1/f007.bin",
         str(tmp_path / "expected")], capture_output=True, text=True, timeout=120,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    said = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT")]
    assert said, out.stderr
    got, left = said[0].removeprefix("RESULT ").rsplit(" LEFT ", 1)
    assert got == "bytes" or "closed Store" in got, got
    assert left == "0"  # let go of once the read was done


def test_status_after_the_close_is_the_runs_report(pack: Path, tmp_path: Path) -> None:
    """status() of a closed Store (the report printed after the ``with``) said every
    holder read nothing and the hit rate was 0.0: its counters were let go of with it."""
    fs = stagefs.open(pack, runtime=str(tmp_path / "rt"))
    for name in ("d0/f000.bin", "d1/f001.bin", "d2/f002.bin"):
        assert fs.read(name) == FILES[name]
    before = fs.status()
    assert before["holders"]["origin"]["reads"] == 3
    fs.close()
    after = fs.status()
    assert after["holders"] == before["holders"]
    assert after["hit_rate"] == before["hit_rate"]
    with pytest.raises(ValueError, match="closed Store"):
        fs.read("d0/f000.bin")
    assert fs.status()["holders"] == before["holders"]  # a refused read counts nothing
