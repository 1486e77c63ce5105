"""The checks every holder of shard bytes (a ``ShardSource``, tiers/base.py) must pass.

A holder answers ``pread(shard, offset, length)``. The Store verifies what it returns, so a
holder need not check bytes; but it must return exactly the bytes it stores for a range
inside a shard, refuse anything else with ``SourceUnavailable`` or a ``StagefsError`` (never
short, shifted or another shard's bytes, never a bare IndexError or OSError), keep
answering from many threads at once, and keep answering in a forked child (a DataLoader
worker) without being told about the fork.

To check a holder of your own, describe it with a ``HolderCase`` and run the checks::

    from stagefs.testing.holders import CHECKS, HolderCase, run_checks

    run_checks(MyCase())            # raises HolderCheckFailed naming the check and range

or one pytest test per check (pytest is not needed to import this module)::

    @pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__)
    def test_my_holder(check, my_case):
        check(my_case)

A check may change the holder's stored bytes (``check_corrupt_copy``): give each check a
new case.
"""

from __future__ import annotations

import os
import random
import select
import signal
import threading
import time
import warnings
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from stagefs.errors import StagefsError
from stagefs.format import KIND_FILE, Manifest
from stagefs.store import Store
from stagefs.tiers.base import ShardSource, SourceUnavailable

__all__ = [
    "CHECKS",
    "HolderCase",
    "HolderCheckFailed",
    "check_after_fork",
    "check_concurrent_readers",
    "check_corrupt_copy",
    "check_missing_shard",
    "check_out_of_bounds",
    "check_ranges",
    "run_checks",
]

FORK_DEADLINE_S = 120.0  # a child that has not answered by then is hung: the check fails


class HolderCheckFailed(AssertionError):
    """A holder did not behave as every holder must; the message names what and where."""


class HolderCase(ABC):
    """One holder under test and the dataset it serves.

    ``holder`` holds every shard of ``manifest`` except ``absent``. ``sums`` are the files'
    checksums where the manifest has none (an in-place dataset: a ``SumTable``), else None.
    """

    name: str
    manifest: Manifest
    holder: ShardSource
    absent: int
    sums: Any = None

    @abstractmethod
    def shard_bytes(self, shard: int) -> bytes:
        """The true bytes of ``shard``, from somewhere other than the holder."""

    @abstractmethod
    def corrupt(self, shard: int, offset: int, value: int) -> None:
        """Make the byte at ``offset`` of the copy of ``shard`` the holder serves ``value``."""

    def close(self) -> None:
        """Release what the case made (the holder included)."""
        self.holder.close()


# -- the checks ---------------------------------------------------------------------------------


def check_ranges(case: HolderCase) -> None:
    """Ranges at the start, middle and end of a shard, one byte, zero bytes, the whole."""
    for s in _sample_shards(case):
        true = case.shard_bytes(s)
        n = len(true)
        mid = n // 2
        for off, length in [(0, 1), (0, 64), (mid - 3, 7), (mid, 1), (n - 5, 5), (n - 1, 1),
                            (0, n), (0, 0), (mid, 0), (n, 0)]:
            _expect(case, s, off, length, true[off : off + length])


def check_out_of_bounds(case: HolderCase) -> None:
    """A range outside a shard, a negative one, an unknown shard: refused, never bytes."""
    s = _sample_shards(case)[0]
    n = len(case.shard_bytes(s))
    bad = [(s, n - 2, 3), (s, n, 1), (s, n + 100, 10), (s, -1, 2), (s, -10, 5), (s, 0, -1),
           (s, 3, -5), (len(case.manifest.shards), 0, 1), (-1, 0, 1), (-1, 64, 8)]
    for shard, off, length in bad:
        _refused(case, shard, off, length, "out of bounds")
    _expect(case, s, 0, n, case.shard_bytes(s))  # and it still serves good ranges


def check_missing_shard(case: HolderCase) -> None:
    """A shard the holder does not hold: a range of its files' bytes is refused, never
    answered (a header that a holder makes up, as the in-place origin does, may be)."""
    n = case.manifest.shards[case.absent].size
    for off, length in [(0, n), (n // 2, 16), (n - 1, 1)]:
        _refused(case, case.absent, off, length, "not held")


def check_corrupt_copy(case: HolderCase) -> None:
    """A corrupt stored copy: the holder returns the stored bytes (or refuses), the Store's
    verification catches them and reads the next holder, and a holder with ``drop`` no
    longer serves that shard once the Store dropped it."""
    m = case.manifest
    e = _corruptible_entry(case)
    s, start, stored = int(m.shard[e]), int(m.offset[e]), int(m.stored[e])
    true = case.shard_bytes(s)
    off = start + stored // 2
    case.corrupt(s, off, true[off] ^ 0xFF)
    lo, hi = max(start, off - 3), min(start + stored, off + 4)
    want = bytearray(true[lo:hi])
    want[off - lo] ^= 0xFF
    try:
        got = case.holder.pread(s, lo, hi - lo)
    except SourceUnavailable:
        got = None
    if got is not None and got != want:
        _fail(case, f"shard {s} [{lo}, {hi}) after corrupting byte {off}: returned {got!r}, "
                    f"the stored bytes are {bytes(want)!r}")
    reference = _Reference(case)
    # the Stores borrow the case's manifest and sums: closing them would close those
    good = Store(case.name, manifest=m, origin=reference, sums=case.sums, borrowed=True,
                 sources=lambda _s: (reference,)).read_entry(e)
    store = Store(case.name, manifest=m, origin=reference, sums=case.sums, borrowed=True,
                  sources=lambda _s: (case.holder, reference))
    if store.read_entry(e) != good:
        _fail(case, f"a Store reading entry {e} through the holder returned wrong bytes")
    if store.stats.checksum_failures != 1:
        _fail(case, f"the Store counted {store.stats.checksum_failures} checksum failures "
                    f"reading entry {e} from a corrupt copy, not 1")
    if hasattr(case.holder, "drop"):
        _refused(case, s, start, stored, "dropped as corrupt")
    for other in _sample_shards(case):
        if other != s:
            _expect(case, other, 0, len(case.shard_bytes(other)), case.shard_bytes(other))


def check_concurrent_readers(case: HolderCase, threads: int = 8, reads: int = 150) -> None:
    """Many threads reading random ranges at once each get exactly their bytes."""
    shards = _held(case)
    trues = {s: case.shard_bytes(s) for s in shards}
    start = threading.Barrier(threads)
    errors: list[BaseException] = []

    def reader(seed: int) -> None:
        rng = random.Random(seed)
        try:
            start.wait()
            for i in range(reads):
                s = rng.choice(shards)
                n = len(trues[s])
                off = rng.randrange(n)
                length = n - off if i % 50 == 0 else rng.randint(0, min(n - off, 8192))
                _expect(case, s, off, length, trues[s][off : off + length])
        except BaseException as exc:
            errors.append(exc)

    pool = [threading.Thread(target=reader, args=(i,), name=f"conformance-{i}")
            for i in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    if errors:
        raise errors[0]


def check_after_fork(case: HolderCase) -> None:
    """A holder used before ``fork`` serves a child process correctly, untold of the fork
    (a Store without tiers tells its origin nothing), and the parent afterwards."""
    shards = _held(case)
    for s in shards:  # open whatever the holder keeps open, start whatever it starts
        _expect(case, s, 0, len(case.shard_bytes(s)), case.shard_bytes(s))
    r, w = os.pipe()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # forking with threads: the point
        pid = os.fork()
    if pid == 0:  # the child: answer through the pipe, never return into the caller
        os.close(r)
        code = 0
        try:
            for s in reversed(shards):
                true = case.shard_bytes(s)
                _expect(case, s, 0, len(true), true)
                _expect(case, s, len(true) // 3, 100, true[len(true) // 3 : len(true) // 3 + 100])
            os.write(w, b"ok")
        except BaseException as exc:
            os.write(w, f"{type(exc).__name__}: {exc}".encode()[:4000])
            code = 1
        finally:
            os._exit(code)
    os.close(w)
    try:
        answer = _read_until(r, FORK_DEADLINE_S)
    finally:
        os.close(r)
    if answer is None:
        os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    if answer is None:
        _fail(case, f"a forked child reading through the holder did not answer in "
                    f"{FORK_DEADLINE_S:.0f} s: hung")
    if answer != b"ok":
        _fail(case, f"in a forked child: {answer.decode(errors='replace')}")
    s = shards[0]
    _expect(case, s, 0, len(case.shard_bytes(s)), case.shard_bytes(s))


CHECKS: tuple[Callable[[HolderCase], None], ...] = (
    check_ranges, check_out_of_bounds, check_missing_shard, check_corrupt_copy,
    check_concurrent_readers, check_after_fork,
)


def run_checks(make_case: Callable[[], HolderCase],
               checks: Sequence[Callable[[HolderCase], None]] = CHECKS) -> None:
    """Run each check on a new case from ``make_case`` (a check may corrupt its case)."""
    for check in checks:
        case = make_case()
        try:
            check(case)
        finally:
            case.close()


# -- helpers ------------------------------------------------------------------------------------


class _Reference:
    """The true bytes, as a holder: the next holder after the one under test."""

    name = "reference"

    def __init__(self, case: HolderCase) -> None:
        self._case = case

    def pread(self, shard: int, offset: int, length: int) -> bytes:
        return self._case.shard_bytes(shard)[offset : offset + length]

    def close(self) -> None:
        pass


def _held(case: HolderCase) -> list[int]:
    return [s for s in range(len(case.manifest.shards)) if s != case.absent]


def _sample_shards(case: HolderCase) -> list[int]:
    held = _held(case)
    return sorted({held[0], held[len(held) // 2], held[-1]})


def _corruptible_entry(case: HolderCase) -> int:
    """The largest stored file of a held shard."""
    m = case.manifest
    best, size = -1, 0
    for e in range(len(m)):
        if (m.kind[e] == KIND_FILE and m.stored[e] > size and m.shard[e] != case.absent):
            best, size = e, int(m.stored[e])
    if best < 0:
        raise ValueError(f"{case.name}: the dataset has no stored file to corrupt")
    return best


def _expect(case: HolderCase, shard: int, offset: int, length: int, want: bytes) -> None:
    try:
        got = case.holder.pread(shard, offset, length)
    except Exception as exc:
        _fail(case, f"shard {shard} [{offset}, {offset + length}): raised "
                    f"{type(exc).__name__}: {exc}")
    if got != want:
        _fail(case, f"shard {shard} [{offset}, {offset + length}): {len(got)} bytes that differ "
                    f"from the {len(want)} stored there")


def _refused(case: HolderCase, shard: int, offset: int, length: int, why: str) -> None:
    try:
        got = case.holder.pread(shard, offset, length)
    except (SourceUnavailable, StagefsError):
        return
    except Exception as exc:
        _fail(case, f"shard {shard} [{offset}, {offset + length}) ({why}): raised "
                    f"{type(exc).__name__}: {exc}; a holder raises SourceUnavailable or a "
                    "StagefsError naming what is wrong")
    _fail(case, f"shard {shard} [{offset}, {offset + length}) ({why}): returned {len(got)} "
                "bytes instead of refusing")


def _read_until(fd: int, timeout: float) -> bytes | None:
    """Everything written to the pipe until its writer closes it, or None at the deadline."""
    deadline = time.monotonic() + timeout
    out = bytearray()
    while True:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            return None
        chunk = os.read(fd, 65536)
        if not chunk:
            return bytes(out)
        out += chunk


def _fail(case: HolderCase, message: str) -> NoReturn:
    raise HolderCheckFailed(f"{case.name}: {message}")
